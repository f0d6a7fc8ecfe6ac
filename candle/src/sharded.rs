//! Context parallelism on candle tensors (feature `nccl`): each rank calls
//! [`Attention::forward_sharded`] with its rows of Q, K and V on its own
//! GPU and a [`ContextParallel`] holding its NCCL communicator; the op runs
//! flashgen's [`Runtime::forward_sharded`](flashgen::Runtime::forward_sharded)
//! and, from `loss.backward()`,
//! [`Runtime::backward_sharded`](flashgen::Runtime::backward_sharded) on the
//! tensors' stream, so candle's graph reaches the rank's Q, K and V.

use crate::call::{arg_tensors, cuda_device, operands, tensor, Call, Grads, NAMES};
use crate::error;
use crate::{Arg, Attention};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{Device, Shape, Tensor};
use flashgen::context_parallel::ShardIo;
use flashgen::cudarc::nccl::NcclType;
use flashgen::runtime::{Communicator, UniqueId};
use flashgen::{BackwardIo, BackwardOptions, Element, ForwardOptions, Layout, Runtime};
use std::sync::{Arc, Mutex, PoisonError};

pub use flashgen::context_parallel::{Partition, Schedule, Sharding, Whole};

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
    fn with<R>(&self, f: impl FnOnce(flashgen::context_parallel::ContextParallel<'_>) -> R) -> R {
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        f(flashgen::context_parallel::ContextParallel {
            sharding: self.sharding,
            whole: self.whole,
            schedule: self.schedule,
            comm: &comm,
        })
    }
}

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

/// [`Call::forward`] of a sharded call.
pub(crate) fn forward<T: Element + CudaDType + NcclType>(
    call: &Call,
    cp: &ContextParallel,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let device = cuda_device(&call.qkv[0], "Q")?;
    let rt = call.attention.runtime(&device)?;
    let guards = call.qkv.each_ref().map(|t| t.storage_and_layout());
    let [q, k, v] = operands::<T, 3>(NAMES, &guards);
    let (q, k, v) = (q?, k?, v?);
    let (batch, rows, heads, v_dim) = (q.1.batch, q.1.seq, q.1.heads, v.1.dim);
    let o_layout = Layout::bshd(batch, rows, heads, v_dim);
    // SAFETY: the pieces' merge writes every element of O and the LSE.
    let mut o = unsafe { device.alloc::<T>(o_layout.len())? };
    let mut lse = unsafe { device.alloc::<f32>(batch * heads * rows)? };
    let tensor_guards: Vec<_> = call.tensors().map(|t| t.storage_and_layout()).collect();
    let args = call.arg_values(&tensor_guards)?;
    let io = ShardIo { q, k, v, o: (&mut o, o_layout), lse: &mut lse };
    let opts = ForwardOptions { scale: call.attention.scale(), ..Default::default() };
    cp.with(|cp| rt.forward_sharded(call.attention.spec(), cp, io, &args, &opts)).map_err(error::flashgen)?;
    if call.keep_lse {
        *call.lse.lock().unwrap_or_else(PoisonError::into_inner) = Some(lse);
    }
    Ok((CudaStorage::wrap_cuda_slice(o, device), Shape::from((batch, rows, heads, v_dim))))
}

/// [`Call::backward`] of a sharded call.
pub(crate) fn backward<T: Element + CudaDType + NcclType>(
    call: &Call,
    cp: &ContextParallel,
    o: &Tensor,
    d_o: &Tensor,
) -> candle_core::Result<Grads> {
    let device = cuda_device(&call.qkv[0], "Q")?;
    let rt = call.attention.runtime(&device)?;
    let lse = call.lse.lock().unwrap_or_else(PoisonError::into_inner);
    let lse = lse.as_ref().ok_or_else(|| candle_core::Error::msg("flashgen: the forward kept no LSE"))?;
    let d_o = call.addressable_d_o(d_o)?;
    let guards = call.qkv.each_ref().map(|t| t.storage_and_layout());
    let [q, k, v] = operands::<T, 3>(NAMES, &guards);
    let (q, k, v) = (q?, k?, v?);
    let out_guards = [o, &d_o].map(|t| t.storage_and_layout());
    let [o_io, d_o_io] = operands::<T, 2>(["O", "dO"], &out_guards);
    let shapes = [q.1, k.1, v.1].map(|l| Layout::bshd(l.batch, l.seq, l.heads, l.dim));
    // SAFETY: the sharded backward writes every element of dQ, dK and dV.
    let alloc = |l: Layout| unsafe { device.alloc::<T>(l.len()) };
    let (mut dq, mut dk, mut dv) = (alloc(shapes[0])?, alloc(shapes[1])?, alloc(shapes[2])?);
    let tensor_guards: Vec<_> = call.tensors().map(|t| t.storage_and_layout()).collect();
    let args = call.arg_values(&tensor_guards)?;
    let mut d_tensors = call.tensor_grad_buffers(&device)?;
    let io = BackwardIo {
        q,
        k,
        v,
        o: o_io?,
        lse,
        d_o: d_o_io?,
        dq: (&mut dq, shapes[0]),
        dk: (&mut dk, shapes[1]),
        dv: (&mut dv, shapes[2]),
        d_tensors: d_tensors.iter_mut().map(Option::as_mut).collect(),
    };
    let workspace = call.attention.workspace(&device)?;
    let opts = BackwardOptions { scale: call.attention.scale(), workspace: Some(&workspace), ..Default::default() };
    cp.with(|cp| rt.backward_sharded(call.attention.spec(), cp, io, &args, &opts)).map_err(error::flashgen)?;
    let wrap = |slice, l: Layout| tensor(slice, &device, (l.batch, l.seq, l.heads, l.dim));
    let qkv = [wrap(dq, shapes[0])?, wrap(dk, shapes[1])?, wrap(dv, shapes[2])?];
    Ok(Grads { qkv, tensors: call.tensor_grads(d_tensors, &device)? })
}
