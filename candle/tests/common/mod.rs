//! What the GPU tests share: specs by dtype, fresh random values the dtype
//! holds exactly, host copies, and checks by FlashAttention's rule against
//! flashgen's f64 reference.
#![allow(dead_code)] // each test binary uses its own part

use candle_core::{DType, Device, Tensor};
use flashgen::codegen::reference::{self, ParamValue, Precision, Problem, TensorData};
use flashgen::{parse_one, Shape, Spec};

pub fn spec(source: &str, dtype: DType) -> Spec {
    let name = if dtype == DType::BF16 { "bf16" } else { "f16" };
    parse_one(&source.replace("DTYPE", name)).unwrap()
}

/// Values uniform in [-1, 1) that the dtype holds exactly (fresh per run).
pub struct Random(pub u64);

impl Random {
    pub fn new() -> Random {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let seed = nanos as u64 | 1;
        println!("seed {seed}");
        Random(seed)
    }

    pub fn values(&mut self, n: usize, dtype: DType) -> Vec<f64> {
        let round = |x: f64| match dtype {
            DType::BF16 => flashgen::half::bf16::from_f64(x).to_f64(),
            _ => flashgen::half::f16::from_f64(x).to_f64(),
        };
        (0..n)
            .map(|_| {
                self.0 ^= self.0 >> 12;
                self.0 ^= self.0 << 25;
                self.0 ^= self.0 >> 27;
                let unit = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
                round(2.0 * unit - 1.0)
            })
            .collect()
    }
}

pub fn tensor(values: &[f64], dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    Tensor::from_vec(values.to_vec(), dims, dev).unwrap().to_dtype(dtype).unwrap()
}

pub fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// One problem's host values (the reference's) and its tensors on the GPU.
pub struct Case {
    pub problem: Problem,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

impl Case {
    pub fn new(shape: Shape, dtype: DType, params: Vec<ParamValue>, tensors: Vec<TensorData>, dev: &Device) -> Case {
        let mut random = Random::new();
        let (b, h, hk) = (shape.batch, shape.heads, shape.heads_kv);
        let q = random.values(b * shape.q_len * h * 64, dtype);
        let k = random.values(b * shape.kv_len * hk * 64, dtype);
        let v = random.values(b * shape.kv_len * hk * 64, dtype);
        let (q_dims, kv_dims) = ([b, shape.q_len, h, 64], [b, shape.kv_len, hk, 64]);
        let (qt, kt, vt) =
            (tensor(&q, &q_dims, dtype, dev), tensor(&k, &kv_dims, dtype, dev), tensor(&v, &kv_dims, dtype, dev));
        let problem = Problem { shape, q, k, v, scale: (1.0 / 8f32) as f64, params, tensors };
        Case { problem, q: qt, k: kt, v: vt }
    }
}

/// O against the reference, by FlashAttention's forward rule.
pub fn check_forward(name: &str, spec: &Spec, problem: &Problem, o: &[f64]) {
    let golden = reference::forward(spec, problem, Precision::F64).unwrap();
    let same = reference::forward(spec, problem, Precision::SameDtype(spec.dtype)).unwrap();
    let check = reference::flash_rule(o, &same.o, &golden.o, reference::FORWARD_FACTOR);
    println!("{name}: {check}");
    assert!(check.passed, "{name}: {check}");
}

/// dQ, dK, dV and the trained tensors' gradients (host values) of `loss =
/// sum(O ∘ dO)` against the reference, each by FlashAttention's backward rule.
pub fn check_gradients(spec: &Spec, problem: &Problem, d_o: &[f64], qkv: [&[f64]; 3], d_tensors: &[&[f64]]) {
    let golden = reference::backward(spec, problem, d_o).unwrap();
    let baselines = reference::same_dtype_backwards(spec, problem, d_o, reference::BACKWARD_BASELINES).unwrap();
    let check = |name: &str, got: &[f64], golden: &[f64], pick: &dyn Fn(&reference::Gradients) -> &[f64]| {
        let check = reference::flash_rule_averaged(got, baselines.iter().map(pick), golden, reference::BACKWARD_FACTOR);
        println!("{name}: {check}");
        assert!(check.passed, "{name}: {check}");
    };
    check("dQ", qkv[0], &golden.dq, &|g| &g.dq);
    check("dK", qkv[1], &golden.dk, &|g| &g.dk);
    check("dV", qkv[2], &golden.dv, &|g| &g.dv);
    for (i, got) in d_tensors.iter().enumerate() {
        let want = golden.d_tensors[i].as_ref().unwrap();
        check("d tensor", got, want, &|g| g.d_tensors[i].as_deref().unwrap());
    }
}
