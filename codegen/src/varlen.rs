//! The varlen forward's schedule on the CPU, as its kernels compute it:
//! [`seq_span`] is `library/varlen.cuh`'s, bound for bound, and
//! [`work_tiles`] decodes a launch's CTAs (or a persistent kernel's items)
//! as the kernels do, keeping those whose query tile has rows. The tests in
//! `tests/varlen_schedule.rs` hold it to covering every (sequence, head,
//! query tile) with rows once and reading no token of another sequence,
//! whatever the prefix sums; GPU tests use it to say what a launch on bad
//! prefix sums computes.

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
        Walk::Items => {
            let bh = unit / q_tiles as usize;
            let q_block = q_tiles - 1 - (unit - bh * q_tiles as usize) as i32;
            WorkTile { seq: bh / heads, head: bh % heads, q_block }
        }
    };
    (0..units)
        .map(decode)
        .filter(|t| t.q_block as i64 * (block_m as i64) < seq_span(cu_q, t.seq, total_q, max_q_len).len as i64)
        .collect()
}
