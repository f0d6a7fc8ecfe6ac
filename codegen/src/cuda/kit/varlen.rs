//! Varlen (packed) operands, as both directions print them: Q, K, V, O and
//! their gradients hold the tokens of all sequences back to back, and a
//! work item's `b` is a sequence. An item reads its sequence's span of
//! tokens from the prefix sums (clamped into the buffers,
//! `library/varlen.cuh`) and binds its lengths to `q_len` and `kv_len`, the
//! names the spec's built-ins, the tile bounds and the copies' row counts
//! print as: every line after that is the dense kernel's. Row statistics
//! (the LSE, the backward's D) are `[heads, total_q]`, FlashAttention's
//! varlen layout.

use crate::abi::{ArgKind, Axis, Operand, Side};
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Sequence `b`'s spans of the packed tokens (`q_seq`, `kv_seq`) and its
/// lengths as `q_len` and `kv_len`.
pub(crate) fn write_sequence(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [q_seq, kv_seq] = [Side::Queries, Side::Keys].map(|side| seq_span(spec, side, "b"));
    write!(
        w,
        "\
        // Varlen: sequence b's tokens of Q and O (q_seq) and of K and V (kv_seq);\n\
        // q_len and kv_len are its own lengths.\n\
        const SeqSpan q_seq = {q_seq};\n\
        const SeqSpan kv_seq = {kv_seq};\n\
        [[maybe_unused]] const int q_len = q_seq.len, kv_len = kv_seq.len;  // not every role reads both\n"
    )
}

/// `seq_span(...)` of sequence `seq` (C) on `side`.
pub(crate) fn seq_span(spec: &Spec, side: Side, seq: &str) -> String {
    span_call(spec, "seq_span", side, seq)
}

/// `function(cu, seq, total, max)`: a span of sequence `seq` on `side`.
pub(crate) fn span_call(spec: &Spec, function: &str, side: Side, seq: &str) -> String {
    let [cu, total, max] = [ArgKind::CuSeqlens(side), ArgKind::Tokens(side), ArgKind::MaxLen(side)];
    let [cu, total, max] = [cu, total, max].map(|kind| arg_name(spec, kind));
    format!("{function}({cu}, {seq}, {total}, {max})")
}

/// The offset of sequence `b`'s first row of `op` (K, V and their
/// gradients: the keys' sequence), 64-bit.
pub(crate) fn rows_origin(spec: &Spec, op: Operand) -> String {
    let seq = match op {
        Operand::K | Operand::V | Operand::DK | Operand::DV => "kv_seq",
        _ => "q_seq",
    };
    format!("(long long){seq}.start * {}", arg_name(spec, ArgKind::Stride(op, Axis::Seq)))
}

/// The index of sequence `b`'s first row of head `head` in a row statistic
/// `[heads, total_q]` (the LSE, D).
pub(crate) fn statistic_row(spec: &Spec, head: &str) -> String {
    format!("(long long){head} * {} + q_seq.start", arg_name(spec, ArgKind::Tokens(Side::Queries)))
}
