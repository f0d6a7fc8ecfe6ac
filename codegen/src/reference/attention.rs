//! The attention forward pass, row by row: scores over all keys, softmax,
//! then P·V. O(B·H·Q·K·D); each (sequence, head) on a core of its own
//! ([`crate::parallel`]), allocation-free inside its rows' loop.

use super::eval::{check_len, Arith, Env, ParamValue, Position, TensorData};
use super::rounding::Grid;
use super::ReferenceError;
use crate::dropout::Dropout;
use crate::parallel;
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

/// A varlen (packed) problem: the tokens of all sequences back to back.
/// `problem`'s Q, K and V are `[total, heads, d]` (BSHD of one batch row),
/// its shape's `batch` the number of sequences and its `q_len` / `kv_len`
/// the longest sequence's (the lengths a tensor's `Q_LEN` / `KV_LEN` dims
/// take). Sequence `b` holds query tokens `cu_seqlens_q[b] ..
/// cu_seqlens_q[b + 1]` and key tokens `cu_seqlens_k[b] .. cu_seqlens_k[b +
/// 1]`; in the spec, `b` is the sequence and `q_len` / `kv_len` its lengths.
#[derive(Clone, Debug, PartialEq)]
pub struct VarlenProblem {
    pub problem: Problem,
    pub cu_seqlens_q: Vec<usize>,
    pub cu_seqlens_k: Vec<usize>,
}

/// The result of [`forward`]: O `[batch, q_len, heads, d_v]` and the row
/// log-sum-exp `[batch, heads, q_len]` (natural log; −∞ for a fully masked
/// row). Of [`forward_varlen`]: O `[total_q, heads, d_v]` and the LSE
/// `[heads, total_q]` (FlashAttention's varlen layout).
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
    /// [`Precision::SameDtype`] for an e4m3 forward, as FlashAttention-3's
    /// FP8 tests build it (`intermediate_dtype=float8_e4m3fn`): inputs taken
    /// as they are (e4m3 values, dequantized), P rounded to e4m3.
    E4m3(Dtype),
}

/// Computes attention for `spec` on `problem`.
pub fn forward(spec: &Spec, problem: &Problem, precision: Precision) -> Result<Output, ReferenceError> {
    run_in(spec, problem, &Rows::dense(spec, problem)?, grid_of(precision), None)
}

/// [`forward`] with `dropout` on P: the pairs it drops contribute nothing
/// to O and kept ones weigh `P / (1 − p)`; the LSE is the softmax's, as
/// without dropout. The mask is the device's ([`crate::dropout`]).
pub fn forward_dropout(
    spec: &Spec,
    problem: &Problem,
    precision: Precision,
    dropout: Dropout,
) -> Result<Output, ReferenceError> {
    run_in(spec, problem, &Rows::dense(spec, problem)?, grid_of(precision), Some(dropout))
}

/// Computes attention for `spec` on the packed sequences of `varlen`, each
/// as [`forward`] computes a batch row.
pub fn forward_varlen(spec: &Spec, varlen: &VarlenProblem, precision: Precision) -> Result<Output, ReferenceError> {
    run_in(spec, &varlen.problem, &Rows::varlen(spec, varlen)?, grid_of(precision), None)
}

impl Rows {
    /// A dense problem's batch rows, its operands' lengths checked.
    pub(super) fn dense(spec: &Spec, problem: &Problem) -> Result<Rows, ReferenceError> {
        let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
        check_heads(heads, heads_kv)?;
        let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        check_len("q", problem.q.len(), &[batch, q_len, heads, d_qk])?;
        check_len("k", problem.k.len(), &[batch, kv_len, heads_kv, d_qk])?;
        check_len("v", problem.v.len(), &[batch, kv_len, heads_kv, d_v])?;
        let seqs: Vec<Sequence> =
            (0..batch).map(|b| Sequence { b, q_start: b * q_len, q_len, kv_start: b * kv_len, kv_len }).collect();
        Ok(Rows { seqs, total_q: batch * q_len, lse: LseLayout::Batched })
    }

    /// A varlen problem's sequences, its prefix sums and operands' lengths
    /// checked.
    pub(super) fn varlen(spec: &Spec, varlen: &VarlenProblem) -> Result<Rows, ReferenceError> {
        let problem = &varlen.problem;
        let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
        check_heads(heads, heads_kv)?;
        let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let spans = |name: &str, cu: &[usize], max: usize| -> Result<usize, ReferenceError> {
            check_len(name, cu.len(), &[batch + 1])?;
            let monotone = cu[0] == 0 && cu.windows(2).all(|w| w[0] <= w[1] && w[1] - w[0] <= max);
            match monotone {
                true => Ok(cu[batch]),
                false => Err(ReferenceError::Shape(format!("`{name}` must rise from 0 by at most {max} per sequence"))),
            }
        };
        let (total_q, total_kv) =
            (spans("cu_seqlens_q", &varlen.cu_seqlens_q, q_len)?, spans("cu_seqlens_k", &varlen.cu_seqlens_k, kv_len)?);
        check_len("q", problem.q.len(), &[total_q, heads, d_qk])?;
        check_len("k", problem.k.len(), &[total_kv, heads_kv, d_qk])?;
        check_len("v", problem.v.len(), &[total_kv, heads_kv, d_v])?;
        let (cu_q, cu_k) = (&varlen.cu_seqlens_q, &varlen.cu_seqlens_k);
        let seqs: Vec<Sequence> = (0..batch)
            .map(|b| Sequence {
                b,
                q_start: cu_q[b],
                q_len: cu_q[b + 1] - cu_q[b],
                kv_start: cu_k[b],
                kv_len: cu_k[b + 1] - cu_k[b],
            })
            .collect();
        Ok(Rows { seqs, total_q, lse: LseLayout::Varlen })
    }
}

pub(super) fn grid_of(precision: Precision) -> Option<Grid> {
    match precision {
        Precision::F64 => None,
        Precision::SameDtype(dtype) => Some(Grid::of(dtype)),
        Precision::E4m3(dtype) => Some(Grid::e4m3(dtype)),
    }
}

fn check_heads(heads: usize, heads_kv: usize) -> Result<(), ReferenceError> {
    match heads_kv != 0 && heads.is_multiple_of(heads_kv) {
        true => Ok(()),
        false => {
            Err(ReferenceError::Shape(format!("heads_kv ({heads_kv}) must be positive and divide heads ({heads})")))
        }
    }
}

/// [`run`] in f64 without a grid, else in f32 rounding on `grid`.
pub(super) fn run_in(
    spec: &Spec,
    problem: &Problem,
    rows: &Rows,
    grid: Option<Grid>,
    dropout: Option<Dropout>,
) -> Result<Output, ReferenceError> {
    match grid {
        None => run::<f64>(spec, problem, rows, None, dropout),
        Some(grid) => run::<f32>(spec, problem, rows, Some(grid), dropout),
    }
}

/// Where a problem's sequences sit in its buffers (Q, K, V and O as tokens
/// × heads × dim), and how its LSE is laid out.
pub(super) struct Rows {
    pub seqs: Vec<Sequence>,
    /// Query tokens over all sequences (rows of O).
    pub total_q: usize,
    lse: LseLayout,
}

/// One sequence: a dense problem's batch row, or a varlen one's tokens.
pub(super) struct Sequence {
    pub b: usize,
    pub q_start: usize,
    pub q_len: usize,
    pub kv_start: usize,
    pub kv_len: usize,
}

/// `[batch, heads, q_len]`, or a varlen problem's `[heads, total_q]`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LseLayout {
    Batched,
    Varlen,
}

impl Rows {
    /// The LSE's index of query `i` of `seq` at head `h`.
    pub(super) fn lse_index(&self, seq: &Sequence, h: usize, i: usize, heads: usize) -> usize {
        match self.lse {
            LseLayout::Batched => (seq.b * heads + h) * seq.q_len + i,
            LseLayout::Varlen => h * self.total_q + seq.q_start + i,
        }
    }
}

/// The float type the softmax and matrix products run in.
trait Real:
    Copy + Send + Sync + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self>
{
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

/// The forward pass over `rows`' sequences in `F`, rounding S, P and O on
/// `store` when given (the same-dtype emulation), P dropped out by `dropout`.
/// Each (sequence, head) is independent: they run on every core.
fn run<F: Real>(
    spec: &Spec,
    problem: &Problem,
    rows: &Rows,
    store: Option<Grid>,
    dropout: Option<Dropout>,
) -> Result<Output, ReferenceError> {
    let env = Env::new(spec, &problem.shape, &problem.params, &problem.tensors, F::ARITH)?;
    // Inputs round to the dtype itself, whatever the grid; rounding in f64
    // before narrowing avoids rounding twice.
    let load = |xs: &[f64]| -> Vec<F> { xs.iter().map(|&x| F::from_f64(store.map_or(x, |g| g.load(x)))).collect() };
    let pass = Pass {
        spec,
        env,
        q: load(&problem.q),
        k: load(&problem.k),
        v: load(&problem.v),
        scale: F::from_f64(problem.scale),
        shape: problem.shape,
        store,
        dropout,
    };
    let heads = problem.shape.heads;
    let d_v = spec.head_dims.v as usize;
    let pairs: Vec<(&Sequence, usize)> = rows.seqs.iter().flat_map(|seq| (0..heads).map(move |h| (seq, h))).collect();
    let results = parallel::map(&pairs, |&(seq, h)| pass.head(seq, h));
    let total_q = rows.total_q;
    let mut out = Output { o: vec![0.0; total_q * heads * d_v], lse: vec![f64::NEG_INFINITY; heads * total_q] };
    for (&(seq, h), (o, lse)) in pairs.iter().zip(results) {
        for (i, (o_row, lse)) in o.chunks_exact(d_v).zip(lse).enumerate() {
            out.o[((seq.q_start + i) * heads + h) * d_v..][..d_v].copy_from_slice(o_row);
            out.lse[rows.lse_index(seq, h, i, heads)] = lse;
        }
    }
    Ok(out)
}

/// One forward pass's inputs, loaded in `F`.
struct Pass<'a, F> {
    spec: &'a Spec,
    env: Env<'a>,
    q: Vec<F>,
    k: Vec<F>,
    v: Vec<F>,
    scale: F,
    shape: Shape,
    store: Option<Grid>,
    dropout: Option<Dropout>,
}

impl<F: Real> Pass<'_, F> {
    /// O (`[q_len, d_v]`) and the LSE of head `h`'s rows of `seq`.
    fn head(&self, seq: &Sequence, h: usize) -> (Vec<f64>, Vec<f64>) {
        let Pass { spec, q, k, v, scale, store, dropout, .. } = self;
        let Shape { heads, heads_kv, .. } = self.shape;
        let (d_qk, d_v) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let keep = |x: F| store.map_or(x, |g| F::from_f64(g.round(x.to_f64())));
        let mut env = self.env.clone();
        // Each length is at most the shape's, which `Env::new` checked to fit i32.
        env.set_lens(seq.q_len as i32, seq.kv_len as i32);
        let kv_head = h / (heads / heads_kv);
        // Offset of key `j`'s row in a K/V buffer of head dimension `d`.
        let kv_offset = |j: usize, d: usize| ((seq.kv_start + j) * heads_kv + kv_head) * d;
        let mut o = vec![0.0; seq.q_len * d_v];
        let mut lse = vec![f64::NEG_INFINITY; seq.q_len];
        // Per-row scratch: scores (−∞ for excluded keys), then exp(s − max).
        let mut s = vec![F::NEG_INFINITY; seq.kv_len];
        let mut acc = vec![F::ZERO; d_v];
        for i in 0..seq.q_len {
            let q_row = &q[((seq.q_start + i) * heads + h) * d_qk..][..d_qk];
            let mut at = Position { b: seq.b as i32, h: h as i32, q: i as i32, k: 0, score: 0.0 };
            let mut max = F::NEG_INFINITY;
            for (j, s_j) in s.iter_mut().enumerate() {
                at.k = j as i32;
                *s_j = F::NEG_INFINITY;
                if spec.mask.as_ref().is_some_and(|m| !env.eval(m, &at).as_bool()) {
                    continue;
                }
                let mut x = keep(*scale * dot(q_row, &k[kv_offset(j, d_qk)..][..d_qk]));
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
            // The sink: one more logit in the denominator, with no value row.
            let sink = spec.sink.as_ref().map(|e| F::from_f64(env.eval(e, &at).as_f64()));
            if let Some(x) = sink.filter(|&x| x > max || x.is_nan()) {
                max = x;
            }
            if max == F::NEG_INFINITY {
                continue; // Fully masked, no sink: O = 0 and LSE = −∞ as initialized.
            }
            let mut sum = sink.map_or(F::ZERO, |x| (x - max).exp());
            for s_j in s.iter_mut() {
                *s_j = (*s_j - max).exp();
                sum = sum + *s_j;
            }
            acc.fill(F::ZERO);
            for (j, &e) in s.iter().enumerate() {
                let z = dropout.map_or(1.0, |d| d.factor(seq.b, h, heads, i, j));
                let p = store.map_or(e / sum, |g| F::from_f64(g.round_p((e / sum).to_f64())));
                if p == F::ZERO || z == 0.0 {
                    continue; // Excluded and dropped keys contribute nothing.
                }
                let p = if z == 1.0 { p } else { keep(p * F::from_f64(z)) };
                for (a, &x) in acc.iter_mut().zip(&v[kv_offset(j, d_v)..][..d_v]) {
                    *a = *a + p * x;
                }
            }
            for (o, &a) in o[i * d_v..][..d_v].iter_mut().zip(&acc) {
                *o = keep(a).to_f64();
            }
            lse[i] = (max + sum.ln()).to_f64();
        }
        (o, lse)
    }
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
