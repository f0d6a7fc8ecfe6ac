//! GPU correctness of the varlen (packed) forward kernels, judged with
//! FlashAttention's rule against the f64 varlen reference (each sequence a
//! batch row of its own lengths; see `flashgen_tools::verify::varlen`).
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs and lengths (the seed is printed).

mod support;

use flashgen::codegen::cuda::{Mma, TileConfig};
use flashgen::codegen::reference::{ParamValue, VarlenProblem};
use flashgen::codegen::varlen::{decode_item, item_order, seq_span, tile_work, WORK_CLASSES};
use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::tile_choice;
use flashgen::runtime::RaggedError;
use flashgen::{ArgValue, Error, ForwardOptions, PackedLayout, Runtime, Sequences, VarlenIo};
use flashgen_tools::verify::varlen::{random_varlen_problem, DeviceVarlen, Packing};
use flashgen_tools::verify::{Expected, Report};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
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

/// The persistent kernels claim only items with rows, longest first, from
/// the item order a small kernel writes before them: many short sequences
/// beside one long one, empty ones, sequences without keys or queries, GQA
/// and MHA, causal (both alignments), windowed and full attention. Then a
/// launch whose order lists nothing (every device sequence empty) leaves
/// the work counter ready for the next launch, which must be right.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn persistent_item_order() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let d64 = |variant| with(spec(variant), Dtype::Bf16, 64, 64);
    let specs = [
        (spec("gqa"), heads_of("gqa")),
        (spec("causal"), (6, 2)),
        (spec("causal_bottom_right"), (4, 4)),
        (d64("full"), (6, 3)),
        (d64("sliding_window"), (4, 2)),
    ];
    let mut cases = Vec::new();
    for (spec, heads) in specs {
        for config in tile_choice::candidates(&spec, rt.target()).into_iter().filter(|c| c.persistent()) {
            let mut lens: Vec<(usize, usize)> =
                (0..60).map(|_| (rng.random_range(1..200), rng.random_range(1..250))).collect();
            lens.extend([(0, 0), (0, 33), (1, 1), (40, 0), (2900, 3100), (0, 0)]);
            lens.shuffle(&mut rng);
            cases.push(Case { config: Some(config), ..Case::new(spec.clone(), heads, lens) });
        }
    }
    if cases.is_empty() {
        eprintln!("no persistent configuration on {}: nothing claims from an order", rt.device_name());
        return;
    }
    let configs: Vec<TileConfig> = cases.iter().filter_map(|c| c.config).collect();
    run_all(&rt, cases);

    let spec = spec("causal");
    let lens = [(300, 300), (0, 0), (129, 140)];
    let problem = random_varlen_problem(&spec, (4, 2), &lens, vec![], rand::random());
    let expected = Expected::varlen(&spec, &problem).unwrap();
    let device = |cu: &[usize]| cu.iter().map(|&x| x as i32).collect::<Vec<i32>>();
    let (cu_q, cu_k) = (device(&problem.cu_seqlens_q), device(&problem.cu_seqlens_k));
    for config in configs {
        let mut gpu = DeviceVarlen::upload(&rt, &spec, &problem, Packing::Thd).unwrap();
        gpu.pin_config(Some(config));
        gpu.set_device_seqlens(&[0; 4], &[0; 4]).unwrap();
        gpu.launch(&rt, &spec, &problem).unwrap();
        gpu.download().unwrap_or_else(|e| panic!("{config:?} with nothing listed: {e}"));
        gpu.set_device_seqlens(&cu_q, &cu_k).unwrap();
        gpu.launch(&rt, &spec, &problem).unwrap();
        let report = expected.check(&gpu.download().unwrap());
        assert!(report.passed(), "{config:?} after an empty order: O {}  LSE {}", report.output, report.lse);
    }
}

/// The order kernel lists what its CPU twin lists, longest first by the
/// twin's estimate, a tile's heads together: thousands of short sequences
/// (empty ones among them) beside a long one, under causal masks of both
/// alignments, a window and none, at every persistent configuration's tiles.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn item_order_matches_its_cpu_twin() {
    let rt = runtime();
    let mut rng = StdRng::seed_from_u64(rand::random());
    let mut lens: Vec<(i32, i32)> = (0..3000).map(|_| (rng.random_range(0..120), rng.random_range(0..140))).collect();
    lens.push((6000, 6500));
    lens.shuffle(&mut rng);
    let prefix = |len: fn(&(i32, i32)) -> i32| -> Vec<i32> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |sum, l| {
                *sum += len(l);
                Some(*sum)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (prefix(|l| l.0), prefix(|l| l.1));
    let (batch, heads) = (lens.len(), [6, 2]);
    let totals = [cu_q[batch], cu_k[batch]];
    let (d_cu_q, d_cu_k) = (rt.stream().clone_htod(&cu_q).unwrap(), rt.stream().clone_htod(&cu_k).unwrap());
    let seqs = Sequences { batch, cu_seqlens_q: &d_cu_q, cu_seqlens_k: &d_cu_k, max_q_len: 6000, max_kv_len: 6500 };
    let mut checked = 0;
    for variant in ["causal", "causal_bottom_right", "sliding_window", "full"] {
        let spec = spec(variant);
        let params = params(&spec);
        let args: Vec<ArgValue> = params
            .iter()
            .map(|p| match *p {
                ParamValue::I32(v) => ArgValue::I32(v),
                ParamValue::F32(v) => ArgValue::F32(v),
            })
            .collect();
        for config in tile_choice::candidates(&spec, rt.target()).into_iter().filter(|c| c.persistent()) {
            let (block_m, block_n) = (config.block_m() as i32, config.block_n as i32);
            let tokens = totals.map(|t| t as usize);
            let host = rt.varlen_item_order_host(&spec, config, &seqs, (tokens, heads), &args).unwrap();
            let listed = &host[1..1 + host[0] as usize];
            let work = |seq, q_block, q_len, kv_len| {
                tile_work(&spec, &params, seq, (q_len, kv_len), q_block, (block_m, block_n))
            };
            let twin = item_order([&cu_q, &cu_k], heads[0], totals, [6000, 6500], block_m, work);
            let sorted = |items: &[i64]| {
                let mut items = items.to_vec();
                items.sort();
                items
            };
            let gpu: Vec<i64> = listed.iter().map(|&i| i as i64).collect();
            assert_eq!(sorted(&gpu), sorted(&twin), "{variant} {config:?}: the GPU lists other items");
            let q_tiles = (6000 + block_m - 1) / block_m;
            let tiles: Vec<_> = gpu.iter().map(|&i| decode_item(i, heads[0], q_tiles)).collect();
            let estimate = |t: &flashgen::codegen::varlen::WorkTile| {
                let len = |cu: &[i32]| cu[t.seq + 1] - cu[t.seq];
                work(t.seq, t.q_block, len(&cu_q), len(&cu_k)).min(WORK_CLASSES - 1)
            };
            let estimates: Vec<i32> = tiles.iter().map(estimate).collect();
            assert!(estimates.windows(2).all(|w| w[0] >= w[1]), "{variant} {config:?}: not longest first");
            for unit in tiles.chunks(heads[0]) {
                let same = unit
                    .iter()
                    .enumerate()
                    .all(|(h, t)| (t.seq, t.q_block, t.head) == (unit[0].seq, unit[0].q_block, h));
                assert!(same, "{variant} {config:?}: a tile's heads apart: {unit:?}");
            }
            checked += 1;
        }
    }
    if checked == 0 {
        eprintln!("no persistent configuration on {}: nothing claims from an order", rt.device_name());
    }
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
