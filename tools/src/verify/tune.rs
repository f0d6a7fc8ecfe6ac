//! Autotuning on an uploaded problem: the forward's tile configuration and
//! the backward's dK/dV tile, each remembered by the runtime for the
//! problem's shape class (later launches of the class use them).

use super::{backward_io, grad_buffers, launch_args, random_d_out, DeviceProblem, GradBuffers, Operands, Storage};
use flashgen::codegen::cuda::BackwardTile;
use flashgen::codegen::reference::Problem;
use flashgen::codegen::Spec;
use flashgen::half::{bf16, f16};
use flashgen::runtime::TuneReport;
use flashgen::runtime::{BackwardIo, BackwardOptions, BackwardWorkspace, Error, ForwardIo, ForwardOptions, Runtime};

impl DeviceProblem {
    /// Autotunes the forward on this problem ([`Runtime::autotune`]): O and
    /// LSE then hold a forward's result.
    pub fn autotune(&mut self, rt: &Runtime, spec: &Spec, problem: &Problem) -> Result<TuneReport, Error> {
        super::forward_io!(self, problem, |io, args, opts| rt.autotune(spec, io, &args, &opts))
    }

    /// Autotunes the backward's dK/dV tile on this problem
    /// ([`Runtime::autotune_backward`]) as a training step runs it: against
    /// O and the LSE the last forward left, into Q, K and V alone (no
    /// tensor gradients), with a workspace kept between passes.
    pub fn autotune_backward(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
    ) -> Result<TuneReport<BackwardTile>, Error> {
        match self.operands {
            Operands::F16(_) => self.tune_backward::<f16>(rt, spec, problem),
            Operands::Bf16(_) => self.tune_backward::<bf16>(rt, spec, problem),
        }
    }

    fn tune_backward<T: Storage>(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
    ) -> Result<TuneReport<BackwardTile>, Error> {
        let d_out = random_d_out(spec, problem.shape, 7);
        let mut grads: GradBuffers<T> = grad_buffers(&self.stream, spec, problem.shape, self.layouts, &d_out, false)?;
        let [q, k, v, o] = T::operands(&self.operands).ok_or(Error::Dtype { spec: spec.dtype, got: T::DTYPE })?;
        let workspace = BackwardWorkspace::default();
        let opts = BackwardOptions {
            scale: Some(problem.scale as f32),
            block_mask: self.block_mask.as_ref(),
            workspace: Some(&workspace),
            ..BackwardOptions::default()
        };
        let io = backward_io!(BackwardIo, [q, k, v, o], &self.lse, &mut grads, self.layouts);
        rt.autotune_backward(spec, io, &launch_args(&self.tensors, problem), &opts)
    }
}
