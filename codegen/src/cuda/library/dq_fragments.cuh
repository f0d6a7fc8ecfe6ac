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
