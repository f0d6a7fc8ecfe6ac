// ---- dropout ----------------------------------------------------------------
// Included only by kernels with dropout on (the dropout forward, and the
// dK/dV and dQ kernels of a dropout backward); the twin of
// codegen/src/dropout.rs, bit for bit. The mask is a pure function of (seed,
// offset, b, h, q, k), so the backward regenerates the forward's: one
// Philox4x32-10 call draws a word for each pair of the 2 x 2 block of
// queries q & ~1, q | 1 and keys k & ~1, k | 1 (counter (k >> 1, q >> 1,
// b * heads + h, lo32(offset)), key (lo32(seed), hi32(seed) ^ hi32(offset))),
// pair (q, k) word 2 * (q & 1) + (k & 1); a pair is dropped where its word is
// below the threshold floor(p * 2^32), and a kept one's P is scaled by 1 / (1 - p).
struct Dropout {
    unsigned key0, key1, offset;
    unsigned threshold;
    float scale;
};
__device__ __forceinline__ Dropout dropout_of(unsigned long long seed, unsigned long long offset,
                                              unsigned threshold, float scale) {
    return Dropout{(unsigned)seed, (unsigned)(seed >> 32) ^ (unsigned)(offset >> 32), (unsigned)offset,
                   threshold, scale};
}

struct PhiloxWords {
    unsigned w[4];
};
__device__ __forceinline__ PhiloxWords philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3,
                                                     unsigned k0, unsigned k1) {
    #pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return PhiloxWords{{c0, c1, c2, c3}};
}

// The factors on P of two pairs of one block: 0 where dropped, else the scale.
struct DropoutPair {
    float first, second;
};
__device__ __forceinline__ float dropout_factor(const Dropout& d, unsigned word) {
    return word >= d.threshold ? d.scale : 0.0f;
}
__device__ __forceinline__ PhiloxWords dropout_block(const Dropout& d, unsigned bh, int q, int k) {
    return philox4x32_10((unsigned)k >> 1, (unsigned)q >> 1, bh, d.offset, d.key0, d.key1);
}
// Pairs (q, k) and (q, k + 1), k even: two keys of a query row.
__device__ __forceinline__ DropoutPair dropout_keys(const Dropout& d, unsigned bh, int q, int k) {
    const PhiloxWords r = dropout_block(d, bh, q, k);
    const bool odd = q & 1;
    return DropoutPair{dropout_factor(d, odd ? r.w[2] : r.w[0]), dropout_factor(d, odd ? r.w[3] : r.w[1])};
}
// Pairs (q, k) and (q + 1, k), q even: two queries of a key row.
__device__ __forceinline__ DropoutPair dropout_queries(const Dropout& d, unsigned bh, int q, int k) {
    const PhiloxWords r = dropout_block(d, bh, q, k);
    const bool odd = k & 1;
    return DropoutPair{dropout_factor(d, odd ? r.w[1] : r.w[0]), dropout_factor(d, odd ? r.w[3] : r.w[2])};
}
