//! Symbolic derivatives of score expressions, for the backward pass.
//!
//! The backward pass needs ∂score′/∂score at every kept (q, k) pair, to turn
//! dS′ into dS, and ∂score′/∂t for a captured float tensor `t` the user wants
//! to train (a learned bias), or ∂sink/∂t for one the sink reads (learned
//! sinks). Both are derived here as ordinary checked IR, so
//! the reference interpreter evaluates them and the emitter can print them
//! like any score expression: users never write a backward by hand.
//!
//! Where the classical derivative does not exist, the convention is:
//! - i32 and bool subexpressions, `floor` and casts are piecewise constant:
//!   derivative 0 (an `if` condition or a tensor index never contributes);
//! - `if c { a } else { b }` differentiates the branch taken;
//! - `abs(a)` takes `a′` at 0; `min`/`max` take the first argument's
//!   derivative on ties; `clamp(x, lo, hi)` is `min(max(x, lo), hi)`;
//! - f32 `a % b` (fmod: `a − trunc(a / b) · b`) gives
//!   `a′ + ((a % b − a) / b) · b′`, which states `trunc(a / b)` without a
//!   float → int cast that could saturate.
//!
//! Results are simplified as they are built (0·x → 0, 1·x → x, x + 0 → x,
//! x·(y / x) → y, literal folding when the result is an exact f32), so the
//! ALiBi derivative is the literal `1.0` and a kernel pays only for the
//! nonlinear part of a score mod. `ln 2` is written `log(2.0)`, exact in every
//! precision the interpreter runs.

use crate::spec::{BinOp, Builtin, Expr, ExprKind, Func, Spec, Ty, UnOp};

/// ∂score′/∂score: the derivative of the spec's score expression with respect
/// to the incoming scaled score, an f32 expression of the same spec. `None`
/// when the spec has no score expression (the derivative is 1).
pub fn d_score(spec: &Spec) -> Option<Expr> {
    let score = spec.score.as_ref()?;
    Some(derive(score, &|e| e.kind == ExprKind::Builtin(Builtin::Score)))
}

/// `∂score′/∂t[i]`: the derivative of the score expression with respect to the
/// element of float tensor `tensor` that it reads, an f32 expression of the
/// same spec. The element is the one [`load_indices`] select, so the gradient
/// of `t` sums this over every (b, h, q, k) pair, each adding to the element
/// it reads. `None` when the tensor is not a float tensor or
/// [`load_indices`] is `None`.
pub fn d_load(spec: &Spec, tensor: usize) -> Option<Expr> {
    derive_load(spec.score.as_ref()?, spec, tensor)
}

/// The index expressions with which the score expression reads float tensor
/// `tensor`. A gradient needs a single read: `None` when the score does not
/// read the tensor or reads it with different index expressions (`t[q] -
/// t[k]`), since one pair would then touch several elements.
pub fn load_indices(spec: &Spec, tensor: usize) -> Option<Vec<Expr>> {
    float_read(spec.score.as_ref()?, spec, tensor)
}

/// `∂sink/∂t[i]`: the derivative of the sink expression with respect to the
/// element of float tensor `tensor` it reads (the one [`sink_load_indices`]
/// select), summed over rows by the gradient of `t`. `None` as [`d_load`].
pub fn d_sink_load(spec: &Spec, tensor: usize) -> Option<Expr> {
    derive_load(spec.sink.as_ref()?, spec, tensor)
}

/// The index expressions with which the sink reads float tensor `tensor`,
/// `None` as [`load_indices`].
pub fn sink_load_indices(spec: &Spec, tensor: usize) -> Option<Vec<Expr>> {
    float_read(spec.sink.as_ref()?, spec, tensor)
}

/// Whether float tensor `tensor` has a gradient: the score or the sink reads
/// it, and each of them that does with a single index list. The two reads
/// may differ: their gradients add into the same tensor.
pub fn trainable(spec: &Spec, tensor: usize) -> bool {
    let exprs = || spec.score.iter().chain(&spec.sink);
    let reads = |e: &Expr| reads_tensor(e, tensor);
    let read_once = exprs().filter(|e| reads(e)).all(|e| float_read(e, spec, tensor).is_some());
    read_once && exprs().any(reads)
}

fn derive_load(e: &Expr, spec: &Spec, tensor: usize) -> Option<Expr> {
    float_read(e, spec, tensor)?;
    Some(derive(e, &|x| matches!(x.kind, ExprKind::Load(t, _) if t == tensor)))
}

/// The single index list with which `e` reads float tensor `tensor`.
fn float_read(e: &Expr, spec: &Spec, tensor: usize) -> Option<Vec<Expr>> {
    if spec.tensors.get(tensor)?.elem.value_ty() != Ty::F32 {
        return None;
    }
    let mut first: Option<Vec<Expr>> = None;
    let mut single = true;
    e.walk(&mut |e| match &e.kind {
        ExprKind::Load(t, indices) if *t == tensor => match &first {
            None => first = Some(indices.clone()),
            Some(f) => single &= f == indices,
        },
        _ => {}
    });
    first.filter(|_| single)
}

fn reads_tensor(e: &Expr, tensor: usize) -> bool {
    let mut found = false;
    e.walk(&mut |e| found |= matches!(e.kind, ExprKind::Load(t, _) if t == tensor));
    found
}

/// The derivative of `e` with respect to the f32 subexpressions `var` accepts.
fn derive(e: &Expr, var: &dyn Fn(&Expr) -> bool) -> Expr {
    if e.ty != Ty::F32 {
        return lit(0.0);
    }
    if var(e) {
        return lit(1.0);
    }
    let d = |a: &Expr| derive(a, var);
    match &e.kind {
        ExprKind::Bool(_)
        | ExprKind::Int(_)
        | ExprKind::Float(_)
        | ExprKind::Builtin(_)
        | ExprKind::Param(_)
        | ExprKind::Load(..)
        | ExprKind::Unary(UnOp::Not | UnOp::BitNot, _) => lit(0.0),
        // An f32 cast reads an i32 (the checker drops f32 → f32 casts): 0.
        ExprKind::Cast(a) => d(a),
        ExprKind::Unary(UnOp::Neg, a) => neg(d(a)),
        ExprKind::Binary(op, a, b) => {
            let (a, b) = (&**a, &**b);
            match op {
                BinOp::Add => add(d(a), d(b)),
                BinOp::Sub => sub(d(a), d(b)),
                BinOp::Mul => add(mul(d(a), b.clone()), mul(a.clone(), d(b))),
                // a′/b − a·b′/b², which is a′/b for a constant divisor.
                BinOp::Div => sub(div(d(a), b.clone()), div(mul(a.clone(), d(b)), mul(b.clone(), b.clone()))),
                BinOp::Rem => add(d(a), mul(div(sub(e.clone(), a.clone()), b.clone()), d(b))),
                // Comparisons and logic are bool, handled above.
                _ => lit(0.0),
            }
        }
        ExprKind::Call(func, args) => match (func, args.as_slice()) {
            (Func::Tanh, [a]) => mul(sub(lit(1.0), mul(e.clone(), e.clone())), d(a)),
            (Func::Exp, [a]) => mul(e.clone(), d(a)),
            (Func::Exp2, [a]) => mul(mul(e.clone(), ln_2()), d(a)),
            (Func::Log, [a]) => div(d(a), a.clone()),
            (Func::Log2, [a]) => div(d(a), mul(a.clone(), ln_2())),
            (Func::Sigmoid, [a]) => mul(mul(e.clone(), sub(lit(1.0), e.clone())), d(a)),
            (Func::Sqrt, [a]) => div(d(a), mul(lit(2.0), e.clone())),
            (Func::Abs, [a]) => {
                let da = d(a);
                select(cond(BinOp::Lt, a.clone(), lit(0.0)), neg(da.clone()), da)
            }
            (Func::Min, [a, b]) => select(cond(BinOp::Le, a.clone(), b.clone()), d(a), d(b)),
            (Func::Max, [a, b]) => select(cond(BinOp::Ge, a.clone(), b.clone()), d(a), d(b)),
            (Func::Clamp, [x, lo, hi]) => {
                let (dx, dlo, dhi) = (d(x), d(lo), d(hi));
                if is_lit(&dlo, 0.0) && is_lit(&dhi, 0.0) {
                    // Equal to the general form below, for lo > hi too.
                    let inside = cond(
                        BinOp::And,
                        cond(BinOp::Ge, x.clone(), lo.clone()),
                        cond(BinOp::Le, x.clone(), hi.clone()),
                    );
                    select(inside, dx, lit(0.0))
                } else {
                    let low = Expr { ty: Ty::F32, kind: ExprKind::Call(Func::Max, vec![x.clone(), lo.clone()]) };
                    let d_low = select(cond(BinOp::Ge, x.clone(), lo.clone()), dx, dlo);
                    select(cond(BinOp::Le, low, hi.clone()), d_low, dhi)
                }
            }
            // `floor`, and arities a checked spec never has.
            _ => lit(0.0),
        },
        ExprKind::If(c, t, f) => select((**c).clone(), d(t), d(f)),
    }
}

fn lit(v: f32) -> Expr {
    Expr { ty: Ty::F32, kind: ExprKind::Float(v) }
}

fn is_lit(e: &Expr, v: f32) -> bool {
    e.kind == ExprKind::Float(v)
}

fn ln_2() -> Expr {
    Expr { ty: Ty::F32, kind: ExprKind::Call(Func::Log, vec![lit(2.0)]) }
}

fn arith(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr { ty: Ty::F32, kind: ExprKind::Binary(op, Box::new(a), Box::new(b)) }
}

/// A comparison or `&&`: a bool condition.
fn cond(op: BinOp, a: Expr, b: Expr) -> Expr {
    Expr { ty: Ty::Bool, kind: ExprKind::Binary(op, Box::new(a), Box::new(b)) }
}

/// `if c { t } else { f }`, or just `t` when both branches agree.
fn select(c: Expr, t: Expr, f: Expr) -> Expr {
    if t == f {
        return t;
    }
    Expr { ty: Ty::F32, kind: ExprKind::If(Box::new(c), Box::new(t), Box::new(f)) }
}

/// `a op b` for two literals, when the result is exactly an f32: then the
/// folded tree evaluates like the unfolded one in f32 and in f64.
fn fold(op: BinOp, a: &Expr, b: &Expr) -> Option<Expr> {
    let (ExprKind::Float(x), ExprKind::Float(y)) = (&a.kind, &b.kind) else {
        return None;
    };
    let (x, y) = (f64::from(*x), f64::from(*y));
    let r = match op {
        BinOp::Add => x + y,
        BinOp::Sub => x - y,
        BinOp::Mul => x * y,
        BinOp::Div => x / y,
        _ => return None,
    };
    let narrow = r as f32;
    (r.is_finite() && f64::from(narrow) == r).then(|| lit(narrow))
}

fn neg(a: Expr) -> Expr {
    match a.kind {
        ExprKind::Float(v) => lit(-v),
        ExprKind::Unary(UnOp::Neg, inner) => *inner,
        kind => Expr { ty: Ty::F32, kind: ExprKind::Unary(UnOp::Neg, Box::new(Expr { ty: Ty::F32, kind })) },
    }
}

fn add(a: Expr, b: Expr) -> Expr {
    if is_lit(&a, 0.0) {
        return b;
    }
    if is_lit(&b, 0.0) {
        return a;
    }
    fold(BinOp::Add, &a, &b).unwrap_or_else(|| arith(BinOp::Add, a, b))
}

fn sub(a: Expr, b: Expr) -> Expr {
    if is_lit(&b, 0.0) {
        return a;
    }
    if is_lit(&a, 0.0) {
        return neg(b);
    }
    fold(BinOp::Sub, &a, &b).unwrap_or_else(|| arith(BinOp::Sub, a, b))
}

fn mul(a: Expr, b: Expr) -> Expr {
    if is_lit(&a, 0.0) || is_lit(&b, 0.0) {
        return lit(0.0);
    }
    if is_lit(&a, 1.0) {
        return b;
    }
    if is_lit(&b, 1.0) {
        return a;
    }
    fold(BinOp::Mul, &a, &b)
        .or_else(|| cancel(&a, &b))
        .or_else(|| cancel(&b, &a))
        .unwrap_or_else(|| arith(BinOp::Mul, a, b))
}

fn div(a: Expr, b: Expr) -> Expr {
    if is_lit(&a, 0.0) {
        return lit(0.0);
    }
    if is_lit(&b, 1.0) {
        return a;
    }
    fold(BinOp::Div, &a, &b).unwrap_or_else(|| arith(BinOp::Div, a, b))
}

/// `x · y` when `y` divides by `x` somewhere in its product: that division
/// removed (softcap's `cap · ((1 − t²) · (1 / cap))` → `1 − t²`).
fn cancel(x: &Expr, y: &Expr) -> Option<Expr> {
    let ExprKind::Binary(op, p, q) = &y.kind else {
        return None;
    };
    let (p, q) = (&**p, &**q);
    match op {
        BinOp::Div if q == x => Some(p.clone()),
        BinOp::Div => cancel(x, p).map(|p| div(p, q.clone())),
        BinOp::Mul => cancel(x, p).map(|p| mul(p, q.clone())).or_else(|| cancel(x, q).map(|q| mul(p.clone(), q))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;
    use crate::syntax::expr_source;

    fn spec(fields: &str) -> Spec {
        parse_one(&format!("T {{ dtype: bf16, head_dim: 64, {fields} }}")).expect("test spec parses")
    }

    fn printed(fields: &str) -> String {
        let s = spec(fields);
        expr_source(&s, &d_score(&s).expect("a score expression"))
    }

    #[test]
    fn softcap_keeps_only_the_tanh_term() {
        assert_eq!(
            printed("param cap: f32, score: cap * tanh(score / cap)"),
            "1.0 - tanh(score / cap) * tanh(score / cap)"
        );
    }

    #[test]
    fn additive_biases_have_derivative_one() {
        assert_eq!(printed("tensor slopes: f32[H], score: score + slopes[h] * (k - q) as f32"), "1.0");
        let rel = spec("tensor rel: f32[H, 257], score: score + rel[h][clamp(k - q, -128, 128) + 128]");
        assert_eq!(expr_source(&rel, &d_score(&rel).unwrap()), "1.0");
        assert_eq!(expr_source(&rel, &d_load(&rel, 0).unwrap()), "1.0");
    }

    #[test]
    fn piecewise_functions_select_the_active_derivative() {
        assert_eq!(printed("score: abs(score)"), "if score < 0.0 { -1.0 } else { 1.0 }");
        assert_eq!(printed("score: max(score, 0.0) * 2.0"), "(if score >= 0.0 { 1.0 } else { 0.0 }) * 2.0");
        assert_eq!(printed("score: clamp(score, -5.0, 5.0)"), "if score >= -5.0 && score <= 5.0 { 1.0 } else { 0.0 }");
        assert_eq!(printed("score: if q > k { score * 3.0 } else { score }"), "if q > k { 3.0 } else { 1.0 }");
        assert_eq!(printed("score: floor(score) + score % 2.0"), "1.0");
    }

    #[test]
    fn integer_operators_have_no_derivative() {
        assert_eq!(printed("score: score * (q << 1 | rem_euclid(k, 3)) as f32"), "(q << 1 | rem_euclid(k, 3)) as f32");
        assert_eq!(printed("score: score + (div_euclid(k - q, 4) ^ !k >> 2) as f32"), "1.0");
    }

    #[test]
    fn smooth_functions() {
        assert_eq!(printed("score: exp(score * 0.5)"), "exp(score * 0.5) * 0.5");
        assert_eq!(printed("score: exp2(score)"), "exp2(score) * log(2.0)");
        assert_eq!(printed("score: log(score)"), "1.0 / score");
        assert_eq!(printed("score: sqrt(score)"), "1.0 / (2.0 * sqrt(score))");
        assert_eq!(printed("score: sigmoid(score)"), "sigmoid(score) * (1.0 - sigmoid(score))");
        assert_eq!(printed("param t: f32, score: t / score"), "-(t / (score * score))");
    }

    #[test]
    fn tensor_gradients_need_one_float_read() {
        let s = spec("tensor gain: bf16[H], tensor bias: f32[H, Q_LEN], score: gain[h] * score + bias[h][q]");
        assert_eq!(expr_source(&s, &d_score(&s).unwrap()), "gain[h]");
        assert_eq!(expr_source(&s, &d_load(&s, 0).unwrap()), "score");
        assert_eq!(expr_source(&s, &d_load(&s, 1).unwrap()), "1.0");
        assert_eq!(d_load(&s, 2), None);
        let two_reads = spec("tensor t: f32[KV_LEN], score: score + t[q] - t[k]");
        assert_eq!(d_load(&two_reads, 0), None);
        let int = spec("tensor n: i32[H], score: score * n[h] as f32");
        assert_eq!(d_load(&int, 0), None);
        let mask_only = spec("tensor t: f32[H], mask: t[h] > 0.0");
        assert_eq!((d_score(&mask_only), d_load(&mask_only, 0)), (None, None));
    }
}
