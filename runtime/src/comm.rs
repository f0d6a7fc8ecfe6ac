//! NCCL communicators for context parallelism: the transport that shards of
//! one attention exchange K/V blocks and partial outputs over. A
//! [`Communicator`] is one rank, a thin typed wrapper over cudarc's
//! `nccl::Comm`: it checks peers, lengths and devices before NCCL sees them
//! and turns NCCL's failures into [`CommError::Failed`].
//!
//! Each communicator owns a *communication stream*, a second stream on its
//! rank's device, so exchanges overlap the compute stream's kernels. The two
//! are ordered per buffer by cudarc's event tracking (cudarc 0.19,
//! `driver/safe/core.rs`): every `CudaSlice`, and each view of it, carries a
//! read and a write event. Taking a buffer's pointer for a stream to read
//! (`DevicePtr::device_ptr`) makes that stream wait on the buffer's write
//! event, and for it to write (`DevicePtrMut::device_ptr_mut`) on its read
//! and write events; the guard returned records the read (or write) event
//! on that stream when dropped, after the work using the pointer is queued.
//! flashgen's launches and cudarc's NCCL calls both take pointers this way,
//! and events are recorded once a device has a second stream, which the
//! communication stream ensures (unless the caller turned cudarc's event
//! tracking off). So an exchange waits for the kernels that wrote its
//! buffers, and kernels that later write them wait for it. cudarc keeps one
//! read event per buffer, the last reader's: before writing a buffer that
//! both streams read (a K/V block attended to while it is sent on), order
//! the streams (`CudaStream::join`).
//!
//! The ranks of [`Communicator::all_local`] block on each other inside NCCL
//! calls: drive each from its own thread (a `Communicator` is `Send`).

use crate::comm_error::CommError;
use crate::cuda_libs::ensure_nccl;
use crate::error::Error;
use crate::runtime::Runtime;
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceSlice};
use cudarc::nccl::result::{group_end, group_start, NcclError};
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use std::ffi::{c_char, CStr};
use std::sync::Arc;

/// An NCCL unique id: one rank makes it and sends its bytes to the others;
/// every rank passes it to [`Communicator::from_rank`].
#[derive(Clone, Copy, Debug)]
pub struct UniqueId(Id);

impl UniqueId {
    /// A fresh id (`ncclGetUniqueId`).
    pub fn new() -> Result<UniqueId, Error> {
        ensure_nccl()?;
        Id::new().map(UniqueId).map_err(nccl_error("ncclGetUniqueId"))
    }

    /// The id's bytes, to send to the other ranks' processes.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal().map(|c| c.to_ne_bytes()[0])
    }

    /// The id whose bytes another rank's [`UniqueId::to_bytes`] gave.
    pub fn from_bytes(bytes: [u8; 128]) -> UniqueId {
        UniqueId(Id::uninit(bytes.map(|b| c_char::from_ne_bytes([b]))))
    }
}

/// One rank of an NCCL communicator, on one device, with its own
/// communication stream. Dropping it aborts the communicator
/// (`ncclCommAbort`, as cudarc does): synchronize [`Communicator::stream`]
/// first where exchanges may still run.
#[derive(Debug)]
pub struct Communicator {
    comm: Comm,
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time;
// `Communicator` is not `Sync`, so a thread that holds it is the only user.
unsafe impl Send for Communicator {}

impl Communicator {
    /// One process driving every GPU in `runtimes` (one per device): one
    /// communicator per rank, rank `i` on `runtimes[i]`'s device.
    pub fn all_local(runtimes: &[&Runtime]) -> Result<Vec<Communicator>, Error> {
        check_rank(0, runtimes.len())?;
        let ordinals: Vec<usize> = runtimes.iter().map(|rt| rt.context().ordinal()).collect();
        if let Some(&ordinal) = ordinals.iter().enumerate().find_map(|(i, o)| ordinals[..i].contains(o).then_some(o)) {
            return Err(Error::Comm(CommError::RepeatedDevice { ordinal }));
        }
        ensure_nccl()?;
        let streams = runtimes.iter().map(|rt| comm_stream(rt)).collect::<Result<Vec<_>, _>>()?;
        let comms = Comm::from_devices(streams.clone()).map_err(nccl_error("ncclCommInitAll"))?;
        Ok(comms.into_iter().zip(streams).map(|(comm, stream)| Communicator { comm, stream }).collect())
    }

    /// One process per GPU: this process's `rank` of `world`, on `rt`'s
    /// device; every rank passes the same `id`. Blocks until all joined.
    pub fn from_rank(rt: &Runtime, rank: usize, world: usize, id: &UniqueId) -> Result<Communicator, Error> {
        check_rank(rank, world)?;
        ensure_nccl()?;
        let stream = comm_stream(rt)?;
        // ncclCommInitRank joins on the calling thread's current device.
        let ordinal = rt.context().ordinal();
        rt.context().bind_to_thread().map_err(|e| Error::driver(format!("selecting device {ordinal}"), e))?;
        let comm = Comm::from_rank(stream.clone(), rank, world, id.0).map_err(nccl_error("ncclCommInitRank"))?;
        Ok(Communicator { comm, stream })
    }

    /// This rank, below [`Communicator::world`].
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// The communication stream every exchange is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Grouped point-to-point: every send and receive, each naming its
    /// peer rank, in one `ncclGroupStart`/`ncclGroupEnd` on the
    /// communication stream. A send's length must equal its peer's
    /// matching receive's.
    pub fn exchange<T: NcclType>(
        &self,
        sends: &[(usize, &CudaView<T>)],
        recvs: &mut [(usize, &mut CudaViewMut<T>)],
    ) -> Result<(), Error> {
        for (peer, buf) in sends {
            self.check_peer(*peer)?;
            self.check_device("exchange", *buf)?;
        }
        for (peer, buf) in recvs.iter() {
            self.check_peer(*peer)?;
            self.check_device("exchange", &**buf)?;
        }
        group_start().map_err(nccl_error("ncclGroupStart"))?;
        let queued = self.queue_p2p(sends, recvs);
        // Ends the group even after a failed call, which NCCL requires.
        let ended = group_end().map_err(nccl_error("ncclGroupEnd"));
        // NCCL queues a group's kernels at ncclGroupEnd, but cudarc's send and
        // recv record their buffers' events as they return, inside the group:
        // record them again now, after the kernels. (cudarc's own `Group`
        // holds its guards instead, but panics where ncclGroupEnd fails.)
        for (_, buf) in sends {
            let (_, _read) = buf.device_ptr(&self.stream);
        }
        for (_, buf) in recvs.iter_mut() {
            let (_, _written) = buf.device_ptr_mut(&self.stream);
        }
        queued.and(ended)?;
        self.check_events()
    }

    /// Every rank's `local` into each rank's `gathered`, in rank order:
    /// `gathered.len() == world · local.len()`.
    pub fn all_gather<T: NcclType>(&self, local: &CudaView<T>, gathered: &mut CudaViewMut<T>) -> Result<(), Error> {
        const OP: &str = "all_gather";
        self.check_device(OP, local)?;
        self.check_device(OP, &*gathered)?;
        self.check_len(OP, "gathered", gathered.len(), local.len())?;
        self.comm.all_gather(local, gathered).map_err(nccl_error("ncclAllGather"))?;
        self.check_events()
    }

    /// The sum over ranks of `full`, whose `local.len()`-long part number
    /// `rank` lands in this rank's `local`: `full.len() == world · local.len()`.
    pub fn reduce_scatter_sum(&self, full: &CudaView<f32>, local: &mut CudaViewMut<f32>) -> Result<(), Error> {
        const OP: &str = "reduce_scatter_sum";
        self.check_device(OP, full)?;
        self.check_device(OP, &*local)?;
        self.check_len(OP, "full", full.len(), local.len())?;
        self.comm.reduce_scatter(full, local, &ReduceOp::Sum).map_err(nccl_error("ncclReduceScatter"))?;
        self.check_events()
    }

    /// Queues the sends, then the receives, stopping at the first failure.
    fn queue_p2p<T: NcclType>(
        &self,
        sends: &[(usize, &CudaView<T>)],
        recvs: &mut [(usize, &mut CudaViewMut<T>)],
    ) -> Result<(), Error> {
        // Peers were checked below `world`, which fits an i32.
        for (peer, buf) in sends {
            self.comm.send(*buf, *peer as i32).map_err(nccl_error("ncclSend"))?;
        }
        for (peer, buf) in recvs.iter_mut() {
            self.comm.recv(&mut **buf, *peer as i32).map_err(nccl_error("ncclRecv"))?;
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<(), Error> {
        match peer {
            _ if peer >= self.world() => Err(Error::Comm(CommError::Peer { peer, world: self.world() })),
            _ if peer == self.rank() => Err(Error::Comm(CommError::SelfPeer { rank: peer })),
            _ => Ok(()),
        }
    }

    fn check_device<T>(&self, op: &'static str, buf: &impl DeviceSlice<T>) -> Result<(), Error> {
        let (buffer, comm) = (buf.stream().context().ordinal(), self.stream.context().ordinal());
        match buffer == comm {
            true => Ok(()),
            false => Err(Error::Comm(CommError::Device { op, buffer, comm })),
        }
    }

    /// `len` must be `world · local`.
    fn check_len(&self, op: &'static str, buffer: &'static str, len: usize, local: usize) -> Result<(), Error> {
        let expected = self.world().saturating_mul(local);
        match len == expected {
            true => Ok(()),
            false => Err(Error::Comm(CommError::Length { op, buffer, len, expected })),
        }
    }

    /// The event waits and records cudarc queued, which it reports only
    /// through the context.
    fn check_events(&self) -> Result<(), Error> {
        let ctx = self.stream.context();
        ctx.check_err().map_err(|e| Error::driver("ordering the communication stream's buffers", e))
    }
}

/// A world of 1 to `i32::MAX` ranks (NCCL counts in C ints), `rank` below it.
fn check_rank(rank: usize, world: usize) -> Result<(), Error> {
    match world > 0 && i32::try_from(world).is_ok() && rank < world {
        true => Ok(()),
        false => Err(Error::Comm(CommError::Rank { rank, world })),
    }
}

/// A new stream on `rt`'s device, beside its compute stream.
fn comm_stream(rt: &Runtime) -> Result<Arc<CudaStream>, Error> {
    let ordinal = rt.context().ordinal();
    rt.context()
        .new_stream()
        .map_err(|e| Error::driver(format!("creating a communication stream on device {ordinal}"), e))
}

/// NCCL's name and description of an error, for `map_err`.
fn nccl_error(op: &'static str) -> impl FnOnce(NcclError) -> Error {
    move |NcclError(code)| {
        // SAFETY: NCCL returned `code`, so it is loaded; the string is static.
        let text = unsafe { CStr::from_ptr(cudarc::nccl::sys::ncclGetErrorString(code)) };
        Error::Comm(CommError::Failed { op, detail: format!("{code:?}: {}", text.to_string_lossy()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worlds_hold_one_to_i32_max_ranks() {
        assert!(check_rank(0, 1).is_ok() && check_rank(3, 4).is_ok());
        for (rank, world) in [(0, 0), (4, 4), (0, i32::MAX as usize + 1)] {
            let err = check_rank(rank, world).unwrap_err();
            assert!(matches!(err, Error::Comm(CommError::Rank { .. })), "{err}");
        }
        assert!(check_rank(4, 4).unwrap_err().to_string().contains("rank 4 is not a rank of a communicator of 4"));
        assert!(check_rank(0, 0).unwrap_err().to_string().contains("between 1 and 2147483647 ranks, not 0"));
    }

    #[test]
    fn unique_ids_round_trip_through_bytes() {
        let mut bytes = [0u8; 128];
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 37 % 256) as u8);
        assert_eq!(UniqueId::from_bytes(bytes).to_bytes(), bytes);
    }
}
