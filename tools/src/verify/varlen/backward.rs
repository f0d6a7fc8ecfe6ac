//! The varlen backward on the GPU: [`DeviceVarlen::backward`] runs
//! [`Runtime::backward_varlen`] from the varlen forward's O and LSE into
//! NaN-poisoned gradients, [`check_backward_varlen`] judges them as
//! [`check_backward`](super::super::check_backward) judges dense ones
//! (against the varlen reference backward), and
//! [`DeviceVarlen::time_forward_backward`] times a packed training step.

use super::super::{
    backward_io, cold_median_ms, grad_buffers, gradients_of, judge_gradients, launch_args, random_d_out,
    BackwardReport, GpuGradients, GradBuffers, Operands, Storage,
};
use super::{sequences, DeviceVarlen};
use flashgen::codegen::reference::{self, VarlenProblem};
use flashgen::codegen::{Shape, Spec};
use flashgen::cudarc::driver::CudaSlice;
use flashgen::half::{bf16, f16};
use flashgen::runtime::{BackwardOptions, BackwardWorkspace, Error, Layout, Runtime, VarlenBackwardIo};

/// dL/dO ~ N(0, 1) for a varlen problem, rounded to the spec's dtype,
/// packed like O (`[total_q, heads, d_v]`).
pub fn random_packed_d_out(spec: &Spec, problem: &VarlenProblem, seed: u64) -> Vec<f64> {
    let shape = problem.problem.shape;
    let total_q = problem.cu_seqlens_q[shape.batch];
    random_d_out(spec, Shape { batch: 1, q_len: total_q, ..shape }, seed)
}

/// Judges varlen backward results: FlashAttention's rule against the f64
/// varlen reference backward, the baseline the mean error of
/// [`reference::BACKWARD_BASELINES`] same-dtype emulations.
pub fn check_backward_varlen(
    spec: &Spec,
    problem: &VarlenProblem,
    d_out: &[f64],
    gpu: &GpuGradients,
) -> Result<BackwardReport, reference::ReferenceError> {
    let golden = reference::backward_varlen(spec, problem, d_out, reference::Precision::F64)?;
    let same = reference::same_dtype_backwards_varlen(spec, problem, d_out, reference::BACKWARD_BASELINES)?;
    Ok(judge_gradients(spec, &golden, &same, gpu))
}

impl DeviceVarlen {
    /// Runs the varlen backward from this problem's O and LSE (run
    /// [`Self::launch`] first) with the incoming gradient `d_out` (packed
    /// like O), asking for every tensor gradient the spec has (with
    /// `tensor_grads`, else for none); dQ, dK, dV and the tensor gradients
    /// start NaN-poisoned. Waits and reads them back (packed).
    pub fn backward(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        d_out: &[f64],
        (deterministic, tensor_grads): (bool, bool),
    ) -> Result<GpuGradients, Error> {
        let opts = BackwardOptions { scale: Some(problem.problem.scale as f32), deterministic, ..Default::default() };
        match &self.operands {
            Operands::F16(ops) => self.backward_as(rt, spec, problem, ops, (d_out, tensor_grads), &opts),
            Operands::Bf16(ops) => self.backward_as(rt, spec, problem, ops, (d_out, tensor_grads), &opts),
        }
    }

    /// Median milliseconds (CUDA events) of one packed training step's
    /// attention, the varlen forward and backward into Q, K and V (no
    /// tensor gradients), with buffers and workspace allocated once, each
    /// after `flush_bytes` of zeros written, timed as the peers are (at
    /// least `min_runs` steps).
    pub fn time_forward_backward(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        flush_bytes: usize,
        min_runs: usize,
    ) -> Result<f64, Error> {
        match self.operands {
            Operands::F16(_) => self.time_training::<f16>(rt, spec, problem, flush_bytes, min_runs),
            Operands::Bf16(_) => self.time_training::<bf16>(rt, spec, problem, flush_bytes, min_runs),
        }
    }

    fn time_training<T: Storage>(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        flush_bytes: usize,
        min_runs: usize,
    ) -> Result<f64, Error> {
        let d_out = random_packed_d_out(spec, problem, 7);
        let shape = problem.problem.shape;
        let mut grads = grad_buffers::<T>(&self.stream, spec, shape, self.dense_layouts(), &d_out, false)?;
        let workspace = BackwardWorkspace::default();
        let opts = BackwardOptions {
            scale: Some(problem.problem.scale as f32),
            workspace: Some(&workspace),
            tile: self.backward_tile,
            ..Default::default()
        };
        let stream = self.stream.clone();
        cold_median_ms(&stream, flush_bytes, min_runs, || {
            self.launch(rt, spec, problem)?;
            let ops = T::operands(&self.operands).ok_or(Error::Dtype { spec: spec.dtype, got: T::DTYPE })?;
            self.queue_backward(rt, spec, problem, ops, &mut grads, &opts)
        })
    }

    fn backward_as<T: Storage>(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        ops: &[CudaSlice<T>; 4],
        (d_out, tensor_grads): (&[f64], bool),
        opts: &BackwardOptions<'_>,
    ) -> Result<GpuGradients, Error> {
        let (shape, layouts) = (problem.problem.shape, self.dense_layouts());
        gradients_of::<T>(&self.stream, spec, shape, layouts, (d_out, tensor_grads), |grads| {
            self.queue_backward(rt, spec, problem, ops, grads, opts)
        })
    }

    /// The packed layouts as the one batch row of tokens they are.
    fn dense_layouts(&self) -> [Layout; 4] {
        self.layouts.map(|l| l.as_layout())
    }

    /// Queues the varlen backward kernels into `grads` without waiting.
    fn queue_backward<T: Storage>(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &VarlenProblem,
        [q, k, v, o]: &[CudaSlice<T>; 4],
        grads: &mut GradBuffers<T>,
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let seqs = sequences(&self.cu_seqlens, self.batch, self.max_lens);
        let io = backward_io!(VarlenBackwardIo, [q, k, v, o], &self.lse, grads, self.layouts, seqs: seqs);
        rt.backward_varlen(spec, io, &launch_args(&self.tensors, &problem.problem), opts)
    }
}
