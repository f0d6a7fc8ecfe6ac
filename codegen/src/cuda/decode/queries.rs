//! Where a decode kernel's query rows live: padded (Q and O `[batch, q_len,
//! heads, d]`, every sequence `q_len` tokens) or packed (the varlen
//! forward's layout: the tokens of all sequences back to back, sequence b's
//! span from the prefix sums `cu_seqlens_q`, clamped into the buffer and to
//! `max_q_len` by `seq_span`, `library/varlen.cuh`). A packed kernel binds
//! its sequence's own token count to `q_len` right after its coordinates,
//! so its rows, mask, logit and tile classes are the padded kernel's; only
//! the addresses below differ. The split workspace keeps the padded
//! `[splits, batch, heads, max_q_len]` rows either way (the plan's upper
//! bounds), the LSE is `[heads, total_q]` when packed (the varlen forward's).

use crate::abi::Side;
use crate::cuda::kit::varlen::{seq_span, statistic_row};
use crate::spec::Spec;

/// The layout of a decode kernel's Q, O and LSE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeQueries {
    /// `[batch, q_len, heads, d]`, the LSE `[batch, heads, q_len]`.
    Padded,
    /// Packed tokens split by `cu_seqlens_q`, the LSE `[heads, total_q]`.
    Packed,
}

impl DecodeQueries {
    /// The line binding sequence b's span and `q_len` (packed), else none.
    pub(super) fn sequence(self, spec: &Spec) -> String {
        match self {
            DecodeQueries::Padded => String::new(),
            DecodeQueries::Packed => format!(
                "// Packed queries: sequence b's tokens of Q and O, clamped into the buffers;\n\
                 // q_len is its own count (0 to max_q_len).\n\
                 const SeqSpan q_seq = {};\n\
                 const int q_len = q_seq.len;\n",
                seq_span(spec, Side::Queries, "b")
            ),
        }
    }

    /// Sequence b's first Q row.
    pub(super) fn q_rows(self) -> &'static str {
        match self {
            DecodeQueries::Padded => "q_ptr + b * q_batch_stride",
            DecodeQueries::Packed => "q_ptr + (long long)q_seq.start * q_seq_stride",
        }
    }

    /// O's element at query `q`, head `h`, column `c` of sequence b.
    fn o_at(self) -> &'static str {
        match self {
            DecodeQueries::Padded => "b * o_batch_stride + q * o_seq_stride + h * o_head_stride + c",
            DecodeQueries::Packed => "(long long)(q_seq.start + q) * o_seq_stride + h * o_head_stride + c",
        }
    }

    /// `text` with its addresses for these queries: `@SEQ_ROWS@` (rows per
    /// sequence and head of the split workspace), `@O_AT@` (O's element of
    /// query `q`, head `h`, column `c`) and `@LSE_AT@` (the LSE's index of
    /// the row whose workspace index within a split is `at`).
    pub(super) fn fill(self, spec: &Spec, text: &str) -> String {
        text.replace("@SEQ_ROWS@", self.seq_rows())
            .replace("@O_AT@", self.o_at())
            .replace("@LSE_AT@", &self.lse_at(spec))
    }

    /// Rows per (sequence, head) of the split workspace: the plan's bound.
    fn seq_rows(self) -> &'static str {
        match self {
            DecodeQueries::Padded => "q_len",
            DecodeQueries::Packed => "max_q_len",
        }
    }

    /// The LSE's index of the row whose workspace index (within a split)
    /// is `at`, at query `q` and head `h`.
    fn lse_at(self, spec: &Spec) -> String {
        match self {
            DecodeQueries::Padded => "at".into(),
            DecodeQueries::Packed => format!("{} + q", statistic_row(spec, "h")),
        }
    }
}
