//! Which rows each rank holds and which pieces it computes. A piece is
//! skipped only when the mask's interval analysis proves that no pair of
//! its query and key segments is kept for any batch and head, the rule the
//! kernels skip tiles by; the K/V a rank's pieces all skip never reach it.

use crate::analysis::{classify_region, Region, TileClass};
use crate::reference::ParamValue;
use crate::spec::{Expr, ExprKind, Shape, Spec, Ty};

/// How a sequence's positions are dealt to ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Partition {
    /// Rank r holds the r-th of `ranks` equal chunks.
    Contiguous,
    /// The sequence is cut into `2 · ranks` chunks; rank r holds chunks r
    /// and `2 · ranks − 1 − r`, so under a causal mask every rank has the
    /// same number of kept pairs.
    Zigzag,
}

/// A sequence split over `ranks` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Sharding {
    pub ranks: usize,
    pub partition: Partition,
}

/// A contiguous run of a rank's rows: `len` positions of the whole sequence
/// from `start`, stored from row `local` of the rank's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    pub start: usize,
    pub len: usize,
    pub local: usize,
}

impl Sharding {
    /// Rank `rank`'s segments of a sequence of `len` positions, in the order
    /// its buffers hold them. Chunk i of n is `[i · len / n, (i + 1) · len / n)`.
    pub fn segments(&self, len: usize, rank: usize) -> Vec<Segment> {
        let chunk = |i: usize, n: usize| {
            let start = i * len / n;
            (start, (i + 1) * len / n - start)
        };
        let chunks = match self.partition {
            Partition::Contiguous => vec![chunk(rank, self.ranks)],
            Partition::Zigzag => {
                let n = 2 * self.ranks;
                vec![chunk(rank, n), chunk(n - 1 - rank, n)]
            }
        };
        let mut local = 0;
        chunks
            .into_iter()
            .map(|(start, len)| {
                let segment = Segment { start, len, local };
                local += len;
                segment
            })
            .collect()
    }

    /// How many positions rank `rank` holds of a sequence of `len`.
    pub fn local_len(&self, len: usize, rank: usize) -> usize {
        self.segments(len, rank).iter().map(|s| s.len).sum()
    }
}

/// One launch of a rank: its query segment against the keys of a segment
/// held by `kv_rank` that the mask may keep (the segment less its ends no
/// query keeps), with the mask's class over the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub q: Segment,
    pub kv_rank: usize,
    pub kv: Segment,
    pub class: TileClass,
    /// The piece adds the spec's learned sink: its keys start at position 0.
    pub sink: bool,
}

/// The pieces rank `rank` computes for a launch of the whole `shape`
/// (`q_len` and `kv_len` the whole sequence's), key ranks in ring order
/// from its own (`rank`, `rank − 1`, …), so it starts on keys it holds.
/// Skips the pieces no pair of which is kept, except the one that carries a
/// row's learned sink (its LSE is the sink's even with no key kept).
pub fn rank_pieces(spec: &Spec, shape: &Shape, params: &[ParamValue], sharding: Sharding, rank: usize) -> Vec<Piece> {
    let queries = sharding.segments(shape.q_len, rank);
    let mut pieces = Vec::new();
    for step in 0..sharding.ranks {
        let kv_rank = (rank + sharding.ranks - step) % sharding.ranks;
        for kv in sharding.segments(shape.kv_len, kv_rank) {
            for &q in &queries {
                let sink = spec.sink.is_some() && kv.start == 0 && q.len > 0;
                let class = pair_class(spec, shape, params, q, kv);
                if class != TileClass::Empty || sink {
                    let kv = if sink { kv } else { kept_keys(spec, shape, params, q, kv) };
                    pieces.push(Piece { q, kv_rank, kv, class, sink });
                }
            }
        }
    }
    pieces
}

/// `kv` without the keys at its ends that no query of `q` keeps (the
/// interval analysis proves it), so a window's piece reads, and its rank
/// receives, only the keys inside the window. Binary search on each end:
/// a sub-range of an empty range is empty.
fn kept_keys(spec: &Spec, shape: &Shape, params: &[ParamValue], q: Segment, kv: Segment) -> Segment {
    let empty = |start: usize, len: usize| {
        let part = Segment { start, len, local: 0 };
        len == 0 || pair_class(spec, shape, params, q, part) == TileClass::Empty
    };
    let longest = |is_empty: &dyn Fn(usize) -> bool| {
        let (mut lo, mut hi) = (0, kv.len);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if is_empty(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    };
    let head = longest(&|n| empty(kv.start, n));
    let tail = longest(&|n| n <= kv.len - head && empty(kv.start + kv.len - n, n));
    Segment { start: kv.start + head, len: kv.len - head - tail, local: kv.local + head }
}

/// The mask's class over segment `q` × segment `kv`, every batch and head.
fn pair_class(spec: &Spec, shape: &Shape, params: &[ParamValue], q: Segment, kv: Segment) -> TileClass {
    let span = |s: Segment| match (i32::try_from(s.start), i32::try_from(s.start + s.len)) {
        (Ok(a), Ok(b)) => (a, b - 1),
        _ => (0, -1),
    };
    let last = |n: usize| i32::try_from(n).map_or(i32::MAX, |n| n - 1);
    let region = Region { b: (0, last(shape.batch)), h: (0, last(shape.heads)), q: span(q), k: span(kv) };
    let keep_all = Expr { ty: Ty::Bool, kind: ExprKind::Bool(true) };
    classify_region(spec.mask.as_ref().unwrap_or(&keep_all), shape, params, region)
}
