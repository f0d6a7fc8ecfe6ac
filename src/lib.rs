//! flashgen: fast, exact attention kernels for any attention variant.
//!
//! Describe a variant with [`attention!`] (or a `.attn` string parsed with
//! [`parse_str`]); flashgen generates a tiled FlashAttention CUDA kernel for
//! it, compiles it with NVRTC for the GPU at hand and launches it with checked
//! shapes.
//!
//! ```ignore
//! flashgen::attention! {
//!     /// Causal sliding window.
//!     pub Window {
//!         dtype: bf16, head_dim: 128,
//!         param window: i32,
//!         mask: q >= k && q - k < window,
//!     }
//! }
//! let rt = flashgen::Runtime::new(0)?;
//! Window::forward(&rt, io, &WindowArgs { window: 1024 }, &Default::default())?;
//! ```

pub use flashgen_codegen as codegen;
pub use flashgen_codegen::{parse_one, parse_str, to_source, Dtype, Shape, Spec, SpecError};
pub use flashgen_dsl::attention;
pub use flashgen_runtime as runtime;
pub use flashgen_runtime::{context_parallel, cudarc, half};
pub use flashgen_runtime::{
    ArgValue, BackwardIo, BackwardOptions, BackwardWorkspace, BlockMask, DecodeIo, DecodeKv, DecodeOptions, DecodePlan,
    DecodeShape, DecodeTuneReport, Descale, DeviceInput, DeviceOutput, Dropout, DropoutError, E4m3Error, Element,
    Error, ForwardE4m3Io, ForwardIo, ForwardOptions, KernelSet, KvCacheDtype, KvDescale, Layout, PackedLayout,
    PagedAppend, PagedDecodeIo, PagedIo, PagedKv, PagedLayout, PagedQueries, QkvDescale, Runtime, Sequences,
    TuneReport, VarlenBackwardIo, VarlenDecodeIo, VarlenIo,
};
