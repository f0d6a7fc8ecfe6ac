//! The kernel's argument list: launch order, C names and C types.
//!
//! [`forward_args`] is the single source of the ABI order; the emitter prints
//! the C signature from the list it returns, and the runtime marshals from the
//! same list. Names are fixed for the attention operands and prefixed for spec
//! declarations (`p_window`, `t_slopes`), so a spec name can never collide
//! with a kernel local or a C keyword.

use crate::abi::{ArgKind, Axis, DropoutArg, KernelArg, Operand, Partial, Side};
use crate::cuda::tile_config::TileCopy;
use crate::spec::{ElemTy, Spec, Ty};

/// Q, K, V, O pointers; lse; sizes; 12 strides; scale; params; tensors; a
/// mask's block mask; a persistent kernel's (`persistent`: how it copies)
/// work counter, work order (under a data-dependent mask) and, copying with
/// TMA, its descriptors.
pub(super) fn forward_args(spec: &Spec, persistent: Option<TileCopy>) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = FORWARD_OPERANDS.map(ArgKind::Ptr).to_vec();
    kinds.extend([ArgKind::Lse, ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv, ArgKind::QLen, ArgKind::KvLen]);
    kinds.extend(strides(FORWARD_OPERANDS));
    // The items' claim order under a data-dependent mask.
    let work_order = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
    forward_tail(spec, kinds, persistent, work_order)
}

/// A varlen forward's arguments: as [`forward_args`]', with the sequences'
/// prefix sums, longest lengths and token counts for the lengths, each
/// operand's token and head strides (no batch axis), and no work order. A
/// persistent kernel copying with TMA takes ragged descriptors of Q, K, V
/// and O (`library/tma_ragged.cuh`: rows past a sequence's end lie outside
/// them, so no box reads or writes another sequence's tokens).
pub(super) fn forward_varlen_args(spec: &Spec, persistent: Option<TileCopy>) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = FORWARD_OPERANDS.map(ArgKind::Ptr).to_vec();
    kinds.extend([ArgKind::Lse, ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv]);
    for side in [Side::Queries, Side::Keys] {
        kinds.extend([ArgKind::CuSeqlens(side), ArgKind::MaxLen(side), ArgKind::Tokens(side)]);
    }
    kinds.extend(FORWARD_OPERANDS.into_iter().flat_map(|op| [Axis::Seq, Axis::Head].map(|a| ArgKind::Stride(op, a))));
    forward_tail(spec, kinds, persistent, false)
}

/// A paged forward's arguments: as [`forward_varlen_args`]', the keys'
/// prefix sums and token count replaced by the per-sequence K/V lengths and
/// the block table with its sizes, and K's and V's strides by their page,
/// row and head strides. Copying with TMA, the kernel also takes the keys
/// per box of a page (`library/paged_tma.cuh`).
pub(super) fn forward_paged_args(spec: &Spec, persistent: Option<TileCopy>) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = FORWARD_OPERANDS.map(ArgKind::Ptr).to_vec();
    kinds.extend([ArgKind::Lse, ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv]);
    kinds.extend([ArgKind::CuSeqlens(Side::Queries), ArgKind::MaxLen(Side::Queries), ArgKind::Tokens(Side::Queries)]);
    kinds.extend([ArgKind::KvLens, ArgKind::MaxLen(Side::Keys), ArgKind::BlockTable, ArgKind::PagesPerSeq]);
    kinds.extend([ArgKind::PageSize, ArgKind::NumPages]);
    for op in FORWARD_OPERANDS {
        if matches!(op, Operand::K | Operand::V) {
            kinds.push(ArgKind::PageStride(op));
        }
        kinds.extend([Axis::Seq, Axis::Head].map(|a| ArgKind::Stride(op, a)));
    }
    if persistent == Some(TileCopy::Tma) {
        kinds.push(ArgKind::KvBoxRows);
    }
    forward_tail(spec, kinds, persistent, false)
}

/// The paged append: new K and V rows, the caches; the sequences (prefix
/// sums of new rows, the most of them, their total; lengths before the
/// append); the block table and its sizes; what it reports (lengths after,
/// dropped rows); the strides of the new rows and of the caches.
pub(super) fn paged_append_args(spec: &Spec) -> Vec<KernelArg> {
    const KV: [Operand; 2] = [Operand::K, Operand::V];
    let mut kinds: Vec<ArgKind> = KV.map(ArgKind::NewRows).to_vec();
    kinds.extend(KV.map(ArgKind::Cache));
    kinds.extend([ArgKind::Batch, ArgKind::HeadsKv]);
    kinds.extend([ArgKind::CuSeqlens(Side::Keys), ArgKind::MaxLen(Side::Keys), ArgKind::Tokens(Side::Keys)]);
    kinds.extend([ArgKind::KvLens, ArgKind::BlockTable, ArgKind::PagesPerSeq, ArgKind::PageSize, ArgKind::NumPages]);
    kinds.extend([ArgKind::NewKvLens, ArgKind::Dropped]);
    for op in KV {
        kinds.extend([Axis::Seq, Axis::Head].map(|a| ArgKind::NewRowStride(op, a)));
        kinds.push(ArgKind::PageStride(op));
        kinds.extend([Axis::Seq, Axis::Head].map(|a| ArgKind::Stride(op, a)));
    }
    named(spec, kinds)
}

const FORWARD_OPERANDS: [Operand; 4] = [Operand::Q, Operand::K, Operand::V, Operand::O];

/// `kinds`, then a forward's arguments from the scale on (see
/// [`forward_args`]), the work order where `work_order` and persistent.
fn forward_tail(
    spec: &Spec,
    mut kinds: Vec<ArgKind>,
    persistent: Option<TileCopy>,
    work_order: bool,
) -> Vec<KernelArg> {
    kinds.push(ArgKind::Scale);
    kinds.extend((0..spec.params.len()).map(ArgKind::Param));
    kinds.extend((0..spec.tensors.len()).map(ArgKind::Tensor));
    if spec.mask.is_some() {
        kinds.extend([ArgKind::BlockMask, BLOCK_MASK_BATCH_STRIDE, BLOCK_MASK_HEAD_STRIDE]);
    }
    if persistent.is_some() {
        kinds.push(ArgKind::WorkCounter);
        if work_order {
            kinds.push(ArgKind::WorkOrder);
        }
    }
    let args = named(spec, kinds);
    match persistent {
        Some(TileCopy::Tma) => with_tensor_maps(spec, args, &FORWARD_OPERANDS),
        _ => args,
    }
}

/// A kernel's arguments `args`, followed by the dropout mask's
/// ([`ArgKind::Dropout`]) where `dropout`.
pub(super) fn with_dropout(spec: &Spec, mut args: Vec<KernelArg>, dropout: bool) -> Vec<KernelArg> {
    if dropout {
        args.extend(named(spec, DropoutArg::ALL.map(ArgKind::Dropout).to_vec()));
    }
    args
}

/// A kernel's arguments `args` followed by TMA descriptors of `ops` (see
/// [`ArgKind::TensorMap`]).
pub(super) fn with_tensor_maps(spec: &Spec, mut args: Vec<KernelArg>, ops: &[Operand]) -> Vec<KernelArg> {
    args.extend(named(spec, ops.iter().map(|&op| ArgKind::TensorMap(op)).collect()));
    args
}

const BLOCK_MASK_BATCH_STRIDE: ArgKind = ArgKind::BlockMaskStride(Axis::Batch);
const BLOCK_MASK_HEAD_STRIDE: ArgKind = ArgKind::BlockMaskStride(Axis::Head);

/// Sizes; params; tensors; the output classes.
pub(super) fn block_mask_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds = vec![ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv, ArgKind::QLen, ArgKind::KvLen];
    kinds.extend((0..spec.params.len()).map(ArgKind::Param));
    kinds.extend((0..spec.tensors.len()).map(ArgKind::Tensor));
    kinds.push(ArgKind::BlockMaskOut);
    named(spec, kinds)
}

/// The backward preprocess: O, dO, D, the dQ accumulator it zeroes (null in
/// the deterministic mode); sizes; O's and dO's strides. Where it computes a
/// sink's gradient (`sink_grads`, the slots it trains): also the LSE, the
/// sizes tensor dims may name, params, tensors and those tensors' gradients.
pub(super) fn backward_pre_args(spec: &Spec, sink_grads: &[usize]) -> Vec<KernelArg> {
    let mut kinds = vec![ArgKind::Ptr(Operand::O), ArgKind::Ptr(Operand::DO), ArgKind::Delta, ArgKind::DqAccum];
    kinds.extend([ArgKind::Batch, ArgKind::Heads, ArgKind::QLen]);
    kinds.extend(strides([Operand::O, Operand::DO]));
    if !sink_grads.is_empty() {
        kinds.extend([ArgKind::Lse, ArgKind::HeadsKv, ArgKind::KvLen]);
        kinds.extend((0..spec.params.len()).map(ArgKind::Param));
        kinds.extend((0..spec.tensors.len()).map(ArgKind::Tensor));
        kinds.extend(sink_grads.iter().map(|&i| ArgKind::TensorGrad(i)));
    }
    named(spec, kinds)
}

/// The backward gradient kernels (dK/dV, and the deterministic dQ): the
/// operands `ops` then LSE, D and, unless the kernel writes dQ itself (DQ in
/// `ops`), the dQ accumulator; sizes; the operands' strides; scale; params;
/// tensors; tensor gradients (`tensor_grads`, the slots that have one); the
/// block mask; a dK/dV kernel's key order.
pub(super) fn backward_args<const N: usize>(spec: &Spec, ops: [Operand; N], tensor_grads: &[usize]) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = ops.map(ArgKind::Ptr).to_vec();
    kinds.extend([ArgKind::Lse, ArgKind::Delta]);
    if !ops.contains(&Operand::DQ) {
        kinds.push(ArgKind::DqAccum);
    }
    kinds.extend([ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv, ArgKind::QLen, ArgKind::KvLen]);
    kinds.extend(strides(ops));
    kinds.push(ArgKind::Scale);
    kinds.extend((0..spec.params.len()).map(ArgKind::Param));
    kinds.extend((0..spec.tensors.len()).map(ArgKind::Tensor));
    kinds.extend(tensor_grads.iter().map(|&i| ArgKind::TensorGrad(i)));
    if spec.mask.is_some() {
        kinds.extend([ArgKind::BlockMask, BLOCK_MASK_BATCH_STRIDE, BLOCK_MASK_HEAD_STRIDE]);
    }
    // The dK/dV kernels' CTA order under a data-dependent mask.
    if ops.contains(&Operand::DK) && spec.mask.as_ref().is_some_and(|m| m.reads_tensor()) {
        kinds.push(ArgKind::WorkOrder);
    }
    named(spec, kinds)
}

/// A work-order kernel: the block mask it reads; sizes; its output.
pub(super) fn work_order_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds = vec![ArgKind::BlockMask, BLOCK_MASK_BATCH_STRIDE, BLOCK_MASK_HEAD_STRIDE];
    kinds.extend([ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv, ArgKind::QLen, ArgKind::KvLen, ArgKind::WorkOrder]);
    named(spec, kinds)
}

/// `args` with the dQ accumulator's tickets after the accumulator, where it
/// has them (`tickets`: a Hopper dK/dV kernel's tiles).
pub(super) fn with_dq_tickets(spec: &Spec, mut args: Vec<KernelArg>, tickets: bool) -> Vec<KernelArg> {
    if let (true, Some(at)) = (tickets, args.iter().position(|a| a.kind == ArgKind::DqAccum)) {
        args.insert(at + 1, KernelArg { name: arg_name(spec, ArgKind::DqTickets), kind: ArgKind::DqTickets });
    }
    args
}

/// The backward postprocess: the dQ accumulator, dQ; sizes; dQ's strides; scale.
pub(super) fn backward_post_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds = vec![ArgKind::DqAccum, ArgKind::Ptr(Operand::DQ), ArgKind::Batch, ArgKind::Heads, ArgKind::QLen];
    kinds.extend(strides([Operand::DQ]));
    kinds.push(ArgKind::Scale);
    named(spec, kinds)
}

/// A decode kernel: Q, K, V, O, the LSE; sizes (the cache's rows as the
/// keys' `MaxLen`, which tensors' `KV_LEN` dims are); the per-sequence key
/// counts; the operands' strides; scale, params, tensors; the split count
/// and a split launch's partial results.
pub(super) fn decode_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = FORWARD_OPERANDS.map(ArgKind::Ptr).to_vec();
    kinds.extend([ArgKind::Lse, ArgKind::Batch, ArgKind::Heads, ArgKind::HeadsKv, ArgKind::QLen]);
    kinds.extend([ArgKind::MaxLen(Side::Queries), ArgKind::MaxLen(Side::Keys), ArgKind::KvLens]);
    kinds.extend(strides(FORWARD_OPERANDS));
    kinds.push(ArgKind::Scale);
    kinds.extend((0..spec.params.len()).map(ArgKind::Param));
    kinds.extend((0..spec.tensors.len()).map(ArgKind::Tensor));
    kinds.extend([ArgKind::Splits, ArgKind::PartialO, ArgKind::PartialLse, ArgKind::SplitCounters]);
    named(spec, kinds)
}

/// A paged decode kernel: as [`decode_args`]', with the block table and its
/// sizes after the lengths, and K's and V's batch strides replaced by their
/// page strides (their seq strides are a page's rows').
pub(super) fn decode_paged_args(spec: &Spec) -> Vec<KernelArg> {
    let kinds = decode_args(spec).into_iter().flat_map(|arg| match arg.kind {
        ArgKind::KvLens => {
            vec![arg.kind, ArgKind::BlockTable, ArgKind::PagesPerSeq, ArgKind::PageSize, ArgKind::NumPages]
        }
        ArgKind::Stride(op @ (Operand::K | Operand::V), Axis::Batch) => vec![ArgKind::PageStride(op)],
        kind => vec![kind],
    });
    named(spec, kinds.collect())
}

/// A kernel's arguments `args` with e4m3 `operands` (a decode kernel's K
/// and V, the e4m3 forward's Q, K and V): they are byte pointers, and each
/// has its descale factors and their stride after the softmax scale.
pub(super) fn with_e4m3(spec: &Spec, args: Vec<KernelArg>, operands: &[Operand]) -> Vec<KernelArg> {
    let kinds = args.into_iter().flat_map(|arg| match arg.kind {
        ArgKind::Ptr(op) if operands.contains(&op) => vec![ArgKind::E4m3(op)],
        ArgKind::Scale => std::iter::once(ArgKind::Scale)
            .chain(operands.iter().flat_map(|&op| [ArgKind::Descale(op), ArgKind::DescaleStride(op)]))
            .collect(),
        kind => vec![kind],
    });
    named(spec, kinds.collect())
}

/// The e4m3 forward's V-tile kernel's arguments: V and its strides, the
/// sizes it covers, and the tiles it writes.
pub(super) fn e4m3_v_tiles_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds = vec![ArgKind::E4m3(Operand::V)];
    kinds.extend([Axis::Batch, Axis::Seq, Axis::Head].map(|axis| ArgKind::Stride(Operand::V, axis)));
    kinds.extend([ArgKind::HeadsKv, ArgKind::KvLen, ArgKind::E4m3VTiles]);
    named(spec, kinds)
}

/// A decode kernel's arguments `args` (dense or paged cache) with packed
/// queries: `q_len` becomes the queries' prefix sums and token count (the
/// plan's `max_q_len` is already an argument), and Q and O lose their batch
/// strides (a sequence's rows start at its first token).
pub(super) fn with_packed_queries(spec: &Spec, args: Vec<KernelArg>) -> Vec<KernelArg> {
    let kinds = args.into_iter().flat_map(|arg| match arg.kind {
        ArgKind::QLen => vec![ArgKind::CuSeqlens(Side::Queries), ArgKind::Tokens(Side::Queries)],
        ArgKind::Stride(Operand::Q | Operand::O, Axis::Batch) => Vec::new(),
        kind => vec![kind],
    });
    named(spec, kinds.collect())
}

/// The partials merge kernel: the accumulator, the piece and the output,
/// each with its LSE; the first flag; rows and heads (the grid covers the
/// batch); the three operands' strides.
pub(super) fn merge_partial_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> =
        PARTIALS.into_iter().flat_map(|p| [ArgKind::PartialPtr(p), ArgKind::MergeLse(p)]).collect();
    kinds.extend([ArgKind::First, ArgKind::Rows, ArgKind::Heads]);
    kinds.extend(partial_strides());
    named(spec, kinds)
}

/// The partials add kernel: the accumulator, the piece and the output; the
/// first flag; rows, heads and the columns per row; the operands' strides.
pub(super) fn add_partial_args(spec: &Spec) -> Vec<KernelArg> {
    let mut kinds: Vec<ArgKind> = PARTIALS.map(ArgKind::PartialPtr).to_vec();
    kinds.extend([ArgKind::First, ArgKind::Rows, ArgKind::Heads, ArgKind::Dim]);
    kinds.extend(partial_strides());
    named(spec, kinds)
}

/// The flat f32 add: the accumulator, the piece; the first flag; the
/// element count.
pub(super) fn add_f32_args(spec: &Spec) -> Vec<KernelArg> {
    let kinds = [Partial::Acc, Partial::PieceF32].map(ArgKind::PartialPtr);
    named(spec, [kinds.as_slice(), &[ArgKind::First, ArgKind::Elements]].concat())
}

const PARTIALS: [Partial; 3] = [Partial::Acc, Partial::Piece, Partial::Out];

/// Batch, row and head strides of the accumulator, the piece and the output.
fn partial_strides() -> impl Iterator<Item = ArgKind> {
    PARTIALS.into_iter().flat_map(|p| [Axis::Batch, Axis::Seq, Axis::Head].map(|axis| ArgKind::PartialStride(p, axis)))
}

/// A dense backward kernel's arguments `args` in varlen form: each length
/// (`q_len`, `kv_len`) becomes its side's prefix sums, longest length and
/// token count, and the operands lose their batch strides (a sequence's
/// rows start at its first token).
pub(super) fn with_varlen_sizes(spec: &Spec, args: Vec<KernelArg>) -> Vec<KernelArg> {
    let sizes = |side| [ArgKind::CuSeqlens(side), ArgKind::MaxLen(side), ArgKind::Tokens(side)];
    let kinds = args.into_iter().flat_map(|arg| match arg.kind {
        ArgKind::QLen => sizes(Side::Queries).to_vec(),
        ArgKind::KvLen => sizes(Side::Keys).to_vec(),
        ArgKind::Stride(_, Axis::Batch) => Vec::new(),
        kind => vec![kind],
    });
    named(spec, kinds.collect())
}

/// Batch, seq and head strides of each operand.
fn strides<const N: usize>(ops: [Operand; N]) -> impl Iterator<Item = ArgKind> {
    ops.into_iter().flat_map(|op| [Axis::Batch, Axis::Seq, Axis::Head].map(|axis| ArgKind::Stride(op, axis)))
}

fn named(spec: &Spec, kinds: Vec<ArgKind>) -> Vec<KernelArg> {
    kinds.into_iter().map(|kind| KernelArg { name: arg_name(spec, kind), kind }).collect()
}

/// The C names of the arguments that emitters name in kernel text; each is
/// defined here once and used by name there.
pub(crate) mod names {
    pub const BLOCK_MASK: &str = "block_mask";
    pub const BLOCK_MASK_BATCH_STRIDE: &str = "block_mask_batch_stride";
    pub const BLOCK_MASK_HEAD_STRIDE: &str = "block_mask_head_stride";
    pub const DELTA: &str = "delta";
    pub const DQ_ACCUM: &str = "dq_accum";
    pub const DQ_TICKETS: &str = "dq_tickets";
    pub const Q_MAP: &str = "q_map";
    pub const K_MAP: &str = "k_map";
    pub const V_MAP: &str = "v_map";
    pub const O_MAP: &str = "o_map";
    pub const DOUT_MAP: &str = "dout_map";
    pub const CU_SEQLENS_Q: &str = "cu_seqlens_q";
    pub const CU_SEQLENS_K: &str = "cu_seqlens_k";
    pub const MAX_Q_LEN: &str = "max_q_len";
    pub const MAX_KV_LEN: &str = "max_kv_len";
    pub const TOTAL_Q: &str = "total_q";
    pub const TOTAL_KV: &str = "total_kv";
    pub const KV_LENS: &str = "kv_lens";
    pub const BLOCK_TABLE: &str = "block_table";
    pub const PAGES_PER_SEQ: &str = "pages_per_seq";
    pub const PAGE_SIZE: &str = "page_size";
    pub const KV_BOX_ROWS: &str = "kv_box_rows";
    pub const NUM_PAGES: &str = "num_pages";
    pub const NEW_KV_LENS: &str = "new_kv_lens";
    pub const DROPPED: &str = "dropped";
    pub const SPLITS: &str = "num_splits";
    pub const PARTIAL_O: &str = "partial_o";
    pub const PARTIAL_LSE: &str = "partial_lse";
    pub const SPLIT_COUNTERS: &str = "split_counters";
    pub const FIRST: &str = "first";
    pub const ROWS: &str = "rows";
    pub const DIM: &str = "dim";
    pub const ELEMENTS: &str = "n";
}

/// The C name of an argument, e.g. `k_seq_stride` or `p_window`.
pub(super) fn arg_name(spec: &Spec, kind: ArgKind) -> String {
    match kind {
        ArgKind::Ptr(op) | ArgKind::E4m3(op) => format!("{}_ptr", operand(op)),
        ArgKind::Descale(op) => format!("{}_descale", operand(op)),
        ArgKind::DescaleStride(op) => format!("{}_descale_stride", operand(op)),
        ArgKind::E4m3VTiles => "v_tiles_out".into(),
        ArgKind::Lse => "lse".into(),
        ArgKind::Batch => "batch".into(),
        ArgKind::Heads => "heads".into(),
        ArgKind::HeadsKv => "heads_kv".into(),
        ArgKind::QLen => "q_len".into(),
        ArgKind::KvLen => "kv_len".into(),
        ArgKind::Stride(op, axis) => format!("{}_{}_stride", operand(op), axis_name(axis)),
        ArgKind::Scale => "scale".into(),
        ArgKind::Param(i) => format!("p_{}", spec.params[i].name),
        ArgKind::Tensor(i) => format!("t_{}", spec.tensors[i].name),
        ArgKind::BlockMask => names::BLOCK_MASK.into(),
        BLOCK_MASK_BATCH_STRIDE => names::BLOCK_MASK_BATCH_STRIDE.into(),
        ArgKind::BlockMaskStride(_) => names::BLOCK_MASK_HEAD_STRIDE.into(),
        ArgKind::BlockMaskOut => "block_mask_out".into(),
        ArgKind::Delta => names::DELTA.into(),
        ArgKind::DqAccum => names::DQ_ACCUM.into(),
        ArgKind::DqTickets => names::DQ_TICKETS.into(),
        ArgKind::TensorGrad(i) => format!("dt_{}", spec.tensors[i].name),
        ArgKind::WorkCounter => "work_counter".into(),
        ArgKind::TensorMap(op) => match op {
            Operand::Q => names::Q_MAP.into(),
            Operand::K => names::K_MAP.into(),
            Operand::V => names::V_MAP.into(),
            Operand::O => names::O_MAP.into(),
            Operand::DO => names::DOUT_MAP.into(),
            _ => format!("{}_map", operand(op)),
        },
        ArgKind::WorkOrder => "work_order".into(),
        ArgKind::CuSeqlens(Side::Queries) => names::CU_SEQLENS_Q.into(),
        ArgKind::CuSeqlens(Side::Keys) => names::CU_SEQLENS_K.into(),
        ArgKind::MaxLen(Side::Queries) => names::MAX_Q_LEN.into(),
        ArgKind::MaxLen(Side::Keys) => names::MAX_KV_LEN.into(),
        ArgKind::Tokens(Side::Queries) => names::TOTAL_Q.into(),
        ArgKind::Tokens(Side::Keys) => names::TOTAL_KV.into(),
        ArgKind::KvLens => names::KV_LENS.into(),
        ArgKind::BlockTable => names::BLOCK_TABLE.into(),
        ArgKind::PagesPerSeq => names::PAGES_PER_SEQ.into(),
        ArgKind::PageSize => names::PAGE_SIZE.into(),
        ArgKind::KvBoxRows => names::KV_BOX_ROWS.into(),
        ArgKind::NumPages => names::NUM_PAGES.into(),
        ArgKind::PageStride(op) => format!("{}_page_stride", operand(op)),
        ArgKind::NewRows(op) => format!("new_{}", operand(op)),
        ArgKind::NewRowStride(op, axis) => format!("new_{}", arg_name(spec, ArgKind::Stride(op, axis))),
        ArgKind::Cache(op) => format!("{}_cache", operand(op)),
        ArgKind::NewKvLens => names::NEW_KV_LENS.into(),
        ArgKind::Dropped => names::DROPPED.into(),
        ArgKind::Splits => names::SPLITS.into(),
        ArgKind::PartialO => names::PARTIAL_O.into(),
        ArgKind::PartialLse => names::PARTIAL_LSE.into(),
        ArgKind::SplitCounters => names::SPLIT_COUNTERS.into(),
        ArgKind::PartialPtr(p) => format!("{}_ptr", partial(p)),
        ArgKind::PartialStride(p, axis) => format!("{}_{}_stride", partial(p), axis_name(axis)),
        ArgKind::MergeLse(p) => format!("{}_lse", partial(p)),
        ArgKind::First => names::FIRST.into(),
        ArgKind::Rows => names::ROWS.into(),
        ArgKind::Dim => names::DIM.into(),
        ArgKind::Elements => names::ELEMENTS.into(),
        ArgKind::Dropout(part) => match part {
            DropoutArg::Seed => "dropout_seed".into(),
            DropoutArg::Offset => "dropout_offset".into(),
            DropoutArg::Threshold => "dropout_threshold".into(),
            DropoutArg::Scale => "dropout_scale".into(),
        },
    }
}

/// The C type of an argument. Q/K/V/O hold raw 16-bit patterns.
pub(super) fn arg_type(spec: &Spec, kind: ArgKind) -> String {
    match kind {
        ArgKind::Ptr(Operand::O | Operand::DQ | Operand::DK | Operand::DV) => "unsigned short* __restrict__".into(),
        ArgKind::Ptr(_) | ArgKind::NewRows(_) => "const unsigned short* __restrict__".into(),
        ArgKind::Cache(_) => "unsigned short* __restrict__".into(),
        ArgKind::NewKvLens => "int* __restrict__".into(),
        ArgKind::Dropped => "unsigned int* __restrict__".into(),
        ArgKind::Lse | ArgKind::Delta | ArgKind::DqAccum | ArgKind::TensorGrad(_) => "float* __restrict__".into(),
        ArgKind::Batch | ArgKind::Heads | ArgKind::HeadsKv | ArgKind::QLen | ArgKind::KvLen => "int".into(),
        ArgKind::MaxLen(_) | ArgKind::Tokens(_) | ArgKind::Splits => "int".into(),
        ArgKind::PagesPerSeq | ArgKind::PageSize | ArgKind::KvBoxRows | ArgKind::NumPages => "int".into(),
        ArgKind::CuSeqlens(_) | ArgKind::KvLens | ArgKind::BlockTable => "const int* __restrict__".into(),
        ArgKind::PartialO | ArgKind::PartialLse => "float* __restrict__".into(),
        ArgKind::SplitCounters | ArgKind::DqTickets => "unsigned int* __restrict__".into(),
        ArgKind::E4m3(_) => "const unsigned char* __restrict__".into(),
        ArgKind::E4m3VTiles => "unsigned char* __restrict__".into(),
        ArgKind::Descale(_) => "const float* __restrict__".into(),
        ArgKind::DescaleStride(_) => "int".into(),
        ArgKind::Stride(..) | ArgKind::BlockMaskStride(_) | ArgKind::PageStride(_) | ArgKind::NewRowStride(..) => {
            "long long".into()
        }
        ArgKind::BlockMask => "const unsigned char* __restrict__".into(),
        ArgKind::BlockMaskOut => "unsigned char* __restrict__".into(),
        ArgKind::Scale | ArgKind::Dropout(DropoutArg::Scale) => "float".into(),
        ArgKind::Dropout(DropoutArg::Seed | DropoutArg::Offset) => "unsigned long long".into(),
        ArgKind::Dropout(DropoutArg::Threshold) => "unsigned".into(),
        ArgKind::Param(i) => c_type(spec.params[i].ty).into(),
        ArgKind::Tensor(i) => format!("const {}* __restrict__", elem_type(spec.tensors[i].elem)),
        ArgKind::WorkCounter => "unsigned long long* __restrict__".into(),
        ArgKind::TensorMap(_) => "const __grid_constant__ TensorMap".into(),
        ArgKind::WorkOrder => "int* __restrict__".into(),
        ArgKind::PartialPtr(Partial::Acc) | ArgKind::MergeLse(Partial::Acc | Partial::Out) => {
            "float* __restrict__".into()
        }
        ArgKind::PartialPtr(Partial::PieceF32) | ArgKind::MergeLse(_) => "const float* __restrict__".into(),
        ArgKind::PartialPtr(Partial::Piece) => "const unsigned short* __restrict__".into(),
        ArgKind::PartialPtr(Partial::Out) => "unsigned short* __restrict__".into(),
        ArgKind::PartialStride(..) => "long long".into(),
        ArgKind::First | ArgKind::Rows | ArgKind::Dim | ArgKind::Elements => "int".into(),
    }
}

fn axis_name(axis: Axis) -> &'static str {
    match axis {
        Axis::Batch => "batch",
        Axis::Seq => "seq",
        Axis::Head => "head",
    }
}

/// The C name of a partials kernel's operand.
fn partial(p: Partial) -> &'static str {
    match p {
        Partial::Acc => "acc",
        Partial::Piece | Partial::PieceF32 => "piece",
        Partial::Out => "out",
    }
}

fn operand(op: Operand) -> &'static str {
    match op {
        Operand::Q => "q",
        Operand::K => "k",
        Operand::V => "v",
        Operand::O => "o",
        Operand::DO => "dout",
        Operand::DQ => "dq",
        Operand::DK => "dk",
        Operand::DV => "dv",
    }
}

/// The C type of an expression type.
pub(crate) fn c_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Bool => "bool",
        Ty::I32 => "int",
        Ty::F32 => "float",
    }
}

/// The C type a tensor element is stored as.
fn elem_type(elem: ElemTy) -> &'static str {
    match elem {
        ElemTy::I32 => "int",
        ElemTy::F32 => "float",
        ElemTy::F16 | ElemTy::Bf16 => "unsigned short",
    }
}
