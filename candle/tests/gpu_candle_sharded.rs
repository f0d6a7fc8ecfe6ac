//! Context parallelism on candle tensors over NCCL (feature `nccl`): every
//! GPU of the machine is a rank (one thread each; one GPU makes a world of
//! one), each holding its rows of Q, K and V; the ranks' O and gradients,
//! put back in sequence order, against flashgen's f64 reference. Ignored
//! without a GPU.
#![cfg(feature = "nccl")]

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{check_forward, check_gradients, host, spec, tensor, Random};
use flashgen::codegen::reference::{Problem, TensorData};
use flashgen::Shape;
use flashgen_candle::sharded::{self, Partition, Schedule, Sharding, Whole};
use flashgen_candle::{Arg, Attention, ContextParallel};

const DOCUMENT: &str =
    "Document { dtype: DTYPE, head_dim: 64, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }";
const ALIBI: &str = "Alibi { dtype: DTYPE, head_dim: 64, tensor slopes: f32[H], mask: q >= k, \
                     score: score + slopes[h] * (k - q) as f32 }";

/// The whole problem's rows `rows` (per batch row, position ranges) of a
/// `[batch, len, heads, dim]` array, in order.
fn take_rows(values: &[f64], batch: usize, len: usize, rows: &[(usize, usize)]) -> Vec<f64> {
    let row = values.len() / (batch * len);
    let mut out = Vec::new();
    for b in 0..batch {
        for &(start, n) in rows {
            out.extend_from_slice(&values[(b * len + start) * row..(b * len + start + n) * row]);
        }
    }
    out
}

/// Writes a rank's rows (as [`take_rows`] took them) back into `whole`.
fn put_rows(whole: &mut [f64], part: &[f64], batch: usize, len: usize, rows: &[(usize, usize)]) {
    let row = whole.len() / (batch * len);
    let mut at = 0;
    for b in 0..batch {
        for &(start, n) in rows {
            whole[(b * len + start) * row..(b * len + start + n) * row].copy_from_slice(&part[at..at + n * row]);
            at += n * row;
        }
    }
}

/// What one rank computed, as host values: O, dQ, dK, dV and the trained
/// tensor's gradient (its share of the sum).
struct RankResult {
    rows: Vec<(usize, usize)>,
    o: Vec<f64>,
    grads: [Vec<f64>; 3],
    d_tensor: Option<Vec<f64>>,
}

/// One rank's forward and backward, on its own thread and GPU.
fn rank(
    attention: &Attention,
    problem: &Problem,
    d_o: &[f64],
    cp: ContextParallel,
    device: &Device,
    trained: bool,
) -> RankResult {
    let shape = problem.shape;
    let (batch, len) = (shape.batch, shape.q_len);
    let rows = cp.rows(len);
    let local: usize = rows.iter().map(|r| r.1).sum();
    let dtype = if attention.spec().dtype == flashgen::Dtype::Bf16 { DType::BF16 } else { DType::F16 };
    let operand = |values: &[f64], heads| {
        let t = tensor(&take_rows(values, batch, len, &rows), &[batch, local, heads, 64], dtype, device);
        Var::from_tensor(&t).unwrap()
    };
    let (q, k, v) =
        (operand(&problem.q, shape.heads), operand(&problem.k, shape.heads_kv), operand(&problem.v, shape.heads_kv));
    let (args, tensor_var) = match &problem.tensors[..] {
        [TensorData::Float(slopes)] => {
            let var = Var::from_tensor(&tensor(slopes, &[slopes.len()], DType::F32, device)).unwrap();
            (vec![Arg::from(var.as_tensor())], trained.then_some(var))
        }
        [TensorData::I32(ids)] => {
            (vec![Arg::Tensor(Tensor::from_vec(ids.clone(), (batch, len), device).unwrap())], None)
        }
        _ => (vec![], None),
    };
    let o = attention.forward_sharded(&q, &k, &v, &args, &cp).unwrap();
    let d_o = tensor(&take_rows(d_o, batch, len, &rows), o.dims(), dtype, device);
    let grads = (&o * &d_o).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = |var: &Var| host(grads.get(var.as_tensor()).unwrap());
    RankResult { o: host(&o), grads: [grad(&q), grad(&k), grad(&v)], d_tensor: tensor_var.as_ref().map(grad), rows }
}

/// Every rank's results put back in sequence order (tensor gradients summed)
/// and checked against the reference.
fn check_sharded(name: &str, source: &str, tensors: Vec<TensorData>, sharding: Sharding, schedule: Schedule) {
    let devices: Vec<Device> = (0..sharding.ranks).map(|i| Device::new_cuda(i).unwrap()).collect();
    let spec = spec(source, DType::BF16);
    let len = 192 * sharding.ranks;
    let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: len, kv_len: len };
    let mut random = Random::new();
    let [q, k, v] =
        [shape.heads, shape.heads_kv, shape.heads_kv].map(|h| random.values(shape.batch * len * h * 64, DType::BF16));
    let problem = Problem { shape, q, k, v, scale: 0.125, params: vec![], tensors };
    let d_o = random.values(problem.q.len(), DType::BF16);
    let attention = Attention::new(&spec);
    let comms = sharded::all_local(&devices).unwrap();
    let whole = Whole { q_len: len, kv_len: len };
    let results: Vec<RankResult> = std::thread::scope(|scope| {
        let jobs = comms.into_iter().zip(&devices).map(|(comm, device)| {
            let cp = ContextParallel::new(comm, sharding, whole, schedule);
            let (attention, problem, d_o) = (&attention, &problem, &d_o);
            scope.spawn(move || rank(attention, problem, d_o, cp, device, true))
        });
        jobs.collect::<Vec<_>>().into_iter().map(|h| h.join().expect("a rank's thread panicked")).collect()
    });
    let mut o = vec![0.0; problem.q.len()];
    let mut grads = [problem.q.clone(), problem.k.clone(), problem.v.clone()].map(|mut g| {
        g.fill(f64::NAN);
        g
    });
    let mut d_tensor: Option<Vec<f64>> = None;
    for r in &results {
        put_rows(&mut o, &r.o, shape.batch, len, &r.rows);
        for (whole, part) in grads.iter_mut().zip(&r.grads) {
            put_rows(whole, part, shape.batch, len, &r.rows);
        }
        if let Some(part) = &r.d_tensor {
            let sum = d_tensor.get_or_insert_with(|| vec![0.0; part.len()]);
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
    }
    let what = format!("{name}, {} ranks, {:?}, {schedule:?}", sharding.ranks, sharding.partition);
    check_forward(&format!("{what}: O"), &spec, &problem, &o);
    let d_tensors: Vec<&[f64]> = d_tensor.iter().map(Vec::as_slice).collect();
    check_gradients(&spec, &problem, &d_o, grads.each_ref().map(Vec::as_slice), &d_tensors);
}

fn gpus() -> usize {
    flashgen::cudarc::driver::CudaContext::device_count().expect("a CUDA driver") as usize
}

#[test]
#[ignore = "needs a GPU"]
fn every_rank_on_its_gpu_matches_the_reference() {
    let ranks = gpus().min(4);
    for (partition, schedule) in [(Partition::Zigzag, Schedule::Ring), (Partition::Contiguous, Schedule::AllGather)] {
        let sharding = Sharding { ranks, partition };
        let slopes = (0..4).map(|h| 2f64.powi(-(h + 1))).collect();
        check_sharded("alibi, trained slopes", ALIBI, vec![TensorData::Float(slopes)], sharding, schedule);
        // Three documents per batch row, one crossing every rank boundary.
        let len = 192 * ranks;
        let ids = (0..2 * len).map(|i| ((i % len) * 3 / len) as i32 + (i / len) as i32).collect();
        check_sharded("documents", DOCUMENT, vec![TensorData::I32(ids)], sharding, schedule);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn a_communicator_of_another_world_is_an_error() {
    let device = Device::new_cuda(0).unwrap();
    let attention = Attention::new(&spec(ALIBI, DType::BF16));
    let comm = sharded::all_local(std::slice::from_ref(&device)).unwrap().pop().unwrap();
    let sharding = Sharding { ranks: 2, partition: Partition::Contiguous };
    let cp = ContextParallel::new(comm, sharding, Whole { q_len: 256, kv_len: 256 }, Schedule::Ring);
    let t = |heads| Tensor::zeros((1, 128, heads, 64), DType::BF16, &device).unwrap();
    let slopes = Tensor::zeros(4, DType::F32, &device).unwrap();
    let err = attention.forward_sharded(&t(4), &t(2), &t(2), &[(&slopes).into()], &cp).unwrap_err();
    assert!(err.to_string().contains("the sharding has 2 ranks"), "{err}");
}
