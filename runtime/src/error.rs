//! The runtime's one error type.
//!
//! Every failure, from a missing CUDA library to a mis-sized buffer, is a
//! variant here whose message names the offending library, operand or
//! argument, so callers never have to decode a raw driver code or a panic.

use crate::arch::Arch;
pub use crate::comm_error::CommError;
use crate::dropout_error::DropoutError;
use crate::e4m3_error::E4m3Error;
pub use crate::ragged_error::RaggedError;
use crate::shard_error::ShardError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;
use flashgen_codegen::abi::{Axis, Operand};
use flashgen_codegen::Dtype;
use std::fmt;
use std::path::PathBuf;

#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// libnvrtc could not be loaded: not on the system's library path, nor
    /// in any of the `searched` directories. `fix` is a command that
    /// installs it where the search looks.
    NvrtcMissing {
        searched: Vec<PathBuf>,
        fix: String,
    },
    /// An NCCL communicator could not be made or used.
    Comm(CommError),
    /// libcuda (the driver) could not be loaded.
    DriverMissing,
    /// The NVRTC found is of a newer CUDA major version than the driver,
    /// which cannot load the kernels it compiles.
    NvrtcNewerThanDriver {
        nvrtc: (i32, i32),
        driver: (i32, i32),
    },
    /// There is no GPU with this ordinal.
    NoDevice {
        ordinal: usize,
        count: usize,
    },
    /// `Runtime::on_stream` was given a stream of another device.
    StreamDevice {
        stream: usize,
        runtime: usize,
    },
    /// A string that does not name a compute capability.
    InvalidArch {
        input: String,
    },
    /// The GPU is older than the kernels support.
    UnsupportedArch {
        arch: Arch,
        device: String,
    },
    /// A CUDA driver call failed.
    Driver {
        during: String,
        source: DriverError,
    },
    /// An NVRTC call other than the compilation itself failed.
    Nvrtc {
        during: &'static str,
        source: NvrtcError,
    },
    /// NVRTC rejected a kernel. `numbered_source` matches the log's line numbers.
    Compile {
        kernel: String,
        arch: Arch,
        log: String,
        numbered_source: String,
    },
    /// The kernel cache directory cannot be written (reported by
    /// precompilation only: launches fall back to compiling).
    Cache {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Precompilation was asked for with the disk cache disabled.
    CacheDisabled,
    /// Writing a `FLASHGEN_DUMP` file failed.
    Dump {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The kernel needs more shared memory per block than the GPU offers.
    SharedMemory {
        kernel: String,
        needed: u32,
        available: u32,
    },
    /// The generated kernel's launch description is inconsistent with its
    /// spec (a code generator bug, reported rather than trusted).
    KernelAbi {
        kernel: String,
        problem: String,
    },
    /// The element type of Q/K/V/O differs from the spec's dtype.
    Dtype {
        spec: Dtype,
        got: Dtype,
    },
    /// A size of `operand` disagrees with the same size of `other`.
    SizeMismatch {
        operand: Operand,
        other: Operand,
        what: &'static str,
        got: usize,
        expected: usize,
    },
    /// The head dimension of `operand` differs from the spec's.
    HeadDim {
        operand: Operand,
        got: usize,
        expected: u32,
    },
    /// A kernel other than the decode's (and the paged append's) asked of
    /// a spec whose head dims exceed what it supports (specs declare up to
    /// `MAX_DECODE_HEAD_DIM`, MLA's 576; the forward and backward take up to
    /// `MAX_HEAD_DIM`).
    WideHeadDims {
        spec: String,
        kernel: &'static str,
        qk: u32,
        v: u32,
        max: u32,
    },
    /// Query heads must be a positive multiple of key/value heads.
    HeadGroups {
        heads: usize,
        heads_kv: usize,
    },
    NegativeStride {
        operand: Operand,
        axis: Axis,
        stride: i64,
    },
    /// The layout addresses elements past the end of the buffer, or,
    /// addressing none, starts past it (`needed`: the elements up to its
    /// last element, or up to its start).
    OutOfBounds {
        operand: Operand,
        needed: u128,
        len: usize,
    },
    /// The layout's largest element offset overflows the kernel's int64 indexing.
    OffsetOverflow {
        operand: Operand,
    },
    /// A size exceeds what the kernel or the launch grid can index.
    TooLarge {
        what: &'static str,
        value: usize,
        max: usize,
    },
    /// The softmax scale is not a positive finite number.
    Scale {
        scale: f32,
    },
    /// The LSE buffer holds fewer than `batch · heads · q_len` floats (a
    /// varlen launch's: `heads · total_q`).
    LseTooSmall {
        len: usize,
        needed: usize,
    },
    /// The number of launch arguments differs from params + tensors.
    ArgCount {
        expected: usize,
        got: usize,
        signature: String,
    },
    /// An argument's variant does not match its declared type.
    ArgType {
        name: String,
        expected: String,
        got: &'static str,
    },
    /// A captured tensor's buffer is smaller than its declared shape.
    TensorTooSmall {
        name: String,
        len: usize,
        needed: usize,
    },
    /// A captured tensor's dimension expression is below 1 or leaves i32
    /// for the launch's shape.
    TensorDim(flashgen_codegen::DimError),
    /// A block mask was asked of a spec without a mask.
    NoMask {
        spec: String,
    },
    /// A work order was asked under a mask that reads no tensor: its
    /// kernels walk a fixed order.
    NoWorkOrder {
        spec: String,
    },
    /// A block mask was built for another spec, shape, tile size, params
    /// or tensors than the launch it was passed to.
    BlockMaskMismatch {
        what: &'static str,
    },
    /// A gradient was asked for a captured tensor that has none (see
    /// `flashgen_codegen::grad::d_load`).
    NoTensorGrad {
        tensor: String,
    },
    /// More tensor-gradient slots than the spec declares tensors.
    TensorGradCount {
        declared: usize,
        got: usize,
    },
    /// A launch asked for a tile configuration that is not one of the
    /// spec's candidates on this GPU (`tile_choice::candidates`; a
    /// backward's: `BackwardConfig::tiles`).
    NotACandidate {
        config: String,
        spec: String,
        arch: Arch,
    },
    /// Autotuning could run no candidate: each one's name and error.
    Tuning {
        spec: String,
        failures: Vec<(String, Error)>,
    },
    /// An operand of a context-parallel partials launch (the merge or add
    /// of pieces: `acc`, `piece`, `out` or one's LSE) disagrees with the
    /// others or with its buffer; `problem` says how.
    Partial {
        operand: &'static str,
        problem: String,
    },
    /// A varlen, paged or decode launch's sequences, pages or plan disagree
    /// with its buffers.
    Ragged(RaggedError),
    /// A context-parallel launch's ranks or rows disagree with its sharding.
    Shard(ShardError),
    /// A launch's dropout has a probability outside `[0, 1)`, or the launch
    /// has no dropout kernels.
    Dropout(DropoutError),
    /// An e4m3 forward's GPU, spec, configuration or operands rule it out.
    E4m3(E4m3Error),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NvrtcMissing { searched, fix } => {
                write!(f, "libnvrtc (NVIDIA's runtime compiler) was not found on the system's library path")?;
                write!(f, " (LD_LIBRARY_PATH, ldconfig) nor in:")?;
                searched.iter().try_for_each(|dir| write!(f, "\n  {}", dir.display()))?;
                write!(f, "\nto install it, run: {fix}\n(or install a CUDA toolkit, or set CUDA_PATH to one)")
            }
            Error::Comm(e) => write!(f, "{e}"),
            Error::DriverMissing => write!(
                f,
                "libcuda (the NVIDIA driver) was not found: flashgen needs an NVIDIA GPU with its driver installed"
            ),
            Error::NvrtcNewerThanDriver { nvrtc: (nv, nv_minor), driver: (dv, dv_minor) } => write!(
                f,
                "NVRTC {nv}.{nv_minor} compiles kernels that the CUDA {dv}.{dv_minor} driver cannot load: \
                 put NVRTC {dv} first (`pip install nvidia-cuda-nvrtc-cu{dv}`, or a CUDA {dv} toolkit on the \
                 library path; flashgen built for CUDA {dv}'s bindings, e.g. `cuda-12080`, looks for it first), or update \
                 the driver"
            ),
            Error::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device with ordinal {ordinal}: the driver reports {count} device(s)")
            }
            Error::StreamDevice { stream, runtime } => write!(
                f,
                "the stream belongs to device {stream}, the runtime to device {runtime}: \
                 open a runtime on that device (Runtime::from_stream) instead"
            ),
            Error::InvalidArch { input } => {
                write!(f, "invalid GPU architecture `{input}`: expected e.g. `sm_90`, `sm_90a` or `90`")
            }
            Error::UnsupportedArch { arch, device } => {
                write!(f, "{device} is {arch}; flashgen kernels need {} or newer", Arch::MIN)
            }
            Error::Driver { during, source } => write!(f, "CUDA driver error while {during}: {source}"),
            Error::Nvrtc { during, source } => write!(f, "NVRTC error while {during}: {source}"),
            Error::Compile { kernel, arch, log, numbered_source } => write!(
                f,
                "NVRTC failed to compile `{kernel}` for {arch}:\n{log}\n--- generated source ---\n{numbered_source}"
            ),
            Error::Cache { path, source } => write!(f, "cannot write the kernel cache at {}: {source}", path.display()),
            Error::CacheDisabled => write!(
                f,
                "the kernel cache is disabled: unset FLASHGEN_CACHE=off, and set FLASHGEN_CACHE_DIR or HOME"
            ),
            Error::Dump { path, source } => {
                write!(f, "cannot write {} (FLASHGEN_DUMP): {source}", path.display())
            }
            Error::SharedMemory { kernel, needed, available } => write!(
                f,
                "`{kernel}` needs {needed} bytes of shared memory per block; the GPU offers at most {available}"
            ),
            Error::KernelAbi { kernel, problem } => write!(
                f,
                "kernel `{kernel}` breaks the launch contract: {problem} (a flashgen code generator bug)"
            ),
            launch => launch.fmt_launch(f),
        }
    }
}

impl Error {
    /// The message of an error in a launch's inputs (shapes, layouts,
    /// arguments, block masks, configurations); `fmt` writes the rest.
    fn fmt_launch(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Dtype { spec, got } => write!(f, "the spec's dtype is {spec} but Q/K/V/O are {got}"),
            Error::SizeMismatch { operand, other, what, got, expected } => {
                write!(f, "{operand:?} has {what} = {got} but {other:?} has {what} = {expected}")
            }
            Error::HeadDim { operand, got, expected } => {
                write!(f, "{operand:?} has head dim {got} but the spec declares {expected}")
            }
            Error::HeadGroups { heads, heads_kv } => write!(
                f,
                "Q has {heads} heads and K/V have {heads_kv}: query heads must be a positive multiple of key/value heads"
            ),
            Error::NegativeStride { operand, axis, stride } => {
                write!(f, "{operand:?} has negative {} stride {stride}", axis_name(*axis))
            }
            Error::OutOfBounds { operand, needed, len } => write!(
                f,
                "{operand:?}'s layout reaches {needed} elements into its buffer, which holds {len}"
            ),
            Error::OffsetOverflow { operand } => {
                write!(f, "{operand:?}'s layout addresses offsets beyond the kernel's 64-bit indexing")
            }
            Error::TooLarge { what, value, max } => write!(f, "{what} = {value} exceeds the maximum {max}"),
            Error::Scale { scale } => write!(f, "the softmax scale must be positive and finite, got {scale}"),
            Error::LseTooSmall { len, needed } => {
                write!(f, "the LSE buffer holds {len} floats but the launch writes {needed} (batch · heads · q_len, varlen: heads · total_q)")
            }
            Error::ArgCount { expected, got, signature } => {
                write!(f, "expected {expected} argument(s) ({signature}), got {got}")
            }
            Error::ArgType { name, expected, got } => write!(f, "argument `{name}` must be {expected}, got {got}"),
            Error::TensorTooSmall { name, len, needed } => write!(
                f,
                "tensor `{name}` holds {len} elements but its declared shape needs {needed}"
            ),
            Error::TensorDim(e) => write!(f, "{e}"),
            Error::NoMask { spec } => write!(f, "spec `{spec}` has no mask, so it needs no block mask"),
            Error::WideHeadDims { spec, kernel, qk, v, max } => write!(
                f,
                "spec `{spec}` has head dims {qk}/{v}: the {kernel} kernels take head dims up to {max}; \
                 past that only decode plans (Runtime::decode_plan) run it"
            ),
            Error::NoWorkOrder { spec } => {
                write!(f, "the mask of spec `{spec}` reads no tensor, so its kernels walk a fixed order, not a work order")
            }
            Error::NoTensorGrad { tensor } => write!(
                f,
                "tensor `{tensor}` has no gradient: only float tensors the score expression reads with one index list do"
            ),
            Error::TensorGradCount { declared, got } => {
                write!(f, "{got} tensor-gradient slots given but the spec declares {declared} tensor(s)")
            }
            Error::BlockMaskMismatch { what } => {
                write!(f, "the block mask was built for a different {what} than this launch; rebuild it")
            }
            Error::NotACandidate { config, spec, arch } => {
                write!(f, "tile configuration {config} is not a candidate of spec `{spec}` on {arch}")
            }
            Error::Shard(e) => write!(f, "context parallelism: {e}"),
            Error::Ragged(e) => write!(f, "{e}"),
            Error::Dropout(e) => write!(f, "dropout: {e}"),
            Error::E4m3(e) => write!(f, "{e}"),
            Error::Partial { operand, problem } => write!(f, "partials operand `{operand}`: {problem}"),
            Error::Tuning { spec, failures } => {
                write!(f, "autotuning `{spec}`: every tile configuration failed")?;
                failures.iter().try_for_each(|(config, e)| write!(f, "\n{config}: {e}"))
            }
            // `fmt` writes every other variant itself and never calls this with one.
            other => write!(f, "{other:?}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver { source, .. } => Some(source),
            Error::Nvrtc { source, .. } => Some(source),
            Error::Cache { source, .. } | Error::Dump { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn axis_name(axis: Axis) -> &'static str {
    match axis {
        Axis::Batch => "batch",
        Axis::Seq => "seq",
        Axis::Head => "head",
    }
}

impl Error {
    /// A driver error with what was being done, for `map_err`.
    pub fn driver(during: impl Into<String>, source: DriverError) -> Error {
        Error::Driver { during: during.into(), source }
    }

    /// Whether this machine has no usable GPU (no driver or no device): the
    /// one condition under which GPU work may be skipped rather than failed.
    pub fn is_no_gpu(&self) -> bool {
        matches!(self, Error::DriverMissing | Error::NoDevice { .. })
    }
}
