//! Context parallelism: one attention over a sequence split across ranks
//! ([`Sharding`]), for every spec. Each rank computes *pieces*, its query
//! segments against the key segments the mask keeps any pair of
//! ([`flashgen_codegen::shard::rank_pieces`]), with the ordinary kernels
//! emitted from the spec's shard view (positions and lengths of the whole
//! sequence), and merges them exactly by their LSEs; the backward sums the
//! pieces' gradients in f32.
//!
//! [`Runtime::forward_sharded_local`](crate::Runtime::forward_sharded_local) and
//! [`Runtime::backward_sharded_local`](crate::Runtime::backward_sharded_local)
//! run every rank on one device (the ranks' buffers all there): what a
//! context-parallel launch computes, checkable on one GPU.

#[cfg(feature = "nccl")]
mod exchange;
mod local;
mod pieces;

pub use crate::check_shard::{ShardError, Whole};
use crate::layout::Layout;
use crate::operand::{DeviceInput, DeviceOutput};
use cudarc::driver::CudaSlice;
#[cfg(feature = "nccl")]
pub use exchange::{ContextParallel, Schedule};
use flashgen_codegen::shard::Segment;
pub use flashgen_codegen::shard::{Partition, Sharding};
use flashgen_codegen::Shape;

/// One rank's rows of a forward's operands, segment after segment as
/// [`Sharding::segments`] orders them (each layout's `seq` is the rank's
/// row count), and its LSE: `f32` segment after segment, each `[batch,
/// heads, segment length]`. A rank's backward takes a
/// [`BackwardIo`](crate::BackwardIo) of its rows laid out the same way;
/// a trainable tensor's gradient (whole, f32) is then the rank's share of
/// the sum over ranks.
pub struct ShardIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub k: (&'a dyn DeviceInput<T>, Layout),
    pub v: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: &'a mut CudaSlice<f32>,
}

/// `layout`'s rows of `segment` (a rank's buffer holds its segments back to back).
pub(crate) fn segment_rows(layout: Layout, segment: Segment) -> Layout {
    let offset = layout.offset as i64 + segment.local as i64 * layout.strides[1];
    Layout { seq: segment.len, offset: usize::try_from(offset).unwrap_or(usize::MAX), ..layout }
}

/// Where segment `segment`'s rows start in a rank's LSE (`[batch, heads, len]` per segment).
pub(crate) fn lse_offset(shape: &Shape, segment: Segment) -> usize {
    shape.batch * shape.heads * segment.local
}
