//! Paged K/V addressing on the CPU, as the kernels compute it: the twin of
//! `library/paged.cuh`, bound for bound. Key `k` of sequence `b` is row
//! `k % page_size` of page `table[b][k / page_size]`; lengths and page ids
//! come from the device, so both are clamped. The tests in
//! `tests/paged_addressing.rs` hold it to never leaving the caches or the
//! block table, whatever the lengths and ids; GPU tests use it to say what
//! a launch on bad values computes.

use crate::varlen::{seq_span, SeqSpan};

/// One sequence's view of a paged cache: its row of the block table and
/// the cache's geometry (strides in elements).
#[derive(Clone, Copy, Debug)]
pub struct PagedRows<'a> {
    pub pages: &'a [i32],
    pub page_size: i32,
    pub num_pages: i32,
    pub page_stride: i64,
    pub row_stride: i64,
}

/// Sequence `b`'s key count from `kv_lens` (one per sequence), clamped as
/// the kernels clamp it: into `[0, min(pages_per_seq · page_size, max_len)]`
/// (0 in caches of no pages), so no key lies past the table's pages or the
/// longest length the grid and the tensors are sized by.
pub fn paged_kv_len(
    kv_lens: &[i32],
    b: usize,
    pages_per_seq: i32,
    page_size: i32,
    num_pages: i32,
    max_len: i32,
) -> i32 {
    let cap = match num_pages > 0 {
        true => (pages_per_seq as i64 * page_size as i64).min(max_len as i64),
        false => 0,
    };
    (kv_lens[b] as i64).max(0).min(cap) as i32
}

/// The element offset of key `k` (`0 <= k <` the clamped length) from the
/// head's first element of page 0: a page id outside `[0, num_pages)` reads
/// the nearest page instead.
pub fn paged_row(p: &PagedRows, k: i32) -> i64 {
    let page = p.pages[(k / p.page_size) as usize].max(0).min(p.num_pages - 1);
    page as i64 * p.page_stride + (k % p.page_size) as i64 * p.row_stride
}

/// Sequence `b`'s queries: [`seq_span`] of the prefix sums `cu`, or with
/// none (dense queries, `total = batch · max_len`) `max_len` rows from
/// `b · max_len`.
pub fn query_span(cu: Option<&[i32]>, b: usize, total: i32, max_len: i32) -> SeqSpan {
    match cu {
        None => SeqSpan { start: b as i32 * max_len, len: max_len },
        Some(cu) => seq_span(cu, b, total, max_len),
    }
}
