//! Trace points of the warp-specialized forward ([`emit_forward_traced`]):
//! `TR(code);` lines (library/trace.cuh) at 20 events of the producer's and
//! the consumers' loops, printed where the emitters print the lines they
//! time, and nothing at all in a kernel that does not trace, so the
//! untraced kernels stay byte-identical. `scripts/trace/analyze.py` names
//! the codes (its table, in `scripts/trace/harness_args.py`, mirrors
//! [`Event`]).
//!
//! [`emit_forward_traced`]: super::emit_forward_traced

use super::plan::Plan;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// A traced event and its code. Consumer events are 1..19, producer events
/// 20.. (analyze.py tells the roles apart by them). The line each follows
/// or precedes is named; events that exist only in some configurations say
/// which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// After the wait for the producer's claim.
    Item = 1,
    /// After the wait for the item's Q.
    QFull = 2,
    /// After the wait for a tile's K.
    KFull = 3,
    /// After the wait for this warpgroup's turn (ping-pong only).
    Turn = 4,
    /// After S = Q K^T is done (`fence_operands(s[0])`).
    SDone = 5,
    /// Before the wait for P V: the softmax is done.
    SMax = 6,
    /// After the wait for P V.
    PvDone = 7,
    /// After the tile's P is packed (the step's end).
    TileEnd = 12,
    /// At the end of a turn passed on a tile the warpgroup's rows keep no
    /// pair of (where the producer classifies per warpgroup).
    Pass = 8,
    /// Before the last visited tile's P V.
    LoopExit = 9,
    /// After the last visited tile's P V.
    LastPv = 10,
    /// After the epilogue's first wait (the warpgroup's barrier, or the
    /// warp's wait for its previous O's read).
    EpiStart = 13,
    /// Before the copy engine's store of the warp's O (TMA only).
    OStaged = 14,
    /// After the warp's store of O is issued (TMA only).
    OStored = 15,
    /// After the warp frees its share of the Q buffer.
    Epi = 11,
    /// Producer: after the wait for a free Q buffer.
    PQEmpty = 20,
    /// Producer: after the claim is seen by every producer thread.
    PClaim = 21,
    /// Producer: after the item's tiles are classified (the first tile).
    PFirst = 25,
    /// Producer: before the wait for a free K stage.
    PTile = 22,
    /// Producer: after the wait for a free K stage.
    PKEmpty = 23,
    /// Producer: after the wait for a free V stage.
    PVEmpty = 24,
}

/// `TR(code);` where the plan traces; nothing otherwise.
pub(super) fn point(w: &mut Writer<String>, plan: &Plan, event: Event) -> fmt::Result {
    match plan.trace {
        true => writeln!(w, "TR({});", event as u8),
        false => Ok(()),
    }
}

/// The body's first line where the plan traces: the per-thread event count
/// that `TR` bumps (library/trace.cuh).
pub(super) fn counter(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    match plan.trace {
        true => writeln!(w, "TRACE_COUNTER"),
        false => Ok(()),
    }
}
