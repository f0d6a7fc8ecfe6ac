//! What a decode plan and its launches check, as pure functions over
//! shapes so they are testable without a GPU. A launch's operands pass the
//! forward's checks (`check_forward`: Q and O `[batch, q_len, heads, d]`,
//! the cache `[batch, max_kv_len, heads_kv, d]`, params and tensors) and
//! must then match the plan they run in; the per-sequence lengths stay on
//! the device, where the kernel clamps them into the cache. A paged launch
//! (`check_paged_launch`) checks its caches as the paged forward does
//! (`check_paged`) and its Q and O as the dense decode's.

use crate::args::ArgInfo;
use crate::check::{check_bounds, check_lse, check_shape, Buffer};
use crate::check_paged::{check_cache_buffers, check_caches};
use crate::descale::{check_descales, DescaleLen};
use crate::error::{Error, RaggedError};
use crate::layout::Layout;
use crate::paged::PagedShape;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::cuda::{DecodeCache, DecodeQueries, KvCacheDtype, MAX_SPLITS};
use flashgen_codegen::{Dtype, Shape, Spec};

/// The upper bounds a decode plan is made for: every launch in the plan
/// has exactly these sizes (a varlen plan's sequences up to `q_len` tokens
/// each), and a cache of `max_kv_len` rows per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// K/V heads; divides `heads` (GQA, MQA at 1).
    pub heads_kv: usize,
    /// New query tokens per sequence (1 to a few; in a plan for packed
    /// queries, the most a sequence has).
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
        return Err(Error::Ragged(RaggedError::DecodeShape {
            problem: "q_len is 0: a decode step has at least one query".into(),
        }));
    }
    let grid_yz = crate::check::MAX_GRID_YZ;
    let most = crate::check::MAX_LEN;
    for (what, value, max) in
        [("batch", batch, grid_yz), ("heads_kv", heads_kv, grid_yz), ("max_kv_len", max_kv_len, most)]
    {
        if value > max {
            return Err(Error::TooLarge { what, value, max });
        }
    }
    // A sequence's rows size the plan's tiles (`group_rows`) even in a plan
    // of no sequences, where the batch's rows below are 0.
    let int = i32::MAX as usize;
    let per_seq = heads.saturating_mul(q_len);
    let rows = batch.saturating_mul(per_seq);
    for (what, value) in
        [("query rows of a sequence (heads · q_len)", per_seq), ("query rows (batch · heads · q_len)", rows)]
    {
        if value.saturating_mul(MAX_SPLITS as usize) > int {
            return Err(Error::TooLarge { what, value, max: int / MAX_SPLITS as usize });
        }
    }
    Ok(())
}

/// A split count the caller asked for: 1 to [`MAX_SPLITS`].
pub(crate) fn check_splits(splits: usize) -> Result<u32, Error> {
    match splits {
        1.. if splits <= MAX_SPLITS as usize => Ok(splits as u32),
        _ => Err(Error::Ragged(RaggedError::DecodeShape {
            problem: format!("{splits} splits: a decode splits its keys 1 to {MAX_SPLITS} ways"),
        })),
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
            return Err(Error::Ragged(RaggedError::DecodePlanMismatch { what, plan, got }));
        }
    }
    if kv_lens < plan.batch {
        return Err(Error::Ragged(RaggedError::KvLensLen { len: kv_lens, batch: plan.batch }));
    }
    Ok(())
}

/// What a decode kernel reads: its kind of cache, of queries and of cache
/// elements (a plan's, or a run's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RunKind {
    pub cache: DecodeCache,
    pub queries: DecodeQueries,
    pub kv: KvCacheDtype,
}

/// Refuses a run of another kind than the `plan`'s kernel reads, then an
/// e4m3 run's descale buffers (`descales`, `None` for a 16-bit cache) of
/// other lengths than they must hold for the plan's `heads_kv`.
pub(crate) fn check_run_kind(
    plan: RunKind,
    heads_kv: usize,
    (cache, queries): (DecodeCache, DecodeQueries),
    descales: Option<&[(&'static str, DescaleLen)]>,
) -> Result<(), Error> {
    let cache_name = |c| if c == DecodeCache::Paged { "paged" } else { "dense" };
    let queries_name = |q| if q == DecodeQueries::Packed { "packed" } else { "padded" };
    if cache != plan.cache {
        let (plan, got) = (cache_name(plan.cache), cache_name(cache));
        return Err(Error::Ragged(RaggedError::DecodeCache { plan, got }));
    }
    if queries != plan.queries {
        let (plan, got) = (queries_name(plan.queries), queries_name(queries));
        return Err(Error::Ragged(RaggedError::DecodeQueries { plan, got }));
    }
    let kv = if descales.is_some() { KvCacheDtype::E4m3 } else { KvCacheDtype::Spec };
    if kv != plan.kv {
        let (plan, got) = (plan.kv.name(), kv.name());
        return Err(Error::Ragged(RaggedError::DecodeKvDtype { plan, got }));
    }
    descales.map_or(Ok(()), |d| check_descales(d, heads_kv))
}

/// In a plan that reads V from K's tiles (`DecodeOptions::v_in_k`): V
/// (its device address and layout) must be K's first columns, the same
/// buffer, start and strides (the plan already holds V's head dim within
/// K's).
pub(crate) fn check_v_in_k((k_ptr, k): (u64, Layout), (v_ptr, v): (u64, Layout)) -> Result<(), Error> {
    let problem = if v_ptr != k_ptr {
        "is another buffer"
    } else if v.offset != k.offset {
        "starts elsewhere in K's buffer"
    } else if v.strides != k.strides {
        "has other strides than K"
    } else {
        return Ok(());
    };
    Err(Error::Ragged(RaggedError::VNotInK { problem }))
}

/// A paged decode launch as the checks see it: Q and O `[batch, q_len,
/// heads, d]`, the paged caches.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedDecodeProblem {
    pub dtype: Dtype,
    pub q: Buffer,
    pub o: Buffer,
    pub lse: Option<usize>,
    pub kv: PagedShape,
}

/// Checks a paged decode launch of `spec`: Q and O against each other, the
/// spec's head dims and the caches' sequences; the caches, block table and
/// lengths as the paged forward checks them; params, tensors and buffer
/// bounds. Returns the shape (the longest length as `kv_len`), or `None`
/// with no sequences.
pub(crate) fn check_paged_launch(
    spec: &Spec,
    p: &PagedDecodeProblem,
    args: &[ArgInfo],
) -> Result<Option<Shape>, Error> {
    if p.dtype != spec.dtype {
        return Err(Error::Dtype { spec: spec.dtype, got: p.dtype });
    }
    let (q, o) = (&p.q.layout, &p.o.layout);
    for (operand, other, what, got, expected) in [
        (Operand::O, Operand::Q, "batch", o.batch, q.batch),
        (Operand::O, Operand::Q, "seq", o.seq, q.seq),
        (Operand::O, Operand::Q, "heads", o.heads, q.heads),
        (Operand::K, Operand::Q, "batch (sequences)", p.kv.batch, q.batch),
    ] {
        if got != expected {
            return Err(Error::SizeMismatch { operand, other, what, got, expected });
        }
    }
    for (operand, got, expected) in [(Operand::Q, q.dim, spec.head_dims.qk), (Operand::O, o.dim, spec.head_dims.v)] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    check_caches(spec, &p.kv)?;
    let heads_kv = p.kv.caches[0].0.heads;
    let shape = Shape { batch: q.batch, heads: q.heads, heads_kv, q_len: q.seq, kv_len: p.kv.max_kv_len };
    check_shape(spec, &shape, args)?;
    check_bounds(Operand::Q, &p.q)?;
    check_bounds(Operand::O, &p.o)?;
    check_cache_buffers(&p.kv)?;
    if shape.batch == 0 || shape.q_len == 0 {
        return Ok(None);
    }
    check_lse(p.lse, shape.batch.saturating_mul(shape.heads).saturating_mul(shape.q_len))?;
    Ok(Some(shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paged::PagedLayout;

    const SHAPE: DecodeShape = DecodeShape { batch: 4, heads: 32, heads_kv: 8, q_len: 1, max_kv_len: 4096 };

    #[test]
    fn plans_need_head_groups_and_queries() {
        assert!(check_plan_shape(&SHAPE).is_ok());
        let bad_groups = DecodeShape { heads_kv: 5, ..SHAPE };
        assert!(matches!(check_plan_shape(&bad_groups), Err(Error::HeadGroups { heads: 32, heads_kv: 5 })));
        let mqa = DecodeShape { heads_kv: 1, ..SHAPE };
        assert!(check_plan_shape(&mqa).is_ok());
        assert!(matches!(
            check_plan_shape(&DecodeShape { q_len: 0, ..SHAPE }),
            Err(Error::Ragged(RaggedError::DecodeShape { .. }))
        ));
        let long = DecodeShape { max_kv_len: 1 << 31, ..SHAPE };
        assert!(matches!(check_plan_shape(&long), Err(Error::TooLarge { what: "max_kv_len", .. })));
        let wide = DecodeShape { batch: 70_000, ..SHAPE };
        assert!(matches!(check_plan_shape(&wide), Err(Error::TooLarge { what: "batch", .. })));
        assert_eq!(SHAPE.group_rows(), 4);
    }

    /// Regression (found by `check_props`): a plan of no sequences passed
    /// with any heads and q_len (its rows, batch · heads · q_len, are 0),
    /// and `decode_plan`'s `group_rows` (heads / heads_kv · q_len) then
    /// overflowed, a panic in debug builds.
    #[test]
    fn plans_without_sequences_still_bound_a_sequences_rows() {
        let empty = DecodeShape { batch: 0, heads: usize::MAX, heads_kv: 1, q_len: usize::MAX, ..SHAPE };
        let err = check_plan_shape(&empty).unwrap_err();
        assert!(matches!(err, Error::TooLarge { what: "query rows of a sequence (heads · q_len)", .. }), "{err}");
        assert!(check_plan_shape(&DecodeShape { batch: 0, ..SHAPE }).is_ok());
    }

    #[test]
    fn split_counts_are_bounded() {
        assert_eq!(check_splits(1).unwrap(), 1);
        assert_eq!(check_splits(128).unwrap(), 128);
        for bad in [0, 129] {
            assert!(matches!(check_splits(bad), Err(Error::Ragged(RaggedError::DecodeShape { .. }))), "{bad}");
        }
    }

    #[test]
    fn launches_match_their_plan() {
        let shape = SHAPE.as_shape();
        assert!(check_launch(&SHAPE, &shape, 4).is_ok());
        assert!(check_launch(&SHAPE, &shape, 9).is_ok(), "spare lengths are not read");
        assert!(matches!(
            check_launch(&SHAPE, &shape, 3),
            Err(Error::Ragged(RaggedError::KvLensLen { len: 3, batch: 4 }))
        ));
        let longer = Shape { kv_len: 8192, ..shape };
        let err = check_launch(&SHAPE, &longer, 4).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { plan: 4096, got: 8192, .. })), "{err}");
        let more_queries = Shape { q_len: 2, ..shape };
        assert!(matches!(
            check_launch(&SHAPE, &more_queries, 4),
            Err(Error::Ragged(RaggedError::DecodePlanMismatch { what: "q_len", .. }))
        ));
    }

    #[test]
    fn v_in_k_is_a_view_of_k() {
        // MLA: K [batch, cache rows, 1, 576], V its first 512 columns.
        let k = Layout::bshd(4, 4096, 1, 576);
        let v = Layout { dim: 512, ..k };
        assert!(check_v_in_k((0x1000, k), (0x1000, v)).is_ok());
        let paged = PagedLayout::contiguous(64, 16, 1, 576).as_layout();
        assert!(check_v_in_k((0x1000, paged), (0x1000, Layout { dim: 512, ..paged })).is_ok());
        let not = |v_ptr, v: Layout| match check_v_in_k((0x1000, k), (v_ptr, v)) {
            Err(Error::Ragged(RaggedError::VNotInK { problem })) => problem,
            other => panic!("{other:?}"),
        };
        assert_eq!(not(0x2000, v), "is another buffer");
        assert_eq!(not(0x1000, Layout { offset: 64, ..v }), "starts elsewhere in K's buffer");
        assert_eq!(not(0x1000, Layout::bshd(4, 4096, 1, 512)), "has other strides than K");
    }

    /// 4 sequences of `SHAPE`'s heads at d = 128; 64 pages of 16 rows, 8
    /// pages per sequence, the longest 100 keys.
    fn paged() -> PagedDecodeProblem {
        let q = Layout::bshd(4, 1, 32, 128);
        let cache = PagedLayout::contiguous(64, 16, 8, 128);
        let kv = PagedShape {
            caches: [(cache, cache.as_layout().len()); 2],
            table_len: 32,
            kv_lens_len: 4,
            pages_per_seq: 8,
            max_kv_len: 100,
            batch: 4,
        };
        let buffer = Buffer { layout: q, len: q.len() };
        PagedDecodeProblem { dtype: Dtype::Bf16, q: buffer, o: buffer, lse: Some(128), kv }
    }

    fn check_paged(p: &PagedDecodeProblem) -> Result<Option<Shape>, Error> {
        let spec = flashgen_codegen::parse_one("S { dtype: bf16, head_dim: 128 }").unwrap();
        check_paged_launch(&spec, p, &[])
    }

    fn with_kv(kv: impl FnOnce(&mut PagedShape)) -> PagedDecodeProblem {
        let mut p = paged();
        kv(&mut p.kv);
        p
    }

    #[test]
    fn paged_launches_check_their_caches() {
        let shape = check_paged(&paged()).unwrap().unwrap();
        assert_eq!(shape, Shape { batch: 4, heads: 32, heads_kv: 8, q_len: 1, kv_len: 100 });
        assert!(check_launch(&DecodeShape { max_kv_len: 100, ..SHAPE }, &shape, 4).is_ok());
        let zero = with_kv(|kv| kv.caches = [(PagedLayout::contiguous(64, 0, 8, 128), 1 << 20); 2]);
        assert!(matches!(check_paged(&zero), Err(Error::Ragged(RaggedError::ZeroPageSize))));
        let err = check_paged(&with_kv(|kv| kv.table_len = 31)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", len: 31, expected: 32 })),
            "{err}"
        );
        let err = check_paged(&with_kv(|kv| kv.kv_lens_len = 3)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "kv_lens", len: 3, expected: 4 })),
            "{err}"
        );
        let err = check_paged(&with_kv(|kv| kv.max_kv_len = 129)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: 129, capacity: 128 })),
            "{err}"
        );
        let err = check_paged(&with_kv(|kv| kv.caches[1].1 -= 1)).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::V, .. }), "{err}");
        let err = check_paged(&with_kv(|kv| kv.caches[0].0.dim = 64)).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::K, got: 64, .. }), "{err}");
    }

    #[test]
    fn paged_launches_check_their_queries() {
        let err = check_paged(&with_kv(|kv| (kv.batch, kv.table_len, kv.kv_lens_len) = (3, 24, 3))).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::K, what: "batch (sequences)", .. }), "{err}");
        let mut p = paged();
        p.o.layout = Layout::bshd(4, 2, 32, 128);
        p.o.len = p.o.layout.len();
        let err = check_paged(&p).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::O, what: "seq", .. }), "{err}");
        let mut p = paged();
        p.q.len -= 1;
        assert!(matches!(check_paged(&p), Err(Error::OutOfBounds { operand: Operand::Q, .. })));
        let err = check_paged(&PagedDecodeProblem { lse: Some(127), ..paged() }).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 127, needed: 128 }), "{err}");
        let err = check_paged(&PagedDecodeProblem { dtype: Dtype::F16, ..paged() }).unwrap_err();
        assert!(matches!(err, Error::Dtype { .. }), "{err}");
        let mut gqa = paged();
        gqa.kv.caches = [(PagedLayout::contiguous(64, 16, 5, 128), 1 << 24); 2];
        assert!(matches!(check_paged(&gqa), Err(Error::HeadGroups { heads: 32, heads_kv: 5 })));
    }
}
