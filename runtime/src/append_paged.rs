//! The checked, asynchronous paged append: a step's new K and V rows,
//! packed, written into their sequences' pages after the keys they hold,
//! so that the paged forward attends to them next.

use crate::check::Buffer;
use crate::check_paged::{check_append, AppendProblem};
use crate::element::Element;
use crate::error::Error;
use crate::kernels::Which;
use crate::launch_checks::launch_checked;
use crate::layout::PackedLayout;
use crate::marshal::{launch_config, marshal, AppendBindings, Bindings, PagedBindings, VarlenBindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::paged::{PagedLayout, PagedShape};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtrMut};
use flashgen_codegen::{Shape, Spec};

/// One paged append: sequence `b`'s new rows are the new K's and V's tokens
/// `cu_seqlens[b] .. cu_seqlens[b + 1]`; they become its keys `kv_lens[b]
/// ..` in the pages its row of the block table names.
pub struct PagedAppend<'a, T> {
    /// The new rows, packed `[tokens, heads_kv, dim]`.
    pub k: (&'a dyn DeviceInput<T>, PackedLayout),
    pub v: (&'a dyn DeviceInput<T>, PackedLayout),
    /// `i32[batch + 1]` prefix sums of each sequence's new rows, on the
    /// device (clamped there as [`Sequences`](crate::Sequences)' are).
    pub cu_seqlens: &'a dyn DeviceInput<i32>,
    /// The most new rows of one sequence (longer ones are cut there).
    pub max_new_len: usize,
    /// The caches written, as [`PagedKv`](crate::PagedKv) reads them.
    pub k_cache: (&'a mut dyn DeviceOutput<T>, PagedLayout),
    pub v_cache: (&'a mut dyn DeviceOutput<T>, PagedLayout),
    pub block_table: &'a dyn DeviceInput<i32>,
    pub pages_per_seq: usize,
    /// `i32[batch]`: each sequence's keys before the append.
    pub kv_lens: &'a dyn DeviceInput<i32>,
    /// `i32[batch]`, written: each sequence's keys after the append
    /// (`kv_lens[b]` plus its new rows, at most `pages_per_seq · page_size`).
    pub new_kv_lens: Option<&'a mut CudaSlice<i32>>,
    /// Its first entry counts up the rows dropped because they would land
    /// past their sequence's pages.
    pub dropped: Option<&'a mut CudaSlice<u32>>,
    pub batch: usize,
}

impl Runtime {
    /// Writes `append`'s new rows into their pages (caches of `spec`'s
    /// dtype and head dims, as [`Runtime::forward_paged`] reads them).
    /// Checks sizes, strides, buffer lengths and entry counts, then queues
    /// the kernel on [`Runtime::stream`] without waiting. Lengths, prefix
    /// sums and page ids stay on the device and are clamped there: a row
    /// past its sequence's pages is dropped (and counted in `dropped`), a
    /// bad page id writes the nearest page, never outside the caches.
    pub fn append_paged<T: Element>(&self, spec: &Spec, append: PagedAppend<'_, T>) -> Result<(), Error> {
        let PagedAppend {
            k,
            v,
            cu_seqlens,
            max_new_len,
            k_cache,
            v_cache,
            block_table,
            pages_per_seq,
            kv_lens,
            new_kv_lens,
            dropped,
            batch,
        } = append;
        let cache = k_cache.1;
        let problem = AppendProblem {
            dtype: T::DTYPE,
            rows: [(k.1, k.0.len()), (v.1, v.0.len())].map(|(l, len)| Buffer { layout: l.as_layout(), len }),
            kv: PagedShape {
                caches: [(cache, k_cache.0.len()), (v_cache.1, v_cache.0.len())],
                table_len: block_table.len(),
                kv_lens_len: kv_lens.len(),
                pages_per_seq,
                max_kv_len: 0,
                batch,
            },
            cu_seqlens: cu_seqlens.len(),
            max_new_len,
            new_kv_lens: new_kv_lens.as_ref().map(|l| l.len()),
            dropped: dropped.as_ref().map(|d| d.len()),
        };
        if !check_append(spec, &problem)? {
            return Ok(());
        }
        let loaded = self.load_which(spec, Which::PagedAppend)?;
        let kernel = loaded.kernel();
        let shape = Shape { batch, heads: cache.heads, heads_kv: cache.heads, q_len: 0, kv_len: max_new_len };
        let grid = launch_config(kernel, &shape, 1, self.sm_count())?;

        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after the launch.
        let stream = self.stream().as_ref();
        let (k_ptr, _k) = k.0.device_ptr(stream);
        let (v_ptr, _v) = v.0.device_ptr(stream);
        let (k_cache_ptr, _kc) = k_cache.0.device_ptr_mut(stream);
        let (v_cache_ptr, _vc) = v_cache.0.device_ptr_mut(stream);
        let (cu, _cu) = cu_seqlens.device_ptr(stream);
        let (table, _table) = block_table.device_ptr(stream);
        let (lens, _lens) = kv_lens.device_ptr(stream);
        let new_lens = new_kv_lens.map(|l| l.device_ptr_mut(stream));
        let dropped = dropped.map(|d| d.device_ptr_mut(stream));
        // The caches take K's and V's slots; Q's and O's are unused.
        let [k_layout, v_layout] = [cache, v_cache.1].map(|l| l.as_layout());
        let layouts = [k_layout, k_layout, v_layout, v_layout];
        let row_strides = [k.1.strides, v.1.strides];
        let values = marshal(
            kernel,
            &Bindings {
                varlen: Some(VarlenBindings { cu_seqlens: [0, cu], tokens: [0, k.1.tokens] }),
                paged: Some(PagedBindings {
                    kv_lens: lens,
                    block_table: table,
                    pages_per_seq,
                    page_size: cache.page_size,
                    num_pages: cache.num_pages,
                }),
                append: Some(AppendBindings {
                    rows: [k.1.as_layout().address(k_ptr), v.1.as_layout().address(v_ptr)],
                    strides: row_strides,
                    new_kv_lens: new_lens.as_ref().map_or(0, |(ptr, _)| *ptr),
                    dropped: dropped.as_ref().map_or(0, |(ptr, _)| *ptr),
                }),
                ..Bindings::without_operands(shape, &[], &[]).with_operands(
                    [0, k_cache_ptr, v_cache_ptr, 0],
                    layouts,
                    0,
                    0.0,
                )
            },
        )?;

        // SAFETY: `marshal` followed the kernel's own argument list;
        // `check_append` proved every new row and every cache row the
        // layouts address is inside its buffer, the prefix sums hold batch
        // + 1 entries, the table batch · pages_per_seq, the lengths batch
        // (and the lengths after, where given); the kernel clamps every
        // prefix sum, length and page id into them (`paged.cuh`).
        unsafe { launch_checked(self, stream, &loaded, &values, grid) }
    }
}
