//! GPU correctness of MLA's absorbed decode (QK head dim 576, V 512, one
//! K/V head shared by 16 or 128 query heads: DeepSeek-V2/V3), judged with
//! FlashAttention's rule against the f64 varlen reference as
//! `gpu_decode.rs` judges the other head dims. The cache is MLA's: V is K's
//! first 512 columns, passed as a view of K (same buffer, start and
//! strides) to a plan made with `DecodeOptions::v_in_k`, which reads V from
//! K's tiles; one case passes a V of its own to a plain plan.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `cargo test --release -p flashgen-tools --test gpu_decode_mla -- --include-ignored`,
//! where a missing GPU or any runtime error fails them. Every case draws
//! fresh random inputs (the seed is printed).

mod support;

use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::{DecodeOptions, DecodeShape, Error, RaggedError, Runtime};
use flashgen_tools::verify::decode::{random_decode_problem, DecodeProblem, DeviceDecode};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::decode::{capture, replay_matches, run_cases, shape};
use support::runtime;

/// MLA's decode under a bottom-right causal mask (speculative and
/// multi-token steps), bf16.
const MLA_CAUSAL: &str = "MlaCausal { dtype: bf16, head_dim: 576, v_head_dim: 512, mask: q + kv_len - q_len >= k }";
/// MLA's decode without a mask, f16.
const MLA_FULL: &str = "MlaFull { dtype: f16, head_dim: 576, v_head_dim: 512 }";

/// A spec of its source.
fn mla(source: &str) -> Spec {
    flashgen::parse_one(source).unwrap()
}

/// One MLA decode case: its bounds (one K/V head), the sequences' key
/// counts, packed queries' token counts (`None`: padded), the split count
/// (`None`: the plan's), the page size (`None`: a dense cache) and whether
/// V is a view of K (else a tensor of its own).
struct Case {
    spec: Spec,
    shape: DecodeShape,
    lens: Vec<usize>,
    q_lens: Option<Vec<usize>>,
    splits: Option<usize>,
    page_size: Option<usize>,
    v_in_k: bool,
}

impl Case {
    fn new(spec: &Spec, heads: usize, q_len: usize, lens: Vec<usize>) -> Case {
        let max_kv_len = lens.iter().copied().max().unwrap_or(1).max(1);
        let shape = shape((heads, 1), lens.len(), q_len, max_kv_len);
        Case { spec: spec.clone(), shape, lens, q_lens: None, splits: None, page_size: None, v_in_k: true }
    }

    fn row(&self, splits: usize, seed: u64) -> String {
        let s = self.shape;
        format!(
            "{:<10} {:<4} h={:>3}/1 b={} q={:<2} kv={:<12} page={:<5} splits={splits:<3} v={:<4} {} seed={seed}",
            self.spec.name,
            self.spec.dtype.name(),
            s.heads,
            s.batch,
            s.q_len,
            format!("{:?}", self.lens),
            self.page_size.map_or("dense".into(), |p| p.to_string()),
            if self.v_in_k { "in-K" } else { "own" },
            self.q_lens.as_ref().map_or(String::new(), |q| format!("q_lens={q:?}")),
        )
    }

    /// The step on the GPU: the plan, the upload (V a view of K or not,
    /// dense or on pages of a block table shuffled by `seed`), one run on
    /// NaN-poisoned outputs, judged against the reference.
    fn run(&self, rt: &Runtime, seed: u64) -> Result<(usize, Report), String> {
        let mut problem = random_decode_problem(&self.spec, self.shape, &self.lens, vec![], seed);
        if self.v_in_k {
            problem = problem.v_in_k(&self.spec);
        }
        if let Some(q_lens) = &self.q_lens {
            problem = problem.with_q_lens(q_lens);
        }
        let expected = Expected::varlen(&self.spec, &problem.reference).map_err(|e| e.to_string())?;
        let opts = DecodeOptions {
            scale: Some(problem.reference.problem.scale as f32),
            splits: self.splits,
            paged: self.page_size.is_some(),
            varlen: self.q_lens.is_some(),
            v_in_k: self.v_in_k,
            ..Default::default()
        };
        let plan = rt.decode_plan(&self.spec, self.shape, &opts).map_err(|e| e.to_string())?;
        let mut gpu = upload(rt, self, &problem, seed).map_err(|e| e.to_string())?;
        gpu.run(rt, &plan, &problem).map_err(|e| e.to_string())?;
        if gpu.spare_rows_written().map_err(|e| e.to_string())? != 0 {
            return Err("a packed step wrote rows of no sequence".into());
        }
        Ok((plan.splits(), expected.check(&gpu.download().map_err(|e| e.to_string())?)))
    }
}

/// `problem` on the GPU as `case` says.
fn upload(rt: &Runtime, case: &Case, problem: &DecodeProblem, seed: u64) -> Result<DeviceDecode, Error> {
    let paged = case.page_size.map(|page| problem.paged(&case.spec, page, seed));
    match (case.v_in_k, &paged) {
        (true, paged) => DeviceDecode::upload_v_in_k(rt, &case.spec, problem, paged.as_ref()),
        (false, Some(paged)) => DeviceDecode::upload_paged(rt, &case.spec, problem, paged),
        (false, None) => DeviceDecode::upload(rt, &case.spec, problem),
    }
}

fn run_all(cases: Vec<Case>) {
    let rt = runtime();
    run_cases(cases, |case, seed| case.run(&rt, seed), Case::row);
}

/// q_len 1 and 4; 16 and 128 query heads; key counts 1, 17 and 4097 (the
/// last a tile's first key; the second sequence half as long); dense caches
/// and pages of 16 and 64 rows; unsplit, split 7 ways and as the plan
/// chooses; V a view of K.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_heads_lengths_pages_and_splits() {
    let spec = mla(MLA_CAUSAL);
    let mut cases = Vec::new();
    for q_len in [1, 4] {
        for heads in [16, 128] {
            for kv_len in [1usize, 17, 4097] {
                for page_size in [None, Some(16), Some(64)] {
                    for splits in [Some(1), Some(7), None] {
                        let case = Case::new(&spec, heads, q_len, vec![kv_len, kv_len.div_ceil(2)]);
                        cases.push(Case { splits, page_size, ..case });
                    }
                }
            }
        }
    }
    run_all(cases);
}

/// Without a mask, f16; one long sequence split across the GPU (65536
/// keys), dense and paged; empty and one-key sequences beside a long one.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_unmasked_long_and_ragged() {
    let spec = mla(MLA_FULL);
    let mut cases = Vec::new();
    for page_size in [None, Some(64)] {
        cases.push(Case { page_size, ..Case::new(&spec, 16, 1, vec![65536]) });
        for splits in [Some(1), None] {
            cases.push(Case { splits, page_size, ..Case::new(&spec, 128, 2, vec![0, 1, 3000, 17]) });
        }
    }
    run_all(cases);
}

/// Packed queries (a token count per sequence, 0 to 4), dense and on pages
/// of 16 rows, split and unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_packed_queries() {
    let spec = mla(MLA_CAUSAL);
    let mut cases = Vec::new();
    for page_size in [None, Some(16)] {
        for splits in [Some(1), Some(5), None] {
            for heads in [16, 128] {
                let case = Case::new(&spec, heads, 4, vec![4097, 17, 1, 900]);
                cases.push(Case { q_lens: Some(vec![4, 0, 1, 3]), splits, page_size, ..case });
            }
        }
    }
    run_all(cases);
}

/// V in a tensor of its own (not a view of K) with a plain plan: the
/// column-split kernel copies V's tiles itself; dense and paged, split and
/// unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_with_v_of_its_own() {
    let spec = mla(MLA_CAUSAL);
    let mut cases = Vec::new();
    for page_size in [None, Some(16)] {
        for splits in [Some(1), None] {
            for (heads, q_len) in [(16, 1), (128, 4)] {
                let case = Case::new(&spec, heads, q_len, vec![4097, 2049]);
                cases.push(Case { splits, page_size, v_in_k: false, ..case });
            }
        }
    }
    run_all(cases);
}

/// V read from K's tiles below a V head dim of 256, where the warps split
/// the keys: V = K at d = 128, and V K's first 128 of 192 columns; dense
/// and paged, split and unsplit.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn v_in_k_with_the_key_split() {
    let specs = [
        "VisK { dtype: bf16, head_dim: 128, mask: q + kv_len - q_len >= k }",
        "VinK { dtype: f16, head_dim: 192, v_head_dim: 128 }",
    ];
    let mut cases = Vec::new();
    for spec in specs.map(mla) {
        for page_size in [None, Some(16)] {
            for splits in [Some(1), None] {
                let case = Case::new(&spec, 16, 2, vec![4097, 17]);
                cases.push(Case { splits, page_size, ..case });
            }
        }
    }
    run_all(cases);
}

/// One MLA step captured into a CUDA graph and replayed with new lengths
/// (and, paged, new pages) written to the same buffers.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_captured_step_replays() {
    let rt = runtime();
    // One stream: no cross-stream events, which a capture may not wait on.
    unsafe { rt.context().disable_event_tracking() };
    let spec = mla(MLA_CAUSAL);
    for paged in [false, true] {
        let shape = shape((64, 1), 2, 2, 3000);
        let mut rng = StdRng::seed_from_u64(rand::random());
        let lens = |rng: &mut StdRng| vec![rng.random_range(2..=3000), rng.random_range(2..=3000)];
        let first = lens(&mut rng);
        let problem = random_decode_problem(&spec, shape, &first, vec![], rng.random()).v_in_k(&spec);
        let opts = DecodeOptions {
            paged,
            v_in_k: true,
            scale: Some(problem.reference.problem.scale as f32),
            ..Default::default()
        };
        let plan = rt.decode_plan(&spec, shape, &opts).unwrap();
        let pages = paged.then(|| problem.paged(&spec, 16, rng.random()));
        let mut gpu = DeviceDecode::upload_v_in_k(&rt, &spec, &problem, pages.as_ref()).unwrap();
        let graph = capture(&rt, || gpu.run(&rt, &plan, &problem).unwrap());
        for round in 0..3 {
            let lens = if round == 0 { first.clone() } else { lens(&mut rng) };
            let step = problem.clone().with_lens(&lens);
            match paged {
                true => gpu.set_pages(&step.paged(&spec, 16, rng.random())).unwrap(),
                false => gpu.set_kv_lens(&lens.iter().map(|&n| n as i32).collect::<Vec<_>>()).unwrap(),
            }
            replay_matches(&graph, &spec, &step, &gpu, &format!("paged {paged}, round {round}, lens {lens:?}"));
        }
    }
}

/// Typed refusals: a V that is not a view of K in a `v_in_k` plan, an
/// e4m3 cache at V head dim 512, and any kernel but the decode's for a
/// spec of MLA's head dims.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn mla_refusals_are_typed() {
    let rt = runtime();
    let spec = mla(MLA_CAUSAL);
    let shape = shape((16, 1), 2, 1, 100);
    let problem = random_decode_problem(&spec, shape, &[100, 7], vec![], 3).v_in_k(&spec);
    let plan = rt.decode_plan(&spec, shape, &DecodeOptions { v_in_k: true, ..Default::default() }).unwrap();
    let mut own_v = DeviceDecode::upload(&rt, &spec, &problem).unwrap();
    let err = own_v.run(&rt, &plan, &problem).unwrap_err();
    assert!(matches!(err, Error::Ragged(RaggedError::VNotInK { .. })), "{err}");
    let e4m3 = DecodeOptions { kv_cache: flashgen::runtime::KvCacheDtype::E4m3, ..Default::default() };
    let err = rt.decode_plan(&spec, shape, &e4m3).err().unwrap();
    assert!(matches!(err, Error::Ragged(RaggedError::DecodeShape { .. })), "{err}");
    let err = rt.load(&spec).err().unwrap();
    assert!(matches!(err, Error::WideHeadDims { qk: 576, v: 512, max: 256, .. }), "{err}");
    let f16 = flashgen::parse_one(MLA_FULL).unwrap();
    assert_eq!(f16.dtype, Dtype::F16);
    let plan = rt.decode_plan(&f16, shape, &DecodeOptions { v_in_k: true, ..Default::default() }).unwrap();
    assert_eq!(plan.config().warps, flashgen::codegen::cuda::WarpSplit::Columns);
}
