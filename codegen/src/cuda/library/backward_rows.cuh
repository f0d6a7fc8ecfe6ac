// ---- backward helpers -----------------------------------------------------------
// Sum across the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
// The statistic (LSE or D) of query column n * 8 + 2 * t + c of a step's
// shared column `col`: both of a lane's columns of tile n in one 8-byte load,
// so that the compiler reads each pair once for its two elements. `col` is
// 8-byte aligned: the statistics follow 16-bit tiles of whole 16 x 16 blocks
// in shared memory, and a step's BLOCK_M columns are a multiple of 16.
__device__ __forceinline__ float col_stat(const float* col, int n, int t, int c) {
    const float2 pair = reinterpret_cast<const float2*>(col)[n * 4 + t];
    return c == 0 ? pair.x : pair.y;
}
