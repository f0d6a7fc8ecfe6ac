// One thread stores ROWS rows of a shared tile laid out as tma_load_tile
// writes it (panels of TILE_ROWS rows), from `tile` (a row 8-aligned in
// panel 0) to rows [row, row + ROWS) of the descriptor's tensor, one bulk
// group; rows and columns past the tensor's end are not written. The
// threads that wrote the tile fenced their writes for the async proxy.
template <int ROWS, int COLS, int TILE_ROWS>
__device__ __forceinline__ void tma_store_tile(const unsigned short* tile, const TensorMap& map, int row, int head, int batch) {
    #pragma unroll
    for (int p = 0; p < COLS / 64; ++p) {
        asm volatile(
            "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];"
            :: "l"(reinterpret_cast<unsigned long long>(&map)), "r"(p * 64), "r"(row), "r"(head), "r"(batch),
               "r"(smem_addr(tile + p * TILE_ROWS * 64))
            : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until this thread's bulk stores have read their shared memory
// (`_read`), or have written global memory.
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
