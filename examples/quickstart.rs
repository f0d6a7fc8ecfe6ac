//! Quickstart: define a variant with `attention!`, JIT-compile it, and — on
//! a machine with an NVIDIA GPU — run it on random inputs and check it
//! against the f64 CPU reference.
//!
//! Run with `scripts/quickstart.sh` (it fetches NVRTC when no CUDA toolkit is
//! installed), or `cargo run --release --example quickstart`.

use flashgen::codegen::reference::{self, ParamValue, Precision, Problem, TensorData};
use flashgen::half::bf16;
use flashgen::runtime::{compile_cubin, Arch};
use flashgen::{attention, ForwardIo, ForwardOptions, Layout, Runtime, Shape};
use std::time::Instant;

attention! {
    /// Causal sliding window with ALiBi (Mistral/MPT style).
    pub SlidingAlibi {
        dtype: bf16, head_dim: 128,
        param window: i32,          // runtime scalar: changing it never recompiles
        tensor slopes: f32[H],      // captured tensor, one value per query head
        mask: q >= k && q - k < window,
        score: score + slopes[h] * (k - q) as f32,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("spec:\n{}", SlidingAlibi::SOURCE);
    let kernel = SlidingAlibi::kernel();
    println!("generated `{}`: {} lines of CUDA", kernel.name, kernel.source.lines().count());

    // NVRTC needs no GPU: this works on any machine with libnvrtc.
    let arch: Arch = "sm_90".parse()?;
    let start = Instant::now();
    let cubin = compile_cubin(&kernel, arch)?;
    println!("NVRTC: {arch} CUBIN of {} bytes in {:.0} ms", cubin.len(), start.elapsed().as_secs_f64() * 1e3);

    let rt = match Runtime::new(0) {
        Ok(rt) => rt,
        Err(e) if e.is_no_gpu() => {
            println!("no GPU here ({e}): skipping the run; the kernel was generated and compiled above");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    println!("GPU: {} ({})", rt.device_name(), rt.arch());

    // Two sequences of 1024 tokens, 8 heads, window 256, ALiBi slopes 2^(-8(h+1)/H).
    let shape = Shape { batch: 2, heads: 8, heads_kv: 8, q_len: 1024, kv_len: 1024 };
    let window = 256;
    let slopes: Vec<f64> = (0..shape.heads).map(|h| 2f64.powf(-8.0 * (h + 1) as f64 / shape.heads as f64)).collect();
    let mut random = uniform_bf16(seed());
    let len = shape.batch * shape.q_len * shape.heads * 128;
    let problem = Problem {
        shape,
        q: random(len),
        k: random(len),
        v: random(len),
        scale: (1.0 / 128f32.sqrt()) as f64, // the launch default, as the GPU gets it
        params: vec![ParamValue::I32(window)],
        tensors: vec![TensorData::Float(slopes.clone())],
    };

    // Upload, poison O with NaN, launch through the typed API.
    let stream = rt.stream();
    let to_bf16 = |x: &[f64]| x.iter().map(|&v| bf16::from_f64(v)).collect::<Vec<_>>();
    let q = stream.clone_htod(&to_bf16(&problem.q))?;
    let k = stream.clone_htod(&to_bf16(&problem.k))?;
    let v = stream.clone_htod(&to_bf16(&problem.v))?;
    let layout = Layout::bshd(shape.batch, shape.q_len, shape.heads, 128);
    let mut o = stream.clone_htod(&vec![bf16::NAN; layout.len()])?;
    let slopes_gpu = stream.clone_htod(&slopes.iter().map(|&s| s as f32).collect::<Vec<_>>())?;
    let args = SlidingAlibiArgs { window, slopes: &slopes_gpu };

    let start = Instant::now();
    let io = ForwardIo { q: (&q, layout), k: (&k, layout), v: (&v, layout), o: (&mut o, layout), lse: None };
    SlidingAlibi::forward(&rt, io, &args, &ForwardOptions::default())?;
    stream.synchronize()?;
    println!("first call (JIT compile + load + run): {:.0} ms", start.elapsed().as_secs_f64() * 1e3);

    let out: Vec<f64> = stream.clone_dtoh(&o)?.iter().map(|x| x.to_f64()).collect();
    let spec = SlidingAlibi::spec();
    let golden = reference::forward(spec, &problem, Precision::F64)?;
    let same = reference::forward(spec, &problem, Precision::SameDtype(spec.dtype))?;
    let check = reference::flash_rule(&out, &same.o, &golden.o, reference::FORWARD_FACTOR);
    println!("check against the f64 reference: {check}");
    if !check.passed {
        return Err("the GPU result failed FlashAttention's error rule".into());
    }
    Ok(())
}

/// Fresh inputs on every run.
fn seed() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// Draws of `n` values uniform in [-1, 1), exactly representable in bf16
/// (xorshift64*: no dependency for a demo's inputs).
fn uniform_bf16(seed: u64) -> impl FnMut(usize) -> Vec<f64> {
    let mut state = seed | 1;
    move |n| {
        (0..n)
            .map(|_| {
                state ^= state >> 12;
                state ^= state << 25;
                state ^= state >> 27;
                let unit = (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
                bf16::from_f64(2.0 * unit - 1.0).to_f64()
            })
            .collect()
    }
}
