// ---- tile classification of bit operations and Euclidean division -----------
// Included only by kernels whose mask uses them; each helper is the rule of
// the same name in analysis.rs, bound for bound.
__device__ __forceinline__ long long r_floor_div_ll(long long a, long long p) {
    const long long q = a / p;
    return q * p > a ? q - 1 : q;
}
__device__ __forceinline__ long long r_mod_ll(long long a, long long p) { return a - r_floor_div_ll(a, p) * p; }
// By a positive constant: floor division, monotone. Else |q| <= |x|.
__device__ __forceinline__ Range r_div_euclid(Range a, Range d) {
    if (d.lo == d.hi && d.lo > 0) return Range{r_floor_div_ll(a.lo, d.lo), r_floor_div_ll(a.hi, d.lo)};
    return r_div(a, r_unknown_int());
}
// In [0, |y| - 1], at most x for x >= 0; monotone over one quotient.
__device__ __forceinline__ Range r_rem_euclid(Range a, Range d) {
    if (d.lo == d.hi && d.lo > 0 && r_floor_div_ll(a.lo, d.lo) == r_floor_div_ll(a.hi, d.lo))
        return Range{r_mod_ll(a.lo, d.lo), r_mod_ll(a.hi, d.lo)};
    const long long m = r_max_ll(r_max_ll(r_abs_ll(d.lo), r_abs_ll(d.hi)), 1);
    return Range{0, a.lo >= 0 ? r_min_ll(a.hi, m - 1) : m - 1};
}
// Shifts by a constant amount (low 5 bits) are monotone; << may wrap.
__device__ __forceinline__ Range r_shl(Range a, Range n) {
    if (n.lo != n.hi) return r_unknown_int();
    const long long scale = 1LL << (n.lo & 31);
    return r_norm(a.lo * scale, a.hi * scale);
}
__device__ __forceinline__ Range r_shr(Range a, Range n) {
    if (n.lo == n.hi) return Range{a.lo >> (n.lo & 31), a.hi >> (n.lo & 31)};
    return Range{r_min_ll(a.lo, 0), r_max_ll(a.hi, 0)};
}
// The largest value of v's bit length, 2^k - 1 (v >= 0).
__device__ __forceinline__ long long r_bit_fill(long long v) { return (1LL << (64 - __clzll(v))) - 1; }
__device__ __forceinline__ Range r_bit_and(Range a, Range b) {
    const bool a_pos = a.lo >= 0, b_pos = b.lo >= 0;
    const long long hi = a_pos && b_pos ? r_min_ll(a.hi, b.hi)
                         : a_pos        ? a.hi
                         : b_pos        ? b.hi
                         : a.hi < 0 && b.hi < 0 ? r_min_ll(a.hi, b.hi)
                                                : r_max_ll(a.hi, b.hi);
    return Range{a_pos || b_pos ? 0 : -2147483648LL, hi};
}
__device__ __forceinline__ Range r_bit_or(Range a, Range b) {
    if (a.lo < 0 || b.lo < 0) return r_unknown_int();
    return Range{r_max_ll(a.lo, b.lo), r_bit_fill(r_max_ll(a.hi, b.hi))};
}
__device__ __forceinline__ Range r_bit_xor(Range a, Range b) {
    if (a.lo < 0 || b.lo < 0) return r_unknown_int();
    return Range{0, r_bit_fill(r_max_ll(a.hi, b.hi))};
}
