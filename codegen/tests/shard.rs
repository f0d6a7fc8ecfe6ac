//! Context parallelism on the CPU: the sharding tiles the sequence, the
//! shard view means the spec at whole-sequence positions, and a rank's plan
//! skips only (query segment, key segment) pieces with no kept pair.

mod support;

use flashgen_codegen::analysis::TileClass;
use flashgen_codegen::reference::{Arith, Env, ParamValue, Position, TensorData, Value};
use flashgen_codegen::shard::{rank_pieces, view, Partition, Piece, Segment, ShardParams, Sharding};
use flashgen_codegen::{parse_str, ElemTy, Shape, Spec, Ty};
use proptest::prelude::*;
use std::path::PathBuf;
use support::Rng;

/// The shipped specs and the language test's spec.
fn specs() -> Vec<Spec> {
    let root: PathBuf = [env!("CARGO_MANIFEST_DIR"), ".."].iter().collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("specs"))
        .expect("specs/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .collect();
    files.sort();
    files.push(root.join("codegen/tests/specs/language.attn"));
    files
        .iter()
        .flat_map(|f| parse_str(&std::fs::read_to_string(f).expect("a readable spec")).expect("valid"))
        .collect()
}

/// Random params (small ints, so windows and prefixes fall inside the
/// sequence) and tensors (ids in 0..3, so documents repeat) for `shape`.
fn inputs(spec: &Spec, shape: &Shape, rng: &mut Rng) -> (Vec<ParamValue>, Vec<TensorData>) {
    let params = spec
        .params
        .iter()
        .map(|p| match p.ty {
            Ty::I32 => ParamValue::I32((rng.next_u64() % 24) as i32),
            _ => ParamValue::F32(rng.normal() as f32),
        })
        .collect();
    let tensors = spec
        .tensors
        .iter()
        .map(|t| {
            let n = t.len(shape);
            match t.elem {
                ElemTy::I32 => TensorData::I32((0..n).map(|_| (rng.next_u64() % 3) as i32).collect()),
                _ => TensorData::Float((0..n).map(|_| f64::from(rng.normal() as f32)).collect()),
            }
        })
        .collect();
    (params, tensors)
}

fn eval(env: &Env, e: Option<&flashgen_codegen::Expr>, at: Position) -> Option<Value> {
    e.map(|e| env.eval(e, &at))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn segments_tile_the_sequence_once(len in 0usize..300, ranks in 1usize..9, zigzag: bool) {
        let partition = if zigzag { Partition::Zigzag } else { Partition::Contiguous };
        let sharding = Sharding { ranks, partition };
        let mut owner = vec![None; len];
        for rank in 0..ranks {
            let segments = sharding.segments(len, rank);
            let mut local = 0;
            for Segment { start, len: n, local: at } in segments {
                prop_assert_eq!(at, local, "segments are stored back to back");
                local += n;
                for (p, slot) in owner.iter_mut().enumerate().skip(start).take(n) {
                    prop_assert!(slot.is_none(), "position {} dealt twice", p);
                    *slot = Some(rank);
                }
            }
            prop_assert_eq!(local, sharding.local_len(len, rank));
            // Ranks hold equal shares up to one position per chunk.
            let chunks = if zigzag { 2 } else { 1 };
            prop_assert!(local.abs_diff(len / ranks) <= chunks);
        }
        prop_assert!(owner.iter().all(Option::is_some), "every position has a rank");
    }
}

#[test]
fn the_view_means_the_spec_at_whole_sequence_positions() {
    let mut rng = Rng(7);
    for spec in specs() {
        for trial in 0..12 {
            let whole = Shape { batch: 2, heads: 2, heads_kv: 1, q_len: 40 + trial, kv_len: 40 + 2 * trial };
            let (params, tensors) = inputs(&spec, &whole, &mut rng);
            let spec_env = Env::new(&spec, &whole, &params, &tensors, Arith::F32).expect("valid inputs");
            let (q0, k0) = ((rng.next_u64() % 30) as i32, (rng.next_u64() % 30) as i32);
            let local = Shape { q_len: whole.q_len - q0 as usize, kv_len: whole.kv_len - k0 as usize, ..whole };
            let shard = ShardParams { q0, k0, q_len: whole.q_len as i32, kv_len: whole.kv_len as i32 };
            let mut view_params = params.clone();
            view_params.extend(shard.values().map(ParamValue::I32));
            let view = view(&spec, true);
            let view_env = Env::new(&view, &local, &view_params, &tensors, Arith::F32).expect("the view's inputs");
            for _ in 0..64 {
                let (b, h) = ((rng.next_u64() % 2) as i32, (rng.next_u64() % 2) as i32);
                let (q, k) =
                    ((rng.next_u64() % local.q_len as u64) as i32, (rng.next_u64() % local.kv_len as u64) as i32);
                let score = rng.normal();
                let at_view = Position { b, h, q, k, score };
                let at_spec = Position { q: q + q0, k: k + k0, ..at_view };
                for (a, b) in [(&view.mask, &spec.mask), (&view.score, &spec.score), (&view.sink, &spec.sink)] {
                    assert_eq!(
                        eval(&view_env, a.as_ref(), at_view),
                        eval(&spec_env, b.as_ref(), at_spec),
                        "{}: the view at ({q}, {k}) + ({q0}, {k0})",
                        spec.name
                    );
                }
            }
        }
    }
}

#[test]
fn the_view_drops_the_sink_where_asked_and_keeps_the_spec_params_first() {
    for spec in specs() {
        let v = view(&spec, false);
        assert!(v.sink.is_none());
        assert_eq!(&v.params[..spec.params.len()], &spec.params[..]);
        assert_eq!(v.params.len(), spec.params.len() + flashgen_codegen::shard::SHARD_PARAMS);
        let names: std::collections::HashSet<_> = v.params.iter().map(|p| &p.name).collect();
        assert_eq!(names.len(), v.params.len(), "{}: param names stay distinct", spec.name);
    }
    let clash = parse_str("C { dtype: bf16, head_dim: 64, param shard_q0: i32, mask: q >= k + shard_q0 }").unwrap();
    let v = view(&clash[0], true);
    assert_eq!(v.params[1].name, "shard_q0_");
}

/// Whether `spec` keeps (b, h, q, k) of the whole sequence.
fn keeps(env: &Env, spec: &Spec, b: i32, h: i32, q: usize, k: usize) -> bool {
    let at = Position { b, h, q: q as i32, k: k as i32, score: 0.0 };
    match eval(env, spec.mask.as_ref(), at) {
        None => true,
        Some(Value::Bool(v)) => v,
        Some(other) => panic!("a mask evaluated to {other:?}"),
    }
}

#[test]
fn a_rank_skips_only_pieces_without_a_kept_pair() {
    let mut rng = Rng(11);
    for spec in specs() {
        for trial in 0..6 {
            let len = 23 + 9 * trial;
            let whole = Shape { batch: 2, heads: 2, heads_kv: 1, q_len: len, kv_len: len };
            let (params, tensors) = inputs(&spec, &whole, &mut rng);
            let env = Env::new(&spec, &whole, &params, &tensors, Arith::F32).expect("valid inputs");
            for (ranks, partition) in [(1, Partition::Contiguous), (3, Partition::Contiguous), (4, Partition::Zigzag)] {
                let sharding = Sharding { ranks, partition };
                for rank in 0..ranks {
                    let pieces = rank_pieces(&spec, &whole, &params, sharding, rank);
                    check_rank(&spec, &env, sharding, &whole, rank, &pieces);
                }
            }
        }
    }
}

fn check_rank(spec: &Spec, env: &Env, sharding: Sharding, whole: &Shape, rank: usize, pieces: &[Piece]) {
    for q in sharding.segments(whole.q_len, rank) {
        for kv_rank in 0..sharding.ranks {
            for kv in sharding.segments(whole.kv_len, kv_rank) {
                let inside = |p: &&Piece| p.kv.start >= kv.start && p.kv.start + p.kv.len <= kv.start + kv.len;
                let found: Vec<_> = pieces.iter().filter(|p| p.q == q && p.kv_rank == kv_rank).filter(inside).collect();
                assert!(found.len() <= 1, "{}: a piece computed twice", spec.name);
                if let Some(p) = found.first() {
                    assert_eq!(
                        p.kv.local - kv.local,
                        p.kv.start - kv.start,
                        "{}: trimmed rows keep their place",
                        spec.name
                    );
                }
                let pairs = || {
                    (0..2).flat_map(move |b| {
                        (0..2).flat_map(move |h| {
                            (q.start..q.start + q.len)
                                .flat_map(move |qp| (kv.start..kv.start + kv.len).map(move |kp| (b, h, qp, kp)))
                        })
                    })
                };
                let kept: Vec<_> = pairs().filter(|&(b, h, qp, kp)| keeps(env, spec, b, h, qp, kp)).collect();
                if let Some(p) = found.first() {
                    let outside = kept.iter().find(|&&(_, _, _, kp)| kp < p.kv.start || kp >= p.kv.start + p.kv.len);
                    assert!(outside.is_none(), "{}: {p:?} trimmed the kept pair {outside:?}", spec.name);
                }
                let kept = kept.len();
                match found.first() {
                    None => assert_eq!(kept, 0, "{}: rank {rank} skipped {q:?} x {kv:?} with kept pairs", spec.name),
                    Some(p) if p.class == TileClass::Full => {
                        assert_eq!(kept, pairs().count(), "{}: a full piece with a dropped pair", spec.name)
                    }
                    Some(p) => assert_eq!(p.sink, spec.sink.is_some() && kv.start == 0 && q.len > 0),
                }
            }
        }
    }
}

#[test]
fn a_windows_pieces_read_only_the_keys_inside_the_window() {
    let spec = parse_str("W { dtype: bf16, head_dim: 64, param window: i32, mask: q >= k && q - k < window }").unwrap();
    let whole = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 4000, kv_len: 4000 };
    let params = [ParamValue::I32(100)];
    for rank in 0..4 {
        let sharding = Sharding { ranks: 4, partition: Partition::Zigzag };
        for piece in rank_pieces(&spec[0], &whole, &params, sharding, rank) {
            // A segment's own keys, or the window's reach into the one before it.
            let reach = if piece.kv.start + piece.kv.len <= piece.q.start { 99 } else { piece.q.len };
            assert!(piece.kv.len <= reach, "rank {rank}: {piece:?}");
        }
    }
    let causal = parse_str("C { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    let contiguous = Sharding { ranks: 4, partition: Partition::Contiguous };
    let counts: Vec<usize> = (0..4).map(|r| rank_pieces(&causal[0], &whole, &[], contiguous, r).len()).collect();
    assert_eq!(counts, [1, 2, 3, 4], "causal: a rank reads the keys at and before its own");
}
