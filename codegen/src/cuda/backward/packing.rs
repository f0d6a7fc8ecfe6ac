//! Dense or varlen (packed) operands in the backward kernels. A varlen
//! kernel's `b` is a sequence: after binding it, each kernel binds its
//! sequence's spans and lengths to `q_len` and `kv_len` (`kit::varlen`) and
//! returns where its tile lies past the sequence's end, so every later line
//! is the dense kernel's. What differs is where rows start: operands at
//! their sequence's first token, row statistics (LSE, D) and the `Rows` dQ
//! accumulator in the packed token space (`[heads, total_q]`), and the
//! `Fragments` accumulator's 64-query tiles per head at sequence `b`'s
//! first tile, `q_seq.start / 64 + b`: each sequence gets
//! `ceil(len / 64)` whole tiles of its own, so a head holds
//! `ceil(total_q / 64) + batch` tiles ([`DqAccum::varlen_len`](super::DqAccum::varlen_len);
//! the CPU twin is `crate::varlen::dq_accum_tile`).

use crate::abi::{ArgKind, Axis, KernelArg, Operand, Side};
use crate::cuda::kit::varlen::{rows_origin, seq_span, statistic_row, write_sequence};
use crate::cuda::signature::{arg_name, with_varlen_sizes};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use crate::varlen::DQ_TILE_ROWS;
use std::fmt::{self, Write};

/// Whether a backward kernel reads dense (`[batch, seq, heads, dim]`) or
/// varlen (packed) operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Packing {
    Dense,
    Varlen,
}

impl Packing {
    /// The kernel name's prefix: `prefix`, or `prefix_varlen`.
    pub fn prefix(self, prefix: &str) -> String {
        match self {
            Packing::Dense => prefix.to_string(),
            Packing::Varlen => format!("{prefix}_varlen"),
        }
    }

    /// A dense kernel's argument list `args` in this packing (see
    /// [`with_varlen_sizes`]).
    pub fn args(self, spec: &Spec, args: Vec<KernelArg>) -> Vec<KernelArg> {
        match self {
            Packing::Dense => args,
            Packing::Varlen => with_varlen_sizes(spec, args),
        }
    }

    /// After `b`: a varlen kernel's sequence (its query side alone where
    /// `!keys`) and the return of a tile whose first row `first` lies at or
    /// past `len` (`q_len` or `kv_len`).
    pub fn write_sequence(
        self,
        w: &mut Writer<String>,
        spec: &Spec,
        keys: bool,
        first: &str,
        len: &str,
    ) -> fmt::Result {
        if self == Packing::Dense {
            return Ok(());
        }
        match keys {
            true => write_sequence(w, spec)?,
            false => write!(
                w,
                "\
                // Varlen: sequence b's tokens of the queries' rows (q_seq); q_len is its own.\n\
                const SeqSpan q_seq = {};\n\
                const int q_len = q_seq.len;\n",
                seq_span(spec, Side::Queries, "b")
            )?,
        }
        writeln!(w, "if ({first} >= {len}) return;  // a tile past its sequence's end: no rows")
    }

    /// The last coordinate of a TMA copy of `op`'s rows (C): the batch row,
    /// or a varlen kernel's sequence, whose ragged descriptors take its span
    /// (`library/tma_ragged.cuh`).
    pub fn tma_seq(self, op: Operand) -> &'static str {
        match (self, op) {
            (Packing::Dense, _) => "b",
            (Packing::Varlen, Operand::K | Operand::V) => "kv_seq",
            (Packing::Varlen, _) => "q_seq",
        }
    }

    /// `auto* rows = ptr + origin + head * head_stride;`: the rows of `op`
    /// at `head` of batch row (or sequence) `b`.
    pub fn write_rows(self, w: &mut Writer<String>, spec: &Spec, op: Operand, rows: &str, head: &str) -> fmt::Result {
        let ptr = arg_name(spec, ArgKind::Ptr(op));
        let head_stride = arg_name(spec, ArgKind::Stride(op, Axis::Head));
        let origin = match self {
            Packing::Dense => format!("b * {}", arg_name(spec, ArgKind::Stride(op, Axis::Batch))),
            Packing::Varlen => rows_origin(spec, op),
        };
        writeln!(w, "auto* {rows} = {ptr} + {origin} + {head} * {head_stride};")
    }

    /// The index of the first row of head `head` (C) in a row statistic
    /// (the LSE, D): dense `[batch, heads, q_len]`, varlen `[heads, total_q]`.
    pub fn statistic_row(self, spec: &Spec, head: &str) -> String {
        match self {
            Packing::Dense => {
                let [heads, q_len] = [ArgKind::Heads, ArgKind::QLen].map(|kind| arg_name(spec, kind));
                format!("((long long)b * {heads} + {head}) * {q_len}")
            }
            Packing::Varlen => statistic_row(spec, head),
        }
    }

    /// The index of the first element of head `h`'s rows in a `Rows` dQ
    /// accumulator (`D` f32 per row, rows as a row statistic's).
    pub fn accum_rows(self, spec: &Spec) -> String {
        match self {
            Packing::Dense => format!("{} * D", self.statistic_row(spec, "h")),
            Packing::Varlen => format!("({}) * D", self.statistic_row(spec, "h")),
        }
    }

    /// The index of 64-query tile `tile` (C) of head `head` in a
    /// `Fragments` dQ accumulator, whose heads hold `tiles` tiles each
    /// where dense (C: `ceil(q_len / 64)`).
    pub fn accum_tile(self, spec: &Spec, head: &str, tiles: &str, tile: &str) -> String {
        format!("{} + {tile}", self.accum_first_tile(spec, head, tiles))
    }

    /// The index of the first tile of head `head`'s queries (of this
    /// sequence, where varlen) in a `Fragments` dQ accumulator, as
    /// [`Self::accum_tile`] counts them.
    pub fn accum_first_tile(self, spec: &Spec, head: &str, tiles: &str) -> String {
        let [heads, batch, total_q] =
            [ArgKind::Heads, ArgKind::Batch, ArgKind::Tokens(Side::Queries)].map(|kind| arg_name(spec, kind));
        match self {
            Packing::Dense => format!("((long long)b * {heads} + {head}) * {tiles}"),
            Packing::Varlen => {
                let m = DQ_TILE_ROWS;
                // Tiles per head, in 64 bits: total_q + 63 may not fit an int.
                let per_head = format!("(({total_q} + {m} - 1LL) / {m} + {batch})");
                format!("(long long){head} * {per_head} + q_seq.start / {m} + b")
            }
        }
    }
}
