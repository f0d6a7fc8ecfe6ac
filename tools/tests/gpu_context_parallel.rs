//! GPU correctness of context parallelism simulated on one GPU: every
//! example spec's sequence dealt to 2 to 4 ranks (contiguous and zigzag),
//! each rank's pieces run with the shard view's kernels and merged by LSE,
//! the backward's pieces summed in f32; the gathered O, LSE and gradients
//! judged with FlashAttention's rule against the f64 reference of the
//! unsharded problem.
//!
//! Over NCCL, every visible GPU a rank, the same judged against the
//! reference.
//!
//! Ignored by a plain `cargo test`: they need a GPU; run them with
//! `--include-ignored`. Every case draws fresh random inputs (the seed is
//! printed).

mod support;

use flashgen::codegen::reference::Problem;
use flashgen::codegen::shard::{Partition, Sharding};
use flashgen::codegen::{Shape, Spec};
use flashgen::context_parallel::Schedule;
use flashgen::Runtime;
use flashgen_tools::examples::SPECS;
use flashgen_tools::verify::shard::{run_sharded, Ranks};
use flashgen_tools::verify::{self, check_backward, GpuGradients};
use support::backward::judge_all;
use support::{heads_of, language_spec, params, runtime, spec};

/// The shardings the cases rotate through.
const SHARDINGS: [(usize, Partition); 4] =
    [(2, Partition::Zigzag), (3, Partition::Contiguous), (4, Partition::Zigzag), (2, Partition::Contiguous)];

/// Every example spec and the language fixture, with its GQA heads.
fn cases() -> Vec<(String, Spec, (usize, usize))> {
    let mut cases: Vec<_> = SPECS.iter().map(|(name, _)| (name.to_string(), spec(name), heads_of(name))).collect();
    cases.push(("language".into(), language_spec(), (4, 2)));
    cases
}

struct Run {
    row: String,
    spec: Spec,
    problem: Problem,
    d_out: Vec<f64>,
    /// Set once the case ran.
    grads: Option<GpuGradients>,
}

#[test]
#[ignore = "needs an NVIDIA GPU (run with --include-ignored)"]
fn forward_and_backward_of_every_spec_sharded() {
    let rt = runtime();
    let (mut runs, mut failures) = (Vec::new(), Vec::new());
    for (i, (name, spec, (heads, heads_kv))) in cases().into_iter().enumerate() {
        for (j, len) in [333usize, 700].into_iter().enumerate() {
            let (ranks, partition) = SHARDINGS[(i + j) % SHARDINGS.len()];
            let sharding = Sharding { ranks, partition };
            let shape = Shape { batch: 2, heads, heads_kv, q_len: len, kv_len: len };
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
            let d_out = verify::random_d_out(&spec, shape, seed);
            let row = format!("{name:<20} len {len:>4} {ranks} ranks {partition:?} seed {seed}");
            let case = Run { row, spec: spec.clone(), problem, d_out, grads: None };
            runs.extend(run_case(Ranks::OneGpu(&rt, sharding), case, &mut failures));
        }
    }
    judge_gradients(&runs, failures);
}

/// Over NCCL, one rank per visible GPU (needs two; says so and passes with
/// one): causal, documents, a window, ALiBi's trained slopes and learned
/// sinks, both schedules and partitions, judged against the reference.
#[test]
#[ignore = "needs two or more NVIDIA GPUs (run with --include-ignored)"]
fn forward_and_backward_over_nccl() {
    let gpus = flashgen::cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
    if gpus < 2 {
        println!("over NCCL: needs 2 GPUs, {gpus} visible: nothing run");
        return;
    }
    let runtimes: Vec<Runtime> = (0..gpus).map(|i| Runtime::new(i).expect("a GPU")).collect();
    let (mut runs, mut failures) = (Vec::new(), Vec::new());
    let schedules = [(Partition::Zigzag, Schedule::Ring), (Partition::Contiguous, Schedule::AllGather)];
    for (i, name) in ["causal", "document", "sliding_window", "alibi", "sink_window"].into_iter().enumerate() {
        for (j, len) in [777usize, 1536].into_iter().enumerate() {
            let spec = spec(name);
            let (partition, schedule) = schedules[(i + j) % 2];
            let (heads, heads_kv) = heads_of(name);
            let shape = Shape { batch: 2, heads, heads_kv, q_len: len, kv_len: len };
            let seed: u64 = rand::random();
            let problem = verify::random_problem(&spec, shape, params(&spec), vec![], None, seed);
            let d_out = verify::random_d_out(&spec, shape, seed);
            let row = format!("{name:<20} len {len:>4} {gpus} GPUs {partition:?} {schedule:?} seed {seed}");
            let case = Run { row, spec, problem, d_out, grads: None };
            runs.extend(run_case(Ranks::Nccl(&runtimes, partition, schedule), case, &mut failures));
        }
    }
    judge_gradients(&runs, failures);
}

/// Judges every run's gradients; fails the test if any, or any of
/// `failures`, failed.
fn judge_gradients(runs: &[Run], failures: Vec<String>) {
    judge_all(
        runs,
        |r| r.row.clone(),
        |r| match &r.grads {
            Some(grads) => check_backward(&r.spec, &r.problem, &r.d_out, grads).map_err(|e| e.to_string()),
            None => Err("the backward did not run".into()),
        },
        failures,
    );
}

/// Runs `case` sharded over `ranks` and prints its forward's verdict; the
/// case with its gradients, to judge, or its failure in `failures`.
fn run_case(ranks: Ranks<'_>, mut case: Run, failures: &mut Vec<String>) -> Option<Run> {
    match run_sharded(ranks, &case.spec, &case.problem, Some(&case.d_out)) {
        Ok((output, grads)) => {
            let report = verify::check(&case.spec, &case.problem, &output).expect("a valid problem");
            match report.passed() {
                true => println!("ok     {}  O {:.2e}≤{:.2e}", case.row, report.output.error, report.output.tolerance),
                false => {
                    println!("FAILED {} forward\n       O: {}\n       LSE: {}", case.row, report.output, report.lse);
                    failures.push(format!("{} forward", case.row));
                }
            }
            case.grads = grads;
            Some(case)
        }
        Err(e) => {
            println!("ERROR  {}  {e}", case.row);
            failures.push(case.row);
            None
        }
    }
}
