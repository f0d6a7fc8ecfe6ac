//! The backward pass: FlashAttention-2's, generated from the same spec as the
//! forward, in four kernels launched in order.
//!
//! 1. **Preprocess** (`bwd_pre`): D = rowsum(dO ∘ O) in f32, and the
//!    atomic mode's dQ accumulator zeroed, 64 query rows per CTA; with a
//!    learned sink that reads a trainable tensor, the sink's gradient
//!    (`sink`).
//! 2. **dK/dV** (`bwd`): one CTA per (kv tile, K/V head, batch), 16 keys per
//!    warp. K and V stay in shared memory while the CTA walks every query
//!    tile of every query head of its GQA group, so dK and dV accumulate in
//!    registers and need no atomics. Per step it recomputes Sᵀ = K·Qᵀ with
//!    the spec's score and mask exactly as the forward (same log2-domain
//!    logit), P = exp2(S − LSE·log2 e) from the forward's natural-log LSE,
//!    dPᵀ = V·dOᵀ, dS′ = P ∘ (dP − D), dS = dS′ · ∂score′/∂score
//!    ([`crate::grad::d_score`]), then dV += Pᵀ·dO and dK += dSᵀ·Q on
//!    `mma.sync.m16n8k16`. Working on transposed tiles (keys as MMA rows)
//!    makes Pᵀ and dSᵀ A operands straight from the accumulators, as P is in
//!    the forward. dQ += dS·K goes through shared memory (dSᵀ stored once,
//!    read back with `ldmatrix.trans`) into f32 atomics on an accumulator:
//!    16-byte `red.global.add.v4.f32` on sm_90, after lanes t and t ^ 1
//!    swap halves of their m16n8 tiles. The Q, dO and statistics tiles are
//!    double-buffered: step j + 1's `cp.async` copies are queued right after
//!    step j's barrier and land while step j multiplies.
//!
//!    On Hopper (`BackwardConfig::preferred`, head dims padding to 64 through 128) the
//!    dK/dV kernel is the warp-specialized wgmma one of `dkdv_wgmma`: the
//!    same per-element code and tile walk, with 128 keys per CTA in two
//!    consumer warpgroups, a producer warpgroup that walks the query steps
//!    and streams them (telling the consumers each step's tile and class),
//!    and dQ = dS·K on the tensor cores from a shared dS tile.
//!    Its consumers store each step's dQ to shared memory in their fragment
//!    order, and one producer thread adds the tile with a single bulk
//!    reduction, so the accumulator keeps that order ([`DqAccum::Fragments`]).
//! 3. **Postprocess** (`bwd_post`): dQ = scale · accumulator, in the
//!    operand dtype.
//! 4. **Deterministic dQ** (`bwd_dq`), instead of the atomics and the
//!    postprocess when asked for: one CTA per query tile walks the kv tiles,
//!    recomputing P and dS, and keeps dQ in registers, so the result does not
//!    depend on scheduling. It costs a second recomputation of S and dP.
//!
//! Rows past `q_len` and fully masked rows (LSE = −∞) get LSE = +∞ in the
//! log2 domain, so exp2 gives P = 0 and every gradient they touch stays 0,
//! never NaN. Where P = 0 the score-mod derivative is not evaluated (it may
//! be infinite there, e.g. `1 / score`), as in the reference backward.
//!
//! Block sparsity: the dK/dV kernel classifies each (query tile × its keys)
//! and the dQ kernel each (its queries × kv tile) with the forward's interval
//! analysis, skipping empty tiles and mask evaluation on full ones. A
//! [`BlockMask`](crate::abi::ArgKind::BlockMask) is built at the forward's
//! tile sizes; a backward tile takes the combined class of the forward tiles
//! that cover it (empty only if all are, full only if all are), which is
//! sound for any tile sizes.
//!
//! Captured-tensor gradients ([`crate::grad::d_load`]): dt[i] += dS′ ·
//! ∂score′/∂t[i], summed in f32 by `atomicAdd` into a zeroed f32 buffer,
//! from the dK/dV kernel in both modes. A read whose index depends on
//! neither q nor k (`slopes[h]`) is first summed per thread over a whole
//! head and then per warp, one atomic per warp and head; others add per
//! element. The order of f32 atomics varies between runs, so tensor
//! gradients are **not** bitwise deterministic, even in deterministic mode.
//!
//! Varlen (packed) operands ([`emit_backward_varlen`]): the same kernels,
//! each CTA bound to its sequence's span and lengths, rows of D and the dQ
//! accumulator in the packed token space (see `packing`).

mod common;
mod dkdv;
mod dkdv_wgmma;
mod dq;
mod mask_columns;
mod orientation;
mod packing;
mod rows;
mod sink;
mod step;
mod tile;

use super::target::{pad16, Mma, Target};
use super::tile_config::{TileConfig, TileCopy};
use crate::abi::Kernel;
use crate::grad::trainable;
use crate::spec::Spec;
use packing::Packing;
pub use tile::BackwardTile;

/// Queries up to which [`BackwardConfig::preferred_for`] takes 64-query
/// steps where 80 are preferred.
const SHORT_QUERIES: usize = 1024;

/// One of the backward kernels of a spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardPass {
    /// D = rowsum(dO ∘ O); zeroes the dQ accumulator.
    Preprocess,
    /// dK, dV, tensor gradients, and dQ by atomics unless deterministic.
    KeyValue,
    /// dQ without atomics (the deterministic mode).
    Query,
    /// dQ from its f32 accumulator (the atomic mode).
    Postprocess,
}

/// How the backward kernels tile a problem.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardConfig {
    /// The dK/dV kernel's MMA: `mma.sync` warps, or on Hopper the
    /// warp-specialized `wgmma` kernel (see `dkdv_wgmma`): 64-query steps,
    /// with whole columns 128 keys for head dims that pad alike to 64
    /// through 128 (but 112), with column halves 64 keys and transposed
    /// 96 (64 above 192) where the wider pads to 144 through 256;
    /// elsewhere `Mma::Wgmma` emits the `mma.sync`
    /// kernel with this configuration. The other backward kernels are the
    /// same for both.
    pub mma: Mma,
    /// Warps of the dK/dV kernel, 16 keys each: its CTA owns
    /// 16 · warps / `columns.parts()` keys (128 at head dims up to 128, as
    /// FlashAttention-2: each Q/dO tile loaded serves twice the keys of 4
    /// warps, and dQ takes half the reductions).
    pub warps: u32,
    /// How the `mma.sync` dK/dV kernel's warps hold a 16-key block's dK
    /// and dV columns (see [`Self::default_for`]).
    pub columns: KeyColumns,
    /// Queries per step of the dK/dV kernel (a multiple of 16; the Hopper
    /// kernel's: 64, or 128 or 80 where its layout takes them, else 64).
    pub block_m: u32,
    /// Keys per step of the deterministic dQ kernel (a multiple of 16); its
    /// CTA owns 64 queries, 16 per warp.
    pub dq_block_n: u32,
    /// Whether the dK/dV kernel computes the gradients of the trainable
    /// tensors (and takes their arguments). Without them a score mod that
    /// only adds a tensor's value needs no per-element gradient terms, and
    /// its P and dS can split like a plain score's. No other kernel reads it.
    pub tensor_grads: bool,
    /// How the Hopper dK/dV kernel's producer copies K, V, Q and dO, chosen
    /// per launch like `tensor_grads`: with TMA where it can address them.
    /// No other kernel reads it (they copy with their threads).
    pub copy: TileCopy,
    /// Whether the dK/dV and dQ kernels apply dropout to P (see
    /// [`crate::dropout`]) and take its arguments; the other kernels are
    /// the same either way (D = rowsum(dO ∘ O) holds with dropout too).
    pub dropout: bool,
}

/// How the `mma.sync` dK/dV kernel's warps hold the dK and dV rows of a
/// 16-key block (the CUDA's `COL_PARTS`: warps per 16 keys).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyColumns {
    /// One warp holds every column of its 16 keys' dK and dV.
    Whole,
    /// Two warps share 16 keys, each holding half of dK's and dV's columns,
    /// where one warp's whole rows of both would spill. Each sums the keys'
    /// Sᵀ and dPᵀ over half the head dims and adds its partner's sums
    /// through shared memory.
    Halves,
    /// The Hopper kernel only (FlashAttention-3's and -4's tile at head
    /// dims 129 to 192): each consumer warpgroup its own 48 of the CTA's 96
    /// keys and every column of their dK and dV, computed transposed (head
    /// dims as wgmma's rows, so 48 keys fit the registers where 64 keys'
    /// rows would not); S and dP with queries as rows, P and dS through
    /// shared memory. Nothing is computed twice. Elsewhere it means
    /// [`KeyColumns::Whole`].
    Transposed,
}

impl KeyColumns {
    /// Warps per 16 keys.
    pub fn parts(self) -> u32 {
        match self {
            KeyColumns::Whole | KeyColumns::Transposed => 1,
            KeyColumns::Halves => 2,
        }
    }
}

impl BackwardConfig {
    /// The default for a spec. The dK/dV kernel holds dK and dV (DP/2 +
    /// DVP/2 f32 per thread) for its whole run, plus Sᵀ and dPᵀ (block_m
    /// f32 per thread), so block_m shrinks as head dims grow: 64 up to head
    /// dim 64, 32 up to 192, 16 beyond. Where dK and dV together would
    /// still spill (DP + DVP > 384: ptxas spills 650–800 bytes at 224 and
    /// 256, under 100 at 192), two warps share 16 keys, each with half the
    /// columns (64 keys per CTA, as FlashAttention-2's hdim-256 tile), if
    /// both halves of both head dims are whole 16-column steps.
    pub fn default_for(spec: &Spec) -> BackwardConfig {
        let widest = TileConfig::padded_head_dim(spec);
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let split = dp + dvp > 384 && dp % 32 == 0 && dvp % 32 == 0;
        let (warps, columns, block_m, dq_block_n) = match widest {
            0..=64 => (4, KeyColumns::Whole, 64, 64),
            65..=128 => (8, KeyColumns::Whole, 32, 64),
            _ if split => (8, KeyColumns::Halves, 32, 32),
            129..=192 => (4, KeyColumns::Whole, 32, 32),
            _ => (4, KeyColumns::Whole, 16, 32),
        };
        let copy = TileCopy::Threads;
        BackwardConfig { mma: Mma::Sync, warps, columns, block_m, dq_block_n, tensor_grads: true, copy, dropout: false }
    }

    /// The configuration the runtime uses on `target`: on Hopper the wgmma
    /// dK/dV kernel where it covers the head dims — whole columns (two
    /// consumer warpgroups of 64 keys each, FlashAttention-3's hdim-128
    /// tile) for dims that pad alike to 64 through 128 (but 112), in
    /// 128-query steps (d = 64) or 80-query steps (d = 128) where the layout
    /// takes them, but 64 at d = 128 under a mask that reads tensors
    /// (documents: a short one wastes more of a long step than it saves;
    /// at d = 64 staging their per-query terms made the 128-query step the
    /// faster one), transposed tiles (each warpgroup 48 of 96 keys, 32 of 64
    /// above 192) where the wider pads to 144 through 256, but column halves
    /// (both warpgroups on 64 keys) above 192 under a mask that reads
    /// tensors; otherwise [`Self::default_for`], its tiles made to fit the
    /// target's shared memory. `Runtime::autotune_backward` times them all.
    pub fn preferred(spec: &Spec, target: Target) -> BackwardConfig {
        let portable = BackwardConfig::default_for(spec).fitted(spec, target);
        let data_dependent = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
        let suits_mask = |c: &BackwardConfig| c.block_m != dkdv_wgmma::TRANSPOSED_DQ_STEP || !data_dependent;
        // Above 192 (32 keys per warpgroup) transposed tiles lead column
        // halves by 6-19% on full, causal, windowed, softcapped and ALiBi
        // attention at 256 but trail them by 5-9% on documents.
        let widest = pad16(spec.head_dims.qk).max(pad16(spec.head_dims.v));
        let suits_dims = |c: &BackwardConfig| c.columns != KeyColumns::Transposed || widest <= 192 || !data_dependent;
        let hopper = BackwardTile::hopper_tiles()
            .map(|tile| portable.with_tile(tile))
            .into_iter()
            .find(|c| c.lays_out(spec) && suits_mask(c) && suits_dims(c));
        match hopper {
            Some(config) if target.mma == Mma::Wgmma => config,
            _ => portable,
        }
    }

    /// The configuration the runtime uses without tuning for `q_len`
    /// queries: [`Self::preferred`], but a masked spec's 80-query steps give
    /// way to 64 up to 1024 queries (`SHORT_QUERIES`), where a key column
    /// visits few of them and its last step is partial more often (causal
    /// training steps of 512 tokens ran 4% faster in 64-query steps; level
    /// at 1024; 80 leads from 2048 and on full attention at every length).
    pub fn preferred_for(spec: &Spec, target: Target, q_len: usize) -> BackwardConfig {
        let preferred = BackwardConfig::preferred(spec, target);
        let short =
            preferred.block_m == dkdv_wgmma::TRANSPOSED_DQ_STEP && spec.mask.is_some() && q_len <= SHORT_QUERIES;
        match short {
            true => preferred.with_tile(BackwardTile::hopper(KeyColumns::Whole, dkdv_wgmma::DQ_ROWS)),
            false => preferred,
        }
    }

    /// This `mma.sync` configuration with smaller tiles where a kernel's
    /// shared memory would exceed what one CTA of `target` may take (an
    /// A100's 163 KiB, where d = 256's column halves at 32-query steps need
    /// 168; 99 KiB on sm_86/89/120, where d = 128's 32-query steps need
    /// 112): the dK/dV kernel's query steps halve down to 16, then column
    /// halves give way to one warp per 16 keys (their partial sums take
    /// shared memory), then its warps halve down to 2 (d = 248 and 256 on
    /// 99 KiB), then the dQ kernel's key steps halve down to 16.
    fn fitted(self, spec: &Spec, target: Target) -> BackwardConfig {
        let limit = target.smem_per_sm - target.smem_reserved_per_cta;
        let fits = |config| dkdv::smem_bytes(spec, config) <= limit;
        let mut config = self;
        while !fits(config) && config.block_m > 16 {
            config.block_m /= 2;
        }
        if !fits(config) && config.columns == KeyColumns::Halves {
            config = BackwardConfig { warps: 4, columns: KeyColumns::Whole, ..config };
        }
        while !fits(config) && config.warps > 2 * config.columns.parts() {
            config.warps /= 2;
        }
        while dq::smem_bytes(spec, config) > limit && config.dq_block_n > 16 {
            config.dq_block_n /= 2;
        }
        config
    }

    /// Whether this configuration's dK/dV kernel is the Hopper kernel in
    /// its own tile: laid out for `spec`, in the query steps it names.
    fn lays_out(self, spec: &Spec) -> bool {
        dkdv_wgmma::Layout::of(spec, self).is_some_and(|layout| layout.block_m == self.block_m)
    }

    /// Keys per CTA of the dK/dV kernel for `spec`: its Hopper layout's,
    /// else 16 per warp of a column part.
    pub fn block_n(self, spec: &Spec) -> u32 {
        match dkdv_wgmma::Layout::of(spec, self) {
            Some(layout) => layout.block_n(),
            None => 16 * self.warps / self.columns.parts(),
        }
    }

    /// This configuration with the fields `pass`'s kernel does not read
    /// set to one value, so that equal kernels have equal configurations
    /// (and one cache entry): `tensor_grads` and `copy` select among dK/dV
    /// kernels only, and `copy` among Hopper ones.
    pub fn for_pass(self, pass: BackwardPass) -> BackwardConfig {
        let key_value = pass == BackwardPass::KeyValue;
        let tensor_grads = self.tensor_grads || !key_value;
        let copy = if key_value && self.mma == Mma::Wgmma { self.copy } else { TileCopy::Threads };
        let dropout = self.dropout && matches!(pass, BackwardPass::KeyValue | BackwardPass::Query);
        BackwardConfig { tensor_grads, copy, dropout, ..self }
    }

    /// This configuration with `dropout`, in the query steps its Hopper
    /// dK/dV kernel then takes (128- and 80-query steps give way to 64 with
    /// dropout), so that the passes that do not read `dropout` (the
    /// postprocess) read the dQ accumulator in the order that kernel stores.
    pub fn with_dropout(self, spec: &Spec, dropout: bool) -> BackwardConfig {
        let config = BackwardConfig { dropout, ..self };
        match dkdv_wgmma::Layout::of(spec, config) {
            Some(layout) => BackwardConfig { block_m: layout.block_m, ..config },
            None => config,
        }
    }

    /// The dQ accumulator's layout under this configuration.
    pub fn dq_accum(self, spec: &Spec) -> DqAccum {
        match dkdv_wgmma::Layout::of(spec, self) {
            Some(layout) => layout.dq_accum(),
            None => DqAccum::Rows,
        }
    }

    /// The (query, key) rows per tile of the dK/dV kernel — its TMA boxes'
    /// rows — where it is the Hopper kernel, which may copy with TMA
    /// ([`BackwardConfig::copy`]); `None` for the one that never does.
    pub fn key_value_tma_tile(self, spec: &Spec) -> Option<(u32, u32)> {
        dkdv_wgmma::Layout::of(spec, self).map(|layout| (layout.block_m, layout.block_n()))
    }
}

/// How the atomic mode's f32 dQ accumulator is laid out (zeroed by the
/// preprocess; the postprocess reads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DqAccum {
    /// `[batch, heads, q_len, D]`, row-major (the `mma.sync` kernel).
    Rows,
    /// `[batch, heads, ceil(q_len / 64), 64 · cols]`: one contiguous tile
    /// per 64 queries, in the wgmma kernel's accumulator `order`
    /// (`dq_fragments.cuh`), rows past `q_len` included; `cols` the
    /// columns its products span (`DP`: D padded, zeros beyond D);
    /// `step_rows` the queries of the kernel's steps (64, 80 or 128), each
    /// step's ticket at the tile it starts in (`ArgKind::DqTickets`).
    Fragments { cols: u32, order: DqOrder, step_rows: u32 },
}

/// The order of a [`DqAccum::Fragments`] tile: the wgmma dK/dV kernel's
/// dQ accumulators as its consumers store them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DqOrder {
    /// Queries as the accumulators' rows, the tile's chunks in thread
    /// order per m16n8 tile (`dq_chunk`).
    Queries,
    /// Head dims as rows (80-query steps' dQᵀ), in 16-query groups
    /// (`dqt_chunk`).
    HeadDims,
}

impl DqAccum {
    /// f32 elements of the accumulator of `heads` (batch · heads) heads of
    /// `q_len` queries (a varlen launch's: [`DqAccum::varlen_len`]).
    pub fn len(self, spec: &Spec, heads: usize, q_len: usize) -> usize {
        match self {
            DqAccum::Rows => heads * q_len * spec.head_dims.qk as usize,
            DqAccum::Fragments { cols, .. } => {
                let rows = q_len.next_multiple_of(dkdv_wgmma::DQ_ROWS as usize);
                heads * rows * cols as usize
            }
        }
    }
}

impl DqAccum {
    /// Whether the kernels around this accumulator take its tickets
    /// (`ArgKind::DqTickets`) for `spec`: a Hopper kernel's tiles, but not
    /// under a mask that reads a tensor (documents), whose dK/dV kernel
    /// loses more to the waits for a step's first store than the zeroing
    /// they save.
    pub fn has_tickets(self, spec: &Spec) -> bool {
        matches!(self, DqAccum::Fragments { .. }) && !spec.mask.as_ref().is_some_and(|m| m.reads_tensor())
    }

    /// The tickets (one per tile) of an accumulator of `len` f32 elements
    /// that has them ([`DqAccum::has_tickets`]).
    pub fn tickets(self, len: usize) -> usize {
        match self {
            DqAccum::Rows => 0,
            DqAccum::Fragments { cols, .. } => len / (dkdv_wgmma::DQ_ROWS * cols) as usize,
        }
    }

    /// f32 elements of a varlen launch's accumulator: `heads` query heads
    /// over `total_q` packed queries of `batch` sequences (the `Fragments`
    /// layout gives each sequence whole 64-query tiles: see `packing`).
    pub fn varlen_len(self, spec: &Spec, heads: usize, total_q: usize, batch: usize) -> usize {
        match self {
            DqAccum::Rows => heads * total_q * spec.head_dims.qk as usize,
            DqAccum::Fragments { cols, .. } => {
                let m = dkdv_wgmma::DQ_ROWS as usize;
                heads * (total_q.div_ceil(m) + batch) * m * cols as usize
            }
        }
    }
}

/// Emits one backward kernel of `spec` with its portable configuration.
/// Deterministic, like every emitter.
pub fn emit_backward(spec: &Spec, pass: BackwardPass) -> Kernel {
    emit_backward_with(spec, pass, BackwardConfig::default_for(spec))
}

/// Emits one backward kernel of `spec` with configuration `config`.
pub fn emit_backward_with(spec: &Spec, pass: BackwardPass, config: BackwardConfig) -> Kernel {
    emit(spec, pass, config, Packing::Dense)
}

/// One backward kernel of `spec` in `config` on varlen (packed) operands,
/// the backward of [`emit_forward_varlen`](crate::cuda::emit_forward_varlen):
/// `b` is a sequence, rows of the LSE, D and the dQ accumulator are in the
/// packed token space (see `packing`), and a tile past its sequence's end
/// does nothing. The Hopper dK/dV kernel copying with TMA takes ragged
/// descriptors (`library/tma_ragged.cuh`): no box crosses a sequence's end.
pub fn emit_backward_varlen(spec: &Spec, pass: BackwardPass, config: BackwardConfig) -> Kernel {
    emit(&spec.varlen_view(), pass, config, Packing::Varlen)
}

fn emit(spec: &Spec, pass: BackwardPass, config: BackwardConfig, packing: Packing) -> Kernel {
    match pass {
        BackwardPass::Preprocess => rows::emit_preprocess(spec, config.dq_accum(spec), packing),
        BackwardPass::KeyValue => match dkdv_wgmma::Layout::of(spec, config) {
            Some(layout) => dkdv_wgmma::emit(spec, config, &layout, packing),
            None => dkdv::emit(spec, config, packing),
        },
        BackwardPass::Query => dq::emit(spec, config, packing),
        BackwardPass::Postprocess => rows::emit_postprocess(spec, config.dq_accum(spec), packing),
    }
}

/// The captured tensors that have a gradient: float tensors the score
/// expression or the sink reads, each with a single index list (see
/// [`crate::grad::trainable`]).
pub fn trainable_tensors(spec: &Spec) -> Vec<usize> {
    (0..spec.tensors.len()).filter(|&i| trainable(spec, i)).collect()
}
