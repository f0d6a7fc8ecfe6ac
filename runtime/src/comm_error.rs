//! What can go wrong making or using an NCCL communicator ([`CommError`],
//! inside [`crate::Error::Comm`]).

use std::fmt;
use std::path::PathBuf;

/// A communicator's failure: NCCL missing or failing, or bad ranks, peers,
/// lengths or devices, found before NCCL sees them.
#[derive(Debug)]
pub enum CommError {
    /// libnccl could not be loaded by cudarc, which loads it only by the
    /// names `libnccl.so` and `libnccl.so.<CUDA major>` from the system's
    /// library path. `found` is a `libnccl.so.2` (NCCL's soname, which
    /// NVIDIA's and PyTorch's wheels ship alone) in one of the `searched`
    /// directories; `fix` makes it reachable, or installs one.
    Missing { searched: Vec<PathBuf>, found: Option<PathBuf>, fix: String },
    /// An NCCL call failed: `detail` is NCCL's error name and description.
    Failed { op: &'static str, detail: String },
    /// A communicator's world of no ranks or more than `i32::MAX`, or a
    /// rank not below it.
    Rank { rank: usize, world: usize },
    /// One process's communicators were given two runtimes of one device.
    RepeatedDevice { ordinal: usize },
    /// A point-to-point peer that is not a rank of the communicator.
    Peer { peer: usize, world: usize },
    /// A point-to-point exchange of a rank with itself.
    SelfPeer { rank: usize },
    /// A collective's buffer of another length than the op needs.
    Length { op: &'static str, buffer: &'static str, len: usize, expected: usize },
    /// A buffer on another device than the communicator's.
    Device { op: &'static str, buffer: usize, comm: usize },
}

impl fmt::Display for CommError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CommError::Missing { searched, found, fix } => {
                write!(f, "libnccl (NVIDIA's collective communication library, needed by multi-GPU communicators)")?;
                write!(f, " was not found as libnccl.so or libnccl.so.<CUDA major> on the system's library path")?;
                match found {
                    Some(lib) => write!(f, "; it is at {}", lib.display())?,
                    None => {
                        write!(f, ", and no libnccl.so.2 is in:")?;
                        searched.iter().try_for_each(|dir| write!(f, "\n  {}", dir.display()))?;
                    }
                }
                write!(f, "\nfix: {fix}")
            }
            CommError::Failed { op, detail } => write!(f, "NCCL error in {op}: {detail}"),
            CommError::Rank { rank, world } => match *world == 0 || i32::try_from(*world).is_err() {
                true => write!(f, "a communicator has between 1 and {} ranks, not {world}", i32::MAX),
                false => write!(f, "rank {rank} is not a rank of a communicator of {world}"),
            },
            CommError::RepeatedDevice { ordinal } => {
                write!(f, "device {ordinal} is given twice: one process's communicators need one runtime per device")
            }
            CommError::Peer { peer, world } => {
                write!(f, "peer {peer} is not a rank of the communicator: its ranks are 0..{world}")
            }
            CommError::SelfPeer { rank } => write!(f, "rank {rank} cannot send to or receive from itself"),
            CommError::Length { op, buffer, len, expected } => {
                write!(f, "{op}: {buffer} holds {len} elements but the op needs {expected} (world · the local length)")
            }
            CommError::Device { op, buffer, comm } => {
                write!(f, "{op}: a buffer is on device {buffer} but the communicator on device {comm}")
            }
        }
    }
}
