//! The persistent varlen forward's item order (`cuda::emit_varlen_order`):
//! its items with rows, longest first, written by a one-block kernel queued
//! on the forward's stream just before it, into scratch memory that the
//! stream frees after the forward. Its time counts as the forward's.

use crate::args::{ArgInfo, ArgValue};
use crate::check_varlen::{check_sequences, VarlenShape};
use crate::error::Error;
use crate::forward_varlen::Sequences;
use crate::kernels::Which;
use crate::launch_checks::launch_bound;
use crate::marshal::{launch_config, Bindings, VarlenBindings};
use crate::runtime::Runtime;
use crate::scratch;
use cudarc::driver::{CudaSlice, DevicePtrMut};
use flashgen_codegen::abi::{ArgKind, Kernel};
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::varlen::order_capacity;
use flashgen_codegen::{Shape, Spec};

impl Runtime {
    /// Queues the item order of a varlen forward `kernel` of `spec` over
    /// `shape` (the longest lengths) and `sequences`, with the params in
    /// `args`; `None` where the kernel claims from no order (it is not
    /// persistent). The order must live until the forward is queued.
    pub(crate) fn varlen_item_order(
        &self,
        spec: &Spec,
        kernel: &Kernel,
        shape: Shape,
        sequences: VarlenBindings,
        args: &[ArgInfo],
    ) -> Result<Option<CudaSlice<i32>>, Error> {
        match kernel.args.iter().any(|a| a.kind == ArgKind::WorkOrder) {
            true => self.queue_item_order(spec, (kernel.block_m, kernel.block_n), shape, sequences, args).map(Some),
            false => Ok(None),
        }
    }

    /// The item order the persistent varlen forward in `config` claims
    /// from for the sequences `seqs` over buffers of `tokens` tokens (Q's,
    /// K's) and `heads` heads (query, K/V), checked as a launch's sequences
    /// are, copied to the host (for inspection and tests): the number of
    /// listed items, then their indices (`flashgen_codegen::varlen::
    /// decode_item`). `flashgen_codegen::varlen::item_order` is its CPU
    /// twin.
    pub fn varlen_item_order_host(
        &self,
        spec: &Spec,
        config: TileConfig,
        seqs: &Sequences<'_>,
        (tokens, heads): ([usize; 2], [usize; 2]),
        args: &[ArgValue<'_>],
    ) -> Result<Vec<i32>, Error> {
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let counts =
            (seqs.batch, [seqs.cu_seqlens_q.len(), seqs.cu_seqlens_k.len()], [seqs.max_q_len, seqs.max_kv_len]);
        let VarlenShape { shape, tokens } = check_sequences(spec, counts, tokens, heads, &infos)?;
        // The forward decodes items in 31 bits (`launch_config` refuses more).
        let items = shape.q_len.div_ceil(config.block_m() as usize) as u64 * (shape.heads * shape.batch) as u64;
        if items > i32::MAX as u64 {
            let (what, max) = ("work items (query tiles × heads × batch)", i32::MAX as usize);
            return Err(Error::TooLarge { what, value: items as usize, max });
        }
        let stream = self.stream().as_ref();
        let (cu_q, _cu_q) = seqs.cu_seqlens_q.device_ptr(stream);
        let (cu_k, _cu_k) = seqs.cu_seqlens_k.device_ptr(stream);
        let sequences = VarlenBindings { cu_seqlens: [cu_q, cu_k], tokens };
        let order = self.queue_item_order(spec, (config.block_m(), config.block_n), shape, sequences, &infos)?;
        self.stream().clone_dtoh(&order).map_err(|e| Error::driver("reading an item order", e))
    }

    /// Queues the order kernel for tiles of `(block_m, block_n)`.
    fn queue_item_order(
        &self,
        spec: &Spec,
        (block_m, block_n): (u32, u32),
        shape: Shape,
        sequences: VarlenBindings,
        args: &[ArgInfo],
    ) -> Result<CudaSlice<i32>, Error> {
        let loaded = self.load_which(spec, Which::VarlenOrder(block_m, block_n))?;
        let [total_q, _] = sequences.tokens;
        let capacity = order_capacity(shape.batch, shape.heads, total_q as i32, shape.q_len as i32, block_m as i32);
        let stream = self.stream();
        // SAFETY: the order kernel writes the count, then every entry up to
        // it, and nothing reads an entry past the count.
        let mut order = unsafe { scratch::uninit::<i32>(stream, 1 + capacity)? };
        let grid = launch_config(loaded.kernel(), &shape, 1, self.sm_count())?;
        {
            // The guard orders the launch after the allocation and records it.
            let (order_ptr, _order) = order.device_ptr_mut(stream.as_ref());
            let base = Bindings::without_operands(shape, args, &[]);
            let bindings = Bindings { varlen: Some(sequences), work_order: order_ptr, ..base };
            // SAFETY: the kernel reads `batch + 1` entries of each prefix sum
            // (checked by `check_sequences`) and writes at most `1 + capacity`
            // entries of the order.
            unsafe { launch_bound(self, stream.as_ref(), &loaded, &bindings, grid)? };
        }
        Ok(order)
    }
}
