//! What every forward body sets up per work item: its operands' rows, the
//! Q load, the hoisted spec terms with the `logit` lambdas, and the
//! accumulators and online-softmax state.

use super::e4m3::Operands;
use super::logit::write_logit;
use super::mma::write_operand_lanes;
use super::plan::Plan;
use super::softmax::RowSums;
use super::varlen;
use crate::abi::{ArgKind, Axis, Operand};
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::{hoist, Hoisted, Level};
use crate::cuda::kit::terms::{spec_exprs, stage_pointer_decl, write_tile_terms, KeyTerms};
use crate::cuda::signature::{arg_name, c_type};
use crate::cuda::tile_config::pipelined;
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Who works on an item, which decides the operands' rows it addresses.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum ItemRole {
    /// Every thread of a CTA: it loads Q, K and V and stores O itself.
    Cta,
    /// A warp-specialized kernel's producer: it copies Q, K and V (with
    /// TMA, by coordinates alone).
    Producer(TileCopy),
    /// Its consumers: they store O (with TMA, by coordinates alone).
    Consumers(TileCopy),
}

/// From the query tile `q_block` and `b`, `h`: its first row (a varlen
/// kernel's: its sequence, see [`varlen::write_sequence`]), the K/V head
/// of a `role` that loads K and V, and this (batch, head)'s rows of the
/// operands the role addresses, with whether Q's, K's and V's allow 16-byte
/// copies.
pub(super) fn write_item_rows(w: &mut Writer<String>, plan: &Plan, role: ItemRole) -> fmt::Result {
    let spec = plan.spec;
    let name = |kind| arg_name(spec, kind);
    if plan.varlen {
        varlen::write_sequence(w, plan)?;
    }
    let [heads, heads_kv] = [ArgKind::Heads, ArgKind::HeadsKv].map(name);
    let seq_stride = |op| name(ArgKind::Stride(op, Axis::Seq));
    let [q_stride, k_stride, v_stride] = [Operand::Q, Operand::K, Operand::V].map(seq_stride);
    match plan.tail_aligned {
        true => {
            // The slack is the rows the sequence's last tile would leave
            // empty (a packed sequence's own q_len; an item has rows, so q_len > 0).
            let q_len = name(ArgKind::QLen);
            writeln!(w, "// Tiles end at the last row; the first starts at row 0 and overlaps the second.")?;
            writeln!(w, "const int q0 = max_i32(q_block * BLOCK_M - (BLOCK_M - 1 - ({q_len} - 1) % BLOCK_M), 0);")?
        }
        false => writeln!(w, "const int q0 = q_block * BLOCK_M;")?,
    }
    if !matches!(role, ItemRole::Consumers(_)) {
        writeln!(w, "// GQA / MQA: each group of {heads} / {heads_kv} query heads shares one K/V head.")?;
        writeln!(w, "const int kv_head = h / ({heads} / {heads_kv});")?;
    }
    let copies = matches!(role, ItemRole::Cta | ItemRole::Producer(TileCopy::Threads));
    let stores = matches!(role, ItemRole::Cta | ItemRole::Consumers(TileCopy::Threads));
    let qkv = [(Operand::Q, "q_rows", "h"), (Operand::K, "k_rows", "kv_head"), (Operand::V, "v_rows", "kv_head")];
    let o = stores.then_some((Operand::O, "o_rows", "h"));
    let ops: Vec<_> = qkv.into_iter().filter(|_| copies).chain(o).collect();
    if !ops.is_empty() {
        writeln!(w, "\n// This (batch, head)'s rows of each operand; 64-bit offsets throughout.")?;
    }
    for (op, rows, head) in ops {
        let [ptr, head_stride] = [ArgKind::Ptr(op), ArgKind::Stride(op, Axis::Head)].map(name);
        let first = match plan.varlen {
            true => varlen::rows_origin(plan, op).map(|origin| format!("{ptr} + {origin} + {head} * {head_stride}")),
            false => Some(dense_rows(spec, op, head)),
        };
        match first {
            Some(first) => writeln!(w, "auto* {rows} = {first};")?,
            None => {
                writeln!(w, "auto* {rows} = {ptr} + {head} * {head_stride};  // the head's first element of page 0")?;
                varlen::paged_rows(w, spec, op, rows)?;
            }
        }
    }
    if plan.paged && role == ItemRole::Producer(TileCopy::Tma) {
        writeln!(w, "// The sequence's pages, for the boxes' page ids (K's and V's are the same).")?;
        varlen::paged_rows(w, spec, Operand::K, "k_rows")?;
    }
    if copies {
        // Paged rows are 16-byte aligned where pages are 16 bytes apart too.
        let pages_aligned = match plan.paged {
            true => {
                let [k, v] = [Operand::K, Operand::V].map(|op| name(ArgKind::PageStride(op)));
                format!("\n    && {k} % 8 == 0 && {v} % 8 == 0")
            }
            false => String::new(),
        };
        write!(
            w,
            "\
            // 16-byte copies need 16-byte aligned rows; otherwise (odd strides, odd\n\
            // offsets) the tiles load element by element. Uniform across the CTA.\n\
            const bool vector = aligned16(q_rows, {q_stride}) && aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride}){pages_aligned};\n"
        )?;
    }
    writeln!(w)
}

/// The first element of (batch `b`, head `head`)'s rows of dense operand
/// `op` (C expression; 64-bit offsets).
pub(super) fn dense_rows(spec: &Spec, op: Operand, head: &str) -> String {
    let name = |kind| arg_name(spec, kind);
    let [ptr, batch, head_stride] =
        [ArgKind::Ptr(op), ArgKind::Stride(op, Axis::Batch), ArgKind::Stride(op, Axis::Head)].map(name);
    format!("{ptr} + b * {batch} + {head} * {head_stride}")
}

/// `load_tile`'s arguments for the Q tile into `q_tile`.
pub(super) fn q_load(spec: &Spec) -> String {
    let [q_len, q_stride] = [ArgKind::QLen, ArgKind::Stride(Operand::Q, Axis::Seq)].map(|kind| arg_name(spec, kind));
    format!("(q_tile, q_rows + (long long)q0 * {q_stride}, {q_stride}, {q_len} - q0, vector);")
}

/// The spec's hoisted terms and the `logit` lambdas; returns the hoisted
/// terms the tile steps read. `staged_items`: the producer staged the
/// item's terms per CTA and per query ([`StagedTerms::items`]).
pub(super) fn write_spec_terms<'s>(
    w: &mut Writer<String>,
    plan: &Plan<'s>,
    kv_len: &str,
    staged_items: bool,
) -> Result<Vec<Hoisted<'s>>, fmt::Error> {
    let spec = plan.spec;
    let hoisted = hoist(&spec_exprs(spec));
    write_invariants(w, spec, &hoisted, plan.key_terms, staged_items)?;
    // e4m3 operands: the descales scale the dot products too (`e4m3::write_descales`).
    let scale = match plan.operands {
        Operands::Sixteen => arg_name(spec, ArgKind::Scale),
        Operands::E4m3 => "qk_scale".to_string(),
    };
    let columns = plan.columns.map(|columns| columns.global.keep());
    write_logit(w, spec, &hoisted, (&scale, kv_len), columns.as_ref())?;
    writeln!(w)?;
    Ok(hoisted)
}

/// The Q operand's address, the O accumulators and the online softmax
/// state; for pipelined kernels also P of the previous tile.
pub(super) fn write_accumulators(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let (config, sums) = (plan.config, plan.row_sums);
    write_operand_lanes(w, config.mma)?;
    let (sum, sum_decl) = match sums {
        RowSums::Fadd => ("this lane's share of the running sum l.", "float l[M_TILES][2] = {};"),
        RowSums::TensorCores => (
            "the running sum, P times ones: row r's is row_sum[mt][0][2 * r] (and 2 * r + 1).",
            "float row_sum[M_TILES][1][4] = {};  // an m64n8 accumulator per m-tile",
        ),
    };
    write!(
        w,
        "\
        \n\
        // This warp's WARP_M rows of O (f32), and the online softmax state of the\n\
        // lane's rows (g and g + 8 of each m-tile): running max m (log2 units) and\n\
        // {sum}\n\
        float o[M_TILES][O_TILES][4] = {{}};\n\
        float m[M_TILES][2];\n\
        {sum_decl}\n\
        #pragma unroll\n\
        for (int mt = 0; mt < M_TILES; ++mt) m[mt][0] = m[mt][1] = neg_inf();\n"
    )?;
    if pipelined(config) {
        write!(
            w,
            "\
            // P of the previous visited tile: the A operand of its P V, issued\n\
            // behind the next tile's S (FlashAttention-3's intra-warpgroup\n\
            // pipelining; ptxas places the wait for it before that S's softmax).\n\
            // V of tile j therefore loads with K of the tile after it.\n\
            unsigned p[M_TILES][BLOCK_N / {k_step}][4];\n\
            bool pv_pending = false;\n",
            k_step = plan.operands.k_step()
        )?;
    }
    Ok(())
}

/// Hoisted spec terms (see [`super::hoist`]): CTA-level constants, row-level
/// values for the rows this lane owns (row slot `i`, as in the softmax
/// loop), and the column-level arrays the tile loop fills (`Staged`: each
/// read from the staging the producer filled).
pub(super) fn write_invariants(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    keys: KeyTerms,
    staged_items: bool,
) -> fmt::Result {
    if hoisted.is_empty() {
        return Ok(());
    }
    writeln!(w, "// Spec terms that vary per CTA, per row or per key column, computed once there.")?;
    for h in hoisted {
        let ty = c_type(h.expr.ty);
        let value = c_expr(spec, h.expr);
        // Staged items: the producer evaluated the item's terms with its Q.
        let (cta, row) = match staged_items {
            false => (value.clone(), value),
            true => (format!("staged_{}[qb]", h.name), format!("staged_{}[qb][q - q0]", h.name)),
        };
        match h.level {
            Level::Cta => writeln!(w, "const {ty} {} = {cta};", h.name)?,
            Level::Row => {
                writeln!(w, "{ty} {}[2 * M_TILES];", h.name)?;
                writeln!(w, "#pragma unroll")?;
                w.block(format_args!("for (int i = 0; i < 2 * M_TILES; ++i)"), |w| {
                    writeln!(w, "const int q = q0 + tile_row(warp, i / 2) + g + 8 * (i % 2);")?;
                    writeln!(w, "{}[i] = {row};", h.name)
                })?
            }
            Level::Column => match keys {
                // Zeroed: NVRTC's front end cannot see a tile fill it before a logit reads it.
                KeyTerms::PerThread => writeln!(w, "{ty} {}[S_TILES][2] = {{}};  // filled per tile", h.name)?,
                KeyTerms::Staged => {
                    writeln!(w, "// This lane's keys of the tile's slot: [n][c] is key n * 8 + 2 * t + c.")?;
                    writeln!(w, "{}", stage_pointer_decl(h))?
                }
            },
        }
    }
    Ok(())
}

/// The forward's per-key terms for the tile at `kv0` (see
/// [`write_tile_terms`]).
pub(super) fn write_key_terms(w: &mut Writer<String>, spec: &Spec, hoisted: &[Hoisted], keys: KeyTerms) -> fmt::Result {
    write_tile_terms(w, spec, hoisted, Level::Column, "k", "kv0", keys)
}
