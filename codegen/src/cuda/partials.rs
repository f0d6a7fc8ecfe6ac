//! Context parallelism's partials kernels. Context parallelism splits
//! attention over query and key segments; each (query segment, key segment)
//! piece is an ordinary forward or backward launch, and these kernels fold
//! the pieces into a running f32 sum, so no attention kernel changes:
//!
//! - **merge** ([`emit_merge_partial`]): forward pieces' O weighed by their
//!   rows' LSEs into the accumulator's (as the split decode's combine weighs
//!   its splits), in place or into a final O and LSE in the storage dtype.
//! - **add** ([`emit_add_partial`]): backward pieces of dQ, dK or dV summed
//!   (the head dim is an argument: one kernel serves all three).
//! - **flat add** ([`emit_add_f32`]): captured tensors' f32 gradients summed.
//!
//! Spec-independent but for the storage dtype and, in the merge, the V head
//! dim. The row kernels give a warp each row (lanes over its contiguous
//! columns) and a CTA `ROWS` rows of one batch and head, so one lane reads
//! and writes a row's LSE and no barrier is needed (`library/partials.cuh`).

use crate::abi::{ArgKind, Axis, Grid, Kernel, KernelArg, Partial};
use crate::cuda::library::Part;
use crate::cuda::signature::{add_f32_args, add_partial_args, arg_name, merge_partial_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::writer::Writer;
use crate::spec::{Dtype, Spec};
use std::fmt::{self, Write};

const THREADS: u32 = 128;

/// Rows per CTA of the row kernels: four per warp.
const ROWS: u32 = 16;

/// Elements per CTA of the flat add: four per thread.
const FLAT_ELEMENTS: u32 = 4 * THREADS;

/// The merge kernel of `spec`'s O (its dtype and V head dim).
pub fn emit_merge_partial(spec: &Spec) -> Kernel {
    let constants = format!("{}constexpr int DV = {};  // V/O head dim\n", row_constants(spec), spec.head_dims.v);
    emit(spec, "merge_partial", merge_partial_args(spec), ROWS, &constants, |w| write_merge(w, spec))
}

/// The add kernel of `spec`'s gradients (its dtype; any head dim).
pub fn emit_add_partial(spec: &Spec) -> Kernel {
    emit(spec, "add_partial", add_partial_args(spec), ROWS, &row_constants(spec), |w| write_add(w, spec))
}

/// The flat f32 add (spec-independent but for its name and header).
pub fn emit_add_f32(spec: &Spec) -> Kernel {
    let constants = format!("constexpr int FLAT = {FLAT_ELEMENTS};  // elements per CTA, strided by THREADS\n");
    emit(spec, "add_f32", add_f32_args(spec), FLAT_ELEMENTS, &constants, |w| write_add_f32(w, spec))
}

/// The row kernels' storage type and rows per CTA.
fn row_constants(spec: &Spec) -> String {
    let storage = match spec.dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    format!(
        "using storage = {storage};  // element format of pieces and outputs\n\
         constexpr int WARPS = THREADS / 32;\n\
         constexpr int ROWS = {ROWS};  // rows per CTA, a warp per row\n"
    )
}

/// A partials kernel: the prelude and `partials.cuh`, `THREADS` and its
/// `constants`, and `body`; a CTA per `block_m` rows (or elements) of a
/// batch and head.
fn emit(
    spec: &Spec,
    kind: &str,
    args: Vec<KernelArg>,
    block_m: u32,
    constants: &str,
    body: impl FnOnce(&mut Writer<String>) -> fmt::Result,
) -> Kernel {
    let name = kernel_name(kind, spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        writeln!(w, "// ---- kernel configuration ---------------------------------------------------")?;
        writeln!(w, "constexpr int THREADS = {THREADS};\n{constants}")
    };
    let library = [vec![Piece::Part(Part::Prelude)], vec![Piece::Part(Part::Partials)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, body);
    Kernel { name, source, grid: Grid::QueryTiles, block_m, block_n: 1, threads: THREADS, dynamic_smem: 0, args }
}

/// Declares `acc`, `piece` and `out`: the row's first element of each
/// operand (null where the operand is).
fn row_pointers(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    for (p, ty, local) in [
        (Partial::Acc, "float*", "acc"),
        (Partial::Piece, "const unsigned short*", "piece"),
        (Partial::Out, "unsigned short*", "out"),
    ] {
        let ptr = arg_name(spec, ArgKind::PartialPtr(p));
        let [b, s, h] = [Axis::Batch, Axis::Seq, Axis::Head].map(|a| arg_name(spec, ArgKind::PartialStride(p, a)));
        let row = format!("partial_row({ptr}, {b}, {s}, {h}, b, row, h)");
        match p {
            Partial::Acc => writeln!(w, "{ty} {local} = {row};")?,
            _ => writeln!(w, "{ty} {local} = {ptr} == nullptr ? nullptr : {row};")?,
        }
    }
    Ok(())
}

/// The row loop of a CTA: warp `threadIdx.x / 32` takes every `WARPS`-th
/// of its `ROWS` rows of batch `blockIdx.z`, head `blockIdx.y`.
fn open_rows(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let rows = arg_name(spec, ArgKind::Rows);
    write!(
        w,
        "\
        const int lane = threadIdx.x % 32, h = blockIdx.y, b = blockIdx.z;\n\
        const int row0 = blockIdx.x * ROWS, count = min({rows} - row0, ROWS);  // this CTA's rows\n\
        for (int i = threadIdx.x / 32; i < count; i += WARPS) {{\n\
        \x20   const int row = row0 + i;\n"
    )
}

fn write_merge(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [first, piece, out] =
        [ArgKind::First, ArgKind::PartialPtr(Partial::Piece), ArgKind::PartialPtr(Partial::Out)].map(n);
    let [acc_lse, piece_lse, out_lse] = [Partial::Acc, Partial::Piece, Partial::Out].map(|p| n(ArgKind::MergeLse(p)));
    let [rows, heads] = [ArgKind::Rows, ArgKind::Heads].map(n);
    open_rows(w, spec)?;
    w.indented(|w| {
        write!(
            w,
            "\
            const long long lse_row = ((long long)b * {heads} + h) * {rows} + row;  // the LSEs' index\n\
            // Lane 0 alone reads the row's LSEs and writes its merged one (in\n\
            // place over {acc_lse} without an output): no read races the write.\n\
            float lse_acc = neg_inf(), lse_piece = neg_inf();\n\
            if (lane == 0 && !{first}) lse_acc = {acc_lse}[lse_row];\n\
            if (lane == 0 && {piece} != nullptr) lse_piece = {piece_lse}[lse_row];\n\
            const MergeWeights w = merge_weights(__shfl_sync(~0u, lse_acc, 0), __shfl_sync(~0u, lse_piece, 0));\n"
        )?;
        row_pointers(w, spec)?;
        writeln!(w, "merge_row<storage, DV>(acc, piece, out, w, lane);")?;
        writeln!(w, "if (lane == 0) ({out} != nullptr ? {out_lse} : {acc_lse})[lse_row] = w.lse;")
    })?;
    writeln!(w, "}}")
}

fn write_add(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [first, dim] = [ArgKind::First, ArgKind::Dim].map(|k| arg_name(spec, k));
    open_rows(w, spec)?;
    w.indented(|w| {
        row_pointers(w, spec)?;
        writeln!(w, "add_row<storage>(acc, {first} != 0, piece, out, {dim}, lane);")
    })?;
    writeln!(w, "}}")
}

/// Thread `t` of CTA `c` adds elements `c * FLAT + t + THREADS * j`
/// (coalesced); `first` zeroes, a null piece adds nothing.
fn write_add_f32(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [acc, piece, first, count] =
        [ArgKind::PartialPtr(Partial::Acc), ArgKind::PartialPtr(Partial::PieceF32), ArgKind::First, ArgKind::Elements]
            .map(|k| arg_name(spec, k));
    write!(
        w,
        "\
        const long long start = (long long)blockIdx.x * FLAT + threadIdx.x;\n\
        #pragma unroll\n\
        for (int j = 0; j < FLAT / THREADS; ++j) {{\n\
        \x20   const long long i = start + (long long)THREADS * j;\n\
        \x20   if (i >= {count}) break;\n\
        \x20   const float x = {first} ? 0.0f : {acc}[i];\n\
        \x20   {acc}[i] = {piece} == nullptr ? x : x + {piece}[i];\n\
        }}\n"
    )
}
