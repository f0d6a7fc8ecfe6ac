//! Strided 4-D layouts of the Q, K, V and O operands.

/// Sizes and element strides of one `[batch, seq, heads, dim]` operand, and
/// where it starts in its buffer. The head-dim axis is always contiguous
/// (stride 1), so any permutation of the other three axes, or a view into a
/// larger buffer (Q, K and V of one fused projection, [`Layout::fused_qkv`]),
/// is expressible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub dim: usize,
    /// Element strides of the batch, seq and head axes.
    pub strides: [i64; 3],
    /// Elements of the buffer before the operand's first element.
    pub offset: usize,
}

impl Layout {
    /// Contiguous `[batch, seq, heads, dim]` (the FlashAttention layout).
    pub fn bshd(batch: usize, seq: usize, heads: usize, dim: usize) -> Layout {
        let (head, seq_stride) = (dim, heads.saturating_mul(dim));
        let strides = [seq.saturating_mul(seq_stride), seq_stride, head].map(stride);
        Layout { batch, seq, heads, dim, strides, offset: 0 }
    }

    /// Contiguous `[batch, heads, seq, dim]` (the PyTorch SDPA layout).
    pub fn bhsd(batch: usize, seq: usize, heads: usize, dim: usize) -> Layout {
        let (seq_stride, head) = (dim, seq.saturating_mul(dim));
        let strides = [heads.saturating_mul(head), seq_stride, head].map(stride);
        Layout { batch, seq, heads, dim, strides, offset: 0 }
    }

    /// Q, K and V inside one fused projection's output `[batch, seq, heads +
    /// 2 * heads_kv, dim]` (each token's query heads, then its K heads, then
    /// its V heads), as views of that one buffer: no copy.
    pub fn fused_qkv(batch: usize, seq: usize, heads: usize, heads_kv: usize, dim: usize) -> [Layout; 3] {
        let row = heads.saturating_add(heads_kv.saturating_mul(2));
        let seq_stride = row.saturating_mul(dim);
        let strides = [seq.saturating_mul(seq_stride), seq_stride, dim].map(stride);
        let view = |heads, first_head: usize| Layout {
            batch,
            seq,
            heads,
            dim,
            strides,
            offset: first_head.saturating_mul(dim),
        };
        [view(heads, 0), view(heads_kv, heads), view(heads_kv, heads.saturating_add(heads_kv))]
    }

    /// This layout starting `offset` elements into its buffer.
    pub fn at(self, offset: usize) -> Layout {
        Layout { offset, ..self }
    }

    /// The device address of the operand's first element in a buffer of
    /// 16-bit elements at `base` (the offset was checked against the buffer).
    pub(crate) fn address(&self, base: u64) -> u64 {
        base + 2 * self.offset as u64
    }

    /// [`Layout::address`] in a buffer of bytes (e4m3 operands).
    pub(crate) fn byte_address(&self, base: u64) -> u64 {
        base + self.offset as u64
    }

    /// Number of elements a contiguous buffer of this shape holds.
    pub fn len(&self) -> usize {
        [self.batch, self.seq, self.heads, self.dim].iter().fold(1, |n, &d| n.saturating_mul(d))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Sizes and element strides of one varlen (packed, "THD") operand
/// `[tokens, heads, dim]`: the tokens of all sequences back to back, which
/// `cu_seqlens` split into sequences. The head-dim axis is contiguous; the
/// token and head axes take any strides, as [`Layout`]'s do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedLayout {
    pub tokens: usize,
    pub heads: usize,
    pub dim: usize,
    /// Element strides of the token and head axes.
    pub strides: [i64; 2],
    /// Elements of the buffer before the operand's first element.
    pub offset: usize,
}

impl PackedLayout {
    /// Contiguous `[tokens, heads, dim]` (FlashAttention's varlen layout).
    pub fn thd(tokens: usize, heads: usize, dim: usize) -> PackedLayout {
        let strides = [heads.saturating_mul(dim), dim].map(stride);
        PackedLayout { tokens, heads, dim, strides, offset: 0 }
    }

    /// This layout starting `offset` elements into its buffer.
    pub fn at(self, offset: usize) -> PackedLayout {
        PackedLayout { offset, ..self }
    }

    /// The same elements as a [`Layout`] of one batch row of `tokens`
    /// positions, which the bounds checks and addresses read.
    pub fn as_layout(&self) -> Layout {
        let [token, head] = self.strides;
        let strides = [0, token, head];
        Layout { batch: 1, seq: self.tokens, heads: self.heads, dim: self.dim, strides, offset: self.offset }
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
    fn fused_qkv_views_interleave_heads() {
        let [q, k, v] = Layout::fused_qkv(2, 5, 8, 2, 64);
        assert_eq!(q.strides, [5 * 12 * 64, 12 * 64, 64]);
        assert_eq!((q.heads, k.heads, v.heads), (8, 2, 2));
        assert_eq!((q.offset, k.offset, v.offset), (0, 8 * 64, 10 * 64));
        assert!(k.strides == q.strides && v.strides == q.strides);
    }

    #[test]
    fn packed_layouts_are_one_batch_row() {
        let l = PackedLayout::thd(37, 4, 64).at(8);
        assert_eq!(l.strides, [4 * 64, 64]);
        let dense = l.as_layout();
        assert_eq!((dense.batch, dense.seq, dense.heads, dense.dim, dense.offset), (1, 37, 4, 64, 8));
        assert_eq!(dense.strides, [0, 4 * 64, 64]);
    }

    #[test]
    fn huge_sizes_saturate() {
        assert_eq!(Layout::bshd(2, usize::MAX, 2, 2).strides[0], i64::MAX);
        assert_eq!(Layout::bhsd(1, 1, usize::MAX, 2).len(), usize::MAX);
    }

    /// Regression (found by `check_props`): V's first head was `heads +
    /// heads_kv`, which overflowed (a panic in debug builds) where the
    /// strides beside it saturate.
    #[test]
    fn fused_qkv_of_huge_head_counts_saturates() {
        let [_, k, v] = Layout::fused_qkv(1, 1, usize::MAX, 2, 1);
        assert_eq!((k.offset, v.offset), (usize::MAX, usize::MAX));
        assert_eq!(k.strides[1], i64::MAX);
    }
}
