//! Which forward tile configurations a launch may use, in order of
//! preference: the autotuner's candidates, and the configuration a launch
//! uses without tuning. Codegen says which configurations it can generate
//! for a spec ([`TileConfig::feasible`]); the order among them is a
//! measured policy and lives here (docs/kernels.md gives the measurements).

use flashgen_codegen::cuda::{
    columns_apart, e4m3_supports, is_light, per_warpgroup_classes, Mma, Target, TileConfig, TALL_PAIR,
};
use flashgen_codegen::mask_parts::MaskParts;
use flashgen_codegen::{BinOp, Expr, ExprKind, Spec};

/// The configuration used without autotuning on `target` when the key
/// length is unknown: the first of [`candidates`]; where none fits (head
/// dims beyond the forward's, which a launch refuses), the default, so that
/// the refusal names a kernel.
pub fn preferred(spec: &Spec, target: Target) -> TileConfig {
    first_or_default(spec, &candidates(spec, target))
}

/// The first of `candidates`, else `spec`'s default.
fn first_or_default(spec: &Spec, candidates: &[TileConfig]) -> TileConfig {
    candidates.first().copied().unwrap_or_else(|| TileConfig::default_for(spec))
}

/// The configuration of `spec`'s e4m3 forward on `target`: the first of
/// [`e4m3_candidates`] that runs it ([`e4m3_supports`]); `None` where none
/// does (before Hopper, head dims above 128).
pub fn e4m3(spec: &Spec, target: Target) -> Option<TileConfig> {
    e4m3_candidates(spec).into_iter().find(|&config| e4m3_supports(spec, config, target))
}

/// The e4m3 forward's configurations for `spec`, preferred first (the
/// order `flashgen-bench --e4m3-tiles` measured): an 8-bit product takes
/// half the time of a 16-bit one, so a tile's fixed costs weigh twice as
/// much and the widest key tiles the registers hold lead. At d <= 64 three
/// warpgroups of 160-key tiles (FlashAttention-3's FP8 shape), whose
/// softmax outlasts their products; above, two of 224 keys.
pub fn e4m3_candidates(spec: &Spec) -> [TileConfig; 3] {
    let tile = |warps, block_n| TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n };
    match TileConfig::padded_head_dim(spec) <= 64 {
        true => [tile(12, 160), tile(12, 128), tile(8, 224)],
        false => [tile(8, 224), tile(8, 192), tile(8, 128)],
    }
}

/// The configuration used without autotuning on `target` for `kv_len`
/// keys: [`preferred`], except that with long keys (`long_keys`) at
/// d <= 64 three warpgroups lead for every spec whose S, P and O fit their
/// registers ([`is_light`]) but an `||` with an `&&` term
/// (`banded_disjuncts`). In the autotuner's sweep at d = 64 (H200), three
/// warpgroups against two took 10-19% less time on full attention at 768
/// and 1024 keys, 3-5% on causal, 5-9% on ALiBi, 0-4% on documents, and
/// 9-10% more on causal attention and ALiBi at 512 keys; on a 1024-key
/// window, whose three-warpgroup kernel classifies tiles per warpgroup
/// (`per_warpgroup_classes`) to no end while the window spans the keys, 4-6%
/// more at 768 and 1024 keys, level at 2048.
pub fn preferred_for(spec: &Spec, target: Target, kv_len: usize) -> TileConfig {
    let light = is_light(spec) && !banded_disjuncts(spec);
    let long = long_keys(spec, KeyClass::of(kv_len)) && TileConfig::padded_head_dim(spec) <= 64 && light;
    let candidates = candidates(spec, target);
    match long && candidates.contains(&THREE_WARPGROUPS) {
        true => THREE_WARPGROUPS,
        false => first_or_default(spec, &candidates),
    }
}

/// The one way the key count enters [`preferred_for`]'s choice, which is
/// the same for every length of a class: a launch can key a remembered
/// choice by it without looking at the spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyClass {
    /// Up to 512 keys (`LONG_KEYS`).
    Short,
    /// Up to 1024 (`BAND_LONG_KEYS`).
    Middle,
    /// Beyond.
    Long,
}

impl KeyClass {
    /// The class of `kv_len` keys.
    pub fn of(kv_len: usize) -> KeyClass {
        match kv_len {
            n if n <= LONG_KEYS => KeyClass::Short,
            n if n <= BAND_LONG_KEYS => KeyClass::Middle,
            _ => KeyClass::Long,
        }
    }
}

/// Whether keys of `class` are long to [`preferred_for`] for `spec`: past
/// 512, or past 1024 where three warpgroups would classify tiles per
/// warpgroup (a band) or walk a band beside global columns taken apart.
fn long_keys(spec: &Spec, class: KeyClass) -> bool {
    match class {
        KeyClass::Short => false,
        KeyClass::Middle => !(per_warpgroup_classes(spec, THREE_WARPGROUPS) || columns_apart(spec)),
        KeyClass::Long => true,
    }
}

/// The configurations worth timing for `spec` on `target`, preferred
/// first. A block mask serves them all: a forward tile that differs from
/// the mask tile combines the mask tiles it overlaps (`coarse_class`).
///
/// The order is what `flashgen-bench --tune` measured: up to head dim 128, Hopper's warp-specialized
/// wgmma kernel first (two warpgroups, 128-key tiles; at d <= 64 its
/// 192-key tiles second, or last when the mask has two conjuncts that
/// do not both bound k or the score calls a transcendental function; at
/// d <= 64 three warpgroups first for plain specs, third for masks of
/// one conjunct or of bounds on k that read no tensor (but an `||` with an
/// `&&` term: `banded_disjuncts`), else last; at
/// d <= 64 one warpgroup, two CTAs per SM, first for specs that are not
/// `light`, else last; one warpgroup of 128 rows after it), then the 64-key back-to-back
/// kernels (two warpgroups, one); among mma.sync configs, 128-key tiles
/// only for plain d <= 64 specs (masks and score mods then spill). Above
/// d = 128 the warp-specialized kernels lead: `WIDE_192`, `WIDE_256`. Only tiles that fit the target's shared
/// memory are candidates ([`TileConfig::fits`]).
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
    // last tile costs more than that saves.
    let light = is_light(spec);
    let (first, rest) = hopper.split_at(1);
    let small = match light {
        true => [first, &[wgmma(8, 192)], rest].concat(),
        false => [first, rest, &[wgmma(8, 192)]].concat(),
    };
    // Three warpgroups of 64 rows (FlashAttention-3's d <= 64 tile): at
    // d <= 64 a tile's softmax outlasts its products, and a third
    // warpgroup keeps the tensor cores busy through it. S, P and O fit
    // in its 160 registers; partial-tile code of two conjuncts (but for
    // bounds on k) or of tensor reads, and transcendental scores, spill.
    // Slower at 1k keys, where the ragged last 192-row tile wastes work.
    let three = THREE_WARPGROUPS;
    let reads_tensor = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
    let simple_mask = light && !reads_tensor && !banded_disjuncts(spec);
    let small = match (plain, simple_mask) {
        (true, _) => [&[three], small.as_slice()].concat(),
        (false, true) => [&small[..2], &[three], &small[2..]].concat(),
        (false, false) => [small.as_slice(), &[three]].concat(),
    };
    // One consumer warpgroup, two CTAs per SM: each CTA's item boundary
    // (last P V, epilogue, next claim, first S) overlaps the other's
    // tiles. First where a transcendental score or a partial tile of two
    // conjuncts crowds two warpgroups' registers (softcap), else last (two
    // warpgroups lead on documents and ALiBi).
    // One warpgroup of 128 rows, two CTAs per SM (`TALL_PAIR`), last: its
    // items' ends overlap the other CTA's tiles as the pair's do, each K/V
    // tile serving 128 queries, but its 64-key steps run 12-19% slower than
    // the pair's (full and causal at 4k); it leads only where items are a
    // tile or two long (documents of 256 tokens, 6% ahead of the pair).
    let pair = ONE_WARPGROUP_PAIR;
    let small = match !light {
        true => [&[pair], small.as_slice(), &[TALL_PAIR]].concat(),
        false => [small.as_slice(), &[pair, TALL_PAIR]].concat(),
    };
    let (hopper, portable) = match TileConfig::padded_head_dim(spec) {
        0..=64 if plain => (small, vec![sync(4, 2, 128), default, sync(8, 1, 64)]),
        0..=64 => (small, vec![default, sync(4, 2, 128), sync(8, 1, 64)]),
        65..=128 => (hopper, vec![default, sync(8, 1, 64)]),
        129..=192 => (WIDE_192.to_vec(), vec![default, sync(4, 1, 64)]),
        193..=256 => (WIDE_256.to_vec(), vec![default, sync(4, 1, 64)]),
        _ => (vec![], vec![default, sync(4, 1, 64)]),
    };
    let hopper = if target.mma == Mma::Wgmma { hopper } else { vec![] };
    TileConfig::fitting(spec, target, [hopper, portable].into_iter().flatten())
}

/// Above d = 128 up to 192: the warp-specialized kernel with 128-key
/// tiles where they fit (a V head dim up to 128: DeepSeek's QK 192 / V
/// 128), else 112 (one Q buffer each), then 80 (two Q buffers), then the
/// back-to-back 64-key kernel: the widest tile that fits keeps the fewest
/// softmax passes and barriers per FLOP.
const WIDE_192: [TileConfig; 4] = [wgmma_pair(128), wgmma_pair(112), wgmma_pair(80), wgmma_pair(64)];

/// At d = 256: the warp-specialized kernel with 80-key tiles (one Q
/// buffer; the 48-key tile's S product waits on shared memory), then with
/// 48-key tiles (two Q buffers), where a spec's staged terms leave no room
/// for 80, then the back-to-back 64-key kernel.
const WIDE_256: [TileConfig; 3] = [wgmma_pair(80), wgmma_pair(48), wgmma_pair(64)];

/// Two consumer warpgroups of 64 rows with `block_n`-key tiles.
const fn wgmma_pair(block_n: u32) -> TileConfig {
    TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n }
}

/// Whether `spec`'s mask is an `||` one of whose terms is itself an `&&`
/// (a window or band beside global tokens or sinks): two warpgroups lead
/// there at d <= 64, before three and one a CTA. Tuner sweeps on an H200 at
/// 8k and 16k keys, ms: a Longformer band with global rows and columns
/// 0.428 / 0.433 against three warpgroups' 0.525 / 0.621; 4 sinks beside a
/// 1024-key window 0.472 / 0.478 against 0.538 / 0.541 and one warpgroup's
/// 0.546 / 0.554. An `||` of plain comparisons (a prefix, then causal) keeps
/// three: 0.665 / 2.204 at 4k / 16k against two's 0.784 / 2.745. Nor is
/// a band beside a number of global columns a literal bounds (a literal,
/// or a launch's param bounded: [`columns_apart`];
/// the walk keeps the band past the columns, a plain window's shape):
/// there three warpgroups ran level with two (sinks beside a window,
/// 0.432 / 0.446 against 0.434 / 0.448 ms).
fn banded_disjuncts(spec: &Spec) -> bool {
    let conjunction = |e: &&Expr| matches!(e.kind, ExprKind::Binary(BinOp::And, ..));
    let banded =
        matches!(MaskParts::of(spec.mask.as_ref()), Some(MaskParts::Disjuncts(terms)) if terms.iter().any(conjunction));
    banded && !columns_apart(spec)
}

/// Keys beyond which [`preferred_for`] may differ from
/// [`preferred`] (`long_keys`).
const LONG_KEYS: usize = 512;

/// [`LONG_KEYS`] for specs whose three-warpgroup kernel walks a band: it
/// classifies tiles per warpgroup, or takes global columns apart from it.
const BAND_LONG_KEYS: usize = 1024;

/// The d <= 64 wgmma tile of one consumer warpgroup (64 query rows,
/// 128-key tiles), two CTAs per SM.
const ONE_WARPGROUP_PAIR: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 4, m_tiles: 1, block_n: 128 };

/// The d <= 64 wgmma tile of three consumer warpgroups (192 query rows,
/// 128-key tiles).
const THREE_WARPGROUPS: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 12, m_tiles: 1, block_n: 128 };

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen_codegen::parse_one;

    /// Every head dim the e4m3 forward takes has a configuration on
    /// Hopper, none before it, and none for QK head dims of partial k-steps.
    #[test]
    fn e4m3_configurations_cover_their_head_dims() {
        for (qk, v, some) in [(64, 64, true), (96, 96, true), (128, 128, true), (128, 64, true), (80, 80, false)] {
            let spec =
                parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}, mask: q >= k }}")).unwrap();
            assert_eq!(e4m3(&spec, Target::HOPPER).is_some(), some, "{qk}/{v}");
            assert_eq!(e4m3(&spec, Target::for_sm(8, 0)), None, "{qk}/{v}");
        }
    }

    /// The tuner times exactly what codegen can generate, each once.
    #[test]
    fn candidates_are_the_feasible_configurations() {
        let specs = [
            "S { dtype: bf16, head_dim: 64 }",
            "S { dtype: bf16, head_dim: 64, param w: i32, mask: q >= k && q - k < w }",
            "S { dtype: bf16, head_dim: 64, param cap: f32, mask: q >= k, score: cap * tanh(score / cap) }",
            "S { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
            "S { dtype: f16, head_dim: 128, mask: q >= k }",
            "S { dtype: bf16, head_dim: 256 }",
            "S { dtype: bf16, head_dim: 160, mask: q >= k }",
            "S { dtype: bf16, head_dim: 192, v_head_dim: 128, mask: q >= k }",
        ];
        for source in specs {
            let spec = parse_one(source).unwrap();
            for target in [Target::PORTABLE, Target::HOPPER, Target::for_sm(8, 9)] {
                let mut ordered = candidates(&spec, target);
                let mut feasible = TileConfig::feasible(&spec, target);
                let key = |c: &TileConfig| (c.mma == Mma::Wgmma, c.warps, c.m_tiles, c.block_n);
                ordered.sort_by_key(key);
                feasible.sort_by_key(key);
                assert_eq!(ordered, feasible, "{source} on {target:?}");
            }
        }
    }

    /// Above d = 128 (and at 80 and 96) Hopper's default is warp-specialized.
    #[test]
    fn wide_heads_prefer_the_warp_specialized_kernel() {
        for (qk, v) in [(80, 80), (96, 96), (160, 160), (192, 192), (192, 128), (256, 256)] {
            let spec =
                parse_one(&format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}, mask: q >= k }}")).unwrap();
            let config = preferred_for(&spec, Target::HOPPER, 16384);
            assert!(config.mma == Mma::Wgmma && config.persistent(), "{qk}/{v}: {config:?}");
        }
    }

    /// At d <= 64: plain attention prefers three consumer warpgroups; a
    /// document or causal mask two up to 512 keys, three past; a
    /// transcendental score one warpgroup per CTA, two CTAs per SM, at every
    /// length; a sliding window (both conjuncts bound k) three past 1024 keys.
    #[test]
    fn d64_preferences() {
        let hopper = Target::HOPPER;
        let shape = |c: TileConfig| (c.mma, c.warps, c.per_sm());
        let full = parse_one("S { dtype: bf16, head_dim: 64 }").unwrap();
        assert_eq!(shape(preferred(&full, hopper)), (Mma::Wgmma, 12, 1));
        let doc =
            parse_one("S { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }")
                .unwrap();
        let causal = parse_one("S { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
        for spec in [&doc, &causal] {
            assert_eq!(shape(preferred_for(spec, hopper, 512)), (Mma::Wgmma, 8, 1));
            for kv_len in [513, 1024, 2048] {
                assert_eq!(shape(preferred_for(spec, hopper, kv_len)), (Mma::Wgmma, 12, 1));
            }
        }
        let softcap = "S { dtype: bf16, head_dim: 64, param cap: f32, mask: q >= k, score: cap * tanh(score / cap) }";
        let softcap = parse_one(softcap).unwrap();
        for kv_len in [1024, 16384] {
            assert_eq!(shape(preferred_for(&softcap, hopper, kv_len)), (Mma::Wgmma, 4, 2));
        }
        let window = parse_one("S { dtype: bf16, head_dim: 64, param w: i32, mask: q >= k && q - k < w }").unwrap();
        assert_eq!(shape(preferred_for(&window, hopper, 1024)), (Mma::Wgmma, 8, 1));
        assert_eq!(shape(preferred_for(&window, hopper, 1025)), (Mma::Wgmma, 12, 1));
    }

    /// A remembered ragged choice is keyed by [`KeyClass`]: every length of
    /// a class gets the same configuration.
    #[test]
    fn the_choice_is_one_per_key_class() {
        let masks = ["", "mask: q >= k,", "param w: i32, mask: q >= k && q - k < w,", "mask: k < 4 || q - k < 100,"];
        let classes = [[1, 300, 512], [513, 700, 1024], [1025, 4096, usize::MAX]];
        for (mask, dim) in masks.iter().flat_map(|m| [64, 128].map(|d| (m, d))) {
            let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: {dim}, {mask} }}")).unwrap();
            for lengths in classes {
                let class = KeyClass::of(lengths[0]);
                let configs =
                    lengths.map(|kv_len| (KeyClass::of(kv_len), preferred_for(&spec, Target::HOPPER, kv_len)));
                assert!(configs.iter().all(|c| *c == (class, configs[0].1)), "{mask} d = {dim}: {configs:?}");
            }
        }
    }

    /// At d <= 64 an `||` with an `&&` term (global tokens beside a band,
    /// sinks beside a window) prefers two warpgroups at every length; three
    /// and one a CTA stay candidates. An `||` of comparisons (a prefix)
    /// takes three past 512 keys; a literal number of sinks beside a window,
    /// whose walk keeps the window alone, past 1024, as the window does.
    #[test]
    fn banded_disjuncts_prefer_two_warpgroups() {
        let hopper = Target::HOPPER;
        let source =
            |mask: &str| format!("S {{ dtype: bf16, head_dim: 64, param w: i32, param g: i32, mask: {mask} }}");
        for (mask, short) in [("k < g || q >= k", 512), ("k < 4 || (q >= k && q - k < w)", 1024)] {
            let spec = parse_one(&source(mask)).unwrap();
            assert_eq!(preferred_for(&spec, hopper, short), wgmma_pair(128), "{mask}");
            assert_eq!(preferred_for(&spec, hopper, short + 1), THREE_WARPGROUPS, "{mask}");
        }
        for mask in ["(q - k <= w && k - q <= w) || q < g || k < g", "k < g || (q >= k && q - k < w)"] {
            let spec = parse_one(&source(mask)).unwrap();
            for kv_len in [1024, 16384] {
                assert_eq!(preferred_for(&spec, hopper, kv_len), wgmma_pair(128), "{mask} at {kv_len}");
            }
            let others = candidates(&spec, hopper);
            assert!(others.contains(&THREE_WARPGROUPS) && others.contains(&ONE_WARPGROUP_PAIR), "{mask}");
        }
    }
}
