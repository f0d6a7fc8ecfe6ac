//! Context parallelism over NCCL: each rank of a [`Communicator`] runs its
//! pieces ([`super::pieces`]) on its own GPU, and the K/V rows its pieces
//! read come from their owners by NCCL point-to-point exchanges. At step `s`
//! rank `r` sends its K and V to rank `r + s` and receives rank `r − s`'s,
//! each only where the receiver has a piece over them, so K/V a mask drops
//! for all of a rank's queries never move. The backward sends each owner the
//! f32 dK and dV of its rows back the same way.
//!
//! [`Schedule::Ring`] exchanges step `s + 1`'s rows while step `s`'s pieces
//! compute (two receive slots); [`Schedule::AllGather`] receives every
//! needed block first, then computes.

use super::pieces::{backward_piece, ForwardAcc, GradAcc, KeyValue, Pieces, RankGradIn, RankOut};
use super::{ShardGradIo, ShardIo, Whole};
use crate::args::{ArgInfo, ArgValue};
use crate::backward::BackwardOptions;
use crate::check_shard::{check_exchange, whole_shape};
use crate::comm::Communicator;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::layout::Layout;
use crate::operand::DeviceInput;
use crate::runtime::Runtime;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop};
use cudarc::nccl::NcclType;
use flashgen_codegen::shard::{Piece, Sharding};
use flashgen_codegen::Spec;
use std::sync::Arc;

/// When K/V rows move relative to the pieces that read them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// Step by step, the next step's rows in flight while this step's
    /// pieces compute.
    Ring,
    /// Every needed row first, then every piece.
    AllGather,
}

/// A context-parallel launch on one rank of `comm`.
#[derive(Clone, Copy)]
pub struct ContextParallel<'c> {
    pub sharding: Sharding,
    pub whole: Whole,
    pub schedule: Schedule,
    pub comm: &'c Communicator,
}

/// K and V rows received from rank `.0`.
type Inbox<T> = Option<(usize, [CudaSlice<T>; 2])>;

/// Every rank's pieces, so each knows what the others need of it.
struct Plans {
    rank: usize,
    ranks: usize,
    pieces: Vec<Vec<Piece>>,
}

impl Plans {
    fn new(pieces: &Pieces, rank: usize) -> Plans {
        let ranks = pieces.sharding.ranks;
        Plans { rank, ranks, pieces: (0..ranks).map(|r| pieces.of_rank(r)).collect() }
    }

    /// Whether rank `to` has a piece over rank `from`'s keys.
    fn needs(&self, to: usize, from: usize) -> bool {
        self.pieces[to].iter().any(|p| p.kv_rank == from)
    }

    /// Step `step`'s peers: the rank sent to, if it needs this rank's rows,
    /// and the rank received from, if this rank needs its rows.
    fn step(&self, step: usize) -> (Option<usize>, Option<usize>) {
        let (to, from) = ((self.rank + step) % self.ranks, (self.rank + self.ranks - step) % self.ranks);
        (self.needs(to, self.rank).then_some(to), self.needs(self.rank, from).then_some(from))
    }

    fn mine(&self, kv_rank: usize) -> impl Iterator<Item = &Piece> {
        self.pieces[self.rank].iter().filter(move |p| p.kv_rank == kv_rank)
    }
}

/// `len` elements of an operand's buffer from `offset`: a contiguous rank's
/// K or V rows as NCCL sends them.
struct Span<'a, T> {
    src: &'a dyn DeviceInput<T>,
    offset: usize,
    len: usize,
}

impl<T> DeviceSlice<T> for Span<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.src.stream()
    }
}

impl<T> DevicePtr<T> for Span<'_, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (CUdeviceptr, SyncOnDrop<'b>) {
        let (ptr, guard) = self.src.device_ptr(stream);
        (ptr + (self.offset * std::mem::size_of::<T>()) as u64, guard)
    }
}

/// This rank's K and V (contiguous, checked) copied once into buffers of
/// their own: what every exchange sends.
fn packed<T: Element>(rt: &Runtime, kv: KeyValue<'_, T>) -> Result<[CudaSlice<T>; 2], Error> {
    let one = |(src, layout): (&dyn DeviceInput<T>, Layout)| {
        let span = Span { src, offset: layout.offset, len: layout.len() };
        let mut buf =
            rt.stream().alloc_zeros::<T>(span.len.max(1)).map_err(|e| Error::driver("allocating K/V to send", e))?;
        if span.len > 0 {
            rt.stream()
                .memcpy_dtod(&span, &mut buf.slice_mut(..span.len))
                .map_err(|e| Error::driver("packing K/V to send", e))?;
        }
        Ok(buf)
    };
    Ok([one(kv[0])?, one(kv[1])?])
}

/// Step `step`'s exchange: this rank's K and V (`mine`) to the rank that
/// needs them; the sender's rows, if this rank needs them, into fresh
/// buffers of `sizes(sender)` elements.
fn exchange_step<T: Element + NcclType>(
    plans: &Plans,
    comm: &Communicator,
    mine: &[CudaSlice<T>; 2],
    sizes: &dyn Fn(usize) -> [usize; 2],
    step: usize,
) -> Result<Inbox<T>, Error> {
    let (to, from) = plans.step(step);
    let mut recv = match from {
        Some(from) => {
            let alloc = |n: usize| {
                comm.stream().alloc_zeros::<T>(n.max(1)).map_err(|e| Error::driver("allocating received K/V", e))
            };
            let [k, v] = sizes(from);
            Some((from, [alloc(k)?, alloc(v)?]))
        }
        None => None,
    };
    let sends: Vec<_> = to.into_iter().flat_map(|to| mine.iter().map(move |b| (to, b.slice(..)))).collect();
    let sends: Vec<_> = sends.iter().map(|(to, view)| (*to, view)).collect();
    let mut views: Vec<_> = match &mut recv {
        Some((from, [k, v])) => vec![(*from, k.slice_mut(..)), (*from, v.slice_mut(..))],
        None => Vec::new(),
    };
    let mut recvs: Vec<_> = views.iter_mut().map(|(from, view)| (*from, view)).collect();
    comm.exchange(&sends, &mut recvs)?;
    Ok(recv)
}

impl Runtime {
    /// This rank's share of a context-parallel forward over `cp.comm`'s
    /// ranks (rank = the communicator's): its operands as [`ShardIo`]
    /// (K and V contiguous `[batch, rows, heads, dim]`, as they are sent),
    /// the whole sequence's params and tensors. Every rank calls it with
    /// the same spec, sharding, schedule, whole lengths and args.
    pub fn forward_sharded<T: Element + NcclType>(
        &self,
        spec: &Spec,
        cp: ContextParallel<'_>,
        io: ShardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let rank = cp.comm.rank();
        check_exchange(cp.sharding, cp.comm.world(), [&io.k.1, &io.v.1])?;
        let shape = whole_shape(spec, cp.sharding, cp.whole, rank, [&io.q.1, &io.k.1], &infos)?;
        let pieces = Pieces::new(spec, shape, cp.sharding, args);
        let plans = Plans::new(&pieces, rank);
        let mine = packed(self, [io.k, io.v])?;
        let sizes = sizes_of(spec, &shape, cp.sharding);
        let kv_layouts = |r: usize| {
            let rows = cp.sharding.local_len(shape.kv_len, r);
            [spec.head_dims.qk, spec.head_dims.v].map(|d| Layout::bshd(shape.batch, rows, shape.heads_kv, d as usize))
        };
        let mut acc = ForwardAcc::new(self, &pieces, rank, &plans.pieces[rank])?;
        let mut out = RankOut { q: io.q, o: io.o, lse: io.lse };
        let ranks = cp.sharding.ranks;
        let ahead = match cp.schedule {
            Schedule::Ring => 1,
            Schedule::AllGather => ranks,
        };
        let mut inbox: Vec<Inbox<T>> = (0..ranks).map(|_| None).collect();
        let mut posted = 1;
        for step in 0..ranks {
            while posted < ranks && posted <= step + ahead {
                inbox[posted] = exchange_step(&plans, cp.comm, &mine, &sizes, posted)?;
                posted += 1;
            }
            let kv_rank = (rank + ranks - step) % ranks;
            let received = inbox[step].take();
            let kv: KeyValue<'_, T> = match &received {
                _ if step == 0 => [io.k, io.v],
                Some((_, [k, v])) => {
                    let [lk, lv] = kv_layouts(kv_rank);
                    [(k as &dyn DeviceInput<T>, lk), (v as &dyn DeviceInput<T>, lv)]
                }
                None => continue,
            };
            for piece in plans.mine(kv_rank) {
                acc.add(self, &pieces, piece, kv, &mut out, opts)?;
            }
        }
        acc.finish(self, &pieces, &mut out)
    }
}

/// Step `step`'s return of gradients: this rank's f32 dK and dV of rank
/// `r − step`'s rows (`partial`, if it has any) to that rank; rank `r +
/// step`'s of this rank's rows, if it has any, into fresh buffers of
/// `sizes` elements.
fn return_step(
    plans: &Plans,
    comm: &Communicator,
    partial: Option<&GradAcc>,
    sizes: [usize; 2],
    step: usize,
) -> Result<Option<[CudaSlice<f32>; 2]>, Error> {
    let (from_me_to, back_from) = plans.step(step);
    // The K/V of step `step` went to `from_me_to`; its gradients come back
    // from there, and this rank's partial goes back where its K/V came from.
    let owner = back_from.filter(|_| partial.is_some());
    let mut recv = match from_me_to {
        Some(_) => {
            let alloc =
                |n: usize| comm.stream().alloc_zeros::<f32>(n.max(1)).map_err(|e| Error::driver("allocating dK/dV", e));
            Some([alloc(sizes[0])?, alloc(sizes[1])?])
        }
        None => None,
    };
    let sent: Vec<_> = match (owner, partial) {
        (Some(owner), Some(p)) => p.buffers.iter().map(|b| (owner, b.slice(..))).collect(),
        _ => Vec::new(),
    };
    let sends: Vec<_> = sent.iter().map(|(to, view)| (*to, view)).collect();
    let mut views: Vec<_> = match (&mut recv, from_me_to) {
        (Some([k, v]), Some(peer)) => vec![(peer, k.slice_mut(..)), (peer, v.slice_mut(..))],
        _ => Vec::new(),
    };
    let mut recvs: Vec<_> = views.iter_mut().map(|(from, view)| (*from, view)).collect();
    comm.exchange(&sends, &mut recvs)?;
    Ok(recv)
}

impl Runtime {
    /// This rank's share of a context-parallel backward (see
    /// [`Runtime::forward_sharded`]), after it wrote the rank's O and LSE.
    /// A trainable tensor's gradient is this rank's share of the sum: add
    /// the ranks' (an all-reduce, as for data-parallel gradients).
    pub fn backward_sharded<T: Element + NcclType>(
        &self,
        spec: &Spec,
        cp: ContextParallel<'_>,
        io: ShardGradIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let rank = cp.comm.rank();
        check_exchange(cp.sharding, cp.comm.world(), [&io.k.1, &io.v.1])?;
        let shape = whole_shape(spec, cp.sharding, cp.whole, rank, [&io.q.1, &io.k.1], &infos)?;
        let pieces = Pieces::new(spec, shape, cp.sharding, args);
        let plans = Plans::new(&pieces, rank);
        let ShardGradIo { q, k, v, o, lse, d_o, dq, dk, dv, mut d_tensors } = io;
        for t in d_tensors.iter_mut().flatten() {
            self.stream().memset_zeros(*t).map_err(|e| Error::driver("zeroing a tensor gradient", e))?;
        }
        let mine = packed(self, [k, v])?;
        let (dqk, dvd) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let kv_rows = |r: usize| cp.sharding.local_len(shape.kv_len, r);
        let sizes = sizes_of(spec, &shape, cp.sharding);
        let input = RankGradIn { q, o, d_o, lse };
        let mut dq_acc = GradAcc::zeros(self, shape.batch, q.1.seq, shape.heads, &[dqk])?;
        let mut own = GradAcc::zeros(self, shape.batch, k.1.seq, shape.heads_kv, &[dqk, dvd])?;
        let ranks = cp.sharding.ranks;
        let ahead = if cp.schedule == Schedule::Ring { 1 } else { ranks };
        let mut inbox: Vec<Inbox<T>> = (0..ranks).map(|_| None).collect();
        let (mut posted, mut returned) = (1, Vec::new());
        for step in 0..ranks {
            while posted < ranks && posted <= step + ahead {
                inbox[posted] = exchange_step(&plans, cp.comm, &mine, &sizes, posted)?;
                posted += 1;
            }
            let kv_rank = (rank + ranks - step) % ranks;
            let received = inbox[step].take();
            let kv: KeyValue<'_, T> = match &received {
                _ if step == 0 => [k, v],
                Some((_, [rk, rv])) => {
                    let [lk, lv] = [dqk, dvd].map(|d| Layout::bshd(shape.batch, kv_rows(kv_rank), shape.heads_kv, d));
                    [(rk as &dyn DeviceInput<T>, lk), (rv as &dyn DeviceInput<T>, lv)]
                }
                None => [k, v],
            };
            let mut partial = match step {
                0 => None,
                _ => Some(GradAcc::zeros(self, shape.batch, kv_rows(kv_rank), shape.heads_kv, &[dqk, dvd])?),
            };
            let mut computed = false;
            for piece in plans.mine(kv_rank) {
                let dkv = partial.as_mut().unwrap_or(&mut own);
                backward_piece(self, &pieces, piece, kv, &input, &mut dq_acc, dkv, &mut d_tensors, opts)?;
                computed = true;
            }
            if step > 0 {
                let partial = partial.filter(|_| computed);
                returned.push(return_step(&plans, cp.comm, partial.as_ref(), sizes(rank), step)?);
            }
        }
        for [pk, pv] in returned.into_iter().flatten() {
            self.add_f32(spec, false, &mut own.buffers[0], Some(&pk))?;
            self.add_f32(spec, false, &mut own.buffers[1], Some(&pv))?;
        }
        dq_acc.write(self, spec, 0, dq)?;
        own.write(self, spec, 0, dk)?;
        own.write(self, spec, 1, dv)
    }
}

/// Elements of each rank's K and V rows.
fn sizes_of(spec: &Spec, shape: &flashgen_codegen::Shape, sharding: Sharding) -> impl Fn(usize) -> [usize; 2] {
    let (shape, dims) = (*shape, [spec.head_dims.qk, spec.head_dims.v]);
    move |r| dims.map(|d| shape.batch * sharding.local_len(shape.kv_len, r) * shape.heads_kv * d as usize)
}
