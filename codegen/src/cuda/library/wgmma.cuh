// ---- warpgroup MMA (sm_90a) --------------------------------------------------
// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start
// address, leading and stride byte offsets (16-byte units), 128-byte swizzle.
__device__ __forceinline__ unsigned long long gmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16
         | (unsigned long long)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
// The descriptor of the tile `bytes` further on: the start address sits in
// bits 0-13 as addr >> 4, and shared addresses stay below 2^18, so the sum
// never carries out of the field. Descriptors of a loop's k-steps are then
// one add from a base built once.
__device__ __forceinline__ unsigned long long desc_plus(unsigned long long desc, unsigned bytes) {
    return desc + (bytes >> 4);
}
// The same sum on the address word alone, the upper word passed through:
// for descriptors built per step (the forward's) ptxas then issues one
// 32-bit add per product where the 64-bit sum takes two (the carry into the
// upper word) and more moves. Where descriptors fold into constants (the
// dK/dV kernel's), the 64-bit form leaves fewer instructions.
__device__ __forceinline__ unsigned long long desc_plus_lo(unsigned long long desc, unsigned bytes) {
    unsigned long long sum;
    asm("mov.b64 %0, {%1, %2};" : "=l"(sum) : "r"(unsigned(desc) + (bytes >> 4)), "r"(unsigned(desc >> 32)));
    return sum;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Blocks until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Pins accumulator registers at this point of the asm order: without it the
// compiler may move their reads or writes across a wgmma_wait (they are not
// its operands) and touch registers the tensor cores still own.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(d[i][c]) :: "memory");
    }
}
// Named barriers (id 1..15; 0 is __syncthreads) over `threads` threads:
// sync waits for the barrier to complete, arrive only counts towards it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// Makes this thread's shared-memory writes (cp.async, stores) visible to the
// tensor cores' async proxy; a barrier then publishes them to the warpgroup.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
