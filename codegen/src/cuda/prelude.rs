//! The prelude every generated kernel starts with: scalar helpers and the
//! row/tile primitives the kernel body is written in.
//!
//! It is fixed text, independent of the spec, so it is easy to read and
//! review as CUDA. Tile helpers are templates over the storage format and the
//! sizes; only what a kernel instantiates is compiled. The scalar helpers
//! define the spec language's semantics where C's would be undefined, and the
//! CPU reference implements the same rules.

pub(super) const PRELUDE: &str = r#"// ---- 16-bit floats ----------------------------------------------------------
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
// Softmax runs in base 2 (exp(x) = exp2(x * LOG2E)); LN2 converts the
// log-sum-exp back to natural log.
constexpr float LOG2E = 1.442695f;
constexpr float LN2 = 0.6931472f;
__device__ __forceinline__ float neg_inf() { return __int_as_float((int)0xff800000u); }

// ---- spec-language scalars --------------------------------------------------
// i32 arithmetic wraps like Rust's wrapping ops (signed overflow is undefined
// in C, so it goes through unsigned). Division and remainder by zero give 0;
// INT_MIN / -1 wraps to INT_MIN and INT_MIN % -1 is 0.
__device__ __forceinline__ int add_i32(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ int sub_i32(int a, int b) { return (int)((unsigned)a - (unsigned)b); }
__device__ __forceinline__ int mul_i32(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ int neg_i32(int a) { return (int)(0u - (unsigned)a); }
__device__ __forceinline__ int div_i32(int a, int b) { return b == 0 ? 0 : b == -1 ? neg_i32(a) : a / b; }
__device__ __forceinline__ int rem_i32(int a, int b) { return b == 0 || b == -1 ? 0 : a % b; }
__device__ __forceinline__ int min_i32(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int max_i32(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int abs_i32(int a) { return a < 0 ? neg_i32(a) : a; }
// clamp(x, lo, hi) = min(max(x, lo), hi), also when lo > hi.
__device__ __forceinline__ int clamp_i32(int x, int lo, int hi) { return min_i32(max_i32(x, lo), hi); }
__device__ __forceinline__ float clamp_f32(float x, float lo, float hi) { return fminf(fmaxf(x, lo), hi); }
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
// Rust's `x as i32`: truncate toward zero, saturate, NaN -> 0 (a C cast is
// undefined out of range).
__device__ __forceinline__ int f32_to_i32(float x) {
    return x != x ? 0 : x >= 2147483648.0f ? 2147483647 : x <= -2147483648.0f ? (-2147483647 - 1) : (int)x;
}
// Tensor indices are clipped into [0, n - 1] (JAX's "clip" gather mode): a
// spec can never read outside a captured tensor.
__device__ __forceinline__ long long clip(int i, long long n) {
    const long long c = i < n - 1 ? (long long)i : n - 1;
    return c > 0 ? c : 0;
}

// ---- rows and tiles ---------------------------------------------------------
// A query row belongs to LANES adjacent threads of one warp. Lane l of a row
// owns head-dim elements l, l + LANES, l + 2 * LANES, ... of every row vector:
// the lanes of a row read adjacent shared-memory words and all rows of a warp
// read the same K/V row at once (a broadcast), so tile reads never conflict.
// A lane's slice is an f32 register array of ceil(DIM / LANES) elements; for
// head dims that LANES does not divide, the tail lanes skip the last element.
template <int DIM, int LANES>
__device__ __forceinline__ bool in_dim(int d) { return DIM % LANES == 0 || d < DIM; }

// Copies the first `rows` rows of a ROWS x COLS tile (global row stride
// `stride` elements) into shared memory with all THREADS threads, consecutive
// threads on consecutive elements. Rows past `rows` are zero-filled: the tail
// tile's scores are masked, but 0 * garbage could still be NaN.
template <int ROWS, int COLS, int THREADS>
__device__ __forceinline__ void load_tile(unsigned short (&tile)[ROWS][COLS], const unsigned short* __restrict__ src,
                                          long long stride, int rows) {
#pragma unroll 4
    for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
        const int r = i / COLS;
        const int c = i % COLS;
        tile[r][c] = r < rows ? src[r * stride + c] : (unsigned short)0;
    }
}

// Widens this lane's slice of a global row to f32.
template <typename T, int DIM, int LANES, int N>
__device__ __forceinline__ void load_slice(float (&dst)[N], const unsigned short* __restrict__ row, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int d = lane + i * LANES;
        if (in_dim<DIM, LANES>(d)) dst[i] = T::to_f32(row[d]);
    }
}

// Sums x over the LANES threads of a row; every lane gets the total. The mask
// is the full warp: every thread runs this, rows past q_len included.
template <int LANES>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// q . k for one key row of a shared-memory tile: a partial dot over the
// lane's slice, then a sum across the row's lanes.
template <typename T, int DIM, int LANES, int N>
__device__ __forceinline__ float dot(const float (&q)[N], const unsigned short* k, int lane) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int d = lane + i * LANES;
        if (in_dim<DIM, LANES>(d)) acc += q[i] * T::to_f32(k[d]);
    }
    return row_sum<LANES>(acc);
}

template <int N>
__device__ __forceinline__ float row_max(const float (&s)[N]) {
    float m = s[0];
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, s[j]);
    return m;
}

template <int N>
__device__ __forceinline__ void rescale(float (&o)[N], float alpha) {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= alpha;
}

// o += p * v for one value row of a shared-memory tile.
template <typename T, int DIM, int LANES, int N>
__device__ __forceinline__ void accumulate(float (&o)[N], float p, const unsigned short* v, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int d = lane + i * LANES;
        if (in_dim<DIM, LANES>(d)) o[i] += p * T::to_f32(v[d]);
    }
}

// Narrows o * factor to the storage format and writes this lane's slice of a
// global row.
template <typename T, int DIM, int LANES, int N>
__device__ __forceinline__ void store_slice(unsigned short* __restrict__ row, const float (&o)[N], float factor, int lane) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int d = lane + i * LANES;
        if (in_dim<DIM, LANES>(d)) row[d] = T::from_f32(o[i] * factor);
    }
}
"#;
