//! The varlen schedule (`flashgen_codegen::varlen`, the CPU twin of the
//! kernels' sequence spans and tile decode): every (sequence, head, query
//! or key tile) with rows is computed once, a tile reads only tokens of its
//! own sequence, and each sequence has dQ accumulator tiles of its own;
//! whatever the prefix sums hold, every read stays inside the buffers.

use flashgen_codegen::varlen::{
    dq_accum_tile, dq_accum_tiles, seq_span, tile_rows, work_tiles, Walk, WorkTile, DQ_TILE_ROWS,
};
use proptest::prelude::*;
use std::collections::HashSet;
use std::ops::Range;

/// Prefix sums of `lens`, and the tokens of a buffer that holds them and
/// `pad` more.
fn prefix_sums(lens: &[i32], pad: i32) -> (Vec<i32>, i32) {
    let cu: Vec<i32> = std::iter::once(0)
        .chain(lens.iter().scan(0, |sum, &len| {
            *sum += len;
            Some(*sum)
        }))
        .collect();
    let total = cu[lens.len()] + pad;
    (cu, total)
}

/// Lengths of up to 6 sequences, 0 and 1 included, sometimes one much
/// longer than the rest.
fn lengths() -> impl Strategy<Value = Vec<i32>> {
    (prop::collection::vec(prop_oneof![Just(0), Just(1), 0..200i32], 0..6), any::<bool>()).prop_map(
        |(mut lens, long)| {
            if long && !lens.is_empty() {
                lens[0] = 1500;
            }
            lens
        },
    )
}

/// The rows `tile` reads and writes, as token indices of the packed buffer,
/// its tiles from row 0 or ending at the sequence's last row.
fn rows_aligned(tile: &WorkTile, cu: &[i32], total: i32, max: i32, block_m: i32, tail: bool) -> Range<i32> {
    let span = seq_span(cu, tile.seq, total, max);
    let r = tile_rows(tile.q_block, span.len, block_m, tail);
    span.start + r.start..span.start + r.end
}

/// [`rows_aligned`] from row 0, as the backward's tiles and the forward's grid walk them.
fn rows(tile: &WorkTile, cu: &[i32], total: i32, max: i32, block_m: i32) -> Range<i32> {
    rows_aligned(tile, cu, total, max, block_m, false)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_query_tile_with_rows_runs_once_inside_its_sequence(
        lens in lengths(),
        pad in 0..40i32,
        extra_max in 0..70i32,
        heads in 1..4usize,
        block_m in prop::sample::select(vec![64, 128, 192]),
        walk in prop::sample::select(vec![Walk::Grid, Walk::Items, Walk::LongestTail]),
    ) {
        let (cu, total) = prefix_sums(&lens, pad);
        // The host requires max_q_len <= total; any such bound at least the
        // longest length is valid.
        let longest = lens.iter().copied().max().unwrap_or(0);
        let max = (longest + extra_max).min(total);
        let tiles = work_tiles(&cu, heads, total, max, block_m, walk);
        let unique: HashSet<WorkTile> = tiles.iter().copied().collect();
        prop_assert_eq!(unique.len(), tiles.len(), "a tile runs twice");
        let expected: HashSet<WorkTile> = (0..lens.len())
            .flat_map(|seq| (0..heads).map(move |head| (seq, head)))
            .flat_map(|(seq, head)| {
                let q_tiles = (lens[seq] + block_m - 1) / block_m;
                (0..q_tiles).map(move |q_block| WorkTile { seq, head, q_block })
            })
            .collect();
        prop_assert_eq!(&unique, &expected);
        for tile in &tiles {
            let r = rows(tile, &cu, total, max, block_m);
            prop_assert!(cu[tile.seq] <= r.start && r.start < r.end && r.end <= cu[tile.seq + 1], "{tile:?} reads {r:?}");
        }
        // Every row of every sequence is written by exactly one tile per head.
        let written: usize = tiles.iter().map(|t| rows(t, &cu, total, max, block_m).len()).sum();
        prop_assert_eq!(written, heads * lens.iter().sum::<i32>() as usize);
    }

    /// Tiles that end at their sequence's last row cover every row of it,
    /// each tile as many rows as the sequence has up to `block_m`, none
    /// outside it: only the first two tiles share rows.
    #[test]
    fn tail_aligned_tiles_fill_their_sequence(
        lens in lengths(),
        heads in 1..3usize,
        block_m in prop::sample::select(vec![64, 128, 192]),
    ) {
        let (cu, total) = prefix_sums(&lens, 0);
        let max = lens.iter().copied().max().unwrap_or(0);
        let tiles = work_tiles(&cu, heads, total, max, block_m, Walk::Items);
        let mut covered = vec![0u32; total as usize];
        for tile in &tiles {
            let r = rows_aligned(tile, &cu, total, max, block_m, true);
            let len = lens[tile.seq];
            prop_assert!(cu[tile.seq] <= r.start && r.end <= cu[tile.seq + 1], "{tile:?} reads {r:?}");
            prop_assert_eq!(r.len() as i32, len.min(block_m), "{:?} is short", tile);
            prop_assert_eq!(r.end == cu[tile.seq + 1], tile.q_block == (len - 1) / block_m);
            r.for_each(|row| covered[row as usize] += 1);
        }
        // Per head, the first two tiles share the rows the last would have left empty.
        for (seq, &len) in lens.iter().enumerate() {
            let shared = if len > block_m { (len + block_m - 1) / block_m * block_m - len } else { 0 };
            let rows = cu[seq]..cu[seq + 1];
            prop_assert!(rows.clone().all(|row| [1, 2].map(|n| n * heads as u32).contains(&covered[row as usize])));
            let twice = rows.filter(|&row| covered[row as usize] == 2 * heads as u32).count();
            prop_assert_eq!(twice as i32, shared);
        }
    }

    #[test]
    fn bad_prefix_sums_stay_inside_the_buffer(
        cu in prop::collection::vec(prop_oneof![Just(i32::MIN), Just(i32::MAX), -50..400i32], 1..7),
        total in 0..300i32,
        max in 0..300i32,
        heads in 1..3usize,
        block_m in prop::sample::select(vec![64, 128]),
    ) {
        let max = max.min(total);
        let tiles = work_tiles(&cu, heads, total, max, block_m, Walk::Items);
        prop_assert_eq!(tiles.iter().copied().collect::<HashSet<_>>().len(), tiles.len());
        for b in 0..cu.len() - 1 {
            let span = seq_span(&cu, b, total, max);
            prop_assert!(0 <= span.start && 0 <= span.len && span.len <= max && span.start + span.len <= total, "{span:?}");
        }
        for tile in &tiles {
            let r = rows(tile, &cu, total, max, block_m);
            prop_assert!(0 <= r.start && r.start < r.end && r.end <= total, "{tile:?} reads {r:?}");
        }
    }
}

/// Sequence `b`'s tiles of the `Fragments` dQ accumulator (in one head).
fn accum_tiles(cu: &[i32], b: usize, total: i32, max: i32) -> std::ops::Range<i64> {
    let first = dq_accum_tile(cu, b, total, max) as i64;
    let len = seq_span(cu, b, total, max).len;
    first..first + (len + DQ_TILE_ROWS - 1) as i64 / DQ_TILE_ROWS as i64
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The dK/dV kernels' CTAs: every key tile with keys of every sequence
    /// and K/V head once, inside its sequence's keys.
    #[test]
    fn every_key_tile_with_keys_runs_once_inside_its_sequence(
        lens in lengths(),
        pad in 0..40i32,
        heads_kv in 1..3usize,
        block_n in prop::sample::select(vec![64, 128]),
    ) {
        let (cu, total) = prefix_sums(&lens, pad);
        let max = lens.iter().copied().max().unwrap_or(0);
        let tiles = work_tiles(&cu, heads_kv, total, max, block_n, Walk::Grid);
        prop_assert_eq!(tiles.iter().copied().collect::<HashSet<_>>().len(), tiles.len());
        let written: usize = tiles.iter().map(|t| rows(t, &cu, total, max, block_n).len()).sum();
        prop_assert_eq!(written, heads_kv * lens.iter().sum::<i32>() as usize);
        for tile in &tiles {
            let r = rows(tile, &cu, total, max, block_n);
            prop_assert!(cu[tile.seq] <= r.start && r.end <= cu[tile.seq + 1], "{tile:?} reads {r:?}");
        }
    }

    /// Well-formed prefix sums give each sequence's query tiles accumulator
    /// tiles no other sequence touches, inside a head's tiles.
    #[test]
    fn sequences_have_dq_accumulator_tiles_of_their_own(lens in lengths(), pad in 0..40i32) {
        let (cu, total) = prefix_sums(&lens, pad);
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut owner = HashSet::new();
        for b in 0..lens.len() {
            let tiles = accum_tiles(&cu, b, total, max);
            prop_assert_eq!(tiles.end - tiles.start, (lens[b] as i64 + 63) / 64);
            for tile in tiles {
                prop_assert!(tile < dq_accum_tiles(total, lens.len()), "sequence {b}: tile {tile}");
                prop_assert!(owner.insert(tile), "sequence {b} shares tile {tile}");
            }
        }
    }

    /// Whatever the prefix sums, every accumulator tile a sequence touches
    /// lies inside the head's tiles.
    #[test]
    fn bad_prefix_sums_stay_inside_the_dq_accumulator(
        cu in prop::collection::vec(prop_oneof![Just(i32::MIN), Just(i32::MAX), -50..400i32], 1..7),
        total in 0..300i32,
        max in 0..300i32,
    ) {
        let (max, batch) = (max.min(total), cu.len() - 1);
        for b in 0..batch {
            let tiles = accum_tiles(&cu, b, total, max);
            prop_assert!(0 <= tiles.start && tiles.end <= dq_accum_tiles(total, batch), "{b}: {tiles:?}");
        }
    }
}

#[test]
fn well_formed_prefix_sums_are_read_as_they_are() {
    let (cu, total) = prefix_sums(&[5, 0, 1, 130], 3);
    let spans: Vec<_> = (0..4).map(|b| seq_span(&cu, b, total, 130)).collect();
    let expected = [(0, 5), (5, 0), (5, 1), (6, 130)];
    assert_eq!(spans.iter().map(|s| (s.start, s.len)).collect::<Vec<_>>(), expected);
    // 130 rows in 64-row tiles: three tiles for the long sequence, one each
    // for the short ones, none for the empty one; per head.
    assert_eq!(work_tiles(&cu, 2, total, 130, 64, Walk::Grid).len(), 2 * (1 + 1 + 3));
}

/// The runtime sizes the accumulator as the twin counts its tiles.
#[test]
fn the_dq_accumulator_holds_every_head_s_tiles() {
    use flashgen_codegen::cuda::{DqAccum, DqOrder};
    let spec = flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 120, mask: q >= k }").unwrap();
    for (heads, total, batch) in [(1, 0, 1), (4, 100, 3), (8, 6401, 40)] {
        let len = DqAccum::Fragments { cols: 128, order: DqOrder::Queries, step_rows: 64 }
            .varlen_len(&spec, heads, total, batch);
        assert_eq!(len as i64, heads as i64 * dq_accum_tiles(total as i32, batch) * DQ_TILE_ROWS as i64 * 128);
    }
}
