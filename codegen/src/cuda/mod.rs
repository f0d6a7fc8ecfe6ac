//! CUDA C++ emission: a checked [`Spec`](crate::Spec) → one self-contained
//! kernel plus the [`abi::Kernel`](crate::abi::Kernel) that tells the runtime
//! how to launch it.
//!
//! Design:
//! - Every source is standalone text for NVRTC: nothing is `#include`d (the
//!   PyPI NVRTC ships no toolkit headers), so `prelude` spells out the 16-bit
//!   float conversions and the spec language's scalar semantics.
//! - Generated code reads like hand-written ThunderKittens-style CUDA: named
//!   row/tile helpers from the prelude, and a kernel body whose comments say
//!   which tile is where and why.
//! - `signature` owns the argument list; the C signature is printed from the
//!   same `Vec<KernelArg>` the runtime walks, so the order lives in one place.
//! - Output is a pure function of the spec: no maps, no hashing, no
//!   environment, so sources are byte-identical across runs and snapshots.

mod backward;
mod block_mask;
mod decode;
mod e4m3_v_tiles;
mod forward;
mod kit;
pub mod library;
mod paged_append;
mod partials;
mod signature;
mod source;
mod target;
mod tile_config;
mod work_order;
mod writer;

pub use backward::{
    emit_backward, emit_backward_varlen, emit_backward_with, trainable_tensors, BackwardConfig, BackwardPass,
    BackwardTile, DqAccum, DqOrder, KeyColumns,
};
pub use block_mask::emit_block_mask;
pub use decode::{
    emit_decode, emit_decode_paged, emit_decode_with, split_candidates, split_count, DecodeCache, DecodeConfig,
    DecodeQueries, DecodeUnfit, KvCacheDtype, SplitLaunch, WarpSplit, DECODE_BLOCK_N, DECODE_COLUMNS_BLOCK_N,
    DECODE_WARPS, MAX_SPLITS,
};
pub use e4m3_v_tiles::{e4m3_v_row, emit_e4m3_v_tiles};
pub use forward::{
    columns_apart, e4m3_supports, emit_forward, emit_forward_copying, emit_forward_dropout, emit_forward_e4m3,
    emit_forward_paged, emit_forward_traced, emit_forward_varlen, emit_forward_with, is_light, per_warpgroup_classes,
    ColumnsParam,
};
pub use paged_append::emit_paged_append;
pub use partials::{emit_add_f32, emit_add_partial, emit_merge_partial};
pub use target::{Mma, Target};
pub use tile_config::TileCopy;
pub use tile_config::{TileConfig, TALL_PAIR};
pub use work_order::{emit_work_order, Work, BUCKETS, HEADS_PER_BLOCK};
