//! flashgen-runtime: compiles generated kernels with NVRTC, caches them per
//! device and launches them after checking every shape, stride and buffer
//! size. The only flashgen crate that touches CUDA.
//!
//! Nothing here panics on bad input or a machine without CUDA: missing
//! libraries, missing GPUs, compile failures and mis-sized buffers are all
//! [`Error`] variants. Set `FLASHGEN_DUMP=<dir>` to keep the generated source
//! and NVRTC log of every compile.
//!
//! Compiled kernels persist in a per-user disk cache ([`DiskCache`]:
//! `$FLASHGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/flashgen`, else
//! `$HOME/.cache/flashgen`; `FLASHGEN_CACHE=off` disables it), so a variant
//! compiles once per machine; [`precompile`] fills it ahead of time without a GPU.
//!
//! The forward kernel comes in a few tile configurations per spec and GPU
//! ([`tile_choice::candidates`]). A launch uses the one [`Runtime::autotune`]
//! found fastest for its [`ShapeClass`] — remembered in memory and in the
//! disk cache's `tuning/` records, so later processes reuse it — else the
//! documented default, [`tile_choice::preferred_for`]. The backward's dK/dV
//! kernel likewise comes in a few tiles ([`Runtime::backward_candidates`]),
//! tuned by [`Runtime::autotune_backward`] and remembered apart. With
//! `FLASHGEN_AUTOTUNE=1` ([`AUTOTUNE_ENV`], or [`Runtime::with_autotune`]) the
//! first forward or dense backward launch of an untuned class tunes on its
//! own buffers.
//!
//! ```no_run
//! use flashgen_runtime::{half::bf16, ForwardIo, Layout, Runtime};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let spec = flashgen_codegen::parse_one("Causal { dtype: bf16, head_dim: 128, mask: q >= k }")?;
//! let rt = Runtime::new(0)?;
//! let layout = Layout::bshd(2, 1024, 16, 128);
//! let (q, k, v) = (rt.stream().alloc_zeros::<bf16>(layout.len())?, rt.stream().alloc_zeros(layout.len())?, rt.stream().alloc_zeros(layout.len())?);
//! let mut o = rt.stream().alloc_zeros::<bf16>(layout.len())?;
//! let io = ForwardIo { q: (&q, layout), k: (&k, layout), v: (&v, layout), o: (&mut o, layout), lse: None };
//! rt.forward(&spec, io, &[], &Default::default())?;
//! rt.stream().synchronize()?;
//! # Ok(())
//! # }
//! ```

// Four layers, the lowest first: a module imports only from its own layer
// and the layers listed before it.
//
// The vocabulary: types, checks and small tools, no CUDA calls.
mod arch;
mod arch_parse;
mod args;
mod atomic_file;
mod check;
mod check_decode;
mod check_decode_varlen;
mod check_paged;
mod check_partials;
mod check_shard;
mod check_varlen;
mod comm_error;
mod cuda_libs;
mod dropout;
mod dropout_error;
mod e4m3_error;
mod element;
mod error;
mod few;
mod kernels;
mod layout;
#[cfg(feature = "dynamic-loading")]
mod lib_search;
#[cfg(all(feature = "dynamic-loading", feature = "nccl"))]
mod nccl_lib;
mod operand;
mod paged;
mod ragged_error;
mod shard_error;
mod single_flight;
mod spec_key;
mod stable_hash;
pub mod tile_choice;

// Launch plumbing: argument values, TMA descriptors, event timing.
mod marshal;
mod scratch;
mod timing;
mod tma;

// Compiling, and what persists: the kernel cache and tuning records.
mod choices;
mod compile_lock;
mod disk_cache;
mod nvrtc;
#[cfg(feature = "dynamic-loading")]
mod nvrtc_lib;
mod nvrtc_phases;
mod tuning;

// One GPU and the launches on it; communicators between GPUs.
mod append_paged;
mod autotune;
mod autotune_backward;
mod backward;
mod backward_varlen;
mod block_mask;
mod bounded_columns;
#[cfg(feature = "nccl")]
mod comm;
pub mod context_parallel;
mod decode;
mod decode_e4m3;
mod decode_paged;
mod decode_tune;
mod decode_varlen;
mod descale;
pub mod e4m3;
mod forward;
mod forward_e4m3;
mod forward_launch;
mod forward_paged;
mod forward_varlen;
mod launch_checks;
mod partials;
mod runtime;

#[cfg(test)]
mod check_props;
#[cfg(test)]
mod host_allocs;
#[cfg(test)]
mod test_dir;

pub use append_paged::PagedAppend;
pub use arch::Arch;
pub use args::ArgValue;
pub use autotune::TuneReport;
pub use backward::{BackwardIo, BackwardOptions, BackwardWorkspace};
pub use backward_varlen::VarlenBackwardIo;
pub use block_mask::BlockMask;
pub use check_decode::DecodeShape;
#[cfg(feature = "nccl")]
pub use comm::{Communicator, UniqueId};
pub use comm_error::CommError;
pub use decode::{DecodeIo, DecodeKv, DecodeOptions, DecodePlan};
pub use decode_paged::PagedDecodeIo;
pub use decode_tune::DecodeTuneReport;
pub use decode_varlen::VarlenDecodeIo;
pub use descale::{Descale, KvDescale, QkvDescale};
pub use disk_cache::{
    precompile, Cleared, DiskCache, Entry, EntryKey, PrecompileReport, CACHE_DIR_ENV, CACHE_ENV, CACHE_MAX_BYTES_ENV,
    DEFAULT_MAX_BYTES,
};
pub use dropout_error::DropoutError;
pub use e4m3_error::E4m3Error;
pub use element::Element;
pub use error::Error;
pub use flashgen_codegen::cuda::KvCacheDtype;
pub use flashgen_codegen::Dropout;
pub use forward_e4m3::ForwardE4m3Io;
pub use forward_launch::{ForwardIo, ForwardOptions};
pub use forward_paged::{PagedIo, PagedQueries};
pub use forward_varlen::{Sequences, VarlenIo};
pub use kernels::{spec_kernels, KernelSet, LoadedKernel};
pub use layout::{Layout, PackedLayout};
pub use nvrtc::{
    compile_count, compile_cubin, compile_cubin_with_log, kernel_resources, nvrtc_version, KernelResources, DUMP_ENV,
};
pub use nvrtc_phases::{compile_phases, CompilePhases};
pub use operand::{DeviceInput, DeviceOutput};
pub use paged::{PagedKv, PagedLayout};
pub use ragged_error::RaggedError;
pub use runtime::{CacheStats, Runtime};
pub use timing::{median_ms, median_ms_after, sustained_median_ms};
pub use tma::TMA_ENV;
pub use tuning::{backward_tile_name, config_name, Candidate, ShapeClass, AUTOTUNE_ENV};
pub use {cudarc, half};
