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
