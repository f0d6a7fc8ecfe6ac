//! The front end: every example spec parses, canonical printing round-trips,
//! and errors carry their exact message and position.

use flashgen_codegen::{
    parse_one, parse_str, to_source, BinOp, Builtin, Dim, Dtype, ElemTy, Expr, ExprKind, HeadDims, Spec, Ty,
};
use std::path::PathBuf;

fn example_specs() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../specs");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "attn"))
        .map(|path| (path.display().to_string(), std::fs::read_to_string(&path).unwrap()))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no specs in {}", dir.display());
    files
}

/// `spec` prints to source that parses back to itself, and printing is
/// stable.
fn assert_round_trip(spec: &Spec) {
    let printed = to_source(spec);
    let back = parse_one(&printed).unwrap_or_else(|e| panic!("{}\n{printed}", e.render("printed", &printed)));
    assert_eq!(&back, spec, "round trip of\n{printed}");
    assert_eq!(to_source(&back), printed);
}

fn parse(source: &str) -> Spec {
    parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("test", source)))
}

#[test]
fn every_example_parses_and_round_trips() {
    for (path, source) in example_specs() {
        let specs = parse_str(&source).unwrap_or_else(|e| panic!("{}", e.render(&path, &source)));
        assert_eq!(specs.len(), 1, "{path}");
        assert!(!specs[0].doc.is_empty(), "{path}: examples are documented");
        assert_round_trip(&specs[0]);
    }
}

fn example(name: &str) -> Spec {
    let (path, source) = example_specs().into_iter().find(|(p, _)| p.ends_with(&format!("/{name}.attn"))).unwrap();
    parse_str(&source).unwrap_or_else(|e| panic!("{}", e.render(&path, &source))).remove(0)
}

fn builtin(b: Builtin) -> Expr {
    Expr { ty: b.ty(), kind: ExprKind::Builtin(b) }
}

fn binary(op: BinOp, ty: Ty, a: Expr, b: Expr) -> Expr {
    Expr { ty, kind: ExprKind::Binary(op, Box::new(a), Box::new(b)) }
}

#[test]
fn examples_lower_to_the_expected_ir() {
    let causal = example("causal");
    assert_eq!((causal.name.as_str(), causal.dtype, causal.public), ("Causal", Dtype::Bf16, false));
    assert_eq!(causal.head_dims, HeadDims { qk: 128, v: 128 });
    assert_eq!(causal.mask, Some(binary(BinOp::Ge, Ty::Bool, builtin(Builtin::Q), builtin(Builtin::K))));
    assert_eq!(causal.score, None);
    assert_eq!(causal.doc, ["Causal (top-left aligned): query i sees keys 0..=i."]);

    assert_eq!(example("gqa").head_dims, HeadDims { qk: 192, v: 128 });
    assert_eq!(example("full").mask, None);

    let rel = example("relative_bias");
    assert_eq!(rel.dtype, Dtype::F16);
    assert_eq!(rel.tensors[0].elem, ElemTy::F32);
    assert_eq!(rel.tensors[0].dims, [Dim::Heads, Dim::Const(257)]);

    let doc = example("document");
    assert_eq!((doc.tensors[0].elem, &doc.tensors[0].dims[..]), (ElemTy::I32, &[Dim::Batch, Dim::KvLen][..]));

    let softcap = example("softcap");
    assert_eq!((softcap.params[0].name.as_str(), softcap.params[0].ty), ("cap", Ty::F32));
    assert!(softcap.score.as_ref().unwrap().uses(Builtin::Score));
}

#[test]
fn tricky_expressions_round_trip() {
    let bodies = [
        // Casts inside comparisons must be parenthesized (`q as f32 < x`
        // reads as a generic type).
        "mask: (q as f32) < (k as f32) * 2.0",
        "mask: score_bias[h] > (q as f32)",
        "score: ((q > k) as i32) as f32 * score",
        "score: -(q as f32) + (-3 as f32)",
        // Nested if/else, as an operand, as a condition.
        "score: if q > k { if q - k > 4 { score - 1.0 } else { score } } else { -score }",
        "score: score + if q > k { 1.0 } else { 0.0 }",
        "score: if if q > k { true } else { false } { score } else { 0.0 }",
        // Negative literals.
        "score: score * -2.5 - -1.0",
        "mask: q - -1 > k && k > -7",
        "score: rel[h][clamp(k - q, -128, 128) + 128]",
        // Precedence and associativity.
        "mask: q - k - 1 > 0 && q - (k - 1) > 0",
        "mask: (q - k) * 2 < k - (q - 1) && !(q == k) || k == 0",
        "mask: (k < w || q >= k) && (q > k) == (k < q)",
        "mask: q / 2 * 2 == q % 3 + 1 - q / (2 * 2)",
        "score: --score / (score * score) + exp2(-score) * sigmoid(score % 2.0)",
        // Literal coercion, blocks, bool literals.
        "score: score / 30 + { score }",
        "mask: true",
        "score: 1e-7 * score + 3.4028235e38 + 0.1",
    ];
    for body in bodies {
        let source = format!(
            "/// Doc.\npub T {{ dtype: f16, head_dim: 96, v_head_dim: 64, param w: i32, tensor score_bias: bf16[H], tensor rel: f32[H, 257], {body} }}"
        );
        assert_round_trip(&parse(&source));
    }
}

#[test]
fn printing_is_canonical() {
    let spec = parse("pub T{head_dim:64,dtype:bf16,mask:((q>=k)),param w:i32}");
    assert_eq!(
        to_source(&spec),
        "pub T {\n    dtype: bf16,\n    head_dim: 64,\n    param w: i32,\n    mask: q >= k,\n}\n"
    );
}

#[test]
fn literals_take_the_type_of_their_f32_neighbour() {
    let spec = parse("T { dtype: bf16, head_dim: 64, score: score / 30 }");
    let ExprKind::Binary(BinOp::Div, _, rhs) = &spec.score.unwrap().kind else { panic!() };
    assert_eq!(**rhs, Expr { ty: Ty::F32, kind: ExprKind::Float(30.0) });
    // `-literal` folds, so `-1` stays a flexible literal.
    let spec = parse("T { dtype: bf16, head_dim: 64, score: score * -1 }");
    let ExprKind::Binary(BinOp::Mul, _, rhs) = &spec.score.unwrap().kind else { panic!() };
    assert_eq!(rhs.kind, ExprKind::Float(-1.0));
}

#[test]
fn files_hold_several_specs() {
    let specs = parse_str("A { dtype: bf16, head_dim: 64 }\n/// B.\npub B { dtype: f16, head_dim: 32 }").unwrap();
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["A", "B"]);
    assert!(specs[1].public);
}

/// Parses `source` expecting an error: returns `(line, column, message)`.
fn error(source: &str) -> (usize, usize, String) {
    let e = parse_str(source).map(|_| ()).expect_err(source);
    let (line, col) = e.line_col();
    (line, col, e.message)
}

/// A three-line spec whose third line is `line3` (after four spaces).
fn with_line3(decls: &str, line3: &str) -> String {
    format!("T {{\n    dtype: bf16, head_dim: 64, {decls}\n    {line3},\n}}")
}

fn assert_error(source: &str, line: usize, col: usize, message: &str) {
    assert_eq!(error(source), (line, col, message.to_string()), "source:\n{source}");
}

#[test]
fn name_errors() {
    assert_error(
        &with_line3("", "mask: q >= kk"),
        3,
        16,
        "unknown name `kk`: expected b, h, q, k, q_len, kv_len, score, or a declared param or tensor",
    );
    assert_error(
        &with_line3("", "mask: score > 0.0"),
        3,
        11,
        "`score` cannot be used in a mask: a mask depends only on positions, params and tensors",
    );
    assert_error(
        &with_line3("tensor t: f32[H],", "score: score + t"),
        3,
        20,
        "tensor `t` must be indexed, e.g. `t[h]`",
    );
    assert_error(
        &with_line3("param w: i32,", "score: score + w[h] as f32"),
        3,
        20,
        "only declared tensors can be indexed",
    );
    assert_error(
        &with_line3("", "score: foo(score)"),
        3,
        12,
        "unknown function: expected one of min, max, abs, clamp, exp, exp2, log, log2, tanh, sigmoid, sqrt, floor, \
         rem_euclid, div_euclid",
    );
    assert_error(&with_line3("", "param q: i32"), 3, 11, "`q` is a built-in name and cannot be redeclared");
    assert_error(&with_line3("", "param exp: f32"), 3, 11, "`exp` is a built-in name and cannot be redeclared");
}

#[test]
fn type_errors() {
    assert_error(&with_line3("", "mask: q - k"), 3, 11, "the mask must be bool, found i32");
    assert_error(&with_line3("", "score: q"), 3, 12, "the score must be f32, found i32");
    assert_error(&with_line3("", "score: q + score"), 3, 12, "mismatched types: i32 + f32; convert one side with `as`");
    assert_error(
        &with_line3("tensor t: f32[H, KV_LEN],", "score: score + t[h]"),
        3,
        20,
        "tensor `t` has 2 dimension(s) but is indexed with 1",
    );
    assert_error(
        &with_line3("tensor t: f32[H],", "score: score + t[h][k]"),
        3,
        20,
        "tensor `t` has 1 dimension(s) but is indexed with 2",
    );
    assert_error(&with_line3("tensor t: f32[H],", "score: score + t[score]"), 3, 22, "an index must be i32, found f32");
    assert_error(&with_line3("", "score: tanh(score, 2.0)"), 3, 12, "`tanh` takes 1 argument(s), found 2");
    assert_error(&with_line3("", "score: clamp(score, 1.0)"), 3, 12, "`clamp` takes 3 argument(s), found 2");
    assert_error(&with_line3("", "score: min(score, q)"), 3, 23, "`min` expects f32 here, found i32");
    assert_error(&with_line3("", "score: exp(q)"), 3, 16, "`exp` expects f32 here, found i32");
    assert_error(
        &with_line3("", "score: if q > k { score }"),
        3,
        12,
        "an `if` needs an `else` branch: every expression must have a value",
    );
    assert_error(
        &with_line3("", "score: if q { score } else { 0.0 }"),
        3,
        15,
        "an `if` condition must be bool, found i32",
    );
    assert_error(
        &with_line3("", "score: if q > k { score } else { q }"),
        3,
        12,
        "`if` branches have different types: f32 and i32",
    );
    assert_error(&with_line3("", "mask: q > k && k"), 3, 20, "`&&` needs bool operands, found i32");
    assert_error(
        &with_line3("", "score: !score"),
        3,
        12,
        "cannot apply `!` to f32: it is logical not on bool, bitwise not on i32",
    );
    assert_error(&with_line3("", "mask: (q > k) < (k > q)"), 3, 11, "cannot apply `<` to bool");
    assert_error(
        &with_line3("", "score: (q > k) as f32"),
        3,
        12,
        "cannot cast bool to f32; cast to i32 first, or use `if`",
    );
    assert_error(&with_line3("", "score: score as u8"), 3, 21, "can only cast to `i32` or `f32`");
    assert_error(&with_line3("", "mask: q > 2147483648"), 3, 15, "integer literal out of range for i32");
    assert_error(
        &with_line3("", "score: score.abs()"),
        3,
        12,
        "unsupported expression: expected arithmetic, bitwise operators, comparisons, `&&`/`||`/`!`, `if`/`else`, \
         casts, calls or tensor indexing",
    );
}

#[test]
fn declaration_errors() {
    assert_error("T { head_dim: 64 }", 1, 3, "missing `dtype: f16` or `dtype: bf16`");
    assert_error("T {\n    dtype: bf16,\n}", 1, 3, "missing `head_dim: <1..=576>`");
    assert_error("T { dtype: f32, head_dim: 64 }", 1, 12, "unknown dtype: expected `f16` or `bf16`");
    assert_error("T { dtype: bf16, head_dim: 0 }", 1, 28, "unsupported head dimension 0: expected 1 to 576");
    assert_error("T { dtype: bf16, head_dim: 600 }", 1, 28, "unsupported head dimension 600: expected 1 to 576");
    assert_error(
        "T { dtype: bf16, head_dim: 64, v_head_dim: 577 }",
        1,
        44,
        "unsupported head dimension 577: expected 1 to 576",
    );
    assert_error("T { dtype: bf16, head_dim: w }", 1, 28, "a head dimension must be an integer literal from 1 to 576");
    assert_error("T { dtype: bf16, head_dim: -4 }", 1, 28, "unsupported head dimension -4: expected 1 to 576");
    assert_error(&with_line3("", "dtype: f16"), 3, 5, "`dtype` is given twice");
    assert_error(&with_line3("param w: i32,", "tensor w: f32[H]"), 3, 12, "`w` is given twice");
    assert_error(
        &with_line3("", "tensor t: f32[N]"),
        3,
        19,
        "unknown dimension `N`: expected `B`, `H`, `H_KV`, `Q_LEN`, `KV_LEN`, a positive integer, or `+ - *` of them \
         and `/` by a positive integer (e.g. `2 * KV_LEN - 1`)",
    );
    assert_error(&with_line3("", "tensor t: f32[0]"), 3, 19, "a constant dimension must be a positive integer");
    assert_error(
        &with_line3("", "tensor t: f32[B, H, Q_LEN, KV_LEN]"),
        3,
        12,
        "tensor `t` has 4 dimensions: expected 1 to 3",
    );
    assert_error(
        &with_line3("", "tensor t: f64[H]"),
        3,
        15,
        "unknown tensor element type `f64`: expected `i32`, `f32`, `f16` or `bf16`",
    );
    assert_error(&with_line3("", "param w: bool"), 3, 14, "unknown param type `bool`: expected `i32` or `f32`");
    assert_error(
        &with_line3("", "window: 4"),
        3,
        5,
        "unknown field `window`: expected one of `dtype`, `head_dim`, `v_head_dim`, `mask`, `score`, `sink`, `param NAME: TYPE`, `tensor NAME: TYPE[DIMS]`",
    );
}

#[test]
fn file_errors() {
    assert_error("", 1, 1, "expected at least one spec: `Name { dtype: bf16, head_dim: 128, ... }`");
    assert_error("A { dtype: bf16, head_dim: 64 }\nA { dtype: f16, head_dim: 64 }", 2, 1, "spec `A` is defined twice");
    assert_error("#[inline] A { dtype: bf16, head_dim: 64 }", 1, 1, "only `///` doc comments may precede a spec");
    let two = parse_one("A { dtype: bf16, head_dim: 64 } B { dtype: bf16, head_dim: 64 }").unwrap_err();
    assert_eq!(two.message, "expected one spec, found 2");
    let (line, col, message) = error("A { dtype: bf16, head_dim: 64, mask: q >= k ` }");
    assert_eq!((line, col), (1, 45));
    assert!(message.starts_with("invalid token"), "{message}");
}

#[test]
fn unbalanced_delimiters_name_where_they_opened() {
    let unclosed = "/// Doc with a stray ( in it.\nA {\n    dtype: bf16, head_dim: 64,\n    mask: (q >= k,\n";
    assert_error(unclosed, 4, 11, "unclosed `(` opened at 4:11: no `)` before the end");
    let brace = "A {\n    dtype: bf16, head_dim: 64, // a comment with }\n";
    assert_error(brace, 1, 3, "unclosed `{` opened at 1:3: no `}` before the end");
    let crossed = "A {\n    dtype: bf16, head_dim: 64,\n    mask: (q >= k },\n";
    assert_error(crossed, 3, 19, "`}` does not close `(` opened at 3:11 (expected `)`)");
    assert_error("A { dtype: bf16, head_dim: 64 } )", 1, 33, "unexpected `)`: nothing is open here");
    let rendered = parse_str(brace).unwrap_err().render("b.attn", brace);
    assert!(rendered.starts_with("b.attn:1:3: error: unclosed `{`") && rendered.contains("\n     |   ^"), "{rendered}");
}

#[test]
fn errors_render_with_a_caret() {
    let source = with_line3("", "mask: q >= x");
    let e = parse_str(&source).unwrap_err();
    assert_eq!(e.to_string(), format!("3:16: {}", e.message));
    let caret = format!("     | {}^", " ".repeat(15)); // Under `x`, column 16.
    assert_eq!(
        e.render("x.attn", &source),
        format!("x.attn:3:16: error: {}\n   3 |     mask: q >= x,\n{caret}", e.message)
    );
}

// ---- Known front-end bugs, reported to the owners of `error.rs` and
// `syntax/`; each test states the intended behaviour. ----

#[test]
fn multi_character_carets_start_at_the_error_column() {
    let source = with_line3("", "mask: q >= kk");
    let rendered = parse_str(&source).unwrap_err().render("x.attn", &source);
    assert!(rendered.ends_with(&format!("\n     | {}^^", " ".repeat(15))), "{rendered}");
}

#[test]
fn a_cast_literal_is_no_longer_flexible() {
    assert_error(
        &with_line3("", "score: score + 1 as i32"),
        3,
        12,
        "mismatched types: f32 + i32; convert one side with `as`",
    );
}

#[test]
fn i32_min_is_a_valid_literal() {
    let spec = parse("T { dtype: bf16, head_dim: 64, mask: q > -2147483648 }");
    assert_round_trip(&spec);
}

#[test]
fn multi_line_doc_attributes_round_trip() {
    assert_round_trip(&parse("#[doc = \"a\\nb\"] T { dtype: bf16, head_dim: 64 }"));
}

#[test]
fn names_must_be_plain_ascii() {
    let cases = [
        ("r#S { dtype: bf16, head_dim: 64 }", 1),
        ("S { dtype: bf16, head_dim: 64, param r#type: i32 }", 38),
        ("Caf\u{e9} { dtype: bf16, head_dim: 64 }", 1),
    ];
    for (source, col) in cases {
        let e = flashgen_codegen::parse_str(source).unwrap_err();
        assert!(e.message.contains("plain ASCII identifiers"), "{source}: {}", e.message);
        assert_eq!(e.line_col().1, col, "{source}");
    }
}
