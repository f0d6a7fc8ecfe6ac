//! The i32 bit operators (`& | ^ << >>`, `!` on i32) and the Euclidean
//! builtins (`rem_euclid`, `div_euclid`): parsing with Rust's precedence,
//! canonical printing, type errors with their positions, and the reference
//! interpreter's values against Rust's own operators.

use flashgen_codegen::reference::{Arith, Env, ParamValue, Position, Value};
use flashgen_codegen::{
    parse_one, parse_str, syntax::expr_source, to_source, BinOp, Expr, ExprKind, Func, Shape, Spec, Ty, UnOp,
};

fn parse(source: &str) -> Spec {
    parse_one(source).unwrap_or_else(|e| panic!("{}", e.render("test", source)))
}

/// A spec whose mask is `mask`, with i32 params `a` and `n`.
fn mask_spec(mask: &str) -> Spec {
    parse(&format!("T {{ dtype: bf16, head_dim: 64, param a: i32, param n: i32, mask: {mask} }}"))
}

fn assert_round_trip(spec: &Spec) {
    let printed = to_source(spec);
    let back = parse_one(&printed).unwrap_or_else(|e| panic!("{}\n{printed}", e.render("printed", &printed)));
    assert_eq!(&back, spec, "round trip of\n{printed}");
    assert_eq!(to_source(&back), printed);
}

/// The operator at the root of a binary tree and its operands' printed form.
fn root(spec: &Spec, e: &Expr) -> (BinOp, String, String) {
    match &e.kind {
        ExprKind::Binary(op, a, b) => (*op, expr_source(spec, a), expr_source(spec, b)),
        other => panic!("not a binary node: {other:?}"),
    }
}

#[test]
fn precedence_is_rusts() {
    // Tightest first: * / %, + -, << >>, &, ^, |, comparisons, &&, ||.
    let cases = [
        ("q + k << 2 == a", BinOp::Eq, "q + k << 2", "a"),
        ("q << 2 & a == n", BinOp::Eq, "q << 2 & a", "n"),
        ("q & k ^ a | n == 0", BinOp::Eq, "q & k ^ a | n", "0"),
        ("q | k ^ a & n > 0", BinOp::Gt, "q | k ^ a & n", "0"),
        ("q >> 1 < k && a | n != 0", BinOp::And, "q >> 1 < k", "a | n != 0"),
    ];
    for (mask, op, left, right) in cases {
        let spec = mask_spec(mask);
        assert_eq!(root(&spec, spec.mask.as_ref().unwrap()), (op, left.into(), right.into()), "{mask}");
    }
    // Below the comparison: `q | k ^ a & n` is `q | (k ^ (a & n))`.
    let spec = mask_spec("q | k ^ a & n > 0");
    let ExprKind::Binary(_, or, _) = &spec.mask.as_ref().unwrap().kind else { panic!() };
    assert_eq!(root(&spec, or), (BinOp::BitOr, "q".into(), "k ^ a & n".into()));
    let ExprKind::Binary(_, _, xor) = &or.kind else { panic!() };
    assert_eq!(root(&spec, xor), (BinOp::BitXor, "k".into(), "a & n".into()));
    // Shifts are left-associative, and `-`/`!` bind tighter than any of them.
    let spec = mask_spec("q >> 1 >> a == !k << -n");
    let ExprKind::Binary(_, shifts, rhs) = &spec.mask.as_ref().unwrap().kind else { panic!() };
    assert_eq!(root(&spec, shifts), (BinOp::Shr, "q >> 1".into(), "a".into()));
    let ExprKind::Binary(BinOp::Shl, not, _) = &rhs.kind else { panic!() };
    assert!(matches!(not.kind, ExprKind::Unary(UnOp::BitNot, _)) && not.ty == Ty::I32);
}

#[test]
fn printing_keeps_the_parentheses_that_matter() {
    let cases = [
        ("(q & k) == 0", "q & k == 0"),
        ("q & (k == k) as i32 > 0", "q & ((k == k) as i32) > 0"),
        ("(q | k) & a == 0", "(q | k) & a == 0"),
        ("q - (k << 1) > (q - k) << 1", "q - (k << 1) > q - k << 1"),
        ("(q ^ k) ^ (a ^ n) == 0", "q ^ k ^ (a ^ n) == 0"),
        ("!(q & k) == !q | !k", "!(q & k) == !q | !k"),
        ("!!q == q", "!!q == q"),
        ("rem_euclid(q - k, 4) + div_euclid(-q, a) == 0", "rem_euclid(q - k, 4) + div_euclid(-q, a) == 0"),
    ];
    for (mask, printed) in cases {
        let spec = mask_spec(mask);
        assert_eq!(expr_source(&spec, spec.mask.as_ref().unwrap()), printed, "{mask}");
        assert_round_trip(&spec);
    }
}

#[test]
fn new_operators_round_trip_in_every_position() {
    let bodies = [
        "mask: (packed[h][q >> 5] >> (k & 31)) & 1 == 1 && rem_euclid(k - q, 4) != 3",
        "score: score + (div_euclid(k - q, 16) ^ !q | q << 2) as f32",
        "score: if q & 1 == 0 { score } else { -score }",
        "score: score * (q >> a) as f32 + packed[h][rem_euclid(k, 64)] as f32",
        "mask: clamp(q ^ k, 0, a) < min(q | k, n << 3) && !(q >> 1 == k >> 1)",
    ];
    for body in bodies {
        let spec = parse(&format!(
            "T {{ dtype: bf16, head_dim: 64, param a: i32, param n: i32, tensor packed: i32[H, 64], {body} }}"
        ));
        assert_round_trip(&spec);
    }
}

#[test]
fn euclid_builtins_are_i32_calls() {
    let spec = mask_spec("rem_euclid(q, a) == div_euclid(k, 2)");
    let ExprKind::Binary(_, l, r) = &spec.mask.as_ref().unwrap().kind else { panic!() };
    assert!(matches!(&l.kind, ExprKind::Call(Func::RemEuclid, args) if args.len() == 2) && l.ty == Ty::I32);
    assert!(matches!(&r.kind, ExprKind::Call(Func::DivEuclid, args) if args.len() == 2) && r.ty == Ty::I32);
}

/// Parses `source` expecting an error: `(line, column, message)`.
fn error(source: &str) -> (usize, usize, String) {
    let e = parse_str(source).map(|_| ()).expect_err(source);
    let (line, col) = e.line_col();
    (line, col, e.message)
}

/// The error of a spec whose third line is `line3`, with params `a: i32`
/// and `s: f32`.
fn line3_error(line3: &str) -> (usize, usize, String) {
    error(&format!("T {{\n    dtype: bf16, head_dim: 64, param a: i32, param s: f32,\n    {line3},\n}}"))
}

#[test]
fn type_errors_name_the_operator_and_the_operand() {
    let cases: [(&str, usize, &str); 12] = [
        ("mask: q & s > 0", 15, "`&` needs i32 operands, found f32"),
        ("mask: s | q > 0", 11, "`|` needs i32 operands, found f32"),
        ("mask: (q > k) & (k > q)", 11, "`&` needs i32 operands, found bool; for bools use `&&`"),
        ("mask: (q > k) | (k > q)", 11, "`|` needs i32 operands, found bool; for bools use `||`"),
        ("mask: q ^ (k > q) == 0", 15, "`^` needs i32 operands, found bool"),
        ("score: score << 1", 12, "`<<` needs i32 operands, found f32"),
        ("mask: q >> 1.5 > 0", 16, "`>>` needs i32 operands, found f32"),
        ("score: (q & 1) as f32 * (score ^ s)", 30, "`^` needs i32 operands, found f32"),
        ("score: !score", 12, "cannot apply `!` to f32: it is logical not on bool, bitwise not on i32"),
        ("mask: rem_euclid(q, s) > 0", 25, "`rem_euclid` expects i32 here, found f32"),
        ("mask: div_euclid(2.5, k) > 0", 22, "`div_euclid` expects i32 here, found f32"),
        ("mask: rem_euclid(q) > 0", 11, "`rem_euclid` takes 2 argument(s), found 1"),
    ];
    for (line3, col, message) in cases {
        assert_eq!(line3_error(line3), (3, col, message.to_string()), "{line3}");
    }
    // The mask of a bitwise expression is i32, not bool.
    assert_eq!(line3_error("mask: q & k"), (3, 11, "the mask must be bool, found i32".to_string()));
    // C's `~` is not Rust's.
    assert_eq!(
        line3_error("mask: ~q & 1 == 0"),
        (3, 11, "`~` is not an operator here: bitwise not is `!` on i32, as in Rust".to_string())
    );
    // Compound assignments are not operators of the language.
    assert_eq!(
        line3_error("mask: q <<= k").2,
        "unsupported operator: expected + - * / % & | ^ << >> < <= > >= == != && ||"
    );
}

/// The reference's value of the i32 expression `e` over params `a` and `n`
/// at (q, k) = (0, 0).
fn eval_i32(e: &str, a: i32, n: i32) -> i32 {
    let spec = parse(&format!("T {{ dtype: bf16, head_dim: 64, param a: i32, param n: i32, score: ({e}) as f32 }}"));
    let ExprKind::Cast(inner) = &spec.score.as_ref().unwrap().kind else { panic!("{e}: a cast at the top") };
    let shape = Shape { batch: 1, heads: 1, heads_kv: 1, q_len: 1, kv_len: 1 };
    let params = [ParamValue::I32(a), ParamValue::I32(n)];
    let env = Env::new(&spec, &shape, &params, &[], Arith::F64).unwrap();
    match env.eval(inner, &Position { b: 0, h: 0, q: 0, k: 0, score: 0.0 }) {
        Value::I32(v) => v,
        other => panic!("{e}: {other:?}"),
    }
}

/// Operands that reach every edge: signs, zero, ±1, shift amounts past 31
/// and negative ones, i32's ends.
const EDGES: [i32; 16] = [i32::MIN, i32::MIN + 1, -65537, -33, -32, -7, -1, 0, 1, 5, 7, 31, 32, 33, 1 << 30, i32::MAX];

#[test]
fn reference_matches_rusts_wrapping_operators() {
    type Op = fn(i32, i32) -> i32;
    let ops: [(&str, Op); 10] = [
        ("a & n", |a, n| a & n),
        ("a | n", |a, n| a | n),
        ("a ^ n", |a, n| a ^ n),
        ("a << n", |a, n| a.wrapping_shl(n as u32)),
        ("a >> n", |a, n| a.wrapping_shr(n as u32)),
        ("!a", |a, _| !a),
        ("rem_euclid(a, n)", |a, n| if n == 0 { 0 } else { a.wrapping_rem_euclid(n) }),
        ("div_euclid(a, n)", |a, n| if n == 0 { 0 } else { a.wrapping_div_euclid(n) }),
        // Truncating `/` and `%`, unlike the Euclidean builtins.
        ("a / n", |a, n| if n == 0 { 0 } else { a.wrapping_div(n) }),
        ("a % n", |a, n| if n == 0 { 0 } else { a.wrapping_rem(n) }),
    ];
    for (e, op) in ops {
        for a in EDGES {
            for n in EDGES {
                assert_eq!(eval_i32(e, a, n), op(a, n), "{e} at a = {a}, n = {n}");
            }
        }
    }
}

#[test]
fn documented_values() {
    // Shift amounts use their low 5 bits: 33 shifts by 1, -1 by 31.
    assert_eq!(eval_i32("1 << n", 0, 33), 2);
    assert_eq!(eval_i32("1 << n", 0, -1), i32::MIN);
    assert_eq!(eval_i32("a >> n", -8, 1), -4, ">> copies the sign bit");
    // Truncation toward zero versus Euclid.
    assert_eq!((eval_i32("a % n", -7, 2), eval_i32("rem_euclid(a, n)", -7, 2)), (-1, 1));
    assert_eq!((eval_i32("a / n", -7, 2), eval_i32("div_euclid(a, n)", -7, 2)), (-3, -4));
    assert_eq!((eval_i32("rem_euclid(a, n)", 7, -2), eval_i32("div_euclid(a, n)", 7, -2)), (1, -3));
    assert_eq!((eval_i32("rem_euclid(a, n)", 5, 0), eval_i32("div_euclid(a, n)", 5, 0)), (0, 0), "by zero");
    assert_eq!(eval_i32("div_euclid(a, n)", i32::MIN, -1), i32::MIN, "wraps like `/`");
    assert_eq!(eval_i32("!a", 0, 0), -1);
}
