// A 64-query step's dQ accumulator tile in the dK/dV kernel's fragment order:
// 16-byte chunk (warpgroup * tiles + n) * 128 + thread holds that consumer
// thread's m16n8 tile n of its warpgroup's columns, so a warp's 16-byte
// stores of one tile are 512 contiguous bytes (no bank conflicts).
__device__ __forceinline__ int dq_chunk(int tiles, int warpgroup, int n, int thread) {
    return (warpgroup * tiles + n) * 128 + thread;
}
// The inverse: chunk c holds (row, col), (row, col + 1), (row + 8, col) and
// (row + 8, col + 1) of the tile (the m16n8 accumulator layout).
__device__ __forceinline__ void dq_chunk_origin(int tiles, int c, int& row, int& col) {
    const int thread = c % 128, n = c / 128 % tiles, warpgroup = c / (128 * tiles);
    row = thread / 32 * 16 + thread % 32 / 4;
    col = (warpgroup * tiles + n) * 8 + thread % 4 * 2;
}
// An 80-query step's dQ^T (d = 128, head dims as rows: consumer warp w holds head
// dims 16w to 16w + 15) in 16-query groups of 512 chunks, so that a step's rows
// are contiguous whatever tile they start in: group n / 2's chunk
// (warp * 2 + n % 2) * 32 + lane holds consumer thread (warp, lane)'s m16n8 tile
// n, and a warp's stores of one tile are 512 contiguous bytes.
__device__ __forceinline__ int dqt_chunk(int n, int thread) {
    return n / 2 * 512 + (thread / 32 * 2 + n % 2) * 32 + thread % 32;
}
// The inverse, as (query, head dim): chunk c holds (row, col), (row + 1, col),
// (row, col + 8) and (row + 1, col + 8) of dQ.
__device__ __forceinline__ void dqt_chunk_origin(int c, int& row, int& col) {
    const int group = c / 512, warp = c % 512 / 64, tile = c / 32 % 2, lane = c % 32;
    row = group * 16 + tile * 8 + lane % 4 * 2;
    col = warp * 16 + lane / 4;
}
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
