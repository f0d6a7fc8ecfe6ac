//! The varlen schedule on the CPU, as its kernels compute it:
//! [`seq_span`] is `library/varlen.cuh`'s, bound for bound, and
//! [`work_tiles`] decodes a launch's CTAs (or a persistent kernel's items)
//! as the kernels do, keeping those whose query tile has rows, and
//! [`tile_rows`] places a tile's rows in its sequence. The
//! backward's row kernels and dQ kernel walk query tiles as the forward's
//! grid does; its dK/dV kernels walk key tiles the same way, over the keys'
//! prefix sums and K/V heads (their CTA order permutes the grid, the set is
//! [`work_tiles`]'); [`dq_accum_tile`] places each sequence's tiles of the
//! Hopper kernel's dQ accumulator. The tests in `tests/varlen_schedule.rs`
//! hold it to covering every (sequence, head, tile) with rows once, reading
//! no token of another sequence and giving each sequence accumulator tiles
//! of its own, and to staying inside the buffers whatever the prefix sums;
//! GPU tests use it to say what a launch on bad prefix sums computes.

use crate::mask_parts::{longest_tail_last, TAIL_ITEMS};

/// A sequence's tokens in a packed operand: `start .. start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub start: i32,
    pub len: i32,
}

/// Sequence `b`'s span from the prefix sums `cu` (`batch + 1` entries)
/// over a buffer of `total` tokens, clamped as the kernels clamp it:
/// `0 <= start <= start + len <= total` and `len <= max_len`, whatever `cu`
/// holds.
pub fn seq_span(cu: &[i32], b: usize, total: i32, max_len: i32) -> SeqSpan {
    let start = cu[b].max(0).min(total);
    let end = cu[b + 1].max(start).min(total);
    SeqSpan { start, len: (end - start).min(max_len) }
}

/// One work tile of a varlen forward: query tile `q_block` (rows from
/// `q_block · block_m`) of head `head` of sequence `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkTile {
    pub seq: usize,
    pub head: usize,
    pub q_block: i32,
}

/// How a varlen forward's work is laid out: a grid of CTAs, or a
/// persistent kernel's claimed items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Walk {
    /// `(q_tiles, heads, batch)` CTAs, query tiles in reverse launch order.
    Grid,
    /// `q_tiles · heads · batch` items, `(b · heads + h) · q_tiles` + the
    /// tile counted from the last.
    Items,
    /// [`Walk::Items`], the last pairs' items (about
    /// [`TAIL_ITEMS`](crate::mask_parts::TAIL_ITEMS)) tile by tile: a
    /// persistent kernel under an analytic mask
    /// ([`longest_tail_last`](crate::mask_parts::longest_tail_last)).
    LongestTail,
}

/// The tiles that compute rows, in launch (claim) order: the longest
/// sequence's query tiles (`max_q_len` rows) for every sequence and head,
/// decoded as the kernels decode them, less those past their sequence's end
/// (a CTA returns at once; a persistent producer claims on).
pub fn work_tiles(cu_q: &[i32], heads: usize, total_q: i32, max_q_len: i32, block_m: i32, walk: Walk) -> Vec<WorkTile> {
    let batch = cu_q.len() - 1;
    let q_tiles = (max_q_len + block_m - 1) / block_m;
    let units = q_tiles as usize * heads * batch;
    let decode = |unit: usize| match walk {
        Walk::Grid => {
            let (x, rest) = (unit % q_tiles as usize, unit / q_tiles as usize);
            WorkTile { seq: rest / heads, head: rest % heads, q_block: q_tiles - 1 - x as i32 }
        }
        Walk::Items | Walk::LongestTail => {
            let tail = if walk == Walk::LongestTail { TAIL_ITEMS } else { 0 };
            let (bh, q_block) = longest_tail_last(unit as i64, (heads * batch) as i64, q_tiles as i64, tail);
            WorkTile { seq: bh as usize / heads, head: bh as usize % heads, q_block: q_block as i32 }
        }
    };
    (0..units)
        .map(decode)
        .filter(|t| t.q_block as i64 * (block_m as i64) < seq_span(cu_q, t.seq, total_q, max_q_len).len as i64)
        .collect()
}

/// The rows of its sequence (`len` > 0 rows) that query tile `q_block`
/// computes: `q_block · block_m` on, or with `tail_aligned` (the persistent
/// forwards' `Plan::tail_aligned`) tiles that end at the sequence's last
/// row, the first starting at row 0 and overlapping the second.
pub fn tile_rows(q_block: i32, len: i32, block_m: i32, tail_aligned: bool) -> std::ops::Range<i32> {
    let slack = if tail_aligned { block_m - 1 - (len - 1) % block_m } else { 0 };
    let q0 = (q_block * block_m - slack).max(0);
    q0..(q0 + block_m).min(len)
}

/// Query rows per tile of the backward's `Fragments` dQ accumulator (the
/// Hopper dK/dV kernel's step).
pub const DQ_TILE_ROWS: i32 = 64;

/// The first of sequence `b`'s `ceil(len / DQ_TILE_ROWS)` tiles in a head of
/// a varlen launch's `Fragments` dQ accumulator (`backward/packing.rs`):
/// `start / DQ_TILE_ROWS + b` of its clamped span, so that well-formed
/// prefix sums give each sequence tiles of its own.
pub fn dq_accum_tile(cu: &[i32], b: usize, total: i32, max_len: i32) -> i32 {
    seq_span(cu, b, total, max_len).start / DQ_TILE_ROWS + b as i32
}

/// Tiles per head of that accumulator: `ceil(total / DQ_TILE_ROWS) + batch`,
/// which hold every sequence's tiles whatever the prefix sums.
pub fn dq_accum_tiles(total: i32, batch: usize) -> i64 {
    (total as i64 + DQ_TILE_ROWS as i64 - 1) / DQ_TILE_ROWS as i64 + batch as i64
}
