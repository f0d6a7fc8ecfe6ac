//! The persistent varlen forward's item order (`cuda::emit_varlen_order`):
//! its items with rows, longest first, written by a one-block kernel queued
//! on the forward's stream just before it, into scratch memory that the
//! stream frees after the forward. Its time counts as the forward's.

use crate::args::ArgInfo;
use crate::error::Error;
use crate::kernels::Which;
use crate::launch_checks::launch_bound;
use crate::marshal::{launch_config, Bindings, VarlenBindings};
use crate::runtime::Runtime;
use crate::scratch;
use cudarc::driver::{CudaSlice, DevicePtrMut};
use flashgen_codegen::abi::{ArgKind, Kernel};
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
        if !kernel.args.iter().any(|a| a.kind == ArgKind::WorkOrder) {
            return Ok(None);
        }
        let loaded = self.load_which(spec, Which::VarlenOrder(kernel.block_m, kernel.block_n))?;
        let [total_q, _] = sequences.tokens;
        let capacity =
            order_capacity(shape.batch, shape.heads, total_q as i32, shape.q_len as i32, kernel.block_m as i32);
        let stream = self.stream();
        // SAFETY: the order kernel writes the count, then every entry up to
        // it, and the forward reads no entry past the count.
        let mut order = unsafe { scratch::uninit::<i32>(stream, 1 + capacity)? };
        let grid = launch_config(loaded.kernel(), &shape, 1, self.sm_count())?;
        {
            // The guard orders the launch after the allocation and records it.
            let (order_ptr, _order) = order.device_ptr_mut(stream.as_ref());
            let base = Bindings::without_operands(shape, args, &[]);
            let bindings = Bindings { varlen: Some(sequences), work_order: order_ptr, ..base };
            // SAFETY: the kernel reads `batch + 1` entries of each prefix sum
            // (checked by `check_varlen`) and writes at most `1 + capacity`
            // entries of the order.
            unsafe { launch_bound(self, stream.as_ref(), &loaded, &bindings, grid)? };
        }
        Ok(Some(order))
    }
}
