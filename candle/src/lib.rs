//! flashgen attention as a candle op: any `attention!` spec (or `.attn`
//! spec parsed at run time) runs on candle tensors, forward and backward.
//!
//! ```ignore
//! flashgen::attention! {
//!     pub Window { dtype: bf16, head_dim: 128, param window: i32, mask: q >= k && q - k < window }
//! }
//! let attention = flashgen_candle::Attention::new(Window::spec());
//! // q: [batch, q_len, heads, 128], k and v: [batch, kv_len, kv_heads, 128], bf16, on a CUDA device.
//! let o = attention.forward(&q, &k, &v, &[1024.into()])?;
//! ```
//!
//! Q, K and V are `[batch, seq, heads, head_dim]` tensors of the spec's
//! dtype; any layout whose head dim is contiguous is read where it lies (a
//! `[b, h, s, d]` tensor transposed to `[b, s, h, d]`, the Q, K and V slices
//! of a fused projection); others are copied once. Fewer K/V heads than Q
//! heads is GQA/MQA. Kernels run on the tensors' device's own stream, in
//! order with candle's work there. O is a new compact `[batch, q_len, heads,
//! v_dim]` tensor; the forward keeps the row log-sum-exp for the backward
//! when any input tracks gradients, and `loss.backward()` gives dQ, dK, dV
//! and the gradients of the spec's trainable captured tensors.

mod call;
mod error;
mod graph;
pub mod layout;
pub mod plain;
#[cfg(feature = "nccl")]
pub mod sharded;

pub use call::Arg;
pub use error::Error;
#[cfg(feature = "nccl")]
pub use sharded::ContextParallel;

use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::Tensor;
use flashgen::{BackwardWorkspace, Runtime, Spec};
use std::sync::{Arc, Mutex, PoisonError};

/// One attention variant, ready to run on candle tensors. Cheap to clone;
/// the clones share the compiled kernels.
#[derive(Clone)]
pub struct Attention {
    inner: Arc<Inner>,
}

struct Inner {
    spec: Spec,
    /// The captured tensors the backward can differentiate, by index.
    trainable: Vec<usize>,
    scale: Option<f32>,
    /// A runtime on the stream of each candle CUDA device used so far (one
    /// GPU's runtimes share their compiled kernels), with the backward
    /// pass's workspace there.
    devices: Mutex<Vec<OnDevice>>,
}

#[derive(Clone)]
struct OnDevice {
    id: DeviceId,
    runtime: Arc<Runtime>,
    workspace: Arc<BackwardWorkspace>,
}

impl Attention {
    /// The op for `spec` with the softmax scale `1 / sqrt(head_dims.qk)`.
    pub fn new(spec: &Spec) -> Attention {
        Attention::with_scale(spec, None)
    }

    /// The op for `spec` with softmax scale `scale` (`None`: `1 / sqrt(head_dims.qk)`).
    pub fn with_scale(spec: &Spec, scale: Option<f32>) -> Attention {
        let trainable = flashgen::codegen::cuda::trainable_tensors(spec);
        let inner = Inner { spec: spec.clone(), trainable, scale, devices: Mutex::default() };
        Attention { inner: Arc::new(inner) }
    }

    pub fn spec(&self) -> &Spec {
        &self.inner.spec
    }

    pub fn scale(&self) -> Option<f32> {
        self.inner.scale
    }

    fn trainable(&self) -> &[usize] {
        &self.inner.trainable
    }

    /// O for `q`, `k`, `v` and the spec's params and captured tensors
    /// (`args`, in declaration order, params first). Errors name the
    /// operand: CPU tensors, another dtype than the spec's, shapes the spec
    /// or each other reject, missing or extra args.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, args: &[Arg]) -> candle_core::Result<Tensor> {
        let call = call::Call::new(self, q, k, v, args)?;
        graph::attend(call, [q, k, v], &call::arg_tensors(args))
    }

    /// The flashgen runtime on `device`'s stream (made on first use there).
    pub fn runtime(&self, device: &CudaDevice) -> candle_core::Result<Arc<Runtime>> {
        Ok(self.on(device)?.runtime)
    }

    pub(crate) fn workspace(&self, device: &CudaDevice) -> candle_core::Result<Arc<BackwardWorkspace>> {
        Ok(self.on(device)?.workspace)
    }

    fn on(&self, device: &CudaDevice) -> candle_core::Result<OnDevice> {
        let mut devices = self.inner.devices.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = devices.iter().find(|d| d.id == device.id()) {
            return Ok(known.clone());
        }
        let stream = device.cuda_stream();
        let ordinal = stream.context().ordinal();
        let runtime = match devices.iter().find(|d| d.runtime.context().ordinal() == ordinal) {
            Some(same_gpu) => same_gpu.runtime.on_stream(stream),
            None => Runtime::from_stream(stream),
        };
        let runtime = Arc::new(runtime.map_err(error::flashgen)?);
        let on = OnDevice { id: device.id(), runtime, workspace: Arc::default() };
        devices.push(on.clone());
        Ok(on)
    }
}
