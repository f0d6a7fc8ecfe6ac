//! What the checked launches share around their own checks: the options no
//! ragged (varlen, paged) kernel supports, the ragged forward's tile
//! configuration, and queuing a marshalled kernel once the stream waits its
//! buffers' guards queued have had their say.

use crate::args::{ArgInfo, ArgValue};
use crate::check::softmax_scale;
use crate::choices::Choice;
use crate::error::{Error, RaggedError};
use crate::kernels::LoadedKernel;
use crate::marshal::{launch, launch_inline, marshal, marshal_into, Bindings, Value, INLINE_ARGS};
use crate::runtime::Runtime;
use cudarc::driver::{CudaStream, DevicePtr, LaunchConfig, SyncOnDrop};
use flashgen_codegen::abi::{Grid, Kernel};
use flashgen_codegen::cuda::TileConfig;
use flashgen_codegen::{Dropout, Spec};

/// The softmax scale and the argument infos of a ragged launch (`launch`
/// names it in a dropout error), after refusing what no ragged kernel does:
/// dropout and a block mask ([`RaggedError::VarlenBlockMask`]). Checked in
/// this order, so the first problem is the one reported.
pub(crate) fn check_ragged_options(
    spec: &Spec,
    launch: &'static str,
    (scale, dropout, has_block_mask): (Option<f32>, Option<Dropout>, bool),
    args: &[ArgValue<'_>],
) -> Result<(f32, Vec<ArgInfo>), Error> {
    let scale = softmax_scale(spec, scale)?;
    crate::dropout::refuse(dropout, launch)?;
    if has_block_mask {
        return Err(Error::Ragged(RaggedError::VarlenBlockMask));
    }
    Ok((scale, args.iter().map(ArgValue::info).collect()))
}

impl Runtime {
    /// The work counter `kernel`'s CTAs claim their items from, for a
    /// persistent grid, with the guard that orders the launch after pending
    /// work on it (keep it until after the launch); `None` for other grids.
    pub(crate) fn work_counter_for<'s>(
        &'s self,
        kernel: &Kernel,
        stream: &'s CudaStream,
    ) -> Option<(u64, SyncOnDrop<'s>)> {
        matches!(kernel.grid, Grid::Persistent { .. } | Grid::KeyUnits).then(|| self.work_counter().device_ptr(stream))
    }

    /// A ragged forward's tile configuration: `config` where it is a
    /// candidate, else the preferred one for its longest sequence's
    /// `max_kv_len` keys (ragged launches do not autotune), remembered per
    /// spec: choosing weighs every candidate's shared memory, up to as long
    /// as the rest of a launch's host time for a union mask.
    pub(crate) fn ragged_config(
        &self,
        spec: &Spec,
        config: Option<TileConfig>,
        max_kv_len: usize,
    ) -> Result<TileConfig, Error> {
        if let Some(config) = config {
            return self.candidate(spec, config);
        }
        let class = crate::tile_choice::KeyClass::of(max_kv_len);
        let remembered = self.ragged_choices.get(spec, class).unwrap_or_else(|| {
            let config = crate::tile_choice::preferred_for(spec, self.target(), max_kv_len);
            self.ragged_choices.keep_first(spec, class, Choice { config, tuned: false })
        });
        Ok(remembered.config)
    }
}

/// Queues `loaded`'s kernel on `stream` with `values`; a failure, of the
/// launch or of a stream wait queued by the buffers' guards (reported by the
/// context, not where the wait was queued), is an error of launching it.
/// Up to [`INLINE_ARGS`] values go to the driver from the stack.
///
/// # Safety
/// As [`launch`]: `values` match the kernel's parameters (as `marshal`
/// makes them) and every address they let it touch is in bounds of a live
/// allocation.
pub(crate) unsafe fn launch_checked(
    rt: &Runtime,
    stream: &CudaStream,
    loaded: &LoadedKernel,
    values: &[Value],
    grid: LaunchConfig,
) -> Result<(), Error> {
    let launching = |e| Error::driver(format!("launching `{}`", loaded.kernel().name), e);
    rt.context().check_err().map_err(launching)?;
    // SAFETY: the caller's contract; `launch_inline` takes INLINE_ARGS values.
    match values.len() <= INLINE_ARGS {
        true => unsafe { launch_inline(stream, loaded.function(), values, grid) },
        false => unsafe { launch(stream, loaded.function(), values, grid) },
    }
    .map_err(launching)
}

/// Marshals `b` for `loaded`'s kernel (its own argument list) and queues
/// it ([`launch_checked`]), the values on the stack where they fit
/// [`INLINE_ARGS`]: a warm launch allocates nothing here.
///
/// # Safety
/// Every address `b` lets the kernel touch is in bounds of a live
/// allocation.
pub(crate) unsafe fn launch_bound(
    rt: &Runtime,
    stream: &CudaStream,
    loaded: &LoadedKernel,
    b: &Bindings,
    grid: LaunchConfig,
) -> Result<(), Error> {
    let kernel = loaded.kernel();
    if kernel.args.len() > INLINE_ARGS {
        // SAFETY: `marshal` follows the kernel's own argument list; the rest is the caller's.
        return unsafe { launch_checked(rt, stream, loaded, &marshal(kernel, b)?, grid) };
    }
    let mut values = [Value::I32(0); INLINE_ARGS];
    let count = marshal_into(kernel, b, &mut values)?;
    // SAFETY: as above, `marshal_into` having written the first `count` values.
    unsafe { launch_checked(rt, stream, loaded, &values[..count], grid) }
}
