// ---- paged K/V -------------------------------------------------------------------
// K and V caches of `num_pages` pages of `page_size` rows; key k of sequence
// b is row k % page_size of page pages[k / page_size], `pages` being b's row
// of the block table. Lengths and page ids are on the device, which the
// host cannot read before the launch, so both are clamped: a bad kv_len
// gives wrong rows (never more than the table's pages or max_kv_len), a bad
// page id reads page 0 or num_pages - 1 instead. `flashgen_codegen::paged`
// is the CPU twin.
struct PagedRows {
    const int* __restrict__ pages;
    int page_size, num_pages;
    long long page_stride, row_stride;
};
// Sequence b's key count, clamped into [0, min(pages_per_seq * page_size, max_len)]
// (0 in caches of no pages).
__device__ __forceinline__ int paged_kv_len(const int* __restrict__ kv_lens, int b, int pages_per_seq, int page_size,
                                            int num_pages, int max_len) {
    const long long cap = num_pages > 0 ? min((long long)pages_per_seq * page_size, (long long)max_len) : 0ll;
    return (int)min(max((long long)kv_lens[b], 0ll), cap);
}
// The element offset of key k (0 <= k < its sequence's clamped length).
__device__ __forceinline__ long long paged_row(const PagedRows& p, int k) {
    const int page = min(max(p.pages[k / p.page_size], 0), p.num_pages - 1);
    return page * p.page_stride + (k % p.page_size) * p.row_stride;
}
// Sequence b's queries: from the prefix sums, or with none (dense queries,
// `total` = batch * max_len) max_len rows from b * max_len.
__device__ __forceinline__ SeqSpan query_span(const int* __restrict__ cu, int b, int total, int max_len) {
    if (cu == nullptr) return {b * max_len, max_len};
    return seq_span(cu, b, total, max_len);
}
// How load_paged_tile copies a tile of ROWS x COLS (WIDTH valid columns)
// with THREADS threads: as load_tile does (each thread one chunk column,
// rows STEP apart), where BY_LANES. A division and a table read per copy
// cost more than the copy on a producer of few registers, so there each
// lane of a warp resolves one of the rows the warp copies (paged_key), and
// each copy takes its row's offset from that lane.
template <int ROWS, int COLS, int WIDTH, int THREADS>
struct PagedGather {
    static constexpr int CHUNKS = COLS / 8;
    static constexpr int STEP = THREADS % CHUNKS == 0 ? THREADS / CHUNKS : 1;
    static constexpr bool BY_LANES =
        WIDTH % 8 == 0 && STEP % 8 == 0 && ROWS % STEP == 0 && ROWS <= THREADS && 32 % CHUNKS == 0;
    // A warp's threads start at G rows; lane l resolves the row that start
    // l % G reaches at step l / G.
    static constexpr int G = BY_LANES ? 32 / CHUNKS : 1;
    static __device__ __forceinline__ int own_row(int tid) {
        const int lane = tid % 32;
        return tid / CHUNKS - lane / CHUNKS + lane % G + STEP * (lane / G);
    }
};
// The page (clamped) and the row in it of the key this lane resolves for
// the tile of keys k0 + [0, rows) (page 0, row 0 past them).
struct PagedKey {
    int page, slot;
};
template <int ROWS, int COLS, int WIDTH, int THREADS, int FIRST = 0>
__device__ __forceinline__ PagedKey paged_key(const PagedRows& p, int k0, int rows) {
    const int own = PagedGather<ROWS, COLS, WIDTH, THREADS>::own_row(threadIdx.x - FIRST);
    if (own >= rows) return {0, 0};
    const int k = k0 + own, index = k / p.page_size;
    return {min(max(p.pages[index], 0), p.num_pages - 1), k - index * p.page_size};
}
// load_tile's gather: rows [0, ROWS) of the tile are keys k0 + r of a paged
// cache (`src` its head's first element), valid for r < rows; 16-byte copies
// where `vector` (every row 16-byte aligned), element by element otherwise.
// `key` is this lane's paged_key of the tile, which a producer reads a tile
// ahead so that the table's latency hides behind the copies.
template <int ROWS, int COLS, int WIDTH, int THREADS, bool PANELS = false, int FIRST = 0>
__device__ __forceinline__ void load_paged_tile(unsigned short* tile, const unsigned short* src, const PagedRows& p,
                                                PagedKey key, int k0, int rows, bool vector) {
    using Gather = PagedGather<ROWS, COLS, WIDTH, THREADS>;
    constexpr int CHUNKS = Gather::CHUNKS, STEP = Gather::STEP, G = Gather::G;
    const int tid = threadIdx.x - FIRST;
    if (Gather::BY_LANES && vector) {
        const long long own = key.page * p.page_stride + key.slot * p.row_stride;
        const int start = tid % 32 / CHUNKS, r0 = tid / CHUNKS, c = (tid % CHUNKS) * 8;
        unsigned short* dst = tile + tile_offset<ROWS, COLS, PANELS>(r0, c);
        // Unrolled so that several shuffles are in flight at once.
        #pragma unroll 4
        for (int i = 0, r = r0; r < ROWS; ++i, r += STEP, dst += STEP * (PANELS ? 64 : COLS)) {
            const long long row = __shfl_sync(0xffffffffu, own, i * G + start);
            const bool valid = r < rows && c < WIDTH;
            cp_async_16(dst, valid ? src + row + c : src, valid ? 16 : 0);
        }
    } else if (WIDTH % 8 == 0 && vector) {
        #pragma unroll 1
        for (int i = tid; i < ROWS * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
            const bool valid = r < rows && c < WIDTH;
            cp_async_16(tile + tile_offset<ROWS, COLS, PANELS>(r, c), valid ? src + paged_row(p, k0 + r) + c : src,
                        valid ? 16 : 0);
        }
    } else {
        for (int i = tid; i < ROWS * COLS; i += THREADS) {
            const int r = i / COLS, c = i % COLS;
            tile[tile_offset<ROWS, COLS, PANELS>(r, c)] =
                r < rows && c < WIDTH ? src[paged_row(p, k0 + r) + c] : (unsigned short)0;
        }
    }
}
// Copies new rows [r0, r1) of one sequence (row r at src + r * src_stride,
// heads src_head apart) to its keys start + r in the cache (heads
// cache_head apart), one element per thread and step; keys at or past
// `cap` (the sequence's pages' rows) are dropped.
template <int WIDTH, int THREADS>
__device__ __forceinline__ void append_rows(unsigned short* cache, long long cache_head, const PagedRows& p,
                                            const unsigned short* src, long long src_stride, long long src_head,
                                            int heads, int start, int r0, int r1, int cap) {
    const int per_row = heads * WIDTH;
    for (long long i = threadIdx.x; i < (long long)(r1 - r0) * per_row; i += THREADS) {
        const int r = r0 + (int)(i / per_row), e = (int)(i % per_row), h = e / WIDTH, c = e % WIDTH;
        const long long key = (long long)start + r;
        if (key < cap) cache[paged_row(p, (int)key) + h * cache_head + c] = src[r * src_stride + h * src_head + c];
    }
}
