// ---- tensor memory accelerator (TMA) --------------------------------------------
// A TMA descriptor (CUtensorMap), passed by value as a __grid_constant__
// kernel parameter: the copy engine reads it where the parameters live.
struct __align__(64) TensorMap { unsigned long long opaque[16]; };
// Arrives on the barrier and adds `bytes` of asynchronous copies to what
// its current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// Copies the box at (col, row, head, batch) of the descriptor's tensor to
// shared memory at `dst` (1024-byte aligned); its bytes complete on `bar`.
// Coordinates past the tensor's end read zeros.
__device__ __forceinline__ void tma_load(unsigned dst, const TensorMap& map, unsigned bar, int col, int row, int head, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
        : "memory");
}
// One thread loads a ROWS x COLS tile from rows [row, row + ROWS): COLS / 64
// boxes, one per panel, all completing on `bar` (this thread arrives on it).
template <int ROWS, int COLS>
__device__ __forceinline__ void tma_load_tile(unsigned short* tile, const TensorMap& map, unsigned bar, int row, int head, int batch) {
    mbar_arrive_expect_tx(bar, ROWS * COLS * 2);
    #pragma unroll
    for (int p = 0; p < COLS / 64; ++p) tma_load(smem_addr(tile + p * ROWS * 64), map, bar, p * 64, row, head, batch);
}
