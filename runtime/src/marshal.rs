//! Kernel argument values and launch geometry, derived from the kernel's ABI
//! description ([`Kernel::args`]) so the argument order lives only in the
//! code generator.

use crate::args::ArgInfo;
use crate::error::Error;
use crate::layout::Layout;
use crate::tma::{TensorMap, TensorMaps};
use cudarc::driver::{CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use flashgen_codegen::abi::{ArgKind, Axis, DropoutArg, Grid, Kernel, KernelArg, Operand, Partial, Side};
use flashgen_codegen::{Dropout, Shape};
use std::ffi::c_void;

/// One kernel argument, by value, with the C type the ABI gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Value {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
    TensorMap(TensorMap),
}

/// Everything a kernel argument can carry, for one checked launch.
pub(crate) struct Bindings<'a> {
    /// Sizes checked to fit i32.
    pub shape: Shape,
    /// Device addresses of Q, K, V, O.
    pub ptrs: [u64; 4],
    /// Batch, seq and head strides of Q, K, V, O.
    pub strides: [[i64; 3]; 4],
    /// The LSE output's address, or 0 (null) for none.
    pub lse: u64,
    pub scale: f32,
    /// The checked launch arguments (params read their values here).
    pub args: &'a [ArgInfo],
    /// Device addresses of the captured tensors.
    pub tensors: &'a [u64],
    /// A built block mask's address (0: none) and its batch and head strides.
    pub block_mask: (u64, [i64; 2]),
    /// The block-mask kernel's output address.
    pub block_mask_out: u64,
    /// A block mask's work order for the kernel (0: none), or a work-order
    /// kernel's output.
    pub work_order: u64,
    /// What only backward kernels take.
    pub grads: Option<GradBindings<'a>>,
    /// A persistent kernel's work counter (zero between launches).
    pub work_counter: Option<u64>,
    /// The TMA descriptors of a kernel that copies with TMA (see
    /// `tma::tensor_maps`).
    pub tensor_maps: Option<TensorMaps>,
    /// Keys per TMA box of a paged kernel copying with TMA
    /// (`tma::paged_box_rows`).
    pub kv_box_rows: u32,
    /// What only varlen kernels take; their `shape` holds the longest
    /// sequences' lengths.
    pub varlen: Option<VarlenBindings>,
    /// What only paged kernels take (their K and V strides are the
    /// caches' page, row and head strides).
    pub paged: Option<PagedBindings>,
    /// What only the paged append takes (its caches are `ptrs[1]` and
    /// `ptrs[2]`, with K's and V's strides).
    pub append: Option<AppendBindings>,
    /// What only decode kernels take; their `shape`'s `kv_len` is the
    /// cache's rows.
    pub decode: Option<DecodeBindings>,
    /// What only the partials kernels take; their `shape` is `batch`,
    /// `heads` and their rows (or elements) as `q_len`.
    pub partials: Option<PartialBindings>,
    /// A dropout kernel's mask, checked (`p` in `[0, 1)`).
    pub dropout: Option<Dropout>,
    /// e4m3 operands' descale factors, Q's, K's and V's (a decode kernel
    /// reads K's and V's): device addresses and the entries between K/V
    /// heads' factors (0: one for the tensor).
    pub descales: Option<[(u64, i32); 3]>,
    /// The e4m3 forward's V tiles (0: none).
    pub v_tiles: u64,
}

/// A partials kernel's operands (context parallelism's merge and adds).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PartialBindings {
    /// Device addresses of the accumulator's, the piece's and the output's
    /// first elements (0: null).
    pub ptrs: [u64; 3],
    /// Their batch, row and head strides.
    pub strides: [[i64; 3]; 3],
    /// Device addresses of the merge's LSEs of each (0: null).
    pub lse: [u64; 3],
    pub first: bool,
    /// Columns per row of the add kernel.
    pub dim: usize,
}

/// A decode launch's per-sequence key counts, split count and workspace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeBindings {
    /// Device address of `kv_lens`, `i32[batch]`.
    pub kv_lens: u64,
    pub splits: u32,
    /// Device addresses of the partial O and LSE (0 with one split).
    pub partial: [u64; 2],
    /// Device address of the split counters (0 with one split).
    pub counters: u64,
}

/// A varlen launch's sequences, queries' then keys'.
#[derive(Clone, Copy, Debug)]
pub(crate) struct VarlenBindings {
    /// Device addresses of `cu_seqlens_q` and `cu_seqlens_k`.
    pub cu_seqlens: [u64; 2],
    /// Tokens in Q (and O) and in K (and V), checked to fit i32.
    pub tokens: [usize; 2],
}

/// A paged launch's caches beyond their addresses and strides.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PagedBindings {
    /// Device addresses of `kv_lens` and the block table.
    pub kv_lens: u64,
    pub block_table: u64,
    /// Checked to fit i32.
    pub pages_per_seq: usize,
    pub page_size: usize,
    pub num_pages: usize,
}

/// The paged append's new rows and what it reports.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AppendBindings {
    /// Device addresses of the new K and V rows.
    pub rows: [u64; 2],
    /// Token and head strides of the new K and V rows.
    pub strides: [[i64; 2]; 2],
    /// The lengths after the append and the dropped rows' count (0: none).
    pub new_kv_lens: u64,
    pub dropped: u64,
}

impl<'a> Bindings<'a> {
    /// Sizes, params and tensors with every other binding empty (no
    /// operands): what a block mask's kernels (building one, ordering work
    /// under one) take, and the base every launch sets its own bindings on.
    pub fn without_operands(shape: Shape, args: &'a [ArgInfo], tensors: &'a [u64]) -> Bindings<'a> {
        Bindings {
            shape,
            ptrs: [0; 4],
            strides: [[0; 3]; 4],
            lse: 0,
            scale: 0.0,
            args,
            tensors,
            block_mask: (0, [0; 2]),
            block_mask_out: 0,
            work_order: 0,
            grads: None,
            work_counter: None,
            tensor_maps: None,
            kv_box_rows: 0,
            varlen: None,
            paged: None,
            append: None,
            decode: None,
            partials: None,
            dropout: None,
            descales: None,
            v_tiles: 0,
        }
    }
}

impl Bindings<'_> {
    /// These bindings with Q, K, V and O in buffers at `bases` laid out as
    /// `layouts`, the LSE at `lse` (0: none) and the softmax `scale`.
    pub fn with_operands(self, bases: [u64; 4], layouts: [Layout; 4], lse: u64, scale: f32) -> Self {
        let ptrs = [0, 1, 2, 3].map(|i| layouts[i].address(bases[i]));
        Bindings { ptrs, strides: layouts.map(|l| l.strides), lse, scale, ..self }
    }
}

/// The backward kernels' arguments beyond the forward's.
pub(crate) struct GradBindings<'a> {
    /// Device addresses of dO, dQ, dK, dV.
    pub ptrs: [u64; 4],
    /// Batch, seq and head strides of dO, dQ, dK, dV.
    pub strides: [[i64; 3]; 4],
    /// D = rowsum(dO ∘ O), f32 `[batch, heads, q_len]`.
    pub delta: u64,
    /// The f32 dQ accumulator, or 0 (null) in the deterministic mode.
    pub dq_accum: u64,
    /// Its tickets (`ArgKind::DqTickets`), or 0 where it has none.
    pub dq_tickets: u64,
    /// Per declared tensor, its gradient buffer's address or 0 (none asked).
    pub tensor_grads: &'a [u64],
}

/// The argument values in launch order.
pub(crate) fn marshal(kernel: &Kernel, b: &Bindings) -> Result<Vec<Value>, Error> {
    kernel.args.iter().map(|arg| value_of(kernel, arg, b)).collect()
}

/// The most arguments [`marshal_into`] and [`launch_inline`] take.
pub(crate) const INLINE_ARGS: usize = 64;

/// [`marshal`] into `out`, without allocating: how many values it wrote.
/// An ABI error where the kernel takes more arguments than `out` holds.
pub(crate) fn marshal_into(kernel: &Kernel, b: &Bindings, out: &mut [Value]) -> Result<usize, Error> {
    if kernel.args.len() > out.len() {
        let problem = format!("{} arguments, more than the {} an inline launch takes", kernel.args.len(), out.len());
        return Err(Error::KernelAbi { kernel: kernel.name.clone(), problem });
    }
    for (slot, arg) in out.iter_mut().zip(&kernel.args) {
        *slot = value_of(kernel, arg, b)?;
    }
    Ok(kernel.args.len())
}

/// The value of `kernel`'s argument `arg` under the bindings `b`.
fn value_of(kernel: &Kernel, arg: &KernelArg, b: &Bindings) -> Result<Value, Error> {
    let size = |n: usize| Value::I32(n as i32);
    let abi_error = || Error::KernelAbi {
        kernel: kernel.name.clone(),
        problem: format!("argument `{}` refers to a param, tensor or gradient the launch lacks", arg.name),
    };
    let grads = || b.grads.as_ref().ok_or_else(abi_error);
    let varlen = || b.varlen.ok_or_else(abi_error);
    let decode = || b.decode.ok_or_else(abi_error);
    let descale = || b.descales.ok_or_else(abi_error);
    let paged = || b.paged.ok_or_else(abi_error);
    let append = || b.append.ok_or_else(abi_error);
    let partials = || b.partials.ok_or_else(abi_error);
    let qkv = |op| match op {
        Operand::Q => Ok(0),
        Operand::K => Ok(1),
        Operand::V => Ok(2),
        _ => Err(abi_error()),
    };
    let kv = |op| match op {
        Operand::K | Operand::V => qkv(op).map(|i| i - 1),
        _ => Err(abi_error()),
    };
    let side = |side| usize::from(side == Side::Keys);
    Ok(match arg.kind {
        ArgKind::Ptr(op) => Value::Ptr(match operand_index(op) {
            Slot::Forward(i) => b.ptrs[i],
            Slot::Grad(i) => grads()?.ptrs[i],
        }),
        ArgKind::E4m3(op) => Value::Ptr(b.ptrs[qkv(op)?]),
        ArgKind::Descale(op) => Value::Ptr(descale()?[qkv(op)?].0),
        ArgKind::DescaleStride(op) => Value::I32(descale()?[qkv(op)?].1),
        ArgKind::E4m3VTiles => Value::Ptr(b.v_tiles),
        ArgKind::Lse => Value::Ptr(b.lse),
        ArgKind::Batch => size(b.shape.batch),
        ArgKind::Heads => size(b.shape.heads),
        ArgKind::HeadsKv => size(b.shape.heads_kv),
        ArgKind::QLen => size(b.shape.q_len),
        ArgKind::KvLen => size(b.shape.kv_len),
        ArgKind::Stride(op, axis) => Value::I64(match operand_index(op) {
            Slot::Forward(i) => b.strides[i][axis_index(axis)],
            Slot::Grad(i) => grads()?.strides[i][axis_index(axis)],
        }),
        ArgKind::Scale => Value::F32(b.scale),
        ArgKind::Param(i) => match b.args.get(i) {
            Some(ArgInfo::I32(v)) => Value::I32(*v),
            Some(ArgInfo::F32(v)) => Value::F32(*v),
            _ => return Err(abi_error()),
        },
        ArgKind::Tensor(i) => Value::Ptr(*b.tensors.get(i).ok_or_else(abi_error)?),
        ArgKind::BlockMask => Value::Ptr(b.block_mask.0),
        ArgKind::BlockMaskStride(axis) => Value::I64(b.block_mask.1[usize::from(axis == Axis::Head)]),
        ArgKind::BlockMaskOut => Value::Ptr(b.block_mask_out),
        ArgKind::Delta => Value::Ptr(grads()?.delta),
        ArgKind::DqAccum => Value::Ptr(grads()?.dq_accum),
        ArgKind::DqTickets => Value::Ptr(grads()?.dq_tickets),
        ArgKind::TensorGrad(i) => Value::Ptr(*grads()?.tensor_grads.get(i).ok_or_else(abi_error)?),
        ArgKind::WorkCounter => Value::Ptr(b.work_counter.ok_or_else(abi_error)?),
        // A kernel takes descriptors only where generated to copy with them.
        ArgKind::TensorMap(op) => {
            Value::TensorMap(b.tensor_maps.as_ref().and_then(|maps| maps.get(op)).ok_or_else(abi_error)?)
        }
        ArgKind::WorkOrder => Value::Ptr(b.work_order),
        ArgKind::CuSeqlens(s) => Value::Ptr(varlen()?.cu_seqlens[side(s)]),
        ArgKind::MaxLen(Side::Queries) => size(b.shape.q_len),
        ArgKind::MaxLen(Side::Keys) => size(b.shape.kv_len),
        ArgKind::Tokens(s) => size(varlen()?.tokens[side(s)]),
        ArgKind::KvLens => Value::Ptr(match (b.paged, b.decode) {
            (Some(paged), _) => paged.kv_lens,
            (None, Some(decode)) => decode.kv_lens,
            (None, None) => return Err(abi_error()),
        }),
        ArgKind::BlockTable => Value::Ptr(paged()?.block_table),
        ArgKind::PagesPerSeq => size(paged()?.pages_per_seq),
        ArgKind::PageSize => size(paged()?.page_size),
        ArgKind::KvBoxRows => Value::I32(b.kv_box_rows as i32),
        ArgKind::NumPages => size(paged()?.num_pages),
        // A cache's pages are its layout's batch axis (`PagedLayout::as_layout`).
        ArgKind::PageStride(op) => match operand_index(op) {
            Slot::Forward(i) if b.paged.is_some() => Value::I64(b.strides[i][0]),
            _ => return Err(abi_error()),
        },
        ArgKind::NewRows(op) => Value::Ptr(append()?.rows[kv(op)?]),
        ArgKind::NewRowStride(op, axis) => match axis {
            Axis::Seq | Axis::Head => Value::I64(append()?.strides[kv(op)?][usize::from(axis == Axis::Head)]),
            Axis::Batch => return Err(abi_error()),
        },
        ArgKind::Cache(op) => Value::Ptr(b.ptrs[1 + kv(op)?]),
        ArgKind::NewKvLens => Value::Ptr(append()?.new_kv_lens),
        ArgKind::Dropped => Value::Ptr(append()?.dropped),
        ArgKind::Splits => Value::I32(decode()?.splits as i32),
        ArgKind::PartialO => Value::Ptr(decode()?.partial[0]),
        ArgKind::PartialLse => Value::Ptr(decode()?.partial[1]),
        ArgKind::SplitCounters => Value::Ptr(decode()?.counters),
        ArgKind::PartialPtr(p) => Value::Ptr(partials()?.ptrs[partial_index(p)]),
        ArgKind::PartialStride(p, axis) => Value::I64(partials()?.strides[partial_index(p)][axis_index(axis)]),
        ArgKind::MergeLse(p) => Value::Ptr(partials()?.lse[partial_index(p)]),
        ArgKind::First => Value::I32(i32::from(partials()?.first)),
        ArgKind::Rows | ArgKind::Elements => size(b.shape.q_len),
        ArgKind::Dim => size(partials()?.dim),
        ArgKind::Dropout(part) => {
            let d = b.dropout.ok_or_else(abi_error)?;
            match part {
                DropoutArg::Seed => Value::I64(d.seed as i64),
                DropoutArg::Offset => Value::I64(d.offset as i64),
                DropoutArg::Threshold => Value::I32(d.threshold() as i32),
                DropoutArg::Scale => Value::F32(d.scale()),
            }
        }
    })
}

/// [`launch`] without allocating: the values' addresses go to the driver
/// from the stack, so a launch costs no host allocation.
///
/// # Safety
/// As [`launch`]; `values` holds at most [`INLINE_ARGS`] values.
pub(crate) unsafe fn launch_inline(
    stream: &CudaStream,
    function: &CudaFunction,
    values: &[Value],
    config: LaunchConfig,
) -> Result<(), DriverError> {
    let mut params = [std::ptr::null_mut::<c_void>(); INLINE_ARGS];
    for (param, value) in params.iter_mut().zip(values) {
        *param = match value {
            Value::Ptr(x) => x as *const u64 as *mut c_void,
            Value::I64(x) => x as *const i64 as *mut c_void,
            Value::I32(x) => x as *const i32 as *mut c_void,
            Value::F32(x) => x as *const f32 as *mut c_void,
            Value::TensorMap(x) => x as *const TensorMap as *mut c_void,
        };
    }
    stream.context().bind_to_thread()?;
    let LaunchConfig { grid_dim, block_dim, shared_mem_bytes } = config;
    let params = &mut params[..values.len().min(INLINE_ARGS)];
    cudarc::driver::result::launch_kernel(
        function.cu_function(),
        grid_dim,
        block_dim,
        shared_mem_bytes,
        stream.cu_stream(),
        params,
    )
}

/// Queues `function` on `stream` with `values` as its arguments.
///
/// # Safety
/// `values` must match the kernel's parameters in order and type (as
/// [`marshal`] makes them), and every address they let it touch must be in
/// bounds of a live allocation.
pub(crate) unsafe fn launch(
    stream: &CudaStream,
    function: &CudaFunction,
    values: &[Value],
    config: LaunchConfig,
) -> Result<(), DriverError> {
    let mut builder = stream.launch_builder(function);
    for value in values {
        match value {
            Value::Ptr(x) => builder.arg(x),
            Value::I64(x) => builder.arg(x),
            Value::I32(x) => builder.arg(x),
            Value::F32(x) => builder.arg(x),
            Value::TensorMap(x) => builder.arg(x),
        };
    }
    builder.launch(config).map(drop)
}

/// The kernel's grid (see [`Grid`]) for `shape` on a GPU with `sms` SMs;
/// `slices` is the number of (batch, head) slices a block mask holds
/// (`Grid::MaskTiles`), or a decode launch's split count (`Grid::KvGroups`). The
/// sizes were checked against the grid limits, so the narrowing casts are
/// exact.
pub(crate) fn launch_config(kernel: &Kernel, shape: &Shape, slices: usize, sms: u32) -> Result<LaunchConfig, Error> {
    let zero_divisor = match kernel.grid {
        Grid::KeyTiles | Grid::KeyUnits => kernel.block_n == 0,
        Grid::Heads { per_block } | Grid::KvHeads { per_block } => per_block == 0,
        Grid::Persistent { per_sm } => per_sm == 0,
        _ => false,
    };
    if kernel.block_m == 0 || kernel.threads == 0 || zero_divisor {
        let problem = format!(
            "block_m = {}, block_n = {}, threads = {}, grid = {:?}",
            kernel.block_m, kernel.block_n, kernel.threads, kernel.grid
        );
        return Err(Error::KernelAbi { kernel: kernel.name.clone(), problem });
    }
    let q_tiles = shape.q_len.div_ceil(kernel.block_m as usize) as u32;
    Ok(LaunchConfig {
        grid_dim: match kernel.grid {
            Grid::QueryTiles => (q_tiles, shape.heads as u32, shape.batch as u32),
            Grid::Persistent { per_sm } => {
                // The kernel decodes an item's coordinates in 31 bits.
                let items = u64::from(q_tiles) * shape.heads as u64 * shape.batch as u64;
                if items > i32::MAX as u64 {
                    let (what, max) = ("work items (query tiles × heads × batch)", i32::MAX as usize);
                    return Err(Error::TooLarge { what, value: items as usize, max });
                }
                (items.min(u64::from(sms.max(1)) * u64::from(per_sm)) as u32, 1, 1)
            }
            Grid::KeyTiles => {
                (shape.kv_len.div_ceil(kernel.block_n as usize) as u32, shape.heads_kv as u32, shape.batch as u32)
            }
            Grid::KeyUnits => {
                // The kernel numbers units in 31 bits.
                let tiles = shape.kv_len.div_ceil(kernel.block_n as usize) as u64;
                let units = tiles * shape.heads_kv as u64 * shape.batch as u64;
                if units > i32::MAX as u64 {
                    let (what, max) = ("dK/dV units (key tiles × K/V heads × batch)", i32::MAX as usize);
                    return Err(Error::TooLarge { what, value: units as usize, max });
                }
                (units.min(u64::from(sms.max(1))) as u32, 1, 1)
            }
            Grid::MaskTiles => (shape.kv_len.div_ceil(kernel.block_n as usize) as u32, q_tiles, slices as u32),
            Grid::Heads { per_block } => (1, shape.heads.div_ceil(per_block as usize) as u32, shape.batch as u32),
            Grid::KvHeads { per_block } => (1, shape.heads_kv.div_ceil(per_block as usize) as u32, shape.batch as u32),
            // One block per sequence at least: it writes the length after.
            Grid::NewRows => (shape.kv_len.div_ceil(kernel.block_m as usize).max(1) as u32, shape.batch as u32, 1),
            Grid::KvGroups => {
                let rows = (shape.heads / shape.heads_kv.max(1)) * shape.q_len;
                let tiles = rows.div_ceil(kernel.block_m as usize) * slices;
                (tiles as u32, shape.heads_kv as u32, shape.batch as u32)
            }
        },
        block_dim: (kernel.threads, 1, 1),
        shared_mem_bytes: kernel.dynamic_smem,
    })
}

/// Where an operand's address and strides are bound.
enum Slot {
    Forward(usize),
    Grad(usize),
}

fn operand_index(op: Operand) -> Slot {
    match op {
        Operand::Q => Slot::Forward(0),
        Operand::K => Slot::Forward(1),
        Operand::V => Slot::Forward(2),
        Operand::O => Slot::Forward(3),
        Operand::DO => Slot::Grad(0),
        Operand::DQ => Slot::Grad(1),
        Operand::DK => Slot::Grad(2),
        Operand::DV => Slot::Grad(3),
    }
}

fn partial_index(p: Partial) -> usize {
    match p {
        Partial::Acc => 0,
        Partial::Piece | Partial::PieceF32 => 1,
        Partial::Out => 2,
    }
}

fn axis_index(axis: Axis) -> usize {
    match axis {
        Axis::Batch => 0,
        Axis::Seq => 1,
        Axis::Head => 2,
    }
}

#[cfg(test)]
mod tests;
