// A warp's 16 rows of an f32 accumulator (TILES m16n8 tiles) times
// `factor`, rows first..first + 15 of the 16-bit `rows` (`len` of them exist,
// `cols` columns), out to global memory through `stage`: this warp's 16 rows
// of a free shared tile 8 * TILES columns wide. The column pairs land with
// each row's 16-byte chunks XORed with its swizzle_key (a warp's pair
// stores then hit all 32 banks); the rows leave 16 bytes
// per lane where they are 16-byte aligned and the chunk holds only columns
// below `cols`, else element by element.
template <class S, int TILES>
__device__ __forceinline__ void store_warp_rows(S, unsigned short* stage, const float (&acc)[TILES][4], float factor,
                                                unsigned short* rows, long long stride, int first, int len, int cols) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char* bytes = reinterpret_cast<unsigned char*>(stage);
    #pragma unroll
    for (int n = 0; n < TILES; ++n) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            const unsigned pair = (unsigned)S::from_f32(acc[n][2 * i] * factor) | (unsigned)S::from_f32(acc[n][2 * i + 1] * factor) << 16;
            *reinterpret_cast<unsigned*>(bytes + row * 16 * TILES + (n ^ swizzle_key<TILES>(row)) * 16 + 4 * t) = pair;
        }
    }
    __syncwarp();
    unsigned short* out = rows + first * stride;
    const int count = min_i32(16, len - first);
    const bool vector = aligned16(rows, stride);
    #pragma unroll
    for (int c = lane; c < 16 * TILES; c += 32) {
        const int row = c / TILES, chunk = c % TILES;
        if (row >= count) break;
        const unsigned char* from = bytes + row * 16 * TILES + (chunk ^ swizzle_key<TILES>(row)) * 16;
        unsigned short* to = out + row * stride + chunk * 8;
        if (vector && chunk * 8 + 8 <= cols) {
            *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
        } else {
            for (int e = 0; e < 8 && chunk * 8 + e < cols; ++e) to[e] = reinterpret_cast<const unsigned short*>(from)[e];
        }
    }
}
// Byte offset of a lane's ldmatrix row (see LdmLane) for a (row_step, step)
// known only at run time: the swizzle computed in full.
template <int COLS>
__device__ __forceinline__ unsigned ldm_at(const LdmLane<COLS>& lane, int row_step, int step) {
    return 2 * swizzle<COLS>(lane.row + row_step, 16 * step + 8 * lane.half);
}
// dst[0..4) += (a, b, c, d): one 16-byte f32 reduction on sm_90 (dst 16-byte
// aligned), four scalar atomics before it.
__device__ __forceinline__ void red_add4(float* dst, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
    atomicAdd(dst + 2, c);
    atomicAdd(dst + 3, d);
#endif
}
// Adds a warp's m16n8 f32 accumulator tile to rows [row0, row0 + 16) x
// columns [col0, col0 + 8) of a row-major f32 matrix of `rows` x COLS (rows
// and columns past the end are dropped). Lanes t and t ^ 1 swap half their
// elements, so that each lane holds four consecutive columns of one row
// (row g for even t, g + 8 for odd): one red_add4 per lane, not four atomics.
template <int COLS>
__device__ __forceinline__ void red_add_tile(float* m, int rows, int row0, int col0, const float (&acc)[4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if constexpr (COLS % 4 == 0) {
        const bool odd = t % 2 == 1;
        const float x0 = __shfl_xor_sync(0xffffffffu, odd ? acc[0] : acc[2], 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, odd ? acc[1] : acc[3], 1);
        const int row = row0 + g + (odd ? 8 : 0), col = col0 + 2 * (t & ~1);
        const float v0 = odd ? x0 : acc[0], v1 = odd ? x1 : acc[1];
        const float v2 = odd ? acc[2] : x0, v3 = odd ? acc[3] : x1;
        if (row < rows && col < COLS) red_add4(m + (long long)row * COLS + col, v0, v1, v2, v3);
    } else {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + 8 * (e / 2), col = col0 + 2 * t + e % 2;
            if (row < rows && col < COLS) atomicAdd(&m[(long long)row * COLS + col], acc[e]);
        }
    }
}

// Adds to a warp's partial S^T and dP^T (TILES m16n8 tiles each, summed over
// its part of the head dims) those of its partner, the warp of the other
// column part on the same 16 keys: each stores its sums to its slot `mine`
// (lane-major, conflict-free) and reads the partner's `theirs` once both
// pass named barrier `bar` (the pair's 64 threads). Both add the same two
// values (a + b = b + a exactly), so their P and dS agree bit for bit. The
// caller's next write to `mine` must follow a barrier of the whole CTA.
template <int TILES>
__device__ __forceinline__ void add_partner_sums(float (&s)[TILES][4], float (&dp)[TILES][4], float* mine,
                                                 const float* theirs, int bar) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int n = 0; n < TILES; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            mine[(n * 4 + e) * 32 + lane] = s[n][e];
            mine[((TILES + n) * 4 + e) * 32 + lane] = dp[n][e];
        }
    }
    asm volatile("bar.sync %0, 64;" ::"r"(bar) : "memory");
    #pragma unroll
    for (int n = 0; n < TILES; ++n) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[n][e] += theirs[(n * 4 + e) * 32 + lane];
            dp[n][e] += theirs[((TILES + n) * 4 + e) * 32 + lane];
        }
    }
}
