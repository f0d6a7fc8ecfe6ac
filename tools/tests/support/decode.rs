//! What the decode test files share: their bounds, the loop that runs and
//! tabulates their cases, and captured steps' replays.

use super::forward::Table;
use flashgen::codegen::Spec;
use flashgen::cudarc::driver::CudaGraph;
use flashgen::runtime::{DecodeShape, Runtime};
use flashgen_tools::verify::decode::{DecodeProblem, DeviceDecode};
use flashgen_tools::verify::{Expected, Report};

/// Decode bounds of `heads` (query, K/V) heads.
pub fn shape(heads: (usize, usize), batch: usize, q_len: usize, max_kv_len: usize) -> DecodeShape {
    DecodeShape { batch, heads: heads.0, heads_kv: heads.1, q_len, max_kv_len }
}

/// Runs every case with a fresh seed (`once`: its split count and verdict),
/// prints a table of their rows (`row`: the case, its split count and
/// seed) and fails if any row failed.
pub fn run_cases<C>(
    cases: Vec<C>,
    once: impl Fn(&C, u64) -> Result<(usize, Report), String>,
    row: impl Fn(&C, usize, u64) -> String,
) {
    let mut table = Table::default();
    for case in cases {
        let seed: u64 = rand::random();
        let outcome = once(&case, seed);
        let splits = outcome.as_ref().map_or(0, |(s, _)| *s);
        table.record(row(&case, splits, seed), outcome.map(|(_, report)| report));
    }
    table.finish();
}

/// One decode step (`step` queues it) captured on `rt`'s stream into a
/// CUDA graph.
pub fn capture(rt: &Runtime, step: impl FnOnce()) -> CudaGraph {
    flashgen_tools::decode_bench::capture(rt.stream(), || {
        step();
        Ok(())
    })
    .unwrap()
}

/// Replays `graph` and asserts that `gpu`'s result matches `step`'s
/// reference (`what`: the round, in the message).
pub fn replay_matches(graph: &CudaGraph, spec: &Spec, step: &DecodeProblem, gpu: &DeviceDecode, what: &str) {
    graph.launch().unwrap();
    let report = Expected::varlen(spec, &step.reference).unwrap().check(&gpu.download().unwrap());
    assert!(report.passed(), "{what}: O {} LSE {}", report.output, report.lse);
}
