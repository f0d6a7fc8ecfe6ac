//! The decode kernel's body up to its epilogue: which rows, keys and split
//! the CTA owns, the Q rows, the K/V pipeline and the tile step (S = Q·Kᵀ,
//! the spec, the online softmax, O += P·V on `mma.sync`).

use super::logit::write_logit;
use super::queries::DecodeQueries;
use super::tiles::write_tile_kept;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// The CTA's coordinates, its split of the keys, the K/V row addressing
/// and the prologue: Q, then `STAGES - 1` K/V tiles in flight.
pub(super) fn write_setup(
    w: &mut Writer<String>,
    spec: &Spec,
    cache: DecodeCache,
    queries: DecodeQueries,
) -> fmt::Result {
    write_coordinates(w, spec, cache, queries)?;
    write_tile_kept(w, spec)?;
    write_prologue(w, cache, queries)
}

/// Where the kernel's K/V rows live: the one thing a paged decode kernel
/// prints differently (its lengths, row addressing and tile copies).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeCache {
    /// `[batch, max_kv_len, heads_kv, d]`, rows through `KvRows`.
    Dense,
    /// Pages through a block table, rows through `PagedKvRows`.
    Paged,
}

/// Which rows, keys and split the CTA owns, and how it addresses the cache.
fn write_coordinates(w: &mut Writer<String>, spec: &Spec, cache: DecodeCache, queries: DecodeQueries) -> fmt::Result {
    w.write_str(
        "\
extern __shared__ __align__(128) unsigned short smem[];
unsigned short* q_tile = smem;
unsigned short* k_tiles = q_tile + Q_TILE;  // [STAGES][K_TILE]
unsigned short* v_tiles = k_tiles + STAGES * K_TILE;  // [STAGES][V_TILE]

// The CTA: split `split` of sequence b's keys under K/V head kv_head, for
// query rows [row0, row0 + BLOCK_M) of the heads sharing that K/V head.
// Rows are token-major: row = query token * group + head within the group,
// so one K/V byte serves every query head of its group.
const int b = blockIdx.z;
const int kv_head = blockIdx.y;
const int split = blockIdx.x % num_splits;
const int row0 = blockIdx.x / num_splits * BLOCK_M;
const int group = heads / heads_kv;  // query heads per K/V head
",
    )?;
    w.write_str(&queries.sequence(spec))?;
    w.write_str(
        "\
const int rows = group * q_len;
if (row0 >= rows) return;
const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair
",
    )?;
    w.write_str(match cache {
        DecodeCache::Dense => {
            "\
const int kv_len = cache_len(kv_lens, b, max_kv_len);
const int kv_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;
const KvRows k_rows{k_ptr + b * k_batch_stride + kv_head * k_head_stride, k_seq_stride};
const KvRows v_rows{v_ptr + b * v_batch_stride + kv_head * v_head_stride, v_seq_stride};
"
        }
        DecodeCache::Paged => {
            "\
// Sequence b's keys are in the pages its row of the block table names.
const int kv_len = paged_kv_len(kv_lens, b, pages_per_seq, page_size, num_pages, max_kv_len);
const int kv_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;
const PageTable table{block_table + (long long)b * pages_per_seq, page_size, num_pages};
const PagedKvRows k_rows{k_ptr + kv_head * k_head_stride, k_page_stride, k_seq_stride};
const PagedKvRows v_rows{v_ptr + kv_head * v_head_stride, v_page_stride, v_seq_stride};
"
        }
    })?;
    w.write_str("const bool k_vector = k_rows.vector(), v_vector = v_rows.vector();\n")
}

/// This split's tiles, the K/V loads, then the prologue: Q, and
/// `STAGES - 1` tiles in flight.
fn write_prologue(w: &mut Writer<String>, cache: DecodeCache, queries: DecodeQueries) -> fmt::Result {
    w.write_str(
        "\
// This split's K/V tiles: an even share of the band of tiles the mask may
// keep (an empty share still stores its rows: no keys, LSE -inf).
const int per_split = (band_end - band_begin + num_splits - 1) / num_splits;
const int tile_begin = min(band_begin + split * per_split, band_end);
const int tile_end = min(tile_begin + per_split, band_end);
auto load_kv = [&](int j, int stage) {
    if (!tile_kept(j)) return;
    const int first = j * BLOCK_N;
",
    )?;
    w.write_str(match cache {
        DecodeCache::Dense => {
            "    \
    load_kv_tile<BLOCK_N, DP, D, THREADS>(k_tiles + stage * K_TILE, k_rows, first, kv_len - first, k_vector);
    load_kv_tile<BLOCK_N, DVP, DV, THREADS>(v_tiles + stage * V_TILE, v_rows, first, kv_len - first, v_vector);
"
        }
        DecodeCache::Paged => {
            "    \
    // One key of the warp's share per lane, resolved once for K and V.
    const PageSlot slot = tile_slot<BLOCK_N, WARPS>(table, first, kv_len - first);
    load_paged_kv_tile<BLOCK_N, DP, D, WARPS>(k_tiles + stage * K_TILE, k_rows, slot, kv_len - first, k_vector);
    load_paged_kv_tile<BLOCK_N, DVP, DV, WARPS>(v_tiles + stage * V_TILE, v_rows, slot, kv_len - first, v_vector);
"
        }
    })?;
    w.write_str(
        "\
};

// Prologue: the Q rows (plain loads, once), then STAGES - 1 K/V tiles in
// flight, one cp.async group each (empty groups past the split's end keep
// the count the waits rely on).
const unsigned short* q_group = ",
    )?;
    w.write_str(queries.q_rows())?;
    w.write_str(
        " + (long long)kv_head * group * q_head_stride;
load_q_rows<BLOCK_M, DP, D, THREADS>(q_tile, q_group, q_seq_stride, q_head_stride, group, row0, rows);
#pragma unroll
for (int s = 0; s < STAGES - 1; ++s) {
    if (tile_begin + s < tile_end) load_kv(tile_begin + s, s);
    cp_async_commit();
}

// The spec's h and q of this lane's rows (a row past the group's end
// repeats the last one: computed, never stored).
int row_h[2 * M_TILES], row_q[2 * M_TILES];
#pragma unroll
for (int i = 0; i < 2 * M_TILES; ++i) {
    const int row = min(row0 + i / 2 * 16 + g + 8 * (i % 2), rows - 1);
    row_q[i] = row / group;
    row_h[i] = kv_head * group + row % group;
}
",
    )
}

/// The accumulators, the spec's logit and the loop over the split's tiles.
pub(super) fn write_tile_loop(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    writeln!(w)?;
    write_logit(w, spec)?;
    w.write_str(
        "
// Each warp owns every row and a quarter of each tile's keys (WARP_N), with
// its own max, sum and O; the epilogue merges the four.
float o[M_TILES][O_TILES][4] = {};
float m[M_TILES][2], l[M_TILES][2];
#pragma unroll
for (int mt = 0; mt < M_TILES; ++mt) {
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.0f;
}
// ldmatrix rows of this lane in the Q, K and V tiles (see LdmLane).
const LdmLane<DP> q_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
const LdmLane<DP> k_lane(lane % 8 + lane / 16 * 8, lane / 8 % 2);
const LdmLane<DVP> v_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
const unsigned q_smem = smem_addr(q_tile);
const int kw = warp * WARP_N;  // this warp's first key in each tile

for (int j = tile_begin; j < tile_end; ++j) {
    // Tile j has landed once at most STAGES - 2 later groups are pending;
    // the barrier publishes it and frees the stage tile j - 1 used, which
    // then takes tile j + STAGES - 1.
    cp_async_wait_group<STAGES - 2>();
    __syncthreads();
    if (j + STAGES - 1 < tile_end) load_kv(j + STAGES - 1, (j - tile_begin + STAGES - 1) % STAGES);
    cp_async_commit();
    if (!tile_kept(j)) continue;
    const int stage = (j - tile_begin) % STAGES;
    const unsigned k_smem = smem_addr(k_tiles + stage * K_TILE);
    const unsigned v_smem = smem_addr(v_tiles + stage * V_TILE);
    const int kv0 = j * BLOCK_N + kw;

    // S = Q K^T on every row x this warp's keys.
    float s[M_TILES][S_TILES][4] = {};
    #pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        unsigned a[M_TILES][4];
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(a[mt], q_smem + q_lane.at(mt * 16, kk));
        #pragma unroll
        for (int n = 0; n < S_TILES; n += 2) {
            unsigned kb[4];
            ldmatrix_x4(kb, k_smem + k_lane.at(kw + n * 8, kk));
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(storage{}, s[mt][n], a[mt], kb[0], kb[1]);
                mma_16816(storage{}, s[mt][n + 1], a[mt], kb[2], kb[3]);
            }
        }
    }

    // The spec, then the online softmax (base 2), row by row; a row's O and
    // l are rescaled whenever its max grows (while every key so far is
    // masked, m is -inf and exp2 runs against 0: finite_or_zero).
    #pragma unroll
    for (int i = 0; i < 2 * M_TILES; ++i) {
        const int mt = i / 2, r = i % 2;
        #pragma unroll
        for (int n = 0; n < S_TILES; ++n) {
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                float& x = s[mt][n][2 * r + c];
                x = logit(x, row_h[i], row_q[i], kv0 + n * 8 + 2 * t + c);
            }
        }
        const float m_new = fmaxf(m[mt][r], quad_max(row_max(s[mt], r)));
        if (m_new > m[mt][r]) {
            const float alpha = fast_exp2(m[mt][r] - m_new);
            m[mt][r] = m_new;
            l[mt][r] *= alpha;
            #pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                o[mt][n][2 * r] *= alpha;
                o[mt][n][2 * r + 1] *= alpha;
            }
        }
        const float m_use = finite_or_zero(m[mt][r]);
        #pragma unroll
        for (int n = 0; n < S_TILES; ++n) {
            #pragma unroll
            for (int c = 0; c < 2; ++c) {
                float& x = s[mt][n][2 * r + c];
                x = fast_exp2(x - m_use);
            }
        }
        l[mt][r] += row_sum(s[mt], r);
    }

    // O += P V, P straight from the S registers (pack_p).
    #pragma unroll
    for (int kk = 0; kk < WARP_N / 16; ++kk) {
        unsigned p[M_TILES][4];
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) pack_p(storage{}, p[mt], s[mt], kk);
        #pragma unroll
        for (int n = 0; n < O_TILES; n += 2) {
            unsigned vb[4];
            ldmatrix_x4_trans(vb, v_smem + v_lane.at(kw + kk * 16, n / 2));
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(storage{}, o[mt][n], p[mt], vb[0], vb[1]);
                mma_16816(storage{}, o[mt][n + 1], p[mt], vb[2], vb[3]);
            }
        }
    }
}
cp_async_wait_all();
__syncthreads();  // every warp is done with the stages: the epilogue reuses them
",
    )
}
