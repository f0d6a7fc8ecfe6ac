//! GPU time of queued work, by CUDA events: what autotuning ranks candidates
//! by, and what the benchmark and the CLI report.

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
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
