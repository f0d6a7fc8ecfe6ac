//! A decode step over paged K/V caches: [`DecodePlan::run_paged`], the
//! dense [`DecodePlan::run`]'s twin for caches that [`PagedKv`] describes
//! (pages, a block table, per-sequence lengths, all on the device). The
//! plan, made with [`DecodeOptions::paged`](crate::DecodeOptions::paged),
//! holds the paged decode kernel; a run checks the caches as the paged
//! forward does and queues the same launches as a dense run: nothing
//! allocated, copied or synchronized, so a step is captured into a CUDA
//! graph once and replayed with new lengths and block tables written to the
//! same buffers.

use crate::args::ArgValue;
use crate::check::Buffer;
use crate::check_decode::{check_launch, check_paged_launch, PagedDecodeProblem};
use crate::decode::{DecodePlan, Operands};
use crate::element::Element;
use crate::error::Error;
use crate::layout::Layout;
use crate::marshal::PagedBindings;
use crate::operand::{DeviceInput, DeviceOutput};
use crate::paged::PagedKv;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtrMut};

/// The operands of one decode step on paged caches. Q and O are `[batch,
/// q_len, heads, d]` (any [`Layout`] strides), as [`DecodeIo`](crate::DecodeIo)'s;
/// the keys and values are `kv`'s pages, sequence `b`'s key `k` at row `k %
/// page_size` of page `block_table[b][k / page_size]`, and its query `i` is
/// the spec's `q = i` with `kv_len` its clamped length. `kv.max_kv_len` is
/// the plan's `max_kv_len` (captured tensors' `KV_LEN` dims). The LSE, if
/// asked, is `f32[batch, heads, q_len]`.
pub struct PagedDecodeIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    pub kv: PagedKv<'a, T>,
}

impl DecodePlan {
    /// Queues one decode step over paged caches on `rt`'s stream without
    /// waiting, as [`DecodePlan::run`] does over a dense cache: checks Q, O,
    /// the caches (page size 0, table and lengths of the batch's entries,
    /// `max_kv_len` within a sequence's pages, caches inside their buffers)
    /// and `args` against the plan, then launches. Page ids and lengths are
    /// read on the device each launch and clamped there (a length into `[0,
    /// min(pages_per_seq · page_size, max_kv_len)]`, a page id into `[0,
    /// num_pages)`). A plan made for dense caches refuses it
    /// ([`RaggedError::DecodeCache`](crate::RaggedError::DecodeCache)).
    pub fn run_paged<T: Element>(
        &self,
        rt: &Runtime,
        io: PagedDecodeIo<'_, T>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.check_cache(true)?;
        let infos = self.arg_infos(args)?;
        let infos = &infos[..args.len()];
        let PagedDecodeIo { q, o, lse, kv } = io;
        let problem = PagedDecodeProblem {
            dtype: T::DTYPE,
            q: Buffer { layout: q.1, len: q.0.len() },
            o: Buffer { layout: o.1, len: o.0.len() },
            lse: lse.as_ref().map(|l| l.len()),
            kv: kv.shape(),
        };
        let Some(shape) = check_paged_launch(self.spec(), &problem, infos)? else {
            return Ok(());
        };
        check_launch(&self.shape(), &shape, kv.kv_lens.len())?;

        // The guards order the launches after pending work on each buffer
        // and record them for later work; they must live until after both.
        let stream = rt.stream().as_ref();
        let (q_ptr, _q) = q.0.device_ptr(stream);
        let (k_ptr, _k) = kv.k.0.device_ptr(stream);
        let (v_ptr, _v) = kv.v.0.device_ptr(stream);
        let (o_ptr, _o) = o.0.device_ptr_mut(stream);
        let (lens_ptr, _lens) = kv.kv_lens.device_ptr(stream);
        let (table_ptr, _table) = kv.block_table.device_ptr(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let cache = kv.k.1;
        let operands = Operands {
            ptrs: [q_ptr, k_ptr, v_ptr, o_ptr],
            layouts: [q.1, cache.as_layout(), kv.v.1.as_layout(), o.1],
            lse: lse.as_ref().map_or(0, |(ptr, _)| *ptr),
            kv_lens: lens_ptr,
        };
        let paged = PagedBindings {
            kv_lens: lens_ptr,
            block_table: table_ptr,
            pages_per_seq: kv.pages_per_seq,
            page_size: cache.page_size,
            num_pages: cache.num_pages,
        };
        self.queue(rt, shape, infos, args, operands, Some(paged))
    }
}
