//! The producer warpgroup of the Hopper dK/dV kernel: K and V once, then
//! the walk over the visited query steps, filling the stage ring, and the
//! bulk additions of each step's dQ tile.

use crate::abi::{ArgKind, Axis, Operand};
use crate::cuda::backward::common::{write_tile_walk, Walk};
use crate::cuda::backward::dkdv::write_key_unit;
use crate::cuda::backward::packing::Packing;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::{DELTA, DOUT_MAP, DQ_ACCUM, DQ_TICKETS, K_MAP, Q_MAP, V_MAP};
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

use super::query_terms::QueryTerms;
use super::{adder_warp_walks, units, DqSplit, Layout, DQT_GROUP_ROWS, TMA_COPIERS};
/// What the producer's code is written from: the spec, the kernel's layout,
/// how it copies and packs operands, and the per-query terms it stages.
pub(super) struct Producer<'a> {
    pub spec: &'a Spec,
    pub layout: &'a Layout,
    pub copy: TileCopy,
    pub packing: Packing,
    pub query_terms: &'a QueryTerms<'a, 'a>,
    /// Whether the CTA is persistent (`Layout::persistent`).
    pub units: bool,
}

impl Producer<'_> {
    /// Whether the dQ accumulator has tickets (`DqAccum::has_tickets`).
    fn tickets(&self) -> bool {
        self.layout.dq_accum().has_tickets(self.spec)
    }
}

/// The producer warpgroup: K and V once, then per visited step its Q and dO
/// tiles and statistics into the next stage, and the previous step's dQ
/// tile into the accumulator; it ends with `return`.
pub(super) fn write(w: &mut Writer<String>, p: &Producer) -> fmt::Result {
    let Producer { spec, layout, copy, packing, .. } = *p;
    // Who copies and who adds dQ (see the comment written below). Under a
    // data-dependent mask the walk tests tiles a warp at a time (see
    // `write_tile_walk`), so the adder's whole warp walks: the walk needs
    // every lane. Elsewhere the lone lane walks (a whole warp walking was
    // slower under causal masks).
    let tma_copiers = TMA_COPIERS.to_string();
    let (roles, copiers, count, adder) = match copy {
        TileCopy::Tma => (
            "// The first two warps copy (the leader issues TMA) and store statistics; the\n\
             // last warp's first lane adds each visited step's dQ tiles to the accumulator\n",
            "warp < WARPS + 2",
            tma_copiers.as_str(),
            "warp == WARPS + 3 && lane == 0",
        ),
        TileCopy::Threads => (
            "// All four warps copy; the leader, between its copies, adds each visited\n\
             // step's dQ tiles to the accumulator\n",
            "true",
            "PRODUCER_THREADS",
            "leader",
        ),
    };
    let keep = match (copy, adder_warp_walks(spec)) {
        (TileCopy::Threads, _) => String::new(),
        (TileCopy::Tma, true) => {
            format!(
                "if (!copies && !({DQ_ACCUM} != nullptr && warp == WARPS + 3)) return;  // the adder's warp walks\n"
            )
        }
        (TileCopy::Tma, false) => "if (!copies && !adds_dq) return;\n".to_string(),
    };
    write!(
        w,
        "\
        const bool leader = threadIdx.x == THREADS;  // publishes the walk's words\n\
        {roles}\
        // once the consumers have stored it, a step late (the visit of the next step,\n\
        // or the end, names it). Each walks the tiles itself.\n\
        const bool copies = {copiers};\n\
        constexpr int COPIERS = {count};\n\
        const bool adds_dq = {DQ_ACCUM} != nullptr && {adder};\n\
        {keep}\
        float* dq_last = nullptr;  // the last visited step's first accumulator tile\n\
        unsigned dq_last_seen = 0;  // its ticket's value before this CTA's visit (`add_dq`)\n\
        int dq_last_bytes = 0;  // and the bytes of its tiles\n"
    )?;
    write_add_dq(w, p.tickets())?;
    if p.units {
        w.block(format_args!("for (int u = 0;; ++u)"), |w| {
            units::write_claim(w, spec, layout)?;
            write_key_unit(w, spec)?;
            write_unit_walk(w, p)
        })?;
    } else {
        write_kv_loads(w, spec, copy, packing.tma_seq(Operand::K), layout.k_half_cols().is_some())?;
        write_walk(w, p)?;
        // With TMA the leader also publishes for the copies it issued.
        let publish = match copy {
            TileCopy::Tma => "if (leader) ",
            TileCopy::Threads => "",
        };
        write!(
            w,
            "\
            int j = seek(0);\n\
            if (leader) first_head = j < q_steps ? h : -1;\n\
            {publish}mbar_arrive(kv_full);\n"
        )?;
        w.block(format_args!("while (j < q_steps)"), |w| write_step(w, p))?;
    }
    w.block(format_args!("if (dq_last != nullptr)"), |w| {
        writeln!(w, "add_dq(dq_last, dq_last_seen, it - 1, dq_last_bytes);")?;
        writeln!(w, "bulk_wait_read<0>();  // shared memory outlives the reads; the adds land by the kernel's end")
    })?;
    if copy == TileCopy::Threads {
        writeln!(w, "cp_async_wait_all();  // no copy outlives its thread")?;
    }
    writeln!(w, "return;")
}

/// The walk over the query heads of the CTA's group and their tiles:
/// `seek(j)`, the first visited tile from tile j of head h on.
fn write_walk(w: &mut Writer<String>, p: &Producer) -> fmt::Result {
    let q_len = arg_name(p.spec, ArgKind::QLen);
    write!(
        w,
        "\
        // The walk over every query head of the group in turn: its lambdas read the\n\
        // head h, and seek(j) is the first visited tile from tile j of head h on,\n\
        // moving h along (q_steps past the group's last head).\n\
        int h = kv_head * group;\n"
    )?;
    write_tile_walk(w, p.spec, &Walk { axis: "q", tiles: "q_steps", size: "BLOCK_M", len: &q_len })?;
    write!(
        w,
        "\
        auto seek = [&](int j) {{\n\
        \x20   for (;;) {{\n\
        \x20       j = next_tile(j);\n\
        \x20       if (j < q_steps || h + 1 == (kv_head + 1) * group) return j;\n\
        \x20       ++h;\n\
        \x20       j = 0;\n\
        \x20   }}\n\
        }};\n"
    )
}

/// A persistent CTA's unit: the walk, with the unit's K and V copied (by the
/// leader, TMA) once its first step's tiles are on their way and the
/// consumers have freed the last unit's: the ring meanwhile fills with the
/// unit's first steps while the consumers store the last unit's dK and dV.
fn write_unit_walk(w: &mut Writer<String>, p: &Producer) -> fmt::Result {
    let Producer { spec, layout, packing, .. } = *p;
    write_walk(w, p)?;
    write!(
        w,
        "\
        int j = seek(0);\n\
        // The unit's first visited head, in the slot of its parity: the consumers read\n\
        // the slot's last word (two units back) before they freed that unit's K and V,\n\
        // which the leader has waited for.\n\
        if (leader) first_head[u % 2] = j < q_steps ? h : -1;\n\
        // K and V once the consumers have freed the last unit's.\n\
        auto load_kv = [&] {{\n\
        \x20   if (!leader) return;\n\
        \x20   mbar_wait(kv_empty, (u + 1) % 2);\n"
    )?;
    w.indented(|w| {
        write_kv_loads(w, spec, TileCopy::Tma, packing.tma_seq(Operand::K), layout.k_half_cols().is_some())
    })?;
    write!(
        w,
        "\
        \x20   mbar_arrive(kv_full);\n\
        }};\n\
        bool kv_loaded = false;\n"
    )?;
    w.block(format_args!("while (j < q_steps)"), |w| {
        write_step(w, p)?;
        writeln!(w, "if (!kv_loaded) load_kv();  // behind the unit's first step")?;
        writeln!(w, "kv_loaded = true;")
    })?;
    writeln!(w, "if (!kv_loaded) load_kv();  // a unit without steps: its dK and dV are zeros")
}

/// The adding thread's part of a visited step: the previous step's dQ tiles
/// into the accumulator, then this step's place there (and its ticket).
fn write_dq_step(w: &mut Writer<String>, p: &Producer) -> fmt::Result {
    let Producer { spec, layout, packing, .. } = *p;
    let q_len = arg_name(spec, ArgKind::QLen);
    writeln!(w, "if (dq_last != nullptr) add_dq(dq_last, dq_last_seen, it - 1, dq_last_bytes);")?;
    let head_tiles = format!("(({q_len} + DQ_ROWS - 1) / DQ_ROWS)");
    let first_tile = packing.accum_first_tile(spec, "step_h", &head_tiles);
    writeln!(w, "const long long first_tile = {first_tile};")?;
    match layout.dq_split() {
        DqSplit::Columns | DqSplit::Rows => {
            writeln!(w, "dq_last = {DQ_ACCUM} + (first_tile + step_j * (BLOCK_M / DQ_ROWS)) * (DQ_ROWS * DP);")?;
            writeln!(w, "// A step's last tiles may lie past the queries (128-query steps): not added.")?;
            writeln!(w, "const int dq_rows = min_i32(BLOCK_M, {q_len} - step_j * BLOCK_M);")?;
            writeln!(w, "dq_last_bytes = (dq_rows + DQ_ROWS - 1) / DQ_ROWS * DQ_ROWS * DP * 4;")?;
        }
        DqSplit::HeadDims => {
            // The accumulator's tiles are contiguous: a step's rows start
            // inside one and may end in the next.
            let group = DQT_GROUP_ROWS;
            writeln!(w, "dq_last = {DQ_ACCUM} + first_tile * (DQ_ROWS * DP) + (long long)step_j * DQ_TILE;")?;
            writeln!(w, "// A step's last {group}-query groups may lie past the queries: not added.")?;
            writeln!(w, "const int dq_rows = min_i32(BLOCK_M, {q_len} - step_j * BLOCK_M);")?;
            writeln!(w, "dq_last_bytes = (dq_rows + {group} - 1) / {group} * {group} * DP * 4;")?;
        }
    }
    if p.tickets() {
        writeln!(w, "if ({DQ_TICKETS} != nullptr) dq_last_seen = dq_ticket_take(dq_ticket(dq_last));")?;
    }
    Ok(())
}

/// `add_dq(dst, seen, s, bytes)`, the adding thread's bulk addition of step
/// s's dQ tiles; with `tickets` (`DqAccum::has_tickets`) also `dq_ticket`.
fn write_add_dq(w: &mut Writer<String>, tickets: bool) -> fmt::Result {
    let (wait, issue, mark) = match tickets {
        false => (String::new(), "bulk_reduce_add(dst, src, bytes);\n", ""),
        true => {
            writeln!(w, "// A step's ticket: that of the accumulator tile its first row lies in.")?;
            writeln!(
                w,
                "auto dq_ticket = [&](const float* dst) {{ return {DQ_TICKETS} + (dst - {DQ_ACCUM}) / (DQ_ROWS * DP); }};"
            )?;
            (
                format!(
                    "\
                    // With tickets (the step's taken at its visit, `seen` its value then) the\n\
                    // first CTA to visit the step stores its tiles instead and marks them\n\
                    // stored once they have landed; the others wait for that mark before their\n\
                    // tiles are ready, so that the wait overlaps their consumers' work.\n\
                    unsigned* ticket = {DQ_TICKETS} != nullptr ? dq_ticket(dst) : nullptr;\n\
                    const bool first = ticket != nullptr && seen == 0;\n\
                    if (ticket != nullptr && !first) dq_ticket_wait_stored(ticket, seen);\n"
                ),
                "\
                if (first) bulk_store(dst, src, bytes);\n\
                else bulk_reduce_add(dst, src, bytes);\n",
                "\
                if (first) {\n\
                \x20   bulk_wait<0>();\n\
                \x20   dq_ticket_mark_stored(ticket);\n\
                }\n",
            )
        }
    };
    writeln!(w, "// Adds step s's dQ tiles, `bytes` of them (none past the queries).")?;
    writeln!(w, "auto add_dq = [&](float* dst, [[maybe_unused]] unsigned seen, int s, int bytes) {{")?;
    w.indented(|w| {
        write!(
            w,
            "\
            {wait}\
            mbar_wait(dq_full + 8 * (s % DQ_BUFS), s / DQ_BUFS % 2);\n\
            const unsigned src = smem_addr(dq_tiles + s % DQ_BUFS * DQ_TILE);\n\
            {issue}\
            bulk_commit();\n\
            // All but the last DQ_BUFS - 1 additions have read their tiles: free the oldest.\n\
            bulk_wait_read<DQ_BUFS - 1>();\n\
            const int read = s - (DQ_BUFS - 1);\n\
            if (read >= 0) mbar_arrive(dq_empty + 8 * (read % DQ_BUFS));\n\
            {mark}"
        )
    })?;
    writeln!(w, "}};")
}

/// The CTA's K and V tiles (and K's upper half copied where `k_half`),
/// once, completing `kv_full`; with TMA, at batch row or sequence `seq`.
fn write_kv_loads(w: &mut Writer<String>, spec: &Spec, copy: TileCopy, seq: &str, k_half: bool) -> fmt::Result {
    let kv_len = arg_name(spec, ArgKind::KvLen);
    let [k_stride, v_stride] = [Operand::K, Operand::V].map(|op| arg_name(spec, ArgKind::Stride(op, Axis::Seq)));
    match copy {
        TileCopy::Tma => {
            writeln!(w, "if (leader) {{")?;
            writeln!(w, "    tma_load_tile<BLOCK_N, DPC>(k_tile, {K_MAP}, kv_full, k0, kv_head, {seq});")?;
            writeln!(w, "    tma_load_tile<BLOCK_N, DVPC>(v_tile, {V_MAP}, kv_full, k0, kv_head, {seq});")?;
            if k_half {
                writeln!(w, "    mbar_arrive_expect_tx(kv_full, BLOCK_N * K_HALF_COLS * 2);")?;
                writeln!(w, "    for (int p = 0; p < K_HALF_COLS / 64; ++p) {{")?;
                writeln!(
                    w,
                    "        tma_load(smem_addr(k_half_tile + p * BLOCK_N * 64), {K_MAP}, kv_full, DP / 2 + p * 64, k0, kv_head, {seq});"
                )?;
                writeln!(w, "    }}")?;
            }
            writeln!(w, "}}")?;
        }
        TileCopy::Threads => {
            let rows = |tile: &str, cols: &str, width: &str, src: &str, stride: &str| {
                format!(
                    "load_tile<BLOCK_N, {cols}, {width}, PRODUCER_THREADS, true, THREADS>({tile}, {src} + (long long)k0 * \
                     {stride}, {stride}, {kv_len} - k0, kv_vector);"
                )
            };
            writeln!(w, "{}", rows("k_tile", "DPC", "D", "k_rows", &k_stride))?;
            writeln!(w, "{}", rows("v_tile", "DVPC", "DV", "v_rows", &v_stride))?;
            if k_half {
                writeln!(w, "{}", rows("k_half_tile", "K_HALF_COLS", "D - DP / 2", "k_rows + DP / 2", &k_stride))?;
            }
            writeln!(w, "mbar_arrive_loaded<COPY_WIDTH>(kv_full, kv_vector);")?;
        }
    }
    Ok(())
}

/// One visited step of the producer's walk: the step's Q and dO tiles and
/// statistics into the next stage, its words for the consumers, and the
/// previous step's dQ tile into the accumulator.
fn write_step(w: &mut Writer<String>, p: &Producer) -> fmt::Result {
    let Producer { spec, copy, packing, query_terms, .. } = *p;
    let n = |kind| arg_name(spec, kind);
    let [q_len, lse] = [ArgKind::QLen, ArgKind::Lse].map(n);
    let statistic_row = packing.statistic_row(spec, "step_h");
    let [q_stride, do_stride] = [Operand::Q, Operand::DO].map(|op| n(ArgKind::Stride(op, Axis::Seq)));
    writeln!(w, "// Step `it` is tile j of head h.")?;
    writeln!(w, "const int step_h = h, step_j = j, stage = it % STAGES;")?;
    writeln!(w, "const bool full = tile_full(j);")?;
    w.block(format_args!("if (copies)"), |w| {
        if copy == TileCopy::Threads {
            packing.write_rows(w, spec, Operand::Q, "q_rows", "step_h")?;
            packing.write_rows(w, spec, Operand::DO, "dout_rows", "step_h")?;
            writeln!(w, "const bool q_vector = aligned16(q_rows, {q_stride}) && aligned16(dout_rows, {do_stride});")?;
        }
        write!(
            w,
            "\
            const float* lse_row = {lse} + {statistic_row};\n\
            const float* delta_row = {DELTA} + {statistic_row};\n\
            const int q0 = step_j * BLOCK_M;\n\
            // The statistics, LSE to log2 units: a fully masked row (LSE = -inf) or\n\
            // one past q_len gets +inf, so P = 0. Read before the stage is free,\n\
            // so that their latency hides behind the wait; rows r + i * COPIERS.\n\
            constexpr int STAT_ROWS = (BLOCK_M + COPIERS - 1) / COPIERS;\n\
            float l[STAT_ROWS], d[STAT_ROWS];\n\
            #pragma unroll\n\
            for (int i = 0; i < STAT_ROWS; ++i) {{\n\
            \x20   const int r = threadIdx.x - THREADS + i * COPIERS;\n\
            \x20   const bool valid = r < BLOCK_M && q0 + r < {q_len};\n\
            \x20   l[i] = valid ? lse_row[q0 + r] : neg_inf();\n\
            \x20   d[i] = valid ? delta_row[q0 + r] : 0.0f;\n\
            }}\n"
        )?;
        query_terms.write_loads(w)?;
        writeln!(w, "mbar_wait(stage_empty + 8 * stage, (it / STAGES + 1) % 2);")?;
        match copy {
            TileCopy::Tma => write!(
                w,
                "\
                if (leader) {{\n\
                \x20   tma_load_tile<BLOCK_M, DPC>(q_tiles + stage * Q_TILE, {Q_MAP}, stage_full + 8 * stage, q0, step_h, {seq});\n\
                \x20   tma_load_tile<BLOCK_M, DVPC>(dout_tiles + stage * DO_TILE, {DOUT_MAP}, stage_full + 8 * stage, q0, step_h, {seq});\n\
                }}\n",
                seq = packing.tma_seq(Operand::Q)
            )?,
            TileCopy::Threads => write!(
                w,
                "\
                load_tile<BLOCK_M, DPC, D, PRODUCER_THREADS, true, THREADS>(q_tiles + stage * Q_TILE, q_rows + (long long)q0 * {q_stride}, {q_stride}, {q_len} - q0, q_vector);\n\
                load_tile<BLOCK_M, DVPC, DV, PRODUCER_THREADS, true, THREADS>(dout_tiles + stage * DO_TILE, dout_rows + (long long)q0 * {do_stride}, {do_stride}, {q_len} - q0, q_vector);\n\
                mbar_arrive_loaded<COPY_WIDTH>(stage_full + 8 * stage, q_vector);\n"
            )?,
        }
        write!(
            w,
            "\
            #pragma unroll\n\
            for (int i = 0; i < STAT_ROWS; ++i) {{\n\
            \x20   const int r = threadIdx.x - THREADS + i * COPIERS;\n\
            \x20   if (r < BLOCK_M) {{\n\
            \x20       lse_cols[stage * BLOCK_M + r] = l[i] == neg_inf() ? -neg_inf() : l[i] * LOG2E;\n\
            \x20       delta_cols[stage * BLOCK_M + r] = d[i];\n\
            \x20   }}\n\
            }}\n"
        )?;
        query_terms.write_stores(w)
    })?;
    writeln!(w, "j = seek(j + 1);  // the next step, whose head the stage's words name")?;
    w.block(format_args!("if (copies)"), |w| {
        w.block(format_args!("if (leader)"), |w| {
            writeln!(w, "step_tile[stage] = step_j << 1 | (full ? 1 : 0);")?;
            writeln!(w, "step_next[stage] = j < q_steps ? h : -1;")
        })?;
        writeln!(w, "mbar_arrive(stage_full + 8 * stage);")
    })?;
    w.block(format_args!("if (adds_dq)"), |w| write_dq_step(w, p))?;
    writeln!(w, "++it;")
}
