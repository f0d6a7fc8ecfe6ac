//! Everything `forward_varlen` and `backward_varlen` check before a launch, as pure functions
//! over layouts and lengths so it is testable without a GPU.
//!
//! The host sees the buffers' lengths, the prefix sums' entry counts and
//! the longest lengths, not the prefix sums themselves (they are on the
//! device): the kernels clamp each sequence into the buffers
//! (`library/varlen.cuh`), so what these checks cannot see gives wrong rows,
//! never an access out of bounds.

use crate::args::ArgInfo;
use crate::check::{check_bounds, check_grads, check_lse, check_operands, check_shape, Grads, Problem, MAX_LEN};
use crate::error::{Error, RaggedError};
use flashgen_codegen::abi::Operand;
use flashgen_codegen::{Shape, Spec};

/// A varlen forward launch as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VarlenProblem {
    /// The packed operands as one batch row of `tokens` positions each
    /// (`PackedLayout::as_layout`), and the LSE's length.
    pub operands: Problem,
    pub batch: usize,
    /// Entries of `cu_seqlens_q` and `cu_seqlens_k`.
    pub cu_seqlens: [usize; 2],
    /// `max_q_len` and `max_kv_len`.
    pub max_lens: [usize; 2],
}

/// A checked varlen launch: its shape (the lengths are the longest
/// sequences', which size the grid and the tensors' `Q_LEN` / `KV_LEN`
/// dims) and the tokens of Q (and O) and of K (and V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VarlenShape {
    pub shape: Shape,
    pub tokens: [usize; 2],
}

/// Checks a varlen forward launch of `spec`. Returns its shape, or `None`
/// when there is nothing to compute (no sequence, or no queries). Keys may
/// be absent: every row is then fully masked, and the kernel still writes
/// O and the LSE.
pub(crate) fn check_varlen(spec: &Spec, p: &VarlenProblem, args: &[ArgInfo]) -> Result<Option<VarlenShape>, Error> {
    let checked = check_packed(spec, p, args)?;
    if checked.shape.batch == 0 || checked.shape.q_len == 0 {
        return Ok(None);
    }
    check_varlen_lse(p, &checked)?;
    Ok(Some(checked))
}

/// Checks a varlen backward launch of `spec`: the forward's operands and
/// LSE (`p.operands.lse`, which must be given) as [`check_varlen`] does,
/// then each gradient operand against its counterpart (dO ~ O, dQ ~ Q,
/// dK ~ K, dV ~ V) and its buffer. Returns the shape, or `None` without a
/// sequence; no queries is still a launch (dK and dV must be 0).
pub(crate) fn check_varlen_backward(
    spec: &Spec,
    p: &VarlenProblem,
    g: &Grads,
    args: &[ArgInfo],
) -> Result<Option<VarlenShape>, Error> {
    let checked = check_packed(spec, p, args)?;
    check_grads(&p.operands, g)?;
    if checked.shape.batch == 0 {
        return Ok(None);
    }
    check_varlen_lse(p, &checked)?;
    Ok(Some(checked))
}

/// Everything both directions check but the LSE.
fn check_packed(spec: &Spec, p: &VarlenProblem, args: &[ArgInfo]) -> Result<VarlenShape, Error> {
    let ops = &p.operands;
    check_operands(spec, ops)?;
    let tokens = [ops.q.layout.seq, ops.k.layout.seq];
    for (which, len) in ["cu_seqlens_q", "cu_seqlens_k"].into_iter().zip(p.cu_seqlens) {
        let expected = p.batch.saturating_add(1);
        if len != expected {
            return Err(Error::Ragged(RaggedError::CuSeqlensLen { which, len, expected }));
        }
    }
    // A sequence cannot outgrow its buffer, and a longest length of 0 while
    // the buffers hold tokens is almost surely a caller's mistake (every
    // row would be left unwritten).
    for ((which, max), tokens) in ["max_q_len", "max_kv_len"].into_iter().zip(p.max_lens).zip(tokens) {
        if max > tokens || (max == 0 && tokens > 0) {
            return Err(Error::Ragged(RaggedError::MaxSeqlen { which, max, tokens }));
        }
    }
    let [q_len, kv_len] = p.max_lens;
    let shape = Shape { batch: p.batch, heads: ops.q.layout.heads, heads_kv: ops.k.layout.heads, q_len, kv_len };
    check_shape(spec, &shape, args)?;
    // Token counts are i32 kernel arguments, rounded up to tiles there.
    for (what, value) in [("total_q (tokens of Q)", tokens[0]), ("total_kv (tokens of K)", tokens[1])] {
        if value > MAX_LEN {
            return Err(Error::TooLarge { what, value, max: MAX_LEN });
        }
    }
    for (operand, buffer) in [(Operand::Q, &ops.q), (Operand::K, &ops.k), (Operand::V, &ops.v), (Operand::O, &ops.o)] {
        check_bounds(operand, buffer)?;
    }
    Ok(VarlenShape { shape, tokens })
}

/// The LSE, where given, holds `[heads, total_q]`.
fn check_varlen_lse(p: &VarlenProblem, checked: &VarlenShape) -> Result<(), Error> {
    check_lse(p.operands.lse, checked.shape.heads.saturating_mul(checked.tokens[0]))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::check::Buffer;
    use crate::layout::PackedLayout;
    use flashgen_codegen::{parse_one, Dtype, ElemTy};

    /// Per-sequence tensors are `[B, max_len]`.
    pub(crate) fn spec() -> Spec {
        parse_one("G { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }").unwrap()
    }

    /// A buffer that holds `layout` exactly.
    pub(crate) fn buffer(layout: PackedLayout) -> Buffer {
        let layout = layout.as_layout();
        Buffer { layout, len: layout.len() }
    }

    /// 3 sequences, 100 query and 300 key tokens, the longest 60 and 200;
    /// 8 query heads, 2 K/V heads.
    fn problem() -> VarlenProblem {
        let [q, o] = [PackedLayout::thd(100, 8, 64); 2].map(buffer);
        let [k, v] = [PackedLayout::thd(300, 2, 64); 2].map(buffer);
        let operands = Problem { dtype: Dtype::Bf16, q, k, v, o, lse: Some(8 * 100) };
        VarlenProblem { operands, batch: 3, cu_seqlens: [4, 4], max_lens: [60, 200] }
    }

    fn args(batch: usize, max_kv: usize) -> [ArgInfo; 1] {
        [ArgInfo::Tensor(ElemTy::I32, batch * max_kv)]
    }

    fn check(p: &VarlenProblem) -> Result<Option<VarlenShape>, Error> {
        check_varlen(&spec(), p, &args(3, 200))
    }

    #[test]
    fn accepts_a_valid_launch() {
        let checked = check(&problem()).unwrap().unwrap();
        let shape = Shape { batch: 3, heads: 8, heads_kv: 2, q_len: 60, kv_len: 200 };
        assert_eq!(checked, VarlenShape { shape, tokens: [100, 300] });
        // Strided views are fine where they stay inside their buffers.
        let mut p = problem();
        p.operands.q = Buffer {
            layout: PackedLayout { strides: [1024, 64], ..PackedLayout::thd(100, 8, 64) }.as_layout(),
            len: 100 * 1024,
        };
        check(&p).unwrap().unwrap();
    }

    #[test]
    fn prefix_sums_need_batch_plus_one_entries() {
        for (cu_seqlens, which, len) in
            [([3, 4], "cu_seqlens_q", 3), ([4, 5], "cu_seqlens_k", 5), ([0, 4], "cu_seqlens_q", 0)]
        {
            let err = check(&VarlenProblem { cu_seqlens, ..problem() }).unwrap_err();
            assert!(
                matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: w, len: l, expected: 4 }) if w == which && l == len),
                "{err}"
            );
            assert!(err.to_string().contains("batch + 1 = 4"), "{err}");
        }
    }

    #[test]
    fn longest_lengths_must_fit_the_buffers() {
        for (max_lens, which, max) in [
            ([101, 200], "max_q_len", 101),
            ([60, 301], "max_kv_len", 301),
            ([0, 200], "max_q_len", 0),
            ([60, 0], "max_kv_len", 0),
        ] {
            let err = check(&VarlenProblem { max_lens, ..problem() }).unwrap_err();
            assert!(
                matches!(err, Error::Ragged(RaggedError::MaxSeqlen { which: w, max: m, .. }) if w == which && m == max),
                "{err}"
            );
        }
    }

    #[test]
    fn empty_launches_launch_nothing_but_empty_keys_do() {
        // No queries at all: nothing to write.
        let mut p = problem();
        let [q, o] = [PackedLayout::thd(0, 8, 64); 2].map(buffer);
        (p.operands.q, p.operands.o, p.max_lens[0]) = (q, o, 0);
        assert_eq!(check(&p).unwrap(), None);
        // No sequences.
        let p = VarlenProblem { batch: 0, cu_seqlens: [1, 1], ..problem() };
        assert_eq!(check_varlen(&spec(), &p, &args(0, 200)).unwrap(), None);
        // No keys: rows are fully masked, O and the LSE still written.
        let mut p = problem();
        let [k, v] = [PackedLayout::thd(0, 2, 64); 2].map(buffer);
        (p.operands.k, p.operands.v, p.max_lens[1]) = (k, v, 0);
        let checked = check_varlen(&spec(), &p, &args(3, 0)).unwrap().unwrap();
        assert_eq!((checked.shape.kv_len, checked.tokens), (0, [100, 0]));
    }

    #[test]
    fn heads_must_group() {
        let mut p = problem();
        let [k, v] = [PackedLayout::thd(300, 3, 64); 2].map(buffer);
        (p.operands.k, p.operands.v) = (k, v);
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::HeadGroups { heads: 8, heads_kv: 3 }), "{err}");
    }

    #[test]
    fn buffers_must_hold_their_tokens() {
        let mut p = problem();
        p.operands.k.len -= 1;
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::K, .. }), "{err}");
        let mut p = problem();
        p.operands.o = buffer(PackedLayout::thd(99, 8, 64));
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::O, other: Operand::Q, .. }), "{err}");
        let err = check(&VarlenProblem { operands: Problem { lse: Some(799), ..problem().operands }, ..problem() });
        assert!(matches!(err, Err(Error::LseTooSmall { len: 799, needed: 800 })), "{err:?}");
    }

    /// The gradients of `problem()`: dO like O, dQ like Q, dK and dV like K.
    fn grads() -> Grads {
        let [d_o, dq] = [PackedLayout::thd(100, 8, 64); 2].map(buffer);
        let [dk, dv] = [PackedLayout::thd(300, 2, 64); 2].map(buffer);
        Grads { d_o, dq, dk, dv }
    }

    #[test]
    fn backward_checks_the_gradients_and_the_lse() {
        let check = |p: &VarlenProblem, g: &Grads| check_varlen_backward(&spec(), p, g, &args(3, 200));
        let checked = check(&problem(), &grads()).unwrap().unwrap();
        assert_eq!(checked.tokens, [100, 300]);
        let mut g = grads();
        g.dk = buffer(PackedLayout::thd(299, 2, 64));
        let err = check(&problem(), &g).unwrap_err();
        assert!(matches!(err, Error::SizeMismatch { operand: Operand::DK, other: Operand::K, .. }), "{err}");
        let mut g = grads();
        g.dq.len -= 1;
        let err = check(&problem(), &g).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::DQ, .. }), "{err}");
        let mut g = grads();
        g.d_o = buffer(PackedLayout::thd(100, 8, 32));
        let err = check(&problem(), &g).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::DO, got: 32, .. }), "{err}");
        let p = VarlenProblem { operands: Problem { lse: Some(799), ..problem().operands }, ..problem() };
        let err = check(&p, &grads()).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 799, needed: 800 }), "{err}");
        // The forward's checks hold too.
        let err = check(&VarlenProblem { cu_seqlens: [4, 3], ..problem() }, &grads()).unwrap_err();
        assert!(matches!(err, Error::Ragged(RaggedError::CuSeqlensLen { which: "cu_seqlens_k", .. })), "{err}");
    }

    #[test]
    fn backward_without_queries_still_launches() {
        // dK and dV must be written (zeros) even when no sequence has a query.
        let (mut p, mut g) = (problem(), grads());
        let [q, o] = [PackedLayout::thd(0, 8, 64); 2].map(buffer);
        (p.operands.q, p.operands.o, p.max_lens[0], p.operands.lse) = (q, o, 0, Some(0));
        (g.dq, g.d_o) = (q, o);
        let checked = check_varlen_backward(&spec(), &p, &g, &args(3, 200)).unwrap().unwrap();
        assert_eq!((checked.shape.q_len, checked.tokens), (0, [0, 300]));
        let p = VarlenProblem { batch: 0, cu_seqlens: [1, 1], ..problem() };
        assert_eq!(check_varlen_backward(&spec(), &p, &grads(), &args(0, 200)).unwrap(), None);
    }

    #[test]
    fn tensors_are_sized_by_the_longest_sequences() {
        // doc: i32[B, KV_LEN] holds batch · max_kv_len elements.
        let err = check_varlen(&spec(), &problem(), &args(3, 199)).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: 600, .. }), "{err}");
    }
}
