//! A context-parallel launch's checks: each rank holds the rows its
//! sharding deals it, the ranks agree on the batch and heads, and the
//! params and tensors fit the spec at the whole sequence's lengths.

use crate::args::{check_args, ArgInfo};
use crate::check::MAX_LEN;
use crate::error::Error;
use crate::layout::Layout;
pub use crate::shard_error::ShardError;
use flashgen_codegen::shard::Sharding;
use flashgen_codegen::{Shape, Spec};

/// The whole sequence's lengths, which every rank's launch names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Whole {
    pub q_len: usize,
    pub kv_len: usize,
}

/// The whole launch's shape from rank `rank`'s Q and K layouts, after
/// checking they hold the rows the sharding deals the rank, and the params
/// and tensors against the spec at the whole lengths.
pub(crate) fn whole_shape(
    spec: &Spec,
    sharding: Sharding,
    whole: Whole,
    rank: usize,
    [q, k]: [&Layout; 2],
    args: &[ArgInfo],
) -> Result<Shape, Error> {
    if rank >= sharding.ranks {
        return Err(Error::Shard(ShardError::Rank { rank, ranks: sharding.ranks }));
    }
    // The pieces take positions in the whole sequence as i32 kernel
    // arguments (`ShardParams`), and dealing rows multiplies a chunk index
    // (up to 2 · ranks) by a whole length: both must fit.
    for (what, value) in [("ranks", sharding.ranks), ("whole q_len", whole.q_len), ("whole kv_len", whole.kv_len)] {
        if value > MAX_LEN {
            return Err(Error::TooLarge { what, value, max: MAX_LEN });
        }
    }
    for (operand, layout, len) in [("Q", q, whole.q_len), ("K", k, whole.kv_len)] {
        let expected = sharding.local_len(len, rank);
        if layout.seq != expected {
            return Err(Error::Shard(ShardError::Rows { operand, rank, expected, got: layout.seq, whole: len }));
        }
    }
    let shape = Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: whole.q_len, kv_len: whole.kv_len };
    check_args(spec, &shape, args)?;
    Ok(shape)
}

/// [`whole_shape`] for every rank's Q and K layouts (`layouts[r]`), which
/// must agree on the batch and head counts.
pub(crate) fn check_ranks(
    spec: &Spec,
    sharding: Sharding,
    whole: Whole,
    layouts: &[[Layout; 2]],
    args: &[ArgInfo],
) -> Result<Shape, Error> {
    if layouts.len() != sharding.ranks || sharding.ranks == 0 {
        return Err(Error::Shard(ShardError::RankCount { expected: sharding.ranks, got: layouts.len() }));
    }
    let first = whole_shape(spec, sharding, whole, 0, [&layouts[0][0], &layouts[0][1]], args)?;
    for (rank, [q, k]) in layouts.iter().enumerate().skip(1) {
        let shape = whole_shape(spec, sharding, whole, rank, [q, k], args)?;
        let sizes = [("batch", shape.batch, first.batch), ("heads", shape.heads, first.heads)];
        let sizes = sizes.into_iter().chain([("K/V heads", shape.heads_kv, first.heads_kv)]);
        if let Some((what, got, expected)) = sizes.into_iter().find(|(_, got, expected)| got != expected) {
            return Err(Error::Shard(ShardError::Disagree { rank, what, got, expected }));
        }
    }
    Ok(first)
}

/// A launch over NCCL: the communicator has the sharding's ranks, and this
/// rank's K and V are contiguous `[batch, rows, heads, dim]` (they are sent
/// as they lie).
#[cfg(feature = "nccl")]
pub(crate) fn check_exchange(sharding: Sharding, world: usize, kv: [&Layout; 2]) -> Result<(), Error> {
    if world != sharding.ranks {
        return Err(Error::Shard(ShardError::RankCount { expected: sharding.ranks, got: world }));
    }
    for (operand, layout) in ["K", "V"].into_iter().zip(kv) {
        let dense = Layout::bshd(layout.batch, layout.seq, layout.heads, layout.dim).at(layout.offset);
        if *layout != dense {
            return Err(Error::Shard(ShardError::NotContiguous { operand }));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen_codegen::shard::Partition;

    fn causal() -> Spec {
        flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: q >= k }")
            .unwrap()
    }

    #[test]
    fn ranks_must_hold_their_rows_and_agree() {
        let sharding = Sharding { ranks: 2, partition: Partition::Zigzag };
        let whole = Whole { q_len: 100, kv_len: 100 };
        let l = |seq, heads| Layout::bshd(2, seq, heads, 64);
        let doc = [ArgInfo::Tensor(flashgen_codegen::ElemTy::I32, 200)];
        let good = [[l(50, 4), l(50, 2)], [l(50, 4), l(50, 2)]];
        assert_eq!(check_ranks(&causal(), sharding, whole, &good, &doc).unwrap().kv_len, 100);
        let err = check_ranks(&causal(), sharding, whole, &good[..1], &doc).unwrap_err();
        assert!(matches!(err, Error::Shard(ShardError::RankCount { expected: 2, got: 1 })), "{err}");
        let rows = [[l(50, 4), l(50, 2)], [l(49, 4), l(50, 2)]];
        let err = check_ranks(&causal(), sharding, whole, &rows, &doc).unwrap_err();
        assert!(matches!(err, Error::Shard(ShardError::Rows { rank: 1, expected: 50, got: 49, .. })), "{err}");
        let heads = [[l(50, 4), l(50, 2)], [l(50, 8), l(50, 2)]];
        let err = check_ranks(&causal(), sharding, whole, &heads, &doc).unwrap_err();
        assert!(matches!(err, Error::Shard(ShardError::Disagree { rank: 1, what: "heads", .. })), "{err}");
        // The tensors are the whole sequence's: 2 x 100 ids, not a shard's.
        let small = [ArgInfo::Tensor(flashgen_codegen::ElemTy::I32, 100)];
        let err = check_ranks(&causal(), sharding, whole, &good, &small).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: 200, .. }), "{err}");
    }

    /// Regression (found by `check_props`): whole lengths past i32 were
    /// accepted; dealing their rows (`Sharding::segments`: chunk index ·
    /// length) overflowed, a panic in debug builds, and the pieces' i32
    /// positions would have saturated, a silent wrong answer.
    #[test]
    fn whole_lengths_fit_the_pieces_i32_positions() {
        let sharding = Sharding { ranks: 2, partition: Partition::Zigzag };
        let whole = Whole { q_len: usize::MAX, kv_len: 100 };
        let l = Layout::bshd(2, 50, 4, 64);
        let err = whole_shape(&causal(), sharding, whole, 0, [&l, &l], &[]).unwrap_err();
        assert!(matches!(err, Error::TooLarge { what: "whole q_len", .. }), "{err}");
        let many = Sharding { ranks: usize::MAX, partition: Partition::Zigzag };
        let err = whole_shape(&causal(), many, Whole { kv_len: 100, ..whole }, 0, [&l, &l], &[]).unwrap_err();
        assert!(matches!(err, Error::TooLarge { what: "ranks", .. }), "{err}");
    }
}
