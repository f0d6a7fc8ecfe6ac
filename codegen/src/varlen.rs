//! The varlen schedule on the CPU, as its kernels compute it:
//! [`seq_span`] is `library/varlen.cuh`'s, bound for bound, and
//! [`work_tiles`] decodes a launch's CTAs (or a persistent kernel's items)
//! as the kernels do, keeping those whose query tile has rows. The
//! backward's row kernels and dQ kernel walk query tiles as the forward's
//! grid does; its dK/dV kernels walk key tiles the same way, over the keys'
//! prefix sums and K/V heads (their CTA order permutes the grid, the set is
//! [`work_tiles`]'); [`dq_accum_tile`] places each sequence's tiles of the
//! Hopper kernel's dQ accumulator. The tests in `tests/varlen_schedule.rs`
//! hold it to covering every (sequence, head, tile) with rows once, reading
//! no token of another sequence and giving each sequence accumulator tiles
//! of its own, and to staying inside the buffers whatever the prefix sums;
//! GPU tests use it to say what a launch on bad prefix sums computes.
//!
//! The persistent forward claims its items from an item order instead
//! ([`item_order`], the twin of `cuda::emit_varlen_order`'s kernel): the
//! (sequence, head, query tile) items with rows, longest first by
//! [`tile_work`], numbered as [`decode_item`] decodes them.

use crate::analysis::{classify, TileClass};
use crate::reference::ParamValue;
use crate::spec::{Shape, Spec};

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
        Walk::Items => decode_item(unit as i64, heads, q_tiles),
    };
    (0..units)
        .map(decode)
        .filter(|t| t.q_block as i64 * (block_m as i64) < seq_span(cu_q, t.seq, total_q, max_q_len).len as i64)
        .collect()
}

/// Item `item` of a persistent varlen forward with `q_tiles` query tiles
/// per (sequence, head): `(seq · heads + head) · q_tiles` + the tile counted
/// from the last, as the kernel decodes it.
pub fn decode_item(item: i64, heads: usize, q_tiles: i32) -> WorkTile {
    let bh = item / q_tiles as i64;
    let q_block = q_tiles - 1 - (item - bh * q_tiles as i64) as i32;
    WorkTile { seq: bh as usize / heads, head: bh as usize % heads, q_block }
}

/// The item [`decode_item`] decodes as `tile`.
pub fn item_index(tile: WorkTile, heads: usize, q_tiles: i32) -> i64 {
    (tile.seq as i64 * heads as i64 + tile.head as i64) * q_tiles as i64 + (q_tiles - 1 - tile.q_block) as i64
}

/// Work estimates at least this many key tiles order as equals: the order
/// kernel counts its units per estimate in shared memory, one word each.
pub const WORK_CLASSES: i32 = 1024;

/// Entries of a launch's item order after its count: every item with rows
/// of well-formed prefix sums, `heads · Σ ceil(len / block_m) ≤ heads ·
/// (ceil(total_q / block_m) + batch)`, and never more than the launch's
/// items. (Prefix sums whose spans overlap may name more; the order then
/// keeps its first `capacity` items.)
pub fn order_capacity(batch: usize, heads: usize, total_q: i32, max_q_len: i32, block_m: i32) -> usize {
    let q_tiles = (max_q_len as i64 + block_m as i64 - 1) / block_m as i64;
    let items = q_tiles * (heads * batch) as i64;
    let compact = heads as i64 * ((total_q as i64 + block_m as i64 - 1) / block_m as i64 + batch as i64);
    items.min(compact) as usize
}

/// The key tiles (of `block_n` keys) that the interval analysis cannot rule
/// out for query tile `q_block` (of `block_m` rows) of sequence `seq`, of
/// `q_len` queries and `kv_len` keys, at head 0: the tiles the persistent
/// forward's producer walks (`next_tile` over the same classes) unless a
/// finer test removes more. The order's work estimate: causal tiles count
/// the keys up to their diagonal, full attention every key of the sequence.
pub fn tile_work(
    spec: &Spec,
    params: &[ParamValue],
    seq: usize,
    (q_len, kv_len): (i32, i32),
    q_block: i32,
    (block_m, block_n): (i32, i32),
) -> i32 {
    let shape = Shape { batch: seq + 1, heads: 1, heads_kv: 1, q_len: q_len as usize, kv_len: kv_len as usize };
    let q = (q_block * block_m, (q_block * block_m + block_m).min(q_len) - 1);
    let kv_tiles = (kv_len + block_n - 1) / block_n;
    let kept = |j: &i32| {
        let k = (j * block_n, (j * block_n + block_n).min(kv_len) - 1);
        classify(spec, &shape, params, seq as i32, 0, q, k) != TileClass::Empty
    };
    (0..kv_tiles).filter(kept).count() as i32
}

/// The persistent varlen forward's items in the order it claims them, as
/// the order kernel writes them: every (sequence, head, query tile) with
/// rows (spans clamped by [`seq_span`]), longest first by `work(seq,
/// q_block, q_len, kv_len)` capped at [`WORK_CLASSES`] − 1, the heads of one
/// tile together, at most [`order_capacity`] of them. The kernel orders
/// equal estimates as its atomics fall; this twin keeps them in sequence
/// and tile order.
pub fn item_order(
    [cu_q, cu_k]: [&[i32]; 2],
    heads: usize,
    [total_q, total_kv]: [i32; 2],
    [max_q_len, max_kv_len]: [i32; 2],
    block_m: i32,
    work: impl Fn(usize, i32, i32, i32) -> i32,
) -> Vec<i64> {
    let batch = cu_q.len() - 1;
    let q_tiles = (max_q_len + block_m - 1) / block_m;
    let mut units: Vec<(i32, usize, i32)> = Vec::new();
    for seq in 0..batch {
        let q_len = seq_span(cu_q, seq, total_q, max_q_len).len;
        let kv_len = seq_span(cu_k, seq, total_kv, max_kv_len).len;
        for q_block in 0..(q_len + block_m - 1) / block_m {
            units.push((work(seq, q_block, q_len, kv_len).min(WORK_CLASSES - 1), seq, q_block));
        }
    }
    units.sort_by_key(|&(work, _, _)| std::cmp::Reverse(work));
    let capacity = order_capacity(batch, heads, total_q, max_q_len, block_m);
    let items = units.iter().flat_map(|&(_, seq, q_block)| {
        (0..heads).map(move |head| item_index(WorkTile { seq, head, q_block }, heads, q_tiles))
    });
    items.take(capacity).collect()
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
