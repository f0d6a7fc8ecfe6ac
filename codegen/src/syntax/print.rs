//! The canonical printer: a [`Spec`] back to source text.
//!
//! The output parses back to an equal spec, so it serves as the spec's
//! identity across processes (the runtime's disk cache and tuning records
//! key on it) and as the text the macro embeds in the code it generates.

use crate::spec::{BinOp, Expr, ExprKind, Spec, UnOp};
use std::fmt::Write;

/// Prints `spec` in canonical form: fixed field order, minimal parentheses.
pub fn to_source(spec: &Spec) -> String {
    let mut out = String::new();
    for line in &spec.doc {
        let _ = writeln!(out, "/// {line}");
    }
    let vis = if spec.public { "pub " } else { "" };
    let _ = writeln!(out, "{vis}{} {{", spec.name);
    let _ = writeln!(out, "    dtype: {},", spec.dtype);
    let _ = writeln!(out, "    head_dim: {},", spec.head_dims.qk);
    if spec.head_dims.v != spec.head_dims.qk {
        let _ = writeln!(out, "    v_head_dim: {},", spec.head_dims.v);
    }
    for p in &spec.params {
        let _ = writeln!(out, "    param {}: {},", p.name, p.ty);
    }
    for t in &spec.tensors {
        let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        let _ = writeln!(out, "    tensor {}: {}[{}],", t.name, t.elem.name(), dims.join(", "));
    }
    if let Some(mask) = &spec.mask {
        let _ = writeln!(out, "    mask: {},", expr_source(spec, mask));
    }
    if let Some(score) = &spec.score {
        let _ = writeln!(out, "    score: {},", expr_source(spec, score));
    }
    if let Some(sink) = &spec.sink {
        let _ = writeln!(out, "    sink: {},", expr_source(spec, sink));
    }
    out.push_str("}\n");
    out
}

/// Prints one expression of `spec` in the spec language.
pub fn expr_source(spec: &Spec, e: &Expr) -> String {
    let mut out = String::new();
    write_expr(&mut out, spec, e, 0);
    out
}

/// Writes `e`, parenthesized if its own precedence is below `min_prec`.
fn write_expr(out: &mut String, spec: &Spec, e: &Expr, min_prec: u8) {
    match &e.kind {
        ExprKind::Bool(v) => {
            let _ = write!(out, "{v}");
        }
        ExprKind::Int(v) => {
            let _ = write!(out, "{v}");
        }
        ExprKind::Float(v) => {
            let _ = write!(out, "{v:?}");
        }
        ExprKind::Builtin(b) => out.push_str(b.name()),
        ExprKind::Param(i) => out.push_str(&spec.params[*i].name),
        ExprKind::Load(t, idx) => {
            out.push_str(&spec.tensors[*t].name);
            for i in idx {
                out.push('[');
                write_expr(out, spec, i, 0);
                out.push(']');
            }
        }
        ExprKind::Unary(op, a) => {
            out.push(if *op == UnOp::Neg { '-' } else { '!' });
            write_expr(out, spec, a, UNARY_PREC);
        }
        ExprKind::Binary(op, a, b) => {
            let prec = op.precedence();
            let open = prec < min_prec;
            if open {
                out.push('(');
            }
            // Left-associative: the right operand needs strictly tighter
            // binding. Comparisons don't chain in Rust, so both sides do.
            let left = if op.is_comparison() { prec + 1 } else { prec };
            write_expr(out, spec, a, left.max(BINARY_OPERAND));
            let _ = write!(out, " {} ", op.symbol());
            write_expr(out, spec, b, (prec + 1).max(BINARY_OPERAND));
            if open {
                out.push(')');
            }
        }
        ExprKind::Cast(a) => {
            // Casts are parenthesized whenever they sit inside another
            // operator: `x as f32 < y` would parse as a generic type.
            let open = min_prec > 0;
            if open {
                out.push('(');
            }
            write_expr(out, spec, a, UNARY_PREC);
            let _ = write!(out, " as {}", e.ty);
            if open {
                out.push(')');
            }
        }
        ExprKind::Call(f, args) => {
            out.push_str(f.name());
            out.push('(');
            for (i, a) in args.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_expr(out, spec, a, 0);
            }
            out.push(')');
        }
        ExprKind::If(c, t, f) => {
            let open = min_prec > 0;
            if open {
                out.push('(');
            }
            out.push_str("if ");
            write_expr(out, spec, c, 0);
            out.push_str(" { ");
            write_expr(out, spec, t, 0);
            out.push_str(" } else { ");
            write_expr(out, spec, f, 0);
            out.push_str(" }");
            if open {
                out.push(')');
            }
        }
    }
}

/// Operands of binary operators sit at least here, so casts and `if`s
/// inside them get parentheses.
const BINARY_OPERAND: u8 = 1;
/// Tighter than any binary operator: operands of `-`, `!` and `as`.
const UNARY_PREC: u8 = BinOp::Mul.precedence() + 1;
