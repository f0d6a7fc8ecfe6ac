//! Launch values of a spec's runtime params and captured tensors.

use crate::error::Error;
use crate::few::{Few, Kept};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use flashgen_codegen::reference::ParamValue;
use flashgen_codegen::{Dim, ElemTy, Shape, Spec, TensorDecl, Ty};
use half::{bf16, f16};
use std::borrow::Cow;

/// One runtime param or captured tensor: params first, then tensors, each
/// in declaration order. Every variant converts with `From`.
#[derive(Clone, Copy, Debug)]
pub enum ArgValue<'a> {
    I32(i32),
    F32(f32),
    I32s(&'a CudaSlice<i32>),
    F32s(&'a CudaSlice<f32>),
    F16s(&'a CudaSlice<f16>),
    Bf16s(&'a CudaSlice<bf16>),
}

macro_rules! from_impls {
    ($($ty:ty => $variant:ident),* $(,)?) => {$(
        impl<'a> From<$ty> for ArgValue<'a> {
            fn from(value: $ty) -> Self {
                ArgValue::$variant(value)
            }
        }
    )*};
}

from_impls! {
    i32 => I32,
    f32 => F32,
    &'a CudaSlice<i32> => I32s,
    &'a CudaSlice<f32> => F32s,
    &'a CudaSlice<f16> => F16s,
    &'a CudaSlice<bf16> => Bf16s,
}

/// An argument without its device buffer: what the checks and the
/// marshalling need, constructible without a GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum ArgInfo {
    I32(i32),
    F32(f32),
    Tensor(ElemTy, usize),
}

/// A reference evaluation's param value, as a launch's.
impl From<ParamValue> for ArgValue<'_> {
    fn from(value: ParamValue) -> Self {
        match value {
            ParamValue::I32(v) => ArgValue::I32(v),
            ParamValue::F32(v) => ArgValue::F32(v),
        }
    }
}

impl ArgValue<'_> {
    pub(crate) fn info(&self) -> ArgInfo {
        match *self {
            ArgValue::I32(v) => ArgInfo::I32(v),
            ArgValue::F32(v) => ArgInfo::F32(v),
            ArgValue::I32s(s) => ArgInfo::Tensor(ElemTy::I32, s.len()),
            ArgValue::F32s(s) => ArgInfo::Tensor(ElemTy::F32, s.len()),
            ArgValue::F16s(s) => ArgInfo::Tensor(ElemTy::F16, s.len()),
            ArgValue::Bf16s(s) => ArgInfo::Tensor(ElemTy::Bf16, s.len()),
        }
    }

    /// A tensor's device address, with the guard that orders the launch after
    /// pending writes to it (drop it after the launch); `None` for scalars.
    pub(crate) fn device_ptr<'s>(&'s self, stream: &'s CudaStream) -> Option<(u64, SyncOnDrop<'s>)> {
        match self {
            ArgValue::I32(_) | ArgValue::F32(_) => None,
            ArgValue::I32s(s) => Some(s.device_ptr(stream)),
            ArgValue::F32s(s) => Some(s.device_ptr(stream)),
            ArgValue::F16s(s) => Some(s.device_ptr(stream)),
            ArgValue::Bf16s(s) => Some(s.device_ptr(stream)),
        }
    }
}

impl ArgInfo {
    fn type_name(self) -> &'static str {
        match self {
            ArgInfo::I32(_) => "i32",
            ArgInfo::F32(_) => "f32",
            ArgInfo::Tensor(ElemTy::I32, _) => "CudaSlice<i32>",
            ArgInfo::Tensor(ElemTy::F32, _) => "CudaSlice<f32>",
            ArgInfo::Tensor(ElemTy::F16, _) => "CudaSlice<f16>",
            ArgInfo::Tensor(ElemTy::Bf16, _) => "CudaSlice<bf16>",
        }
    }
}

/// The device pointers of the captured tensors among `args`, in order, and
/// the guards that order a launch after pending work on them and record it
/// for later work: keep the guards until after the launch. Inline for up
/// to [`FEW`](crate::few::FEW) tensors.
pub(crate) fn tensor_ptrs<'s>(args: &'s [ArgValue<'_>], stream: &'s CudaStream) -> (Few<u64>, Kept<SyncOnDrop<'s>>) {
    let (mut ptrs, mut guards) = (Few::new(0), Kept::default());
    for (ptr, guard) in args.iter().filter_map(|a| a.device_ptr(stream)) {
        ptrs.push(ptr);
        guards.push(guard);
    }
    (ptrs, guards)
}

/// Checks `args` against the spec's params and tensors for a launch of `shape`.
pub(crate) fn check_args(spec: &Spec, shape: &Shape, args: &[ArgInfo]) -> Result<(), Error> {
    let expected = spec.params.len() + spec.tensors.len();
    if args.len() != expected {
        return Err(Error::ArgCount { expected, got: args.len(), signature: signature(spec) });
    }
    let (params, tensors) = args.split_at(spec.params.len());
    for (param, &arg) in spec.params.iter().zip(params) {
        if !matches!((param.ty, arg), (Ty::I32, ArgInfo::I32(_)) | (Ty::F32, ArgInfo::F32(_))) {
            let expected = param.ty.name().to_string();
            return Err(Error::ArgType { name: param.name.clone(), expected, got: arg.type_name() });
        }
    }
    for (tensor, &arg) in spec.tensors.iter().zip(tensors) {
        match arg {
            ArgInfo::Tensor(elem, len) if elem == tensor.elem => {
                let tensor = bound(tensor, params);
                tensor.check_dims(shape).map_err(Error::TensorDim)?;
                let needed = tensor.len(shape);
                if len < needed {
                    return Err(Error::TensorTooSmall { name: tensor.name.clone(), len, needed });
                }
            }
            _ => {
                let expected = format!("CudaSlice<{}> for {}", tensor.elem.name(), tensor_decl(tensor));
                return Err(Error::ArgType { name: tensor.name.clone(), expected, got: arg.type_name() });
            }
        }
    }
    Ok(())
}

/// `tensor` with its dims' params ([`flashgen_codegen::Dim::Param`]) bound
/// to their values in `args` (the launch's params first, as [`check_args`]
/// reads them): a copy only where a dim reads a param (a shard's view), so
/// other launches check their tensors without allocating.
pub(crate) fn bound<'t>(tensor: &'t TensorDecl, args: &[ArgInfo]) -> Cow<'t, TensorDecl> {
    fn reads_param(dim: &Dim) -> bool {
        match dim {
            Dim::Param(_) => true,
            Dim::Op(_, a, b) => reads_param(a) || reads_param(b),
            _ => false,
        }
    }
    if !tensor.dims.iter().any(reads_param) {
        return Cow::Borrowed(tensor);
    }
    Cow::Owned(tensor.bind_params(&|i| match args.get(i) {
        Some(ArgInfo::I32(v)) => Some(*v),
        _ => None,
    }))
}

/// `window: i32, slopes: f32[H]`, for error messages.
pub(crate) fn signature(spec: &Spec) -> String {
    let params = spec.params.iter().map(|p| format!("{}: {}", p.name, p.ty));
    let tensors = spec.tensors.iter().map(|t| format!("{}: {}", t.name, tensor_decl(t)));
    let all: Vec<String> = params.chain(tensors).collect();
    if all.is_empty() {
        "the spec declares no params or tensors".to_string()
    } else {
        all.join(", ")
    }
}

fn tensor_decl(t: &TensorDecl) -> String {
    let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
    format!("{}[{}]", t.elem.name(), dims.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Spec {
        flashgen_codegen::parse_one(
            "S { dtype: bf16, head_dim: 64, param window: i32, param cap: f32, tensor slopes: f32[H], \
             tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q - k < window, \
             score: cap * tanh(score / cap) + slopes[h] }",
        )
        .unwrap()
    }

    const SHAPE: Shape = Shape { batch: 2, heads: 8, heads_kv: 2, q_len: 100, kv_len: 300 };
    const GOOD: [ArgInfo; 4] =
        [ArgInfo::I32(128), ArgInfo::F32(30.0), ArgInfo::Tensor(ElemTy::F32, 8), ArgInfo::Tensor(ElemTy::I32, 600)];

    #[test]
    fn accepts_matching_args() {
        check_args(&spec(), &SHAPE, &GOOD).unwrap();
        // Larger buffers are fine.
        let mut args = GOOD;
        args[3] = ArgInfo::Tensor(ElemTy::I32, 10_000);
        check_args(&spec(), &SHAPE, &args).unwrap();
    }

    #[test]
    fn wrong_count_lists_the_signature() {
        let err = check_args(&spec(), &SHAPE, &GOOD[..3]).unwrap_err();
        assert!(matches!(err, Error::ArgCount { expected: 4, got: 3, .. }), "{err}");
        assert!(err.to_string().contains("window: i32, cap: f32, slopes: f32[H], doc: i32[B, KV_LEN]"), "{err}");
    }

    #[test]
    fn wrong_types_name_the_argument() {
        for (i, bad, name) in [
            (0, ArgInfo::F32(1.0), "window"),
            (1, ArgInfo::I32(1), "cap"),
            (2, ArgInfo::Tensor(ElemTy::F16, 8), "slopes"),
            (3, ArgInfo::I32(0), "doc"),
        ] {
            let mut args = GOOD;
            args[i] = bad;
            let err = check_args(&spec(), &SHAPE, &args).unwrap_err();
            assert!(matches!(&err, Error::ArgType { name: n, .. } if n == name), "{err}");
            assert!(err.to_string().contains(bad.type_name()), "{err}");
        }
    }

    #[test]
    fn dimension_expressions_are_checked_before_sizes() {
        let spec =
            flashgen_codegen::parse_one("S { dtype: bf16, head_dim: 64, tensor rel: f32[H, Q_LEN - KV_LEN] }").unwrap();
        let args = [ArgInfo::Tensor(ElemTy::F32, 1 << 20)];
        let err = check_args(&spec, &SHAPE, &args).unwrap_err();
        assert!(matches!(&err, Error::TensorDim(e) if e.value == Some(-200)), "{err}");
        assert_eq!(
            err.to_string(),
            "tensor `rel`: dimension `Q_LEN - KV_LEN` is -200 for this launch; it must be at least 1"
        );
        let longer_queries = Shape { q_len: 310, ..SHAPE };
        check_args(&spec, &longer_queries, &args).unwrap();
        let err = check_args(&spec, &longer_queries, &[ArgInfo::Tensor(ElemTy::F32, 79)]).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: 80, .. }), "{err}");
    }

    #[test]
    fn too_small_tensor() {
        let mut args = GOOD;
        args[3] = ArgInfo::Tensor(ElemTy::I32, 599);
        let err = check_args(&spec(), &SHAPE, &args).unwrap_err();
        assert!(matches!(&err, Error::TensorTooSmall { name, len: 599, needed: 600 } if name == "doc"), "{err}");
        // A shape whose element count overflows can never be satisfied.
        let huge = Shape { batch: usize::MAX, kv_len: 2, ..SHAPE };
        let err = check_args(&spec(), &huge, &GOOD).unwrap_err();
        assert!(matches!(err, Error::TensorTooSmall { needed: usize::MAX, .. }), "{err}");
    }
}
