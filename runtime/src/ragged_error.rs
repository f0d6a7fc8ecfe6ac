//! What a varlen, paged or decode launch can get wrong about its sequences,
//! pages or plan ([`RaggedError`], inside [`crate::Error::Ragged`]).

use std::fmt;

/// A ragged launch's prefix sums, longest lengths, block table, page size
/// or decode plan disagreeing with its buffers.
#[derive(Debug)]
pub enum RaggedError {
    /// A varlen launch's prefix sums (`cu_seqlens_q` or `cu_seqlens_k`)
    /// do not hold `batch + 1` entries.
    CuSeqlensLen { which: &'static str, len: usize, expected: usize },
    /// A varlen launch's longest sequence (`max_q_len` or `max_kv_len`)
    /// disagrees with its buffers: longer than the tokens they hold, or 0
    /// while they hold tokens.
    MaxSeqlen { which: &'static str, max: usize, tokens: usize },
    /// A block mask was passed to a varlen launch: block masks are built
    /// over a batch of equal lengths.
    VarlenBlockMask,
    /// A paged cache's pages hold no rows.
    ZeroPageSize,
    /// A paged launch's `block_table` (`batch · pages_per_seq` entries) or
    /// `kv_lens` (`batch`) holds another number of entries.
    PagedEntries { which: &'static str, len: usize, expected: usize },
    /// A paged launch's `max_kv_len` exceeds the rows a sequence's pages
    /// can hold (`pages_per_seq · page_size`, 0 in caches of no pages).
    MaxKvLenPastPages { max_kv_len: usize, capacity: usize },
    /// Dense queries of a paged launch: Q's tokens are not `batch · q_len`.
    DenseQueries { tokens: usize, batch: usize, q_len: usize },
    /// A decode launch's operands disagree with the plan they run in
    /// (`what`: batch, heads, heads_kv, q_len or the cache's rows).
    DecodePlanMismatch { what: &'static str, plan: usize, got: usize },
    /// A decode launch's `kv_lens` holds fewer than `batch` entries.
    KvLensLen { len: usize, batch: usize },
    /// A decode plan that cannot be made: no queries, a split count out of
    /// range, or head dims whose stages do not fit the GPU's shared memory.
    DecodeShape { problem: String },
    /// A decode plan ran on another kind of cache than it was made for
    /// (`DecodeOptions::paged`: `run_paged` needs a paged plan, `run` a
    /// dense one).
    DecodeCache { plan: &'static str, got: &'static str },
    /// A decode plan ran on other queries than it was made for
    /// (`DecodeOptions::varlen`: `run_varlen` needs a plan for packed
    /// queries, `run` and `run_paged` one for padded ones).
    DecodeQueries { plan: &'static str, got: &'static str },
    /// A decode plan ran on caches of another element format than it was
    /// made for (`DecodeOptions::kv_cache`: the `_e4m3` runs need an e4m3
    /// plan, the others a 16-bit one).
    DecodeKvDtype { plan: &'static str, got: &'static str },
    /// A plan made with `DecodeOptions::v_in_k` ran on a V that is not K's
    /// first `head_dims.v` columns: another buffer, start or strides.
    VNotInK { problem: &'static str },
    /// An e4m3 decode launch's K or V descale factors hold another number
    /// of entries than their granularity reads (1 per tensor, `heads_kv`
    /// per K/V head).
    DescaleLen { operand: &'static str, granularity: &'static str, len: usize, expected: usize },
}

impl fmt::Display for RaggedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
        RaggedError::CuSeqlensLen { which, len, expected } => {
            write!(f, "{which} holds {len} entries but batch + 1 = {expected}")
        }
        RaggedError::MaxSeqlen { which, max, tokens } => match max {
            0 => write!(f, "{which} is 0 but the buffers hold {tokens} tokens"),
            _ => write!(f, "{which} = {max} exceeds the {tokens} tokens the buffers hold"),
        },
        RaggedError::VarlenBlockMask => write!(
            f,
            "a varlen launch takes no block mask (it is built for equal lengths); launch without one"
        ),
        RaggedError::ZeroPageSize => write!(f, "the paged caches' page_size is 0: a page holds at least one row"),
        RaggedError::PagedEntries { which, len, expected } => {
            write!(f, "{which} holds {len} entries but the launch reads {expected}")
        }
        RaggedError::MaxKvLenPastPages { max_kv_len, capacity } => write!(
            f,
            "max_kv_len = {max_kv_len} exceeds the {capacity} rows a sequence's pages hold (pages_per_seq · page_size, 0 without pages)"
        ),
        RaggedError::DenseQueries { tokens, batch, q_len } => write!(
            f,
            "dense queries: Q holds {tokens} tokens but batch · q_len = {batch} · {q_len}"
        ),
        RaggedError::DecodePlanMismatch { what, plan, got } => {
            write!(f, "the decode operands' {what} is {got} but the plan was made for {plan}: make a plan for them")
        }
        RaggedError::KvLensLen { len, batch } => write!(f, "kv_lens holds {len} entries but batch = {batch}"),
        RaggedError::DecodeShape { problem } => write!(f, "no decode plan: {problem}"),
        RaggedError::DecodeCache { plan, got } => write!(
            f,
            "the decode plan was made for a {plan} cache but ran on a {got} one: \
             make it with DecodeOptions::paged set as its runs need"
        ),
        RaggedError::DecodeQueries { plan, got } => write!(
            f,
            "the decode plan was made for {plan} queries but ran on {got} ones: \
             make it with DecodeOptions::varlen set as its runs need"
        ),
        RaggedError::DecodeKvDtype { plan, got } => write!(
            f,
            "the decode plan was made for a {plan} cache but ran on a {got} one: \
             make it with DecodeOptions::kv_cache set as its runs need"
        ),
        RaggedError::VNotInK { problem } => write!(
            f,
            "the decode plan reads V from K's tiles (DecodeOptions::v_in_k) but V {problem}: \
             pass V as a view of K's first head_dims.v columns (same buffer, start and strides)"
        ),
        RaggedError::DescaleLen { operand, granularity, len, expected } => write!(
            f,
            "{operand}'s {granularity} descale factors hold {len} entries but the launch reads {expected}"
        ),
        }
    }
}
