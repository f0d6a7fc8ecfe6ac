//! Tuning a decode plan's split count: the caller's own step, timed at
//! every candidate count ([`split_candidates`]), each after a flush of the
//! L2 (a serving loop's other layers evict the cache between two steps of
//! one layer); the fastest stays the plan's.
//!
//! The step is a closure, so one tuner serves every kind of run (dense,
//! paged, packed queries, e4m3 caches) on the caller's real buffers and
//! lengths. Tuning synchronizes with the GPU: tune before capturing a step
//! into a CUDA graph, not during.

use crate::decode::DecodePlan;
use crate::error::Error;
use crate::runtime::Runtime;
use crate::timing::median_ms_after;
use cudarc::driver::sys::CUdevice_attribute;
use flashgen_codegen::cuda::split_candidates;
use std::fmt;

/// Untimed steps per candidate.
const WARMUP: usize = 2;
/// Timed steps per candidate; the median counts.
const RUNS: usize = 7;

/// What [`DecodePlan::tune`] measured and chose.
#[derive(Debug)]
pub struct DecodeTuneReport {
    /// The split count the plan runs with now.
    pub best: usize,
    /// Each candidate split count in ascending order with its median
    /// milliseconds per step, or why it could not run.
    pub candidates: Vec<(usize, Result<f64, Error>)>,
}

/// `best N | 1 0.123 ms, 2 0.081 ms, 4 failed (why), …`
impl fmt::Display for DecodeTuneReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "best {} |", self.best)?;
        for (i, (splits, ms)) in self.candidates.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            match ms {
                Ok(ms) => write!(f, "{sep}{splits} {ms:.4} ms")?,
                Err(e) => write!(f, "{sep}{splits} failed ({})", e.to_string().lines().next().unwrap_or_default())?,
            }
        }
        Ok(())
    }
}

impl DecodePlan {
    /// Times `step`, one decode step of this plan on the caller's buffers
    /// (`|plan| plan.run(&rt, io, &args)`, or any other run), at each
    /// candidate split count, and keeps the fastest: powers of two up to one
    /// tile of keys a split, and the plan's own count. `rt` is the runtime
    /// the plan was made on. The step's outputs hold one candidate's step
    /// when it returns (the same attention, summed in another order).
    ///
    /// A step that fails at the plan's own count fails the tune with its
    /// error (bad operands, say), the plan unchanged; a candidate that
    /// fails otherwise (its workspace does not fit the GPU) is reported
    /// and skipped. Synchronizes with the GPU.
    pub fn tune(
        &mut self,
        rt: &Runtime,
        mut step: impl FnMut(&DecodePlan) -> Result<(), Error>,
    ) -> Result<DecodeTuneReport, Error> {
        let own = self.splits() as u32;
        step(self)?;
        let mut flush = l2_flush_buffer(rt)?;
        let mut flush_l2 = || rt.stream().memset_zeros(&mut flush).map_err(|e| Error::driver("flushing the L2", e));
        let mut candidates = Vec::new();
        for splits in split_candidates(own, self.kv_tiles()) {
            let timed = match self.resplit(rt, splits) {
                Ok(()) => median_ms_after(rt.stream(), WARMUP, RUNS, &mut flush_l2, || step(self)),
                Err(e) => Err(e),
            };
            candidates.push((splits as usize, timed));
        }
        let best = candidates
            .iter()
            .filter_map(|(splits, ms)| ms.as_ref().ok().map(|ms| (*ms, *splits)))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map_or(own as usize, |(_, splits)| splits);
        self.resplit(rt, best as u32)?;
        Ok(DecodeTuneReport { best, candidates })
    }
}

/// Twice the GPU's L2 in bytes (32 MiB where the driver does not say), on
/// `rt`'s stream: zeroing it evicts what a step left there.
fn l2_flush_buffer(rt: &Runtime) -> Result<cudarc::driver::CudaSlice<u8>, Error> {
    let l2 = rt.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE).unwrap_or(0);
    let bytes = 2 * usize::try_from(l2).unwrap_or(0).max(16 << 20);
    rt.stream().alloc_zeros::<u8>(bytes).map_err(|e| Error::driver("allocating the L2 flush buffer", e))
}
