//! Kernel argument values and launch geometry, derived from the kernel's ABI
//! description ([`Kernel::args`]) so the argument order lives only in the
//! code generator.

use crate::args::ArgInfo;
use crate::error::Error;
use crate::layout::Layout;
use crate::tma::TensorMap;
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
    pub tensor_maps: Option<Vec<(Operand, TensorMap)>>,
    /// Keys per TMA box of a warp-specialized varlen or paged kernel's K/V
    /// copies, 0 for none (`tma::kv_boxes`).
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
    /// For the kernels of a block mask (building one, ordering work under
    /// one): sizes, params and tensors, no operands; the caller sets the
    /// mask's addresses.
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
    let paged = || b.paged.ok_or_else(abi_error);
    let append = || b.append.ok_or_else(abi_error);
    let partials = || b.partials.ok_or_else(abi_error);
    let kv = |op| match op {
        Operand::K => Ok(0),
        Operand::V => Ok(1),
        _ => Err(abi_error()),
    };
    let side = |side| usize::from(side == Side::Keys);
    Ok(match arg.kind {
        ArgKind::Ptr(op) => Value::Ptr(match operand_index(op) {
            Slot::Forward(i) => b.ptrs[i],
            Slot::Grad(i) => grads()?.ptrs[i],
        }),
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
        ArgKind::TensorGrad(i) => Value::Ptr(*grads()?.tensor_grads.get(i).ok_or_else(abi_error)?),
        ArgKind::WorkCounter => Value::Ptr(b.work_counter.ok_or_else(abi_error)?),
        // A kernel takes descriptors only where generated to copy with them.
        ArgKind::TensorMap(op) => Value::TensorMap(
            b.tensor_maps.as_ref().and_then(|maps| maps.iter().find(|(o, _)| *o == op)).ok_or_else(abi_error)?.1,
        ),
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
        Grid::KeyTiles => kernel.block_n == 0,
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
mod tests {
    use super::*;
    use flashgen_codegen::abi::KernelArg;
    use flashgen_codegen::ElemTy;

    fn kernel(kinds: &[ArgKind]) -> Kernel {
        Kernel {
            name: "k".into(),
            source: String::new(),
            grid: Grid::QueryTiles,
            block_m: 64,
            block_n: 32,
            threads: 128,
            dynamic_smem: 1024,
            args: kinds.iter().enumerate().map(|(i, &kind)| KernelArg { name: format!("a{i}"), kind }).collect(),
        }
    }

    const SHAPE: Shape = Shape { batch: 3, heads: 8, heads_kv: 2, q_len: 129, kv_len: 7 };

    fn bindings<'a>(args: &'a [ArgInfo], tensors: &'a [u64]) -> Bindings<'a> {
        Bindings {
            shape: SHAPE,
            ptrs: [10, 11, 12, 13],
            strides: [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]],
            lse: 0,
            scale: 0.125,
            args,
            tensors,
            block_mask: (77, [40, 0]),
            block_mask_out: 78,
            work_order: 79,
            work_counter: None,
            tensor_maps: None,
            kv_box_rows: 0,
            grads: None,
            varlen: None,
            paged: None,
            append: None,
            decode: None,
            partials: None,
            dropout: None,
        }
    }

    #[test]
    fn values_follow_the_abi_order() {
        let k = kernel(&[
            ArgKind::Ptr(Operand::V),
            ArgKind::Lse,
            ArgKind::Stride(Operand::K, Axis::Head),
            ArgKind::QLen,
            ArgKind::HeadsKv,
            ArgKind::Scale,
            ArgKind::Param(1),
            ArgKind::Param(0),
            ArgKind::Tensor(0),
            ArgKind::BlockMask,
            ArgKind::BlockMaskStride(Axis::Batch),
            ArgKind::BlockMaskStride(Axis::Head),
            ArgKind::BlockMaskOut,
        ]);
        let args = [ArgInfo::I32(-5), ArgInfo::F32(2.5), ArgInfo::Tensor(ElemTy::F32, 8)];
        let values = marshal(&k, &bindings(&args, &[99])).unwrap();
        use Value::*;
        let expected = [
            Ptr(12),
            Ptr(0),
            I64(6),
            I32(129),
            I32(2),
            F32(0.125),
            F32(2.5),
            I32(-5),
            Ptr(99),
            Ptr(77),
            I64(40),
            I64(0),
            Ptr(78),
        ];
        assert_eq!(values, expected);
    }

    /// A varlen kernel's sequences, longest lengths and token counts come
    /// from the varlen bindings and the shape, its strides from each
    /// operand's token and head axes; without varlen bindings it is refused.
    #[test]
    fn varlen_kernels_marshal_their_sequences() {
        use flashgen_codegen::cuda::{emit_forward_varlen, Mma, TileConfig};
        let spec = flashgen_codegen::parse_one(
            "D { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        )
        .unwrap();
        let args = [ArgInfo::Tensor(ElemTy::I32, 3 * 7)];
        let persistent = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
        for config in [TileConfig::default_for(&spec), persistent] {
            let kernel = emit_forward_varlen(&spec, config);
            let varlen = Some(VarlenBindings { cu_seqlens: [91, 92], tokens: [500, 700] });
            let tensor_maps =
                Some(vec![(Operand::K, crate::tma::TensorMap::ZERO), (Operand::V, crate::tma::TensorMap::ZERO)]);
            let b = Bindings { varlen, tensor_maps, work_counter: Some(93), ..bindings(&args, &[99]) };
            let values = marshal(&kernel, &b).unwrap();
            let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
            use Value::*;
            for (name, expected) in [
                ("cu_seqlens_q", Ptr(91)),
                ("cu_seqlens_k", Ptr(92)),
                ("max_q_len", I32(129)),
                ("max_kv_len", I32(7)),
                ("total_q", I32(500)),
                ("total_kv", I32(700)),
                ("q_seq_stride", I64(2)),
                ("v_head_stride", I64(9)),
                ("t_doc", Ptr(99)),
            ] {
                assert_eq!(value(name), expected, "{name} in {config:?}");
            }
            let err = marshal(&kernel, &Bindings { varlen: None, ..b }).unwrap_err();
            assert!(matches!(err, Error::KernelAbi { .. }), "{err}");
        }
    }

    /// A paged kernel's caches: pages' strides from their layouts' batch
    /// axis, the table, lengths and sizes from the paged bindings (and a
    /// warp-specialized kernel's TMA boxes); without them it is refused.
    #[test]
    fn paged_kernels_marshal_their_caches() {
        use flashgen_codegen::cuda::{emit_forward_paged, Mma, TileConfig};
        let spec =
            flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 64, mask: q + kv_len - q_len >= k }").unwrap();
        let persistent = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };
        for config in [TileConfig::default_for(&spec), persistent] {
            let kernel = emit_forward_paged(&spec, config);
            let varlen = Some(VarlenBindings { cu_seqlens: [0, 0], tokens: [500, 0] });
            let paged =
                Some(PagedBindings { kv_lens: 94, block_table: 95, pages_per_seq: 6, page_size: 3, num_pages: 17 });
            let tensor_maps =
                Some(vec![(Operand::K, crate::tma::TensorMap::ZERO), (Operand::V, crate::tma::TensorMap::ZERO)]);
            let b =
                Bindings { varlen, paged, tensor_maps, kv_box_rows: 8, work_counter: Some(93), ..bindings(&[], &[]) };
            let values = marshal(&kernel, &b).unwrap();
            let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
            use Value::*;
            for (name, expected) in [
                ("cu_seqlens_q", Ptr(0)),
                ("kv_lens", Ptr(94)),
                ("block_table", Ptr(95)),
                ("pages_per_seq", I32(6)),
                ("page_size", I32(3)),
                ("num_pages", I32(17)),
                ("max_kv_len", I32(7)),
                ("k_page_stride", I64(4)),
                ("k_seq_stride", I64(5)),
                ("v_page_stride", I64(7)),
                ("v_head_stride", I64(9)),
            ] {
                assert_eq!(value(name), expected, "{name} in {config:?}");
            }
            if config == persistent {
                assert_eq!(value("kv_box_rows"), I32(8));
            }
            let err = marshal(&kernel, &Bindings { paged: None, ..b }).unwrap_err();
            assert!(matches!(err, Error::KernelAbi { .. }), "{err}");
        }
    }

    /// A decode kernel's lengths, split count and workspace come from the
    /// decode bindings, the cache's rows from the shape; inline marshalling
    /// gives the same values as `marshal`; the grid covers every row tile
    /// of every split.
    #[test]
    fn decode_kernels_marshal_their_lengths_and_splits() {
        use flashgen_codegen::cuda::{emit_decode, DecodeConfig, Target};
        let spec = flashgen_codegen::parse_one(
            "D { dtype: bf16, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        )
        .unwrap();
        let kernel = emit_decode(&spec, DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap());
        let args = [ArgInfo::Tensor(ElemTy::I32, 3 * 7)];
        let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
        let b = Bindings { decode, ..bindings(&args, &[99]) };
        let values = marshal(&kernel, &b).unwrap();
        let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
        use Value::*;
        for (name, expected) in [
            ("kv_lens", Ptr(94)),
            ("num_splits", I32(5)),
            ("partial_o", Ptr(95)),
            ("partial_lse", Ptr(96)),
            ("split_counters", Ptr(98)),
            ("max_kv_len", I32(7)),
            ("max_q_len", I32(129)),
            ("k_seq_stride", I64(5)),
            ("t_doc", Ptr(99)),
        ] {
            assert_eq!(value(name), expected, "{name}");
        }
        let mut inline = [Value::I32(0); INLINE_ARGS];
        let count = marshal_into(&kernel, &b, &mut inline).unwrap();
        assert_eq!(&inline[..count], &values[..]);
        assert!(matches!(marshal_into(&kernel, &b, &mut inline[..3]), Err(Error::KernelAbi { .. })));
        assert!(matches!(marshal(&kernel, &Bindings { decode: None, ..b }), Err(Error::KernelAbi { .. })));
        // 8 heads over 2 K/V heads x 129 queries = 516 rows: 33 tiles of 16, 5 splits each.
        let grid = launch_config(&kernel, &SHAPE, 5, 132).unwrap();
        assert_eq!(grid.grid_dim, (33 * 5, 2, 3));
    }

    /// A paged decode kernel binds its block table and sizes from the paged
    /// bindings and K's and V's pages' strides from their layouts' batch
    /// axis, beside the decode bindings; without the paged ones it is refused.
    #[test]
    fn paged_decode_kernels_marshal_their_tables() {
        use flashgen_codegen::cuda::{emit_decode_paged, DecodeConfig, Target};
        let spec = flashgen_codegen::parse_one("D { dtype: bf16, head_dim: 64 }").unwrap();
        let kernel = emit_decode_paged(&spec, DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap());
        let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
        let paged =
            Some(PagedBindings { kv_lens: 94, block_table: 97, pages_per_seq: 6, page_size: 16, num_pages: 40 });
        let b = Bindings { decode, paged, ..bindings(&[], &[]) };
        let values = marshal(&kernel, &b).unwrap();
        let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
        use Value::*;
        for (name, expected) in [
            ("kv_lens", Ptr(94)),
            ("block_table", Ptr(97)),
            ("pages_per_seq", I32(6)),
            ("page_size", I32(16)),
            ("num_pages", I32(40)),
            ("k_page_stride", I64(4)),
            ("k_seq_stride", I64(5)),
            ("v_page_stride", I64(7)),
            ("v_head_stride", I64(9)),
            ("q_batch_stride", I64(1)),
            ("num_splits", I32(5)),
        ] {
            assert_eq!(value(name), expected, "{name}");
        }
        assert!(!kernel.args.iter().any(|a| a.name == "k_batch_stride"), "pages replace K's batch axis");
        let mut inline = [Value::I32(0); INLINE_ARGS];
        let count = marshal_into(&kernel, &b, &mut inline).unwrap();
        assert_eq!(&inline[..count], &values[..]);
        assert!(matches!(marshal(&kernel, &Bindings { paged: None, ..b }), Err(Error::KernelAbi { .. })));
    }

    /// A decode kernel over packed queries binds their prefix sums and
    /// tokens from the varlen bindings and the plan's `q_len` as
    /// `max_q_len`; Q and O have no batch stride; without the varlen
    /// bindings it is refused. Its grid is the padded kernel's.
    #[test]
    fn varlen_decode_kernels_marshal_their_sequences() {
        use flashgen_codegen::cuda::{emit_decode_with, DecodeCache, DecodeConfig, DecodeQueries, Target};
        let spec = flashgen_codegen::parse_one("D { dtype: bf16, head_dim: 64 }").unwrap();
        let config = DecodeConfig::for_rows(&spec, Target::HOPPER, 8).unwrap();
        let decode = Some(DecodeBindings { kv_lens: 94, splits: 5, partial: [95, 96], counters: 98 });
        let varlen = Some(VarlenBindings { cu_seqlens: [91, 0], tokens: [300, 0] });
        let paged =
            Some(PagedBindings { kv_lens: 94, block_table: 97, pages_per_seq: 6, page_size: 16, num_pages: 40 });
        for (cache, paged) in [(DecodeCache::Dense, None), (DecodeCache::Paged, paged)] {
            let kernel = emit_decode_with(&spec, config, cache, DecodeQueries::Packed);
            let b = Bindings { decode, varlen, paged, ..bindings(&[], &[]) };
            let values = marshal(&kernel, &b).unwrap();
            let value = |name: &str| values[kernel.args.iter().position(|a| a.name == name).unwrap()];
            use Value::*;
            for (name, expected) in [
                ("cu_seqlens_q", Ptr(91)),
                ("total_q", I32(300)),
                ("max_q_len", I32(129)),
                ("q_seq_stride", I64(2)),
                ("o_head_stride", I64(12)),
                ("kv_lens", Ptr(94)),
                ("num_splits", I32(5)),
            ] {
                assert_eq!(value(name), expected, "{cache:?} {name}");
            }
            for gone in ["q_len", "q_batch_stride", "o_batch_stride"] {
                assert!(!kernel.args.iter().any(|a| a.name == gone), "{cache:?}: {gone}");
            }
            let mut inline = [Value::I32(0); INLINE_ARGS];
            let count = marshal_into(&kernel, &b, &mut inline).unwrap();
            assert_eq!(&inline[..count], &values[..]);
            assert!(matches!(marshal(&kernel, &Bindings { varlen: None, ..b }), Err(Error::KernelAbi { .. })));
            assert_eq!(launch_config(&kernel, &SHAPE, 5, 132).unwrap().grid_dim, (33 * 5, 2, 3));
        }
    }

    /// The varlen backward kernels bind their sequences as the forward's do,
    /// and the gradients' token and head strides.
    #[test]
    fn varlen_backward_kernels_marshal_their_sequences() {
        use flashgen_codegen::cuda::{emit_backward_varlen, BackwardConfig, BackwardPass, Target};
        let spec = flashgen_codegen::parse_one("C { dtype: bf16, head_dim: 128, mask: q >= k }").unwrap();
        let grads = || GradBindings {
            ptrs: [20, 21, 22, 23],
            strides: [[0, 13, 14], [0, 15, 16], [0, 17, 18], [0, 19, 20]],
            delta: 24,
            dq_accum: 25,
            tensor_grads: &[],
        };
        let varlen = Some(VarlenBindings { cu_seqlens: [91, 92], tokens: [500, 700] });
        let b = || Bindings { varlen, grads: Some(grads()), ..bindings(&[], &[]) };
        let configs = [BackwardConfig::default_for(&spec), BackwardConfig::preferred(&spec, Target::for_sm(9, 0))];
        for (config, pass) in configs.into_iter().flat_map(|c| {
            [BackwardPass::Preprocess, BackwardPass::KeyValue, BackwardPass::Query, BackwardPass::Postprocess]
                .map(|pass| (c, pass))
        }) {
            let kernel = emit_backward_varlen(&spec, pass, config);
            let values = marshal(&kernel, &b()).unwrap();
            let value = |name: &str| kernel.args.iter().position(|a| a.name == name).map(|i| values[i]);
            use Value::*;
            for (name, expected) in [
                ("cu_seqlens_q", Ptr(91)),
                ("max_q_len", I32(129)),
                ("total_q", I32(500)),
                ("dq_seq_stride", I64(15)),
                ("dk_head_stride", I64(18)),
            ] {
                let got = value(name);
                assert!(got.is_none() || got == Some(expected), "{name} in {pass:?}: {got:?}");
            }
            assert!(kernel.args.iter().all(|a| !matches!(a.kind, ArgKind::Stride(_, Axis::Batch))), "{pass:?}");
            assert!(marshal(&kernel, &Bindings { varlen: None, ..b() }).is_err(), "{pass:?}");
        }
    }

    #[test]
    fn dangling_indices_are_abi_errors() {
        for kind in [ArgKind::Param(1), ArgKind::Tensor(1), ArgKind::Param(2)] {
            let args = [ArgInfo::I32(1), ArgInfo::Tensor(ElemTy::I32, 1)];
            let err = marshal(&kernel(&[kind]), &bindings(&args, &[5])).unwrap_err();
            assert!(matches!(err, Error::KernelAbi { .. }), "{kind:?}: {err}");
        }
    }

    #[test]
    fn grid_covers_every_query_tile() {
        let cfg = launch_config(&kernel(&[]), &SHAPE, 1, 132).unwrap();
        assert_eq!((cfg.grid_dim, cfg.block_dim, cfg.shared_mem_bytes), ((3, 8, 3), (128, 1, 1), 1024));
        let mut k = kernel(&[]);
        k.grid = Grid::MaskTiles;
        assert_eq!(launch_config(&k, &SHAPE, 6, 132).unwrap().grid_dim, (1, 3, 6));
        // Persistent: per_sm blocks per SM, but never more than the 72 items.
        k.grid = Grid::Persistent { per_sm: 1 };
        assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (72, 1, 1));
        assert_eq!(launch_config(&k, &SHAPE, 1, 16).unwrap().grid_dim, (16, 1, 1));
        k.grid = Grid::Persistent { per_sm: 2 };
        assert_eq!(launch_config(&k, &SHAPE, 1, 16).unwrap().grid_dim, (32, 1, 1));
        assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (72, 1, 1));
        // Its items' coordinates are decoded in 31 bits: 2^31 items are refused.
        let huge = Shape { batch: 256, heads: 256, heads_kv: 256, q_len: 64 << 15, kv_len: 64 };
        assert!(matches!(launch_config(&k, &huge, 1, 132), Err(Error::TooLarge { value: 2_147_483_648, .. })));
        let most = Shape { batch: 255, ..huge };
        assert!(launch_config(&k, &most, 1, 132).is_ok());
        // Work orders: one block per few heads (8 here) or K/V heads (2) of a batch.
        k.grid = Grid::Heads { per_block: 3 };
        assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (1, 3, 3));
        k.grid = Grid::KvHeads { per_block: 3 };
        assert_eq!(launch_config(&k, &SHAPE, 1, 132).unwrap().grid_dim, (1, 1, 3));
        k.grid = Grid::Heads { per_block: 0 };
        assert!(matches!(launch_config(&k, &SHAPE, 1, 132), Err(Error::KernelAbi { .. })));
        k.grid = Grid::Heads { per_block: 1 };
        k.block_m = 0;
        assert!(matches!(launch_config(&k, &SHAPE, 1, 132), Err(Error::KernelAbi { .. })));
    }
}
