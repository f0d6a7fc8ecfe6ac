//! Learned sinks: the field's grammar, checks and canonical form, and the
//! reference's meaning of it (one more logit in each row's denominator with
//! no value row; a row with no kept key gives O = 0 and LSE = sink).

mod support;

use flashgen_codegen::grad::trainable;
use flashgen_codegen::reference::{forward, Output, ParamValue, Precision, Problem, TensorData};
use flashgen_codegen::{parse_one, to_source, Shape, Spec};
use support::Rng;

fn parse(source: &str) -> Spec {
    parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("test", source)))
}

fn error(source: &str) -> String {
    parse_one(source).expect_err("an invalid spec").message
}

const SINKS: &str = "S { dtype: bf16, head_dim: 8, tensor sinks: f32[H], mask: k <= q, sink: sinks[h] }";

#[test]
fn the_sink_parses_prints_and_round_trips() {
    let spec = parse(SINKS);
    assert!(spec.sink.is_some());
    let printed = to_source(&spec);
    assert!(printed.contains("    sink: sinks[h],\n"), "{printed}");
    assert_eq!(parse(&printed), spec);
    let affine = parse(
        "S { dtype: f16, head_dim: 8, param p: f32, tensor w: f32[B, H], \
         sink: if p > 0.0 { 2 * tanh(w[b][h]) } else { (h - b) as f32 } }",
    );
    let printed = to_source(&affine);
    assert_eq!(parse(&printed), affine, "{printed}");
    assert!(to_source(&parse("S { dtype: bf16, head_dim: 8 }")).find("sink").is_none());
}

#[test]
fn a_sink_is_f32_over_b_h_params_and_tensors() {
    for name in ["q", "k", "score", "q_len", "kv_len"] {
        let message = error(&format!("S {{ dtype: bf16, head_dim: 8, sink: {name} as f32 }}"));
        assert!(message.contains(&format!("`{name}` cannot be used in a sink")), "{name}: {message}");
    }
    let message = error("S { dtype: bf16, head_dim: 8, tensor t: f32[KV_LEN], sink: t[k] }");
    assert!(message.contains("`k` cannot be used in a sink"), "{message}");
    assert_eq!(error("S { dtype: bf16, head_dim: 8, sink: h }"), "the sink must be f32, found i32");
    assert_eq!(error("S { dtype: bf16, head_dim: 8, sink: h > 0 }"), "the sink must be f32, found bool");
    assert!(parse("S { dtype: bf16, head_dim: 8, sink: 1 }").sink.is_some(), "an integer literal reads as f32");
    assert_eq!(error("S { dtype: bf16, head_dim: 8, sink: 0.0, sink: 1.0 }"), "`sink` is given twice");
    assert!(error("S { dtype: bf16, head_dim: 8, param sink: f32 }").contains("built-in name"));
}

#[test]
fn tensors_the_sink_reads_once_are_trainable() {
    let spec = parse(
        "S { dtype: bf16, head_dim: 8, tensor a: f32[H], tensor b2: f32[H], tensor c: f32[H], tensor d: i32[H], \
         score: score + a[h], sink: a[0] + b2[h] + c[h] * c[0] + d[h] as f32 }",
    );
    assert_eq!((0..4).map(|i| trainable(&spec, i)).collect::<Vec<_>>(), [true, true, false, false]);
}

fn problem(spec: &Spec, shape: Shape, sinks: Vec<f64>) -> Problem {
    let mut rng = Rng(17);
    let (dk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let mut fill = |n: usize| -> Vec<f64> { (0..n).map(|_| rng.normal()).collect() };
    let q = fill(shape.batch * shape.q_len * shape.heads * dk);
    let k = fill(shape.batch * shape.kv_len * shape.heads_kv * dk);
    let v = fill(shape.batch * shape.kv_len * shape.heads_kv * dv);
    let tensors = vec![TensorData::Float(sinks)];
    Problem { shape, q, k, v, scale: 0.5, params: Vec::<ParamValue>::new(), tensors }
}

const SHAPE: Shape = Shape { batch: 2, heads: 2, heads_kv: 1, q_len: 5, kv_len: 4 };

fn run(spec: &Spec, p: &Problem) -> Output {
    forward(spec, p, Precision::F64).expect("a valid problem")
}

#[test]
fn a_sink_of_negative_infinity_is_no_sink() {
    let with = parse(SINKS);
    let without = Spec { sink: None, ..with.clone() };
    let p = problem(&with, SHAPE, vec![f64::NEG_INFINITY; 2]);
    assert_eq!(run(&with, &p), run(&without, &p));
}

/// With the sink, each row's LSE is logaddexp(LSE without it, sink) and its
/// O shrinks by the weight its keys keep, exp(LSE without − LSE with).
#[test]
fn the_sink_joins_the_denominator_with_no_value() {
    let with = parse(SINKS);
    let without = Spec { sink: None, ..with.clone() };
    let sinks = vec![0.7, -1.3];
    let p = problem(&with, SHAPE, sinks.clone());
    let (a, b) = (run(&with, &p), run(&without, &p));
    let Shape { batch, heads, q_len, .. } = SHAPE;
    let dv = with.head_dims.v as usize;
    for bi in 0..batch {
        for (h, &sink) in sinks.iter().enumerate().take(heads) {
            for i in 0..q_len {
                let row = (bi * heads + h) * q_len + i;
                let (lse, plain) = (a.lse[row], b.lse[row]);
                let top = plain.max(sink);
                let expected = top + ((plain - top).exp() + (sink - top).exp()).ln();
                assert!((lse - expected).abs() < 1e-12, "row {row}: {lse} vs {expected}");
                let shrink = (plain - lse).exp();
                let o = ((bi * q_len + i) * heads + h) * dv;
                for d in 0..dv {
                    assert!((a.o[o + d] - b.o[o + d] * shrink).abs() < 1e-12, "row {row} col {d}");
                }
            }
        }
    }
}

#[test]
fn a_row_with_no_kept_key_gives_zero_and_the_sink() {
    // Five queries, four keys, `k < q - 1` keeps nothing for queries 0 and 1.
    let spec = parse("S { dtype: bf16, head_dim: 8, tensor sinks: f32[H], mask: k < q - 1, sink: sinks[h] * 2.0 }");
    let p = problem(&spec, SHAPE, vec![0.25, -3.0]);
    let out = run(&spec, &p);
    let Shape { batch, heads, q_len, .. } = SHAPE;
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..2 {
                assert_eq!(out.lse[(b * heads + h) * q_len + i], [0.5, -6.0][h]);
                let o = ((b * q_len + i) * heads + h) * 8;
                assert!(out.o[o..o + 8].iter().all(|&x| x == 0.0));
            }
            assert!(out.lse[(b * heads + h) * q_len + 2].is_finite());
        }
    }
    let same = forward(&spec, &p, Precision::SameDtype(spec.dtype)).unwrap();
    assert_eq!(same.lse[0], 0.5, "the same-dtype emulation too");
}
