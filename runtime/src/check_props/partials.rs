//! Context parallelism's checks: the partials' merge and adds
//! (`check_partials.rs`) and the ranks' shards (`check_shard.rs`).

use super::ragged::buffer;
use super::{args, assert_holds, assert_inside, dtype, no_panic, specs, Rng, CASES, EDGES};
use crate::check::Buffer;
use crate::check_partials::{check_add, check_add_f32, check_merge, AddBuffers, LseBuffer, MergeBuffers};
use crate::check_shard::{check_ranks, whole_shape, Whole};
use crate::layout::Layout;
use flashgen_codegen::shard::{Partition, Sharding};
use flashgen_codegen::Shape;
use std::fmt::Debug;

const INT: u128 = i32::MAX as u128;

/// An LSE of `rows` floats from a drawn offset, in a buffer that holds
/// them exactly (wild: a drawn length, at times a huge offset).
fn lse(rng: &mut Rng, rows: usize, wild: bool) -> LseBuffer {
    let offset = match wild && rng.odd(10) {
        true => rng.pick(&EDGES),
        false => rng.pick(&[0, 0, 16, 1000]),
    };
    let len = offset.saturating_add(rows);
    LseBuffer { offset, len: if wild { rng.len(len) } else { len } }
}

/// A merge of O pieces of head dim `dim`: the accumulator and, where given,
/// the piece and the output, each with its LSE.
fn draw_merge(rng: &mut Rng, dim: usize, wild: bool) -> MergeBuffers {
    let (batch, rows) = if wild { (rng.size(3), rng.size(50)) } else { (rng.below(4), rng.below(50)) };
    let heads = if wild { rng.heads().0 } else { rng.pick(&[1, 2, 8]) };
    let dim = if wild { rng.dim(dim as u32) } else { dim };
    let lse_rows = batch.saturating_mul(heads).saturating_mul(rows);
    let side = |rng: &mut Rng| {
        let mut sizes = [batch, rows, heads, dim];
        if wild && rng.odd(10) {
            sizes[rng.below(4)] = rng.size(50);
        }
        let l = rng.layout(sizes);
        (buffer(rng, l, wild), lse(rng, lse_rows, wild))
    };
    let (acc, acc_lse) = side(rng);
    let (piece, out) = (rng.chance(70).then(|| side(rng)), rng.chance(70).then(|| side(rng)));
    MergeBuffers { acc: Buffer { layout: Layout { dim, ..acc.layout }, ..acc }, acc_lse, piece, out }
}

/// What an accepted merge or add must hold of `acc`, `piece` and `out`.
fn assert_rows_sound(acc: &Buffer, others: [Option<&Buffer>; 2], launched: bool, case: &dyn Debug) {
    assert_inside("acc", &acc.layout, acc.len, launched, case);
    for (what, b) in ["piece", "out"].into_iter().zip(others) {
        let Some(b) = b else { continue };
        assert_inside(what, &b.layout, b.len, launched, case);
        let (l, a) = (&b.layout, &acc.layout);
        assert_eq!([l.batch, l.seq, l.heads, l.dim], [a.batch, a.seq, a.heads, a.dim], "{what}: {case:?}");
    }
    let l = &acc.layout;
    assert!(l.batch <= 65_535 && l.heads <= 65_535 && l.seq as u128 <= INT, "sizes past the grid: {case:?}");
}

#[test]
fn merges_and_adds_accept_only_launches_inside_their_buffers() {
    let (specs, mut rng, mut accepted) = (specs(), Rng::new(0xC0), 0);
    for case in 0..CASES {
        let spec = &specs[rng.case().below(specs.len())];
        let dtype = dtype(&mut rng, spec);
        let m = draw_merge(&mut rng, spec.head_dims.v as usize, true);
        let pieces = [m.piece.as_ref().map(|p| &p.0), m.out.as_ref().map(|o| &o.0)];
        if case % 2 == 0 {
            let Ok(launch) = no_panic(&m, || check_merge(spec, dtype, &m)) else { continue };
            assert_rows_sound(&m.acc, pieces, launch.is_some(), &m);
            assert_eq!((dtype, m.acc.layout.dim), (spec.dtype, spec.head_dims.v as usize), "{m:?}");
            let l = &m.acc.layout;
            let rows = l.batch as u128 * l.heads as u128 * l.seq as u128;
            let lses = [Some(m.acc_lse), m.piece.map(|p| p.1), m.out.map(|o| o.1)];
            for (what, LseBuffer { offset, len }) in
                ["acc_lse", "piece_lse", "out_lse"].into_iter().zip(lses).filter_map(|(w, l)| Some((w, l?)))
            {
                assert_holds(what, len, offset as u128 + rows, &m);
            }
        } else {
            let add = AddBuffers { acc: m.acc, piece: m.piece.map(|p| p.0), out: m.out.map(|o| o.0) };
            let Ok(launch) = no_panic(&add, || check_add(spec, dtype, &add)) else { continue };
            assert_rows_sound(&add.acc, pieces, launch.is_some(), &add);
            assert!(dtype == spec.dtype && add.acc.layout.dim as u128 <= INT, "{add:?}");
            if let Some((shape, dim)) = launch {
                assert!(shape.batch * shape.heads * shape.q_len * dim > 0, "an empty add launched: {add:?}");
            }
        }
        accepted += 1;
    }
    assert!(accepted > CASES / 20, "only {accepted} of {CASES} wild draws accepted");
    for _ in 0..CASES {
        let acc = rng.size(100);
        let piece = match rng.below(3) {
            0 => None,
            1 => Some(acc),
            _ => Some(rng.count(acc)),
        };
        if let Ok(launch) = no_panic(&(acc, piece), || check_add_f32(acc, piece)) {
            assert!(piece.is_none_or(|p| p == acc) && acc as u128 <= INT, "{acc} {piece:?}");
            assert_eq!(launch.map(|s| s.q_len), (acc > 0).then_some(acc));
        }
    }
}

#[test]
fn well_formed_merges_and_adds_pass() {
    let (specs, mut rng) = (specs(), Rng::new(0xC1));
    for _ in 0..CASES {
        let spec = &specs[rng.below(specs.len())];
        let m = draw_merge(&mut rng, spec.head_dims.v as usize, false);
        let l = m.acc.layout;
        let shape = Shape { batch: l.batch, heads: l.heads, heads_kv: l.heads, q_len: l.seq, kv_len: 0 };
        let launched = l.batch * l.heads * l.seq > 0;
        assert_eq!(check_merge(spec, spec.dtype, &m).unwrap(), launched.then_some(shape), "{m:?}");
        let add = AddBuffers { acc: m.acc, piece: m.piece.map(|p| p.0), out: m.out.map(|o| o.0) };
        assert_eq!(check_add(spec, spec.dtype, &add).unwrap(), launched.then_some((shape, l.dim)), "{add:?}");
    }
}

/// Rows of a sequence of `len` that rank `rank` of `ranks` holds: chunk i
/// of n is `[i · len / n, (i + 1) · len / n)`, Zigzag's rank r holds chunks
/// r and 2 · ranks − 1 − r (computed in u128).
fn local_len(zigzag: bool, ranks: usize, rank: usize, len: usize) -> u128 {
    let chunk = |i: u128, n: u128| ((i + 1) * len as u128 / n) - (i * len as u128 / n);
    let (r, n) = (rank as u128, ranks as u128);
    match zigzag {
        true => chunk(r, 2 * n) + chunk(2 * n - 1 - r, 2 * n),
        false => chunk(r, n),
    }
}

#[test]
fn shards_accept_only_the_rows_each_rank_holds() {
    let (specs, mut rng, mut accepted) = (specs(), Rng::new(0x5A), 0);
    for _ in 0..CASES {
        let spec = &specs[rng.case().below(specs.len())];
        let zigzag = rng.chance(50);
        let partition = if zigzag { Partition::Zigzag } else { Partition::Contiguous };
        let ranks = if rng.odd(10) { rng.pick(&[0, 1 << 20, i32::MAX as usize, usize::MAX]) } else { 1 + rng.below(4) };
        let whole = Whole { q_len: rng.size(100), kv_len: rng.size(100) };
        let (batch, (heads, heads_kv)) = (rng.size(3), rng.heads());
        let dims = [spec.head_dims.qk as usize; 2];
        let layouts: Vec<[Layout; 2]> = (0..ranks.min(4))
            .map(|rank| {
                let [q, k] = [whole.q_len, whole.kv_len]
                    .map(|len| local_len(zigzag, ranks, rank, len).min(usize::MAX as u128) as usize);
                let q = if rng.odd(10) { q.wrapping_add(1) } else { q };
                [rng.layout([batch, q, heads, dims[0]]), rng.layout([batch, k, heads_kv, dims[1]])]
            })
            .collect();
        let sharding = Sharding { ranks, partition };
        let shape = Shape { batch, heads, heads_kv, q_len: whole.q_len, kv_len: whole.kv_len };
        let args = args(spec, &shape, rng.odd(5));
        let any = rng.below(4);
        let rank = rng.pick(&[0, ranks.saturating_sub(1), ranks, any]);
        let one = layouts.get(rank).copied().unwrap_or([Layout::bshd(batch, 0, heads, dims[0]); 2]);
        let case = (sharding, whole, rank, &layouts);
        let single = no_panic(&case, || whole_shape(spec, sharding, whole, rank, [&one[0], &one[1]], &args));
        let all = no_panic(&case, || check_ranks(spec, sharding, whole, &layouts, &args));
        let every: Vec<_> = layouts.iter().copied().enumerate().collect();
        for (ranks_checked, result) in [(vec![(rank, one)], single), (every, all)] {
            let Ok(got) = result else { continue };
            accepted += 1;
            let [q, k] = ranks_checked[0].1;
            assert_eq!(got, Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, ..shape }, "{case:?}");
            // The ShardParams positions are i32: the whole lengths must fit.
            assert!(whole.q_len as u128 <= INT && whole.kv_len as u128 <= INT, "{case:?}");
            for (r, [q, k]) in ranks_checked {
                assert!(r < ranks, "{case:?}");
                let want = [whole.q_len, whole.kv_len].map(|len| local_len(zigzag, ranks, r, len));
                assert_eq!([q.seq as u128, k.seq as u128], want, "rank {r}: {case:?}");
            }
        }
    }
    assert!(accepted > CASES / 20, "only {accepted} wild draws accepted");
    // Well-formed: each rank holds exactly its rows.
    for _ in 0..CASES {
        let spec = &specs[rng.below(specs.len())];
        let (zigzag, ranks) = (rng.chance(50), 1 + rng.below(4));
        let partition = if zigzag { Partition::Zigzag } else { Partition::Contiguous };
        let whole = Whole { q_len: rng.below(100), kv_len: rng.below(100) };
        let (batch, (heads, heads_kv)) = (rng.below(4), rng.pick(&[(1, 1), (4, 2), (6, 3)]));
        let dim = spec.head_dims.qk as usize;
        let layouts: Vec<[Layout; 2]> = (0..ranks)
            .map(|r| {
                let [q, k] = [whole.q_len, whole.kv_len].map(|len| local_len(zigzag, ranks, r, len) as usize);
                [rng.layout([batch, q, heads, dim]), rng.layout([batch, k, heads_kv, dim])]
            })
            .collect();
        let shape = Shape { batch, heads, heads_kv, q_len: whole.q_len, kv_len: whole.kv_len };
        let got = check_ranks(spec, Sharding { ranks, partition }, whole, &layouts, &args(spec, &shape, false));
        assert_eq!(got.unwrap(), shape, "{layouts:?}");
    }
    // The model deals every row to exactly one rank.
    for (ranks, len) in [(1, 7), (2, 100), (3, 100), (4, 5), (8, 1000)] {
        for zigzag in [false, true] {
            assert_eq!((0..ranks).map(|r| local_len(zigzag, ranks, r, len)).sum::<u128>(), len as u128);
        }
    }
}
