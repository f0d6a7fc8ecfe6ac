//! What the partials launches (context parallelism's merge and adds of
//! pieces, `partials.rs`) check, as pure functions over layouts and buffer
//! lengths so they are testable without a GPU. The kernels index every
//! operand with its strides and no bounds tests: each operand must have the
//! accumulator's sizes and hold its layout's last element, and each LSE its
//! `batch · heads · rows` floats from its offset.

use crate::check::{needed_len, Buffer, LayoutFault, MAX_GRID_YZ};
use crate::error::Error;
use flashgen_codegen::abi::Operand;
use flashgen_codegen::{Dtype, Shape, Spec};

/// An LSE `f32[batch, heads, rows]`, contiguous from `offset` in a buffer
/// of `len` floats.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LseBuffer {
    pub offset: usize,
    pub len: usize,
}

/// A merge as the checks see it: the accumulator (f32) and its LSE, the
/// piece and the output (storage dtype), each with its LSE, where given.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MergeBuffers {
    pub acc: Buffer,
    pub acc_lse: LseBuffer,
    pub piece: Option<(Buffer, LseBuffer)>,
    pub out: Option<(Buffer, LseBuffer)>,
}

/// An add as the checks see it: the accumulator (f32), the piece and the
/// output (storage dtype), where given.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AddBuffers {
    pub acc: Buffer,
    pub piece: Option<Buffer>,
    pub out: Option<Buffer>,
}

/// Checks a merge of `spec`'s O stored as `dtype`: the dtype, the
/// accumulator's head dim (the spec's V head dim, the kernel's), then the
/// operands as [`check_rows`] does and every LSE. Returns the launch shape
/// (rows as `q_len`), or `None` where there are no rows.
pub(crate) fn check_merge(spec: &Spec, dtype: Dtype, m: &MergeBuffers) -> Result<Option<Shape>, Error> {
    check_dtype(spec, dtype)?;
    let dim = m.acc.layout.dim;
    if dim != spec.head_dims.v as usize {
        return Err(Error::HeadDim { operand: Operand::O, got: dim, expected: spec.head_dims.v });
    }
    let piece = m.piece.map(|(buffer, _)| buffer);
    let out = m.out.map(|(buffer, _)| buffer);
    let shape = check_rows(&AddBuffers { acc: m.acc, piece, out })?;
    let l = &m.acc.layout;
    let rows = (l.batch as u128) * (l.heads as u128) * (l.seq as u128);
    let lses = [("acc_lse", Some(m.acc_lse)), ("piece_lse", m.piece.map(|p| p.1)), ("out_lse", m.out.map(|o| o.1))];
    for (operand, lse) in lses {
        if let Some(LseBuffer { offset, len }) = lse {
            if offset as u128 + rows > len as u128 {
                let problem =
                    format!("holds {len} floats but the launch uses {rows} (batch · heads · rows) from {offset} on");
                return Err(Error::Partial { operand, problem });
            }
        }
    }
    Ok(shape)
}

/// Checks an add of `spec`'s gradients stored as `dtype`: the dtype, then
/// the operands as [`check_rows`] does. Returns the launch shape (rows as
/// `q_len`) and the columns per row, or `None` where there is nothing to add.
pub(crate) fn check_add(spec: &Spec, dtype: Dtype, a: &AddBuffers) -> Result<Option<(Shape, usize)>, Error> {
    check_dtype(spec, dtype)?;
    let dim = a.acc.layout.dim;
    if dim > i32::MAX as usize {
        return Err(Error::TooLarge { what: "dim", value: dim, max: i32::MAX as usize });
    }
    Ok(check_rows(a)?.filter(|_| dim > 0).map(|shape| (shape, dim)))
}

/// Checks a flat add of `piece` (its length, where given) into an
/// accumulator of `acc` floats: the same length, which the kernel's i32
/// count holds. Returns the launch shape (the elements as `q_len`), or
/// `None` where there are none.
pub(crate) fn check_add_f32(acc: usize, piece: Option<usize>) -> Result<Option<Shape>, Error> {
    if let Some(len) = piece.filter(|&len| len != acc) {
        let problem = format!("holds {len} floats but the accumulator holds {acc}");
        return Err(Error::Partial { operand: "piece", problem });
    }
    if acc > i32::MAX as usize {
        return Err(Error::TooLarge { what: "elements", value: acc, max: i32::MAX as usize });
    }
    Ok((acc > 0).then_some(Shape { batch: 1, heads: 1, heads_kv: 1, q_len: acc, kv_len: 0 }))
}

fn check_dtype(spec: &Spec, dtype: Dtype) -> Result<(), Error> {
    match dtype == spec.dtype {
        true => Ok(()),
        false => Err(Error::Dtype { spec: spec.dtype, got: dtype }),
    }
}

/// The piece and the output have the accumulator's sizes; batch and heads
/// fit the grid, rows an i32; every operand's buffer holds its layout.
fn check_rows(a: &AddBuffers) -> Result<Option<Shape>, Error> {
    let l = &a.acc.layout;
    for (operand, other) in [("piece", a.piece), ("out", a.out)] {
        let Some(other) = other else { continue };
        let o = &other.layout;
        for (what, got, expected) in
            [("batch", o.batch, l.batch), ("rows", o.seq, l.seq), ("heads", o.heads, l.heads), ("dim", o.dim, l.dim)]
        {
            if got != expected {
                let problem = format!("has {what} = {got} but the accumulator has {what} = {expected}");
                return Err(Error::Partial { operand, problem });
            }
        }
    }
    for (what, value, max) in
        [("batch", l.batch, MAX_GRID_YZ), ("heads", l.heads, MAX_GRID_YZ), ("rows", l.seq, i32::MAX as usize)]
    {
        if value > max {
            return Err(Error::TooLarge { what, value, max });
        }
    }
    for (operand, buffer) in [("acc", Some(a.acc)), ("piece", a.piece), ("out", a.out)] {
        if let Some(buffer) = buffer {
            check_buffer(operand, &buffer)?;
        }
    }
    let empty = l.batch == 0 || l.heads == 0 || l.seq == 0;
    Ok((!empty).then_some(Shape { batch: l.batch, heads: l.heads, heads_kv: l.heads, q_len: l.seq, kv_len: 0 }))
}

/// `b`'s buffer holds every element its layout addresses.
fn check_buffer(operand: &'static str, b: &Buffer) -> Result<(), Error> {
    let problem = match needed_len(&b.layout) {
        Ok(needed) if needed <= b.len as u128 => return Ok(()),
        Ok(needed) => format!("its layout reaches {needed} elements into its buffer, which holds {}", b.len),
        Err(LayoutFault::NegativeStride(axis, stride)) => format!("negative {axis:?} stride {stride}"),
        Err(LayoutFault::Overflow) => "its layout addresses offsets beyond 64-bit indexing".to_string(),
    };
    Err(Error::Partial { operand, problem })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Layout;
    use flashgen_codegen::parse_one;

    fn contiguous(layout: Layout) -> Buffer {
        Buffer { layout, len: layout.len() }
    }

    fn gqa() -> Spec {
        parse_one("G { dtype: bf16, head_dim: 192, v_head_dim: 128 }").unwrap()
    }

    /// B = 2, 100 rows, 8 heads, d = 128; LSEs of 1600 floats, the piece's
    /// 16 floats into its buffer.
    fn merge() -> MergeBuffers {
        let o = Layout::bshd(2, 100, 8, 128);
        MergeBuffers {
            acc: contiguous(o),
            acc_lse: LseBuffer { offset: 0, len: 1600 },
            piece: Some((contiguous(Layout::bhsd(2, 100, 8, 128)), LseBuffer { offset: 16, len: 1616 })),
            out: Some((contiguous(o), LseBuffer { offset: 0, len: 1600 })),
        }
    }

    fn partial_error(err: Error) -> (&'static str, String) {
        match err {
            Error::Partial { operand, problem } => (operand, problem),
            other => panic!("expected Error::Partial, got {other}"),
        }
    }

    #[test]
    fn a_merge_of_matching_operands_passes() {
        let shape = check_merge(&gqa(), Dtype::Bf16, &merge()).unwrap().unwrap();
        assert_eq!((shape.batch, shape.heads, shape.q_len), (2, 8, 100));
        let bare = MergeBuffers { piece: None, out: None, ..merge() };
        assert!(check_merge(&gqa(), Dtype::Bf16, &bare).unwrap().is_some());
        let empty = Layout::bshd(2, 0, 8, 128);
        let none = MergeBuffers { acc: contiguous(empty), piece: None, out: None, ..merge() };
        assert!(check_merge(&gqa(), Dtype::Bf16, &none).unwrap().is_none());
    }

    #[test]
    fn a_merge_checks_dtype_head_dim_and_sizes() {
        let err = check_merge(&gqa(), Dtype::F16, &merge()).unwrap_err();
        assert!(matches!(err, Error::Dtype { spec: Dtype::Bf16, got: Dtype::F16 }), "{err}");
        let narrow = Layout::bshd(2, 100, 8, 192);
        let err = check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { acc: contiguous(narrow), ..merge() }).unwrap_err();
        assert!(matches!(err, Error::HeadDim { operand: Operand::O, got: 192, expected: 128 }), "{err}");
        let m = merge();
        let fewer_rows = (contiguous(Layout::bshd(2, 99, 8, 128)), m.out.unwrap().1);
        let (operand, problem) =
            partial_error(check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { out: Some(fewer_rows), ..m }).unwrap_err());
        assert_eq!((operand, problem.as_str()), ("out", "has rows = 99 but the accumulator has rows = 100"));
        let more_heads = (contiguous(Layout::bshd(2, 100, 9, 128)), m.piece.unwrap().1);
        let (operand, _) = partial_error(
            check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { piece: Some(more_heads), ..m }).unwrap_err(),
        );
        assert_eq!(operand, "piece");
    }

    #[test]
    fn a_merge_checks_every_buffer_and_lse() {
        let m = merge();
        let short = Buffer { len: m.acc.len - 1, ..m.acc };
        let (operand, problem) =
            partial_error(check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { acc: short, ..m }).unwrap_err());
        assert_eq!(operand, "acc");
        assert!(problem.contains("reaches 204800 elements"), "{problem}");
        let shifted = (Buffer { layout: m.piece.unwrap().0.layout.at(1), ..m.piece.unwrap().0 }, m.piece.unwrap().1);
        let (operand, _) =
            partial_error(check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { piece: Some(shifted), ..m }).unwrap_err());
        assert_eq!(operand, "piece");
        let mut negative = m.acc;
        negative.layout.strides[1] = -1;
        let (operand, problem) =
            partial_error(check_merge(&gqa(), Dtype::Bf16, &MergeBuffers { acc: negative, ..m }).unwrap_err());
        assert_eq!((operand, problem.as_str()), ("acc", "negative Seq stride -1"));
        for (which, lse) in [
            (0, LseBuffer { offset: 1, len: 1600 }),
            (1, LseBuffer { offset: 16, len: 1615 }),
            (2, LseBuffer { offset: 0, len: 0 }),
        ] {
            let m = match which {
                0 => MergeBuffers { acc_lse: lse, ..m },
                1 => MergeBuffers { piece: Some((m.piece.unwrap().0, lse)), ..m },
                _ => MergeBuffers { out: Some((m.out.unwrap().0, lse)), ..m },
            };
            let (operand, _) = partial_error(check_merge(&gqa(), Dtype::Bf16, &m).unwrap_err());
            assert_eq!(operand, ["acc_lse", "piece_lse", "out_lse"][which]);
        }
    }

    #[test]
    fn an_add_takes_any_head_dim_and_checks_sizes() {
        let dq = Layout::bshd(2, 100, 8, 192);
        let add = AddBuffers { acc: contiguous(dq), piece: Some(contiguous(dq)), out: Some(contiguous(dq)) };
        let (shape, dim) = check_add(&gqa(), Dtype::Bf16, &add).unwrap().unwrap();
        assert_eq!((shape.batch, shape.heads, shape.q_len, dim), (2, 8, 100, 192));
        let err = check_add(&gqa(), Dtype::F16, &add).unwrap_err();
        assert!(matches!(err, Error::Dtype { .. }), "{err}");
        let dv = contiguous(Layout::bshd(2, 100, 8, 128));
        let (operand, problem) =
            partial_error(check_add(&gqa(), Dtype::Bf16, &AddBuffers { out: Some(dv), ..add }).unwrap_err());
        assert_eq!((operand, problem.as_str()), ("out", "has dim = 128 but the accumulator has dim = 192"));
        let short = Buffer { len: 10, ..contiguous(dq) };
        let (operand, _) =
            partial_error(check_add(&gqa(), Dtype::Bf16, &AddBuffers { piece: Some(short), ..add }).unwrap_err());
        assert_eq!(operand, "piece");
        let no_cols = contiguous(Layout::bshd(2, 100, 8, 0));
        assert!(check_add(&gqa(), Dtype::Bf16, &AddBuffers { acc: no_cols, piece: None, out: None })
            .unwrap()
            .is_none());
        let wide = contiguous(Layout::bshd(1, 1, 65_536, 1));
        let err = check_add(&gqa(), Dtype::Bf16, &AddBuffers { acc: wide, piece: None, out: None }).unwrap_err();
        assert!(matches!(err, Error::TooLarge { what: "heads", .. }), "{err}");
    }

    #[test]
    fn a_flat_add_needs_equal_lengths_that_fit_i32() {
        assert_eq!(check_add_f32(300, Some(300)).unwrap().unwrap().q_len, 300);
        assert_eq!(check_add_f32(300, None).unwrap().unwrap().q_len, 300);
        assert!(check_add_f32(0, Some(0)).unwrap().is_none());
        let (operand, problem) = partial_error(check_add_f32(300, Some(299)).unwrap_err());
        assert_eq!((operand, problem.as_str()), ("piece", "holds 299 floats but the accumulator holds 300"));
        let huge = i32::MAX as usize + 1;
        assert!(matches!(check_add_f32(huge, None), Err(Error::TooLarge { what: "elements", .. })));
    }
}
