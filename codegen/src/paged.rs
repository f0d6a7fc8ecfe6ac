//! Paged K/V addressing on the CPU, as the kernels compute it: the twin of
//! `library/paged.cuh` (and of the paged decode kernel's tile copy,
//! `library/decode_paged.cuh`), bound for bound. Key `k` of sequence `b` is row
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
    let (page, row) = page_slot(p, k);
    page as i64 * p.page_stride + row as i64 * p.row_stride
}

/// Key `k`'s page (clamped, as [`paged_row`]'s) and row in it: what a
/// paged decode kernel's lane resolves once per tile (`PageTable::slot`).
pub fn page_slot(p: &PagedRows, k: i32) -> (i32, i32) {
    (p.pages[(k / p.page_size) as usize].max(0).min(p.num_pages - 1), k % p.page_size)
}

/// The paged decode tile copy's lanes (`load_paged_kv_tile`): warp `warp`
/// of `warps` copies rows `[warp · rows / warps, …)` of a tile of `rows`,
/// and its lane `lane` resolves the key of the share's row `lane % (rows /
/// warps)` (`warp_tile_row`). Returns the tile row that lane resolves.
pub fn warp_tile_row(rows: usize, warps: usize, warp: usize, lane: usize) -> usize {
    let share = rows / warps;
    warp * share + lane % share
}

/// Step `step` of lane `lane` of warp `warp` copying a tile of `rows` rows
/// of `chunks` chunks (16 bytes, or elements in the scalar copy): the tile
/// row and chunk it copies and the lane whose resolved key it takes by
/// shuffle, or `None` past the warp's share.
pub fn warp_tile_copy(
    (rows, warps, chunks): (usize, usize, usize),
    warp: usize,
    lane: usize,
    step: usize,
) -> Option<(usize, usize, usize)> {
    let share = rows / warps;
    let e = step * 32 + lane;
    let source = (e / chunks).min(share - 1);
    (e < share * chunks).then_some((warp * share + source, e % chunks, source))
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
