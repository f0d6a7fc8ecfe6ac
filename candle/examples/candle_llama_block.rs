//! A Llama-style decoder block (fused QKV projection, RoPE, GQA, a sliding
//! window, SwiGLU) whose attention is flashgen's candle op, checked against
//! the same block with candle's own attention and timed against it: per
//! forward and per training step (forward + backward).
//!
//! Run on a machine with an NVIDIA GPU: `cargo run --release --example
//! candle_llama_block` in candle/ (after `source ../scripts/cuda-build-env.sh`
//! where no CUDA toolkit is installed).

mod common;

use candle_core::{DType, Device};
use common::{keep_mask, max_diff, time_ms, Attend, Block, Dims, Rope};
use flashgen_candle::{Arg, Attention};

flashgen::attention! {
    /// Causal sliding window (Mistral style).
    pub Window {
        dtype: bf16, head_dim: 128,
        param window: i32,
        mask: q >= k && q - k < window,
    }
}

const WINDOW: usize = 1024;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let dims = Dims { model: 2048, heads: 16, heads_kv: 4, head_dim: 128, hidden: 5632 };
    let (batch, seq) = (1, 4096);
    let block = Block::new(dims, DType::BF16, &dev)?;
    let x = candle_core::Tensor::randn(0f32, 1.0, (batch, seq, dims.model), &dev)?.to_dtype(DType::BF16)?;
    let rope = Rope::new(seq, dims.head_dim, DType::BF16, &dev)?;
    let attention = Attention::new(Window::spec());
    let args = [Arg::I32(WINDOW as i32)];
    let flashgen = Attend::Flashgen(&attention, &args);
    let keep = keep_mask(seq, |q, k| q >= k && q - k < WINDOW, &dev)?;
    let plain = Attend::Plain { bias: None, keep: Some(&keep) };

    // The check: the block in f32 with candle's attention is the reference.
    let reference = {
        let block32 = Block { dtype: DType::F32, ..block.clone() };
        let rope32 = Rope::new(seq, dims.head_dim, DType::F32, &dev)?;
        block32.forward(&x.to_dtype(DType::F32)?, &rope32, &plain)?
    };
    let with_flashgen = block.forward(&x, &rope, &flashgen)?;
    let with_candle = block.forward(&x, &rope, &plain)?;
    let (err_flashgen, err_candle) = (max_diff(&with_flashgen, &reference)?, max_diff(&with_candle, &reference)?);
    println!(
        "block output, max |error| against the f32 block: flashgen {err_flashgen:.4}, candle bf16 {err_candle:.4}"
    );
    if err_flashgen.is_nan() || err_flashgen > 2.0 * err_candle + 1e-6 {
        return Err("flashgen's block is more than twice as far from the f32 block as candle's".into());
    }

    let iters = 20;
    let forward = |attend: &Attend| time_ms(&dev, iters, || block.forward(&x, &rope, attend).map(drop));
    let step = |attend: &Attend| {
        time_ms(&dev, iters, || {
            let loss = block.forward(&x, &rope, attend)?.to_dtype(DType::F32)?.sqr()?.mean_all()?;
            loss.backward().map(drop)
        })
    };
    let (f_flashgen, f_candle) = (forward(&flashgen)?, forward(&plain)?);
    let (s_flashgen, s_candle) = (step(&flashgen)?, step(&plain)?);
    let per_token = |ms: f64| ms * 1e3 / (batch * seq) as f64;
    println!("{:<28} {:>10} {:>10} {:>8}", format!("block, {batch}×{seq} tokens"), "flashgen", "candle", "speedup");
    println!("{:<28} {:>7.2} ms {:>7.2} ms {:>7.2}×", "forward", f_flashgen, f_candle, f_candle / f_flashgen);
    println!("{:<28} {:>7.3} µs {:>7.3} µs", "forward per token", per_token(f_flashgen), per_token(f_candle));
    println!("{:<28} {:>7.2} ms {:>7.2} ms {:>7.2}×", "training step", s_flashgen, s_candle, s_candle / s_flashgen);
    Ok(())
}
