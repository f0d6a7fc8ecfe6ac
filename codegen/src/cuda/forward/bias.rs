//! Additive score biases, strength-reduced in the forward's logit.
//!
//! A score `score + T` (T free of `score`: a bias) needs, in log2 units,
//! `dot · scale · LOG2E + T · LOG2E`: one FFMA over a hoisted `scale · LOG2E`
//! instead of a multiply by the scale, the add and a multiply by LOG2E.
//!
//! A *key-linear* bias `a * (X as f32)`, `a` free of k and X = ±k + R (R free
//! of k; ALiBi's `slopes[h] * (k - q) as f32`), costs per element an integer
//! op, a conversion and a multiply when written as is. The logit's element
//! at key k = k0 + j (k0 = kv0 + 2t the lane's first key of the tile, and
//! j = 8n + c a constant of the unrolled loop) has X = X(k0) ± j, so
//! `T · LOG2E = fmaf(a · LOG2E, ±j, a · LOG2E · X(k0))`: one FFMA with an
//! immediate per element, the rest once per row of the tile (LLVM hoists
//! and shares what the elements of a row have in common). At d = 64 the
//! softmax's instruction issue, not the tensor cores, bounds ALiBi, so every
//! instruction per element counts.
//!
//! Where R is ±q (ALiBi's `k - q`), X = ±k0 ± q0 ± j ± (q − q0) for the
//! item's first row q0, and the last part is the same for every key of a
//! row: the softmax of a row does not change when each of its logits moves
//! by one constant, so at head dims up to 64 the logits leave it out (X is
//! taken at q0, and the FFMA of `j` is the same for the lane's rows: LLVM
//! computes it once per column instead of once per element) and only the
//! row's LSE adds it back ([`lse_row_term`]). That pays at d <= 64, where
//! the softmax bounds a tile; at d = 128 the tensor cores do, and it cost.
//!
//! Rounding: `X(k0)` and `j` convert exactly while |X| ≤ 2^24 (sequences of
//! 16M keys); past that, and in the reassociated products, the bias differs
//! from the spec's by a few ulp, which the spec language allows for f32.

use crate::cuda::kit::expr::c_expr_in;
use crate::cuda::kit::hoist::{lookup, Hoisted};
use crate::spec::{BinOp, Builtin, Expr, ExprKind, Spec, Ty};

/// The bias of a score `score + T` or `T + score`.
pub(super) fn additive_bias(score: &Expr) -> Option<&Expr> {
    let ExprKind::Binary(BinOp::Add, a, b) = &score.kind else { return None };
    let is_score = |e: &Expr| e.kind == ExprKind::Builtin(Builtin::Score);
    let bias = match (is_score(a), is_score(b)) {
        (true, false) => b,
        (false, true) => a,
        _ => return None,
    };
    (!bias.uses(Builtin::Score)).then_some(&**bias)
}

/// The logit lambdas' body for a score with the additive `bias`, in log2
/// units over the kernel's `scale_log2`: the statements they start with, if
/// any, and the logit expression (which may read `k0`: [`reads_first_key`]).
/// `hoisted` names the spec's hoisted terms.
pub(super) fn biased_logit(spec: &Spec, bias: &Expr, hoisted: &[Hoisted]) -> (Option<String>, String) {
    let c_expr = |e: &Expr| c_expr_in(spec, e, &|x| lookup(hoisted, x));
    let Some(linear) = KeyLinear::of(bias) else {
        return (None, format!("fmaf(dot, scale_log2, {} * LOG2E)", c_expr(bias)));
    };
    // X at the lane's first key of the tile (names hoisted per key are X at
    // other keys), and at the item's first row where the row's part moves
    // into its LSE.
    let row_free = linear.row_part_dropped(spec).is_some();
    let at_k0 = |x: &Expr| match (x.uses(Builtin::K), &x.kind) {
        (true, ExprKind::Builtin(Builtin::K)) => Some("k0".to_string()),
        (true, _) => None,
        (false, ExprKind::Builtin(Builtin::Q)) if row_free => Some("q0".to_string()),
        (false, _) => lookup(hoisted, x),
    };
    let x0 = c_expr_in(spec, linear.position, &at_k0);
    let j = if linear.sign < 0 { "-(n * 8 + c)" } else { "n * 8 + c" };
    let prologue = format!("const float key_step = {} * LOG2E;", c_expr(linear.factor));
    (Some(prologue), format!("fmaf(dot, scale_log2, fmaf(key_step, (float)({j}), key_step * (float){x0}))"))
}

/// Whether [`biased_logit`] reads `k0`, the lane's first key of the tile
/// (`key_bounds::FIRST_KEY`, which the lambda declares).
pub(super) fn reads_first_key(bias: &Expr) -> bool {
    KeyLinear::of(bias).is_some()
}

/// What the LSE of a row adds to the logits' log-sum-exp (log2 units),
/// where the logits leave out the row's part of a key-linear bias (see the
/// module note): a C expression over `q` and `q0`, and the spec's terms as
/// the epilogue sees them (`hoisted`, rows by slot `i`).
pub(super) fn lse_row_term(spec: &Spec, hoisted: &[Hoisted]) -> Option<String> {
    let linear = KeyLinear::of(additive_bias(spec.score.as_ref()?)?)?;
    let row_sign = linear.row_part_dropped(spec)?;
    let factor = c_expr_in(spec, linear.factor, &|x| lookup(hoisted, x));
    let offset = if row_sign < 0 { "q0 - q" } else { "q - q0" };
    Some(format!("{factor} * LOG2E * (float)({offset})"))
}

/// A key-linear bias `a * (X as f32)` (either factor order).
struct KeyLinear<'e> {
    /// The factor free of k.
    factor: &'e Expr,
    /// The i32 X, linear in k with coefficient `sign`.
    position: &'e Expr,
    /// +1 for `k + R`, `R + k`, `k - R` and `k`; -1 for `R - k`.
    sign: i32,
    /// Where R is ±q: that sign.
    row_sign: Option<i32>,
}

impl<'e> KeyLinear<'e> {
    fn of(bias: &'e Expr) -> Option<Self> {
        let ExprKind::Binary(BinOp::Mul, a, b) = &bias.kind else { return None };
        [(a, b), (b, a)].into_iter().find_map(|(factor, cast)| {
            let ExprKind::Cast(position) = &cast.kind else { return None };
            let (sign, row_sign) = key_sign(position)?;
            (position.ty == Ty::I32 && !factor.uses(Builtin::K)).then_some(KeyLinear {
                factor,
                position,
                sign,
                row_sign,
            })
        })
    }

    /// The sign of q in X where the logits leave the row's part of the bias
    /// out: R is ±q, and the head dims are at most 64 (the softmax's issue
    /// rate bounds the tile, see the module note).
    fn row_part_dropped(&self, spec: &Spec) -> Option<i32> {
        self.row_sign.filter(|_| spec.head_dims.qk.max(spec.head_dims.v) <= 64)
    }
}

/// The coefficients of k and, where R is q itself, of q in `e` when `e` is
/// k, `k ± R`, `R + k` or `R - k` with R free of k.
fn key_sign(e: &Expr) -> Option<(i32, Option<i32>)> {
    let is = |e: &Expr, x| e.kind == ExprKind::Builtin(x);
    if is(e, Builtin::K) {
        return Some((1, None));
    }
    let ExprKind::Binary(op, a, b) = &e.kind else { return None };
    let (k_left, k_right) = (is(a, Builtin::K) && !b.uses(Builtin::K), is(b, Builtin::K) && !a.uses(Builtin::K));
    // X = k_sign * k + rest_sign * rest.
    let (rest, k_sign, rest_sign) = match op {
        BinOp::Add if k_left => (b, 1, 1),
        BinOp::Add if k_right => (a, 1, 1),
        BinOp::Sub if k_left => (b, 1, -1),
        BinOp::Sub if k_right => (a, -1, 1),
        _ => return None,
    };
    Some((k_sign, is(rest, Builtin::Q).then_some(rest_sign)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    fn score(body: &str) -> Expr {
        let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: 64, tensor slopes: f32[H], {body} }}")).unwrap();
        spec.score.unwrap()
    }

    #[test]
    fn alibi_is_a_key_linear_bias() {
        for (body, signs) in [
            ("score: score + slopes[h] * (k - q) as f32,", (1, Some(-1))),
            ("score: (q - k) as f32 * slopes[h] + score,", (-1, Some(1))),
            ("score: score + 0.5 * (k + q) as f32,", (1, Some(1))),
            ("score: score + slopes[h] * k as f32,", (1, None)),
            ("score: score + slopes[h] * (k - 2 * q) as f32,", (1, None)),
        ] {
            let score = score(body);
            let bias = additive_bias(&score).expect(body);
            assert_eq!(KeyLinear::of(bias).map(|l| (l.sign, l.row_sign)), Some(signs), "{body}");
        }
    }

    #[test]
    fn the_lse_takes_back_the_row_part_at_small_head_dims() {
        let alibi = |head_dim: u32, position: &str| {
            let source = format!(
                "S {{ dtype: bf16, head_dim: {head_dim}, tensor slopes: f32[H], score: score + slopes[h] * ({position}) as f32 }}"
            );
            lse_row_term(&parse_one(&source).unwrap(), &[])
        };
        assert_eq!(alibi(64, "k - q").as_deref(), Some("t_slopes[clip(h, heads)] * LOG2E * (float)(q0 - q)"));
        assert_eq!(alibi(64, "q - k").as_deref(), Some("t_slopes[clip(h, heads)] * LOG2E * (float)(q - q0)"));
        // Tensor cores bound d = 128: its logits keep the row's part.
        assert_eq!(alibi(128, "k - q"), None);
        // No row part to leave out.
        assert_eq!(alibi(64, "k"), None);
    }

    #[test]
    fn other_scores_are_not() {
        // Not additive in the score, or the bias not linear in k.
        for body in ["score: score * 2.0,", "score: score + score * 0.5,", "score: tanh(score / 30.0) * 30.0,"] {
            assert!(additive_bias(&score(body)).is_none(), "{body}");
        }
        for body in [
            "score: score + slopes[h] * (k * 2) as f32,",
            "score: score + (k - q) as f32 * (k - q) as f32,",
            "score: score + slopes[h],",
            "score: score + slopes[h] * (k - k) as f32,",
        ] {
            let score = score(body);
            let bias = additive_bias(&score).expect(body);
            assert!(KeyLinear::of(bias).is_none(), "{body}");
        }
    }
}
