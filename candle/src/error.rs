//! What the candle op rejects before anything reaches flashgen; flashgen's
//! own checks (shapes against the spec, strides, buffer bounds) arrive as
//! `flashgen::Error`, both wrapped in `candle_core::Error`.

use candle_core::DType;
use std::fmt;

/// A candle tensor the op cannot take, named by its role.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// Q, K, V (or a captured tensor) is not on a CUDA device.
    NotCuda { operand: String },
    /// The operands live on different CUDA devices.
    Devices { operand: String },
    /// Q, K, V must be 4-D `[batch, seq, heads, head_dim]`.
    Rank { operand: String, rank: usize },
    /// An operand's dtype is not the one the spec declares.
    Dtype { operand: String, got: DType, expected: &'static str },
    /// The call gave a different number of params and tensors than the spec
    /// declares, or a tensor where a scalar is declared (or the reverse).
    Args { detail: String },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotCuda { operand } => write!(f, "flashgen: {operand} is not on a CUDA device"),
            Error::Devices { operand } => write!(f, "flashgen: {operand} is on another CUDA device than Q"),
            Error::Rank { operand, rank } => {
                write!(f, "flashgen: {operand} has {rank} dimensions; expected [batch, seq, heads, head_dim]")
            }
            Error::Dtype { operand, got, expected } => {
                write!(f, "flashgen: {operand} is {got:?}; the spec expects {expected}")
            }
            Error::Args { detail } => write!(f, "flashgen: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        candle_core::Error::wrap(e)
    }
}

/// flashgen's own error (a failed check, compile or launch) as candle's.
pub(crate) fn flashgen(e: flashgen::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}
