//! A Llama-style decoder block in plain candle ops, whose attention is
//! either flashgen's op or candle's own (`flashgen_candle::plain`), and the
//! measuring helpers the examples share.

// Each example uses part of it.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor, Var, D};
use flashgen_candle::{plain, Arg, Attention};
use std::time::Instant;

/// Sizes of one block.
#[derive(Clone, Copy)]
pub struct Dims {
    pub model: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub hidden: usize,
}

/// How the block attends: flashgen's op with the spec's args, or candle's
/// attention with the same variant given as a bias and a keep mask.
pub enum Attend<'a> {
    Flashgen(&'a Attention, &'a [Arg]),
    Plain { bias: Option<&'a Tensor>, keep: Option<&'a Tensor> },
}

/// Weights as trainable f32 variables; the block computes in `dtype`.
/// Clones share the variables.
#[derive(Clone)]
pub struct Block {
    pub dims: Dims,
    pub dtype: DType,
    pub qkv: Var,
    pub out: Var,
    pub gate: Var,
    pub up: Var,
    pub down: Var,
    pub norm_attn: Var,
    pub norm_mlp: Var,
}

impl Block {
    pub fn new(dims: Dims, dtype: DType, dev: &Device) -> candle_core::Result<Block> {
        let Dims { model, heads, heads_kv, head_dim, hidden } = dims;
        let linear =
            |fan_in: usize, fan_out: usize| Var::randn(0f32, (fan_in as f32).powf(-0.5), (fan_in, fan_out), dev);
        let ones = |n: usize| Var::from_tensor(&Tensor::ones(n, DType::F32, dev)?);
        Ok(Block {
            dims,
            dtype,
            qkv: linear(model, (heads + 2 * heads_kv) * head_dim)?,
            out: linear(heads * head_dim, model)?,
            gate: linear(model, hidden)?,
            up: linear(model, hidden)?,
            down: linear(hidden, model)?,
            norm_attn: ones(model)?,
            norm_mlp: ones(model)?,
        })
    }

    pub fn vars(&self) -> [&Var; 7] {
        [&self.qkv, &self.out, &self.gate, &self.up, &self.down, &self.norm_attn, &self.norm_mlp]
    }

    /// `x + attention(norm(x)) `, then `+ mlp(norm(·))`, for x `[batch, seq, model]`.
    pub fn forward(&self, x: &Tensor, rope: &Rope, attend: &Attend) -> candle_core::Result<Tensor> {
        let Dims { model, heads, heads_kv, head_dim, .. } = self.dims;
        let (batch, seq, _) = x.dims3()?;
        let h = rms_norm(x, &self.norm_attn)?;
        // One fused projection; Q, K and V are views of it (flashgen reads V in place).
        let qkv = self.linear(&h, &self.qkv)?.reshape((batch, seq, heads + 2 * heads_kv, head_dim))?;
        let q = rope.apply(&qkv.narrow(2, 0, heads)?)?;
        let k = rope.apply(&qkv.narrow(2, heads, heads_kv)?)?;
        let v = qkv.narrow(2, heads + heads_kv, heads_kv)?;
        let o = match attend {
            Attend::Flashgen(attention, args) => attention.forward(&q, &k, &v, args)?,
            Attend::Plain { bias, keep } => plain::attention(&q, &k, &v, (head_dim as f64).powf(-0.5), *bias, *keep)?,
        };
        let x = (x + self.linear(&o.reshape((batch, seq, heads * head_dim))?, &self.out)?)?;
        let h = rms_norm(&x, &self.norm_mlp)?;
        let mlp = (self.linear(&h, &self.gate)?.silu()? * self.linear(&h, &self.up)?)?;
        let out = (&x + self.linear(&mlp, &self.down)?)?;
        debug_assert_eq!(out.dim(2)?, model);
        Ok(out)
    }

    fn linear(&self, x: &Tensor, w: &Var) -> candle_core::Result<Tensor> {
        x.broadcast_matmul(&w.as_tensor().to_dtype(self.dtype)?)
    }
}

fn rms_norm(x: &Tensor, weight: &Var) -> candle_core::Result<Tensor> {
    let x32 = x.to_dtype(DType::F32)?;
    let norm = x32.broadcast_div(&(x32.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?)?;
    norm.broadcast_mul(weight.as_tensor())?.to_dtype(x.dtype())
}

/// Rotary position embedding (rotate-half form) for `[batch, seq, heads, dim]`.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(seq: usize, head_dim: usize, dtype: DType, dev: &Device) -> candle_core::Result<Rope> {
        let half = head_dim / 2;
        let freqs: Vec<f32> = (0..half).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
        let freqs = Tensor::new(freqs, dev)?;
        let positions = Tensor::arange(0u32, seq as u32, dev)?.to_dtype(DType::F32)?;
        let angles = positions.unsqueeze(1)?.broadcast_mul(&freqs.unsqueeze(0)?)?;
        let shape = (1, seq, 1, half);
        let cos = angles.cos()?.reshape(shape)?.to_dtype(dtype)?;
        Ok(Rope { sin: angles.sin()?.reshape(shape)?.to_dtype(dtype)?, cos })
    }

    pub fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let half = x.dim(3)? / 2;
        let (a, b) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
        let first = (a.broadcast_mul(&self.cos)? - b.broadcast_mul(&self.sin)?)?;
        let second = (b.broadcast_mul(&self.cos)? + a.broadcast_mul(&self.sin)?)?;
        Tensor::cat(&[first, second], 3)
    }
}

/// `[seq, seq]` with 1 where query i may attend to key j.
pub fn keep_mask(seq: usize, keep: impl Fn(usize, usize) -> bool, dev: &Device) -> candle_core::Result<Tensor> {
    let values: Vec<u8> = (0..seq * seq).map(|i| keep(i / seq, i % seq) as u8).collect();
    Tensor::from_vec(values, (seq, seq), dev)
}

/// Median milliseconds of `f` over `iters` runs after two warm-ups, each
/// timed to the GPU's completion.
pub fn time_ms(dev: &Device, iters: usize, mut f: impl FnMut() -> candle_core::Result<()>) -> candle_core::Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    dev.synchronize()?;
    let mut times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f()?;
            dev.synchronize()?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<candle_core::Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// max |a − b| over all elements, in f64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let diff = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?.abs()?;
    diff.flatten_all()?.max(0)?.to_scalar::<f64>()
}
