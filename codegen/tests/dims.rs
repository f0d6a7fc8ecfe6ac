//! Tensor dimensions as expressions of launch sizes and constants: parsing,
//! folding, canonical printing, errors, values at a launch shape, and the
//! checks the reference (like the runtime) makes before reading a tensor.

use flashgen_codegen::reference::{Arith, Env, ParamValue, ReferenceError, TensorData};
use flashgen_codegen::{parse_one, parse_str, to_source, Dim, DimError, DimOp, Shape, Spec};

fn tensor_spec(dims: &str) -> Spec {
    let source = format!("T {{ dtype: bf16, head_dim: 64, param m: i32, tensor t: f32[{dims}] }}");
    parse_one(&source).unwrap_or_else(|e| panic!("{}", e.render("test", &source)))
}

fn dims(text: &str) -> Vec<Dim> {
    tensor_spec(text).tensors.remove(0).dims
}

fn op(op: DimOp, a: Dim, b: Dim) -> Dim {
    Dim::Op(op, Box::new(a), Box::new(b))
}

#[test]
fn expressions_parse_with_arithmetic_precedence() {
    assert_eq!(
        dims("H, 2 * KV_LEN - 1"),
        [Dim::Heads, op(DimOp::Sub, op(DimOp::Mul, Dim::Const(2), Dim::KvLen), Dim::Const(1))]
    );
    assert_eq!(dims("(Q_LEN + 63) / 64"), [op(DimOp::Div, op(DimOp::Add, Dim::QLen, Dim::Const(63)), Dim::Const(64))]);
    assert_eq!(dims("B * H_KV"), [op(DimOp::Mul, Dim::Batch, Dim::HeadsKv)]);
}

#[test]
fn constant_parts_fold() {
    assert_eq!(dims("2 * 8, 16"), [Dim::Const(16), Dim::Const(16)]);
    assert_eq!(dims("H * (3 - 1)"), [op(DimOp::Mul, Dim::Heads, Dim::Const(2))]);
    assert_eq!(tensor_spec("2 * 8"), tensor_spec("16"), "one spec, one cache key");
    // A lone constant may use all of u32, as before.
    assert_eq!(dims("4000000000"), [Dim::Const(4_000_000_000)]);
}

#[test]
fn printing_round_trips_with_minimal_parentheses() {
    for (written, printed) in [
        ("2 * KV_LEN - 1", "2 * KV_LEN - 1"),
        ("(Q_LEN + 63) / 64", "(Q_LEN + 63) / 64"),
        ("Q_LEN + (KV_LEN - 1)", "Q_LEN + (KV_LEN - 1)"),
        ("(Q_LEN + KV_LEN) - 1", "Q_LEN + KV_LEN - 1"),
        ("H * (B * 2)", "H * (B * 2)"),
        ("((H))", "H"),
    ] {
        let spec = tensor_spec(written);
        let text = to_source(&spec);
        assert!(text.contains(&format!("tensor t: f32[{printed}],")), "{written}: {text}");
        assert_eq!(parse_one(&text).unwrap(), spec, "{written}");
    }
}

fn error(dims: &str) -> (usize, usize, String) {
    let source = format!("T {{\n    dtype: bf16, head_dim: 64, param m: i32,\n    tensor t: f32[{dims}],\n}}");
    let e = parse_str(&source).map(|_| ()).expect_err(dims);
    let (line, col) = e.line_col();
    (line, col, e.message)
}

#[test]
fn errors_say_what_a_dimension_may_be() {
    let allowed = "`B`, `H`, `H_KV`, `Q_LEN`, `KV_LEN`, a positive integer, or `+ - *` of them and `/` by a \
                   positive integer (e.g. `2 * KV_LEN - 1`)";
    let cases: Vec<(&str, usize, String)> = vec![
        (
            "H, 2 * m + 1",
            26,
            format!("param `m` cannot size a tensor: dimensions use only the launch sizes and constants, {allowed}"),
        ),
        ("kv_len", 19, "unknown dimension `kv_len`: the launch sizes are upper-case here, e.g. `KV_LEN`".into()),
        ("N", 19, format!("unknown dimension `N`: expected {allowed}")),
        ("KV_LEN % 2", 26, format!("unsupported operator in a dimension: expected {allowed}")),
        ("-KV_LEN", 19, format!("unsupported tensor dimension: expected {allowed}")),
        ("max(H, 2)", 19, format!("unsupported tensor dimension: expected {allowed}")),
        ("KV_LEN / H", 28, "a dimension may divide only by a positive integer constant".into()),
        ("KV_LEN / (1 - 1)", 28, "a dimension may divide only by a positive integer constant".into()),
        ("3 - 3", 19, "this dimension is 0: a dimension must be at least 1".into()),
        ("H + (1 - 2)", 24, "this part of the dimension is -1: constants must be from 0 to 2147483647".into()),
        (
            "H + 65536 * 65536",
            23,
            "this part of the dimension is 4294967296: constants must be from 0 to 2147483647".into(),
        ),
        ("H + 3000000000", 23, "a constant in a dimension expression must be an integer from 0 to 2147483647".into()),
        ("0", 19, "a constant dimension must be a positive integer".into()),
        ("1.5", 19, "a constant dimension must be a positive integer".into()),
    ];
    for (dims, col, message) in cases {
        assert_eq!(error(dims), (3, col, message), "{dims}");
    }
}

const SHAPE: Shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 100, kv_len: 300 };

#[test]
fn values_at_a_launch_shape() {
    let value = |text: &str| dims(text)[0].value(&SHAPE);
    assert_eq!(value("2 * KV_LEN - 1"), Some(599));
    assert_eq!(value("(Q_LEN + 63) / 64"), Some(2));
    assert_eq!(value("Q_LEN - KV_LEN"), Some(-200));
    // Every value along the way must fit i32, as the kernels compute it.
    let long = Shape { kv_len: 1 << 30, ..SHAPE };
    assert_eq!(dims("4 * KV_LEN / 4")[0].value(&long), None);
    assert_eq!(dims("KV_LEN + KV_LEN - KV_LEN")[0].value(&long), None, "2^31 on the way");
    assert_eq!(dims("KV_LEN - 1 + 1")[0].value(&long), Some(1 << 30));
    let tensor = tensor_spec("Q_LEN - KV_LEN").tensors.remove(0);
    assert_eq!(tensor.dims[0].resolve(&SHAPE), 0, "a negative value resolves to no elements");
    assert_eq!(
        tensor.check_dims(&SHAPE),
        Err(DimError { tensor: "t".into(), dim: "Q_LEN - KV_LEN".into(), value: Some(-200) })
    );
    assert_eq!(
        tensor.check_dims(&SHAPE).unwrap_err().to_string(),
        "tensor `t`: dimension `Q_LEN - KV_LEN` is -200 for this launch; it must be at least 1"
    );
    let wide = tensor_spec("4 * KV_LEN").tensors.remove(0);
    assert_eq!(
        wide.check_dims(&long).unwrap_err().to_string(),
        "tensor `t`: dimension `4 * KV_LEN` leaves the i32 range for this launch"
    );
    assert_eq!(wide.len(&SHAPE), 1200);
}

#[test]
fn the_reference_checks_dimensions_before_lengths() {
    let spec = tensor_spec("Q_LEN - KV_LEN");
    let data = [TensorData::Float(vec![])];
    let err = Env::new(&spec, &SHAPE, &[ParamValue::I32(0)], &data, Arith::F64).unwrap_err();
    assert!(matches!(&err, ReferenceError::Shape(m) if m.contains("is -200 for this launch")), "{err}");
    let spec = tensor_spec("2 * KV_LEN - 1");
    let data = [TensorData::Float(vec![0.0; 599])];
    Env::new(&spec, &SHAPE, &[ParamValue::I32(0)], &data, Arith::F64).unwrap();
}

/// A dimension expression drawn by the proptest below, printed fully
/// parenthesized and evaluated independently of the crate.
#[derive(Clone, Debug)]
enum Drawn {
    Symbol(&'static str),
    Const(i64),
    Op(char, Box<Drawn>, Box<Drawn>),
}

impl Drawn {
    fn text(&self) -> String {
        match self {
            Drawn::Symbol(s) => s.to_string(),
            Drawn::Const(c) => c.to_string(),
            Drawn::Op(op, a, b) => format!("({} {op} {})", a.text(), b.text()),
        }
    }

    /// The value at `shape` in i128, each step checked against i32 as the
    /// kernels need (constants only: folded, any size until the end).
    fn value(&self, shape: &Shape) -> Option<i128> {
        let v = match self {
            Drawn::Symbol(s) => {
                let d = Dim::SYMBOLS.iter().find(|(n, _)| n == s).unwrap().1.clone();
                i128::from(d.value(shape)?)
            }
            Drawn::Const(c) => i128::from(*c),
            Drawn::Op(op, a, b) => {
                let (a, b) = (a.value(shape)?, b.value(shape)?);
                match op {
                    '+' => a + b,
                    '-' => a - b,
                    '*' => a * b,
                    _ => a / b,
                }
            }
        };
        i32::try_from(v).is_ok().then_some(v)
    }
}

fn drawn() -> impl proptest::strategy::Strategy<Value = Drawn> {
    use proptest::prelude::*;
    let leaf = prop_oneof![
        prop::sample::select(vec!["B", "H", "H_KV", "Q_LEN", "KV_LEN"]).prop_map(Drawn::Symbol),
        (0i64..100).prop_map(Drawn::Const),
    ];
    leaf.prop_recursive(4, 16, 2, |inner| {
        prop_oneof![
            (prop::sample::select(vec!['+', '-', '*']), inner.clone(), inner.clone()).prop_map(|(op, a, b)| Drawn::Op(
                op,
                Box::new(a),
                Box::new(b)
            )),
            (inner, 1i64..9).prop_map(|(a, c)| Drawn::Op('/', Box::new(a), Box::new(Drawn::Const(c)))),
        ]
    })
}

proptest::proptest! {
    /// Any expression parses or fails with an error (never a panic); one
    /// that parses prints back to itself and has the drawn value where
    /// every step fits i32.
    #[test]
    fn drawn_dimensions_round_trip_and_evaluate(d in drawn()) {
        let source = format!("T {{ dtype: bf16, head_dim: 64, tensor t: f32[{}] }}", d.text());
        let Ok(spec) = parse_one(&source) else { return Ok(()) };
        let back = parse_one(&to_source(&spec)).unwrap();
        proptest::prop_assert_eq!(&back, &spec);
        for shape in [SHAPE, Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 1, kv_len: 70_000 }] {
            let got = spec.tensors[0].dims[0].value(&shape);
            if let Some(want) = d.value(&shape) {
                proptest::prop_assert_eq!(got.map(i128::from), Some(want), "{}", d.text());
            }
        }
    }
}
