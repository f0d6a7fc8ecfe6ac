//! The CPU reference: an interpreter of the spec IR and the attention it
//! defines (forward, and in f64 the backward), used by tests, the CLI and the
//! quickstart to check GPU results.
//!
//! Semantics shared with the generated kernels:
//! - `s = scale · q·k`; with a score expression, `s = score(s)` where `score`
//!   is the scaled score and `b`, `h`, `q`, `k` are the batch, query head,
//!   query row and key index; pairs whose mask is false are excluded;
//! - K/V head of query head `h` is `h / (heads / heads_kv)` (GQA/MQA);
//! - a sink (`spec.sink`) is one more logit in each row's softmax
//!   denominator, with no value row: the row's weights are
//!   `softmax([s_1 … s_n, sink])` over its n kept keys;
//! - with dropout ([`forward_dropout`], [`backward_dropout`]), the pairs
//!   [`crate::dropout::Dropout`] drops weigh nothing in O and kept ones
//!   `P / (1 − p)`; the LSE is the softmax's;
//! - a fully masked row gives O = 0 and LSE = −∞ (the sink with one),
//!   never NaN;
//! - tensor indices are clamped into `[0, dim − 1]`, integer `/` and `%` by
//!   zero give 0, and integer `+ - *` wrap, so no spec can trap;
//! - Q, K, V and O are BSHD contiguous, LSE is `[batch, heads, q_len]` in
//!   natural log.
//!
//! Packed sequences ([`forward_varlen`]) and paged K/V caches
//! ([`forward_paged`], gathered into packed ones) reuse that definition per
//! sequence.
//!
//! [`Precision::F64`] is the golden reference (every float operation in
//! f64); [`Precision::SameDtype`] emulates a same-dtype PyTorch reference,
//! whose error against the golden one sets the tolerance of
//! [`flash_rule`]; for gradients, its mean over several emulations
//! ([`same_dtype_backwards`], [`flash_rule_averaged`]).

mod attention;
mod backward;
mod eval;
mod metrics;
mod paged;
mod rounding;

pub use attention::{forward, forward_dropout, forward_varlen, Output, Precision, Problem, VarlenProblem};
pub use backward::{
    backward, backward_dropout, backward_in, backward_varlen, same_dtype_backwards, same_dtype_backwards_dropout,
    same_dtype_backwards_varlen, Gradients,
};
pub use eval::{Arith, Env, ParamValue, Position, TensorData, Value};
pub use metrics::{
    flash_rule, flash_rule_averaged, max_abs_diff, mean_abs_diff, FlashCheck, BACKWARD_BASELINES, BACKWARD_FACTOR,
    FLASH_SLACK, FORWARD_FACTOR,
};
pub use paged::{forward_paged, gather, PagedProblem};
pub use rounding::{round_bf16, round_dtype, round_e4m3, round_f16};

use std::fmt;

/// Inputs that do not fit the spec or the shape. The spec itself is trusted:
/// it was checked when parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReferenceError {
    /// `heads_kv` is zero or does not divide `heads`, a size exceeds i32
    /// (the type of `b`, `h`, `q`, `k`), or a buffer size overflows usize.
    Shape(String),
    /// A buffer's length disagrees with the shape.
    Length { buffer: String, expected: usize, found: usize },
    /// Params or captured tensors disagree with the spec's declarations.
    Mismatch(String),
}

impl fmt::Display for ReferenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReferenceError::Shape(m) | ReferenceError::Mismatch(m) => f.write_str(m),
            ReferenceError::Length { buffer, expected, found } => {
                write!(f, "`{buffer}` holds {found} elements, expected {expected}")
            }
        }
    }
}

impl std::error::Error for ReferenceError {}
