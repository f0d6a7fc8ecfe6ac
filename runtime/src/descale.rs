//! The f32 descale factors of e4m3 operands ([`KvDescale`]: a decode
//! step's K/V caches; [`QkvDescale`]: the e4m3 forward's Q, K and V): on
//! the device, checked against the launch's K/V heads and bound to it. A
//! leaf under the launches that take them.

use crate::error::{Error, RaggedError};
use crate::operand::DeviceInput;
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

/// The descale factors of an e4m3 forward's Q, K and V, each its own (per
/// tensor, or per K/V head: Q's factor of a head is its K/V head's).
#[derive(Clone, Copy)]
pub struct QkvDescale<'a> {
    pub q: Descale<'a>,
    pub k: Descale<'a>,
    pub v: Descale<'a>,
}

impl QkvDescale<'_> {
    /// Refuses buffers of other lengths than their granularity reads for
    /// `heads_kv` K/V heads (the kernel reads them unchecked).
    pub(crate) fn check(&self, heads_kv: usize) -> Result<(), Error> {
        self.q.check("Q", heads_kv)?;
        self.k.check("K", heads_kv)?;
        self.v.check("V", heads_kv)
    }

    /// The factors as the launch binds them, Q's, K's and V's.
    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> [BoundDescale<'s>; 3] {
        [self.q.bind(stream), self.k.bind(stream), self.v.bind(stream)]
    }
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

    pub(crate) fn check(self, operand: &'static str, heads_kv: usize) -> Result<(), Error> {
        let (expected, granularity) = self.expected(heads_kv);
        let len = self.buffer().len();
        if len != expected {
            return Err(Error::Ragged(RaggedError::DescaleLen { operand, granularity, len, expected }));
        }
        Ok(())
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundDescale<'s> {
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
