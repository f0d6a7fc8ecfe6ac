//! Specs compared field for field and float for float by their bits: the
//! identity the runtime keys compiled kernels on, checked without printing
//! the spec ([`crate::to_source`] allocates and formats on every call).
//!
//! `==` (derived) equates `0.0` and `-0.0`, which print, and emit,
//! differently; [`Spec::same_structure`] does not, so specs it equates
//! print the same text and generate the same kernels.

use crate::spec::{Expr, ExprKind, Spec};

impl Spec {
    /// Whether `self` and `other` are identical: every field equal, float
    /// literals bit for bit.
    pub fn same_structure(&self, other: &Spec) -> bool {
        // Destructured, so a new field cannot be left out unnoticed.
        let Spec { name, doc, public, dtype, head_dims, params, tensors, mask, score, sink } = self;
        let same = |a: &Option<Expr>, b: &Option<Expr>| match (a, b) {
            (Some(a), Some(b)) => a.same_structure(b),
            (a, b) => a.is_none() && b.is_none(),
        };
        (name, doc, public, dtype, head_dims, params, tensors)
            == (&other.name, &other.doc, &other.public, &other.dtype, &other.head_dims, &other.params, &other.tensors)
            && same(mask, &other.mask)
            && same(score, &other.score)
            && same(sink, &other.sink)
    }
}

impl Expr {
    /// Whether the two trees are identical, float literals bit for bit.
    pub fn same_structure(&self, other: &Expr) -> bool {
        let all = |a: &[Expr], b: &[Expr]| a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.same_structure(b));
        // Exhaustive over `self`, so a new kind of node cannot be left out.
        self.ty == other.ty
            && match (&self.kind, &other.kind) {
                (ExprKind::Float(a), b) => matches!(b, ExprKind::Float(b) if a.to_bits() == b.to_bits()),
                // The leaves without floats: `==` is exact on them.
                (a @ (ExprKind::Bool(_) | ExprKind::Int(_) | ExprKind::Builtin(_) | ExprKind::Param(_)), b) => a == b,
                (ExprKind::Load(t, a), b) => matches!(b, ExprKind::Load(u, b) if t == u && all(a, b)),
                (ExprKind::Unary(op, a), b) => matches!(b, ExprKind::Unary(oq, b) if op == oq && a.same_structure(b)),
                (ExprKind::Binary(op, a, b), other) => matches!(other,
                    ExprKind::Binary(oq, c, d) if op == oq && a.same_structure(c) && b.same_structure(d)),
                (ExprKind::Cast(a), b) => matches!(b, ExprKind::Cast(b) if a.same_structure(b)),
                (ExprKind::Call(f, a), b) => matches!(b, ExprKind::Call(g, b) if f == g && all(a, b)),
                (ExprKind::If(c, t, e), other) => matches!(other,
                    ExprKind::If(d, u, f) if c.same_structure(d) && t.same_structure(u) && e.same_structure(f)),
            }
    }
}
