// ---- e4m3 operands of the Hopper forward ---------------------------------------
// Four f32 as the e4m3 bytes of one register, `a` in the lowest byte
// (rounded to nearest even, saturated at ±448).
__device__ __forceinline__ unsigned e4m3x4(float a, float b, float c, float d) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned)lo | (unsigned)hi << 16;
}
// P's 32 keys of k-step kk as the A operand of an m64nNk32 e4m3 wgmma, straight
// from the S accumulators. The A fragment holds four consecutive columns of one
// row per register, the accumulators two per 8-key group; rather than move
// bytes between lanes, a register takes the lane's two columns of two adjacent
// groups: column 4t + j of the A tile (j < 4, plus 16 for the second half) is
// key 16 * half + 8 * (j / 2) + 2t + j % 2 of the step, and the V tiles list
// their keys in that order (`e4m3_v_tile`).
template <int TILES>
__device__ __forceinline__ void pack_p_e4m3(unsigned (&p)[4], const float (&s)[TILES][4], int kk) {
    const int n = 4 * kk;
    p[0] = e4m3x4(s[n][0], s[n][1], s[n + 1][0], s[n + 1][1]);
    p[1] = e4m3x4(s[n][2], s[n][3], s[n + 1][2], s[n + 1][3]);
    p[2] = e4m3x4(s[n + 2][0], s[n + 2][1], s[n + 3][0], s[n + 3][1]);
    p[3] = e4m3x4(s[n + 2][2], s[n + 2][3], s[n + 3][2], s[n + 3][3]);
}
