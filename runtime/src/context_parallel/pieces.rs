//! One rank's pieces on its device: each an ordinary forward or backward
//! launch of the shard view over one query segment and one key segment,
//! merged into the rank's running output by LSE, or its gradients added in
//! f32. The drivers ([`super::local`], and the NCCL schedules) only decide
//! where each key segment's K and V come from and where dK and dV go.

use super::{lse_offset, segment_rows};
use crate::args::ArgValue;
use crate::backward::{BackwardIo, BackwardOptions};
use crate::block_mask::BlockMask;
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::{ForwardIo, ForwardOptions};
use crate::layout::Layout;
use crate::operand::{DeviceInput, DeviceOutput};
use crate::partials::{AddIo, MergeIo};
use crate::runtime::Runtime;
use crate::scratch;
use cudarc::driver::CudaSlice;
use flashgen_codegen::cuda::trainable_tensors;
use flashgen_codegen::shard::{rank_pieces, view, Piece, Segment, ShardParams, Sharding};
use flashgen_codegen::{reference::ParamValue, Shape, Spec};

/// What every piece of one launch shares: the spec and its shard views
/// (without and with the learned sink), the whole shape, the user's args.
pub(super) struct Pieces<'s, 'a> {
    pub spec: &'s Spec,
    views: [Spec; 2],
    pub shape: Shape,
    pub sharding: Sharding,
    args: &'s [ArgValue<'a>],
    params: Vec<ParamValue>,
}

/// K and V rows of one rank's key segments, as that rank holds them.
pub(super) type KeyValue<'k, T> = [(&'k dyn DeviceInput<T>, Layout); 2];

impl<'s, 'a> Pieces<'s, 'a> {
    pub fn new(spec: &'s Spec, shape: Shape, sharding: Sharding, args: &'s [ArgValue<'a>]) -> Self {
        let params = args[..spec.params.len()]
            .iter()
            .map(|a| match *a {
                ArgValue::I32(v) => ParamValue::I32(v),
                ArgValue::F32(v) => ParamValue::F32(v),
                _ => ParamValue::I32(0),
            })
            .collect();
        Pieces { spec, views: [view(spec, false), view(spec, true)], shape, sharding, args, params }
    }

    /// Rank `rank`'s pieces, key ranks in ring order from its own.
    pub fn of_rank(&self, rank: usize) -> Vec<Piece> {
        rank_pieces(self.spec, &self.shape, &self.params, self.sharding, rank)
    }

    /// The view a piece launches, its args (the user's params, the piece's
    /// positions and the whole lengths, then the user's tensors) and, for
    /// a mask that reads tensors, the piece's own block mask (a block mask
    /// serves one launch's tiles, so the whole launch's would not fit).
    fn launch(&self, rt: &Runtime, piece: &Piece) -> Result<(&Spec, Vec<ArgValue<'a>>, Option<BlockMask>), Error> {
        let int = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
        let shard = ShardParams {
            q0: int(piece.q.start),
            k0: int(piece.kv.start),
            q_len: int(self.shape.q_len),
            kv_len: int(self.shape.kv_len),
        };
        let (params, tensors) = self.args.split_at(self.spec.params.len());
        let mut args = params.to_vec();
        args.extend(shard.values().map(ArgValue::I32));
        args.extend_from_slice(tensors);
        let view = &self.views[usize::from(piece.sink)];
        let mask = match view.mask.as_ref().is_some_and(|m| m.reads_tensor()) {
            true => {
                let shape = Shape { q_len: piece.q.len, kv_len: piece.kv.len, ..self.shape };
                Some(rt.block_mask(view, shape, &args)?)
            }
            false => None,
        };
        Ok((view, args, mask))
    }
}

/// A rank's running forward: its output so far in f32 and, per query
/// segment, the pieces merged and still to come.
pub(super) struct ForwardAcc {
    o: CudaSlice<f32>,
    o_layout: Layout,
    lse: CudaSlice<f32>,
    segments: Vec<Segment>,
    merged: Vec<bool>,
    left: Vec<usize>,
}

/// A rank's query rows and where its output goes.
pub(super) struct RankOut<'o, T> {
    pub q: (&'o dyn DeviceInput<T>, Layout),
    pub o: (&'o mut dyn DeviceOutput<T>, Layout),
    pub lse: &'o mut CudaSlice<f32>,
}

impl ForwardAcc {
    pub fn new(rt: &Runtime, pieces: &Pieces, rank: usize, plan: &[Piece]) -> Result<Self, Error> {
        let shape = &pieces.shape;
        let segments = pieces.sharding.segments(shape.q_len, rank);
        let rows: usize = segments.iter().map(|s| s.len).sum();
        let o_layout = Layout::bshd(shape.batch, rows, shape.heads, pieces.spec.head_dims.v as usize);
        let alloc = |n: usize| scratch::zeros::<f32>(rt.stream(), n);
        let left = segments.iter().map(|s| plan.iter().filter(|p| p.q == *s).count()).collect();
        Ok(ForwardAcc {
            o: alloc(o_layout.len())?,
            o_layout,
            lse: alloc(shape.batch * shape.heads * rows)?,
            merged: vec![false; segments.len()],
            segments,
            left,
        })
    }

    /// Computes `piece` (its keys in `kv`) and merges it; the segment's
    /// last piece writes the rank's O and LSE rows.
    pub fn add<T: Element>(
        &mut self,
        rt: &Runtime,
        pieces: &Pieces,
        piece: &Piece,
        kv: KeyValue<'_, T>,
        out: &mut RankOut<'_, T>,
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        crate::dropout::refuse(opts.dropout, "context-parallel")?;
        let shape = &pieces.shape;
        let dv = pieces.spec.head_dims.v as usize;
        let n = piece.q.len;
        let mut o = scratch::zeros::<T>(rt.stream(), shape.batch * n * shape.heads * dv)?;
        let mut lse = scratch::zeros::<f32>(rt.stream(), shape.batch * shape.heads * n)?;
        let o_layout = Layout::bshd(shape.batch, n, shape.heads, dv);
        let (view, args, mask) = pieces.launch(rt, piece)?;
        let io = ForwardIo {
            q: (out.q.0, segment_rows(out.q.1, piece.q)),
            k: (kv[0].0, segment_rows(kv[0].1, piece.kv)),
            v: (kv[1].0, segment_rows(kv[1].1, piece.kv)),
            o: (&mut o, o_layout),
            lse: Some(&mut lse),
        };
        rt.forward(view, io, &args, &ForwardOptions { block_mask: mask.as_ref(), ..*opts })?;
        let s = self.segment(piece.q);
        self.left[s] -= 1;
        self.merge(rt, pieces, s, Some((&o, o_layout, &lse)), out)
    }

    /// Writes the rank's rows of every segment no piece reached (no kept
    /// key: O = 0, LSE = −inf); the others were written by their last piece.
    pub fn finish<T: Element>(mut self, rt: &Runtime, pieces: &Pieces, out: &mut RankOut<'_, T>) -> Result<(), Error> {
        for s in 0..self.segments.len() {
            if !self.merged[s] {
                self.merge::<T>(rt, pieces, s, None, out)?;
            }
        }
        Ok(())
    }

    fn segment(&self, q: Segment) -> usize {
        self.segments.iter().position(|s| *s == q).unwrap_or(0)
    }

    fn merge<T: Element>(
        &mut self,
        rt: &Runtime,
        pieces: &Pieces,
        s: usize,
        piece: Option<(&CudaSlice<T>, Layout, &CudaSlice<f32>)>,
        out: &mut RankOut<'_, T>,
    ) -> Result<(), Error> {
        let segment = self.segments[s];
        let at = lse_offset(&pieces.shape, segment);
        let out = match self.left[s] == 0 {
            true => {
                let o: &mut dyn DeviceOutput<T> = &mut *out.o.0;
                Some(((o, segment_rows(out.o.1, segment)), (&mut *out.lse, at)))
            }
            false => None,
        };
        let piece = piece.map(|(o, layout, lse)| {
            let o: &dyn DeviceInput<T> = o;
            ((o, layout), (lse, 0))
        });
        let io = MergeIo {
            first: !self.merged[s],
            acc_o: (&mut self.o, segment_rows(self.o_layout, segment)),
            acc_lse: (&mut self.lse, at),
            piece,
            out,
        };
        rt.merge_partial(pieces.spec, io)?;
        self.merged[s] = true;
        Ok(())
    }
}

/// A rank's backward inputs: its rows of Q, O, dO and LSE.
pub(super) struct RankGradIn<'g, T> {
    pub q: (&'g dyn DeviceInput<T>, Layout),
    pub o: (&'g dyn DeviceInput<T>, Layout),
    pub d_o: (&'g dyn DeviceInput<T>, Layout),
    pub lse: &'g CudaSlice<f32>,
}

/// Gradients in f32 as they accumulate: one rank's dQ, or the dK and dV of
/// one rank's key rows.
pub(super) struct GradAcc {
    pub buffers: Vec<CudaSlice<f32>>,
    pub layouts: Vec<Layout>,
}

impl GradAcc {
    /// Zeroed f32 buffers, `[batch, rows, heads, dim]` per entry of `dims`.
    pub fn zeros(rt: &Runtime, batch: usize, rows: usize, heads: usize, dims: &[usize]) -> Result<Self, Error> {
        let layouts: Vec<Layout> = dims.iter().map(|&d| Layout::bshd(batch, rows, heads, d)).collect();
        let buffers = layouts.iter().map(|l| scratch::zeros::<f32>(rt.stream(), l.len())).collect::<Result<_, _>>()?;
        Ok(GradAcc { buffers, layouts })
    }

    /// Adds `piece` (laid out `[batch, segment, heads, dim]`) into entry `i`'s rows of `segment`.
    fn add<T: Element>(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        i: usize,
        segment: Segment,
        piece: &CudaSlice<T>,
    ) -> Result<(), Error> {
        let acc = segment_rows(self.layouts[i], segment);
        let piece_layout = Layout::bshd(acc.batch, acc.seq, acc.heads, acc.dim);
        let io =
            AddIo { first: false, acc: (&mut self.buffers[i], acc), piece: Some((piece, piece_layout)), out: None };
        rt.add_partial(spec, io)
    }

    /// Writes entry `i` rounded to `T` into `out`.
    pub fn write<T: Element>(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        i: usize,
        out: (&mut dyn DeviceOutput<T>, Layout),
    ) -> Result<(), Error> {
        let o: &mut dyn DeviceOutput<T> = out.0;
        let io =
            AddIo { first: false, acc: (&mut self.buffers[i], self.layouts[i]), piece: None, out: Some((o, out.1)) };
        rt.add_partial(spec, io)
    }
}

/// Computes the backward of `piece` (its keys in `kv`) and adds its dQ into
/// `dq`'s rows, its dK and dV into `dkv`'s rows of the key segment, and its
/// tensor gradients into `d_tensors` (zeroed by the caller).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_piece<T: Element>(
    rt: &Runtime,
    pieces: &Pieces,
    piece: &Piece,
    kv: KeyValue<'_, T>,
    input: &RankGradIn<'_, T>,
    dq: &mut GradAcc,
    dkv: &mut GradAcc,
    d_tensors: &mut [Option<&mut CudaSlice<f32>>],
    opts: &BackwardOptions<'_>,
) -> Result<(), Error> {
    crate::dropout::refuse(opts.dropout, "context-parallel")?;
    let shape = &pieces.shape;
    let (dqk, dv) = (pieces.spec.head_dims.qk as usize, pieces.spec.head_dims.v as usize);
    let (n, m) = (piece.q.len, piece.kv.len);
    let stream = rt.stream();
    let zeros = |len: usize| scratch::zeros::<T>(stream, len);
    let mut piece_dq = zeros(shape.batch * n * shape.heads * dqk)?;
    let mut piece_dk = zeros(shape.batch * m * shape.heads_kv * dqk)?;
    let mut piece_dv = zeros(shape.batch * m * shape.heads_kv * dv)?;
    // The backward reads the LSE from a buffer's start: the segment's rows.
    let rows = shape.batch * shape.heads * n;
    let mut lse = scratch::zeros::<f32>(stream, rows)?;
    let at = lse_offset(shape, piece.q);
    if rows > 0 {
        stream
            .memcpy_dtod(&input.lse.slice(at..at + rows), &mut lse)
            .map_err(|e| Error::driver("copying a segment's LSE", e))?;
    }
    let (view, args, mask) = pieces.launch(rt, piece)?;
    // A tensor only the sink reads has no gradient in a piece without it.
    let trainable = trainable_tensors(view);
    let mut tensor_grads: Vec<Option<CudaSlice<f32>>> = d_tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let wanted = t.as_ref().filter(|_| trainable.contains(&i));
            wanted.map(|t| scratch::zeros::<f32>(stream, t.len())).transpose()
        })
        .collect::<Result<_, _>>()?;
    let io = BackwardIo {
        q: (input.q.0, segment_rows(input.q.1, piece.q)),
        k: (kv[0].0, segment_rows(kv[0].1, piece.kv)),
        v: (kv[1].0, segment_rows(kv[1].1, piece.kv)),
        o: (input.o.0, segment_rows(input.o.1, piece.q)),
        lse: &lse,
        d_o: (input.d_o.0, segment_rows(input.d_o.1, piece.q)),
        dq: (&mut piece_dq, Layout::bshd(shape.batch, n, shape.heads, dqk)),
        dk: (&mut piece_dk, Layout::bshd(shape.batch, m, shape.heads_kv, dqk)),
        dv: (&mut piece_dv, Layout::bshd(shape.batch, m, shape.heads_kv, dv)),
        d_tensors: tensor_grads.iter_mut().map(Option::as_mut).collect(),
    };
    rt.backward(view, io, &args, &BackwardOptions { block_mask: mask.as_ref(), ..*opts })?;
    dq.add(rt, pieces.spec, 0, piece.q, &piece_dq)?;
    dkv.add(rt, pieces.spec, 0, piece.kv, &piece_dk)?;
    dkv.add(rt, pieces.spec, 1, piece.kv, &piece_dv)?;
    for (acc, grad) in d_tensors.iter_mut().zip(&tensor_grads) {
        if let (Some(acc), Some(grad)) = (acc, grad) {
            rt.add_f32(pieces.spec, false, acc, Some(grad))?;
        }
    }
    Ok(())
}
