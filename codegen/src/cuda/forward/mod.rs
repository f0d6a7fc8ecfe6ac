//! The forward kernel: FlashAttention-2 on tensor cores, for any spec.
//!
//! Each CTA owns `BLOCK_M` query rows of one (batch, head), 16 per warp, and
//! streams K/V through shared memory `BLOCK_N` keys at a time in a two-stage
//! `cp.async` pipeline: tile j + 1 loads while tile j is multiplied. S = Q·Kᵀ
//! and O += P·V run on `mma.sync.m16n8k16` with f32 accumulators; S stays in
//! registers, goes through the spec's score and mask and the online softmax
//! (base 2, one rescale per tile), and is repacked in place as the A operand
//! of P·V. No score matrix ever reaches memory.
//!
//! On Hopper the same loop runs on `wgmma` (see `wgmma.rs`); with 128-key
//! tiles it is software-pipelined (FlashAttention-3): P·V of tile j is
//! issued behind S of tile j + 1 and runs while the softmax of that S does,
//! so V loads one iteration after its K, O's rescale waits for P·V, and the
//! warpgroups take turns issuing their products. Then it is warp-specialized
//! (see `ring.rs`) and persistent: one more warpgroup issues every copy into
//! a ring of stages, so the warpgroups that multiply never wait at a CTA
//! barrier, and each CTA (one per SM; two of one consumer warpgroup each,
//! which overlap each other instead of taking turns) walks work items it
//! claims from a counter, the next item's loads running while the current
//! one finishes.
//!
//! The spec enters in one place: the `logit` lambda, which maps a dot product
//! at (q, k) to a log2-domain logit, or −∞ where the mask drops the pair.

mod bias;
mod key_bounds;
mod persistent;

use super::expr::{c_expr, c_expr_in, c_type};
use super::hoist::{hoist, lookup, Hoisted, Level};
use super::prelude::PRELUDE;
use super::ranges::RANGES;
use super::ring::RING;
use super::signature::{arg_name, forward_args};
use super::source::{kernel_name, write_entry, write_header};
use super::tile_class::{class_expr, tile_class_expr};
use super::tiles::TILES;
use super::tma::{TileCopy, TMA, TMA_STORE};
use super::wgmma::{write_wgmma_op, AFrom, WGMMA};
use super::writer::Writer;
use crate::abi::{ArgKind, Axis, Grid, Kernel, KernelArg, Operand};
use crate::analysis::block_uniform;
use crate::spec::{BinOp, Dtype, Expr, ExprKind, Func, Spec};
use bias::{additive_bias, biased_logit, lse_row_term, reads_first_key};
use key_bounds::{column_test, key_bounds, FIRST_KEY};
use std::fmt::{self, Write};

/// Which tensor-core instructions a forward kernel is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mma {
    /// Warp-level `mma.sync.m16n8k16` fed by `ldmatrix`: every GPU from sm_80.
    Sync,
    /// Hopper's warpgroup-level `wgmma.mma_async` reading K and V (and Q)
    /// straight from shared memory: sm_90a only.
    Wgmma,
}

/// What the GPU a kernel is generated for offers beyond sm_80.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Target {
    /// `wgmma` (compute capability 9.0, compiled as sm_90a).
    pub wgmma: bool,
}

impl Target {
    /// Any sm_80-class GPU.
    pub const PORTABLE: Target = Target { wgmma: false };

    /// The target of compute capability `major.minor`.
    pub fn for_sm(major: u32, minor: u32) -> Target {
        Target { wgmma: (major, minor) == (9, 0) }
    }
}

/// A tile configuration: how a CTA covers queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    pub mma: Mma,
    /// Warps per CTA (with `Mma::Wgmma`, four per warpgroup).
    pub warps: u32,
    /// 16-row MMA tiles per warp: each K/V fragment read from shared memory
    /// feeds this many MMAs, so 2 halves the shared-memory traffic per FLOP
    /// at the price of twice the accumulator registers. 1 with `Mma::Wgmma`
    /// (a warpgroup's 64 rows are 16 per warp).
    pub m_tiles: u32,
    /// Keys per K/V tile (a multiple of 16).
    pub block_n: u32,
}

impl TileConfig {
    /// The portable default for a spec (`Mma::Sync`), whose tile is also the
    /// granularity of the spec's block masks ([`TileConfig::mask_tile`]): 4
    /// warps; up to head dim 128, 32 query rows per warp (FlashAttention-2's
    /// BLOCK_M = 128) with 64-key tiles (at d = 128 the mask and score code
    /// then leaves ptxas a few loop-invariant spills, cheaper than halving
    /// the tile: 1.1-1.3x on the H200); above 128 the O accumulator alone
    /// needs 128 registers, so 16 rows and 32 keys.
    pub fn default_for(spec: &Spec) -> TileConfig {
        let sync = |warps, m_tiles, block_n| TileConfig { mma: Mma::Sync, warps, m_tiles, block_n };
        match widest(spec) {
            0..=128 => sync(4, 2, 64),
            _ => sync(4, 1, 32),
        }
    }

    /// The configuration used without autotuning on `target` when the key
    /// length is unknown: the first of [`TileConfig::candidates`].
    pub fn preferred(spec: &Spec, target: Target) -> TileConfig {
        TileConfig::candidates(spec, target)[0]
    }

    /// The configuration used without autotuning on `target` for `kv_len`
    /// keys. [`TileConfig::preferred`], except that from 4096 keys on at
    /// d <= 64 three warpgroups lead for every spec whose S, P and O fit
    /// their registers ([`light`]): the H200 measured them ahead there for
    /// causal, documents and ALiBi (fourteenth session) and the sliding
    /// window once its partial tiles tested column bounds (nineteenth), and
    /// behind at 1024 keys, where the ragged last 192-row tile wastes work
    /// (bench/RESULTS.md).
    pub fn preferred_for(spec: &Spec, target: Target, kv_len: usize) -> TileConfig {
        let long = kv_len > LONG_KEYS && widest(spec) <= 64 && light(spec);
        match long && TileConfig::candidates(spec, target).contains(&THREE_WARPGROUPS) {
            true => THREE_WARPGROUPS,
            false => TileConfig::preferred(spec, target),
        }
    }

    /// The configurations worth timing for `spec` on `target`, preferred
    /// first. A block mask serves them all: a forward tile that differs from
    /// the mask tile combines the mask tiles it overlaps (`coarse_class`).
    ///
    /// The order is what the H200 measured with `flashgen-bench --tune`
    /// (bench/RESULTS.md): up to head dim 128, Hopper's warp-specialized
    /// wgmma kernel first (two warpgroups, 128-key tiles; at d <= 64 its
    /// 192-key tiles second, or last when the mask has two conjuncts that
    /// do not both bound k or the score calls a transcendental function; at
    /// d <= 64 three warpgroups first for plain specs, third for masks of
    /// one conjunct or of bounds on k that read no tensor, else last; at
    /// d <= 64 one warpgroup, two CTAs per SM, first for specs that are not
    /// `light`, else last), then the 64-key back-to-back
    /// kernels (two warpgroups, one); among mma.sync configs, 128-key tiles
    /// only for plain d <= 64 specs (masks and score mods then spill).
    pub fn candidates(spec: &Spec, target: Target) -> Vec<TileConfig> {
        let sync = |warps, m_tiles, block_n| TileConfig { mma: Mma::Sync, warps, m_tiles, block_n };
        // Warpgroups of 64 rows: two share each K/V tile; one alone leaves
        // room for two CTAs per SM that overlap each other's softmax.
        let wgmma = |warps, block_n| TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n };
        let default = TileConfig::default_for(spec);
        let plain = spec.mask.is_none() && spec.score.is_none();
        let hopper = vec![wgmma(8, 128), wgmma(8, 64), wgmma(4, 64)];
        // 192-key tiles at d <= 64 cut the per-tile overhead per FLOP again
        // (the tuner's pick from 4k keys on), but S and P take 144 registers:
        // a two-conjunct mask's partial-tile code (unless its conjuncts bound
        // k) or a transcendental score then spills, and at 1k keys the ragged
        // last tile costs more than that saves (measured, RESULTS).
        let light = light(spec);
        let (first, rest) = hopper.split_at(1);
        let small = match light {
            true => [first, &[wgmma(8, 192)], rest].concat(),
            false => [first, rest, &[wgmma(8, 192)]].concat(),
        };
        // Three warpgroups of 64 rows (FlashAttention-3's d <= 64 tile): at
        // d <= 64 a tile's softmax outlasts its products, and a third
        // warpgroup keeps the tensor cores busy through it. S, P and O fit
        // in its 160 registers; partial-tile code of two conjuncts (but for
        // bounds on k) or of tensor reads, and transcendental scores, spill
        // (measured: 1.14-1.17x on full attention from 4k keys, +3-5% causal,
        // slower at 1k keys, where the ragged last 192-row tile wastes work).
        let three = THREE_WARPGROUPS;
        let reads_tensor = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
        let simple_mask = light && !reads_tensor;
        let small = match (plain, simple_mask) {
            (true, _) => [&[three], small.as_slice()].concat(),
            (false, true) => [&small[..2], &[three], &small[2..]].concat(),
            (false, false) => [small.as_slice(), &[three]].concat(),
        };
        // One consumer warpgroup, two CTAs per SM: each CTA's item boundary
        // (last P V, epilogue, next claim, first S) overlaps the other's
        // tiles. First where a transcendental score or a partial tile of two
        // conjuncts crowds two warpgroups' registers (softcap), else last
        // (measured at 1k and 2k keys, three rounds: two warpgroups 4-9%
        // ahead on documents and ALiBi; softcap a tie).
        let pair = ONE_WARPGROUP_PAIR;
        let small = match !light {
            true => [&[pair], small.as_slice()].concat(),
            false => [small.as_slice(), &[pair]].concat(),
        };
        let (hopper, portable) = match widest(spec) {
            0..=64 if plain => (small, vec![sync(4, 2, 128), default, sync(8, 1, 64)]),
            0..=64 => (small, vec![default, sync(4, 2, 128), sync(8, 1, 64)]),
            65..=128 => (hopper, vec![default, sync(8, 1, 64)]),
            _ => (vec![], vec![default, sync(4, 1, 64)]),
        };
        let hopper = if target.wgmma { hopper } else { vec![] };
        [hopper, portable].concat()
    }

    /// `(rows, keys)` of a block-mask tile for `spec`: the portable
    /// default's tile, whatever configuration a forward launch uses.
    pub fn mask_tile(spec: &Spec) -> (u32, u32) {
        let config = TileConfig::default_for(spec);
        (config.block_m(), config.block_n)
    }

    /// Whether the kernel is persistent (warp-specialized): it claims work
    /// items, in a block mask's work order where it has one.
    pub fn persistent(self) -> bool {
        warp_specialized(self)
    }

    pub fn block_m(self) -> u32 {
        16 * self.m_tiles * self.warps
    }

    /// CTAs a warp-specialized kernel runs per SM: two of one consumer
    /// warpgroup each (their items' ends then overlap the other CTA's
    /// tiles), else one.
    pub fn per_sm(self) -> u32 {
        if warp_specialized(self) && self.warps == 4 {
            2
        } else {
            1
        }
    }

    /// Threads per CTA: the `warps` that multiply, plus the producer
    /// warpgroup of a warp-specialized kernel.
    pub fn threads(self) -> u32 {
        32 * self.warps + if warp_specialized(self) { PRODUCER_THREADS } else { 0 }
    }

    /// K/V pipeline stages in shared memory: for a warp-specialized kernel
    /// a ring of as many as fit beside its two Q buffers, up to
    /// `RING_STAGES` (two at d = 128, three at d = 64); else two (loads of
    /// tile j + 1 while tile j is multiplied).
    pub fn stages(self, spec: &Spec) -> u32 {
        if !warp_specialized(self) {
            return 2;
        }
        let (q, stage) = self.tile_bytes(spec);
        let budget = self.smem_budget(spec) - self.o_buffer_bytes(spec);
        (2..=RING_STAGES).rev().find(|s| 2 * q + s * stage + 1024 <= budget).unwrap_or(2)
    }

    /// Whether a warp-specialized kernel stages O in a buffer of its own
    /// (`OStaging::OBuffer`): where one fits beside its two Q buffers and a
    /// full ring (at d <= 64, two or three consumer warpgroups).
    pub(super) fn o_buffer(self, spec: &Spec) -> bool {
        let (q, stage) = self.tile_bytes(spec);
        let o = self.o_tile_bytes(spec);
        warp_specialized(self) && 2 * q + RING_STAGES * stage + o + 1024 <= self.smem_budget(spec)
    }

    /// O's own buffer, where the kernel has one.
    fn o_buffer_bytes(self, spec: &Spec) -> u32 {
        match self.o_buffer(spec) {
            true => self.o_tile_bytes(spec),
            false => 0,
        }
    }

    /// A staged O tile: 64-column panels of 16-bit elements.
    fn o_tile_bytes(self, spec: &Spec) -> u32 {
        2 * self.block_m() * pad16(spec.head_dims.v).next_multiple_of(64)
    }

    /// What a warp-specialized kernel's dynamic shared memory may take: an
    /// SM's share, less the static arrays beside it.
    fn smem_budget(self, spec: &Spec) -> u32 {
        let ones = if RowSums::of(spec, self) == RowSums::TensorCores { ONES_TILE_BYTES } else { 0 };
        SM_SMEM / self.per_sm()
            - CTA_SMEM_RESERVE
            - STATIC_SMEM_SLACK
            - KeyTerms::of(self).static_bytes(spec, self)
            - ones
    }

    /// Dynamic shared memory: the Q tile (a warp-specialized kernel: two Q
    /// buffers, and O's own buffer where it has one) and `stages` stages of
    /// K and V tiles, 16-bit elements; wgmma's tiles are whole 64-column
    /// panels, 1024-byte aligned (the slack is reserved).
    pub fn smem_bytes(self, spec: &Spec) -> u32 {
        let (q, stage) = self.tile_bytes(spec);
        let q_buffers = if warp_specialized(self) { 2 } else { 1 };
        let slack = if self.mma == Mma::Wgmma { 1024 } else { 0 };
        q_buffers * q + self.stages(spec) * stage + self.o_buffer_bytes(spec) + slack
    }

    /// Bytes of the Q tile and of one K/V stage in shared memory. A
    /// warp-specialized kernel's Q buffer also stages its O: as wide as
    /// the wider of the two.
    fn tile_bytes(self, spec: &Spec) -> (u32, u32) {
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let (qk, v) = match self.mma {
            Mma::Sync => (dp, dvp),
            Mma::Wgmma => (dp.next_multiple_of(64), dvp.next_multiple_of(64)),
        };
        let q_cols = if warp_specialized(self) { qk.max(v) } else { qk };
        (2 * self.block_m() * q_cols, 2 * self.block_n * (qk + v))
    }
}

/// Stages of a warp-specialized kernel's ring, at most.
const RING_STAGES: u32 = 3;

/// Shared memory of an sm_90 SM, of which the driver reserves
/// `CTA_SMEM_RESERVE` per resident CTA; a warp-specialized kernel's
/// dynamic shared memory leaves `STATIC_SMEM_SLACK` for its static shared
/// memory (barriers, staged block-mask classes) besides what `stages`
/// counts.
const SM_SMEM: u32 = 228 * 1024;
const CTA_SMEM_RESERVE: u32 = 1024;
const STATIC_SMEM_SLACK: u32 = 4 * 1024;

/// Static shared memory of the tile of ones that row sums on the tensor
/// cores multiply P with (`ones_tile`): an m64n8k16 product's B operand,
/// two 8-key groups of 128-byte rows.
pub(super) const ONES_TILE_BYTES: u32 = 2048;

/// Threads of a warp-specialized kernel's producer warpgroup.
const PRODUCER_THREADS: u32 = 128;

/// Registers per thread of a warp-specialized kernel after `setmaxnreg`,
/// (producer, consumers). `setmaxnreg` moves registers within the pool the
/// CTA got at launch (its threads times the launch count, the register file
/// over the threads in multiples of 8), and a request the pool cannot meet
/// blocks forever: the consumers get the most it allows, in multiples of 8,
/// up to what their tiles need, the producer at least 24 and the rest. A
/// consumer thread holds S and P (3/4 of a register per key of the tile), O
/// (DVP / 2) and, by ptxas's reports, ~80 more: 208 at d <= 64 with 128-key
/// tiles, where 240 left the producer 24 and it spilled ~300 instructions
/// in its tile walk (20 at 88); 240 (the most) otherwise. Two consumer
/// warpgroups: 24 / 240 or 88 / 208 of 168 at launch; three: 32 / 160 of
/// 128 (the three-warpgroup producer spills ~100-200 instructions at 32,
/// but 152 made ptxas serialize the consumers' wgmma, C7512: -40%). One
/// (two CTAs per SM) shares 128 at launch with the producer, which keeps
/// 88 there (at 48 it spilled ~100 instructions; the consumers' 168 spill
/// 2).
fn ws_regs(spec: &Spec, config: TileConfig) -> (u32, u32) {
    let pool = launch_regs(config) * config.threads() / 128;
    let groups = config.warps / 4;
    let need = 3 * config.block_n / 4 + pad16(spec.head_dims.v) / 2 + 80;
    let producer_floor = if groups == 1 { 88 } else { 24 };
    let consumer = ((pool - producer_floor) / groups).min(need).min(240) / 8 * 8;
    (pool - groups * consumer, consumer)
}

/// Registers per thread at launch: the register file shared by the CTAs
/// of an SM, in multiples of 8.
fn launch_regs(config: TileConfig) -> u32 {
    65536 / config.per_sm() / config.threads() / 8 * 8
}

/// Keys beyond which [`TileConfig::preferred_for`] may differ from
/// [`TileConfig::preferred`].
const LONG_KEYS: usize = 2048;

/// The d <= 64 wgmma tile of one consumer warpgroup (64 query rows,
/// 128-key tiles), two CTAs per SM.
const ONE_WARPGROUP_PAIR: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 4, m_tiles: 1, block_n: 128 };

/// The d <= 64 wgmma tile of three consumer warpgroups (192 query rows,
/// 128-key tiles).
const THREE_WARPGROUPS: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 12, m_tiles: 1, block_n: 128 };

/// Whether a spec's partial-tile code and score fit the registers of the
/// d <= 64 tiles that hold the most (192-key S, three warpgroups): no mask
/// of two conjuncts unless each bounds k (a sliding window: its partial
/// tiles keep an interval of columns per row, `key_bounds`), no
/// transcendental score.
fn light(spec: &Spec) -> bool {
    let mask_fits = two_conjuncts(spec).is_none() || key_bounds(spec.mask.as_ref()).is_some();
    mask_fits && !spec.score.as_ref().is_some_and(transcendental)
}

/// Whether `e` calls a transcendental function (tanh, exp, …).
fn transcendental(e: &Expr) -> bool {
    let mut found = false;
    e.walk(&mut |n| found |= matches!(&n.kind, ExprKind::Call(f, _) if !f.is_numeric() && *f != Func::Floor));
    found
}

/// The wider head dim, padded to the MMA k-step.
fn widest(spec: &Spec) -> u32 {
    pad16(spec.head_dims.qk).max(pad16(spec.head_dims.v))
}

/// Head dims round up to the MMA k-step (and to pairs of 8-wide n-tiles).
pub(super) fn pad16(d: u32) -> u32 {
    d.div_ceil(16) * 16
}

/// Emits the forward kernel for `spec` with its default tile configuration.
/// Deterministic: the same spec always gives byte-identical source.
pub fn emit_forward(spec: &Spec) -> Kernel {
    emit_forward_with(spec, TileConfig::default_for(spec))
}

/// Emits the forward kernel for `spec` with an explicit tile configuration;
/// a warp-specialized one copies with TMA.
pub fn emit_forward_with(spec: &Spec, config: TileConfig) -> Kernel {
    emit_forward_copying(spec, config, TileCopy::Tma)
}

/// [`emit_forward_with`], copying tiles as `copy` says where the
/// configuration is warp-specialized (the others copy with their threads).
pub fn emit_forward_copying(spec: &Spec, config: TileConfig, copy: TileCopy) -> Kernel {
    let name = kernel_name("fwd", spec);
    let copy = warp_specialized(config).then_some(copy);
    let args = forward_args(spec, copy);
    let mut w = Writer::new(String::new());
    write_kernel(&mut w, spec, config, copy, &name, &args).expect("formatting into a String cannot fail");
    Kernel {
        name,
        source: w.into_inner(),
        grid: match warp_specialized(config) {
            true => Grid::Persistent { per_sm: config.per_sm() },
            false => Grid::QueryTiles,
        },
        block_m: config.block_m(),
        block_n: config.block_n,
        threads: config.threads(),
        dynamic_smem: config.smem_bytes(spec),
        args,
    }
}

/// `copy`: how a warp-specialized kernel copies (`None` for the others).
fn write_kernel(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    copy: Option<TileCopy>,
    name: &str,
    args: &[KernelArg],
) -> fmt::Result {
    write_header(w, spec)?;
    w.write_str(PRELUDE)?;
    writeln!(w)?;
    w.write_str(RANGES)?;
    writeln!(w)?;
    w.write_str(TILES)?;
    writeln!(w)?;
    if config.mma == Mma::Wgmma {
        w.write_str(WGMMA)?;
        write_wgmma_op(w, spec.dtype, config.block_n, AFrom::Shared)?;
        write_wgmma_op(w, spec.dtype, pad16(spec.head_dims.v), AFrom::Registers)?;
        if RowSums::of(spec, config) == RowSums::TensorCores {
            write_wgmma_op(w, spec.dtype, 8, AFrom::Registers)?;
        }
        writeln!(w)?;
    }
    if let Some(copy) = copy {
        w.write_str(RING)?;
        writeln!(w)?;
        w.write_str(persistent::WORK_CLAIMS)?;
        writeln!(w)?;
        if copy == TileCopy::Tma {
            w.write_str(TMA)?;
            w.write_str(TMA_STORE)?;
            writeln!(w)?;
        }
    }
    write_config(w, spec, config)?;
    writeln!(w)?;
    let bounds = match config.per_sm() {
        1 => "CTA_THREADS".to_string(),
        n => format!("CTA_THREADS, {n}"),
    };
    write_entry(w, spec, (name, &bounds), args, |w| write_body(w, spec, config, copy))
}

fn write_config(w: &mut Writer<String>, spec: &Spec, config: TileConfig) -> fmt::Result {
    let storage = match spec.dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    let (d, dv) = (spec.head_dims.qk, spec.head_dims.v);
    let (dp, dvp) = (pad16(d), pad16(dv));
    let TileConfig { mma, warps, m_tiles, block_n } = config;
    write!(
        w,
        "\
        // ---- kernel configuration ---------------------------------------------------\n\
        using storage = {storage};  // element format of Q, K, V and O\n\
        constexpr int D = {d};  // Q/K head dim\n\
        constexpr int DV = {dv};  // V/O head dim\n\
        constexpr int DP = (D + 15) / 16 * 16;  // D padded to the MMA k-step (zeros beyond D)\n\
        constexpr int DVP = (DV + 15) / 16 * 16;  // DV padded to pairs of 8-wide MMA tiles\n\
        constexpr int WARPS = {warps};\n\
        constexpr int THREADS = 32 * WARPS;  // the threads that multiply\n\
        constexpr int M_TILES = {m_tiles};  // 16-row MMA tiles per warp\n\
        constexpr int WARP_M = 16 * M_TILES;  // query rows per warp\n\
        constexpr int BLOCK_M = WARP_M * WARPS;  // query rows per CTA: grid.x = ceil(q_len / BLOCK_M)\n\
        constexpr int BLOCK_N = {block_n};  // keys per K/V tile\n\
        constexpr int S_TILES = BLOCK_N / 8;  // m16n8 accumulator tiles of a warp's S\n\
        constexpr int O_TILES = DVP / 8;  // m16n8 accumulator tiles of a warp's O\n\
        // Shared memory: the Q tile, then STAGES pipeline stages of K and of V tiles.\n"
    )?;
    if warp_specialized(config) {
        let groups = config.warps / 4;
        let launch = launch_regs(config);
        let (producer, consumer) = ws_regs(spec, config);
        write!(
            w,
            "\
            // Warp specialization: one more warpgroup copies Q and the K/V tiles into\n\
            // a ring of STAGES stages (see the stage ring above) and hands most of its\n\
            // registers to the {groups} warpgroups that multiply ({launch} each at launch: {producer} + {groups} x {consumer}).\n\
            constexpr int WARPGROUPS = WARPS / 4;  // consumer warpgroups, 64 rows each\n\
            constexpr int PRODUCER_THREADS = {PRODUCER_THREADS};\n\
            constexpr int CTA_THREADS = THREADS + PRODUCER_THREADS;\n\
            constexpr int PRODUCER_REGS = {producer};\n\
            constexpr int CONSUMER_REGS = {consumer};\n"
        )?;
    } else {
        writeln!(w, "constexpr int CTA_THREADS = THREADS;")?;
    }
    writeln!(w, "constexpr int STAGES = {};  // K/V pipeline stages", config.stages(spec))?;
    let cols = ShmemCols::of(mma);
    if mma == Mma::Wgmma {
        writeln!(w, "// wgmma reads whole 64-column panels (zeros beyond DP and DVP).")?;
        writeln!(w, "constexpr int QK_COLS = {};", dp.next_multiple_of(64))?;
        writeln!(w, "constexpr int V_COLS = {};", dvp.next_multiple_of(64))?;
    }
    let ShmemCols { qk, v, .. } = cols;
    if warp_specialized(config) {
        let (q_note, o_tile) = match config.o_buffer(spec) {
            true => ("", "BLOCK_M * V_COLS;  // O's own staging buffer"),
            false => ("; it also stages O", "0;  // O is staged in the item's Q buffer"),
        };
        writeln!(w, "constexpr int Q_TILE = BLOCK_M * (QK_COLS > V_COLS ? QK_COLS : V_COLS);  // a Q buffer{q_note}")?;
        writeln!(w, "constexpr int O_TILE = {o_tile}")?;
    } else {
        writeln!(w, "constexpr int Q_TILE = BLOCK_M * {qk};")?;
    }
    writeln!(w, "constexpr int K_TILE = BLOCK_N * {qk};")?;
    writeln!(w, "constexpr int V_TILE = BLOCK_N * {v};")?;
    if spec.mask.is_some() {
        write_mask_tiles(w, spec)?;
    }
    Ok(())
}

/// The shared-tile column counts and layout flag `load_tile` gets, as C.
#[derive(Clone, Copy)]
struct ShmemCols {
    qk: &'static str,
    v: &'static str,
    /// `load_tile`'s trailing template argument: wgmma's panel layout.
    panels: &'static str,
}

impl ShmemCols {
    fn of(mma: Mma) -> ShmemCols {
        match mma {
            Mma::Sync => ShmemCols { qk: "DP", v: "DVP", panels: "" },
            Mma::Wgmma => ShmemCols { qk: "QK_COLS", v: "V_COLS", panels: ", true" },
        }
    }
}

fn write_body(w: &mut Writer<String>, spec: &Spec, config: TileConfig, copy: Option<TileCopy>) -> fmt::Result {
    match config.mma {
        Mma::Sync => writeln!(w, "extern __shared__ __align__(128) unsigned short smem[];")?,
        Mma::Wgmma => write!(
            w,
            "\
            // wgmma's swizzle atoms are 1024-byte aligned; the launch reserves the slack.\n\
            extern __shared__ __align__(1024) unsigned char smem_raw[];\n\
            unsigned short* smem = (unsigned short*)(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);\n"
        )?,
    }
    if let Some(copy) = copy {
        return persistent::write_body(w, spec, config, copy);
    }
    let name = |kind| arg_name(spec, kind);
    let [q_len, kv_len] = [ArgKind::QLen, ArgKind::KvLen].map(name);
    let ShmemCols { qk: qk_cols, panels, .. } = ShmemCols::of(config.mma);
    write!(
        w,
        "\
        unsigned short* q_tile = smem;\n\
        unsigned short* k_tiles = q_tile + Q_TILE;  // [STAGES][K_TILE]\n\
        unsigned short* v_tiles = k_tiles + STAGES * K_TILE;  // [STAGES][V_TILE]\n\
        \n\
        // The spec's built-ins b and h (q and k are bound per element below).\n\
        const int b = blockIdx.z;\n\
        const int h = blockIdx.y;\n\
        // Query tiles in reverse launch order: under a causal mask the last rows\n\
        // do the most work, and starting them first leaves light tiles for the\n\
        // grid's tail.\n\
        const int q_block = gridDim.x - 1 - blockIdx.x;\n\
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;\n\
        const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair\n"
    )?;
    write_item_rows(w, spec, ItemRole::Cta)?;
    let q_load = q_load(spec);
    writeln!(w, "// Prologue: the Q tile, then (once the tile classes say which) the first")?;
    writeln!(w, "// visited K/V tile, in flight together.")?;
    writeln!(w, "load_tile<BLOCK_M, {qk_cols}, D, THREADS{panels}>{q_load}")?;
    writeln!(w, "const int kv_tiles = ({kv_len} + BLOCK_N - 1) / BLOCK_N;")?;
    write_tile_classes(w, spec, config, &q_len, &kv_len, &Stagers::CTA, ClassReader::Cta)?;
    let kv = KvLoads::of(spec, config);
    let pipelined = pipelined(config);
    writeln!(w, "int j = next_tile(0);")?;
    // Pipelined kernels load a tile's V one iteration after its K (see below).
    kv.load_if(w, "j < kv_tiles", "", "j", !pipelined)?;
    write!(
        w,
        "\
        cp_async_commit();\n\
        // The tile after j, one ahead: finding it may read the block mask, and a\n\
        // tile's compute hides that load's latency.\n\
        int next = j < kv_tiles ? next_tile(j + 1) : kv_tiles;\n"
    )?;
    writeln!(w)?;
    let hoisted = write_spec_terms(w, spec, &kv_len, KeyTerms::of(config), false)?;
    write_accumulators(w, config, RowSums::Fadd)?;
    writeln!(w)?;
    let step = |w: &mut Writer<String>| match config.mma {
        Mma::Sync => write_sync_step(w, spec, &hoisted),
        Mma::Wgmma if pipelined => write_wgmma_step(w, spec, config, &hoisted),
        Mma::Wgmma => write_wgmma_serial_step(w, spec, config, &hoisted),
    };
    write_cta_loop(w, spec, config, &kv, step)?;
    write_epilogue(w, spec, &hoisted, OStaging::Cta, RowSums::Fadd)
}

/// Who works on an item, which decides the operands' rows it addresses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ItemRole {
    /// Every thread of a CTA: it loads Q, K and V and stores O itself.
    Cta,
    /// A warp-specialized kernel's producer: it copies Q, K and V (with
    /// TMA, by coordinates alone).
    Producer(TileCopy),
    /// Its consumers: they store O (with TMA, by coordinates alone).
    Consumers(TileCopy),
}

/// From the query tile `q_block` and `b`, `h`: its first row, the K/V head
/// of a `role` that loads K and V, and this (batch, head)'s rows of the
/// operands the role addresses, with whether Q's, K's and V's allow 16-byte
/// copies.
fn write_item_rows(w: &mut Writer<String>, spec: &Spec, role: ItemRole) -> fmt::Result {
    let name = |kind| arg_name(spec, kind);
    let [heads, heads_kv] = [ArgKind::Heads, ArgKind::HeadsKv].map(name);
    let seq_stride = |op| name(ArgKind::Stride(op, Axis::Seq));
    let [q_stride, k_stride, v_stride] = [Operand::Q, Operand::K, Operand::V].map(seq_stride);
    writeln!(w, "const int q0 = q_block * BLOCK_M;")?;
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
        let ptr = name(ArgKind::Ptr(op));
        let batch_stride = name(ArgKind::Stride(op, Axis::Batch));
        let head_stride = name(ArgKind::Stride(op, Axis::Head));
        writeln!(w, "auto* {rows} = {ptr} + b * {batch_stride} + {head} * {head_stride};")?;
    }
    if copies {
        write!(
            w,
            "\
            // 16-byte copies need 16-byte aligned rows; otherwise (odd strides, odd\n\
            // offsets) the tiles load element by element. Uniform across the CTA.\n\
            const bool vector = aligned16(q_rows, {q_stride}) && aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});\n"
        )?;
    }
    writeln!(w)
}

/// `load_tile`'s arguments for the Q tile into `q_tile`.
fn q_load(spec: &Spec) -> String {
    let [q_len, q_stride] = [ArgKind::QLen, ArgKind::Stride(Operand::Q, Axis::Seq)].map(|kind| arg_name(spec, kind));
    format!("(q_tile, q_rows + (long long)q0 * {q_stride}, {q_stride}, {q_len} - q0, vector);")
}

/// The spec's hoisted terms and the `logit` lambdas; returns the hoisted
/// terms the tile steps read. `staged_items`: the producer staged the
/// item's terms per CTA and per query ([`StagedTerms::items`]).
fn write_spec_terms<'s>(
    w: &mut Writer<String>,
    spec: &'s Spec,
    kv_len: &str,
    keys: KeyTerms,
    staged_items: bool,
) -> Result<Vec<Hoisted<'s>>, fmt::Error> {
    let hoisted = hoist(&spec_exprs(spec));
    write_invariants(w, spec, &hoisted, keys, staged_items)?;
    write_logit(w, spec, &hoisted, &arg_name(spec, ArgKind::Scale), kv_len)?;
    writeln!(w)?;
    Ok(hoisted)
}

/// The Q operand's address, the O accumulators and the online softmax
/// state; for pipelined kernels also P of the previous tile.
fn write_accumulators(w: &mut Writer<String>, config: TileConfig, sums: RowSums) -> fmt::Result {
    match config.mma {
        Mma::Sync => write!(
            w,
            "\
            // ldmatrix rows of this lane in the Q, K and V tiles (see LdmLane).\n\
            const LdmLane<DP> q_lane(warp * WARP_M + lane % 8 + (lane / 8 % 2) * 8, lane / 16);\n\
            const LdmLane<DP> k_lane(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
            const LdmLane<DVP> v_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);\n\
            const unsigned q_smem = smem_addr(q_tile);\n"
        )?,
        Mma::Wgmma => write!(
            w,
            "\
            // This warpgroup's 64 rows of the Q tile (128-byte rows in each panel).\n\
            const unsigned q_smem = smem_addr(q_tile) + warp / 4 * 64 * 128;\n"
        )?,
    }
    let (sum, sum_decl) = match sums {
        RowSums::Fadd => ("this lane's share of the running sum l.", "float l[M_TILES][2] = {};"),
        RowSums::TensorCores => (
            "the running sum, P times ones: row r's is row_sum[mt][2 * r] (and 2 * r + 1).",
            "float row_sum[M_TILES][4] = {};",
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
            unsigned p[BLOCK_N / 16][4];\n\
            bool pv_pending = false;\n"
        )?;
    }
    Ok(())
}

/// The tile loop of kernels whose threads all load and all multiply: two
/// stages, every thread's copies waited for and published by a CTA barrier.
fn write_cta_loop(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    kv: &KvLoads,
    step: impl Fn(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    let pipelined = pipelined(config);
    let v_stage = if pipelined { "(stage ^ 1)" } else { "stage" };
    writeln!(w, "int stage = 0;")?;
    let interior = interior_decl(spec, "kv0");
    w.block(format_args!("for (; j < kv_tiles; stage ^= 1)"), |w| {
        write!(
            w,
            "\
            const int kv0 = j * BLOCK_N;\n\
            const bool full = tile_full(j);  // the mask keeps every pair: skip evaluating it\n\
            {interior}\
            const unsigned k_smem = smem_addr(k_tiles + stage * K_TILE);\n\
            const unsigned v_smem = smem_addr(v_tiles + {v_stage} * V_TILE);\n\
            cp_async_wait_all();\n"
        )?;
        if config.mma == Mma::Wgmma {
            writeln!(w, "fence_async_smem();  // the tensor cores read the tiles through the async proxy")?;
            writeln!(w, "__syncthreads();  // this iteration's tiles are visible; the stages the loads")?;
            writeln!(w, "                  // below overwrite are done with (their products were waited for)")?;
        } else {
            writeln!(w, "__syncthreads();  // tile j is visible, and every warp is done with the previous one")?;
        }
        // The next loads: K of `next` and V of `next` (pipelined: of j) into the stages
        // the previous iteration finished with. (Issuing them after the
        // wgmmas instead measured 4-6% slower on the H200.)
        kv.load_if(w, "next < kv_tiles", " + (stage ^ 1)", "next", !pipelined)?;
        if pipelined {
            kv.v(w, "v_tiles + stage * V_TILE", "j")?;
        }
        writeln!(w, "cp_async_commit();")?;
        writeln!(w, "const int after = next < kv_tiles ? next_tile(next + 1) : kv_tiles;")?;
        step(w)?;
        writeln!(w, "j = next;")?;
        writeln!(w, "next = after;")
    })?;
    if pipelined {
        let wait = ["cp_async_wait_all();", "fence_async_smem();", "__syncthreads();  // its V is visible"];
        write_last_pv(w, spec, &wait, "(stage ^ 1)", &[], RowSums::Fadd)?;
    }
    writeln!(w, "cp_async_wait_all();  // nothing may stay in flight past the kernel (kv_len = 0)")
}

/// The last visited tile's P V (pipelined kernels): the `wait` lines make
/// its V, in stage `v_stage`, visible to the tensor cores (async proxy)
/// first, the `done` lines follow it.
fn write_last_pv(
    w: &mut Writer<String>,
    spec: &Spec,
    wait: &[&str],
    v_stage: &str,
    done: &[&str],
    sums: RowSums,
) -> fmt::Result {
    writeln!(w, "// The last visited tile's P V.")?;
    w.block(format_args!("if (pv_pending)"), |w| {
        for line in wait {
            writeln!(w, "{line}")?;
        }
        writeln!(w, "const unsigned v_smem = smem_addr(v_tiles + {v_stage} * V_TILE);")?;
        write_pv_waited(w, spec, sums)?;
        done.iter().try_for_each(|line| writeln!(w, "{line}"))
    })
}

/// O += P V on the tensor cores, issued and waited for: O is the
/// warpgroup's again afterwards.
fn write_pv_waited(w: &mut Writer<String>, spec: &Spec, sums: RowSums) -> fmt::Result {
    writeln!(w, "wgmma_fence();")?;
    write_wgmma_pv(w, spec, sums)?;
    writeln!(w, "wgmma_commit();")?;
    writeln!(w, "wgmma_wait<0>();")?;
    write_fence_accumulators(w, sums)
}

/// Pins O (and the row sums on the tensor cores) after a wait for P V.
fn write_fence_accumulators(w: &mut Writer<String>, sums: RowSums) -> fmt::Result {
    writeln!(w, "fence_operands(o[0]);")?;
    match sums {
        RowSums::Fadd => Ok(()),
        RowSums::TensorCores => writeln!(w, "fence_operands(row_sum);"),
    }
}

/// O = o / l into a swizzled shared tile, then to memory; and the LSE. Only
/// the threads that multiply get here: a warp-specialized kernel meets on a
/// named barrier of theirs instead of `__syncthreads`.
fn write_epilogue(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    staging: OStaging,
    sums: RowSums,
) -> fmt::Result {
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
    // The logits leave out a row's part of a key-linear bias: its LSE adds it.
    let sum = match sums {
        RowSums::Fadd => "quad_sum(l[mt][r])",
        RowSums::TensorCores => "row_sum[mt][2 * r]",
    };
    let row_term = match lse_row_term(spec, hoisted) {
        Some(term) => format!(" + {term}"),
        None => String::new(),
    };
    if let OStaging::OBuffer(_) = staging {
        // The warp's last S has read its rows of Q: the producer may refill the buffer.
        writeln!(
            w,
            "\nif (lane == 0) mbar_arrive(q_empty + 8 * qb);  // the Q buffer takes the Q of the item after next"
        )?;
    }
    write!(
        w,
        "\
        \n\
        {sync}  // {done}\n\
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
        \x20   const int q = q0 + warp * WARP_M + mt * 16 + g + 8 * r;\n\
        \x20   const float sum = sums[i] = {sum};\n\
        \x20   if ({lse} != nullptr && t == 0 && q < {q_len}) {{\n\
        \x20       {lse}[((long long)b * {heads} + h) * {q_len} + q] = sum > 0.0f ? (m[mt][r] + fast_log2(sum){row_term}) * LN2 : neg_inf();\n\
        \x20   }}\n\
        }}\n\
        unsigned short* o_tile = {o_tile}\n\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const int row = warp * WARP_M + mt * 16 + g + 8 * r;\n\
        \x20   const float inv = sums[i] > 0.0f ? fast_rcp(sums[i]) : 0.0f;\n\
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
            write_o_store(w, copy, &store, true)?;
            writeln!(w, "__syncwarp();  // the warp's reads of o_tile are done:")?;
            writeln!(
                w,
                "if (lane == 0) mbar_arrive(q_empty + 8 * qb);  // the buffer takes the Q of the item after next"
            )
        }
        // Nothing waits for the store here: the next item's epilogue does.
        OStaging::OBuffer(copy) => write_o_store(w, copy, &store, false),
    }
}

/// O from a warp-specialized kernel's staging tile to memory: with TMA each
/// warp's lane 0 hands its 16 rows to the copy engine (no warpgroup barrier,
/// no per-thread address math; the copy engine clips rows past q_len),
/// waiting until the copy has read them where `wait_read` (the tile is the
/// Q buffer the warp frees next); else the warpgroup meets and its threads
/// store 16 bytes at a time.
fn write_o_store(w: &mut Writer<String>, copy: TileCopy, store: &str, wait_read: bool) -> fmt::Result {
    match copy {
        TileCopy::Tma => {
            write!(
                w,
                "\
                // The copy engine stores the warp's rows.\n\
                fence_async_smem();  // this thread's O, visible to the copy engine\n\
                __syncwarp();\n\
                if (lane == 0) {{\n\
                \x20   tma_store_tile<WARP_M, V_COLS, BLOCK_M>(o_tile + warp * WARP_M * 64, o_map, q0 + warp * WARP_M, h, b);\n"
            )?;
            if wait_read {
                writeln!(w, "\x20   tma_store_wait_read();")?;
            }
            writeln!(w, "}}")
        }
        TileCopy::Threads => writeln!(w, "{WARPGROUP_SYNC}\n{store}"),
    }
}

/// A consumer warpgroup's own named barrier (the other warpgroups go on).
const WARPGROUP_SYNC: &str = "named_barrier_sync(3 + WARPGROUPS + warpgroup, 128);";

/// Where the epilogue stages O in shared memory (unrelated to [`Stagers`],
/// who stage a tensor mask's block classes).
#[derive(Clone, Copy, PartialEq, Eq)]
enum OStaging {
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

/// Block sparsity by analysis: `next_tile(j)` is the first K/V tile from `j`
/// on that the mask does not remove entirely, and `tile_full(j)` says the
/// mask keeps every pair of tile `j`. Both come from interval arithmetic over
/// the mask with this CTA's query rows and the tile's keys (see `ranges`),
/// evaluated with the launch's params, so they cost a few integer ops per
/// tile and need no mask tensor or precompute pass. A mask that reads
/// positions only as tile-aligned blocks (declared block sparsity, see
/// [`block_uniform`]) is evaluated once per tile instead.
fn write_tile_classes(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    q_len: &str,
    kv_len: &str,
    stagers: &Stagers,
    reader: ClassReader,
) -> fmt::Result {
    let (Some(mask), Some(class)) = (&spec.mask, tile_class_expr(spec)) else {
        writeln!(w, "// No mask: every tile is visited and kept whole.")?;
        writeln!(w, "auto next_tile = [](int j) {{ return j; }};")?;
        return match reader {
            ClassReader::Cta => writeln!(w, "auto tile_full = [](int) {{ return true; }};"),
            ClassReader::RingWord => writeln!(w, "auto tile_bits = [](int) {{ return (int)TILE_FULL; }};"),
        };
    };
    let (skip, full) = if block_uniform(mask, config.block_m(), config.block_n) {
        write!(
            w,
            "\
            // The mask reads q and k only through tile-aligned blocks (declared\n\
            // block sparsity): its value at a tile's first pair holds for the tile.\n\
            auto block_kept = [&](int j) -> bool {{\n\
            \x20   const int q = q0, k = j * BLOCK_N;\n\
            \x20   return {};\n\
            }};\n",
            c_expr(spec, mask)
        )?;
        (" || !block_kept(j)", " || block_kept(j)")
    } else {
        ("", "")
    };
    write!(
        w,
        "\
        // Tile classes: the mask over rows [q_lo, q_hi] x the keys of tiles\n\
        // [j0, j1), in interval arithmetic (lo = 1: keeps every pair; hi = 0:\n\
        // keeps none); span_class over this CTA's rows.\n\
        auto rows_class = [&](int q_lo, int q_hi, int j0, int j1) -> Range {{\n\
        \x20   const int k_lo = j0 * BLOCK_N;\n\
        \x20   const int k_hi = (int)(j1 * (long long)BLOCK_N < {kv_len} ? j1 * (long long)BLOCK_N : {kv_len}) - 1;\n\
        \x20   return {class};\n\
        }};\n\
        const int q_lo = q0, q_hi = min_i32(q0 + BLOCK_M, {q_len}) - 1;\n\
        auto span_class = [&](int j0, int j1) {{ return rows_class(q_lo, q_hi, j0, j1); }};\n\
        // A block mask built for data-dependent masks (tensor reads) refines\n\
        // them: 0 = no pair kept, 2 = every pair kept, exact per tile.\n"
    )?;
    let conjuncts = two_conjuncts(spec).map(|pair| pair.map(|e| class_expr(spec, e)));
    if let (Some([a, b]), ClassReader::Cta) = (&conjuncts, reader) {
        write!(
            w,
            "\
            // Bit x: conjunct x of the mask keeps every pair of tile j, and every\n\
            // key of the tile exists (logit_only tests no bound at kv_len).\n\
            auto whole_conjuncts = [&](int j) -> int {{\n\
            \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
            \x20   const int k_lo = j * BLOCK_N, k_hi = k_lo + BLOCK_N - 1;\n\
            \x20   return ({a}.lo == 1 ? 1 : 0) | ({b}.lo == 1 ? 2 : 0);\n\
            }};\n"
        )?;
    }
    let keys = format!("j * BLOCK_N, min_i32((j + 1) * BLOCK_N, {kv_len}) - 1");
    if !mask.reads_tensor() {
        write_block_class(w, "mask_class", kv_len, "q_lo, q_hi", &keys)?;
    } else {
        write_block_class(w, "block_class", kv_len, "q_lo, q_hi", &keys)?;
        let Stagers { first, count, after } = stagers;
        write!(
            w,
            "\
            // The mask reads tensors, so the block mask decides most tiles: its\n\
            // classes for this tile's rows are staged in shared memory once, and\n\
            // next_tile's scan over removed tiles costs no dependent global loads\n\
            // (they would stall a CTA that has the SM to itself).\n\
            constexpr int STAGED_TILES = 1024;\n\
            __shared__ unsigned char staged_class[STAGED_TILES];\n\
            const bool staged = block_mask != nullptr && kv_tiles <= STAGED_TILES;\n\
            if (staged) {{\n\
            \x20   for (int j = {first}; j < kv_tiles; j += {count}) staged_class[j] = (unsigned char)block_class(j);\n\
            }}\n\
            {after}\n\
            auto mask_class = [&](int j) {{ return staged ? (int)staged_class[j] : block_class(j); }};\n"
        )?;
    }
    write!(
        w,
        "\
        // The next tile from j on that keeps a pair. Runs of tiles the analysis\n\
        // rules out are skipped by binary search, so a sliding window does not\n\
        // pay for a scan over every tile of the row.\n"
    )?;
    write_next_tile(w, "kv_tiles", &format!("mask_class(j) == 0{skip}"), mask.reads_tensor())?;
    let keeps_all = format!("span_class(j, j + 1).lo == 1 || mask_class(j) == 2{full}");
    match (reader, conjuncts) {
        (ClassReader::Cta, _) => writeln!(w, "auto tile_full = [&](int j) {{ return {keeps_all}; }};"),
        (ClassReader::RingWord, None) => {
            writeln!(w, "auto tile_bits = [&](int j) -> int {{ return {keeps_all} ? TILE_FULL : 0; }};")
        }
        // The producer classifies every tile it copies: each conjunct once.
        (ClassReader::RingWord, Some([a, b])) => write!(
            w,
            "\
            // Tile j's bits of its word: TILE_FULL where the mask keeps every pair,\n\
            // else bit x (in TILE_WHOLE units) where conjunct x keeps every pair\n\
            // and every key exists (logit_only tests no bound at kv_len).\n\
            auto tile_bits = [&](int j) -> int {{\n\
            \x20   const int k_lo = j * BLOCK_N, k_hi = min_i32((j + 1) * BLOCK_N, {kv_len}) - 1;\n\
            \x20   const Range a = {a}, b = {b};\n\
            \x20   if (r_and(a, b).lo == 1 || mask_class(j) == 2{full}) return TILE_FULL;\n\
            \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
            \x20   return ((a.lo == 1 ? 1 : 0) | (b.lo == 1 ? 2 : 0)) * TILE_WHOLE;\n\
            }};\n"
        ),
    }
}

/// Who reads the tile classes: a CTA's own main loop (`tile_full`, and
/// `whole_conjuncts` under a two-conjunct mask), or a ring producer that packs
/// them into each tile's word (`tile_bits`).
#[derive(Clone, Copy)]
enum ClassReader {
    Cta,
    RingWord,
}

/// The threads that stage a tensor mask's block classes in shared memory
/// (`staged_class`), C: the first one's index among them, their count, and
/// the barrier that publishes the classes (`after`). Every reader of the
/// previous item's classes has passed a barrier of theirs since.
struct Stagers {
    first: &'static str,
    count: &'static str,
    after: &'static str,
}

impl Stagers {
    /// Every thread of a CTA that owns one query tile.
    const CTA: Stagers = Stagers { first: "threadIdx.x", count: "CTA_THREADS", after: "__syncthreads();" };
    /// A warp-specialized kernel's producer, per item, past the barrier on
    /// which it reads its claim (named barrier 2 + WARPGROUPS: the consumers
    /// pass their turns on 1..=WARPGROUPS, and each warpgroup meets its own
    /// threads on 3 + WARPGROUPS + warpgroup). Its consumers take each
    /// tile's class from it.
    const PRODUCER: Stagers = Stagers {
        first: "threadIdx.x - THREADS",
        count: "PRODUCER_THREADS",
        after: "named_barrier_sync(2 + WARPGROUPS, PRODUCER_THREADS);",
    };
}

/// The tile sizes at which a block mask is built ([`TileConfig::mask_tile`]).
pub(super) fn write_mask_tiles(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let (rows, keys) = TileConfig::mask_tile(spec);
    writeln!(w, "// A block mask holds one class per MASK_M x MASK_N tile.")?;
    writeln!(w, "constexpr int MASK_M = {rows};")?;
    writeln!(w, "constexpr int MASK_N = {keys};")
}

/// The lambda `name(j)`: the class of tile j (queries `q_span`, keys
/// `k_span`, each "lo, hi" in C) in the block mask's slice of (`b`, `h`) at
/// the call (a walk over several heads moves `h`), combined over the mask
/// tiles it overlaps; 1 (undecided) without a mask.
pub(super) fn write_block_class(
    w: &mut Writer<String>,
    name: &str,
    kv_len: &str,
    q_span: &str,
    k_span: &str,
) -> fmt::Result {
    write!(
        w,
        "\
        const int mask_kv_tiles = ({kv_len} + MASK_N - 1) / MASK_N;\n\
        auto {name} = [&](int j) {{\n\
        \x20   if (block_mask == nullptr) return 1;\n\
        \x20   const unsigned char* slice = block_mask + b * block_mask_batch_stride + h * block_mask_head_stride;\n\
        \x20   return coarse_class<MASK_M, MASK_N>(slice, mask_kv_tiles, {q_span}, {k_span});\n\
        }};\n"
    )
}

/// The `next_tile` lambda over `tiles` tiles: the first tile from j on that
/// keeps a pair, by the `span_class` lambda and, per tile, the C condition
/// `empty` (true where a finer source says the tile keeps no pair). A
/// visited next tile costs one span evaluation; a run of tiles the analysis
/// rules out whole (the far side of a sliding window, other documents) is
/// skipped by binary search over the spans from j, which only grow.
///
/// With `warp_scan`, a whole warp calls it with the same j (C `lane` is the
/// lane), and where the analysis keeps tile j the warp tests tiles j to
/// j + 31 at once: a run of tiles that only `empty` removes (other documents
/// of a block mask) then costs one round of independent loads per 32 tiles,
/// not a dependent load per tile.
pub(super) fn write_next_tile(w: &mut Writer<String>, tiles: &str, empty: &str, warp_scan: bool) -> fmt::Result {
    let kept = if warp_scan {
        format!(
            "\
            \x20           const int mine = j + lane;\n\
            \x20           const bool kept = mine < {tiles} && span_class(mine, mine + 1).hi != 0 && !removed(mine);\n\
            \x20           const unsigned ahead = __ballot_sync(0xffffffffu, kept);\n\
            \x20           if (ahead != 0) return j + __ffs(ahead) - 1;\n\
            \x20           j += 32;\n"
        )
    } else {
        format!("\x20           if (!({empty})) return j;\n\x20           ++j;\n")
    };
    if warp_scan {
        writeln!(w, "// Where the block mask alone removes tiles (other documents), a warp")?;
        writeln!(w, "// tests 32 at once: every lane of a warp walks with the same j.")?;
        writeln!(w, "auto removed = [&](int j) {{ return {empty}; }};")?;
    }
    write!(
        w,
        "\
        auto next_tile = [&](int j) {{\n\
        \x20   while (j < {tiles}) {{\n\
        \x20       if (span_class(j, j + 1).hi != 0) {{\n\
        {kept}\
        \x20           continue;\n\
        \x20       }}\n\
        \x20       // Tiles [j, lo) keep no pair; [j, hi) keeps one, or hi is the end.\n\
        \x20       int lo = j + 1, hi = {tiles};\n\
        \x20       if (span_class(j, hi).hi == 0) return hi;\n\
        \x20       while (hi - lo > 1) {{\n\
        \x20           const int mid = lo + (hi - lo) / 2;\n\
        \x20           if (span_class(j, mid).hi == 0) lo = mid; else hi = mid;\n\
        \x20       }}\n\
        \x20       j = lo;\n\
        \x20   }}\n\
        \x20   return j;\n\
        }};\n"
    )
}

/// How a tile's per-key spec terms reach the threads that read them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyTerms {
    /// Each thread evaluates the terms of its own 32 keys.
    PerThread,
    /// The producer evaluates each visited tile's terms into a slot of
    /// shared memory (`staged_inv_N[KEY_SLOTS][BLOCK_N]`, visited tile `it`
    /// in slot `it % KEY_SLOTS`) and publishes them with its K; the
    /// consumers' logit reads them there. One evaluation per key instead of
    /// 32 per consumer thread (a tensor read is ~7 instructions: clip,
    /// 64-bit offset, load), and no load latency or barrier on the
    /// consumers' path. Read in place, not copied to registers: 32 of them
    /// beside S, O and P spill the three-warpgroup kernel.
    ///
    /// One slot more than the ring has stages, so K's stage still goes back
    /// once S is done: the producer fills tile `it`'s slot after every
    /// consumer warp released tile `it - STAGES`'s K, so after each is done
    /// with the logit of tile `it - STAGES - 1`, the slot's last reader.
    Staged,
}

impl KeyTerms {
    /// Staged in the warp-specialized wgmma kernels, whose producer walks
    /// the tiles ahead of the consumers.
    pub(super) fn of(config: TileConfig) -> Self {
        match config.mma == Mma::Wgmma && warp_specialized(config) {
            true => KeyTerms::Staged,
            false => KeyTerms::PerThread,
        }
    }

    /// Static shared memory of the staging slots (4 bytes per element at
    /// most, for as many stages as a ring may have), which the ring leaves
    /// room for.
    fn static_bytes(self, spec: &Spec, config: TileConfig) -> u32 {
        if self == KeyTerms::PerThread {
            return 0;
        }
        let hoisted = hoist(&spec_exprs(spec));
        let count = |level| hoisted.iter().filter(|h| h.level == level).count() as u32;
        let slots = RING_STAGES + 1;
        4 * (count(Level::Column) * slots * config.block_n
            + count(Level::Row) * 2 * config.block_m()
            + count(Level::Cta) * 2)
    }
}

/// Hoisted spec terms (see [`super::hoist`]): CTA-level constants, row-level
/// values for the rows this lane owns (row slot `i`, as in the softmax
/// loop), and the column-level arrays the tile loop fills (`Staged`: each
/// read from the staging the producer filled).
fn write_invariants(
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
                    writeln!(w, "const int q = q0 + warp * WARP_M + (i / 2) * 16 + g + 8 * (i % 2);")?;
                    writeln!(w, "{}[i] = {row};", h.name)
                })?
            }
            Level::Column => match keys {
                KeyTerms::PerThread => writeln!(w, "{ty} {}[S_TILES][2];  // filled per tile", h.name)?,
                KeyTerms::Staged => {
                    let name = &h.name;
                    writeln!(w, "// This lane's keys of the tile's slot: [n][c] is key n * 8 + 2 * t + c.")?;
                    writeln!(w, "const {ty} (*{name})[8] = (const {ty} (*)[8])&staged_{name}[0][2 * t];")?
                }
            },
        }
    }
    Ok(())
}

/// Fills the per-column arrays of the hoisted terms at `level` for the tile
/// whose first column is `first_col`, with the column's built-in bound as
/// `var`. The forward's columns are keys (`Level::Column`, `k`, from `kv0`);
/// the backward's dK/dV kernel has queries as columns (`Level::Row`).
pub(super) fn write_column_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[&Hoisted],
    level: Level,
    var: &str,
    first_col: &str,
) -> fmt::Result {
    for h in hoisted.iter().filter(|h| h.level == level) {
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for (int n = 0; n < S_TILES; ++n)"), |w| {
            writeln!(w, "#pragma unroll")?;
            w.block(format_args!("for (int c = 0; c < 2; ++c)"), |w| {
                writeln!(w, "const int {var} = {first_col} + n * 8 + 2 * t + c;")?;
                writeln!(w, "{}[n][c] = {};", h.name, c_expr(spec, h.expr))
            })
        })?;
    }
    Ok(())
}

/// The forward's per-key terms for the tile at `kv0` (see
/// [`write_tile_terms`]).
fn write_key_terms(w: &mut Writer<String>, spec: &Spec, hoisted: &[Hoisted], keys: KeyTerms) -> fmt::Result {
    write_tile_terms(w, spec, hoisted, Level::Column, "k", "kv0", keys)
}

/// Fills the hoisted terms of `level` for the tile whose first column
/// (`var`) is `first_col` (see [`write_split_terms`]).
pub(super) fn write_tile_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    level: Level,
    var: &str,
    first_col: &str,
    keys: KeyTerms,
) -> fmt::Result {
    write_split_terms(w, spec, hoisted, level, |w, terms| match keys {
        KeyTerms::PerThread => write_column_terms(w, spec, terms, level, var, first_col),
        KeyTerms::Staged => write_stage_pointers(w, terms),
    })
}

/// `write`s the hoisted terms of `level`: those of the mask alone only
/// where a tile is not `interior` ([`interior_decl`]): the logit never
/// reads them there, and under a document mask most visited tiles are such.
fn write_split_terms<'h, 's>(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &'h [Hoisted<'s>],
    level: Level,
    write: impl Fn(&mut Writer<String>, &[&'h Hoisted<'s>]) -> fmt::Result,
) -> fmt::Result {
    let in_mask = |h: &&Hoisted| {
        let mut found = false;
        if let Some(mask) = &spec.mask {
            mask.walk(&mut |e| found |= std::ptr::eq(e, h.expr));
        }
        found
    };
    let (mask_terms, terms): (Vec<&Hoisted>, Vec<&Hoisted>) =
        hoisted.iter().filter(|h| h.level == level).partition(in_mask);
    if !terms.is_empty() {
        write(w, &terms)?;
    }
    if mask_terms.is_empty() {
        return Ok(());
    }
    w.block(format_args!("if (!interior)"), |w| write(w, &mask_terms))
}

/// [`KeyTerms::Staged`], the consumers: each term's name points at the
/// lane's keys in visited tile `it`'s slot, where the producer put them.
fn write_stage_pointers(w: &mut Writer<String>, hoisted: &[&Hoisted]) -> fmt::Result {
    for h in hoisted.iter().filter(|h| h.level == Level::Column) {
        let (ty, name) = (c_type(h.expr.ty), &h.name);
        writeln!(w, "{name} = (const {ty} (*)[8])&staged_{name}[it % KEY_SLOTS][2 * t];")?;
    }
    Ok(())
}

/// The spec's mask and score, the expressions its terms are hoisted from.
fn spec_exprs(spec: &Spec) -> Vec<&Expr> {
    spec.mask.iter().chain(spec.score.iter()).collect()
}

/// The per-key terms among `hoisted`.
fn key_terms<'h, 's>(hoisted: &'h [Hoisted<'s>]) -> impl Iterator<Item = &'h Hoisted<'s>> {
    hoisted.iter().filter(|h| h.level == Level::Column)
}

/// A warp-specialized kernel's spec terms that its producer evaluates for
/// the consumers ([`KeyTerms::Staged`]): the spec's hoisted terms, once.
pub(super) struct StagedTerms<'s> {
    spec: &'s Spec,
    hoisted: Vec<Hoisted<'s>>,
    /// The item's per-CTA and per-query terms come with its Q: where the
    /// ring has three stages. The consumers then meet no global load at an
    /// item's first tile (documents d = 64 +5-6% at 4k and 16k keys), but
    /// the producer's item prologue grows, and with two stages it has too
    /// little lead to hide that (documents d = 128 -3 to -5% at 1k and 4k;
    /// bench/RESULTS.md, fourteenth session).
    pub items: bool,
}

impl<'s> StagedTerms<'s> {
    pub(super) fn of(spec: &'s Spec, config: TileConfig) -> Self {
        let hoisted = hoist(&spec_exprs(spec));
        let any_item = hoisted.iter().any(|h| h.level != Level::Column);
        let items = any_item && warp_specialized(config) && config.stages(spec) >= 3;
        StagedTerms { spec, hoisted, items }
    }

    /// Whether the spec has per-key terms, which come with each tile's K.
    pub(super) fn per_key(&self) -> bool {
        key_terms(&self.hoisted).next().is_some()
    }

    /// The item terms (per CTA and per query) this kernel stages.
    fn item_terms(&self) -> impl Iterator<Item = &Hoisted<'s>> {
        self.hoisted.iter().filter(|h| self.items && h.level != Level::Column)
    }

    /// The shared staging (per CTA and per query for each Q buffer's item,
    /// per key in slots of visited tiles), declared where producer and
    /// consumers both see it.
    pub(super) fn write_buffers(&self, w: &mut Writer<String>) -> fmt::Result {
        for h in self.item_terms() {
            let (ty, name) = (c_type(h.expr.ty), &h.name);
            match h.level {
                Level::Cta => writeln!(w, "__shared__ {ty} staged_{name}[2];  // spec term of each Q buffer's item")?,
                _ => writeln!(
                    w,
                    "__shared__ {ty} staged_{name}[2][BLOCK_M];  // per-query spec terms of each Q buffer's item"
                )?,
            }
        }
        if !self.per_key() {
            return Ok(());
        }
        writeln!(w, "// Per-key spec terms of the visited tiles, tile it in slot it % KEY_SLOTS: one")?;
        writeln!(w, "// slot more than stages, so K's stage goes back before the logit reads them.")?;
        writeln!(w, "constexpr int KEY_SLOTS = STAGES + 1;")?;
        for h in key_terms(&self.hoisted) {
            writeln!(w, "__shared__ {} staged_{}[KEY_SLOTS][BLOCK_N];", c_type(h.expr.ty), h.name)?;
        }
        Ok(())
    }

    /// With item `qb`'s Q on its way: the producer threads load the item's
    /// terms into registers (`item_inv_N`; per query, the thread's slot `i`
    /// holds row `threadIdx.x - THREADS + i * PRODUCER_THREADS`), so that
    /// their latency overlaps the tile classes' loads;
    /// [`StagedTerms::write_item_stores`] stages them.
    pub(super) fn write_item_loads(&self, w: &mut Writer<String>) -> fmt::Result {
        let (ctas, rows): (Vec<&Hoisted>, Vec<&Hoisted>) = self.item_terms().partition(|h| h.level == Level::Cta);
        if ctas.is_empty() && rows.is_empty() {
            return Ok(());
        }
        writeln!(w, "// The item's spec terms per CTA and per query, for its consumers.")?;
        for h in &ctas {
            writeln!(w, "const {} item_{} = {};", c_type(h.expr.ty), h.name, c_expr(self.spec, h.expr))?;
        }
        if rows.is_empty() {
            return Ok(());
        }
        writeln!(w, "constexpr int ITEM_ROWS = (BLOCK_M + PRODUCER_THREADS - 1) / PRODUCER_THREADS;")?;
        for h in &rows {
            writeln!(w, "{} item_{}[ITEM_ROWS];", c_type(h.expr.ty), h.name)?;
        }
        write_item_rows_loop(w, |w| {
            writeln!(w, "const int q = q0 + threadIdx.x - THREADS + i * PRODUCER_THREADS;")?;
            rows.iter().try_for_each(|h| writeln!(w, "item_{}[i] = {};", h.name, c_expr(self.spec, h.expr)))
        })
    }

    /// The stores of [`StagedTerms::write_item_loads`]' terms into the Q
    /// buffer's staging; after the producer threads' barrier, the leader
    /// publishes them on Q's barrier, and the consumers read them once Q is
    /// in: no global load latency at an item's first tile.
    pub(super) fn write_item_stores(&self, w: &mut Writer<String>) -> fmt::Result {
        if self.item_terms().next().is_none() {
            return Ok(());
        }
        for h in self.item_terms().filter(|h| h.level == Level::Cta) {
            writeln!(w, "if (leader) staged_{0}[qb] = item_{0};", h.name)?;
        }
        let rows: Vec<&Hoisted> = self.item_terms().filter(|h| h.level == Level::Row).collect();
        if !rows.is_empty() {
            write_item_rows_loop(w, |w| {
                writeln!(w, "const int r = threadIdx.x - THREADS + i * PRODUCER_THREADS;")?;
                let store = |h: &&Hoisted| writeln!(w, "if (r < BLOCK_M) staged_{0}[qb][r] = item_{0}[i];", h.name);
                rows.iter().try_for_each(store)
            })?;
        }
        writeln!(w, "named_barrier_sync(2 + WARPGROUPS, PRODUCER_THREADS);  // the leader publishes them with Q")
    }

    /// Once tile `j`'s K is on its way: the leader's warp evaluates the
    /// tile's per-key terms into its slot (those of the mask alone only
    /// where the consumers evaluate the mask), and the leader publishes
    /// them, with the tile's word, on K's barrier.
    pub(super) fn write_key_terms(&self, w: &mut Writer<String>) -> fmt::Result {
        let spec = self.spec;
        w.block(format_args!("if (warp == WARPS)"), |w| {
            writeln!(w, "const int kv0 = j * BLOCK_N;")?;
            write!(w, "{}", interior_decl(spec, "kv0"))?;
            write_split_terms(w, spec, &self.hoisted, Level::Column, |w, terms| {
                w.block(format_args!("for (int col = lane; col < BLOCK_N; col += 32)"), |w| {
                    writeln!(w, "const int k = kv0 + col;")?;
                    let store = |h: &&Hoisted| {
                        writeln!(w, "staged_{}[it % KEY_SLOTS][col] = {};", h.name, c_expr(spec, h.expr))
                    };
                    terms.iter().try_for_each(store)
                })
            })?;
            writeln!(w, "__syncwarp();  // the warp's terms are in, for the leader's release")?;
            writeln!(w, "if (leader) mbar_arrive(k_full + 8 * stage);")
        })
    }
}

/// A loop over a producer thread's slots of the item's query rows.
fn write_item_rows_loop(w: &mut Writer<String>, body: impl FnOnce(&mut Writer<String>) -> fmt::Result) -> fmt::Result {
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int i = 0; i < ITEM_ROWS; ++i)"), body)
}

/// `interior`: the tile whose first key is `first_key` is kept whole and
/// every key exists, so the spec runs without mask or bounds code there
/// (`logit_interior`, `logit_whole`) and the mask's per-column terms are not
/// loaded. Everywhere else they are, and the logit may evaluate the mask.
pub(crate) fn interior_decl(spec: &Spec, first_key: &str) -> String {
    let kv_len = arg_name(spec, ArgKind::KvLen);
    format!("const bool interior = full && {first_key} + BLOCK_N <= {kv_len};  // kept whole, every key present\n")
}

/// The `logit` lambda: dot product at (q, k) → log2-domain logit, or −∞
/// where the pair is masked or k is past the end of the sequence. `i` is
/// the row slot and `(n, c)` the column slot, for hoisted terms.
/// `logit_interior` is the same on `interior` tiles ([`interior_decl`]):
/// no mask or bounds code. (Two lambdas rather than one generic
/// lambda: NVRTC 13.0 rejects generic lambdas in device code.)
fn write_logit(w: &mut Writer<String>, spec: &Spec, hoisted: &[Hoisted], scale: &str, kv_len: &str) -> fmt::Result {
    let c_expr = |e: &Expr| c_expr_in(spec, e, &|x| lookup(hoisted, x));
    let (prologue, logit) = match &spec.score {
        None => {
            // S stays in dot-product units (see `SUnits::Dots`).
            writeln!(w, "// The spec: mask each element of S (-inf where masked); the softmax scales it.")?;
            writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
            (None, "dot".to_string())
        }
        Some(e) => match additive_bias(e) {
            None => {
                writeln!(w, "// The spec: score and mask each element of S (log2 units, -inf where masked).")?;
                (Some(format!("const float score = dot * {scale};")), format!("{} * LOG2E", c_expr(e)))
            }
            Some(bias) => {
                writeln!(w, "// The spec: score and mask each element of S (log2 units, -inf where masked);")?;
                writeln!(w, "// the score adds a bias to the scaled dot product, one FFMA.")?;
                writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
                biased_logit(spec, bias, hoisted)
            }
        },
    };
    let bias_reads_k0 = spec.score.as_ref().and_then(additive_bias).is_some_and(reads_first_key);
    // A lambda's statements: k0 where it tests column bounds or the bias
    // reads it, then the score's.
    let statements = |k0: bool| -> Vec<String> {
        let k0 = k0.then(|| FIRST_KEY.to_string());
        k0.into_iter().chain(prologue.clone()).collect()
    };
    // How a lambda keeps the pairs `mask` (all of it, or one conjunct)
    // keeps, given the C condition `full` that skips it: as an interval of
    // columns where every conjunct bounds k (`key_bounds`), else as written.
    // `in_bounds`: the lambda only sees tiles whose keys all exist.
    let keep = |mask: Option<&Expr>, full: Option<&str>, in_bounds: bool| -> (Vec<String>, String) {
        match key_bounds(mask) {
            Some(bounds) => {
                let (test, call) = column_test(kv_len, &bounds, full, in_bounds, c_expr);
                let lines = [FIRST_KEY.to_string()].into_iter().chain(test).chain(statements(false)).collect();
                (lines, format!("{call}{logit})"))
            }
            // A tensor mask: the column against the keys left (one compare
            // with an immediate) and, not short-circuited, the mask, so each
            // column's staged key term loads once for both of a lane's rows
            // (its reads are clipped, so in bounds past kv_len too).
            None => match mask {
                Some(e) if e.reads_tensor() => {
                    let kept = format!("(n * 8 + c < {kv_len} - (k - n * 8 - c)) & ({})", c_expr(e));
                    (statements(bias_reads_k0), format!("kept_or_neg_inf({kept}, {logit})"))
                }
                _ => {
                    let cond = match (mask, full) {
                        (Some(e), Some(_)) => skip_if_full(e, &c_expr(e)),
                        (Some(e), None) => format!(" && {}", c_expr(e)),
                        (None, _) => String::new(),
                    };
                    (statements(bias_reads_k0), format!("kept_or_neg_inf(k < {kv_len}{cond}, {logit})"))
                }
            },
        }
    };
    let params = "float dot, int q, int k, int i, int n, int c";
    let lambda = |w: &mut Writer<String>, head: &str, (lines, kept): (Vec<String>, String)| {
        writeln!(w, "{head} {{")?;
        w.indented(|w| {
            lines.iter().try_for_each(|line| writeln!(w, "{line}"))?;
            writeln!(w, "return {kept};")
        })?;
        writeln!(w, "}};")
    };
    lambda(
        w,
        &format!("auto logit = [&]({params}, bool full) -> float"),
        keep(spec.mask.as_ref(), Some("full"), false),
    )?;
    let interior: String = statements(bias_reads_k0).iter().map(|line| format!("{line} ")).collect();
    writeln!(w, "auto logit_interior = [&]({params}) -> float {{ {interior}return {logit}; }};")?;
    if let Some(conjuncts) = two_conjuncts(spec) {
        writeln!(w, "// Partial tiles on which one conjunct of the mask holds throughout, every")?;
        writeln!(w, "// key present (whole_conjuncts): the other conjunct alone.")?;
        for (x, e) in conjuncts.iter().enumerate() {
            lambda(w, &format!("auto logit_only{x} = [&]({params}) -> float"), keep(Some(e), None, true))?;
        }
    }
    Ok(())
}

/// The mask term of `logit`, ` && (full || mask)`: a tile kept whole but
/// cut by kv_len skips the mask. Not for a mask that reads tensors: there LLVM
/// moves each element's compare up to the loads of the tile's column terms
/// and carries the results across the wait for S, and ptxas packs them into
/// bits of a register and unpacks them again: ~12 instructions per element
/// instead of 2 (documents forward at 4k: 321 → 375 TFLOP/s on the H200).
/// Masks without tensors keep the `full ||`: without it, the sliding window
/// and softcap forward lost 2–3% to a spill in the tile loop.
fn skip_if_full(mask: &Expr, c_mask: &str) -> String {
    match mask.reads_tensor() {
        true => format!(" && {c_mask}"),
        false => format!(" && (full || {c_mask})"),
    }
}

/// The mask's two top-level conjuncts, when it is `a && b`: on a partial
/// tile one of them often holds throughout (the diagonal tile of a sliding
/// window is inside the window, its far edge is below the diagonal), and
/// the kernel then evaluates only the other.
fn two_conjuncts(spec: &Spec) -> Option<[&Expr; 2]> {
    match &spec.mask.as_ref()?.kind {
        ExprKind::Binary(BinOp::And, a, b) => Some([&**a, &**b]),
        _ => None,
    }
}

/// How the kernel copies one K or V tile (keys from `tile * BLOCK_N`) into
/// shared memory.
struct KvLoads {
    /// Copied by a warp-specialized kernel's producer warpgroup (else by
    /// every thread).
    ws: bool,
    cols: ShmemCols,
    k_stride: String,
    v_stride: String,
    kv_len: String,
}

impl KvLoads {
    fn of(spec: &Spec, config: TileConfig) -> KvLoads {
        let name = |kind| arg_name(spec, kind);
        KvLoads {
            ws: warp_specialized(config),
            cols: ShmemCols::of(config.mma),
            k_stride: name(ArgKind::Stride(Operand::K, Axis::Seq)),
            v_stride: name(ArgKind::Stride(Operand::V, Axis::Seq)),
            kv_len: name(ArgKind::KvLen),
        }
    }

    /// When `cond` holds: K of `tile`, and V with it when `with_v`, into the
    /// stage `k_tiles{stage} * K_TILE` (`stage` empty: the first one).
    fn load_if(&self, w: &mut Writer<String>, cond: &str, stage: &str, tile: &str, with_v: bool) -> fmt::Result {
        let dst = |tiles: &str, size: &str| match stage {
            "" => tiles.to_string(),
            _ => format!("{tiles}{stage} * {size}"),
        };
        w.block(format_args!("if ({cond})"), |w| {
            self.k(w, &dst("k_tiles", "K_TILE"), tile)?;
            if with_v {
                self.v(w, &dst("v_tiles", "V_TILE"), tile)?;
            }
            Ok(())
        })
    }

    fn k(&self, w: &mut Writer<String>, dst: &str, tile: &str) -> fmt::Result {
        self.load(w, ["k_rows", self.cols.qk, "D", &self.k_stride], dst, tile)
    }

    fn v(&self, w: &mut Writer<String>, dst: &str, tile: &str) -> fmt::Result {
        self.load(w, ["v_rows", self.cols.v, "DV", &self.v_stride], dst, tile)
    }

    /// `source`: the operand's rows, shared-tile columns, valid width and
    /// row stride.
    fn load(&self, w: &mut Writer<String>, source: [&str; 4], dst: &str, tile: &str) -> fmt::Result {
        let [rows, cols, width, stride] = source;
        let kv_len = &self.kv_len;
        let threads = match self.ws {
            true => "PRODUCER_THREADS, true, THREADS".to_string(),
            false => format!("THREADS{}", self.cols.panels),
        };
        writeln!(
            w,
            "load_tile<BLOCK_N, {cols}, {width}, {threads}>({dst}, {rows} + (long long){tile} * BLOCK_N * {stride}, {stride}, {kv_len} - {tile} * BLOCK_N, vector);"
        )
    }
}

/// One K/V tile of the `mma.sync` kernel: S, the spec, the softmax and P V,
/// back to back (two CTAs per SM overlap each other's phases).
fn write_sync_step(w: &mut Writer<String>, spec: &Spec, hoisted: &[Hoisted]) -> fmt::Result {
    write_key_terms(w, spec, hoisted, KeyTerms::PerThread)?;
    write!(
        w,
        "\
        \n\
        // S = Q K^T on this warp's WARP_M rows x BLOCK_N keys; each K fragment\n\
        // feeds all M_TILES row tiles.\n\
        float s[M_TILES][S_TILES][4] = {{}};\n\
        #pragma unroll\n\
        for (int kk = 0; kk < DP / 16; ++kk) {{\n\
        \x20   unsigned a[M_TILES][4];\n\
        \x20   #pragma unroll\n\
        \x20   for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(a[mt], q_smem + q_lane.at(mt * 16, kk));\n\
        {sweep}\
        }}\n",
        sweep = mma_sweep("s", "a", "S_TILES", "kb", "ldmatrix_x4(kb, k_smem + k_lane.at(n * 8, kk))")
    )?;
    write_logits(w, spec, "whole_conjuncts(j)")?;
    write_softmax(w, SUnits::of(spec), Rescale::Inline, RowSums::Fadd)?;
    write!(
        w,
        "\
        // O += P V, with P taken straight from the S registers (pack_p).\n\
        #pragma unroll\n\
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
        \x20   unsigned p[M_TILES][4];\n\
        \x20   #pragma unroll\n\
        \x20   for (int mt = 0; mt < M_TILES; ++mt) pack_p(storage{{}}, p[mt], s[mt], kk);\n\
        {sweep}\
        }}\n",
        sweep = mma_sweep("o", "p", "O_TILES", "vb", "ldmatrix_x4_trans(vb, v_smem + v_lane.at(kk * 16, n / 2))")
    )
}

/// One k-step of an `mma.sync` product, inside a loop over `kk`:
/// `acc[mt][n]` += `a[mt]` x B for every pair of 8-column tiles n of
/// `tiles`, B's fragments for the pair loaded into `b` by `load_b` (C,
/// with `n` and `kk` bound), each feeding all M_TILES row tiles.
fn mma_sweep(acc: &str, a: &str, tiles: &str, b: &str, load_b: &str) -> String {
    format!(
        "\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < {tiles}; n += 2) {{\n\
        \x20       unsigned {b}[4];\n\
        \x20       {load_b};\n\
        \x20       #pragma unroll\n\
        \x20       for (int mt = 0; mt < M_TILES; ++mt) {{\n\
        \x20           mma_16816(storage{{}}, {acc}[mt][n], {a}[mt], {b}[0], {b}[1]);\n\
        \x20           mma_16816(storage{{}}, {acc}[mt][n + 1], {a}[mt], {b}[2], {b}[3]);\n\
        \x20       }}\n\
        \x20   }}\n"
    )
}

/// Whether a wgmma kernel has two or three warpgroups to take turns on the
/// tensor cores (measured on the H200, bench/RESULTS.md: +4-8% at d = 128, +2-3%
/// at d = 64).
pub(super) fn ping_pong(config: TileConfig) -> bool {
    pipelined(config) && config.warps >= 8
}

/// Whether a kernel has a producer warpgroup that feeds a stage ring (see
/// `ring.rs`): the pipelined wgmma kernels (the ping-pong ones, and one
/// consumer warpgroup two CTAs per SM), whose consumers then never meet at
/// a CTA barrier and issue no copies.
fn warp_specialized(config: TileConfig) -> bool {
    pipelined(config)
}

/// Whether a wgmma kernel runs P V of one tile behind S of the next
/// ([`write_wgmma_step`]). Measured on the H200 (bench/RESULTS.md): it pays
/// with 128-key tiles; with 64-key tiles the back-to-back schedule
/// ([`write_wgmma_serial_step`]) was 4-7% faster on full attention and
/// 1.45x on causal at d = 64.
fn pipelined(config: TileConfig) -> bool {
    config.mma == Mma::Wgmma && config.block_n >= 128
}

/// Issues and commits S = Q K^T on this warpgroup's 64 rows x BLOCK_N keys,
/// both operands from shared memory.
fn write_wgmma_s(w: &mut Writer<String>, config: TileConfig) -> fmt::Result {
    write!(
        w,
        "\
        \n\
        // S = Q K^T on this warpgroup's 64 rows x BLOCK_N keys, both operands\n\
        // from shared memory; the first k-step overwrites S.\n\
        float s[M_TILES][S_TILES][4];\n\
        wgmma_fence();\n\
        #pragma unroll\n\
        for (int kk = 0; kk < DP / 16; ++kk) {{\n\
        \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
        \x20   wgmma_ss_n{block_n}(s[0], gmma_desc(q_smem + panel * BLOCK_M * 128 + step, 16, 1024),\n\
        \x20                    gmma_desc(k_smem + panel * BLOCK_N * 128 + step, 16, 1024), kk);\n\
        }}\n\
        wgmma_commit();\n",
        block_n = config.block_n
    )
}

/// One K/V tile of the wgmma kernel, back to back: S, the spec, the softmax
/// and P V, each product waited for before the next step.
fn write_wgmma_serial_step(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    hoisted: &[Hoisted],
) -> fmt::Result {
    write_wgmma_s(w, config)?;
    if hoisted.iter().any(|h| h.level == Level::Column) {
        writeln!(w, "// While the tensor cores run: the tile's per-key spec terms.")?;
        write_key_terms(w, spec, hoisted, KeyTerms::PerThread)?;
    }
    writeln!(w, "wgmma_wait<0>();")?;
    writeln!(w, "fence_operands(s[0]);")?;
    write_logits(w, spec, "whole_conjuncts(j)")?;
    write_softmax(w, SUnits::of(spec), Rescale::Inline, RowSums::Fadd)?;
    writeln!(w, "// O += P V: P from the S registers (pack_p), V from shared memory (MN-major).")?;
    writeln!(w, "unsigned p[BLOCK_N / 16][4];")?;
    writeln!(w, "#pragma unroll")?;
    writeln!(w, "for (int kk = 0; kk < BLOCK_N / 16; ++kk) pack_p(storage{{}}, p[kk], s[0], kk);")?;
    write_pv_waited(w, spec, RowSums::Fadd)
}

/// One K/V tile of the wgmma kernel, software-pipelined: S of tile j and
/// P V of the previous tile are issued together, and O is rescaled once P V
/// is done. The source waits for P V after the softmax of S, but ptxas
/// schedules that wait at the softmax's top: holding it there lost at
/// d = 128 (bench/RESULTS.md, thirteenth session), so the other warpgroups'
/// products are what the softmax overlaps.
fn write_wgmma_step(w: &mut Writer<String>, spec: &Spec, config: TileConfig, hoisted: &[Hoisted]) -> fmt::Result {
    let ping_pong = ping_pong(config);
    if ping_pong {
        writeln!(w)?;
        writeln!(w, "named_barrier_sync(1 + warpgroup, 256);  // this warpgroup's turn on the tensor cores")?;
    }
    write_wgmma_s(w, config)?;
    let sums = RowSums::of(spec, config);
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
        write_key_terms(w, spec, hoisted, KeyTerms::of(config))
    };
    writeln!(w, "// Behind S, O += P V of the previous tile, in a group of its own (an")?;
    writeln!(w, "// empty group would become a dummy wgmma); then wait for S alone. ptxas")?;
    writeln!(w, "// checks each path on its own, so each branch fences, commits and waits")?;
    writeln!(w, "// itself: anything less serializes every wgmma of the kernel (C7514/C7519).")?;
    w.block(format_args!("if (pv_pending)"), |w| {
        writeln!(w, "wgmma_fence();")?;
        write_wgmma_pv(w, spec, sums)?;
        writeln!(w, "wgmma_commit();")?;
        overlapped(w)?;
        writeln!(w, "wgmma_wait<1>();")
    })?;
    w.block(format_args!("else"), |w| {
        overlapped(w)?;
        writeln!(w, "wgmma_wait<0>();")
    })?;
    writeln!(w, "fence_operands(s[0]);")?;
    let ring = warp_specialized(config);
    if ring {
        writeln!(w, "if (lane == 0) mbar_arrive(k_empty + 8 * stage);  // S is done with this K")?;
    }
    // A ring's consumers have the tile's class from the producer (`tile`).
    write_logits(w, spec, if ring { "(tile / TILE_WHOLE & 3)" } else { "whole_conjuncts(j)" })?;
    write_softmax(w, SUnits::of(spec), Rescale::Deferred, sums)?;
    writeln!(w, "wgmma_wait<0>();  // P V is done: O and p are this warpgroup's again")?;
    write_fence_accumulators(w, sums)?;
    if ring {
        writeln!(w, "if (pv_pending && lane == 0) mbar_arrive(v_empty + 8 * v_stage);  // and with its V")?;
    }
    let row_sum = match sums {
        RowSums::Fadd => "",
        RowSums::TensorCores => {
            "\x20       row_sum[mt][2 * r] *= alpha[i];\n\
                                 \x20       row_sum[mt][2 * r + 1] *= alpha[i];\n"
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
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) pack_p(storage{{}}, p[kk], s[0], kk);\n\
        pv_pending = true;\n"
    )
}

/// Issues O += P V on the tensor cores (P from the registers `p`, V
/// MN-major from `v_smem`), uncommitted. wgmma reads P asynchronously, so
/// all of it stays live until its group is waited for.
fn write_wgmma_pv(w: &mut Writer<String>, spec: &Spec, sums: RowSums) -> fmt::Result {
    let row_sums = match sums {
        RowSums::Fadd => "",
        RowSums::TensorCores => "\x20   wgmma_rs_n8(row_sum, p[kk], ones);  // and the row sums\n",
    };
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
        \x20   wgmma_rs_n{dvp}(o[0], p[kk], gmma_desc(v_smem + kk * 16 * 128, BLOCK_N * 128, 1024));\n\
        {row_sums}\
        }}\n",
        dvp = pad16(spec.head_dims.v)
    )
}

/// The spec on every element of S (see `write_logit`). `whole` is the C
/// expression of the tile's `whole_conjuncts` bits.
fn write_logits(w: &mut Writer<String>, spec: &Spec, whole: &str) -> fmt::Result {
    write!(
        w,
        "\
        \n\
        // The spec on every element of S (-inf where masked).\n\
        // Interior tiles (kept whole, no key past kv_len) run without mask\n\
        // and bounds code.\n"
    )?;
    let conjuncts = two_conjuncts(spec).is_some();
    if conjuncts {
        writeln!(w, "const int whole = {whole};  // read only where the tile is not interior")?;
    }
    writeln!(w, "if (interior) {{")?;
    w.indented(|w| write_apply_logits(w, "logit_interior(x, q, kv0 + n * 8 + 2 * t + c, i, n, c)"))?;
    let logit = "logit(x, q, kv0 + n * 8 + 2 * t + c, i, n, c, full)";
    let only = |x| format!("logit_only{x}(x, q, kv0 + n * 8 + 2 * t + c, i, n, c)");
    // Tiles where conjunct 1 holds whole (conjunct 0 alone decides) go last,
    // their code falling through into the softmax: with a causal conjunct
    // first (sliding windows) they are the diagonal tiles that every item
    // visits. The H200 measured 1.5% at 1k keys against them first.
    match conjuncts {
        true => {
            writeln!(w, "}} else if (whole == 1) {{")?;
            w.indented(|w| write_apply_logits(w, &only(1)))?;
            writeln!(w, "}} else if (whole == 0) {{")?;
            w.indented(|w| write_apply_logits(w, logit))?;
            writeln!(w, "}} else {{  // whole == 2")?;
            w.indented(|w| write_apply_logits(w, &only(0)))?;
        }
        false => {
            writeln!(w, "}} else {{")?;
            w.indented(|w| write_apply_logits(w, logit))?;
        }
    }
    writeln!(w, "}}")
}

/// When the online softmax's rescale of O happens.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rescale {
    /// Right where a row's max grows: O is in registers the warp owns.
    Inline,
    /// Later: the previous tile's P V still accumulates into O, so each
    /// row's factor waits in `alpha` (1 where the row is not rescaled).
    Deferred,
}

/// Where the softmax's row sums l accumulate.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowSums {
    /// One FADD per element of P into the lane's share; the epilogue adds
    /// the four lanes of a row.
    Fadd,
    /// On the tensor cores, beside P V: P times a tile of ones (`ones`, one
    /// m64n8 product per 16 keys) into `row_sum`, each of whose columns
    /// holds the whole row's sum, so the epilogue needs no shuffles. The sum
    /// is then of P as rounded for P V: the weights O averages with.
    TensorCores,
}

impl RowSums {
    /// At d <= 64 a warp's softmax chain, not the tensor cores, bounds a
    /// warp-specialized kernel's tile: the FADDs (one per element of P, 64
    /// per tile and thread) leave it for 1/8 more P V. The H200 measured +3-4%
    /// on causal from 4k keys, +1% on the sliding window and full
    /// attention, and 2-3% lost on ALiBi and softcap and 2% on documents
    /// at 4k (bench/RESULTS.md, twentieth session): specs with a score or
    /// a tensor-reading mask keep the FADDs.
    fn of(spec: &Spec, config: TileConfig) -> RowSums {
        let unscored = spec.score.is_none() && !spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
        match warp_specialized(config) && widest(spec) <= 64 && unscored {
            true => RowSums::TensorCores,
            false => RowSums::Fadd,
        }
    }
}

/// What S holds when the softmax starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SUnits {
    /// Masked dot products, for specs without a score expression: the scale
    /// goes into exp2's argument as one FFMA per element (FlashAttention's
    /// `x * scale - max * scale`), and the row max is taken before scaling,
    /// which the runtime's positive scale (`check::softmax_scale`) allows.
    Dots,
    /// Logits in log2 units: a score expression needs the scaled score.
    Log2,
}

impl SUnits {
    fn of(spec: &Spec) -> SUnits {
        match spec.score {
            None => SUnits::Dots,
            Some(_) => SUnits::Log2,
        }
    }
}

/// The online softmax over S, in place: S becomes P.
fn write_softmax(w: &mut Writer<String>, units: SUnits, rescale: Rescale, sums: RowSums) -> fmt::Result {
    write!(
        w,
        "\
        \n\
        // Online softmax, base 2, row by row. A row's O and l are rescaled only\n\
        // when its max grew by more than RESCALE_SLACK: until then exp2 runs\n\
        // against the stale max, so P <= 2^RESCALE_SLACK, exact enough for f32\n\
        // sums and 16-bit P (FlashAttention-4's conditional rescaling). The\n\
        // four lanes of a row agree on the branch. While every key so far is\n\
        // masked, m is -inf and exp2 runs against 0 (finite_or_zero).\n"
    )?;
    if rescale == Rescale::Deferred {
        writeln!(w, "float alpha[2 * M_TILES];")?;
    }
    let (alpha, scale_o) = match rescale {
        Rescale::Inline => (
            "const float alpha",
            "\
            \x20       #pragma unroll\n\
            \x20       for (int n = 0; n < O_TILES; ++n) {\n\
            \x20           o[mt][n][2 * r] *= alpha;\n\
            \x20           o[mt][n][2 * r + 1] *= alpha;\n\
            \x20       }\n",
        ),
        Rescale::Deferred => ("alpha[i]", ""),
    };
    let keep = match rescale {
        Rescale::Inline => "",
        Rescale::Deferred => "\x20   alpha[i] = 1.0f;\n",
    };
    // Row sums on the tensor cores are rescaled with O.
    let l_scale = match (sums, rescale) {
        (RowSums::Fadd, Rescale::Inline) => "\x20       l[mt][r] *= alpha;\n",
        (RowSums::Fadd, Rescale::Deferred) => "\x20       l[mt][r] *= alpha[i];\n",
        (RowSums::TensorCores, _) => "",
    };
    let l_add = match sums {
        RowSums::Fadd => "\x20   l[mt][r] += row_sum(s[mt], r);\n",
        RowSums::TensorCores => "",
    };
    let (to_log2, exp2_arg) = match units {
        SUnits::Dots => (" * scale_log2", "fmaf(x, scale_log2, -m_use)"),
        SUnits::Log2 => ("", "x - m_use"),
    };
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const float m_new = fmaxf(m[mt][r], quad_max(row_max(s[mt], r)){to_log2});\n\
        {keep}\
        \x20   if (m_new > m[mt][r] + RESCALE_SLACK) {{\n\
        \x20       {alpha} = fast_exp2(m[mt][r] - m_new);\n\
        \x20       m[mt][r] = m_new;\n\
        {l_scale}\
        {scale_o}\
        \x20   }}\n\
        \x20   const float m_use = finite_or_zero(m[mt][r]);\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < S_TILES; ++n) {{\n\
        \x20       #pragma unroll\n\
        \x20       for (int c = 0; c < 2; ++c) {{\n\
        \x20           float& x = s[mt][n][2 * r + c];\n\
        \x20           x = fast_exp2({exp2_arg});\n\
        \x20       }}\n\
        \x20   }}\n\
        {l_add}\
        }}\n\
        \n"
    )
}

/// Maps this warp's S tile (keys from `kv0`) through `call`, element by
/// element.
fn write_apply_logits(w: &mut Writer<String>, call: &str) -> fmt::Result {
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const int q = q0 + warp * WARP_M + mt * 16 + g + 8 * r;\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < S_TILES; ++n) {{\n\
        \x20       #pragma unroll\n\
        \x20       for (int c = 0; c < 2; ++c) {{\n\
        \x20           float& x = s[mt][n][2 * r + c];\n\
        \x20           x = {call};\n\
        \x20       }}\n\
        \x20   }}\n\
        }}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::O_STORE_ROWS;

    /// `setmaxnreg` only moves registers within the pool a CTA got at launch:
    /// a split that asks for more blocks the consumers forever.
    #[test]
    fn register_splits_fit_the_launch_pool() {
        let specs = ["S { dtype: bf16, head_dim: 64 }", "S { dtype: f16, head_dim: 128, mask: q >= k }"];
        for source in specs {
            let spec = crate::parse_one(source).unwrap();
            for config in
                TileConfig::candidates(&spec, Target::for_sm(9, 0)).into_iter().filter(|c| warp_specialized(*c))
            {
                // The consumers' TMA store of O takes one warp's rows.
                assert_eq!(16 * config.m_tiles, O_STORE_ROWS, "{config:?}");
                let (producer, consumer) = ws_regs(&spec, config);
                let pool = launch_regs(config) * config.threads();
                assert!(producer * 128 + consumer * 32 * config.warps <= pool, "{config:?}");
                assert!(pool * config.per_sm() <= 65536, "{config:?}");
                assert!(producer >= 24 && consumer <= 240 && producer % 8 == 0 && consumer % 8 == 0, "{config:?}");
            }
        }
    }

    /// Staged spec terms take static shared memory that the ring's
    /// stages leave room for: with two per-key terms (a mask's and a
    /// score's) every warp-specialized candidate's dynamic and staged shared
    /// memory stays within the budget.
    #[test]
    fn staged_terms_fit_beside_the_ring() {
        let source = "S { dtype: bf16, head_dim: HD, tensor doc: i32[B, KV_LEN], tensor bias: f32[B, KV_LEN], \
                      mask: doc[b][q] == doc[b][k], score: score + bias[b][k] }";
        for head_dim in [64, 128] {
            let spec = crate::parse_one(&source.replace("HD", &head_dim.to_string())).unwrap();
            for config in
                TileConfig::candidates(&spec, Target::for_sm(9, 0)).into_iter().filter(|c| warp_specialized(*c))
            {
                let staged = KeyTerms::of(config).static_bytes(&spec, config);
                // doc[b][k] and bias[b][k] per key, doc[b][q] per query.
                let expected = 4 * (2 * (RING_STAGES + 1) * config.block_n + 2 * config.block_m());
                assert_eq!(staged, expected, "{config:?}");
                let budget = SM_SMEM / config.per_sm() - CTA_SMEM_RESERVE - STATIC_SMEM_SLACK;
                assert!(config.smem_bytes(&spec) + staged <= budget, "{config:?}");
            }
        }
    }
}
