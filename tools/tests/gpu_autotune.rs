//! Autotuning on the GPU: every candidate tile configuration of every example
//! spec is exact (tuning may pick any of them), and a tuned choice, the
//! forward's or the backward's dK/dV tile, is remembered on disk for the
//! next runtime.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU fails them.

mod support;

use flashgen::codegen::cuda::TileConfig;
use flashgen::codegen::Dtype;
use flashgen::runtime::tile_choice;
use flashgen::runtime::{config_name, DiskCache, TuneReport};
use flashgen::{Error, Runtime};
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::{self, DeviceProblem, Expected};
use std::fmt::Debug;
use std::path::Path;
use support::forward::{run_once, Case, Table};
use support::{params, runtime, spec, with};

/// Every example spec, and some at other head dims, whose candidate lists
/// differ (see `TileConfig::candidates`). Ragged lengths: neither is a
/// multiple of any candidate's tile (64 to 192 query rows, 32 to 192 keys);
/// data-dependent masks also run with a block mask, built at the spec's mask
/// tile whatever tile a candidate uses.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn every_candidate_config_is_exact() {
    let rt = runtime();
    let mut specs: Vec<_> = SPECS.iter().map(|(variant, _)| (*variant, spec(variant))).collect();
    specs.extend([
        ("full", with(spec("full"), Dtype::Bf16, 64, 64)),
        ("causal", with(spec("causal"), Dtype::F16, 64, 64)),
        ("sliding_window", with(spec("sliding_window"), Dtype::Bf16, 64, 64)),
        ("document", with(spec("document"), Dtype::Bf16, 64, 64)),
        ("softcap", with(spec("softcap"), Dtype::Bf16, 64, 64)),
        ("alibi", with(spec("alibi"), Dtype::Bf16, 64, 64)),
        ("document", with(spec("document"), Dtype::Bf16, 96, 96)),
        ("alibi", with(spec("alibi"), Dtype::F16, 256, 256)),
    ]);
    let mut table = Table::default();
    for (variant, spec) in specs {
        let heads = if variant == "gqa" { (8, 2) } else { (4, 4) };
        let block_masks: &[bool] =
            if spec.mask.as_ref().is_some_and(|m| m.reads_tensor()) { &[false, true] } else { &[false] };
        // Compiled in parallel up front; a failed load (not cached, so a
        // launch would compile it again) is each of its rows' failure.
        let configs = tile_choice::candidates(&spec, rt.target());
        let loads: Vec<Result<(), String>> =
            rt.load_forwards(&spec, &configs).into_iter().map(|l| l.map(drop).map_err(|e| e.to_string())).collect();
        for seqs in [(113, 203), (300, 555)] {
            let case = Case::new(heads, seqs);
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, case.shape(), params(&spec), vec![], None, seed);
            let expected = match Expected::new(&spec, &problem) {
                Ok(expected) => expected,
                Err(e) => {
                    table.record(case.row(&spec, seed), Err(e.to_string()));
                    continue;
                }
            };
            for (&config, load) in configs.iter().zip(&loads) {
                for &block_mask in block_masks {
                    let mask = if block_mask { " +block mask" } else { "" };
                    let row = format!("{} {}{mask}", case.row(&spec, seed), config_name(config));
                    let outcome = load.clone().and_then(|()| {
                        run_once(&rt, &spec, &problem, case.layout, Some(config), block_mask, &expected)
                            .map_err(|e| e.to_string())
                    });
                    table.record(row, outcome);
                }
            }
        }
    }
    table.finish();
}

/// `autotune` times every candidate and keeps the fastest; a second runtime
/// on the same cache finds the record and, even with tuning on launch,
/// launches the winner without tuning again; a class without a record is
/// tuned on launch.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_tuned_choice_is_remembered_on_disk() {
    let rt = runtime();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-autotune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = || Some(DiskCache::at(&dir));
    let rt = rt.with_disk_cache(cache()).with_autotune(false);
    let spec = spec("causal");
    let case = Case::new((4, 4), (1024, 1024));
    let shape = case.shape();
    let problem = verify::random_problem(&spec, shape, vec![], vec![], None, 1);
    let expected = Expected::new(&spec, &problem).unwrap();

    assert_eq!(rt.tuned_config(&spec, &shape), None);
    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, case.layout).unwrap();
    let report = gpu.autotune(&rt, &spec, &problem).unwrap();
    println!("{report}");
    fastest_of(&report, &tile_choice::candidates(&spec, rt.target()));
    assert_eq!(rt.tuned_config(&spec, &shape), Some(report.best));
    assert!(expected.check(&gpu.download().unwrap()).passed(), "tuning leaves a forward's result in O and LSE");
    assert_eq!(DiskCache::at(&dir).tunings().unwrap().len(), 1);

    let fresh = Runtime::new(0).unwrap().with_disk_cache(cache()).with_autotune(true);
    let mut gpu = DeviceProblem::upload(&fresh, &spec, &problem, case.layout).unwrap();
    gpu.launch(&fresh, &spec, &problem).unwrap();
    let stats = fresh.cache_stats();
    assert_eq!((stats.compiles, stats.disk_hits), (0, 1), "only the winner, from disk: {stats:?}");
    assert_eq!(fresh.tuned_config(&spec, &shape), Some(report.best));
    assert!(expected.check(&gpu.download().unwrap()).passed());

    let ragged = Case::new((4, 4), (113, 203));
    let problem = verify::random_problem(&spec, ragged.shape(), vec![], vec![], None, 2);
    let mut gpu = DeviceProblem::upload(&fresh, &spec, &problem, ragged.layout).unwrap();
    assert_eq!(fresh.tuned_config(&spec, &ragged.shape()), None, "another shape class");
    gpu.launch(&fresh, &spec, &problem).unwrap();
    assert!(fresh.tuned_config(&spec, &ragged.shape()).is_some(), "tuned on launch");
    assert_eq!(DiskCache::at(&dir).tunings().unwrap().len(), 2);
    let out = gpu.download().unwrap();
    assert!(Expected::new(&spec, &problem).unwrap().check(&out).passed());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `autotune_backward` times every dK/dV tile of the runtime's list and
/// keeps the fastest, which a backward launch without a tile of its own
/// then runs, exactly; a fresh runtime on the same cache finds the record
/// (apart from the forward's), and with tuning on launch an untuned class
/// tunes before its first backward.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn a_tuned_backward_tile_is_remembered() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-autotune-bwd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cache = || Some(DiskCache::at(&dir));
    let rt = runtime().with_disk_cache(cache()).with_autotune(false);
    // Documents at d = 64: 64- and 128-query steps on Hopper.
    let spec = with(spec("document"), Dtype::Bf16, 64, 64);
    let case = Case::new((4, 4), (1024, 1024));
    let shape = case.shape();
    let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, 5);
    let d_out = verify::random_d_out(&spec, shape, 6);
    let exact = |grads| verify::check_backward(&spec, &problem, &d_out, &grads).unwrap().passed();

    assert_eq!(rt.tuned_backward_tile(&spec, &shape), None);
    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, case.layout).unwrap();
    gpu.build_block_mask(&rt, &spec, &problem).unwrap();
    gpu.launch(&rt, &spec, &problem).unwrap();
    let report = gpu.autotune_backward(&rt, &spec, &problem).unwrap();
    println!("{report}");
    fastest_of(&report, &rt.backward_candidates(&spec));
    assert_eq!(rt.tuned_backward_tile(&spec, &shape), Some(report.best));
    assert_eq!(rt.tuned_config(&spec, &shape), None, "the forward is tuned apart");
    assert!(exact(gpu.backward(&rt, &spec, &problem, &d_out, false, true, None).unwrap()));
    assert_eq!(DiskCache::at(&dir).tunings().unwrap().len(), 1);

    let fresh = Runtime::new(0).unwrap().with_disk_cache(cache()).with_autotune(false);
    assert_eq!(fresh.tuned_backward_tile(&spec, &shape), Some(report.best), "read from disk");
    assert_eq!(fresh.tuned_config(&spec, &shape), None);

    let tuning = fresh.with_autotune(true);
    let ragged = Case::new((2, 2), (300, 555));
    let problem = verify::random_problem(&spec, ragged.shape(), params(&spec), vec![], None, 7);
    let d_out = verify::random_d_out(&spec, ragged.shape(), 8);
    let mut gpu = DeviceProblem::upload(&tuning, &spec, &problem, ragged.layout).unwrap();
    gpu.launch(&tuning, &spec, &problem).unwrap();
    assert_eq!(tuning.tuned_backward_tile(&spec, &ragged.shape()), None, "another shape class");
    let grads = gpu.backward(&tuning, &spec, &problem, &d_out, false, true, None).unwrap();
    assert!(tuning.tuned_backward_tile(&spec, &ragged.shape()).is_some(), "tuned on launch");
    assert!(verify::check_backward(&spec, &problem, &d_out, &grads).unwrap().passed());
    // The forward's and the backward's records of both classes.
    assert_eq!(DiskCache::at(&dir).tunings().unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `report` timed exactly `candidates`, in order, and names the fastest of
/// those that ran its best.
fn fastest_of<C: Copy + PartialEq + Debug>(report: &TuneReport<C>, candidates: &[C]) {
    assert_eq!(report.candidates.iter().map(|(c, _)| *c).collect::<Vec<_>>(), candidates);
    let fastest = report
        .candidates
        .iter()
        .filter_map(|(c, ms)| Some((*c, *ms.as_ref().ok()?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(c, _)| c);
    assert_eq!(Some(report.best), fastest);
}

/// A launch may pin a candidate, and nothing else: other tile shapes are
/// neither known to compile nor tested.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn only_candidates_can_be_pinned() {
    let rt = runtime();
    let spec = spec("document");
    let case = Case::new((2, 2), (256, 256));
    let problem = verify::random_problem(&spec, case.shape(), vec![], vec![], None, 3);
    let mut gpu = DeviceProblem::upload(&rt, &spec, &problem, case.layout).unwrap();
    let preferred = tile_choice::preferred(&spec, rt.target());
    gpu.pin_config(Some(TileConfig { block_n: preferred.block_n + 16, ..preferred }));
    let err = gpu.launch(&rt, &spec, &problem).unwrap_err();
    assert!(matches!(err, Error::NotACandidate { .. }), "{err}");
}
