//! One attention call on candle tensors: its operands, the flashgen forward
//! and backward launches on the tensors' own stream, and what the forward
//! leaves for the backward (the row log-sum-exp) and the backward for the
//! graph (every gradient, computed in one pass).

use crate::error::{self, Error};
use crate::layout::{is_compact, operand_layout};
use crate::Attention;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{DType, Shape, Storage, Tensor};
use flashgen::cudarc::driver::{CudaSlice, DeviceRepr};
use flashgen::half::{bf16, f16};
use flashgen::{
    ArgValue, BackwardIo, BackwardOptions, BlockMask, Dtype, Element, ForwardIo, ForwardOptions, Layout, Runtime,
};
use std::sync::{Mutex, PoisonError};
#[cfg(feature = "nccl")]
use {crate::context::ContextParallel, flashgen::context_parallel::ShardIo, flashgen::cudarc::nccl::NcclType};

/// A runtime param or captured tensor, in the spec's declaration order:
/// params first, then tensors.
#[derive(Clone, Debug)]
pub enum Arg {
    I32(i32),
    F32(f32),
    /// A captured tensor on the operands' device, of the declared element
    /// type (i32, f32, f16 or bf16) and element count; read as row-major.
    Tensor(Tensor),
}

impl From<i32> for Arg {
    fn from(v: i32) -> Self {
        Arg::I32(v)
    }
}

impl From<f32> for Arg {
    fn from(v: f32) -> Self {
        Arg::F32(v)
    }
}

/// The captured tensors among `args`, in order.
pub(crate) fn arg_tensors(args: &[Arg]) -> Vec<Tensor> {
    let tensor = |a: &Arg| match a {
        Arg::Tensor(t) => Some(t.clone()),
        _ => None,
    };
    args.iter().filter_map(tensor).collect()
}

impl From<&Tensor> for Arg {
    fn from(t: &Tensor) -> Self {
        Arg::Tensor(t.clone())
    }
}

/// Every gradient of one call, from one backward launch: dQ, dK, dV and one
/// per captured tensor (`None` for those not trained).
#[derive(Clone)]
pub(crate) struct Grads {
    pub qkv: [Tensor; 3],
    pub tensors: Vec<Option<Tensor>>,
}

/// The state one forward call shares between the ops it put in candle's
/// graph.
pub(crate) struct Call {
    pub attention: Attention,
    /// Q, K, V as flashgen reads them (a compact copy where the caller's
    /// layout was not addressable).
    pub qkv: [Tensor; 3],
    pub args: Vec<Arg>,
    /// Per captured tensor: whether the backward computes its gradient.
    pub train: Vec<bool>,
    /// Whether the forward keeps the LSE (some operand tracks gradients).
    pub keep_lse: bool,
    pub lse: Mutex<Option<CudaSlice<f32>>>,
    /// The tile classes of a mask that reads captured tensors (built by the
    /// forward, so both passes skip the tiles it proves empty).
    pub block_mask: Mutex<Option<BlockMask>>,
    pub grads: Mutex<Option<Grads>>,
    /// A context-parallel call's rank, sharding and communicator.
    #[cfg(feature = "nccl")]
    pub sharded: Option<ContextParallel>,
}

pub(crate) const NAMES: [&str; 3] = ["Q", "K", "V"];

impl Call {
    /// Takes the operands, copying only those flashgen cannot address.
    pub fn new(attention: &Attention, q: &Tensor, k: &Tensor, v: &Tensor, args: &[Arg]) -> candle_core::Result<Call> {
        let mut qkv = [q.clone(), k.clone(), v.clone()];
        let qkv_tracked = qkv.iter().any(Tensor::track_op);
        for (t, name) in qkv.iter_mut().zip(NAMES) {
            check_device(name, t, q)?;
            if operand_layout(name, t.layout())?.is_none() {
                *t = t.detach().contiguous()?;
            }
        }
        let spec = attention.spec();
        let declared = spec.params.len() + spec.tensors.len();
        if args.len() != declared {
            let detail = format!("spec `{}` declares {declared} params and tensors; got {}", spec.name, args.len());
            return Err(Error::Args { detail }.into());
        }
        if let Some((i, _)) = args.iter().enumerate().take(spec.params.len()).find(|(_, a)| matches!(a, Arg::Tensor(_)))
        {
            let detail = format!("argument {i} (`{}`) is a param: pass a number", spec.params[i].name);
            return Err(Error::Args { detail }.into());
        }
        let mut train = vec![false; spec.tensors.len()];
        let mut args = args.to_vec();
        for (i, arg) in args.iter_mut().enumerate().skip(spec.params.len()) {
            let index = i - spec.params.len();
            let Arg::Tensor(t) = arg else {
                let detail = format!("argument {i} (`{}`) must be a tensor", spec.tensors[index].name);
                return Err(Error::Args { detail }.into());
            };
            check_device(&spec.tensors[index].name, t, q)?;
            train[index] = attention.trainable().contains(&index) && t.track_op();
            let (storage, layout) = t.storage_and_layout();
            let len = storage_len(&storage);
            if !is_compact(layout, len) {
                drop(storage);
                *t = t.detach().force_contiguous()?;
            }
        }
        let keep_lse = qkv_tracked || train.contains(&true);
        Ok(Call {
            attention: attention.clone(),
            qkv,
            args,
            train,
            keep_lse,
            lse: Mutex::default(),
            block_mask: Mutex::default(),
            grads: Mutex::default(),
            #[cfg(feature = "nccl")]
            sharded: None,
        })
    }

    /// Runs the forward on the operands' stream: O as a compact
    /// `[batch, q_len, heads, v_dim]` tensor's storage, and its shape.
    pub fn forward(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        #[cfg(feature = "nccl")]
        if let Some(cp) = &self.sharded {
            return match self.attention.spec().dtype {
                Dtype::Bf16 => self.forward_sharded::<bf16>(cp),
                Dtype::F16 => self.forward_sharded::<f16>(cp),
            };
        }
        match self.attention.spec().dtype {
            Dtype::Bf16 => self.forward_as::<bf16>(),
            Dtype::F16 => self.forward_as::<f16>(),
        }
    }

    /// Runs the backward on the operands' stream from the forward's output
    /// and the incoming gradient, keeping every gradient for the graph.
    pub fn backward(&self, o: &Tensor, d_o: &Tensor) -> candle_core::Result<()> {
        let grads = self.gradients(o, d_o)?;
        *self.grads.lock().unwrap_or_else(PoisonError::into_inner) = Some(grads);
        Ok(())
    }

    fn gradients(&self, o: &Tensor, d_o: &Tensor) -> candle_core::Result<Grads> {
        #[cfg(feature = "nccl")]
        if let Some(cp) = &self.sharded {
            return match self.attention.spec().dtype {
                Dtype::Bf16 => self.backward_sharded::<bf16>(cp, o, d_o),
                Dtype::F16 => self.backward_sharded::<f16>(cp, o, d_o),
            };
        }
        match self.attention.spec().dtype {
            Dtype::Bf16 => self.backward_as::<bf16>(o, d_o),
            Dtype::F16 => self.backward_as::<f16>(o, d_o),
        }
    }

    /// [`Call::forward`] of a sharded call: its rank's rows of O.
    #[cfg(feature = "nccl")]
    fn forward_sharded<T: Element + CudaDType + NcclType>(
        &self,
        cp: &ContextParallel,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        // The pieces' merge writes an LSE whether or not the backward needs it.
        self.forward_with::<T>(true, |rt, [q, k, v], o, lse, args| {
            let lse = lse.expect("an LSE was allocated");
            let io = ShardIo { q, k, v, o, lse };
            let opts = ForwardOptions { scale: self.attention.scale(), ..Default::default() };
            cp.with(|cp| rt.forward_sharded(self.attention.spec(), cp, io, args, &opts)).map_err(error::flashgen)
        })
    }

    /// [`Call::backward`] of a sharded call: its rank's share, over NCCL.
    #[cfg(feature = "nccl")]
    fn backward_sharded<T: Element + CudaDType + NcclType>(
        &self,
        cp: &ContextParallel,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<Grads> {
        let spec = self.attention.spec();
        self.backward_with::<T>(o, d_o, |rt, io, args, opts| {
            cp.with(|cp| rt.backward_sharded(spec, cp, io, args, opts))
        })
    }

    fn forward_as<T: Element + CudaDType>(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        self.forward_with::<T>(self.keep_lse, |rt, [q, k, v], o, lse, args| {
            let block_mask = self.build_block_mask(rt, [q.1, k.1], args)?;
            let io = ForwardIo { q, k, v, o, lse };
            let opts =
                ForwardOptions { scale: self.attention.scale(), block_mask: block_mask.as_ref(), ..Default::default() };
            rt.forward(self.attention.spec(), io, args, &opts).map_err(error::flashgen)?;
            *self.block_mask.lock().unwrap_or_else(PoisonError::into_inner) = block_mask;
            Ok(())
        })
    }

    /// O from `launch`, given Q, K and V as flashgen reads them, O (compact
    /// `[batch, q_len, heads, v_dim]`), the LSE where `with_lse` asks for
    /// one, and the call's args; the LSE is kept for the backward where it
    /// needs one.
    fn forward_with<T: Element + CudaDType>(
        &self,
        with_lse: bool,
        launch: impl for<'a> FnOnce(
            &Runtime,
            [(&'a dyn flashgen::DeviceInput<T>, Layout); 3],
            (&'a mut dyn flashgen::DeviceOutput<T>, Layout),
            Option<&'a mut CudaSlice<f32>>,
            &[ArgValue<'_>],
        ) -> candle_core::Result<()>,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let device = cuda_device(&self.qkv[0], "Q")?;
        let rt = self.attention.runtime(&device)?;
        let guards = self.qkv.each_ref().map(|t| t.storage_and_layout());
        let [q, k, v] = operands::<T, 3>(NAMES, &guards);
        let (q, k, v) = (q?, k?, v?);
        let (batch, q_len, heads, v_dim) = (q.1.batch, q.1.seq, q.1.heads, v.1.dim);
        let o_layout = Layout::bshd(batch, q_len, heads, v_dim);
        // SAFETY: the launch (the kernel, or a sharded call's merge of its
        // pieces) writes every element of O and the LSE before anything
        // reads them.
        let mut o = unsafe { device.alloc::<T>(o_layout.len())? };
        let mut lse = match with_lse {
            true => Some(unsafe { device.alloc::<f32>(batch * heads * q_len)? }),
            false => None,
        };
        let tensor_guards: Vec<_> = self.tensors().map(|t| t.storage_and_layout()).collect();
        let args = self.arg_values(&tensor_guards)?;
        launch(&rt, [q, k, v], (&mut o, o_layout), lse.as_mut(), &args)?;
        *self.lse.lock().unwrap_or_else(PoisonError::into_inner) = if self.keep_lse { lse } else { None };
        Ok((CudaStorage::wrap_cuda_slice(o, device), Shape::from((batch, q_len, heads, v_dim))))
    }

    fn backward_as<T: Element + CudaDType>(&self, o: &Tensor, d_o: &Tensor) -> candle_core::Result<Grads> {
        let spec = self.attention.spec();
        self.backward_with::<T>(o, d_o, |rt, io, args, opts| rt.backward(spec, io, args, opts))
    }

    /// Every gradient from `launch`, given the gradient buffers as
    /// [`BackwardIo`] and the call's args and options (the block mask the
    /// forward built, if any; a sharded call's pieces build their own).
    fn backward_with<T: Element + CudaDType>(
        &self,
        o: &Tensor,
        d_o: &Tensor,
        launch: impl FnOnce(
            &Runtime,
            BackwardIo<'_, T>,
            &[ArgValue<'_>],
            &BackwardOptions<'_>,
        ) -> Result<(), flashgen::Error>,
    ) -> candle_core::Result<Grads> {
        let device = cuda_device(&self.qkv[0], "Q")?;
        let rt = self.attention.runtime(&device)?;
        let lse = self.lse.lock().unwrap_or_else(PoisonError::into_inner);
        let lse = lse.as_ref().ok_or_else(|| candle_core::Error::msg("flashgen: the forward kept no LSE"))?;
        let d_o = self.addressable_d_o(d_o)?;
        let guards = self.qkv.each_ref().map(|t| t.storage_and_layout());
        let [q, k, v] = operands::<T, 3>(NAMES, &guards);
        let (q, k, v) = (q?, k?, v?);
        let out_guards = [o, &d_o].map(|t| t.storage_and_layout());
        let [o_io, d_o_io] = operands::<T, 2>(["O", "dO"], &out_guards);
        let (o_io, d_o_io) = (o_io?, d_o_io?);
        let shapes = [q.1, k.1, v.1].map(|l| Layout::bshd(l.batch, l.seq, l.heads, l.dim));
        // SAFETY: the backward kernels write every element of dQ, dK and dV.
        let alloc = |l: Layout| unsafe { device.alloc::<T>(l.len()) };
        let (mut dq, mut dk, mut dv) = (alloc(shapes[0])?, alloc(shapes[1])?, alloc(shapes[2])?);
        let tensor_guards: Vec<_> = self.tensors().map(|t| t.storage_and_layout()).collect();
        let args = self.arg_values(&tensor_guards)?;
        let mut d_tensors = self.tensor_grad_buffers(&device)?;
        let io = BackwardIo {
            q,
            k,
            v,
            o: o_io,
            lse,
            d_o: d_o_io,
            dq: (&mut dq, shapes[0]),
            dk: (&mut dk, shapes[1]),
            dv: (&mut dv, shapes[2]),
            d_tensors: d_tensors.iter_mut().map(Option::as_mut).collect(),
        };
        let workspace = self.attention.workspace(&device)?;
        let block_mask = self.block_mask.lock().unwrap_or_else(PoisonError::into_inner);
        let opts = BackwardOptions {
            scale: self.attention.scale(),
            workspace: Some(&workspace),
            block_mask: block_mask.as_ref(),
            ..Default::default()
        };
        launch(&rt, io, &args, &opts).map_err(error::flashgen)?;
        let wrap = |slice, l: Layout| tensor(slice, &device, (l.batch, l.seq, l.heads, l.dim));
        let qkv = [wrap(dq, shapes[0])?, wrap(dk, shapes[1])?, wrap(dv, shapes[2])?];
        Ok(Grads { qkv, tensors: self.tensor_grads(d_tensors, &device)? })
    }

    /// dO as flashgen can address it (a compact copy where it cannot).
    pub(crate) fn addressable_d_o(&self, d_o: &Tensor) -> candle_core::Result<Tensor> {
        match operand_layout("dO", d_o.layout())? {
            Some(_) => Ok(d_o.clone()),
            None => d_o.contiguous(),
        }
    }

    /// The block mask of a mask that reads captured tensors (no other mask
    /// needs one: its interval analysis is exact enough without).
    fn build_block_mask(
        &self,
        rt: &Runtime,
        [q, k]: [Layout; 2],
        args: &[ArgValue<'_>],
    ) -> candle_core::Result<Option<BlockMask>> {
        let spec = self.attention.spec();
        if !spec.mask.as_ref().is_some_and(flashgen::codegen::Expr::reads_tensor) {
            return Ok(None);
        }
        let shape = flashgen::Shape { batch: q.batch, heads: q.heads, heads_kv: k.heads, q_len: q.seq, kv_len: k.seq };
        rt.block_mask(spec, shape, args).map(Some).map_err(error::flashgen)
    }

    pub(crate) fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.args.iter().filter_map(|a| match a {
            Arg::Tensor(t) => Some(t),
            _ => None,
        })
    }

    /// flashgen's launch values, borrowing the captured tensors' storage.
    pub(crate) fn arg_values<'g>(
        &self,
        guards: &'g [(candle_core::StorageRef<'_>, &candle_core::Layout)],
    ) -> candle_core::Result<Vec<ArgValue<'g>>> {
        let spec = self.attention.spec();
        let scalars = self.args.iter().filter_map(|a| match *a {
            Arg::I32(v) => Some(Ok(ArgValue::I32(v))),
            Arg::F32(v) => Some(Ok(ArgValue::F32(v))),
            Arg::Tensor(_) => None,
        });
        let tensors = guards.iter().zip(&spec.tensors).map(|((storage, _), decl)| {
            let slice = cuda_storage(storage, &decl.name)?;
            Ok(match &slice.slice {
                candle_core::cuda_backend::CudaStorageSlice::I32(s) => ArgValue::I32s(s),
                candle_core::cuda_backend::CudaStorageSlice::F32(s) => ArgValue::F32s(s),
                candle_core::cuda_backend::CudaStorageSlice::F16(s) => ArgValue::F16s(s),
                candle_core::cuda_backend::CudaStorageSlice::BF16(s) => ArgValue::Bf16s(s),
                _ => {
                    let (operand, got) = (decl.name.clone(), slice.dtype());
                    return Err(Error::Dtype { operand, got, expected: "i32, f32, f16 or bf16" }.into());
                }
            })
        });
        // Call::new checked that params and tensors sit in their slots.
        scalars.chain(tensors).collect()
    }

    /// A zeroed f32 buffer per trained tensor (the kernels add into it).
    pub(crate) fn tensor_grad_buffers(&self, device: &CudaDevice) -> candle_core::Result<Vec<Option<CudaSlice<f32>>>> {
        let counts = self.tensors().map(Tensor::elem_count);
        counts.zip(&self.train).map(|(n, &train)| train.then(|| device.alloc_zeros::<f32>(n)).transpose()).collect()
    }

    /// The tensor gradients as tensors of their tensors' shapes and dtypes.
    pub(crate) fn tensor_grads(
        &self,
        buffers: Vec<Option<CudaSlice<f32>>>,
        device: &CudaDevice,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let grads = buffers.into_iter().zip(self.tensors()).map(|(buffer, t)| {
            let Some(buffer) = buffer else { return Ok(None) };
            let grad = tensor(buffer, device, t.shape().clone())?;
            Ok(Some(if t.dtype() == DType::F32 { grad } else { grad.to_dtype(t.dtype())? }))
        });
        grads.collect()
    }
}

/// Checks that `t` is a CUDA tensor on Q's device.
fn check_device(operand: &str, t: &Tensor, q: &Tensor) -> Result<(), Error> {
    match (t.device(), q.device()) {
        (candle_core::Device::Cuda(a), candle_core::Device::Cuda(b)) if a.id() == b.id() => Ok(()),
        (candle_core::Device::Cuda(_), candle_core::Device::Cuda(_)) => {
            Err(Error::Devices { operand: operand.to_string() })
        }
        (candle_core::Device::Cuda(_), _) => Err(Error::NotCuda { operand: "Q".to_string() }),
        _ => Err(Error::NotCuda { operand: operand.to_string() }),
    }
}

pub(crate) fn cuda_device(t: &Tensor, operand: &str) -> Result<CudaDevice, Error> {
    match t.device() {
        candle_core::Device::Cuda(device) => Ok(device.clone()),
        _ => Err(Error::NotCuda { operand: operand.to_string() }),
    }
}

fn cuda_storage<'s>(storage: &'s Storage, operand: &str) -> Result<&'s CudaStorage, Error> {
    match storage {
        Storage::Cuda(s) => Ok(s),
        _ => Err(Error::NotCuda { operand: operand.to_string() }),
    }
}

/// Elements in a storage's buffer (a view's tensor may use fewer).
fn storage_len(storage: &Storage) -> usize {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    let Storage::Cuda(storage) = storage else { return 0 };
    match &storage.slice {
        S::U8(s) | S::F6E2M3(s) | S::F6E3M2(s) | S::F4(s) | S::F8E8M0(s) => s.len(),
        S::U32(s) => s.len(),
        S::I16(s) => s.len(),
        S::I32(s) => s.len(),
        S::I64(s) => s.len(),
        S::BF16(s) => s.len(),
        S::F16(s) => s.len(),
        S::F32(s) => s.len(),
        S::F64(s) => s.len(),
        S::F8E4M3(s) => s.len(),
    }
}

/// The `[batch, seq, heads, dim]` operands behind `guards` as flashgen
/// reads them: each tensor's whole buffer and the layout addressing it.
pub(crate) fn operands<'g, T: Element + CudaDType + DeviceRepr, const N: usize>(
    names: [&str; N],
    guards: &'g [(candle_core::StorageRef<'_>, &candle_core::Layout); N],
) -> [candle_core::Result<(&'g dyn flashgen::DeviceInput<T>, Layout)>; N] {
    std::array::from_fn(|i| {
        let ((storage, layout), name) = (&guards[i], names[i]);
        let wrong_dtype =
            |_| Error::Dtype { operand: name.to_string(), got: storage.dtype(), expected: T::DTYPE.name() };
        let slice: &dyn flashgen::DeviceInput<T> =
            cuda_storage(storage, name)?.as_cuda_slice::<T>().map_err(wrong_dtype)?;
        // Q, K, V and dO were made addressable before; O is compact.
        let layout = operand_layout(name, layout)?.ok_or_else(|| candle_core::Error::msg("flashgen: layout"))?;
        Ok((slice, layout))
    })
}

/// A compact candle tensor owning `slice`, outside the graph.
pub(crate) fn tensor<T: CudaDType>(
    slice: CudaSlice<T>,
    device: &CudaDevice,
    shape: impl Into<Shape>,
) -> candle_core::Result<Tensor> {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, device.clone()));
    Ok(Tensor::from_storage(storage, shape, candle_core::op::BackpropOp::none(), false))
}
