// ---- ragged TMA: boxes of one sequence of a packed operand ---------------------
// A ragged descriptor (runtime `tma::encode_ragged`) describes a packed
// operand [tokens, heads, d] as the 5-d tensor of coordinates
// (col, r, head, end, 2^30) whose element lies at
//     col + head * head_stride + (end + r - 2^30) * row_stride,
// the fifth stride being 2^34 - row_stride bytes, so that 2^30 of them
// wrap to -2^30 rows modulo 2^64. Its second dimension holds 2^30 rows: a
// box of sequence rows [start, start + len) from row `row` addresses
// r = 2^30 - len + row, inside the tensor exactly while row < len, so the
// copy engine reads zeros past the sequence's end and writes nothing there,
// as it does past a dense tensor's. (Triton's ragged descriptors do the same.)
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, unsigned bar, int col, int row, int head,
                                         SeqSpan seq) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"((1 << 30) - seq.len + row),
           "r"(head), "r"(seq.start + seq.len), "r"(1 << 30), "r"(bar)
        : "memory");
}
// tma_load_tile's rows [row, row + ROWS) of sequence `seq`.
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile(unsigned short* tile, const TensorMap& map, unsigned bar, int row, int head,
                                              SeqSpan seq) {
    mbar_arrive_expect_tx(bar, ROWS * COLS * 2);
    #pragma unroll
    for (int p = 0; p < COLS / 64; ++p) tma_load(smem_addr(tile + p * ROWS * 64), map, bar, p * 64, row, head, seq);
}
// tma_store_tile's rows [row, row + ROWS) of sequence `seq`; rows past its
// end are not written.
template <int ROWS, int COLS, int TILE_ROWS>
__device__ __forceinline__ void tma_store_tile(const unsigned short* tile, const TensorMap& map, int row, int head,
                                               SeqSpan seq) {
    #pragma unroll
    for (int p = 0; p < COLS / 64; ++p) {
        asm volatile(
            "cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];"
            :: "l"(reinterpret_cast<unsigned long long>(&map)), "r"(p * 64), "r"((1 << 30) - seq.len + row), "r"(head),
               "r"(seq.start + seq.len), "r"(1 << 30), "r"(smem_addr(tile + p * TILE_ROWS * 64))
            : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
