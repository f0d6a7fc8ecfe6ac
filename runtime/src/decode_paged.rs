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
use crate::decode::{arg_infos, DecodeKv, DecodePlan, StepIo};
use crate::descale::KvDescale;
use crate::element::Element;
use crate::error::Error;
use crate::layout::Layout;
use crate::operand::{DeviceInput, DeviceOutput};
use crate::paged::PagedKv;
use crate::runtime::Runtime;
use cudarc::driver::CudaSlice;
use flashgen_codegen::cuda::{DecodeCache, DecodeQueries};

/// The operands of one decode step on paged caches. Q and O are `[batch,
/// q_len, heads, d]` (any [`Layout`] strides), as [`DecodeIo`](crate::DecodeIo)'s;
/// the keys and values are `kv`'s pages, sequence `b`'s key `k` at row `k %
/// page_size` of page `block_table[b][k / page_size]`, and its query `i` is
/// the spec's `q = i` with `kv_len` its clamped length. `kv.max_kv_len` is
/// the plan's `max_kv_len` (captured tensors' `KV_LEN` dims). The LSE, if
/// asked, is `f32[batch, heads, q_len]`. `C` is the caches' element: `T`,
/// or `u8` holding e4m3 ([`DecodePlan::run_paged_e4m3`]).
pub struct PagedDecodeIo<'a, T, C = T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    pub kv: PagedKv<'a, C>,
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
    /// ([`RaggedError::DecodeCache`](crate::RaggedError::DecodeCache)), one
    /// made for packed queries ([`RaggedError::DecodeQueries`](crate::RaggedError::DecodeQueries)).
    pub fn run_paged<T: Element>(
        &self,
        rt: &Runtime,
        io: PagedDecodeIo<'_, T>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.run_pages(rt, io, None, args)
    }

    /// [`DecodePlan::run_paged`] over caches of `C` (`T`, or e4m3 bytes
    /// with their `descale`).
    pub(crate) fn run_pages<T: Element, C>(
        &self,
        rt: &Runtime,
        io: PagedDecodeIo<'_, T, C>,
        descale: Option<&KvDescale<'_>>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.check_kind(DecodeCache::Paged, DecodeQueries::Padded, descale)?;
        let infos = arg_infos(self.spec(), args)?;
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
        let kv = DecodeKv::Paged(kv);
        self.queue(rt, (shape, infos, args), StepIo { q, o, lse, kv, packed: None }, descale)
    }
}
