//! The f64 reference backward against central finite differences of the
//! forward, and the symbolic score derivatives against finite differences of
//! the score expression, for every shipped spec and a few that exercise each
//! differentiation rule, on tiny random problems.

mod support;

use flashgen_codegen::grad::{d_load, d_score, d_sink_load, trainable};
use flashgen_codegen::reference::{
    backward, backward_dropout, backward_in, flash_rule_averaged, forward, forward_dropout, max_abs_diff, round_bf16,
    same_dtype_backwards, Arith, Env, Gradients, ParamValue, Position, Precision, Problem, ReferenceError, TensorData,
    Value, BACKWARD_FACTOR,
};
use flashgen_codegen::{parse_one, parse_str, to_source, Dropout, ElemTy, Expr, HeadDims, Shape, Spec, Ty};
use std::path::PathBuf;

/// Variants beyond the shipped ones: every differentiation rule, trainable
/// tensors (one read through a clamped index), a tensor read twice (no
/// gradient), a mask that empties row 0, and i32 operators (constants to
/// the derivative) in the mask, the score and a trainable tensor's index.
const EXTRA: &str = r#"
Smooth {
    dtype: bf16, head_dim: 4,
    param t: f32,
    score: t * tanh(score / t) + exp(score * 0.5) / 3.0 + log(2.0 + sigmoid(score)) * sqrt(score * score + 1.0)
        - exp2(-score * score) + log2(3.0 + tanh(score / (1.5 + sigmoid(score)))) - 0.5 / (score * score + 2.0),
}
Piecewise {
    dtype: bf16, head_dim: 4,
    tensor w: f32[H],
    score: abs(score) * 0.5 + min(score, 0.25) - max(score * w[h], -0.3) + clamp(score, -0.8, 0.9)
        + clamp(0.3, score * 0.5, score) + (if score > 0.1 { score * score } else { -score })
        + floor(score * 2.0) + score % 0.7 + 1.5 % (score + 3.0) + (q - k) as f32 * 0.1,
}
Biased {
    dtype: f16, head_dim: 4,
    tensor gain: bf16[H],
    tensor bias: f32[H, Q_LEN, KV_LEN],
    tensor edge: f32[H, KV_LEN],
    mask: q + 1 >= k,
    score: gain[h] * score + bias[h][q][k] + edge[h][k + 2] * 0.5,
}
TwoReads {
    dtype: bf16, head_dim: 4,
    tensor t: f32[KV_LEN],
    score: score + t[q] - t[k],
}
MaskedRow {
    dtype: bf16, head_dim: 4,
    mask: k < q,
    score: score * 0.5,
}
Sinks {
    dtype: bf16, head_dim: 4,
    tensor sinks: f32[H],
    mask: k <= q + 1,
    sink: sinks[h],
}
SharedSink {
    dtype: f16, head_dim: 4,
    param p: f32,
    tensor w: f32[H],
    tensor u: bf16[B, 3],
    mask: k < q,
    score: score * w[h],
    sink: 2.0 * tanh(w[h] * (b + 1) as f32) + u[b][h + 1] * p,
}
IntOperators {
    dtype: bf16, head_dim: 4,
    tensor gain: f32[H, 16],
    mask: rem_euclid(k - q, 3) != 2 || q >> 1 == k >> 1,
    score: gain[h][(q ^ k) & 15] * score + (div_euclid(k - q, 2) | !q << 1) as f32 * 0.1 + score * (q & 1) as f32,
}
"#;

use support::Rng;

/// The shipped specs and [`EXTRA`], with head dims small enough for finite
/// differences over every element (QK and V differ, as in the GQA example).
fn specs() -> Vec<Spec> {
    let dir: PathBuf = [env!("CARGO_MANIFEST_DIR"), "..", "specs"].iter().collect();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("specs/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "attn"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "expected the shipped examples in {}", dir.display());
    let mut specs: Vec<Spec> = files
        .iter()
        .flat_map(|f| parse_str(&std::fs::read_to_string(f).expect("a readable spec")).expect("a valid spec"))
        .collect();
    specs.extend(parse_str(EXTRA).expect("the extra specs are valid"));
    for s in &mut specs {
        s.head_dims = HeadDims { qk: 4, v: 3 };
    }
    specs
}

fn spec(name: &str) -> Spec {
    specs().into_iter().find(|s| s.name == name).expect("a known spec")
}

/// Plain, GQA (4/2) and MQA with fewer keys than queries (which empties row 0
/// of a bottom-right causal mask).
const SHAPES: [Shape; 3] = [
    Shape { batch: 2, heads: 2, heads_kv: 2, q_len: 4, kv_len: 5 },
    Shape { batch: 1, heads: 4, heads_kv: 2, q_len: 3, kv_len: 6 },
    Shape { batch: 1, heads: 2, heads_kv: 1, q_len: 5, kv_len: 4 },
];

/// Random inputs in f64 (finite differences need no dtype rounding): N(0, 1)
/// Q, K, V with a scale that spreads scores over the score mods' kinks and
/// curves, params `2` (i32) / `0.8` (f32), float tensors N(0, 0.5²), i32
/// tensors in {0, 1} (document ids).
fn problem(spec: &Spec, shape: Shape, rng: &mut Rng) -> Problem {
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let q = normals(rng, shape.batch * shape.q_len * shape.heads * dk, 1.0);
    let k = normals(rng, shape.batch * shape.kv_len * shape.heads_kv * dk, 1.0);
    let v = normals(rng, shape.batch * shape.kv_len * shape.heads_kv * dv, 1.0);
    let params =
        spec.params.iter().map(|p| if p.ty == Ty::I32 { ParamValue::I32(2) } else { ParamValue::F32(0.8) }).collect();
    let tensors = spec
        .tensors
        .iter()
        .map(|t| match t.elem {
            ElemTy::I32 => TensorData::I32((0..t.len(&shape)).map(|_| i32::from(rng.uniform() < 0.5)).collect()),
            _ => TensorData::Float(normals(rng, t.len(&shape), 0.5)),
        })
        .collect();
    Problem { shape, q, k, v, scale: 2.0 / (dk as f64).sqrt(), params, tensors }
}

fn normals(rng: &mut Rng, n: usize, sigma: f64) -> Vec<f64> {
    (0..n).map(|_| sigma * rng.normal()).collect()
}

/// An f32-typed value (f64 under [`Arith::F64`]).
fn float(v: Value) -> f64 {
    match v {
        Value::F32(x) => x,
        other => panic!("expected an f32 value, found {other:?}"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Input {
    Q,
    K,
    V,
    Tensor(usize),
}

fn input(p: &mut Problem, which: Input) -> &mut Vec<f64> {
    match which {
        Input::Q => &mut p.q,
        Input::K => &mut p.k,
        Input::V => &mut p.v,
        Input::Tensor(slot) => match &mut p.tensors[slot] {
            TensorData::Float(d) => d,
            TensorData::I32(_) => panic!("i32 tensors have no gradient"),
        },
    }
}

const STEP: f64 = 1e-6;

/// L = Σ O ∘ dO, whose gradient is the backward of `d_out`; O with
/// `dropout`'s mask where given (a fixed mask: O stays smooth).
fn loss(spec: &Spec, p: &Problem, d_out: &[f64], dropout: Option<Dropout>) -> f64 {
    let out = match dropout {
        None => forward(spec, p, Precision::F64),
        Some(d) => forward_dropout(spec, p, Precision::F64, d),
    };
    out.expect("a valid problem").o.iter().zip(d_out).map(|(o, d)| o * d).sum()
}

/// ∂L/∂input by central differences, element by element.
fn numeric(spec: &Spec, p: &Problem, d_out: &[f64], which: Input, dropout: Option<Dropout>) -> Vec<f64> {
    let len = input(&mut p.clone(), which).len();
    (0..len)
        .map(|i| {
            let (mut plus, mut minus) = (p.clone(), p.clone());
            input(&mut plus, which)[i] += STEP;
            input(&mut minus, which)[i] -= STEP;
            (loss(spec, &plus, d_out, dropout) - loss(spec, &minus, d_out, dropout)) / (2.0 * STEP)
        })
        .collect()
}

/// Roundoff in the differences is about 1e-16 · |L| / STEP ≈ 1e-9 here, the
/// truncation error STEP² · L‴ smaller still.
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-8 + 1e-6 * w.abs(), "{what}[{i}]: backward {g}, finite differences {w}");
    }
}

#[test]
fn gradients_match_finite_differences() {
    let mut rng = Rng(7);
    for spec in specs() {
        for shape in SHAPES {
            let p = problem(&spec, shape, &mut rng);
            let d_out: Vec<f64> = (0..p.shape.batch * p.shape.q_len * p.shape.heads * spec.head_dims.v as usize)
                .map(|_| rng.normal())
                .collect();
            check_gradients(&spec, &p, &d_out, None);
        }
    }
}

/// The backward with dropout against finite differences of the dropout
/// forward (its mask fixed by seed and offset), for every spec at p = 0.3;
/// at p = 0 the dropout forward is the plain one.
#[test]
fn dropout_gradients_match_finite_differences() {
    let mut rng = Rng(11);
    for (x, spec) in specs().into_iter().enumerate() {
        let shape = SHAPES[x % SHAPES.len()];
        let p = problem(&spec, shape, &mut rng);
        let d_out: Vec<f64> =
            (0..shape.batch * shape.q_len * shape.heads * spec.head_dims.v as usize).map(|_| rng.normal()).collect();
        let dropout = Dropout { p: 0.3, seed: 0x5eed + x as u64, offset: 3 };
        check_gradients(&spec, &p, &d_out, Some(dropout));
        let none = Dropout { p: 0.0, ..dropout };
        assert_eq!(forward_dropout(&spec, &p, Precision::F64, none), forward(&spec, &p, Precision::F64));
    }
}

/// The reference backward (with `dropout`, where given) of every input
/// that has a gradient against finite differences.
fn check_gradients(spec: &Spec, p: &Problem, d_out: &[f64], dropout: Option<Dropout>) {
    let g = match dropout {
        None => backward(spec, p, d_out),
        Some(d) => backward_dropout(spec, p, d_out, Precision::F64, d),
    };
    let g = g.expect("a valid problem");
    let what = |buffer: &str| format!("{} {:?} {dropout:?} {buffer}", spec.name, p.shape);
    assert_close(&what("dq"), &g.dq, &numeric(spec, p, d_out, Input::Q, dropout));
    assert_close(&what("dk"), &g.dk, &numeric(spec, p, d_out, Input::K, dropout));
    assert_close(&what("dv"), &g.dv, &numeric(spec, p, d_out, Input::V, dropout));
    assert_eq!(g.d_tensors.len(), spec.tensors.len());
    for (slot, dt) in g.d_tensors.iter().enumerate() {
        assert_eq!(dt.is_some(), trainable(spec, slot), "{}", what(&spec.tensors[slot].name));
        if let Some(dt) = dt {
            let name = what(&spec.tensors[slot].name);
            assert_close(&name, dt, &numeric(spec, p, d_out, Input::Tensor(slot), dropout));
        }
    }
}

#[test]
fn trainable_tensors_are_the_float_ones_read_once() {
    let trainable = |name: &str| -> Vec<bool> {
        let s = spec(name);
        (0..s.tensors.len()).map(|i| d_load(&s, i).is_some()).collect()
    };
    assert_eq!(trainable("Alibi"), [true]);
    assert_eq!(trainable("RelativeBias"), [true]);
    assert_eq!(trainable("Document"), [false]);
    assert_eq!(trainable("Biased"), [true, true, true]);
    assert_eq!(trainable("TwoReads"), [false]);
    let sink_read = |name: &str| -> Vec<bool> {
        let s = spec(name);
        (0..s.tensors.len()).map(|i| d_sink_load(&s, i).is_some()).collect()
    };
    assert_eq!(sink_read("SharedSink"), [true, true]);
    assert_eq!(trainable("SharedSink"), [true, false], "the sink's tensor `u` is not read by the score");
}

#[test]
fn clamped_reads_train_the_element_they_read() {
    // `edge[h][k + 2]` with KV_LEN 5: keys 0 to 2 read columns 2 to 4, keys 3
    // and 4 clamp to column 4, so columns 0 and 1 get nothing.
    let s = spec("Biased");
    let mut rng = Rng(11);
    let p = problem(&s, SHAPES[0], &mut rng);
    let d_out: Vec<f64> = (0..p.q.len() / 4 * 3).map(|_| rng.normal()).collect();
    let g = backward(&s, &p, &d_out).unwrap();
    let edge = g.d_tensors[2].as_ref().unwrap();
    for h in 0..2 {
        assert_eq!(&edge[h * 5..][..2], [0.0, 0.0]);
        assert!(edge[h * 5 + 2..][..3].iter().all(|&x| x != 0.0), "{edge:?}");
    }
}

#[test]
fn fully_masked_rows_have_zero_gradients() {
    let s = spec("MaskedRow");
    let mut rng = Rng(3);
    let p = problem(&s, SHAPES[0], &mut rng);
    let d_out = vec![1.0; p.q.len() / 4 * 3];
    let g = backward(&s, &p, &d_out).unwrap();
    let (heads, dk) = (p.shape.heads, 4);
    for b in 0..p.shape.batch {
        // Query 0 keeps no key.
        let row0 = &g.dq[b * p.shape.q_len * heads * dk..][..heads * dk];
        assert!(row0.iter().all(|&x| x == 0.0), "{row0:?}");
    }
    assert!(g.dq.iter().any(|&x| x != 0.0));
}

/// The same-dtype baselines: the first is `backward_in`'s, each is off the
/// golden gradients by a plausible amount and off in its own way (independent
/// draws); dQ, dK, dV are in the dtype and an f32 tensor's gradient in f32.
/// The averaged rule passes the golden slopes gradient and fails one with a
/// head's sign flipped or its gradient lost.
#[test]
fn same_dtype_baselines_are_independent_draws() {
    let spec = parse_one(
        "Alibi { dtype: bf16, head_dim: 32, tensor slopes: f32[H], mask: q >= k, \
         score: score + slopes[h] * (k - q) as f32 }",
    )
    .unwrap();
    let mut rng = Rng(5);
    let mut p = problem(&spec, Shape { batch: 1, heads: 2, heads_kv: 2, q_len: 40, kv_len: 48 }, &mut rng);
    for x in p.q.iter_mut().chain(&mut p.k).chain(&mut p.v) {
        *x = round_bf16(*x);
    }
    p.tensors = vec![TensorData::Float(vec![0.5, 0.0625])]; // ALiBi's geometric slopes
    let d_out: Vec<f64> = (0..p.q.len()).map(|_| round_bf16(rng.normal())).collect();
    let golden = backward(&spec, &p, &d_out).unwrap();
    let same = same_dtype_backwards(&spec, &p, &d_out, 4).unwrap();
    assert_eq!(same[0], backward_in(&spec, &p, &d_out, Precision::SameDtype(spec.dtype)).unwrap());
    let scale = golden.dq.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    for (i, s) in same.iter().enumerate() {
        let err = max_abs_diff(&s.dq, &golden.dq);
        assert!(err > 0.0 && err < 0.05 * scale, "baseline {i}: dQ error {err} of {scale}");
        assert!(same[..i].iter().all(|other| other.dq != s.dq), "baseline {i} repeats another");
    }
    assert!(same[0].dq.iter().chain(&same[0].dk).chain(&same[0].dv).all(|&x| round_bf16(x) == x));
    let slopes = |g: &Gradients| g.d_tensors[0].clone().unwrap();
    assert!(slopes(&same[0]).iter().all(|&x| f64::from(x as f32) == x));
    assert!(slopes(&same[0]).iter().any(|&x| round_bf16(x) != x), "not rounded to bf16");

    let baselines: Vec<Vec<f64>> = same.iter().map(slopes).collect();
    let rule =
        |out: &[f64]| flash_rule_averaged(out, baselines.iter().map(Vec::as_slice), &slopes(&golden), BACKWARD_FACTOR);
    let golden_slopes = slopes(&golden);
    assert!(rule(&golden_slopes).passed);
    let flipped = [golden_slopes[0], -golden_slopes[1]];
    assert!(!rule(&flipped).passed, "{}", rule(&flipped));
    let dropped = [golden_slopes[0], 0.0];
    assert!(!rule(&dropped).passed, "{}", rule(&dropped));
}

#[test]
fn malformed_gradients_are_errors() {
    let s = spec("Softcap");
    let p = problem(&s, SHAPES[0], &mut Rng(1));
    let n = p.q.len() / 4 * 3;
    assert_eq!(
        backward(&s, &p, &vec![0.0; n - 1]),
        Err(ReferenceError::Length { buffer: "d_out".into(), expected: n, found: n - 1 })
    );
    let mut bad = p.clone();
    bad.shape.heads_kv = 3;
    assert!(matches!(backward(&s, &bad, &vec![0.0; n]), Err(ReferenceError::Shape(_))));
}

/// Every derivative the specs get, with a name for messages.
fn derivatives(spec: &Spec) -> Vec<(String, Expr)> {
    let score = d_score(spec).map(|d| ("d_score".to_string(), d));
    let loads = (0..spec.tensors.len()).filter_map(|i| d_load(spec, i).map(|d| (format!("d_load {i}"), d)));
    score.into_iter().chain(loads).collect()
}

#[test]
fn derivatives_print_as_valid_score_expressions() {
    for spec in specs() {
        assert_eq!(d_score(&spec).is_some(), spec.score.is_some(), "{}", spec.name);
        for (what, d) in derivatives(&spec) {
            let mut as_score = spec.clone();
            as_score.score = Some(d.clone());
            let source = to_source(&as_score);
            let reparsed = parse_one(&source).unwrap_or_else(|e| panic!("{} {what}: {e}\n{source}", spec.name));
            assert_eq!(reparsed.score, Some(d), "{} {what}:\n{source}", spec.name);
        }
    }
}

#[test]
fn d_score_matches_finite_differences_of_the_score() {
    let mut rng = Rng(5);
    for spec in specs() {
        let (Some(score), Some(d)) = (&spec.score, d_score(&spec)) else { continue };
        let shape = SHAPES[1];
        let p = problem(&spec, shape, &mut rng);
        let env = Env::new(&spec, &shape, &p.params, &p.tensors, Arith::F64).unwrap();
        let at_score = |at: &Position, s: f64| float(env.eval(score, &Position { score: s, ..*at }));
        for b in 0..shape.batch as i32 {
            for h in 0..shape.heads as i32 {
                for q in 0..shape.q_len as i32 {
                    for k in 0..shape.kv_len as i32 {
                        let at = Position { b, h, q, k, score: 2.0 * rng.normal() };
                        let want = (at_score(&at, at.score + STEP) - at_score(&at, at.score - STEP)) / (2.0 * STEP);
                        let got = float(env.eval(&d, &at));
                        assert!(
                            (got - want).abs() <= 1e-7 + 1e-6 * want.abs(),
                            "{} at {at:?}: d_score {got}, finite differences {want}",
                            spec.name
                        );
                    }
                }
            }
        }
    }
}
