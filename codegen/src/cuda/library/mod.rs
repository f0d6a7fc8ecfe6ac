//! The CUDA library: real `.cuh` files, pulled in with `include_str!`, that
//! every kernel's source starts with (no `#include`: NVRTC from PyPI ships
//! no toolkit headers, so each source is self-contained). [`Part`] names
//! them; `source::assemble` prints the parts a kernel asks for, in order.
//! The only library code generated per kernel is the wgmma instruction
//! wrappers (`wgmma_ops`), one per operand width.

pub(crate) mod wgmma_ops;

use crate::spec::{Domain, Expr, ExprKind, Spec, UnOp};

/// One file of the CUDA library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The prelude every generated kernel starts with: 16-bit float formats and
    /// the scalar helpers of the spec language.
    ///
    /// It is fixed text, independent of the spec, so it is easy to read and
    /// review as CUDA. The scalar helpers define the spec language's semantics
    /// where C's would be undefined, and the CPU reference implements the same
    /// rules. The tensor-core tile operations live in [`Part::Tiles`].
    Prelude,

    /// The scalar helpers of the bit shifts and Euclidean division, after
    /// the prelude in kernels of specs that use bit operations or
    /// `rem_euclid`/`div_euclid` ([`Part::extension`]).
    IntOps,

    /// The prelude section for tile classification: interval arithmetic over the
    /// spec language, the kernel-side twin of [`crate::analysis`].
    ///
    /// Each helper here implements the rule of the same name in
    /// `analysis.rs` (`r_add` ↔ `RangeBinOp::Add`, …) bound for bound, so a tile
    /// is classified identically on host and device. Bounds are exact in 64 bits;
    /// one that leaves i32 range means the i32 operation may wrap, so the result
    /// widens to all of i32 (`r_norm`). Bools are sub-intervals of [0, 1].
    Ranges,

    /// The interval rules of bit operations and Euclidean division, after
    /// [`Part::Ranges`] in kernels whose mask uses them.
    IntRanges,

    /// The tensor-core tile library: the handful of named operations the
    /// forward kernel is written in (ThunderKittens style).
    ///
    /// - `store_tile`: shared → global, 16 bytes per thread where rows allow
    ///   (the output tile leaves through shared memory in coalesced rows).
    /// - `cp_async_16` / `load_tile`: global → shared copies, 16 bytes per
    ///   thread and instruction, bypassing registers so the next K/V tile loads
    ///   while the current one is multiplied; a scalar fallback covers head dims
    ///   that are not a multiple of 8 and operands that are not 16-byte aligned.
    /// - `swizzle`: shared tiles store 16-byte chunks XOR-permuted by row, so the
    ///   eight rows an `ldmatrix` reads at once hit eight different bank groups.
    /// - `ldmatrix_x4` (`_trans` for V): shared → the register fragments that
    ///   `mma.sync.m16n8k16` expects, four 8×8 matrices per instruction.
    /// - `mma_16816`: one 16×8×16 tensor-core product, f16/bf16 in, f32 out.
    /// - `pack2`: two f32 → one register of two 16-bit values (P as an operand).
    /// - `row_max` / `row_sum`: one row of a warp's S tiles reduced in a
    ///   pairwise tree, so the softmax waits on log2 of a row's elements
    ///   dependent steps rather than on a chain through all of them.
    ///
    /// Fragment coordinates (PTX ISA, "mma.m16n8k16"): with `g = lane / 4` and
    /// `t = lane % 4`, accumulator element `i` of an m16n8 tile sits at row
    /// `g + 8 * (i / 2)` and column `2 * t + i % 2`.
    Tiles,

    /// Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a), the tile operations
    /// of `Mma::Wgmma` kernels (the forward's, and the backward's dK/dV).
    ///
    /// A warpgroup (four warps) multiplies a 64-row A tile by an N-column B
    /// tile that the tensor cores read straight from shared memory through a
    /// 64-bit *matrix descriptor*: no `ldmatrix`, no B fragments in registers.
    /// Operands sit in the 128-byte-swizzle layout (`tile_offset<…, true>`:
    /// 64-column panels of 128-byte rows, eight rows per 1024-byte atom), the
    /// one layout wgmma reads both K-major (Q and K: the reduction runs along the
    /// row) and MN-major (V, with the transpose flag). The instruction is
    /// asynchronous: `wgmma_fence` orders earlier register writes before it,
    /// `wgmma_commit` closes a group and `wgmma_wait<N>` blocks until at most N
    /// groups are still running, so one product can run behind the code that
    /// consumes another.
    ///
    /// The accumulator layout per warp equals `mma.sync.m16n8k16`'s m16n8 tiles
    /// side by side (warp w of the warpgroup holds rows 16w..16w + 15), and P
    /// feeds the second product from registers in the m16n8k16 A-fragment
    /// layout, so the element loop and the online softmax are the same code
    /// for both MMA kinds. Instruction wrappers are generated per N because each
    /// accumulator register is its own asm operand.
    Wgmma,

    /// The stage ring of warp-specialized kernels: one producer warpgroup copies
    /// tiles into a ring of shared-memory stages while the consumer warpgroups
    /// multiply them, each side paced by the other through `mbarrier`s instead
    /// of CTA-wide barriers (FlashAttention-3's producer/consumer split).
    ///
    /// Every stage has a *full* barrier (the producer's 128 threads arrive once
    /// their copies have landed, or, with TMA, one thread arrives and the copy
    /// engine completes the bytes it announced) and an *empty* barrier (each
    /// consumer warp arrives once its products have read the stage). A barrier completes a
    /// phase per round of the ring, so a waiter names the phase by its parity:
    /// round `r` of a stage waits for parity `r % 2` on *full* and, one round
    /// behind, `(r + 1) % 2` on *empty* (a fresh barrier counts the phase before
    /// its first as complete, so the producer's first round does not wait).
    ///
    /// The producer needs few registers and the consumers many: `setmaxnreg`
    /// moves them, so the CTA still fits the register file.
    Ring,

    /// Work claims of persistent CTAs: the work counter, and the multiply-high
    /// divisions that decode an item into its query tile, head and batch.
    WorkClaims,

    /// Varlen (packed) operands: a sequence's span of tokens from the prefix
    /// sums, clamped into the buffers.
    Varlen,

    /// Paged K/V: a key's row through the block table, lengths and page ids
    /// clamped, and the gathering tile copy. Follows `Varlen`.
    Paged,
    /// Decode kernels' KV cache (`KvRows`: the one place cache rows are
    /// addressed; `cache_len`: per-sequence lengths clamped into it), their
    /// multi-stage waits and the Q rows of a K/V head's query group.
    Decode,

    /// Paged decode kernels' cache rows: each warp's share of a K/V tile
    /// resolved through the block table once per key, then copied by chunks
    /// whose lanes take the key's page by shuffle. Follows `Paged` and
    /// `Decode`.
    DecodePaged,

    /// E4m3 decode kernels' K/V fragments: the exact e4m3 → f16/bf16
    /// conversion on registers after ldmatrix, and the orders the 1-byte
    /// tiles put K's dims and V's columns in. Follows `Decode`.
    DecodeE4m3,

    /// The Hopper forward's e4m3 operands: P packed from the S accumulators
    /// as an 8-bit wgmma's A fragment (`pack_p_e4m3`). Follows `Wgmma`.
    ForwardE4m3,

    /// The e4m3 forward's V tiles: V rewritten with its keys along the rows
    /// (8-bit wgmma reads B K-major only), in the key order `pack_p_e4m3`
    /// leaves P in (`e4m3_v_tile`, the body of `cuda::e4m3_v_tiles`).
    E4m3VTiles,

    /// Hopper's tensor memory accelerator (TMA) for the producers of the
    /// warp-specialized kernels (the persistent forward, the backward's dK/dV
    /// kernel): one thread hands the copy engine a whole tile (a
    /// descriptor, coordinates and a barrier), where cp.async needs every
    /// producer thread to compute and issue 16 bytes at a time. The persistent
    /// forward's consumers store O the same way, one bulk store per warp. The runtime
    /// encodes the descriptors (`runtime/src/tma.rs`); a tile in shared memory
    /// is the layout wgmma reads: 64-column panels of 128-byte rows, 16-byte
    /// chunks XORed with the row (the copy engine's 128-byte swizzle).
    Tma,

    /// The copy engine's stores, for the persistent forward's O.
    TmaStore,

    /// Ragged TMA descriptors of packed operands: boxes of one sequence's
    /// rows, zeros past its end on loads, nothing written there on stores.
    /// Follows `Varlen` and `Tma`.
    TmaRagged,

    /// The paged forward's K/V tiles by TMA: a warp's lanes copy a tile in
    /// boxes of one page each, from the pages the block table names, zeros
    /// past the sequence's keys. Follows `Paged` and `TmaRagged`.
    PagedTma,

    /// `clock64()` trace points of a traced forward kernel
    /// (`emit_forward_traced`, for `scripts/trace/harness.cu`): the `g_trace`
    /// rows, `TR(code)`, which thread 0 of each warpgroup of the first
    /// `TRACE_CTAS` CTAs uses to append `code << 56 | clock64`, and
    /// `TRACE_COUNTER`, the count `TR` keeps in a register. `-DTRACE_ON=0`
    /// leaves both empty: the same kernel, untimed.
    Trace,

    /// Row helpers of the backward kernels (`warp_sum`).
    BackwardRows,

    /// Tile helpers of the backward kernels: f32 accumulator tiles times
    /// 16-bit tiles, vector reductions into global accumulators.
    BackwardTiles,

    /// The Hopper dK/dV kernel's fragment moves (`stmatrix`, register-fed
    /// operands).
    HopperBackward,

    /// A 64-query step's dQ accumulator tile in the Hopper dK/dV kernel's
    /// fragment order, and its mapping back to rows.
    DqFragments,

    /// The dQ accumulator's tickets (`ArgKind::DqTickets`): taken, marked
    /// stored and waited for, in the kernels around an accumulator that has
    /// them.
    DqTickets,

    /// The transposed Hopper dK/dV kernel's moves between accumulators and
    /// key-major shared tiles (`stmatrix.trans`), and its dK/dV stores.
    HopperTransposed,

    /// A row's softmax closed with a learned sink (`sink_row`), after
    /// [`Part::Tiles`] in kernels of specs with a sink ([`Part::extension`]).
    Sink,

    /// Context parallelism's partials (`cuda::partials`): merge weights
    /// from two LSEs, and a row merged or added by a warp's lanes.
    Partials,

    /// Dropout on P (`crate::dropout`'s twin): Philox4x32-10 and the
    /// factors of a 2 x 2 block of pairs, in kernels with dropout on only.
    Dropout,
}

impl Part {
    /// Every part, in the order kernels include them.
    pub const ALL: [Part; 29] = [
        Part::Prelude,
        Part::IntOps,
        Part::Ranges,
        Part::IntRanges,
        Part::Tiles,
        Part::Wgmma,
        Part::Ring,
        Part::WorkClaims,
        Part::Varlen,
        Part::Paged,
        Part::Decode,
        Part::DecodePaged,
        Part::DecodeE4m3,
        Part::ForwardE4m3,
        Part::E4m3VTiles,
        Part::Tma,
        Part::TmaStore,
        Part::TmaRagged,
        Part::PagedTma,
        Part::Trace,
        Part::BackwardRows,
        Part::BackwardTiles,
        Part::HopperBackward,
        Part::DqFragments,
        Part::DqTickets,
        Part::HopperTransposed,
        Part::Sink,
        Part::Partials,
        Part::Dropout,
    ];

    /// The part's CUDA text, verbatim.
    pub fn text(self) -> &'static str {
        match self {
            Part::Prelude => include_str!("prelude.cuh"),
            Part::IntOps => include_str!("int_ops.cuh"),
            Part::Ranges => include_str!("ranges.cuh"),
            Part::IntRanges => include_str!("int_ranges.cuh"),
            Part::Tiles => include_str!("tiles.cuh"),
            Part::Wgmma => include_str!("wgmma.cuh"),
            Part::Ring => include_str!("ring.cuh"),
            Part::WorkClaims => include_str!("work_claims.cuh"),
            Part::Varlen => include_str!("varlen.cuh"),
            Part::Paged => include_str!("paged.cuh"),
            Part::Decode => include_str!("decode.cuh"),
            Part::DecodePaged => include_str!("decode_paged.cuh"),
            Part::DecodeE4m3 => include_str!("decode_e4m3.cuh"),
            Part::ForwardE4m3 => include_str!("forward_e4m3.cuh"),
            Part::E4m3VTiles => include_str!("e4m3_v_tiles.cuh"),
            Part::Tma => include_str!("tma.cuh"),
            Part::TmaStore => include_str!("tma_store.cuh"),
            Part::TmaRagged => include_str!("tma_ragged.cuh"),
            Part::PagedTma => include_str!("paged_tma.cuh"),
            Part::Trace => include_str!("trace.cuh"),
            Part::BackwardRows => include_str!("backward_rows.cuh"),
            Part::BackwardTiles => include_str!("backward_tiles.cuh"),
            Part::HopperBackward => include_str!("hopper_backward.cuh"),
            Part::DqFragments => include_str!("dq_fragments.cuh"),
            Part::DqTickets => include_str!("dq_tickets.cuh"),
            Part::HopperTransposed => include_str!("hopper_transposed.cuh"),
            Part::Sink => include_str!("sink.cuh"),
            Part::Partials => include_str!("partials.cuh"),
            Part::Dropout => include_str!("dropout.cuh"),
        }
    }

    /// The part's file name under `codegen/src/cuda/library/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Part::Prelude => "prelude.cuh",
            Part::IntOps => "int_ops.cuh",
            Part::Ranges => "ranges.cuh",
            Part::IntRanges => "int_ranges.cuh",
            Part::Tiles => "tiles.cuh",
            Part::Wgmma => "wgmma.cuh",
            Part::Ring => "ring.cuh",
            Part::WorkClaims => "work_claims.cuh",
            Part::Varlen => "varlen.cuh",
            Part::Paged => "paged.cuh",
            Part::Decode => "decode.cuh",
            Part::DecodePaged => "decode_paged.cuh",
            Part::DecodeE4m3 => "decode_e4m3.cuh",
            Part::ForwardE4m3 => "forward_e4m3.cuh",
            Part::E4m3VTiles => "e4m3_v_tiles.cuh",
            Part::Tma => "tma.cuh",
            Part::TmaStore => "tma_store.cuh",
            Part::TmaRagged => "tma_ragged.cuh",
            Part::PagedTma => "paged_tma.cuh",
            Part::Trace => "trace.cuh",
            Part::BackwardRows => "backward_rows.cuh",
            Part::BackwardTiles => "backward_tiles.cuh",
            Part::HopperBackward => "hopper_backward.cuh",
            Part::DqFragments => "dq_fragments.cuh",
            Part::DqTickets => "dq_tickets.cuh",
            Part::HopperTransposed => "hopper_transposed.cuh",
            Part::Sink => "sink.cuh",
            Part::Partials => "partials.cuh",
            Part::Dropout => "dropout.cuh",
        }
    }

    /// The optional part that follows `self` in a kernel of `spec`: helpers
    /// of operators only some specs use, so that the kernels of the others
    /// stay as they were.
    pub fn extension(self, spec: &Spec) -> Option<Part> {
        match self {
            Part::Prelude if spec.mask.iter().chain(&spec.score).chain(&spec.sink).any(uses_int_ops) => {
                Some(Part::IntOps)
            }
            Part::Ranges if spec.mask.as_ref().is_some_and(uses_int_ops) => Some(Part::IntRanges),
            Part::Tiles if spec.sink.is_some() => Some(Part::Sink),
            _ => None,
        }
    }
}

/// Whether `e` uses a bit operation or an i32-only function.
fn uses_int_ops(e: &Expr) -> bool {
    let mut found = false;
    e.walk(&mut |n| {
        found |= match &n.kind {
            ExprKind::Binary(op, ..) => op.is_bitwise(),
            ExprKind::Unary(op, _) => *op == UnOp::BitNot,
            ExprKind::Call(f, _) => f.domain() == Domain::Int,
            _ => false,
        }
    });
    found
}
