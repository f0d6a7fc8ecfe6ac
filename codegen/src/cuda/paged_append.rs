//! The paged append: writes each sequence's new K and V rows (packed, as
//! a varlen launch's keys) into its pages after its current keys, so a
//! serving loop appends a step's tokens and attends to them with the paged
//! forward and nothing else.
//!
//! One block copies `ROWS` new rows of one sequence, element by element
//! (rows scatter over pages, and the copy is a small share of a step).
//! Lengths, prefix sums and page ids are clamped as the forward clamps them
//! (`library/paged.cuh`, `library/varlen.cuh`): a row that would land past
//! the sequence's pages is dropped and counted, never written elsewhere.
//! The first block of each sequence writes its length after the append
//! (capped at its pages' rows).

use crate::abi::{ArgKind, Axis, Grid, Kernel, Operand, Side};
use crate::cuda::library::Part;
use crate::cuda::signature::{arg_name, paged_append_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const THREADS: u32 = 128;

/// New rows per block.
const ROWS: u32 = 16;

/// Emits the append kernel for the caches `spec`'s paged forward reads (its
/// head dims size the rows).
pub fn emit_paged_append(spec: &Spec) -> Kernel {
    let name = kernel_name("paged_append", spec);
    let args = paged_append_args(spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        let (d, dv) = (spec.head_dims.qk, spec.head_dims.v);
        writeln!(w, "constexpr int D = {d}, DV = {dv};  // K's and V's head dims")?;
        writeln!(w, "constexpr int THREADS = {THREADS}, ROWS = {ROWS};  // new rows per block\n")
    };
    let library = [vec![Piece::Part(Part::Prelude)], vec![Piece::Part(Part::Varlen)], vec![Piece::Part(Part::Paged)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, |w| write_append(w, spec));
    Kernel { name, source, grid: Grid::NewRows, block_m: ROWS, block_n: 0, threads: THREADS, dynamic_smem: 0, args }
}

/// One block: rows `blockIdx.x * ROWS ..` of sequence `blockIdx.y`'s new
/// rows, K then V.
fn write_append(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [cu, max_new, total, lens, table, per_seq, page_size, num_pages, heads_kv, new_lens, dropped] = [
        ArgKind::CuSeqlens(Side::Keys),
        ArgKind::MaxLen(Side::Keys),
        ArgKind::Tokens(Side::Keys),
        ArgKind::KvLens,
        ArgKind::BlockTable,
        ArgKind::PagesPerSeq,
        ArgKind::PageSize,
        ArgKind::NumPages,
        ArgKind::HeadsKv,
        ArgKind::NewKvLens,
        ArgKind::Dropped,
    ]
    .map(n);
    write!(
        w,
        "\
        const int b = blockIdx.y;\n\
        const SeqSpan fresh = seq_span({cu}, b, {total}, {max_new});  // this sequence's new rows\n\
        // Its keys so far, and the most its pages hold (0 without pages).\n\
        const int cap = {num_pages} > 0 ? (int)min((long long){per_seq} * {page_size}, 2147483647ll) : 0;\n\
        const int start = paged_kv_len({lens}, b, {per_seq}, {page_size}, {num_pages}, cap);\n\
        const int* pages = {table} + (long long)b * {per_seq};\n\
        if (blockIdx.x == 0 && threadIdx.x == 0) {{\n\
        \x20   const long long end = (long long)start + fresh.len;\n\
        \x20   if ({new_lens} != nullptr) {new_lens}[b] = (int)min(end, (long long)cap);\n\
        \x20   if ({dropped} != nullptr && end > cap) atomicAdd({dropped}, (unsigned int)(end - cap));\n\
        }}\n\
        const int r0 = blockIdx.x * ROWS, r1 = min(r0 + ROWS, fresh.len);\n"
    )?;
    for (op, width) in [(Operand::K, "D"), (Operand::V, "DV")] {
        let [new, cache, page_stride] = [ArgKind::NewRows(op), ArgKind::Cache(op), ArgKind::PageStride(op)].map(n);
        let [new_row, new_head] = [Axis::Seq, Axis::Head].map(|a| n(ArgKind::NewRowStride(op, a)));
        let [row, head] = [Axis::Seq, Axis::Head].map(|a| n(ArgKind::Stride(op, a)));
        write!(
            w,
            "\
            {{\n\
            \x20   const PagedRows p = {{pages, {page_size}, {num_pages}, {page_stride}, {row}}};\n\
            \x20   append_rows<{width}, THREADS>({cache}, {head}, p, {new} + (long long)fresh.start * {new_row}, {new_row}, {new_head},\n\
            \x20                                 {heads_kv}, start, r0, r1, cap);\n\
            }}\n"
        )?;
    }
    Ok(())
}
