//! The call in candle's graph, so that `loss.backward()` reaches Q, K, V and
//! the trained captured tensors.
//!
//! Without trained tensors the call is one custom op over (Q, K, V). candle's
//! custom ops take at most three tensors, so otherwise it is a chain: a
//! `Gather` over (Q, K, V) makes a one-element token, each further `Gather`
//! folds two tensors into the token, and an `Attend` over the last token and
//! the last one or two tensors produces O. Only `Attend` launches kernels:
//! its forward is the attention forward; its backward computes every
//! gradient in one pass and keeps them in the [`Call`], from which each
//! `Gather` hands candle its own inputs' share.

use crate::call::Call;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use std::sync::{Arc, PoisonError};

/// Which gradient an op returns for one of its inputs.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Q,
    K,
    V,
    /// The captured tensor of this declaration index.
    Tensor(usize),
    /// The token an earlier `Gather` made (its gradient is zero).
    Token,
}

/// O for `call`, wired into candle's graph. `graph` holds the caller's own
/// tensors (Q, K, V, then each captured tensor), which the gradients attach to.
pub(crate) fn attend(call: Call, graph: [&Tensor; 3], tensors: &[Tensor]) -> candle_core::Result<Tensor> {
    let trained: Vec<usize> = (0..call.train.len()).filter(|&i| call.train[i]).collect();
    let call = Arc::new(call);
    let [q, k, v] = graph;
    if !call.keep_lse {
        return q.apply_op3_no_bwd(k, v, &Attend { call, slots: vec![] });
    }
    if trained.is_empty() {
        return q.apply_op3(k, v, Attend { call, slots: vec![Slot::Q, Slot::K, Slot::V] });
    }
    let gather = Gather { call: call.clone(), slots: vec![Slot::Q, Slot::K, Slot::V] };
    let mut token = q.apply_op3(k, v, gather)?;
    let mut rest = &trained[..];
    while rest.len() > 2 {
        let slots = vec![Slot::Token, Slot::Tensor(rest[0]), Slot::Tensor(rest[1])];
        token = token.apply_op3(&tensors[rest[0]], &tensors[rest[1]], Gather { call: call.clone(), slots })?;
        rest = &rest[2..];
    }
    match *rest {
        [a] => token.apply_op2(&tensors[a], Attend { call, slots: vec![Slot::Token, Slot::Tensor(a)] }),
        [a, b] => {
            let slots = vec![Slot::Token, Slot::Tensor(a), Slot::Tensor(b)];
            token.apply_op3(&tensors[a], &tensors[b], Attend { call, slots })
        }
        _ => unreachable!("the loop leaves one or two trained tensors"),
    }
}

/// The gradients of `slots`' inputs from the call's kept gradients. The op
/// over Q, K and V runs its backward last in the chain: it takes them, so
/// they are not kept as long as the graph.
fn share(call: &Call, slots: &[Slot], inputs: &[&Tensor]) -> candle_core::Result<Vec<Option<Tensor>>> {
    let mut kept = call.grads.lock().unwrap_or_else(PoisonError::into_inner);
    let grads = match slots.first() {
        Some(Slot::Q) => kept.take(),
        _ => kept.clone(),
    };
    let grads = grads.ok_or_else(|| candle_core::Error::msg("flashgen: the backward kept no gradients"))?;
    let grad = |(slot, input): (&Slot, &&Tensor)| -> candle_core::Result<Option<Tensor>> {
        Ok(match *slot {
            Slot::Q => Some(grads.qkv[0].clone()),
            Slot::K => Some(grads.qkv[1].clone()),
            Slot::V => Some(grads.qkv[2].clone()),
            Slot::Tensor(i) => grads.tensors[i].clone(),
            Slot::Token => Some(input.zeros_like()?),
        })
    };
    slots.iter().zip(inputs).map(grad).collect()
}

fn no_cpu() -> candle_core::Error {
    crate::Error::NotCuda { operand: "Q".to_string() }.into()
}

/// Produces O; its backward computes every gradient of the call.
struct Attend {
    call: Arc<Call>,
    slots: Vec<Slot>,
}

impl Attend {
    fn backward(&self, inputs: &[&Tensor], o: &Tensor, d_o: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        self.call.backward(o, d_o)?;
        share(&self.call, &self.slots, inputs)
    }
}

impl CustomOp3 for Attend {
    fn name(&self) -> &'static str {
        "flashgen-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(no_cpu())
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.call.forward()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.backward(&[a, b, c], o, d_o)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten(), grads.next().flatten()))
    }
}

impl CustomOp2 for Attend {
    fn name(&self) -> &'static str {
        "flashgen-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(no_cpu())
    }

    fn cuda_fwd(
        &self,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.call.forward()
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut grads = self.backward(&[a, b], o, d_o)?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten()))
    }
}

/// Ties inputs into the chain; its backward hands out their gradients.
struct Gather {
    call: Arc<Call>,
    slots: Vec<Slot>,
}

impl CustomOp3 for Gather {
    fn name(&self) -> &'static str {
        "flashgen-attention-inputs"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(no_cpu())
    }

    fn cuda_fwd(
        &self,
        a: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let token = a.device.alloc_zeros::<f32>(1)?;
        Ok((CudaStorage::wrap_cuda_slice(token, a.device.clone()), Shape::from(1)))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut grads = share(&self.call, &self.slots, &[a, b, c])?.into_iter();
        Ok((grads.next().flatten(), grads.next().flatten(), grads.next().flatten()))
    }
}
