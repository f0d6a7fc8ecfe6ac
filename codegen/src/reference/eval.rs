//! The expression interpreter: typed IR trees → values.
//!
//! Evaluation is total. A checked spec only ever combines values of the types
//! its nodes declare; the conversions below (C's: bool ↔ 0/1, float → int by
//! truncation) exist so that evaluation needs no failure path.

use super::ReferenceError;
use crate::spec::{BinOp, Builtin, ElemTy, Expr, ExprKind, Func, Shape, Spec, Ty, UnOp};

/// The value of an expression. `F32` is an f32-typed value: under
/// [`Arith::F32`] it always holds an exact f32, under [`Arith::F64`] the f64
/// that the golden reference computes in its place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    Bool(bool),
    I32(i32),
    F32(f64),
}

impl Value {
    pub(super) fn as_bool(self) -> bool {
        match self {
            Value::Bool(b) => b,
            Value::I32(i) => i != 0,
            Value::F32(x) => x != 0.0,
        }
    }

    /// Float → int like Rust's `as`: truncating, saturating, NaN → 0.
    pub(super) fn as_i32(self) -> i32 {
        match self {
            Value::Bool(b) => i32::from(b),
            Value::I32(i) => i,
            Value::F32(x) => x as i32,
        }
    }

    pub(super) fn as_f64(self) -> f64 {
        match self {
            Value::Bool(b) => f64::from(u8::from(b)),
            Value::I32(i) => f64::from(i),
            Value::F32(x) => x,
        }
    }
}

/// The precision of f32-typed arithmetic: `F32` as on the GPU, `F64` for the
/// golden reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arith {
    F32,
    F64,
}

impl Arith {
    /// Rounds the f64 result of one operation to this precision. For + − × ÷
    /// and √ of f32 operands this equals f32 arithmetic: f64 carries more than
    /// 2·24 + 2 significand bits, so rounding twice is innocuous.
    fn round(self, x: f64) -> f64 {
        match self {
            Arith::F32 => f64::from(x as f32),
            Arith::F64 => x,
        }
    }

    /// Applies a library function, in f32 where the GPU would.
    fn apply(self, x: f64, in_f32: fn(f32) -> f32, in_f64: fn(f64) -> f64) -> f64 {
        match self {
            Arith::F32 => f64::from(in_f32(x as f32)),
            Arith::F64 => in_f64(x),
        }
    }
}

/// The value of a runtime param, in declaration order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ParamValue {
    I32(i32),
    F32(f32),
}

impl ParamValue {
    pub fn ty(self) -> Ty {
        match self {
            ParamValue::I32(_) => Ty::I32,
            ParamValue::F32(_) => Ty::F32,
        }
    }
}

/// The contents of a captured tensor, row-major. Float elements (f32, f16,
/// bf16) are given already rounded to their storage type.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    I32(Vec<i32>),
    Float(Vec<f64>),
}

/// Where an expression is evaluated: the (b, h, q, k) pair and, for the
/// score expression, the incoming scaled score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Position {
    pub b: i32,
    pub h: i32,
    pub q: i32,
    pub k: i32,
    pub score: f64,
}

/// Everything an expression reads besides its [`Position`]: the launch
/// sizes, params and captured tensors, validated against the spec once.
#[derive(Clone, Debug)]
pub struct Env<'a> {
    arith: Arith,
    q_len: i32,
    kv_len: i32,
    params: &'a [ParamValue],
    tensors: Vec<Tensor<'a>>,
}

#[derive(Clone, Debug)]
struct Tensor<'a> {
    dims: Vec<usize>,
    data: &'a TensorData,
}

impl<'a> Env<'a> {
    /// Checks `params` and `tensors` against the spec's declarations (count,
    /// types, lengths for `shape`) and that every size fits an i32.
    pub fn new(
        spec: &Spec,
        shape: &Shape,
        params: &'a [ParamValue],
        tensors: &'a [TensorData],
        arith: Arith,
    ) -> Result<Self, ReferenceError> {
        let Shape { batch, heads, heads_kv, q_len, kv_len } = *shape;
        let to_i32 = |n: usize| {
            i32::try_from(n).map_err(|_| ReferenceError::Shape(format!("size {n} does not fit the spec's i32")))
        };
        for n in [batch, heads, heads_kv] {
            to_i32(n)?;
        }
        let (q_len, kv_len) = (to_i32(q_len)?, to_i32(kv_len)?);
        if params.len() != spec.params.len() {
            return Err(ReferenceError::Mismatch(format!(
                "{} param value(s) given, the spec declares {}",
                params.len(),
                spec.params.len()
            )));
        }
        for (value, decl) in params.iter().zip(&spec.params) {
            if value.ty() != decl.ty {
                return Err(ReferenceError::Mismatch(format!(
                    "param `{}` is {}, given {}",
                    decl.name,
                    decl.ty,
                    value.ty()
                )));
            }
        }
        if tensors.len() != spec.tensors.len() {
            return Err(ReferenceError::Mismatch(format!(
                "{} tensor(s) given, the spec declares {}",
                tensors.len(),
                spec.tensors.len()
            )));
        }
        let tensors = tensors
            .iter()
            .zip(&spec.tensors)
            .map(|(data, decl)| {
                let found = match (data, decl.elem) {
                    (TensorData::I32(d), ElemTy::I32) => d.len(),
                    (TensorData::Float(d), ElemTy::F32 | ElemTy::F16 | ElemTy::Bf16) => d.len(),
                    _ => {
                        return Err(ReferenceError::Mismatch(format!(
                            "tensor `{}` holds {}, given the other kind of data",
                            decl.name,
                            decl.elem.name()
                        )))
                    }
                };
                let param = |i: usize| match params.get(i) {
                    Some(ParamValue::I32(v)) => Some(*v),
                    _ => None,
                };
                let decl = decl.bind_params(&param);
                decl.check_dims(shape).map_err(|e| ReferenceError::Shape(e.to_string()))?;
                let dims: Vec<usize> = decl.dims.iter().map(|d| d.resolve(shape)).collect();
                check_len(&decl.name, found, &dims)?;
                Ok(Tensor { dims, data })
            })
            .collect::<Result<_, _>>()?;
        Ok(Env { arith, q_len, kv_len, params, tensors })
    }

    /// The built-ins `q_len` and `kv_len` from here on: one varlen
    /// sequence's lengths (at most the shape's, which `new` checked).
    pub(super) fn set_lens(&mut self, q_len: i32, kv_len: i32) {
        (self.q_len, self.kv_len) = (q_len, kv_len);
    }

    /// Evaluates `e` at `at`. Only branches that are taken are evaluated.
    pub fn eval(&self, e: &Expr, at: &Position) -> Value {
        match &e.kind {
            ExprKind::Bool(b) => Value::Bool(*b),
            ExprKind::Int(i) => Value::I32(*i),
            ExprKind::Float(x) => Value::F32(f64::from(*x)),
            ExprKind::Builtin(b) => match b {
                Builtin::B => Value::I32(at.b),
                Builtin::H => Value::I32(at.h),
                Builtin::Q => Value::I32(at.q),
                Builtin::K => Value::I32(at.k),
                Builtin::QLen => Value::I32(self.q_len),
                Builtin::KvLen => Value::I32(self.kv_len),
                Builtin::Score => Value::F32(self.arith.round(at.score)),
            },
            ExprKind::Param(i) => match self.params[*i] {
                ParamValue::I32(v) => Value::I32(v),
                ParamValue::F32(v) => Value::F32(f64::from(v)),
            },
            ExprKind::Load(slot, indices) => self.load(&self.tensors[*slot], indices, at),
            ExprKind::Unary(UnOp::Not, a) => Value::Bool(!self.eval(a, at).as_bool()),
            ExprKind::Unary(UnOp::BitNot, a) => Value::I32(!self.eval(a, at).as_i32()),
            ExprKind::Unary(UnOp::Neg, a) => match self.eval(a, at) {
                Value::F32(x) => Value::F32(-x),
                v => Value::I32(v.as_i32().wrapping_neg()),
            },
            // Both operands are pure and total, so `&&`/`||` need not
            // short-circuit.
            ExprKind::Binary(op, a, b) => {
                let (x, y) = (self.eval(a, at), self.eval(b, at));
                match a.ty {
                    Ty::F32 => float_binary(self.arith, *op, x.as_f64(), y.as_f64()),
                    Ty::I32 | Ty::Bool => int_binary(*op, x.as_i32(), y.as_i32()),
                }
            }
            ExprKind::Cast(a) => {
                let v = self.eval(a, at);
                match e.ty {
                    Ty::Bool => Value::Bool(v.as_bool()),
                    Ty::I32 => Value::I32(v.as_i32()),
                    Ty::F32 => Value::F32(self.arith.round(v.as_f64())),
                }
            }
            ExprKind::Call(func, args) => {
                // Arity is at most 3: no allocation per call.
                let mut v = [Value::I32(0); 3];
                for (slot, a) in v.iter_mut().zip(args) {
                    *slot = self.eval(a, at);
                }
                let [x, y, z] = v;
                match e.ty {
                    Ty::F32 => Value::F32(float_call(self.arith, *func, x.as_f64(), y.as_f64(), z.as_f64())),
                    Ty::I32 | Ty::Bool => Value::I32(int_call(self.arith, *func, x.as_i32(), y.as_i32(), z.as_i32())),
                }
            }
            ExprKind::If(c, t, f) => {
                if self.eval(c, at).as_bool() {
                    self.eval(t, at)
                } else {
                    self.eval(f, at)
                }
            }
        }
    }

    /// The row-major offset `indices` address in a tensor of `dims` at `at`,
    /// every index clamped into `[0, dim − 1]` (also used by the backward
    /// pass, so a clamped read trains the element it actually read).
    pub(crate) fn element(&self, indices: &[Expr], dims: &[usize], at: &Position) -> usize {
        indices.iter().zip(dims).fold(0, |offset, (index, &dim)| {
            let i = usize::try_from(self.eval(index, at).as_i32()).unwrap_or(0);
            offset * dim + i.min(dim.saturating_sub(1))
        })
    }

    /// Row-major load with every index clamped into `[0, dim − 1]`, the
    /// semantics the kernels share. An empty tensor (possible only when the
    /// launch has no rows or keys to evaluate) reads as 0.
    fn load(&self, t: &Tensor, indices: &[Expr], at: &Position) -> Value {
        let offset = self.element(indices, &t.dims, at);
        match t.data {
            TensorData::I32(d) => Value::I32(d.get(offset).copied().unwrap_or(0)),
            TensorData::Float(d) => Value::F32(self.arith.round(d.get(offset).copied().unwrap_or(0.0))),
        }
    }
}

/// Integer operators: `+ - *` wrap, `/` and `%` truncate toward zero (the
/// remainder takes the dividend's sign), by zero they give 0, and
/// `i32::MIN / -1` wraps to `i32::MIN` (`% -1` gives 0). Shifts use the
/// amount's low 5 bits; `>>` is arithmetic.
fn int_binary(op: BinOp, x: i32, y: i32) -> Value {
    let int = |v| Value::I32(v);
    // Two's complement: the shift amount's low 5 bits, as `wrapping_shl` takes them.
    let amount = y as u32;
    match op {
        BinOp::Add => int(x.wrapping_add(y)),
        BinOp::Sub => int(x.wrapping_sub(y)),
        BinOp::Mul => int(x.wrapping_mul(y)),
        BinOp::Div => int(if y == 0 { 0 } else { x.wrapping_div(y) }),
        BinOp::Rem => int(if y == 0 { 0 } else { x.wrapping_rem(y) }),
        BinOp::BitAnd => int(x & y),
        BinOp::BitOr => int(x | y),
        BinOp::BitXor => int(x ^ y),
        BinOp::Shl => int(x.wrapping_shl(amount)),
        BinOp::Shr => int(x.wrapping_shr(amount)),
        _ => Value::Bool(compare(op, x, y)),
    }
}

/// Float operators; `%` is C's `fmod` (exact, so no rounding needed).
fn float_binary(arith: Arith, op: BinOp, x: f64, y: f64) -> Value {
    let float = |v| Value::F32(arith.round(v));
    match op {
        BinOp::Add => float(x + y),
        BinOp::Sub => float(x - y),
        BinOp::Mul => float(x * y),
        BinOp::Div => float(x / y),
        BinOp::Rem => float(x % y),
        _ => Value::Bool(compare(op, x, y)),
    }
}

/// Comparisons and logic (operands other than 0 are true, as in C). NaN
/// compares unequal to everything.
fn compare<T: PartialOrd + Default>(op: BinOp, x: T, y: T) -> bool {
    let truth = |v: &T| *v != T::default();
    match op {
        BinOp::Lt => x < y,
        BinOp::Le => x <= y,
        BinOp::Gt => x > y,
        BinOp::Ge => x >= y,
        BinOp::Eq => x == y,
        BinOp::Ne => x != y,
        BinOp::And => truth(&x) && truth(&y),
        BinOp::Or => truth(&x) || truth(&y),
        // Arithmetic is handled by the callers.
        BinOp::Add
        | BinOp::Sub
        | BinOp::Mul
        | BinOp::Div
        | BinOp::Rem
        | BinOp::BitAnd
        | BinOp::BitOr
        | BinOp::BitXor
        | BinOp::Shl
        | BinOp::Shr => false,
    }
}

/// Functions on i32; `clamp(x, lo, hi) = min(max(x, lo), hi)`, so
/// `lo > hi` gives `hi` rather than a panic. Float-only functions (never
/// typed i32 by the checker) compute in float and truncate.
fn int_call(arith: Arith, func: Func, x: i32, y: i32, z: i32) -> i32 {
    match func {
        Func::Min => x.min(y),
        Func::Max => x.max(y),
        Func::Abs => x.wrapping_abs(),
        Func::Clamp => x.max(y).min(z),
        Func::RemEuclid => {
            if y == 0 {
                0
            } else {
                x.wrapping_rem_euclid(y)
            }
        }
        Func::DivEuclid => {
            if y == 0 {
                0
            } else {
                x.wrapping_div_euclid(y)
            }
        }
        _ => float_call(arith, func, f64::from(x), f64::from(y), f64::from(z)) as i32,
    }
}

/// Float functions. `min`/`max` ignore a NaN operand like `fminf`/`fmaxf`;
/// transcendental functions run in f32 under [`Arith::F32`], like the GPU.
fn float_call(arith: Arith, func: Func, x: f64, y: f64, z: f64) -> f64 {
    match func {
        Func::Min => x.min(y),
        Func::Max => x.max(y),
        Func::Abs => x.abs(),
        Func::Clamp => x.max(y).min(z),
        Func::Floor => x.floor(),
        Func::Sqrt => arith.round(x.sqrt()),
        Func::Exp => arith.apply(x, f32::exp, f64::exp),
        Func::Exp2 => arith.apply(x, f32::exp2, f64::exp2),
        Func::Log => arith.apply(x, f32::ln, f64::ln),
        Func::Log2 => arith.apply(x, f32::log2, f64::log2),
        Func::Tanh => arith.apply(x, f32::tanh, f64::tanh),
        // 1 / (1 + exp(−x)), each step rounded like the GPU's f32 code.
        Func::Sigmoid => arith.round(1.0 / arith.round(1.0 + arith.apply(-x, f32::exp, f64::exp))),
        // i32-only (never typed f32 by the checker): in i32.
        Func::RemEuclid | Func::DivEuclid => f64::from(int_call(arith, func, x as i32, y as i32, z as i32)),
    }
}

/// Fails unless a buffer of `found` elements matches `dims`.
pub(super) fn check_len(buffer: &str, found: usize, dims: &[usize]) -> Result<(), ReferenceError> {
    let expected = dims
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| ReferenceError::Shape(format!("`{buffer}` has more elements than fit in memory")))?;
    if found != expected {
        return Err(ReferenceError::Length { buffer: buffer.to_string(), expected, found });
    }
    Ok(())
}
