//! Strided 4-D layouts of the Q, K, V and O operands.

/// Sizes and element strides of one `[batch, seq, heads, dim]` operand. The
/// head-dim axis is always contiguous (stride 1), so any permutation of the
/// other three axes, or a slice of a larger buffer, is expressible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub dim: usize,
    /// Element strides of the batch, seq and head axes.
    pub strides: [i64; 3],
}

impl Layout {
    /// Contiguous `[batch, seq, heads, dim]` (the FlashAttention layout).
    pub fn bshd(batch: usize, seq: usize, heads: usize, dim: usize) -> Layout {
        let (head, seq_stride) = (dim, heads.saturating_mul(dim));
        Layout { batch, seq, heads, dim, strides: [seq.saturating_mul(seq_stride), seq_stride, head].map(stride) }
    }

    /// Contiguous `[batch, heads, seq, dim]` (the PyTorch SDPA layout).
    pub fn bhsd(batch: usize, seq: usize, heads: usize, dim: usize) -> Layout {
        let (seq_stride, head) = (dim, seq.saturating_mul(dim));
        Layout { batch, seq, heads, dim, strides: [heads.saturating_mul(head), seq_stride, head].map(stride) }
    }

    /// Number of elements a contiguous buffer of this shape holds.
    pub fn len(&self) -> usize {
        [self.batch, self.seq, self.heads, self.dim].iter().fold(1, |n, &d| n.saturating_mul(d))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Absurd sizes saturate rather than wrap, so the bounds check rejects them
/// instead of accepting a wrapped stride.
fn stride(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_strides() {
        let l = Layout::bshd(2, 5, 3, 64);
        assert_eq!(l.strides, [5 * 3 * 64, 3 * 64, 64]);
        assert_eq!((l.batch, l.seq, l.heads, l.dim), (2, 5, 3, 64));
        assert_eq!(l.len(), 2 * 5 * 3 * 64);
        let l = Layout::bhsd(2, 5, 3, 64);
        assert_eq!(l.strides, [3 * 5 * 64, 64, 5 * 64]);
        assert_eq!(l.len(), 2 * 5 * 3 * 64);
        assert!(Layout::bshd(0, 5, 3, 64).is_empty());
    }

    #[test]
    fn huge_sizes_saturate() {
        assert_eq!(Layout::bshd(2, usize::MAX, 2, 2).strides[0], i64::MAX);
        assert_eq!(Layout::bhsd(1, 1, usize::MAX, 2).len(), usize::MAX);
    }
}
