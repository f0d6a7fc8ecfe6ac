//! GPU correctness of the generated forward kernels, judged with
//! FlashAttention's rule against the f64 reference (see
//! `flashgen_tools::verify`).
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs (the seed is printed with each
//! failure).

mod support;

use flashgen::codegen::cuda::TALL_PAIR;
use flashgen::codegen::reference::ParamValue;
use flashgen::codegen::{Builtin, Dtype, Shape, Spec};
use flashgen::Error;
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::{self, DeviceProblem, OperandLayout};
use support::forward::{
    in_configurations, in_every_configuration, in_every_configuration_with, run_all, run_all_in, Case,
};
use support::{language_spec, params, runtime, spec, with};

const SEQLEN_PAIRS: [(usize, usize); 3] = [(113, 203), (128, 217), (1024, 1023)];

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_at_awkward_seqlens() {
    let rt = runtime();
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for seqs in SEQLEN_PAIRS {
            let heads = if variant == "gqa" { (8, 2) } else { (4, 4) };
            cases.push((spec(variant), Case::new(heads, seqs)));
        }
    }
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn both_dtypes_and_several_head_dims() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["full", "causal", "alibi", "document", "softcap"] {
        for dtype in [Dtype::F16, Dtype::Bf16] {
            for (qk, v) in [(64, 64), (128, 128), (59, 59), (96, 96), (256, 256), (192, 128)] {
                cases.push((with(spec(variant), dtype, qk, v), Case::new((4, 2), (113, 203))));
            }
        }
    }
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mha_gqa_and_mqa() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["full", "causal", "alibi", "document"] {
        for heads in [(6, 6), (6, 2), (6, 1)] {
            cases.push((spec(variant), Case::new(heads, (128, 217))));
        }
    }
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn strided_operand_layouts() {
    let rt = runtime();
    let mut cases = Vec::new();
    for variant in ["causal", "sliding_window", "gqa"] {
        for layout in [OperandLayout::Bshd, OperandLayout::Bhsd, OperandLayout::Padded] {
            let heads = if variant == "gqa" { (4, 2) } else { (3, 3) };
            cases.push((spec(variant), Case { batch: 3, heads, seqs: (113, 203), layout }));
        }
    }
    // Sinks at d = 64: the global columns' tile copied from each layout.
    for layout in [OperandLayout::Bshd, OperandLayout::Bhsd, OperandLayout::Padded] {
        let sinks = with(spec("streaming_window"), Dtype::Bf16, 64, 64);
        cases.push((sinks, Case { batch: 2, heads: (3, 3), seqs: (520, 700), layout }));
    }
    run_all(&rt, cases);
}

/// More work items (query tiles of every head) than SMs: each persistent
/// warp-specialized CTA walks several, with both Q buffers, the stage ring
/// and the warpgroups' turns running on from item to item; its producer
/// copying with TMA, then with cp.async (the path of layouts TMA cannot
/// address).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn persistent_ctas_walk_many_items() {
    let rt = runtime();
    let cases = || {
        let case = || Case { batch: 4, heads: (16, 4), seqs: (520, 700), layout: OperandLayout::Bshd };
        let mut cases: Vec<_> = ["causal", "sliding_window", "document", "softcap"].map(|v| (spec(v), case())).into();
        cases.push((with(spec("full"), Dtype::Bf16, 64, 64), case()));
        // d = 64 past 2048 keys: three warpgroups, which pass their turns on
        // the tiles their rows keep no pair of.
        let long_keys = || Case { seqs: (520, 2100), ..case() };
        cases.push((with(spec("sliding_window"), Dtype::Bf16, 64, 64), long_keys()));
        // Sinks beside a window: most items take the global columns' tile.
        cases.push((with(spec("streaming_window"), Dtype::Bf16, 64, 64), long_keys()));
        cases
    };
    run_all(&rt, cases());
    run_all(&rt.with_tma(false), cases());
}

/// One warpgroup of 128 rows, two CTAs per SM (`TALL_PAIR`, two m64
/// products per tile): every example spec at d = 64, with and without a
/// block mask; then with four times more items than CTAs, so that each
/// walks several, its producer copying with TMA and with threads.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn tall_warpgroups_run_every_example() {
    let narrow = |v: &str| with(spec(v), Dtype::Bf16, 64, 64);
    // Block-sparse's layout covers 2048 keys, and GQA at d = 64 is causal.
    let examples = SPECS.iter().filter(|(v, _)| !["block_sparse", "gqa"].contains(v));
    in_configurations(&runtime(), examples.map(|(v, _)| (params(&narrow(v)), narrow(v))).collect(), &|_| {
        vec![TALL_PAIR]
    });
    for rt in [runtime(), runtime().with_tma(false)] {
        let many = || Case { batch: 8, heads: (16, 4), seqs: (1024, 1100), layout: OperandLayout::Bshd };
        let cases = ["causal", "sliding_window", "document", "full", "alibi"].map(|v| (narrow(v), many()));
        run_all_in(&rt, cases.into(), Some(TALL_PAIR));
    }
}

/// The i32 operators, Euclidean builtins and dimension expressions
/// (`language.attn`) in every candidate configuration of the GPU, with and
/// without a block mask: the kernels' helpers and interval rules against
/// the reference's.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn language_features_in_every_configuration() {
    in_every_configuration(&runtime(), vec![language_spec()]);
}

/// Masks that are unions (global tokens, sinks beside a window, a prefix)
/// in every candidate configuration at both head dims: their partial tiles
/// test a union of column intervals per row, whose code differs per tile
/// shape; the test's params end the sinks and globals inside a tile, so the
/// whole union runs, not only each disjunct alone.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn union_masks_in_every_configuration() {
    let stems = ["longformer", "prefix_lm", "streaming_window"];
    let specs = stems.iter().flat_map(|stem| [spec(stem), with(spec(stem), Dtype::Bf16, 64, 64)]);
    in_every_configuration(&runtime(), specs.collect());
}

/// Global columns first (`k < C || ...`, head dims up to 64): a param C
/// beside a window, which a launch whose C fits 64 keys bounds, taking the
/// columns apart from the walk (0, 4, 16: a 16-key tile; 32; 33: a 48-key
/// one), and where C passes that (100, 5000: past every key) items whose
/// window keeps no pair of the first tile take the column tile and the
/// others walk it; a window of no key; global rows beside them
/// (Longformer); a per-query term staged with Q; literal columns beside a
/// band, whose walk leaves the columns to the column tile (`40 >= k`:
/// inclusive, 41 keys of a 48-key tile; `4 >= k` with a score at a padded
/// head dim); every candidate configuration (one warpgroup per CTA has no
/// column tile).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn global_columns_first_in_every_configuration() {
    let valued = |spec: Spec, overrides: &[(&str, i32)]| {
        let values = spec
            .params
            .iter()
            .zip(params(&spec))
            .map(|(p, value)| match overrides.iter().find(|(name, _)| *name == p.name) {
                Some(&(_, v)) => ParamValue::I32(v),
                None => value,
            })
            .collect();
        (values, spec)
    };
    let window = spec("streaming_window");
    let literal = flashgen::parse_one(
        "LiteralSinks { dtype: f16, head_dim: 48, param window: i32, \
         mask: (q >= k && q - k < window) || 4 >= k, score: 30.0 * tanh(score / 30.0) }",
    )
    .unwrap();
    // A per-query term, which the producer stages with Q and the column tile's
    // logits read.
    let row_bias = flashgen::parse_one(
        "RowBias { dtype: bf16, head_dim: 64, param sinks: i32, param window: i32, tensor rb: f32[Q_LEN], \
         mask: k < sinks || (q >= k && q - k < window), score: score + rb[q] }",
    )
    .unwrap();
    let band = flashgen::parse_one(
        "BandSinks { dtype: bf16, head_dim: 64, param window: i32, \
         mask: 40 >= k || (q - k < window && k - q < window) }",
    )
    .unwrap();
    let cases = vec![
        valued(row_bias, &[("sinks", 7)]),
        valued(with(window.clone(), Dtype::Bf16, 64, 64), &[("sinks", 100)]),
        valued(with(window.clone(), Dtype::F16, 64, 64), &[("sinks", 5000)]),
        valued(with(window.clone(), Dtype::Bf16, 64, 64), &[("sinks", 0)]),
        valued(band.clone(), &[("window", 150)]),
        // Windows that keep no key, or one: the walk keeps no pair of some
        // rows, or of any.
        valued(band.clone(), &[("window", 0)]),
        valued(band, &[("window", 1)]),
        valued(with(window.clone(), Dtype::Bf16, 64, 64), &[("sinks", 4), ("window", 0)]),
        valued(with(window.clone(), Dtype::Bf16, 64, 64), &[("sinks", 4)]),
        valued(with(window.clone(), Dtype::F16, 64, 64), &[("sinks", 16)]),
        valued(with(window.clone(), Dtype::Bf16, 64, 64), &[("sinks", 32)]),
        valued(with(window, Dtype::Bf16, 64, 64), &[("sinks", 33)]),
        valued(with(spec("longformer"), Dtype::Bf16, 64, 64), &[("globals", 32)]),
        valued(literal, &[]),
    ];
    in_every_configuration_with(&runtime(), cases);
}

/// q_len > kv_len with a bottom-right causal mask leaves the first rows with
/// no key at all: they must come out as O = 0 and LSE = −∞.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn fully_masked_rows() {
    let rt = runtime();
    let cases = vec![
        (spec("causal_bottom_right"), Case::new((2, 2), (300, 37))),
        (spec("causal_bottom_right"), Case::new((2, 1), (1024, 1000))),
        // d = 64: the warp-specialized kernel sums rows on the tensor cores.
        (with(spec("causal_bottom_right"), Dtype::Bf16, 64, 64), Case::new((2, 2), (300, 37))),
        // A band past 2048 keys: three warpgroups, which pass their turns on
        // every tile their rows keep no pair of, the fully masked ones on all.
        (bottom_right_window(), Case::new((2, 2), (2400, 2100))),
    ];
    run_all(&rt, cases);
}

/// A sliding window aligned to the bottom-right corner at d = 64.
fn bottom_right_window() -> Spec {
    let source = "BottomRightWindow { dtype: bf16, head_dim: 64, param window: i32, \
                  mask: q + kv_len - q_len >= k && q - k < window + q_len - kv_len }";
    flashgen::parse_one(source).expect("a valid spec")
}

/// Bad launches are typed errors, never launches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_launches_are_rejected() {
    let rt = runtime();
    let spec = spec("sliding_window");
    let stream = rt.stream();
    let layout = flashgen::Layout::bshd(1, 64, 2, 128);
    let q = stream.alloc_zeros::<flashgen::half::bf16>(layout.len()).unwrap();
    let short = stream.alloc_zeros::<flashgen::half::bf16>(layout.len() - 1).unwrap();
    let mut o = stream.alloc_zeros::<flashgen::half::bf16>(layout.len()).unwrap();
    let io =
        flashgen::ForwardIo { q: (&q, layout), k: (&short, layout), v: (&q, layout), o: (&mut o, layout), lse: None };
    let err = rt.forward(&spec, io, &[flashgen::ArgValue::I32(8)], &Default::default()).unwrap_err();
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let io = flashgen::ForwardIo { q: (&q, layout), k: (&q, layout), v: (&q, layout), o: (&mut o, layout), lse: None };
    let err = rt.forward(&spec, io, &[], &Default::default()).unwrap_err();
    assert!(matches!(err, Error::ArgCount { .. }), "{err}");
}

/// A document mask without causality: interval analysis keeps every tile,
/// so only the block mask can skip any.
const DOCUMENTS: &str =
    "Documents { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }";

/// Block masks: the classes match a brute-force evaluation of the mask on
/// every tile, and forward passes that use them stay exact.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn block_masks_are_exact_and_skip_tiles() {
    use flashgen::codegen::cuda::TileConfig;
    use flashgen::codegen::reference::{Arith, Env, Position, Value};
    let rt = runtime();
    let documents = flashgen::parse_one(DOCUMENTS).unwrap();
    let mut failures = Vec::new();
    for (spec, heads, seqs) in [
        (documents.clone(), (2, 2), (1024, 1024)),
        (documents, (4, 1), (113, 203)),
        (spec("document"), (2, 2), (1024, 1023)),
        // Work orders sort items in windows of 4 heads: a whole one and a part.
        (spec("document"), (6, 3), (520, 700)),
        (spec("sliding_window"), (2, 2), (1024, 1023)),
        (spec("prefix_lm"), (3, 3), (300, 555)),
        (spec("block_sparse"), (2, 2), (1024, 1023)),
    ] {
        let shape = Shape { batch: 2, heads: heads.0, heads_kv: heads.1, q_len: seqs.0, kv_len: seqs.1 };
        let seed: u64 = rand::random();
        let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
        let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd).unwrap();
        let mask = gpu.build_block_mask(&rt, &spec, &problem).unwrap();
        let classes = mask.classes(&rt).unwrap();
        let (q_tiles, kv_tiles) = mask.tiles();

        // Brute force at batch 1, head 0: slice 0 unless the mask reads b.
        let (bm, bn) = TileConfig::mask_tile(&spec);
        let (bm, bn) = (bm as usize, bn as usize);
        let env = Env::new(&spec, &shape, &problem.params, &problem.tensors, Arith::F32).unwrap();
        let mask_expr = spec.mask.as_ref().unwrap();
        let heads_per_slice = if mask_expr.uses(Builtin::H) { heads.0 } else { 1 };
        let slice = if mask_expr.uses(Builtin::B) { heads_per_slice * q_tiles * kv_tiles } else { 0 };
        let mut skipped = 0;
        for qt in 0..q_tiles {
            for kt in 0..kv_tiles {
                let (mut any, mut all) = (false, true);
                for q in qt * bm..((qt + 1) * bm).min(seqs.0) {
                    for k in kt * bn..((kt + 1) * bn).min(seqs.1) {
                        let at = Position { b: 1, h: 0, q: q as i32, k: k as i32, score: 0.0 };
                        let keep = env.eval(spec.mask.as_ref().unwrap(), &at) == Value::Bool(true);
                        any |= keep;
                        all &= keep;
                    }
                }
                let want = if !any {
                    0
                } else if all {
                    2
                } else {
                    1
                };
                let got = classes[slice + qt * kv_tiles + kt];
                skipped += usize::from(got == 0);
                if got != want {
                    failures.push(format!("{}: tile ({qt}, {kt}) is {got}, expected {want} (seed {seed})", spec.name));
                }
            }
        }
        let out = {
            gpu.launch(&rt, &spec, &problem).unwrap();
            gpu.download().unwrap()
        };
        let report = verify::check(&spec, &problem, &out).unwrap();
        println!(
            "{:<16} s={:>4}/{:<4} tiles skipped {skipped}/{}  O: {}",
            spec.name,
            seqs.0,
            seqs.1,
            q_tiles * kv_tiles,
            report.output
        );
        if !report.passed() {
            failures.push(format!("{}: O {} LSE {} (seed {seed})", spec.name, report.output, report.lse));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Work orders, checked against the block mask's classes: each unit's count
/// of visited mask tiles is right, and within every window of heads of a
/// batch (4 heads; 6 here: a whole window and a part) the order is a
/// permutation of the window's units, longest class first, launch order
/// within a class.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn work_orders_sort_each_window_longest_first() {
    use flashgen::codegen::cuda::{TileConfig, Work, BUCKETS, HEADS_PER_BLOCK};
    let rt = runtime();
    let spec = spec("document");
    // Query and key tiles alike: as many of each, 6 (K/V) heads.
    let shape = Shape { batch: 2, heads: 6, heads_kv: 6, q_len: 1000, kv_len: 1000 };
    let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, rand::random());
    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd).unwrap();
    let mask = gpu.build_block_mask(&rt, &spec, &problem).unwrap();
    let classes = mask.classes(&rt).unwrap();
    let (mask_q, mask_kv) = mask.tiles();
    let (mask_m, mask_n) = TileConfig::mask_tile(&spec);
    // The mask reads b, not h: one slice per batch.
    let kept = |b: usize, row: usize, col: usize| classes[(b * mask_q + row) * mask_kv + col] != 0;
    let tile = 128;
    let tiles = shape.q_len.div_ceil(tile);
    // The count of unit i of a head of batch b: query tiles run last first.
    let count_of = |work: Work, b: usize, i: usize| -> i32 {
        let span = |t: usize, mask_tile: u32, mask_tiles: usize| {
            t * tile / mask_tile as usize..((t + 1) * tile).div_ceil(mask_tile as usize).min(mask_tiles)
        };
        let count = match work {
            Work::QueryTiles { .. } => {
                let rows = span(tiles - 1 - i, mask_m, mask_q);
                (0..mask_kv).filter(|&col| rows.clone().any(|row| kept(b, row, col))).count()
            }
            Work::KeyTiles { .. } => {
                let cols = span(i, mask_n, mask_kv);
                (0..mask_q).filter(|&row| cols.clone().any(|col| kept(b, row, col))).count()
            }
        };
        count as i32
    };
    for work in [Work::QueryTiles { block_m: tile as u32 }, Work::KeyTiles { block_n: tile as u32 }] {
        let found = mask.work_order_host(&rt, &spec, work).unwrap();
        let units = shape.batch * shape.heads * tiles;
        let (order, counts) = found.split_at(units);
        for (c, &count) in counts.iter().enumerate() {
            let (b, i) = (c / tiles / shape.heads, c % tiles);
            assert_eq!(count, count_of(work, b, i), "{work:?}: count of unit {c}");
        }
        let per_block = HEADS_PER_BLOCK as usize;
        let windows = (0..shape.batch).flat_map(|b| (0..shape.heads).step_by(per_block).map(move |h| (b, h)));
        for (b, h0) in windows {
            let window = (b * shape.heads + h0) * tiles..(b * shape.heads + (h0 + per_block).min(shape.heads)) * tiles;
            let walked = &order[window.clone()];
            let mut sorted: Vec<usize> = walked.iter().map(|&c| c as usize).collect();
            sorted.sort_unstable();
            assert!(sorted.iter().copied().eq(window.clone()), "{work:?}: window {window:?} walks {walked:?}");
            let longest = walked.iter().map(|&c| counts[c as usize]).max().unwrap();
            let class = |c: i32| (longest - counts[c as usize]) * (BUCKETS as i32 - 1) / longest.max(1);
            for pair in walked.windows(2) {
                let (x, y) = (pair[0], pair[1]);
                assert!((class(x), x) < (class(y), y), "{work:?}: {x} walks before {y} in {walked:?}");
            }
        }
    }
}

/// A block mask is only valid for the launch it was built for.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn block_mask_must_match_the_launch() {
    let rt = runtime();
    let spec = spec("sliding_window");
    let shape = Shape { batch: 1, heads: 2, heads_kv: 2, q_len: 256, kv_len: 256 };
    let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, 7);
    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, OperandLayout::Bshd).unwrap();
    let mask = gpu.build_block_mask(&rt, &spec, &problem).unwrap();
    // Work orders exist only under masks that read tensors, for the mask's spec.
    let work = flashgen::codegen::cuda::Work::KeyTiles { block_n: 128 };
    let err = mask.work_order_host(&rt, &spec, work).unwrap_err();
    assert!(matches!(err, Error::NoWorkOrder { .. }), "{err}");
    let err = mask.work_order_host(&rt, &self::spec("document"), work).unwrap_err();
    assert!(matches!(err, Error::BlockMaskMismatch { what: "spec" }), "{err}");
    let mut other = problem.clone();
    other.params = vec![ParamValue::I32(3)];
    let err = gpu.launch(&rt, &spec, &other).unwrap_err();
    assert!(matches!(err, Error::BlockMaskMismatch { what: "params or tensors" }), "{err}");
    let err = rt.block_mask(&self::spec("full"), shape, &[]).err();
    assert!(matches!(err, Some(Error::NoMask { .. })), "{err:?}");
}
