//! GPU time of queued work, by CUDA events: what autotuning ranks candidates
//! by ([`median_ms`], a few steps, each waited for), and what the benchmark
//! and the CLI report ([`sustained_median_ms`], the peers' protocol).

use crate::error::Error;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;

/// The median milliseconds between events recorded on `stream` around
/// `step` (which queues work there), over `runs` timed steps (at least one)
/// after `warmup` untimed ones. Waits for each timed step.
pub fn median_ms(
    stream: &CudaStream,
    warmup: usize,
    runs: usize,
    step: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    median_ms_after(stream, warmup, runs, || Ok(()), step)
}

/// [`median_ms`] with `before` queued ahead of every step, outside the
/// timed events: an L2 flush, as triton's `do_bench` gives each repetition.
pub fn median_ms_after(
    stream: &CudaStream,
    warmup: usize,
    runs: usize,
    mut before: impl FnMut() -> Result<(), Error>,
    mut step: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    for _ in 0..warmup {
        before()?;
        step()?;
    }
    let err = |e| Error::driver("timing with CUDA events", e);
    let mut times = Vec::with_capacity(runs.max(1));
    for _ in 0..runs.max(1) {
        before()?;
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        step()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err)?;
        end.synchronize().map_err(err)?;
        times.push(f64::from(start.elapsed_ms(&end).map_err(err)?));
    }
    Ok(median(times))
}

/// Untimed steps of [`sustained_median_ms`] fill about this many
/// milliseconds, and timed ones [`REP_MS`]: triton's `do_bench` defaults.
const WARMUP_MS: f64 = 25.0;
const REP_MS: f64 = 100.0;

/// Steps of the estimate that sizes [`sustained_median_ms`]'s runs.
const ESTIMATE_STEPS: usize = 5;

/// The median milliseconds between events recorded on `stream` around
/// `step`, each step after `before` (outside its events), as triton's
/// `do_bench` times the peers: one untimed step, five to estimate a step's
/// time, untimed steps filling [`WARMUP_MS`], then timed ones filling
/// [`REP_MS`] (at least `min_runs`), queued back to back and waited for at
/// the end only. A GPU under sustained load runs at the clock its power
/// limit allows, well below the boost clock a short burst of waited-for
/// steps gets: timed any other way than the peers, a kernel would be
/// compared at another clock.
pub fn sustained_median_ms(
    stream: &CudaStream,
    min_runs: usize,
    mut before: impl FnMut() -> Result<(), Error>,
    mut step: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    let err = |e| Error::driver("timing with CUDA events", e);
    let record = || stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(err);
    before()?;
    step()?;
    let start = record()?;
    for _ in 0..ESTIMATE_STEPS {
        before()?;
        step()?;
    }
    let end = record()?;
    end.synchronize().map_err(err)?;
    let estimate = f64::from(start.elapsed_ms(&end).map_err(err)?) / ESTIMATE_STEPS as f64;
    let steps_in = |ms: f64| (ms / estimate.max(1e-3)) as usize;
    for _ in 0..steps_in(WARMUP_MS).max(1) {
        before()?;
        step()?;
    }
    let runs = steps_in(REP_MS).max(min_runs).max(1);
    let mut events = Vec::with_capacity(runs);
    for _ in 0..runs {
        before()?;
        let start = record()?;
        step()?;
        events.push((start, record()?));
    }
    let mut times = Vec::with_capacity(runs);
    for (start, end) in &events {
        end.synchronize().map_err(err)?;
        times.push(f64::from(start.elapsed_ms(end).map_err(err)?));
    }
    Ok(median(times))
}

/// The middle of `times` (at least one).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
