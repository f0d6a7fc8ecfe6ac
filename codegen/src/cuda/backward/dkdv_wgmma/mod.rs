//! The dK/dV kernel on Hopper's warpgroup MMA (sm_90a), warp-specialized
//! like the forward's 128-key kernel (FlashAttention-3's backward).
//!
//! Two consumer warpgroups and a producer warpgroup that copies the CTA's K
//! and V once and then each visited query step's Q, dO and statistics into
//! a ring of stages (`library/ring.cuh`: full/empty `mbarrier`s;
//! `setmaxnreg` gives the consumers 240 registers). The warpgroups share
//! the keys as [`Layout`] says: with whole columns (head dims up to 128)
//! each owns 64 of the CTA's 128 keys; with column halves (above 128,
//! where 64 keys' dK and dV no longer fit one warpgroup's registers) both
//! work on the same 64 keys, each repeating Sᵀ, dPᵀ, P and dS and holding
//! half of dK's, dV's and dQ's columns of the head dims padded to whole
//! panels (zero columns past D); transposed (the runtime's choice from 129
//! through 192) each owns 48 of the CTA's 96 keys and computes with queries
//! as rows, its dK and dV transposed (`transposed`). Otherwise, per step a
//! consumer warpgroup computes, keys as rows:
//!
//! - Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, both operands from shared memory (K-major);
//! - P and dS on its registers, the same element code as the `mma.sync`
//!   kernel (`step::write_elements`: the accumulator layouts agree), with
//!   the logit of a tile the mask keeps whole (every key present) free of
//!   mask and bounds; without a score mod P is computed, and dV issued,
//!   while dPᵀ is still on the tensor cores;
//! - dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ and dSᵀ as register A operands,
//!   dO and Q MN-major from the stage (in [`Chunk`]s of its columns), into
//!   accumulators that live for the whole kernel (64 + 64 registers at
//!   d = 128 and at 256's halves);
//! - dS itself (queries as rows) into shared memory by `stmatrix.trans`, and
//!   once both warpgroups' halves are there (a named barrier),
//!   dQ = dS·K for its half of dQ's columns (with 128-query steps, at
//!   d = 64: for its own 64 queries, every column; with 80-query steps, at
//!   d = 128: dQᵀ = Kᵀ·dSᵀ for its 64 head dims, wgmma's M being 64; dS
//!   there reads P back from its 16-bit fragments), added to the f32
//!   accumulator:
//!   stored to a shared tile in fragment order (conflict-free
//!   16-byte stores) that one producer thread adds to global memory with a
//!   single bulk reduction (`cp.reduce.async.bulk`), as FlashAttention-3
//!   does: the consumers issue no global atomics.
//!
//! The element code, spec lambdas, tile walk and epilogue are the
//! `mma.sync` kernel's (`dkdv.rs`); only the products and the data movement
//! differ, and only the producer walks: with each stage it writes the step's
//! query tile and class and the next step's head, which the consumers read
//! behind the stage's full barrier. Where steps are 128 queries long (d =
//! 64) the kernel is persistent (`units`): a CTA per SM takes unit after
//! unit, each one CTA's work here.

mod consumers;
mod producer;
mod query_terms;
mod transposed;
mod units;

use super::common::{dropout_kind, write_source, Sections, SpecTerms};
use super::dkdv::{write_key_cta, write_key_lanes, write_key_tiles};
use super::packing::Packing;
use super::{BackwardConfig, DqAccum, DqOrder, KeyColumns};
use crate::abi::{ArgKind, Grid, Kernel, KernelArg, Operand};
use crate::cuda::kit::hoist::hoist;
use crate::cuda::kit::warp_roles::write_roles;
use crate::cuda::library;
use crate::cuda::library::wgmma_ops::AFrom;
use crate::cuda::signature::{arg_name, with_dropout};
use crate::cuda::signature::{backward_args, with_dq_tickets, with_tensor_maps};
use crate::cuda::source::kernel_name;
use crate::cuda::source::Piece;
use crate::cuda::target::{pad16, Mma, Target};
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use query_terms::QueryTerms;
use std::fmt::{self, Write};

const OPERANDS: [Operand; 6] = [Operand::Q, Operand::K, Operand::V, Operand::DO, Operand::DK, Operand::DV];

/// Consumer warps: two warpgroups.
pub(super) const WARPS: u32 = 8;

/// Query rows of a tile of the dQ accumulator: a step's (64-query steps),
/// or each warpgroup's half of a 128-query step's.
pub(super) const DQ_ROWS: u32 = 64;

/// Queries per step where dQ is computed transposed (FlashAttention-4's
/// sm90 tile for full attention at d = 128): wgmma's M is 64, so an
/// 80-query dQ takes head dims as rows, each warpgroup its 64 of d = 128.
pub(super) const TRANSPOSED_DQ_STEP: u32 = 80;

/// Queries per contiguous group of the accumulator that such steps add to
/// (`dq_fragments.cuh`: dqt_chunk), a step's five.
pub(super) const DQT_GROUP_ROWS: u32 = 16;
// The CPU twin (`crate::varlen::dq_accum_tile`) places tiles of this
// kernel's steps.
const _: () = assert!(DQ_ROWS as i32 == crate::varlen::DQ_TILE_ROWS);

/// How the kernel is laid out for a spec: how its two consumer warpgroups
/// share the CTA's keys, how many Q/dO stages and dQ tiles its shared
/// memory holds, and the column chunks of its dK and dV products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    /// `Whole`: each warpgroup its own 64 keys and every column of their dK
    /// and dV (128 keys per CTA). `Halves`: both on the same 64 keys, each
    /// computing Sᵀ, dPᵀ, P and dS whole (the products repeated to keep
    /// dK's and dV's halves within the registers above d = 128) and holding
    /// half of dK's, dV's and dQ's columns. `Transposed`: each its own 48
    /// of 96 keys, every column of their dKᵀ and dVᵀ, half of dQ's columns.
    pub columns: KeyColumns,
    /// Queries per step: 64, where Sᵀ and dPᵀ (32 registers each) fit next
    /// to dK and dV (64 each at d = 128, or half the columns at 256) in 240
    /// registers; 128 with whole columns at d = 64 (FlashAttention-3's
    /// hdim-64 tile), where dK and dV take 32 each: every product twice as
    /// long against the same per-step synchronization, and dQ split by
    /// rows (each warpgroup its own 64 queries, every column); 80 with whole
    /// columns at d = 128 (Sᵀ and dPᵀ 40 registers each), dQ transposed
    /// ([`DqSplit::HeadDims`]).
    pub block_m: u32,
    /// Q/dO stages of the ring.
    stages: u32,
    /// Steps' dQ tiles awaiting the bulk addition (one is drained long
    /// before the next step's dQ is ready).
    dq_bufs: u32,
    /// The chunks of the dK and dV products.
    pub dk: Chunks,
    pub dv: Chunks,
    /// Transposed: the chunks of a warpgroup's half of dQ's columns (K's
    /// MN-major panels must not be crossed); empty elsewhere (the other
    /// layouts read K's upper half again where it would: `k_half_cols`).
    pub dq: Chunks,
    /// The columns of Q/K and of V the products span (`DP`, `DVP`): whole
    /// columns pad to the MMA k-step, halves to whole 64-column panels, so
    /// that each warpgroup's half starts at a panel or 32 columns into one
    /// (the columns past the head dim are zeros, and their gradients are
    /// never stored).
    pub padded: [u32; 2],
}

/// A chunk of a warpgroup's dK or dV columns that one product computes:
/// its width and each warpgroup's first column. A wgmma's MN-major operand
/// must not start inside a 64-column panel and cross into the next, so
/// halves that start inside a panel take two chunks, the one that ends the
/// panel after the rest; chunks are in accumulator order, the same widths
/// for both warpgroups, so that they issue the same products with no branch
/// (a wgmma on a path ptxas cannot prove uniform is serialized).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Chunk {
    pub width: u32,
    pub first: [u32; 2],
}

/// One or two chunks, in accumulator order: a fixed-size value, so that a
/// launch asking for the layout allocates nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Chunks {
    items: [Chunk; 2],
    len: usize,
}

impl Chunks {
    fn one(chunk: Chunk) -> Chunks {
        Chunks { items: [chunk, Chunk::default()], len: 1 }
    }

    fn two(items: [Chunk; 2]) -> Chunks {
        Chunks { items, len: 2 }
    }
}

impl std::ops::Deref for Chunks {
    type Target = [Chunk];

    fn deref(&self) -> &[Chunk] {
        &self.items[..self.len]
    }
}

/// The chunks of `d` (padded) columns held as `columns`; `None` for halves
/// that start neither at a panel nor 32 columns in (those would need chunks
/// of other widths in each warpgroup).
fn chunks(columns: KeyColumns, d: u32) -> Option<Chunks> {
    let h = d / 2;
    match (columns, h % 64) {
        (KeyColumns::Whole | KeyColumns::Transposed, _) => Some(Chunks::one(Chunk { width: d, first: [0, 0] })),
        (KeyColumns::Halves, 0) => Some(Chunks::one(Chunk { width: h, first: [0, h] })),
        (KeyColumns::Halves, 32) if h == 32 => Some(Chunks::one(Chunk { width: h, first: [0, h] })),
        (KeyColumns::Halves, 32) => {
            Some(Chunks::two([Chunk { width: h - 32, first: [0, h + 32] }, Chunk { width: 32, first: [h - 32, h] }]))
        }
        _ => None,
    }
}

impl Layout {
    /// The layout of `config`'s kernel for `spec`: `None` unless it is the
    /// wgmma kernel and covers the head dims, whole columns where Q/K and V
    /// pad alike to 64 through 128 (the dK and dV accumulators fill the
    /// registers at 128), halves and transposed tiles where the wider pads
    /// to 144 through 256 (each head dim padded to whole panels: [`chunks`];
    /// transposed, also dQ's halves in chunks); 128- or 80-query steps
    /// where `config.block_m` asks for them and [`Layout::takes_long_steps`],
    /// 64 otherwise; the most stages and dQ tiles that fit Hopper's shared
    /// memory (64-query steps of whole columns need both pairs: not at 112;
    /// 80-query steps take one dQ tile).
    pub(super) fn of(spec: &Spec, config: BackwardConfig) -> Option<Layout> {
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let columns = config.columns;
        let long_steps = Layout::takes_long_steps(spec, config);
        let panels = [spec.head_dims.qk, spec.head_dims.v].map(tile_cols);
        let (covered, options, padded): (bool, &[(u32, u32)], _) = match columns {
            KeyColumns::Whole if long_steps => (true, &[(2, 2), (2, 1)], [dp, dvp]),
            KeyColumns::Whole => (dp == dvp && (64..=128).contains(&dp), &[(2, 2)], [dp, dvp]),
            KeyColumns::Halves => ((129..=256).contains(&dp.max(dvp)), &[(2, 2), (2, 1), (1, 1)], panels),
            KeyColumns::Transposed => ((129..=256).contains(&dp.max(dvp)), &[(2, 1), (1, 1)], panels),
        };
        if config.mma != Mma::Wgmma || !covered {
            return None;
        }
        let (dk, dv) = (chunks(columns, padded[0])?, chunks(columns, padded[1])?);
        let dq = match columns {
            KeyColumns::Transposed => chunks(KeyColumns::Halves, padded[0])?,
            _ => Chunks::default(),
        };
        let block_m = if long_steps { config.block_m } else { DQ_ROWS };
        let mut layouts =
            options.iter().map(|&(stages, dq_bufs)| Layout { columns, block_m, stages, dq_bufs, dk, dv, dq, padded });
        layouts.find(|layout| layout.smem_used(spec) <= SMEM_LIMIT)
    }

    /// Whether `config`'s kernel may take the steps longer than 64 queries
    /// that `config.block_m` asks for: 128 at d = 64, 80 at d = 128 (head
    /// dims padded), with whole columns, for a spec whose P and dS split
    /// into two passes with nothing but P between them (no score mod, no
    /// dropout): with a score mod's terms beside S and dP the registers
    /// spill.
    fn takes_long_steps(spec: &Spec, config: BackwardConfig) -> bool {
        let d = match config.block_m {
            m if m == 2 * DQ_ROWS => 64,
            TRANSPOSED_DQ_STEP => 128,
            _ => return false,
        };
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let whole = config.columns == KeyColumns::Whole && dp == d && dvp == d;
        whole && spec.score.is_none() && !config.dropout
    }

    /// How the consumers split a step's dQ product.
    pub(super) fn dq_split(&self) -> DqSplit {
        match self.block_m {
            TRANSPOSED_DQ_STEP => DqSplit::HeadDims,
            m if m > DQ_ROWS => DqSplit::Rows,
            _ => DqSplit::Columns,
        }
    }

    /// The dQ accumulator its consumers add to.
    pub(super) fn dq_accum(&self) -> DqAccum {
        DqAccum::Fragments { cols: self.padded[0], order: self.dq_order(), step_rows: self.block_m }
    }

    /// The order its consumers store dQ in.
    fn dq_order(&self) -> DqOrder {
        match self.dq_split() {
            DqSplit::HeadDims => DqOrder::HeadDims,
            DqSplit::Columns | DqSplit::Rows => DqOrder::Queries,
        }
    }

    /// The N of a warpgroup's dQ product: its columns, or with head dims as
    /// rows the step's queries.
    pub(super) fn dq_n(&self) -> u32 {
        match self.dq_split() {
            DqSplit::Columns => self.padded[0] / 2,
            DqSplit::Rows => self.padded[0],
            DqSplit::HeadDims => self.block_m,
        }
    }

    /// Keys per CTA.
    pub(super) fn block_n(&self) -> u32 {
        match self.columns {
            KeyColumns::Transposed => 2 * transposed::keys(self.padded),
            columns => 16 * WARPS / columns.parts(),
        }
    }

    /// K and V of the CTA's keys, the stages of Q, dO and two statistics
    /// per query, two dS tiles (transposed: and a Pᵀ tile), the steps' f32
    /// dQ, the upper half of K again where `k_half_cols` says, and the
    /// slack that aligns them to 1024 bytes (226 KB in all at d = 128 and
    /// 96, just under Hopper's 227).
    fn smem_bytes(&self, spec: &Spec) -> u32 {
        let (dp, dpc, dvpc) = (self.padded[0], tile_cols(spec.head_dims.qk), tile_cols(spec.head_dims.v));
        let (m, n, stages) = (self.block_m, self.block_n(), self.stages);
        let k_half = n * self.k_half_cols().unwrap_or(0);
        let score_tiles = if self.columns == KeyColumns::Transposed { 3 } else { 2 };
        2 * (n * (dpc + dvpc) + stages * m * (dpc + dvpc) + score_tiles * m * n + k_half)
            + 4 * (2 * stages * m + self.dq_bufs * m * dp)
            + 1024
    }

    /// Columns of the upper half of K's (the second warpgroup's dQ columns)
    /// copied again into a panel of their own, where they start inside a
    /// panel and cross into the next (80, 96 and halves of 192): a wgmma's
    /// MN-major operand must not. `None` where they start at a panel (128,
    /// 256) or end in it (64), and in transposed tiles (dQ in chunks).
    pub(super) fn k_half_cols(&self) -> Option<u32> {
        let half = self.padded[0] / 2;
        let crosses = !half.is_multiple_of(64) && half % 64 + half > 64;
        (crosses && self.columns != KeyColumns::Transposed).then_some(half.next_multiple_of(64))
    }

    /// Static shared memory beside it: the ring's and dQ tiles' barriers,
    /// the walk's words, and what a persistent kernel adds (counted for
    /// every layout: `units`).
    fn static_smem(&self) -> u32 {
        8 * (1 + 2 * self.stages + 2 * self.dq_bufs) + 4 * (1 + 2 * self.stages) + units::STATIC_SMEM
    }

    /// The TMA copies of K and V: K, V, and K's upper half again where
    /// `k_half_cols` says.
    pub(super) fn kv_tiles(&self) -> u32 {
        if self.k_half_cols().is_some() {
            3
        } else {
            2
        }
    }

    /// Whether the kernel is persistent (`Grid::KeyUnits`): one CTA per SM
    /// claims unit after unit (a non-persistent CTA's keys), copying the
    /// next unit's K and V while it stores the last one's dK and dV through
    /// the dS tiles, the ring running on across units. Whole columns in
    /// 128-query steps (d = 64, whose steps are half a d = 128 step's work
    /// against the same fixed costs per unit; at d = 128 the persistent
    /// kernel ran no faster), dense operands copied by TMA.
    fn persistent(&self, copy: TileCopy, packing: Packing) -> bool {
        let long = self.dq_split() == DqSplit::Rows;
        self.columns == KeyColumns::Whole && long && copy == TileCopy::Tma && packing == Packing::Dense
    }

    /// Shared memory a CTA may still take beside the layout's: room for
    /// staged per-query terms (`query_terms`).
    fn spare_smem(&self, spec: &Spec) -> u32 {
        SMEM_LIMIT.saturating_sub(self.smem_used(spec))
    }

    /// Shared memory a CTA takes, dynamic and static.
    fn smem_used(&self, spec: &Spec) -> u32 {
        self.smem_bytes(spec) + self.static_smem()
    }
}

/// How the two consumer warpgroups split a step's dQ, the sum over the
/// CTA's keys of both warpgroups' dS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DqSplit {
    /// dQ = dS·K, each warpgroup every query and half of the columns
    /// (64-query steps).
    Columns,
    /// dQ = dS·K, each warpgroup its own 64 queries and every column
    /// (128-query steps).
    Rows,
    /// dQᵀ = Kᵀ·dSᵀ, each warpgroup every query and its 64 of the head
    /// dims as wgmma's rows (80-query steps, d = 128).
    HeadDims,
}

/// Columns of a shared tile of head dim `d`: whole 64-column panels (wgmma's
/// 128-byte swizzle), zero beyond `d`.
fn tile_cols(d: u32) -> u32 {
    pad16(d).next_multiple_of(64)
}

/// Shared memory one CTA may take on Hopper.
const SMEM_LIMIT: u32 = Target::HOPPER.smem_per_sm - Target::HOPPER.smem_reserved_per_cta;

/// Threads of the producer warpgroup.
const PRODUCER_THREADS: u32 = 128;

/// Producer threads that copy and store statistics when TMA copies: its
/// first two warps (each arrives on a stage's full barrier).
const TMA_COPIERS: u32 = 64;

/// Whether the dQ adder's whole warp walks (TMA copies): under a mask that
/// reads tensors the walk tests tiles a warp at a time; elsewhere its one
/// lane walks alone.
fn adder_warp_walks(spec: &Spec) -> bool {
    spec.mask.as_ref().is_some_and(|m| m.reads_tensor())
}

/// The kernel in `config` (its `tensor_grads`, `copy` and `dropout`), laid
/// out as `layout` (`Layout::of` the two).
pub(super) fn emit(spec: &Spec, config: BackwardConfig, layout: &Layout, packing: Packing) -> Kernel {
    let BackwardConfig { tensor_grads, copy, dropout, .. } = config;
    let name = kernel_name(&packing.prefix(&dropout_kind("bwd", dropout)), spec);
    let mut terms = SpecTerms::new(spec, tensor_grads, dropout);
    if layout.columns == KeyColumns::Halves {
        // Both warpgroups compute every element: one adds the tensor gradients.
        terms.owner = Some("part == 0");
    }
    let slots: Vec<usize> = terms.grads.iter().map(|(slot, ..)| *slot).collect();
    let tickets = layout.dq_accum().has_tickets(spec);
    let args = packing.args(spec, with_dq_tickets(spec, backward_args(spec, OPERANDS, &slots), tickets));
    let args = match copy {
        TileCopy::Tma => with_tensor_maps(spec, args, &[Operand::Q, Operand::K, Operand::V, Operand::DO]),
        TileCopy::Threads => args,
    };
    let mut args = with_dropout(spec, args, dropout);
    let units = layout.persistent(copy, packing);
    if units {
        args.push(KernelArg { name: arg_name(spec, ArgKind::WorkCounter), kind: ArgKind::WorkCounter });
    }
    let source = write_source(
        spec,
        Sections::Hopper { library: hopper_library(layout, copy, tickets, units), padded: layout.padded },
        &name,
        &args,
        |w| write_config(w, spec, layout, copy),
        |w| write_body(w, spec, &terms, layout, copy, packing),
    );
    Kernel {
        name,
        source,
        grid: if units { Grid::KeyUnits } else { Grid::KeyTiles },
        block_m: layout.block_m,
        block_n: layout.block_n(),
        threads: 32 * WARPS + PRODUCER_THREADS,
        dynamic_smem: layout.smem_bytes(spec),
        args,
    }
}

/// The warpgroup MMA and stage-ring library sections and the products
/// this kernel issues: m64 by BLOCK_M (Sᵀ, dPᵀ), by a warpgroup's dQ
/// columns, and by each chunk's width of dK and dV; the dQ accumulator's
/// tickets where it has them; a persistent kernel's work claims.
fn hopper_library(layout: &Layout, copy: TileCopy, tickets: bool, units: bool) -> Vec<Vec<Piece>> {
    let mut wgmma = match layout.columns {
        KeyColumns::Transposed => transposed::products(layout),
        _ => {
            let dq_operands = match layout.dq_split() {
                DqSplit::HeadDims => AFrom::SharedMnA,
                DqSplit::Columns | DqSplit::Rows => AFrom::SharedMnB,
            };
            let mut wgmma = vec![
                Piece::Part(library::Part::Wgmma),
                Piece::Wgmma(layout.block_m, AFrom::Shared),
                Piece::Wgmma(layout.dq_n(), dq_operands),
            ];
            let mut widths: Vec<u32> = layout.dk.iter().chain(layout.dv.iter()).map(|chunk| chunk.width).collect();
            widths.sort_unstable();
            widths.dedup();
            wgmma.extend(widths.into_iter().map(|n| Piece::Wgmma(n, AFrom::Registers)));
            wgmma
        }
    };
    wgmma.extend([Piece::Part(library::Part::HopperBackward), Piece::Part(library::Part::DqFragments)]);
    if tickets {
        wgmma.push(Piece::Part(library::Part::DqTickets));
    }
    if layout.columns == KeyColumns::Transposed {
        wgmma.push(Piece::Part(library::Part::HopperTransposed));
    }
    let mut sections = vec![wgmma, vec![Piece::Part(library::Part::Ring)]];
    if copy == TileCopy::Tma {
        sections.push(vec![Piece::Part(library::Part::Tma)]);
    }
    if units {
        sections.push(vec![Piece::Part(library::Part::WorkClaims)]);
    }
    sections
}

fn write_config(w: &mut Writer<String>, spec: &Spec, layout: &Layout, copy: TileCopy) -> fmt::Result {
    let Layout { columns, stages, dq_bufs, .. } = *layout;
    let (warps, block_m, block_n) = (WARPS, layout.block_m, layout.block_n());
    let [dpc, dvpc] = [spec.head_dims.qk, spec.head_dims.v].map(tile_cols);
    let dq_tiles = layout.dq_n() / 8;
    let dq_what = match layout.dq_split() {
        DqSplit::Columns => "its warpgroup's half of the columns",
        DqSplit::Rows => "its warpgroup's 64 queries, every column",
        DqSplit::HeadDims => "every query of its warpgroup's 64 head dims (dQ^T)",
    };
    let keys = match columns {
        KeyColumns::Whole => "// the consumer warps: two warpgroups of 64 keys each",
        KeyColumns::Halves => "// the consumer warps: two warpgroups on the same 64 keys",
        KeyColumns::Transposed => "// the consumer warps: two warpgroups of 48 keys each",
    };
    write!(
        w,
        "\
        constexpr int WARPS = {warps};  {keys}\n\
        constexpr int THREADS = 32 * WARPS;  // the threads that multiply\n\
        // Warp specialization: one more warpgroup copies K, V and the query steps'\n\
        // tiles into a ring of STAGES stages (see the stage ring above) and hands\n\
        // most of its registers to the two that multiply (24 + 2 x 240).\n\
        constexpr int PRODUCER_THREADS = {PRODUCER_THREADS};\n\
        constexpr int CTA_THREADS = THREADS + PRODUCER_THREADS;\n\
        constexpr int PRODUCER_REGS = 24;\n\
        constexpr int CONSUMER_REGS = 240;\n\
        constexpr int STAGES = {stages};  // Q/dO stages of the ring\n\
        constexpr int BLOCK_N = {block_n};  // keys per CTA: grid.x = ceil(kv_len / BLOCK_N)\n\
        constexpr int BLOCK_M = {block_m};  // queries per step of the loop\n\
        constexpr int DPC = {dpc}, DVPC = {dvpc};  // tile columns: whole 64-column panels\n\
        constexpr int DQ_TILES = {dq_tiles};  // m16n8 tiles of a warp's dQ: {dq_what}\n\
        constexpr int DQ_ROWS = {DQ_ROWS};  // query rows of a tile of the dQ accumulator\n\
        constexpr int DQ_TILE = BLOCK_M * DP;  // f32 of a step's dQ tiles\n\
        constexpr int DQ_BUFS = {dq_bufs};  // steps' dQ tiles awaiting their bulk addition\n"
    )?;
    if copy == TileCopy::Threads {
        writeln!(w, "// Whether any tile copy may use cp.async (see mbar_arrive_loaded).")?;
        writeln!(w, "constexpr int COPY_WIDTH = D % 8 == 0 || DV % 8 == 0 ? 8 : 1;")?;
    }
    if columns == KeyColumns::Halves {
        writeln!(w, "constexpr int COL_PARTS = 2;  // a warpgroup's part of dK's and dV's columns")?;
    }
    if let Some(cols) = layout.k_half_cols() {
        writeln!(w, "constexpr int K_HALF_COLS = {cols};  // the second copy of K's upper half")?;
    }
    if columns == KeyColumns::Transposed {
        return transposed::write_tiles(w, spec, layout);
    }
    write_key_tiles(
        w,
        spec,
        "\
        // Shared memory, every tile in wgmma's 64-column panels: this CTA's K and V;\n\
        // STAGES stages of a step's Q and dO tiles and two statistics per query; two\n\
        // dS tiles (queries as rows: the A operand of dQ = dS K); DQ_BUFS steps' dQ;\n\
        // with K_HALF_COLS, the upper half of K's columns again, from a panel's start.\n",
        ["DPC", "DVPC"],
        columns,
    )
}

fn write_body(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    layout: &Layout,
    copy: TileCopy,
    packing: Packing,
) -> fmt::Result {
    write!(
        w,
        "\
        // wgmma's swizzle atoms are 1024-byte aligned; the launch reserves the slack\n\
        // (declared so aligned, the static variables would take 1024 bytes).\n\
        extern __shared__ __align__(16) unsigned char smem_raw[];\n\
        unsigned short* smem = (unsigned short*)(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);\n\
        unsigned short* k_tile = smem;  // [BLOCK_N][DPC], for every step\n\
        unsigned short* v_tile = k_tile + K_TILE;  // [BLOCK_N][DVPC]\n\
        unsigned short* q_tiles = v_tile + V_TILE;  // [STAGES][BLOCK_M][DPC]\n\
        unsigned short* dout_tiles = q_tiles + STAGES * Q_TILE;  // [STAGES][BLOCK_M][DVPC]\n\
        unsigned short* ds_tiles = dout_tiles + STAGES * DO_TILE;  // [2][BLOCK_M][BLOCK_N]: dS, for dQ\n\
        {extra_tile}\
        float* lse_cols = (float*)({extra});  // [STAGES][BLOCK_M]: LSE in log2 units, +inf for no gradient\n\
        float* delta_cols = lse_cols + STAGES * BLOCK_M;  // [STAGES][BLOCK_M]: D = rowsum(dO * O)\n\
        float* dq_tiles = delta_cols + STAGES * BLOCK_M;  // [DQ_BUFS][DQ_TILE]: step it's dQ in it % DQ_BUFS, for the bulk reduction\n\
        \n",
        extra_tile = match layout.columns {
            KeyColumns::Transposed => "\
                // P^T, keys as rows, for dV^T = dO^T P (the dS tiles hold dS^T here).\n\
                unsigned short* pt_tile = ds_tiles + 2 * DS_TILE;  // [BLOCK_N][BLOCK_M]\n",
            _ => "\
                // With K_HALF_COLS [BLOCK_N][K_HALF_COLS], on a swizzle atom as every 16-bit tile.\n\
                unsigned short* k_half_tile = ds_tiles + 2 * DS_TILE;\n",
        },
        extra = match (layout.columns, layout.k_half_cols()) {
            (KeyColumns::Transposed, _) => "pt_tile + DS_TILE",
            (_, Some(_)) => "k_half_tile + BLOCK_N * K_HALF_COLS",
            (_, None) => "k_half_tile + 0",
        },
    )?;
    let units = layout.persistent(copy, packing);
    if units {
        write_key_lanes(w, spec, KeyColumns::Whole)?;
        units::write_count(w, spec)?;
    } else {
        write_key_cta(w, spec, copy == TileCopy::Threads, packing, KeyColumns::Whole)?;
    }
    // A full barrier's arrivals: the copies', K/V's also the walk's (it
    // publishes the first head) and a stage's also those of the threads that
    // store statistics.
    let (unit_decls, unit_inits) = units::barriers(spec);
    let (tma_copiers, kv_tiles) = (TMA_COPIERS.to_string(), layout.kv_tiles().to_string());
    let (kv_copies, copies, walkers, statistics) = match copy {
        // One per tile (K's upper half again included), from the thread that
        // issues them; the leader; the two copying warps' threads.
        TileCopy::Tma => (kv_tiles.as_str(), "2", "1", tma_copiers.as_str()),
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
        __shared__ __align__(8) unsigned long long ring_bars[1 + 2 * STAGES + 2 * DQ_BUFS];\n\
        const unsigned kv_full = smem_addr(ring_bars), stage_full = kv_full + 8, stage_empty = stage_full + 8 * STAGES;\n\
        const unsigned dq_full = stage_empty + 8 * STAGES, dq_empty = dq_full + 8 * DQ_BUFS;\n\
        // Only the producer walks the tiles. It publishes with K/V the head of the\n\
        // first visited step (-1: none), and with each stage its step's words: the\n\
        // query tile and its class (j << 1 | full), and the head of the step after\n\
        // it (-1: none).\n\
        __shared__ int {first_head}, step_tile[STAGES], step_next[STAGES];\n\
        {unit_decls}\
        if (threadIdx.x == 0) {{\n\
        \x20   mbar_init(kv_full, {kv_copies} + {walkers});  // the copies + the first head's publishers\n\
        {unit_inits}\
        \x20   for (int s = 0; s < STAGES; ++s) {{\n\
        \x20       mbar_init(stage_full + 8 * s, {copies} + {statistics});  // the copies + the statistics' writers\n\
        \x20       mbar_init(stage_empty + 8 * s, WARPS);  // one arrival per consumer warp\n\
        \x20   }}\n\
        \x20   for (int s = 0; s < DQ_BUFS; ++s) {{\n\
        \x20       mbar_init(dq_full + 8 * s, WARPS);\n\
        \x20       mbar_init(dq_empty + 8 * s, 1);\n\
        \x20   }}\n\
        }}\n\
        __syncthreads();\n\
        int it = 0;  // visited steps so far, over every head: step `it` uses stage it % STAGES\n\
        \n",
        first_head = if units { "first_head[2]" } else { "first_head" },
        unit_decls = if units { unit_decls } else { "" },
        unit_inits = if units { unit_inits.as_str() } else { "" },
    )?;
    let exprs = terms.exprs(spec);
    let hoisted = hoist(&exprs);
    let query_terms = QueryTerms::of(spec, &hoisted, layout);
    query_terms.write_buffers(w)?;
    let consumers =
        consumers::Consumers { spec, terms, layout, hoisted: &hoisted, query_terms: &query_terms, units, copy };
    let producer = producer::Producer { spec, layout, copy, packing, query_terms: &query_terms, units };
    let producer = |w: &mut Writer<String>| producer::write(w, &producer);
    match layout.columns {
        KeyColumns::Transposed => write_roles(w, producer, |w| transposed::write(w, &consumers)),
        _ => write_roles(w, producer, |w| consumers::write(w, &consumers)),
    }
}

#[cfg(test)]
mod tests;
