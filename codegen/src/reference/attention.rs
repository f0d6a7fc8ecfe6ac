//! The attention forward pass, row by row: scores over all keys, softmax,
//! then P·V. O(B·H·Q·K·D) and allocation-free inside the loops.

use super::eval::{check_len, Arith, Env, ParamValue, Position, TensorData};
use super::rounding::{round_dtype, Grid};
use super::ReferenceError;
use crate::spec::{Dtype, Shape, Spec};
use std::ops::{Add, Div, Mul, Sub};

/// One attention problem. Q, K, V are BSHD contiguous and already rounded to
/// the spec's dtype: Q `[batch, q_len, heads, d_qk]`, K `[batch, kv_len,
/// heads_kv, d_qk]`, V `[batch, kv_len, heads_kv, d_v]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub shape: Shape,
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    /// The softmax scale: `score = scale · q·k` (the GPU receives it as f32).
    pub scale: f64,
    /// One value per declared param, in declaration order.
    pub params: Vec<ParamValue>,
    /// One buffer per declared tensor, in declaration order.
    pub tensors: Vec<TensorData>,
}

/// The result of [`forward`]: O `[batch, q_len, heads, d_v]` and the row
/// log-sum-exp `[batch, heads, q_len]` (natural log; −∞ for a fully masked
/// row).
#[derive(Clone, Debug, PartialEq)]
pub struct Output {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// How the reference computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The golden reference: every operation in f64.
    F64,
    /// A same-dtype PyTorch reference, as FlashAttention's tests build it
    /// (`attention_ref(..., upcast=False)`): S = scale·QKᵀ accumulated in f32
    /// and rounded to the dtype; score and mask expressions in f32; softmax in
    /// f32 with P rounded to the dtype; O = P·V accumulated in f32 and rounded
    /// to the dtype. LSE stays f32.
    SameDtype(Dtype),
}

/// Computes attention for `spec` on `problem`.
pub fn forward(spec: &Spec, problem: &Problem, precision: Precision) -> Result<Output, ReferenceError> {
    forward_on(
        spec,
        problem,
        match precision {
            Precision::F64 => None,
            Precision::SameDtype(dtype) => Some(Grid::of(dtype)),
        },
    )
}

/// [`forward`] in f64 without a grid, else the same-dtype emulation rounding
/// S, P and O on `grid`.
pub(super) fn forward_on(spec: &Spec, problem: &Problem, grid: Option<Grid>) -> Result<Output, ReferenceError> {
    let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
    if heads_kv == 0 || heads % heads_kv != 0 {
        return Err(ReferenceError::Shape(format!(
            "heads_kv ({heads_kv}) must be positive and divide heads ({heads})"
        )));
    }
    let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    check_len("q", problem.q.len(), &[batch, q_len, heads, d_qk])?;
    check_len("k", problem.k.len(), &[batch, kv_len, heads_kv, d_qk])?;
    check_len("v", problem.v.len(), &[batch, kv_len, heads_kv, d_v])?;
    match grid {
        None => run::<f64>(spec, problem, None),
        Some(grid) => run::<f32>(spec, problem, Some(grid)),
    }
}

/// The float type the softmax and matrix products run in.
trait Real: Copy + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self> {
    const ZERO: Self;
    const NEG_INFINITY: Self;
    /// The arithmetic the spec's expressions run in alongside.
    const ARITH: Arith;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! impl_real {
    ($t:ty, $arith:expr) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const ARITH: Arith = $arith;
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                f64::from(self)
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}

impl_real!(f32, Arith::F32);
impl_real!(f64, Arith::F64);

/// The forward pass in `F`, rounding S, P and O on `store` when given (the
/// same-dtype emulation).
fn run<F: Real>(spec: &Spec, problem: &Problem, store: Option<Grid>) -> Result<Output, ReferenceError> {
    let env = Env::new(spec, &problem.shape, &problem.params, &problem.tensors, F::ARITH)?;
    let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
    let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let keep = |x: F| store.map_or(x, |g| F::from_f64(g.round(x.to_f64())));
    // Inputs round to the dtype itself, whatever the grid; rounding in f64
    // before narrowing avoids rounding twice.
    let load = |xs: &[f64]| -> Vec<F> {
        xs.iter().map(|&x| F::from_f64(store.map_or(x, |g| round_dtype(g.dtype, x)))).collect()
    };
    let (q, k, v) = (load(&problem.q), load(&problem.k), load(&problem.v));
    let scale = F::from_f64(problem.scale);
    let group = heads / heads_kv;

    let mut out =
        Output { o: vec![0.0; batch * q_len * heads * d_v], lse: vec![f64::NEG_INFINITY; batch * heads * q_len] };
    // Per-row scratch: scores (−∞ for excluded keys), then exp(s − max).
    let mut s = vec![F::NEG_INFINITY; kv_len];
    let mut acc = vec![F::ZERO; d_v];
    for b in 0..batch {
        for h in 0..heads {
            let kv_head = h / group;
            // Offset of key `j`'s row in a K/V buffer of head dimension `d`.
            let kv_offset = |j: usize, d: usize| ((b * kv_len + j) * heads_kv + kv_head) * d;
            for i in 0..q_len {
                let row = (b * q_len + i) * heads + h;
                let q_row = &q[row * d_qk..][..d_qk];
                // Sizes were checked to fit i32 by `Env::new`.
                let mut at = Position { b: b as i32, h: h as i32, q: i as i32, k: 0, score: 0.0 };
                let mut max = F::NEG_INFINITY;
                for (j, s_j) in s.iter_mut().enumerate() {
                    at.k = j as i32;
                    *s_j = F::NEG_INFINITY;
                    if spec.mask.as_ref().is_some_and(|m| !env.eval(m, &at).as_bool()) {
                        continue;
                    }
                    let mut x = keep(scale * dot(q_row, &k[kv_offset(j, d_qk)..][..d_qk]));
                    if let Some(score) = &spec.score {
                        at.score = x.to_f64();
                        x = F::from_f64(env.eval(score, &at).as_f64());
                    }
                    *s_j = x;
                    // A NaN score sticks, poisoning the row instead of
                    // being skipped.
                    if x > max || x.is_nan() {
                        max = x;
                    }
                }
                if max == F::NEG_INFINITY {
                    continue; // Fully masked: O = 0 and LSE = −∞ as initialized.
                }
                let mut sum = F::ZERO;
                for s_j in s.iter_mut() {
                    *s_j = (*s_j - max).exp();
                    sum = sum + *s_j;
                }
                acc.fill(F::ZERO);
                for (j, &e) in s.iter().enumerate() {
                    let p = keep(e / sum);
                    if p == F::ZERO {
                        continue; // Excluded keys contribute nothing.
                    }
                    for (a, &x) in acc.iter_mut().zip(&v[kv_offset(j, d_v)..][..d_v]) {
                        *a = *a + p * x;
                    }
                }
                for (o, &a) in out.o[row * d_v..][..d_v].iter_mut().zip(&acc) {
                    *o = keep(a).to_f64();
                }
                out.lse[(b * heads + h) * q_len + i] = (max + sum.ln()).to_f64();
            }
        }
    }
    Ok(out)
}

/// q·k with eight independent accumulators: vectorizable, and no less
/// accurate than one running sum.
fn dot<F: Real>(a: &[F], b: &[F]) -> F {
    const LANES: usize = 8;
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = a_chunks.remainder().iter().zip(b_chunks.remainder()).fold(F::ZERO, |s, (&x, &y)| s + x * y);
    let mut lanes = [F::ZERO; LANES];
    for (x, y) in a_chunks.zip(b_chunks) {
        for ((l, &x), &y) in lanes.iter_mut().zip(x).zip(y) {
            *l = *l + x * y;
        }
    }
    lanes.into_iter().fold(tail, |s, l| s + l)
}
