// A dK/dV step's dQ ticket (`dq_tickets`: one per accumulator tile, the
// ticket of the step that starts in it): how many CTAs have reached the step,
// and DQ_STORED once the first one's tiles have landed. The first stores its
// tiles where the others add theirs, so the accumulator needs no zeroing.
constexpr unsigned DQ_STORED = 1u << 31;
// The ticket's value before this CTA's arrival: 0 for the first.
__device__ __forceinline__ unsigned dq_ticket_take(unsigned* ticket) {
    unsigned seen;
    asm volatile("atom.acquire.gpu.global.add.u32 %0, [%1], 1;" : "=r"(seen) : "l"(ticket) : "memory");
    return seen;
}
// After the first CTA's bulk store has written (bulk_wait<0>): its async-proxy
// writes, then the mark, released to the CTAs that wait for it.
__device__ __forceinline__ void dq_ticket_mark_stored(unsigned* ticket) {
    asm volatile("fence.proxy.async.global;" ::: "memory");
    asm volatile("red.release.gpu.global.or.b32 [%0], %1;" :: "l"(ticket), "r"(DQ_STORED) : "memory");
}
// Waits, from `seen` (the take's value), for the first CTA's mark; then this
// CTA's bulk additions may follow (their proxy ordered after the mark).
__device__ __forceinline__ void dq_ticket_wait_stored(const unsigned* ticket, unsigned seen) {
    while ((seen & DQ_STORED) == 0) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(ticket) : "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
}
