// ---- paged K/V by TMA ----------------------------------------------------------------
// A cache [num_pages, page_size, heads, d] whose pages lie page_size rows
// apart is a packed operand of num_pages * page_size rows: a ragged
// descriptor of it (`tma_ragged.cuh`) copies a box of rows of one page,
// reading zeros past the sequence's keys, whose rows in its last page hold
// whatever the cache held. A tile lies in one page, or is whole pages
// (runtime `tma::paged_box_rows`): one box per page.
//
// The producer warpgroup's four warps issue a tile's boxes: box b of K by
// warp b % 2, of V by warp 2 + b % 2, each in lane b / 2. Issuing a box
// takes a loop over the lanes that have one (the copy instruction reads
// uniform registers), so one warp issuing 32 boxes a tile of pages of 16
// would be the kernel's bottleneck; four warps run on four schedulers.
//
// The page of box `box` of the tile of keys k0.. (boxes of box_rows keys),
// clamped; 0 for a box past the tile or past the sequence's keys, which
// reads no table entry past the sequence's pages. The warps read it a
// tile ahead: a box waiting on its page id would leave the copy engine
// idle for the table's latency on every tile.
template <int ROWS>
__device__ __forceinline__ int paged_box_page(const PagedRows& p, int k0, int kv_len, int box_rows, int box) {
    const int k = k0 + box * box_rows;
    if (k - k0 >= ROWS || k >= kv_len) return 0;
    return min(max(p.pages[k / p.page_size], 0), p.num_pages - 1);
}
// Copies box `box` of the ROWS x COLS tile of keys k0.. into `tile` from
// `page` (its paged_box_page); keys at and past kv_len read zeros. The
// `arrives` thread arrives on `bar` with the whole tile's bytes.
template <int ROWS, int COLS>
__device__ __forceinline__ void load_paged_boxes(unsigned short* tile, const TensorMap& map, unsigned bar,
                                                 const PagedRows& p, int k0, int kv_len, int box_rows, int head,
                                                 int page, int box, bool arrives) {
    const int r = box * box_rows;
    if (arrives) mbar_arrive_expect_tx(bar, ROWS * COLS * 2);
    if (r < ROWS) {
        const SeqSpan rows = {page * p.page_size + (k0 + r) % p.page_size, min(box_rows, kv_len - k0 - r)};
        #pragma unroll
        for (int c = 0; c < COLS / 64; ++c)
            tma_load(smem_addr(tile + c * ROWS * 64 + r * 64), map, bar, c * 64, 0, head, rows);
    }
}
