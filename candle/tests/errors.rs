//! What the op rejects before it needs a GPU.

use candle_core::{DType, Device, Tensor};
use flashgen_candle::{Arg, Attention};

#[test]
fn cpu_tensors_are_refused_by_name() {
    let spec = flashgen::parse_one("Causal { dtype: bf16, head_dim: 64, mask: q >= k }").unwrap();
    let q = Tensor::zeros((1, 16, 2, 64), DType::BF16, &Device::Cpu).unwrap();
    let err = Attention::new(&spec).forward(&q, &q, &q, &[]).unwrap_err();
    assert!(err.to_string().contains("Q is not on a CUDA device"), "{err}");
}

#[test]
fn args_convert_from_scalars_and_tensors() {
    let t = Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(Arg::from(3), Arg::I32(3)));
    assert!(matches!(Arg::from(0.5f32), Arg::F32(v) if v == 0.5));
    assert!(matches!(Arg::from(&t), Arg::Tensor(ref a) if a.id() == t.id()));
}
