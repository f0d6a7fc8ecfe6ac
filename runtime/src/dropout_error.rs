//! What a launch's dropout can get wrong ([`DropoutError`], inside
//! [`crate::Error::Dropout`]).

use std::fmt;

/// A launch's dropout that cannot run.
#[derive(Debug)]
pub enum DropoutError {
    /// The probability is not in `[0, 1)` (or NaN).
    Probability { p: f32 },
    /// Dropout on a launch whose kernels have none: varlen, paged and
    /// context-parallel launches (decode takes no dropout option).
    Unsupported { launch: &'static str },
}

impl fmt::Display for DropoutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DropoutError::Probability { p } => write!(f, "the probability must be in [0, 1), got {p}"),
            DropoutError::Unsupported { launch } => {
                write!(f, "{launch} launches have none; only dense forward and backward launches drop out")
            }
        }
    }
}
