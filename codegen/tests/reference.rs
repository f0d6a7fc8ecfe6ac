//! The CPU reference against textbook attention written independently here,
//! plus the interpreter's edge-case semantics, rounding and error metrics.

mod support;

use flashgen_codegen::reference::{
    flash_rule, flash_rule_averaged, forward, max_abs_diff, mean_abs_diff, round_bf16, round_dtype, round_e4m3,
    round_f16, Arith, Env, Output, ParamValue, Position, Precision, Problem, ReferenceError, TensorData, Value,
    FORWARD_FACTOR,
};
use flashgen_codegen::{parse_one, Shape, Spec};

use support::Rng;

fn shape(batch: usize, heads: usize, heads_kv: usize, q_len: usize, kv_len: usize) -> Shape {
    Shape { batch, heads, heads_kv, q_len, kv_len }
}

/// N(0, 1) Q, K, V rounded to the spec's dtype, scale 1/√d.
fn problem(spec: &Spec, shape: Shape, seed: u64, params: Vec<ParamValue>, tensors: Vec<TensorData>) -> Problem {
    let mut rng = Rng(seed);
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let mut fill = |n: usize| -> Vec<f64> { (0..n).map(|_| round_dtype(spec.dtype, rng.normal())).collect() };
    let q = fill(shape.batch * shape.q_len * shape.heads * dk);
    let k = fill(shape.batch * shape.kv_len * shape.heads_kv * dk);
    let v = fill(shape.batch * shape.kv_len * shape.heads_kv * dv);
    Problem { shape, q, k, v, scale: 1.0 / (dk as f64).sqrt(), params, tensors }
}

/// Textbook attention: O = Σ e^s·v / Σ e^s and LSE = ln Σ e^s over the
/// pairs `logit([b, h, q, k], scaled score)` keeps (None = masked).
fn naive(spec: &Spec, p: &Problem, logit: impl Fn([usize; 4], f64) -> Option<f64>) -> Output {
    let Shape { batch, heads, heads_kv, q_len, kv_len } = p.shape;
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let mut o = vec![0.0; batch * q_len * heads * dv];
    let mut lse = vec![0.0; batch * heads * q_len];
    for b in 0..batch {
        for h in 0..heads {
            let hk = h * heads_kv / heads;
            for i in 0..q_len {
                let weights: Vec<(usize, f64)> = (0..kv_len)
                    .filter_map(|j| {
                        let s: f64 = (0..dk)
                            .map(|d| {
                                p.q[((b * q_len + i) * heads + h) * dk + d]
                                    * p.k[((b * kv_len + j) * heads_kv + hk) * dk + d]
                            })
                            .sum();
                        logit([b, h, i, j], p.scale * s).map(|l| (j, l.exp()))
                    })
                    .collect();
                let z: f64 = weights.iter().map(|(_, w)| w).sum();
                lse[(b * heads + h) * q_len + i] = z.ln();
                if weights.is_empty() {
                    continue;
                }
                for d in 0..dv {
                    let num: f64 =
                        weights.iter().map(|&(j, w)| w * p.v[((b * kv_len + j) * heads_kv + hk) * dv + d]).sum();
                    o[((b * q_len + i) * heads + h) * dv + d] = num / z;
                }
            }
        }
    }
    Output { o, lse }
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g == w || (g - w).abs() <= tol;
        assert!(ok, "{what}[{n}]: got {g}, want {w}");
    }
}

/// The f64 reference equals the textbook formula.
fn check_against_naive(spec: &Spec, p: &Problem, logit: impl Fn([usize; 4], f64) -> Option<f64>) {
    let got = forward(spec, p, Precision::F64).unwrap();
    let want = naive(spec, p, logit);
    assert_close("o", &got.o, &want.o, 1e-12);
    assert_close("lse", &got.lse, &want.lse, 1e-12);
}

const TINY: Shape = Shape { batch: 2, heads: 2, heads_kv: 2, q_len: 5, kv_len: 7 };

#[test]
fn full_attention_matches_naive() {
    let spec = parse_one("Full { dtype: bf16, head_dim: 4 }").unwrap();
    let p = problem(&spec, TINY, 1, vec![], vec![]);
    check_against_naive(&spec, &p, |_, s| Some(s));
}

#[test]
fn causal_matches_naive() {
    let spec = parse_one("Causal { dtype: f16, head_dim: 4, mask: q >= k }").unwrap();
    let p = problem(&spec, TINY, 2, vec![], vec![]);
    check_against_naive(&spec, &p, |[_, _, q, k], s| (q >= k).then_some(s));
}

#[test]
fn softcap_matches_naive() {
    let spec =
        parse_one("Softcap { dtype: bf16, head_dim: 4, param cap: f32, score: cap * tanh(score / cap) }").unwrap();
    let mut p = problem(&spec, TINY, 3, vec![ParamValue::F32(0.75)], vec![]);
    p.scale = 3.0; // Large scores, so that the cap matters.
    check_against_naive(&spec, &p, |_, s| Some(0.75 * (s / 0.75).tanh()));
}

#[test]
fn alibi_with_a_tensor_matches_naive() {
    let spec = parse_one(
        "Alibi { dtype: bf16, head_dim: 4, tensor slopes: f32[H], mask: q >= k, score: score + slopes[h] * (k - q) as f32 }",
    )
    .unwrap();
    let slopes = [0.5, 0.125];
    let p = problem(&spec, TINY, 4, vec![], vec![TensorData::Float(slopes.to_vec())]);
    check_against_naive(&spec, &p, |[_, h, q, k], s| (q >= k).then(|| s + slopes[h] * (k as f64 - q as f64)));
}

#[test]
fn gqa_and_mqa_match_naive() {
    let spec = parse_one("Gqa { dtype: bf16, head_dim: 6, v_head_dim: 4, mask: q >= k }").unwrap();
    for heads_kv in [1, 2, 4] {
        let p = problem(&spec, shape(2, 4, heads_kv, 5, 7), 5, vec![], vec![]);
        check_against_naive(&spec, &p, |[_, _, q, k], s| (q >= k).then_some(s));
    }
}

#[test]
fn document_mask_with_an_i32_tensor_matches_naive() {
    let spec = parse_one(
        "Document { dtype: bf16, head_dim: 4, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k }",
    )
    .unwrap();
    let doc = [0, 0, 1, 1, 1, 2, 2, 0, 1, 1, 1, 1, 1, 1];
    let p = problem(&spec, TINY, 6, vec![], vec![TensorData::I32(doc.to_vec())]);
    check_against_naive(&spec, &p, |[b, _, q, k], s| (doc[b * 7 + q] == doc[b * 7 + k] && q >= k).then_some(s));
}

#[test]
fn fully_masked_rows_give_zero_and_negative_infinity() {
    let spec = parse_one("Shifted { dtype: bf16, head_dim: 4, mask: q >= k + 2 }").unwrap();
    let p = problem(&spec, TINY, 7, vec![], vec![]);
    for precision in [Precision::F64, Precision::SameDtype(spec.dtype)] {
        let out = forward(&spec, &p, precision).unwrap();
        assert!(out.o.iter().chain(&out.lse).all(|x| !x.is_nan()), "{precision:?}: NaN");
        for (row, &lse) in out.lse.iter().enumerate() {
            let q = row % TINY.q_len;
            assert_eq!(lse == f64::NEG_INFINITY, q < 2, "{precision:?}: row {row}");
        }
        // Rows q = 0 and 1 of every (b, h) are zero.
        for (n, &o) in out.o.iter().enumerate() {
            let q = n / (TINY.heads * 4) % TINY.q_len;
            if q < 2 {
                assert_eq!(o, 0.0, "{precision:?}: o[{n}]");
            }
        }
    }
    check_against_naive(&spec, &p, |[_, _, q, k], s| (q >= k + 2).then_some(s));
}

#[test]
fn lse_of_uniform_scores_is_log_kv_len_and_o_is_the_mean() {
    let spec = parse_one("Full { dtype: bf16, head_dim: 4 }").unwrap();
    let mut p = problem(&spec, shape(1, 1, 1, 3, 8), 8, vec![], vec![]);
    p.q.iter_mut().for_each(|x| *x = 0.0);
    let out = forward(&spec, &p, Precision::F64).unwrap();
    for lse in &out.lse {
        assert!((lse - 8f64.ln()).abs() < 1e-15, "{lse}");
    }
    for d in 0..4 {
        let mean = (0..8).map(|j| p.v[j * 4 + d]).sum::<f64>() / 8.0;
        for i in 0..3 {
            assert!((out.o[i * 4 + d] - mean).abs() < 1e-15);
        }
    }
}

#[test]
fn same_dtype_differs_from_f64_by_a_plausible_amount() {
    let spec = parse_one("Causal { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    let p = problem(&spec, shape(1, 2, 2, 128, 128), 9, vec![], vec![]);
    let golden = forward(&spec, &p, Precision::F64).unwrap();
    let same = forward(&spec, &p, Precision::SameDtype(spec.dtype)).unwrap();
    let o_err = max_abs_diff(&same.o, &golden.o);
    assert!(o_err > 0.0 && o_err < 1e-2, "O error {o_err}");
    let lse_err = max_abs_diff(&same.lse, &golden.lse);
    assert!(lse_err > 0.0 && lse_err < 1e-2, "LSE error {lse_err}");
    // Same-dtype outputs are representable in the dtype.
    assert!(same.o.iter().all(|&x| round_bf16(x) == x));
    // The rule: the golden output passes, the same-dtype one by definition,
    // and an output twice as far off as allowed fails.
    assert!(flash_rule(&golden.o, &same.o, &golden.o, FORWARD_FACTOR).passed);
    assert!(flash_rule(&same.o, &same.o, &golden.o, FORWARD_FACTOR).passed);
    let worse: Vec<f64> = golden.o.iter().map(|x| x + 5.0 * o_err).collect();
    let check = flash_rule(&worse, &same.o, &golden.o, FORWARD_FACTOR);
    assert!(!check.passed, "{check}");
}

#[test]
fn flash_rule_never_passes_nan() {
    let golden = [1.0, 2.0];
    assert!(!flash_rule(&[1.0, f64::NAN], &golden, &golden, FORWARD_FACTOR).passed);
    assert!(!flash_rule(&golden, &[f64::NAN, 2.0], &golden, FORWARD_FACTOR).passed);
    assert!(!flash_rule(&[1.0], &golden, &golden, FORWARD_FACTOR).passed, "length mismatch");
    assert!(flash_rule(&[1.0, 2.0 + 5e-7], &golden, &golden, FORWARD_FACTOR).passed, "within the slack");
}

#[test]
fn averaged_rule_uses_the_mean_baseline_error() {
    let golden = [1.0, 2.0];
    let (near, far) = ([1.0, 2.1], [1.5, 2.0]);
    let check = flash_rule_averaged(&[1.0, 2.5], [&near[..], &far[..]], &golden, 2.0);
    assert!((check.reference_error - 0.3).abs() < 1e-12 && check.passed, "{check}");
    assert!(!flash_rule_averaged(&[1.0, 2.7], [&near[..], &far[..]], &golden, 2.0).passed);
    assert_eq!(
        flash_rule_averaged(&[1.0, 2.1], [&near[..]], &golden, 2.0),
        flash_rule(&[1.0, 2.1], &near, &golden, 2.0)
    );
    assert!(!flash_rule_averaged(&golden, [], &golden, 2.0).passed, "no baseline");
}

#[test]
fn diff_metrics() {
    let inf = f64::INFINITY;
    assert_eq!(max_abs_diff(&[1.0, -inf, 3.0], &[1.5, -inf, 2.0]), 1.0);
    assert!(max_abs_diff(&[f64::NAN, 1.0], &[0.0, 5.0]).is_nan());
    assert!(max_abs_diff(&[1.0], &[1.0, 2.0]).is_nan());
    assert_eq!(mean_abs_diff(&[1.0, 2.0], &[1.5, 3.0]), 0.75);
    assert_eq!(mean_abs_diff(&[], &[]), 0.0);
}

#[test]
fn rounding_is_to_nearest_even_from_f64() {
    let p = |e: i32| 2f64.powi(e);
    // bf16 has 8 significand bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7.
    assert_eq!(round_bf16(1.0 + p(-8)), 1.0);
    assert_eq!(round_bf16(1.0 + 3.0 * p(-8)), 1.0 + 2.0 * p(-7));
    // A bit far below the tie still breaks it (lost by truncating to f32).
    assert_eq!(round_bf16(1.0 + p(-8) + p(-40)), 1.0 + p(-7));
    assert_eq!(round_bf16(-(1.0 + p(-8) + p(-40))), -(1.0 + p(-7)));
    // f16 has 11: the same with 1 + 2^-11.
    assert_eq!(round_f16(1.0 + p(-11)), 1.0);
    assert_eq!(round_f16(1.0 + p(-11) + p(-40)), 1.0 + p(-10));
    assert_eq!(round_f16(65504.0), 65504.0);
    assert_eq!(round_f16(70000.0), f64::INFINITY);
    assert_eq!(round_bf16(1e39), f64::INFINITY);
    assert!(round_f16(f64::NAN).is_nan());
    assert_eq!(round_dtype(flashgen_codegen::Dtype::Bf16, 0.1), f64::from(half::bf16::from_f32(0.1).to_f32()));
}

#[test]
fn e4m3_rounding_is_to_nearest_even_and_saturates() {
    let p = |e: i32| 2f64.powi(e);
    // 3 significand bits: 1 + 2^-4 is a tie between 1 and 1 + 2^-3.
    assert_eq!(round_e4m3(1.0 + p(-4)), 1.0);
    assert_eq!(round_e4m3(1.0 + 3.0 * p(-4)), 1.25);
    assert_eq!(round_e4m3(1.0 + p(-4) + p(-30)), 1.125);
    // Subnormals in steps of 2^-9 below 2^-6; half a step is a tie to 0.
    assert_eq!(round_e4m3(p(-9)), p(-9));
    assert_eq!(round_e4m3(p(-10)), 0.0);
    assert_eq!(round_e4m3(3.0 * p(-10)), p(-8));
    // The largest finite value, 448; beyond it the kernels saturate.
    assert_eq!(round_e4m3(448.0), 448.0);
    assert_eq!(round_e4m3(1e6), 448.0);
    assert_eq!(round_e4m3(-500.0), -448.0);
    assert_eq!(round_e4m3(0.0), 0.0);
    assert!(round_e4m3(f64::NAN).is_nan());
}

// ---- Interpreter semantics --------------------------------------------

const EVAL_SHAPE: Shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 9, kv_len: 11 };

fn at(q: i32, k: i32, score: f64) -> Position {
    Position { b: 1, h: 3, q, k, score }
}

/// Evaluates the mask or score of `T { dtype: bf16, head_dim: 4, <fields> }`.
fn eval_with(fields: &str, params: &[ParamValue], tensors: &[TensorData], at: Position, arith: Arith) -> Value {
    let spec = parse_one(&format!("T {{ dtype: bf16, head_dim: 4, {fields} }}")).unwrap();
    let env = Env::new(&spec, &EVAL_SHAPE, params, tensors, arith).unwrap();
    env.eval(spec.score.as_ref().or(spec.mask.as_ref()).unwrap(), &at)
}

fn eval(fields: &str, params: &[ParamValue], at: Position) -> Value {
    eval_with(fields, params, &[], at, Arith::F32)
}

#[test]
fn integer_division_and_remainder_never_trap() {
    let ints = |x: i32, y: i32| [ParamValue::I32(x), ParamValue::I32(y)];
    let decls = "param x: i32, param y: i32,";
    let run = |body: &str, x, y| eval(&format!("{decls} score: ({body}) as f32"), &ints(x, y), at(0, 0, 0.0));
    assert_eq!(run("x / y", 7, 0), Value::F32(0.0));
    assert_eq!(run("x % y", 7, 0), Value::F32(0.0));
    assert_eq!(run("x / y", i32::MIN, -1), Value::F32(i32::MIN as f64));
    assert_eq!(run("x % y", i32::MIN, -1), Value::F32(0.0));
    assert_eq!(run("x + y", i32::MAX, 1), Value::F32(i32::MIN as f64));
    assert_eq!(run("x * y", i32::MIN, -1), Value::F32(i32::MIN as f64));
    assert_eq!(run("-x", i32::MIN, 0), Value::F32(i32::MIN as f64));
    assert_eq!(run("-7 / y", 0, 2), Value::F32(-3.0), "truncating division");
    assert_eq!(run("-7 % y", 0, 2), Value::F32(-1.0));
}

#[test]
fn clamp_min_max_abs() {
    // lo > hi: min(max(x, lo), hi) = hi, no panic.
    assert_eq!(eval("score: clamp(q, 5, 2) as f32", &[], at(0, 0, 0.0)), Value::F32(2.0));
    assert_eq!(eval("score: clamp(score, 1.0, -1.0)", &[], at(0, 0, 0.5)), Value::F32(-1.0));
    assert_eq!(eval("score: clamp(q - k, -2, 2) as f32", &[], at(0, 7, 0.0)), Value::F32(-2.0));
    assert_eq!(eval("score: (abs(q - k) + max(q, k)) as f32", &[], at(2, 7, 0.0)), Value::F32(12.0));
    // Float min/max ignore NaN, like fminf/fmaxf.
    assert_eq!(eval("score: min(score, 1.0)", &[], at(0, 0, f64::NAN)), Value::F32(1.0));
    assert_eq!(eval("score: max(score, -1.0)", &[], at(0, 0, f64::NAN)), Value::F32(-1.0));
}

#[test]
fn tensor_indices_are_clamped() {
    let t = [TensorData::Float(vec![10.0, 20.0, 30.0, 40.0])];
    let run =
        |index: &str, q| eval_with(&format!("tensor t: f32[4], score: t[{index}]"), &[], &t, at(q, 0, 0.0), Arith::F32);
    assert_eq!(run("q - 10", 0), Value::F32(10.0));
    assert_eq!(run("q", 2), Value::F32(30.0));
    assert_eq!(run("q + 100", 0), Value::F32(40.0));
    // Row-major in two dimensions, each index clamped on its own.
    let m = [TensorData::I32((0..6).collect())];
    let run2 = |q, k| eval_with("tensor m: i32[2, 3], score: m[q][k] as f32", &[], &m, at(q, k, 0.0), Arith::F32);
    assert_eq!(run2(1, 2), Value::F32(5.0));
    assert_eq!(run2(5, -1), Value::F32(3.0));
    assert_eq!(run2(-3, 9), Value::F32(2.0));
    // Symbolic dims resolve against the shape: doc is [B = 2, KV_LEN = 11].
    let doc = [TensorData::I32((0..22).collect())];
    let v = eval_with("tensor doc: i32[B, KV_LEN], score: doc[b][k] as f32", &[], &doc, at(0, 20, 0.0), Arith::F32);
    assert_eq!(v, Value::F32(21.0));
}

#[test]
fn casts() {
    let trunc = |x| eval("score: (score as i32) as f32", &[], at(0, 0, x));
    assert_eq!(trunc(3.7), Value::F32(3.0));
    assert_eq!(trunc(-3.7), Value::F32(-3.0));
    assert_eq!(trunc(f64::NAN), Value::F32(0.0));
    assert_eq!(trunc(1e20), Value::F32(2147483648.0), "saturates to i32::MAX, then rounds to f32");
    assert_eq!(trunc(-1e20), Value::F32(-2147483648.0));
    assert_eq!(eval("score: (q > k) as i32 as f32", &[], at(3, 1, 0.0)), Value::F32(1.0));
    assert_eq!(eval("score: (q > k) as i32 as f32", &[], at(1, 3, 0.0)), Value::F32(0.0));
    // i32 → f32 rounds to f32 (2^24 + 1 is not an f32).
    assert_eq!(eval("score: (q + 16777216) as f32", &[], at(1, 0, 0.0)), Value::F32(16777216.0));
}

#[test]
fn masks_evaluate_to_bool() {
    let run = |mask: &str, q, k| eval(&format!("param w: i32, mask: {mask}"), &[ParamValue::I32(3)], at(q, k, 0.0));
    assert_eq!(run("q >= k && q - k < w", 5, 3), Value::Bool(true));
    assert_eq!(run("q >= k && q - k < w", 5, 1), Value::Bool(false));
    assert_eq!(run("k < w || !(q >= k)", 1, 5), Value::Bool(true));
    assert_eq!(run("if q > 2 { k == 0 } else { true }", 4, 1), Value::Bool(false));
    assert_eq!(run("q + kv_len - q_len >= k", 0, 2), Value::Bool(true));
    assert_eq!(run("b == 1 && h == 3", 0, 0), Value::Bool(true));
    assert_eq!(run("(q > k) == (k < q)", 0, 0), Value::Bool(true));
}

#[test]
fn float_arithmetic_follows_the_precision() {
    let third = |arith| eval_with("score: score / 3.0", &[], &[], at(0, 0, 1.0), arith);
    assert_eq!(third(Arith::F32), Value::F32(f64::from(1.0f32 / 3.0)));
    assert_eq!(third(Arith::F64), Value::F32(1.0 / 3.0));
    // The incoming score is rounded to f32 under F32 arithmetic.
    let id = |arith| eval_with("score: score", &[], &[], at(0, 0, 0.1), arith);
    assert_eq!(id(Arith::F32), Value::F32(f64::from(0.1f32)));
    assert_eq!(id(Arith::F64), Value::F32(0.1));
    let f = |body: &str, x: f64| eval(&format!("score: {body}"), &[], at(0, 0, x));
    // Library functions: the compiler may constant-fold the expected side
    // with a different (correctly rounded) libm, so allow one f32 ulp.
    let near = |body: &str, x: f64, want: f32| {
        let Value::F32(got) = f(body, x) else { panic!("{body}: not f32") };
        assert!(
            (got - f64::from(want)).abs() <= f64::from(want.abs()) * 2.0 * f64::from(f32::EPSILON),
            "{body}: {got} vs {want}"
        );
    };
    near("tanh(score)", 0.3, 0.3f32.tanh());
    near("exp2(score) + log2(score)", 1.5, 1.5f32.exp2() + 1.5f32.log2());
    near("sigmoid(score)", 2.0, 1.0 / (1.0 + (-2.0f32).exp()));
    assert_eq!(f("sigmoid(score)", 0.0), Value::F32(0.5));
    near("sqrt(score) + floor(score)", 2.0, 2f32.sqrt() + 2.0);
    near("log(exp(score))", 1.0, 1f32.exp().ln());
    assert_eq!(f("score % 2.0", -5.5), Value::F32(-1.5), "fmod");
    assert_eq!(f("score / 0.0", 1.0), Value::F32(f64::INFINITY));
    let p = eval_with("param c: f32, score: score * c", &[ParamValue::F32(0.1)], &[], at(0, 0, 1.0), Arith::F64);
    assert_eq!(p, Value::F32(f64::from(0.1f32)), "f32 params keep their f32 value in f64 mode");
}

// ---- Input validation --------------------------------------------------

#[test]
fn malformed_inputs_are_errors() {
    let spec = parse_one("Bias { dtype: bf16, head_dim: 4, param w: i32, tensor t: f32[H], mask: q - k < w }").unwrap();
    let good = problem(&spec, TINY, 10, vec![ParamValue::I32(2)], vec![TensorData::Float(vec![0.0; 2])]);
    assert!(forward(&spec, &good, Precision::F64).is_ok());
    let fails = |edit: &dyn Fn(&mut Problem)| {
        let mut p = good.clone();
        edit(&mut p);
        forward(&spec, &p, Precision::F64).unwrap_err()
    };
    assert_eq!(
        fails(&|p| {
            p.q.pop();
        }),
        ReferenceError::Length { buffer: "q".into(), expected: 80, found: 79 }
    );
    assert!(matches!(fails(&|p| p.v.push(0.0)), ReferenceError::Length { ref buffer, .. } if buffer == "v"));
    assert!(matches!(fails(&|p| p.params.clear()), ReferenceError::Mismatch(_)));
    assert!(matches!(fails(&|p| p.params[0] = ParamValue::F32(2.0)), ReferenceError::Mismatch(_)));
    assert!(matches!(fails(&|p| p.tensors[0] = TensorData::I32(vec![0; 2])), ReferenceError::Mismatch(_)));
    assert!(
        matches!(fails(&|p| p.tensors[0] = TensorData::Float(vec![0.0; 3])), ReferenceError::Length { ref buffer, .. } if buffer == "t")
    );
    assert!(matches!(fails(&|p| p.shape.heads_kv = 0), ReferenceError::Shape(_)));
    assert!(matches!(fails(&|p| p.shape.heads_kv = 3), ReferenceError::Shape(_)));
    // Sizes beyond i32 are rejected, not truncated (empty batch: no buffers).
    let huge = |p: &mut Problem| {
        p.shape = shape(0, 2, 2, 3_000_000_000, 7);
        p.q.clear();
        p.k.clear();
        p.v.clear();
        p.tensors[0] = TensorData::Float(vec![0.0; 2]);
    };
    assert!(matches!(fails(&huge), ReferenceError::Shape(_)));
    // Buffer sizes that overflow usize are errors too.
    assert!(matches!(fails(&|p| p.shape.q_len = usize::MAX), ReferenceError::Shape(_)));
}

#[test]
fn empty_problems_are_fine() {
    let spec = parse_one("Causal { dtype: bf16, head_dim: 4, mask: q >= k }").unwrap();
    for s in [shape(0, 2, 1, 5, 7), shape(1, 2, 1, 0, 7), shape(1, 2, 1, 5, 0)] {
        let out = forward(&spec, &problem(&spec, s, 11, vec![], vec![]), Precision::F64).unwrap();
        assert!(out.o.iter().all(|&x| x == 0.0));
        assert!(out.lse.iter().all(|&x| x == f64::NEG_INFINITY));
    }
}
