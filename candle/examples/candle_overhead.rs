//! What the candle op costs over a direct flashgen launch on the same
//! buffers: time per call to completion and host time per call, medians
//! of alternating rounds.
//!
//! Run on a machine with an NVIDIA GPU: `cargo run --release --example
//! candle_overhead` in candle/.

use candle_core::{DType, Device, Storage, Tensor};
use flashgen::half::bf16;
use flashgen::{ArgValue, ForwardIo, ForwardOptions, Layout};
use flashgen_candle::{Arg, Attention};
use std::time::Instant;

flashgen::attention! {
    pub Causal { dtype: bf16, head_dim: 128, mask: q >= k }
}

/// Mean (host milliseconds per call, milliseconds per call to completion)
/// of `calls` calls of `f`.
fn per_call(
    dev: &Device,
    calls: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<(f64, f64)> {
    f()?;
    dev.synchronize()?;
    let (mut host, start) = (0.0, Instant::now());
    for _ in 0..calls {
        let call = Instant::now();
        f()?;
        host += call.elapsed().as_secs_f64();
    }
    dev.synchronize()?;
    let total = start.elapsed().as_secs_f64();
    Ok((host * 1e3 / calls as f64, total * 1e3 / calls as f64))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &dev else { return Err("no CUDA device".into()) };
    let attention = Attention::new(Causal::spec());
    let rt = attention.runtime(cuda)?;
    println!("{:<24} {:>12} {:>12} {:>12} {:>12}", "shape", "direct host", "op host", "direct", "op");
    for (batch, seq, heads) in [(1, 4096, 16), (4, 4096, 16), (1, 256, 4)] {
        let layout = Layout::bshd(batch, seq, heads, 128);
        let random = || Tensor::randn(0f32, 1.0, (batch, seq, heads, 128), &dev)?.to_dtype(DType::BF16);
        let (q, k, v) = (random()?, random()?, random()?);
        let mut o = cuda.alloc_zeros::<bf16>(layout.len())?;
        let guards = [&q, &k, &v].map(|t| t.storage_and_layout());
        let slices = guards.each_ref().map(|(s, _)| match &**s {
            Storage::Cuda(s) => s.as_cuda_slice::<bf16>(),
            _ => Err(candle_core::Error::Msg("a tensor off the GPU".into())),
        });
        let [qs, ks, vs] = slices;
        let (qs, ks, vs) = (qs?, ks?, vs?);
        let calls = if seq >= 4096 { 50 } else { 1000 };
        let mut direct = || {
            per_call(&dev, calls, || {
                let io =
                    ForwardIo { q: (qs, layout), k: (ks, layout), v: (vs, layout), o: (&mut o, layout), lse: None };
                rt.forward(Causal::spec(), io, &[] as &[ArgValue], &ForwardOptions::default())
                    .map_err(candle_core::Error::wrap)
            })
        };
        let op = || per_call(&dev, calls, || attention.forward(&q, &k, &v, &[] as &[Arg]).map(drop));
        // Alternating rounds, so that clocks and the memory pool's state
        // favour neither; medians of each.
        let mut samples: [Vec<f64>; 4] = Default::default();
        for _ in 0..7 {
            let ((direct_host, direct_ms), (op_host, op_ms)) = (direct()?, op()?);
            for (sample, value) in samples.iter_mut().zip([direct_host, direct_ms, op_host, op_ms]) {
                sample.push(value);
            }
        }
        let [direct_host, direct_ms, op_host, op_ms] = samples.map(median);
        drop(guards);
        let name = format!("{batch}×{seq}, {heads} heads");
        println!(
            "{name:<24} {:>9.1} µs {:>9.1} µs {:>9.3} ms {:>9.3} ms  (op ÷ direct {:.3})",
            direct_host * 1e3,
            op_host * 1e3,
            direct_ms,
            op_ms,
            op_ms / direct_ms
        );
    }
    Ok(())
}
