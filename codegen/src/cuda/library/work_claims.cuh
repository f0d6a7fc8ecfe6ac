// ---- work claims (persistent CTAs) ---------------------------------------------
// The `done`-th item of this CTA: its index first, then the next unclaimed
// one. Each CTA claims until it gets an index past the last item, once. The
// last CTA to do so resets the counter for the next launch on the stream
// (every other CTA has made its last claim by then): no launch pays for a
// memset.
__device__ __forceinline__ long long claim(unsigned long long* counter, int done, long long items) {
    if (done == 0) return blockIdx.x;  // the grid never exceeds the items
    const long long item = gridDim.x + (long long)atomicAdd(counter, 1ull);
    if (item >= items) {
        __threadfence();  // this CTA's last claim is done before it counts itself out
        if (atomicAdd(counter + 1, 1ull) == gridDim.x - 1) {
            atomicExch(counter, 0ull);
            atomicExch(counter + 1, 0ull);
        }
    }
    return item;
}
// Division by a divisor fixed for the launch as a multiply-high and a shift
// (m = ceil(2^p / d), p = 31 + ceil(log2 d)), exact for dividends below 2^31
// (the runtime launches fewer items): built once per CTA, it takes an item's
// coordinates off the long 64-bit division call between items.
struct FastDiv {
    unsigned d, m = 0, s = 0;
    __device__ explicit FastDiv(unsigned divisor) : d(divisor) {
        if (d > 1) {
            const unsigned p = 31 + (32 - __clz(d - 1));
            m = (unsigned)(((1ull << p) + d - 1) / d);
            s = p - 32;
        }
    }
    __device__ unsigned div(unsigned n) const { return d == 1 ? n : __umulhi(n, m) >> s; }
};
