//! Tensor dimensions: launch-size symbols, integer constants, and `+ - *`
//! of them with `/` by a positive constant (`2 * KV_LEN - 1`,
//! `(Q_LEN + 63) / 64`). Constant parts fold to their value, so
//! `f32[2 * 8]` and `f32[16]` are one spec.

use crate::error::{err, SpecError};
use crate::spec::{Builtin, Dim, DimOp, Param};
use syn::spanned::Spanned;

const ALLOWED: &str = "`B`, `H`, `H_KV`, `Q_LEN`, `KV_LEN`, a positive integer, or `+ - *` of them and `/` by a \
                       positive integer (e.g. `2 * KV_LEN - 1`)";

/// One dimension of a tensor declaration.
pub(super) fn lower_dim(e: &syn::Expr, params: &[Param]) -> Result<Dim, SpecError> {
    if let syn::Expr::Lit(lit) = e {
        // A constant alone may use all of u32 (the kernels clip in 64 bits).
        return match int_literal(e).filter(|l| l.suffix().is_empty()).map(|l| l.base10_parse::<u32>()) {
            Some(Ok(n)) if n > 0 => Ok(Dim::Const(n)),
            _ => err(lit.span(), "a constant dimension must be a positive integer"),
        };
    }
    match lower(e, params)? {
        Dim::Const(0) => err(e.span(), "this dimension is 0: a dimension must be at least 1"),
        dim => Ok(dim),
    }
}

fn lower(e: &syn::Expr, params: &[Param]) -> Result<Dim, SpecError> {
    match e {
        syn::Expr::Paren(p) => lower(&p.expr, params),
        syn::Expr::Group(g) => lower(&g.expr, params),
        syn::Expr::Lit(_) => {
            let lit = int_literal(e).filter(|l| l.suffix().is_empty());
            match lit.and_then(|l| l.base10_parse::<i32>().ok()) {
                Some(n) => Ok(Dim::Const(n as u32)),
                None => err(e.span(), "a constant in a dimension expression must be an integer from 0 to 2147483647"),
            }
        }
        syn::Expr::Path(p) => symbol(p, params),
        syn::Expr::Binary(b) => {
            let op = match b.op {
                syn::BinOp::Add(_) => DimOp::Add,
                syn::BinOp::Sub(_) => DimOp::Sub,
                syn::BinOp::Mul(_) => DimOp::Mul,
                syn::BinOp::Div(_) => DimOp::Div,
                _ => return err(b.op.span(), format!("unsupported operator in a dimension: expected {ALLOWED}")),
            };
            let (l, r) = (lower(&b.left, params)?, lower(&b.right, params)?);
            if op == DimOp::Div && !matches!(r, Dim::Const(c) if c > 0) {
                return err(b.right.span(), "a dimension may divide only by a positive integer constant");
            }
            let (Dim::Const(x), Dim::Const(y)) = (&l, &r) else {
                return Ok(Dim::Op(op, Box::new(l), Box::new(r)));
            };
            // Constants fold, so each constant a kernel sees is an i32.
            let (x, y) = (i64::from(*x), i64::from(*y));
            let v = match op {
                DimOp::Add => x + y,
                DimOp::Sub => x - y,
                DimOp::Mul => x * y,
                DimOp::Div => x / y,
            };
            match u32::try_from(v) {
                Ok(n) if i32::try_from(v).is_ok() => Ok(Dim::Const(n)),
                _ => {
                    err(b.span(), format!("this part of the dimension is {v}: constants must be from 0 to 2147483647"))
                }
            }
        }
        _ => err(e.span(), format!("unsupported tensor dimension: expected {ALLOWED}")),
    }
}

fn symbol(p: &syn::ExprPath, params: &[Param]) -> Result<Dim, SpecError> {
    let Some(id) = p.path.get_ident() else {
        return err(p.span(), format!("unsupported tensor dimension: expected {ALLOWED}"));
    };
    if let Some((_, d)) = Dim::SYMBOLS.iter().find(|(s, _)| id == s) {
        return Ok(d.clone());
    }
    let name = id.to_string();
    let message = if params.iter().any(|p| p.name == name) {
        format!("param `{name}` cannot size a tensor: dimensions use only the launch sizes and constants, {ALLOWED}")
    } else if let Some(upper) = Builtin::ALL.iter().find(|(n, _)| *n == name).map(|(n, _)| n.to_uppercase()) {
        format!("unknown dimension `{name}`: the launch sizes are upper-case here, e.g. `{upper}`")
    } else {
        format!("unknown dimension `{name}`: expected {ALLOWED}")
    };
    err(id.span(), message)
}

fn int_literal(e: &syn::Expr) -> Option<&syn::LitInt> {
    match e {
        syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Int(lit), .. }) => Some(lit),
        _ => None,
    }
}
