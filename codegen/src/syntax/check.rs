//! Type checking: `syn` expressions → typed [`Expr`] trees.
//!
//! The language is a small, Rust-flavoured scalar language over i32, f32 and
//! bool. Types are strict like Rust's (mixing i32 and f32 needs `as`), with
//! one convenience: an integer literal next to an f32 operand is read as f32,
//! so `score / 30` works. As in Rust, `!` is logical not on bool and
//! bitwise complement on i32, and `& | ^ << >>` take i32 only.

use crate::error::{err, SpecError};
use crate::spec::{BinOp, Builtin, Domain, Expr, ExprKind, Func, Param, TensorDecl, Ty, UnOp};
use syn::spanned::Spanned;

/// Which expression is being checked: it decides the expected result type
/// and which built-ins are in scope.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Mask,
    Score,
    /// One value per row's softmax, shared by every query of a (b, h):
    /// only `b`, `h`, params and tensors, so kernels evaluate it once per
    /// row whatever their rows' layout (varlen and decode bind `q_len`
    /// and `kv_len` per sequence, and the backward's row kernels have no
    /// keys).
    Sink,
}

pub(crate) struct Scope<'a> {
    pub params: &'a [Param],
    pub tensors: &'a [TensorDecl],
}

/// Names a param or tensor may not take.
pub(crate) fn is_reserved(name: &str) -> bool {
    Builtin::ALL.iter().any(|(n, _)| *n == name)
        || Func::ALL.iter().any(|(n, _)| *n == name)
        || matches!(name, "true" | "false" | "param" | "tensor")
}

impl Scope<'_> {
    pub fn check(&self, e: &syn::Expr, role: Role) -> Result<Expr, SpecError> {
        let typed = Checker { scope: self, role }.expr(e)?;
        let want = match role {
            Role::Mask => Ty::Bool,
            Role::Score | Role::Sink => Ty::F32,
        };
        let typed = coerce_literal(typed, want);
        if typed.ty != want {
            let what = match role {
                Role::Mask => "mask",
                Role::Score => "score",
                Role::Sink => "sink",
            };
            return err(e.span(), format!("the {what} must be {want}, found {}", typed.ty));
        }
        Ok(typed)
    }
}

struct Checker<'a> {
    scope: &'a Scope<'a>,
    role: Role,
}

impl Checker<'_> {
    fn expr(&self, e: &syn::Expr) -> Result<Expr, SpecError> {
        match e {
            syn::Expr::Lit(lit) => literal(&lit.lit),
            syn::Expr::Paren(p) => self.expr(&p.expr),
            syn::Expr::Group(g) => self.expr(&g.expr),
            syn::Expr::Path(p) => self.name(p),
            syn::Expr::Unary(u) => self.unary(u),
            syn::Expr::Binary(b) => self.binary(b),
            syn::Expr::Cast(c) => self.cast(c),
            syn::Expr::Call(c) => self.call(c),
            syn::Expr::Index(i) => self.index(i),
            syn::Expr::If(i) => self.if_else(i),
            syn::Expr::Block(b) => self.block(&b.block),
            other => err(other.span(), "unsupported expression: expected arithmetic, bitwise operators, comparisons, `&&`/`||`/`!`, `if`/`else`, casts, calls or tensor indexing"),
        }
    }

    fn name(&self, p: &syn::ExprPath) -> Result<Expr, SpecError> {
        let Some(id) = p.path.get_ident() else {
            return err(p.span(), "expected a simple name");
        };
        let name = id.to_string();
        if let Some((_, b)) = Builtin::ALL.iter().find(|(n, _)| *n == name) {
            if *b == Builtin::Score && self.role == Role::Mask {
                return err(
                    id.span(),
                    "`score` cannot be used in a mask: a mask depends only on positions, params and tensors",
                );
            }
            if self.role == Role::Sink && !matches!(b, Builtin::B | Builtin::H) {
                return err(
                    id.span(),
                    format!("`{name}` cannot be used in a sink: a sink is one logit per row of a (b, h), over `b`, `h`, params and tensors"),
                );
            }
            return Ok(Expr { ty: b.ty(), kind: ExprKind::Builtin(*b) });
        }
        if let Some(i) = self.scope.params.iter().position(|p| p.name == name) {
            return Ok(Expr { ty: self.scope.params[i].ty, kind: ExprKind::Param(i) });
        }
        if self.scope.tensors.iter().any(|t| t.name == name) {
            return err(id.span(), format!("tensor `{name}` must be indexed, e.g. `{name}[h]`"));
        }
        err(
            id.span(),
            format!("unknown name `{name}`: expected b, h, q, k, q_len, kv_len, score, or a declared param or tensor"),
        )
    }

    fn unary(&self, u: &syn::ExprUnary) -> Result<Expr, SpecError> {
        // `-2147483648` is only in range once negated.
        if let (syn::UnOp::Neg(_), syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(i), .. })) = (&u.op, &*u.expr) {
            if matches!(i.suffix(), "" | "i32") {
                return match i.base10_parse::<i64>().ok().and_then(|v| i32::try_from(-v).ok()) {
                    Some(v) => Ok(Expr { ty: Ty::I32, kind: ExprKind::Int(v) }),
                    None => err(u.span(), "integer literal out of range for i32"),
                };
            }
        }
        let a = self.expr(&u.expr)?;
        let op = match (u.op, a.ty) {
            (syn::UnOp::Neg(_), Ty::I32 | Ty::F32) => UnOp::Neg,
            (syn::UnOp::Not(_), Ty::Bool) => UnOp::Not,
            (syn::UnOp::Not(_), Ty::I32) => UnOp::BitNot,
            (syn::UnOp::Neg(_), _) => return err(u.span(), format!("cannot apply `-` to {}", a.ty)),
            (syn::UnOp::Not(_), _) => {
                return err(
                    u.span(),
                    format!("cannot apply `!` to {}: it is logical not on bool, bitwise not on i32", a.ty),
                )
            }
            _ => return err(u.op.span(), "unsupported unary operator"),
        };
        // Fold `-literal` so that literals keep their flexible type.
        let kind = match (op, &a.kind) {
            (UnOp::Neg, ExprKind::Int(v)) => ExprKind::Int(v.wrapping_neg()),
            (UnOp::Neg, ExprKind::Float(v)) => ExprKind::Float(-v),
            _ => ExprKind::Unary(op, Box::new(a.clone())),
        };
        Ok(Expr { ty: a.ty, kind })
    }

    fn binary(&self, b: &syn::ExprBinary) -> Result<Expr, SpecError> {
        let op = bin_op(&b.op).ok_or_else(|| {
            SpecError::new(b.op.span(), "unsupported operator: expected + - * / % & | ^ << >> < <= > >= == != && ||")
        })?;
        let (l, r) = (self.expr(&b.left)?, self.expr(&b.right)?);
        // Logic takes bools and bit operations i32s, with no literal
        // coercion: `x & 1.0` is an error, not a float operation.
        let only = if op.is_logical() { Some(Ty::Bool) } else { op.is_bitwise().then_some(Ty::I32) };
        if let Some(want) = only {
            for (side, e) in [(&*b.left, &l), (&*b.right, &r)] {
                if e.ty != want {
                    let hint = match (op, e.ty) {
                        (BinOp::BitAnd, Ty::Bool) => "; for bools use `&&`",
                        (BinOp::BitOr, Ty::Bool) => "; for bools use `||`",
                        _ => "",
                    };
                    let sym = op.symbol();
                    return err(side.span(), format!("`{sym}` needs {want} operands, found {}{hint}", e.ty));
                }
            }
            return Ok(Expr { ty: want, kind: ExprKind::Binary(op, Box::new(l), Box::new(r)) });
        }
        let (lt, rt) = (l.ty, r.ty);
        let (l, r) = (coerce_literal(l, rt), coerce_literal(r, lt));
        if l.ty != r.ty {
            return err(
                b.span(),
                format!("mismatched types: {} {} {}; convert one side with `as`", l.ty, op.symbol(), r.ty),
            );
        }
        let arithmetic_ok = op.is_comparison() && matches!(op, BinOp::Eq | BinOp::Ne) || l.ty != Ty::Bool;
        if !arithmetic_ok {
            return err(b.span(), format!("cannot apply `{}` to bool", op.symbol()));
        }
        let ty = if op.is_comparison() { Ty::Bool } else { l.ty };
        Ok(Expr { ty, kind: ExprKind::Binary(op, Box::new(l), Box::new(r)) })
    }

    fn cast(&self, c: &syn::ExprCast) -> Result<Expr, SpecError> {
        let a = self.expr(&c.expr)?;
        let ty = match &*c.ty {
            syn::Type::Path(p) if p.path.is_ident("i32") => Ty::I32,
            syn::Type::Path(p) if p.path.is_ident("f32") => Ty::F32,
            other => return err(other.span(), "can only cast to `i32` or `f32`"),
        };
        // A cast of a literal stays a cast: `1 as i32` is no longer flexible.
        if a.ty == ty && !matches!(a.kind, ExprKind::Int(_)) {
            return Ok(a);
        }
        if a.ty == Ty::Bool && ty == Ty::F32 {
            return err(c.span(), "cannot cast bool to f32; cast to i32 first, or use `if`");
        }
        Ok(Expr { ty, kind: ExprKind::Cast(Box::new(a)) })
    }

    fn call(&self, c: &syn::ExprCall) -> Result<Expr, SpecError> {
        let name = match &*c.func {
            syn::Expr::Path(p) => p.path.get_ident().map(|i| i.to_string()),
            _ => None,
        };
        let Some(func) = name.as_deref().and_then(|n| Func::ALL.iter().find(|(f, _)| *f == n)).map(|(_, f)| *f) else {
            let names: Vec<&str> = Func::ALL.iter().map(|(n, _)| *n).collect();
            return err(c.func.span(), format!("unknown function: expected one of {}", names.join(", ")));
        };
        if c.args.len() != func.arity() {
            return err(
                c.span(),
                format!("`{}` takes {} argument(s), found {}", func.name(), func.arity(), c.args.len()),
            );
        }
        let args: Vec<Expr> = c.args.iter().map(|a| self.expr(a)).collect::<Result<_, _>>()?;
        // A numeric function's result is f32 if any argument is f32.
        let ty = match func.domain() {
            Domain::Float => Ty::F32,
            Domain::Int => Ty::I32,
            Domain::Numeric if args.iter().any(|a| a.ty == Ty::F32) => Ty::F32,
            Domain::Numeric => Ty::I32,
        };
        let args: Vec<Expr> = args.into_iter().map(|a| coerce_literal(a, ty)).collect();
        for (a, syn_a) in args.iter().zip(&c.args) {
            if a.ty != ty {
                return err(syn_a.span(), format!("`{}` expects {ty} here, found {}", func.name(), a.ty));
            }
        }
        Ok(Expr { ty, kind: ExprKind::Call(func, args) })
    }

    fn index(&self, e: &syn::ExprIndex) -> Result<Expr, SpecError> {
        // `t[i][j]` nests as Index(Index(t, i), j): unwind to the base name.
        let mut indices = vec![&*e.index];
        let mut base = &*e.expr;
        while let syn::Expr::Index(inner) = base {
            indices.push(&inner.index);
            base = &inner.expr;
        }
        indices.reverse();
        let name = match base {
            syn::Expr::Path(p) => p.path.get_ident().map(|i| i.to_string()),
            _ => None,
        };
        let Some(slot) = name.as_ref().and_then(|n| self.scope.tensors.iter().position(|t| &t.name == n)) else {
            return err(base.span(), "only declared tensors can be indexed");
        };
        let tensor = &self.scope.tensors[slot];
        if indices.len() != tensor.dims.len() {
            return err(
                e.span(),
                format!(
                    "tensor `{}` has {} dimension(s) but is indexed with {}",
                    tensor.name,
                    tensor.dims.len(),
                    indices.len()
                ),
            );
        }
        let args = indices
            .into_iter()
            .map(|i| {
                let a = self.expr(i)?;
                if a.ty != Ty::I32 {
                    return err(i.span(), format!("an index must be i32, found {}", a.ty));
                }
                Ok(a)
            })
            .collect::<Result<_, _>>()?;
        Ok(Expr { ty: tensor.elem.value_ty(), kind: ExprKind::Load(slot, args) })
    }

    fn if_else(&self, i: &syn::ExprIf) -> Result<Expr, SpecError> {
        let cond = self.expr(&i.cond)?;
        if cond.ty != Ty::Bool {
            return err(i.cond.span(), format!("an `if` condition must be bool, found {}", cond.ty));
        }
        let Some((_, else_branch)) = &i.else_branch else {
            return err(i.span(), "an `if` needs an `else` branch: every expression must have a value");
        };
        let then = self.block(&i.then_branch)?;
        let other = self.expr(else_branch)?;
        let (tt, ot) = (then.ty, other.ty);
        let (then, other) = (coerce_literal(then, ot), coerce_literal(other, tt));
        if then.ty != other.ty {
            return err(i.span(), format!("`if` branches have different types: {} and {}", then.ty, other.ty));
        }
        Ok(Expr { ty: then.ty, kind: ExprKind::If(Box::new(cond), Box::new(then), Box::new(other)) })
    }

    fn block(&self, b: &syn::Block) -> Result<Expr, SpecError> {
        match b.stmts.as_slice() {
            [syn::Stmt::Expr(e, None)] => self.expr(e),
            _ => err(b.span(), "a block must hold exactly one expression"),
        }
    }
}

fn literal(lit: &syn::Lit) -> Result<Expr, SpecError> {
    match lit {
        syn::Lit::Bool(b) => Ok(Expr { ty: Ty::Bool, kind: ExprKind::Bool(b.value) }),
        syn::Lit::Int(i) => match (i.suffix(), i.base10_parse::<i32>()) {
            ("" | "i32", Ok(v)) => Ok(Expr { ty: Ty::I32, kind: ExprKind::Int(v) }),
            ("f32", _) => match i.base10_parse::<f32>() {
                Ok(v) => Ok(Expr { ty: Ty::F32, kind: ExprKind::Float(v) }),
                Err(_) => err(i.span(), "invalid f32 literal"),
            },
            ("" | "i32", Err(_)) => err(i.span(), "integer literal out of range for i32"),
            (suffix, _) => err(i.span(), format!("unsupported literal suffix `{suffix}`: expected i32 or f32")),
        },
        syn::Lit::Float(f) => match (f.suffix(), f.base10_parse::<f32>()) {
            ("" | "f32", Ok(v)) if v.is_finite() => Ok(Expr { ty: Ty::F32, kind: ExprKind::Float(v) }),
            ("" | "f32", _) => err(f.span(), "invalid f32 literal"),
            (suffix, _) => err(f.span(), format!("unsupported literal suffix `{suffix}`: expected f32")),
        },
        other => err(other.span(), "unsupported literal: expected an integer, a float or a bool"),
    }
}

fn bin_op(op: &syn::BinOp) -> Option<BinOp> {
    use syn::BinOp as S;
    Some(match op {
        S::Add(_) => BinOp::Add,
        S::Sub(_) => BinOp::Sub,
        S::Mul(_) => BinOp::Mul,
        S::Div(_) => BinOp::Div,
        S::Rem(_) => BinOp::Rem,
        S::Lt(_) => BinOp::Lt,
        S::Le(_) => BinOp::Le,
        S::Gt(_) => BinOp::Gt,
        S::Ge(_) => BinOp::Ge,
        S::Eq(_) => BinOp::Eq,
        S::Ne(_) => BinOp::Ne,
        S::And(_) => BinOp::And,
        S::Or(_) => BinOp::Or,
        S::BitAnd(_) => BinOp::BitAnd,
        S::BitOr(_) => BinOp::BitOr,
        S::BitXor(_) => BinOp::BitXor,
        S::Shl(_) => BinOp::Shl,
        S::Shr(_) => BinOp::Shr,
        _ => return None,
    })
}

/// Reads an integer literal as f32 when it stands next to an f32.
fn coerce_literal(e: Expr, want: Ty) -> Expr {
    match e.kind {
        ExprKind::Int(v) if want == Ty::F32 => Expr { ty: Ty::F32, kind: ExprKind::Float(v as f32) },
        _ => e,
    }
}
