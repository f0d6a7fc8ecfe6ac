//! What a decode plan and its launches check, as pure functions over
//! shapes so they are testable without a GPU. A launch's operands pass the
//! forward's checks (`check_forward`: Q and O `[batch, q_len, heads, d]`,
//! the cache `[batch, max_kv_len, heads_kv, d]`, params and tensors) and
//! must then match the plan they run in; the per-sequence lengths stay on
//! the device, where the kernel clamps them into the cache.

use crate::error::Error;
use flashgen_codegen::cuda::MAX_SPLITS;
use flashgen_codegen::Shape;

/// The upper bounds a decode plan is made for: every launch in the plan
/// has exactly these sizes, and a cache of `max_kv_len` rows per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// K/V heads; divides `heads` (GQA, MQA at 1).
    pub heads_kv: usize,
    /// New query tokens per sequence (1 to a few).
    pub q_len: usize,
    /// Rows of the KV cache per sequence: the most keys a sequence has.
    pub max_kv_len: usize,
}

impl DecodeShape {
    /// As the forward's checks see it: `kv_len` is the cache's rows.
    pub(crate) fn as_shape(self) -> Shape {
        let DecodeShape { batch, heads, heads_kv, q_len, max_kv_len } = self;
        Shape { batch, heads, heads_kv, q_len, kv_len: max_kv_len }
    }

    /// Query rows sharing one K/V head: a tile's rows come from these.
    pub(crate) fn group_rows(self) -> usize {
        self.heads / self.heads_kv.max(1) * self.q_len
    }
}

/// Checks a plan's bounds: heads in groups, at least one query token,
/// sizes the kernels index in i32 and grids hold.
pub(crate) fn check_plan_shape(shape: &DecodeShape) -> Result<(), Error> {
    let DecodeShape { batch, heads, heads_kv, q_len, max_kv_len } = *shape;
    if heads == 0 || heads_kv == 0 || heads % heads_kv != 0 {
        return Err(Error::HeadGroups { heads, heads_kv });
    }
    if q_len == 0 {
        return Err(Error::DecodeShape { problem: "q_len is 0: a decode step has at least one query".into() });
    }
    let grid_yz = crate::check::MAX_GRID_YZ;
    let int = i32::MAX as usize;
    for (what, value, max) in
        [("batch", batch, grid_yz), ("heads_kv", heads_kv, grid_yz), ("max_kv_len", max_kv_len, int)]
    {
        if value > max {
            return Err(Error::TooLarge { what, value, max });
        }
    }
    let rows = batch.saturating_mul(heads).saturating_mul(q_len);
    if rows.saturating_mul(MAX_SPLITS as usize) > int {
        return Err(Error::TooLarge {
            what: "query rows (batch · heads · q_len)",
            value: rows,
            max: int / MAX_SPLITS as usize,
        });
    }
    Ok(())
}

/// A split count the caller asked for: 1 to [`MAX_SPLITS`].
pub(crate) fn check_splits(splits: usize) -> Result<u32, Error> {
    match splits {
        1.. if splits <= MAX_SPLITS as usize => Ok(splits as u32),
        _ => Err(Error::DecodeShape {
            problem: format!("{splits} splits: a decode splits its keys 1 to {MAX_SPLITS} ways"),
        }),
    }
}

/// A launch's checked shape (its cache's rows as `kv_len`) and `kv_lens`'
/// entries against the plan's bounds.
pub(crate) fn check_launch(plan: &DecodeShape, got: &Shape, kv_lens: usize) -> Result<(), Error> {
    let want = plan.as_shape();
    for (what, plan, got) in [
        ("batch", want.batch, got.batch),
        ("heads", want.heads, got.heads),
        ("heads_kv", want.heads_kv, got.heads_kv),
        ("q_len", want.q_len, got.q_len),
        ("cache rows (max_kv_len)", want.kv_len, got.kv_len),
    ] {
        if plan != got {
            return Err(Error::DecodePlanMismatch { what, plan, got });
        }
    }
    if kv_lens < plan.batch {
        return Err(Error::KvLensLen { len: kv_lens, batch: plan.batch });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: DecodeShape = DecodeShape { batch: 4, heads: 32, heads_kv: 8, q_len: 1, max_kv_len: 4096 };

    #[test]
    fn plans_need_head_groups_and_queries() {
        assert!(check_plan_shape(&SHAPE).is_ok());
        let bad_groups = DecodeShape { heads_kv: 5, ..SHAPE };
        assert!(matches!(check_plan_shape(&bad_groups), Err(Error::HeadGroups { heads: 32, heads_kv: 5 })));
        let mqa = DecodeShape { heads_kv: 1, ..SHAPE };
        assert!(check_plan_shape(&mqa).is_ok());
        assert!(matches!(check_plan_shape(&DecodeShape { q_len: 0, ..SHAPE }), Err(Error::DecodeShape { .. })));
        let long = DecodeShape { max_kv_len: 1 << 31, ..SHAPE };
        assert!(matches!(check_plan_shape(&long), Err(Error::TooLarge { what: "max_kv_len", .. })));
        let wide = DecodeShape { batch: 70_000, ..SHAPE };
        assert!(matches!(check_plan_shape(&wide), Err(Error::TooLarge { what: "batch", .. })));
        assert_eq!(SHAPE.group_rows(), 4);
    }

    #[test]
    fn split_counts_are_bounded() {
        assert_eq!(check_splits(1).unwrap(), 1);
        assert_eq!(check_splits(128).unwrap(), 128);
        for bad in [0, 129] {
            assert!(matches!(check_splits(bad), Err(Error::DecodeShape { .. })), "{bad}");
        }
    }

    #[test]
    fn launches_match_their_plan() {
        let shape = SHAPE.as_shape();
        assert!(check_launch(&SHAPE, &shape, 4).is_ok());
        assert!(check_launch(&SHAPE, &shape, 9).is_ok(), "spare lengths are not read");
        assert!(matches!(check_launch(&SHAPE, &shape, 3), Err(Error::KvLensLen { len: 3, batch: 4 })));
        let longer = Shape { kv_len: 8192, ..shape };
        let err = check_launch(&SHAPE, &longer, 4).unwrap_err();
        assert!(matches!(err, Error::DecodePlanMismatch { plan: 4096, got: 8192, .. }), "{err}");
        let more_queries = Shape { q_len: 2, ..shape };
        assert!(matches!(check_launch(&SHAPE, &more_queries, 4), Err(Error::DecodePlanMismatch { what: "q_len", .. })));
    }
}
