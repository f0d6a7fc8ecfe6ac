//! GPU correctness of the decode path (`DecodePlan`), judged with
//! FlashAttention's rule against the f64 varlen reference: a decode step
//! is the forward of `q_len` queries per sequence against its first
//! `kv_lens[b]` cache rows (see `flashgen_tools::verify::decode`). Paged
//! cases run the same steps with the keys in pages of a shuffled block
//! table (`DecodePlan::run_paged`), judged by the same reference.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and lengths (the seed is printed).

mod support;

use flashgen::codegen::Spec;
use flashgen::half::bf16;
use flashgen::runtime::RaggedError;
use flashgen::runtime::{DecodeOptions, DecodeShape, Error, Layout, PagedDecodeIo, PagedKv, PagedLayout, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::decode::{random_decode_problem, random_lens, DecodeProblem, DeviceDecode};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::decode::{capture, replay_matches, run_cases, shape};
use support::{params, runtime, spec, with};

/// One decode case: a spec, its bounds, the sequences' key counts, the
/// split count (`None`: the plan's) and the page size (`None`: a dense
/// cache).
struct Case {
    spec: Spec,
    shape: DecodeShape,
    lens: Vec<usize>,
    splits: Option<usize>,
    page_size: Option<usize>,
}

impl Case {
    fn row(&self, splits: usize, seed: u64) -> String {
        let (spec, s) = (&self.spec, self.shape);
        let longest = self.lens.iter().max().unwrap_or(&0);
        format!(
            "{:<18} {:<4} d={:>3}/{:<3} h={:>2}/{:<2} b={:<2} q={:<2} kv<={:<6} cache={:<6} page={:<5} splits={splits:<3} seed={seed}",
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
            self.page_size.map_or("dense".into(), |p| p.to_string()),
        )
    }
}

/// The plan options of `problem` split `splits` ways (`None`: the plan's
/// choice), on pages or not.
fn options(problem: &DecodeProblem, splits: Option<usize>, paged: bool) -> DecodeOptions {
    DecodeOptions { scale: Some(problem.reference.problem.scale as f32), splits, paged, ..Default::default() }
}

/// `problem` on the GPU: a dense cache, or pages of `page_size` rows of a
/// block table shuffled by `seed`.
fn upload(rt: &Runtime, spec: &Spec, problem: &DecodeProblem, page_size: Option<usize>, seed: u64) -> DeviceDecode {
    match page_size {
        None => DeviceDecode::upload(rt, spec, problem),
        Some(page) => DeviceDecode::upload_paged(rt, spec, problem, &problem.paged(spec, page, seed)),
    }
    .unwrap()
}

/// Plans, uploads (outputs NaN-poisoned), runs once and judges.
fn run_once(rt: &Runtime, case: &Case, problem: &DecodeProblem, seed: u64) -> Result<(usize, Report), String> {
    let expected = Expected::varlen(&case.spec, &problem.reference).map_err(|e| e.to_string())?;
    let opts = options(problem, case.splits, case.page_size.is_some());
    let plan = rt.decode_plan(&case.spec, case.shape, &opts).map_err(|e| e.to_string())?;
    let mut gpu = upload(rt, &case.spec, problem, case.page_size, seed);
    gpu.run(rt, &plan, problem).map_err(|e| e.to_string())?;
    Ok((plan.splits(), expected.check(&gpu.download().map_err(|e| e.to_string())?)))
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let once = |case: &Case, seed| {
        let problem = random_decode_problem(&case.spec, case.shape, &case.lens, params(&case.spec), seed);
        run_once(rt, case, &problem, seed)
    };
    run_cases(cases, once, Case::row);
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
                cases.push(Case { spec: spec(variant), shape, lens, splits, page_size: None });
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
                    let shape = shape(heads, 2, 2, kv_len);
                    cases.push(Case { spec: spec.clone(), shape, lens, splits, page_size: None });
                }
            }
        }
    }
    let d256 = with(spec("causal_bottom_right"), flashgen::codegen::Dtype::Bf16, 256, 256);
    for splits in [Some(1), None] {
        let (shape, lens) = (shape((8, 2), 2, 3, 1000), vec![1000, 333]);
        cases.push(Case { spec: d256.clone(), shape, lens, splits, page_size: None });
    }
    run_all(&rt, cases);
}

/// Split counts around the combine's rounds of loads (`COMBINE_IN_FLIGHT`
/// splits a round, the last round's surplus predicated off): 9, 17, 26
/// and 128 (more splits than a short cache's tiles: empty splits of no
/// keys); dense and paged, GQA and MQA.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn split_counts_across_the_combines_rounds() {
    let rt = runtime();
    let mut cases = Vec::new();
    for splits in [9, 17, 26, 128] {
        for (heads, kv_len, page_size) in [((8, 2), 20000, None), ((8, 1), 4097, Some(16)), ((16, 2), 300, None)] {
            let (shape, lens) = (shape(heads, 2, 2, kv_len), vec![kv_len, kv_len / 3]);
            cases.push(Case { spec: spec("causal_bottom_right"), shape, lens, splits: Some(splits), page_size });
        }
    }
    run_all(&rt, cases);
}

/// One long cache: 65536 keys of one sequence, split across the GPU.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn one_long_sequence() {
    let rt = runtime();
    let cases = [None, Some(16)].map(|page_size| Case {
        spec: spec("causal_bottom_right"),
        shape: shape((8, 2), 1, 1, 65536),
        lens: vec![65536],
        splits: None,
        page_size,
    });
    run_all(&rt, cases.into());
}

/// Tuning the split count times the caller's own step at every candidate
/// count, keeps the fastest, and leaves every step exact: the output of
/// the last candidate timed, and a fresh step of the tuned plan. A step
/// that fails fails the tune, the plan as it was.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_tuned_plan_runs_its_fastest_split_count() {
    let rt = runtime();
    let spec = spec("causal_bottom_right");
    for page_size in [None, Some(16)] {
        let (shape, seed) = (shape((32, 8), 2, 1, 4096), rand::random());
        let problem = random_decode_problem(&spec, shape, &[4096, 1000], vec![], seed);
        let expected = Expected::varlen(&spec, &problem.reference).unwrap();
        let mut plan = rt.decode_plan(&spec, shape, &options(&problem, None, page_size.is_some())).unwrap();
        let mut gpu = upload(&rt, &spec, &problem, page_size, seed);
        let report = plan.tune(&rt, |p| gpu.run(&rt, p, &problem)).unwrap();
        println!("page {page_size:?} seed {seed}: {report}");
        assert_eq!(report.best, plan.splits(), "{report}");
        let counts: Vec<usize> = report.candidates.iter().map(|(splits, _)| *splits).collect();
        assert!(counts.starts_with(&[1, 2, 4, 8]) && counts.windows(2).all(|w| w[0] < w[1]), "{report}");
        assert!(report.candidates.iter().all(|(_, ms)| ms.as_ref().is_ok_and(|ms| *ms > 0.0)), "{report}");
        let last = expected.check(&gpu.download().unwrap());
        assert!(last.passed(), "after tuning: O {} LSE {}", last.output, last.lse);
        let mut fresh = upload(&rt, &spec, &problem, page_size, seed);
        fresh.run(&rt, &plan, &problem).unwrap();
        let tuned = expected.check(&fresh.download().unwrap());
        assert!(tuned.passed(), "tuned: O {} LSE {}", tuned.output, tuned.lse);

        let before = plan.splits();
        let failing = plan.tune(&rt, |_| Err(Error::NoMask { spec: spec.name.clone() }));
        assert!(matches!(failing, Err(Error::NoMask { .. })), "{failing:?}");
        assert_eq!(plan.splits(), before);
    }
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
        let opts = options(&problem, splits, false);
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
    replay_captured_steps(false);
}

/// Captures one decode step (on 16-row pages when `paged`) into a CUDA
/// graph and replays it three times, each with new lengths written to the
/// same device buffer (and, paged, a new block table and the pages' new
/// contents): each replay matches the reference for its step.
fn replay_captured_steps(paged: bool) {
    let rt = runtime();
    // One stream: no cross-stream events, which a capture may not wait on.
    unsafe { rt.context().disable_event_tracking() };
    let spec = spec("causal_bottom_right");
    // Unsplit, 26 splits (a round and a partial one) and the plan's.
    for splits in [Some(1), Some(26), None] {
        let shape = shape((8, 2), 2, 2, 3000);
        let mut rng = StdRng::seed_from_u64(rand::random());
        let first = random_lens(&mut rng, 2, (2, 3000));
        let problem = random_decode_problem(&spec, shape, &first, vec![], rng.random());
        let plan = rt.decode_plan(&spec, shape, &options(&problem, splits, paged)).unwrap();
        let mut gpu = match paged {
            true => DeviceDecode::upload_paged(&rt, &spec, &problem, &problem.paged(&spec, 16, rng.random())),
            false => DeviceDecode::upload(&rt, &spec, &problem),
        }
        .unwrap();
        let graph = capture(&rt, || gpu.run(&rt, &plan, &problem).unwrap());
        for round in 0..3 {
            let lens = if round == 0 { first.clone() } else { random_lens(&mut rng, 2, (2, 3000)) };
            let step = problem.clone().with_lens(&lens);
            match paged {
                true => gpu.set_pages(&step.paged(&spec, 16, rng.random())).unwrap(),
                false => gpu.set_kv_lens(&lens.iter().map(|&n| n as i32).collect::<Vec<_>>()).unwrap(),
            }
            replay_matches(&graph, &spec, &step, &gpu, &format!("round {round}, lens {lens:?}"));
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
    assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { what: "q_len", plan: 2, got: 1 })), "{err}");
    let bad = rt.decode_plan(&spec, shape((8, 3), 2, 1, 64), &DecodeOptions::default()).err().unwrap();
    assert!(matches!(bad, Error::HeadGroups { .. }), "{bad}");
    let too_many = DecodeOptions { splits: Some(1000), ..DecodeOptions::default() };
    assert!(matches!(
        rt.decode_plan(&spec, shape((8, 2), 2, 1, 64), &too_many),
        Err(Error::Ragged(RaggedError::DecodeShape { .. }))
    ));
}

/// Every example spec on paged caches of 1, 16, 64 and 256-row pages
/// (shuffled block tables) at q_len 1 and 4, ragged lengths (0, 1, then
/// random), split as the plan chooses and unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_on_pages() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for q_len in [1, 4] {
            for page_size in [1, 16, 64, 256] {
                for splits in [None, Some(1)] {
                    let max_kv_len = 700;
                    let mut lens = random_lens(&mut rng, 4, (q_len, max_kv_len));
                    lens[..2].copy_from_slice(&[0, 1]);
                    let shape = shape((8, 2), 4, q_len, max_kv_len);
                    cases.push(Case { spec: spec(variant), shape, lens, splits, page_size: Some(page_size) });
                }
            }
        }
    }
    run_all(&rt, cases);
}

/// Paged caches under GQA ratios 1, 4 and 8 and MQA, key counts 1, 17 and
/// 4097, split and unsplit, pages of 16 and 256 rows; head dims 64 (pages
/// of one row), 96 (of 16) and 256 (of 64).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn paged_head_groups_lengths_and_splits() {
    let rt = runtime();
    let mut cases = Vec::new();
    let window = "DecodeWindow { dtype: bf16, head_dim: 128, param window: i32, \
                  mask: q + kv_len - q_len >= k && q + kv_len - q_len - k < window }";
    for spec in [spec("causal_bottom_right"), flashgen::parse_one(window).unwrap()] {
        for heads in [(8, 8), (8, 2), (16, 2), (8, 1)] {
            for kv_len in [1usize, 17, 4097] {
                for (splits, page_size) in [(Some(1), 16), (Some(7), 256), (None, 16), (None, 256)] {
                    let lens = vec![kv_len, kv_len.div_ceil(2)];
                    let shape = shape(heads, 2, 2, kv_len);
                    cases.push(Case { spec: spec.clone(), shape, lens, splits, page_size: Some(page_size) });
                }
            }
        }
    }
    // d = 96: three CTAs' tiles an SM fill Hopper's shared memory to the byte.
    let dims = [
        (flashgen::codegen::Dtype::F16, 64, 1),
        (flashgen::codegen::Dtype::Bf16, 96, 16),
        (flashgen::codegen::Dtype::Bf16, 256, 64),
    ];
    for (dtype, d, page_size) in dims {
        for splits in [Some(1), None] {
            let spec = with(spec("causal_bottom_right"), dtype, d, d);
            let (shape, lens) = (shape((8, 2), 2, 3, 1000), vec![1000, 333]);
            cases.push(Case { spec, shape, lens, splits, page_size: Some(page_size) });
        }
    }
    run_all(&rt, cases);
}

/// Paged lengths and page ids are clamped on the device: a length past a
/// sequence's pages keeps its pages' keys (here, all of them), a negative
/// one none; arbitrary ids and lengths read inside the caches (a fault
/// would fail the download).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn paged_lengths_and_page_ids_are_clamped() {
    let rt = runtime();
    let spec = spec("full");
    for splits in [Some(1), Some(5)] {
        let shape = shape((8, 2), 3, 1, 300);
        let problem = random_decode_problem(&spec, shape, &[0, 300, 7], vec![], rand::random());
        let paged = problem.paged(&spec, 16, rand::random());
        let plan = rt.decode_plan(&spec, shape, &options(&problem, splits, true)).unwrap();
        let mut gpu = DeviceDecode::upload_paged(&rt, &spec, &problem, &paged).unwrap();
        gpu.set_kv_lens(&[-5, 100_000, 7]).unwrap();
        gpu.run(&rt, &plan, &problem).unwrap();
        let report = Expected::varlen(&spec, &problem.reference).unwrap().check(&gpu.download().unwrap());
        assert!(report.passed(), "splits {splits:?}: O {} LSE {}", report.output, report.lse);
        let table: Vec<i32> = paged.block_table.iter().map(|&p| p as i32).collect();
        let garbage: Vec<i32> =
            table.iter().enumerate().map(|(i, &p)| [p, -1, i32::MAX, i32::MIN, 5000][i % 5]).collect();
        gpu.set_block_table(&garbage).unwrap();
        for lens in [[-7, i32::MAX, 3], [i32::MIN, 3, 299], [300, 300, 300]] {
            gpu.set_kv_lens(&lens).unwrap();
            gpu.run(&rt, &plan, &problem).unwrap();
            gpu.download().unwrap_or_else(|e| panic!("splits {splits:?}, lens {lens:?}: {e}"));
        }
    }
}

/// A paged decode step captured into a CUDA graph, replayed with new
/// lengths, a new block table and the pages' new contents written to the
/// same device buffers: each replay matches the reference for its step.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_captured_paged_step_replays_with_new_tables() {
    replay_captured_steps(true);
}

/// Paged runs are checked before any launch: a plan runs only on its kind
/// of cache, and a page size of 0, a short block table or another longest
/// length are typed errors.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn paged_runs_outside_the_plan_are_refused() {
    let rt = runtime();
    let spec = spec("full");
    let problem = random_decode_problem(&spec, shape((8, 2), 2, 1, 64), &[64, 3], vec![], 1);
    let dense = rt.decode_plan(&spec, problem.shape, &options(&problem, None, false)).unwrap();
    let paged = rt.decode_plan(&spec, problem.shape, &options(&problem, None, true)).unwrap();
    let mut on_pages = DeviceDecode::upload_paged(&rt, &spec, &problem, &problem.paged(&spec, 16, 2)).unwrap();
    let err = on_pages.run(&rt, &dense, &problem).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeCache { plan: "dense", got: "paged" })), "{err}");
    let err = DeviceDecode::upload(&rt, &spec, &problem).unwrap().run(&rt, &paged, &problem).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeCache { plan: "paged", got: "dense" })), "{err}");

    let stream = rt.stream();
    let q_layout = Layout::bshd(2, 1, 8, 128);
    let q = stream.alloc_zeros::<bf16>(q_layout.len()).unwrap();
    let mut o = stream.alloc_zeros::<bf16>(q_layout.len()).unwrap();
    let cache = PagedLayout::contiguous(10, 16, 2, 128);
    let k = stream.alloc_zeros::<bf16>(cache.as_layout().len()).unwrap();
    let table = stream.clone_htod(&[0i32; 8]).unwrap();
    let lens = stream.clone_htod(&[64i32, 3]).unwrap();
    let mut run = |page_size: usize, pages_per_seq: usize, max_kv_len: usize| {
        let layout = PagedLayout { page_size, ..cache };
        let kv = PagedKv {
            k: (&k, layout),
            v: (&k, layout),
            block_table: &table,
            pages_per_seq,
            kv_lens: &lens,
            max_kv_len,
            batch: 2,
        };
        paged
            .run_paged(&rt, PagedDecodeIo { q: (&q, q_layout), o: (&mut o, q_layout), lse: None, kv }, &[])
            .unwrap_err()
    };
    let err = run(0, 4, 64);
    assert!(matches!(err, Error::Ragged(RaggedError::ZeroPageSize)), "{err}");
    let err = run(16, 3, 48);
    assert!(
        matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", len: 8, expected: 6 })),
        "{err}"
    );
    let err = run(16, 4, 65);
    assert!(matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: 65, capacity: 64 })), "{err}");
    let err = run(16, 4, 48);
    assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { plan: 64, got: 48, .. })), "{err}");
}
