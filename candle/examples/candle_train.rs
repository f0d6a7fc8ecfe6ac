//! A few training steps of a one-block model whose attention is flashgen's
//! candle op with ALiBi, whose per-head slopes are trained too: the
//! gradients of every weight and of the slopes match candle's own attention
//! by FlashAttention's backward rule, and the loss falls under Adam.
//!
//! Run on a machine with an NVIDIA GPU: `cargo run --release --example
//! candle_train` in candle/.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use common::{keep_mask, max_diff, time_ms, Attend, Block, Dims, Rope};
use flashgen_candle::{Arg, Attention};

flashgen::attention! {
    /// Causal ALiBi with learned slopes.
    pub Alibi {
        dtype: bf16, head_dim: 64,
        tensor slopes: f32[H],
        mask: q >= k,
        score: score + slopes[h] * (k - q) as f32,
    }
}

const DIMS: Dims = Dims { model: 256, heads: 4, heads_kv: 4, head_dim: 64, hidden: 512 };
const BACKWARD_FACTOR: f64 = 3.0;

/// The model: a block and its ALiBi slopes.
struct Model {
    block: Block,
    slopes: Var,
}

impl Model {
    fn new(dev: &Device, first_slope: f32) -> candle_core::Result<Model> {
        let slopes: Vec<f32> = (0..DIMS.heads).map(|h| first_slope / 2f32.powi(h as i32)).collect();
        Ok(Model { block: Block::new(DIMS, DType::BF16, dev)?, slopes: Var::new(slopes, dev)? })
    }

    fn vars(&self) -> Vec<&Var> {
        self.block.vars().into_iter().chain([&self.slopes]).collect()
    }

    /// The block with flashgen's attention, or (`relative` given) with
    /// candle's, computing in `dtype`.
    fn forward(
        &self,
        x: &Tensor,
        rope: &Rope,
        relative: Option<(&Tensor, &Tensor)>,
        dtype: DType,
    ) -> candle_core::Result<Tensor> {
        let block = Block { dtype, ..self.block.clone() };
        let x = x.to_dtype(dtype)?;
        match relative {
            None => {
                let attention = Attention::new(Alibi::spec());
                let args = [Arg::from(self.slopes.as_tensor())];
                block.forward(&x, rope, &Attend::Flashgen(&attention, &args))
            }
            Some((distance, keep)) => {
                // bias[h, q, k] = slopes[h] · (k − q)
                let bias = self.slopes.as_tensor().reshape((DIMS.heads, 1, 1))?.broadcast_mul(distance)?;
                block.forward(&x, rope, &Attend::Plain { bias: Some(&bias), keep: Some(keep) })
            }
        }
    }
}

/// Adam (β = 0.9, 0.999) with its moments per variable.
struct Adam {
    moments: Vec<(Tensor, Tensor)>,
    steps: i32,
}

impl Adam {
    const LR: f64 = 3e-3;

    fn new(vars: &[&Var]) -> candle_core::Result<Adam> {
        let zeros = |v: &&Var| Ok((v.zeros_like()?, v.zeros_like()?));
        Ok(Adam { moments: vars.iter().map(zeros).collect::<candle_core::Result<_>>()?, steps: 0 })
    }

    fn step(&mut self, vars: &[&Var], grads: &candle_core::backprop::GradStore) -> candle_core::Result<()> {
        self.steps += 1;
        let (c1, c2) = (1.0 - 0.9f64.powi(self.steps), 1.0 - 0.999f64.powi(self.steps));
        for (var, (m, v)) in vars.iter().zip(&mut self.moments) {
            let Some(g) = grads.get(var.as_tensor()) else { continue };
            *m = ((&*m * 0.9)? + (g * 0.1)?)?;
            *v = ((&*v * 0.999)? + (g.sqr()? * 0.001)?)?;
            let update = ((&*m / c1)? / ((&*v / c2)?.sqrt()? + 1e-8)?)?;
            var.set(&(var.as_tensor() - (update * Self::LR)?)?)?;
        }
        Ok(())
    }
}

fn loss(out: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
    (out.to_dtype(DType::F32)? - target)?.sqr()?.mean_all()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let (batch, seq) = (4, 512);
    let x = Tensor::randn(0f32, 1.0, (batch, seq, DIMS.model), &dev)?;
    let distance: Vec<f32> = (0..seq * seq).map(|i| (i % seq) as f32 - (i / seq) as f32).collect();
    let distance = Tensor::from_vec(distance, (seq, seq), &dev)?;
    let keep = keep_mask(seq, |q, k| q >= k, &dev)?;
    let plain = Some((&distance, &keep));
    let (rope, rope32) =
        (Rope::new(seq, DIMS.head_dim, DType::BF16, &dev)?, Rope::new(seq, DIMS.head_dim, DType::F32, &dev)?);

    // A fixed random teacher gives the targets; the student starts elsewhere.
    let teacher = Model::new(&dev, 0.5)?;
    let target = teacher.forward(&x, &rope32, plain, DType::F32)?.detach();
    let student = Model::new(&dev, 0.05)?;

    // Gradients: flashgen and candle's attention in bf16 against the f32 model.
    let grads_of = |out: Tensor| loss(&out, &target)?.backward();
    let g_flashgen = grads_of(student.forward(&x, &rope, None, DType::BF16)?)?;
    let g_candle = grads_of(student.forward(&x, &rope, plain, DType::BF16)?)?;
    let g_golden = grads_of(student.forward(&x, &rope32, plain, DType::F32)?)?;
    let names = ["qkv", "out", "gate", "up", "down", "norm_attn", "norm_mlp", "slopes"];
    for (name, var) in names.iter().zip(student.vars()) {
        let grad = |g: &candle_core::backprop::GradStore| g.get(var.as_tensor()).cloned().ok_or("no gradient");
        let golden = grad(&g_golden)?;
        let (err, baseline) = (max_diff(&grad(&g_flashgen)?, &golden)?, max_diff(&grad(&g_candle)?, &golden)?);
        let passed = err <= BACKWARD_FACTOR * baseline + 1e-6;
        println!(
            "d{name:<10} max |error| flashgen {err:.3e}, candle bf16 {baseline:.3e}: {}",
            if passed { "ok" } else { "FAILED" }
        );
        if !passed {
            return Err(format!("the gradient of {name} fails FlashAttention's backward rule").into());
        }
    }

    // Training with flashgen's attention: Adam, every weight and the slopes.
    let mut adam = Adam::new(&student.vars())?;
    let mut losses = Vec::new();
    for step in 0..40 {
        let l = loss(&student.forward(&x, &rope, None, DType::BF16)?, &target)?;
        adam.step(&student.vars(), &l.backward()?)?;
        losses.push(l.to_scalar::<f32>()?);
        if step % 10 == 0 {
            println!("step {step:>2}: loss {:.4}", losses[step]);
        }
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    println!("loss {first:.4} → {last:.4}");
    if last.is_nan() || last >= 0.8 * first {
        return Err("the loss did not fall".into());
    }

    let step_ms = |relative| {
        time_ms(&dev, 10, || loss(&student.forward(&x, &rope, relative, DType::BF16)?, &target)?.backward().map(drop))
    };
    let (t_flashgen, t_candle) = (step_ms(None)?, step_ms(plain)?);
    println!(
        "training step ({batch}×{seq} tokens): flashgen {t_flashgen:.2} ms, candle {t_candle:.2} ms ({:.2}×)",
        t_candle / t_flashgen
    );
    Ok(())
}
