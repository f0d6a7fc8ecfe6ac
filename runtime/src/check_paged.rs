//! Everything `forward_paged` and `append_paged` check before a launch (and
//! the caches' checks a paged decode shares), as
//! pure functions over layouts and lengths so it is testable without a GPU.
//!
//! The host sees the caches' layouts and buffer lengths, the block table's
//! and the lengths' entry counts and the longest lengths; not the page ids,
//! lengths or prefix sums (they are on the device), which the kernel clamps
//! (`library/paged.cuh`): what these checks cannot see gives wrong rows,
//! never an access out of bounds.

use crate::args::ArgInfo;
use crate::check::{check_bounds, check_lse, check_shape, Buffer, MAX_GRID_YZ, MAX_LEN};
use crate::error::{Error, RaggedError};
use crate::paged::PagedShape;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::{Dtype, Shape, Spec};

/// A paged forward launch as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedProblem {
    pub dtype: Dtype,
    /// Q and O as one batch row of tokens (`PackedLayout::as_layout`).
    pub q: Buffer,
    pub o: Buffer,
    pub lse: Option<usize>,
    pub kv: PagedShape,
    /// Entries of `cu_seqlens_q`; `None`: dense queries.
    pub cu_seqlens_q: Option<usize>,
    pub max_q_len: usize,
}

/// A checked launch over packed (or dense) queries, paged or decode: its
/// shape (the longest lengths, which size the grid and the tensors' `Q_LEN`
/// / `KV_LEN` dims) and Q's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PackedChecked {
    pub shape: Shape,
    pub total_q: usize,
}

/// Checks a paged forward launch of `spec`. Returns its shape, or `None`
/// when there is nothing to compute (no sequence, or no queries).
pub(crate) fn check_paged(spec: &Spec, p: &PagedProblem, args: &[ArgInfo]) -> Result<Option<PackedChecked>, Error> {
    if p.dtype != spec.dtype {
        return Err(Error::Dtype { spec: spec.dtype, got: p.dtype });
    }
    let k = p.kv.caches[0].0;
    check_queries(spec, [&p.q, &p.o], p.kv.batch, p.cu_seqlens_q, p.max_q_len)?;
    check_caches(spec, &p.kv)?;
    let shape = Shape {
        batch: p.kv.batch,
        heads: p.q.layout.heads,
        heads_kv: k.heads,
        q_len: p.max_q_len,
        kv_len: p.kv.max_kv_len,
    };
    check_shape(spec, &shape, args)?;
    check_cache_buffers(&p.kv)?;
    check_packed_rows(shape, [&p.q, &p.o], p.lse)
}

/// A checked `shape`'s packed Q and O (`[q, o]`): Q's token count an i32,
/// both inside their buffers, the LSE, where given, `[heads, total_q]`.
/// `None` when there is nothing to compute (no sequence, or no queries).
pub(crate) fn check_packed_rows(
    shape: Shape,
    [q, o]: [&Buffer; 2],
    lse: Option<usize>,
) -> Result<Option<PackedChecked>, Error> {
    let total_q = q.layout.seq;
    // Sizes the kernel takes as i32 (lengths: `check_shape`).
    if total_q > i32::MAX as usize {
        return Err(Error::TooLarge { what: "total_q (tokens of Q)", value: total_q, max: i32::MAX as usize });
    }
    check_bounds(Operand::Q, q)?;
    check_bounds(Operand::O, o)?;
    if shape.batch == 0 || shape.q_len == 0 {
        return Ok(None);
    }
    check_lse(lse, shape.heads.saturating_mul(total_q))?;
    Ok(Some(PackedChecked { shape, total_q }))
}

/// A paged append as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AppendProblem {
    pub dtype: Dtype,
    /// The new K and V rows as one batch row of tokens.
    pub rows: [Buffer; 2],
    /// The caches, table and lengths (`max_kv_len` unused).
    pub kv: PagedShape,
    /// Entries of the new rows' prefix sums.
    pub cu_seqlens: usize,
    pub max_new_len: usize,
    /// Entries of the buffers for the lengths after and the dropped count.
    pub new_kv_lens: Option<usize>,
    pub dropped: Option<usize>,
}

/// Checks a paged append of rows sized by `spec`'s head dims. Returns
/// whether to launch: there are sequences (with no new rows the kernel
/// still writes their lengths after).
pub(crate) fn check_append(spec: &Spec, p: &AppendProblem) -> Result<bool, Error> {
    if p.dtype != spec.dtype {
        return Err(Error::Dtype { spec: spec.dtype, got: p.dtype });
    }
    check_caches(spec, &p.kv)?;
    let cache = p.kv.caches[0].0;
    let [k, v] = p.rows.map(|b| b.layout);
    for (operand, what, got, expected) in [
        (Operand::V, "tokens", v.seq, k.seq),
        (Operand::K, "heads", k.heads, cache.heads),
        (Operand::V, "heads", v.heads, cache.heads),
    ] {
        if got != expected {
            let other = if what == "tokens" { Operand::K } else { operand };
            return Err(Error::SizeMismatch { operand, other, what, got, expected });
        }
    }
    for (operand, got, expected) in [(Operand::K, k.dim, spec.head_dims.qk), (Operand::V, v.dim, spec.head_dims.v)] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    let (batch, tokens, max) = (p.kv.batch, k.seq, p.max_new_len);
    if p.cu_seqlens != batch.saturating_add(1) {
        return Err(Error::Ragged(RaggedError::CuSeqlensLen {
            which: "cu_seqlens",
            len: p.cu_seqlens,
            expected: batch.saturating_add(1),
        }));
    }
    if max > tokens || (max == 0 && tokens > 0) {
        return Err(Error::Ragged(RaggedError::MaxSeqlen { which: "max_new_len", max, tokens }));
    }
    for (which, len, needed) in [("new_kv_lens", p.new_kv_lens, batch), ("dropped", p.dropped, 1)] {
        match len {
            Some(len) if len < needed => {
                return Err(Error::Ragged(RaggedError::PagedEntries { which, len, expected: needed }))
            }
            _ => {}
        }
    }
    for (what, value, max) in [("batch", batch, MAX_GRID_YZ), ("tokens of the new rows", tokens, MAX_LEN)] {
        if value > max {
            return Err(Error::TooLarge { what, value, max });
        }
    }
    for (operand, rows) in [Operand::K, Operand::V].into_iter().zip(&p.rows) {
        check_bounds(operand, rows)?;
    }
    check_cache_buffers(&p.kv)?;
    Ok(batch > 0)
}

/// Q and O (`[q, o]`, as one batch row of tokens): equal sizes, the spec's
/// head dims, and their split into `batch` sequences (prefix sums of
/// `cu_seqlens_q` = `batch + 1` entries and at least `max_q_len` tokens,
/// or, without prefix sums, `batch · max_q_len` dense tokens).
pub(crate) fn check_queries(
    spec: &Spec,
    [q, o]: [&Buffer; 2],
    batch: usize,
    cu_seqlens_q: Option<usize>,
    max_q_len: usize,
) -> Result<(), Error> {
    let (q, o) = (&q.layout, &o.layout);
    for (what, got, expected) in [("tokens", o.seq, q.seq), ("heads", o.heads, q.heads)] {
        if got != expected {
            return Err(Error::SizeMismatch { operand: Operand::O, other: Operand::Q, what, got, expected });
        }
    }
    for (operand, got, expected) in [(Operand::Q, q.dim, spec.head_dims.qk), (Operand::O, o.dim, spec.head_dims.v)] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    let (tokens, max) = (q.seq, max_q_len);
    match cu_seqlens_q {
        Some(len) if len != batch.saturating_add(1) => Err(Error::Ragged(RaggedError::CuSeqlensLen {
            which: "cu_seqlens_q",
            len,
            expected: batch.saturating_add(1),
        })),
        Some(_) if max > tokens || (max == 0 && tokens > 0) => {
            Err(Error::Ragged(RaggedError::MaxSeqlen { which: "max_q_len", max, tokens }))
        }
        None if batch.checked_mul(max) != Some(tokens) => {
            Err(Error::Ragged(RaggedError::DenseQueries { tokens, batch, q_len: max }))
        }
        _ => Ok(()),
    }
}

/// The caches' sizes the kernels take as i32 (pages, page size, pages per
/// sequence), and every row of K and V inside its buffer.
pub(crate) fn check_cache_buffers(kv: &PagedShape) -> Result<(), Error> {
    let cache = kv.caches[0].0;
    for (what, value) in
        [("num_pages", cache.num_pages), ("page_size", cache.page_size), ("pages_per_seq", kv.pages_per_seq)]
    {
        if value > i32::MAX as usize {
            return Err(Error::TooLarge { what, value, max: i32::MAX as usize });
        }
    }
    for (operand, (layout, len)) in [Operand::K, Operand::V].into_iter().zip(kv.caches) {
        check_bounds(operand, &Buffer { layout: layout.as_layout(), len })?;
    }
    Ok(())
}

/// K and V: the same pages, page size and heads, the spec's head dims, a
/// nonzero page size, a block table and lengths of the batch's entries,
/// and a longest length that fits a sequence's pages.
pub(crate) fn check_caches(spec: &Spec, kv: &PagedShape) -> Result<(), Error> {
    let [(k, _), (v, _)] = kv.caches;
    for (what, got, expected) in
        [("pages", v.num_pages, k.num_pages), ("page_size", v.page_size, k.page_size), ("heads", v.heads, k.heads)]
    {
        if got != expected {
            return Err(Error::SizeMismatch { operand: Operand::V, other: Operand::K, what, got, expected });
        }
    }
    for (operand, got, expected) in [(Operand::K, k.dim, spec.head_dims.qk), (Operand::V, v.dim, spec.head_dims.v)] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    if k.page_size == 0 {
        return Err(Error::Ragged(RaggedError::ZeroPageSize));
    }
    let table = kv.batch.saturating_mul(kv.pages_per_seq);
    for (which, len, expected) in [("block_table", kv.table_len, table), ("kv_lens", kv.kv_lens_len, kv.batch)] {
        if len != expected {
            return Err(Error::Ragged(RaggedError::PagedEntries { which, len, expected }));
        }
    }
    let capacity = match k.num_pages {
        0 => 0,
        _ => kv.pages_per_seq.saturating_mul(k.page_size),
    };
    if kv.max_kv_len > capacity {
        return Err(Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: kv.max_kv_len, capacity }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    // The varlen checks' fixtures: the paged forward's queries are packed alike.
    use crate::check_varlen::tests::{buffer, spec};
    use crate::layout::PackedLayout;
    use crate::paged::PagedLayout;
    use flashgen_codegen::ElemTy;

    /// K and V caches of `layout`, each in a buffer of its own exact size.
    fn caches(layout: PagedLayout) -> [(PagedLayout, usize); 2] {
        [(layout, layout.as_layout().len()); 2]
    }

    /// 3 sequences, 100 query tokens (the longest 60), 8 query heads; 40
    /// pages of 16 rows, 2 K/V heads, 5 pages per sequence (80 keys), the
    /// longest 70.
    fn problem() -> PagedProblem {
        let [q, o] = [PackedLayout::thd(100, 8, 64); 2].map(buffer);
        let kv = PagedShape {
            caches: caches(PagedLayout::contiguous(40, 16, 2, 64)),
            table_len: 15,
            kv_lens_len: 3,
            pages_per_seq: 5,
            max_kv_len: 70,
            batch: 3,
        };
        PagedProblem { dtype: Dtype::Bf16, q, o, lse: Some(800), kv, cu_seqlens_q: Some(4), max_q_len: 60 }
    }

    fn check(p: &PagedProblem) -> Result<Option<PackedChecked>, Error> {
        check_paged(&spec(), p, &[ArgInfo::Tensor(ElemTy::I32, p.kv.batch * p.kv.max_kv_len)])
    }

    fn with_kv(kv: impl FnOnce(&mut PagedShape)) -> PagedProblem {
        let mut p = problem();
        kv(&mut p.kv);
        p
    }

    #[test]
    fn accepts_packed_and_dense_queries() {
        let shape = Shape { batch: 3, heads: 8, heads_kv: 2, q_len: 60, kv_len: 70 };
        assert_eq!(check(&problem()).unwrap(), Some(PackedChecked { shape, total_q: 100 }));
        // Dense: 3 sequences of 20 queries are 60 tokens.
        let [q, o] = [PackedLayout::thd(60, 8, 64); 2].map(buffer);
        let dense = PagedProblem { q, o, cu_seqlens_q: None, max_q_len: 20, ..problem() };
        assert_eq!(check(&dense).unwrap().unwrap().shape.q_len, 20);
        let err = check(&PagedProblem { max_q_len: 21, ..dense }).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::DenseQueries { tokens: 60, batch: 3, q_len: 21 })), "{err}");
    }

    #[test]
    fn page_size_zero_is_refused() {
        let p = with_kv(|kv| kv.caches = caches(PagedLayout::contiguous(40, 0, 2, 64)));
        assert!(matches!(check(&p), Err(Error::Ragged(RaggedError::ZeroPageSize))));
    }

    #[test]
    fn table_and_lengths_hold_the_batch() {
        let err = check(&with_kv(|kv| kv.table_len = 14)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", len: 14, expected: 15 })),
            "{err}"
        );
        let err = check(&with_kv(|kv| kv.pages_per_seq = 4)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", len: 15, expected: 12 })),
            "{err}"
        );
        let err = check(&with_kv(|kv| kv.kv_lens_len = 4)).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "kv_lens", len: 4, expected: 3 })),
            "{err}"
        );
        let err = check(&PagedProblem { cu_seqlens_q: Some(3), ..problem() }).unwrap_err();
        assert!(
            matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_q", len: 3, expected: 4 })),
            "{err}"
        );
    }

    #[test]
    fn longest_length_fits_a_sequences_pages() {
        let err = check(&with_kv(|kv| kv.max_kv_len = 81)).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: 81, capacity: 80 })), "{err}");
        // No pages: no keys.
        let err = check(&with_kv(|kv| kv.caches = caches(PagedLayout::contiguous(0, 16, 2, 64)))).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::MaxKvLenPastPages { max_kv_len: 70, capacity: 0 })), "{err}");
        let p = with_kv(|kv| (kv.caches, kv.max_kv_len) = (caches(PagedLayout::contiguous(0, 16, 2, 64)), 0));
        let checked = check_paged(&spec(), &p, &[ArgInfo::Tensor(ElemTy::I32, 0)]).unwrap().unwrap();
        assert_eq!(checked.shape.kv_len, 0);
        let err = check(&PagedProblem { max_q_len: 101, ..problem() }).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: "max_q_len", max: 101, .. })), "{err}");
    }

    #[test]
    fn caches_must_agree_and_fit_their_buffers() {
        let err = check(&with_kv(|kv| kv.caches[1].0.num_pages = 39)).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::V, what: "pages", .. }), "{err}");
        let err = check(&with_kv(|kv| kv.caches[0].1 -= 1)).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::K, .. }), "{err}");
        // A strided view past its buffer: pages 1 element further apart.
        let err = check(&with_kv(|kv| kv.caches[1].0.strides[0] += 1)).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::V, .. }), "{err}");
        let err = check(&with_kv(|kv| kv.caches[1].0.strides[1] = -1)).unwrap_err();
        assert!(matches!(err, Error::NegativeStride { operand: Operand::V, .. }), "{err}");
        let err = check(&with_kv(|kv| kv.caches[0].0.dim = 32)).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::K, got: 32, .. }), "{err}");
        let err = check(&with_kv(|kv| kv.caches = caches(PagedLayout::contiguous(40, 16, 3, 64)))).unwrap_err();
        assert!(matches!(err, Error::HeadGroups { heads: 8, heads_kv: 3 }), "{err}");
    }

    #[test]
    fn queries_and_lse_fit_their_buffers() {
        let mut p = problem();
        p.o = buffer(PackedLayout::thd(99, 8, 64));
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::O, other: Operand::Q, .. }), "{err}");
        let err = check(&PagedProblem { lse: Some(799), ..problem() }).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 799, needed: 800 }), "{err}");
        // Nothing to compute: no sequences.
        let p = with_kv(|kv| (kv.batch, kv.table_len, kv.kv_lens_len) = (0, 0, 0));
        let p = PagedProblem { cu_seqlens_q: Some(1), ..p };
        assert_eq!(check_paged(&spec(), &p, &[ArgInfo::Tensor(ElemTy::I32, 0)]).unwrap(), None);
    }

    /// 3 sequences appending 10 rows (the most 6) to `problem`'s caches.
    fn append() -> AppendProblem {
        AppendProblem {
            dtype: Dtype::Bf16,
            rows: [PackedLayout::thd(10, 2, 64); 2].map(buffer),
            kv: PagedShape { max_kv_len: 0, ..problem().kv },
            cu_seqlens: 4,
            max_new_len: 6,
            new_kv_lens: Some(3),
            dropped: Some(1),
        }
    }

    fn append_err(p: AppendProblem) -> Error {
        check_append(&spec(), &p).unwrap_err()
    }

    #[test]
    fn appends_check_rows_caches_and_reports() {
        assert!(check_append(&spec(), &append()).unwrap());
        let none = [PackedLayout::thd(0, 2, 64); 2].map(buffer);
        assert!(check_append(&spec(), &AppendProblem { rows: none, max_new_len: 0, ..append() }).unwrap());
        let kv = PagedShape { batch: 0, table_len: 0, kv_lens_len: 0, ..append().kv };
        let no_seqs = AppendProblem { rows: none, max_new_len: 0, cu_seqlens: 1, kv, ..append() };
        assert!(!check_append(&spec(), &no_seqs).unwrap());
        let zero_pages = caches(PagedLayout::contiguous(40, 0, 2, 64));
        let err = append_err(AppendProblem { kv: PagedShape { caches: zero_pages, ..append().kv }, ..append() });
        assert!(matches!(err, Error::Ragged(RaggedError::ZeroPageSize)), "{err}");
        let err = append_err(AppendProblem { kv: PagedShape { table_len: 16, ..append().kv }, ..append() });
        assert!(matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "block_table", .. })), "{err}");
        let err = append_err(AppendProblem { cu_seqlens: 3, ..append() });
        assert!(matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens", .. })), "{err}");
        let err = append_err(AppendProblem { max_new_len: 11, ..append() });
        assert!(matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: "max_new_len", .. })), "{err}");
        let err = append_err(AppendProblem { new_kv_lens: Some(2), ..append() });
        assert!(matches!(err, Error::Ragged(RaggedError::PagedEntries { which: "new_kv_lens", .. })), "{err}");
        let rows = [PackedLayout::thd(10, 2, 64), PackedLayout::thd(10, 1, 64)].map(buffer);
        let err = append_err(AppendProblem { rows, ..append() });
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::V, what: "heads", .. }), "{err}");
        let mut rows = [PackedLayout::thd(10, 2, 64); 2].map(buffer);
        rows[0].len -= 1;
        let err = append_err(AppendProblem { rows, ..append() });
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::K, .. }), "{err}");
    }

    #[test]
    fn tensors_are_sized_by_the_longest_lengths() {
        let err = check_paged(&spec(), &problem(), &[ArgInfo::Tensor(ElemTy::I32, 209)]).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: 210, .. }), "{err}");
    }
}
