// ---- decode over e4m3 K/V: one-byte cache tiles converted on registers ------------
// An e4m3 decode kernel copies its K/V tiles as they are (a byte an element:
// half a 16-bit cache's traffic, and the kernel waits on memory) and converts
// each fragment right after its ldmatrix, in the registers the MMA reads:
// every element is converted once (each warp owns its keys of a tile), with
// no second pass through shared memory. A 1-byte tile is a 16-bit tile of
// half the columns, so the 16-bit ldmatrix reads it; each lane then holds
// its bytes in another order than the MMA's 16-bit fragments, which the
// products absorb: K's dims are a reduction the Q tile is permuted for
// (load_q_rows' INTERLEAVED), V's dims become O's columns (e4m3_o_column).

// Two e4m3 values (the low byte first) as two f16 values, exactly (every
// e4m3 value is an f16).
__device__ __forceinline__ unsigned e4m3x2_to_f16(unsigned pair) {
#if __CUDA_ARCH__ >= 890
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)pair));
    return r;
#else
    // Sign, exponent and mantissa moved into f16's places: the f16 of value
    // · 2^-8 (bias 15 for 7), then · 2^8, exact (no .ftz: subnormals stay).
    const unsigned y = __byte_perm(pair, 0u, 0x1404);  // byte 0 to byte 1, byte 1 to byte 3
    const unsigned raw = (y & 0x80008000u) | ((y & 0x7f007f00u) >> 1);
    unsigned r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(raw), "r"(0x5c005c00u), "r"(0x80008000u));
    return r;
#endif
}
// The MMAs of an e4m3 kernel run on f16: e4m3 -> f16 is one instruction per
// pair where bf16 would take four more (shifts, masks and a scaling FMA), and
// the kernel is issue-bound on them. A bf16 Q tile goes to f16 as it is
// loaded (load_q_rows' tile, INTERLEAVED), scaled by 2^shift so that its
// largest |q| lands in [2^15, 2^16) (bf16's largest mantissa times 2^15 is
// 65280, below f16's 65504): every value within 2^29 of that largest keeps
// all its bits (f16 holds bf16's 8 significant bits while normal), and the
// smaller ones round to f16's subnormals, off by at most 2^-40 of the
// largest. Each thread holds its chunks on registers while the CTA agrees on
// the largest (one barrier). Returns 2^-shift, for the softmax scale. Every
// thread calls it.
template <int ROWS, int COLS, int WIDTH, int THREADS>
__device__ __forceinline__ float load_q_rows_to_f16(unsigned short* tile, const QRows& q) {
    constexpr int CHUNKS = ROWS * COLS / 8, HELD = (CHUNKS + THREADS - 1) / THREADS;
    __shared__ unsigned warp_top[THREADS / 32];
    const bool vector = q_vector<WIDTH>(q);
    uint4 held[HELD];
    unsigned top = 0;  // magnitudes order as integers
    #pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * THREADS;
        held[k] = i < CHUNKS ? q_chunk<COLS, WIDTH, true>(q, vector, i) : make_uint4(0u, 0u, 0u, 0u);
        const unsigned pairs[4] = {held[k].x, held[k].y, held[k].z, held[k].w};
        #pragma unroll
        for (const unsigned pair : pairs) top = max(top, max(pair & 0x7fffu, (pair >> 16) & 0x7fffu));
    }
    top = __reduce_max_sync(0xffffffffu, top);
    if (threadIdx.x % 32 == 0) warp_top[threadIdx.x / 32] = top;
    __syncthreads();
    #pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) top = max(top, warp_top[w]);
    const int shift = min(142 - (int)(top >> 7), 100);
    const float up = __int_as_float((127 + shift) << 23);
    #pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * THREADS;
        if (i >= CHUNKS) break;
        unsigned pairs[4] = {held[k].x, held[k].y, held[k].z, held[k].w};
        #pragma unroll
        for (unsigned& pair : pairs) {
            const unsigned lo = f16::from_f32(bf16::to_f32((unsigned short)(pair & 0xffffu)) * up);
            const unsigned hi = f16::from_f32(bf16::to_f32((unsigned short)(pair >> 16)) * up);
            pair = lo | hi << 16;
        }
        *(uint4*)(tile + swizzle<COLS>(i / (COLS / 8), i % (COLS / 8) * 8)) = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
    return __int_as_float((127 - shift) << 23);
}

// Two 8x8 16-bit matrices from shared memory, transposed; lanes 0-15 supply
// the rows (ldmatrix_x2 is decode.cuh's).
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// K's B fragment of a 16-dim step of S = Q K^T from this lane's ldmatrix
// register of 8 keys: the four e4m3 dims 4t .. 4t + 3 of key g. The MMA
// takes dims 4t, 4t + 1 as its k rows 2t, 2t + 1 and dims 4t + 2, 4t + 3 as
// rows 2t + 8, 2t + 9, where the Q tile holds those dims (q_column).
__device__ __forceinline__ void e4m3_key_fragment(unsigned keys, unsigned& b0, unsigned& b1) {
    b0 = e4m3x2_to_f16(keys);
    b1 = e4m3x2_to_f16(keys >> 16);
}

// V's B fragments of a 16-dim chunk from this lane's ldmatrix.trans register
// of 8 keys: keys 2t, 2t + 1 at dims 2g, 2g + 1 (bytes: (2t, 2g), (2t, 2g +
// 1), (2t + 1, 2g), (2t + 1, 2g + 1)). `even` is the keys' pair at dim 2g,
// `odd` at 2g + 1: two MMAs whose n = g is dim 2g and 2g + 1 of the chunk.
__device__ __forceinline__ void e4m3_value_fragment(unsigned x, unsigned& even, unsigned& odd) {
    const unsigned pairs = __byte_perm(x, 0u, 0x3120);
    even = e4m3x2_to_f16(pairs);
    odd = e4m3x2_to_f16(pairs >> 16);
}

// The O column of accumulator element c (0, 1) of this lane's m16n8 tile n
// in an e4m3 kernel: tiles n and n + 1 (n even) are a 16-dim chunk's even
// and odd dims (e4m3_value_fragment).
__device__ __forceinline__ int e4m3_o_column(int n, int t, int c) { return n / 2 * 16 + 4 * t + 2 * c + n % 2; }
