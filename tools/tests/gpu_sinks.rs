//! GPU correctness of learned sinks (`sink:`), judged with FlashAttention's
//! rule against the f64 reference, whose rows take the sink as one more
//! logit of their softmax denominator with no value row: the forward in
//! every configuration the GPU may pick, with and without a block mask,
//! rows with no kept key (O = 0, LSE = the sink); the backward with the
//! sink tensor's gradient; decode steps split across the keys (the sink
//! counts once) and unsplit.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`, where a missing GPU or any runtime error fails them.
//! Every case draws fresh random inputs (the seed is printed).

mod support;

use flashgen::codegen::{Dtype, Spec};
use flashgen::runtime::{DecodeOptions, DecodeShape};
use flashgen_tools::verify::decode::{random_decode_problem, DeviceDecode};
use flashgen_tools::verify::{self, Expected, OperandLayout};
use support::backward::{forward_then_backward, GpuRuns};
use support::forward::{in_every_configuration, run_all, Case, Table};
use support::{params, runtime, spec, with};

/// Sinks from −4 to 8 (the tensor's values are uniform in [0, 1)), against
/// scores of about ±3: rows the sink dominates and rows it barely touches.
/// `k + 16 < q` keeps no key for queries 0 to 16.
const MASKED: &str = "SinkMasked { dtype: bf16, head_dim: 128, tensor sinks: f32[H], \
                      mask: k + 16 < q, sink: sinks[h] * 12.0 - 4.0 }";
/// A key-linear bias whose row part the d = 64 forward leaves out of its
/// logits and adds back to the LSE: the sink joins them in that frame.
const ALIBI: &str = "SinkAlibi { dtype: f16, head_dim: 64, tensor slopes: f32[H], tensor sinks: f32[H], \
                     mask: q >= k, score: score + slopes[h] * (k - q) as f32, sink: 2.0 * tanh(sinks[h]) + 1.0 }";
/// Documents (a block mask skips whole rows' tiles) of which each query sees
/// the keys at least eight before it.
const DOCUMENT: &str = "SinkDocument { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], \
                        tensor sinks: f32[H], mask: doc[b][q] == doc[b][k] && k + 8 < q, sink: sinks[h] }";
/// Decode rows whose sequence has at most 300 keys keep none: the rows of
/// the sink alone, next to rows with keys (whose LSEs set a tolerance a
/// same-dtype sink alone would leave at the slack).
const DECODE_MASKED: &str = "SinkDecode { dtype: bf16, head_dim: 128, tensor sinks: f32[H], \
                             mask: k + 300 < q + kv_len - q_len, sink: sinks[h] * 12.0 - 4.0 }";
/// A tensor both the score and the sink read: its gradient has both parts.
const SHARED: &str = "SinkShared { dtype: bf16, head_dim: 128, tensor w: f32[H], mask: q >= k, \
                      score: score * (w[h] + 0.5), sink: w[h] * 4.0 - 1.0 }";

fn parse(source: &str) -> Spec {
    flashgen::parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("sinks", source)))
}

/// The sink specs: the shipped gpt-oss style one and the ones above.
fn sink_specs() -> Vec<Spec> {
    let mut specs = vec![spec("sink_window")];
    specs.extend([MASKED, ALIBI, DOCUMENT, SHARED].map(parse));
    specs.push(with(parse(MASKED), Dtype::F16, 64, 64));
    specs
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn forward_in_every_configuration() {
    in_every_configuration(&runtime(), sink_specs());
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn backward_trains_the_sink() {
    let rt = runtime();
    let mut runs = GpuRuns::new();
    for spec in sink_specs() {
        for (heads, seqs, deterministic) in [((3, 3), (113, 203), false), ((4, 2), (1024, 1023), true)] {
            let shape = Case::new(heads, seqs).shape();
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
            let d_out = verify::random_d_out(&spec, shape, seed);
            let row = format!("{:<14} {shape:?} deterministic {deterministic} seed {seed}", spec.name);
            let gpu = forward_then_backward(&rt, &spec, &problem, &d_out, deterministic, None);
            runs.record(row, gpu, |grads| (spec.clone(), problem, d_out, grads));
        }
    }
    runs.judge(|(spec, problem, d_out, grads)| {
        let report = verify::check_backward(spec, problem, d_out, grads).map_err(|e| e.to_string())?;
        match report.d_tensors.iter().any(|(t, _)| t == "sinks" || t == "w") {
            true => Ok(report),
            false => Err("no sink tensor gradient was judged".into()),
        }
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn decode_counts_the_sink_once_across_splits() {
    let rt = runtime();
    let mut table = Table::default();
    for spec in [spec("sink_window"), parse(ALIBI), parse(DECODE_MASKED)] {
        for q_len in [1, 4] {
            for splits in [Some(1), Some(7), None] {
                // An empty sequence and a single key: rows of the sink alone
                // (all rows of the sequences up to 300 keys in `SinkDecode`).
                let lens = [0, 1, 700, 4097];
                let shape = DecodeShape { batch: 4, heads: 8, heads_kv: 2, q_len, max_kv_len: 4097 };
                let seed: u64 = rand::random();
                let problem = random_decode_problem(&spec, shape, &lens, params(&spec), seed);
                let row = format!("{:<14} q={q_len} splits {splits:?} seed {seed}", spec.name);
                let outcome = (|| -> Result<_, String> {
                    let expected = Expected::varlen(&spec, &problem.reference).map_err(|e| e.to_string())?;
                    let scale = Some(problem.reference.problem.scale as f32);
                    let opts = DecodeOptions { scale, splits, ..Default::default() };
                    let plan = rt.decode_plan(&spec, shape, &opts).map_err(|e| e.to_string())?;
                    let mut gpu = DeviceDecode::upload(&rt, &spec, &problem).map_err(|e| e.to_string())?;
                    gpu.run(&rt, &plan, &problem).map_err(|e| e.to_string())?;
                    Ok(expected.check(&gpu.download().map_err(|e| e.to_string())?))
                })();
                table.record(row, outcome);
            }
        }
    }
    table.finish();
}

/// The runtime's own choice of configuration on a problem of many CTAs (a
/// persistent kernel's consumers close many items' rows). The varlen and
/// paged forwards print the same epilogue: the example-spec tests run them
/// on `sink_window`.
#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn forward_as_the_runtime_chooses() {
    let case = || Case { batch: 4, heads: (16, 4), seqs: (520, 700), layout: OperandLayout::Bshd };
    run_all(&runtime(), sink_specs().into_iter().map(|spec| (spec, case())).collect());
}
