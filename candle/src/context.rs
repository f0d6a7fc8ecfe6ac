//! A context-parallel call's rank (feature `nccl`): its sharding, whole
//! lengths, schedule and communicator, as the candle op keeps them from the
//! forward to the backward.

use flashgen::context_parallel::{Schedule, Sharding, Whole};
use flashgen::runtime::Communicator;
use std::sync::{Arc, Mutex, PoisonError};

/// One rank's share of a context-parallel call: how the sequence is split,
/// its whole lengths, when K/V rows move, and the rank's communicator
/// (rank = the communicator's). Cheap to clone; the clones share the
/// communicator, which one launch uses at a time.
#[derive(Clone)]
pub struct ContextParallel {
    pub sharding: Sharding,
    pub whole: Whole,
    pub schedule: Schedule,
    comm: Arc<Mutex<Communicator>>,
}

impl ContextParallel {
    pub fn new(comm: Communicator, sharding: Sharding, whole: Whole, schedule: Schedule) -> ContextParallel {
        ContextParallel { sharding, whole, schedule, comm: Arc::new(Mutex::new(comm)) }
    }

    /// This rank's rows of a whole sequence's `len` positions: (first
    /// position, count) per segment, in the order the rank's tensors hold them.
    pub fn rows(&self, len: usize) -> Vec<(usize, usize)> {
        let rank = self.comm.lock().unwrap_or_else(PoisonError::into_inner).rank();
        self.sharding.segments(len, rank).iter().map(|s| (s.start, s.len)).collect()
    }

    /// Runs `f` with the flashgen launch description, holding the communicator.
    pub(crate) fn with<R>(&self, f: impl FnOnce(flashgen::context_parallel::ContextParallel<'_>) -> R) -> R {
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        f(flashgen::context_parallel::ContextParallel {
            sharding: self.sharding,
            whole: self.whole,
            schedule: self.schedule,
            comm: &comm,
        })
    }
}
