//! A tile configuration: how a CTA covers queries and keys, and the
//! properties every kernel derives from it (rows per CTA, threads, CTAs per
//! SM, whether it is warp-specialized). The forward's resource plan lives in
//! `forward::plan`; the block-mask granularity is [`TileConfig::mask_tile`].

use crate::cuda::forward::TermLevels;
use crate::cuda::target::{pad16, Mma, Target};
use crate::spec::Spec;
use std::cell::OnceCell;

/// A tile configuration: how a CTA covers queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TileConfig {
    pub mma: Mma,
    /// Warps per CTA (with `Mma::Wgmma`, four per warpgroup).
    pub warps: u32,
    /// 16-row MMA tiles per warp: each K/V fragment read from shared memory
    /// feeds this many MMAs, so 2 halves the shared-memory traffic per FLOP
    /// at the price of twice the accumulator registers. With `Mma::Wgmma`
    /// a warpgroup's m64 products: 2 gives one warpgroup 128 rows of its
    /// own (`TALL_PAIR`).
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
    /// the tile); above 128 the O accumulator alone
    /// needs 128 registers, so 16 rows and 32 keys.
    pub fn default_for(spec: &Spec) -> TileConfig {
        let sync = |warps, m_tiles, block_n| TileConfig { mma: Mma::Sync, warps, m_tiles, block_n };
        match TileConfig::padded_head_dim(spec) {
            0..=128 => sync(4, 2, 64),
            _ => sync(4, 1, 32),
        }
    }

    /// Every configuration the generator supports for `spec` on `target`
    /// whose tiles fit its shared memory ([`TileConfig::fits`]): the
    /// autotuner times them all, and the runtime orders them
    /// (`flashgen_runtime::tile_choice`).
    pub fn feasible(spec: &Spec, target: Target) -> Vec<TileConfig> {
        let sync = |warps, m_tiles, block_n| TileConfig { mma: Mma::Sync, warps, m_tiles, block_n };
        // Warpgroups of 64 rows; 192-key tiles and three warpgroups only
        // where S, P and O fit their registers at d <= 64. Above d = 128
        // two warpgroups whose O (DVP / 2 registers) leaves room for S of
        // at most 112 keys, and a ring of two stages beside one or two Q
        // buffers (`forward::plan`): 80 keys fit beside two Q buffers at
        // d = 192, 112 beside one, 128 beside one where V's head dim is
        // 128; 80 and 48 beside one at d = 256 (64 keys would be the
        // back-to-back kernel, which stays a candidate).
        let wgmma = |warps, block_n| TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n };
        let default = TileConfig::default_for(spec);
        let (hopper, portable) = match TileConfig::padded_head_dim(spec) {
            0..=64 => (
                vec![
                    wgmma(8, 128),
                    wgmma(8, 64),
                    wgmma(4, 64),
                    wgmma(8, 192),
                    wgmma(12, 128),
                    wgmma(4, 128),
                    TALL_PAIR,
                ],
                vec![default, sync(4, 2, 128), sync(8, 1, 64)],
            ),
            65..=128 => (vec![wgmma(8, 128), wgmma(8, 64), wgmma(4, 64)], vec![default, sync(8, 1, 64)]),
            129..=192 => {
                (vec![wgmma(8, 80), wgmma(8, 112), wgmma(8, 128), wgmma(8, 64)], vec![default, sync(4, 1, 64)])
            }
            193..=256 => (vec![wgmma(8, 80), wgmma(8, 48), wgmma(8, 64)], vec![default, sync(4, 1, 64)]),
            _ => (vec![], vec![default, sync(4, 1, 64)]),
        };
        let hopper = if target.mma == Mma::Wgmma { hopper } else { vec![] };
        TileConfig::fitting(spec, target, [hopper, portable].into_iter().flatten())
    }

    /// Whether this configuration's shared memory fits one CTA of `target`
    /// (GPUs of 99 KiB per CTA take none of the 64-key tiles above d = 144;
    /// the default's 32-key tiles fit up to 256). A warp-specialized
    /// kernel's static shared memory counts too: its ring is planned to
    /// fill what is left of the SM.
    pub fn fits(self, spec: &Spec, target: Target) -> bool {
        self.fits_with(spec, target, || TermLevels::of(spec))
    }

    /// The configurations of `configs` that fit one CTA of `target`
    /// ([`TileConfig::fits`]), in order; the spec's terms hoisted once.
    pub fn fitting(spec: &Spec, target: Target, configs: impl IntoIterator<Item = TileConfig>) -> Vec<TileConfig> {
        let levels = OnceCell::new();
        configs
            .into_iter()
            .filter(|c| c.fits_with(spec, target, || *levels.get_or_init(|| TermLevels::of(spec))))
            .collect()
    }

    /// The wider of the spec's head dims, padded to the MMA k-step: what
    /// decides which tiles fit.
    pub fn padded_head_dim(spec: &Spec) -> u32 {
        pad16(spec.head_dims.qk).max(pad16(spec.head_dims.v))
    }

    /// How this configuration's forward kernel copies when a launch asks
    /// for `copy`: only warp-specialized kernels have the choice, the others
    /// copy with their threads (one kernel, one cache entry).
    pub fn kernel_copy(self, copy: TileCopy) -> TileCopy {
        if self.persistent() {
            copy
        } else {
            TileCopy::Threads
        }
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
}

/// One consumer warpgroup of 128 rows (two m64 products per tile) and
/// 64-key tiles, two CTAs per SM: each warpgroup walks items of its own,
/// so an item's end overlaps the other CTA's tiles, while each K/V tile
/// still serves 128 queries (d <= 64: S, P and O of both products fit
/// the registers).
pub const TALL_PAIR: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 4, m_tiles: 2, block_n: 64 };

/// Threads of a warp-specialized kernel's producer warpgroup.
pub(crate) const PRODUCER_THREADS: u32 = 128;

/// Whether a wgmma kernel has two or three warpgroups to take turns on the
/// tensor cores, so that one's softmax overlaps the others' products.
pub(crate) fn ping_pong(config: TileConfig) -> bool {
    pipelined(config) && config.warps >= 8
}

/// Whether a kernel has a producer warpgroup that feeds a stage ring (see
/// `library/ring.cuh`): the pipelined wgmma kernels (the ping-pong ones, and one
/// consumer warpgroup two CTAs per SM), whose consumers then never meet at
/// a CTA barrier and issue no copies.
pub(crate) fn warp_specialized(config: TileConfig) -> bool {
    pipelined(config)
}

/// Whether a wgmma kernel runs P V of one tile behind S of the next
/// (`forward::wgmma_step`). It pays with 128-key tiles; with 64-key tiles
/// on 64 rows the back-to-back schedule is faster up to d = 128, as such a
/// product is too short to hide a softmax behind. Every other shape is
/// pipelined: above d = 128 shared memory holds only narrower tiles (48
/// to 112 keys), whose products are as long as a 128-key tile's at
/// d <= 128, and 64 keys on 128 rows are a 128-key tile's work.
pub(crate) fn pipelined(config: TileConfig) -> bool {
    config.mma == Mma::Wgmma && config.block_n * config.m_tiles != 64
}

/// How a warp-specialized kernel's producer fills its shared tiles (and a
/// forward's consumers store O), fixed when the kernel is generated: its
/// source holds that path alone. The copy engine (`Tma`, with descriptors among the
/// kernel's arguments) is what a launch uses wherever TMA can address the
/// operands; the producer's threads (`Threads`, cp.async) take the layouts
/// it cannot. A kernel holds one path: it compiles faster and
/// its producer needs fewer registers than with both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TileCopy {
    Tma,
    Threads,
}
