//! Backward cases' second half: the GPU runs are done, their gradients are
//! judged against the reference on every core, and a row is printed per run.

use flashgen_tools::verify::BackwardReport;

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
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = runs.len().div_ceil(workers).max(1);
    let (row, check) = (&row, &check);
    let verdicts: Vec<(String, Result<BackwardReport, String>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = runs
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(|run| (row(run), check(run))).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("a reference thread panicked")).collect()
    });
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
