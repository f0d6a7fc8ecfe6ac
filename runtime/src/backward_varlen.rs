//! The checked, asynchronous varlen (packed) backward launch: the gradients
//! of [`Runtime::forward_varlen`], queued as the dense backward's kernels in
//! their varlen form (`flashgen_codegen::cuda::emit_backward_varlen`).
//!
//! Workspace: D (`f32[heads, total_q]`, the LSE's layout) and, in the
//! atomic mode, the dQ accumulator (`f32[heads, total_q, head_dim]`, or the
//! Hopper kernel's 64-query tiles, whole tiles per sequence:
//! `DqAccum::varlen_len`), in the [`BackwardWorkspace`] or a fresh buffer
//! as for the dense backward.

use crate::args::ArgValue;
use crate::backward::{check_tensor_grads, BackwardIo, BackwardOptions, Launch};
use crate::check::{Buffer, Grads, Problem};
use crate::check_varlen::{check_varlen_backward, VarlenProblem};
use crate::element::Element;
use crate::error::Error;
use crate::forward_varlen::Sequences;
use crate::launch_checks::check_ragged_options;
use crate::layout::PackedLayout;
use crate::marshal::VarlenBindings;
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use cudarc::driver::CudaSlice;
use flashgen_codegen::Spec;

/// The operands of one varlen backward pass: the varlen forward's inputs,
/// its output O and LSE (`f32[heads, total_q]`, as [`crate::VarlenIo::lse`]
/// writes it), the incoming gradient dO (laid out like O), and the
/// gradients written: dQ, dK, dV (laid out like Q, K, V; tokens of no
/// sequence are left as they were) and, per declared tensor in declaration
/// order, an optional f32 buffer of the tensor's element count (sized by the
/// longest sequence, as the forward reads it) for its gradient
/// (overwritten; trailing tensors may be left out).
pub struct VarlenBackwardIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, PackedLayout),
    pub k: (&'a dyn DeviceInput<T>, PackedLayout),
    pub v: (&'a dyn DeviceInput<T>, PackedLayout),
    pub o: (&'a dyn DeviceInput<T>, PackedLayout),
    pub lse: &'a CudaSlice<f32>,
    pub d_o: (&'a dyn DeviceInput<T>, PackedLayout),
    pub dq: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    pub dk: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    pub dv: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    /// One per declared tensor: the f32 gradient of a trainable tensor, or
    /// `None` (see [`BackwardIo::d_tensors`]).
    pub d_tensors: Vec<Option<&'a mut CudaSlice<f32>>>,
    /// The sequences of the forward launch.
    pub seqs: Sequences<'a>,
}

impl Runtime {
    /// The backward of [`Runtime::forward_varlen`]: per sequence what
    /// [`Runtime::backward`] computes per batch row, with `b` the sequence
    /// and `q_len` / `kv_len` its lengths; a tensor's gradient sums over the
    /// sequences that read it.
    ///
    /// Checks sizes, strides, buffer lengths, the prefix sums' entry counts,
    /// the longest lengths, the LSE's `[heads, total_q]` and `args` against
    /// `spec` as [`Runtime::forward_varlen`] does, plus the gradient
    /// operands, then queues the kernels on [`Runtime::stream`] without
    /// waiting. `opts.block_mask` must be `None` ([`RaggedError::VarlenBlockMask`](crate::RaggedError::VarlenBlockMask));
    /// scale, the deterministic mode and the workspace work as in
    /// [`Runtime::backward`]. The Hopper dK/dV kernel copies with its threads.
    pub fn backward_varlen<T: Element>(
        &self,
        spec: &Spec,
        io: VarlenBackwardIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let options = (opts.scale, opts.dropout, opts.block_mask.is_some());
        let (scale, infos) = check_ragged_options(spec, "varlen", options, args)?;
        let VarlenBackwardIo { q, k, v, o, lse, d_o, dq, dk, dv, d_tensors, seqs } = io;
        let [q_l, k_l, v_l, o_l, do_l, dq_l, dk_l, dv_l] =
            [q.1, k.1, v.1, o.1, d_o.1, dq.1, dk.1, dv.1].map(|l| l.as_layout());
        let buffer = |layout, len| Buffer { layout, len };
        let problem = VarlenProblem {
            operands: Problem::new(
                T::DTYPE,
                [(q_l, q.0.len()), (k_l, k.0.len()), (v_l, v.0.len()), (o_l, o.0.len())],
                Some(lse.len()),
            ),
            batch: seqs.batch,
            cu_seqlens: [seqs.cu_seqlens_q.len(), seqs.cu_seqlens_k.len()],
            max_lens: [seqs.max_q_len, seqs.max_kv_len],
        };
        let grads = Grads {
            d_o: buffer(do_l, d_o.0.len()),
            dq: buffer(dq_l, dq.0.len()),
            dk: buffer(dk_l, dk.0.len()),
            dv: buffer(dv_l, dv.0.len()),
        };
        let checked = check_varlen_backward(spec, &problem, &grads, &infos)?;
        check_tensor_grads(spec, checked.map(|c| c.shape), &d_tensors, &infos)?;
        let Some(checked) = checked else {
            return Ok(());
        };
        // The guards order the launches after pending work on the prefix
        // sums; they must live until after the launches.
        let stream = self.stream().as_ref();
        let (cu_q, _cu_q) = seqs.cu_seqlens_q.device_ptr(stream);
        let (cu_k, _cu_k) = seqs.cu_seqlens_k.device_ptr(stream);
        let varlen = Some(VarlenBindings { cu_seqlens: [cu_q, cu_k], tokens: checked.tokens });
        // The packed operands as the one batch row of tokens they are to the
        // dense machinery; the varlen kernels take only their token and head
        // strides.
        let io = BackwardIo {
            q: (q.0, q_l),
            k: (k.0, k_l),
            v: (v.0, v_l),
            o: (o.0, o_l),
            lse,
            d_o: (d_o.0, do_l),
            dq: (dq.0, dq_l),
            dk: (dk.0, dk_l),
            dv: (dv.0, dv_l),
            d_tensors,
        };
        self.queue_backward(
            spec,
            io,
            args,
            opts,
            Launch { shape: checked.shape, scale, varlen, dropout: None, tuned: None },
        )
    }
}
