//! What a context-parallel launch can get wrong ([`ShardError`], inside
//! [`crate::Error::Shard`]).

use std::fmt;

/// What a context-parallel launch got wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardError {
    /// `ranks` operands were given for a sharding over `expected` ranks.
    RankCount { expected: usize, got: usize },
    /// A rank at or past the sharding's rank count.
    Rank { rank: usize, ranks: usize },
    /// Rank `rank`'s `operand` holds `got` rows where the sharding deals it
    /// `expected` of the whole sequence's `whole`.
    Rows { operand: &'static str, rank: usize, expected: usize, got: usize, whole: usize },
    /// Rank `rank`'s `what` differs from rank 0's.
    Disagree { rank: usize, what: &'static str, got: usize, expected: usize },
    /// A rank's K or V that NCCL would send is not contiguous BSHD.
    NotContiguous { operand: &'static str },
}

impl fmt::Display for ShardError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardError::RankCount { expected, got } => {
                write!(f, "the sharding has {expected} ranks but operands for {got} were given")
            }
            ShardError::Rank { rank, ranks } => write!(f, "rank {rank} is not one of the sharding's {ranks} ranks"),
            ShardError::Rows { operand, rank, expected, got, whole } => write!(
                f,
                "rank {rank}'s {operand} holds {got} rows, but the sharding deals it {expected} of the whole {whole}"
            ),
            ShardError::NotContiguous { operand } => write!(
                f,
                "{operand} is sent to other ranks as it lies, so it must be contiguous [batch, rows, heads, dim]"
            ),
            ShardError::Disagree { rank, what, got, expected } => {
                write!(f, "rank {rank}'s {what} is {got}, rank 0's {expected}: every rank has the same")
            }
        }
    }
}
