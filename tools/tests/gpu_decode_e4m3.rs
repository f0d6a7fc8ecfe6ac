//! GPU correctness of decode steps over e4m3 K/V caches
//! (`DecodeOptions::kv_cache = KvCacheDtype::E4m3`, the `_e4m3` runs),
//! judged with FlashAttention's rule against the f64 varlen reference over
//! the dequantized caches: the reference reads `descale · e4m3` of the very
//! bytes the kernel reads (`flashgen_tools::verify::decode_e4m3`), so only
//! the kernel's own arithmetic is judged. Descales per tensor and per K/V
//! head (each head's values drawn at its own range), dense caches and
//! pages of 1, 16 and 256 rows, padded and packed queries.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and lengths (the seed is printed).

mod support;

use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::{
    DecodeIo, DecodeOptions, DecodeShape, Descale, Error, KvCacheDtype, KvDescale, Layout, RaggedError, Runtime,
};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::decode::{random_decode_problem, random_lens, DecodeProblem, DeviceDecode};
use flashgen_tools::verify::decode_e4m3::Granularity;
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::decode::{capture, replay_matches, run_cases, shape};
use support::{params, runtime, spec, with};

const GRANULARITIES: [Granularity; 2] = [Granularity::PerTensor, Granularity::PerKvHead];

/// One case: a spec, its bounds, the sequences' key counts (and token
/// counts: packed queries), the split count (`None`: the plan's), the page
/// size (`None`: a dense cache), the descales' granularity and the queries'
/// scale (times 2^`q_exponent`, the softmax scale undoing it).
struct Case {
    spec: Spec,
    shape: DecodeShape,
    lens: Vec<usize>,
    q_lens: Option<Vec<usize>>,
    splits: Option<usize>,
    page_size: Option<usize>,
    granularity: Granularity,
    q_exponent: i32,
}

impl Case {
    fn row(&self, splits: usize, seed: u64) -> String {
        let (spec, s) = (&self.spec, self.shape);
        format!(
            "{:<18} {:<4} d={:>3}/{:<3} h={:>2}/{:<2} b={} q={:<2} q_lens={:<12} kv<={:<5} page={:<5} {:<9?} q*2^{:<3} splits={splits:<3} seed={seed}",
            spec.name,
            spec.dtype.name(),
            spec.head_dims.qk,
            spec.head_dims.v,
            s.heads,
            s.heads_kv,
            s.batch,
            s.q_len,
            self.q_lens.as_ref().map_or("padded".into(), |q| format!("{q:?}")),
            self.lens.iter().max().unwrap_or(&0),
            self.page_size.map_or("dense".into(), |p| p.to_string()),
            self.granularity,
            self.q_exponent,
        )
    }
}

/// An e4m3 plan's options for `problem`.
fn options(problem: &DecodeProblem, case: &Case) -> DecodeOptions {
    DecodeOptions {
        scale: Some(problem.reference.problem.scale as f32),
        splits: case.splits,
        paged: case.page_size.is_some(),
        varlen: case.q_lens.is_some(),
        kv_cache: KvCacheDtype::E4m3,
        v_in_k: false,
    }
}

/// Quantizes, plans, uploads (outputs NaN-poisoned), runs once and judges.
fn run_once(rt: &Runtime, case: &Case, seed: u64) -> Result<(usize, Report), String> {
    let drawn = random_decode_problem(&case.spec, case.shape, &case.lens, params(&case.spec), seed);
    let (mut problem, scales) = drawn.with_queries_scaled(case.q_exponent).quantized(case.granularity);
    if let Some(q_lens) = &case.q_lens {
        problem = problem.with_q_lens(q_lens);
    }
    let expected = Expected::varlen(&case.spec, &problem.reference).map_err(|e| e.to_string())?;
    let plan = rt.decode_plan(&case.spec, case.shape, &options(&problem, case)).map_err(|e| e.to_string())?;
    let paged = case.page_size.map(|page| problem.paged(&case.spec, page, seed));
    let mut gpu =
        DeviceDecode::upload_e4m3(rt, &case.spec, &problem, &scales, paged.as_ref()).map_err(|e| e.to_string())?;
    gpu.run(rt, &plan, &problem).map_err(|e| e.to_string())?;
    let report = expected.check(&gpu.download().map_err(|e| e.to_string())?);
    match gpu.spare_rows_written().map_err(|e| e.to_string())? {
        0 => Ok((plan.splits(), report)),
        n => Err(format!("{n} elements past the step's tokens written")),
    }
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    run_cases(cases, |case, seed| run_once(rt, case, seed), Case::row);
}

/// Every example spec at q_len 1 and 4 under GQA (4 query heads a K/V
/// head), dense and on pages of 1, 16 and 256 rows, split as the plan
/// chooses and unsplit, descales per tensor and per K/V head; ragged
/// lengths (one empty sequence, one of a single key, the rest random).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_on_e4m3_caches() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        for q_len in [1, 4] {
            for page_size in [None, Some(1), Some(16), Some(256)] {
                for splits in [None, Some(1)] {
                    for granularity in GRANULARITIES {
                        let max_kv_len = 700;
                        let mut lens = random_lens(&mut rng, 4, (q_len, max_kv_len));
                        lens[..2].copy_from_slice(&[0, 1]);
                        let (spec, shape) = (spec(variant), shape((8, 2), 4, q_len, max_kv_len));
                        cases.push(Case {
                            spec,
                            shape,
                            lens,
                            q_lens: None,
                            splits,
                            page_size,
                            granularity,
                            q_exponent: 0,
                        });
                    }
                }
            }
        }
    }
    run_all(&rt, cases);
}

/// GQA ratios 1, 4 and 8 and MQA, key counts 1, 17 and 4097, split and
/// unsplit; f16 at d = 64, bf16 at d = 256 and at head dims no multiple of
/// 16 (element-wise copies), two 16-row tiles (q_len 8); one long sequence
/// split across the GPU.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn e4m3_head_groups_dims_and_lengths() {
    let rt = runtime();
    let mut cases = Vec::new();
    let mut push = |spec: &Spec, shape: DecodeShape, lens: Vec<usize>, splits, page_size, granularity| {
        let spec = spec.clone();
        cases.push(Case { spec, shape, lens, q_lens: None, splits, page_size, granularity, q_exponent: 0 });
    };
    let causal = spec("causal_bottom_right");
    for heads in [(8, 8), (8, 2), (16, 2), (8, 1)] {
        for kv_len in [1usize, 17, 4097] {
            for (splits, page) in [(Some(1), None), (Some(7), Some(16)), (None, None), (None, Some(256))] {
                let lens = vec![kv_len, kv_len.div_ceil(2)];
                push(&causal, shape(heads, 2, 2, kv_len), lens, splits, page, Granularity::PerKvHead);
            }
        }
    }
    for (dtype, d, dv) in [(Dtype::F16, 64, 64), (Dtype::Bf16, 256, 256), (Dtype::Bf16, 72, 40), (Dtype::F16, 128, 128)]
    {
        for (splits, page) in [(Some(1), None), (None, Some(16))] {
            for granularity in GRANULARITIES {
                let spec = with(spec("causal_bottom_right"), dtype, d, dv);
                push(&spec, shape((16, 2), 2, 8, 1000), vec![1000, 333], splits, page, granularity);
            }
        }
    }
    for page in [None, Some(16)] {
        push(&causal, shape((32, 8), 1, 1, 65536), vec![65536], None, page, Granularity::PerKvHead);
    }
    run_all(&rt, cases);
}

/// Packed queries (a token count per sequence, 0 to q_len) over dense and
/// paged e4m3 caches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn e4m3_packed_queries() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for variant in ["causal_bottom_right", "softcap", "sink_window", "alibi"] {
        for page_size in [None, Some(16)] {
            for (splits, granularity) in [(None, Granularity::PerKvHead), (Some(1), Granularity::PerTensor)] {
                let lens = random_lens(&mut rng, 4, (4, 900));
                let q_lens = Some(vec![0, 1, 4, rng.random_range(0..=4)]);
                let (spec, shape) = (spec(variant), shape((8, 2), 4, 4, 900));
                cases.push(Case { spec, shape, lens, q_lens, splits, page_size, granularity, q_exponent: 0 });
            }
        }
    }
    run_all(&rt, cases);
}

/// Queries past f16's largest value (times 2^20) and below its normals
/// (times 2^-20), the softmax scale undoing the factor: the kernels' f16
/// MMAs take Q scaled by a power of two of the CTA's own, so every score
/// stays. Every bf16 example spec at q_len 1 and 4, dense and paged.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn e4m3_queries_outside_f16s_range() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for (variant, _) in SPECS {
        let spec = spec(variant);
        if spec.dtype != Dtype::Bf16 {
            continue;
        }
        for (q_len, page_size) in [(1, None), (4, Some(16))] {
            for q_exponent in [20, -20] {
                let lens = random_lens(&mut rng, 2, (q_len, 2000));
                let (spec, shape) = (spec.clone(), shape((8, 2), 2, q_len, 2000));
                let granularity = Granularity::PerKvHead;
                cases.push(Case { spec, shape, lens, q_lens: None, splits: None, page_size, granularity, q_exponent });
            }
        }
    }
    run_all(&rt, cases);
}

/// A captured e4m3 step replays with new descales written to the same
/// device buffers: K's doubled and V's halved (per K/V head), the
/// reference's caches likewise.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_captured_e4m3_step_replays_with_new_descales() {
    let rt = runtime();
    unsafe { rt.context().disable_event_tracking() };
    let spec = spec("causal_bottom_right");
    for (splits, page) in [(Some(1), None), (None, Some(16))] {
        let case = Case {
            spec: spec.clone(),
            shape: shape((8, 2), 2, 1, 3000),
            lens: vec![3000, 1234],
            q_lens: None,
            splits,
            page_size: page,
            granularity: Granularity::PerKvHead,
            q_exponent: 0,
        };
        let seed = rand::random();
        let drawn = random_decode_problem(&spec, case.shape, &case.lens, vec![], seed);
        let (problem, scales) = drawn.quantized(case.granularity);
        let plan = rt.decode_plan(&spec, case.shape, &options(&problem, &case)).unwrap();
        let paged = page.map(|p| problem.paged(&spec, p, seed));
        let mut gpu = DeviceDecode::upload_e4m3(&rt, &spec, &problem, &scales, paged.as_ref()).unwrap();
        let graph = capture(&rt, || gpu.run(&rt, &plan, &problem).unwrap());
        for (round, (k_factor, v_factor)) in [(1.0, 1.0), (2.0, 0.5), (0.25, 4.0)].into_iter().enumerate() {
            let k: Vec<f32> = scales.k.iter().map(|d| d * k_factor).collect();
            let v: Vec<f32> = scales.v.iter().map(|d| d * v_factor).collect();
            gpu.set_descales(&k, &v).unwrap();
            let mut step = problem.clone();
            step.k_cache.iter_mut().for_each(|x| *x *= f64::from(k_factor));
            step.v_cache.iter_mut().for_each(|x| *x *= f64::from(v_factor));
            let step = step.with_lens(&case.lens);
            replay_matches(&graph, &spec, &step, &gpu, &format!("{splits:?} {page:?} round {round}"));
        }
    }
}

/// E4m3 runs are checked before any launch: a plan runs only on its cache
/// format, and descales of the wrong length are typed errors.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn e4m3_runs_outside_the_plan_are_refused() {
    let rt = runtime();
    let spec = spec("full");
    let s = shape((8, 2), 2, 1, 64);
    let e4m3 = rt.decode_plan(&spec, s, &DecodeOptions { kv_cache: KvCacheDtype::E4m3, ..Default::default() }).unwrap();
    let plain = rt.decode_plan(&spec, s, &DecodeOptions::default()).unwrap();
    let problem = random_decode_problem(&spec, s, &[64, 3], vec![], 1);
    let err = DeviceDecode::upload(&rt, &spec, &problem).unwrap().run(&rt, &e4m3, &problem).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeKvDtype { plan: "e4m3", .. })), "{err}");
    let (quantized, scales) = problem.quantized(Granularity::PerTensor);
    let mut gpu = DeviceDecode::upload_e4m3(&rt, &spec, &quantized, &scales, None).unwrap();
    let err = gpu.run(&rt, &plain, &quantized).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeKvDtype { got: "e4m3", .. })), "{err}");

    let stream = rt.stream();
    let (q_layout, kv_layout) = (Layout::bshd(2, 1, 8, 128), Layout::bshd(2, 64, 2, 128));
    let q = stream.alloc_zeros::<flashgen::half::bf16>(q_layout.len()).unwrap();
    let mut o = stream.alloc_zeros::<flashgen::half::bf16>(q_layout.len()).unwrap();
    let cache = stream.alloc_zeros::<u8>(kv_layout.len()).unwrap();
    let lens = stream.clone_htod(&[64i32, 3]).unwrap();
    let (one, two, three) = (
        stream.clone_htod(&[1f32]).unwrap(),
        stream.clone_htod(&[1f32; 2]).unwrap(),
        stream.clone_htod(&[1f32; 3]).unwrap(),
    );
    let mut run = |k: Descale<'_>, v: Descale<'_>| {
        let io = DecodeIo {
            q: (&q, q_layout),
            k: (&cache, kv_layout),
            v: (&cache, kv_layout),
            o: (&mut o, q_layout),
            lse: None,
            kv_lens: &lens,
        };
        e4m3.run_e4m3(&rt, io, KvDescale { k, v }, &[])
    };
    run(Descale::PerTensor(&one), Descale::PerKvHead(&two)).unwrap();
    let err = run(Descale::PerTensor(&two), Descale::PerKvHead(&two)).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DescaleLen { operand: "K", len: 2, expected: 1, .. })), "{err}");
    let err = run(Descale::PerTensor(&one), Descale::PerKvHead(&three)).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::DescaleLen { operand: "V", len: 3, expected: 2, .. })), "{err}");
    stream.synchronize().unwrap();
}
