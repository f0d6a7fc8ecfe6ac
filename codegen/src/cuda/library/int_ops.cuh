// ---- spec-language bit operations and Euclidean division --------------------
// Included only by kernels of specs that use them. Shifts take the amount's
// low 5 bits (Rust's wrapping_shl / wrapping_shr; C leaves amounts outside
// 0..31 undefined); << shifts zeros in through unsigned (a negative operand
// is undefined in C++17), >> copies the sign bit in, as Rust's i32 >>.
__device__ __forceinline__ int shl_i32(int a, int n) { return (int)((unsigned)a << (n & 31)); }
__device__ __forceinline__ int shr_i32(int a, int n) { return a >> (n & 31); }
// Euclidean division (Rust's wrapping_rem_euclid / wrapping_div_euclid): the
// remainder is in [0, |b|), by 0 both give 0, and INT_MIN by -1 gives the
// wrapped quotient INT_MIN and remainder 0. Adding |b| goes through unsigned
// because |INT_MIN| wraps to INT_MIN.
__device__ __forceinline__ int rem_euclid_i32(int a, int b) {
    const int r = rem_i32(a, b);
    return r < 0 ? (int)((unsigned)r + (unsigned)abs_i32(b)) : r;
}
__device__ __forceinline__ int div_euclid_i32(int a, int b) {
    const int q = div_i32(a, b);
    return rem_i32(a, b) >= 0 ? q : b > 0 ? q - 1 : q + 1;
}
