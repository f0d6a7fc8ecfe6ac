//! Context parallelism on candle tensors (feature `nccl`): each rank calls
//! [`Attention::forward_sharded`] with its rows of Q, K and V on its own
//! GPU and a [`ContextParallel`] holding its NCCL communicator; the op runs
//! flashgen's [`Runtime::forward_sharded`](flashgen::Runtime::forward_sharded)
//! and, from `loss.backward()`,
//! [`Runtime::backward_sharded`](flashgen::Runtime::backward_sharded) on the
//! tensors' stream, so candle's graph reaches the rank's Q, K and V.

use crate::call::{arg_tensors, Call};
use crate::error;
use crate::{Arg, Attention, ContextParallel};
use candle_core::{Device, Tensor};
use flashgen::runtime::{Communicator, UniqueId};
use flashgen::Runtime;

pub use flashgen::context_parallel::{Partition, Schedule, Sharding, Whole};

/// One communicator per device, rank `i` on `devices[i]`, for one process
/// driving every GPU of a host (each rank's calls then run on a thread of
/// their own: a rank's launch waits for its peers').
pub fn all_local(devices: &[Device]) -> candle_core::Result<Vec<Communicator>> {
    let runtimes = devices.iter().map(runtime).collect::<candle_core::Result<Vec<_>>>()?;
    Communicator::all_local(&runtimes.iter().collect::<Vec<_>>()).map_err(error::flashgen)
}

/// This process's `rank` of `world`, on `device`, for one process per GPU;
/// every rank passes the same `id` (made by one of them and shared).
pub fn from_rank(device: &Device, rank: usize, world: usize, id: &UniqueId) -> candle_core::Result<Communicator> {
    Communicator::from_rank(&runtime(device)?, rank, world, id).map_err(error::flashgen)
}

/// A runtime on `device`'s stream: what a communicator is made from.
fn runtime(device: &Device) -> candle_core::Result<Runtime> {
    match device {
        Device::Cuda(device) => Runtime::from_stream(device.cuda_stream()).map_err(error::flashgen),
        _ => Err(error::Error::NotCuda { operand: "a communicator's device".to_string() }.into()),
    }
}

impl Attention {
    /// This rank's rows of O for its rows of `q`, `k` and `v` (segment after
    /// segment, as [`ContextParallel::rows`] lists them) on its GPU, with
    /// the whole sequence's params and captured tensors. Every rank calls
    /// it with the same spec, sharding, schedule, whole lengths and args.
    /// `loss.backward()` runs the sharded backward, which waits for every
    /// rank's; a trained captured tensor's gradient is this rank's share of
    /// the sum over ranks (add them, as data-parallel gradients are).
    pub fn forward_sharded(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        args: &[Arg],
        cp: &ContextParallel,
    ) -> candle_core::Result<Tensor> {
        let mut call = Call::new(self, q, k, v, args)?;
        // K and V are sent as they lie: they must be compact.
        for t in &mut call.qkv[1..] {
            if !t.is_contiguous() {
                *t = t.detach().contiguous()?;
            }
        }
        call.sharded = Some(cp.clone());
        crate::graph::attend(call, [q, k, v], &arg_tensors(args))
    }
}
