//! The forward's resource plan for a tile configuration: pipeline stages,
//! O's staging buffer, shared memory and the warp-specialized register
//! split, all within what the target's SM offers.

use super::e4m3::{e4m3_tile_bytes, Operands};
use super::mma::{smem_slack, tile_cols};
use super::softmax::{RowSums, SUnits};
use crate::abi::Operand;
use crate::analysis::block_uniform;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::{hoist, Level};
use crate::cuda::kit::key_bounds::key_bounds;
use crate::cuda::kit::terms::{spec_exprs, KeyTerms};
use crate::cuda::target::{pad16, Mma, Target};
use crate::cuda::tile_config::{ping_pong, warp_specialized, TileConfig, TileCopy};
use crate::mask_parts::{GlobalColumns, GlobalRows, MaskParts};
use crate::spec::{Expr, Spec};

/// Every choice of one forward kernel, made before anything is printed:
/// the emitters print a plan and decide nothing of their own.
pub(super) struct Plan<'s> {
    pub spec: &'s Spec,
    pub config: TileConfig,
    /// How a warp-specialized kernel copies its tiles; `None`: a kernel
    /// whose threads all copy (cp.async) and all multiply.
    pub copy: Option<TileCopy>,
    /// K/V pipeline stages ([`TileConfig::stages`]).
    pub stages: u32,
    /// A warp-specialized kernel's Q buffers ([`TileConfig::q_buffers`]).
    pub q_buffers: u32,
    /// O staged in a buffer of its own ([`TileConfig::o_buffer`]).
    pub o_buffer: bool,
    pub row_sums: RowSums,
    pub key_terms: KeyTerms,
    pub units: SUnits,
    /// A warp-specialized kernel's registers per thread (see [`ws_regs`]).
    pub regs: Option<Regs>,
    /// Dynamic shared memory, bytes ([`TileConfig::smem_bytes`]).
    pub smem_bytes: u32,
    /// Whether the kernel prints its trace points (`trace::point`).
    pub trace: bool,
    /// Whether Q, K, V and O are packed sequences (`varlen`): `spec` is
    /// then the spec's [`Spec::varlen_view`], and `copy` the threads'.
    pub varlen: bool,
    /// Whether K and V are paged caches read through a block table
    /// (`varlen`'s paged form, `varlen` set too): queries stay packed (or
    /// dense), keys are gathered row by row.
    pub paged: bool,
    /// The mask's global rows, whose query tiles go first (`item_order`);
    /// `None` without them, and on packed operands.
    pub global_rows: Option<GlobalRows<'s>>,
    /// Whether a persistent kernel without global rows ends on its last
    /// pairs' tiles tile by tile, longest first (`item_order`): under an
    /// analytic mask, where items differ in length (one that reads a
    /// tensor has the block mask's work order instead).
    pub longest_tail: bool,
    /// The mask's global columns, taken ahead of each item's tile walk
    /// where it can (`global_columns`); `None` on packed operands, e4m3
    /// ones and with dropout.
    pub columns: Option<ColumnsFirst<'s>>,
    /// Whether P is dropped out before P V (`dropout`); the row sums are
    /// then FADDs, of P before dropout.
    pub dropout: bool,
    /// The element format of Q, K and V (`e4m3`).
    pub operands: Operands,
    /// Whether S's products take Q from registers, loaded once per item
    /// (`wgmma_step::write_q_fragments`): a warpgroup of two m64 products
    /// on 64-key tiles (`TALL_PAIR`), where with both operands in shared
    /// memory each S product would read 128 bytes per tensor-core cycle,
    /// all the SM's shared bandwidth, beside the ring's copies.
    pub q_fragments: bool,
    /// Whether the persistent kernel's query tiles end at the last row
    /// where `q_len` is not a multiple of BLOCK_M: the short tile's waste
    /// then falls on the first rows, which under a causal mask or a window
    /// see the fewest keys, rather than on the last, which see the most
    /// ([`tail_aligned`]). The first tile starts at row 0 and overlaps the
    /// second: both compute the rows they share alike, and both store them.
    pub tail_aligned: bool,
}

/// A kernel's global columns, taken from a tile of their own ahead of each
/// item's walk (`global_columns`), and that tile's keys.
#[derive(Clone, Copy)]
pub(super) struct ColumnsFirst<'s> {
    pub global: GlobalColumns<'s>,
    /// `COLUMN_KEYS`: a multiple of 16, at most the tile's `BLOCK_N`.
    pub keys: u32,
    pub share: ColumnShare,
}

/// How an item's tile walk and its column tile share the global columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ColumnShare {
    /// The walk keeps the whole mask; an item whose other disjuncts keep
    /// no pair of its first tile starts past it and takes the columns from
    /// the column tile, where they fit it (Longformer's three disjuncts, a
    /// prefix beside a causal mask).
    FirstTile,
    /// The walk keeps the pairs past the columns (`rest && k >= C`: the
    /// plan's spec is that view, [`walked_view`]) and every item takes
    /// keys [0, C) from the column tile: where `rest` is a band (sinks
    /// beside a window), whose union with the columns crowded the walk's
    /// registers (three warpgroups spilled on it) and tested both of a
    /// band's edges on each partial tile, and C at most a literal, which
    /// the tile holds. (A param's C may pass the tile, and blocks of it
    /// taken one after another cost more than walking the whole mask saves:
    /// `docs/kernels.md`; a launch whose C fits bounds it instead,
    /// `bounded_columns`.)
    Apart,
}

impl<'s> ColumnsFirst<'s> {
    /// The global columns of `spec`'s forward in `config`, where it takes
    /// them first: where [`ColumnsFirst::reserved`] and no spec term is
    /// per key (the producer stages those per ring tile).
    pub(super) fn of(spec: &'s Spec, config: TileConfig) -> Option<ColumnsFirst<'s>> {
        ColumnsFirst::reserved(spec, config).filter(|_| !per_key_terms(spec))
    }

    /// The column tile that `config`'s kernels of `spec` reserve shared
    /// memory for (every operand layout's, and those with a per-key term,
    /// which take none: this test stays cheap on a ragged launch's choice of
    /// configuration): [`ColumnsFirst::eligible`] columns, in a kernel whose
    /// consumer warpgroups take turns (wgmma, warp-specialized). Elsewhere
    /// the tile did not pay: with one warpgroup per CTA no other
    /// warpgroup's turn overlaps the tile's chain of waited products.
    fn reserved(spec: &'s Spec, config: TileConfig) -> Option<ColumnsFirst<'s>> {
        let columns = ColumnsFirst::eligible(spec)?;
        (ping_pong(config) && warp_specialized(config) && columns.keys <= config.block_n).then_some(columns)
    }

    /// The column tile of `spec`, whatever the configuration: head dims up
    /// to 64 that allow 16-byte copies, a mask with global columns. A
    /// literal C, or a param a literal bounds (`min(p, 16)`: a launch's
    /// bounded spec, `bounded_columns`), gets a tile of C's most keys
    /// rounded up to 16 (up to 64), a param one 32 keys (StreamingLLM's 4
    /// sinks, Longformer's 32 global columns). At d = 128 the tile did not pay (level beside a window,
    /// Longformer slower as its producer spilled more).
    fn eligible(spec: &'s Spec) -> Option<ColumnsFirst<'s>> {
        let dims = spec.head_dims;
        let narrow = TileConfig::padded_head_dim(spec) <= 64;
        if !(narrow && dims.qk.is_multiple_of(8) && dims.v.is_multiple_of(8)) {
            return None;
        }
        let parts = MaskParts::of(spec.mask.as_ref())?;
        let global = parts.global_columns()?;
        let (keys, bounded) = match global.most() {
            Some(c) => {
                let end = i64::from(c) + i64::from(global.inclusive);
                (u32::try_from(end).ok().filter(|end| (1..=64).contains(end))?.next_multiple_of(16), true)
            }
            None => (32, false),
        };
        let band = |(_, past): (GlobalColumns, Expr)| key_bounds(Some(&past)).is_some_and(|bounds| bounds.len() >= 3);
        let share = match bounded && parts.past_columns().is_some_and(band) {
            true => ColumnShare::Apart,
            false => ColumnShare::FirstTile,
        };
        Some(ColumnsFirst { global, keys, share })
    }

    /// Shared memory of one Q buffer's column tile: `keys` rows of K and
    /// of V, whole 64-column panels, where [`ColumnsFirst::reserved`].
    pub(super) fn tile_bytes(spec: &Spec, config: TileConfig, (qk_cols, v_cols): (u32, u32)) -> u32 {
        ColumnsFirst::reserved(spec, config).map_or(0, |columns| 2 * columns.keys * (qk_cols + v_cols))
    }

    /// The keys the column tile holds for every query (C expression of an
    /// int): [0, C), or [0, C] where the disjunct is inclusive, within
    /// [0, kv_len).
    pub(super) fn end(&self, spec: &Spec, kv_len: &str) -> String {
        let bound = c_expr(spec, self.global.bound);
        let end = match self.global.inclusive {
            true => format!("(long long){bound} + 1"),
            false => format!("(long long){bound}"),
        };
        format!("(int)max(0LL, min({end}, (long long){kv_len}))")
    }
}

/// Whether `spec`'s mask has a spec term per key (the producer stages
/// those per ring tile, which the column tile's keys are not).
fn per_key_terms(spec: &Spec) -> bool {
    hoist(&spec_exprs(spec)).iter().any(|h| h.level == Level::Column)
}

/// Where `config`'s forward of `spec` takes the global columns apart from
/// its walk ([`ColumnShare::Apart`]): the view of `spec` whose mask is
/// what the walk keeps, `rest && k >= C`.
pub(super) fn walked_view(spec: &Spec, config: TileConfig) -> Option<Spec> {
    ColumnsFirst::of(spec, config).filter(|columns| columns.share == ColumnShare::Apart)?;
    let (_, past) = MaskParts::of(spec.mask.as_ref())?.past_columns()?;
    Some(Spec { mask: Some(past), ..spec.clone() })
}

/// Whether `spec`'s warp-specialized forwards at d <= 64 walk a mask
/// without its global columns ([`ColumnShare::Apart`]): the runtime's
/// choice of tiles reads the walked mask's shape.
pub fn columns_apart(spec: &Spec) -> bool {
    ColumnsFirst::eligible(spec).is_some_and(|columns| columns.share == ColumnShare::Apart) && !per_key_terms(spec)
}

/// Registers per thread of a warp-specialized kernel: at launch, then the
/// producer's and each consumer's after `setmaxnreg`.
#[derive(Clone, Copy)]
pub(super) struct Regs {
    pub launch: u32,
    pub producer: u32,
    pub consumer: u32,
}

impl<'s> Plan<'s> {
    /// The plan of `spec`'s kernel in `config`, untraced; `copy` applies
    /// where the configuration is warp-specialized.
    pub(super) fn new(spec: &'s Spec, config: TileConfig, copy: TileCopy) -> Plan<'s> {
        let ws = warp_specialized(config);
        let regs = ws.then(|| {
            let (producer, consumer) = ws_regs(spec, config);
            Regs { launch: launch_regs(config), producer, consumer }
        });
        let global_rows = MaskParts::of(spec.mask.as_ref()).and_then(|parts| parts.global_rows());
        Plan {
            spec,
            config,
            copy: ws.then_some(copy),
            stages: config.stages(spec),
            q_buffers: config.q_buffers(spec),
            o_buffer: config.o_buffer(spec),
            row_sums: RowSums::of(spec, config),
            key_terms: KeyTerms::of(config),
            units: SUnits::of(spec),
            regs,
            smem_bytes: config.smem_bytes(spec),
            trace: false,
            varlen: false,
            paged: false,
            global_rows,
            longest_tail: global_rows.is_none() && analytic_mask(spec),
            columns: ColumnsFirst::of(spec, config),
            dropout: false,
            operands: Operands::Sixteen,
            q_fragments: holds_q_fragments(config),
            tail_aligned: tail_aligned(spec, config, global_rows.is_some()),
        }
    }

    /// This plan, printing `view` (its spec's [`walked_view`]) where there
    /// is one.
    pub(super) fn walking(self, view: Option<&'s Spec>) -> Plan<'s> {
        match view {
            Some(spec) => Plan { spec, ..self },
            None => self,
        }
    }

    /// Whether the kernel walks its spec's mask without the global columns
    /// ([`ColumnShare::Apart`]): its spec is then a [`walked_view`].
    pub(super) fn walks_apart(&self) -> bool {
        self.columns.is_some_and(|columns| columns.share == ColumnShare::Apart)
    }

    /// The plan of `spec`'s kernel on e4m3 operands in `config` (see
    /// `e4m3::e4m3_supports`), copying with TMA: its tiles take the bytes
    /// of `e4m3_tile_bytes`, and the row sums are FADDs (the tensor cores'
    /// would read P as e4m3).
    pub(super) fn e4m3(spec: &'s Spec, config: TileConfig) -> Plan<'s> {
        let smem = config.smem_with(spec, e4m3_tile_bytes(spec, config));
        Plan {
            operands: Operands::E4m3,
            q_fragments: false,
            columns: None,
            row_sums: RowSums::Fadd,
            stages: smem.stages,
            q_buffers: smem.q_buffers,
            o_buffer: smem.o_buffer,
            smem_bytes: smem.bytes,
            ..Plan::new(spec, config, TileCopy::Tma)
        }
    }

    /// [`Plan::new`] with dropout on P. Row sums on the tensor cores would
    /// sum P as P V reads it, after dropout: FADDs sum it before. (Shared
    /// memory still holds the unused tile of ones: the plan keeps
    /// [`TileConfig::smem_bytes`], the configuration's.)
    pub(super) fn dropout(spec: &'s Spec, config: TileConfig, copy: TileCopy) -> Plan<'s> {
        Plan { dropout: true, row_sums: RowSums::Fadd, columns: None, ..Plan::new(spec, config, copy) }
    }

    /// The plan of a varlen kernel in `config` for `view`, a spec's
    /// [`Spec::varlen_view`]. A tile may run past its sequence into the next
    /// one: the threads' copies clip it, and TMA's descriptors are ragged
    /// (`library/tma_ragged.cuh`), so its boxes read zeros there and write
    /// nothing.
    pub(super) fn varlen(view: &'s Spec, config: TileConfig, copy: TileCopy) -> Plan<'s> {
        let tail_aligned = tail_aligned(view, config, false);
        let longest_tail = analytic_mask(view);
        Plan {
            varlen: true,
            global_rows: None,
            longest_tail,
            columns: None,
            tail_aligned,
            ..Plan::new(view, config, copy)
        }
    }

    /// The plan of a paged kernel in `config` for `view`, as [`Plan::varlen`]'s:
    /// a K/V tile gathers rows from scattered pages, with TMA by boxes of a
    /// page (`library/paged_tma.cuh`), else with the threads.
    pub(super) fn paged(view: &'s Spec, config: TileConfig, copy: TileCopy) -> Plan<'s> {
        Plan { paged: true, ..Plan::varlen(view, config, copy) }
    }

    /// The last coordinate of a TMA copy of `op`'s rows (C): the batch row,
    /// or a varlen kernel's sequence, whose ragged descriptors take its span.
    pub(super) fn tma_seq(&self, op: Operand) -> &'static str {
        match (self.varlen, op) {
            (false, _) => "b",
            (true, Operand::K | Operand::V) => "kv_seq",
            (true, _) => "q_seq",
        }
    }
}

impl TileConfig {
    /// K/V pipeline stages in shared memory: for a warp-specialized kernel
    /// a ring of as many as fit beside its Q buffers, up to `RING_STAGES`
    /// (two at d = 128, three at d = 64); else two (loads of tile j + 1
    /// while tile j is multiplied).
    pub fn stages(self, spec: &Spec) -> u32 {
        self.smem_with(spec, self.tile_bytes(spec)).stages
    }

    /// Q buffers in shared memory: a warp-specialized kernel has two (the
    /// next item's Q loads while the current item finishes) where they fit
    /// beside a ring of two stages, else one (above d = 128 with wide
    /// tiles: the producer then loads the next item's Q once the consumers
    /// stored the O staged in it), and one where a tile narrower than 64
    /// keys can have a third stage instead; other kernels one.
    pub fn q_buffers(self, spec: &Spec) -> u32 {
        self.smem_with(spec, self.tile_bytes(spec)).q_buffers
    }

    /// Whether a warp-specialized kernel stages O in a buffer of its own
    /// (`OStaging::OBuffer`): where one fits beside its two Q buffers and a
    /// full ring (at d <= 64, two or three consumer warpgroups).
    pub(super) fn o_buffer(self, spec: &Spec) -> bool {
        self.smem_with(spec, self.tile_bytes(spec)).o_buffer
    }

    /// Dynamic shared memory: the Q tile (a warp-specialized kernel: its Q
    /// buffers, and O's own buffer where it has one) and `stages` stages of
    /// K and V tiles, 16-bit elements; wgmma's tiles are whole 64-column
    /// panels, 1024-byte aligned (the slack is reserved).
    pub fn smem_bytes(self, spec: &Spec) -> u32 {
        self.smem_with(spec, self.tile_bytes(spec)).bytes
    }

    /// The shared-memory layout of a kernel whose Q buffer and K/V stage
    /// take `(q, stage)` bytes (see [`TileConfig::stages`] and the others).
    pub(super) fn smem_with(self, spec: &Spec, tiles: (u32, u32)) -> SmemLayout {
        self.smem_beside(spec, tiles, self.static_smem_bytes(spec))
    }

    /// [`TileConfig::smem_with`] beside `statics` bytes of static shared
    /// memory.
    fn smem_beside(self, spec: &Spec, (q, stage): (u32, u32), statics: u32) -> SmemLayout {
        let budget = self.budget_beside(statics);
        let ws = warp_specialized(self);
        // A tile narrower than 64 keys multiplies too briefly for two stages
        // to cover a load: it takes a third stage over a second Q buffer.
        let deeper_ring = self.block_n < 64 && q + 3 * stage + 1024 <= budget;
        let q_buffers = match ws && 2 * q + 2 * stage + 1024 <= budget && !deeper_ring {
            true => 2,
            false => 1,
        };
        let o = self.o_tile_bytes(spec);
        let o_buffer = ws && 2 * q + RING_STAGES * stage + o + 1024 <= budget;
        let o_bytes = if o_buffer { o } else { 0 };
        let stages = match ws {
            true => (2..=RING_STAGES).rev().find(|s| q_buffers * q + s * stage + 1024 <= budget - o_bytes).unwrap_or(2),
            false => 2,
        };
        let bytes = q_buffers * q + stages * stage + o_bytes + smem_slack(self.mma);
        SmemLayout { q_buffers, stages, o_buffer, bytes }
    }

    /// A staged O tile: 64-column panels of 16-bit elements.
    pub(super) fn o_tile_bytes(self, spec: &Spec) -> u32 {
        2 * self.block_m() * pad16(spec.head_dims.v).next_multiple_of(64)
    }

    /// What a warp-specialized kernel's dynamic shared memory may take: an
    /// SM's share, less the static arrays beside it.
    pub(super) fn smem_budget(self, spec: &Spec) -> u32 {
        self.budget_beside(self.static_smem_bytes(spec))
    }

    /// An SM's share of shared memory less `statics` static bytes.
    fn budget_beside(self, statics: u32) -> u32 {
        let target = Target::of_mma(self.mma);
        target.smem_per_sm / self.per_sm() - target.smem_reserved_per_cta - statics
    }

    /// A warp-specialized kernel's static shared memory: the ring's
    /// barriers and words, a tensor-reading mask's staged tile classes, the
    /// staged spec terms and the tile of ones, in whole KiB (the dynamic
    /// shared memory after it is 1024-byte aligned).
    pub(crate) fn static_smem_bytes(self, spec: &Spec) -> u32 {
        self.static_smem_with(spec, || TermLevels::of(spec))
    }

    /// [`TileConfig::static_smem_bytes`], the spec's hoisted terms counted
    /// by `levels` where the kernel stages them.
    fn static_smem_with(self, spec: &Spec, levels: impl FnOnce() -> TermLevels) -> u32 {
        let ones = if RowSums::of(spec, self) == RowSums::TensorCores { ONES_TILE_BYTES } else { 0 };
        let classes = if spec.mask.as_ref().is_some_and(|m| m.reads_tensor()) { STAGED_CLASS_TILES } else { 0 };
        (RING_STATIC_BYTES + classes + KeyTerms::of(self).static_bytes(levels, self) + ones).next_multiple_of(1024)
    }

    /// Whether this configuration's shared memory fits one CTA of `target`
    /// ([`TileConfig::fits`]), the spec's hoisted terms counted by `levels`
    /// (once for all the configurations a caller weighs: hoisting is most
    /// of the test's time).
    pub(crate) fn fits_with(self, spec: &Spec, target: Target, levels: impl FnOnce() -> TermLevels) -> bool {
        let statics = self.static_smem_with(spec, levels);
        let layout = self.smem_beside(spec, self.tile_bytes(spec), statics);
        let statics = if warp_specialized(self) { statics } else { 0 };
        layout.bytes + statics <= target.smem_per_sm / self.per_sm() - target.smem_reserved_per_cta
    }

    /// Bytes of the Q tile and of one K/V stage in shared memory. A
    /// warp-specialized kernel's Q buffer also stages its O: as wide as
    /// the wider of the two; the global columns' tile goes with it
    /// ([`ColumnsFirst`]; reserved for the kernels of every operand layout).
    pub(super) fn tile_bytes(self, spec: &Spec) -> (u32, u32) {
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let (qk, v) = (tile_cols(self.mma, dp), tile_cols(self.mma, dvp));
        let q_cols = if warp_specialized(self) { qk.max(v) } else { qk };
        let columns = ColumnsFirst::tile_bytes(spec, self, (qk, v));
        (2 * self.block_m() * q_cols + columns, 2 * self.block_n * (qk + v))
    }
}

/// A kernel's shared memory (see [`TileConfig::smem_with`]).
#[derive(Clone, Copy)]
pub(super) struct SmemLayout {
    pub q_buffers: u32,
    pub stages: u32,
    pub o_buffer: bool,
    /// Dynamic shared memory, with the alignment slack.
    pub bytes: u32,
}

/// Stages of a warp-specialized kernel's ring, at most.
pub(super) const RING_STAGES: u32 = 3;

/// Static shared memory of a warp-specialized kernel's ring, at most: its
/// barriers, the claimed items and the tiles' words (about 190 bytes with
/// three stages).
pub(super) const RING_STATIC_BYTES: u32 = 256;

/// Tiles whose block-mask classes a kernel with a tensor-reading mask
/// stages in shared memory, a byte each (`classes::write_mask_class`).
pub(crate) const STAGED_CLASS_TILES: u32 = 1024;

/// Static shared memory of the tile of ones that row sums on the tensor
/// cores multiply P with (`ones_tile`): an m64n8k16 product's B operand,
/// two 8-key groups of 128-byte rows.
pub(super) const ONES_TILE_BYTES: u32 = 2048;

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
/// 2); of 128 rows (`TALL_PAIR`: S, P and O twice, and Q's fragments),
/// 232 beside the producer's 24, where the consumers spill ~25 values of
/// their items' set-up and epilogue, none in the tile loop. Consumers that
/// need fewer than the launch's keep it: `setmaxnreg.dec` may only lower
/// the producer's count, and ptxas rejects the kernel otherwise (a narrow V
/// beside a wide QK, d = 256 / 32).
pub(super) fn ws_regs(spec: &Spec, config: TileConfig) -> (u32, u32) {
    let launch = launch_regs(config);
    let pool = launch * config.threads() / 128;
    let groups = config.warps / 4;
    let need = config.m_tiles * (3 * config.block_n / 4 + pad16(spec.head_dims.v) / 2) + 80;
    let need = need + q_fragment_regs(spec, config);
    let producer_floor = match (groups, config.m_tiles) {
        (1, 1) => 88,
        _ => 24,
    };
    let consumer = ((pool - producer_floor) / groups).min(need).min(240) / 8 * 8;
    let consumer = consumer.max(launch);
    (pool - groups * consumer, consumer)
}

/// Whether a persistent kernel's query tiles end at the last row
/// ([`Plan::tail_aligned`]), given whether its `global_rows` come first
/// (their tiles are counted from row 0): not under a mask read per
/// tile-aligned block either (its value at a tile's first row holds for
/// the tile). Only where neither of BLOCK_M and BLOCK_N divides the other:
/// otherwise the shift never changes how many key tiles a tile's rows
/// reach under a causal mask or a window, and the shifted diagonal cuts
/// one more key tile, masked per element (packed causal documents of ~500
/// tokens in 128-row tiles ran 3-4% slower).
fn tail_aligned(spec: &Spec, config: TileConfig, global_rows: bool) -> bool {
    let (m, n) = (config.block_m(), config.block_n);
    let blocks = spec.mask.as_ref().is_some_and(|mask| block_uniform(mask, m, n));
    warp_specialized(config) && !global_rows && !blocks && m % n != 0 && n % m != 0
}

/// Whether `spec` has a mask that reads no tensor: its items' lengths
/// follow from their coordinates alone.
fn analytic_mask(spec: &Spec) -> bool {
    spec.mask.as_ref().is_some_and(|mask| !mask.reads_tensor())
}

/// Whether `config`'s 16-bit kernels hold Q's fragments ([`Plan::q_fragments`]).
fn holds_q_fragments(config: TileConfig) -> bool {
    config.mma == Mma::Wgmma && config.m_tiles > 1
}

/// A consumer thread's registers for Q's fragments ([`Plan::q_fragments`]):
/// 16 bytes per 16 x 16 block of its warp's rows.
fn q_fragment_regs(spec: &Spec, config: TileConfig) -> u32 {
    match holds_q_fragments(config) {
        true => config.m_tiles * pad16(spec.head_dims.qk) / 16 * 4,
        false => 0,
    }
}

/// Registers per thread at launch: the register file shared by the CTAs
/// of an SM, in multiples of 8.
pub(super) fn launch_regs(config: TileConfig) -> u32 {
    Target::of_mma(config.mma).regs_per_sm / config.per_sm() / config.threads() / 8 * 8
}

impl KeyTerms {
    /// Staged in the warp-specialized wgmma kernels, whose producer walks
    /// the tiles ahead of the consumers.
    pub(crate) fn of(config: TileConfig) -> Self {
        match config.mma == Mma::Wgmma && warp_specialized(config) {
            true => KeyTerms::Staged,
            false => KeyTerms::PerThread,
        }
    }

    /// Static shared memory of the staging slots (4 bytes per element at
    /// most, for as many stages as a ring may have), which the ring leaves
    /// room for; the spec's terms counted by `levels`.
    fn static_bytes(self, levels: impl FnOnce() -> TermLevels, config: TileConfig) -> u32 {
        if self == KeyTerms::PerThread {
            return 0;
        }
        let TermLevels { column, row, cta } = levels();
        4 * (column * (RING_STAGES + 1) * config.block_n + row * 2 * config.block_m() + cta * 2)
    }
}

/// A spec's hoisted terms by the level they vary at ([`Level`]): per key,
/// per query row, per CTA.
#[derive(Clone, Copy)]
pub(crate) struct TermLevels {
    column: u32,
    row: u32,
    cta: u32,
}

impl TermLevels {
    pub(crate) fn of(spec: &Spec) -> TermLevels {
        let hoisted = hoist(&spec_exprs(spec));
        let count = |level| hoisted.iter().filter(|h| h.level == level).count() as u32;
        TermLevels { column: count(Level::Column), row: count(Level::Row), cta: count(Level::Cta) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `setmaxnreg` only moves registers within the pool a CTA got at launch:
    /// a split that asks for more blocks the consumers forever.
    #[test]
    pub(super) fn register_splits_fit_the_launch_pool() {
        let specs = [
            "S { dtype: bf16, head_dim: 64 }",
            "S { dtype: f16, head_dim: 128, mask: q >= k }",
            "S { dtype: bf16, head_dim: 160 }",
            "S { dtype: bf16, head_dim: 192, v_head_dim: 128, mask: q >= k }",
            "S { dtype: bf16, head_dim: 256, mask: q >= k }",
            "S { dtype: f16, head_dim: 256, v_head_dim: 32 }",
            "S { dtype: bf16, head_dim: 32 }",
        ];
        for source in specs {
            let spec = crate::parse_one(source).unwrap();
            let ws: Vec<_> =
                TileConfig::feasible(&spec, Target::HOPPER).into_iter().filter(|c| warp_specialized(*c)).collect();
            assert!(!ws.is_empty(), "{source}");
            for config in ws {
                let (producer, consumer) = ws_regs(&spec, config);
                let pool = launch_regs(config) * config.threads();
                assert!(producer * 128 + consumer * 32 * config.warps <= pool, "{config:?}");
                assert!(pool * config.per_sm() <= Target::HOPPER.regs_per_sm, "{config:?}");
                assert!(producer >= 24 && consumer <= 240 && producer % 8 == 0 && consumer % 8 == 0, "{config:?}");
                // `setmaxnreg.dec` lowers the producer's count, `.inc` raises the consumers'.
                let launch = launch_regs(config);
                assert!(
                    producer <= launch && consumer >= launch,
                    "{source}: {config:?} {producer}/{consumer} of {launch}"
                );
            }
        }
    }

    /// Persistent kernels end their query tiles at the last row (a packed
    /// sequence's own) but where global rows count tiles from row 0 or the
    /// mask is read per tile-aligned block; kernels of a CTA per tile keep
    /// tiles from row 0.
    #[test]
    fn query_tiles_end_at_the_last_row_where_nothing_counts_from_row_0() {
        let three = TileConfig { mma: Mma::Wgmma, warps: 12, m_tiles: 1, block_n: 128 };
        let aligned = |mask: &str, config: TileConfig, copy| {
            let spec = crate::parse_one(&format!("S {{ dtype: bf16, head_dim: 64, {mask} }}")).unwrap();
            Plan::new(&spec, config, copy).tail_aligned
        };
        for copy in [TileCopy::Tma, TileCopy::Threads] {
            assert!(aligned("mask: q >= k", three, copy));
            assert!(aligned("mask: q - k < 100 && q >= k", TileConfig { warps: 8, block_n: 192, ..three }, copy));
            // One tile size divides the other: the shift would reach no fewer key tiles.
            for divides in [TileConfig { warps: 8, ..three }, TileConfig { warps: 4, ..three }, crate::cuda::TALL_PAIR]
            {
                assert!(!aligned("mask: q >= k", divides, copy));
            }
            assert!(!aligned("mask: q < 32 || (q - k < 64 && k - q < 64)", three, copy));
            assert!(!aligned("tensor layout: i32[H, 8, 8], mask: layout[h][q / 192][k / 128] != 0", three, copy));
            assert!(!aligned("mask: q >= k", TileConfig { mma: Mma::Sync, warps: 4, m_tiles: 2, block_n: 64 }, copy));
        }
        let spec = crate::parse_one("S { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
        assert!(Plan::varlen(&spec, three, TileCopy::Tma).tail_aligned);
        assert!(Plan::paged(&spec, three, TileCopy::Threads).tail_aligned);
    }

    /// Above d = 128 every head dim has warp-specialized candidates (the
    /// runtime's default at d = 256 among them), and their Q buffers are
    /// two where two fit beside the ring: at 80-key tiles up to d = 192.
    #[test]
    pub(super) fn wide_heads_have_warp_specialized_kernels() {
        let cases = [
            ((160, 160), 80, 2),
            ((192, 192), 80, 2),
            ((192, 192), 112, 1),
            ((192, 128), 80, 2),
            ((256, 256), 48, 1),
            ((256, 256), 80, 1),
        ];
        for ((qk, v), block_n, q_buffers) in cases {
            let source = format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v} }}");
            let spec = crate::parse_one(&source).unwrap();
            let config = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n };
            assert!(TileConfig::feasible(&spec, Target::HOPPER).contains(&config), "{source}: {config:?}");
            assert!(warp_specialized(config), "{config:?}");
            assert_eq!(config.q_buffers(&spec), q_buffers, "{source}: {config:?}");
            assert!(config.smem_bytes(&spec) <= config.smem_budget(&spec), "{source}: {config:?}");
        }
    }

    /// Staged spec terms take static shared memory that the ring's
    /// stages leave room for: with two per-key terms (a mask's and a
    /// score's) every warp-specialized candidate's dynamic and staged shared
    /// memory stays within the budget.
    #[test]
    pub(super) fn staged_terms_fit_beside_the_ring() {
        let source = "S { dtype: bf16, head_dim: HD, tensor doc: i32[B, KV_LEN], tensor bias: f32[B, KV_LEN], \
                      mask: doc[b][q] == doc[b][k], score: score + bias[b][k] }";
        for head_dim in [64, 128, 160, 192, 256] {
            let spec = crate::parse_one(&source.replace("HD", &head_dim.to_string())).unwrap();
            for config in TileConfig::feasible(&spec, Target::HOPPER).into_iter().filter(|c| warp_specialized(*c)) {
                let staged = KeyTerms::of(config).static_bytes(|| TermLevels::of(&spec), config);
                // doc[b][k] and bias[b][k] per key, doc[b][q] per query.
                let expected = 4 * (2 * (RING_STAGES + 1) * config.block_n + 2 * config.block_m());
                assert_eq!(staged, expected, "{config:?}");
                let hopper = Target::HOPPER;
                let budget = hopper.smem_per_sm / config.per_sm() - hopper.smem_reserved_per_cta;
                assert!(config.smem_bytes(&spec) + config.static_smem_bytes(&spec) <= budget, "{config:?}");
            }
        }
    }
}
