//! Hopper's tensor memory accelerator (TMA) for the producers of the
//! warp-specialized kernels (the persistent forward, the backward's dK/dV
//! kernel): one thread hands the copy engine a whole tile (a
//! descriptor, coordinates and a barrier), where cp.async needs every
//! producer thread to compute and issue 16 bytes at a time. The persistent
//! forward's consumers store O the same way, one bulk store per warp. The runtime
//! encodes the descriptors (`runtime/src/tma.rs`); a tile in shared memory
//! is the layout wgmma reads: 64-column panels of 128-byte rows, 16-byte
//! chunks XORed with the row (the copy engine's 128-byte swizzle).

/// How a warp-specialized kernel's producer fills its shared tiles (and a
/// forward's consumers store O), fixed when the kernel is generated: its
/// source holds that path alone. The copy engine (`Tma`, with descriptors among the
/// kernel's arguments) is what a launch uses wherever TMA can address the
/// operands; the producer's threads (`Threads`, cp.async) take the layouts
/// it cannot. Without the other path a kernel compiles about a quarter
/// faster and its producer spills less (bench/RESULTS.md, 2026-11-24).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileCopy {
    Tma,
    Threads,
}

pub(super) const TMA: &str = r#"// ---- tensor memory accelerator (TMA) --------------------------------------------
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
"#;

/// The copy engine's stores, for the persistent forward's O.
pub(super) const TMA_STORE: &str = r#"// One thread stores ROWS rows of a shared tile laid out as tma_load_tile
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
"#;
