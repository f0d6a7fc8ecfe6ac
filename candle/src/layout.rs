//! candle layouts as flashgen operands: a `[batch, seq, heads, head_dim]`
//! tensor whose head dim is contiguous is addressed where it lies (any
//! strides of the other three axes, any start offset: a transposed
//! `[b, h, s, d]` tensor, one slice of a fused QKV projection); other
//! layouts need a compact copy first.

use crate::error::Error;

/// The flashgen layout of a candle tensor's `layout`, or `None` where
/// flashgen cannot address it in place (head dim not contiguous). A rank
/// other than 4 is an error.
pub fn operand_layout(operand: &str, layout: &candle_core::Layout) -> Result<Option<flashgen::Layout>, Error> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let &[batch, seq, heads, dim] = dims else {
        return Err(Error::Rank { operand: operand.to_string(), rank: dims.len() });
    };
    if dim > 1 && strides[3] != 1 {
        return Ok(None);
    }
    let strides = [strides[0], strides[1], strides[2]].map(|s| i64::try_from(s).unwrap_or(i64::MAX));
    Ok(Some(flashgen::Layout { batch, seq, heads, dim, strides, offset: layout.start_offset() }))
}

/// Whether a captured tensor can be passed as its storage as it stands:
/// flashgen reads captured tensors as whole, compact, row-major buffers.
pub fn is_compact(layout: &candle_core::Layout, storage_len: usize) -> bool {
    layout.is_contiguous() && layout.start_offset() == 0 && storage_len == layout.shape().elem_count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Layout, Shape};

    fn layout(dims: &[usize]) -> Layout {
        Layout::contiguous(Shape::from(dims))
    }

    #[test]
    fn a_contiguous_tensor_is_bshd() {
        let got = operand_layout("Q", &layout(&[2, 16, 4, 64])).unwrap().unwrap();
        assert_eq!(got, flashgen::Layout::bshd(2, 16, 4, 64));
    }

    #[test]
    fn a_transposed_bhsd_tensor_is_addressed_in_place() {
        // [b, h, s, d] storage seen as [b, s, h, d] through transpose(1, 2).
        let got = operand_layout("K", &layout(&[2, 4, 16, 64]).transpose(1, 2).unwrap()).unwrap().unwrap();
        assert_eq!(got, flashgen::Layout::bhsd(2, 16, 4, 64));
    }

    #[test]
    fn slices_of_a_fused_projection_keep_their_offsets() {
        // [b, s, 8 + 2 + 2, d]: Q heads, then K heads, then V heads.
        let fused = layout(&[2, 16, 12, 64]);
        let expected = flashgen::Layout::fused_qkv(2, 16, 8, 2, 64);
        for (i, (start, heads)) in [(0, 8), (8, 2), (10, 2)].into_iter().enumerate() {
            let view = fused.narrow(2, start, heads).unwrap();
            assert_eq!(operand_layout("V", &view).unwrap().unwrap(), expected[i]);
        }
    }

    #[test]
    fn a_non_contiguous_head_dim_needs_a_copy() {
        let view = layout(&[2, 64, 4, 16]).transpose(1, 3).unwrap();
        assert_eq!(operand_layout("Q", &view).unwrap(), None);
        // A head dim of one element has no stride to speak of.
        let single = layout(&[2, 1, 4, 16]).transpose(1, 3).unwrap();
        assert!(operand_layout("Q", &single).unwrap().is_some());
    }

    #[test]
    fn a_tensor_of_another_rank_is_an_error() {
        let err = operand_layout("Q", &layout(&[16, 4, 64])).unwrap_err();
        assert_eq!(err, Error::Rank { operand: "Q".into(), rank: 3 });
        assert!(err.to_string().contains("[batch, seq, heads, head_dim]"));
    }

    #[test]
    fn captured_tensors_must_be_whole_and_row_major() {
        assert!(is_compact(&layout(&[4, 8]), 32));
        assert!(!is_compact(&layout(&[4, 8]), 64), "a view of a larger buffer");
        assert!(!is_compact(&layout(&[4, 8]).narrow(0, 1, 2).unwrap(), 32), "an offset view");
        assert!(!is_compact(&layout(&[4, 8]).transpose(0, 1).unwrap(), 32), "a transposed view");
    }
}
