//! The checked, asynchronous backward launch: the kernels of
//! `flashgen_codegen::cuda::emit_backward`, queued in order on the runtime's
//! stream.
//!
//! Workspace: D (`f32[batch, heads, q_len]`) and, in the atomic mode, the dQ
//! accumulator (zeroed by the preprocess; `f32[batch, heads, q_len, head_dim]`, or per
//! 64-query tile in the Hopper kernel's fragment order: `DqAccum`) live in one
//! buffer, allocated on the stream per launch or kept between launches in a
//! [`BackwardWorkspace`]. Requested tensor gradients are zeroed, then
//! summed into by f32 atomics: they are not bitwise deterministic, in either
//! mode. dQ, dK and dV are deterministic in the deterministic mode; in the
//! atomic mode dQ's f32 sum order varies between runs.

use crate::arch::Arch;
use crate::args::{bound, tensor_ptrs, ArgInfo, ArgValue};
use crate::block_mask::BlockMask;
use crate::check::{check_backward, softmax_scale, Buffer, Grads, Problem};
use crate::dropout;
use crate::element::Element;
use crate::error::Error;
use crate::kernels::{LoadedKernel, Which};
use crate::layout::Layout;
use crate::marshal::{launch, launch_config, marshal, Bindings, GradBindings, VarlenBindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use crate::scratch;
use crate::tma::{self, TensorMaps};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use flashgen_codegen::abi::{ArgKind, Operand};
use flashgen_codegen::cuda::{trainable_tensors, BackwardConfig, BackwardPass, BackwardTile, Work};
use flashgen_codegen::{Dropout, Shape, Spec};
use std::sync::{Arc, Mutex, PoisonError};

/// The operands of one backward pass: the forward's inputs, its output O and
/// row log-sum-exp (`f32[batch, heads, q_len]`, as [`crate::ForwardIo::lse`]
/// writes it), the incoming gradient dO (laid out like O), and the gradients
/// written: dQ, dK, dV (laid out like Q, K, V) and, per declared tensor in
/// declaration order, an optional f32 buffer of the tensor's element count
/// for its gradient (overwritten; trailing tensors may be left out).
pub struct BackwardIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub k: (&'a dyn DeviceInput<T>, Layout),
    pub v: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a dyn DeviceInput<T>, Layout),
    pub lse: &'a CudaSlice<f32>,
    pub d_o: (&'a dyn DeviceInput<T>, Layout),
    pub dq: (&'a mut dyn DeviceOutput<T>, Layout),
    pub dk: (&'a mut dyn DeviceOutput<T>, Layout),
    pub dv: (&'a mut dyn DeviceOutput<T>, Layout),
    /// One per declared tensor: the f32 gradient of a trainable tensor, or
    /// `None`. With `None` for every tensor the dK/dV kernel computes no
    /// tensor-gradient terms at all.
    pub d_tensors: Vec<Option<&'a mut CudaSlice<f32>>>,
}

/// A checked backward launch: its shape (a varlen one's: the longest
/// lengths), softmax scale, and a varlen launch's sequences.
#[derive(Clone, Copy)]
pub(crate) struct Launch {
    pub shape: Shape,
    pub scale: f32,
    pub varlen: Option<VarlenBindings>,
    /// The checked dropout (`None`: none, or p = 0).
    pub dropout: Option<Dropout>,
    /// The dK/dV tile tuned for the launch's class, where no tile was asked
    /// for (one of the spec's tiles: it was tuned among them).
    pub tuned: Option<BackwardTile>,
}

/// A backward launch's configuration, TMA descriptors and kernels (the
/// preprocess, the dK/dV kernel and the dQ pass).
type LaunchKernels = (BackwardConfig, Option<TensorMaps>, [Arc<LoadedKernel>; 3]);

impl Launch {
    /// Backward kernel `pass` in `config`, dense or varlen as the launch is.
    fn which(&self, pass: BackwardPass, config: BackwardConfig) -> Which {
        match self.varlen {
            None => Which::backward(pass, config),
            Some(_) => Which::backward_varlen(pass, config),
        }
    }
}

/// Device memory for the backward pass's intermediates, kept between the
/// launches given it in [`BackwardOptions::workspace`] so that they skip an
/// allocation each. It grows to the largest launch it served (and moves to
/// another device's memory when a launch there needs it). Launches reuse it
/// in stream order, as cudarc orders every buffer: each waits for the work
/// queued on it before, on whichever stream, so no launch sees another's
/// values.
#[derive(Default)]
pub struct BackwardWorkspace(Mutex<Option<CudaSlice<f32>>>);

#[derive(Clone, Copy, Default)]
pub struct BackwardOptions<'a> {
    /// Softmax scale; must be the forward's (positive and finite). `None`
    /// means `1 / sqrt(head_dims.qk)`.
    pub scale: Option<f32>,
    /// The block mask the forward used (same spec, shape, params and
    /// tensors): the backward kernels skip the same tiles.
    pub block_mask: Option<&'a BlockMask>,
    /// Compute dQ in a separate kernel without atomics, so dQ, dK and dV are
    /// bitwise reproducible (tensor gradients still use atomics).
    pub deterministic: bool,
    /// Where D and the dQ accumulator live; `None` allocates them per call.
    pub workspace: Option<&'a BackwardWorkspace>,
    /// The forward's dropout, the same seed and offset: the dK/dV and dQ
    /// kernels regenerate its mask. Dense launches only, as the forward's.
    pub dropout: Option<Dropout>,
    /// Run the dK/dV kernel in this tile, which must be one of
    /// `BackwardConfig::tiles` of the spec on this GPU (else
    /// [`Error::NotACandidate`]); `None`: on a dense launch without dropout
    /// the tile [`Runtime::autotune_backward`] chose for its shape class,
    /// else the untuned choice for the launch's queries
    /// (`BackwardConfig::preferred_for`). Every tile computes the same
    /// gradients.
    pub tile: Option<BackwardTile>,
}

impl<T> BackwardIo<'_, T> {
    /// The same operands, borrowed again: for launches one after another.
    pub fn reborrow(&mut self) -> BackwardIo<'_, T> {
        BackwardIo {
            q: self.q,
            k: self.k,
            v: self.v,
            o: self.o,
            lse: self.lse,
            d_o: self.d_o,
            dq: (&mut *self.dq.0, self.dq.1),
            dk: (&mut *self.dk.0, self.dk.1),
            dv: (&mut *self.dv.0, self.dv.1),
            d_tensors: self.d_tensors.iter_mut().map(|t| t.as_deref_mut()).collect(),
        }
    }
}

impl<T: Element> BackwardIo<'_, T> {
    /// Checks the operands and dO, dQ, dK, dV against `spec`; the launch's
    /// shape, `None` where there is nothing to compute.
    fn check(&self, spec: &Spec, infos: &[ArgInfo]) -> Result<Option<Shape>, Error> {
        let Self { q, k, v, o, lse, d_o, dq, dk, dv, .. } = self;
        let buffer = |layout, len| Buffer { layout, len };
        let operands = [(q.1, q.0.len()), (k.1, k.0.len()), (v.1, v.0.len()), (o.1, o.0.len())];
        let problem = Problem::new(T::DTYPE, operands, Some(lse.len()));
        let grads = Grads {
            d_o: buffer(d_o.1, d_o.0.len()),
            dq: buffer(dq.1, dq.0.len()),
            dk: buffer(dk.1, dk.0.len()),
            dv: buffer(dv.1, dv.0.len()),
        };
        check_backward(spec, &problem, &grads, infos)
    }

    /// `config` with the dK/dV kernel's copies: TMA where the Hopper kernel
    /// can address Q, dO, K and V with it (and the descriptors, addressing
    /// rows as `rows` says), else its threads.
    fn with_copies(
        &self,
        rt: &Runtime,
        spec: &Spec,
        config: BackwardConfig,
        rows: tma::Rows,
    ) -> (BackwardConfig, Option<TensorMaps>) {
        let s = rt.stream().as_ref();
        let Self { q, k, v, d_o, .. } = self;
        let tensor_maps = config.key_value_tma_tile(spec).and_then(|(block_m, block_n)| {
            let operands = [
                (Operand::Q, q.1.address(q.0.device_ptr(s).0), &q.1),
                (Operand::K, k.1.address(k.0.device_ptr(s).0), &k.1),
                (Operand::V, v.1.address(v.0.device_ptr(s).0), &v.1),
                (Operand::DO, d_o.1.address(d_o.0.device_ptr(s).0), &d_o.1),
            ];
            tma::tensor_maps(&operands, tma::Tile { block_m, block_n }, spec.dtype, rt.tma, rows)
        });
        (BackwardConfig { copy: tma::copy_with(&tensor_maps), ..config }, tensor_maps)
    }
}

impl Runtime {
    /// Checks every size, stride, buffer length and argument against `spec`
    /// as [`Runtime::forward`] does, plus the gradient operands, then queues
    /// the backward kernels on [`Runtime::stream`] without waiting for them
    /// (unless the launch tunes first: [`Runtime::with_autotune`]).
    pub fn backward<T: Element>(
        &self,
        spec: &Spec,
        mut io: BackwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let checked = io.check(spec, &infos)?;
        let scale = softmax_scale(spec, opts.scale)?;
        let dropout = dropout::checked(opts.dropout)?;
        check_tensor_grads(spec, checked, &io.d_tensors, &infos)?;
        let Some(shape) = checked else {
            return Ok(());
        };
        let tuned = match (opts.tile, dropout) {
            (None, None) => self.backward_tile_for(spec, (shape, &mut io), args, opts)?,
            _ => None,
        };
        self.queue_backward(spec, io, args, opts, Launch { shape, scale, varlen: None, dropout, tuned })
    }

    /// Queues the backward kernels of a checked launch: dense ones, or with
    /// `launch.varlen` the varlen ones over packed operands (`io`'s layouts
    /// then [`PackedLayout::as_layout`](crate::PackedLayout::as_layout)'s).
    pub(crate) fn queue_backward<T: Element>(
        &self,
        spec: &Spec,
        io: BackwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
        launch: Launch,
    ) -> Result<(), Error> {
        let Launch { shape, scale, varlen, dropout, .. } = launch;
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let (config, tensor_maps, [pre, main, dq_pass]) = self.backward_kernels(spec, &io, opts, &launch)?;

        let (rows, accum) = workspace_sizes(spec, config, &launch);
        // No accumulator (a null pointer) in the deterministic mode, or without queries.
        let accum_len = if opts.deterministic { 0 } else { accum };
        let tickets = if binds_tickets(spec, config, &launch) { config.dq_accum(spec).tickets(accum_len) } else { 0 };
        // The accumulator starts 256 bytes aligned, as a fresh allocation
        // would: the dK/dV kernel adds to it with 16-byte vector or bulk reductions.
        let [delta_span, tickets_span] = [rows, tickets].map(|n| n.next_multiple_of(64));
        let mut kept = opts.workspace.map(|w| w.0.lock().unwrap_or_else(PoisonError::into_inner));
        let mut fresh = None;
        let slot = kept.as_deref_mut().unwrap_or(&mut fresh);
        let buffer = self.workspace_in(slot, (delta_span + tickets_span + accum_len).max(1))?;
        // The preprocess writes every row of D and zeroes the tickets, or
        // the accumulator where it has none.
        let (mut delta, mut rest) = buffer.split_at_mut(delta_span.min(buffer.len()));
        let (mut dq_tickets, mut rest) = rest.split_at_mut(tickets_span);
        let mut dq_accum = (accum_len > 0).then(|| rest.slice_mut(..accum_len));
        let BackwardIo { q, k, v, o, lse, d_o, dq, dk, dv, mut d_tensors } = io;
        let stream = self.stream();
        for t in d_tensors.iter_mut().flatten() {
            stream.memset_zeros(*t).map_err(|e| Error::driver("zeroing a tensor gradient", e))?;
        }

        // The guards order the launches after pending work on each buffer and
        // record them for later work; they must live until after the launches.
        let s = stream.as_ref();
        let (q_ptr, _q) = q.0.device_ptr(s);
        let (k_ptr, _k) = k.0.device_ptr(s);
        let (v_ptr, _v) = v.0.device_ptr(s);
        let (o_ptr, _o) = o.0.device_ptr(s);
        let (lse_ptr, _lse) = lse.device_ptr(s);
        let (do_ptr, _do) = d_o.0.device_ptr(s);
        let (dq_ptr, _dq) = dq.0.device_ptr_mut(s);
        let (dk_ptr, _dk) = dk.0.device_ptr_mut(s);
        let (dv_ptr, _dv) = dv.0.device_ptr_mut(s);
        let [q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, dk_ptr, dv_ptr] = [
            (q_ptr, &q.1),
            (k_ptr, &k.1),
            (v_ptr, &v.1),
            (o_ptr, &o.1),
            (do_ptr, &d_o.1),
            (dq_ptr, &dq.1),
            (dk_ptr, &dk.1),
            (dv_ptr, &dv.1),
        ]
        .map(|(p, l)| l.address(p));
        let (delta_ptr, _delta) = delta.device_ptr_mut(s);
        let accum = dq_accum.as_mut().map(|a| a.device_ptr_mut(s));
        let tickets = (tickets > 0).then(|| dq_tickets.device_ptr_mut(s));
        let grad_guards: Vec<_> = d_tensors.iter_mut().map(|t| t.as_mut().map(|t| t.device_ptr_mut(s))).collect();
        let mut tensor_grads: Vec<u64> = grad_guards.iter().map(|g| g.as_ref().map_or(0, |(ptr, _)| *ptr)).collect();
        tensor_grads.resize(spec.tensors.len(), 0);
        let (tensor_ptrs, _tensors) = tensor_ptrs(args, s);
        if let Some(mask) = opts.block_mask {
            mask.built_for.check_launch(spec, shape, &infos, &tensor_ptrs)?;
        }
        let block_mask = opts.block_mask.map(|m| (m.classes.device_ptr(s), m.strides));
        // Under a data-dependent mask the dK/dV kernel starts its longest CTAs first.
        let key_order = match opts.block_mask {
            Some(mask) if main.kernel().args.iter().any(|a| a.kind == ArgKind::WorkOrder) => {
                Some(mask.work_order(self, spec, Work::KeyTiles { block_n: main.kernel().block_n })?)
            }
            _ => None,
        };
        let key_order = key_order.as_ref().map(|order| order.device_ptr(s));
        // A persistent dK/dV kernel's CTAs claim their units from the work counter.
        let work_counter = self.work_counter_for(main.kernel(), s);
        let bindings = Bindings {
            ptrs: [q_ptr, k_ptr, v_ptr, o_ptr],
            strides: [q.1.strides, k.1.strides, v.1.strides, o.1.strides],
            lse: lse_ptr,
            scale,
            block_mask: block_mask.as_ref().map_or((0, [0; 2]), |((ptr, _), strides)| (*ptr, *strides)),
            work_order: key_order.as_ref().map_or(0, |(ptr, _)| *ptr),
            work_counter: work_counter.as_ref().map(|(ptr, _)| *ptr),
            tensor_maps,
            varlen,
            dropout,
            grads: Some(GradBindings {
                ptrs: [do_ptr, dq_ptr, dk_ptr, dv_ptr],
                strides: [d_o.1.strides, dq.1.strides, dk.1.strides, dv.1.strides],
                delta: delta_ptr,
                dq_accum: accum.as_ref().map_or(0, |(ptr, _)| *ptr),
                dq_tickets: tickets.as_ref().map_or(0, |(ptr, _)| *ptr),
                tensor_grads: &tensor_grads,
            }),
            ..Bindings::without_operands(shape, &infos, &tensor_ptrs)
        };
        // Stream waits queued by the guards report failures here, not below.
        self.context().check_err().map_err(|e| Error::driver("ordering the backward launches", e))?;
        let has_queries = shape.q_len > 0;
        if has_queries {
            self.launch_pass(&pre, &bindings)?;
        }
        if shape.kv_len > 0 {
            self.launch_pass(&main, &bindings)?;
        }
        if has_queries {
            self.launch_pass(&dq_pass, &bindings)?;
        }
        Ok(())
    }

    /// A launch's configuration, its TMA descriptors (dense launches where
    /// TMA can address the operands) and its three kernels, loaded together.
    fn backward_kernels<T: Element>(
        &self,
        spec: &Spec,
        io: &BackwardIo<'_, T>,
        opts: &BackwardOptions<'_>,
        launch: &Launch,
    ) -> Result<LaunchKernels, Error> {
        // Tensor gradients nobody asked for are not computed at all. A spec
        // with nothing to train has one dK/dV kernel either way: it is keyed
        // as `Runtime::prepare` and `precompile` compile it.
        let tensor_grads = io.d_tensors.iter().any(Option::is_some) || trainable_tensors(spec).is_empty();
        let chosen = match (opts.tile, launch.tuned) {
            (None, Some(tuned)) => BackwardConfig::preferred(spec, self.target()).with_tile(tuned),
            (None, None) => BackwardConfig::preferred_for(spec, self.target(), launch.shape.q_len),
            (tile, _) => chosen_config(spec, self.arch(), tile)?,
        };
        let config = BackwardConfig { tensor_grads, ..chosen }.with_dropout(spec, launch.dropout.is_some());
        // A varlen launch's descriptors are ragged: no box crosses a sequence's end.
        let rows = match launch.varlen {
            None => tma::Rows::Batched,
            Some(_) => tma::Rows::Ragged,
        };
        let (config, tensor_maps) = io.with_copies(self, spec, config, rows);
        let dq_pass = if opts.deterministic { BackwardPass::Query } else { BackwardPass::Postprocess };
        let passes = [BackwardPass::Preprocess, BackwardPass::KeyValue, dq_pass].map(|pass| launch.which(pass, config));
        let key_order =
            opts.block_mask.and_then(|_| Which::work_order(spec, Work::KeyTiles { block_n: config.block_n(spec) }));
        let [pre, main, dq_pass] = self.load_launch(spec, passes, key_order);
        Ok((config, tensor_maps, [pre?, main?, dq_pass?]))
    }

    /// The workspace in `slot` if it holds `len` floats on this device, else
    /// a fresh one in its place.
    fn workspace_in<'s>(
        &self,
        slot: &'s mut Option<CudaSlice<f32>>,
        len: usize,
    ) -> Result<&'s mut CudaSlice<f32>, Error> {
        let buffer = match slot.take() {
            Some(b) if b.len() >= len && Arc::ptr_eq(b.context(), self.context()) => b,
            old => {
                // Freed (after the work queued on it) before its successor
                // is allocated, so the pool can reuse the memory.
                drop(old);
                scratch::zeros::<f32>(self.stream(), len)?
            }
        };
        Ok(slot.insert(buffer))
    }

    fn launch_pass(&self, loaded: &LoadedKernel, bindings: &Bindings) -> Result<(), Error> {
        let kernel = loaded.kernel();
        let values = marshal(kernel, bindings)?;
        let config = launch_config(kernel, &bindings.shape, 1, self.sm_count())?;
        // SAFETY: `marshal` followed the kernel's own argument list, so the
        // values match its parameters in order and type; `check_backward`
        // proved every operand's layout inside its buffer, the workspace and
        // tensor gradients were sized from the checked shape and declarations,
        // and a block mask was checked to be built for this launch.
        unsafe { launch(self.stream(), loaded.function(), &values, config) }
            .map_err(|e| Error::driver(format!("launching `{}`", kernel.name), e))
    }
}

/// The configuration of `spec`'s backward on `arch`: the preferred one, its
/// dK/dV kernel in `tile` where a launch asks for one of the spec's tiles.
fn chosen_config(spec: &Spec, arch: Arch, tile: Option<BackwardTile>) -> Result<BackwardConfig, Error> {
    let preferred = BackwardConfig::preferred(spec, arch.target());
    match tile {
        None => Ok(preferred),
        Some(tile) if BackwardConfig::tiles(spec, arch.target()).contains(&tile) => Ok(preferred.with_tile(tile)),
        Some(tile) => Err(Error::NotACandidate { config: tile.to_string(), spec: spec.name.clone(), arch }),
    }
}

/// The most keys per query at which the dK/dV kernel takes its dQ
/// accumulator's tickets (`DqAccum::tickets`): they save the preprocess its
/// zeroing, a fixed cost per query, and cost the dK/dV kernel a small
/// share of its time (the CTAs waiting for a step's first store), which
/// grows with the keys, so past this length they no longer pay.
const TICKET_KEYS: usize = 4096;

/// Whether `launch` binds the dQ accumulator's tickets: where its kernels
/// take them (`DqAccum::has_tickets`), up to [`TICKET_KEYS`] keys.
fn binds_tickets(spec: &Spec, config: BackwardConfig, launch: &Launch) -> bool {
    // `kv_len`: a varlen launch's longest sequence.
    launch.shape.kv_len <= TICKET_KEYS && config.dq_accum(spec).has_tickets(spec)
}

/// Rows of D (per batch row, head and query; varlen: per head and packed
/// query) and f32 elements of the dQ accumulator of `launch` in `config`.
fn workspace_sizes(spec: &Spec, config: BackwardConfig, launch: &Launch) -> (usize, usize) {
    let (shape, accum) = (launch.shape, config.dq_accum(spec));
    match launch.varlen {
        None => (shape.batch * shape.heads * shape.q_len, accum.len(spec, shape.batch * shape.heads, shape.q_len)),
        Some(v) => {
            let total_q = v.tokens[0];
            (shape.heads * total_q, accum.varlen_len(spec, shape.heads, total_q, shape.batch))
        }
    }
}

/// Each requested tensor gradient belongs to a tensor that has one, and its
/// buffer holds the tensor's element count.
pub(crate) fn check_tensor_grads(
    spec: &Spec,
    shape: Option<Shape>,
    d_tensors: &[Option<&mut CudaSlice<f32>>],
    args: &[ArgInfo],
) -> Result<(), Error> {
    let lens: Vec<Option<usize>> = d_tensors.iter().map(|t| t.as_ref().map(|t| t.len())).collect();
    check_tensor_grad_lens(spec, shape, &lens, args)
}

fn check_tensor_grad_lens(
    spec: &Spec,
    shape: Option<Shape>,
    lens: &[Option<usize>],
    args: &[ArgInfo],
) -> Result<(), Error> {
    if lens.len() > spec.tensors.len() {
        return Err(Error::TensorGradCount { declared: spec.tensors.len(), got: lens.len() });
    }
    let trainable = trainable_tensors(spec);
    for (slot, len) in lens.iter().enumerate() {
        let Some(len) = *len else { continue };
        let tensor = bound(&spec.tensors[slot], args);
        if !trainable.contains(&slot) {
            return Err(Error::NoTensorGrad { tensor: tensor.name.clone() });
        }
        if let Some(shape) = shape {
            let needed = tensor.len(&shape);
            if len < needed {
                return Err(Error::TensorTooSmall { name: format!("d_{}", tensor.name), len, needed });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen_codegen::parse_one;

    #[test]
    fn tensor_gradients_are_checked() {
        let spec = parse_one(
            "S { dtype: bf16, head_dim: 64, tensor slopes: f32[H], tensor doc: i32[B, KV_LEN], \
             mask: doc[b][q] == doc[b][k], score: score + slopes[h] }",
        )
        .unwrap();
        let shape = Some(Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 10, kv_len: 20 });
        check_tensor_grad_lens(&spec, shape, &[Some(4)], &[]).unwrap();
        check_tensor_grad_lens(&spec, shape, &[None, None], &[]).unwrap();
        let err = check_tensor_grad_lens(&spec, shape, &[Some(3)], &[]).unwrap_err();
        assert!(matches!(&err, Error::TensorTooSmall { name, len: 3, needed: 4 } if name == "d_slopes"), "{err}");
        let err = check_tensor_grad_lens(&spec, shape, &[None, Some(40)], &[]).unwrap_err();
        assert!(matches!(&err, Error::NoTensorGrad { tensor } if tensor == "doc"), "{err}");
        let err = check_tensor_grad_lens(&spec, shape, &[None, None, None], &[]).unwrap_err();
        assert!(matches!(err, Error::TensorGradCount { declared: 2, got: 3 }), "{err}");
    }

    /// Tickets replace the accumulator's zeroing up to TICKET_KEYS keys,
    /// and never under a mask that reads a tensor.
    #[test]
    fn tickets_stand_for_zeroing_on_short_analytic_launches() {
        let launch = |kv_len| Launch {
            shape: Shape { batch: 1, heads: 2, heads_kv: 2, q_len: 1024, kv_len },
            scale: 1.0,
            varlen: None,
            dropout: None,
            tuned: None,
        };
        let causal = parse_one("C { dtype: bf16, head_dim: 128, mask: q >= k }").unwrap();
        let documents =
            parse_one("D { dtype: bf16, head_dim: 128, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }")
                .unwrap();
        let hopper = |spec| BackwardConfig::preferred(spec, Arch::new(9, 0).target());
        let binds = |spec, kv_len| binds_tickets(spec, hopper(spec), &launch(kv_len));
        assert!(binds(&causal, 1024) && binds(&causal, TICKET_KEYS));
        assert!(!binds(&causal, TICKET_KEYS + 1) && !binds(&documents, 1024));
        let portable = BackwardConfig::preferred(&causal, Arch::new(8, 0).target());
        assert!(!binds_tickets(&causal, portable, &launch(1024)));
        // One ticket per 64-query tile of the accumulator.
        let accum = hopper(&causal).dq_accum(&causal);
        assert_eq!(accum.tickets(accum.len(&causal, 2, 1000)), 2 * 16);
    }

    /// A launch may pick any of the spec's dK/dV tiles; another is refused
    /// with the tile and the GPU named.
    #[test]
    fn a_backward_tile_must_be_one_of_the_specs() {
        use flashgen_codegen::cuda::{KeyColumns, Mma};
        let spec = parse_one("S { dtype: bf16, head_dim: 256, mask: q >= k }").unwrap();
        let hopper = Arch::new(9, 0);
        assert_eq!(chosen_config(&spec, hopper, None).unwrap(), BackwardConfig::preferred(&spec, hopper.target()));
        for tile in BackwardConfig::tiles(&spec, hopper.target()) {
            assert_eq!(chosen_config(&spec, hopper, Some(tile)).unwrap().tile(), tile);
        }
        // Hopper's whole-column kernel does not cover d = 256, nor does any tile fit 99 KiB at 64-query steps.
        let wgmma = BackwardTile { mma: Mma::Wgmma, warps: 8, columns: KeyColumns::Whole, block_m: 64 };
        let err = chosen_config(&spec, hopper, Some(wgmma)).unwrap_err();
        assert!(matches!(&err, Error::NotACandidate { arch, .. } if *arch == hopper), "{err}");
        assert!(err.to_string().contains("wgmma, 8 warps, whole columns, 64-query steps"), "{err}");
        let wide = BackwardTile { mma: Mma::Sync, warps: 8, columns: KeyColumns::Whole, block_m: 64 };
        assert!(chosen_config(&spec, Arch::new(8, 6), Some(wide)).is_err());
    }
}
