//! The dK/dV kernel (and dQ by atomics): one CTA per (kv tile, K/V head,
//! batch), keys as the rows of every warp's tiles. See the module note.

use super::common::dropout_kind;
use super::common::{
    per_head, write_column_terms, write_row_terms, write_source, write_spec_lambdas, write_tile_walk, Sections,
    SpecTerms, Walk,
};
use super::orientation::Rows;
use super::packing::Packing;
use super::step::{write_register_products, write_scores, write_split_elements, FromRegisters, Part};
use super::{BackwardConfig, KeyColumns};
use crate::abi::{ArgKind, Axis, Grid, Kernel, Operand};
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::hoist;
use crate::cuda::kit::terms::{interior_decl, KeyTerms};
use crate::cuda::kit::tile_walk::write_mask_tiles;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::backward_args;
use crate::cuda::signature::names::{DELTA, DQ_ACCUM};
use crate::cuda::signature::with_dropout;
use crate::cuda::source::kernel_name;
use crate::cuda::target::pad16;
use crate::cuda::writer::Writer;
use crate::mask_parts::{MaskParts, TAIL_ITEMS};
use crate::spec::Spec;
use std::fmt::{self, Write};

const OPERANDS: [Operand; 6] = [Operand::Q, Operand::K, Operand::V, Operand::DO, Operand::DK, Operand::DV];

pub(super) fn emit(spec: &Spec, config: BackwardConfig, packing: Packing) -> Kernel {
    let name = kernel_name(&packing.prefix(&dropout_kind("bwd", config.dropout)), spec);
    let terms = SpecTerms::new(spec, config.tensor_grads, config.dropout);
    let slots: Vec<usize> = terms.grads.iter().map(|(slot, ..)| *slot).collect();
    let args = with_dropout(spec, packing.args(spec, backward_args(spec, OPERANDS, &slots)), config.dropout);
    let source = write_source(
        spec,
        Sections::Tiles,
        &name,
        &args,
        |w| write_config(w, spec, config),
        |w| write_body(w, spec, &terms, packing, config.columns),
    );
    Kernel {
        name,
        source,
        grid: Grid::KeyTiles,
        block_m: config.block_m,
        block_n: keys_per_cta(config),
        threads: 32 * config.warps,
        dynamic_smem: smem_bytes(spec, config),
        args,
    }
}

/// K and V of the CTA's keys, and two buffers of a query step's Q, dO, dSᵀ
/// (16-bit) and two f32 statistics per query.
pub(super) fn smem_bytes(spec: &Spec, config: BackwardConfig) -> u32 {
    let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
    let (m, n) = (config.block_m, keys_per_cta(config));
    let partials = match config.columns {
        KeyColumns::Whole | KeyColumns::Transposed => 0,
        KeyColumns::Halves => 4 * config.warps * partials_per_warp(config),
    };
    2 * (n * (dp + dvp) + 2 * m * (dp + dvp + n)) + 2 * 4 * 2 * m + partials
}

/// Keys per CTA: 16 per warp of a column part.
fn keys_per_cta(config: BackwardConfig) -> u32 {
    16 * config.warps / config.columns.parts()
}

/// f32 of a warp's slot for its partial Sᵀ and dPᵀ under halved columns: both
/// accumulators' BLOCK_M / 8 m16n8 tiles, 4 per lane.
fn partials_per_warp(config: BackwardConfig) -> u32 {
    2 * config.block_m / 8 * 4 * 32
}

fn write_config(w: &mut Writer<String>, spec: &Spec, config: BackwardConfig) -> fmt::Result {
    let BackwardConfig { warps, columns, block_m, .. } = config;
    writeln!(w, "constexpr int WARPS = {warps};")?;
    writeln!(w, "constexpr int THREADS = 32 * WARPS;")?;
    let block_n = match columns {
        KeyColumns::Whole | KeyColumns::Transposed => "16 * WARPS;  // keys per CTA, 16 per warp",
        KeyColumns::Halves => {
            writeln!(
                w,
                "constexpr int COL_PARTS = {};  // warps per 16 keys, each with its part of dK's and dV's columns",
                columns.parts()
            )?;
            writeln!(
                w,
                "constexpr int PARTIALS = {};  // f32 of a warp's slot for its partial S^T and dP^T",
                partials_per_warp(config)
            )?;
            "16 * WARPS / COL_PARTS;  // keys per CTA, 16 per COL_PARTS warps"
        }
    };
    write!(
        w,
        "\
        constexpr int BLOCK_N = {block_n}: grid.x = ceil(kv_len / BLOCK_N)\n\
        constexpr int BLOCK_M = {block_m};  // queries per step of the loop\n\
        constexpr int DQ_COLS = DP % 32 == 0 ? 32 : 16;  // columns of a warp's dQ block per step\n"
    )?;
    write_key_tiles(
        w,
        spec,
        "\
        // Shared memory: this CTA's K and V tiles; two buffers of a step's Q and dO\n\
        // tiles and two statistics per query (the next step's load into one while\n\
        // the other is multiplied) and of its dS^T (read by the next step's dQ).\n",
        ["DP", "DVP"],
        columns,
    )
}

/// The tile constants both dK/dV kernels share (after their BLOCK_M and
/// BLOCK_N, and COL_PARTS where `columns` halves them): each warp's m16n8 tile
/// counts, the block mask's tile, and after `layout` (a comment on the
/// shared-memory layout) the tile sizes, whose rows hold `cols` (the
/// constants naming the Q/K and V tiles' columns).
pub(super) fn write_key_tiles(
    w: &mut Writer<String>,
    spec: &Spec,
    layout: &str,
    cols: [&str; 2],
    columns: KeyColumns,
) -> fmt::Result {
    let [qk, v] = cols;
    writeln!(
        w,
        "constexpr int S_TILES = BLOCK_M / 8;  // m16n8 tiles of a warp's S^T and dP^T (16 keys x BLOCK_M queries)"
    )?;
    match columns {
        KeyColumns::Whole | KeyColumns::Transposed => w.write_str(
            "\
            constexpr int DK_TILES = DP / 8;  // m16n8 tiles of a warp's dK (16 keys x DP)\n\
            constexpr int DV_TILES = DVP / 8;  // m16n8 tiles of a warp's dV (16 keys x DVP)\n",
        )?,
        KeyColumns::Halves => w.write_str(
            "\
            constexpr int DK_TILES = DP / 8 / COL_PARTS;  // m16n8 tiles of a warp's dK (16 keys x its DP / COL_PARTS)\n\
            constexpr int DV_TILES = DVP / 8 / COL_PARTS;  // m16n8 tiles of a warp's dV (16 keys x its DVP / COL_PARTS)\n",
        )?,
    }
    write_mask_tiles(w, spec)?;
    w.write_str(layout)?;
    write!(
        w,
        "\
        constexpr int K_TILE = BLOCK_N * {qk};\n\
        constexpr int V_TILE = BLOCK_N * {v};\n\
        constexpr int Q_TILE = BLOCK_M * {qk};\n\
        constexpr int DO_TILE = BLOCK_M * {v};\n\
        constexpr int DS_TILE = BLOCK_N * BLOCK_M;\n"
    )
}

/// Where a dK/dV CTA's work comes from: its block, one per key tile of
/// every (batch, K/V head) pair (`Grid::KeyTiles`), or, persistent
/// (`Grid::KeyUnits`), each unit `unit` it claims, numbered as the blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyWork {
    Blocks,
    Units,
}

impl KeyWork {
    /// The C expressions of the work's index and of the virtual grid's key
    /// tiles, K/V heads and batch rows it indexes.
    fn index_and_dims(self, spec: &Spec) -> (String, [String; 3]) {
        match self {
            KeyWork::Blocks => (
                "blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z)".into(),
                ["gridDim.x", "gridDim.y", "gridDim.z"].map(String::from),
            ),
            KeyWork::Units => {
                let dims = ["key_tiles".to_string(), arg_name(spec, ArgKind::HeadsKv), arg_name(spec, ArgKind::Batch)];
                ("unit".into(), dims)
            }
        }
    }
}

/// A dK/dV kernel's CTA: its batch, K/V head and keys, the query heads of
/// its group, the query steps, and the rows of dK and dV, and of K and V
/// where its threads `load_kv`; a varlen CTA past its sequence's keys returns.
///
/// With halved columns, `warp` names the warp's 16 keys and `part` its part
/// of dK's and dV's columns (warps of one part are consecutive).
pub(super) fn write_key_cta(
    w: &mut Writer<String>,
    spec: &Spec,
    load_kv: bool,
    packing: Packing,
    columns: KeyColumns,
) -> fmt::Result {
    let kv_len = arg_name(spec, ArgKind::KvLen);
    write_cta_order(w, spec, KeyWork::Blocks)?;
    packing.write_sequence(w, spec, true, "k0", &kv_len)?;
    write_key_lanes(w, spec, columns)?;
    write_key_rows(w, spec, load_kv, packing)
}

/// The CTA's lanes, its group's query heads and the query steps: what
/// every unit of a persistent CTA shares.
pub(super) fn write_key_lanes(w: &mut Writer<String>, spec: &Spec, columns: KeyColumns) -> fmt::Result {
    let [q_len, heads, heads_kv] = [ArgKind::QLen, ArgKind::Heads, ArgKind::HeadsKv].map(|kind| arg_name(spec, kind));
    match columns {
        KeyColumns::Whole | KeyColumns::Transposed => {
            w.write_str("const int warp = warp_index(), lane = threadIdx.x % 32;\n")?
        }
        KeyColumns::Halves => w.write_str(
            "\
            const int warp_in_cta = warp_index(), lane = threadIdx.x % 32;\n\
            const int warp = warp_in_cta % (WARPS / COL_PARTS);\n\
            const int part = warp_in_cta / (WARPS / COL_PARTS);  // this warp's part of dK's and dV's columns\n",
        )?,
    }
    write!(
        w,
        "\
        const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair\n\
        const int group = {heads} / {heads_kv};  // query heads sharing this K/V head\n\
        const int q_steps = ({q_len} + BLOCK_M - 1) / BLOCK_M;\n"
    )
}

/// A persistent CTA's unit `unit` (dense operands): its batch, K/V head and
/// keys. Its rows of dK and dV are [`write_unit_rows`]'s, written where they
/// are stored: live across the unit's steps, they would take registers.
pub(super) fn write_key_unit(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    write_cta_order(w, spec, KeyWork::Units)?;
    write_key_range(w, spec)
}

/// A persistent CTA's unit's rows of dK and dV.
pub(super) fn write_unit_rows(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    for (op, rows) in [(Operand::DK, "dk_rows"), (Operand::DV, "dv_rows")] {
        Packing::Dense.write_rows(w, spec, op, rows, "kv_head")?;
    }
    Ok(())
}

/// The CTA's key range, for the tile classes.
fn write_key_range(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let kv_len = arg_name(spec, ArgKind::KvLen);
    write!(
        w,
        "\
        [[maybe_unused]] const int k_lo = k0, k_hi = min_i32(k0 + BLOCK_N, {kv_len}) - 1;  // this CTA's keys (for the classes)\n\
        \n"
    )
}

/// The CTA's key range and the rows of dK and dV, and of K and V where its
/// threads `load_kv`.
fn write_key_rows(w: &mut Writer<String>, spec: &Spec, load_kv: bool, packing: Packing) -> fmt::Result {
    let [k_stride, v_stride] = [Operand::K, Operand::V].map(|op| arg_name(spec, ArgKind::Stride(op, Axis::Seq)));
    write_key_range(w, spec)?;
    let kv = [(Operand::K, "k_rows"), (Operand::V, "v_rows")].into_iter().filter(|_| load_kv);
    for (op, rows) in kv.chain([(Operand::DK, "dk_rows"), (Operand::DV, "dv_rows")]) {
        packing.write_rows(w, spec, op, rows, "kv_head")?;
    }
    match load_kv {
        true => writeln!(w, "const bool kv_vector = aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});"),
        false => Ok(()),
    }
}

/// The CTA's keys, K/V head and batch from its block index (persistent: its
/// unit's, as `work` says): under an analytic mask, whose first keys may
/// see the most queries (causal), in an order that starts long CTAs early,
/// the key tiles of global columns (`k < C`, which every query sees) first
/// of all; under a data-dependent one in the block mask's work order,
/// longest first within windows of a few heads (`work_order`); else the
/// launch order (no mask keeps the work even).
/// `mask_parts::global_columns_first` is the analytic order's twin on the
/// CPU.
fn write_cta_order(w: &mut Writer<String>, spec: &Spec, work: KeyWork) -> fmt::Result {
    let (cta, [tiles, kv_heads, batch]) = work.index_and_dims(spec);
    let Some(mask) = &spec.mask else {
        return match work {
            KeyWork::Blocks => w.write_str(
                "\
                // The spec's built-in b (h, q and k are bound in the loops below).\n\
                const int b = blockIdx.z;\n\
                const int kv_head = blockIdx.y;\n\
                const int k0 = blockIdx.x * BLOCK_N;\n",
            ),
            KeyWork::Units => write!(
                w,
                "\
                // The spec's built-in b (h, q and k are bound in the loops below).\n\
                const int b = {cta} / ({tiles} * {kv_heads});\n\
                const int kv_head = {cta} / {tiles} % {kv_heads};\n\
                const int k0 = {cta} % {tiles} * BLOCK_N;\n"
            ),
        };
    };
    if mask.reads_tensor() {
        let order = arg_name(spec, ArgKind::WorkOrder);
        let (index, cta) = match work {
            KeyWork::Blocks => (format!("const int cta = {cta};\n"), "cta".to_string()),
            KeyWork::Units => (String::new(), cta),
        };
        return write!(
            w,
            "\
            // The spec's built-in b (h, q and k are bound in the loops below). CTAs\n\
            // start in launch order; with the block mask's work order, longest first\n\
            // within windows of heads, so that the grid ends on short CTAs (null:\n\
            // in launch order).\n\
            {index}\
            const int slot = {order} != nullptr ? {order}[{cta}] : {cta};\n\
            const int b = slot / ({tiles} * {kv_heads});\n\
            const int kv_head = slot / {tiles} % {kv_heads};\n\
            const int k0 = slot % {tiles} * BLOCK_N;\n"
        );
    }
    write_global_column_tiles(w, spec, &tiles)?;
    write!(
        w,
        "\
        // The spec's built-in b (h, q and k are bound in the loops below). CTAs\n\
        // start in launch order: first the global columns' key tiles, tile by\n\
        // tile over every (batch, K/V head) pair (every query sees them: in the\n\
        // order below the last pairs' would start near the grid's end and trail\n\
        // it); then in bands of BAND pairs, which run together and share their\n\
        // heads' Q, dO and dQ in L2, key tile by key tile: a band's last CTAs are\n\
        // its last keys', under a causal mask the shortest. The last band takes\n\
        // the last pairs of about TAIL_CTAS CTAs (two waves on a 132-SM GPU),\n\
        // so that the grid's last wave holds only their shortest CTAs.\n\
        constexpr int BAND = 4, TAIL_CTAS = {TAIL_ITEMS};\n\
        const int pairs = {kv_heads} * {batch}, cta = {cta};\n\
        int pair, key_tile;\n\
        if (cta < global_tiles * pairs) {{\n\
        \x20   key_tile = cta / pairs;\n\
        \x20   pair = cta % pairs;\n\
        }} else {{\n\
        \x20   const int rest = cta - global_tiles * pairs, tiles = {tiles} - global_tiles;\n\
        \x20   const int tail_pairs = max_i32(BAND, (TAIL_CTAS + tiles - 1) / tiles);\n\
        \x20   const int tail_first = max_i32(pairs - tail_pairs, 0) / BAND * BAND;  // the last band's first pair\n\
        \x20   const int first = rest < tail_first * tiles ? rest / (BAND * tiles) * BAND : tail_first;\n\
        \x20   const int band_pairs = first == tail_first ? pairs - tail_first : BAND, in_band = rest - first * tiles;\n\
        \x20   pair = first + in_band % band_pairs;\n\
        \x20   key_tile = global_tiles + in_band / band_pairs;\n\
        }}\n\
        const int b = pair / {kv_heads};\n\
        const int kv_head = pair % {kv_heads};\n\
        const int k0 = key_tile * BLOCK_N;\n",
    )
}

/// `global_tiles`: the key tiles (of `tiles`, C) holding a global column
/// of the mask (`k < C`, a disjunct every query's row keeps), 0 without.
fn write_global_column_tiles(w: &mut Writer<String>, spec: &Spec, tiles: &str) -> fmt::Result {
    let columns = MaskParts::of(spec.mask.as_ref()).and_then(|parts| parts.global_columns());
    let Some(columns) = columns else {
        return writeln!(w, "constexpr int global_tiles = 0;  // the mask has no global columns");
    };
    let bound = c_expr(spec, columns.bound);
    let inclusive = if columns.inclusive { " + 1" } else { "" };
    write!(
        w,
        "\
        const long long global_keys = (long long){bound}{inclusive};  // the global columns: k < global_keys\n\
        const int global_tiles = global_keys <= 0 ? 0\n\
        \x20   : (int)min((global_keys + BLOCK_N - 1) / BLOCK_N, (long long){tiles});\n"
    )
}

fn write_body(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    packing: Packing,
    columns: KeyColumns,
) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [q_len, kv_len] = [ArgKind::QLen, ArgKind::KvLen].map(n);
    let [k_stride, v_stride] = [Operand::K, Operand::V].map(|op| n(ArgKind::Stride(op, Axis::Seq)));
    w.write_str(
        "\
        extern __shared__ __align__(128) unsigned short smem[];\n\
        unsigned short* k_tile = smem;  // [BLOCK_N][DP], for every step\n\
        unsigned short* v_tile = k_tile + K_TILE;  // [BLOCK_N][DVP]\n\
        unsigned short* q_tiles = v_tile + V_TILE;  // [2][BLOCK_M][DP]: a step's queries\n\
        unsigned short* dout_tiles = q_tiles + 2 * Q_TILE;  // [2][BLOCK_M][DVP]\n\
        unsigned short* ds_tiles = dout_tiles + 2 * DO_TILE;  // [2][BLOCK_N][BLOCK_M]: dS^T, for dQ\n\
        float* lse_cols = (float*)(ds_tiles + 2 * DS_TILE);  // [2][BLOCK_M]: LSE in log2 units, +inf for no gradient\n\
        float* delta_cols = lse_cols + 2 * BLOCK_M;  // [2][BLOCK_M]: D = rowsum(dO * O)\n",
    )?;
    if columns == KeyColumns::Halves {
        writeln!(
            w,
            "float* partials = delta_cols + 2 * BLOCK_M;  // [WARPS][PARTIALS]: each warp's partial S^T and dP^T"
        )?;
    }
    writeln!(w)?;
    write_key_cta(w, spec, true, packing, columns)?;
    let worker = match columns {
        KeyColumns::Whole | KeyColumns::Transposed => "warp",
        KeyColumns::Halves => {
            write_one_part_adds_grads(w, spec, terms)?;
            "threadIdx.x / 32"
        }
    };
    write!(
        w,
        "\
        // K and V of this CTA's keys stay in shared memory for the whole kernel.\n\
        load_tile<BLOCK_N, DP, D, THREADS>(k_tile, k_rows + (long long)k0 * {k_stride}, {k_stride}, {kv_len} - k0, kv_vector);\n\
        load_tile<BLOCK_N, DVP, DV, THREADS>(v_tile, v_rows + (long long)k0 * {v_stride}, {v_stride}, {kv_len} - k0, kv_vector);\n\
        cp_async_commit();\n\
        \n\
        // ldmatrix rows of this lane (see LdmLane). *_a: the A-operand pattern\n\
        // (rows 0-15 of a 16-column step), which also reads B operands through\n\
        // .trans; *_b: the B-operand pattern (two 8-row n-tiles), which also\n\
        // reads A operands through .trans.\n\
        const LdmLane<DP> d_a(lane % 8 + (lane / 8 % 2) * 8, lane / 16), d_b(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
        const LdmLane<DVP> dv_a(lane % 8 + (lane / 8 % 2) * 8, lane / 16), dv_b(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
        const LdmLane<BLOCK_M> ds_b(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
        const unsigned k_smem = smem_addr(k_tile), v_smem = smem_addr(v_tile);\n\
        const unsigned ds_smem = smem_addr(ds_tiles);\n\
        \n\
        // This warp's 16 keys of dK and dV (f32), summed over every query of every\n\
        // head of the group: no atomics.\n\
        float dk_acc[DK_TILES][4] = {{}};\n\
        float dv_acc[DV_TILES][4] = {{}};\n\
        int buf = 0;  // the buffer the next load fills: the one no warp may still read\n\
        \n"
    )?;
    let exprs = terms.exprs(spec);
    let hoisted = hoist(&exprs);
    w.block(format_args!("for (int h = kv_head * group; h < (kv_head + 1) * group; ++h)"), |w| {
        write_head_steps(w, spec, packing, worker)?;
        write_row_terms(w, spec, &hoisted, (Rows::Keys, KeyTerms::PerThread), Some("k0 + warp * 16"))?;
        write_spec_lambdas(w, spec, terms, &hoisted, Rows::Keys)?;
        write_head_grad_sums(w, spec, terms)?;
        write_tile_walk(w, spec, &Walk { axis: "q", tiles: "q_steps", size: "BLOCK_M", len: &q_len })?;
        writeln!(w)?;
        writeln!(w, "const int first = next_tile(0);")?;
        writeln!(w, "if (first < q_steps) load_step(first, buf);")?;
        writeln!(w, "int dq_pending = -1;  // first query of the step whose dS^T awaits its dQ")?;
        w.block(format_args!("for (int j = first, j_next; j < q_steps; j = j_next, buf ^= 1)"), |w| {
            write_step(w, spec, terms, &hoisted, columns)
        })?;
        writeln!(w, "if (dq_pending >= 0) {{")?;
        writeln!(w, "    __syncthreads();  // the last step's dS^T is visible")?;
        writeln!(w, "    add_dq(dq_pending, buf ^ 1);")?;
        writeln!(w, "}}")?;
        write_head_grad_adds(w, spec, terms)
    })?;
    write!(
        w,
        "\
        cp_async_wait_all();  // nothing may stay in flight past the kernel (no step visited)\n\
        \n\
        // Epilogue: dK = scale * sum dS^T Q and dV = sum P^T dO. Every warp's dQ\n\
        // reads every key: once all are done, K and V stage the stores.\n\
        __syncthreads();\n"
    )?;
    write_key_stores(w, spec, columns, "warp", Staging::KeyTiles)
}

/// The per-head lambdas of the `mma.sync` dK/dV kernel: `load_step` queues
/// a query tile's copies; `add_dq` adds a step's dQ from its dSᵀ, in blocks
/// the warps take in turn from `worker`, their index in the CTA.
fn write_head_steps(w: &mut Writer<String>, spec: &Spec, packing: Packing, worker: &str) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [q_len, lse] = [ArgKind::QLen, ArgKind::Lse].map(n);
    let (statistic_row, accum_rows) = (packing.statistic_row(spec, "h"), packing.accum_rows(spec));
    let [q_stride, do_stride] = [Operand::Q, Operand::DO].map(|op| n(ArgKind::Stride(op, Axis::Seq)));
    packing.write_rows(w, spec, Operand::Q, "q_rows", "h")?;
    packing.write_rows(w, spec, Operand::DO, "dout_rows", "h")?;
    write!(
        w,
        "\
        const bool q_vector = aligned16(q_rows, {q_stride}) && aligned16(dout_rows, {do_stride});\n\
        const float* lse_row = {lse} + {statistic_row};\n\
        const float* delta_row = {DELTA} + {statistic_row};\n\
        // Queues the copies of query tile jj's Q, dO and statistics into buffer bb.\n\
        auto load_step = [&](int jj, int bb) {{\n\
        \x20   const int q0 = jj * BLOCK_M;\n\
        \x20   load_tile<BLOCK_M, DP, D, THREADS>(q_tiles + bb * Q_TILE, q_rows + (long long)q0 * {q_stride}, {q_stride}, {q_len} - q0, q_vector);\n\
        \x20   load_tile<BLOCK_M, DVP, DV, THREADS>(dout_tiles + bb * DO_TILE, dout_rows + (long long)q0 * {do_stride}, {do_stride}, {q_len} - q0, q_vector);\n\
        \x20   for (int r = threadIdx.x; r < BLOCK_M; r += THREADS) {{\n\
        \x20       const bool valid = q0 + r < {q_len};\n\
        \x20       cp_async_4(&lse_cols[bb * BLOCK_M + r], valid ? lse_row + q0 + r : lse_row, valid ? 4 : 0);\n\
        \x20       cp_async_4(&delta_cols[bb * BLOCK_M + r], valid ? delta_row + q0 + r : delta_row, valid ? 4 : 0);\n\
        \x20   }}\n\
        \x20   cp_async_commit();\n\
        }};\n\
        // dQ += dS K for the step at queries q0 from dS^T buffer bb, once every warp\n\
        // has stored it: the warps take 16-query x DQ_COLS-column blocks in turn and\n\
        // add them to the f32 accumulator by vector reductions.\n\
        float* dq_rows = {DQ_ACCUM} + {accum_rows};\n\
        auto add_dq = [&](int q0, int bb) {{\n\
        \x20   for (int blk = {worker}; blk < (BLOCK_M / 16) * (DP / DQ_COLS); blk += WARPS) {{\n\
        \x20       const int m0 = blk / (DP / DQ_COLS) * 16, c0 = blk % (DP / DQ_COLS) * DQ_COLS;\n\
        \x20       float acc[DQ_COLS / 8][4] = {{}};\n\
        \x20       #pragma unroll\n\
        \x20       for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
        \x20           unsigned a[4];\n\
        \x20           ldmatrix_x4_trans(a, ds_smem + 2 * bb * DS_TILE + ldm_at(ds_b, kk * 16, m0 / 16));\n\
        \x20           #pragma unroll\n\
        \x20           for (int n = 0; n < DQ_COLS / 8; n += 2) {{\n\
        \x20               unsigned kb[4];\n\
        \x20               ldmatrix_x4_trans(kb, k_smem + ldm_at(d_a, kk * 16, (c0 + 8 * n) / 16));\n\
        \x20               mma_16816(storage{{}}, acc[n], a, kb[0], kb[1]);\n\
        \x20               mma_16816(storage{{}}, acc[n + 1], a, kb[2], kb[3]);\n\
        \x20           }}\n\
        \x20       }}\n\
        \x20       #pragma unroll\n\
        \x20       for (int n = 0; n < DQ_COLS / 8; ++n) red_add_tile<D>(dq_rows, {q_len}, q0 + m0, c0 + 8 * n, acc[n]);\n\
        \x20   }}\n\
        }};\n"
    )?;
    Ok(())
}

/// Under halved columns every warp computes its keys' dS: those of part 0
/// alone add the tensors' gradients (the others' pointers are nulled).
fn write_one_part_adds_grads(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms) -> fmt::Result {
    if terms.grads.is_empty() {
        return Ok(());
    }
    let nulls: Vec<String> = terms
        .grads
        .iter()
        .map(|(slot, ..)| format!("{} = nullptr;", arg_name(spec, ArgKind::TensorGrad(*slot))))
        .collect();
    writeln!(w, "// Every part computes dS: part 0 alone adds the tensors' gradients.")?;
    writeln!(w, "if (part != 0) {{ {} }}", nulls.join(" "))
}

/// Per trainable tensor read once per head (`slopes[h]`): the lane's running
/// sum of its gradient terms at this head (see [`write_head_grad_adds`]).
pub(super) fn write_head_grad_sums(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms) -> fmt::Result {
    for (slot, _, indices) in &terms.grads {
        if per_head(indices) {
            let t = &spec.tensors[*slot].name;
            writeln!(w, "float acc_{t} = 0.0f;  // this lane's share of d{t} at this head's element")?;
        }
    }
    Ok(())
}

/// The sums of [`write_head_grad_sums`] added to their gradients, one atomic
/// per warp and head.
pub(super) fn write_head_grad_adds(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms) -> fmt::Result {
    for (slot, _, indices) in &terms.grads {
        if per_head(indices) {
            let t = &spec.tensors[*slot].name;
            let dt = arg_name(spec, ArgKind::TensorGrad(*slot));
            writeln!(w, "// One atomic per warp and head for d{t}.")?;
            writeln!(w, "const float sum_{t} = warp_sum(acc_{t});")?;
            let owner = terms.owner_clause();
            writeln!(w, "if ({owner}{dt} != nullptr && lane == 0) atomicAdd(&{dt}[at_{t}(0, 0, 0, 0, 0)], sum_{t});")?;
        }
    }
    Ok(())
}

/// The epilogue of a dK/dV kernel: dK = scale · dk_acc and dV = dv_acc,
/// this warp's 16 keys, for the keys and columns that exist, staged in the
/// warp's own rows of `staging`, which the caller has freed: rows
/// leave 16 bytes per lane (a 2-byte store per element kept the window's
/// short CTAs waiting on the store queue for ~14% of their time).
///
/// With halved columns a warp stores its part of the columns, staged in its
/// part of its rows.
pub(super) fn write_key_stores(
    w: &mut Writer<String>,
    spec: &Spec,
    columns: KeyColumns,
    warp: &str,
    staging: Staging,
) -> fmt::Result {
    let [kv_len, scale] = [ArgKind::KvLen, ArgKind::Scale].map(|kind| arg_name(spec, kind));
    let [dk_stride, dv_stride] = [Operand::DK, Operand::DV].map(|op| arg_name(spec, ArgKind::Stride(op, Axis::Seq)));
    let [k_stage, v_stage] = match staging {
        Staging::KeyTiles => ["k_tile", "v_tile"],
        Staging::DsTiles => ["ds_tiles"; 2],
    };
    let stores = [
        (k_stage, "DP", "DK_TILES", "dk_acc", scale.as_str(), "dk_rows", dk_stride, "D"),
        (v_stage, "DVP", "DV_TILES", "dv_acc", "1.0f", "dv_rows", dv_stride, "DV"),
    ];
    for (i, (tile, width, tiles, acc, factor, rows, stride, cols)) in stores.into_iter().enumerate() {
        if i == 1 && staging == Staging::DsTiles {
            writeln!(w, "__syncwarp();  // every lane has read dK's rows before dV's take their place")?;
        }
        match columns {
            KeyColumns::Whole | KeyColumns::Transposed => writeln!(
                w,
                "store_warp_rows(storage{{}}, {tile} + {warp} * 16 * {width}, {acc}, {factor}, {rows}, {stride}, k0 + {warp} * 16, {kv_len}, {cols});"
            )?,
            KeyColumns::Halves => writeln!(
                w,
                "store_warp_rows(storage{{}}, {tile} + {warp} * 16 * {width} + part * 16 * 8 * {tiles}, {acc}, {factor}, {rows} + part * 8 * {tiles}, {stride}, k0 + {warp} * 16, {kv_len}, {cols} - part * 8 * {tiles});"
            )?,
        }
    }
    Ok(())
}

/// Where a warp stages its rows of dK and dV before storing them: in its
/// rows of the K and V tiles, or (a persistent kernel, whose next unit's K
/// and V are on their way) in the dS tiles, dK's then dV's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Staging {
    KeyTiles,
    DsTiles,
}

/// One step: the query tile j of head h against this CTA's keys.
fn write_step(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    hoisted: &[crate::cuda::kit::hoist::Hoisted],
    columns: KeyColumns,
) -> fmt::Result {
    let q_len = arg_name(spec, ArgKind::QLen);
    let interior = interior_decl(spec, "k0");
    write!(
        w,
        "\
        j_next = next_tile(j + 1);\n\
        const int q0 = j * BLOCK_M;\n\
        const bool full = tile_full(j);  // the mask keeps every pair: skip evaluating it\n\
        {interior}\
        unsigned short* q_tile = q_tiles + buf * Q_TILE;\n\
        float* lse_col = lse_cols + buf * BLOCK_M;\n\
        const float* delta_col = delta_cols + buf * BLOCK_M;\n\
        const unsigned q_smem = smem_addr(q_tile), dout_smem = smem_addr(dout_tiles + buf * DO_TILE);\n\
        cp_async_wait_all();  // this thread's copies of step j, queued a step ahead, have landed\n\
        // LSE to log2 units, each by the thread that copied it. A fully masked row\n\
        // (LSE = -inf) or one past q_len gets +inf: P = 0.\n\
        for (int r = threadIdx.x; r < BLOCK_M; r += THREADS) {{\n\
        \x20   const float l = lse_col[r];\n\
        \x20   lse_col[r] = q0 + r >= {q_len} || l == neg_inf() ? -neg_inf() : l * LOG2E;\n\
        }}\n\
        __syncthreads();  // step j's tiles are visible, and every warp is done with the other buffer\n\
        if (j_next < q_steps) load_step(j_next, buf ^ 1);  // the next step's copies overlap this step's math\n\
        // The previous step's dQ: its dS^T became visible at the barrier above.\n\
        if (dq_pending >= 0) add_dq(dq_pending, buf ^ 1);\n"
    )?;
    write_column_terms(w, spec, hoisted, Rows::Keys, "q0")?;
    write_scores(w, Rows::Keys, columns)?;
    if columns == KeyColumns::Halves {
        writeln!(w, "// Each part summed its share of the head dims: add the other's sums.")?;
        writeln!(
            w,
            "add_partner_sums(s, dp, partials + threadIdx.x / 32 * PARTIALS, partials + ((part ^ 1) * (WARPS / COL_PARTS) + warp) * PARTIALS, 1 + warp);"
        )?;
    }
    write_split_elements(w, spec, terms, Rows::Keys, ("k0 + warp * 16", "q0"), Part::Both)?;
    write!(
        w,
        "\
        \n\
        // dV += P^T dO and dK += dS^T Q, with P^T and dS^T straight from the\n\
        // registers: the accumulators of query tiles 2kk and 2kk + 1 are exactly the\n\
        // A fragment of the kk-th 16-query step.\n"
    )?;
    let dv = FromRegisters {
        a: "pa",
        from: "s",
        acc: "dv_acc",
        tiles: "DV_TILES",
        b: "ob",
        smem: "dout_smem",
        lane: "dv_a",
        first_col: (columns == KeyColumns::Halves).then_some("part * (DV_TILES / 2)"),
    };
    let dk = FromRegisters {
        a: "dsa",
        from: "dp",
        acc: "dk_acc",
        tiles: "DK_TILES",
        b: "qb",
        smem: "q_smem",
        lane: "d_a",
        first_col: (columns == KeyColumns::Halves).then_some("part * (DK_TILES / 2)"),
    };
    write_register_products(w, "BLOCK_M / 16", &[dv, dk])?;
    // The warps of one 16 keys hold the same dS^T: each stores its share of
    // the two 8-row halves.
    let (rows, parts) = match columns {
        KeyColumns::Whole | KeyColumns::Transposed => ("int i = 0; i < 2; ++i", ""),
        KeyColumns::Halves => ("int i = part; i < 2; i += COL_PARTS", "; each part its rows"),
    };
    write!(
        w,
        "\
        \n\
        if ({DQ_ACCUM} == nullptr) continue;  // deterministic mode: a separate kernel computes dQ\n\
        // dS^T to shared memory, so that the next step's dQ can read dS with queries\n\
        // as rows (its barrier makes it visible: no barrier here){parts}.\n\
        unsigned short* ds_tile = ds_tiles + buf * DS_TILE;\n\
        #pragma unroll\n\
        for ({rows}) {{\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < S_TILES; ++n) {{\n\
        \x20       const int row = warp * 16 + g + 8 * i;\n\
        \x20       *(unsigned*)&ds_tile[swizzle<BLOCK_M>(row, n * 8 + 2 * t)] = pack2(storage{{}}, dp[n][2 * i], dp[n][2 * i + 1]);\n\
        \x20   }}\n\
        }}\n\
        dq_pending = q0;\n"
    )
}
