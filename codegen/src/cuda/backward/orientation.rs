//! Which built-in a backward kernel's accumulator rows run over, and what
//! follows from it for its hoisted terms and its built-ins' names.

use crate::cuda::kit::hoist::Level;

/// Which built-in the rows of a warp's accumulator tiles run over. Lane
/// slot `i` (0, 1: rows g and g + 8) indexes row-level terms, `(n, c)`
/// (8-wide tile n, column 2t + c) column-level ones.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Rows {
    /// Sᵀ: keys are rows, queries columns (the dK/dV kernel).
    Keys,
    /// S: queries are rows, keys columns (the dQ kernel, like the forward).
    Queries,
}

impl Rows {
    /// The hoisting level of terms that vary per row.
    pub(super) fn row_level(self) -> Level {
        match self {
            Rows::Keys => Level::Column,
            Rows::Queries => Level::Row,
        }
    }

    /// The hoisting level of terms that vary per column: the other one.
    pub(super) fn column_level(self) -> Level {
        match self {
            Rows::Keys => Level::Row,
            Rows::Queries => Level::Column,
        }
    }

    /// The built-ins of the rows and of the columns: `("k", "q")` or `("q", "k")`.
    pub(super) fn vars(self) -> (&'static str, &'static str) {
        match self {
            Rows::Keys => ("k", "q"),
            Rows::Queries => ("q", "k"),
        }
    }
}
