//! The checked, asynchronous paged forward launch: queries packed (or
//! dense), keys and values in paged caches read through a block table
//! (`paged`), each sequence's K/V length on the device. Chunked prefill is
//! a launch whose sequences have fewer queries than keys: the spec's
//! `q_len` and `kv_len` are each sequence's own, so a mask written
//! bottom-right (`q + kv_len - q_len >= k`) aligns a chunk's queries with
//! the last of its keys.

use crate::args::{tensor_ptrs, ArgValue};
use crate::check::Buffer;
use crate::check_paged::{check_paged, PagedProblem};
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::kernels::Which;
use crate::launch_checks::{check_ragged_options, launch_checked};
use crate::layout::PackedLayout;
use crate::marshal::{launch_config, marshal, Bindings, PagedBindings, VarlenBindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::paged::PagedKv;
use crate::runtime::Runtime;
use crate::tma::{copy_with, paged_box_rows, ragged_forward_maps};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use flashgen_codegen::Spec;

/// The operands of one paged forward pass. Q and O are `[tokens, heads,
/// dim]`; O and the optional LSE (`f32[heads, total_q]`, as
/// [`VarlenIo`](crate::VarlenIo)'s) are written.
pub struct PagedIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, PackedLayout),
    pub o: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    pub queries: PagedQueries<'a>,
    pub kv: PagedKv<'a, T>,
}

/// How Q's tokens split into the sequences of [`PagedKv::batch`].
pub enum PagedQueries<'a> {
    /// Sequence `b`'s queries are Q's tokens `cu_seqlens_q[b] ..
    /// cu_seqlens_q[b + 1]` (`i32[batch + 1]` on the device, clamped there
    /// as [`Sequences`](crate::Sequences)' are), at most `max_q_len`.
    Packed { cu_seqlens_q: &'a dyn DeviceInput<i32>, max_q_len: usize },
    /// Every sequence has `q_len` queries, Q's tokens `b · q_len ..`: a
    /// `[batch, q_len, heads, dim]` tensor whose batch rows follow each
    /// other, as its `batch · q_len` tokens.
    Dense { q_len: usize },
}

impl PagedQueries<'_> {
    /// The longest sequence's queries.
    fn max_q_len(&self) -> usize {
        match *self {
            PagedQueries::Packed { max_q_len, .. } => max_q_len,
            PagedQueries::Dense { q_len } => q_len,
        }
    }
}

impl Runtime {
    /// Attention of packed (or dense) queries over paged K/V caches: in
    /// `spec`, `b` is the sequence, `q` and `k` positions inside it and
    /// `q_len` / `kv_len` its own lengths, as in
    /// [`Runtime::forward_varlen`]; key `k` of sequence `b` is read from its
    /// page `block_table[b][k / page_size]`. Captured tensors are sized by
    /// the longest lengths (`max_q_len`, `max_kv_len`).
    ///
    /// Checks sizes, strides, buffer lengths, the block table's and the
    /// lengths' entry counts, the longest lengths and `args` against
    /// `spec`, then queues the kernel on [`Runtime::stream`] without
    /// waiting. Page ids and lengths stay on the device: the kernel clamps
    /// them (a length into `[0, min(pages_per_seq · page_size,
    /// max_kv_len)]`, a page id into `[0, num_pages)`), so bad values give
    /// wrong rows, never an access out of bounds. Runs in `opts.config` or
    /// the preferred configuration for `max_kv_len` keys; no block mask
    /// ([`RaggedError::VarlenBlockMask`](crate::RaggedError::VarlenBlockMask)) and no autotuning. Warp-specialized
    /// kernels copy K/V tiles by TMA, a box per page, where a tile holds
    /// whole pages or lies in one, the pages lie a page apart and TMA can
    /// address every operand; else their threads gather the rows.
    pub fn forward_paged<T: Element>(
        &self,
        spec: &Spec,
        io: PagedIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let options = (opts.scale, opts.dropout, opts.block_mask.is_some());
        let (scale, infos) = check_ragged_options(spec, "paged", options, args)?;
        let PagedIo { q, o, lse, queries, kv } = io;
        let [q_layout, o_layout] = [q.1, o.1].map(|l| l.as_layout());
        let problem = PagedProblem {
            dtype: T::DTYPE,
            q: Buffer { layout: q_layout, len: q.0.len() },
            o: Buffer { layout: o_layout, len: o.0.len() },
            lse: lse.as_ref().map(|l| l.len()),
            kv: kv.shape(),
            cu_seqlens_q: match queries {
                PagedQueries::Packed { cu_seqlens_q, .. } => Some(cu_seqlens_q.len()),
                PagedQueries::Dense { .. } => None,
            },
            max_q_len: queries.max_q_len(),
        };
        let Some(checked) = check_paged(spec, &problem, &infos)? else {
            return Ok(());
        };
        let config = self.ragged_config(spec, opts.config, kv.max_kv_len)?;

        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after the launch.
        let stream = self.stream().as_ref();
        let (q_ptr, _q) = q.0.device_ptr(stream);
        let (k_ptr, _k) = kv.k.0.device_ptr(stream);
        let (v_ptr, _v) = kv.v.0.device_ptr(stream);
        let (o_ptr, _o) = o.0.device_ptr_mut(stream);
        let cu_q = match queries {
            PagedQueries::Packed { cu_seqlens_q, .. } => Some(cu_seqlens_q.device_ptr(stream)),
            PagedQueries::Dense { .. } => None,
        };
        let (table, _table) = kv.block_table.device_ptr(stream);
        let (kv_lens, _kv_lens) = kv.kv_lens.device_ptr(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let (tensor_ptrs, _tensors) = tensor_ptrs(args, stream);
        let layouts = [q_layout, kv.k.1.as_layout(), kv.v.1.as_layout(), o_layout];
        let ptrs = [q_ptr, k_ptr, v_ptr, o_ptr];
        // Dense queries are one run of rows too: their batch rows follow each other.
        let operands = [0, 1, 2, 3].map(|i| (layouts[i].address(ptrs[i]), &layouts[i]));
        let kv_box_rows = paged_box_rows(config.block_n, kv.k.1.page_size);
        let tensor_maps = ragged_forward_maps(config, operands, kv_box_rows, spec.dtype, self.tma);
        let loaded = self.load_which(spec, Which::ForwardPaged(config, config.kernel_copy(copy_with(&tensor_maps))))?;
        let kernel = loaded.kernel();
        let grid = launch_config(kernel, &checked.shape, 1, self.sm_count())?;
        let work_counter = self.work_counter_for(kernel, stream);
        let values = marshal(
            kernel,
            &Bindings {
                work_counter: work_counter.as_ref().map(|(ptr, _)| *ptr),
                // Null prefix sums: dense queries.
                varlen: Some(VarlenBindings {
                    cu_seqlens: [cu_q.as_ref().map_or(0, |(ptr, _)| *ptr), 0],
                    tokens: [checked.total_q, 0],
                }),
                paged: Some(PagedBindings {
                    kv_lens,
                    block_table: table,
                    pages_per_seq: kv.pages_per_seq,
                    page_size: kv.k.1.page_size,
                    num_pages: kv.k.1.num_pages,
                }),
                tensor_maps,
                kv_box_rows,
                ..Bindings::without_operands(checked.shape, &infos, &tensor_ptrs).with_operands(
                    ptrs,
                    layouts,
                    lse.as_ref().map_or(0, |(ptr, _)| *ptr),
                    scale,
                )
            },
        )?;

        // SAFETY: `marshal` followed the kernel's own argument list, so the
        // values match its parameters in order and type; `check_paged`
        // proved every row of the caches and every token of Q and O the
        // layouts address is inside its buffer, the block table holds batch
        // · pages_per_seq entries and kv_lens batch, and the kernel clamps
        // every length, page id and query span into them (`paged.cuh`).
        unsafe { launch_checked(self, stream, &loaded, &values, grid) }
    }
}
