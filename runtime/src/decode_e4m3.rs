//! Decoding over FP8 e4m3 K/V caches: a plan made with
//! [`DecodeOptions::kv_cache`](crate::DecodeOptions::kv_cache) `=
//! KvCacheDtype::E4m3` reads caches of one byte an element (half a 16-bit
//! cache's bytes, and a decode step waits on those bytes), each element
//! `descale · e4m3`, with f32 descale factors per tensor or per K/V head
//! ([`KvDescale`]). Q and O stay the plan's element type. The factors live
//! on the device, read each launch, so a captured step replays with new
//! ones written to the same buffers.
//!
//! [`DecodePlan::run_e4m3`], [`DecodePlan::run_paged_e4m3`] and
//! [`DecodePlan::run_varlen_e4m3`] are the 16-bit runs with `u8` caches:
//! the same checks (lengths count bytes, as elements), then the descales'
//! (`RaggedError::DescaleLen`), and the same launch. A plan for one cache
//! format refuses the other (`RaggedError::DecodeKvDtype`).

use crate::args::ArgValue;
use crate::decode::{DecodeIo, DecodePlan};
use crate::decode_paged::PagedDecodeIo;
use crate::decode_varlen::VarlenDecodeIo;
use crate::descale::KvDescale;
use crate::element::Element;
use crate::error::Error;
use crate::runtime::Runtime;

impl DecodePlan {
    /// [`DecodePlan::run`] over dense e4m3 caches (`u8`, strides in
    /// bytes) with their `descale` factors: checks as `run` does, then the
    /// factors' lengths (`RaggedError::DescaleLen`); a plan made for 16-bit
    /// caches refuses it (`RaggedError::DecodeKvDtype`).
    pub fn run_e4m3<T: Element>(
        &self,
        rt: &Runtime,
        io: DecodeIo<'_, T, u8>,
        descale: KvDescale<'_>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.run_dense(rt, io, Some(&descale), args)
    }

    /// [`DecodePlan::run_paged`] over paged e4m3 caches, as
    /// [`DecodePlan::run_e4m3`] over dense ones.
    pub fn run_paged_e4m3<T: Element>(
        &self,
        rt: &Runtime,
        io: PagedDecodeIo<'_, T, u8>,
        descale: KvDescale<'_>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.run_pages(rt, io, Some(&descale), args)
    }

    /// [`DecodePlan::run_varlen`] over e4m3 caches (dense or paged), as
    /// [`DecodePlan::run_e4m3`].
    pub fn run_varlen_e4m3<T: Element>(
        &self,
        rt: &Runtime,
        io: VarlenDecodeIo<'_, T, u8>,
        descale: KvDescale<'_>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.run_packed(rt, io, Some(&descale), args)
    }
}
