//! The contract between a generated kernel and the runtime that launches it.
//!
//! The emitter describes each kernel it writes as a [`Kernel`]: entry point,
//! launch geometry and the meaning of every argument in order. The runtime
//! marshals arguments by walking [`Kernel::args`], so the argument order lives
//! in exactly one place: the emitter.

/// One of the attention operands: the forward's four, and the backward's
/// incoming gradient dO and its outputs dQ, dK, dV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    Q,
    K,
    V,
    O,
    DO,
    DQ,
    DK,
    DV,
}

/// A strided axis of an operand (the head-dim axis is always contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Axis {
    Batch,
    Seq,
    Head,
}

/// What one kernel argument carries. Pointers are device addresses (u64);
/// strides are i64 element counts; sizes are i32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgKind {
    /// Base pointer of an operand.
    Ptr(Operand),
    /// `float*` row log-sum-exp output `[batch, heads, q_len]` (a varlen
    /// kernel's: `[heads, total_q]`, FlashAttention's), or null.
    Lse,
    Batch,
    Heads,
    HeadsKv,
    QLen,
    KvLen,
    Stride(Operand, Axis),
    /// The softmax scale (`score = scale · q·k`), as f32.
    Scale,
    /// The spec's `i`-th runtime param, as i32 or f32.
    Param(usize),
    /// Base pointer of the spec's `i`-th captured tensor.
    Tensor(usize),
    /// `const unsigned char*` tile classes of a built block mask
    /// `[batch', heads', q_tiles, kv_tiles]` (0 empty, 1 partial, 2 full), or
    /// null: the forward kernel then relies on interval analysis alone.
    BlockMask,
    /// Element stride of the block mask's batch or head axis; 0 where the
    /// mask does not depend on it (one slice broadcast to all).
    BlockMaskStride(Axis),
    /// `unsigned char*` output of the block-mask kernel.
    BlockMaskOut,
    /// `float*` D = rowsum(dO ∘ O) `[batch, heads, q_len]`: the backward
    /// preprocess writes it, the gradient kernels read it.
    Delta,
    /// `float*` dQ accumulator `[batch, heads, q_len, head_dims.qk]` of the
    /// dK/dV kernel and the postprocess, zeroed by the preprocess;
    /// null in the deterministic mode, where a separate kernel computes dQ.
    DqAccum,
    /// `unsigned int*` one ticket per tile of a Hopper dK/dV kernel's dQ
    /// accumulator (`library/dq_tickets.cuh`): the preprocess zeroes them
    /// instead of the accumulator, the first CTA at a step stores its dQ
    /// tiles and the rest add to them, and the postprocess writes 0 for rows
    /// no CTA stored. Null where the accumulator is zeroed instead.
    DqTickets,
    /// `float*` gradient of the spec's `i`-th captured tensor (its element
    /// count, zeroed before the pass), or null when not requested.
    TensorGrad(usize),
    /// `unsigned long long*` a persistent kernel's work counter, two words:
    /// how many work items its CTAs have claimed beyond their first ones,
    /// and how many CTAs are done claiming. Zero before the first launch;
    /// each launch leaves it zero.
    WorkCounter,
    /// `const __grid_constant__ TensorMap`: a TMA descriptor (CUtensorMap)
    /// of Q, K, V, O or dO as `[batch, seq, heads, dim]`, copied in boxes of
    /// [`TmaBox::of`], with the 128-byte swizzle. Only kernels
    /// generated to copy with TMA take them (`cuda::TileCopy`).
    TensorMap(Operand),
    /// `const int*` a varlen launch's prefix sums of its sequences' query
    /// (Q and O tokens) or key (K and V tokens) counts, `i32[batch + 1]`
    /// on the device. Kernels clamp what they read into the buffers.
    CuSeqlens(Side),
    /// A varlen launch's longest sequence of queries or keys: the grid
    /// covers its query tiles, and tensors' `Q_LEN` / `KV_LEN` dims are these.
    MaxLen(Side),
    /// A varlen launch's tokens in Q and O, or in K and V: what sequences
    /// are clamped into, and (queries) the LSE's row count.
    Tokens(Side),
    /// `const int*` a paged or decode launch's K/V length of each sequence,
    /// `i32[batch]` on the device, read each launch (so a captured CUDA graph
    /// replays with new lengths); kernels clamp each into the cache.
    KvLens,
    /// `const int*` a paged launch's block table `i32[batch,
    /// pages_per_seq]`: the page ids of each sequence's keys, in order, on
    /// the device; kernels clamp each id into `[0, num_pages)`.
    BlockTable,
    /// Columns of the block table: the most pages one sequence holds.
    PagesPerSeq,
    /// Rows (keys) per page.
    PageSize,
    /// Pages in the K and V caches.
    NumPages,
    /// Keys per TMA box of a paged kernel copying with TMA (a tile's rows;
    /// a page's where tiles are whole pages: `library/paged_tma.cuh`).
    KvBoxRows,
    /// Element stride between the pages of a K or V cache (`Stride(op,
    /// Axis::Seq)` is its rows', `Stride(op, Axis::Head)` its heads').
    PageStride(Operand),
    /// `const unsigned short*` the append kernel's new K or V rows, packed
    /// `[tokens, heads_kv, dim]` (split into sequences by `CuSeqlens(Keys)`).
    NewRows(Operand),
    /// Element stride of the new K or V rows' token (`Axis::Seq`) or head axis.
    NewRowStride(Operand, Axis),
    /// `unsigned short*` the append kernel's K or V cache, written (its
    /// strides: `PageStride` and `Stride(op, Seq | Head)`).
    Cache(Operand),
    /// `int*` the append kernel's lengths after the append, `i32[batch]`,
    /// or null.
    NewKvLens,
    /// `unsigned int*` the append kernel's count of rows dropped past a
    /// sequence's pages, added to; or null.
    Dropped,
    /// `int*` a work order under a data-dependent mask: the dK/dV kernel's
    /// CTAs or a persistent forward's items, longest first within windows of
    /// a few heads, as their indices in launch (claim) order, then each
    /// unit's count of visited mask tiles. A work-order
    /// kernel writes it from a block mask; the others read it (null: launch
    /// order).
    WorkOrder,
    /// A decode launch's split count: the CTAs each sequence's keys are
    /// divided among (1: the kernel writes O and the LSE itself).
    Splits,
    /// `float*` a split decode's partial O `[splits, batch, heads, q_len,
    /// head_dims.v]`, each split's rows normalized by their own sums.
    PartialO,
    /// `float*` a split decode's partial LSE `[splits, batch, heads,
    /// q_len]` (natural log, −∞ for a split without kept keys).
    PartialLse,
    /// `unsigned int*` a split decode's count of finished splits per row
    /// tile `[batch, heads_kv, row tiles]`, zero between launches (the last
    /// split of a tile sets it back).
    SplitCounters,
    /// `const unsigned char*` an e4m3 operand (in place of its `Ptr`): a
    /// decode kernel's K or V cache, the e4m3 forward's Q, K or V; a byte an
    /// element, strides in bytes.
    E4m3(Operand),
    /// `const float*` an e4m3 operand's descale factors on the device:
    /// one for the tensor, or one per K/V head.
    Descale(Operand),
    /// Entries between consecutive K/V heads' descale factors: 0 (one
    /// factor for the tensor) or 1 (one per K/V head).
    DescaleStride(Operand),
    /// `unsigned char*` the e4m3 forward's V tiles (`cuda::e4m3_v_tiles`
    /// writes them, the forward reads them by TMA): `[batch, heads_kv,
    /// ceil(kv_len / 128), pad16(head_dims.v), 128]` bytes.
    E4m3VTiles,
    /// Base pointer of a partials kernel's operand (see [`Partial`]), at
    /// its first element; a piece or an output may be null.
    PartialPtr(Partial),
    /// Element stride of a partials kernel's operand's batch, row or head
    /// axis (its columns are contiguous).
    PartialStride(Partial, Axis),
    /// The merge kernel's LSE of an operand, `f32[batch, heads, rows]`
    /// contiguous (natural log, −∞: nothing kept); null with its operand.
    MergeLse(Partial),
    /// `int` whether a partials kernel's accumulator holds nothing yet: it
    /// is then read as zeros (LSE −∞), never loaded.
    First,
    /// Rows per batch and head of a partials kernel's segment: the launch
    /// shape's `q_len`, which its grid (`Grid::QueryTiles`) covers.
    Rows,
    /// Columns per row of the add kernel: the head dim of the gradient
    /// it sums (dQ, dK or dV).
    Dim,
    /// Elements of the flat f32 add: the launch shape's `q_len`, which its
    /// grid covers.
    Elements,
    /// A dropout kernel's mask ([`crate::dropout`]): seed and offset
    /// (`unsigned long long`), threshold (`unsigned`), scale (`float`).
    Dropout(DropoutArg),
}

/// The parts of [`ArgKind::Dropout`], in the kernels' order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropoutArg {
    Seed,
    Offset,
    Threshold,
    Scale,
}

impl DropoutArg {
    pub const ALL: [DropoutArg; 4] = [DropoutArg::Seed, DropoutArg::Offset, DropoutArg::Threshold, DropoutArg::Scale];
}

/// An operand of the partials kernels, which fold context parallelism's
/// pieces (a query segment against one key segment) into a running sum.
/// Each is `[batch, rows, heads, dim]` with strided batch, row and head axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Partial {
    /// The running sum in f32 (`float*`): read unless `First`, written
    /// where there is no `Out`.
    Acc,
    /// One piece in the spec's storage dtype (`const unsigned short*`), or
    /// null: an empty piece (zeros; LSE −∞).
    Piece,
    /// The sum in the storage dtype (`unsigned short*`), written instead of
    /// the accumulator; or null.
    Out,
    /// The flat add's piece in f32 (`const float*`), or null.
    PieceF32,
}

/// Which tokens of a varlen launch an argument describes: the queries' (Q,
/// O, the LSE) or the keys' (K, V).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    Queries,
    Keys,
}

/// Rows of O a persistent forward stores per TMA copy: one warp's of an
/// m64 product.
pub const O_STORE_ROWS: u32 = 16;

/// The box a kernel's TMA descriptor of one operand copies: `cols` elements
/// of the head dim (128 bytes of 16-bit elements, the span of the 128-byte
/// swizzle the kernels' shared tiles use) by `rows` rows of the sequence,
/// one head of one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaBox {
    pub cols: u32,
    pub rows: u32,
}

impl TmaBox {
    /// Columns per box.
    pub const COLS: u32 = 64;

    /// The box of `op` for a kernel of `block_m` query rows and `block_n`
    /// keys per tile: a tile's rows for Q and dO (`block_m`) and K and V
    /// (`block_n`), one warp's rows of O ([`O_STORE_ROWS`]).
    pub fn of(op: Operand, block_m: u32, block_n: u32) -> TmaBox {
        let rows = match op {
            Operand::K | Operand::V => block_n,
            Operand::O => O_STORE_ROWS,
            _ => block_m,
        };
        TmaBox { cols: TmaBox::COLS, rows }
    }
}

/// How a kernel's grid covers a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Grid {
    /// The forward pass: `(ceil(q_len / block_m), heads, batch)`; also the
    /// split decode's combine and the partials kernels (`q_len`: their rows).
    QueryTiles,
    /// A persistent forward pass: `per_sm` blocks per SM (the most that fit
    /// one), or one per work item (`ceil(q_len / block_m) · heads · batch`
    /// of them) if there are fewer; each block walks the items.
    Persistent { per_sm: u32 },
    /// The backward dK/dV kernel: `(ceil(kv_len / block_n), heads_kv, batch)`.
    KeyTiles,
    /// A persistent dK/dV kernel: one block per SM, or one per unit (a key
    /// tile of a (batch, K/V head) pair, `ceil(kv_len / block_n) · heads_kv
    /// · batch` of them) if there are fewer; each block claims units from
    /// the work counter.
    KeyUnits,
    /// The block-mask kernel: one block per tile,
    /// `(ceil(kv_len / block_n), ceil(q_len / block_m), batch' · heads')` where
    /// batch' and heads' are 1 unless the mask reads `b` or `h`.
    MaskTiles,
    /// One block per `per_block` heads of a batch:
    /// `(1, ceil(heads / per_block), batch)`.
    Heads { per_block: u32 },
    /// The append kernel: `(max(1, ceil(kv_len / block_m)), batch)`, `kv_len`
    /// being the most new rows of one sequence.
    NewRows,
    /// One block per `per_block` K/V heads of a batch:
    /// `(1, ceil(heads_kv / per_block), batch)`.
    KvHeads { per_block: u32 },
    /// The decode kernel: `(splits · ceil(heads / heads_kv · q_len /
    /// block_m), heads_kv, batch)`, the query rows sharing a K/V head in
    /// tiles of `block_m`; the split count is the launch's (a `DecodePlan`
    /// in the runtime sizes this grid).
    KvGroups,
}

/// A kernel argument: its C name and what it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelArg {
    pub name: String,
    pub kind: ArgKind,
}

/// A generated kernel, ready to compile and launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernel {
    /// The `extern "C"` entry point.
    pub name: String,
    /// Self-contained CUDA C++ (no toolkit headers).
    pub source: String,
    pub grid: Grid,
    /// Query rows per tile.
    pub block_m: u32,
    /// Keys per tile.
    pub block_n: u32,
    /// Threads per block (one-dimensional).
    pub threads: u32,
    /// Dynamic shared memory per block, in bytes.
    pub dynamic_smem: u32,
    /// Arguments in launch order.
    pub args: Vec<KernelArg>,
}
