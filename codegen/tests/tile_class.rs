//! Tile classification by interval analysis: soundness against brute force
//! over random masks, plus the exact classes of the shipped specs.

use flashgen_codegen::analysis::{block_uniform, classify, TileClass};
use flashgen_codegen::reference::{Arith, Env, ParamValue, Position, TensorData, Value};
use flashgen_codegen::{parse_one, Shape, Spec};
use proptest::prelude::*;

use TileClass::{Empty, Full, Partial};

/// Every mask may use these declarations: two i32 params, an f32 param and
/// an i32 tensor (document ids).
const DECLS: &str = "param w: i32, param v: i32, param s: f32, tensor doc: i32[B, KV_LEN]";

fn int_leaf() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["q", "k", "q_len", "kv_len", "b", "h", "w", "v"]).prop_map(String::from),
        3 => (-70i32..70).prop_map(|c| format!("({c})")),
        1 => prop::sample::select(vec![i32::MIN, i32::MIN + 1, -65536, 65536, 1 << 30, i32::MAX - 1, i32::MAX])
            .prop_map(|c| format!("({c})")),
        1 => prop::sample::select(vec!["doc[b][q]", "doc[b][k]", "doc[h][k - q]"]).prop_map(String::from),
    ]
}

/// An i32 expression and a bool expression over the leaves, each fully
/// parenthesized so that any combination parses.
fn int_expr() -> impl Strategy<Value = String> {
    int_leaf().prop_recursive(4, 24, 3, |inner| {
        let cmp = (inner.clone(), prop::sample::select(vec!["<", "<=", ">", ">=", "==", "!="]), inner.clone())
            .prop_map(|(a, op, b)| format!("({a} {op} {b})"));
        prop_oneof![
            (inner.clone(), prop::sample::select(vec!["+", "-", "*", "/", "%"]), inner.clone())
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            (inner.clone(), prop::sample::select(vec!["&", "|", "^", "<<", ">>"]), inner.clone())
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            // Shifts by a constant and Euclid by a positive one have exact rules.
            (inner.clone(), prop::sample::select(vec!["<<", ">>"]), 0i32..34)
                .prop_map(|(a, op, c)| format!("({a} {op} {c})")),
            (prop::sample::select(vec!["rem_euclid", "div_euclid"]), inner.clone(), 1i32..70)
                .prop_map(|(f, a, c)| format!("{f}({a}, {c})")),
            (prop::sample::select(vec!["min", "max", "rem_euclid", "div_euclid"]), inner.clone(), inner.clone())
                .prop_map(|(f, a, b)| format!("{f}({a}, {b})")),
            inner.clone().prop_map(|a| format!("abs({a})")),
            inner.clone().prop_map(|a| format!("(!{a})")),
            inner.clone().prop_map(|a| format!("(-{a})")),
            (inner.clone(), inner.clone(), inner.clone()).prop_map(|(a, b, c)| format!("clamp({a}, {b}, {c})")),
            (cmp.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("(if {c} {{ {a} }} else {{ {b} }})")),
            cmp.prop_map(|c| format!("({c} as i32)")),
            inner.clone().prop_map(|a| format!("((({a} as f32) * s) as i32)")),
        ]
    })
}

fn bool_expr() -> impl Strategy<Value = String> {
    let cmp = (int_expr(), prop::sample::select(vec!["<", "<=", ">", ">=", "==", "!="]), int_expr())
        .prop_map(|(a, op, b)| format!("({a} {op} {b})"));
    let leaf = prop_oneof![
        6 => cmp,
        1 => prop::sample::select(vec!["true", "false", "((q as f32) < s)"]).prop_map(String::from),
    ];
    leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            (inner.clone(), prop::sample::select(vec!["&&", "||", "==", "!="]), inner.clone())
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.clone().prop_map(|a| format!("(!{a})")),
            (inner.clone(), inner.clone(), inner.clone())
                .prop_map(|(c, a, b)| format!("(if {c} {{ {a} }} else {{ {b} }})")),
        ]
    })
}

/// Mostly small params (window-like), sometimes extreme ones.
fn param() -> impl Strategy<Value = i32> {
    prop_oneof![3 => -8i32..200, 1 => any::<i32>()]
}

/// A launch with q_len ≠ kv_len and one tile of at most 64 × 64 inside it.
#[derive(Clone, Debug)]
struct Case {
    shape: Shape,
    b: i32,
    h: i32,
    q: (i32, i32),
    k: (i32, i32),
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..3, 1usize..3, 1usize..160, 1usize..160)
        .prop_filter("q_len != kv_len", |(_, _, q, kv)| q != kv)
        .prop_flat_map(|(batch, heads, q_len, kv_len)| {
            let shape = Shape { batch, heads, heads_kv: 1, q_len, kv_len };
            (Just(shape), 0..batch as i32, 0..heads as i32, 0..q_len as i32, 1i32..=64, 0..kv_len as i32, 1i32..=64)
        })
        .prop_map(|(shape, b, h, q_lo, q_size, k_lo, k_size)| Case {
            shape,
            b,
            h,
            q: (q_lo, (q_lo + q_size - 1).min(shape.q_len as i32 - 1)),
            k: (k_lo, (k_lo + k_size - 1).min(shape.kv_len as i32 - 1)),
        })
}

/// Brute force: how many pairs of the tile the mask keeps.
fn kept(spec: &Spec, case: &Case, params: &[ParamValue], doc: &[i32]) -> usize {
    let tensors = [TensorData::I32(doc.to_vec())];
    let env = Env::new(spec, &case.shape, params, &tensors, Arith::F32).unwrap();
    let mask = spec.mask.as_ref().unwrap();
    let mut n = 0;
    for q in case.q.0..=case.q.1 {
        for k in case.k.0..=case.k.1 {
            let kept = match env.eval(mask, &Position { b: case.b, h: case.h, q, k, score: 0.0 }) {
                Value::Bool(v) => v,
                other => panic!("mask evaluated to {other:?}"),
            };
            n += usize::from(kept);
        }
    }
    n
}

/// Values for the params of [`DECLS`].
const DECL_PARAMS: [ParamValue; 3] = [ParamValue::I32(0), ParamValue::I32(0), ParamValue::F32(0.0)];

fn mask_spec(mask: &str) -> Spec {
    parse_one(&format!("S {{ dtype: bf16, head_dim: 64, {DECLS}, mask: {mask} }}")).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn classification_is_sound(
        mask in bool_expr(),
        case in case(),
        (w, v) in (param(), param()),
        s in -100.0f32..100.0,
        seed in any::<u64>(),
    ) {
        let spec = mask_spec(&mask);
        let params = [ParamValue::I32(w), ParamValue::I32(v), ParamValue::F32(s)];
        // Document ids: a few small values (so equality varies), from the seed.
        let len = case.shape.batch * case.shape.kv_len;
        let doc: Vec<i32> = (0..len as u64).map(|i| ((seed.wrapping_mul(i + 1) >> 29) % 3) as i32).collect();
        let class = classify(&spec, &case.shape, &params, case.b, case.h, case.q, case.k);
        let total = ((case.q.1 - case.q.0 + 1) * (case.k.1 - case.k.0 + 1)) as usize;
        let n = kept(&spec, &case, &params, &doc);
        match class {
            Empty => prop_assert_eq!(n, 0, "Empty, but pairs are kept"),
            Full => prop_assert_eq!(n, total, "Full, but pairs are masked"),
            Partial => {}
        }
    }
}

/// Masks over block indices (`q / 32`, `k / 16`, ...), with the odd bare
/// or finer-grained position mixed in so that non-uniform masks occur too.
fn block_mask_expr() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        30 => prop::sample::select(vec![
            "(q / 32)", "(q / 64)", "(k / 16)", "(k / 48)", "b", "h", "w", "(3)", "doc[b][q / 32]", "doc[h][k / 16]",
        ]),
        1 => prop::sample::select(vec!["q", "(k / 8)"]),
    ]
    .prop_map(String::from);
    let int = leaf.prop_recursive(3, 12, 2, |inner| {
        (inner.clone(), prop::sample::select(vec!["+", "-", "*", "/", "%", "&", "|", "^", ">>"]), inner)
            .prop_map(|(a, op, b)| format!("({a} {op} {b})"))
    });
    let cmp = (int.clone(), prop::sample::select(vec!["<", "<=", "==", "!="]), int)
        .prop_map(|(a, op, b)| format!("({a} {op} {b})"));
    cmp.prop_recursive(2, 6, 2, |inner| {
        prop_oneof![
            (inner.clone(), prop::sample::select(vec!["&&", "||"]), inner.clone())
                .prop_map(|(a, op, b)| format!("({a} {op} {b})")),
            inner.prop_map(|a| format!("(!{a})")),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A mask `block_uniform` accepts keeps all or none of every aligned
    /// 32 x 16 tile (clipped to the sequence ends).
    #[test]
    fn block_uniform_masks_are_constant_over_aligned_tiles(
        mask in block_mask_expr(),
        case in case(),
        (qt, kt) in (0i32..5, 0i32..10),
        w in param(),
        seed in any::<u64>(),
    ) {
        let spec = mask_spec(&mask);
        prop_assume!(block_uniform(spec.mask.as_ref().unwrap(), 32, 16));
        let (q_len, kv_len) = (case.shape.q_len as i32, case.shape.kv_len as i32);
        let (qt, kt) = (qt % ((q_len + 31) / 32), kt % ((kv_len + 15) / 16));
        let tile = Case {
            q: (qt * 32, (qt * 32 + 31).min(q_len - 1)),
            k: (kt * 16, (kt * 16 + 15).min(kv_len - 1)),
            ..case
        };
        let params = [ParamValue::I32(w), ParamValue::I32(0), ParamValue::F32(0.0)];
        let len = tile.shape.batch * tile.shape.kv_len;
        let doc: Vec<i32> = (0..len as u64).map(|i| ((seed.wrapping_mul(i + 1) >> 29) % 3) as i32).collect();
        let total = ((tile.q.1 - tile.q.0 + 1) * (tile.k.1 - tile.k.0 + 1)) as usize;
        let n = kept(&spec, &tile, &params, &doc);
        prop_assert!(n == 0 || n == total, "{n} of {total} pairs kept in a uniform tile");
    }
}

#[test]
fn declared_block_layouts_are_uniform_over_tiles_they_align_with() {
    let layout = |mask: &str| {
        let spec =
            parse_one(&format!("S {{ dtype: bf16, head_dim: 64, tensor layout: i32[H, 64, 64], mask: {mask} }}"))
                .unwrap();
        spec.mask.unwrap()
    };
    let block_sparse = layout("layout[h][q / 128][k / 128] != 0");
    assert!(block_uniform(&block_sparse, 128, 64));
    assert!(block_uniform(&block_sparse, 64, 64), "tiles inside blocks");
    assert!(!block_uniform(&block_sparse, 256, 64), "a tile would straddle two blocks");
    assert!(block_uniform(&layout("q / 128 >= k / 128"), 128, 64), "block-causal");
    assert!(!block_uniform(&layout("q >= k"), 128, 64));
    assert!(!block_uniform(&layout("layout[h][q / 100][k / 128] != 0"), 128, 64));
    assert!(!block_uniform(&layout("layout[h][(q + 1) / 128][k / 128] != 0"), 128, 64));
}

fn shipped(source: &str) -> Spec {
    parse_one(source).unwrap()
}

fn shape(q_len: usize, kv_len: usize) -> Shape {
    Shape { batch: 2, heads: 4, heads_kv: 2, q_len, kv_len }
}

/// Classes of tiles `(q_lo, q_hi, k_lo, k_hi)` in batch 1, head 3.
fn classes(spec: &Spec, shape: Shape, params: &[ParamValue], tiles: &[(i32, i32, i32, i32)]) -> Vec<TileClass> {
    tiles.iter().map(|&(q0, q1, k0, k1)| classify(spec, &shape, params, 1, 3, (q0, q1), (k0, k1))).collect()
}

#[test]
fn full_and_score_only_specs_are_full() {
    for source in [include_str!("../../specs/full.attn"), include_str!("../../specs/relative_bias.attn")] {
        assert_eq!(classes(&shipped(source), shape(100, 300), &[], &[(0, 63, 0, 63), (64, 99, 256, 299)]), [Full; 2]);
    }
}

#[test]
fn causal_skips_above_and_unmasks_below_the_diagonal() {
    let tiles = [(0, 63, 64, 127), (64, 127, 0, 63), (0, 63, 0, 63), (64, 127, 63, 63), (5, 5, 5, 5)];
    let expected = [Empty, Full, Partial, Full, Full];
    for source in [
        include_str!("../../specs/causal.attn"),
        include_str!("../../specs/gqa.attn"),
        include_str!("../../specs/alibi.attn"),
    ] {
        assert_eq!(classes(&shipped(source), shape(512, 512), &[], &tiles), expected);
    }
    let softcap = shipped(include_str!("../../specs/softcap.attn"));
    assert_eq!(classes(&softcap, shape(512, 512), &[ParamValue::F32(30.0)], &tiles), expected);
}

#[test]
fn sliding_window_skips_both_sides_of_the_band() {
    let spec = shipped(include_str!("../../specs/sliding_window.attn"));
    let tiles = [(256, 319, 0, 63), (128, 191, 64, 127), (128, 191, 128, 191), (128, 191, 0, 63), (0, 63, 64, 127)];
    assert_eq!(
        classes(&spec, shape(512, 512), &[ParamValue::I32(128)], &tiles),
        [Empty, Full, Partial, Partial, Empty]
    );
    // A window of zero keeps nothing; a negative one too.
    for w in [0, -5] {
        assert_eq!(classes(&spec, shape(512, 512), &[ParamValue::I32(w)], &[(64, 127, 0, 63)]), [Empty]);
    }
}

#[test]
fn prefix_lm_is_full_over_the_prefix() {
    let spec = shipped(include_str!("../../specs/prefix_lm.attn"));
    let tiles = [(0, 63, 0, 63), (0, 63, 128, 191), (0, 63, 64, 127), (200, 263, 100, 163)];
    assert_eq!(classes(&spec, shape(512, 512), &[ParamValue::I32(100)], &tiles), [Full, Empty, Partial, Full]);
}

#[test]
fn bottom_right_causal_shifts_the_diagonal_by_kv_len_minus_q_len() {
    let spec = shipped(include_str!("../../specs/causal_bottom_right.attn"));
    // 100 queries over 300 keys: query i sees keys 0..=i + 200.
    let tiles = [(0, 63, 0, 63), (0, 63, 64, 127), (0, 63, 264, 299), (64, 99, 200, 263), (0, 63, 200, 263)];
    assert_eq!(classes(&spec, shape(100, 300), &[], &tiles), [Full, Full, Empty, Full, Partial]);
    // More queries than keys: the first 50 queries see nothing.
    assert_eq!(classes(&spec, shape(150, 100), &[], &[(0, 49, 0, 99), (50, 99, 0, 0)]), [Empty, Full]);
}

#[test]
fn document_mask_is_only_ever_empty_by_causality() {
    let spec = shipped(include_str!("../../specs/document.attn"));
    let tiles = [(0, 63, 64, 127), (64, 127, 0, 63), (0, 63, 0, 63), (7, 7, 7, 7)];
    assert_eq!(classes(&spec, shape(512, 512), &[], &tiles), [Empty, Partial, Partial, Partial]);
    let without_causal = mask_spec("doc[b][q] == doc[b][k]");
    assert_eq!(classes(&without_causal, shape(512, 512), &DECL_PARAMS, &tiles), [Partial; 4]);
}

#[test]
fn wrapping_is_never_assumed_away() {
    let cls = |mask: &str, q| classify(&mask_spec(mask), &shape(512, 512), &DECL_PARAMS, 0, 0, q, (0, 0));
    // q + i32::MAX wraps negative for q >= 1: the exact bounds leave i32.
    assert_eq!(cls("q + 2147483647 > 0", (0, 5)), Partial);
    assert_eq!(cls("q + 2147483647 > 0", (0, 0)), Full);
    // q · 2^32 wraps to 0 for every q: sound but unknown.
    assert_eq!(cls("q * 65536 * 65536 == 0", (0, 63)), Partial);
    // i32::MIN / -1 and abs(i32::MIN) wrap to i32::MIN.
    assert_eq!(cls("(q - 2147483647 - 1) / -1 > 0", (0, 3)), Partial);
    assert_eq!(cls("abs(q - 2147483647 - 1) >= 0", (0, 3)), Partial);
    // Without overflow, exact: q / 8 and q % 8 over one block of 8.
    assert_eq!(cls("q / 8 == 2 && q % 8 <= 7", (16, 23)), Full);
    assert_eq!(cls("q % 8 == 0", (17, 23)), Empty);
    // x % 0 = 0; x / 0 = 0 is only known to satisfy |x / y| <= |x|.
    assert_eq!(cls("q % (k - k) == 0 && q / 0 <= 63", (0, 63)), Full);
    assert_eq!(cls("q / 0 == 0", (0, 63)), Partial);
    // Empty tiles keep nothing.
    assert_eq!(cls("true", (5, 4)), Empty);
}
