//! GPU correctness of decode steps over packed queries
//! (`DecodePlan::run_varlen`: a token count per sequence, 0 to the plan's
//! `q_len`), judged with FlashAttention's rule against the f64 varlen
//! reference: sequence b's step is the forward of its `q_lens[b]` tokens
//! (the spec's `q_len`) against its first `kv_lens[b]` cache rows (see
//! `flashgen_tools::verify::decode`). Q and O hold the plan's `batch ·
//! q_len` tokens, the step's first: the tokens past them must stay
//! unwritten. Dense caches and 16-row pages of a shuffled block table.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs, lengths and token counts (the
//! seed is printed).

mod support;

use flashgen::codegen::Spec;
use flashgen::runtime::{DecodeOptions, DecodeShape, Error, RaggedError, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::decode::{random_decode_problem, random_lens, DecodeProblem, DeviceDecode};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::decode::{capture, replay_matches, run_cases, shape};
use support::{params, runtime, spec};

/// Pages of the paged cases.
const PAGE: usize = 16;

/// One case: a spec, the plan's bounds, the sequences' key and token
/// counts, the split count (`None`: the plan's) and whether the cache is
/// paged.
struct Case {
    spec: Spec,
    shape: DecodeShape,
    kv_lens: Vec<usize>,
    q_lens: Vec<usize>,
    splits: Option<usize>,
    paged: bool,
}

impl Case {
    fn row(&self, splits: usize, seed: u64) -> String {
        let (spec, s) = (&self.spec, self.shape);
        format!(
            "{:<18} h={:>2}/{:<2} b={:<2} q<={:<2} q_lens={:?} kv_lens={:?} cache={:<5} splits={splits:<3} seed={seed}",
            spec.name,
            s.heads,
            s.heads_kv,
            s.batch,
            s.q_len,
            self.q_lens,
            self.kv_lens,
            if self.paged { "paged" } else { "dense" },
        )
    }
}

/// The plan options of `problem`: packed queries, split `splits` ways
/// (`None`: the plan's choice), on pages or not.
fn options(problem: &DecodeProblem, splits: Option<usize>, paged: bool) -> DecodeOptions {
    DecodeOptions {
        scale: Some(problem.reference.problem.scale as f32),
        splits,
        paged,
        varlen: true,
        ..Default::default()
    }
}

/// `problem` on the GPU, its cache dense or in 16-row pages of a block
/// table shuffled by `seed`.
fn upload(rt: &Runtime, spec: &Spec, problem: &DecodeProblem, paged: bool, seed: u64) -> DeviceDecode {
    match paged {
        true => DeviceDecode::upload_paged(rt, spec, problem, &problem.paged(spec, PAGE, seed)),
        false => DeviceDecode::upload(rt, spec, problem),
    }
    .unwrap()
}

/// Plans, uploads (outputs NaN-poisoned), runs once and judges: the step's
/// rows against the reference, and no write past them.
fn run_once(rt: &Runtime, case: &Case, problem: &DecodeProblem, seed: u64) -> Result<(usize, Report), String> {
    let expected = Expected::varlen(&case.spec, &problem.reference).map_err(|e| e.to_string())?;
    let plan = rt.decode_plan(&case.spec, case.shape, &options(problem, case.splits, case.paged));
    let plan = plan.map_err(|e| e.to_string())?;
    let mut gpu = upload(rt, &case.spec, problem, case.paged, seed);
    gpu.run(rt, &plan, problem).map_err(|e| e.to_string())?;
    let report = expected.check(&gpu.download().map_err(|e| e.to_string())?);
    match gpu.spare_rows_written().map_err(|e| e.to_string())? {
        0 => Ok((plan.splits(), report)),
        n => Err(format!("{n} elements of O or the LSE past the step's tokens were written")),
    }
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let once = |case: &Case, seed| {
        let problem = random_decode_problem(&case.spec, case.shape, &case.kv_lens, params(&case.spec), seed)
            .with_q_lens(&case.q_lens);
        run_once(rt, case, &problem, seed)
    };
    run_cases(cases, once, Case::row);
}

/// Token counts for `batch` (at least 4) sequences of at most `max`: 0, 1
/// and `max` among them, the rest random; key counts at least the tokens
/// (a step's tokens are its last keys), up to `max_kv_len`.
fn counts(rng: &mut StdRng, batch: usize, max: usize, max_kv_len: usize) -> (Vec<usize>, Vec<usize>) {
    let mut q_lens = random_lens(rng, batch, (0, max));
    q_lens[..3].copy_from_slice(&[0, 1, max]);
    let kv_lens = q_lens.iter().map(|&n| rng.random_range(n..=max_kv_len)).collect();
    (q_lens, kv_lens)
}

/// Every example spec (causal bottom-right, windows, ALiBi, softcap, a
/// sink, tensors...) with 4 and 16 tokens at most per sequence, random
/// counts (0, 1 and the most among them), GQA 4, dense and paged caches,
/// split as the plan chooses and unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_with_ragged_token_counts() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for max_q_len in [4, 16] {
            for paged in [false, true] {
                for splits in [None, Some(1)] {
                    let (q_lens, kv_lens) = counts(&mut rng, 5, max_q_len, 700);
                    let (spec, shape) = (spec(variant), shape((8, 2), 5, max_q_len, 700));
                    cases.push(Case { spec, shape, kv_lens, q_lens, splits, paged });
                }
            }
        }
    }
    run_all(&rt, cases);
}

/// GQA ratios 1, 4 and 8 and MQA (a row tile of 16 tokens × 8 heads spans
/// several tiles), key counts up to 1, 17 and 4097, 1, 7 or the plan's
/// splits, dense and paged, under a bottom-right causal mask and a window
/// at the cache's end.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn head_groups_lengths_and_splits() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let window = "DecodeWindow { dtype: bf16, head_dim: 128, param window: i32, \
                  mask: q + kv_len - q_len >= k && q + kv_len - q_len - k < window }";
    let mut cases = Vec::new();
    for spec in [spec("causal_bottom_right"), flashgen::parse_one(window).unwrap()] {
        for heads in [(8, 8), (8, 2), (16, 2), (8, 1)] {
            for kv_len in [1usize, 17, 4097] {
                for splits in [Some(1), Some(7), None] {
                    for paged in [false, true] {
                        let max_q_len = kv_len.min(16);
                        let (q_lens, kv_lens) = counts(&mut rng, 4, max_q_len, kv_len);
                        let shape = shape(heads, 4, max_q_len, kv_len);
                        cases.push(Case { spec: spec.clone(), shape, kv_lens, q_lens, splits, paged });
                    }
                }
            }
        }
    }
    run_all(&rt, cases);
}

/// A varlen step captured into a CUDA graph once and replayed with new
/// token counts (new prefix sums and packed queries in the same buffers)
/// and new key counts (and, paged, a new block table): each replay matches
/// the reference for its step and writes nothing past its tokens.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_captured_step_replays_with_new_token_counts() {
    let rt = runtime();
    // One stream: no cross-stream events, which a capture may not wait on.
    unsafe { rt.context().disable_event_tracking() };
    let spec = spec("causal_bottom_right");
    for paged in [false, true] {
        for splits in [Some(1), None] {
            let shape = shape((8, 2), 4, 8, 3000);
            let mut rng = StdRng::seed_from_u64(rand::random());
            let (q_lens, kv_lens) = counts(&mut rng, 4, 8, 3000);
            let problem = random_decode_problem(&spec, shape, &kv_lens, vec![], rng.random()).with_q_lens(&q_lens);
            let plan = rt.decode_plan(&spec, shape, &options(&problem, splits, paged)).unwrap();
            let mut gpu = upload(&rt, &spec, &problem, paged, rng.random());
            let graph = capture(&rt, || gpu.run(&rt, &plan, &problem).unwrap());
            for round in 0..4 {
                let step = match round {
                    0 => problem.clone(),
                    _ => {
                        let (q_lens, kv_lens) = counts(&mut rng, 4, 8, 3000);
                        problem.clone().with_lens(&kv_lens).with_q_lens(&q_lens)
                    }
                };
                gpu.set_queries(&step).unwrap();
                match paged {
                    true => gpu.set_pages(&step.paged(&spec, PAGE, rng.random())).unwrap(),
                    false => gpu.set_kv_lens(&step.kv_lens.iter().map(|&n| n as i32).collect::<Vec<_>>()).unwrap(),
                }
                let what = format!("paged {paged}, splits {splits:?}, round {round}, q_lens {:?}", step.q_lens);
                replay_matches(&graph, &spec, &step, &gpu, &what);
                assert_eq!(gpu.spare_rows_written().unwrap(), 0, "{what}");
            }
        }
    }
}

/// Prefix sums the kernel clamps: whatever they hold (negative, falling,
/// past Q's tokens, sequences longer than the plan's `q_len`), a step reads
/// and writes inside its buffers (a fault would fail the download).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_prefix_sums_stay_inside_the_buffers() {
    let rt = runtime();
    let spec = spec("causal_bottom_right");
    for paged in [false, true] {
        for splits in [Some(1), Some(5)] {
            let shape = shape((8, 2), 3, 4, 300);
            let problem = random_decode_problem(&spec, shape, &[300, 7, 0], vec![], rand::random());
            let problem = problem.with_q_lens(&[4, 2, 0]);
            let plan = rt.decode_plan(&spec, shape, &options(&problem, splits, paged)).unwrap();
            let mut gpu = upload(&rt, &spec, &problem, paged, rand::random());
            for cu in [[0, 12, 12, 12], [-5, 3, 1, i32::MAX], [i32::MIN, i32::MAX, -1, 20], [11, 12, 13, 100]] {
                gpu.set_cu_seqlens(&cu).unwrap();
                gpu.run(&rt, &plan, &problem).unwrap();
                gpu.download().unwrap_or_else(|e| panic!("paged {paged}, splits {splits:?}, cu {cu:?}: {e}"));
            }
        }
    }
}

/// Runs outside the plan are refused before any launch: packed queries in a
/// plan for padded ones (and the other way round), prefix sums of the wrong
/// length, fewer tokens than the plan's `q_len`.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn runs_outside_the_plan_are_refused() {
    let rt = runtime();
    let spec = spec("full");
    let shape = shape((8, 2), 2, 4, 64);
    let padded = random_decode_problem(&spec, shape, &[64, 3], vec![], 1);
    let packed = padded.clone().with_q_lens(&[4, 1]);
    let plan = |varlen| rt.decode_plan(&spec, shape, &DecodeOptions { varlen, ..options(&packed, None, false) });
    let (padded_plan, packed_plan) = (plan(false).unwrap(), plan(true).unwrap());
    let err = upload(&rt, &spec, &packed, false, 0).run(&rt, &padded_plan, &packed).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeQueries { plan: "padded", got: "packed" })), "{err}");
    let err = upload(&rt, &spec, &padded, false, 0).run(&rt, &packed_plan, &padded).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeQueries { plan: "packed", got: "padded" })), "{err}");
    let err = upload(&rt, &spec, &packed, true, 0).run(&rt, &packed_plan, &packed).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeCache { plan: "dense", got: "paged" })), "{err}");
    // A plan for 3 sequences refuses a step of 2.
    let wider = rt.decode_plan(&spec, DecodeShape { batch: 3, ..shape }, &options(&packed, None, false)).unwrap();
    let err = upload(&rt, &spec, &packed, false, 0).run(&rt, &wider, &packed).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { what: "batch", plan: 3, got: 2 })), "{err}");
    // Q of 8 tokens cannot hold a sequence of the 16 a plan allows.
    let longer = rt.decode_plan(&spec, DecodeShape { q_len: 16, ..shape }, &options(&packed, None, false)).unwrap();
    let err = upload(&rt, &spec, &packed, false, 0).run(&rt, &longer, &packed).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: "max_q_len", max: 16, tokens: 8 })), "{err}");
}
