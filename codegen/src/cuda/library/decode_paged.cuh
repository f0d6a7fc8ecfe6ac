// ---- decode over paged K/V: a tile's keys through the block table -----------------
// A paged decode kernel reads its cache rows here, as a dense one reads them
// through KvRows. Each warp copies a fixed, contiguous share of every K/V
// tile's keys (WARP_ROWS of them); lane i of the warp resolves its share's
// key i once per tile (one division and one block-table read, both clamped
// as paged_row clamps), and the lanes copying that key's 16-byte chunks take
// its page and row from lane i by shuffle: nothing is divided or read from
// the table per chunk. `flashgen_codegen::paged::{page_slot, warp_tile_row}`
// are the CPU twins.

// A key's page (clamped into the cache) and its row in that page.
struct PageSlot {
    int page, row;
};

// One sequence's row of the block table and the cache's page geometry.
struct PageTable {
    const int* __restrict__ pages;
    int page_size, num_pages;
    // Key k's slot, 0 <= k < the sequence's clamped length (paged_kv_len),
    // so the table entry read is one of the sequence's pages_per_seq.
    __device__ __forceinline__ PageSlot slot(int k) const {
        return {min(max(pages[k / page_size], 0), num_pages - 1), k % page_size};
    }
};

// The rows of one K/V head in a paged cache: `base` is the head's first
// element in page 0; E and the strides as KvRows'.
template <typename E>
struct PagedKvRows {
    const E* base;
    long long page_stride, row_stride;
    __device__ __forceinline__ const E* at(int page, int row) const {
        return base + page * page_stride + row * row_stride;
    }
    // Whether every row allows 16-byte copies.
    __device__ __forceinline__ bool vector() const {
        return aligned16(base, page_stride) && row_stride * (long long)sizeof(E) % 16 == 0;
    }
};
template <typename E>
PagedKvRows(const E*, long long, long long) -> PagedKvRows<E>;

// The tile row this lane resolves: its warp's share of the tile's ROWS keys
// starts at warp * WARP_ROWS, and lanes past the share repeat it.
template <int ROWS, int WARPS>
__device__ __forceinline__ int warp_tile_row() {
    constexpr int WARP_ROWS = ROWS / WARPS;
    static_assert(ROWS % WARPS == 0 && WARP_ROWS <= 32, "a warp's share of a tile is at most a key per lane");
    return threadIdx.x / 32 * WARP_ROWS + threadIdx.x % 32 % WARP_ROWS;
}

// This lane's resolved key of the tile whose first key is `first`; keys at
// or past `rows` (the sequence's end) are never copied and read no table.
template <int ROWS, int WARPS>
__device__ __forceinline__ PageSlot tile_slot(const PageTable& table, int first, int rows) {
    const int r = warp_tile_row<ROWS, WARPS>();
    return r < rows ? table.slot(first + r) : PageSlot{0, 0};
}

// Copies the tile's keys into a swizzled shared tile of COLS columns
// (tile_byte), rows at or past `rows` (and cols past WIDTH) zero-filled,
// each warp its share of the rows, `slot` this lane's resolved key
// (tile_slot); COLS and WIDTH count elements of E. 16-byte copies where
// `vector`, consecutive lanes taking consecutive chunks of a row (a warp's
// copies stay coalesced within each page row); element by element otherwise.
// Every lane runs every step: the shuffles need the whole warp.
template <int ROWS, int COLS, int WIDTH, int WARPS, typename E>
__device__ __forceinline__ void load_paged_kv_tile(void* tile, const PagedKvRows<E>& kv, PageSlot slot, int rows,
                                                   bool vector) {
    constexpr int WARP_ROWS = ROWS / WARPS;
    constexpr int CHUNK = 16 / sizeof(E);  // elements per 16-byte copy
    const int r0 = threadIdx.x / 32 * WARP_ROWS, lane = threadIdx.x % 32;
    char* bytes = (char*)tile;
    constexpr int CHUNKS = COLS / CHUNK, STEPS = (WARP_ROWS * CHUNKS + 31) / 32;
    if constexpr (wide_rows<E>(CHUNKS, STEPS) && WARP_ROWS % 4 == 0) {
        if (WIDTH % CHUNK == 0 && vector) {
            // A lane copies chunks lane % 8 + 8k of the warp's rows lane / 8 + 4m.
            #pragma unroll
            for (int m = 0; m < WARP_ROWS / 4; ++m) {
                const int i = lane / 8 + 4 * m;
                const int page = __shfl_sync(0xffffffffu, slot.page, i), row = __shfl_sync(0xffffffffu, slot.row, i);
                char* dst = bytes + tile_byte<E, COLS>(r0 + i, lane % 8 * CHUNK);
                wide_row_copy<CHUNKS, WIDTH>(dst, kv.at(page, row) + lane % 8 * CHUNK, kv.base, lane % 8, r0 + i < rows);
            }
            return;
        }
    }
    if (WIDTH % CHUNK == 0 && vector) {
        #pragma unroll(unrolled_copies(STEPS))
        for (int step = 0; step < STEPS; ++step) {
            const int e = step * 32 + lane, i = min(e / CHUNKS, WARP_ROWS - 1), c = e % CHUNKS * CHUNK;
            const int page = __shfl_sync(0xffffffffu, slot.page, i), row = __shfl_sync(0xffffffffu, slot.row, i);
            const bool valid = r0 + i < rows && c < WIDTH;
            if (e < WARP_ROWS * CHUNKS) {
                cp_async_16(bytes + tile_byte<E, COLS>(r0 + i, c), valid ? kv.at(page, row) + c : kv.base,
                            valid ? 16 : 0);
            }
        }
    } else {
        #pragma unroll 1
        for (int step = 0; step < (WARP_ROWS * COLS + 31) / 32; ++step) {
            const int e = step * 32 + lane, i = min(e / COLS, WARP_ROWS - 1), c = e % COLS;
            const int page = __shfl_sync(0xffffffffu, slot.page, i), row = __shfl_sync(0xffffffffu, slot.row, i);
            if (e < WARP_ROWS * COLS) {
                *(E*)(bytes + tile_byte<E, COLS>(r0 + i, c)) =
                    r0 + i < rows && c < WIDTH ? kv.at(page, row)[c] : (E)0;
            }
        }
    }
}

// A paged operand's tile copies with this lane's share resolved once per
// CTA, as KvTileCopy's: lane l of a warp copies chunk column `col` of its
// warp's rows `row`, `row` + STEP, ... (STEP = 32 / CHUNKS), each row's
// address taken by shuffle from the lane that resolved its key (tile_slot),
// so a copy costs two shuffles and an add. Shapes it does not divide evenly
// and unaligned caches take load_paged_kv_tile's general copy.
template <int ROWS, int COLS, int WIDTH, int WARPS, typename E>
struct PagedTileCopy {
    static constexpr int CHUNK = 16 / sizeof(E), CHUNKS = COLS / CHUNK, WARP_ROWS = ROWS / WARPS;
    static constexpr int STEP = 32 % CHUNKS == 0 ? 32 / CHUNKS : 1;
    using Slots = ColumnSlots<STEP, COLS, E>;
    static constexpr bool PLANNED = 32 % CHUNKS == 0 && COLS % CHUNK == 0 && WIDTH % CHUNK == 0 &&
                                    WARP_ROWS % (STEP * Slots::PERIOD) == 0 && WARP_ROWS / STEP <= 16;

    PagedKvRows<E> kv;
    bool vector;  // every row allows 16-byte copies
    int row, col;  // this lane's first row of its warp's share, and its column
    Slots slots;

    __device__ __forceinline__ PagedTileCopy(const PagedKvRows<E>& rows, bool vector_rows)
        : kv(rows), vector(vector_rows), row(threadIdx.x % 32 / CHUNKS), col(threadIdx.x % 32 % CHUNKS * CHUNK),
          slots(threadIdx.x / 32 * WARP_ROWS + row, col) {}

    // The tile's keys (this lane's resolved one: `slot`) into `tile`, rows
    // at or past `rows` zeroed. Every lane runs it: the shuffles need the warp.
    __device__ __forceinline__ void operator()(void* tile, PageSlot slot, int rows) const {
        if constexpr (PLANNED) {
            if (vector) {
                const int r0 = threadIdx.x / 32 * WARP_ROWS;
                const unsigned long long mine = (unsigned long long)kv.at(slot.page, slot.row);
                // Row `row` + j * STEP of the warp's share, resolved by the lane of that index.
                auto source = [&](int j) { return (const E*)__shfl_sync(0xffffffffu, mine, row + j * STEP) + col; };
                const bool whole = rows >= r0 + WARP_ROWS && col < WIDTH;
                planned_copies<WARP_ROWS / STEP, STEP>(smem_addr(tile), slots, source, whole, r0 + row, rows,
                                                       col < WIDTH, kv.base);
                return;
            }
        }
        load_paged_kv_tile<ROWS, COLS, WIDTH, WARPS>(tile, kv, slot, rows, vector);
    }
};

template <int ROWS, int COLS, int WIDTH, int WARPS, typename E>
__device__ __forceinline__ PagedTileCopy<ROWS, COLS, WIDTH, WARPS, E> paged_tile_copy(const PagedKvRows<E>& kv,
                                                                                   bool vector) {
    return PagedTileCopy<ROWS, COLS, WIDTH, WARPS, E>(kv, vector);
}
