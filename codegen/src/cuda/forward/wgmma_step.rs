//! One K/V tile on Hopper's wgmma: back to back, or software-pipelined
//! (P V of one tile behind S of the next) with the warpgroups taking turns.

use super::classes::cta_selector;
use super::dropout::write_dropout;
use super::e4m3::{write_pv_e4m3, Operands};
use super::item::write_key_terms;
use super::logit::{write_cut_logits, write_interior_logits, write_logits};
use super::plan::Plan;
use super::softmax::{write_softmax, Rescale, RowSums};
use super::trace::{self, Event};
use crate::cuda::kit::hoist::{Hoisted, Level};
use crate::cuda::target::pad16;
use crate::cuda::tile_config::ping_pong;
use crate::cuda::writer::Writer;
use crate::mask_parts::MaskParts;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// The last visited tile's P V (pipelined kernels): the `wait` lines make
/// its V, in stage `v_stage`, visible to the tensor cores (async proxy)
/// first, the `done` lines follow it.
pub(super) fn write_last_pv(
    w: &mut Writer<String>,
    plan: &Plan,
    wait: &[&str],
    v_stage: &str,
    done: &[&str],
) -> fmt::Result {
    writeln!(w, "// The last visited tile's P V.")?;
    w.block(format_args!("if (pv_pending)"), |w| {
        for line in wait {
            writeln!(w, "{line}")?;
        }
        writeln!(w, "const unsigned v_smem = smem_addr(v_tiles + {v_stage} * V_TILE);")?;
        write_pv_waited(w, plan)?;
        done.iter().try_for_each(|line| writeln!(w, "{line}"))
    })
}

/// O += P V on the tensor cores, issued and waited for: O is the
/// warpgroup's again afterwards.
pub(super) fn write_pv_waited(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    writeln!(w, "wgmma_fence();")?;
    write_wgmma_pv(w, plan)?;
    writeln!(w, "wgmma_commit();")?;
    writeln!(w, "wgmma_wait<0>();")?;
    write_fence_accumulators(w, plan.row_sums)
}

/// Pins O (and the row sums on the tensor cores) after a wait for P V.
pub(super) fn write_fence_accumulators(w: &mut Writer<String>, sums: RowSums) -> fmt::Result {
    let row_sum = match sums {
        RowSums::Fadd => "",
        RowSums::TensorCores => " fence_operands(row_sum[mt]);",
    };
    writeln!(w, "#pragma unroll")?;
    writeln!(w, "for (int mt = 0; mt < M_TILES; ++mt) {{ fence_operands(o[mt]);{row_sum} }}")
}

/// Pins S after the wait for its products.
pub(super) fn write_fence_s(w: &mut Writer<String>) -> fmt::Result {
    writeln!(w, "#pragma unroll")?;
    writeln!(w, "for (int mt = 0; mt < M_TILES; ++mt) fence_operands(s[mt]);")
}

/// Issues and commits S = Q K^T on this warpgroup's 64 * M_TILES rows x
/// BLOCK_N keys (an m64 product per 64 rows), K from shared memory and Q
/// from there too or from its fragments ([`Plan::q_fragments`]), 32 bytes
/// of their rows a k-step.
pub(super) fn write_wgmma_s(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    write_wgmma_s_over(w, plan, plan.config.block_n, "BLOCK_N")
}

/// [`write_wgmma_s`] over a K tile of `n` keys, `rows` (its C name) a
/// panel.
pub(super) fn write_wgmma_s_over(w: &mut Writer<String>, plan: &Plan, n: u32, rows: &str) -> fmt::Result {
    let (q, wrapper, from) = match plan.q_fragments {
        true => ("qf[mt][kk]", "wgmma_rs_kb", "Q from its fragments, K from shared memory"),
        false => (
            "desc_plus_lo(gmma_desc(q_smem, 16, 1024), mt * 64 * 128 + panel * BLOCK_M * 128 + step)",
            plan.operands.s_wrapper(),
            "both operands from shared memory",
        ),
    };
    write!(
        w,
        "\
        \n\
        // S = Q K^T on this warpgroup's 64 * M_TILES rows x {rows} keys:\n\
        // {from}; the first k-step overwrites S.\n\
        float s[M_TILES][S_TILES][4];\n\
        wgmma_fence();\n\
        #pragma unroll\n\
        for (int mt = 0; mt < M_TILES; ++mt) {{\n\
        \x20   #pragma unroll\n\
        \x20   for (int kk = 0; kk < DP / {k_step}; ++kk) {{\n\
        \x20       const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
        \x20       {wrapper}_n{block_n}(s[mt], {q},\n\
        \x20                        desc_plus_lo(gmma_desc(k_smem, 16, 1024), panel * {rows} * 128 + step), kk);\n\
        \x20   }}\n\
        }}\n\
        wgmma_commit();\n",
        block_n = n,
        k_step = plan.operands.k_step(),
    )
}

/// Q's A fragments of this warp's rows, for S's products from registers
/// ([`Plan::q_fragments`]): loaded once per item, once Q has landed.
pub(super) fn write_q_fragments(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    if !plan.q_fragments {
        return Ok(());
    }
    write!(
        w,
        "\
        // Q's A fragments (m16n8k16 layout, a 16 x 16 block per k-step):\n\
        // S's products read only K from shared memory.\n\
        unsigned qf[M_TILES][DP / 16][4];\n\
        #pragma unroll\n\
        for (int mt = 0; mt < M_TILES; ++mt) {{\n\
        \x20   const int row = tile_row(warp, mt) + lane % 8 + lane / 8 % 2 * 8;\n\
        \x20   #pragma unroll\n\
        \x20   for (int kk = 0; kk < DP / 16; ++kk) {{\n\
        \x20       ldmatrix_x4(qf[mt][kk], smem_addr(q_tile + tile_offset<BLOCK_M, QK_COLS, true>(row, kk * 16 + lane / 16 * 8)));\n\
        \x20   }}\n\
        }}\n"
    )
}

/// One K/V tile of the wgmma kernel, back to back: S, the spec, the softmax
/// and P V, each product waited for before the next step.
pub(super) fn write_wgmma_serial_step(w: &mut Writer<String>, plan: &Plan, hoisted: &[Hoisted]) -> fmt::Result {
    let spec = plan.spec;
    write_wgmma_s(w, plan)?;
    if hoisted.iter().any(|h| h.level == Level::Column) {
        writeln!(w, "// While the tensor cores run: the tile's per-key spec terms.")?;
        write_key_terms(w, spec, hoisted, plan.key_terms)?;
    }
    writeln!(w, "wgmma_wait<0>();")?;
    write_fence_s(w)?;
    write_logits(w, spec, cta_selector(spec))?;
    write_softmax(w, plan.units, Rescale::Inline, plan.row_sums)?;
    write_dropout(w, plan)?;
    writeln!(w, "// O += P V: P from the S registers (pack_p), V from shared memory (MN-major).")?;
    writeln!(w, "unsigned p[M_TILES][BLOCK_N / 16][4];")?;
    writeln!(w, "#pragma unroll")?;
    writeln!(w, "{}", pack_loop(plan))?;
    write_pv_waited(w, plan)
}

/// One K/V tile of the warp-specialized wgmma kernel, software-pipelined:
/// S of tile j and P V of the previous tile are issued together, and O is
/// rescaled once P V is done. With the branch on the tile's class inside
/// the step, ptxas waits for P V where its arms meet, before the softmax.
/// Where [`splits_by_class`], interior tiles and the others each run a
/// whole step of their own instead: the interior tiles' step is straight
/// code from the products' issue to P V's wait, which ptxas schedules
/// freely.
pub(super) fn write_wgmma_step(w: &mut Writer<String>, plan: &Plan, hoisted: &[Hoisted]) -> fmt::Result {
    let spec = plan.spec;
    // The consumers have the tile's class from the producer (`tile`).
    let selector = "(tile / TILE_WHOLE & 3)";
    if !splits_by_class(spec) {
        return write_pipelined_tile(w, plan, hoisted, &|w| write_logits(w, spec, selector));
    }
    writeln!(w)?;
    w.block(format_args!("if (interior)"), |w| {
        write_pipelined_tile(w, plan, hoisted, &|w| {
            writeln!(w, "// Kept whole, every key present: the score alone.")?;
            write_interior_logits(w)
        })
    })?;
    w.block(format_args!("else"), |w| {
        write_pipelined_tile(w, plan, hoisted, &|w| {
            writeln!(w, "// The spec on every element of S (-inf where masked).")?;
            write_cut_logits(w)
        })
    })
}

/// Whether interior tiles get a step of their own: for specs without a
/// score whose mask is one part (full, causal, documents; the other
/// tiles' step then needs no selector, `write_cut_logits`). A score, or a
/// mask whose parts each get a logit of their own (windows, global tokens),
/// makes the step long enough that running it twice costs more than the
/// overlap gains.
pub(super) fn splits_by_class(spec: &Spec) -> bool {
    spec.score.is_none() && MaskParts::of(spec.mask.as_ref()).is_none()
}

/// [`write_wgmma_step`]'s tile, `logits` mapping S through the spec.
fn write_pipelined_tile(
    w: &mut Writer<String>,
    plan: &Plan,
    hoisted: &[Hoisted],
    logits: &dyn Fn(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    let (spec, config) = (plan.spec, plan.config);
    let ping_pong = ping_pong(config);
    if ping_pong {
        writeln!(w)?;
        writeln!(w, "named_barrier_sync(1 + warpgroup, 256);  // this warpgroup's turn on the tensor cores")?;
        trace::point(w, plan, Event::Turn)?;
    }
    write_wgmma_s(w, plan)?;
    let sums = plan.row_sums;
    let end_turn = |w: &mut Writer<String>| match ping_pong {
        true => {
            writeln!(w, "named_barrier_arrive(1 + (warpgroup + 1) % WARPGROUPS, 256);  // the next warpgroup's turn")
        }
        false => Ok(()),
    };
    // Once the products are issued, while the tensor cores run: the other
    // warpgroup's turn and the tile's per-key spec terms.
    let overlapped = |w: &mut Writer<String>| {
        end_turn(w)?;
        write_key_terms(w, spec, hoisted, plan.key_terms)
    };
    writeln!(w, "// Behind S, O += P V of the previous tile, in a group of its own (an")?;
    writeln!(w, "// empty group would become a dummy wgmma); then wait for S alone. ptxas")?;
    writeln!(w, "// checks each path on its own, so each branch fences, commits and waits")?;
    writeln!(w, "// itself: anything less serializes every wgmma of the kernel (C7514/C7519).")?;
    w.block(format_args!("if (pv_pending)"), |w| {
        writeln!(w, "wgmma_fence();")?;
        write_wgmma_pv(w, plan)?;
        writeln!(w, "wgmma_commit();")?;
        overlapped(w)?;
        writeln!(w, "wgmma_wait<1>();")
    })?;
    w.block(format_args!("else"), |w| {
        overlapped(w)?;
        writeln!(w, "wgmma_wait<0>();")
    })?;
    write_fence_s(w)?;
    trace::point(w, plan, Event::SDone)?;
    writeln!(w, "if (lane == 0) mbar_arrive(k_empty + 8 * stage);  // S is done with this K")?;
    logits(w)?;
    write_softmax(w, plan.units, Rescale::Deferred, sums)?;
    write_dropout(w, plan)?;
    trace::point(w, plan, Event::SMax)?;
    writeln!(w, "wgmma_wait<0>();  // P V is done: O and p are this warpgroup's again")?;
    trace::point(w, plan, Event::PvDone)?;
    write_fence_accumulators(w, sums)?;
    writeln!(w, "if (pv_pending && lane == 0) mbar_arrive(v_empty + 8 * v_stage);  // and with its V")?;
    let row_sum = match sums {
        RowSums::Fadd => "",
        RowSums::TensorCores => {
            "\x20       row_sum[mt][0][2 * r] *= alpha[i];\n\
                                 \x20       row_sum[mt][0][2 * r + 1] *= alpha[i];\n"
        }
    };
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   if (alpha[i] != 1.0f) {{\n\
        \x20       #pragma unroll\n\
        \x20       for (int n = 0; n < O_TILES; ++n) {{\n\
        \x20           o[mt][n][2 * r] *= alpha[i];\n\
        \x20           o[mt][n][2 * r + 1] *= alpha[i];\n\
        \x20       }}\n\
        {row_sum}\
        \x20   }}\n\
        }}\n\
        #pragma unroll\n\
        {pack}\n\
        pv_pending = true;\n",
        pack = pack_loop(plan)
    )?;
    trace::point(w, plan, Event::TileEnd)
}

/// Issues O += P V on the tensor cores (P from the registers `p`, V
/// MN-major from `v_smem`; e4m3's K-major, see `e4m3`), uncommitted. wgmma
/// reads P asynchronously, so all of it stays live until its group is
/// waited for.
pub(super) fn write_wgmma_pv(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    if plan.operands == Operands::E4m3 {
        return write_pv_e4m3(w, plan.spec);
    }
    write_wgmma_pv_over(w, plan, "BLOCK_N")
}

/// [`write_wgmma_pv`] on 16-bit operands over a V tile of `rows` keys (its
/// C name), a panel.
pub(super) fn write_wgmma_pv_over(w: &mut Writer<String>, plan: &Plan, rows: &str) -> fmt::Result {
    let row_sums = match plan.row_sums {
        RowSums::Fadd => "",
        RowSums::TensorCores => "\x20       wgmma_rs_n8(row_sum[mt], p[mt][kk], ones);  // and the row sums\n",
    };
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int kk = 0; kk < {rows} / 16; ++kk) {{\n\
        \x20   #pragma unroll\n\
        \x20   for (int mt = 0; mt < M_TILES; ++mt) {{\n\
        \x20       wgmma_rs_n{dvp}(o[mt], p[mt][kk], desc_plus_lo(gmma_desc(v_smem, {rows} * 128, 1024), kk * 16 * 128));\n\
        {row_sums}\
        \x20   }}\n\
        }}\n",
        dvp = pad16(plan.spec.head_dims.v)
    )
}

/// The loop packing P from the S accumulators into the registers `p`, a
/// wgmma k-step each.
fn pack_loop(plan: &Plan) -> String {
    match plan.operands {
        Operands::Sixteen => "\
            for (int mt = 0; mt < M_TILES; ++mt) {\n\
            \x20   #pragma unroll\n\
            \x20   for (int kk = 0; kk < BLOCK_N / 16; ++kk) pack_p(storage{}, p[mt][kk], s[mt], kk);\n\
            }"
        .into(),
        Operands::E4m3 => "for (int kk = 0; kk < BLOCK_N / 32; ++kk) pack_p_e4m3(p[0][kk], s[0], kk);".into(),
    }
}
