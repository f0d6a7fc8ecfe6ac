//! GPU correctness of the Hopper forward above d = 128 (160, 192, 256 and
//! DeepSeek's QK 192 / V 128): every wgmma candidate of each head dim
//! (warp-specialized with one or two Q buffers, and the back-to-back
//! 64-key kernel), judged against the f64 reference. Plain, causal, ALiBi
//! (a captured tensor of slopes), softcap, a sliding window and a document
//! mask (a captured tensor, with its block mask); then more work items than
//! SMs, so that each persistent CTA walks several items through its Q
//! buffers, copying with TMA and with cp.async.
//!
//! Ignored by a plain `cargo test`: run with `--include-ignored` on an
//! sm_90 GPU (elsewhere the Hopper kernels are not candidates and the
//! tests fail).

mod support;

use flashgen::codegen::cuda::{Mma, TileConfig};
use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::{config_name, tile_choice};
use flashgen::Runtime;
use flashgen_tools::verify::{self, Expected};
use support::forward::{run_once, Case, Table};
use support::{params, runtime, spec, with};

const HEAD_DIMS: [(u32, u32); 4] = [(160, 160), (192, 192), (256, 256), (192, 128)];

/// Runs each spec's `case` in every wgmma candidate of `rt`'s GPU, one
/// reference per spec; fails if any row failed or a spec has no
/// warp-specialized candidate.
fn run_wgmma_candidates(rt: &Runtime, specs: &[Spec], case: &Case) {
    compile_ahead(rt, specs);
    let mut table = Table::default();
    for spec in specs {
        let configs = wgmma_candidates(rt, spec);
        assert!(configs.iter().any(|c| c.persistent()), "{}: no warp-specialized candidate", spec.name);
        let seed: u64 = rand::random();
        let problem = verify::random_problem(spec, case.shape(), params(spec), vec![], None, seed);
        let expected = Expected::new(spec, &problem).unwrap();
        let block_mask = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
        for config in configs {
            let row = format!("{} {}", case.row(spec, seed), config_name(config));
            let outcome = run_once(rt, spec, &problem, case.layout, Some(config), block_mask, &expected);
            table.record(row, outcome.map_err(|e| e.to_string()));
        }
    }
    table.finish();
}

fn wgmma_candidates(rt: &Runtime, spec: &Spec) -> Vec<TileConfig> {
    tile_choice::candidates(spec, rt.target()).into_iter().filter(|c| c.mma == Mma::Wgmma).collect()
}

/// Compiles every spec's candidates (those that copy with TMA) at once:
/// NVRTC takes a second or more per kernel, minutes one after another.
/// Errors show again at the launch.
fn compile_ahead(rt: &Runtime, specs: &[Spec]) {
    std::thread::scope(|scope| {
        for spec in specs {
            scope.spawn(move || rt.load_forwards(spec, &wgmma_candidates(rt, spec)));
        }
    });
}

/// `variants` at every wide head dim, bf16.
fn wide(variants: &[&str]) -> Vec<Spec> {
    let at = |v: &&str, (qk, dv)| with(spec(v), Dtype::Bf16, qk, dv);
    HEAD_DIMS.iter().flat_map(|&dims| variants.iter().map(move |v| at(v, dims))).collect()
}

#[test]
#[ignore = "needs an sm_90 GPU (run with --include-ignored)"]
fn every_wide_head_candidate_at_awkward_seqlens() {
    let rt = runtime();
    let specs = wide(&["full", "causal", "alibi", "softcap", "sliding_window", "document"]);
    run_wgmma_candidates(&rt, &specs, &Case::new((4, 2), (113, 203)));
}

/// 9 query tiles x 16 heads: more items than an H100 has SMs, so CTAs
/// claim further items and reload their Q buffers (with one buffer, after
/// the previous item's O left it).
#[test]
#[ignore = "needs an sm_90 GPU (run with --include-ignored)"]
fn wide_head_persistent_ctas_walk_many_items() {
    let rt = runtime();
    let specs = wide(&["causal", "sliding_window"]);
    let case = Case { batch: 1, ..Case::new((16, 4), (1100, 300)) };
    run_wgmma_candidates(&rt, &specs, &case);
    run_wgmma_candidates(&rt.with_tma(false), &specs, &case);
}
