//! flashgen-codegen: spec → checked IR → CUDA C++.
//!
//! Pure by design: no GPU, no file or network I/O. The front end
//! ([`syntax`]) parses and type-checks specs; [`grad`] differentiates score
//! expressions; [`reference`](mod@reference) interprets them in f64 on the CPU; [`cuda`]
//! emits kernels described by [`abi::Kernel`].

pub mod abi;
pub mod analysis;
pub mod cuda;
pub mod dropout;
pub mod error;
pub mod grad;
pub mod index_check;
pub mod mask_parts;
pub mod paged;
pub mod parallel;
pub mod reference;
pub mod shard;
pub mod spec;
mod spec_eq;
pub mod syntax;
pub mod varlen;

pub use dropout::Dropout;
pub use error::SpecError;
pub use spec::*;
pub use syntax::{parse_one, parse_str, parse_tokens, to_source};

/// Bumped whenever generated code changes meaning or ABI; part of every
/// kernel cache key.
pub const CODEGEN_VERSION: u32 = 1;
