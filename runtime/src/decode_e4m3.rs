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
use crate::element::Element;
use crate::error::{Error, RaggedError};
use crate::operand::DeviceInput;
use crate::runtime::Runtime;
use cudarc::driver::{CudaStream, SyncOnDrop};

/// One e4m3 cache's f32 descale factors on the device: the cache's value
/// is `descale · e4m3`.
#[derive(Clone, Copy)]
pub enum Descale<'a> {
    /// One factor for every K/V head: `f32[1]`.
    PerTensor(&'a dyn DeviceInput<f32>),
    /// A factor per K/V head: `f32[heads_kv]`.
    PerKvHead(&'a dyn DeviceInput<f32>),
}

/// The descale factors of an e4m3 step's K and V caches, each its own.
#[derive(Clone, Copy)]
pub struct KvDescale<'a> {
    pub k: Descale<'a>,
    pub v: Descale<'a>,
}

/// A descale buffer as a launch binds it, with the guard that orders the
/// launch after pending writes to it (alive until after the launch).
pub(crate) struct BoundDescale<'s> {
    /// The buffer's address and the entries between K/V heads' factors.
    pub binding: (u64, i32),
    _guard: SyncOnDrop<'s>,
}

impl<'a> Descale<'a> {
    fn buffer(self) -> &'a dyn DeviceInput<f32> {
        match self {
            Descale::PerTensor(b) | Descale::PerKvHead(b) => b,
        }
    }

    /// Entries the buffer holds for `heads_kv` K/V heads, and its name.
    fn expected(self, heads_kv: usize) -> (usize, &'static str) {
        match self {
            Descale::PerTensor(_) => (1, "per-tensor"),
            Descale::PerKvHead(_) => (heads_kv, "per-K/V-head"),
        }
    }

    fn check(self, operand: &'static str, heads_kv: usize) -> Result<(), Error> {
        let (expected, granularity) = self.expected(heads_kv);
        let len = self.buffer().len();
        if len != expected {
            return Err(Error::Ragged(RaggedError::DescaleLen { operand, granularity, len, expected }));
        }
        Ok(())
    }

    fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundDescale<'s> {
        let (ptr, guard) = self.buffer().device_ptr(stream);
        let stride = i32::from(matches!(self, Descale::PerKvHead(_)));
        BoundDescale { binding: (ptr, stride), _guard: guard }
    }
}

impl KvDescale<'_> {
    /// Refuses buffers of other lengths than their granularity reads for
    /// `heads_kv` K/V heads (the kernel reads them unchecked).
    pub(crate) fn check(&self, heads_kv: usize) -> Result<(), Error> {
        self.k.check("K", heads_kv)?;
        self.v.check("V", heads_kv)
    }

    /// K's and V's factors as the launch binds them.
    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> [BoundDescale<'s>; 2] {
        [self.k.bind(stream), self.v.bind(stream)]
    }
}

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
