//! A decode step over packed queries: [`DecodePlan::run_varlen`], for
//! steps whose sequences have different numbers of new tokens (plain
//! decoding next to speculative or multi-token steps, sequences with none).
//! Q and O hold the step's tokens back to back as in the varlen forward
//! ([`PackedLayout`]), split by `cu_seqlens_q` on the device; the plan,
//! made with [`DecodeOptions::varlen`](crate::DecodeOptions::varlen) for at
//! most `q_len` tokens per sequence, holds the packed decode kernel of its
//! cache, dense or paged. A run checks the operands and queues the same
//! launch as [`DecodePlan::run`]: nothing allocated, copied or
//! synchronized, so a step is captured into a CUDA graph once and replayed
//! with new prefix sums (and lengths, block tables) in the same buffers.

use crate::args::ArgValue;
use crate::check::Buffer;
use crate::check_decode::check_launch;
use crate::check_decode_varlen::{check_varlen_decode, CacheShape, VarlenDecodeProblem};
use crate::decode::{arg_infos, DecodeKv, DecodePlan, StepIo};
use crate::descale::KvDescale;
use crate::element::Element;
use crate::error::Error;
use crate::layout::PackedLayout;
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use cudarc::driver::CudaSlice;
use flashgen_codegen::cuda::DecodeQueries;

/// The operands of one decode step over packed queries. Q and O hold the
/// step's tokens back to back ([`PackedLayout`], any token and head
/// strides): sequence `b`'s are tokens `cu_seqlens_q[b] .. cu_seqlens_q[b +
/// 1]`, 0 to the plan's `q_len` of them, and its token `i` is the spec's `q
/// = i` with `q_len` its own count and `kv_len` its key count, exactly as
/// [`Runtime::forward_varlen`] on the same queries and keys (so a bottom-
/// right mask, `q + kv_len - q_len >= k`, aligns each sequence's tokens
/// with its last keys). The LSE, if asked, is `f32[heads, total_q]` (the
/// varlen forward's). Tokens of no sequence are left as they were. `C` is
/// the cache's element: `T`, or `u8` holding e4m3
/// ([`DecodePlan::run_varlen_e4m3`]).
pub struct VarlenDecodeIo<'a, T, C = T> {
    pub q: (&'a dyn DeviceInput<T>, PackedLayout),
    pub o: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    /// `i32[batch + 1]` prefix sums of the sequences' token counts, on the
    /// device. Read there each launch and clamped as the varlen forward
    /// clamps them (`0 <= start <= end <= total_q`, at most `q_len` tokens
    /// a sequence): bad values give wrong rows, never an access outside Q,
    /// O or the LSE.
    pub cu_seqlens_q: &'a dyn DeviceInput<i32>,
    /// The cache: the plan's kind ([`DecodeOptions::paged`](crate::DecodeOptions::paged)).
    pub kv: DecodeKv<'a, C>,
}

impl DecodePlan {
    /// Queues one decode step over packed queries on `rt`'s stream without
    /// waiting, as [`DecodePlan::run`] (dense cache) or
    /// [`DecodePlan::run_paged`] (paged) do for `q_len` tokens each: checks
    /// Q, O (at least `q_len` tokens: `RaggedError::MaxSeqlen`), the LSE,
    /// `cu_seqlens_q` (`batch + 1` entries: `RaggedError::CuSeqlensLen`),
    /// the cache and `args` against the plan, then launches. A plan made
    /// for padded queries refuses it ([`RaggedError::DecodeQueries`](crate::RaggedError::DecodeQueries)),
    /// one for the other kind of cache too ([`RaggedError::DecodeCache`](crate::RaggedError::DecodeCache)),
    /// one for e4m3 caches as well ([`RaggedError::DecodeKvDtype`](crate::RaggedError::DecodeKvDtype)).
    pub fn run_varlen<T: Element>(
        &self,
        rt: &Runtime,
        io: VarlenDecodeIo<'_, T>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.run_packed(rt, io, None, args)
    }

    /// [`DecodePlan::run_varlen`] over a cache of `C` (`T`, or e4m3 bytes
    /// with their `descale`).
    pub(crate) fn run_packed<T: Element, C>(
        &self,
        rt: &Runtime,
        io: VarlenDecodeIo<'_, T, C>,
        descale: Option<&KvDescale<'_>>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.check_kind(io.kv.cache(), DecodeQueries::Packed, descale)?;
        let infos = arg_infos(self.spec(), args)?;
        let infos = &infos[..args.len()];
        let VarlenDecodeIo { q, o, lse, cu_seqlens_q, kv } = io;
        let (q, o) = ((q.0, q.1.as_layout()), (o.0, o.1.as_layout()));
        let problem = VarlenDecodeProblem {
            dtype: T::DTYPE,
            q: Buffer { layout: q.1, len: q.0.len() },
            o: Buffer { layout: o.1, len: o.0.len() },
            lse: lse.as_ref().map(|l| l.len()),
            cu_seqlens_q: cu_seqlens_q.len(),
            cache: match &kv {
                DecodeKv::Dense { k, v, .. } => CacheShape::Dense {
                    k: Buffer { layout: k.1, len: k.0.len() },
                    v: Buffer { layout: v.1, len: v.0.len() },
                },
                DecodeKv::Paged(kv) => CacheShape::Paged(kv.shape()),
            },
        };
        let Some(checked) = check_varlen_decode(self.spec(), &self.shape(), &problem, infos)? else {
            return Ok(());
        };
        check_launch(&self.shape(), &checked.shape, kv.kv_lens().len())?;
        let packed = Some((cu_seqlens_q, checked.total_q));
        self.queue(rt, (checked.shape, infos, args), StepIo { q, o, lse, kv, packed }, descale)
    }
}
