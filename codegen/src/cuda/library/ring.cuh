// ---- stage ring (warp specialization) -----------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(unsigned bar, int parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
// Arrives once this thread's part of a load_tile<…, WIDTH> copy has landed:
// cp.async copies arrive when they complete (the barrier's count includes
// this arrival), element-wise stores (unaligned rows, odd widths) right away.
template <int WIDTH>
__device__ __forceinline__ void mbar_arrive_loaded(unsigned bar, bool vector) {
    if (WIDTH % 8 == 0 && vector) asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
    else mbar_arrive(bar);
}
// Hands registers between warpgroups (all four warps execute it).
template <int N>
__device__ __forceinline__ void regs_release() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N)); }
template <int N>
__device__ __forceinline__ void regs_acquire() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N)); }
