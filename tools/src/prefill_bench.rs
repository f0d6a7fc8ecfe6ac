//! `flashgen-bench --prefill`: chunked prefill against a paged KV cache.
//! bf16, d = 128, 16 heads, 2 sequences, each a chunk of 2048 new queries
//! after `cached` keys already in the cache (bottom-right causal: the chunk's
//! last query sees every key), the cache in pages of 16 or 256 rows under a
//! shuffled block table; against the dense-KV launch of the same shape
//! (`Runtime::forward`, K/V contiguous). Cold L2 before every launch,
//! median of CUDA-event timings; TFLOP/s on the kept pairs; and the host
//! time of one launch call (20 back to back, then a wait).

use crate::verify::paged::{into_pages, DevicePaged, Queries};
use crate::verify::varlen::{random_varlen_problem, DeviceVarlen, Packing};
use crate::verify::{random_problem, DeviceProblem, OperandLayout};
use flashgen::codegen::Shape;
use flashgen::runtime::{Error, Runtime};
use std::time::Instant;

const HEADS: usize = 16;
const BATCH: usize = 2;
const CHUNK: usize = 2048;
const L2_FLUSH_BYTES: usize = 256 << 20;
const SPEC: &str = "Prefill { dtype: bf16, head_dim: 128, mask: q + kv_len - q_len >= k }";

/// Prints a row per cache length: dense K/V, then pages of 16 and 256 rows.
pub fn run(rt: &Runtime, cached: &[usize], iters: usize) {
    println!(
        "device: {} ({}), chunked prefill: bf16, d=128, {HEADS} heads, batch {BATCH}, {CHUNK} new queries, \
         median of {iters}",
        rt.device_name(),
        rt.arch()
    );
    println!(
        "{:<14} {:>7} {:>7} {:>10} {:>9} {:>8} {:>9}",
        "row", "cached", "kv_len", "ms", "TFLOP/s", "÷ dense", "host µs"
    );
    let spec = flashgen::parse_one(SPEC).expect("a valid spec");
    for &before in cached {
        let kv_len = before + CHUNK;
        // Query i of the chunk sees `before + i + 1` keys.
        let pairs = BATCH * (CHUNK * before + CHUNK * (CHUNK + 1) / 2);
        let tflops = |ms: f64| 4.0 * 128.0 * (HEADS * pairs) as f64 / (ms * 1e-3) / 1e12;
        let shape = Shape { batch: BATCH, heads: HEADS, heads_kv: HEADS, q_len: CHUNK, kv_len };
        let dense = random_problem(&spec, shape, vec![], vec![], None, kv_len as u64);
        let dense_ms = DeviceProblem::upload(rt, &spec, &dense, OperandLayout::Bshd).and_then(|mut gpu| {
            gpu.flush_l2(L2_FLUSH_BYTES)?;
            let ms = gpu.time(rt, &spec, &dense, iters)?;
            Ok((ms, host_us(rt, || gpu.launch(rt, &spec, &dense))?))
        });
        drop(dense);
        let dense_tflops = dense_ms.as_ref().ok().map(|&(ms, _)| tflops(ms));
        print_row("dense-kv", before, kv_len, dense_ms.map(|(ms, us)| (ms, tflops(ms), us)), dense_tflops);
        let lens = vec![(CHUNK, kv_len); BATCH];
        let varlen = random_varlen_problem(&spec, (HEADS, HEADS), &lens, vec![], kv_len as u64);
        // The same sequences packed (K/V contiguous per sequence): what the
        // paged kernel adds the gather to.
        let packed = DeviceVarlen::upload(rt, &spec, &varlen, Packing::Thd).and_then(|mut gpu| {
            let ms = gpu.time(rt, &spec, &varlen, L2_FLUSH_BYTES, iters)?;
            Ok((ms, host_us(rt, || gpu.launch(rt, &spec, &varlen))?))
        });
        print_row("varlen", before, kv_len, packed.map(|(ms, us)| (ms, tflops(ms), us)), dense_tflops);
        for page_size in [16, 256] {
            let paged = into_pages(&spec, &varlen, page_size, 4, page_size as u64);
            let timed = DevicePaged::upload(rt, &spec, &paged, Queries::Packed).and_then(|mut gpu| {
                let ms = gpu.time(rt, &spec, &paged, L2_FLUSH_BYTES, iters)?;
                Ok((ms, host_us(rt, || gpu.launch(rt, &spec, &paged))?))
            });
            let row = timed.map(|(ms, us)| (ms, tflops(ms), us));
            print_row(&format!("paged-{page_size}"), before, kv_len, row, dense_tflops);
        }
    }
}

/// Host microseconds per call of `launch`: 20 calls back to back, timed
/// without waiting for the GPU, then a wait.
fn host_us(rt: &Runtime, mut launch: impl FnMut() -> Result<(), Error>) -> Result<f64, Error> {
    let start = Instant::now();
    for _ in 0..20 {
        launch()?;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / 20.0;
    rt.stream().synchronize().map_err(|e| Error::driver("wait for the launches", e))?;
    Ok(us)
}

fn print_row(name: &str, cached: usize, kv_len: usize, timed: Result<(f64, f64, f64), Error>, dense: Option<f64>) {
    match timed {
        Ok((ms, tflops, us)) => {
            let ratio = dense.map_or("-".to_string(), |d| format!("{:.2}", tflops / d));
            println!("{name:<14} {cached:>7} {kv_len:>7} {ms:>10.3} {tflops:>9.1} {ratio:>8} {us:>9.1}");
        }
        Err(e) => println!("{name:<14} {cached:>7} {kv_len:>7} error: {e}"),
    }
}
