//! GPU correctness of the varlen (packed) forward kernels, judged with
//! FlashAttention's rule against the f64 varlen reference (each sequence a
//! batch row of its own lengths; see `flashgen_tools::verify::varlen`).
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and lengths (the seed is printed).

mod support;

use flashgen::codegen::cuda::{Mma, TileConfig};
use flashgen::codegen::reference::VarlenProblem;
use flashgen::codegen::varlen::seq_span;
use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::tile_choice;
use flashgen::runtime::RaggedError;
use flashgen::{Error, ForwardOptions, PackedLayout, Runtime, Sequences, VarlenIo};
use flashgen_tools::verify::varlen::{random_varlen_problem, DeviceVarlen, Packing};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::forward::Table;
use support::packed::{edge_length_cases, every_variant, packed_columns, rejected_buffers, GARBAGE_PREFIX_SUMS};
use support::{heads_of, params, runtime, spec, with};

/// One varlen case: a spec, its heads, its sequences' (queries, keys) and
/// how the operands are packed; run in `config` (`None`: the runtime's).
struct Case {
    spec: Spec,
    heads: (usize, usize),
    lens: Vec<(usize, usize)>,
    packing: Packing,
    config: Option<TileConfig>,
}

impl Case {
    fn new(spec: Spec, heads: (usize, usize), lens: Vec<(usize, usize)>) -> Case {
        Case { spec, heads, lens, packing: Packing::Thd, config: None }
    }

    fn row(&self, seed: u64) -> String {
        let config = self.config.map_or("preferred".to_string(), flashgen::runtime::config_name);
        format!("{} {config} seed={seed}", packed_columns(&self.spec, self.heads, &self.lens, self.packing))
    }
}

/// Uploads `problem` (outputs NaN-poisoned), launches once and judges the
/// result.
fn run_once(rt: &Runtime, case: &Case, problem: &VarlenProblem, expected: &Expected) -> Result<Report, Error> {
    let mut gpu = DeviceVarlen::upload(rt, &case.spec, problem, case.packing)?;
    gpu.pin_config(case.config);
    gpu.launch(rt, &case.spec, problem)?;
    Ok(expected.check(&gpu.download()?))
}

/// Runs every case, prints a table and fails if any row failed.
fn run_all(rt: &Runtime, cases: Vec<Case>) {
    let mut table = Table::default();
    for case in cases {
        let seed: u64 = rand::random();
        let problem = random_varlen_problem(&case.spec, case.heads, &case.lens, params(&case.spec), seed);
        let expected = Expected::varlen(&case.spec, &problem);
        table.judge(case.row(seed), expected, |expected| run_once(rt, &case, &problem, expected));
    }
    table.finish();
}

/// Ragged lengths: an empty sequence, single tokens, queries without keys,
/// odd lengths, one sequence much longer than the rest, shuffled.
fn ragged(rng: &mut StdRng) -> Vec<(usize, usize)> {
    support::ragged(rng, &[(0, 13), (1, 1), (1, 40), (5, 0), (17, 17), (1100, 1100)], (5, 100), |q, rng| {
        rng.random_range(q / 2..q + 150)
    })
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_variant_on_ragged_sequences() {
    run_all(&runtime(), every_variant(ragged, Case::new));
}

/// Every tile configuration the runtime may pick on this GPU: mma.sync,
/// wgmma back to back, and the persistent warp-specialized kernels, whose
/// producer claims past the items of query tiles beyond their sequence's
/// end (many sequences and heads: more items than SMs).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_candidate_configuration() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    let d64 = |variant| with(spec(variant), Dtype::Bf16, 64, 64);
    let specs = [spec("causal"), spec("document"), spec("softcap"), spec("gqa"), d64("full"), d64("sliding_window")];
    for spec in specs {
        let heads = if spec.head_dims.qk == 192 { (8, 2) } else { (6, 2) };
        for config in tile_choice::candidates(&spec, rt.target()) {
            let mut lens = ragged(&mut rng);
            lens.extend((0..12).map(|_| (rng.random_range(0..700), rng.random_range(0..700))));
            cases.push(Case { config: Some(config), ..Case::new(spec.clone(), heads, lens) });
        }
    }
    assert!(cases.iter().any(|c| c.config.is_some_and(|c| c.mma == Mma::Sync)));
    run_all(&rt, cases);
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn strided_packed_operands_and_both_dtypes() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut cases = Vec::new();
    for variant in ["causal", "sliding_window", "alibi", "gqa"] {
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let spec = spec(variant);
            let (qk, v) = (spec.head_dims.qk, spec.head_dims.v);
            let case = Case::new(with(spec, dtype, qk, v), heads_of(variant), ragged(&mut rng));
            cases.push(Case { packing: Packing::Padded, ..case });
        }
    }
    // Head dims that are not a multiple of 8 copy element by element.
    cases.push(Case::new(with(spec("causal"), Dtype::Bf16, 59, 59), (3, 3), ragged(&mut rng)));
    run_all(&rt, cases);
}

/// One sequence alone, a single token, every sequence empty but one, and
/// rows with no key (O = 0, LSE = −∞ under a bottom-right mask).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn edge_lengths() {
    let rt = runtime();
    let mut cases = edge_length_cases(2047, Case::new);
    // Many sequences of one token beside one of 3000.
    let mut lens = vec![(1, 1); 200];
    lens.push((3000, 3000));
    cases.push(Case::new(spec("causal"), (2, 2), lens));
    run_all(&rt, cases);
}

/// Prefix sums on the device that disagree with the buffers are clamped
/// into them: sums past the end or below 0 read as the buffers' ends (here
/// giving the right answer), and arbitrary sums give some result without
/// any access outside the buffers (a fault would fail the download and
/// every later launch on the context).
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_device_prefix_sums_stay_in_bounds() {
    let rt = runtime();
    let spec = spec("causal");
    let lens = [(40, 50), (30, 60), (20, 20)];
    let problem = random_varlen_problem(&spec, (2, 1), &lens, vec![], rand::random());
    let expected = Expected::varlen(&spec, &problem).unwrap();
    // total_q = 90, total_kv = 130: the outer sums clamp to 0 and the ends,
    // as the kernels' CPU twin says.
    let (bad_q, bad_k) = ([-5, 40, 70, 1_000_000], [i32::MIN, 50, 110, i32::MAX]);
    for (bad, good, total, max) in [(bad_q, &problem.cu_seqlens_q, 90, 40), (bad_k, &problem.cu_seqlens_k, 130, 60)] {
        for b in 0..lens.len() {
            let span = seq_span(&bad, b, total, max);
            assert_eq!((span.start as usize, (span.start + span.len) as usize), (good[b], good[b + 1]));
        }
    }
    for config in tile_choice::candidates(&spec, rt.target()) {
        let mut gpu = DeviceVarlen::upload(&rt, &spec, &problem, Packing::Thd).unwrap();
        gpu.pin_config(Some(config));
        gpu.set_device_seqlens(&bad_q, &bad_k).unwrap();
        gpu.launch(&rt, &spec, &problem).unwrap();
        let report = expected.check(&gpu.download().unwrap());
        assert!(report.passed(), "{config:?}: O {}  LSE {}", report.output, report.lse);
        for garbage in GARBAGE_PREFIX_SUMS {
            gpu.set_device_seqlens(&garbage, &garbage.map(|x| x.wrapping_mul(3))).unwrap();
            gpu.launch(&rt, &spec, &problem).unwrap();
            gpu.download().unwrap_or_else(|e| panic!("{config:?} on {garbage:?}: {e}"));
        }
    }
}

/// Bad varlen launches are typed errors, never launches.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn bad_launches_are_rejected() {
    let rt = runtime();
    let spec = spec("causal");
    let stream = rt.stream();
    let (layout, q, mut o) = rejected_buffers(&rt);
    let (cu3, cu4) = (stream.clone_htod(&[0i32, 50, 100]).unwrap(), stream.clone_htod(&[0i32, 50, 60, 100]).unwrap());
    let shape = flashgen::Shape { batch: 2, heads: 2, heads_kv: 2, q_len: 50, kv_len: 50 };
    let block_mask = rt.block_mask(&spec, shape, &[]).unwrap();
    let mut launch = |batch, cu_k: bool, max_q_len, short_k: bool, opts: ForwardOptions| {
        let k = if short_k { PackedLayout::thd(101, 2, 128) } else { layout };
        let seqs = Sequences {
            batch,
            cu_seqlens_q: &cu3,
            cu_seqlens_k: if cu_k { &cu3 } else { &cu4 },
            max_q_len,
            max_kv_len: 50,
        };
        let io = VarlenIo { q: (&q, layout), k: (&q, k), v: (&q, layout), o: (&mut o, layout), lse: None, seqs };
        rt.forward_varlen(&spec, io, &[], &opts).unwrap_err()
    };
    let err = launch(2, false, 50, false, Default::default());
    assert!(
        matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_k", len: 4, expected: 3 })),
        "{err}"
    );
    let err = launch(3, true, 50, false, Default::default());
    assert!(
        matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_q", len: 3, expected: 4 })),
        "{err}"
    );
    let err = launch(2, true, 101, false, Default::default());
    assert!(
        matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: "max_q_len", max: 101, tokens: 100 })),
        "{err}"
    );
    let err = launch(2, true, 50, true, Default::default());
    assert!(matches!(err, Error::SizeMismatch { .. } | Error::OutOfBounds { .. }), "{err}");
    let err = launch(2, true, 50, false, ForwardOptions { block_mask: Some(&block_mask), ..Default::default() });
    assert!(matches!(err, Error::Ragged(RaggedError::VarlenBlockMask)), "{err}");
    let sync = TileConfig { mma: Mma::Sync, warps: 3, m_tiles: 1, block_n: 64 };
    let err = launch(2, true, 50, false, ForwardOptions { config: Some(sync), ..Default::default() });
    assert!(matches!(err, Error::NotACandidate { .. }), "{err}");
}
