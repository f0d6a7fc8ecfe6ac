//! `flashgen-bench --decode`: the decode path's memory bandwidth. bf16,
//! d = 128, 32 query heads over 8 K/V heads, one query token per sequence
//! under the bottom-right causal mask (every key kept), batch × cache length
//! from the flags; each step after 256 MB of zeros written (a cold L2),
//! median of CUDA-event timings. GB/s = the K and V bytes a step must read
//! ÷ its time. A device-to-device copy row gives the ceiling ((read +
//! written bytes) ÷ time), and each row the host time of one
//! `DecodePlan::run`. Each shape runs on a dense cache (`decode` rows) and
//! on paged caches of 16-row pages (`paged16` rows: `DecodePlan::run_paged`,
//! each sequence's pages in a shuffled order, as a serving loop's pool
//! hands them out). With `--e4m3` each also runs on e4m3 caches
//! (`-e4m3` rows: `DecodePlan::run_e4m3`, per-K/V-head descales), GB/s
//! then of the bytes an e4m3 step reads: half the bf16 rows'. With
//! `--decode-mla` the rows are MLA's absorbed decode instead ([`MLA`]: QK
//! 576 / V 512, one K/V head, V read from K's tiles as a view of K), GB/s of
//! the one 576-column cache a step reads. With `--tune` each row's plan
//! first tunes its split count on the row's own step (`DecodePlan::tune`,
//! a `tune` line listing every candidate's time), and the row runs the
//! fastest.

use crate::verify::driver as driver_error;
use flashgen::cudarc::driver::CudaSlice;
use flashgen::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use flashgen::half::bf16;
use flashgen::runtime::{
    median_ms_after, DecodeIo, DecodeOptions, DecodePlan, DecodeShape, Descale, Error, KvCacheDtype, KvDescale, Layout,
    PagedDecodeIo, PagedKv, PagedLayout, Runtime,
};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::time::Instant;

/// What a row decodes: the spec, its heads (query, K/V) and head dims, and
/// whether V is K's first columns (a view of K, `DecodeOptions::v_in_k`).
#[derive(Clone, Copy, Debug)]
pub struct DecodeModel {
    pub spec: &'static str,
    pub heads: (usize, usize),
    pub dims: (usize, usize),
    pub v_in_k: bool,
}

/// The table: bf16, d = 128, 32 query heads over 8 K/V heads.
pub const GQA: DecodeModel = DecodeModel {
    spec: "Decode { dtype: bf16, head_dim: 128, mask: q + kv_len - q_len >= k }",
    heads: (32, 8),
    dims: (128, 128),
    v_in_k: false,
};

/// MLA's absorbed decode (DeepSeek-V2/V3): 128 query heads over one
/// 576-column cache whose first 512 columns are V.
pub const MLA: DecodeModel = DecodeModel {
    spec: "Mla { dtype: bf16, head_dim: 576, v_head_dim: 512, mask: q + kv_len - q_len >= k }",
    heads: (128, 1),
    dims: (576, 512),
    v_in_k: true,
};

impl DecodeModel {
    /// Bytes of cache elements a step must read per key: K and V, or K
    /// alone where V is its first columns.
    fn elements_per_key(&self) -> usize {
        let (dqk, dv) = self.dims;
        self.heads.1 * if self.v_in_k { dqk } else { dqk + dv }
    }
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
    model: DecodeModel,
    (batches, kv_lens): (&[usize], &[usize]),
    (formats, splits, tune): (&[KvCacheDtype], &[usize], bool),
    iters: usize,
) {
    let tracking = if rt.context().is_event_tracking() { "tracked" } else { "untracked" };
    println!(
        "device: {} ({}), decode: bf16, d={}/{}, heads {}/{}{}, q_len 1, median of {iters}, events {tracking}",
        rt.device_name(),
        rt.arch(),
        model.dims.0,
        model.dims.1,
        model.heads.0,
        model.heads.1,
        if model.v_in_k { ", V in K" } else { "" },
    );
    println!(
        "{:<13} {:>5} {:>7} {:>7} {:>10} {:>9} {:>9}",
        "row", "batch", "kv_len", "splits", "ms", "GB/s", "host µs"
    );
    let spec = flashgen::parse_one(model.spec).expect("a valid spec");
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
                        Ok((splits, ms, host_us)) => {
                            let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
                            println!(
                                "{row:<13} {batch:>5} {kv_len:>7} {splits:>7} {ms:>10.4} {gbs:>9.0} {host_us:>9.2}"
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
    (model, spec): (DecodeModel, &flashgen::Spec),
    (batch, kv_len): (usize, usize),
    (page_size, kv, splits, tune): (Option<usize>, KvCacheDtype, Option<usize>, bool),
    iters: usize,
) -> Result<(usize, f64, f64), Error> {
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
    let timed = match kv {
        KvCacheDtype::Spec => time_steps::<bf16>(rt, (&mut plan, model), (page_size, tune), None, iters)?,
        KvCacheDtype::E4m3 => {
            let ones = rt.stream().clone_htod(&vec![1f32; heads_kv]).map_err(driver_error("upload descales"))?;
            let descale = KvDescale { k: Descale::PerKvHead(&ones), v: Descale::PerKvHead(&ones) };
            time_steps::<u8>(rt, (&mut plan, model), (page_size, tune), Some(descale), iters)?
        }
    };
    Ok((plan.splits(), timed.0, timed.1))
}

/// A cache element the bench times, and the runs that read it.
trait Cache: DeviceRepr + ValidAsZeroBits + Unpin + Sized {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16, Self>, d: Option<KvDescale<'_>>) -> Step;
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16, Self>, d: Option<KvDescale<'_>>) -> Step;
}

type Step = Result<(), Error>;

impl Cache for bf16 {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16>, _: Option<KvDescale<'_>>) -> Step {
        plan.run(rt, io, &[])
    }
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16>, _: Option<KvDescale<'_>>) -> Step {
        plan.run_paged(rt, io, &[])
    }
}

impl Cache for u8 {
    fn run(plan: &DecodePlan, rt: &Runtime, io: DecodeIo<'_, bf16, u8>, d: Option<KvDescale<'_>>) -> Step {
        plan.run_e4m3(rt, io, d.expect("e4m3 runs take descales"), &[])
    }
    fn run_paged(plan: &DecodePlan, rt: &Runtime, io: PagedDecodeIo<'_, bf16, u8>, d: Option<KvDescale<'_>>) -> Step {
        plan.run_paged_e4m3(rt, io, d.expect("e4m3 runs take descales"), &[])
    }
}

/// The median step time (ms) and host µs per run of `plan` (of `model`)
/// on caches of `C`, dense or (`page_size`) paged; V a view of K where the
/// model says; the plan's split count tuned on these steps first where
/// `tune`.
fn time_steps<C: Cache>(
    rt: &Runtime,
    (plan, model): (&mut DecodePlan, DecodeModel),
    (page_size, tune): (Option<usize>, bool),
    descale: Option<KvDescale<'_>>,
    iters: usize,
) -> Result<(f64, f64), Error> {
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
            C::run(plan, rt, io, descale)
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
            C::run_paged(plan, rt, PagedDecodeIo { q: (&q, lq), o: (&mut o, lo), lse: None, kv }, descale)
        }
    };
    if tune {
        let report = plan.tune(rt, &mut step)?;
        println!("tune {batch}x{kv_len}: {report}");
    }
    let plan = &*plan;
    let mut flush = stream.alloc_zeros::<u8>(L2_FLUSH_BYTES).map_err(driver_error("allocate the L2 flush buffer"))?;
    let ms = median_ms_after(
        &stream,
        3,
        iters,
        || stream.memset_zeros(&mut flush).map_err(driver_error("flush the L2")),
        || step(plan),
    )?;
    // Host cost: back-to-back runs, queued faster than the GPU drains them.
    let runs = 200;
    let start = Instant::now();
    for _ in 0..runs {
        step(plan)?;
    }
    let host_us = start.elapsed().as_secs_f64() * 1e6 / runs as f64;
    stream.synchronize().map_err(driver_error("wait for the decode steps"))?;
    Ok((ms, host_us))
}

/// Median ms of a device-to-device copy of `bytes` (cold L2).
fn time_copy(rt: &Runtime, bytes: usize, iters: usize) -> Result<f64, Error> {
    let stream = rt.stream().clone();
    let src = stream.alloc_zeros::<u8>(bytes).map_err(driver_error("allocate the copy source"))?;
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(driver_error("allocate the copy target"))?;
    let mut flush = stream.alloc_zeros::<u8>(L2_FLUSH_BYTES).map_err(driver_error("allocate the L2 flush buffer"))?;
    median_ms_after(
        &stream,
        3,
        iters,
        || stream.memset_zeros(&mut flush).map_err(driver_error("flush the L2")),
        || stream.memcpy_dtod(&src, &mut dst).map_err(driver_error("copy")),
    )
}
