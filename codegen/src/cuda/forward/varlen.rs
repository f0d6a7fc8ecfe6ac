//! Varlen (packed) operands in the forward (the pieces both directions
//! share are `kit::varlen`'s). The grid (or the persistent kernel's items)
//! covers the longest sequence's query tiles for every sequence; a tile past
//! its sequence's end does nothing (a CTA returns at once, a persistent
//! producer claims the next item instead), so no tile multiplies padding.
//!
//! A paged kernel (`Plan::paged`) is the same with its keys in a paged
//! cache: `kv_len` is the sequence's clamped K/V length, K and V rows are
//! gathered through its row of the block table (`library/paged.cuh`), and
//! queries may be dense (no prefix sums: `max_q_len` rows per sequence).

use super::plan::Plan;
use crate::abi::{ArgKind, Axis, Operand, Side};
use crate::cuda::kit::varlen::{self as kit, span_call, statistic_row};
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Sequence `b`'s spans and lengths ([`kit::write_sequence`]); a paged
/// kernel's keys are `kv_len` rows of its pages (`kv_pages`, its row of the
/// block table).
pub(super) fn write_sequence(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let spec = plan.spec;
    if !plan.paged {
        return kit::write_sequence(w, spec);
    }
    let name = |kind| arg_name(spec, kind);
    let [lens, pages, page_size, num_pages, max] =
        [ArgKind::KvLens, ArgKind::PagesPerSeq, ArgKind::PageSize, ArgKind::NumPages, ArgKind::MaxLen(Side::Keys)]
            .map(name);
    let table = name(ArgKind::BlockTable);
    let q_seq = query_span(plan, "b");
    write!(
        w,
        "\
        // Paged: sequence b's tokens of Q and O (q_seq), and its keys: kv_len rows\n\
        // of the pages its row of the block table (kv_pages) names.\n\
        const SeqSpan q_seq = {q_seq};\n\
        // Not every role reads each of them.\n\
        [[maybe_unused]] const int q_len = q_seq.len;\n\
        [[maybe_unused]] const int kv_len = paged_kv_len({lens}, b, {pages}, {page_size}, {num_pages}, {max});\n\
        [[maybe_unused]] const int* kv_pages = {table} + (long long)b * {pages};\n"
    )
}

/// Sequence `b`'s queries (C): `seq_span`'s, or a paged kernel's
/// `query_span`, which also takes dense queries (null prefix sums).
fn query_span(plan: &Plan, seq: &str) -> String {
    let function = if plan.paged { "query_span" } else { "seq_span" };
    span_call(plan.spec, function, Side::Queries, seq)
}

/// The offset of sequence `b`'s first row of `op` (K and V: the keys'
/// sequence), 64-bit; `None` for a paged kernel's K and V, whose rows are
/// found per key ([`paged_rows`]).
pub(super) fn rows_origin(plan: &Plan, op: Operand) -> Option<String> {
    match op {
        Operand::K | Operand::V if plan.paged => None,
        _ => Some(kit::rows_origin(plan.spec, op)),
    }
}

/// A paged kernel's `PagedRows` of `op` (K or V) as `{rows}_pages`, and the
/// condition (C) under which its rows allow 16-byte copies beyond
/// `aligned16`: pages 16-byte apart.
pub(super) fn paged_rows(w: &mut Writer<String>, spec: &Spec, op: Operand, rows: &str) -> fmt::Result {
    let name = |kind| arg_name(spec, kind);
    let [page_size, num_pages] = [ArgKind::PageSize, ArgKind::NumPages].map(name);
    let [page_stride, row_stride] = [ArgKind::PageStride(op), ArgKind::Stride(op, Axis::Seq)].map(name);
    let var = pages_var(rows);
    writeln!(w, "const PagedRows {var} = {{kv_pages, {page_size}, {num_pages}, {page_stride}, {row_stride}}};")
}

/// The name of the `PagedRows` of an operand's `rows`.
pub(super) fn pages_var(rows: &str) -> String {
    format!("{}_pages", rows.trim_end_matches("_rows"))
}

/// The `PagedKey` variable of the operand whose rows are `rows`
/// (`k_rows` → `k_key`).
pub(super) fn key_var(rows: &str) -> String {
    format!("{}_key", rows.trim_end_matches("_rows"))
}

/// The LSE's index of row `q` of head `h`: `[heads, total_q]`,
/// FlashAttention's varlen layout.
pub(super) fn lse_index(spec: &Spec) -> String {
    format!("{} + q", statistic_row(spec, "h"))
}

/// Whether a claimed item's query tile has rows in its sequence (C, of the
/// decoded `b_` and `q_block`): items of tiles past their sequence's end
/// are claimed and passed over by the producer alone
/// (`item_order::write_claim_decode`), so the consumers never see them.
pub(super) fn tile_has_rows(plan: &Plan) -> String {
    format!("(long long)q_block * BLOCK_M < {}.len", query_span(plan, "(int)b_"))
}
