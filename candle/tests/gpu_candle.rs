//! The candle op on a GPU, against flashgen's f64 reference and candle's own
//! attention (`flashgen_candle::plain`): forward and backward, bf16 and f16,
//! GQA, strided and offset views, a trained captured tensor. Ignored without
//! a GPU; run with `--include-ignored` (scripts/gpu-pack.sh does).

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{check_forward, check_gradients, host, spec, tensor, Case, Random};
use flashgen::codegen::reference::{self, ParamValue, Precision, TensorData};
use flashgen::{Shape, Spec};
use flashgen_candle::{plain, Arg, Attention};

const WINDOW: &str = "Window { dtype: DTYPE, head_dim: 64, param window: i32, mask: q >= k && q - k < window }";
const DOCUMENT: &str =
    "Document { dtype: DTYPE, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }";
const ALIBI: &str = "Alibi { dtype: DTYPE, head_dim: 64, tensor slopes: f32[H], mask: q >= k, \
                     score: score + slopes[h] * (k - q) as f32 }";

fn device() -> Device {
    Device::new_cuda(0).expect("a CUDA GPU")
}

fn window_keep(q_len: usize, kv_len: usize, window: usize, dev: &Device) -> Tensor {
    let keep: Vec<u8> =
        (0..q_len * kv_len).map(|i| (i / kv_len >= i % kv_len && i / kv_len - i % kv_len < window) as u8).collect();
    Tensor::from_vec(keep, (q_len, kv_len), dev).unwrap()
}

#[test]
#[ignore = "needs a GPU"]
fn the_forward_matches_the_f64_reference_and_candles_attention() {
    let dev = device();
    for dtype in [DType::BF16, DType::F16] {
        let spec = spec(WINDOW, dtype);
        let shape = Shape { batch: 2, heads: 8, heads_kv: 2, q_len: 300, kv_len: 300 };
        let case = Case::new(shape, dtype, vec![ParamValue::I32(100)], vec![], &dev);
        let o = Attention::new(&spec).forward(&case.q, &case.k, &case.v, &[Arg::I32(100)]).unwrap();
        assert_eq!(o.dims(), &[2, 300, 8, 64]);
        assert_eq!(o.dtype(), dtype);
        let golden = reference::forward(&spec, &case.problem, Precision::F64).unwrap();
        let same = reference::forward(&spec, &case.problem, Precision::SameDtype(spec.dtype)).unwrap();
        let check = reference::flash_rule(&host(&o), &same.o, &golden.o, reference::FORWARD_FACTOR);
        println!("{dtype:?} against the reference: {check}");
        assert!(check.passed, "{dtype:?}: {check}");

        let keep = window_keep(300, 300, 100, &dev);
        let candle_o = plain::attention(&case.q, &case.k, &case.v, 0.125, None, Some(&keep)).unwrap();
        let check = reference::flash_rule(&host(&o), &host(&candle_o), &golden.o, reference::FORWARD_FACTOR);
        println!("{dtype:?} against candle's attention: {check}");
        assert!(check.passed, "{dtype:?} with candle's attention as the baseline: {check}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn views_are_read_in_place() {
    let dev = device();
    let spec = spec(WINDOW, DType::BF16);
    let attention = Attention::new(&spec);
    let mut random = Random::new();
    let (b, s, h, hk) = (2, 257, 8, 2);
    // One fused projection [b, s, h + 2 hk, 64]: Q, K and V are narrow views of it.
    let fused =
        tensor(&random.values(b * s * (h + 2 * hk) * 64, DType::BF16), &[b, s, h + 2 * hk, 64], DType::BF16, &dev);
    let (q, k, v) =
        (fused.narrow(2, 0, h).unwrap(), fused.narrow(2, h, hk).unwrap(), fused.narrow(2, h + hk, hk).unwrap());
    let args = [Arg::I32(64)];
    let of_views = attention.forward(&q, &k, &v, &args).unwrap();
    let [qc, kc, vc] = [&q, &k, &v].map(|t| t.force_contiguous().unwrap());
    let of_copies = attention.forward(&qc, &kc, &vc, &args).unwrap();
    assert_eq!(host(&of_views), host(&of_copies), "fused QKV views");
    // [b, h, s, d] tensors seen as [b, s, h, d].
    let [qt, kt, vt] =
        [&qc, &kc, &vc].map(|t| t.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap());
    assert!(!qt.is_contiguous());
    let of_transposed = attention.forward(&qt, &kt, &vt, &args).unwrap();
    assert_eq!(host(&of_transposed), host(&of_copies), "transposed views");
    // A head dim that is not contiguous is copied, with the same result.
    let strided = qc.transpose(1, 3).unwrap().contiguous().unwrap().transpose(1, 3).unwrap();
    assert_eq!(host(&attention.forward(&strided, &kc, &vc, &args).unwrap()), host(&of_copies), "copied");
}

/// dQ, dK, dV (and tensor gradients) of `loss = sum(O ∘ dO)` against the
/// reference, each by FlashAttention's backward rule.
fn check_backward(spec: &Spec, case: &Case, vars: &[&Var], o: &Tensor, d_o_values: &[f64], tensor_vars: &[&Var]) {
    let d_o = tensor(d_o_values, o.dims(), o.dtype(), o.device());
    let grads = (o * &d_o).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |var: &Var| host(grads.get(var.as_tensor()).unwrap());
    let qkv = [grad(vars[0]), grad(vars[1]), grad(vars[2])];
    let d_tensors: Vec<Vec<f64>> = tensor_vars.iter().map(|v| grad(v)).collect();
    let d_tensors: Vec<&[f64]> = d_tensors.iter().map(Vec::as_slice).collect();
    check_gradients(spec, &case.problem, d_o_values, qkv.each_ref().map(Vec::as_slice), &d_tensors);
}

#[test]
#[ignore = "needs a GPU"]
fn the_backward_matches_the_f64_reference() {
    let dev = device();
    for dtype in [DType::BF16, DType::F16] {
        let spec = spec(WINDOW, dtype);
        let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 190, kv_len: 190 };
        let case = Case::new(shape, dtype, vec![ParamValue::I32(80)], vec![], &dev);
        let vars = [&case.q, &case.k, &case.v].map(|t| Var::from_tensor(t).unwrap());
        // Q read through a transposed view: its gradient still has Q's shape.
        let q_view = vars[0].transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap();
        let o = Attention::new(&spec).forward(&q_view, &vars[1], &vars[2], &[Arg::I32(80)]).unwrap();
        let d_o = Random::new().values(o.elem_count(), dtype);
        check_backward(&spec, &case, &[&vars[0], &vars[1], &vars[2]], &o, &d_o, &[]);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn trained_captured_tensors_get_gradients() {
    let dev = device();
    let spec = spec(ALIBI, DType::BF16);
    let shape = Shape { batch: 2, heads: 4, heads_kv: 4, q_len: 160, kv_len: 160 };
    let slopes: Vec<f64> = (0..4).map(|h| 2f64.powi(-(h + 1))).collect();
    let tensors = vec![TensorData::Float(slopes.clone())];
    let case = Case::new(shape, DType::BF16, vec![], tensors, &dev);
    let vars = [&case.q, &case.k, &case.v].map(|t| Var::from_tensor(t).unwrap());
    let slopes = Var::from_tensor(&tensor(&slopes, &[4], DType::F32, &dev)).unwrap();
    let o = Attention::new(&spec).forward(&vars[0], &vars[1], &vars[2], &[slopes.as_tensor().into()]).unwrap();
    let d_o = Random::new().values(o.elem_count(), DType::BF16);
    check_backward(&spec, &case, &[&vars[0], &vars[1], &vars[2]], &o, &d_o, &[&slopes]);
}

#[test]
#[ignore = "needs a GPU"]
fn a_mask_that_reads_a_tensor_runs_with_its_block_mask() {
    let dev = device();
    let spec = spec(DOCUMENT, DType::BF16);
    let (batch, seq) = (2, 400);
    // Documents of 150, 90 and 160 tokens in row 0; 300 and 100 in row 1.
    let ids: Vec<i32> = (0..batch * seq)
        .map(|i| {
            let (b, t) = (i / seq, i % seq);
            match b {
                0 => (t >= 150) as i32 + (t >= 240) as i32,
                _ => (t >= 300) as i32,
            }
        })
        .collect();
    let shape = Shape { batch, heads: 4, heads_kv: 2, q_len: seq, kv_len: seq };
    let case = Case::new(shape, DType::BF16, vec![], vec![TensorData::I32(ids.clone())], &dev);
    let doc = Tensor::from_vec(ids, (batch, seq), &dev).unwrap();
    let vars = [&case.q, &case.k, &case.v].map(|t| Var::from_tensor(t).unwrap());
    let o = Attention::new(&spec).forward(&vars[0], &vars[1], &vars[2], &[(&doc).into()]).unwrap();
    check_forward("document forward", &spec, &case.problem, &host(&o));
    let d_o = Random::new().values(o.elem_count(), DType::BF16);
    check_backward(&spec, &case, &[&vars[0], &vars[1], &vars[2]], &o, &d_o, &[]);
}

#[test]
#[ignore = "needs a GPU"]
fn bad_operands_are_candle_errors() {
    let dev = device();
    let attention = Attention::new(&spec(WINDOW, DType::BF16));
    let t = |dims: &[usize], dtype| Tensor::zeros(dims, dtype, &dev).unwrap();
    let (q, kv) = (t(&[1, 64, 6, 64], DType::BF16), t(&[1, 64, 4, 64], DType::BF16));
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let f16 = t(&[1, 64, 6, 64], DType::F16);
    assert!(err(attention.forward(&f16, &f16, &f16, &[Arg::I32(4)])).contains("F16"));
    assert!(err(attention.forward(&q, &kv, &kv, &[Arg::I32(4)])).contains("head"), "6 heads over 4 K/V heads");
    assert!(err(attention.forward(&q, &q, &q, &[])).contains("declares 1"));
    assert!(err(attention.forward(&q, &q, &q, &[Arg::F32(4.0)])).contains("window"));
    let cpu = Tensor::zeros((1, 64, 6, 64), DType::BF16, &Device::Cpu).unwrap();
    assert!(err(attention.forward(&q, &cpu, &q, &[Arg::I32(4)])).contains("K is not on a CUDA device"));
}
