// ---- decode: the KV cache and the query rows of a K/V head ---------------------
// Every address a decode kernel forms in the KV cache comes from KvRows, so
// another cache layout (pages) changes this struct and nothing else.
// E is the cache's element: unsigned short (bf16, f16) or unsigned char
// (e4m3); strides count elements.
template <typename E>
struct KvRows {
    const E* base;         // row 0 of one sequence and K/V head
    long long seq_stride;  // elements from one cache row to the next
    __device__ __forceinline__ const E* row(int i) const { return base + i * seq_stride; }
    // Whether every row allows 16-byte copies.
    __device__ __forceinline__ bool vector() const { return aligned16(base, seq_stride); }
};
template <typename E>
KvRows(const E*, long long) -> KvRows<E>;

// Byte offset of element (row, col) in a swizzled shared tile of COLS
// elements of E a row: the 16-byte chunks of a row are swizzled as a 16-bit
// tile's (swizzle), so 1-byte rows are 16-bit rows of half the columns.
template <typename E, int COLS>
__device__ __forceinline__ int tile_byte(int row, int col) {
    if constexpr (sizeof(E) == 2) return 2 * swizzle<COLS>(row, col);
    else return 2 * swizzle<COLS / 2>(row, col / 2) + col % 2;
}

// Sequence b's key count, clamped into the cache: a bad length gives wrong
// rows, never a read past the cache (lengths live on the device, so a
// captured graph replays with new ones).
__device__ __forceinline__ int cache_len(const int* __restrict__ kv_lens, int b, int max_kv_len) {
    return min(max(kv_lens[b], 0), max_kv_len);
}

// Two 8x8 16-bit matrices from shared memory; lanes 0-15 supply the rows
// (an e4m3 tile's 16 keys, or the 8 keys of a warp's S where warps split
// O's columns).
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Waits until at most N committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// How far a tile copy of `copies` 16-byte copies a thread is unrolled: up to
// 16 fully (d <= 256, K and V tiles of 64 keys); past that (MLA's 576-column
// rows) not at all: each unrolled copy keeps its hoisted addresses in
// registers across the tile loop, which the MMAs' accumulators then lack.
__host__ __device__ constexpr int unrolled_copies(int copies) { return copies > 16 ? 1 : copies; }

// The copy of wide 16-bit rows (MLA's 576 columns: more than 16 copies a
// thread, whose own hoisted addresses would take the registers the MMAs'
// accumulators need), rows of CHUNKS 16-byte chunks, a multiple of 8: a
// thread copies chunks `slot` + 8k of a row (`slot` its index % 8), so every
// copy's shared and global addresses are the row's first plus constants
// (the swizzle XORs a chunk's low three bits with the row % 8, which the
// steps keep). `src` is the row's chunk `slot` in the cache, `dst` its
// place in the tile.
template <int CHUNKS, int WIDTH, typename E>
__device__ __forceinline__ void wide_row_copy(char* dst, const E* src, const E* fallback, int slot, bool row_ok) {
    static_assert(sizeof(E) == 2 && CHUNKS % 8 == 0, "16-bit rows of whole 128-byte segments");
    #pragma unroll
    for (int k = 0; k < CHUNKS / 8; ++k) {
        const bool valid = row_ok && (slot + 8 * k) * 8 < WIDTH;
        cp_async_16(dst + 128 * k, valid ? src + 64 * k : fallback, valid ? 16 : 0);
    }
}

// Whether a tile of 16-bit rows of CHUNKS chunks, `copies` copies a thread,
// takes wide_row_copy.
template <typename E>
__host__ __device__ constexpr bool wide_rows(int chunks, int copies) {
    return sizeof(E) == 2 && chunks % 8 == 0 && copies > 16;
}

// Copies cache rows [first, first + ROWS) x cols [0, COLS) into a swizzled
// shared tile (tile_byte), rows past `rows` (and cols past WIDTH)
// zero-filled; COLS and WIDTH count elements of E. Each thread copies
// 16-byte chunks; consecutive threads take consecutive chunks of a row, so a
// warp's copies are coalesced.
template <int ROWS, int COLS, int WIDTH, int THREADS, typename E>
__device__ __forceinline__ void load_kv_tile(void* tile, const KvRows<E>& kv, int first, int rows, bool vector) {
    constexpr int CHUNK = 16 / sizeof(E);  // elements per 16-byte copy
    constexpr int CHUNKS = COLS / CHUNK;
    constexpr int COPIES = (ROWS * CHUNKS + THREADS - 1) / THREADS;
    char* bytes = (char*)tile;
    if constexpr (wide_rows<E>(CHUNKS, COPIES) && ROWS % (THREADS / 8) == 0) {
        if (WIDTH % CHUNK == 0 && vector) {
            const int slot = threadIdx.x % 8;
            #pragma unroll
            for (int m = 0; m < ROWS / (THREADS / 8); ++m) {
                const int r = threadIdx.x / 8 + m * (THREADS / 8);
                const E* src = kv.row(first + (r < rows ? r : 0)) + slot * CHUNK;
                wide_row_copy<CHUNKS, WIDTH>(bytes + tile_byte<E, COLS>(r, slot * CHUNK), src, kv.base, slot, r < rows);
            }
            return;
        }
    }
    if (WIDTH % CHUNK == 0 && vector) {
        #pragma unroll(unrolled_copies(COPIES))
        for (int j = 0; j < COPIES; ++j) {
            const int i = threadIdx.x + j * THREADS;
            if ((ROWS * CHUNKS) % THREADS == 0 || i < ROWS * CHUNKS) {
                const int r = i / CHUNKS, c = (i % CHUNKS) * CHUNK;
                const bool valid = r < rows && c < WIDTH;
                cp_async_16(bytes + tile_byte<E, COLS>(r, c), valid ? kv.row(first + r) + c : kv.base, valid ? 16 : 0);
            }
        }
    } else {
        for (int i = threadIdx.x; i < ROWS * COLS; i += THREADS) {
            const int r = i / COLS, c = i % COLS;
            *(E*)(bytes + tile_byte<E, COLS>(r, c)) = r < rows && c < WIDTH ? kv.row(first + r)[c] : (E)0;
        }
    }
}

// Where one thread's copies of a chunk column land in a swizzled tile of
// COLS elements of E a row (tile_byte), the copies visiting rows `row`,
// `row` + STEP, ...: PERIOD offsets plus compile-time constants, since the
// swizzle repeats every 8 rows. Resolved once per CTA, so a tile's copies
// cost no shared-address arithmetic.
template <int STEP, int COLS, typename E>
struct ColumnSlots {
    static constexpr int PERIOD = STEP % 8 == 0 ? 1 : STEP % 4 == 0 ? 2 : STEP % 2 == 0 ? 4 : 8;
    unsigned first[PERIOD];  // byte offsets of the first PERIOD copies
    __device__ __forceinline__ ColumnSlots(int row, int col) {
        #pragma unroll
        for (int p = 0; p < PERIOD; ++p) first[p] = tile_byte<E, COLS>(row + p * STEP, col);
    }
    // Copy j's byte offset (j a compile-time constant in unrolled loops).
    __device__ __forceinline__ unsigned at(int j) const {
        return first[j % PERIOD] + j / PERIOD * (PERIOD * STEP * COLS * (int)sizeof(E));
    }
};

// A planned tile copy's stream of COPIES 16-byte copies: copy j takes the
// address source(j) hands it (called once per j, in order) to slots.at(j).
// Unless `whole`, copy j's tile row is row + j * STEP, and rows at or past
// `rows` (or every row, where !col_ok) are zero-filled from `zeros`.
template <int COPIES, int STEP, class Slots, class Source>
__device__ __forceinline__ void planned_copies(unsigned base, const Slots& slots, Source source, bool whole, int row,
                                               int rows, bool col_ok, const void* zeros) {
    if (whole) {
        #pragma unroll
        for (int j = 0; j < COPIES; ++j) cp_async_16(base + slots.at(j), source(j), 16);
    } else {
        #pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            const void* src = source(j);
            const bool valid = col_ok && row + j * STEP < rows;
            cp_async_16(base + slots.at(j), valid ? src : zeros, valid ? 16 : 0);
        }
    }
}

// One operand's K/V tile copies with this thread's share resolved once per
// CTA. A tile is a stream of 16-byte copies, and decode issues little else
// per byte, so a copy's address arithmetic is what it costs: thread t copies
// chunk column `col` of tile rows `row`, `row` + STEP, ... (STEP = THREADS /
// CHUNKS), so its global addresses are one pointer per tile advanced by a
// constant stride and its shared ones ColumnSlots'. Only a sequence's last
// tile tests rows. Tiles the plan does not divide evenly (padded head dims,
// MLA's wide rows) and unaligned caches take load_kv_tile's general copy.
template <int ROWS, int COLS, int WIDTH, int THREADS, typename E>
struct KvTileCopy {
    static constexpr int CHUNK = 16 / sizeof(E), CHUNKS = COLS / CHUNK;
    static constexpr int STEP = CHUNKS > 0 && THREADS % CHUNKS == 0 ? THREADS / CHUNKS : 1;
    using Slots = ColumnSlots<STEP, COLS, E>;
    static constexpr bool PLANNED = THREADS % CHUNKS == 0 && COLS % CHUNK == 0 && WIDTH % CHUNK == 0 &&
                                    ROWS % (STEP * Slots::PERIOD) == 0 && ROWS / STEP <= 16;

    KvRows<E> kv;
    bool vector;  // every row allows 16-byte copies
    int row, col;  // this thread's first tile row and its column (elements)
    Slots slots;

    __device__ __forceinline__ KvTileCopy(const KvRows<E>& rows, bool vector_rows)
        : kv(rows), vector(vector_rows), row(threadIdx.x / CHUNKS), col(threadIdx.x % CHUNKS * CHUNK),
          slots(row, col) {}

    // Cache rows [first, first + ROWS) into `tile`, rows past `rows` zeroed.
    __device__ __forceinline__ void operator()(void* tile, int first, int rows) const {
        if constexpr (PLANNED) {
            if (vector) {
                const E* from = kv.row(first + row) + col;
                const long long stride = STEP * kv.seq_stride;
                auto source = [&](int) {
                    const E* at = from;
                    from += stride;
                    return at;
                };
                const bool whole = rows >= ROWS && col < WIDTH;
                planned_copies<ROWS / STEP, STEP>(smem_addr(tile), slots, source, whole, row, rows, col < WIDTH, kv.base);
                return;
            }
        }
        load_kv_tile<ROWS, COLS, WIDTH, THREADS>(tile, kv, first, rows, vector);
    }
};

template <int ROWS, int COLS, int WIDTH, int THREADS, typename E>
__device__ __forceinline__ KvTileCopy<ROWS, COLS, WIDTH, THREADS, E> kv_tile_copy(const KvRows<E>& kv, bool vector) {
    return KvTileCopy<ROWS, COLS, WIDTH, THREADS, E>(kv, vector);
}

// The Q column a tile column holds in load_q_rows' INTERLEAVED order.
__device__ __forceinline__ int q_column(int col) {
    const int pair = col % 16 / 2;
    return col / 16 * 16 + (pair < 4 ? 4 * pair : 4 * (pair - 4) + 2) + col % 2;
}

// Where a decode CTA's query rows live: tile row r is the group's query row
// `first + r`, query token (first + r) / group of head (first + r) % group
// counted from `q_group` (the group's first head of the sequence); rows at
// or past `rows` are zero.
struct QRows {
    const unsigned short* q_group;
    long long seq_stride, head_stride;
    int group, first, rows;
    __device__ __forceinline__ long long at(int row, int c) const {
        return (long long)(row / group) * seq_stride + (long long)(row % group) * head_stride + c;
    }
};

// Tile chunk i (8 columns) of the Q tile of COLS columns, WIDTH of them Q's:
// one 16-byte load where every row allows it (`vector`), else 8 scalar
// ones. INTERLEAVED (e4m3 caches, see e4m3_key_fragment) holds each
// 16-column step's columns in the order its K fragments hold the keys'
// dims: tile column pairs 0-3 take Q's column pairs 0, 2, 4, 6 and pairs
// 4-7 take 1, 3, 5, 7 (q_column).
template <int COLS, int WIDTH, bool INTERLEAVED>
__device__ __forceinline__ uint4 q_chunk(const QRows& q, bool vector, int i) {
    const int r = i / (COLS / 8), c = i % (COLS / 8) * 8, row = q.first + r;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (row >= q.rows) return x;
    if (vector && INTERLEAVED) {
        // Tile chunk c / 8 of a 16-column step: column pairs half, half + 2
        // of Q's first chunk, then of its second.
        const int step = c / 16 * 16, half = c / 8 % 2;
        uint4 lo = x, hi = x;
        if (step < WIDTH) lo = *(const uint4*)(q.q_group + q.at(row, step));
        if (step + 8 < WIDTH) hi = *(const uint4*)(q.q_group + q.at(row, step + 8));
        return half == 0 ? make_uint4(lo.x, lo.z, hi.x, hi.z) : make_uint4(lo.y, lo.w, hi.y, hi.w);
    }
    if (vector) return c < WIDTH ? *(const uint4*)(q.q_group + q.at(row, c)) : x;
    unsigned short e[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = INTERLEAVED ? q_column(c + j) : c + j;
        e[j] = col < WIDTH ? q.q_group[q.at(row, col)] : (unsigned short)0;
    }
    return make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
}

// Whether every chunk of Q's rows is one aligned 16-byte load.
template <int WIDTH>
__device__ __forceinline__ bool q_vector(const QRows& q) {
    return WIDTH % 8 == 0 && aligned16(q.q_group, q.seq_stride) && q.head_stride % 8 == 0;
}

// The Q tile of a decode CTA, ROWS x COLS, swizzled; published by the tile
// loop's first barrier. The prologue's cost is per CTA, and a short split
// has few tiles to hide it: 16-byte loads where the rows allow them.
template <int ROWS, int COLS, int WIDTH, int THREADS, bool INTERLEAVED = false>
__device__ __forceinline__ void load_q_rows(unsigned short* tile, const QRows& q) {
    const bool vector = q_vector<WIDTH>(q);
    for (int i = threadIdx.x; i < ROWS * COLS / 8; i += THREADS) {
        *(uint4*)(tile + swizzle<COLS>(i / (COLS / 8), i % (COLS / 8) * 8)) = q_chunk<COLS, WIDTH, INTERLEAVED>(q, vector, i);
    }
}

// Reduces x over the 32 lanes of a warp with `op` (max, +).
template <typename Op>
__device__ __forceinline__ float warp_all(float x, Op op) {
    #pragma unroll
    for (int m = 16; m > 0; m /= 2) x = op(x, __shfl_xor_sync(0xffffffffu, x, m));
    return x;
}

// Split-KV: whether this CTA is the last of its row tile's `num_splits` to
// finish (every thread gets the answer, through `flag` in shared memory).
// Each CTA's partial stores are ordered before its count by the fence; the
// last one reads them through L2 (__ldcg) and sets the count back to 0 for
// the next launch, so a CUDA graph replays without resetting it.
__device__ __forceinline__ bool last_split(unsigned int* counter, int num_splits, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        *flag = atomicAdd(counter, 1u) == (unsigned int)num_splits - 1u;
        if (*flag) atomicExch(counter, 0u);
    }
    __syncthreads();
    const bool last = *flag;
    if (last) __threadfence();
    return last;
}
