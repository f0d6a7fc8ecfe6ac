//! What a decode step over packed queries checks
//! ([`DecodePlan::run_varlen`](crate::DecodePlan::run_varlen)), as pure
//! functions over shapes so they are testable without a GPU.
//!
//! Q and O are checked as the varlen and paged forwards check packed
//! queries (`check_paged::check_queries`: `cu_seqlens_q` of `batch + 1`
//! entries, at least the plan's `q_len` tokens, the LSE `[heads,
//! total_q]`), the cache as a dense step's or a paged one's, and all of it
//! against the plan. The prefix sums stay on the device: the kernel clamps
//! each sequence's span into Q's tokens and to the plan's `q_len`
//! (`seq_span`), so bad ones give wrong rows, never an access out of bounds.

use crate::args::ArgInfo;
use crate::check::{check_bounds, check_shape, Buffer};
use crate::check_decode::DecodeShape;
use crate::check_paged::{check_packed_rows, check_paged, check_queries, PackedChecked, PagedProblem};
use crate::error::{Error, RaggedError};
use crate::paged::PagedShape;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::{Dtype, Shape, Spec};

/// A decode step over packed queries as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VarlenDecodeProblem {
    pub dtype: Dtype,
    /// Q and O as one batch row of tokens (`PackedLayout::as_layout`).
    pub q: Buffer,
    pub o: Buffer,
    pub lse: Option<usize>,
    /// Entries of `cu_seqlens_q`.
    pub cu_seqlens_q: usize,
    pub cache: CacheShape,
}

/// A decode step's cache as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CacheShape {
    /// `[batch, max_kv_len, heads_kv, d]` K and V (`kv_lens`' entries:
    /// `check_launch`).
    Dense {
        k: Buffer,
        v: Buffer,
    },
    Paged(PagedShape),
}

impl CacheShape {
    fn batch(&self) -> usize {
        match self {
            CacheShape::Dense { k, .. } => k.layout.batch,
            CacheShape::Paged(kv) => kv.batch,
        }
    }
}

/// Checks a decode step of `spec` over packed queries in a plan made for
/// `plan`: the cache's sequences are the plan's batch, then Q, O, the LSE,
/// the cache, params and tensors (sized by the plan's `q_len` and the
/// cache's rows). Returns the step's shape (the plan's `q_len`, the cache's
/// rows as `kv_len`) and Q's tokens, or `None` without sequences. The
/// caller then holds the shape to the plan (`check_launch`).
pub(crate) fn check_varlen_decode(
    spec: &Spec,
    plan: &DecodeShape,
    p: &VarlenDecodeProblem,
    args: &[ArgInfo],
) -> Result<Option<PackedChecked>, Error> {
    let batch = p.cache.batch();
    if batch != plan.batch {
        return Err(Error::Ragged(RaggedError::DecodePlanMismatch { what: "batch", plan: plan.batch, got: batch }));
    }
    let (k, v) = match p.cache {
        CacheShape::Paged(kv) => {
            let (q, o, lse, max_q_len) = (p.q, p.o, p.lse, plan.q_len);
            let paged = PagedProblem { dtype: p.dtype, q, o, lse, kv, cu_seqlens_q: Some(p.cu_seqlens_q), max_q_len };
            return check_paged(spec, &paged, args);
        }
        CacheShape::Dense { k, v } => (k, v),
    };
    if p.dtype != spec.dtype {
        return Err(Error::Dtype { spec: spec.dtype, got: p.dtype });
    }
    check_dense_cache(spec, &k, &v)?;
    check_queries(spec, [&p.q, &p.o], batch, Some(p.cu_seqlens_q), plan.q_len)?;
    let (heads, heads_kv, kv_len) = (p.q.layout.heads, k.layout.heads, k.layout.seq);
    let shape = Shape { batch, heads, heads_kv, q_len: plan.q_len, kv_len };
    check_shape(spec, &shape, args)?;
    check_bounds(Operand::K, &k)?;
    check_bounds(Operand::V, &v)?;
    check_packed_rows(shape, [&p.q, &p.o], p.lse)
}

/// A dense cache's K and V: the same sequences, rows and heads, the spec's
/// head dims.
fn check_dense_cache(spec: &Spec, k: &Buffer, v: &Buffer) -> Result<(), Error> {
    let (k, v) = (&k.layout, &v.layout);
    for (what, got, expected) in [("batch", v.batch, k.batch), ("seq", v.seq, k.seq), ("heads", v.heads, k.heads)] {
        if got != expected {
            return Err(Error::SizeMismatch { operand: Operand::V, other: Operand::K, what, got, expected });
        }
    }
    for (operand, got, expected) in [(Operand::K, k.dim, spec.head_dims.qk), (Operand::V, v.dim, spec.head_dims.v)] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check_decode::check_launch;
    use crate::layout::{Layout, PackedLayout};
    use crate::paged::PagedLayout;
    use flashgen_codegen::ElemTy;

    /// 4 sequences of at most 4 tokens, 32 query heads over 8 K/V heads,
    /// 100 cache rows.
    const PLAN: DecodeShape = DecodeShape { batch: 4, heads: 32, heads_kv: 8, q_len: 4, max_kv_len: 100 };

    /// A per-token tensor: `Q_LEN` is the plan's `q_len`.
    fn spec() -> Spec {
        flashgen_codegen::parse_one("S { dtype: bf16, head_dim: 128, tensor w: f32[B, Q_LEN], score: score + w[b][q] }")
            .unwrap()
    }

    fn buffer(layout: Layout) -> Buffer {
        Buffer { layout, len: layout.len() }
    }

    /// 10 packed tokens; a dense cache of the plan's bounds.
    fn problem() -> VarlenDecodeProblem {
        let tokens = buffer(PackedLayout::thd(10, 32, 128).as_layout());
        let cache = buffer(Layout::bshd(4, 100, 8, 128));
        let cache = CacheShape::Dense { k: cache, v: cache };
        VarlenDecodeProblem { dtype: Dtype::Bf16, q: tokens, o: tokens, lse: Some(320), cu_seqlens_q: 5, cache }
    }

    fn check(p: &VarlenDecodeProblem) -> Result<Option<PackedChecked>, Error> {
        check_varlen_decode(&spec(), &PLAN, p, &[ArgInfo::Tensor(ElemTy::F32, 16)])
    }

    fn with_tokens(tokens: usize) -> VarlenDecodeProblem {
        let b = buffer(PackedLayout::thd(tokens, 32, 128).as_layout());
        VarlenDecodeProblem { q: b, o: b, lse: Some(32 * tokens), ..problem() }
    }

    #[test]
    fn accepts_a_step_within_the_plan() {
        let checked = check(&problem()).unwrap().unwrap();
        let shape = Shape { batch: 4, heads: 32, heads_kv: 8, q_len: 4, kv_len: 100 };
        assert_eq!(checked, PackedChecked { shape, total_q: 10 });
        assert!(check_launch(&PLAN, &checked.shape, 4).is_ok());
        // Spare tokens past the sequences are fine: they are left unwritten.
        assert_eq!(check(&with_tokens(64)).unwrap().unwrap().total_q, 64);
    }

    #[test]
    fn prefix_sums_hold_batch_plus_one_entries() {
        for len in [0, 4, 6] {
            let err = check(&VarlenDecodeProblem { cu_seqlens_q: len, ..problem() }).unwrap_err();
            assert!(
                matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_q", expected: 5, .. })),
                "{err}"
            );
        }
    }

    #[test]
    fn buffers_hold_the_plans_tokens_per_sequence() {
        // Fewer tokens than one sequence may have: the plan's bound is wrong.
        let err = check(&with_tokens(3)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: "max_q_len", max: 4, tokens: 3 })),
            "{err}"
        );
        let mut p = problem();
        p.q.len -= 1;
        assert!(matches!(check(&p), Err(Error::OutOfBounds { operand: Operand::Q, .. })));
        let mut p = problem();
        p.o = buffer(PackedLayout::thd(9, 32, 128).as_layout());
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::O, what: "tokens", .. }), "{err}");
        let err = check(&VarlenDecodeProblem { lse: Some(319), ..problem() }).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 319, needed: 320 }), "{err}");
        let err = check_varlen_decode(&spec(), &PLAN, &problem(), &[ArgInfo::Tensor(ElemTy::F32, 15)]).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: 16, .. }), "{err}");
    }

    #[test]
    fn dense_caches_are_checked() {
        let with_cache = |k: Layout, v: Layout| VarlenDecodeProblem {
            cache: CacheShape::Dense { k: buffer(k), v: buffer(v) },
            ..problem()
        };
        let cache = Layout::bshd(4, 100, 8, 128);
        let err = check(&with_cache(cache, Layout::bshd(4, 99, 8, 128))).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::V, what: "seq", .. }), "{err}");
        let err = check(&with_cache(Layout::bshd(4, 100, 8, 64), cache)).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::K, got: 64, .. }), "{err}");
        let mut p = problem();
        let CacheShape::Dense { v, .. } = &mut p.cache else { unreachable!() };
        v.len -= 1;
        assert!(matches!(check(&p), Err(Error::OutOfBounds { operand: Operand::V, .. })));
        let err = check(&VarlenDecodeProblem { dtype: Dtype::F16, ..problem() }).unwrap_err();
        assert!(matches!(err, Error::Dtype { .. }), "{err}");
    }

    #[test]
    fn steps_outside_the_plan_are_refused() {
        let err = check(&VarlenDecodeProblem {
            cache: CacheShape::Dense {
                k: buffer(Layout::bshd(3, 100, 8, 128)),
                v: buffer(Layout::bshd(3, 100, 8, 128)),
            },
            ..problem()
        })
        .unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { what: "batch", plan: 4, got: 3 })),
            "{err}"
        );
        // Other heads or cache rows pass the step's own checks, not the plan's.
        let longer = Layout::bshd(4, 200, 8, 128);
        let p = VarlenDecodeProblem { cache: CacheShape::Dense { k: buffer(longer), v: buffer(longer) }, ..problem() };
        let checked = check(&p).unwrap().unwrap();
        let err = check_launch(&PLAN, &checked.shape, 4).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { plan: 100, got: 200, .. })), "{err}");
        let err = check_launch(&PLAN, &check(&problem()).unwrap().unwrap().shape, 3).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::KvLensLen { len: 3, batch: 4 })), "{err}");
    }

    /// The plan's sequences on 16-row pages, 8 a sequence.
    fn paged() -> VarlenDecodeProblem {
        let cache = PagedLayout::contiguous(40, 16, 8, 128);
        let kv = PagedShape {
            caches: [(cache, cache.as_layout().len()); 2],
            table_len: 32,
            kv_lens_len: 4,
            pages_per_seq: 8,
            max_kv_len: 100,
            batch: 4,
        };
        VarlenDecodeProblem { cache: CacheShape::Paged(kv), ..problem() }
    }

    fn with_pages(change: impl FnOnce(&mut PagedShape)) -> VarlenDecodeProblem {
        let mut p = paged();
        let CacheShape::Paged(kv) = &mut p.cache else { unreachable!() };
        change(kv);
        p
    }

    #[test]
    fn paged_caches_are_checked_as_the_paged_forward_checks_them() {
        let checked = check(&paged()).unwrap().unwrap();
        assert_eq!(checked.shape, Shape { batch: 4, heads: 32, heads_kv: 8, q_len: 4, kv_len: 100 });
        assert_eq!(checked.total_q, 10);
        let err = check(&with_pages(|kv| kv.table_len = 31)).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", .. })), "{err}");
        let err = check(&with_pages(|kv| kv.max_kv_len = 129)).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { .. })), "{err}");
        let err = check(&with_pages(|kv| (kv.batch, kv.table_len, kv.kv_lens_len) = (3, 24, 3))).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::DecodePlanMismatch { what: "batch", .. })), "{err}");
        let err = check(&VarlenDecodeProblem { cu_seqlens_q: 4, ..paged() }).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_q", .. })), "{err}");
        let err = check(&VarlenDecodeProblem { lse: Some(319), ..paged() }).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 319, needed: 320 }), "{err}");
    }

    #[test]
    fn a_plan_without_sequences_launches_nothing() {
        let plan = DecodeShape { batch: 0, ..PLAN };
        let empty = buffer(Layout::bshd(0, 100, 8, 128));
        let p = VarlenDecodeProblem { cu_seqlens_q: 1, cache: CacheShape::Dense { k: empty, v: empty }, ..problem() };
        assert_eq!(check_varlen_decode(&spec(), &plan, &p, &[ArgInfo::Tensor(ElemTy::F32, 0)]).unwrap(), None);
    }
}
