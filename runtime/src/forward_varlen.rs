//! The checked, asynchronous varlen (packed) forward launch: Q, K, V and O
//! hold the tokens of all sequences back to back, split into sequences by
//! prefix sums on the device.

use crate::args::{tensor_ptrs, ArgValue};
use crate::check::Problem;
use crate::check_varlen::{check_varlen, VarlenProblem};
use crate::element::Element;
use crate::error::Error;
use crate::forward_launch::ForwardOptions;
use crate::kernels::Which;
use crate::launch_checks::{check_ragged_options, launch_checked};
use crate::layout::PackedLayout;
use crate::marshal::{launch_config, marshal, Bindings, VarlenBindings};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::runtime::Runtime;
use crate::tma::{copy_with, ragged_forward_maps};
use cudarc::driver::{CudaSlice, DevicePtrMut};
use flashgen_codegen::Spec;

/// The operands of one varlen forward pass. O and the optional row
/// log-sum-exp are written; the LSE is `f32[heads, total_q]` (row `t` of
/// head `h` at `h · total_q + t`, FlashAttention's varlen layout), where
/// `total_q` is Q's token count. Tokens of no sequence (past
/// `cu_seqlens_q[batch]`) are left as they were in O and the LSE.
pub struct VarlenIo<'a, T> {
    pub q: (&'a dyn DeviceInput<T>, PackedLayout),
    pub k: (&'a dyn DeviceInput<T>, PackedLayout),
    pub v: (&'a dyn DeviceInput<T>, PackedLayout),
    pub o: (&'a mut dyn DeviceOutput<T>, PackedLayout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    pub seqs: Sequences<'a>,
}

/// How the packed tokens split into sequences. Sequence `b`'s queries are
/// Q's tokens `cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`, its keys K's
/// `cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`. The prefix sums stay on the
/// device and are not read by the host: the kernels clamp each sequence into
/// the buffers, so prefix sums that are not monotone, leave the buffers or
/// exceed the longest lengths give wrong rows, never an access out of
/// bounds (a sequence longer than its `max_*` is cut there).
pub struct Sequences<'a> {
    /// Number of sequences.
    pub batch: usize,
    /// `i32[batch + 1]` prefix sums of the sequences' query counts.
    pub cu_seqlens_q: &'a dyn DeviceInput<i32>,
    /// `i32[batch + 1]` prefix sums of the sequences' key counts.
    pub cu_seqlens_k: &'a dyn DeviceInput<i32>,
    /// The longest sequence's queries: the grid covers its query tiles for
    /// every sequence, and a spec tensor's `Q_LEN` dim is this.
    pub max_q_len: usize,
    /// The longest sequence's keys (a spec tensor's `KV_LEN` dim).
    pub max_kv_len: usize,
}

impl Runtime {
    /// Attention over packed sequences: in `spec`, `b` is the sequence, `q`
    /// and `k` are positions inside it and `q_len` / `kv_len` its own
    /// lengths, so every mask and score means per sequence what it means
    /// per batch row in [`Runtime::forward`]. Captured tensors are sized by
    /// the longest lengths (`doc: i32[B, KV_LEN]` holds `batch ·
    /// max_kv_len` elements, sequence b's row padded).
    ///
    /// Checks sizes, strides, buffer lengths, the prefix sums' entry counts,
    /// the longest lengths and `args` against `spec`, then queues the kernel
    /// on [`Runtime::stream`] without waiting. Runs in `opts.config` (a
    /// candidate) or [`tile_choice::preferred_for`](crate::tile_choice::preferred_for)
    /// `max_kv_len` keys; no autotuning, and no block mask (`opts.block_mask`
    /// must be `None`: [`RaggedError::VarlenBlockMask`](crate::RaggedError::VarlenBlockMask)). Warp-specialized kernels
    /// copy with TMA where it can address every operand, through ragged
    /// descriptors that end each box at its sequence's end.
    pub fn forward_varlen<T: Element>(
        &self,
        spec: &Spec,
        io: VarlenIo<'_, T>,
        args: &[ArgValue<'_>],
        opts: &ForwardOptions<'_>,
    ) -> Result<(), Error> {
        let options = (opts.scale, opts.dropout, opts.block_mask.is_some());
        let (scale, infos) = check_ragged_options(spec, "varlen", options, args)?;
        let VarlenIo { q, k, v, o, lse, seqs } = io;
        let layouts = [q.1, k.1, v.1, o.1].map(|l| l.as_layout());
        let lens = [q.0.len(), k.0.len(), v.0.len(), o.0.len()];
        let problem = VarlenProblem {
            operands: Problem::new(
                T::DTYPE,
                [0, 1, 2, 3].map(|i| (layouts[i], lens[i])),
                lse.as_ref().map(|l| l.len()),
            ),
            batch: seqs.batch,
            cu_seqlens: [seqs.cu_seqlens_q.len(), seqs.cu_seqlens_k.len()],
            max_lens: [seqs.max_q_len, seqs.max_kv_len],
        };
        let Some(checked) = check_varlen(spec, &problem, &infos)? else {
            return Ok(());
        };
        let config = self.ragged_config(spec, opts.config, seqs.max_kv_len)?;

        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after the launch.
        let stream = self.stream().as_ref();
        let (q_ptr, _q) = q.0.device_ptr(stream);
        let (k_ptr, _k) = k.0.device_ptr(stream);
        let (v_ptr, _v) = v.0.device_ptr(stream);
        let (o_ptr, _o) = o.0.device_ptr_mut(stream);
        let (cu_q, _cu_q) = seqs.cu_seqlens_q.device_ptr(stream);
        let (cu_k, _cu_k) = seqs.cu_seqlens_k.device_ptr(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let (tensor_ptrs, _tensors) = tensor_ptrs(args, stream);
        let ptrs = [q_ptr, k_ptr, v_ptr, o_ptr];
        let operands = [0, 1, 2, 3].map(|i| (layouts[i].address(ptrs[i]), &layouts[i]));
        let tensor_maps = ragged_forward_maps(config, operands, config.block_n, spec.dtype, self.tma);
        let loaded =
            self.load_which(spec, Which::ForwardVarlen(config, config.kernel_copy(copy_with(&tensor_maps))))?;
        let kernel = loaded.kernel();
        let grid = launch_config(kernel, &checked.shape, 1, self.sm_count())?;
        let work_counter = self.work_counter_for(kernel, stream);
        let values = marshal(
            kernel,
            &Bindings {
                work_counter: work_counter.as_ref().map(|(ptr, _)| *ptr),
                tensor_maps,
                varlen: Some(VarlenBindings { cu_seqlens: [cu_q, cu_k], tokens: checked.tokens }),
                ..Bindings::without_operands(checked.shape, &infos, &tensor_ptrs).with_operands(
                    ptrs,
                    layouts,
                    lse.as_ref().map_or(0, |(ptr, _)| *ptr),
                    scale,
                )
            },
        )?;

        // SAFETY: `marshal` followed the kernel's own argument list, so the
        // values match its parameters in order and type; `check_varlen`
        // proved every token the layouts address is inside its buffer, the
        // prefix sums hold batch + 1 entries, and the kernel clamps every
        // sequence they describe into the tokens (`seq_span`).
        unsafe { launch_checked(self, stream, &loaded, &values, grid) }
    }
}
