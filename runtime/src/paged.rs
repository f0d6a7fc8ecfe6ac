//! Paged K/V caches, as the paged forward (and any kernel that reads or
//! appends to such caches) takes them: K and V as pages of rows, a block
//! table naming each sequence's pages in order, and each sequence's K/V
//! length on the device.
//!
//! Key `k` of sequence `b` is row `k % page_size` of page
//! `block_table[b · pages_per_seq + k / page_size]`. The host never reads
//! the table or the lengths (they are on the device): kernels clamp them
//! (`library/paged.cuh`), so a bad value gives wrong rows, never an access
//! outside the caches or the table.

use crate::layout::Layout;
use crate::operand::DeviceInput;

/// Sizes and element strides of one paged cache `[num_pages, page_size,
/// heads, dim]`, and where it starts in its buffer. The head-dim axis is
/// contiguous; the page, row and head axes take any strides (a cache may be
/// `[num_pages, heads, page_size, dim]`, or K and V halves of one buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedLayout {
    pub num_pages: usize,
    pub page_size: usize,
    pub heads: usize,
    pub dim: usize,
    /// Element strides of the page, row and head axes.
    pub strides: [i64; 3],
    /// Elements of the buffer before the cache's first element.
    pub offset: usize,
}

impl PagedLayout {
    /// Contiguous `[num_pages, page_size, heads, dim]` (vLLM's and
    /// FlashAttention's paged layout).
    pub fn contiguous(num_pages: usize, page_size: usize, heads: usize, dim: usize) -> PagedLayout {
        let Layout { strides, .. } = Layout::bshd(num_pages, page_size, heads, dim);
        PagedLayout { num_pages, page_size, heads, dim, strides, offset: 0 }
    }

    /// This layout starting `offset` elements into its buffer.
    pub fn at(self, offset: usize) -> PagedLayout {
        PagedLayout { offset, ..self }
    }

    /// The same elements as a [`Layout`] whose batch axis is the pages and
    /// whose sequence axis is a page's rows (what the bounds checks and the
    /// kernels' strides read: a stride error's `Batch` axis is the pages').
    pub fn as_layout(&self) -> Layout {
        let PagedLayout { num_pages, page_size, heads, dim, strides, offset } = *self;
        Layout { batch: num_pages, seq: page_size, heads, dim, strides, offset }
    }

    /// Rows (keys) the cache holds.
    pub fn rows(&self) -> usize {
        self.num_pages.saturating_mul(self.page_size)
    }
}

/// `batch` sequences' keys and values in paged caches. K and V share the
/// block table and lengths (and so the page count and size); each has its
/// own buffer and layout.
pub struct PagedKv<'a, T> {
    pub k: (&'a dyn DeviceInput<T>, PagedLayout),
    pub v: (&'a dyn DeviceInput<T>, PagedLayout),
    /// `i32[batch, pages_per_seq]`: each sequence's page ids, in key order.
    /// Entries past a sequence's last page are never read.
    pub block_table: &'a dyn DeviceInput<i32>,
    pub pages_per_seq: usize,
    /// `i32[batch]`: each sequence's K/V length, clamped on the device into
    /// `[0, min(pages_per_seq · page_size, max_kv_len)]`.
    pub kv_lens: &'a dyn DeviceInput<i32>,
    /// The longest sequence's keys (a spec tensor's `KV_LEN` dim); at most
    /// `pages_per_seq · page_size`.
    pub max_kv_len: usize,
    pub batch: usize,
}

/// What the host checks of a [`PagedKv`]: everything but the device's
/// values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedShape {
    /// K's and V's layouts and buffer lengths.
    pub caches: [(PagedLayout, usize); 2],
    /// Entries of the block table and of `kv_lens`.
    pub table_len: usize,
    pub kv_lens_len: usize,
    pub pages_per_seq: usize,
    pub max_kv_len: usize,
    pub batch: usize,
}

impl<T> PagedKv<'_, T> {
    pub(crate) fn shape(&self) -> PagedShape {
        PagedShape {
            caches: [(self.k.1, self.k.0.len()), (self.v.1, self.v.0.len())],
            table_len: self.block_table.len(),
            kv_lens_len: self.kv_lens.len(),
            pages_per_seq: self.pages_per_seq,
            max_kv_len: self.max_kv_len,
            batch: self.batch,
        }
    }
}
