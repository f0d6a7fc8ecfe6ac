//! Context parallelism over NCCL: each rank of a [`Communicator`] runs its
//! pieces ([`super::pieces`]) on its own GPU, and the K/V rows its pieces
//! read come from their owners by NCCL point-to-point exchanges. At step `s`
//! rank `r` sends rank `r + s` the rows of its K and V that rank's pieces
//! read (their hull, per batch) and receives those it reads of rank
//! `r − s`'s, so K/V a mask drops for all of a rank's queries never move.
//! The backward returns to each owner the f32 dK and dV of the rows it read.
//!
//! [`Schedule::Ring`] posts step `s + 1`'s exchange before step `s`'s pieces
//! compute, on the communicator's stream; [`Schedule::AllGather`] posts
//! every step's first.

use super::pieces::{backward_piece, ForwardAcc, GradAcc, KeyValue, Pieces, RankGradIn, RankOut};
use super::{ShardIo, Whole};
use crate::args::{ArgInfo, ArgValue};
use crate::backward::{BackwardIo, BackwardOptions};
use crate::check_shard::{check_exchange, whole_shape};
use crate::comm::Communicator;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::layout::Layout;
use crate::operand::DeviceInput;
use crate::runtime::Runtime;
use crate::scratch;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop};
use cudarc::nccl::NcclType;
use flashgen_codegen::shard::{Piece, Segment, Sharding};
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

/// Rows `lo..hi` of a rank's K/V rows, in its own numbering.
type Rows = (usize, usize);

/// A peer rank and rows of the K/V one of the two reads of the other's.
type Peer = Option<(usize, Rows)>;

/// Every rank's pieces, so each knows what the others read of it, and the
/// sizes of every rank's K/V rows.
struct Plans {
    rank: usize,
    ranks: usize,
    pieces: Vec<Vec<Piece>>,
    /// Batch, K/V heads, and the K and V head dims.
    batch: usize,
    heads_kv: usize,
    dims: [usize; 2],
    /// Each rank's K/V row count.
    kv_rows: Vec<usize>,
}

impl Plans {
    fn new(pieces: &Pieces, rank: usize) -> Plans {
        let (shape, sharding) = (pieces.shape, pieces.sharding);
        let dims = [pieces.spec.head_dims.qk, pieces.spec.head_dims.v].map(|d| d as usize);
        Plans {
            rank,
            ranks: sharding.ranks,
            pieces: (0..sharding.ranks).map(|r| pieces.of_rank(r)).collect(),
            batch: shape.batch,
            heads_kv: shape.heads_kv,
            dims,
            kv_rows: (0..sharding.ranks).map(|r| sharding.local_len(shape.kv_len, r)).collect(),
        }
    }

    /// The rows of rank `from`'s K/V that rank `to`'s pieces read (their
    /// hull), if any.
    fn rows(&self, to: usize, from: usize) -> Option<Rows> {
        let read = self.pieces[to].iter().filter(|p| p.kv_rank == from);
        read.map(|p| (p.kv.local, p.kv.local + p.kv.len)).reduce(|a, b| (a.0.min(b.0), a.1.max(b.1)))
    }

    /// Step `step`'s peers: the rank sent to and the rows of this rank's it
    /// reads, and the rank received from and the rows of its this rank reads.
    fn step(&self, step: usize) -> (Peer, Peer) {
        let (to, from) = ((self.rank + step) % self.ranks, (self.rank + self.ranks - step) % self.ranks);
        let sent = self.rows(to, self.rank).map(|rows| (to, rows));
        (sent, self.rows(self.rank, from).map(|rows| (from, rows)))
    }

    fn mine(&self, kv_rank: usize) -> impl Iterator<Item = &Piece> {
        self.pieces[self.rank].iter().filter(move |p| p.kv_rank == kv_rank)
    }

    /// Elements of one row of K (`i = 0`) or V (`i = 1`).
    fn row(&self, i: usize) -> usize {
        self.heads_kv * self.dims[i]
    }

    /// Per batch, the elements of `rows` of a `[batch, n, heads_kv, dim]`
    /// buffer of K (`i = 0`) or V (`i = 1`).
    fn chunks(&self, i: usize, n: usize, (lo, hi): Rows) -> Vec<std::ops::Range<usize>> {
        let row = self.row(i);
        (0..self.batch).map(|b| (b * n + lo) * row..(b * n + hi) * row).collect()
    }
}

/// K and V rows `rows` of rank `from`, `[batch, rows, heads_kv, dim]` each.
struct Received<T> {
    from: usize,
    rows: Rows,
    kv: [CudaSlice<T>; 2],
}

impl<T: Element> Received<T> {
    /// The K/V a piece over rank `from`'s rows reads, and the piece with its
    /// rows numbered from the received ones.
    fn piece(&self, plans: &Plans, piece: &Piece) -> (KeyValue<'_, T>, Piece) {
        let n = self.rows.1 - self.rows.0;
        let [lk, lv] = [0, 1].map(|i| Layout::bshd(plans.batch, n, plans.heads_kv, plans.dims[i]));
        let kv = Segment { local: piece.kv.local - self.rows.0, ..piece.kv };
        ([(&self.kv[0] as &dyn DeviceInput<T>, lk), (&self.kv[1] as &dyn DeviceInput<T>, lv)], Piece { kv, ..*piece })
    }
}

/// The chunks received from one rank, back to back in one buffer.
fn joined<T: Element>(stream: &Arc<CudaStream>, mut parts: Vec<CudaSlice<T>>) -> Result<CudaSlice<T>, Error> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let mut all = scratch::zeros::<T>(stream, parts.iter().map(|p| p.len()).sum())?;
    let mut at = 0;
    for part in &parts {
        let copy = stream.memcpy_dtod(part, &mut all.slice_mut(at..at + part.len()));
        copy.map_err(|e| Error::driver("joining received rows", e))?;
        at += part.len();
    }
    Ok(all)
}

/// Step `step`'s exchange: the rows of this rank's K and V (`mine`) that
/// the rank sent to reads; the rows this rank reads of the sender's.
fn exchange_step<T: Element + NcclType>(
    plans: &Plans,
    comm: &Communicator,
    mine: &[CudaSlice<T>; 2],
    step: usize,
) -> Result<Option<Received<T>>, Error> {
    let (to, from) = plans.step(step);
    let me = plans.kv_rows[plans.rank];
    let mut sent = Vec::new();
    if let Some((to, rows)) = to {
        for (i, buffer) in mine.iter().enumerate() {
            sent.extend(plans.chunks(i, me, rows).into_iter().map(|r| (to, buffer.slice(r))));
        }
    }
    let mut recvs = Vec::new();
    if let Some((from, (lo, hi))) = from {
        for i in 0..2 {
            for chunk in plans.chunks(i, hi - lo, (0, hi - lo)) {
                recvs.push((from, scratch::zeros::<T>(comm.stream(), chunk.len())?));
            }
        }
    }
    let sends: Vec<_> = sent.iter().map(|(to, view)| (*to, view)).collect();
    let mut views: Vec<_> = recvs.iter_mut().map(|(from, b)| (*from, b.slice_mut(..))).collect();
    let mut posted: Vec<_> = views.iter_mut().map(|(from, view)| (*from, view)).collect();
    comm.exchange(&sends, &mut posted)?;
    drop(views);
    let Some((from, rows)) = from else { return Ok(None) };
    let mut parts: Vec<CudaSlice<T>> = recvs.into_iter().map(|(_, b)| b).collect();
    let v = parts.split_off(plans.batch);
    let kv = [joined(comm.stream(), parts)?, joined(comm.stream(), v)?];
    Ok(Some(Received { from, rows, kv }))
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
        let mut buf = scratch::zeros::<T>(rt.stream(), span.len)?;
        if span.len > 0 {
            rt.stream()
                .memcpy_dtod(&span, &mut buf.slice_mut(..span.len))
                .map_err(|e| Error::driver("packing K/V to send", e))?;
        }
        Ok(buf)
    };
    Ok([one(kv[0])?, one(kv[1])?])
}

/// A launch's checks, then its pieces and every rank's plan, for the
/// rank's Q, K and V layouts.
fn plan<'s, 'a>(
    spec: &'s Spec,
    cp: ContextParallel<'_>,
    [q, k, v]: [&Layout; 3],
    args: &'s [ArgValue<'a>],
) -> Result<(Pieces<'s, 'a>, Plans), Error> {
    let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
    check_exchange(cp.sharding, cp.comm.world(), [k, v])?;
    let shape = whole_shape(spec, cp.sharding, cp.whole, cp.comm.rank(), [q, k], &infos)?;
    let pieces = Pieces::new(spec, shape, cp.sharding, args);
    let plans = Plans::new(&pieces, cp.comm.rank());
    Ok((pieces, plans))
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
        let (pieces, plans) = plan(spec, cp, [&io.q.1, &io.k.1, &io.v.1], args)?;
        let rank = plans.rank;
        let mine = packed(self, [io.k, io.v])?;
        let mut acc = ForwardAcc::new(self, &pieces, rank, &plans.pieces[rank])?;
        let mut out = RankOut { q: io.q, o: io.o, lse: io.lse };
        let mut inbox = Inbox::new(&plans, cp.schedule);
        for step in 0..plans.ranks {
            inbox.post(&plans, cp.comm, &mine, step)?;
            match (step, inbox.take(step)) {
                (0, _) => {
                    for piece in plans.mine(rank) {
                        acc.add(self, &pieces, piece, [io.k, io.v], &mut out, opts)?;
                    }
                }
                (_, Some(received)) => {
                    for piece in plans.mine(received.from) {
                        let (kv, piece) = received.piece(&plans, piece);
                        acc.add(self, &pieces, &piece, kv, &mut out, opts)?;
                    }
                }
                (_, None) => {}
            }
        }
        acc.finish(self, &pieces, &mut out)
    }
}

/// The steps' received rows, posted `ahead` steps before they are read.
struct Inbox<T> {
    steps: Vec<Option<Received<T>>>,
    posted: usize,
    ahead: usize,
}

impl<T: Element + NcclType> Inbox<T> {
    fn new(plans: &Plans, schedule: Schedule) -> Self {
        let ahead = match schedule {
            Schedule::Ring => 1,
            Schedule::AllGather => plans.ranks,
        };
        Inbox { steps: (0..plans.ranks).map(|_| None).collect(), posted: 1, ahead }
    }

    /// Posts the exchanges due before step `step` computes.
    fn post(&mut self, plans: &Plans, comm: &Communicator, mine: &[CudaSlice<T>; 2], step: usize) -> Result<(), Error> {
        while self.posted < plans.ranks && self.posted <= step + self.ahead {
            self.steps[self.posted] = exchange_step(plans, comm, mine, self.posted)?;
            self.posted += 1;
        }
        Ok(())
    }

    fn take(&mut self, step: usize) -> Option<Received<T>> {
        self.steps[step].take()
    }
}

/// dK and dV of rows `.0` of this rank's, returned by another rank: its
/// chunks per batch, K's then V's.
type Returned = (Rows, Vec<CudaSlice<f32>>);

/// Step `step`'s return of gradients: this rank's f32 dK and dV (`partial`)
/// of the rows it read of the rank it received from, to that rank; the
/// dK and dV of the rows of this rank's that the rank sent to read.
fn return_step(
    plans: &Plans,
    comm: &Communicator,
    partial: Option<(&GradAcc, Rows)>,
    step: usize,
) -> Result<Option<Returned>, Error> {
    let (to, from) = plans.step(step);
    let mut sent = Vec::new();
    if let (Some((owner, _)), Some((acc, (lo, hi)))) = (from, partial) {
        for (i, buffer) in acc.buffers.iter().enumerate() {
            sent.extend(plans.chunks(i, hi - lo, (0, hi - lo)).into_iter().map(|r| (owner, buffer.slice(r))));
        }
    }
    let mut recvs = Vec::new();
    if let Some((reader, rows)) = to {
        for i in 0..2 {
            for chunk in plans.chunks(i, rows.1 - rows.0, (0, rows.1 - rows.0)) {
                recvs.push((reader, scratch::zeros::<f32>(comm.stream(), chunk.len())?));
            }
        }
    }
    let sends: Vec<_> = sent.iter().map(|(to, view)| (*to, view)).collect();
    let mut views: Vec<_> = recvs.iter_mut().map(|(from, b)| (*from, b.slice_mut(..))).collect();
    let mut posted: Vec<_> = views.iter_mut().map(|(from, view)| (*from, view)).collect();
    comm.exchange(&sends, &mut posted)?;
    drop(views);
    Ok(to.map(|(_, rows)| (rows, recvs.into_iter().map(|(_, b)| b).collect())))
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
        io: BackwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let (pieces, plans) = plan(spec, cp, [&io.q.1, &io.k.1, &io.v.1], args)?;
        let (rank, shape) = (plans.rank, pieces.shape);
        let BackwardIo { q, k, v, o, lse, d_o, dq, dk, dv, mut d_tensors } = io;
        for t in d_tensors.iter_mut().flatten() {
            self.stream().memset_zeros(*t).map_err(|e| Error::driver("zeroing a tensor gradient", e))?;
        }
        let mine = packed(self, [k, v])?;
        let input = RankGradIn { q, o, d_o, lse };
        let mut dq_acc = GradAcc::zeros(self, shape.batch, q.1.seq, shape.heads, &plans.dims[..1])?;
        let mut own = GradAcc::zeros(self, shape.batch, k.1.seq, shape.heads_kv, &plans.dims)?;
        let mut inbox = Inbox::new(&plans, cp.schedule);
        let mut returned = Vec::new();
        for step in 0..plans.ranks {
            inbox.post(&plans, cp.comm, &mine, step)?;
            if step == 0 {
                for piece in plans.mine(rank) {
                    backward_piece(self, &pieces, piece, [k, v], &input, &mut dq_acc, &mut own, &mut d_tensors, opts)?;
                }
                continue;
            }
            let mut partial = None;
            if let Some(received) = inbox.take(step) {
                let (lo, hi) = received.rows;
                let mut acc = GradAcc::zeros(self, shape.batch, hi - lo, shape.heads_kv, &plans.dims)?;
                for piece in plans.mine(received.from) {
                    let (kv, piece) = received.piece(&plans, piece);
                    backward_piece(self, &pieces, &piece, kv, &input, &mut dq_acc, &mut acc, &mut d_tensors, opts)?;
                }
                partial = Some((acc, received.rows));
            }
            let partial = partial.as_ref().map(|(acc, rows)| (acc, *rows));
            returned.extend(return_step(&plans, cp.comm, partial, step)?);
        }
        for (rows, chunks) in returned {
            self.add_returned(spec, &plans, &mut own, rows, chunks)?;
        }
        dq_acc.write(self, spec, 0, dq)?;
        own.write(self, spec, 0, dk)?;
        own.write(self, spec, 1, dv)
    }

    /// Adds another rank's dK and dV of `rows` of this rank's (`chunks`:
    /// per batch, K's then V's) into `own`: placed in a zeroed buffer of
    /// this rank's rows, then added whole.
    fn add_returned(
        &self,
        spec: &Spec,
        plans: &Plans,
        own: &mut GradAcc,
        rows: Rows,
        chunks: Vec<CudaSlice<f32>>,
    ) -> Result<(), Error> {
        let n = plans.kv_rows[plans.rank];
        let mut chunks = chunks.into_iter();
        for i in 0..2 {
            let mut placed = scratch::zeros::<f32>(self.stream(), own.buffers[i].len())?;
            for (range, chunk) in plans.chunks(i, n, rows).into_iter().zip(chunks.by_ref()) {
                let copy = self.stream().memcpy_dtod(&chunk, &mut placed.slice_mut(range));
                copy.map_err(|e| Error::driver("placing returned gradients", e))?;
            }
            self.add_f32(spec, false, &mut own.buffers[i], Some(&placed))?;
        }
        Ok(())
    }
}
