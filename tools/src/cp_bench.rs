//! `flashgen-bench --cp [--lens 131072,524288] [--cp-variants causal,document,window]`:
//! context parallelism's scaling. bf16, d = 128, 16 heads, one sequence of
//! each length: the forward, and the forward with the backward, on one GPU
//! (the unsharded launch) and sharded over every visible GPU through NCCL
//! (zigzag, each schedule). Wall time from a barrier of all ranks to the
//! last rank's finish, median of `iters`; TFLOP/s per GPU on the kept
//! pairs; strong-scaling efficiency `T₁ / (N · T_N)`.

use flashgen::codegen::Spec;
use flashgen::context_parallel::{ContextParallel, Partition, Schedule, ShardIo, Sharding, Whole};
use flashgen::cudarc::driver::CudaSlice;
use flashgen::half::bf16;
use flashgen::runtime::{
    ArgValue, BackwardIo, BackwardOptions, Communicator, Error, ForwardIo, ForwardOptions, Layout, Runtime,
};
use std::sync::Barrier;
use std::time::Instant;

const HEADS: usize = 16;
const DIM: usize = 128;
/// Documents of the `document` row: equal lengths.
const DOCUMENTS: usize = 8;
/// The `window` row's window.
const WINDOW: i32 = 4096;

/// A row's spec, its params' values and its kept pairs at `len`.
fn variant(name: &str, len: usize) -> Option<(Spec, Vec<i32>, f64)> {
    let l = len as f64;
    let (body, params, pairs) = match name {
        "causal" => ("mask: q >= k,", vec![], l * (l + 1.0) / 2.0),
        "document" => {
            let d = l / DOCUMENTS as f64;
            (
                "tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k,",
                vec![],
                DOCUMENTS as f64 * d * (d + 1.0) / 2.0,
            )
        }
        "window" => {
            let w = f64::from(WINDOW).min(l);
            ("param window: i32, mask: q >= k && q - k < window,", vec![WINDOW], l * w - w * (w - 1.0) / 2.0)
        }
        _ => return None,
    };
    let spec = flashgen::parse_one(&format!("Cp {{ dtype: bf16, head_dim: {DIM}, {body} }}")).ok()?;
    Some((spec, params, pairs))
}

/// The params, then the document ids where the spec reads them.
fn args<'a>(spec: &Spec, params: &[i32], doc: &'a CudaSlice<i32>) -> Vec<ArgValue<'a>> {
    let mut args: Vec<ArgValue<'a>> = params.iter().map(|&p| ArgValue::I32(p)).collect();
    if !spec.tensors.is_empty() {
        args.push(doc.into());
    }
    args
}

/// One device's operands: Q, K, V, O, dO, dQ, dK, dV (`rows` each), the
/// LSE, and the document ids of the whole sequence.
struct Buffers {
    qkvo: [CudaSlice<bf16>; 4],
    grads: [CudaSlice<bf16>; 4],
    lse: CudaSlice<f32>,
    doc: CudaSlice<i32>,
    layout: Layout,
}

impl Buffers {
    /// Random-looking operands (a drawn block repeated), documents of equal length.
    fn new(rt: &Runtime, rows: usize, whole: usize) -> Result<Buffers, Error> {
        let s = rt.stream();
        let layout = Layout::bshd(1, rows, HEADS, DIM);
        let block: Vec<bf16> = (0..1 << 20)
            .map(|i: u32| bf16::from_f32(((i.wrapping_mul(2654435761) >> 8) % 2000) as f32 / 1000.0 - 1.0))
            .collect();
        let fill = |n: usize| -> Result<CudaSlice<bf16>, Error> {
            let mut buf = s.alloc_zeros::<bf16>(n).map_err(|e| Error::driver("allocating a bench operand", e))?;
            for at in (0..n).step_by(block.len()) {
                let m = block.len().min(n - at);
                s.memcpy_htod(&block[..m], &mut buf.slice_mut(at..at + m)).map_err(|e| Error::driver("filling", e))?;
            }
            Ok(buf)
        };
        let n = layout.len();
        let ids: Vec<i32> = (0..whole).map(|i| (i * DOCUMENTS / whole.max(1)) as i32).collect();
        Ok(Buffers {
            qkvo: [fill(n)?, fill(n)?, fill(n)?, fill(n)?],
            grads: [fill(n)?, fill(n)?, fill(n)?, fill(n)?],
            lse: s.alloc_zeros::<f32>(HEADS * rows).map_err(|e| Error::driver("allocating the LSE", e))?,
            doc: s.clone_htod(&ids).map_err(|e| Error::driver("uploading documents", e))?,
            layout,
        })
    }

    /// One forward (and backward): unsharded, or this rank's share of `cp`.
    fn step(
        &mut self,
        rt: &Runtime,
        (spec, params): (&Spec, &[i32]),
        cp: Option<ContextParallel<'_>>,
        backward: bool,
    ) -> Result<(), Error> {
        let Buffers { qkvo: [q, k, v, o], grads, lse, doc, layout: l } = self;
        let (l, args) = (*l, args(spec, params, doc));
        // Unsharded, a mask that reads tensors skips tiles by a block mask
        // built per launch, as each sharded piece builds its own.
        let mask = match cp.is_none() && !spec.tensors.is_empty() {
            true => Some(rt.block_mask(
                spec,
                flashgen::Shape { batch: 1, heads: HEADS, heads_kv: HEADS, q_len: l.seq, kv_len: l.seq },
                &args,
            )?),
            false => None,
        };
        match cp {
            Some(cp) => {
                let io = ShardIo { q: (&*q, l), k: (&*k, l), v: (&*v, l), o: (&mut *o, l), lse: &mut *lse };
                rt.forward_sharded(spec, cp, io, &args, &ForwardOptions::default())?;
            }
            None => {
                let io = ForwardIo { q: (&*q, l), k: (&*k, l), v: (&*v, l), o: (&mut *o, l), lse: Some(&mut *lse) };
                rt.forward(spec, io, &args, &ForwardOptions { block_mask: mask.as_ref(), ..Default::default() })?;
            }
        }
        if !backward {
            return Ok(());
        }
        let [d_o, dq, dk, dv] = grads;
        let io = BackwardIo {
            q: (&*q, l),
            k: (&*k, l),
            v: (&*v, l),
            o: (&*o, l),
            lse: &*lse,
            d_o: (&*d_o, l),
            dq: (dq, l),
            dk: (dk, l),
            dv: (dv, l),
            d_tensors: vec![],
        };
        match cp {
            Some(cp) => rt.backward_sharded(spec, cp, io, &args, &BackwardOptions::default()),
            None => rt.backward(spec, io, &args, &BackwardOptions { block_mask: mask.as_ref(), ..Default::default() }),
        }
    }
}

fn sync(rt: &Runtime) -> Result<(), Error> {
    rt.stream().synchronize().map_err(|e| Error::driver("waiting for a rank", e))
}

/// Median milliseconds of `iters` runs of `step` after one warm-up.
fn median(iters: usize, mut step: impl FnMut() -> Result<(), Error>) -> Result<f64, Error> {
    step()?;
    let mut times = Vec::new();
    for _ in 0..iters {
        let start = Instant::now();
        step()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Median milliseconds of the sharded step over every rank, one thread each.
fn sharded_ms(
    runtimes: &[Runtime],
    spec: &Spec,
    params: &[i32],
    len: usize,
    schedule: Schedule,
    backward: bool,
    iters: usize,
) -> Result<f64, Error> {
    let n = runtimes.len();
    let sharding = Sharding { ranks: n, partition: Partition::Zigzag };
    let comms = Communicator::all_local(&runtimes.iter().collect::<Vec<_>>())?;
    let barrier = Barrier::new(n);
    let times: Vec<Result<Vec<f64>, Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> = runtimes
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(r, (rt, comm))| {
                let barrier = &barrier;
                scope.spawn(move || -> Result<Vec<f64>, Error> {
                    let mut buffers = Buffers::new(rt, sharding.local_len(len, r), len)?;
                    let cp =
                        ContextParallel { sharding, whole: Whole { q_len: len, kv_len: len }, schedule, comm: &comm };
                    let mut times = Vec::new();
                    for i in 0..=iters {
                        sync(rt)?;
                        barrier.wait();
                        let start = Instant::now();
                        buffers.step(rt, (spec, params), Some(cp), backward)?;
                        sync(rt)?;
                        comm.stream().synchronize().map_err(|e| Error::driver("waiting for exchanges", e))?;
                        barrier.wait();
                        if i > 0 {
                            times.push(start.elapsed().as_secs_f64() * 1e3);
                        }
                    }
                    Ok(times)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank's thread panicked")).collect()
    });
    let mut first = times.into_iter().next().expect("a rank")?;
    first.sort_by(f64::total_cmp);
    Ok(first[first.len() / 2])
}

/// Prints a row per variant, length, pass and schedule.
pub fn run(lens: &[usize], variants: &[String], iters: usize) {
    let gpus = flashgen::cudarc::driver::CudaContext::device_count().unwrap_or(0).max(0) as usize;
    let runtimes: Vec<Runtime> = match (0..gpus).map(Runtime::new).collect() {
        Ok(r) => r,
        Err(e) => return eprintln!("cannot start the GPUs: {e}"),
    };
    let Some(rt) = runtimes.first() else { return eprintln!("no GPU") };
    println!(
        "device: {} ×{gpus} ({}), context parallel: bf16, d={DIM}, {HEADS} heads, zigzag, median of {iters}",
        rt.device_name(),
        rt.arch()
    );
    println!(
        "{:<9} {:>7} {:<8} {:<10} {:>4} {:>10} {:>12} {:>7}",
        "variant", "tokens", "pass", "schedule", "GPUs", "ms", "TFLOP/s/GPU", "effic."
    );
    for name in variants {
        for &len in lens {
            let Some((spec, params, pairs)) = variant(name, len) else {
                eprintln!("unknown variant `{name}`");
                continue;
            };
            for backward in [false, true] {
                let flops = pairs * (HEADS * 4 * DIM) as f64 * if backward { 3.5 } else { 1.0 };
                let pass = if backward { "fwd+bwd" } else { "fwd" };
                let one = Buffers::new(rt, len, len).and_then(|mut b| {
                    median(iters, || {
                        b.step(rt, (&spec, &params), None, backward)?;
                        sync(rt)
                    })
                });
                let row = |schedule: &str, n: usize, ms: Result<f64, Error>, base: Option<f64>| match ms {
                    Ok(ms) => {
                        let eff = base.map_or(String::new(), |b| format!("{:.2}", b / (n as f64 * ms)));
                        println!(
                            "{name:<9} {len:>7} {pass:<8} {schedule:<10} {n:>4} {ms:>10.2} {:>12.0} {eff:>7}",
                            flops / (ms * 1e-3) / 1e12 / n as f64
                        );
                    }
                    Err(e) => println!("{name:<9} {len:>7} {pass:<8} {schedule:<10} {n:>4} error: {e}"),
                };
                let base = one.as_ref().ok().copied();
                row("unsharded", 1, one, None);
                if gpus < 2 {
                    continue;
                }
                for schedule in [Schedule::Ring, Schedule::AllGather] {
                    let ms = sharded_ms(&runtimes, &spec, &params, len, schedule, backward, iters);
                    row(&format!("{schedule:?}"), gpus, ms, base);
                }
            }
        }
    }
}
