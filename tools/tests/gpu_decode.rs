//! GPU correctness of the decode path (`DecodePlan`), judged with
//! FlashAttention's rule against the f64 varlen reference: a decode step
//! is the forward of `q_len` queries per sequence against its first
//! `kv_lens[b]` cache rows (see `flashgen_tools::verify::decode`).
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and lengths (the seed is printed).

mod support;

use flashgen::codegen::Spec;
use flashgen::cudarc::driver::sys;
use flashgen::runtime::{DecodeOptions, DecodeShape, Error, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::decode::{random_decode_problem, random_lens, DecodeProblem, DeviceDecode};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::forward::Table;
use support::{params, runtime, spec, with};

/// One decode case: a spec, its bounds, the sequences' key counts and the
/// split count (`None`: the plan's).
struct Case {
    spec: Spec,
    shape: DecodeShape,
    lens: Vec<usize>,
    splits: Option<usize>,
}

impl Case {
    fn row(&self, splits: usize, seed: u64) -> String {
        let (spec, s) = (&self.spec, self.shape);
        let longest = self.lens.iter().max().unwrap_or(&0);
        format!(
            "{:<18} {:<4} d={:>3}/{:<3} h={:>2}/{:<2} b={:<2} q={:<2} kv<={:<6} cache={:<6} splits={splits:<3} seed={seed}",
            spec.name,
            spec.dtype.name(),
            spec.head_dims.qk,
            spec.head_dims.v,
            s.heads,
            s.heads_kv,
            s.batch,
            s.q_len,
            longest,
            s.max_kv_len,
        )
    }
}

/// Plans, uploads (outputs NaN-poisoned), runs once and judges.
fn run_once(rt: &Runtime, case: &Case, problem: &DecodeProblem) -> Result<(usize, Report), String> {
    let expected = Expected::varlen(&case.spec, &problem.reference).map_err(|e| e.to_string())?;
    let opts = DecodeOptions { scale: Some(problem.reference.problem.scale as f32), splits: case.splits };
    let plan = rt.decode_plan(&case.spec, case.shape, &opts).map_err(|e| e.to_string())?;
    let mut gpu = DeviceDecode::upload(rt, &case.spec, problem).map_err(|e| e.to_string())?;
    gpu.run(rt, &plan, problem).map_err(|e| e.to_string())?;
    Ok((plan.splits(), expected.check(&gpu.download().map_err(|e| e.to_string())?)))
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let mut table = Table::default();
    for case in cases {
        let seed: u64 = rand::random();
        let problem = random_decode_problem(&case.spec, case.shape, &case.lens, params(&case.spec), seed);
        let outcome = run_once(rt, &case, &problem);
        let splits = outcome.as_ref().map_or(0, |(s, _)| *s);
        table.record(case.row(splits, seed), outcome.map(|(_, report)| report));
    }
    table.finish();
}

fn shape(heads: (usize, usize), batch: usize, q_len: usize, max_kv_len: usize) -> DecodeShape {
    DecodeShape { batch, heads: heads.0, heads_kv: heads.1, q_len, max_kv_len }
}

/// Every example spec at q_len 1, 4 and 16, ragged lengths (one empty
/// sequence, one of a single key, the rest random), split as the plan
/// chooses and unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_at_each_query_count() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for q_len in [1, 4, 16] {
            for splits in [None, Some(1)] {
                let max_kv_len = 700;
                let mut lens = random_lens(&mut rng, 4, (q_len, max_kv_len));
                lens[..2].copy_from_slice(&[0, 1]);
                let shape = shape((8, 2), 4, q_len, max_kv_len);
                cases.push(Case { spec: spec(variant), shape, lens, splits });
            }
        }
    }
    run_all(&rt, cases);
}

/// GQA ratios 1, 4 and 8 and MQA; key counts 1, 17 and 4097 (the last a
/// tile's first key); split and unsplit; head dims 64, 128 and 256; a
/// window at the end of the cache.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn head_groups_lengths_and_splits() {
    let rt = runtime();
    let mut cases = Vec::new();
    // A window at the cache's end: the splits divide its band of tiles.
    let window = "DecodeWindow { dtype: bf16, head_dim: 128, param window: i32, \
                  mask: q + kv_len - q_len >= k && q + kv_len - q_len - k < window }";
    let specs = [
        spec("causal_bottom_right"),
        spec("alibi"),
        with(spec("full"), flashgen::codegen::Dtype::F16, 64, 64),
        flashgen::parse_one(window).unwrap(),
    ];
    for spec in specs {
        for heads in [(8, 8), (8, 2), (16, 2), (8, 1)] {
            for kv_len in [1usize, 17, 4097] {
                for splits in [Some(1), Some(7), None] {
                    let lens = vec![kv_len, kv_len.div_ceil(2)];
                    cases.push(Case { spec: spec.clone(), shape: shape(heads, 2, 2, kv_len), lens, splits });
                }
            }
        }
    }
    let d256 = with(spec("causal_bottom_right"), flashgen::codegen::Dtype::Bf16, 256, 256);
    for splits in [Some(1), None] {
        cases.push(Case { spec: d256.clone(), shape: shape((8, 2), 2, 3, 1000), lens: vec![1000, 333], splits });
    }
    run_all(&rt, cases);
}

/// One long cache: 65536 keys of one sequence, split across the GPU.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn one_long_sequence() {
    let rt = runtime();
    let case =
        Case { spec: spec("causal_bottom_right"), shape: shape((8, 2), 1, 1, 65536), lens: vec![65536], splits: None };
    run_all(&rt, vec![case]);
}

/// Lengths the kernel clamps: negative ones keep no key, ones past the
/// cache keep all of it; nothing outside the cache is read.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn lengths_are_clamped_into_the_cache() {
    let rt = runtime();
    let spec = spec("full");
    for splits in [Some(1), Some(5)] {
        let shape = shape((8, 2), 3, 1, 300);
        let problem = random_decode_problem(&spec, shape, &[0, 300, 7], vec![], rand::random());
        let opts = DecodeOptions { scale: Some(problem.reference.problem.scale as f32), splits };
        let plan = rt.decode_plan(&spec, shape, &opts).unwrap();
        let mut gpu = DeviceDecode::upload(&rt, &spec, &problem).unwrap();
        gpu.set_kv_lens(&[-5, 100_000, 7]).unwrap();
        gpu.run(&rt, &plan, &problem).unwrap();
        let report = Expected::varlen(&spec, &problem.reference).unwrap().check(&gpu.download().unwrap());
        assert!(report.passed(), "splits {splits:?}: O {} LSE {}", report.output, report.lse);
    }
}

/// One decode step captured into a CUDA graph, replayed with new lengths
/// written to the same device buffer: each replay matches the reference
/// for its lengths.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_captured_step_replays_with_new_lengths() {
    let rt = runtime();
    // One stream: no cross-stream events, which a capture may not wait on.
    unsafe { rt.context().disable_event_tracking() };
    let spec = spec("causal_bottom_right");
    for splits in [Some(1), None] {
        let shape = shape((8, 2), 2, 2, 3000);
        let mut rng = StdRng::seed_from_u64(rand::random());
        let first = random_lens(&mut rng, 2, (2, 3000));
        let problem = random_decode_problem(&spec, shape, &first, vec![], rng.random());
        let opts = DecodeOptions { scale: Some(problem.reference.problem.scale as f32), splits };
        let plan = rt.decode_plan(&spec, shape, &opts).unwrap();
        let mut gpu = DeviceDecode::upload(&rt, &spec, &problem).unwrap();
        let stream = rt.stream();
        stream.synchronize().unwrap();
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
        gpu.run(&rt, &plan, &problem).unwrap();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
        for round in 0..3 {
            let lens = if round == 0 { first.clone() } else { random_lens(&mut rng, 2, (2, 3000)) };
            gpu.set_kv_lens(&lens.iter().map(|&n| n as i32).collect::<Vec<_>>()).unwrap();
            graph.launch().unwrap();
            let expected = Expected::varlen(&spec, &problem.clone().with_lens(&lens).reference).unwrap();
            let report = expected.check(&gpu.download().unwrap());
            assert!(report.passed(), "round {round}, lens {lens:?}: O {} LSE {}", report.output, report.lse);
        }
    }
}

/// Operands that disagree with the plan are refused with a typed error.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn launches_outside_the_plan_are_refused() {
    let rt = runtime();
    let spec = spec("full");
    let problem = random_decode_problem(&spec, shape((8, 2), 2, 1, 64), &[64, 3], vec![], 1);
    let plan = rt.decode_plan(&spec, shape((8, 2), 2, 2, 64), &DecodeOptions::default()).unwrap();
    let mut gpu = DeviceDecode::upload(&rt, &spec, &problem).unwrap();
    let err = gpu.run(&rt, &plan, &problem).unwrap_err();
    assert!(matches!(err, Error::DecodePlanMismatch { what: "q_len", plan: 2, got: 1 }), "{err}");
    let bad = rt.decode_plan(&spec, shape((8, 3), 2, 1, 64), &DecodeOptions::default()).err().unwrap();
    assert!(matches!(bad, Error::HeadGroups { .. }), "{bad}");
    let too_many = DecodeOptions { splits: Some(1000), ..DecodeOptions::default() };
    assert!(matches!(rt.decode_plan(&spec, shape((8, 2), 2, 1, 64), &too_many), Err(Error::DecodeShape { .. })));
}
