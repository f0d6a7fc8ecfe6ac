//! The kernel's tile classifier: a spec's mask printed as one C expression of
//! type `Range` (see [`super::ranges`]) over the tile `[q_lo, q_hi]` ×
//! `[k_lo, k_hi]` of batch `b` and head `h`.
//!
//! It prints the same [`RangeExpr`] that [`crate::analysis::classify`]
//! evaluates, so the kernel skips (`hi == 0`) and runs unmasked
//! (`lo == 1`) exactly the tiles `classify` calls `Empty` and `Full`.

use crate::abi::ArgKind;
use crate::analysis::{lower, lower_with, Known, RangeExpr};
use crate::cuda::signature::arg_name;
use crate::spec::{Expr, Spec};

/// The mask's `Range` as a C expression in the locals `q_lo`, `q_hi`, `k_lo`,
/// `k_hi`, `b`, `h` and the kernel arguments; `None` without a mask.
pub(crate) fn tile_class_expr(spec: &Spec) -> Option<String> {
    spec.mask.as_ref().map(|mask| class_expr(spec, mask))
}

/// The `Range` of the boolean `e` (a part of the mask) as a C expression in
/// the same locals as [`tile_class_expr`].
pub(crate) fn class_expr(spec: &Spec, e: &Expr) -> String {
    c_range(spec, &lower(e), &[])
}

/// [`tile_class_expr`] of `mask` with each i32 subexpression of `bounded`
/// (identified by address) read as `r_span(<name>_lo, <name>_hi)`: bounds
/// the kernel computed at run time.
pub(crate) fn bounded_class_expr(spec: &Spec, mask: &Expr, bounded: &[(&Expr, &str)]) -> String {
    let index = |e: &Expr| bounded.iter().position(|(b, _)| std::ptr::eq(*b, e));
    let names: Vec<&str> = bounded.iter().map(|(_, name)| *name).collect();
    c_range(spec, &lower_with(mask, &index), &names)
}

fn c_range(spec: &Spec, r: &RangeExpr, bounded: &[&str]) -> String {
    let c = |a: &RangeExpr| c_range(spec, a, bounded);
    match r {
        RangeExpr::Point(known) => {
            let value = match *known {
                Known::Int(v) => v.to_string(),
                Known::B => "b".into(),
                Known::H => "h".into(),
                Known::QLen => arg_name(spec, ArgKind::QLen),
                Known::KvLen => arg_name(spec, ArgKind::KvLen),
                Known::Param(i) => arg_name(spec, ArgKind::Param(i)),
            };
            format!("r_point({value})")
        }
        RangeExpr::Query => "r_span(q_lo, q_hi)".into(),
        RangeExpr::Key => "r_span(k_lo, k_hi)".into(),
        RangeExpr::UnknownInt => "r_unknown_int()".into(),
        RangeExpr::UnknownBool => "r_unknown_bool()".into(),
        RangeExpr::Bounded(i) => format!("r_span({0}_lo, {0}_hi)", bounded[*i]),
        RangeExpr::Unary(op, a) => format!("{}({})", op.c_name(), c(a)),
        RangeExpr::Binary(op, a, b) => format!("{}({}, {})", op.c_name(), c(a), c(b)),
        RangeExpr::Clamp(args) => format!("r_clamp({}, {}, {})", c(&args[0]), c(&args[1]), c(&args[2])),
        RangeExpr::If(args) => format!("r_if({}, {}, {})", c(&args[0]), c(&args[1]), c(&args[2])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    fn emit(fields: &str) -> Option<String> {
        tile_class_expr(&parse_one(&format!("S {{ dtype: bf16, head_dim: 64, {fields} }}")).unwrap())
    }

    #[test]
    fn prints_interval_calls() {
        assert_eq!(emit(""), None);
        assert_eq!(emit("mask: q >= k").unwrap(), "r_ge(r_span(q_lo, q_hi), r_span(k_lo, k_hi))");
        assert_eq!(
            emit("param w: i32, mask: q >= k && q - k < w").unwrap(),
            "r_and(r_ge(r_span(q_lo, q_hi), r_span(k_lo, k_hi)), \
             r_lt(r_sub(r_span(q_lo, q_hi), r_span(k_lo, k_hi)), r_point(p_w)))"
        );
        assert_eq!(
            emit("tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] || q + kv_len - q_len >= -2147483648")
                .unwrap(),
            "r_or(r_eq(r_unknown_int(), r_unknown_int()), \
             r_ge(r_sub(r_add(r_span(q_lo, q_hi), r_point(kv_len)), r_point(q_len)), r_point(-2147483648)))"
        );
        assert_eq!(
            emit("param s: f32, mask: if h > 1 { (q as f32) < s } else { !(clamp(abs(-q), 0, 9) % 4 != b) }").unwrap(),
            "r_if(r_gt(r_point(h), r_point(1)), r_unknown_bool(), \
             r_not(r_ne(r_rem(r_clamp(r_abs(r_neg(r_span(q_lo, q_hi))), r_point(0), r_point(9)), r_point(4)), \
             r_point(b))))"
        );
    }
    #[test]
    fn bounded_terms_print_as_runtime_spans() {
        let spec = parse_one(
            "S { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k }",
        )
        .unwrap();
        let mask = spec.mask.as_ref().unwrap();
        let crate::spec::ExprKind::Binary(_, eq, _) = &mask.kind else { panic!("an && at the top") };
        let crate::spec::ExprKind::Binary(_, row, col) = &eq.kind else { panic!("an == below it") };
        assert_eq!(
            bounded_class_expr(&spec, mask, &[(row, "inv_0"), (col, "inv_1")]),
            "r_and(r_eq(r_span(inv_0_lo, inv_0_hi), r_span(inv_1_lo, inv_1_hi)), \
             r_ge(r_span(q_lo, q_hi), r_span(k_lo, k_hi)))"
        );
        assert_eq!(bounded_class_expr(&spec, mask, &[]), tile_class_expr(&spec).unwrap());
    }
}
