//! Varlen (packed) problems on the GPU: ragged sequences drawn at random,
//! a [`Runtime::forward_varlen`] launch on NaN-poisoned outputs, and the
//! result in the varlen reference's layouts (O `[total_q, heads, d_v]`,
//! LSE `[heads, total_q]`) for [`Expected::varlen`](crate::verify::judge::Expected::varlen); its backward in
//! `backward`.

use super::{
    cold_median_ms, driver, gather, launch_args, random_tensors, round, upload_operands, upload_tensors, DeviceTensor,
    GpuOutput, Operands,
};
use flashgen::codegen::cuda::{BackwardTile, TileConfig};
use flashgen::codegen::reference::{ParamValue, Problem, VarlenProblem};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::runtime::{Error, ForwardOptions, PackedLayout, Runtime, Sequences, VarlenIo};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use std::sync::Arc;

mod backward;

pub use backward::{check_backward_varlen, random_packed_d_out};

/// Draws a varlen problem for `spec`: sequences of `lens` (queries, keys)
/// each, `heads` (query, K/V) heads, Q/K/V ~ N(0, 1) rounded to the dtype,
/// captured tensors sized by the longest lengths and drawn as
/// [`super::random_problem`] draws them, scale 1/√d.
pub fn random_varlen_problem(
    spec: &Spec,
    heads: (usize, usize),
    lens: &[(usize, usize)],
    params: Vec<ParamValue>,
    seed: u64,
) -> VarlenProblem {
    let mut rng = StdRng::seed_from_u64(seed);
    let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let prefix_sums = |side: fn(&(usize, usize)) -> usize| -> Vec<usize> {
        std::iter::once(0)
            .chain(lens.iter().scan(0, |sum, len| {
                *sum += side(len);
                Some(*sum)
            }))
            .collect()
    };
    let (cu_q, cu_k) = (prefix_sums(|l| l.0), prefix_sums(|l| l.1));
    let (total_q, total_kv) = (cu_q[lens.len()], cu_k[lens.len()]);
    let longest = |side: fn(&(usize, usize)) -> usize| lens.iter().map(side).max().unwrap_or(0);
    let shape = Shape {
        batch: lens.len(),
        heads: heads.0,
        heads_kv: heads.1,
        q_len: longest(|l| l.0),
        kv_len: longest(|l| l.1),
    };
    let mut normal =
        |n: usize| -> Vec<f64> { (0..n).map(|_| round(spec.dtype, rng.sample::<f64, _>(StandardNormal))).collect() };
    let (q, k, v) =
        (normal(total_q * heads.0 * dqk), normal(total_kv * heads.1 * dqk), normal(total_kv * heads.1 * dv));
    let tensors = random_tensors(spec, &shape, vec![None; spec.tensors.len()], &mut rng);
    let scale = f64::from(1.0 / (dqk as f32).sqrt());
    let problem = Problem { shape, q, k, v, scale, params, tensors };
    VarlenProblem { problem, cu_seqlens_q: cu_q, cu_seqlens_k: cu_k }
}

/// How packed Q/K/V/O sit in memory on the GPU. The reference sees THD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// Contiguous `[tokens, heads, dim]`.
    Thd,
    /// THD inside a larger buffer: padded heads and tokens, so both
    /// strides differ from the dense ones.
    Padded,
}

impl Packing {
    pub fn layout(self, tokens: usize, heads: usize, dim: usize) -> PackedLayout {
        match self {
            Packing::Thd => PackedLayout::thd(tokens, heads, dim),
            Packing::Padded => {
                let head = dim as i64 + 8;
                PackedLayout { tokens, heads, dim, strides: [heads as i64 * head + 24, head], offset: 0 }
            }
        }
    }
}

/// A varlen problem's operands, LSE, prefix sums and captured tensors on
/// the GPU.
pub struct DeviceVarlen {
    operands: Operands,
    lse: CudaSlice<f32>,
    tensors: Vec<DeviceTensor>,
    /// `cu_seqlens_q` and `cu_seqlens_k`.
    cu_seqlens: [CudaSlice<i32>; 2],
    batch: usize,
    /// `max_q_len` and `max_kv_len`.
    max_lens: [usize; 2],
    layouts: [PackedLayout; 4],
    stream: Arc<CudaStream>,
    config: Option<TileConfig>,
    /// The backward launches' dK/dV tile ([`Self::pin_backward_tile`]).
    backward_tile: Option<BackwardTile>,
}

impl DeviceVarlen {
    /// Uploads `problem` packed as `packing`, with O and the LSE poisoned.
    pub fn upload(rt: &Runtime, spec: &Spec, problem: &VarlenProblem, packing: Packing) -> Result<Self, Error> {
        let stream = rt.stream().clone();
        let p = &problem.problem;
        let Shape { batch, heads, heads_kv, q_len, kv_len } = p.shape;
        let (total_q, total_kv) = (problem.cu_seqlens_q[batch], problem.cu_seqlens_k[batch]);
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let layouts = [
            packing.layout(total_q, heads, dqk),
            packing.layout(total_kv, heads_kv, dqk),
            packing.layout(total_kv, heads_kv, dv),
            packing.layout(total_q, heads, dv),
        ];
        let dense = layouts.map(|l| l.as_layout());
        let o_poison = vec![f64::NAN; dense[3].len()];
        let host = [&p.q, &p.k, &p.v, &o_poison];
        let operands = match spec.dtype {
            Dtype::F16 => Operands::F16(upload_operands(&stream, host, &dense)?),
            Dtype::Bf16 => Operands::Bf16(upload_operands(&stream, host, &dense)?),
        };
        let lse = stream.clone_htod(&vec![f32::NAN; heads * total_q]).map_err(driver("upload LSE"))?;
        let cu = |cu: &[usize]| {
            let cu: Vec<i32> = cu.iter().map(|&x| x as i32).collect();
            stream.clone_htod(&cu).map_err(driver("upload cu_seqlens"))
        };
        let cu_seqlens = [cu(&problem.cu_seqlens_q)?, cu(&problem.cu_seqlens_k)?];
        let tensors = upload_tensors(&stream, spec, &p.tensors)?;
        let max_lens = [q_len, kv_len];
        Ok(DeviceVarlen {
            operands,
            lse,
            tensors,
            cu_seqlens,
            batch,
            max_lens,
            layouts,
            stream,
            config: None,
            backward_tile: None,
        })
    }

    /// Replaces the prefix sums on the device with `cu_q` and `cu_k`, which
    /// may hold anything (the kernels clamp each sequence into the buffers).
    pub fn set_device_seqlens(&mut self, cu_q: &[i32], cu_k: &[i32]) -> Result<(), Error> {
        let up = driver("upload cu_seqlens");
        self.cu_seqlens = [self.stream.clone_htod(cu_q).map_err(up)?, self.stream.clone_htod(cu_k).map_err(up)?];
        Ok(())
    }

    /// Later launches use tile configuration `config` (one of the spec's
    /// candidates), or with `None` the runtime's own choice.
    pub fn pin_config(&mut self, config: Option<TileConfig>) {
        self.config = config;
    }

    /// Later backward launches run the dK/dV kernel in `tile` (one of
    /// `BackwardConfig::tiles` of the spec), or with `None` in the runtime's
    /// choice.
    pub fn pin_backward_tile(&mut self, tile: Option<BackwardTile>) {
        self.backward_tile = tile;
    }

    /// Enqueues one varlen forward launch (asynchronous).
    pub fn launch(&mut self, rt: &Runtime, spec: &Spec, problem: &VarlenProblem) -> Result<(), Error> {
        let args = launch_args(&self.tensors, &problem.problem);
        let opts =
            ForwardOptions { scale: Some(problem.problem.scale as f32), config: self.config, ..Default::default() };
        let DeviceVarlen { operands, lse, cu_seqlens, batch, max_lens, .. } = self;
        let seqs = sequences(cu_seqlens, *batch, *max_lens);
        let [lq, lk, lv, lo] = self.layouts;
        match operands {
            Operands::F16([q, k, v, o]) => {
                let io = VarlenIo { q: (q, lq), k: (k, lk), v: (v, lv), o: (o, lo), lse: Some(lse), seqs };
                rt.forward_varlen(spec, io, &args, &opts)
            }
            Operands::Bf16([q, k, v, o]) => {
                let io = VarlenIo { q: (q, lq), k: (k, lk), v: (v, lv), o: (o, lo), lse: Some(lse), seqs };
                rt.forward_varlen(spec, io, &args, &opts)
            }
        }
    }

    /// Median milliseconds (CUDA events) of a varlen forward launch, timed
    /// as the peers are (at least `min_runs`), each after `flush_bytes` of zeros written
    /// (a cold L2, as [`super::DeviceProblem::flush_l2`] gives the dense
    /// launches).
    pub fn time(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        flush_bytes: usize,
        min_runs: usize,
    ) -> Result<f64, Error> {
        let stream = self.stream.clone();
        cold_median_ms(&stream, flush_bytes, min_runs, || self.launch(rt, spec, problem))
    }

    /// Waits for the stream and reads O (as THD) and the LSE back.
    pub fn download(&self) -> Result<GpuOutput, Error> {
        let err = driver("download results");
        self.stream.synchronize().map_err(err)?;
        let o_layout = self.layouts[3].as_layout();
        let o = match &self.operands {
            Operands::F16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &o_layout),
            Operands::Bf16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &o_layout),
        };
        let lse = self.stream.clone_dtoh(&self.lse).map_err(err)?.into_iter().map(f64::from).collect();
        Ok(GpuOutput { o, lse })
    }
}

/// The sequences of a launch on the prefix sums `cu_q`, `cu_k`.
fn sequences([cu_q, cu_k]: &[CudaSlice<i32>; 2], batch: usize, [max_q_len, max_kv_len]: [usize; 2]) -> Sequences<'_> {
    Sequences { batch, cu_seqlens_q: cu_q, cu_seqlens_k: cu_k, max_q_len, max_kv_len }
}

#[cfg(test)]
mod tests {
    use super::super::scatter;
    use super::*;
    use flashgen::codegen::reference::TensorData;
    use flashgen::half::bf16;

    /// Both packings place each THD element at a distinct offset, and
    /// gathering inverts scattering.
    #[test]
    fn packings_scatter_and_gather_exactly() {
        let (t, h, d) = (5, 3, 8); // 120 elements: exact in bf16
        let thd: Vec<f64> = (0..t * h * d).map(|i| i as f64).collect();
        for packing in [Packing::Thd, Packing::Padded] {
            let layout = packing.layout(t, h, d).as_layout();
            let buf: Vec<bf16> = scatter(&thd, &layout);
            assert_eq!(buf.iter().filter(|x| !x.is_nan()).count(), thd.len(), "{packing:?}: distinct offsets");
            assert_eq!(gather(&buf, &layout), thd, "{packing:?}");
        }
    }

    #[test]
    fn random_varlen_problems_are_packed_and_sized_by_the_longest() {
        let spec = flashgen::parse_one(
            "S { dtype: bf16, head_dim: 8, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        )
        .unwrap();
        let p = random_varlen_problem(&spec, (4, 2), &[(3, 5), (0, 2), (6, 1)], vec![], 1);
        assert_eq!((p.cu_seqlens_q, p.cu_seqlens_k), (vec![0, 3, 3, 9], vec![0, 5, 7, 8]));
        let shape = p.problem.shape;
        assert_eq!((shape.batch, shape.q_len, shape.kv_len), (3, 6, 5));
        assert_eq!((p.problem.q.len(), p.problem.k.len()), (9 * 4 * 8, 8 * 2 * 8));
        let TensorData::I32(doc) = &p.problem.tensors[0] else { panic!("i32 ids") };
        assert_eq!(doc.len(), 3 * 5);
    }
}
