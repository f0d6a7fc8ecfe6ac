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
    /// Q's, K's and V's buffers as the checks see them ([`check_descales`]).
    pub(crate) fn lens(&self) -> [(&'static str, DescaleLen); 3] {
        [("Q", self.q.as_len()), ("K", self.k.as_len()), ("V", self.v.as_len())]
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

    /// The buffer as the checks see it: its granularity and length.
    pub(crate) fn as_len(self) -> DescaleLen {
        let per_kv_head = matches!(self, Descale::PerKvHead(_));
        DescaleLen { per_kv_head, len: self.buffer().len() }
    }

    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> BoundDescale<'s> {
        let (ptr, guard) = self.buffer().device_ptr(stream);
        let stride = i32::from(matches!(self, Descale::PerKvHead(_)));
        BoundDescale { binding: (ptr, stride), _guard: guard }
    }
}

/// Refuses descale buffers (each named by its operand) of other lengths
/// than their granularity reads for `heads_kv` K/V heads (the kernels read
/// them unchecked).
pub(crate) fn check_descales(buffers: &[(&'static str, DescaleLen)], heads_kv: usize) -> Result<(), Error> {
    buffers.iter().try_for_each(|&(operand, d)| d.check(operand, heads_kv))
}

/// A descale buffer as the checks see it: one factor per K/V head or one
/// for all, and the entries it holds.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DescaleLen {
    pub per_kv_head: bool,
    pub len: usize,
}

impl DescaleLen {
    /// Entries the buffer holds for `heads_kv` K/V heads, and its name.
    fn expected(self, heads_kv: usize) -> (usize, &'static str) {
        match self.per_kv_head {
            false => (1, "per-tensor"),
            true => (heads_kv, "per-K/V-head"),
        }
    }

    /// Refuses a buffer of another length than its granularity reads for
    /// `heads_kv` K/V heads.
    fn check(self, operand: &'static str, heads_kv: usize) -> Result<(), Error> {
        let (expected, granularity) = self.expected(heads_kv);
        if self.len != expected {
            let len = self.len;
            return Err(Error::Ragged(RaggedError::DescaleLen { operand, granularity, len, expected }));
        }
        Ok(())
    }
}

impl KvDescale<'_> {
    /// K's and V's buffers as the checks see them ([`check_descales`]).
    pub(crate) fn lens(&self) -> [(&'static str, DescaleLen); 2] {
        [("K", self.k.as_len()), ("V", self.v.as_len())]
    }

    /// K's and V's factors as the launch binds them.
    pub(crate) fn bind<'s>(&'s self, stream: &'s CudaStream) -> [BoundDescale<'s>; 2] {
        [self.k.bind(stream), self.v.bind(stream)]
    }
}
