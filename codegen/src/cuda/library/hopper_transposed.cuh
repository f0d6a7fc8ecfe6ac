// A warp's 16 query rows x TILES m16n8 tiles of keys of an f32 accumulator
// (P or dS), as 16-bit values, into the rows key0 + 8 n.. of a [keys][64
// queries] tile in wgmma's 128-byte swizzle (16-byte chunk c of row r at
// c ^ r % 8), transposed by stmatrix: keys as rows, the K-major operand of
// a product that sums over the queries; query0 is the warp's first query.
template <class S, int TILES>
__device__ __forceinline__ void store_key_major(S, unsigned tile, const float (&acc)[TILES][4], int key0, int query0) {
    static_assert(TILES % 2 == 0, "stmatrix stores two 8-key tiles at a time");
    const int lane = threadIdx.x % 32, m = lane / 8;
    #pragma unroll
    for (int n = 0; n < TILES; n += 2) {
        const unsigned r[4] = {pack2(S{}, acc[n][0], acc[n][1]), pack2(S{}, acc[n][2], acc[n][3]),
                               pack2(S{}, acc[n + 1][0], acc[n + 1][1]), pack2(S{}, acc[n + 1][2], acc[n + 1][3])};
        const int key = key0 + (n + m / 2) * 8 + lane % 8, chunk = query0 / 8 + m % 2;
        stmatrix_x4_trans(r, tile + key * 128 + (chunk ^ key % 8) * 16);
    }
}
// A warpgroup's dK^T or dV^T (PANELS m64 products: head dims p * 64 +
// 16 warp + g (+ 8) as rows, TILES m16n8 tiles of its keys as columns)
// times `factor`, transposed back into rows key0.. of `tile`: [keys][COLS]
// 16-bit, 16-byte chunk c of row r at c ^ r % 8 (a warp's stores then hit
// every bank).
template <class S, int COLS, int PANELS, int TILES>
__device__ __forceinline__ void stage_key_rows(S, unsigned tile, const float (&acc)[PANELS][TILES][4], float factor,
                                               int key0) {
    static_assert(COLS % 64 == 0 && TILES % 2 == 0, "whole swizzle groups; two 8-key tiles at a time");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4, m = lane / 8;
    #pragma unroll
    for (int p = 0; p < PANELS; ++p) {
        #pragma unroll
        for (int n = 0; n < TILES; n += 2) {
            const float (&a)[4] = acc[p][n], (&b)[4] = acc[p][n + 1];
            const unsigned r[4] = {pack2(S{}, a[0] * factor, a[1] * factor), pack2(S{}, a[2] * factor, a[3] * factor),
                                   pack2(S{}, b[0] * factor, b[1] * factor), pack2(S{}, b[2] * factor, b[3] * factor)};
            const int key = key0 + (n + m / 2) * 8 + lane % 8, chunk = p * 8 + warp * 2 + m % 2;
            stmatrix_x4_trans(r, tile + key * COLS * 2 + (chunk ^ key % 8) * 16);
        }
    }
}
// Rows [0, count) of a tile staged by stage_key_rows, their first `cols`
// columns, to `rows` (`stride` elements apart): 16 bytes a thread where
// `vector`, else element by element; `threads` threads from `thread`.
template <int COLS>
__device__ __forceinline__ void store_key_rows(const unsigned short* tile, unsigned short* rows, long long stride,
                                               int count, int cols, bool vector, int thread, int threads) {
    constexpr int CHUNKS = COLS / 8;
    for (int c = thread; c < count * CHUNKS; c += threads) {
        const int row = c / CHUNKS, chunk = c % CHUNKS;
        if (chunk * 8 >= cols) continue;
        const unsigned short* from = tile + row * COLS + (chunk ^ row % 8) * 8;
        unsigned short* to = rows + row * stride + chunk * 8;
        if (vector && chunk * 8 + 8 <= cols) {
            *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
        } else {
            for (int e = 0; e < 8 && chunk * 8 + e < cols; ++e) to[e] = from[e];
        }
    }
}
