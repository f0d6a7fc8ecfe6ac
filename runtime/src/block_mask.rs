//! Block masks: exact per-tile classes of a data-dependent mask, built on
//! the GPU once and reused by every forward launch with the same inputs
//! (FlexAttention's `BlockMask`, derived from the spec instead of written by
//! hand).
//!
//! A mask the interval analysis can bound needs none: the forward kernel
//! classifies such tiles itself. A mask that reads captured tensors (document
//! ids) or floats is only bounded by evaluating it, which is what the
//! block-mask kernel does, one thread block per tile.

use crate::args::{tensor_ptrs, ArgInfo, ArgValue};
use crate::check::{check_shape, MAX_GRID_YZ};
use crate::error::Error;
use crate::kernels::Which;
use crate::marshal::{launch, launch_config, marshal, Bindings};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use flashgen_codegen::abi::{ArgKind, Kernel};
use flashgen_codegen::cuda::{TileConfig, Work};
use flashgen_codegen::{Builtin, Shape, Spec};
use std::sync::{Arc, Mutex, PoisonError};

/// Tile classes of one spec's mask for one shape and one set of params and
/// tensors: `u8[batch', heads', q_tiles, kv_tiles]`, 0 = no pair kept,
/// 1 = some, 2 = all; batch' and heads' are 1 where the mask ignores `b` or
/// `h`. Rebuild it when a tensor it read changes.
pub struct BlockMask {
    pub(crate) classes: CudaSlice<u8>,
    /// Element strides of the batch and head axes (0 when broadcast).
    pub(crate) strides: [i64; 2],
    pub(crate) built_for: BuiltFor,
    /// Work orders under this mask (`ArgKind::WorkOrder`), each made by the
    /// first launch that needs it, then kept.
    work_orders: Mutex<Vec<(Work, Arc<CudaSlice<i32>>)>>,
}

/// What a block mask is valid for; a forward launch must match it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct BuiltFor {
    pub spec: Spec,
    pub shape: Shape,
    pub tile: (u32, u32),
    pub args: Vec<ArgInfo>,
    pub tensors: Vec<u64>,
}

impl BuiltFor {
    /// For launches of `spec`. Every forward tile configuration reads block
    /// masks at the spec's mask tile.
    pub fn new(spec: &Spec, shape: Shape, args: &[ArgInfo], tensors: &[u64]) -> BuiltFor {
        let tile = TileConfig::mask_tile(spec);
        BuiltFor { spec: spec.clone(), shape, tile, args: args.to_vec(), tensors: tensors.to_vec() }
    }

    /// Whether a mask built for `self` serves a launch of `spec` at `shape`
    /// with `args` and `tensors`: only one built for exactly that launch
    /// does. Compared in place ([`Spec::same_structure`]), allocating nothing.
    pub fn check_launch(&self, spec: &Spec, shape: Shape, args: &[ArgInfo], tensors: &[u64]) -> Result<(), Error> {
        let what = if !self.spec.same_structure(spec) {
            "spec"
        } else if self.shape != shape {
            "shape"
        } else if self.tile != TileConfig::mask_tile(spec) {
            "tile size"
        } else if self.args != args || self.tensors != tensors {
            "params or tensors"
        } else {
            return Ok(());
        };
        Err(Error::BlockMaskMismatch { what })
    }
}

impl BlockMask {
    /// `(q_tiles, kv_tiles)` per (batch, head) slice.
    pub fn tiles(&self) -> (usize, usize) {
        let Shape { q_len, kv_len, .. } = self.built_for.shape;
        let (bm, bn) = self.built_for.tile;
        (q_len.div_ceil(bm as usize), kv_len.div_ceil(bn as usize))
    }

    /// The classes, copied to the host (for inspection and tests).
    pub fn classes(&self, rt: &Runtime) -> Result<Vec<u8>, Error> {
        rt.stream().clone_dtoh(&self.classes).map_err(|e| Error::driver("reading a block mask", e))
    }

    /// `spec`'s `work` under this mask in its work order (longest first
    /// within windows of heads, see `flashgen_codegen::cuda::emit_work_order`):
    /// queued on `rt`'s stream the first time, then kept.
    /// What a forward launch of `kernel` (a persistent one claims its
    /// longest items first under a data-dependent mask) binds of this mask
    /// beside its classes: checked against the launch's `shape`, `args` and
    /// `tensors` first, the item order where the kernel takes one.
    pub(crate) fn for_forward(
        &self,
        rt: &Runtime,
        spec: &Spec,
        kernel: &Kernel,
        (shape, args, tensors): (Shape, &[ArgInfo], &[u64]),
    ) -> Result<Option<Arc<CudaSlice<i32>>>, Error> {
        self.built_for.check_launch(spec, shape, args, tensors)?;
        match kernel.args.iter().any(|a| a.kind == ArgKind::WorkOrder) {
            true => self.work_order(rt, spec, Work::QueryTiles { block_m: kernel.block_m }).map(Some),
            false => Ok(None),
        }
    }

    pub(crate) fn work_order(&self, rt: &Runtime, spec: &Spec, work: Work) -> Result<Arc<CudaSlice<i32>>, Error> {
        let mut orders = self.work_orders.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, order)) = orders.iter().find(|(made_for, _)| *made_for == work) {
            return Ok(Arc::clone(order));
        }
        let loaded = rt.load_which(spec, Which::WorkOrder(work))?;
        let shape = self.built_for.shape;
        let units = match work {
            Work::KeyTiles { block_n } => shape.batch * shape.heads_kv * shape.kv_len.div_ceil(block_n as usize),
            Work::QueryTiles { block_m } => shape.batch * shape.heads * shape.q_len.div_ceil(block_m as usize),
        };
        let stream = rt.stream();
        // The order, then as many words of scratch.
        let mut order =
            stream.alloc_zeros::<i32>((2 * units).max(1)).map_err(|e| Error::driver("allocating a work order", e))?;
        if units > 0 {
            let s = stream.as_ref();
            let (out, _out) = order.device_ptr_mut(s);
            let (classes, _classes) = self.classes.device_ptr(s);
            let kernel = loaded.kernel();
            let values = marshal(
                kernel,
                &Bindings {
                    block_mask: (classes, self.strides),
                    work_order: out,
                    ..Bindings::without_operands(shape, &self.built_for.args, &self.built_for.tensors)
                },
            )?;
            let config = launch_config(kernel, &shape, 1, rt.sm_count())?;
            // SAFETY: `marshal` followed the kernel's argument list; the kernel
            // reads the classes within the shape the mask was built for and
            // writes 2 * units words of `order`.
            unsafe { launch(s, loaded.function(), &values, config) }
                .map_err(|e| Error::driver(format!("launching `{}`", kernel.name), e))?;
        }
        let order = Arc::new(order);
        orders.push((work, Arc::clone(&order)));
        Ok(order)
    }

    /// `spec`'s `work` order under this mask, made if no launch has made it
    /// yet, copied to the host (for inspection and tests): the units in the
    /// order the kernel walks them, then each unit's count of visited mask
    /// tiles. `spec` must be the one the mask was built for.
    pub fn work_order_host(&self, rt: &Runtime, spec: &Spec, work: Work) -> Result<Vec<i32>, Error> {
        if !self.built_for.spec.same_structure(spec) {
            return Err(Error::BlockMaskMismatch { what: "spec" });
        }
        if !spec.mask.as_ref().is_some_and(|mask| mask.reads_tensor()) {
            return Err(Error::NoWorkOrder { spec: spec.name.clone() });
        }
        let order = self.work_order(rt, spec, work)?;
        rt.stream().clone_dtoh(order.as_ref()).map_err(|e| Error::driver("reading a work order", e))
    }
}

/// A block mask's classes for a launch: `slices` (batch', heads') slices
/// of `tiles` (`q_tiles · kv_tiles` mask tiles), the element strides of its
/// batch and head axes (0 where broadcast) and the buffer's length (at
/// least 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MaskLayout {
    pub slices: usize,
    pub tiles: usize,
    pub strides: [i64; 2],
    pub len: usize,
}

/// What [`Runtime::block_mask`] checks before it builds: a mask to build,
/// the launch's shape and `args` as a forward checks them, and a grid
/// of slices and query tiles CUDA can launch. Returns the classes' layout
/// at the spec's mask tile ([`TileConfig::mask_tile`], the build kernel's).
pub(crate) fn check_block_mask(spec: &Spec, shape: &Shape, args: &[ArgInfo]) -> Result<MaskLayout, Error> {
    let mask = spec.mask.as_ref().ok_or_else(|| Error::NoMask { spec: spec.name.clone() })?;
    check_shape(spec, shape, args)?;
    let (block_m, block_n) = TileConfig::mask_tile(spec);
    let (q_tiles, kv_tiles) = (shape.q_len.div_ceil(block_m as usize), shape.kv_len.div_ceil(block_n as usize));
    let heads = if mask.uses(Builtin::H) { shape.heads } else { 1 };
    let batches = if mask.uses(Builtin::B) { shape.batch } else { 1 };
    // Within check_shape's limits none of these products overflows.
    let (slices, tiles) = (batches * heads, q_tiles * kv_tiles);
    if slices > MAX_GRID_YZ || q_tiles > MAX_GRID_YZ {
        let value = slices.max(q_tiles);
        return Err(Error::TooLarge { what: "block mask slices or query tiles", value, max: MAX_GRID_YZ });
    }
    let stride = |used: bool, n: usize| if used { n as i64 } else { 0 };
    let strides = [stride(batches > 1, heads * tiles), stride(heads > 1, tiles)];
    Ok(MaskLayout { slices, tiles, strides, len: (slices * tiles).max(1) })
}

impl Runtime {
    /// Builds the block mask of `spec` for launches of `shape` with these
    /// params and tensors (`args`, as for [`Runtime::forward`]). Asynchronous
    /// on [`Runtime::stream`], like a launch.
    pub fn block_mask(&self, spec: &Spec, shape: Shape, args: &[ArgValue<'_>]) -> Result<BlockMask, Error> {
        let infos: Vec<ArgInfo> = args.iter().map(ArgValue::info).collect();
        let MaskLayout { slices, tiles, strides, len } = check_block_mask(spec, &shape, &infos)?;
        let loaded = self.load_which(spec, Which::BlockMask)?;
        let kernel = loaded.kernel();
        debug_assert_eq!((kernel.block_m, kernel.block_n), TileConfig::mask_tile(spec));
        let stream = self.stream().as_ref();
        let mut classes =
            self.stream().alloc_zeros::<u8>(len).map_err(|e| Error::driver("allocating a block mask", e))?;
        let (tensor_ptrs, _tensors) = tensor_ptrs(args, stream);
        let built_for = BuiltFor::new(spec, shape, &infos, &tensor_ptrs);
        if tiles > 0 && shape.batch > 0 {
            let (out, _guard) = classes.device_ptr_mut(stream);
            let values = marshal(
                kernel,
                &Bindings { block_mask_out: out, ..Bindings::without_operands(shape, &infos, &tensor_ptrs) },
            )?;
            let config = launch_config(kernel, &shape, slices, self.sm_count())?;
            // SAFETY: `marshal` followed the kernel's argument list; the grid
            // is exactly (kv_tiles, q_tiles, slices) and `classes` holds one
            // byte per tile of it; tensor sizes were checked by `check_shape`.
            unsafe { launch(stream, loaded.function(), &values, config) }
                .map_err(|e| Error::driver(format!("launching `{}`", kernel.name), e))?;
        }
        Ok(BlockMask { classes, strides, built_for, work_orders: Mutex::new(Vec::new()) })
    }
}
