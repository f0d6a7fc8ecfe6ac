//! The decode kernel: 1 to a few new query tokens per sequence against a
//! long KV cache, memory-bound, so built to read each K/V byte once at copy
//! bandwidth (issue 37). Any spec: its logit comes from the kit.
//!
//! - **GQA packing.** A CTA owns one K/V head of one sequence and, as the
//!   rows of its tile, every query token of every query head sharing that
//!   K/V head (`heads / heads_kv × q_len` rows, token-major, 16 or 32 per
//!   tile: `plan::DecodeConfig`), so K and V stream once per K/V head.
//! - **Warps split keys, not rows.** With 16 rows there is one MMA row
//!   tile; each of the four warps takes 16 keys of every 64-key tile
//!   (one k-step of P·V) with its own max, sum and O, merged once in the
//!   epilogue through shared memory.
//! - **Pipeline.** K/V tiles stream through `STAGES` (3–4) shared-memory
//!   stages by `cp.async` in 16-byte coalesced copies, `STAGES − 1` tiles in
//!   flight; every cache address comes from `KvRows` (`library/decode.cuh`)
//!   or, in a paged kernel, `PagedKvRows` (`library/decode_paged.cuh`).
//! - **Paged caches** (`emit_decode_paged`). The same kernel, its K/V rows
//!   read through a block table: each warp copies a fixed share of every
//!   tile's keys, each lane resolves one key of that share per tile (a
//!   division and a table read, clamped as the paged forward's), and the
//!   lanes copying the key's chunks take its page by shuffle; lengths are
//!   clamped as `library/paged.cuh` clamps them. Everything past the copies
//!   is the dense kernel's (`body::Cache` is the one difference).
//! - **Split-KV (Flash-Decoding).** Where batch × K/V heads CTAs cannot fill
//!   the GPU, `num_splits` CTAs share a sequence's keys, each writing its
//!   rows (f32, normalized) and LSE to a workspace; the last of them to
//!   finish weighs them into O (`combine`), so a step is one launch. With
//!   one split the kernel writes O itself. The split count is an argument:
//!   `plan::split_count` picks it.
//! - **Positions.** As in the forward: the spec's `q` is the query's index
//!   among the sequence's `q_len` new tokens, `k` the cache row, `kv_len`
//!   the sequence's key count (read on the device, clamped into the cache),
//!   so a decode step computes exactly what the forward computes on the
//!   same Q and keys; bottom-right alignment is the spec's to state
//!   (`q + kv_len - q_len >= k`, `specs/causal_bottom_right.attn`).
//!   Tensors' `KV_LEN` dims are the cache's rows, `Q_LEN` dims `q_len`.
//!
//! - **Packed queries** (`emit_decode_with`, [`DecodeQueries::Packed`]).
//!   Q and O hold every sequence's tokens back to back, split by
//!   `cu_seqlens_q` (read on the device, clamped by `seq_span` into the
//!   buffer and to the plan's `max_q_len`); a CTA binds its sequence's own
//!   count to `q_len`, so its rows (`group × q_len`), mask and logit are the
//!   padded kernel's, and row tiles past them return at once (all splits
//!   of a tile alike, so the split counters stay balanced). `queries`.
//!
//! - **Tiles the mask drops** (interval analysis over the CTA's tokens,
//!   `tiles`) are neither loaded nor multiplied: a window reads the window.
//!
//! - **E4m3 caches** ([`KvCacheDtype::E4m3`]: `library/decode_e4m3.cuh`).
//!   K/V tiles are copied as they are, a byte an element (half the bytes a
//!   step waits on; twice the stages fit), and converted to f16 on
//!   registers right after each ldmatrix: every element once (a warp owns
//!   its keys), no second pass through shared memory, and the conversion is
//!   exact (e4m3 ⊂ f16; one `cvt.rn.f16x2.e4m3x2` a pair on sm_89+, where
//!   bf16 would take five instructions). The MMAs run on f16 whatever the
//!   spec's dtype: a bf16 Q tile is converted as it is loaded, scaled by a
//!   power of two that the softmax scale undoes (`load_q_rows_to_f16`), and P
//!   is packed to f16. The 16-bit ldmatrix reads a byte tile as a 16-bit tile of half
//!   the columns, handing each lane K's dims in another order, which the
//!   Q tile is stored in (`load_q_rows`' INTERLEAVED: the reduction over
//!   dims is the same sum), and V's dims split over two MMAs, whose O
//!   columns the epilogue places (`e4m3_o_column`). The descales are not
//!   applied per element: with `k = dk · k8` per K/V head, `q·k = dk ·
//!   (q·k8)`, so K's factor multiplies the softmax scale (`qk_scale`, once
//!   per CTA: a CTA is one K/V head), and since `O = Σ p v = dv · Σ p v8`,
//!   V's multiplies each row's final `1 / sum`. Both are exact up to one
//!   f32 rounding of a product, cost nothing per element, and leave the
//!   scores, the LSE and the split combine as they are. The factors are
//!   read on the device (per tensor or per K/V head), so a captured step
//!   replays with new ones.
//!
//! - **MLA's head dims** (QK 576 / V 512, `columns`). Past a V head dim of
//!   256 O does not fit a warp's registers, so the warps split O's columns
//!   instead of the keys ([`WarpSplit::Columns`]): each still computes S for
//!   its quarter of a 32-key tile (K read from shared memory once), the
//!   rows' max and P go through shared memory, and each warp multiplies P
//!   by its quarter of V's columns; every K/V byte is still copied once per
//!   CTA. With [`DecodeConfig::v_in_k`] V's fragments come from K's tiles
//!   (MLA's cache: V is K's first 512 columns), so a stage holds K alone
//!   and each cache byte is read once. A row tile is 16 or 32 query rows,
//!   so 128 query heads take four CTAs per sequence, which read the cache
//!   through L2.
//!
//! Modules: `plan` (decisions), `body` (setup, pipeline, tile step),
//! `queries` (padded or packed Q, O and LSE addresses), `tiles`, `logit`,
//! `columns` (the column split's tile step), `epilogue`, `combine` (the
//! last split's).

mod body;
mod columns;
mod combine;
mod epilogue;
mod logit;
mod plan;
mod queries;
mod tiles;

pub use plan::{
    split_candidates, split_count, DecodeCache, DecodeConfig, DecodeUnfit, KvCacheDtype, SplitLaunch, WarpSplit,
    DECODE_BLOCK_N, DECODE_COLUMNS_BLOCK_N, DECODE_WARPS, MAX_SPLITS,
};
pub use queries::DecodeQueries;

use crate::abi::{Grid, Kernel, Operand};
use crate::cuda::library::Part;
use crate::cuda::signature::{decode_args, decode_paged_args, with_e4m3, with_packed_queries};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::writer::Writer;
use crate::spec::{Dtype, Spec};
use body::{write_setup, write_tile_loop};
use epilogue::write_epilogue;
use plan::COMBINE_IN_FLIGHT;
use std::fmt::{self, Write};

/// The decode kernel of `spec` in `config` over a dense cache
/// `[batch, max_kv_len, heads_kv, d]`. Deterministic, like every emitter.
pub fn emit_decode(spec: &Spec, config: DecodeConfig) -> Kernel {
    emit_decode_with(spec, config, DecodeCache::Dense, DecodeQueries::Padded)
}

/// The decode kernel of `spec` in `config` over paged caches: key `k` of
/// sequence `b` is row `k % page_size` of page `block_table[b][k /
/// page_size]` (`crate::paged`), lengths and page ids clamped.
pub fn emit_decode_paged(spec: &Spec, config: DecodeConfig) -> Kernel {
    emit_decode_with(spec, config, DecodeCache::Paged, DecodeQueries::Padded)
}

/// The decode kernel of `spec` in `config` over `cache`, its Q, O and LSE
/// laid out as `queries` says (packed: split by `cu_seqlens_q`, each
/// sequence 0 to `max_q_len` tokens).
pub fn emit_decode_with(spec: &Spec, config: DecodeConfig, cache: DecodeCache, queries: DecodeQueries) -> Kernel {
    let view = spec.varlen_view();
    let (kind, args) = match cache {
        DecodeCache::Dense => ("decode", decode_args(&view)),
        DecodeCache::Paged => ("decode_paged", decode_paged_args(&view)),
    };
    let (kind, args) = match queries {
        DecodeQueries::Padded => (kind.to_string(), args),
        DecodeQueries::Packed => (format!("{kind}_varlen"), with_packed_queries(&view, args)),
    };
    let (name, args) = match config.kv {
        KvCacheDtype::Spec => (kernel_name(&kind, spec), args),
        KvCacheDtype::E4m3 => {
            (kernel_name(&format!("{kind}_e4m3"), spec), with_e4m3(&view, args, &[Operand::K, Operand::V]))
        }
    };
    let bounds = format!("THREADS, {}", config.ctas_per_sm);
    let mut library = vec![vec![Piece::Part(Part::Prelude)]];
    if tiles::classifies(spec) {
        library.push(vec![Piece::Part(Part::Ranges)]);
    }
    library.push(vec![Piece::Part(Part::Tiles)]);
    match (cache, queries) {
        (DecodeCache::Paged, _) => library.extend([vec![Piece::Part(Part::Varlen)], vec![Piece::Part(Part::Paged)]]),
        (DecodeCache::Dense, DecodeQueries::Packed) => library.push(vec![Piece::Part(Part::Varlen)]),
        (DecodeCache::Dense, DecodeQueries::Padded) => {}
    }
    library.push(vec![Piece::Part(Part::Decode)]);
    if cache == DecodeCache::Paged {
        library.push(vec![Piece::Part(Part::DecodePaged)]);
    }
    if config.kv == KvCacheDtype::E4m3 {
        library.push(vec![Piece::Part(Part::DecodeE4m3)]);
    }
    let entry = Entry { name: &name, bounds: &bounds, args: &args };
    let source = assemble(
        &view,
        &library,
        |w| write_config(w, &view, config),
        entry,
        |w| {
            write_setup(w, &view, cache, queries, config)?;
            write_tile_loop(w, &view, config)?;
            write_epilogue(w, &view, queries, config)
        },
    );
    Kernel {
        name,
        source,
        grid: Grid::KvGroups,
        block_m: config.block_m(),
        block_n: config.block_n(),
        threads: 32 * DECODE_WARPS,
        dynamic_smem: config.smem_bytes(spec),
        args,
    }
}

fn storage(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    }
}

/// The `constexpr` block of a decode kernel.
fn write_config(w: &mut Writer<String>, spec: &Spec, config: DecodeConfig) -> fmt::Result {
    let DecodeConfig { m_tiles, stages, kv, warps, v_in_k, .. } = config;
    let (elements, k_tile, v_tile) = match kv {
        KvCacheDtype::Spec => ("Q, K, V and O", "BLOCK_N * DP;", "BLOCK_N * DVP;"),
        KvCacheDtype::E4m3 => (
            "Q and O; K and V are e4m3",
            "BLOCK_N * DP / 2;  // 16-bit units: a byte an e4m3 element",
            "BLOCK_N * DVP / 2;",
        ),
    };
    let (v_tile, v_cols) = match v_in_k {
        true => ("K_TILE;  // V is K's first DV columns: read from K's tiles", "DP"),
        false => (v_tile, "DVP"),
    };
    let (split, warp_dv, pv_keys) = match warps {
        WarpSplit::Keys => ("a quarter of each tile's keys", "DVP", "WARP_N"),
        WarpSplit::Columns => ("a quarter of O's columns (and of each tile's keys for S)", "DVP / WARPS", "BLOCK_N"),
    };
    let slices = config.merge_slices();
    write!(
        w,
        "\
        // ---- kernel configuration ---------------------------------------------------\n\
        using storage = {storage};  // element format of {elements}\n\
        using operand = {operand};  // the MMAs' 16-bit format\n\
        constexpr int D = {d};  // Q/K head dim\n\
        constexpr int DV = {dv};  // V/O head dim\n\
        constexpr int DP = (D + 15) / 16 * 16;  // D padded to the MMA k-step (zeros beyond D)\n\
        constexpr int DVP = (DV + 15) / 16 * 16;  // DV padded to pairs of 8-wide MMA tiles\n\
        constexpr int WARPS = {DECODE_WARPS};  // each owns {split}\n\
        constexpr int THREADS = 32 * WARPS;\n\
        constexpr int M_TILES = {m_tiles};  // 16-row MMA tiles; every warp multiplies all of them\n\
        constexpr int BLOCK_M = 16 * M_TILES;  // query rows per CTA (query heads x tokens)\n\
        constexpr int BLOCK_N = {block_n};  // keys per K/V tile\n\
        constexpr int WARP_N = BLOCK_N / WARPS;  // a warp's keys of each tile's S\n\
        constexpr int S_TILES = WARP_N / 8;  // m16n8 accumulator tiles of a warp's S\n\
        constexpr int PV_KEYS = {pv_keys};  // keys of each tile a warp's P V multiplies\n\
        constexpr int WARP_DV = {warp_dv};  // O's columns a warp owns\n\
        constexpr int O_TILES = WARP_DV / 8;  // m16n8 accumulator tiles of a warp's O\n\
        constexpr int SLICES = {slices};  // the epilogue's O slices: one a warp where each holds every column\n\
        constexpr int STAGES = {stages};  // K/V pipeline stages, STAGES - 1 tiles in flight\n\
        constexpr int MAX_SPLITS = {MAX_SPLITS};  // the most splits a launch has\n\
        constexpr int COMBINE_IN_FLIGHT = {COMBINE_IN_FLIGHT};  // splits' loads in flight per row chunk of the combine\n\
        constexpr int Q_TILE = BLOCK_M * DP;\n\
        constexpr int K_TILE = {k_tile}\n\
        constexpr int V_TILE = {v_tile}\n\
        constexpr bool V_IN_K = {v_in_k};  // V's tiles are K's\n\
        inline constexpr int V_COLS = {v_cols};  // columns of a V tile's rows (inline: e4m3 tiles read their own)\n\
        constexpr int STAGES_UNITS = STAGES * (V_IN_K ? K_TILE : K_TILE + V_TILE);  // 16-bit units of the stages\n\
        constexpr int SCRATCH_BYTES = {scratch};  // past the Q tile: the stages, the merge's rows, the combine's weights\n\
        static_assert(SCRATCH_BYTES >= 2 * STAGES_UNITS, \"the stages fit the scratch\");\n\
        \n",
        storage = storage(spec.dtype),
        // e4m3 converts to f16 in one instruction, to bf16 in five.
        operand = if kv == KvCacheDtype::E4m3 { "f16" } else { storage(spec.dtype) },
        d = spec.head_dims.qk,
        dv = spec.head_dims.v,
        block_n = config.block_n(),
        scratch = config.scratch_bytes(spec),
    )
}
