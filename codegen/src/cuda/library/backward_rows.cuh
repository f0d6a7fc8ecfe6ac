// ---- backward helpers -----------------------------------------------------------
// Sum across the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
