//! Everything `forward` checks before a launch, as pure functions over
//! layouts and buffer lengths so it is testable without a GPU.
//!
//! The kernels trust these checks: they index with the given strides and
//! sizes without bounds tests, so a launch that passes them cannot read or
//! write outside the buffers it was given.

use crate::args::{check_args, ArgInfo};
use crate::error::Error;
use crate::layout::Layout;
use flashgen_codegen::abi::{Axis, Operand};
use flashgen_codegen::{Dtype, Shape, Spec};

/// CUDA's limit on grid dimensions y and z (heads and batch).
pub(crate) const MAX_GRID_YZ: usize = 65_535;

/// The longest sequence (and the most tokens of a packed batch) a launch
/// takes: lengths are i32 kernel arguments, and kernels round them up to
/// whole tiles (of at most 256 rows, a few tiles ahead) in 32-bit ints.
pub(crate) const MAX_LEN: usize = (1 << 31) - 1024;

/// An operand as the checks see it: its layout and its buffer's length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Buffer {
    pub layout: Layout,
    pub len: usize,
}

/// A forward launch as the checks see it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub dtype: Dtype,
    pub q: Buffer,
    pub k: Buffer,
    pub v: Buffer,
    pub o: Buffer,
    /// Length of the LSE buffer, if one was given.
    pub lse: Option<usize>,
}

impl Problem {
    /// Q, K, V and O as (layout, buffer length), in that order.
    pub fn new(dtype: Dtype, operands: [(Layout, usize); 4], lse: Option<usize>) -> Problem {
        let [q, k, v, o] = operands.map(|(layout, len)| Buffer { layout, len });
        Problem { dtype, q, k, v, o, lse }
    }
}

/// The launch's softmax scale: the given one, else `1 / sqrt(head_dims.qk)`.
/// It must be positive and finite: the kernels take a row's max before
/// scaling it (`SUnits::Dots` in the forward's code generator), which a
/// negative, zero or NaN scale would turn into a wrong softmax.
pub(crate) fn softmax_scale(spec: &Spec, scale: Option<f32>) -> Result<f32, Error> {
    let scale = scale.unwrap_or((1.0 / f64::from(spec.head_dims.qk).sqrt()) as f32);
    match scale.is_finite() && scale > 0.0 {
        true => Ok(scale),
        false => Err(Error::Scale { scale }),
    }
}

/// Checks a forward launch of `spec`. Returns its shape, or `None` when the
/// output is empty (no batch or no queries) and nothing should be launched.
/// An empty key sequence still launches: every row is fully masked and the
/// kernel must still write O and the LSE.
pub(crate) fn check_forward(spec: &Spec, p: &Problem, args: &[ArgInfo]) -> Result<Option<Shape>, Error> {
    check_operands(spec, p)?;
    let (q, k) = (&p.q.layout, &p.k.layout);
    let shape = Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq };
    check_shape(spec, &shape, args)?;
    for (operand, buffer) in [(Operand::Q, &p.q), (Operand::K, &p.k), (Operand::V, &p.v), (Operand::O, &p.o)] {
        check_bounds(operand, buffer)?;
    }
    if shape.batch == 0 || shape.q_len == 0 {
        return Ok(None);
    }
    check_lse(p.lse, shape.batch.saturating_mul(shape.heads).saturating_mul(shape.q_len))?;
    Ok(Some(shape))
}

/// An LSE buffer of `len` elements, where given, holds the `needed` rows.
pub(crate) fn check_lse(len: Option<usize>, needed: usize) -> Result<(), Error> {
    match len {
        Some(len) if len < needed => Err(Error::LseTooSmall { len, needed }),
        _ => Ok(()),
    }
}

/// The dtype, and the sizes the operands must share with each other and
/// with the spec's head dims.
pub(crate) fn check_operands(spec: &Spec, p: &Problem) -> Result<(), Error> {
    if p.dtype != spec.dtype {
        return Err(Error::Dtype { spec: spec.dtype, got: p.dtype });
    }
    let (q, k, v, o) = (&p.q.layout, &p.k.layout, &p.v.layout, &p.o.layout);
    for (operand, l, other, expected, what) in [
        (Operand::K, k.batch, Operand::Q, q.batch, "batch"),
        (Operand::V, v.batch, Operand::Q, q.batch, "batch"),
        (Operand::O, o.batch, Operand::Q, q.batch, "batch"),
        (Operand::O, o.heads, Operand::Q, q.heads, "heads"),
        (Operand::V, v.heads, Operand::K, k.heads, "heads"),
        (Operand::O, o.seq, Operand::Q, q.seq, "seq"),
        (Operand::V, v.seq, Operand::K, k.seq, "seq"),
    ] {
        if l != expected {
            return Err(Error::SizeMismatch { operand, other, what, got: l, expected });
        }
    }
    for (operand, got, expected) in [
        (Operand::Q, q.dim, spec.head_dims.qk),
        (Operand::K, k.dim, spec.head_dims.qk),
        (Operand::V, v.dim, spec.head_dims.v),
        (Operand::O, o.dim, spec.head_dims.v),
    ] {
        if got != expected as usize {
            return Err(Error::HeadDim { operand, got, expected });
        }
    }
    Ok(())
}

/// The gradient operands of a backward launch as the checks see them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grads {
    pub d_o: Buffer,
    pub dq: Buffer,
    pub dk: Buffer,
    pub dv: Buffer,
}

/// Checks a backward launch of `spec`: Q, K, V, O, the LSE (`p.lse`, which
/// must be given) and the params as [`check_forward`] does, then each
/// gradient operand against its counterpart (dO ~ O, dQ ~ Q, dK ~ K,
/// dV ~ V) and its buffer. Returns the shape, or `None` without a batch.
/// Unlike the forward, no queries is still a launch: dK and dV must be 0.
pub(crate) fn check_backward(spec: &Spec, p: &Problem, g: &Grads, args: &[ArgInfo]) -> Result<Option<Shape>, Error> {
    check_forward(spec, p, args)?;
    check_grads(p, g)?;
    let (q, k) = (&p.q.layout, &p.k.layout);
    let shape = Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq };
    Ok((shape.batch > 0).then_some(shape))
}

/// Each gradient operand against its counterpart (dO ~ O, dQ ~ Q, dK ~ K,
/// dV ~ V) and its buffer.
pub(crate) fn check_grads(p: &Problem, g: &Grads) -> Result<(), Error> {
    for (operand, grad, other, of) in [
        (Operand::DO, &g.d_o, Operand::O, &p.o),
        (Operand::DQ, &g.dq, Operand::Q, &p.q),
        (Operand::DK, &g.dk, Operand::K, &p.k),
        (Operand::DV, &g.dv, Operand::V, &p.v),
    ] {
        let (l, expected) = (&grad.layout, &of.layout);
        for (what, got, want) in
            [("batch", l.batch, expected.batch), ("seq", l.seq, expected.seq), ("heads", l.heads, expected.heads)]
        {
            if got != want {
                return Err(Error::SizeMismatch { operand, other, what, got, expected: want });
            }
        }
        if l.dim != expected.dim {
            return Err(Error::HeadDim { operand, got: l.dim, expected: expected.dim as u32 });
        }
        check_bounds(operand, grad)?;
    }
    Ok(())
}

/// Head groups, size limits and the params and tensors, for a launch of
/// `shape` (shared by the forward pass and block-mask builds).
pub(crate) fn check_shape(spec: &Spec, shape: &Shape, args: &[ArgInfo]) -> Result<(), Error> {
    if shape.heads == 0 || shape.heads_kv == 0 || !shape.heads.is_multiple_of(shape.heads_kv) {
        return Err(Error::HeadGroups { heads: shape.heads, heads_kv: shape.heads_kv });
    }
    // q_len ≤ MAX_LEN also keeps the grid's x dimension (query tiles)
    // within CUDA's 2^31 - 1, and heads_kv divides heads, so it needs no
    // check of its own.
    for (what, value, max) in [
        ("batch", shape.batch, MAX_GRID_YZ),
        ("heads", shape.heads, MAX_GRID_YZ),
        ("q_len", shape.q_len, MAX_LEN),
        ("kv_len", shape.kv_len, MAX_LEN),
    ] {
        if value > max {
            return Err(Error::TooLarge { what, value, max });
        }
    }
    check_args(spec, shape, args)
}

/// Rejects negative strides, then checks that every element the layout
/// addresses lies inside the buffer at an offset the kernel's int64 indexing
/// can hold.
pub(crate) fn check_bounds(operand: Operand, b: &Buffer) -> Result<(), Error> {
    let needed = needed_len(&b.layout).map_err(|fault| match fault {
        LayoutFault::NegativeStride(axis, stride) => Error::NegativeStride { operand, axis, stride },
        LayoutFault::Overflow => Error::OffsetOverflow { operand },
    })?;
    if needed > b.len as u128 {
        return Err(Error::OutOfBounds { operand, needed, len: b.len });
    }
    Ok(())
}

/// Why a layout has no place in any buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayoutFault {
    /// A negative stride of an axis.
    NegativeStride(Axis, i64),
    /// Its last element's offset leaves i64.
    Overflow,
}

/// The elements a buffer needs to hold every element `l` addresses: its
/// last element's offset + 1, or, when it addresses none, its offset. An
/// empty operand may still be launched (no keys, no queries in a backward)
/// and its address formed (`Layout::address`), which must not leave the
/// buffer (a start near `usize::MAX` overflowed it). Negative strides are
/// refused first, even in an empty layout.
pub(crate) fn needed_len(l: &Layout) -> Result<u128, LayoutFault> {
    let axes = [(Axis::Batch, l.batch), (Axis::Seq, l.seq), (Axis::Head, l.heads)];
    for ((axis, _), &stride) in axes.iter().zip(&l.strides) {
        if stride < 0 {
            return Err(LayoutFault::NegativeStride(*axis, stride));
        }
    }
    if l.is_empty() {
        return Ok(l.offset as u128);
    }
    // The last element sits at offset + Σ (size - 1) · stride + (dim - 1).
    let mut last = l.offset as i128 + l.dim as i128 - 1;
    for ((_, size), &stride) in axes.iter().zip(&l.strides) {
        let step = (*size as i128 - 1).checked_mul(stride as i128).ok_or(LayoutFault::Overflow)?;
        last = last.checked_add(step).ok_or(LayoutFault::Overflow)?;
    }
    if last > i64::MAX as i128 {
        return Err(LayoutFault::Overflow);
    }
    Ok(last as u128 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen_codegen::{parse_one, ElemTy};

    fn gqa() -> Spec {
        parse_one("G { dtype: bf16, head_dim: 192, v_head_dim: 128, tensor slopes: f32[H] }").unwrap()
    }

    fn contiguous(layout: Layout) -> Buffer {
        Buffer { layout, len: layout.len() }
    }

    /// B=2, Q_LEN=100, KV_LEN=300, H=8, H_KV=2, dims 192/128, BSHD buffers.
    fn problem() -> Problem {
        Problem {
            dtype: Dtype::Bf16,
            q: contiguous(Layout::bshd(2, 100, 8, 192)),
            k: contiguous(Layout::bshd(2, 300, 2, 192)),
            v: contiguous(Layout::bhsd(2, 300, 2, 128)),
            o: contiguous(Layout::bshd(2, 100, 8, 128)),
            lse: Some(2 * 8 * 100),
        }
    }

    const ARGS: [ArgInfo; 1] = [ArgInfo::Tensor(ElemTy::F32, 8)];

    fn check(p: &Problem) -> Result<Option<Shape>, Error> {
        check_forward(&gqa(), p, &ARGS)
    }

    #[test]
    fn softmax_scale_defaults_to_the_head_dim_and_must_be_positive() {
        assert_eq!(softmax_scale(&gqa(), None).unwrap(), (1.0 / 192f64.sqrt()) as f32);
        assert_eq!(softmax_scale(&gqa(), Some(0.5)).unwrap(), 0.5);
        for bad in [0.0, -0.125, f32::NAN, f32::INFINITY] {
            let err = softmax_scale(&gqa(), Some(bad)).unwrap_err();
            assert!(matches!(err, Error::Scale { .. }), "{err}");
            assert!(err.to_string().contains("positive and finite"), "{err}");
        }
    }

    #[test]
    fn accepts_a_valid_problem() {
        let shape = check(&problem()).unwrap().unwrap();
        assert_eq!(shape, Shape { batch: 2, heads: 8, heads_kv: 2, q_len: 100, kv_len: 300 });
        check(&Problem { lse: None, ..problem() }).unwrap().unwrap();
    }

    #[test]
    fn dtype_mismatch() {
        let err = check(&Problem { dtype: Dtype::F16, ..problem() }).unwrap_err();
        assert!(matches!(err, Error::Dtype { spec: Dtype::Bf16, got: Dtype::F16 }), "{err}");
    }

    #[test]
    fn size_mismatches_name_both_operands() {
        let mut p = problem();
        p.v = contiguous(Layout::bshd(2, 299, 2, 128));
        let err = check(&p).unwrap_err();
        assert!(
            matches!(err, Error::SizeMismatch { operand: Operand::V, other: Operand::K, what: "seq", .. }),
            "{err}"
        );
        assert_eq!(err.to_string(), "V has seq = 299 but K has seq = 300");

        let mut p = problem();
        p.o = contiguous(Layout::bshd(1, 100, 8, 128));
        assert!(matches!(check(&p), Err(Error::SizeMismatch { operand: Operand::O, what: "batch", .. })));
    }

    #[test]
    fn head_dims_come_from_the_spec() {
        let mut p = problem();
        p.k = contiguous(Layout::bshd(2, 300, 2, 128));
        assert!(matches!(check(&p), Err(Error::HeadDim { operand: Operand::K, got: 128, expected: 192 })));
        let mut p = problem();
        p.o = contiguous(Layout::bshd(2, 100, 8, 192));
        assert!(matches!(check(&p), Err(Error::HeadDim { operand: Operand::O, got: 192, expected: 128 })));
    }

    #[test]
    fn heads_must_divide() {
        let mut p = problem();
        p.k = contiguous(Layout::bshd(2, 300, 3, 192));
        p.v = contiguous(Layout::bshd(2, 300, 3, 128));
        assert!(matches!(check(&p), Err(Error::HeadGroups { heads: 8, heads_kv: 3 })));
        let mut p = problem();
        p.k = contiguous(Layout::bshd(2, 300, 0, 192));
        p.v = contiguous(Layout::bshd(2, 300, 0, 128));
        assert!(matches!(check(&p), Err(Error::HeadGroups { heads_kv: 0, .. })));
    }

    #[test]
    fn out_of_bounds_buffer() {
        let mut p = problem();
        p.q.len -= 1;
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::Q, needed, .. } if needed == p.q.len as u128 + 1));

        // A strided view into a larger buffer: stride 2·dim along seq.
        let mut p = problem();
        p.k.layout.strides = [300 * 2 * 384, 2 * 384, 192];
        p.k.len = 300 * 768 + 299 * 768 + 384;
        check(&p).unwrap();
        p.k.len -= 1;
        assert!(matches!(check(&p), Err(Error::OutOfBounds { operand: Operand::K, .. })));
    }

    #[test]
    fn negative_and_overflowing_strides() {
        let mut p = problem();
        p.v.layout.strides[1] = -128;
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::NegativeStride { operand: Operand::V, axis: Axis::Seq, stride: -128 }), "{err}");
        assert_eq!(err.to_string(), "V has negative seq stride -128");

        let mut p = problem();
        p.o.layout.strides[0] = i64::MAX;
        p.o.len = usize::MAX;
        assert!(matches!(check(&p), Err(Error::OffsetOverflow { operand: Operand::O })));
    }

    #[test]
    fn offsets_count_toward_the_bounds() {
        let mut p = problem();
        let needed = p.q.len as u128;
        p.q.layout.offset = 1;
        let err = check(&p).unwrap_err();
        assert!(matches!(err, Error::OutOfBounds { operand: Operand::Q, needed: n, .. } if n == needed + 1), "{err}");
    }

    /// Regression (found by `check_props`): an operand that addresses no
    /// element (here V of no keys, still launched) was accepted at any
    /// start, and the launch's `Layout::address` (base + 2 · offset) then
    /// overflowed, a panic in debug builds.
    #[test]
    fn empty_operands_start_inside_their_buffers() {
        let mut p = problem();
        p.k = contiguous(Layout::bshd(2, 0, 2, 192));
        p.v = Buffer { layout: Layout::bshd(2, 0, 2, 128).at(usize::MAX - 1), len: 1 << 20 };
        let err = check(&p).unwrap_err();
        let far = (usize::MAX - 1) as u128;
        assert!(
            matches!(err, Error::OutOfBounds { operand: Operand::V, needed, len } if needed == far && len == 1 << 20)
        );
        assert!(
            err.to_string().starts_with("V's layout reaches 18446744073709551614 elements into its buffer"),
            "{err}"
        );
        // Starting at the buffer's end is fine.
        p.v.layout.offset = 1 << 20;
        assert!(check(&p).unwrap().is_some());
    }

    #[test]
    fn lse_must_cover_every_row() {
        let err = check(&Problem { lse: Some(1599), ..problem() }).unwrap_err();
        assert!(matches!(err, Error::LseTooSmall { len: 1599, needed: 1600 }), "{err}");
    }

    #[test]
    fn args_are_checked() {
        assert!(matches!(check_forward(&gqa(), &problem(), &[]), Err(Error::ArgCount { .. })));
        let small = [ArgInfo::Tensor(ElemTy::F32, 7)];
        assert!(matches!(check_forward(&gqa(), &problem(), &small), Err(Error::TensorTooSmall { .. })));
    }

    #[test]
    fn empty_outputs_launch_nothing() {
        let mut p = problem();
        p.q = contiguous(Layout::bshd(2, 0, 8, 192));
        p.o = contiguous(Layout::bshd(2, 0, 8, 128));
        p.lse = Some(0);
        assert_eq!(check(&p).unwrap(), None);

        let mut p = problem();
        for b in [&mut p.q, &mut p.k, &mut p.v, &mut p.o] {
            b.layout.batch = 0;
            b.len = 0;
        }
        assert_eq!(check(&p).unwrap(), None);

        // No keys: still launched, so O gets written.
        let mut p = problem();
        p.k = contiguous(Layout::bshd(2, 0, 2, 192));
        p.v = contiguous(Layout::bshd(2, 0, 2, 128));
        assert!(check(&p).unwrap().is_some());
        // Zero heads is never allowed.
        let mut p = problem();
        p.q.layout.heads = 0;
        p.o.layout.heads = 0;
        assert!(matches!(check(&p), Err(Error::HeadGroups { heads: 0, .. })));
    }

    fn grads(p: &Problem) -> Grads {
        Grads { d_o: p.o, dq: p.q, dk: p.k, dv: p.v }
    }

    #[test]
    fn backward_checks_every_gradient_operand() {
        let p = problem();
        let shape = check_backward(&gqa(), &p, &grads(&p), &ARGS).unwrap().unwrap();
        assert_eq!(shape.heads_kv, 2);
        let mut g = grads(&p);
        g.dk = contiguous(Layout::bshd(2, 299, 2, 192));
        let err = check_backward(&gqa(), &p, &g, &ARGS).unwrap_err();
        assert!(
            matches!(err, Error::SizeMismatch { operand: Operand::DK, other: Operand::K, what: "seq", .. }),
            "{err}"
        );
        let mut g = grads(&p);
        g.d_o = contiguous(Layout::bshd(2, 100, 8, 192));
        let err = check_backward(&gqa(), &p, &g, &ARGS).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::DO, got: 192, expected: 128 }), "{err}");
        let mut g = grads(&p);
        g.dv.len -= 1;
        assert!(matches!(check_backward(&gqa(), &p, &g, &ARGS), Err(Error::OutOfBounds { operand: Operand::DV, .. })));
        let short_lse = Problem { lse: Some(1599), ..p };
        assert!(matches!(check_backward(&gqa(), &short_lse, &g, &ARGS), Err(Error::LseTooSmall { .. })));
    }

    #[test]
    fn backward_without_queries_still_launches() {
        let mut p = problem();
        p.q = contiguous(Layout::bshd(2, 0, 8, 192));
        p.o = contiguous(Layout::bshd(2, 0, 8, 128));
        p.lse = Some(0);
        let shape = check_backward(&gqa(), &p, &grads(&p), &ARGS).unwrap().unwrap();
        assert_eq!((shape.q_len, shape.kv_len), (0, 300));
    }

    #[test]
    fn grid_and_int_limits() {
        let mut p = problem();
        for b in [&mut p.q, &mut p.k, &mut p.v, &mut p.o] {
            b.layout.batch = 65_536;
        }
        assert!(matches!(check(&p), Err(Error::TooLarge { what: "batch", value: 65_536, max: 65_535 })));
        let mut p = problem();
        p.k.layout.seq = 1 << 31;
        p.v.layout.seq = 1 << 31;
        assert!(matches!(check(&p), Err(Error::TooLarge { what: "kv_len", .. })));
    }
}
