//! The decode kernel's body up to its epilogue: which rows, keys and split
//! the CTA owns, the Q rows, the K/V pipeline and the tile step (S = Q·Kᵀ,
//! the spec, the online softmax, O += P·V on `mma.sync`).

use super::columns;
use super::logit::write_logit;
use super::plan::{DecodeCache, DecodeConfig, KvCacheDtype, WarpSplit};
use super::queries::DecodeQueries;
use super::tiles::write_tile_kept;
use crate::cuda::writer::Writer;
use crate::spec::{Dtype, Spec};
use std::fmt::{self, Write};

/// The CTA's coordinates, its split of the keys, the K/V row addressing
/// and the prologue: Q, then `STAGES - 1` K/V tiles in flight.
pub(super) fn write_setup(
    w: &mut Writer<String>,
    spec: &Spec,
    cache: DecodeCache,
    queries: DecodeQueries,
    config: DecodeConfig,
) -> fmt::Result {
    write_coordinates(w, spec, cache, queries)?;
    if config.warps == WarpSplit::Columns {
        w.write_str(SHARED_P)?;
    }
    if config.kv == KvCacheDtype::E4m3 {
        w.write_str(E4M3_DESCALES)?;
    }
    write_tile_kept(w, spec)?;
    write_prologue(w, spec, cache, queries, config)
}

/// Where warps split O's columns: the tile's P and the warps' row maxima,
/// past the stages and what the epilogue reuses of them.
const SHARED_P: &str = "\
// Warps split O's columns: the tile's P [BLOCK_M][BLOCK_N] and each warp's
// row maxima [WARPS][BLOCK_M] live past the scratch (stages, merge, combine).
unsigned short* p_tile = k_tiles + SCRATCH_BYTES / 2;
float* p_max = (float*)(p_tile + BLOCK_M * BLOCK_N);
";

/// An e4m3 kernel's V descale, folded where it costs nothing per element:
/// into the rows' final normalization (the epilogue). K's goes into the
/// softmax scale once Q is in f16 ([`E4M3_Q_BF16`], [`E4M3_Q_F16`]).
const E4M3_DESCALES: &str = "\
// The e4m3 cache's V head descale: each row's final 1 / sum takes it.
const float v_scale = v_descale[kv_head * v_descale_stride];
";

/// A bf16 e4m3 kernel's Q tile: to f16 for the f16 MMAs as it is loaded,
/// scaled by a power of two the softmax scale undoes, with K's descale.
const E4M3_Q_BF16: &str = "\
// The MMAs run on f16 (e4m3 converts to it in one instruction): Q's tile in
// f16, in the order of K's e4m3 fragments, scaled by a power of two that the
// logit's scale undoes with K's descale (q k = dk 2^-shift (2^shift q) k8).
const float qk_scale = scale * k_descale[kv_head * k_descale_stride] *
                       load_q_rows_to_f16<BLOCK_M, DP, D, THREADS>(q_tile, q_rows);
";

/// An f16 e4m3 kernel's Q tile and logit scale: K's descale (Q is f16
/// already).
const E4M3_Q_F16: &str = "\
// Q's columns in the order of K's e4m3 fragments; K's descale goes into the
// logit's scale: q k = dk (q k8).
load_q_rows<BLOCK_M, DP, D, THREADS, true>(q_tile, q_rows);
const float qk_scale = scale * k_descale[kv_head * k_descale_stride];
";

/// Which rows, keys and split the CTA owns, and how it addresses the cache.
fn write_coordinates(w: &mut Writer<String>, spec: &Spec, cache: DecodeCache, queries: DecodeQueries) -> fmt::Result {
    w.write_str(
        "\
extern __shared__ __align__(128) unsigned short smem[];
unsigned short* q_tile = smem;
unsigned short* k_tiles = q_tile + Q_TILE;  // [STAGES][K_TILE]
unsigned short* v_tiles = V_IN_K ? k_tiles : k_tiles + STAGES * K_TILE;  // [STAGES][V_TILE]

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
fn write_prologue(
    w: &mut Writer<String>,
    spec: &Spec,
    cache: DecodeCache,
    queries: DecodeQueries,
    config: DecodeConfig,
) -> fmt::Result {
    w.write_str(
        "\
// This split's K/V tiles: an even share of the band of tiles the mask may
// keep (an empty share still stores its rows: no keys, LSE -inf).
const int per_split = (band_end - band_begin + num_splits - 1) / num_splits;
const int tile_begin = min(band_begin + split * per_split, band_end);
const int tile_end = min(tile_begin + per_split, band_end);
",
    )?;
    write_kv_copies(w, cache, config)?;
    w.write_str(
        "\
// Prologue: STAGES - 1 K/V tiles in flight, one cp.async group each (empty
// groups past the split's end keep the count the waits rely on), then the Q
// rows (plain loads, once) while those are in flight.
#pragma unroll
for (int s = 0; s < STAGES - 1; ++s) {
    if (tile_begin + s < tile_end) load_kv(tile_begin + s, s);
    cp_async_commit();
}
const QRows q_rows{",
    )?;
    w.write_str(queries.q_rows())?;
    w.write_str(" + (long long)kv_head * group * q_head_stride, q_seq_stride, q_head_stride, group, row0, rows};\n")?;
    w.write_str(match (config.kv, spec.dtype) {
        (KvCacheDtype::Spec, _) => "load_q_rows<BLOCK_M, DP, D, THREADS>(q_tile, q_rows);\n",
        (KvCacheDtype::E4m3, Dtype::Bf16) => E4M3_Q_BF16,
        (KvCacheDtype::E4m3, Dtype::F16) => E4M3_Q_F16,
    })?;
    w.write_str(
        "
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

/// This thread's share of every K and V tile (resolved once) and `load_kv`,
/// which copies tile `j` into a stage.
fn write_kv_copies(w: &mut Writer<String>, cache: DecodeCache, config: DecodeConfig) -> fmt::Result {
    let (copy, by) = match cache {
        DecodeCache::Dense => ("kv_tile_copy", "THREADS"),
        DecodeCache::Paged => ("paged_tile_copy", "WARPS"),
    };
    w.write_str("// This thread's share of every K and V tile, resolved once.\n")?;
    writeln!(w, "const auto copy_k = {copy}<BLOCK_N, DP, D, {by}>(k_rows, k_vector);")?;
    if !config.v_in_k {
        writeln!(w, "const auto copy_v = {copy}<BLOCK_N, DVP, DV, {by}>(v_rows, v_vector);")?;
    }
    w.write_str(
        "\
auto load_kv = [&](int j, int stage) {
    if (!tile_kept(j)) return;
    const int first = j * BLOCK_N;
",
    )?;
    let (k_load, v_load) = match cache {
        DecodeCache::Dense => (
            "    copy_k(k_tiles + stage * K_TILE, first, kv_len - first);\n",
            "    copy_v(v_tiles + stage * V_TILE, first, kv_len - first);\n",
        ),
        DecodeCache::Paged => (
            "    \
    // One key of the warp's share per lane, resolved once for K and V.
    const PageSlot slot = tile_slot<BLOCK_N, WARPS>(table, first, kv_len - first);
    copy_k(k_tiles + stage * K_TILE, slot, kv_len - first);
",
            "    copy_v(v_tiles + stage * V_TILE, slot, kv_len - first);\n",
        ),
    };
    w.write_str(k_load)?;
    w.write_str(if config.v_in_k { "    // V is K's first DV columns: K's copy brought them.\n" } else { v_load })?;
    w.write_str("};\n\n")
}

/// The accumulators, the spec's logit and the loop over the split's tiles.
pub(super) fn write_tile_loop(w: &mut Writer<String>, spec: &Spec, config: DecodeConfig) -> fmt::Result {
    let kv = config.kv;
    let by_format = |spec: &'static str, e4m3: &'static str| if kv == KvCacheDtype::E4m3 { e4m3 } else { spec };
    let split_columns = config.warps == WarpSplit::Columns;
    writeln!(w)?;
    write_logit(w, spec, by_format("scale", "qk_scale"))?;
    w.write_str(ACCUMULATORS)?;
    w.write_str(by_format(SPEC_LANES, E4M3_LANES))?;
    if split_columns {
        w.write_str(columns::P_LANE)?;
    }
    w.write_str(LOOP_HEAD)?;
    w.write_str(by_format(
        "    // S = Q K^T on every row x this warp's keys.\n",
        "    // S = Q K^T on every row x this warp's keys, K's e4m3 converted on\n    \
         // registers; one 16-byte chunk of a key row is a whole k-step.\n",
    ))?;
    if split_columns {
        w.write_str(columns::SCORES)?;
    } else {
        w.write_str(SCORES_LOOP)?;
        w.write_str(by_format(SPEC_SCORES, E4M3_SCORES))?;
    }
    w.write_str(SOFTMAX_LOGITS)?;
    if split_columns {
        w.write_str(columns::TILE_MAX)?;
    } else {
        w.write_str("        const float m_new = fmaxf(m[mt][r], quad_max(row_max(s[mt], r)));\n")?;
    }
    w.write_str(SOFTMAX_RESCALE)?;
    let (p_fragment, v_at) = if split_columns {
        w.write_str(columns::SHARE_P)?;
        columns::VALUES
    } else {
        w.write_str(by_format(
            "    // O += P V, P straight from the S registers (pack_p).\n",
            "    // O += P V, P straight from the S registers (pack_p), V's e4m3 converted\n    \
             // on registers: tiles n and n + 1 take a 16-dim chunk's even and odd dims.\n",
        ))?;
        ("pack_p(operand{}, p[mt], s[mt], kk)", "v_smem + v_lane.at(kw + kk * 16, n / 2)")
    };
    w.write_str(&VALUES_LOOP.replace("@P_FRAGMENT@", p_fragment))?;
    w.write_str(&by_format(SPEC_VALUES, E4M3_VALUES).replace("@V_AT@", v_at))?;
    w.write_str(
        "}
cp_async_wait_all();
__syncthreads();  // every warp is done with the stages: the epilogue reuses them
",
    )
}

/// Each warp's O, max and sum.
const ACCUMULATORS: &str = "
// Each warp owns every row with its own max, sum and O (its WARP_DV columns),
// over its keys of each tile; the epilogue merges the four.
float o[M_TILES][O_TILES][4] = {};
float m[M_TILES][2], l[M_TILES][2];
#pragma unroll
for (int mt = 0; mt < M_TILES; ++mt) {
    m[mt][0] = m[mt][1] = neg_inf();
    l[mt][0] = l[mt][1] = 0.0f;
}
";

/// The ldmatrix rows of this lane in 16-bit Q, K and V tiles.
const SPEC_LANES: &str = "\
// ldmatrix rows of this lane in the Q, K and V tiles (see LdmLane).
const LdmLane<DP> q_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
const LdmLane<DP> k_lane(lane % 8 + lane / 16 * 8, lane / 8 % 2);
const LdmLane<V_COLS> v_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
";

/// In an e4m3 kernel: K and V tiles are 16-bit tiles of half the columns,
/// read two 8x8 matrices (a warp's 16 keys) at a time.
const E4M3_LANES: &str = "\
// ldmatrix rows of this lane in the Q tile (see LdmLane) and in the e4m3 K
// and V tiles, 16-bit tiles of half the columns: lanes 0-15 address the
// warp's 16 keys, at a tile's even or odd 16-byte chunk (k_lanes[kk % 2]).
const LdmLane<DP> q_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
const int kv_lane_row = lane % 8 + (lane / 8 % 2) * 8;
const LdmLane<DP / 2> k_lanes[2] = {LdmLane<DP / 2>(kv_lane_row, 0), LdmLane<DP / 2>(kv_lane_row, 1)};
const LdmLane<DVP / 2> v_lanes[2] = {LdmLane<DVP / 2>(kv_lane_row, 0), LdmLane<DVP / 2>(kv_lane_row, 1)};
";

/// The pipeline's wait and refill, the tile's stage and keys.
const LOOP_HEAD: &str = "\
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

";

/// S = Q·Kᵀ: the k-steps over Q's dims, each step's Q fragments; each
/// step's K fragments and MMAs by the cache's format.
const SCORES_LOOP: &str = "    float s[M_TILES][S_TILES][4] = {};
    #pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        unsigned a[M_TILES][4];
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(a[mt], q_smem + q_lane.at(mt * 16, kk));
";

/// S = Q·Kᵀ over 16-bit K: a k-step's fragments and MMAs.
const SPEC_SCORES: &str = "        #pragma unroll
        for (int n = 0; n < S_TILES; n += 2) {
            unsigned kb[4];
            ldmatrix_x4(kb, k_smem + k_lane.at(kw + n * 8, kk));
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(operand{}, s[mt][n], a[mt], kb[0], kb[1]);
                mma_16816(operand{}, s[mt][n + 1], a[mt], kb[2], kb[3]);
            }
        }
    }

";

/// S = Q·Kᵀ over e4m3 K, converted on registers (`e4m3_key_fragment`).
const E4M3_SCORES: &str = "        unsigned kb[2];  // keys kw + g and kw + 8 + g, dims 16 kk + 4t .. 4t + 3
        ldmatrix_x2(kb, k_smem + k_lanes[kk % 2].at(kw, kk / 2));
        #pragma unroll
        for (int n = 0; n < S_TILES; ++n) {
            unsigned b0, b1;
            e4m3_key_fragment(kb[n], b0, b1);
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) mma_16816(operand{}, s[mt][n], a[mt], b0, b1);
        }
    }

";

/// The spec on S, opening the softmax's loop over the lane's rows; the
/// row's new max follows (`m_new`), then [`SOFTMAX_RESCALE`].
const SOFTMAX_LOGITS: &str = "    // The spec, then the online softmax (base 2), row by row; a row's O and
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
";

/// The online softmax from the row's new max `m_new`: O and l rescaled, S
/// turned into P, l summed; closes the loop over the rows.
const SOFTMAX_RESCALE: &str = "        if (m_new > m[mt][r]) {
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

";

/// O += P·V: P's k-steps and O's pairs of tiles, each pair's V fragments
/// and MMAs by the cache's format.
const VALUES_LOOP: &str = "    #pragma unroll
    for (int kk = 0; kk < PV_KEYS / 16; ++kk) {
        unsigned p[M_TILES][4];
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) @P_FRAGMENT@;
        #pragma unroll
        for (int n = 0; n < O_TILES; n += 2) {
";

/// O += P·V over 16-bit V: each pair's fragments and MMAs.
const SPEC_VALUES: &str = "            unsigned vb[4];
            ldmatrix_x4_trans(vb, @V_AT@);
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(operand{}, o[mt][n], p[mt], vb[0], vb[1]);
                mma_16816(operand{}, o[mt][n + 1], p[mt], vb[2], vb[3]);
            }
        }
    }
";

/// O += P·V over e4m3 V, converted on registers (`e4m3_value_fragment`):
/// O's columns come out in `e4m3_o_column`'s order.
const E4M3_VALUES: &str = "            unsigned vb[2], even[2], odd[2];  // keys 2t, 2t + 1, then 2t + 8, 2t + 9
            ldmatrix_x2_trans(vb, v_smem + v_lanes[n / 2 % 2].at(kw + kk * 16, n / 4));
            e4m3_value_fragment(vb[0], even[0], odd[0]);
            e4m3_value_fragment(vb[1], even[1], odd[1]);
            #pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
                mma_16816(operand{}, o[mt][n], p[mt], even[0], even[1]);
                mma_16816(operand{}, o[mt][n + 1], p[mt], odd[0], odd[1]);
            }
        }
    }
";
