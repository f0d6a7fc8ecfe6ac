// ---- tile classification ----------------------------------------------------
// Interval arithmetic over the spec language: a Range holds every value an
// expression can take over a tile of (q, k) pairs. Bools are sub-ranges of
// [0, 1]: lo == 1 means always true, hi == 0 always false. Bounds are exact in
// 64 bits from i32 bounds; one outside i32 means the i32 op may wrap, so the
// result could be anything.
struct Range { long long lo, hi; };
__device__ __forceinline__ Range r_span(long long lo, long long hi) { return Range{lo, hi}; }
__device__ __forceinline__ Range r_point(long long v) { return Range{v, v}; }
__device__ __forceinline__ Range r_unknown_int() { return Range{-2147483648LL, 2147483647LL}; }
__device__ __forceinline__ Range r_unknown_bool() { return Range{0, 1}; }
__device__ __forceinline__ Range r_norm(long long lo, long long hi) {
    return lo < -2147483648LL || hi > 2147483647LL ? r_unknown_int() : Range{lo, hi};
}
__device__ __forceinline__ long long r_min_ll(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long r_max_ll(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long r_abs_ll(long long a) { return a < 0 ? -a : a; }
__device__ __forceinline__ Range r_bool(bool always, bool possibly) { return Range{always ? 1 : 0, possibly ? 1 : 0}; }
// C truthiness (non-zero is true) as a tri-state.
__device__ __forceinline__ Range r_truth(Range a) { return r_bool(a.lo > 0 || a.hi < 0, a.lo != 0 || a.hi != 0); }

__device__ __forceinline__ Range r_add(Range a, Range b) { return r_norm(a.lo + b.lo, a.hi + b.hi); }
__device__ __forceinline__ Range r_sub(Range a, Range b) { return r_norm(a.lo - b.hi, a.hi - b.lo); }
__device__ __forceinline__ Range r_mul(Range a, Range b) {
    const long long c0 = a.lo * b.lo, c1 = a.lo * b.hi, c2 = a.hi * b.lo, c3 = a.hi * b.hi;
    return r_norm(r_min_ll(r_min_ll(c0, c1), r_min_ll(c2, c3)), r_max_ll(r_max_ll(c0, c1), r_max_ll(c2, c3)));
}
__device__ __forceinline__ Range r_neg(Range a) { return r_norm(-a.hi, -a.lo); }
__device__ __forceinline__ Range r_abs(Range a) {
    return a.lo >= 0 ? a : a.hi <= 0 ? r_neg(a) : r_norm(0, r_max_ll(-a.lo, a.hi));
}
// Division by a positive constant is monotone. Otherwise |x / y| <= |x|
// (x / 0 = 0); INT_MIN / -1 wraps, and then the bound 2^31 widens.
__device__ __forceinline__ Range r_div(Range a, Range d) {
    if (d.lo == d.hi && d.lo > 0) return Range{a.lo / d.lo, a.hi / d.lo};
    const long long m = r_max_ll(r_abs_ll(a.lo), r_abs_ll(a.hi));
    return r_norm(-m, m);
}
// The remainder has the dividend's sign, |x % y| <= |x| and |x % y| < |y|
// (x % 0 = x % -1 = 0). By a positive constant with one quotient over the
// whole range, x % p = x - quotient * p is monotone.
__device__ __forceinline__ Range r_rem(Range a, Range d) {
    if (d.lo == d.hi && d.lo > 0 && a.lo / d.lo == a.hi / d.lo) return Range{a.lo % d.lo, a.hi % d.lo};
    const long long m = r_max_ll(r_max_ll(r_abs_ll(d.lo), r_abs_ll(d.hi)), 1);
    return Range{r_max_ll(r_min_ll(a.lo, 0), 1 - m), r_min_ll(r_max_ll(a.hi, 0), m - 1)};
}
__device__ __forceinline__ Range r_min(Range a, Range b) { return Range{r_min_ll(a.lo, b.lo), r_min_ll(a.hi, b.hi)}; }
__device__ __forceinline__ Range r_max(Range a, Range b) { return Range{r_max_ll(a.lo, b.lo), r_max_ll(a.hi, b.hi)}; }
__device__ __forceinline__ Range r_clamp(Range x, Range lo, Range hi) { return r_min(r_max(x, lo), hi); }

// Comparisons: lo = holds for every pair of values, hi = holds for some.
__device__ __forceinline__ Range r_lt(Range a, Range b) { return r_bool(a.hi < b.lo, a.lo < b.hi); }
__device__ __forceinline__ Range r_le(Range a, Range b) { return r_bool(a.hi <= b.lo, a.lo <= b.hi); }
__device__ __forceinline__ Range r_gt(Range a, Range b) { return r_lt(b, a); }
__device__ __forceinline__ Range r_ge(Range a, Range b) { return r_le(b, a); }
__device__ __forceinline__ Range r_eq(Range a, Range b) {
    return r_bool(a.lo == a.hi && b.lo == b.hi && a.lo == b.lo, a.lo <= b.hi && b.lo <= a.hi);
}
__device__ __forceinline__ Range r_not(Range a) {
    const Range t = r_truth(a);
    return Range{1 - t.hi, 1 - t.lo};
}
__device__ __forceinline__ Range r_ne(Range a, Range b) { return r_not(r_eq(a, b)); }
__device__ __forceinline__ Range r_and(Range a, Range b) { return r_min(r_truth(a), r_truth(b)); }
__device__ __forceinline__ Range r_or(Range a, Range b) { return r_max(r_truth(a), r_truth(b)); }
// The taken branch when the condition is known, else the hull of both.
__device__ __forceinline__ Range r_if(Range c, Range t, Range f) {
    const Range k = r_truth(c);
    return k.lo == 1 ? t : k.hi == 0 ? f : Range{r_min_ll(t.lo, f.lo), r_max_ll(t.hi, f.hi)};
}
// The class of queries [q_lo, q_hi] x keys [k_lo, k_hi] in a block mask built
// at MASK_M x MASK_N tiles (`slice`: one (batch, head) slice with kv_tiles
// tiles per row): the mask tiles covering it, combined. 0 if every one keeps
// no pair, 2 if every one keeps all, else 1.
template <int MASK_M, int MASK_N>
__device__ __forceinline__ int coarse_class(const unsigned char* slice, int kv_tiles, int q_lo, int q_hi, int k_lo,
                                            int k_hi) {
    bool any = false, all = true;
    // Not unrolled: a kernel inlines this at each of its tile walks, and
    // unrolled copies cost compile time and the producer's registers.
    #pragma unroll 1
    for (int i = q_lo / MASK_M; i <= q_hi / MASK_M; ++i) {
        #pragma unroll 1
        for (int j = k_lo / MASK_N; j <= k_hi / MASK_N; ++j) {
            const unsigned char c = slice[(long long)i * kv_tiles + j];
            any |= c != 0;
            all &= c == 2;
        }
    }
    return !any ? 0 : all ? 2 : 1;
}
