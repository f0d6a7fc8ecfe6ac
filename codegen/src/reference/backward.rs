//! The reference backward pass: gradients of O with respect to Q, K, V and
//! the captured float tensors the score expression reads once, in f64.
//!
//! FlashAttention's math, row by row from the forward's log-sum-exp:
//! P = exp(S′ − LSE) over kept keys, dV = Pᵀ·dO, dP = dO·Vᵀ,
//! D = rowsum(dO ∘ O), dS′ = P ∘ (dP − D), dS = dS′ · ∂S′/∂S,
//! dQ = scale · dS·K, dK = scale · dSᵀ·Q, and `dt[i] = Σ dS′ · ∂S′/∂t[i]` over
//! the pairs that read element i. A sink's logit gets dsink = −P_sink · D per
//! row (P_sink = exp(sink − LSE)), and `dt[i] += Σ dsink · ∂sink/∂t[i]` over
//! the rows whose sink reads element i. The partial derivatives are the symbolic
//! ones of [`crate::grad`], run by the interpreter, so checking this against
//! finite differences checks the expressions a backward kernel would use.

use super::attention::{grid_of, run_in, Output, Precision, Problem, Rows, VarlenProblem};
use super::eval::{check_len, Arith, Env, Position};
use super::rounding::Grid;
use super::ReferenceError;
use crate::dropout::Dropout;
use crate::grad::{d_load, d_score, d_sink_load, load_indices, sink_load_indices, trainable};
use crate::spec::{Dtype, ElemTy, Expr, Shape, Spec};

/// The gradients of a loss with respect to a [`Problem`]'s inputs, in the
/// same layouts (BSHD contiguous Q, K, V; row-major tensors).
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// One entry per declared tensor: `Some` where [`trainable`] defines the
    /// gradient (a float tensor the score or the sink reads, each with one
    /// index list), `None` for i32 tensors and tensors only the mask or
    /// nothing reads.
    pub d_tensors: Vec<Option<Vec<f64>>>,
}

/// Backpropagates `d_out` (dL/dO, laid out like O: `[batch, q_len, heads,
/// d_v]`) through attention for `spec` on `problem`, in f64. Masked pairs
/// and fully masked rows contribute nothing; dK and dV of a K/V head sum over
/// its group of query heads.
pub fn backward(spec: &Spec, problem: &Problem, d_out: &[f64]) -> Result<Gradients, ReferenceError> {
    backward_in(spec, problem, d_out, Precision::F64)
}

/// [`backward`] at `precision`. [`Precision::SameDtype`] emulates the
/// backward of a same-dtype implementation (the baseline of
/// [`super::flash_rule`] for gradients): P, dP = dO·Vᵀ, D, dS′ and dS are
/// rounded to the dtype, as bf16/f16 autograd materializes them; D =
/// rowsum(dO ∘ O) comes from the O of a same-dtype forward, as a
/// FlashAttention backward only ever has the rounded O (LSE comes from the
/// f64 forward, as a kernel's f32 LSE is nearly exact); dQ, dK and dV are
/// rounded to the dtype and tensor gradients to their tensor's element type,
/// as autograd keeps a gradient in its input's dtype.
pub fn backward_in(
    spec: &Spec,
    problem: &Problem,
    d_out: &[f64],
    precision: Precision,
) -> Result<Gradients, ReferenceError> {
    let rows = Rows::dense(spec, problem)?;
    backward_once(spec, problem, &rows, d_out, precision, None)
}

/// [`backward_in`] of [`super::forward_dropout`]: dV = (P ⊙ Z)ᵀ·dO and
/// dS′ = P ∘ (Z ∘ dP − D), Z the pairs' dropout factors (0 or 1 / (1 − p)),
/// D = rowsum(dO ∘ O) of the dropout forward's O.
pub fn backward_dropout(
    spec: &Spec,
    problem: &Problem,
    d_out: &[f64],
    precision: Precision,
    dropout: Dropout,
) -> Result<Gradients, ReferenceError> {
    let rows = Rows::dense(spec, problem)?;
    backward_once(spec, problem, &rows, d_out, precision, Some(dropout))
}

/// The gradients of a varlen forward ([`super::forward_varlen`]) on the
/// packed sequences of `varlen`, each as [`backward_in`] computes a batch
/// row: `d_out`, dQ, dK and dV are packed (`[total, heads, d]`), a tensor's
/// gradient has the tensor's dims (sized by the longest sequence).
pub fn backward_varlen(
    spec: &Spec,
    varlen: &VarlenProblem,
    d_out: &[f64],
    precision: Precision,
) -> Result<Gradients, ReferenceError> {
    let rows = Rows::varlen(spec, varlen)?;
    backward_once(spec, &varlen.problem, &rows, d_out, precision, None)
}

/// [`same_dtype_backwards`] of a varlen problem (see [`backward_varlen`]).
pub fn same_dtype_backwards_varlen(
    spec: &Spec,
    varlen: &VarlenProblem,
    d_out: &[f64],
    shifts: u32,
) -> Result<Vec<Gradients>, ReferenceError> {
    let rows = Rows::varlen(spec, varlen)?;
    let grids = (0..shifts).map(|i| Some(Grid::shifted(spec.dtype, i, shifts)));
    backwards(spec, &varlen.problem, &rows, d_out, grids, None)
}

/// One backward over `rows` at `precision`.
fn backward_once(
    spec: &Spec,
    problem: &Problem,
    rows: &Rows,
    d_out: &[f64],
    precision: Precision,
    dropout: Option<Dropout>,
) -> Result<Gradients, ReferenceError> {
    let grid = grid_of(precision);
    let mut all = backwards(spec, problem, rows, d_out, [grid], dropout)?;
    Ok(all.remove(0))
}

/// One backward over `rows` per grid (`None`: in f64), all from one f64
/// forward, P dropped out by `dropout`.
fn backwards(
    spec: &Spec,
    problem: &Problem,
    rows: &Rows,
    d_out: &[f64],
    grids: impl IntoIterator<Item = Option<Grid>>,
    dropout: Option<Dropout>,
) -> Result<Vec<Gradients>, ReferenceError> {
    let exact = run_in(spec, problem, rows, None, dropout)?;
    grids.into_iter().map(|grid| backward_on(spec, problem, rows, d_out, (&exact, dropout), grid)).collect()
}

/// `shifts` same-dtype emulations of the backward, the first as
/// [`backward_in`]`(.., Precision::SameDtype(spec.dtype))`, the others
/// rounding every intermediate to the dtype's values scaled by 2^(−i /
/// shifts): each as precise as the dtype, but with its rounding points
/// elsewhere, so their errors are independent draws of the baseline's, and
/// a tolerance can rest on their typical size rather than on one draw (see
/// [`super::flash_rule_averaged`]).
pub fn same_dtype_backwards(
    spec: &Spec,
    problem: &Problem,
    d_out: &[f64],
    shifts: u32,
) -> Result<Vec<Gradients>, ReferenceError> {
    same_dtype_backwards_dropout(spec, problem, d_out, shifts, None)
}

/// [`same_dtype_backwards`] of a forward with `dropout` (see
/// [`backward_dropout`]).
pub fn same_dtype_backwards_dropout(
    spec: &Spec,
    problem: &Problem,
    d_out: &[f64],
    shifts: u32,
    dropout: Option<Dropout>,
) -> Result<Vec<Gradients>, ReferenceError> {
    let rows = Rows::dense(spec, problem)?;
    let grids = (0..shifts).map(|i| Some(Grid::shifted(spec.dtype, i, shifts)));
    backwards(spec, problem, &rows, d_out, grids, dropout)
}

/// The backward over `rows`' sequences from the f64 forward's `exact`
/// output under `dropout` (the forward's): in f64 without a grid, else the
/// same-dtype emulation rounding on `grid`.
fn backward_on(
    spec: &Spec,
    problem: &Problem,
    rows: &Rows,
    d_out: &[f64],
    (exact, dropout): (&Output, Option<Dropout>),
    grid: Option<Grid>,
) -> Result<Gradients, ReferenceError> {
    let round = |x: f64| grid.map_or(x, |g| g.round(x));
    let rounded_o = grid.map(|g| run_in(spec, problem, rows, Some(g), dropout)).transpose()?.map(|out| out.o);
    let o = rounded_o.as_ref().unwrap_or(&exact.o);
    let Shape { heads, heads_kv, .. } = problem.shape;
    let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    check_len("d_out", d_out.len(), &[rows.total_q, heads, d_v])?;
    let mut env = Env::new(spec, &problem.shape, &problem.params, &problem.tensors, Arith::F64)?;
    let d_score = d_score(spec);
    let mut trainable: Vec<Trainable> = (0..spec.tensors.len())
        .filter(|&slot| trainable(spec, slot))
        .map(|slot| {
            let dims: Vec<usize> = spec.tensors[slot].dims.iter().map(|d| d.resolve(&problem.shape)).collect();
            Trainable {
                slot,
                score: Read::of(d_load(spec, slot), load_indices(spec, slot)),
                sink: Read::of(d_sink_load(spec, slot), sink_load_indices(spec, slot)),
                grad: vec![0.0; dims.iter().product()],
                dims,
            }
        })
        .collect();

    let mut g = Gradients {
        dq: vec![0.0; problem.q.len()],
        dk: vec![0.0; problem.k.len()],
        dv: vec![0.0; problem.v.len()],
        d_tensors: vec![None; spec.tensors.len()],
    };
    let group = heads / heads_kv;
    for seq in &rows.seqs {
        // Each length is at most the shape's, which `Env::new` checked to fit i32.
        env.set_lens(seq.q_len as i32, seq.kv_len as i32);
        for h in 0..heads {
            let kv_head = h / group;
            for i in 0..seq.q_len {
                let lse = exact.lse[rows.lse_index(seq, h, i, heads)];
                if lse == f64::NEG_INFINITY {
                    continue; // Fully masked: O = 0 whatever the inputs.
                }
                let row = (seq.q_start + i) * heads + h;
                let q_row = &problem.q[row * d_qk..][..d_qk];
                let do_row = &d_out[row * d_v..][..d_v];
                let delta = round(dot(do_row, &o[row * d_v..][..d_v]));
                // Sizes were checked to fit i32 by `Env::new`.
                let mut at = Position { b: seq.b as i32, h: h as i32, q: i as i32, k: 0, score: 0.0 };
                if let Some(sink) = &spec.sink {
                    let d_sink = round(-round((env.eval(sink, &at).as_f64() - lse).exp()) * delta);
                    for t in &mut trainable {
                        t.add(|t| &t.sink, &env, &at, d_sink);
                    }
                }
                for j in 0..seq.kv_len {
                    at.k = j as i32;
                    if spec.mask.as_ref().is_some_and(|m| !env.eval(m, &at).as_bool()) {
                        continue;
                    }
                    let kv_row = (seq.kv_start + j) * heads_kv + kv_head;
                    let k_row = &problem.k[kv_row * d_qk..][..d_qk];
                    let v_row = &problem.v[kv_row * d_v..][..d_v];
                    at.score = problem.scale * dot(q_row, k_row);
                    let s = spec.score.as_ref().map_or(at.score, |e| env.eval(e, &at).as_f64());
                    let p = round((s - lse).exp());
                    if p == 0.0 {
                        continue; // No weight, as in the forward; avoids 0 · ∞ from the derivatives.
                    }
                    // Dropout's factor: dV takes P as O did, dP reaches S through it too.
                    let z = dropout.map_or(1.0, |d| d.factor(seq.b, h, heads, i, j));
                    let ds_mod = round(p * (z * round(dot(do_row, v_row)) - delta));
                    let ds = round(ds_mod * d_score.as_ref().map_or(1.0, |e| env.eval(e, &at).as_f64()));
                    let p_dropped = round(p * z);
                    for (dv, &x) in g.dv[kv_row * d_v..][..d_v].iter_mut().zip(do_row) {
                        *dv += p_dropped * x;
                    }
                    for (dq, &x) in g.dq[row * d_qk..][..d_qk].iter_mut().zip(k_row) {
                        *dq += problem.scale * ds * x;
                    }
                    for (dk, &x) in g.dk[kv_row * d_qk..][..d_qk].iter_mut().zip(q_row) {
                        *dk += problem.scale * ds * x;
                    }
                    for t in &mut trainable {
                        t.add(|t| &t.score, &env, &at, ds_mod);
                    }
                }
            }
        }
    }
    for t in trainable {
        let store = |x: f64| match (grid, spec.tensors[t.slot].elem) {
            (Some(g), ElemTy::F16) => g.with_dtype(Dtype::F16).round(x),
            (Some(g), ElemTy::Bf16) => g.with_dtype(Dtype::Bf16).round(x),
            (Some(_), _) => f64::from(x as f32),
            (None, _) => x,
        };
        g.d_tensors[t.slot] = Some(t.grad.into_iter().map(store).collect());
    }
    for x in g.dq.iter_mut().chain(&mut g.dk).chain(&mut g.dv) {
        *x = round(*x);
    }
    Ok(g)
}

/// A tensor with a gradient: its reads by the score and the sink, its
/// resolved dims and the gradient accumulated so far.
struct Trainable {
    slot: usize,
    score: Option<Read>,
    sink: Option<Read>,
    dims: Vec<usize>,
    grad: Vec<f64>,
}

/// One expression's read of a tensor: the derivative with respect to the
/// element read, and the read's indices.
struct Read {
    d: Expr,
    indices: Vec<Expr>,
}

impl Read {
    fn of(d: Option<Expr>, indices: Option<Vec<Expr>>) -> Option<Read> {
        Some(Read { d: d?, indices: indices? })
    }
}

impl Trainable {
    /// Adds `upstream` times the derivative of the read `which` selects, if
    /// that expression reads the tensor, to the element it hits at `at`
    /// (clamped exactly as `Env` loads).
    fn add(&mut self, which: impl Fn(&Self) -> &Option<Read>, env: &Env, at: &Position, upstream: f64) {
        let Some(read) = which(self) else { return };
        let element = env.element(&read.indices, &self.dims, at);
        let d = upstream * env.eval(&read.d, at).as_f64();
        // An empty tensor reads as 0 and has no element to train.
        if let Some(dt) = self.grad.get_mut(element) {
            *dt += d;
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
