//! The dK/dV kernel on Hopper's warpgroup MMA (sm_90a), warp-specialized
//! like the forward's 128-key kernel (FlashAttention-3's backward).
//!
//! A CTA owns 128 keys: two consumer warpgroups of 64 keys each, plus a
//! producer warpgroup that copies this CTA's K and V once and then each
//! visited query step's Q, dO and statistics into a two-stage ring
//! (`library/ring.cuh`: full/empty `mbarrier`s; `setmaxnreg` gives the consumers
//! 240 registers). Per step a consumer warpgroup computes, keys as rows:
//!
//! - Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, both operands from shared memory (K-major);
//! - P and dS on its registers, the same element code as the `mma.sync`
//!   kernel (`step::write_elements`: the accumulator layouts agree), with
//!   the logit of a tile the mask keeps whole (every key present) free of
//!   mask and bounds; without a score mod P is computed, and dV issued,
//!   while dPᵀ is still on the tensor cores;
//! - dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ and dSᵀ as register A operands,
//!   dO and Q MN-major from the stage, into accumulators that live for the
//!   whole kernel (64 + 64 registers at d = 128);
//! - dS itself (queries as rows) into shared memory by `stmatrix.trans`, and
//!   once both warpgroups' halves are there (a named barrier),
//!   dQ = dS·K for its half of dQ's columns, added to the f32 accumulator:
//!   stored to one of two shared tiles in fragment order (conflict-free
//!   16-byte stores) that one producer thread adds to global memory with a
//!   single bulk reduction (`cp.reduce.async.bulk`), as FlashAttention-3
//!   does: the consumers issue no global atomics.
//!
//! The element code, spec lambdas, tile walk and epilogue are the
//! `mma.sync` kernel's (`dkdv.rs`); only the products and the data movement
//! differ, and only the producer walks: with each stage it writes the step's
//! query tile and class and the next step's head, which the consumers read
//! behind the stage's full barrier.

use super::common::dropout_kind;
use super::common::{
    write_column_terms, write_row_terms, write_source, write_spec_lambdas, write_tile_walk, Rows, Sections, SpecTerms,
    Walk,
};
use super::dkdv::{write_head_grad_adds, write_head_grad_sums, write_key_cta, write_key_stores, write_key_tiles};
use super::packing::Packing;
use super::step::{write_elements, write_split_elements, Part};
use super::{BackwardConfig, KeyColumns};
use crate::abi::{ArgKind, Axis, Grid, Kernel, Operand};
use crate::cuda::kit::hoist::{hoist, Hoisted};
use crate::cuda::kit::terms::interior_decl;
use crate::cuda::kit::warp_roles::write_roles;
use crate::cuda::library;
use crate::cuda::library::wgmma_ops::AFrom;
use crate::cuda::signature::names::{DELTA, DOUT_MAP, DQ_ACCUM, K_MAP, Q_MAP, V_MAP};
use crate::cuda::signature::with_dropout;
use crate::cuda::signature::{arg_name, backward_args, with_tensor_maps};
use crate::cuda::source::kernel_name;
use crate::cuda::source::Piece;
use crate::cuda::target::{pad16, Target};
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const OPERANDS: [Operand; 6] = [Operand::Q, Operand::K, Operand::V, Operand::DO, Operand::DK, Operand::DV];

/// Q/dO stages of the ring.
const STAGES: u32 = 2;

/// Consumer warps: two warpgroups of 64 keys, so 128 keys per CTA.
pub(super) const WARPS: u32 = 8;

/// Keys per CTA.
pub(super) const BLOCK_N: u32 = 16 * WARPS;

/// Queries per step: with 64 keys per warpgroup, Sᵀ and dPᵀ (32 registers
/// each) fit next to dK and dV (64 each at d = 128) in 240 registers.
pub(super) const BLOCK_M: u32 = 64;
// The CPU twin (`crate::varlen::dq_accum_tile`) places tiles of this
// kernel's steps.
const _: () = assert!(BLOCK_M as i32 == crate::varlen::DQ_TILE_ROWS);

/// Whether this kernel covers `spec`'s head dims: Q/K and V pad alike, to
/// 64 through 128 (the dK and dV accumulators fill the registers at 128),
/// where its tiles fit shared memory (not at 112).
pub(super) fn supports(spec: &Spec) -> bool {
    let hopper = Target::HOPPER;
    let dp = pad16(spec.head_dims.qk);
    dp == pad16(spec.head_dims.v)
        && (64..=128).contains(&dp)
        && smem_bytes(spec) + STATIC_SMEM <= hopper.smem_per_sm - hopper.smem_reserved_per_cta
}

/// Columns of a shared tile of head dim `d`: whole 64-column panels (wgmma's
/// 128-byte swizzle), zero beyond `d`.
fn tile_cols(d: u32) -> u32 {
    pad16(d).next_multiple_of(64)
}

/// Columns of the upper half of K's (the second warpgroup's dQ columns)
/// copied again into a panel of their own, where they start inside a panel
/// and cross into the next (head dims 80 and 96): a wgmma's MN-major operand
/// must not. `None` where they start at a panel (128) or end in it (64).
fn k_half_cols(spec: &Spec) -> Option<u32> {
    let half = pad16(spec.head_dims.qk) / 2;
    (!half.is_multiple_of(64) && half % 64 + half > 64).then_some(half.next_multiple_of(64))
}

/// Threads of the producer warpgroup.
const PRODUCER_THREADS: u32 = 128;

/// The kernel in `config` (its `tensor_grads`, `copy` and `dropout`).
pub(super) fn emit(spec: &Spec, config: BackwardConfig, packing: Packing) -> Kernel {
    let BackwardConfig { tensor_grads, copy, dropout, .. } = config;
    let name = kernel_name(&packing.prefix(&dropout_kind("bwd", dropout)), spec);
    let terms = SpecTerms::new(spec, tensor_grads, dropout);
    let slots: Vec<usize> = terms.grads.iter().map(|(slot, ..)| *slot).collect();
    let args = packing.args(spec, backward_args(spec, OPERANDS, &slots));
    let args = match copy {
        TileCopy::Tma => with_tensor_maps(spec, args, &[Operand::Q, Operand::K, Operand::V, Operand::DO]),
        TileCopy::Threads => args,
    };
    let args = with_dropout(spec, args, dropout);
    let source = write_source(
        spec,
        Sections::Hopper(hopper_library(spec, copy)),
        &name,
        &args,
        |w| write_config(w, spec),
        |w| write_body(w, spec, &terms, copy, packing),
    );
    Kernel {
        name,
        source,
        grid: Grid::KeyTiles,
        block_m: BLOCK_M,
        block_n: BLOCK_N,
        threads: 32 * WARPS + PRODUCER_THREADS,
        dynamic_smem: smem_bytes(spec),
        args,
    }
}

/// K and V of the CTA's keys, STAGES stages of Q, dO and two statistics per
/// query, two dS tiles, two steps' f32 dQ, the upper half of K again where
/// `k_half_cols` says, and the slack that aligns them to 1024 bytes (226 KB
/// in all at d = 128 and 96, just under Hopper's 227).
fn smem_bytes(spec: &Spec) -> u32 {
    let (dp, dpc, dvpc) = (pad16(spec.head_dims.qk), tile_cols(spec.head_dims.qk), tile_cols(spec.head_dims.v));
    let (m, n) = (BLOCK_M, 16 * WARPS);
    let k_half = n * k_half_cols(spec).unwrap_or(0);
    2 * (n * (dpc + dvpc) + STAGES * m * (dpc + dvpc) + 2 * m * n + k_half) + 4 * (2 * STAGES * m + 2 * m * dp) + 1024
}

/// Static shared memory beside it: the ring's barriers and the walk's words.
const STATIC_SMEM: u32 = 8 * (1 + 2 * STAGES + 4) + 4 * (1 + 2 * STAGES);

/// The warpgroup MMA and stage-ring library sections and the products
/// this kernel issues: m64 by BLOCK_M (Sᵀ, dPᵀ), by DP / 2 (a warpgroup's
/// dQ columns), by DP and DVP (dK, dV).
fn hopper_library(spec: &Spec, copy: TileCopy) -> Vec<Vec<Piece>> {
    let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
    let mut wgmma = vec![
        Piece::Part(library::Part::Wgmma),
        Piece::Wgmma(BLOCK_M, AFrom::Shared),
        Piece::Wgmma(dp / 2, AFrom::SharedMnB),
        Piece::Wgmma(dp, AFrom::Registers),
    ];
    if dvp != dp {
        wgmma.push(Piece::Wgmma(dvp, AFrom::Registers));
    }
    wgmma.extend([Piece::Part(library::Part::HopperBackward), Piece::Part(library::Part::DqFragments)]);
    let mut sections = vec![wgmma, vec![Piece::Part(library::Part::Ring)]];
    if copy == TileCopy::Tma {
        sections.push(vec![Piece::Part(library::Part::Tma)]);
    }
    sections
}

fn write_config(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let (warps, block_m) = (WARPS, BLOCK_M);
    let [dpc, dvpc] = [spec.head_dims.qk, spec.head_dims.v].map(tile_cols);
    write!(
        w,
        "\
        constexpr int WARPS = {warps};  // the consumer warps: two warpgroups of 64 keys\n\
        constexpr int THREADS = 32 * WARPS;  // the threads that multiply\n\
        // Warp specialization: one more warpgroup copies K, V and the query steps'\n\
        // tiles into a ring of STAGES stages (see the stage ring above) and hands\n\
        // most of its registers to the two that multiply (24 + 2 x 240).\n\
        constexpr int PRODUCER_THREADS = {PRODUCER_THREADS};\n\
        constexpr int CTA_THREADS = THREADS + PRODUCER_THREADS;\n\
        constexpr int PRODUCER_REGS = 24;\n\
        constexpr int CONSUMER_REGS = 240;\n\
        constexpr int STAGES = {STAGES};  // Q/dO stages of the ring\n\
        constexpr int BLOCK_N = 16 * WARPS;  // keys per CTA: grid.x = ceil(kv_len / BLOCK_N)\n\
        constexpr int BLOCK_M = {block_m};  // queries per step of the loop\n\
        constexpr int DPC = {dpc}, DVPC = {dvpc};  // tile columns: whole 64-column panels\n\
        constexpr int DQ_TILES = DP / 16;  // m16n8 tiles of a warp's dQ: its warpgroup's half of the columns\n\
        constexpr int DQ_TILE = BLOCK_M * DP;  // f32 of a step's dQ accumulator tile\n\
        // Whether any tile copy may use cp.async (see mbar_arrive_loaded).\n\
        constexpr int COPY_WIDTH = D % 8 == 0 || DV % 8 == 0 ? 8 : 1;\n"
    )?;
    if let Some(cols) = k_half_cols(spec) {
        writeln!(w, "constexpr int K_HALF_COLS = {cols};  // the second copy of K's upper half")?;
    }
    write_key_tiles(
        w,
        spec,
        "\
        // Shared memory, every tile in wgmma's 64-column panels: this CTA's K and V;\n\
        // STAGES stages of a step's Q and dO tiles and two statistics per query; two\n\
        // dS tiles (queries as rows: the A operand of dQ = dS K); two steps' dQ; with\n\
        // K_HALF_COLS, the upper half of K's columns again, from a panel's start.\n",
        ["DPC", "DVPC"],
        KeyColumns::Whole,
    )
}

fn write_body(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms, copy: TileCopy, packing: Packing) -> fmt::Result {
    write!(
        w,
        "\
        // wgmma's swizzle atoms are 1024-byte aligned; the launch reserves the slack.\n\
        extern __shared__ __align__(1024) unsigned char smem_raw[];\n\
        unsigned short* smem = (unsigned short*)(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);\n\
        unsigned short* k_tile = smem;  // [BLOCK_N][DPC], for every step\n\
        unsigned short* v_tile = k_tile + K_TILE;  // [BLOCK_N][DVPC]\n\
        unsigned short* q_tiles = v_tile + V_TILE;  // [STAGES][BLOCK_M][DPC]\n\
        unsigned short* dout_tiles = q_tiles + STAGES * Q_TILE;  // [STAGES][BLOCK_M][DVPC]\n\
        unsigned short* ds_tiles = dout_tiles + STAGES * DO_TILE;  // [2][BLOCK_M][BLOCK_N]: dS, for dQ\n\
        float* lse_cols = (float*)(ds_tiles + 2 * DS_TILE);  // [STAGES][BLOCK_M]: LSE in log2 units, +inf for no gradient\n\
        float* delta_cols = lse_cols + STAGES * BLOCK_M;  // [STAGES][BLOCK_M]: D = rowsum(dO * O)\n\
        float* dq_tiles = delta_cols + STAGES * BLOCK_M;  // [2][DQ_TILE]: step it's dQ in it % 2, for the bulk reduction\n"
    )?;
    if k_half_cols(spec).is_some() {
        writeln!(
            w,
            "unsigned short* k_half_tile = (unsigned short*)(dq_tiles + 2 * DQ_TILE);  // [BLOCK_N][K_HALF_COLS]"
        )?;
    }
    writeln!(w)?;
    write_key_cta(w, spec, copy == TileCopy::Threads, packing, KeyColumns::Whole)?;
    // A full barrier's arrivals: the copies', K/V's also the walk's (it
    // publishes the first head) and a stage's also those of the threads that
    // store statistics.
    let (kv_copies, copies, walkers, statistics) = match copy {
        // One per tile (K's upper half again included), from the thread that
        // issues them; the leader; those BLOCK_M.
        TileCopy::Tma => (if k_half_cols(spec).is_some() { "3" } else { "2" }, "2", "1", "BLOCK_M"),
        // One per producer thread, each time.
        TileCopy::Threads => ("PRODUCER_THREADS", "PRODUCER_THREADS", "PRODUCER_THREADS", "PRODUCER_THREADS"),
    };
    write!(
        w,
        "\
        \n\
        // The ring's barriers: K/V's, then per stage full and empty. A full barrier\n\
        // takes the copies' arrivals, K/V's also those of the walk's publishers and\n\
        // a stage's those of the threads that store its statistics. Then per dQ\n\
        // tile full (one arrival per consumer warp) and\n\
        // empty (the adding thread's, once the copy engine has read the tile).\n\
        __shared__ __align__(8) unsigned long long ring_bars[1 + 2 * STAGES + 4];\n\
        const unsigned kv_full = smem_addr(ring_bars), stage_full = kv_full + 8, stage_empty = stage_full + 8 * STAGES;\n\
        const unsigned dq_full = stage_empty + 8 * STAGES, dq_empty = dq_full + 16;\n\
        // Only the producer walks the tiles. It publishes with K/V the head of the\n\
        // first visited step (-1: none), and with each stage its step's words: the\n\
        // query tile and its class (j << 1 | full), and the head of the step after\n\
        // it (-1: none).\n\
        __shared__ int first_head, step_tile[STAGES], step_next[STAGES];\n\
        if (threadIdx.x == 0) {{\n\
        \x20   mbar_init(kv_full, {kv_copies} + {walkers});  // the copies + the first head's publishers\n\
        \x20   for (int s = 0; s < STAGES; ++s) {{\n\
        \x20       mbar_init(stage_full + 8 * s, {copies} + {statistics});  // the copies + the statistics' writers\n\
        \x20       mbar_init(stage_empty + 8 * s, WARPS);  // one arrival per consumer warp\n\
        \x20   }}\n\
        \x20   for (int s = 0; s < 2; ++s) {{\n\
        \x20       mbar_init(dq_full + 8 * s, WARPS);\n\
        \x20       mbar_init(dq_empty + 8 * s, 1);\n\
        \x20   }}\n\
        }}\n\
        __syncthreads();\n\
        int it = 0;  // visited steps so far, over every head: step `it` uses stage it % STAGES\n\
        \n"
    )?;
    let exprs = terms.exprs(spec);
    let hoisted = hoist(&exprs);
    write_roles(w, |w| write_producer(w, spec, copy, packing), |w| write_consumers(w, spec, terms, &hoisted))
}

/// The producer warpgroup: K and V once, then per visited step its Q and dO
/// tiles and statistics into the next stage, and the previous step's dQ
/// tile into the accumulator; it ends with `return`.
fn write_producer(w: &mut Writer<String>, spec: &Spec, copy: TileCopy, packing: Packing) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    // Who copies and who adds dQ (see the comment written below). Under a
    // data-dependent mask the walk tests tiles a warp at a time (see
    // `write_tile_walk`), so the adder's whole warp walks: the walk needs
    // every lane. Elsewhere the lone lane walks (a whole warp walking was
    // slower under causal masks).
    let (roles, copiers, adder) = match copy {
        TileCopy::Tma => (
            "// The first two warps copy (the leader issues TMA) and store statistics; the\n\
             // last warp's first lane adds each visited step's dQ tile to the accumulator\n",
            "warp < WARPS + 2",
            "warp == WARPS + 3 && lane == 0",
        ),
        TileCopy::Threads => (
            "// All four warps copy; the leader, between its copies, adds each visited\n\
             // step's dQ tile to the accumulator\n",
            "true",
            "leader",
        ),
    };
    let keep = match (copy, spec.mask.as_ref().is_some_and(|m| m.reads_tensor())) {
        (TileCopy::Threads, _) => String::new(),
        (TileCopy::Tma, true) => {
            format!(
                "if (!copies && !({DQ_ACCUM} != nullptr && warp == WARPS + 3)) return;  // the adder's warp walks\n"
            )
        }
        (TileCopy::Tma, false) => "if (!copies && !adds_dq) return;\n".to_string(),
    };
    let [q_len, kv_len] = [ArgKind::QLen, ArgKind::KvLen].map(n);
    let [k_stride, v_stride] = [Operand::K, Operand::V].map(|op| n(ArgKind::Stride(op, Axis::Seq)));
    write!(
        w,
        "\
        const bool leader = threadIdx.x == THREADS;  // publishes the walk's words\n\
        {roles}\
        // once the consumers have stored it, a step late (the visit of the next step,\n\
        // or the end, names it). Each walks the tiles itself.\n\
        const bool copies = {copiers};\n\
        const bool adds_dq = {DQ_ACCUM} != nullptr && {adder};\n\
        {keep}\
        auto add_dq = [&](float* dst, int s) {{\n\
        \x20   mbar_wait(dq_full + 8 * (s % 2), s / 2 % 2);\n\
        \x20   bulk_reduce_add(dst, smem_addr(dq_tiles + s % 2 * DQ_TILE), DQ_TILE * 4);\n\
        \x20   bulk_commit();\n\
        \x20   bulk_wait_read<1>();  // the one before has read its tile: free it\n\
        \x20   if (s > 0) mbar_arrive(dq_empty + 8 * ((s - 1) % 2));\n\
        }};\n\
        float* dq_last = nullptr;  // the last visited step's accumulator tile\n"
    )?;
    let k_half = k_half_cols(spec).is_some();
    match copy {
        TileCopy::Tma => {
            let seq = packing.tma_seq(Operand::K);
            writeln!(w, "if (leader) {{")?;
            writeln!(w, "    tma_load_tile<BLOCK_N, DPC>(k_tile, {K_MAP}, kv_full, k0, kv_head, {seq});")?;
            writeln!(w, "    tma_load_tile<BLOCK_N, DVPC>(v_tile, {V_MAP}, kv_full, k0, kv_head, {seq});")?;
            if k_half {
                writeln!(w, "    mbar_arrive_expect_tx(kv_full, BLOCK_N * K_HALF_COLS * 2);")?;
                writeln!(w, "    tma_load(smem_addr(k_half_tile), {K_MAP}, kv_full, DP / 2, k0, kv_head, {seq});")?;
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
    // With TMA the leader also publishes for the copies it issued.
    let publish = match copy {
        TileCopy::Tma => "if (leader) ",
        TileCopy::Threads => "",
    };
    write!(
        w,
        "\
        // The walk over every query head of the group in turn: its lambdas read the\n\
        // head h, and seek(j) is the first visited tile from tile j of head h on,\n\
        // moving h along (q_steps past the group's last head).\n\
        int h = kv_head * group;\n"
    )?;
    write_tile_walk(w, spec, &Walk { axis: "q", tiles: "q_steps", size: "BLOCK_M", len: &q_len })?;
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
        }};\n\
        int j = seek(0);\n\
        if (leader) first_head = j < q_steps ? h : -1;\n\
        {publish}mbar_arrive(kv_full);\n"
    )?;
    w.block(format_args!("while (j < q_steps)"), |w| write_producer_step(w, spec, copy, packing))?;
    w.block(format_args!("if (dq_last != nullptr)"), |w| {
        writeln!(w, "add_dq(dq_last, it - 1);")?;
        writeln!(w, "bulk_wait_read<0>();  // shared memory outlives the reads; the adds land by the kernel's end")
    })?;
    if copy == TileCopy::Threads {
        writeln!(w, "cp_async_wait_all();  // no copy outlives its thread")?;
    }
    writeln!(w, "return;")
}

/// One visited step of the producer's walk: the step's Q and dO tiles and
/// statistics into the next stage, its words for the consumers, and the
/// previous step's dQ tile into the accumulator.
fn write_producer_step(w: &mut Writer<String>, spec: &Spec, copy: TileCopy, packing: Packing) -> fmt::Result {
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
            // so that their latency hides behind the wait.\n\
            const int r = threadIdx.x - THREADS;\n\
            const bool valid = r < BLOCK_M && q0 + r < {q_len};\n\
            const float l = valid ? lse_row[q0 + r] : neg_inf();\n\
            const float d = valid ? delta_row[q0 + r] : 0.0f;\n\
            mbar_wait(stage_empty + 8 * stage, (it / STAGES + 1) % 2);\n"
        )?;
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
            if (r < BLOCK_M) {{\n\
            \x20   lse_cols[stage * BLOCK_M + r] = l == neg_inf() ? -neg_inf() : l * LOG2E;\n\
            \x20   delta_cols[stage * BLOCK_M + r] = d;\n\
            }}\n"
        )
    })?;
    writeln!(w, "j = seek(j + 1);  // the next step, whose head the stage's words name")?;
    w.block(format_args!("if (copies)"), |w| {
        w.block(format_args!("if (leader)"), |w| {
            writeln!(w, "step_tile[stage] = step_j << 1 | (full ? 1 : 0);")?;
            writeln!(w, "step_next[stage] = j < q_steps ? h : -1;")
        })?;
        writeln!(w, "mbar_arrive(stage_full + 8 * stage);")
    })?;
    w.block(format_args!("if (adds_dq)"), |w| {
        writeln!(w, "if (dq_last != nullptr) add_dq(dq_last, it - 1);")?;
        let tile = packing.accum_tile(spec, "step_h", "q_steps", "step_j");
        writeln!(w, "dq_last = {DQ_ACCUM} + ({tile}) * DQ_TILE;")
    })?;
    writeln!(w, "++it;")
}

/// The consumer warpgroups: per head and visited step, the products of the
/// module note; at the end dK and dV.
fn write_consumers(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms, hoisted: &[Hoisted]) -> fmt::Result {
    let k_half = match k_half_cols(spec) {
        Some(_) => "\
            // The second warpgroup's columns cross a panel boundary: it reads their copy.\n\
            const unsigned long long k_half = gmma_desc(warpgroup == 0 ? k_smem : smem_addr(k_half_tile), BLOCK_N * 128, 1024);\n",
        None => "\
            const int half_col = warpgroup * (DP / 2);  // the first of its dQ columns\n\
            const unsigned long long k_half = gmma_desc(k_smem + half_col / 64 * BLOCK_N * 128 + half_col % 64 * 2, BLOCK_N * 128, 1024);\n",
    };
    write!(
        w,
        "\
        const int warpgroup = warp / 4;\n\
        // This warpgroup's 64 keys of the K and V tiles (128-byte rows in each panel).\n\
        const unsigned k_smem = smem_addr(k_tile), v_smem = smem_addr(v_tile);\n\
        // Descriptors of those rows, K-major (S^T, dP^T), and of this warpgroup's\n\
        // half of K's columns, MN-major (dQ = dS K).\n\
        const unsigned long long k_own = gmma_desc(k_smem + warpgroup * 64 * 128, 16, 1024);\n\
        const unsigned long long v_own = gmma_desc(v_smem + warpgroup * 64 * 128, 16, 1024);\n\
        {k_half}\
        // This warp's 16 keys of dK and dV (f32), summed over every query of every\n\
        // head of the group: no atomics.\n\
        float dk_acc[DK_TILES][4] = {{}};\n\
        float dv_acc[DV_TILES][4] = {{}};\n\
        mbar_wait(kv_full, 0);\n\
        int next_h = first_head;  // the head of the next visited step (the producer's word)\n"
    )?;
    w.block(format_args!("for (int h = kv_head * group; h < (kv_head + 1) * group; ++h)"), |w| {
        writeln!(w, "if (h != next_h) continue;  // the head visits no step")?;
        write_row_terms(w, spec, hoisted, Rows::Keys, "k0 + warp * 16")?;
        write_spec_lambdas(w, spec, terms, hoisted, Rows::Keys)?;
        write_head_grad_sums(w, spec, terms)?;
        w.block(format_args!("for (; next_h == h; ++it)"), |w| write_step(w, spec, terms, hoisted))?;
        write_head_grad_adds(w, spec, terms)
    })?;
    writeln!(w)?;
    writeln!(w, "// Epilogue (every product was waited for in its step).")?;
    writeln!(w, "fence_operands(dk_acc);")?;
    writeln!(w, "fence_operands(dv_acc);")?;
    writeln!(w, "// dQ = dS K reads both warpgroups' keys: the consumers' barrier frees K and V.")?;
    writeln!(w, "named_barrier_sync(1, THREADS);")?;
    write_key_stores(w, spec, KeyColumns::Whole)
}

/// One step: the producer's query tile j of head h against this
/// warpgroup's keys.
fn write_step(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms, hoisted: &[Hoisted]) -> fmt::Result {
    let interior = interior_decl(spec, "k0");
    write!(
        w,
        "\
        const int stage = it % STAGES;\n\
        mbar_wait(stage_full + 8 * stage, it / STAGES % 2);\n\
        const int tile = step_tile[stage];\n\
        next_h = step_next[stage];\n\
        const int j = tile >> 1, q0 = j * BLOCK_M;\n\
        const bool full = tile & 1;  // the mask keeps every pair: skip evaluating it\n\
        {interior}\
        const unsigned q_smem = smem_addr(q_tiles + stage * Q_TILE), dout_smem = smem_addr(dout_tiles + stage * DO_TILE);\n\
        // Descriptors of the stage's Q and dO tiles: K-major (S^T, dP^T) and\n\
        // MN-major (dK, dV).\n\
        const unsigned long long q_smem_k = gmma_desc(q_smem, 16, 1024), q_smem_mn = gmma_desc(q_smem, BLOCK_M * 128, 1024);\n\
        const unsigned long long dout_smem_k = gmma_desc(dout_smem, 16, 1024), dout_smem_mn = gmma_desc(dout_smem, BLOCK_M * 128, 1024);\n\
        const float* lse_col = lse_cols + stage * BLOCK_M;\n\
        const float* delta_col = delta_cols + stage * BLOCK_M;\n"
    )?;
    write!(
        w,
        "\
        fence_async_smem();  // the tensor cores read the stage through the async proxy\n\
        \n\
        // S^T = K Q^T, then dP^T = V dO^T, each in a group of its own, on this\n\
        // warpgroup's 64 keys x BLOCK_M queries, both operands from shared memory;\n\
        // the first k-step overwrites them.\n\
        float s[S_TILES][4], dp[S_TILES][4];\n\
        wgmma_fence();\n"
    )?;
    let block_m = BLOCK_M;
    for (acc, dims, a, b) in [("s", "DP", "k_own", "q_smem"), ("dp", "DVP", "v_own", "dout_smem")] {
        write!(
            w,
            "\
            #pragma unroll\n\
            for (int kk = 0; kk < {dims} / 16; ++kk) {{\n\
            \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
            \x20   wgmma_ss_n{block_m}({acc}, desc_plus({a}, panel * BLOCK_N * 128 + step),\n\
            \x20                   desc_plus({b}_k, panel * BLOCK_M * 128 + step), kk);\n\
            }}\n\
            wgmma_commit();\n"
        )?;
    }
    if hoisted.iter().any(|h| h.level == Rows::Keys.column_level()) {
        writeln!(w, "// The spec's terms of the tile's queries, loaded while the products run.")?;
        write_column_terms(w, spec, hoisted, Rows::Keys, "q0")?;
    }
    let rows = ("k0 + warp * 16", "q0");
    // dV += P^T dO (`pa`) and dK += dS^T Q (`dsa`), P^T and dS^T register A
    // operands, dO and Q MN-major from the stage.
    let issue = |w: &mut Writer<String>, fragment: &str, from: &str, acc: &str, n: u32, b: &str| {
        write!(
            w,
            "\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) pack_p(storage{{}}, {fragment}[kk], {from}, kk);\n\
            wgmma_fence();\n\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {{\n\
            \x20   wgmma_rs_n{n}({acc}, {fragment}[kk], desc_plus({b}_mn, kk * 16 * 128));\n\
            }}\n\
            wgmma_commit();\n"
        )
    };
    let [dp_n, dvp_n] = [spec.head_dims.qk, spec.head_dims.v].map(pad16);
    writeln!(w)?;
    writeln!(w, "// The A fragments of dV += P^T dO and dK += dS^T Q: the accumulators of query")?;
    writeln!(w, "// tiles 2kk and 2kk + 1 are the kk-th 16-query step's fragment.")?;
    writeln!(w, "unsigned pa[BLOCK_M / 16][4], dsa[BLOCK_M / 16][4];")?;
    let first_pass = |w: &mut Writer<String>, part: Part| write_split_elements(w, spec, terms, Rows::Keys, rows, part);
    if Part::splits(terms) {
        writeln!(w, "wgmma_wait<1>();  // S^T is done; dP^T may still run")?;
        writeln!(w, "fence_operands(s);")?;
        first_pass(w, Part::P)?;
        writeln!(w, "// dV += P^T dO behind dP^T, while dS waits for it.")?;
        issue(w, "pa", "s", "dv_acc", dvp_n, "dout_smem")?;
        writeln!(w, "wgmma_wait<1>();  // dP^T is done; dV may still run")?;
        writeln!(w, "fence_operands(dp);")?;
        write_elements(w, spec, terms, Rows::Keys, rows, Part::Ds, false)?;
    } else {
        writeln!(w, "wgmma_wait<0>();")?;
        writeln!(w, "fence_operands(s);")?;
        writeln!(w, "fence_operands(dp);")?;
        first_pass(w, Part::Both)?;
        writeln!(w, "// dV += P^T dO.")?;
        issue(w, "pa", "s", "dv_acc", dvp_n, "dout_smem")?;
    }
    writeln!(w, "// dK += dS^T Q.")?;
    issue(w, "dsa", "dp", "dk_acc", dp_n, "q_smem")?;
    write_step_dq(w, spec)
}

/// The end of a step: with a dQ accumulator, dQ = dS K from a transposed dS
/// tile, staged in fragment order for the producer's bulk add; the stage is
/// released once the products that read it are done.
fn write_step_dq(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let release = "\
        keep_operands(pa);\n\
        keep_operands(dsa);\n\
        if (lane == 0) mbar_arrive(stage_empty + 8 * stage);  // this warp is done with the stage\n";
    w.block(format_args!("if ({DQ_ACCUM} != nullptr)"), |w| {
        write!(
            w,
            "\
            // dS with queries as rows, for dQ = dS K: stmatrix transposes each warp's\n\
            // 16 keys x 16 queries per instruction. Buffers alternate per step: the\n\
            // barrier below keeps either warpgroup from reusing one the other reads.\n\
            const unsigned ds_smem = smem_addr(ds_tiles + it % 2 * DS_TILE);\n\
            const unsigned long long ds_k = gmma_desc(ds_smem, 16, 1024);\n\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {{\n\
            \x20   const int row = kk * 16 + lane / 16 * 8 + lane % 8, col = warp * 16 + lane / 8 % 2 * 8;\n\
            \x20   stmatrix_x4_trans(dsa[kk], ds_smem + 2 * tile_offset<BLOCK_M, BLOCK_N, true>(row, col));\n\
            }}\n\
            fence_async_smem();\n\
            named_barrier_sync(1, THREADS);  // both warpgroups' dS are in place\n\
            // dQ = dS K on BLOCK_M queries x this warpgroup's half of the columns (K\n\
            // MN-major: its rows are the reduction), added to the f32 accumulator.\n\
            float dq[DQ_TILES][4];\n\
            wgmma_fence();\n\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
            \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
            \x20   wgmma_ss_mn_n{half}(dq, desc_plus(ds_k, panel * BLOCK_M * 128 + step), desc_plus(k_half, kk * 16 * 128), kk);\n\
            }}\n\
            wgmma_commit();\n\
            wgmma_wait<0>();\n\
            fence_operands(dq);\n\
            {release}\
            // The step's dQ tile in fragment order (dq_chunk), into shared tile\n\
            // it % 2 once the copy engine has read what step it - 2 left there;\n\
            // a producer thread adds it to the accumulator (add_dq).\n\
            const unsigned dq_tile = smem_addr(dq_tiles + it % 2 * DQ_TILE);\n\
            mbar_wait(dq_empty + 8 * (it % 2), (it / 2 + 1) % 2);\n\
            #pragma unroll\n\
            for (int n = 0; n < DQ_TILES; ++n) st_shared_v4(dq_tile + 16 * dq_chunk(DQ_TILES, warpgroup, n, threadIdx.x % 128), dq[n]);\n\
            fence_async_smem();  // the copy engine reads the tile through the async proxy\n\
            __syncwarp();\n\
            if (lane == 0) mbar_arrive(dq_full + 8 * (it % 2));\n",
            half = pad16(spec.head_dims.qk) / 2,
        )
    })?;
    w.block(format_args!("else"), |w| {
        writeln!(w, "// Deterministic mode: a separate kernel computes dQ.")?;
        writeln!(w, "wgmma_wait<0>();")?;
        w.write_str(release)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// K's upper half is a TMA destination and a wgmma operand: its tile,
    /// the last one, starts on a 1024-byte swizzle atom as the others do.
    #[test]
    fn k_half_tile_starts_on_a_swizzle_atom() {
        let mut copied = 0;
        for d in (64..=128).step_by(16) {
            let spec = crate::parse_one(&format!("S {{ dtype: bf16, head_dim: {d} }}")).unwrap();
            if let Some(cols) = k_half_cols(&spec) {
                let offset = smem_bytes(&spec) - 1024 - 2 * 16 * WARPS * cols;
                assert_eq!(offset % 1024, 0, "d = {d}");
                copied += 1;
            }
        }
        assert!(copied > 0, "some head dim copies K's upper half");
    }
}
