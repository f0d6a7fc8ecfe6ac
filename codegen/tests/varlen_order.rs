//! The persistent varlen forward's item order (`flashgen_codegen::varlen::
//! item_order`, the CPU twin of the order kernel): every (sequence, head,
//! query tile) with rows listed once, longest first by its own work
//! estimate, reading only its own sequence's tokens, inside the order's
//! capacity and the launch's items whatever the prefix sums hold.

use flashgen_codegen::parse_one;
use flashgen_codegen::reference::ParamValue;
use flashgen_codegen::varlen::{decode_item, item_order, order_capacity, seq_span, tile_work, WorkTile, WORK_CLASSES};
use proptest::prelude::*;
use std::collections::HashSet;

/// Masks whose work differs per tile (causal, both alignments, a window)
/// and one whose work is the sequence's keys (none), with their params.
fn spec_of(mask: usize) -> (flashgen_codegen::Spec, Vec<ParamValue>) {
    let text = [
        "S { dtype: bf16, head_dim: 64, mask: q >= k }",
        "S { dtype: bf16, head_dim: 64, mask: q + kv_len - q_len >= k }",
        "S { dtype: bf16, head_dim: 64, param window: i32, mask: q >= k && q - k < window }",
        "S { dtype: bf16, head_dim: 64 }",
    ][mask];
    let params = if mask == 2 { vec![ParamValue::I32(100)] } else { Vec::new() };
    (parse_one(text).unwrap(), params)
}

/// Prefix sums of `lens` and a buffer of their tokens and `pad` more.
fn prefix_sums(lens: &[i32], pad: i32) -> (Vec<i32>, i32) {
    let mut cu = vec![0];
    for len in lens {
        cu.push(cu.last().unwrap() + len);
    }
    let total = cu[lens.len()] + pad;
    (cu, total)
}

/// Up to 8 sequences' (queries, keys), 0 and 1 included, sometimes one much
/// longer than the rest.
fn lengths() -> impl Strategy<Value = Vec<(i32, i32)>> {
    let len = || prop_oneof![Just(0), Just(1), 0..300i32];
    (prop::collection::vec((len(), len()), 0..8), any::<bool>()).prop_map(|(mut lens, long)| {
        if long && !lens.is_empty() {
            lens[0] = (1500, 1700);
        }
        lens
    })
}

/// A launch's order, decoded, with each tile's work estimate.
struct Order {
    tiles: Vec<WorkTile>,
    work: Vec<i32>,
    capacity: usize,
    items: i64,
}

fn order(
    mask: usize,
    [cu_q, cu_k]: [&[i32]; 2],
    heads: usize,
    totals: [i32; 2],
    maxes: [i32; 2],
    (block_m, block_n): (i32, i32),
) -> Order {
    let (spec, params) = spec_of(mask);
    let work =
        |seq, q_block, q_len, kv_len| tile_work(&spec, &params, seq, (q_len, kv_len), q_block, (block_m, block_n));
    let items = item_order([cu_q, cu_k], heads, totals, maxes, block_m, work);
    let q_tiles = (maxes[0] + block_m - 1) / block_m;
    let tiles: Vec<WorkTile> = items.iter().map(|&i| decode_item(i, heads, q_tiles)).collect();
    let lens =
        |t: &WorkTile| (seq_span(cu_q, t.seq, totals[0], maxes[0]).len, seq_span(cu_k, t.seq, totals[1], maxes[1]).len);
    let work = tiles.iter().map(|t| work(t.seq, t.q_block, lens(t).0, lens(t).1).min(WORK_CLASSES - 1)).collect();
    let batch = cu_q.len() - 1;
    let capacity = order_capacity(batch, heads, totals[0], maxes[0], block_m);
    Order { tiles, work, capacity, items: q_tiles as i64 * (heads * batch) as i64 }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn every_tile_with_rows_once_longest_first_inside_its_sequence(
        lens in lengths(),
        pad in 0..40i32,
        extra_max in 0..70i32,
        heads in 1..4usize,
        mask in 0..4usize,
        block_m in prop::sample::select(vec![64, 128, 192]),
        block_n in prop::sample::select(vec![64, 128]),
    ) {
        let (q_lens, kv_lens): (Vec<i32>, Vec<i32>) = lens.iter().copied().unzip();
        let ((cu_q, total_q), (cu_k, total_kv)) = (prefix_sums(&q_lens, pad), prefix_sums(&kv_lens, 0));
        let longest = |lens: &[i32], total| (lens.iter().copied().max().unwrap_or(0) + extra_max).min(total);
        let maxes = [longest(&q_lens, total_q), longest(&kv_lens, total_kv)];
        let o = order(mask, [&cu_q, &cu_k], heads, [total_q, total_kv], maxes, (block_m, block_n));
        let unique: HashSet<WorkTile> = o.tiles.iter().copied().collect();
        prop_assert_eq!(unique.len(), o.tiles.len(), "a tile is listed twice");
        let expected: HashSet<WorkTile> = (0..lens.len())
            .flat_map(|seq| (0..heads).map(move |head| (seq, head)))
            .flat_map(|(seq, head)| {
                (0..(q_lens[seq] + block_m - 1) / block_m).map(move |q_block| WorkTile { seq, head, q_block })
            })
            .collect();
        prop_assert_eq!(&unique, &expected);
        prop_assert!(o.tiles.len() <= o.capacity);
        prop_assert!(o.work.windows(2).all(|w| w[0] >= w[1]), "not longest first: {:?}", o.work);
        for t in &o.tiles {
            let q0 = cu_q[t.seq] + t.q_block * block_m;
            prop_assert!(q0 < cu_q[t.seq + 1], "{t:?} starts past its sequence");
        }
    }

    #[test]
    fn bad_prefix_sums_stay_inside_the_order_and_the_buffer(
        cu_q in prop::collection::vec(prop_oneof![Just(i32::MIN), Just(i32::MAX), -50..400i32], 1..7),
        cu_k in prop::collection::vec(prop_oneof![Just(i32::MIN), Just(i32::MAX), -50..400i32], 7),
        totals in (0..300i32, 0..300i32),
        maxes in (0..300i32, 0..300i32),
        heads in 1..3usize,
        mask in 0..4usize,
        block_m in prop::sample::select(vec![64, 128]),
    ) {
        let (totals, batch) = ([totals.0, totals.1], cu_q.len() - 1);
        let maxes = [maxes.0.min(totals[0]), maxes.1.min(totals[1])];
        let o = order(mask, [&cu_q, &cu_k[..=batch]], heads, totals, maxes, (block_m, 64));
        prop_assert!(o.tiles.len() <= o.capacity && o.capacity as i64 <= o.items);
        prop_assert_eq!(o.tiles.iter().copied().collect::<HashSet<_>>().len(), o.tiles.len());
        for t in &o.tiles {
            let span = seq_span(&cu_q, t.seq, totals[0], maxes[0]);
            let q0 = span.start + t.q_block * block_m;
            prop_assert!(t.seq < batch && 0 <= q0 && q0 < span.start + span.len && span.start + span.len <= totals[0]);
        }
    }
}

/// The estimate: a causal tile's keys up to its diagonal, full attention's
/// every key of the sequence, a window's keys within it.
#[test]
fn work_is_the_key_tiles_the_rows_keep() {
    let work = |mask, q_len, kv_len, q_block| {
        let (spec, params) = spec_of(mask);
        tile_work(&spec, &params, 0, (q_len, kv_len), q_block, (128, 64))
    };
    assert_eq!((0..4).map(|t| work(0, 500, 500, t)).collect::<Vec<_>>(), [2, 4, 6, 8]);
    assert_eq!((0..4).map(|t| work(3, 500, 900, t)).collect::<Vec<_>>(), [15; 4]);
    // Bottom-right: 400 keys more than queries.
    assert_eq!(work(1, 500, 900, 0), 9);
    // A window of 100 keys over 128 rows: 228 keys, four or five tiles.
    assert!((4..=5).contains(&work(2, 1000, 1000, 5)));
    assert_eq!(work(0, 0, 0, 0), 0);
}

/// Thousands of sequences, most short, some empty, one long: every item
/// listed, the long sequence's last tiles first.
#[test]
fn thousands_of_sequences() {
    let mut lens: Vec<i32> = (0..4000).map(|i| [0, 1, 17, 64, 65, 300][i % 6]).collect();
    lens[1234] = 20_000;
    let (cu, total) = prefix_sums(&lens, 0);
    let o = order(0, [&cu, &cu], 3, [total, total], [20_000, 20_000], (128, 128));
    let expected: i32 = lens.iter().map(|l| (l + 127) / 128).sum();
    assert_eq!(o.tiles.len(), 3 * expected as usize);
    assert!(o.tiles.len() <= o.capacity);
    assert_eq!((o.tiles[0].seq, o.tiles[0].q_block), (1234, 156));
    assert_eq!(o.tiles[..3].iter().map(|t| t.head).collect::<Vec<_>>(), [0, 1, 2], "a tile's heads go together");
}
