//! The call in candle's graph, so that `loss.backward()` reaches Q, K, V and
//! the trained captured tensors.
//!
//! Without trained tensors the call is one custom op over (Q, K, V). candle's
//! custom ops take at most three tensors, so otherwise it is a chain of
//! [`Link`]s: a gathering link over (Q, K, V) makes a one-element token,
//! each further one folds two tensors into the token, and the attending
//! link over the last token and the last one or two tensors produces O.
//! Only the attending link launches kernels: its forward is the attention
//! forward; its backward computes every gradient in one pass and keeps them
//! in the [`Call`], from which each gathering link hands candle its own
//! inputs' share.

use crate::call::Call;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use std::sync::{Arc, PoisonError};

/// Which gradient a link returns for one of its inputs.
#[derive(Clone, Copy, Debug)]
enum Slot {
    Q,
    K,
    V,
    /// The captured tensor of this declaration index.
    Tensor(usize),
    /// The token an earlier link made (its gradient is zero).
    Token,
}

/// What a link computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Produces O; its backward computes every gradient of the call.
    Attend,
    /// Ties its inputs into the chain (a token); its backward hands out
    /// their gradients.
    Gather,
}

/// One custom op of the call's chain.
struct Link {
    call: Arc<Call>,
    role: Role,
    slots: Vec<Slot>,
}

/// O for `call`, wired into candle's graph. `graph` holds the caller's own
/// tensors (Q, K, V, then each captured tensor), which the gradients attach to.
pub(crate) fn attend(call: Call, graph: [&Tensor; 3], tensors: &[Tensor]) -> candle_core::Result<Tensor> {
    let trained: Vec<usize> = (0..call.train.len()).filter(|&i| call.train[i]).collect();
    let call = Arc::new(call);
    let link = |role, slots| Link { call: call.clone(), role, slots };
    let [q, k, v] = graph;
    if !call.keep_lse {
        return q.apply_op3_no_bwd(k, v, &link(Role::Attend, vec![]));
    }
    let qkv = vec![Slot::Q, Slot::K, Slot::V];
    if trained.is_empty() {
        return q.apply_op3(k, v, link(Role::Attend, qkv));
    }
    let mut token = q.apply_op3(k, v, link(Role::Gather, qkv))?;
    let mut rest = &trained[..];
    while rest.len() > 2 {
        let slots = vec![Slot::Token, Slot::Tensor(rest[0]), Slot::Tensor(rest[1])];
        token = token.apply_op3(&tensors[rest[0]], &tensors[rest[1]], link(Role::Gather, slots))?;
        rest = &rest[2..];
    }
    match *rest {
        [a] => token.apply_op2(&tensors[a], link(Role::Attend, vec![Slot::Token, Slot::Tensor(a)])),
        [a, b] => {
            let slots = vec![Slot::Token, Slot::Tensor(a), Slot::Tensor(b)];
            token.apply_op3(&tensors[a], &tensors[b], link(Role::Attend, slots))
        }
        _ => unreachable!("the loop leaves one or two trained tensors"),
    }
}

impl Link {
    fn name(&self) -> &'static str {
        match self.role {
            Role::Attend => "flashgen-attention",
            Role::Gather => "flashgen-attention-inputs",
        }
    }

    fn forward(&self, first: &CudaStorage) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.role {
            Role::Attend => self.call.forward(),
            Role::Gather => {
                let token = first.device.alloc_zeros::<f32>(1)?;
                Ok((CudaStorage::wrap_cuda_slice(token, first.device.clone()), Shape::from(1)))
            }
        }
    }

    /// The gradients of the link's inputs, in order. The attending link
    /// runs the backward first; the op over Q, K and V, the last in the
    /// chain to run its backward, takes the kept gradients, so that they do
    /// not live as long as the graph.
    fn backward(&self, inputs: &[&Tensor], o: &Tensor, d_o: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        if self.role == Role::Attend {
            self.call.backward(o, d_o)?;
        }
        let mut kept = self.call.grads.lock().unwrap_or_else(PoisonError::into_inner);
        let grads = match self.slots.first() {
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
        self.slots.iter().zip(inputs).map(grad).collect()
    }
}

fn no_cpu() -> candle_core::Error {
    crate::Error::NotCuda { operand: "Q".to_string() }.into()
}

impl CustomOp3 for Link {
    fn name(&self) -> &'static str {
        Link::name(self)
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
        first: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.forward(first)
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

impl CustomOp2 for Link {
    fn name(&self) -> &'static str {
        Link::name(self)
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
        first: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        self.forward(first)
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
