// ---- tensor-core tiles ----------------------------------------------------------
// Fragment coordinates (PTX ISA, mma.m16n8k16): with g = lane / 4, t = lane % 4,
// accumulator element i of an m16n8 tile is at row g + 8 * (i / 2), column
// 2 * t + i % 2.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16 bytes global -> shared without a register round trip, to a
// shared-space address (a copy stream whose destinations are one base plus
// constants keeps them 32-bit); src_bytes = 0 writes zeros (rows past the
// end of a sequence).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
    cp_async_16(smem_addr(dst), src, src_bytes);
}
// 4 bytes global -> shared (a per-row statistic), with the same zero fill.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

// Whether rows starting at p, `stride` elements apart, allow 16-byte copies.
template <typename E>
__device__ __forceinline__ bool aligned16(const E* p, long long stride) {
    return (unsigned long long)p % 16 == 0 && stride * (long long)sizeof(E) % 16 == 0;
}

// The key a row's 16-byte chunk indices are XORed with, in rows of CHUNKS
// chunks: consecutive rows start G = gcd(CHUNKS, 8) bank groups apart
// (modulo the eight 16-byte groups), so every 8 / G rows the groups repeat;
// the key changes there and takes G values (below G, so a chunk stays in
// its row). Eight consecutive rows' same chunk then fall in eight groups,
// as ldmatrix's eight row addresses need.
template <int CHUNKS>
__device__ __forceinline__ int swizzle_key(int row) {
    constexpr int G = CHUNKS % 8 == 0 ? 8 : CHUNKS % 4 == 0 ? 4 : CHUNKS % 2 == 0 ? 2 : 1;
    return row / (8 / G) % G;
}

// Element offset of (row, col) in a swizzled shared tile with COLS columns
// (see swizzle_key).
template <int COLS>
__device__ __forceinline__ int swizzle(int row, int col) {
    return row * COLS + (((col / 8) ^ swizzle_key<COLS / 8>(row)) * 8) + col % 8;
}

// Element offset of (row, col) in a shared tile of ROWS x COLS: swizzled
// rows (ldmatrix), or with PANELS wgmma's 128-byte swizzle: COLS in 64-column
// panels of ROWS x 128 bytes, chunks XORed with row % 8 as the hardware
// expects.
template <int ROWS, int COLS, bool PANELS>
__device__ __forceinline__ int tile_offset(int row, int col) {
    if constexpr (PANELS) return (col / 64) * (ROWS * 64) + row * 64 + ((((col % 64) / 8) ^ (row % 8)) * 8) + col % 8;
    else return swizzle<COLS>(row, col);
}

// Loads rows [0, ROWS) x cols [0, COLS) of a tile whose valid part is
// `rows` x WIDTH (the rest is zero-filled) from global rows `stride`
// elements apart into a swizzled shared tile (see tile_offset). The THREADS
// threads from thread FIRST on copy it.
template <int ROWS, int COLS, int WIDTH, int THREADS, bool PANELS = false, int FIRST = 0>
__device__ __forceinline__ void load_tile(unsigned short* tile, const unsigned short* src, long long stride,
                                          int rows, bool vector) {
    const int tid = threadIdx.x - FIRST;
    constexpr int CHUNKS = COLS / 8;
    // Threads per row step: when it is a multiple of 8 (the swizzle's period)
    // each thread copies one chunk column at rows r0, r0 + STEP, ...: one
    // shared offset and one global pointer, advanced by constants.
    constexpr int STEP = THREADS % CHUNKS == 0 ? THREADS / CHUNKS : 1;
    if (WIDTH % 8 == 0 && vector && STEP % 8 == 0 && ROWS % STEP == 0) {
        const int r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
        unsigned short* dst = tile + tile_offset<ROWS, COLS, PANELS>(r0, c);
        const unsigned short* from = src + r0 * stride + c;
        const long long step = STEP * stride;
        #pragma unroll 1
        for (int r = r0; r < ROWS; r += STEP, dst += STEP * (PANELS ? 64 : COLS), from += step) {
            const bool valid = r < rows && c < WIDTH;
            cp_async_16(dst, valid ? from : src, valid ? 16 : 0);
        }
    } else if (WIDTH % 8 == 0 && vector) {
        // Not unrolled: unrolled copies keep one 64-bit source address per
        // chunk live across the main loop, and the accumulators need them.
        #pragma unroll 1
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
            const bool valid = r < rows && c < WIDTH;
            cp_async_16(tile + tile_offset<ROWS, COLS, PANELS>(r, c), valid ? src + r * stride + c : src, valid ? 16 : 0);
        }
    } else {
        for (int i = tid; i < ROWS * COLS; i += THREADS) {
            const int r = i / COLS, c = i % COLS;
            tile[tile_offset<ROWS, COLS, PANELS>(r, c)] = r < rows && c < WIDTH ? src[r * stride + c] : (unsigned short)0;
        }
    }
}

// Stores ROWS rows of a shared tile of TILE_ROWS x COLS (laid out as
// tile_offset says), from row `first` on, to global rows `stride` elements
// apart: the first `rows` of them, cols [0, WIDTH); 16 bytes per thread and
// instruction where the rows allow it, element by element otherwise.
// THREADS threads store it; this one is `tid` among them.
template <int ROWS, int COLS, int WIDTH, int THREADS, bool PANELS = false, int TILE_ROWS = ROWS>
__device__ __forceinline__ void store_tile(const unsigned short* tile, unsigned short* dst, long long stride, int rows,
                                           bool vector, int tid, int first = 0) {
    if (WIDTH % 8 == 0 && vector) {
        constexpr int CHUNKS = COLS / 8;
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
            if (r < rows && c < WIDTH) {
                *(uint4*)(dst + r * stride + c) = *(const uint4*)(tile + tile_offset<TILE_ROWS, COLS, PANELS>(first + r, c));
            }
        }
    } else {
        for (int i = tid; i < ROWS * COLS; i += THREADS) {
            const int r = i / COLS, c = i % COLS;
            if (r < rows && c < WIDTH) dst[r * stride + c] = tile[tile_offset<TILE_ROWS, COLS, PANELS>(first + r, c)];
        }
    }
}

// Where one lane's ldmatrix rows sit in a swizzled tile with COLS columns.
// The lane addresses row `row + row_step` (row_step a multiple of 8) at
// column `16 * step + 8 * half`. With COLS % 64 == 0 the swizzle only moves
// the low three bits of the chunk index, so four per-lane offsets (one per
// step % 4) plus compile-time constants give every address: the unrolled
// loops then keep 4 registers per operand instead of one per access.
template <int COLS>
struct LdmLane {
    int off[4];
    int row, half;
    __device__ __forceinline__ LdmLane(int row_, int half_) : row(row_), half(half_) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) off[j] = row * COLS + (((2 * j + half) ^ (row % 8)) * 8);
    }
    // Byte offset of this lane's row for (row_step, step).
    __device__ __forceinline__ unsigned at(int row_step, int step) const {
        if constexpr (COLS % 64 == 0) return 2 * (row_step * COLS + (step / 4) * 64 + off[step % 4]);
        else return 2 * swizzle<COLS>(row + row_step, 16 * step + 8 * half);
    }
};

// Four 8x8 16-bit matrices from shared memory (a 32-bit shared address); lane
// l supplies the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// c += a * b on one 16x8x16 tile; the storage tag picks bf16 or f16 inputs.
__device__ __forceinline__ void mma_16816(bf16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_16816(f16, float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> one register holding two 16-bit values (lo in the low half).
__device__ __forceinline__ unsigned pack2(bf16, float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ unsigned pack2(f16, float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Row r (0: g, 1: g + 8) of a warp's TILES m16n8 accumulator tiles, this
// lane's 2 * TILES elements, reduced pairwise: a tree of dependent steps,
// not a chain through every element (max and sum).
template <int TILES, class F>
__device__ __forceinline__ float row_reduce(const float (&s)[TILES][4], int r, F op) {
    float v[TILES];
    #pragma unroll
    for (int n = 0; n < TILES; ++n) v[n] = op(s[n][2 * r], s[n][2 * r + 1]);
    #pragma unroll
    for (int step = 1; step < TILES; step *= 2) {
        #pragma unroll
        for (int n = 0; n + step < TILES; n += 2 * step) v[n] = op(v[n], v[n + step]);
    }
    return v[0];
}
template <int TILES>
__device__ __forceinline__ float row_max(const float (&s)[TILES][4], int r) {
    return row_reduce(s, r, [](float a, float b) { return fmaxf(a, b); });
}
template <int TILES>
__device__ __forceinline__ float row_sum(const float (&s)[TILES][4], int r) {
    return row_reduce(s, r, [](float a, float b) { return a + b; });
}

// The A fragment of the kk-th 16-key step of P V from P's f32 accumulators:
// the m16n8 tiles of keys 2kk and 2kk + 1, packed to 16 bits.
template <class T, int TILES>
__device__ __forceinline__ void pack_p(T tag, unsigned (&p)[4], const float (&s)[TILES][4], int kk) {
    p[0] = pack2(tag, s[2 * kk][0], s[2 * kk][1]);
    p[1] = pack2(tag, s[2 * kk][2], s[2 * kk][3]);
    p[2] = pack2(tag, s[2 * kk + 1][0], s[2 * kk + 1][1]);
    p[3] = pack2(tag, s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Element e of accumulator tile n back from pack_p's fragments: P where only
// its 16-bit copy is left.
template <typename T, int STEPS>
__device__ __forceinline__ float unpack_p(T, const unsigned (&p)[STEPS][4], int n, int e) {
    const unsigned pair = p[n / 2][2 * (n % 2) + e / 2];
    return T::to_f32((unsigned short)(e % 2 == 0 ? pair & 0xffffu : pair >> 16));
}

// 2^x in one MUFU instruction (FlashAttention's exp2f under fast math): ~2 ulp,
// far below the rounding of P to 16 bits; 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// log2(x) and 1 / x in one MUFU instruction each (FlashAttention's epilogue,
// built with fast math, uses the same): ~2^-22 and 1 ulp, far below the
// rounding of O to 16 bits and the LSE check's tolerance. IEEE division
// would add a call for its slow path to every epilogue.
__device__ __forceinline__ float fast_log2(float x) {
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float fast_rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Max and sum across the four lanes that share an accumulator row.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
