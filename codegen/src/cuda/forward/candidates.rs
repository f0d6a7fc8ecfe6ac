//! The forward tile configurations worth timing per spec and target, and
//! the one a launch uses without autotuning.

use super::logit::two_conjuncts;
use crate::cuda::forward::key_bounds::key_bounds;
use crate::cuda::target::{Mma, Target};
use crate::cuda::tile_config::{widest, TileConfig};
use crate::spec::{Expr, ExprKind, Func, Spec};

impl TileConfig {
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
        let hopper = if target.mma == Mma::Wgmma { hopper } else { vec![] };
        [hopper, portable].concat()
    }
}

/// Keys beyond which [`TileConfig::preferred_for`] may differ from
/// [`TileConfig::preferred`].
pub(super) const LONG_KEYS: usize = 2048;

/// The d <= 64 wgmma tile of one consumer warpgroup (64 query rows,
/// 128-key tiles), two CTAs per SM.
pub(super) const ONE_WARPGROUP_PAIR: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 4, m_tiles: 1, block_n: 128 };

/// The d <= 64 wgmma tile of three consumer warpgroups (192 query rows,
/// 128-key tiles).
pub(super) const THREE_WARPGROUPS: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 12, m_tiles: 1, block_n: 128 };

/// Whether a spec's partial-tile code and score fit the registers of the
/// d <= 64 tiles that hold the most (192-key S, three warpgroups): no mask
/// of two conjuncts unless each bounds k (a sliding window: its partial
/// tiles keep an interval of columns per row, `key_bounds`), no
/// transcendental score.
pub(super) fn light(spec: &Spec) -> bool {
    let mask_fits = two_conjuncts(spec).is_none() || key_bounds(spec.mask.as_ref()).is_some();
    mask_fits && !spec.score.as_ref().is_some_and(transcendental)
}

/// Whether `e` calls a transcendental function (tanh, exp, …).
pub(super) fn transcendental(e: &Expr) -> bool {
    let mut found = false;
    e.walk(&mut |n| found |= matches!(&n.kind, ExprKind::Call(f, _) if !f.is_numeric() && *f != Func::Floor));
    found
}
