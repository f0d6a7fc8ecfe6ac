// ---- 16-bit floats ----------------------------------------------------------
// NVRTC ships without cuda_fp16.h / cuda_bf16.h, so half-precision values
// travel as raw bit patterns in `unsigned short` and each format is a tag type
// with its two conversions (round-to-nearest-even when narrowing).
struct bf16 {
    // bf16 is the upper half of an f32: widening is a shift.
    static __device__ __forceinline__ float to_f32(unsigned short x) { return __uint_as_float((unsigned)x << 16); }
    static __device__ __forceinline__ unsigned short from_f32(float x) {
        unsigned short r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
};
struct f16 {
    static __device__ __forceinline__ float to_f32(unsigned short x) {
        float r;
        asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
        return r;
    }
    static __device__ __forceinline__ unsigned short from_f32(float x) {
        unsigned short r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
        return r;
    }
};

// ---- constants --------------------------------------------------------------
// The library's constants are `inline`, as a header's are: a kernel that
// reads none of them compiles without an unused-variable warning.
// Softmax runs in base 2 (exp(x) = exp2(x * LOG2E)); LN2 converts the
// log-sum-exp back to natural log.
inline constexpr float LOG2E = 1.442695f;
inline constexpr float LN2 = 0.6931472f;
// This thread's warp, as a value the compiler knows is the same across the
// warp (a shuffle from lane 0): what derives from it (a warpgroup's tile
// offsets, its wgmma descriptors) then stays in uniform registers instead of
// being moved into them before every wgmma.
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, (int)threadIdx.x / 32, 0); }
__device__ __forceinline__ float neg_inf() { return __int_as_float((int)0xff800000u); }
// x where `keep`, else -inf, as one select: a plain `keep ? x : -inf`
// (nothing to compute where the pair is kept) becomes a branch per element.
__device__ __forceinline__ float kept_or_neg_inf(bool keep, float x) {
    float r;
    asm("{ .reg .pred p; setp.ne.u32 p, %1, 0; selp.f32 %0, %2, 0fFF800000, p; }" : "=f"(r) : "r"((unsigned)keep), "f"(x));
    return r;
}
// A row max used as an exp2 offset: a row with no kept key yet (-inf) uses 0,
// so exp2 sees -inf - 0 = -inf (P = 0), never -inf - -inf = NaN.
__device__ __forceinline__ float finite_or_zero(float m) { return m == neg_inf() ? 0.0f : m; }
// Online softmax: how far (log2 units) a row's max may outgrow the max its O
// and l were scaled by before they are rescaled; P stays <= 2^8.
inline constexpr float RESCALE_SLACK = 8.0f;

// ---- spec-language scalars --------------------------------------------------
// i32 arithmetic wraps like Rust's wrapping ops (signed overflow is undefined
// in C, so it goes through unsigned). Division and remainder by zero give 0;
// INT_MIN / -1 wraps to INT_MIN and INT_MIN % -1 is 0. The division always
// runs, by a divisor that cannot trap, and the special cases are selects:
// guarded by branches, a divisor fixed for a loop let NVVM unswitch an
// unrolled tile loop on each guard, and it ran for minutes on one kernel.
__device__ __forceinline__ int add_i32(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int sub_i32(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int mul_i32(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int neg_i32(int a) { return (int)(0u - (unsigned)a); }
__device__ __forceinline__ int safe_divisor(int b) { return b == 0 || b == -1 ? 1 : b; }
__device__ __forceinline__ int div_i32(int a, int b) {
    const int q = a / safe_divisor(b);
    return b == 0 ? 0 : b == -1 ? neg_i32(a) : q;
}
__device__ __forceinline__ int rem_i32(int a, int b) {
    const int r = a % safe_divisor(b);
    return b == 0 || b == -1 ? 0 : r;
}
__device__ __forceinline__ int min_i32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_i32(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int abs_i32(int a) { return a < 0 ? neg_i32(a) : a; }
// clamp(x, lo, hi) = min(max(x, lo), hi), also when lo > hi.
__device__ __forceinline__ int clamp_i32(int x, int lo, int hi) { return min_i32(max_i32(x, lo), hi); }
__device__ __forceinline__ float clamp_f32(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
// f32 division and tanh without IEEE slow paths (the spec language promises
// f32 arithmetic to a few ulp, not correct rounding): div.full.f32 is within
// 2 ulp over the whole range; tanh from one exp2 and one reciprocal is within
// ~1e-7 absolute and saturates to +-1 (tanhf costs a dozen FMAs and branches
// per element of S).
__device__ __forceinline__ float div_f32(float a, float b) {
    float r;
    asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float tanh_f32(float x) {
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * (2.0f * LOG2E)));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
    return 1.0f - 2.0f * r;
}
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// Rust's `x as i32`: truncate toward zero, saturate, NaN -> 0 (a C cast is
// undefined out of range).
__device__ __forceinline__ int f32_to_i32(float x) {
    return x != x ? 0 : x >= 2147483648.0f ? 2147483647 : x <= -2147483648.0f ? (-2147483647 - 1) : (int)x;
}
// A bound on a logit's column j in [0, N) (forward/key_bounds.rs), clamped
// into [-1, N]: j compares with it as with the exact 64-bit bound.
template <int N>
__device__ __forceinline__ int key_bound(long long b) { return (int)(b < -1 ? -1 : b > N ? N : b); }
// x where lo <= j <= hi, else -inf. One asm that reads x: as C compares,
// LLVM would evaluate them before x exists and carry the booleans along.
__device__ __forceinline__ float kept_between(int j, int lo, int hi, float x) {
    float r;
    asm("{ .reg .pred p; setp.ge.s32 p, %1, %2; setp.le.and.s32 p, %1, %3, p; selp.f32 %0, %4, 0fFF800000, p; }"
        : "=f"(r) : "r"(j), "r"(lo), "r"(hi), "f"(x));
    return r;
}
// x where j <= hi (where lo <= j), else -inf: one compare where the row has
// a bound on one side only.
__device__ __forceinline__ float kept_at_most(int j, int hi, float x) {
    float r;
    asm("{ .reg .pred p; setp.le.s32 p, %1, %2; selp.f32 %0, %3, 0fFF800000, p; }" : "=f"(r) : "r"(j), "r"(hi), "f"(x));
    return r;
}
__device__ __forceinline__ float kept_at_least(int j, int lo, float x) {
    float r;
    asm("{ .reg .pred p; setp.ge.s32 p, %1, %2; selp.f32 %0, %3, 0fFF800000, p; }" : "=f"(r) : "r"(j), "r"(lo), "f"(x));
    return r;
}
// Tensor indices are clipped into [0, n - 1] (JAX's "clip" gather mode): a
// spec can never read outside a captured tensor. Dimensions are ints but for
// constants past 2^31 - 1 (clip_wide).
__device__ __forceinline__ int clip(int i, int n) { return max(min(i, n - 1), 0); }
__device__ __forceinline__ long long clip_wide(int i, long long n) {
    const long long c = i < n - 1 ? (long long)i : n - 1;
    return c > 0 ? c : 0;
}
