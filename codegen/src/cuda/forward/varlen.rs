//! Varlen (packed) operands in the forward (the shared pieces are
//! `kit::varlen`'s). The grid (or the persistent kernel's items) covers the
//! longest sequence's query tiles for every sequence; a tile past its
//! sequence's end does nothing (a CTA returns at once, a persistent producer
//! claims the next item instead), so no tile multiplies padding.

use crate::abi::Side;
use crate::cuda::kit::varlen::{seq_span, statistic_row};
use crate::spec::Spec;

/// The LSE's index of row `q` of head `h`: `[heads, total_q]`,
/// FlashAttention's varlen layout.
pub(super) fn lse_index(spec: &Spec) -> String {
    format!("{} + q", statistic_row(spec, "h"))
}

/// The producer's claim (C, assigned to `item_slot[qb]`): the first
/// claimed item whose query tile has rows in its sequence, or one past the
/// last item. Items of tiles past their sequence's end are claimed and
/// passed over by the producer alone, so the consumers never see them.
pub(super) fn claim_with_rows(spec: &Spec, counter: &str) -> String {
    let q_seq = seq_span(spec, Side::Queries, "(int)by_heads.div(bh)");
    format!(
        "claim({counter}, done, items);\n\
        \x20   // Varlen: pass over items whose query tile lies past its sequence's end.\n\
        \x20   auto has_rows = [&](long long item) {{\n\
        \x20       const unsigned bh = by_q_tiles.div((unsigned)item);\n\
        \x20       const int q_block = q_tiles - 1 - (int)((unsigned)item - bh * (unsigned)q_tiles);\n\
        \x20       return (long long)q_block * BLOCK_M < {q_seq}.len;\n\
        \x20   }};\n\
        \x20   while (item_slot[qb] < items && !has_rows(item_slot[qb])) item_slot[qb] = claim({counter}, done + 1, items)"
    )
}
