//! Expression emission: typed spec [`Expr`]s → C expressions.
//!
//! Every compound expression is parenthesized, so C's precedence (which
//! differs from Rust's, e.g. for `&` vs `==`) never matters and the output
//! needs no precedence table. Anything C leaves undefined goes through a
//! prelude helper with Rust's semantics, shared with the CPU reference: i32
//! arithmetic wraps, `/` and `%` by zero give 0, shifts take the amount's
//! low 5 bits, f32 → i32 saturates, and tensor indices are clamped into
//! range. `& | ^ ~` are C's own (defined on every int).
//!
//! Names: the kernel binds the built-ins `b`, `h`, `q`, `k` and `score` to C
//! locals of the same name; `q_len`/`kv_len`, params and tensors are kernel
//! arguments named by [`signature`](super::signature).

use crate::abi::{ArgKind, Side};
use crate::cuda::signature::{arg_name, c_type};
use crate::spec::{BinOp, Builtin, Dim, ElemTy, Expr, ExprKind, Func, Spec, Ty, UnOp};

/// `e` as a fully parenthesized C expression.
pub(crate) fn c_expr(spec: &Spec, e: &Expr) -> String {
    c_expr_in(spec, e, &|_| None)
}

/// `e` as C, with the subexpressions `hoisted` names (precomputed values,
/// see [`super::hoist`]) replaced by those names.
pub(crate) fn c_expr_in(spec: &Spec, e: &Expr, hoisted: &dyn Fn(&Expr) -> Option<String>) -> String {
    if let Some(name) = hoisted(e) {
        return name;
    }
    let c = |a: &Expr| c_expr_in(spec, a, hoisted);
    match &e.kind {
        ExprKind::Bool(v) => v.to_string(),
        ExprKind::Int(v) => int_literal(*v),
        ExprKind::Float(v) => float_literal(*v),
        ExprKind::Builtin(Builtin::QLen) => arg_name(spec, ArgKind::QLen),
        ExprKind::Builtin(Builtin::KvLen) => arg_name(spec, ArgKind::KvLen),
        ExprKind::Builtin(b) => b.name().into(),
        ExprKind::Param(i) => arg_name(spec, ArgKind::Param(*i)),
        ExprKind::Load(slot, indices) => load(spec, *slot, indices, hoisted),
        ExprKind::Unary(UnOp::Neg, a) if a.ty == Ty::I32 => format!("neg_i32({})", c(a)),
        ExprKind::Unary(UnOp::Neg, a) => format!("(-{})", c(a)),
        ExprKind::Unary(UnOp::Not, a) => format!("(!{})", c(a)),
        ExprKind::Unary(UnOp::BitNot, a) => format!("(~{})", c(a)),
        ExprKind::Binary(op, a, b) => {
            let (x, y) = (c(a), c(b));
            match (op, a.ty) {
                (BinOp::Add, Ty::I32) => format!("add_i32({x}, {y})"),
                (BinOp::Sub, Ty::I32) => format!("sub_i32({x}, {y})"),
                (BinOp::Mul, Ty::I32) => format!("mul_i32({x}, {y})"),
                (BinOp::Div, Ty::I32) => format!("div_i32({x}, {y})"),
                (BinOp::Rem, Ty::I32) => format!("rem_i32({x}, {y})"),
                (BinOp::Shl, _) => format!("shl_i32({x}, {y})"),
                (BinOp::Shr, _) => format!("shr_i32({x}, {y})"),
                (BinOp::Div, _) => format!("div_f32({x}, {y})"),
                (BinOp::Rem, _) => format!("fmodf({x}, {y})"),
                _ => format!("({x} {} {y})", op.symbol()),
            }
        }
        ExprKind::Cast(a) => match (a.ty, e.ty) {
            (Ty::F32, Ty::I32) => format!("f32_to_i32({})", c(a)),
            (_, ty) => format!("(({}){})", c_type(ty), c(a)),
        },
        ExprKind::Call(func, args) => {
            let args: Vec<String> = args.iter().map(c).collect();
            format!("{}({})", func_name(*func, e.ty), args.join(", "))
        }
        ExprKind::If(cond, then, other) => format!("({} ? {} : {})", c(cond), c(then), c(other)),
    }
}

/// A row-major element read: each index clipped into `[0, dim - 1]`, the
/// linear offset built in 64 bits (Horner form), 16-bit floats widened.
fn load(spec: &Spec, slot: usize, indices: &[Expr], hoisted: &dyn Fn(&Expr) -> Option<String>) -> String {
    let tensor = &spec.tensors[slot];
    let offset = load_offset(spec, slot, indices, hoisted);
    let element = format!("{}[{offset}]", arg_name(spec, ArgKind::Tensor(slot)));
    match tensor.elem {
        ElemTy::I32 | ElemTy::F32 => element,
        ElemTy::F16 => format!("f16::to_f32({element})"),
        ElemTy::Bf16 => format!("bf16::to_f32({element})"),
    }
}

/// The element offset a read of tensor `slot` at `indices` hits: each index
/// clipped into `[0, dim - 1]`, the row-major offset in 64 bits.
pub(crate) fn load_offset(
    spec: &Spec,
    slot: usize,
    indices: &[Expr],
    hoisted: &dyn Fn(&Expr) -> Option<String>,
) -> String {
    let mut offset = String::new();
    for (index, dim) in indices.iter().zip(&spec.tensors[slot].dims) {
        let wide = matches!(dim, Dim::Const(n) if *n > i32::MAX as u32);
        let (dim, clip) = (dim_value(spec, dim), if wide { "clip_wide" } else { "clip" });
        let clipped = format!("{clip}({}, {dim})", c_expr_in(spec, index, hoisted));
        // The first index widens the sum: every later term is 64-bit.
        offset = match offset.is_empty() {
            true if indices.len() > 1 && !wide => format!("(long long){clipped}"),
            true => clipped,
            false => format!("({offset} * {dim} + {clipped})"),
        };
    }
    offset
}

/// A tensor dimension as a C value: a size argument, a constant, or an
/// expression of them in plain int arithmetic (the launch checked that every
/// value along the way fits, `TensorDecl::check_dims`).
fn dim_value(spec: &Spec, dim: &Dim) -> String {
    let kind = match dim {
        Dim::Const(n) => return n.to_string(),
        Dim::Op(op, a, b) => return format!("({} {} {})", dim_value(spec, a), op.symbol(), dim_value(spec, b)),
        Dim::Batch => ArgKind::Batch,
        Dim::Heads => ArgKind::Heads,
        Dim::HeadsKv => ArgKind::HeadsKv,
        Dim::QLen => ArgKind::QLen,
        Dim::KvLen => ArgKind::KvLen,
        Dim::MaxQLen => ArgKind::MaxLen(Side::Queries),
        Dim::MaxKvLen => ArgKind::MaxLen(Side::Keys),
        Dim::Param(i) => ArgKind::Param(*i),
    };
    arg_name(spec, kind)
}

/// The C function implementing `func` at result type `ty`.
fn func_name(func: Func, ty: Ty) -> &'static str {
    let int = ty == Ty::I32;
    match func {
        Func::Min if int => "min_i32",
        Func::Max if int => "max_i32",
        Func::Abs if int => "abs_i32",
        Func::Clamp if int => "clamp_i32",
        Func::Min => "fminf",
        Func::Max => "fmaxf",
        Func::Abs => "fabsf",
        Func::Clamp => "clamp_f32",
        Func::Exp => "expf",
        Func::Exp2 => "exp2f",
        Func::Log => "logf",
        Func::Log2 => "log2f",
        Func::Tanh => "tanh_f32",
        Func::Sigmoid => "sigmoid",
        Func::Sqrt => "sqrtf",
        Func::Floor => "floorf",
        Func::RemEuclid => "rem_euclid_i32",
        Func::DivEuclid => "div_euclid_i32",
    }
}

/// Negative literals are parenthesized like any other unary minus, and
/// `i32::MIN` has no literal of its own in C.
fn int_literal(v: i32) -> String {
    match v {
        i32::MIN => "(-2147483647 - 1)".into(),
        v if v < 0 => format!("({v})"),
        v => v.to_string(),
    }
}

/// An f32 literal that denotes exactly `v`. Rust's shortest round-trip
/// decimal (`30.0f`, `1e-5f`) is used when it names `v` whether the C front
/// end rounds it straight to f32 or via f64; otherwise a hex float, which is
/// exact by construction.
pub(crate) fn float_literal(v: f32) -> String {
    let decimal = format!("{v:?}");
    let exact_via_f64 = decimal.parse::<f64>().is_ok_and(|d| (d as f32).to_bits() == v.to_bits());
    let text = if exact_via_f64 { format!("{decimal}f") } else { hex_float(v) };
    if v.is_sign_negative() {
        format!("({text})")
    } else {
        text
    }
}

/// `v` as a C hex-float literal, e.g. `0x1.800000p+1f` for 3.0 (finite `v`).
fn hex_float(v: f32) -> String {
    let bits = v.to_bits();
    let sign = if v.is_sign_negative() { "-" } else { "" };
    let exp = ((bits >> 23) & 0xff) as i32;
    // 23 mantissa bits, shifted to fill 6 hex digits.
    let mantissa = (bits & 0x7f_ffff) << 1;
    match exp {
        0 => format!("{sign}0x0.{mantissa:06x}p-126f"),
        _ => format!("{sign}0x1.{mantissa:06x}p{:+}f", exp - 127),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    /// The C text of a spec's mask and score expressions.
    fn emit(fields: &str) -> (Option<String>, Option<String>) {
        let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: 64, {fields} }}")).unwrap();
        (spec.mask.as_ref().map(|e| c_expr(&spec, e)), spec.score.as_ref().map(|e| c_expr(&spec, e)))
    }

    fn mask(fields: &str) -> String {
        emit(fields).0.unwrap()
    }

    fn score(fields: &str) -> String {
        emit(fields).1.unwrap()
    }

    #[test]
    fn parenthesizes_every_compound() {
        assert_eq!(
            mask("mask: q >= k && q - k < 3 || !(k == 0)"),
            "(((q >= k) && (sub_i32(q, k) < 3)) || (!(k == 0)))"
        );
        assert_eq!(mask("mask: (q < k) == (k < q)"), "((q < k) == (k < q))");
        assert_eq!(score("score: -(score * 2.0) - (1.0 - score)"), "((-(score * 2.0f)) - (1.0f - score))");
        assert_eq!(score("score: score / (1.0 - score)"), "div_f32(score, (1.0f - score))");
    }

    #[test]
    fn integer_ops_never_hit_undefined_behaviour() {
        assert_eq!(
            mask("param n: i32, mask: q / n + q % n * -k > 0"),
            "(add_i32(div_i32(q, p_n), mul_i32(rem_i32(q, p_n), neg_i32(k))) > 0)"
        );
        assert_eq!(score("score: score % 2.5"), "fmodf(score, 2.5f)");
    }

    #[test]
    fn bit_operators_are_cs_and_shifts_and_euclid_helpers() {
        assert_eq!(
            mask("param n: i32, mask: (q & k | q ^ !k) << n >> 2 == rem_euclid(q, n) + div_euclid(k, 8)"),
            "(shr_i32(shl_i32(((q & k) | (q ^ (~k))), p_n), 2) == add_i32(rem_euclid_i32(q, p_n), div_euclid_i32(k, 8)))"
        );
    }

    #[test]
    fn casts_calls_and_if() {
        assert_eq!(
            score("score: (k - q) as f32 + (score as i32) as f32"),
            "(((float)sub_i32(k, q)) + ((float)f32_to_i32(score)))"
        );
        assert_eq!(mask("mask: ((q > k) as i32) < 1"), "(((int)(q > k)) < 1)");
        assert_eq!(
            score("score: if q > k { sigmoid(score) } else { clamp(score, -1, 1) }"),
            "((q > k) ? sigmoid(score) : clamp_f32(score, (-1.0f), 1.0f))"
        );
        assert_eq!(
            mask("mask: max(abs(q - k), 1) < min(q_len, kv_len)"),
            "(max_i32(abs_i32(sub_i32(q, k)), 1) < min_i32(q_len, kv_len))"
        );
    }

    #[test]
    fn loads_clip_every_index_and_widen_half_types() {
        assert_eq!(
            score("tensor rel: f32[H, 257], score: score + rel[h][k - q]"),
            "(score + t_rel[((long long)clip(h, heads) * 257 + clip(sub_i32(k, q), 257))])"
        );
        assert_eq!(
            score("tensor t: f16[B, H_KV, Q_LEN], score: t[b][h][q]"),
            "f16::to_f32(t_t[(((long long)clip(b, batch) * heads_kv + clip(h, heads_kv)) * q_len + clip(q, q_len))])"
        );
        assert_eq!(score("tensor t: bf16[KV_LEN], score: t[k]"), "bf16::to_f32(t_t[clip(k, kv_len)])");
        // Dimension expressions print as int arithmetic (checked at launch).
        assert_eq!(
            score("tensor rel: f32[2 * KV_LEN - 1], score: score + rel[k - q + kv_len - 1]"),
            "(score + t_rel[clip(sub_i32(add_i32(sub_i32(k, q), kv_len), 1), ((2 * kv_len) - 1))])"
        );
        // Constant dimensions past i32::MAX clip in 64 bits.
        assert_eq!(score("tensor t: f32[4000000000], score: score + t[k]"), "(score + t_t[clip_wide(k, 4000000000)])");
    }

    #[test]
    fn literals_print_exactly() {
        assert_eq!(int_literal(i32::MIN), "(-2147483647 - 1)");
        assert_eq!(int_literal(-7), "(-7)");
        assert_eq!(float_literal(30.0), "30.0f");
        assert_eq!(float_literal(-0.0), "(-0.0f)");
        assert_eq!(float_literal(1e-5), "1e-5f");
        assert_eq!(float_literal(0.1), "0.1f");
        assert_eq!(float_literal(f32::MAX), "3.4028235e38f");
        assert_eq!(hex_float(3.0), "0x1.800000p+1f");
        assert_eq!(hex_float(-0.15625), "-0x1.400000p-3f");
        assert_eq!(hex_float(f32::from_bits(1)), "0x0.000002p-126f");
    }

    #[test]
    fn hex_floats_round_trip() {
        for v in [1.0f32, -2.5, 0.1, 1e-40, f32::MIN_POSITIVE, f32::MAX, 123456.79] {
            let text = hex_float(v);
            let (negative, digits) = text.strip_prefix('-').map_or((false, text.as_str()), |t| (true, t));
            let (mantissa, exp) = digits.trim_start_matches("0x").trim_end_matches('f').split_once('p').unwrap();
            let (lead, frac) = mantissa.split_once('.').unwrap();
            let frac = u32::from_str_radix(frac, 16).unwrap() as f64 / 16f64.powi(6);
            let value = (lead.parse::<f64>().unwrap() + frac) * 2f64.powi(exp.parse().unwrap());
            assert_eq!((if negative { -value } else { value }) as f32, v, "{text}");
        }
    }
}
