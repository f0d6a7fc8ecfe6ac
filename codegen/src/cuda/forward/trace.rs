//! Trace points of the warp-specialized forward ([`emit_forward_traced`]):
//! `TR(code);` lines (library/trace.cuh) at 21 events of the producer's and
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
    /// After the item's global columns' tile, its P V waited for
    /// (`global_columns`).
    Columns = 16,
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

#[cfg(test)]
mod tests {
    use super::Event::{self, *};
    use crate::cuda::target::{Mma, Target};
    use crate::cuda::tile_config::{warp_specialized, TileConfig, TileCopy};
    use crate::cuda::{emit_forward_copying, emit_forward_traced};

    const WINDOW: &str = "W { dtype: bf16, head_dim: HD, param window: i32, mask: q >= k && q - k < window }";
    const CAUSAL: &str = "C { dtype: bf16, head_dim: HD, mask: q >= k }";

    /// The producer's events, in the order its item loop prints them.
    const PRODUCER: [Event; 6] = [PQEmpty, PClaim, PFirst, PTile, PKEmpty, PVEmpty];

    /// The consumers' events up to the epilogue, with turns (ping-pong).
    const TILES: [Event; 10] = [Item, QFull, KFull, Turn, SDone, SMax, PvDone, TileEnd, LoopExit, LastPv];

    /// analyze.py names the codes from `scripts/trace/harness_args.py`'s
    /// table, kept by hand: it must hold exactly [`Event`]'s codes.
    #[test]
    fn the_harness_table_has_every_code() {
        let every = [
            Item, QFull, Columns, KFull, Turn, SDone, SMax, PvDone, TileEnd, Pass, LoopExit, LastPv, EpiStart, OStaged,
            OStored, Epi, PQEmpty, PClaim, PFirst, PTile, PKEmpty, PVEmpty,
        ];
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/trace/harness_args.py");
        let script = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let table = &script[script.find("EVENTS = [").expect("the EVENTS table")..];
        let table = &table[..table.find("\n]").expect("the table's end")];
        let mut listed: Vec<u8> =
            table.lines().filter_map(|line| line.trim().strip_prefix('(')?.split(',').next()?.parse().ok()).collect();
        let mut codes: Vec<u8> = every.iter().map(|&e| e as u8).collect();
        listed.sort_unstable();
        codes.sort_unstable();
        assert_eq!(listed, codes, "{path}'s EVENTS against trace::Event");
    }

    fn spec(source: &str, head_dim: u32) -> crate::spec::Spec {
        crate::parse_one(&source.replace("HD", &head_dim.to_string())).unwrap()
    }

    /// The trace points' codes in `source`, in order.
    fn codes(source: &str) -> Vec<u8> {
        let code = |line: &str| line.trim().strip_prefix("TR(")?.strip_suffix(");")?.parse().ok();
        source.lines().filter_map(code).collect()
    }

    fn expected(events: &[&[Event]]) -> Vec<u8> {
        events.concat().into_iter().map(|e| e as u8).collect()
    }

    /// The consumers' events `tiles` of `spec`, the step's (turn to tile
    /// end) twice where interior tiles and the others run a step each.
    fn tile_events(spec: &crate::spec::Spec, tiles: &[Event]) -> Vec<Event> {
        let in_step = |e: &Event| matches!(e, Turn | SDone | SMax | PvDone | TileEnd);
        let first = tiles.iter().position(in_step).unwrap_or(tiles.len());
        let end = first + tiles[first..].iter().take_while(|e| in_step(e)).count();
        let copies = 1 + usize::from(crate::cuda::forward::wgmma_step::splits_by_class(spec));
        let steps = (0..copies).flat_map(|_| tiles[first..end].iter().copied());
        tiles[..first].iter().copied().chain(steps).chain(tiles[end..].iter().copied()).collect()
    }

    /// Every event at its place in wgmma.w8.m1.n128's kernel (two
    /// warpgroups taking turns): with O staged in the Q buffer (d = 128)
    /// a warp frees the buffer after its store, with O's own buffer (d = 64)
    /// before the epilogue's wait; the counter opens the body. A causal
    /// kernel's step splits by class: its tile's events appear twice.
    #[test]
    fn traced_kernels_print_every_event_in_order() {
        let config = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
        for source in [WINDOW, CAUSAL] {
            for (head_dim, epilogue) in
                [(128, [EpiStart, OStaged, OStored, Epi]), (64, [Epi, EpiStart, OStaged, OStored])]
            {
                let spec = spec(source, head_dim);
                let kernel = emit_forward_traced(&spec, config, TileCopy::Tma).unwrap().source;
                let tiles = tile_events(&spec, &TILES);
                assert_eq!(codes(&kernel), expected(&[&PRODUCER, &tiles, &epilogue]), "{source} at d = {head_dim}");
                let entry = kernel.split_once("extern \"C\"").unwrap().1;
                let body = entry.split_once(") {\n").unwrap().1;
                assert!(body.starts_with("    TRACE_COUNTER\n"), "{source} at d = {head_dim}");
                assert!(kernel.contains("#define TRACE_ON 1"));
            }
        }
    }

    /// The configuration-dependent events: one warpgroup takes no turns; a
    /// sliding window's three-warpgroup items pass turns; the producer's
    /// threads store O without the copy engine's events.
    #[test]
    fn optional_events_follow_the_configuration() {
        let window = spec(WINDOW, 64);
        let wgmma = |warps| TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n: 128 };
        let one = emit_forward_traced(&window, wgmma(4), TileCopy::Tma).unwrap().source;
        let tiles: Vec<Event> = TILES.into_iter().filter(|&e| e != Turn).collect();
        let epilogue = [EpiStart, OStaged, OStored, Epi];
        assert_eq!(codes(&one), expected(&[&PRODUCER, &tiles, &epilogue]));
        let three = emit_forward_traced(&window, wgmma(12), TileCopy::Tma).unwrap().source;
        let epilogue = [Epi, EpiStart, OStaged, OStored];
        assert_eq!(codes(&three), expected(&[&PRODUCER, &[Pass], &TILES, &epilogue]));
        let causal = spec(CAUSAL, 128);
        let threads = emit_forward_traced(&causal, wgmma(8), TileCopy::Threads).unwrap().source;
        assert_eq!(codes(&threads), expected(&[&PRODUCER, &tile_events(&causal, &TILES), &[EpiStart, Epi]]));
        // Sinks beside a window: the global columns' tile between Q and the walk.
        let sinks = spec("S { dtype: bf16, head_dim: 64, param w: i32, mask: k < 4 || (q >= k && q - k < w) }", 64);
        let columns = emit_forward_traced(&sinks, wgmma(8), TileCopy::Tma).unwrap().source;
        let tiles = [&TILES[..2], &[Columns], &TILES[2..]].concat();
        assert_eq!(codes(&columns), expected(&[&PRODUCER, &tiles, &[Epi, EpiStart, OStaged, OStored]]));
    }

    /// A kernel that does not trace holds no trace point, counter or trace
    /// library.
    #[test]
    fn untraced_kernels_hold_no_trace_points() {
        for source in [WINDOW, CAUSAL] {
            for head_dim in [64, 128] {
                let spec = spec(source, head_dim);
                for config in TileConfig::feasible(&spec, Target::HOPPER) {
                    for copy in [TileCopy::Tma, TileCopy::Threads] {
                        let kernel = emit_forward_copying(&spec, config, copy).source;
                        assert!(!kernel.contains("TR(") && !kernel.contains("TRACE"), "{config:?} {copy:?}");
                    }
                    if warp_specialized(config) {
                        let traced = emit_forward_traced(&spec, config, TileCopy::Tma).unwrap().source;
                        assert!(codes(&traced).len() >= PRODUCER.len() + TILES.len() - 1, "{config:?}");
                    }
                }
            }
        }
    }
}
