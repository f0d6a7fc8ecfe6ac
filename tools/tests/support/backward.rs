//! Backward cases: the GPU runs collected as they come ([`GpuRuns`]), then
//! their gradients judged against the reference on every core, a row
//! printed per run.

use flashgen::codegen::parallel;
use flashgen::codegen::reference::Problem;
use flashgen::codegen::{Dropout, Spec};
use flashgen::{Error, Runtime};
use flashgen_tools::verify::{BackwardReport, DeviceProblem, GpuGradients, OperandLayout};

/// The GPU halves of backward cases: the runs to judge with their rows, and
/// the rows whose GPU run already failed.
pub struct GpuRuns<R> {
    runs: Vec<(R, String)>,
    failures: Vec<String>,
}

impl<R: Sync> GpuRuns<R> {
    pub fn new() -> Self {
        GpuRuns { runs: Vec::new(), failures: Vec::new() }
    }

    /// Keeps the run `keep` makes of a GPU run's gradients, under `row`, or
    /// prints the error and keeps the row as a failure.
    pub fn record(&mut self, row: String, gpu: Result<GpuGradients, Error>, keep: impl FnOnce(GpuGradients) -> R) {
        match gpu {
            Ok(grads) => self.runs.push((keep(grads), row)),
            Err(e) => {
                println!("ERROR  {row}  {e}");
                self.failures.push(row);
            }
        }
    }

    /// [`judge_all`] over the runs kept (each with `check`) and the failures.
    pub fn judge(self, check: impl Fn(&R) -> Result<BackwardReport, String> + Sync) {
        judge_all(&self.runs, |(_, row)| row.clone(), |(run, _)| check(run), self.failures);
    }
}

/// The deterministic mode's promise: a second run's dQ, dK and dV equal
/// the first's bit for bit (an error naming the spec where they differ).
pub fn same_on_a_second_run(spec: &Spec, grads: &GpuGradients, again: &GpuGradients) -> Result<(), Error> {
    let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    if same(&grads.dq, &again.dq) && same(&grads.dk, &again.dk) && same(&grads.dv, &again.dv) {
        return Ok(());
    }
    Err(Error::KernelAbi {
        kernel: spec.name.clone(),
        problem: "deterministic mode gave different dQ/dK/dV on a second run".into(),
    })
}

/// Uploads `problem` (BSHD), runs the forward with `dropout` and then the
/// backward from its O and LSE, asking for every tensor gradient.
pub fn forward_then_backward(
    rt: &Runtime,
    spec: &Spec,
    problem: &Problem,
    d_out: &[f64],
    deterministic: bool,
    dropout: Option<Dropout>,
) -> Result<GpuGradients, Error> {
    let mut gpu = DeviceProblem::upload(rt, spec, problem, OperandLayout::Bshd)?;
    gpu.set_dropout(dropout);
    gpu.launch(rt, spec, problem)?;
    gpu.backward(rt, spec, problem, d_out, deterministic, true, None)
}

/// Judges every run with `check` (in parallel: the reference backward is
/// the slow part), prints one row each (named by `row`) and fails the test
/// if any failed, or if `failures` (rows whose GPU run already failed)
/// holds any.
pub fn judge_all<R: Sync>(
    runs: &[R],
    row: impl Fn(&R) -> String + Sync,
    check: impl Fn(&R) -> Result<BackwardReport, String> + Sync,
    mut failures: Vec<String>,
) {
    let verdicts = parallel::map(runs, |run| (row(run), check(run)));
    for (row, report) in verdicts {
        match report {
            Ok(r) if r.passed() => println!(
                "ok     {row}  dQ {:.2e}≤{:.2e} dK {:.2e}≤{:.2e} dV {:.2e}≤{:.2e}{}",
                r.dq.error,
                r.dq.tolerance,
                r.dk.error,
                r.dk.tolerance,
                r.dv.error,
                r.dv.tolerance,
                r.d_tensors
                    .iter()
                    .map(|(t, c)| format!(" d{t} {:.2e}≤{:.2e}", c.error, c.tolerance))
                    .collect::<String>()
            ),
            Ok(r) => {
                println!("FAILED {row}\n       dQ: {}\n       dK: {}\n       dV: {}", r.dq, r.dk, r.dv);
                for (t, c) in &r.d_tensors {
                    println!("       d{t}: {c}");
                }
                failures.push(row);
            }
            Err(e) => {
                println!("ERROR  {row}  {e}");
                failures.push(row);
            }
        }
    }
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n"));
}
