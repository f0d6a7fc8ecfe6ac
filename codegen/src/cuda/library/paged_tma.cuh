// ---- paged K/V by TMA ----------------------------------------------------------------
// A K/V cache [num_pages, page_size, heads, d] is a 4-d tensor like a dense
// operand [batch, seq, heads, d], pages in the place of batches: a
// descriptor of it copies BOX rows of one page with one instruction. A tile
// that lies inside one page (or is whole pages) and inside its sequence is
// copied so, box by box from the pages the block table names; the tile at a
// sequence's end keeps the threads' zero-filled gather, since rows past the
// sequence in its last page hold whatever the cache held.
//
// Every one of the THREADS producer threads arrives on `bar` once, as for
// the threads' copies: thread 0 with the tile's bytes (which the boxes
// complete), threads 1 .. boxes - 1 after issuing a box each.
template <int ROWS, int COLS, int THREADS, int FIRST>
__device__ __forceinline__ void load_paged_boxes(unsigned short* tile, const TensorMap& map, unsigned bar,
                                                 const PagedRows& p, int k0, int box_rows, int head) {
    const int tid = threadIdx.x - FIRST;
    if (tid == 0) mbar_arrive_expect_tx(bar, ROWS * COLS * 2);
    if (tid < ROWS / box_rows) {
        const int k = k0 + tid * box_rows, index = k / p.page_size;
        const int page = min(max(p.pages[index], 0), p.num_pages - 1);
        #pragma unroll
        for (int c = 0; c < COLS / 64; ++c)
            tma_load(smem_addr(tile + c * ROWS * 64 + tid * box_rows * 64), map, bar, c * 64, k - index * p.page_size,
                     head, page);
    }
    if (tid != 0) mbar_arrive(bar);
}
