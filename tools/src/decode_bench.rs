//! `flashgen-bench --decode`: the decode path's memory bandwidth. bf16, one
//! query token per sequence under the bottom-right causal mask (every key
//! kept), the models of [`models`] (by default d = 128, 32 query heads over
//! 8 K/V heads; other [`VARIANTS`] add a score or sink), batch × cache
//! length from the flags; each step after 256 MB of zeros written (a cold
//! L2), median of CUDA-event timings. GB/s = the K and V bytes a step must
//! read ÷ its time. A device-to-device copy row gives the ceiling ((read +
//! written bytes) ÷ time), and each row the host time of one
//! `DecodePlan::run` (without event tracking, also of one replay of the
//! step captured in a CUDA graph). Each shape runs on a dense cache
//! (`decode` rows) and on paged caches of 16-row pages (`paged16` rows:
//! `DecodePlan::run_paged`, each sequence's pages in a shuffled order, as a
//! serving loop's pool hands them out). With `--e4m3` each also runs on
//! e4m3 caches (`-e4m3` rows: `DecodePlan::run_e4m3`, per-K/V-head
//! descales), GB/s then of the bytes an e4m3 step reads: half the bf16
//! rows'. With `--decode-mla` the rows are MLA's absorbed decode instead
//! ([`DecodeModel::mla`]: QK 576 / V 512, one K/V head, V read from K's
//! tiles as a view of K), GB/s of the one 576-column cache a step reads.
//! With `--tune` each row's plan first tunes its split count on the row's
//! own step (`DecodePlan::tune`, a `tune` line listing every candidate's
//! time), and the row runs the fastest.

use crate::verify::{cold_median_ms, driver as driver_error};
use flashgen::cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream, DriverError};
use flashgen::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use flashgen::half::bf16;
use flashgen::runtime::{
    ArgValue, DecodeIo, DecodeOptions, DecodePlan, DecodeShape, Descale, Error, KvCacheDtype, KvDescale, Layout,
    PagedDecodeIo, PagedKv, PagedLayout, Runtime,
};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::sync::Arc;
use std::time::Instant;

/// What a row decodes: the spec, its heads (query, K/V) and head dims, and
/// whether V is K's first columns (a view of K, `DecodeOptions::v_in_k`).
#[derive(Clone, Debug)]
pub struct DecodeModel {
    pub spec: String,
    pub heads: (usize, usize),
    pub dims: (usize, usize),
    pub v_in_k: bool,
}

/// The variants `--decode-variants` names: each reads the whole cache (the
/// bottom-right causal mask at one query token keeps every key), and its
/// tensors hold a value per query head: `(name, spec body)`.
pub const VARIANTS: [(&str, &str); 4] = [
    ("causal", "mask: q + kv_len - q_len >= k"),
    (
        "alibi",
        "tensor slopes: f32[H], mask: q + kv_len - q_len >= k, score: score + slopes[h] * (k - q - kv_len + q_len) as f32",
    ),
    ("softcap", "mask: q + kv_len - q_len >= k, score: 30.0 * tanh(score / 30.0)"),
    ("sinks", "tensor sinks: f32[H], mask: q + kv_len - q_len >= k, sink: sinks[h]"),
];

impl DecodeModel {
    /// GQA decoding of `variant` (a name of [`VARIANTS`]), bf16: `heads`
    /// query heads over `heads_kv` K/V heads of head dim `d` (the issue's
    /// table: causal, 32 over 8 at 128).
    pub fn gqa(variant: &str, (heads, heads_kv): (usize, usize), d: usize) -> Option<DecodeModel> {
        let (_, body) = VARIANTS.iter().find(|(name, _)| *name == variant)?;
        Some(DecodeModel {
            spec: format!("Decode {{ dtype: bf16, head_dim: {d}, {body} }}"),
            heads: (heads, heads_kv),
            dims: (d, d),
            v_in_k: false,
        })
    }

    /// MLA's absorbed decode (DeepSeek-V2/V3): `heads` query heads over one
    /// 576-column cache whose first 512 columns are V.
    pub fn mla(heads: usize) -> DecodeModel {
        DecodeModel {
            spec: "Mla { dtype: bf16, head_dim: 576, v_head_dim: 512, mask: q + kv_len - q_len >= k }".into(),
            heads: (heads, 1),
            dims: (576, 512),
            v_in_k: true,
        }
    }

    /// Bytes of cache elements a step must read per key: K and V, or K
    /// alone where V is its first columns.
    fn elements_per_key(&self) -> usize {
        let (dqk, dv) = self.dims;
        self.heads.1 * if self.v_in_k { dqk } else { dqk + dv }
    }
}

/// The GQA models of every variant × head dim × heads pair (`32/8`: query
/// heads over K/V heads) named; empty lists take the table
/// (causal, 128, 32/8).
pub fn models(variants: &[String], dims: &[String], heads: &[String]) -> Result<Vec<DecodeModel>, String> {
    let or = |given: &[String], default: &str| match given.is_empty() {
        true => vec![default.to_string()],
        false => given.to_vec(),
    };
    let mut models = vec![];
    for variant in or(variants, "causal") {
        for d in or(dims, "128") {
            let d = d.parse().map_err(|_| format!("--decode-dims {d}: not a head dim"))?;
            for pair in or(heads, "32/8") {
                let split = pair.split_once('/').and_then(|(h, k)| Some((h.parse().ok()?, k.parse().ok()?)));
                let heads =
                    split.ok_or(format!("--decode-heads {pair}: expected <query heads>/<K/V heads>, as 32/8"))?;
                let names = VARIANTS.map(|v| v.0);
                models.push(
                    DecodeModel::gqa(&variant, heads, d)
                        .ok_or(format!("--decode-variants {variant}: not one of {names:?}"))?,
                );
            }
        }
    }
    Ok(models)
}

/// Zeros written before every timed step: the forward rows' flush.
const L2_FLUSH_BYTES: usize = 256 << 20;
/// Caches past this many bytes (K and V) are skipped: they leave no room
/// on an 80 GB GPU.
const MAX_CACHE_BYTES: usize = 40 << 30;
/// The paged rows' page size (vLLM's default).
const PAGE_SIZE: usize = 16;

/// Prints `model`'s decode rows for every batch × cache length (on
/// `formats` of cache, at each of `splits`: a count, or 0 for the plan's
/// own, which `tune` tunes first), then the copy row.
pub fn run(
    rt: &Runtime,
    model: &DecodeModel,
    (batches, kv_lens): (&[usize], &[usize]),
    (formats, splits, tune): (&[KvCacheDtype], &[usize], bool),
    iters: usize,
) {
    let tracking = if rt.context().is_event_tracking() { "tracked" } else { "untracked" };
    println!(
        "device: {} ({}), decode: {}, bf16, d={}/{}, heads {}/{}{}, q_len 1, median of {iters}, events {tracking}",
        rt.device_name(),
        rt.arch(),
        model.spec,
        model.dims.0,
        model.dims.1,
        model.heads.0,
        model.heads.1,
        if model.v_in_k { ", V in K" } else { "" },
    );
    println!(
        "{:<13} {:>5} {:>7} {:>7} {:>10} {:>9} {:>9} {:>9}",
        "row", "batch", "kv_len", "splits", "ms", "GB/s", "host µs", "graph µs"
    );
    let spec = flashgen::parse_one(&model.spec).expect("a valid spec");
    for &kv_len in kv_lens {
        for &batch in batches {
            let bf16_bytes = batch * kv_len * model.elements_per_key() * 2;
            if bf16_bytes > MAX_CACHE_BYTES {
                println!("{:<10} {batch:>5} {kv_len:>7} skipped: {} GiB of K/V", "decode", bf16_bytes >> 30);
                continue;
            }
            for (&kv, &split) in formats.iter().flat_map(|kv| splits.iter().map(move |s| (kv, s))) {
                let bytes = bf16_bytes / 2 * kv.bytes() as usize;
                let suffix = if kv == KvCacheDtype::E4m3 { "-e4m3" } else { "" };
                let split = (split > 0).then_some(split);
                for (row, page_size) in [("decode", None), ("paged16", Some(PAGE_SIZE))] {
                    let row = format!("{row}{suffix}");
                    let plan = (page_size, kv, split, tune);
                    match time_decode(rt, (model, &spec), (batch, kv_len), plan, iters) {
                        Ok((splits, Timed { ms, host_us, graph_us })) => {
                            let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
                            let graph = graph_us.map_or("-".into(), |us| format!("{us:.2}"));
                            println!(
                                "{row:<13} {batch:>5} {kv_len:>7} {splits:>7} {ms:>10.4} {gbs:>9.0} {host_us:>9.2} {graph:>9}"
                            );
                        }
                        Err(e) => println!("{row:<13} {batch:>5} {kv_len:>7} error: {e}"),
                    }
                }
            }
        }
    }
    match time_copy(rt, 1 << 30, iters) {
        Ok(ms) => {
            let gbs = 2.0 * (1u64 << 30) as f64 / (ms * 1e-3) / 1e9;
            println!("{:<13} {:>5} {:>7} {:>7} {ms:>10.4} {gbs:>9.0}", "d2d-copy", "-", "1 GiB", "-");
        }
        Err(e) => println!("d2d-copy error: {e}"),
    }
}

/// One plan's split count, median step time (ms) and host µs per run, on
/// a dense cache or (`page_size`) paged ones, of bf16 or e4m3 (`kv`), split
/// as the plan chooses (tuned first where `tune`) or `splits` ways.
fn time_decode(
    rt: &Runtime,
    (model, spec): (&DecodeModel, &flashgen::Spec),
    (batch, kv_len): (usize, usize),
    (page_size, kv, splits, tune): (Option<usize>, KvCacheDtype, Option<usize>, bool),
    iters: usize,
) -> Result<(usize, Timed), Error> {
    let (heads, heads_kv) = model.heads;
    let shape = DecodeShape { batch, heads, heads_kv, q_len: 1, max_kv_len: kv_len };
    let opts = DecodeOptions {
        paged: page_size.is_some(),
        kv_cache: kv,
        v_in_k: model.v_in_k,
        splits,
        ..DecodeOptions::default()
    };
    let mut plan = rt.decode_plan(spec, shape, &opts)?;
    let tune = tune && splits.is_none();
    // The spec's tensors, each a value per query head.
    let tensors = (0..spec.tensors.len())
        .map(|_| rt.stream().clone_htod(&vec![0.0625f32; heads]).map_err(driver_error("upload a tensor")))
        .collect::<Result<Vec<CudaSlice<f32>>, Error>>()?;
    let args: Vec<ArgValue> = tensors.iter().map(ArgValue::from).collect();
    let timed = match kv {
        KvCacheDtype::Spec => {
            let with = With { descale: None, args: &args };
            time_steps::<bf16>(rt, (&mut plan, model), (page_size, tune), with, iters)?
        }
        KvCacheDtype::E4m3 => {
            let ones = rt.stream().clone_htod(&vec![1f32; heads_kv]).map_err(driver_error("upload descales"))?;
            let descale = KvDescale { k: Descale::PerKvHead(&ones), v: Descale::PerKvHead(&ones) };
            let with = With { descale: Some(descale), args: &args };
            time_steps::<u8>(rt, (&mut plan, model), (page_size, tune), with, iters)?
        }
    };
    Ok((plan.splits(), timed))
}

/// A cache element the bench times, and the runs that read it.
trait Cache: DeviceRepr + ValidAsZeroBits + Unpin + Sized {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16, Self>, with: With) -> Step;
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16, Self>, with: With) -> Step;
}

type Step = Result<(), Error>;

/// What a run takes beside its operands: the descales of an e4m3 cache and
/// the spec's params and tensors.
#[derive(Clone, Copy)]
struct With<'a> {
    descale: Option<KvDescale<'a>>,
    args: &'a [ArgValue<'a>],
}

impl With<'_> {
    fn descale(&self) -> KvDescale<'_> {
        self.descale.expect("e4m3 runs take descales")
    }
}

impl Cache for bf16 {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16>, with: With) -> Step {
        plan.run(rt, io, with.args)
    }
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16>, with: With) -> Step {
        plan.run_paged(rt, io, with.args)
    }
}

impl Cache for u8 {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16, u8>, with: With) -> Step {
        plan.run_e4m3(rt, io, with.descale(), with.args)
    }
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16, u8>, with: With) -> Step {
        plan.run_paged_e4m3(rt, io, with.descale(), with.args)
    }
}

/// A row's times: the median step (ms), the host's µs per run, and per
/// replay of the step captured in a CUDA graph (without event tracking
/// only: a capture records no events).
struct Timed {
    ms: f64,
    host_us: f64,
    graph_us: Option<f64>,
}

/// Back-to-back calls of `step` (queued faster than the GPU drains them):
/// host µs per call.
fn host_us(stream: &CudaStream, mut step: impl FnMut() -> Step) -> Result<f64, Error> {
    let runs = 200;
    let start = Instant::now();
    for _ in 0..runs {
        step()?;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / runs as f64;
    stream.synchronize().map_err(driver_error("wait for the decode steps"))?;
    Ok(us)
}

/// The times of `plan` (of `model`) on caches of `C`, dense or
/// (`page_size`) paged; V a view of K where the model says; the plan's
/// split count tuned on these steps first where `tune`.
fn time_steps<C: Cache>(
    rt: &Runtime,
    (plan, model): (&mut DecodePlan, &DecodeModel),
    (page_size, tune): (Option<usize>, bool),
    with: With,
    iters: usize,
) -> Result<Timed, Error> {
    let stream = rt.stream().clone();
    let DecodeShape { batch, max_kv_len: kv_len, .. } = plan.shape();
    // A paged cache holds the dense one's rows: every sequence's pages.
    let pages_per_seq = kv_len.div_ceil(page_size.unwrap_or(1));
    let ((heads, heads_kv), (dqk, dv)) = (model.heads, model.dims);
    let k_cache = PagedLayout::contiguous(batch * pages_per_seq, page_size.unwrap_or(1), heads_kv, dqk);
    let [lq, lk] = [Layout::bshd(batch, 1, heads, dqk), Layout::bshd(batch, kv_len, heads_kv, dqk)];
    let lo = Layout::bshd(batch, 1, heads, dv);
    // V: K's first columns at K's strides, or a cache of its own.
    let (v_cache, lv) = match model.v_in_k {
        true => (PagedLayout { dim: dv, ..k_cache }, Layout { dim: dv, ..lk }),
        false => {
            let paged = PagedLayout::contiguous(batch * pages_per_seq, page_size.unwrap_or(1), heads_kv, dv);
            (paged, Layout::bshd(batch, kv_len, heads_kv, dv))
        }
    };
    let during = driver_error("allocate the operands");
    let (q, mut o) =
        (stream.alloc_zeros::<bf16>(lq.len()).map_err(during)?, stream.alloc_zeros(lo.len()).map_err(during)?);
    let cache_len = |paged: PagedLayout, dense: Layout| match page_size {
        Some(_) => paged.as_layout().len(),
        None => dense.len(),
    };
    let k = stream.alloc_zeros::<C>(cache_len(k_cache, lk)).map_err(during)?;
    let own_v = match model.v_in_k {
        true => None,
        false => Some(stream.alloc_zeros::<C>(cache_len(v_cache, lv)).map_err(during)?),
    };
    let v = own_v.as_ref().unwrap_or(&k);
    let lens: CudaSlice<i32> =
        stream.clone_htod(&vec![kv_len as i32; batch]).map_err(driver_error("upload kv_lens"))?;
    let mut table: Vec<i32> = (0..(batch * pages_per_seq) as i32).collect();
    table.shuffle(&mut rand::rngs::StdRng::seed_from_u64(1));
    let table: CudaSlice<i32> = stream.clone_htod(&table).map_err(driver_error("upload the block table"))?;
    let mut step = |plan: &DecodePlan| match page_size {
        None => {
            let io = DecodeIo { q: (&q, lq), k: (&k, lk), v: (v, lv), o: (&mut o, lo), lse: None, kv_lens: &lens };
            C::run(plan, rt, io, with)
        }
        Some(_) => {
            let kv = PagedKv {
                k: (&k, k_cache),
                v: (v, v_cache),
                block_table: &table,
                pages_per_seq,
                kv_lens: &lens,
                max_kv_len: kv_len,
                batch,
            };
            C::run_paged(plan, rt, PagedDecodeIo { q: (&q, lq), o: (&mut o, lo), lse: None, kv }, with)
        }
    };
    if tune {
        let report = plan.tune(rt, &mut step)?;
        println!("tune {batch}x{kv_len}: {report}");
    }
    let plan = &*plan;
    let ms = cold_median_ms(&stream, L2_FLUSH_BYTES, iters, || step(plan))?;
    let host = host_us(&stream, || step(plan))?;
    let graph_us = match rt.context().is_event_tracking() {
        true => None,
        false => {
            let graph = capture(&stream, || step(plan))?;
            Some(host_us(&stream, || graph.launch().map_err(driver_error("replay the captured step")))?)
        }
    };
    Ok(Timed { ms, host_us: host, graph_us })
}

/// One `step` (queued on `stream`) captured into a CUDA graph.
pub fn capture(stream: &Arc<CudaStream>, step: impl FnOnce() -> Step) -> Result<CudaGraph, Error> {
    let during = driver_error("capture a decode step");
    stream.synchronize().map_err(during)?;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(during)?;
    let captured = step();
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).map_err(during)?;
    captured?;
    graph.ok_or_else(|| during(DriverError(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)))
}

/// Median ms of a device-to-device copy of `bytes` (cold L2).
fn time_copy(rt: &Runtime, bytes: usize, iters: usize) -> Result<f64, Error> {
    let stream = rt.stream().clone();
    let src = stream.alloc_zeros::<u8>(bytes).map_err(driver_error("allocate the copy source"))?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(driver_error("allocate the copy target"))?;
    cold_median_ms(&stream, L2_FLUSH_BYTES, iters, || stream.memcpy_dtod(&src, &mut dst).map_err(driver_error("copy")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant's spec parses, at each head dim the bench is run with,
    /// its tensors sized by the heads (the bench's one value a head).
    #[test]
    fn variants_parse_with_tensors_per_head() {
        for (name, _) in VARIANTS {
            for d in [64, 128, 256] {
                let model = DecodeModel::gqa(name, (32, 8), d).unwrap();
                let spec = flashgen::parse_one(&model.spec)
                    .unwrap_or_else(|e| panic!("{name}: {}", e.render(name, &model.spec)));
                for tensor in &spec.tensors {
                    assert!(matches!(tensor.dims[..], [flashgen::codegen::Dim::Heads]), "{name}");
                }
            }
        }
        assert!(DecodeModel::gqa("no-such-variant", (32, 8), 128).is_none());
    }

    /// The flags' lists multiply into models; empty ones take the issue's
    /// table; a bad entry is an error naming its flag.
    #[test]
    fn models_multiply_the_flags_lists() {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = models(&[], &[], &[]).unwrap();
        assert_eq!((one.len(), one[0].heads, one[0].dims), (1, (32, 8), (128, 128)));
        let many = models(&strings(&["causal", "alibi"]), &strings(&["128", "256"]), &strings(&["32/8", "64/8"]));
        assert_eq!(many.unwrap().len(), 8);
        for (v, d, h, flag) in [("x", "128", "32/8", "--decode-variants"), ("causal", "wide", "32/8", "--decode-dims")]
        {
            assert!(models(&strings(&[v]), &strings(&[d]), &strings(&[h])).unwrap_err().starts_with(flag));
        }
        assert!(models(&[], &[], &strings(&["32"])).unwrap_err().starts_with("--decode-heads"));
    }
}
