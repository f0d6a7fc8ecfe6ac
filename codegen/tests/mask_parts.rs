//! Masks of disjuncts (global tokens, sinks plus a window, prefix-LM) and
//! of two conjuncts, against brute force over pairs: the forward's tile
//! walk (the twin of `kit/tile_walk.rs`'s `next_tile`) visits exactly the
//! tiles that keep a pair, each once and in order; a tile classified full
//! keeps every pair; and where a tile's selector names one part of the
//! mask (`MaskParts::selector`), that part alone keeps exactly the pairs
//! the mask keeps, every key of the tile existing.

use flashgen_codegen::analysis::{classify, TileClass};
use flashgen_codegen::mask_parts::MaskParts;
use flashgen_codegen::reference::{Arith, Env, Position, Value};
use flashgen_codegen::{parse_one, Expr, Shape, Spec};
use proptest::prelude::*;

/// One part of a mask: a band, a causal window, bottom-right causal, global
/// columns, global rows or a prefix, with its constants drawn (windows of
/// at least 1, so that no tile is kept by interval arithmetic alone).
fn part() -> impl Strategy<Value = String> {
    let (w, g) = (1i32..200, 0i32..120);
    prop_oneof![
        w.clone().prop_map(|w| format!("(q - k <= {w} && k - q <= {w})")),
        w.clone().prop_map(|w| format!("(q >= k && q - k < {w})")),
        w.prop_map(|w| format!("(k <= q + kv_len - q_len && q + kv_len - q_len - k < {w})")),
        Just("q + kv_len - q_len >= k".to_string()),
        g.clone().prop_map(|g| format!("k < {g}")),
        g.prop_map(|g| format!("q < {g}")),
    ]
}

/// A mask of two or three disjuncts, or a single part (two conjuncts, or
/// none: today's walk alone).
fn mask() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::collection::vec(part(), 2..=3).prop_map(|parts| parts.join(" || ")),
        1 => part(),
    ]
}

/// A launch with q_len ≠ kv_len mostly, and the forward's tile sizes scaled
/// down so that shapes stay small.
fn shape_and_tiles() -> impl Strategy<Value = (Shape, i32, i32)> {
    (1usize..300, 1usize..300, prop::sample::select(vec![16, 32, 64]), prop::sample::select(vec![16, 32, 64]))
        .prop_map(|(q_len, kv_len, bm, bn)| (Shape { batch: 1, heads: 1, heads_kv: 1, q_len, kv_len }, bm, bn))
}

fn spec_of(mask: &str) -> Spec {
    parse_one(&format!("S {{ dtype: bf16, head_dim: 64, mask: {mask} }}")).unwrap()
}

/// The kernels' `next_tile`: the first tile from j on that keeps a pair by
/// `span_empty` (tiles [j0, j1) keep none), skipping a run of removed tiles
/// by binary search over the spans from j.
fn next_tile(mut j: i32, tiles: i32, span_empty: &dyn Fn(i32, i32) -> bool) -> i32 {
    while j < tiles {
        if !span_empty(j, j + 1) {
            return j;
        }
        let (mut lo, mut hi) = (j + 1, tiles);
        if span_empty(j, hi) {
            return hi;
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if span_empty(j, mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        j = lo;
    }
    j
}

/// Whether `e` keeps the pair (q, k).
fn keeps(env: &Env, e: &Expr, q: i32, k: i32) -> bool {
    match env.eval(e, &Position { b: 0, h: 0, q, k, score: 0.0 }) {
        Value::Bool(v) => v,
        other => panic!("a bool expression evaluated to {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 384, ..ProptestConfig::default() })]

    #[test]
    fn walks_visit_kept_tiles_once_and_parts_decide_exactly(mask in mask(), (shape, bm, bn) in shape_and_tiles()) {
        let spec = spec_of(&mask);
        let env = Env::new(&spec, &shape, &[], &[], Arith::F32).unwrap();
        let whole = spec.mask.as_ref().unwrap();
        let parts = MaskParts::of(Some(whole));
        let (q_len, kv_len) = (shape.q_len as i32, shape.kv_len as i32);
        let tiles = (kv_len + bn - 1) / bn;
        let keys = |j0: i32, j1: i32| (j0 * bn, (j1 * bn).min(kv_len) - 1);
        for q0 in (0..q_len).step_by(bm as usize) {
            let rows = (q0, (q0 + bm).min(q_len) - 1);
            let class = |j0: i32, j1: i32| classify(&spec, &shape, &[], 0, 0, rows, keys(j0, j1));
            let span_empty = |j0: i32, j1: i32| class(j0, j1) == TileClass::Empty;
            let mut visited = Vec::new();
            let mut j = next_tile(0, tiles, &span_empty);
            while j < tiles {
                visited.push(j);
                j = next_tile(j + 1, tiles, &span_empty);
            }
            let pairs = |j: i32| {
                let (k0, k1) = keys(j, j + 1);
                (rows.0..=rows.1).flat_map(move |q| (k0..=k1).map(move |k| (q, k)))
            };
            let kept: Vec<i32> = (0..tiles).filter(|&j| pairs(j).any(|(q, k)| keeps(&env, whole, q, k))).collect();
            prop_assert_eq!(&visited, &kept, "{}: rows {:?}", mask, rows);
            for &j in &visited {
                if class(j, j + 1) == TileClass::Full {
                    prop_assert!(pairs(j).all(|(q, k)| keeps(&env, whole, q, k)), "{}: tile {} not full", mask, j);
                }
                let Some(parts) = &parts else { continue };
                let selector = parts.selector(&shape, &[], 0, 0, rows, (j * bn, j * bn + bn - 1));
                let Some(x) = parts.deciding(selector) else { continue };
                prop_assert!((j + 1) * bn <= kv_len, "{}: a selector on tile {} past kv_len", mask, j);
                let part = parts.exprs()[x];
                prop_assert!(
                    pairs(j).all(|(q, k)| keeps(&env, part, q, k) == keeps(&env, whole, q, k)),
                    "{}: part {} does not decide tile {} of rows {:?}", mask, x, j, rows
                );
            }
        }
    }
}

/// The selector is used where the masks of the benchmark need it: the
/// band's partial tiles away from the global tokens, and the window's away
/// from the sinks.
#[test]
fn band_and_window_tiles_are_decided_by_their_disjunct() {
    let shape = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 4096, kv_len: 4096 };
    let select = |mask: &str, rows: (i32, i32), keys: (i32, i32)| {
        let spec = spec_of(mask);
        let parts = MaskParts::of(spec.mask.as_ref()).unwrap();
        parts.deciding(parts.selector(&shape, &[], 0, 0, rows, keys))
    };
    let longformer = "(q - k <= 256 && k - q <= 256) || q < 64 || k < 64";
    // The band's far edges, the global columns' tile, a global row's tile.
    assert_eq!(select(longformer, (1024, 1151), (1280, 1407)), Some(0));
    assert_eq!(select(longformer, (1024, 1151), (768, 895)), Some(0));
    assert_eq!(select(longformer, (1024, 1151), (0, 127)), Some(2));
    assert_eq!(select(longformer, (0, 127), (1024, 1151)), None);
    let sinks = "k < 4 || (q >= k && q - k < 1024)";
    assert_eq!(select(sinks, (2048, 2175), (2048, 2175)), Some(1));
    assert_eq!(select(sinks, (2048, 2175), (0, 127)), Some(0));
    assert_eq!(select(sinks, (512, 639), (0, 127)), None);
}
