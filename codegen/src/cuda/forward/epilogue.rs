//! The forward's epilogue: the LSE, then O = o / l staged in shared memory
//! and stored (by the CTA, or per warpgroup or warp with TMA).

use super::bias::lse_row_term;
use super::e4m3::Operands;
use super::plan::Plan;
use super::softmax::RowSums;
use super::trace::{self, Event};
use super::varlen;
use crate::abi::{ArgKind, Axis, Operand, O_STORE_ROWS};
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::Hoisted;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::O_MAP;
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// O = o / l into a swizzled shared tile, then to memory; and the LSE. Only
/// the threads that multiply get here: a warp-specialized kernel meets on a
/// named barrier of theirs instead of `__syncthreads`.
pub(super) fn write_epilogue(
    w: &mut Writer<String>,
    plan: &Plan,
    hoisted: &[Hoisted],
    staging: OStaging,
) -> fmt::Result {
    let (spec, sums) = (plan.spec, plan.row_sums);
    let name = |kind| arg_name(spec, kind);
    let [q_len, heads, lse] = [ArgKind::QLen, ArgKind::Heads, ArgKind::Lse].map(name);
    let o_stride = name(ArgKind::Stride(Operand::O, Axis::Seq));
    let (sync, done, o_tile) = match staging {
        OStaging::Cta => (
            "__syncthreads();",
            "every warp is done with the Q and K/V tiles: their space stages O",
            "smem;  // [BLOCK_M][DVP]",
        ),
        OStaging::QBuffer(_) => (
            WARPGROUP_SYNC,
            "the warpgroup is done with its rows of this item's Q: they stage its O",
            "q_tile;  // [BLOCK_M][DVP] in 64-column panels, as Q",
        ),
        OStaging::OBuffer(TileCopy::Threads) => (
            WARPGROUP_SYNC,
            "the warpgroup's threads are done storing its previous O",
            "o_buf;  // [BLOCK_M][V_COLS] in 64-column panels, as Q",
        ),
        OStaging::OBuffer(TileCopy::Tma) => (
            "if (lane == 0) tma_store_wait_read();\n__syncwarp();",
            "the copy engine has read the warp's previous O",
            "o_buf;  // [BLOCK_M][V_COLS] in 64-column panels, as Q",
        ),
    };
    // Who stores which rows: a warp-specialized kernel's warpgroups each
    // store their own 64, so none waits for another's last tile. They stage
    // O in the Q buffer's 64-column panels, as Q lies there: a warpgroup's
    // rows of O then overwrite only its own rows of Q (at d > 64 a row-major
    // O would reach into another warpgroup's rows of a later panel).
    let (at, store) = match staging {
        OStaging::Cta => (
            "swizzle<DVP>(row, n * 8 + 2 * t)",
            format!(
                "store_tile<BLOCK_M, DVP, DV, THREADS>(o_tile, o_rows + (long long)q0 * {o_stride}, {o_stride}, {q_len} - q0, aligned16(o_rows, {o_stride}), threadIdx.x);"
            ),
        ),
        OStaging::QBuffer(_) | OStaging::OBuffer(_) => (
            "tile_offset<BLOCK_M, DVP, true>(row, n * 8 + 2 * t)",
            format!(
                "const int wg_row = warpgroup * 4 * WARP_M;\n\
                store_tile<4 * WARP_M, DVP, DV, 128, true, BLOCK_M>(o_tile, o_rows + (long long)(q0 + wg_row) * {o_stride}, {o_stride},\n\
                \x20                                                  {q_len} - q0 - wg_row, aligned16(o_rows, {o_stride}), threadIdx.x % 128, wg_row);"
            ),
        ),
    };
    let lse_index = match plan.varlen {
        true => varlen::lse_index(spec),
        false => format!("((long long)b * {heads} + h) * {q_len} + q"),
    };
    // The logits leave out a row's part of a key-linear bias: its LSE adds it.
    let sum = match sums {
        RowSums::Fadd => "quad_sum(l[mt][r])",
        RowSums::TensorCores => "row_sum[mt][0][2 * r]",
    };
    let row_term = lse_row_term(spec, hoisted);
    let RowStats { stats, lse: lse_value, inv } = RowStats::of(plan, sum, row_term.as_deref());
    if let OStaging::OBuffer(_) = staging {
        // The warp's last S has read its rows of Q: the producer may refill the buffer.
        writeln!(
            w,
            "\nif (lane == 0) mbar_arrive(q_empty + 8 * qb);  // the Q buffer takes the Q of the item after next"
        )?;
        trace::point(w, plan, Event::Epi)?;
    }
    writeln!(w, "\n{sync}  // {done}")?;
    trace::point(w, plan, Event::EpiStart)?;
    write!(
        w,
        "\
        \n\
        // Epilogue: the natural-log LSE, then O = o / l into a swizzled shared\n\
        // tile and to memory in 16-byte row chunks. A fully masked row (l == 0)\n\
        // writes O = 0 and LSE = -inf. The LSE's stores go first: they are on\n\
        // their way while O is staged, not still in flight at the fence ahead\n\
        // of O's copy.\n\
        float sums[2 * M_TILES];\n\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const int q = q0 + tile_row(warp, mt) + g + 8 * r;\n\
        {stats}\
        \x20   if ({lse} != nullptr && t == 0 && q < {q_len}) {{\n\
        \x20       {lse}[{lse_index}] = {lse_value};\n\
        \x20   }}\n\
        }}\n\
        unsigned short* o_tile = {o_tile}\n\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const int row = tile_row(warp, mt) + g + 8 * r;\n\
        \x20   const float inv = {inv};\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < O_TILES; ++n) {{\n\
        \x20       *(unsigned*)(o_tile + {at}) =\n\
        \x20           pack2(storage{{}}, o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);\n\
        \x20   }}\n\
        }}\n\
        "
    )?;
    match staging {
        OStaging::Cta => writeln!(w, "{sync}\n{store}"),
        OStaging::QBuffer(copy) => {
            write_o_store(w, plan, copy, &store, true)?;
            write_release_q_buffer(w, plan)?;
            trace::point(w, plan, Event::Epi)
        }
        // Nothing waits for the store here: the next item's epilogue does.
        OStaging::OBuffer(copy) => write_o_store(w, plan, copy, &store, false),
    }
}

/// What the epilogue prints of a row's statistics, from its sum (C) and
/// max `m[mt][r]`: the first loop's lines (`stats`), which keep in
/// `sums[i]` what the second loop's `inv` scales the row's O by, and the
/// row's natural-log LSE (`lse`), of which the logits left out `row_term`
/// (log2 units).
struct RowStats {
    stats: String,
    lse: String,
    inv: String,
}

impl RowStats {
    /// A sink closes the row's softmax (`sink_row`), evaluated in the
    /// logits' frame; without one a row with no kept key has l == 0.
    fn of(plan: &Plan, sum: &str, row_term: Option<&str>) -> RowStats {
        let stats = Self::of_softmax(plan, sum, row_term);
        // e4m3 operands: V's descale joins O's factor (`e4m3::write_descales`).
        match plan.operands {
            Operands::Sixteen => stats,
            Operands::E4m3 => RowStats { inv: format!("({}) * v_scale", stats.inv), ..stats },
        }
    }

    /// [`RowStats::of`] of the softmax alone.
    fn of_softmax(plan: &Plan, sum: &str, row_term: Option<&str>) -> RowStats {
        let plus_row_term = row_term.map(|term| format!(" + {term}")).unwrap_or_default();
        let Some(sink) = &plan.spec.sink else {
            return RowStats {
                stats: format!("\x20   const float sum = sums[i] = {sum};\n"),
                lse: format!("sum > 0.0f ? (m[mt][r] + fast_log2(sum){plus_row_term}) * LN2 : neg_inf()"),
                inv: "sums[i] > 0.0f ? fast_rcp(sums[i]) : 0.0f".into(),
            };
        };
        let minus_row_term = row_term.map(|term| format!(" - {term}")).unwrap_or_default();
        let sink = c_expr(plan.spec, sink);
        RowStats {
            stats: format!(
                "\x20   // The sink joins the row as one more logit; sums[i] keeps O's factor.\n\
                \x20   const SinkRow closed = sink_row(m[mt][r], {sum}, {sink} * LOG2E{minus_row_term});\n\
                \x20   sums[i] = closed.o_scale;\n"
            ),
            lse: format!("(closed.lse2{plus_row_term}) * LN2"),
            inv: "sums[i]".into(),
        }
    }
}

/// O from a warp-specialized kernel's staging tile to memory: with TMA each
/// warp's lane 0 hands its rows (16 per m-tile) to the copy engine (no warpgroup barrier,
/// no per-thread address math; the copy engine clips rows past q_len),
/// waiting until the copy has read them where `wait_read` (the tile is the
/// Q buffer the warp frees next); else the warpgroup meets and its threads
/// store 16 bytes at a time.
pub(super) fn write_o_store(
    w: &mut Writer<String>,
    plan: &Plan,
    copy: TileCopy,
    store: &str,
    wait_read: bool,
) -> fmt::Result {
    match copy {
        TileCopy::Tma => {
            trace::point(w, plan, Event::OStaged)?;
            write!(
                w,
                "\
                // The copy engine stores the warp's rows, 16 per m-tile.\n\
                fence_async_smem();  // this thread's O, visible to the copy engine\n\
                __syncwarp();\n\
                if (lane == 0) {{\n\
                \x20   #pragma unroll\n\
                \x20   for (int mt = 0; mt < M_TILES; ++mt) {{\n\
                \x20       const int row = tile_row(warp, mt);\n\
                \x20       tma_store_tile<{O_STORE_ROWS}, V_COLS, BLOCK_M>(o_tile + row * 64, {O_MAP}, q0 + row, h, {seq});\n\
                \x20   }}\n",
                seq = plan.tma_seq(Operand::O)
            )?;
            if wait_read {
                writeln!(w, "\x20   tma_store_wait_read();")?;
            }
            writeln!(w, "}}")?;
            trace::point(w, plan, Event::OStored)
        }
        TileCopy::Threads => writeln!(w, "{WARPGROUP_SYNC}\n{store}"),
    }
}

/// Each warp frees its share of the Q buffer once its O left it; the
/// buffer takes the next item's Q, or with two buffers the item after
/// next's (the next one's is in the other buffer).
fn write_release_q_buffer(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let next = match plan.q_buffers {
        1 => "the next item",
        _ => "the item after next",
    };
    writeln!(w, "__syncwarp();  // the warp's reads of o_tile are done:")?;
    writeln!(w, "if (lane == 0) mbar_arrive(q_empty + 8 * qb);  // the buffer takes the Q of {next}")
}

/// A consumer warpgroup's own named barrier (the other warpgroups go on).
pub(super) const WARPGROUP_SYNC: &str = "named_barrier_sync(3 + WARPGROUPS + warpgroup, 128);";

/// Where the epilogue stages O in shared memory (unrelated to [`Stagers`],
/// who stage a tensor mask's block classes).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum OStaging {
    /// From the start, once every thread of the CTA is done with its tiles.
    Cta,
    /// A warp-specialized kernel: in the item's Q buffer (the producer is
    /// already filling the ring and the other Q buffer), each warpgroup in
    /// its own rows once it is done with them, on its own barrier: the
    /// warpgroups' turns on the tensor cores stay staggered across items.
    /// Each consumer warp then frees its share of the buffer, once O has
    /// left it as the kernel copies.
    QBuffer(TileCopy),
    /// A warp-specialized kernel with room for it (`TileConfig::o_buffer`):
    /// in O's own buffer. Each warp frees its share of the Q buffer as the
    /// epilogue starts (its last S has read Q) and waits only for its own
    /// previous O to leave the buffer (with TMA, for the copy engine's read
    /// it did not wait for then; with threads, on the warpgroup's barrier),
    /// so no barrier or wait sits between an item's last P V and its store.
    OBuffer(TileCopy),
}
