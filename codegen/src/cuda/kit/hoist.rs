//! Loop-invariant spec terms, computed once at the level they vary.
//!
//! The forward kernel evaluates the mask and score on every element of S,
//! but parts of them often vary more slowly: `slopes[h]` is fixed for the
//! whole thread block, `doc[b][q]` per query row, `doc[b][k]` per key. Such
//! subexpressions, when they are worth it (they read a tensor or call a
//! transcendental function), are hoisted: CTA-level ones into a constant at
//! the top of the kernel, row-level ones into a register per row a lane owns,
//! column-level ones into a register per key column of the current tile.
//! Cheap integer arithmetic on positions stays inline, except an integer
//! division by a run-time value that is fixed for the whole CTA: it becomes
//! a constant of its own, computed once instead of per element with its
//! special cases (by 0, by -1, the Euclidean fix-up). Divisions left in the
//! loops guard those cases with selects, not branches (`prelude.cuh`): NVVM
//! unswitched a fully unrolled loop over a tile's elements or columns on
//! each branch's invariant guard and took from minutes to over half an
//! hour over one kernel.

use crate::spec::{BinOp, Builtin, Expr, ExprKind, Func, Ty};

/// Where a hoisted value is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// Once per thread block (depends on b, h, params at most).
    Cta,
    /// Once per query row (depends on q, not on k or score).
    Row,
    /// Once per key column of each tile (depends on k, not on q or score).
    Column,
}

/// A hoisted subexpression and the C name its value goes by.
pub(crate) struct Hoisted<'a> {
    pub expr: &'a Expr,
    pub level: Level,
    pub name: String,
}

/// The maximal worthwhile invariant subexpressions of `exprs`, in a
/// deterministic order, named `inv_0`, `inv_1`, ...
pub(crate) fn hoist<'a>(exprs: &[&'a Expr]) -> Vec<Hoisted<'a>> {
    let mut out = Vec::new();
    for e in exprs {
        collect(e, &mut out);
    }
    out
}

/// Looks `e` up among `hoisted` (by identity), giving its C value at the
/// forward's element loop: a constant, `inv_N[i]` for row slot `i`,
/// `inv_N[n][c]` for column slot `(n, c)`.
pub(crate) fn lookup(hoisted: &[Hoisted], e: &Expr) -> Option<String> {
    lookup_indexed(hoisted, e, |level| match level {
        Level::Cta => "",
        Level::Row => "[i]",
        Level::Column => "[n][c]",
    })
}

/// Looks `e` up among `hoisted` (by identity): its name followed by the
/// index a loop keeps values of its level under (`index(level)`).
pub(crate) fn lookup_indexed(hoisted: &[Hoisted], e: &Expr, index: impl Fn(Level) -> &'static str) -> Option<String> {
    let h = hoisted.iter().find(|h| std::ptr::eq(h.expr, e))?;
    Some(format!("{}{}", h.name, index(h.level)))
}

/// [`lookup_indexed`] by value, for a copy of the spec's expressions (a
/// mask rewritten with q and k swapped), whose nodes are not the hoisted
/// ones.
pub(crate) fn lookup_equal_indexed(
    hoisted: &[Hoisted],
    e: &Expr,
    index: impl Fn(Level) -> &'static str,
) -> Option<String> {
    let h = hoisted.iter().find(|h| h.expr == e)?;
    Some(format!("{}{}", h.name, index(h.level)))
}

fn collect<'a>(e: &'a Expr, out: &mut Vec<Hoisted<'a>>) {
    let invariant_division = level(e) == Some(Level::Cta) && divides_at_run_time(e);
    if let Some(level) = level(e).filter(|_| costly(e) || invariant_division) {
        let name = format!("inv_{}", out.len());
        out.push(Hoisted { expr: e, level, name });
        return;
    }
    let mut children = Vec::new();
    match &e.kind {
        ExprKind::Load(_, args) | ExprKind::Call(_, args) => children.extend(args),
        ExprKind::Unary(_, a) | ExprKind::Cast(a) => children.push(&**a),
        ExprKind::Binary(_, a, b) => children.extend([&**a, &**b]),
        ExprKind::If(c, t, f) => children.extend([&**c, &**t, &**f]),
        _ => {}
    }
    for child in children {
        collect(child, out);
    }
}

/// The level `e` is invariant at, or `None` if it varies per element.
fn level(e: &Expr) -> Option<Level> {
    let (q, k, score) = (e.uses(Builtin::Q), e.uses(Builtin::K), e.uses(Builtin::Score));
    match (q, k, score) {
        (_, _, true) | (true, true, _) => None,
        (true, false, _) => Some(Level::Row),
        (false, true, _) => Some(Level::Column),
        (false, false, _) => Some(Level::Cta),
    }
}

/// Worth a register: a memory read or a transcendental function somewhere.
fn costly(e: &Expr) -> bool {
    let mut found = false;
    e.walk(&mut |n| {
        found |= match &n.kind {
            ExprKind::Load(..) => true,
            ExprKind::Call(f, _) => f.is_transcendental(),
            _ => false,
        }
    });
    found
}

/// `e` is an integer division or remainder by a value known only at run
/// time (a constant divisor compiles to a multiply, without branches).
fn divides_at_run_time(e: &Expr) -> bool {
    match &e.kind {
        ExprKind::Call(Func::DivEuclid | Func::RemEuclid, args) => !constant(&args[1]),
        ExprKind::Binary(BinOp::Div | BinOp::Rem, _, d) => e.ty == Ty::I32 && !constant(d),
        _ => false,
    }
}

/// Whether `e` is known when the kernel is generated: no position, param
/// or tensor in it.
fn constant(e: &Expr) -> bool {
    let mut known = true;
    e.walk(&mut |n| known &= !matches!(n.kind, ExprKind::Builtin(_) | ExprKind::Param(_) | ExprKind::Load(..)));
    known
}

#[cfg(test)]
mod tests {
    use super::*;

    fn levels(source: &str) -> Vec<(Level, String)> {
        let spec = crate::parse_one(source).unwrap();
        let exprs: Vec<&Expr> = spec.mask.iter().chain(spec.score.iter()).collect();
        hoist(&exprs).iter().map(|h| (h.level, crate::syntax::expr_source(&spec, h.expr))).collect()
    }

    #[test]
    fn invariant_reads_are_hoisted_to_their_level() {
        let doc = "S { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k }";
        assert_eq!(levels(doc), [(Level::Row, "doc[b][q]".into()), (Level::Column, "doc[b][k]".into())]);
        let alibi = "S { dtype: bf16, head_dim: 64, tensor slopes: f32[H], score: score + slopes[h] * (k - q) as f32 }";
        assert_eq!(levels(alibi), [(Level::Cta, "slopes[h]".into())]);
        let bias =
            "S { dtype: bf16, head_dim: 64, tensor rel: f32[H, 9], score: score + rel[h][clamp(k - q, -4, 4) + 4] }";
        assert_eq!(levels(bias), [], "per-element reads stay in place");
        let cheap = "S { dtype: bf16, head_dim: 64, param w: i32, mask: q - k < w && (q - k) / 4 < 9 }";
        assert_eq!(levels(cheap), [], "integer arithmetic on positions stays inline");
        let divided = "S { dtype: bf16, head_dim: 64, param w: i32, mask: q / w >= k / -(2) && div_euclid(h, w) < 3 }";
        let divisions = [(Level::Cta, "div_euclid(h, w)".into())];
        assert_eq!(levels(divided), divisions, "a CTA's divisions by run-time values are hoisted, alone");
    }
}
