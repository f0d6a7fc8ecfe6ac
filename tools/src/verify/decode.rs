//! Decode problems on the GPU: a dense KV cache whose rows past each
//! sequence's length hold noise the kernel must never read, per-sequence
//! lengths on the device, a [`DecodePlan`] run on NaN-poisoned outputs, and
//! the result in the varlen reference's layouts: a decode step is the
//! varlen forward of `q_len` queries per sequence against its first
//! `kv_lens[b]` cache rows, tensors' `KV_LEN` dims the cache's rows. The
//! same step runs on paged caches ([`DeviceDecode::upload_paged`]): its
//! keys scattered into pages of a shuffled block table
//! ([`DecodeProblem::paged`]), judged by the same reference. A step of
//! packed queries ([`DecodeProblem::with_q_lens`]: a token count per
//! sequence, [`DecodePlan::run_varlen`]) keeps each sequence's first
//! tokens of the padded draw; its Q and O buffers hold the plan's `batch ·
//! q_len` tokens, the step's first and spare ones after (which must stay
//! unwritten: [`DeviceDecode::spare_rows_written`]). A step over e4m3
//! caches ([`DeviceDecode::upload_e4m3`]) reads their bytes and descales
//! (`decode_e4m3`), judged by the reference over the dequantized caches.
//! MLA's cache ([`DecodeProblem::v_in_k`], [`DeviceDecode::upload_v_in_k`])
//! holds V as K's first columns, and runs pass K's buffer as V.

use super::decode_e4m3::{quantize_cache, DeviceE4m3, E4m3Scales, Granularity};
use super::{
    driver, gather, launch_args, random_tensors, round, scatter, upload_operands, upload_tensors, DeviceTensor,
    GpuOutput, Operands, Storage,
};
use flashgen::codegen::reference::{PagedProblem, ParamValue, Problem, VarlenProblem};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::runtime::{
    ArgValue, DecodeIo, DecodeKv, DecodePlan, DecodeShape, Element, Error, Layout, PackedLayout, PagedDecodeIo,
    PagedKv, PagedLayout, Runtime, VarlenDecodeIo,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use std::sync::Arc;

/// A decode problem: the reference's packed view and the cache as the GPU
/// holds it.
#[derive(Clone)]
pub struct DecodeProblem {
    /// The step as the varlen reference sees it (padded queries: Q packed =
    /// Q dense).
    pub reference: VarlenProblem,
    /// Every sequence's `q_len` drawn queries, `[batch, q_len, heads, d]`.
    padded_q: Vec<f64>,
    /// Each sequence's token count of a step of packed queries; `None`:
    /// `q_len` each, padded.
    pub q_lens: Option<Vec<usize>>,
    /// K and V caches `[batch, max_kv_len, heads_kv, d]`, BSHD.
    pub k_cache: Vec<f64>,
    pub v_cache: Vec<f64>,
    pub kv_lens: Vec<usize>,
    pub shape: DecodeShape,
}

/// Draws a decode problem: Q and every cache row ~ N(0, 1) rounded to the
/// dtype, sequence `b` keeping `kv_lens[b]` (at most `shape.max_kv_len`)
/// rows, tensors sized by the cache, scale 1/√d.
pub fn random_decode_problem(
    spec: &Spec,
    shape: DecodeShape,
    kv_lens: &[usize],
    params: Vec<ParamValue>,
    seed: u64,
) -> DecodeProblem {
    let mut rng = StdRng::seed_from_u64(seed);
    let DecodeShape { batch, heads, heads_kv, q_len, max_kv_len } = shape;
    let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let mut normal =
        |n: usize| -> Vec<f64> { (0..n).map(|_| round(spec.dtype, rng.sample::<f64, _>(StandardNormal))).collect() };
    let q = normal(batch * q_len * heads * dqk);
    let (k_cache, v_cache) = (normal(batch * max_kv_len * heads_kv * dqk), normal(batch * max_kv_len * heads_kv * dv));
    let ref_shape = Shape { batch, heads, heads_kv, q_len, kv_len: max_kv_len };
    let tensors = random_tensors(spec, &ref_shape, vec![None; spec.tensors.len()], &mut rng);
    let scale = f64::from(1.0 / (dqk as f32).sqrt());
    let cu_seqlens_q = (0..=batch).map(|b| b * q_len).collect();
    let problem = Problem { shape: ref_shape, q: q.clone(), k: vec![], v: vec![], scale, params, tensors };
    let reference = VarlenProblem { problem, cu_seqlens_q, cu_seqlens_k: vec![] };
    DecodeProblem { reference, padded_q: q, q_lens: None, k_cache, v_cache, kv_lens: vec![], shape }.with_lens(kv_lens)
}

impl DecodeProblem {
    /// The same step (queries, cache, tensors) with sequence `b` keeping
    /// `kv_lens[b]` cache rows: the reference's keys are each sequence's
    /// first rows.
    pub fn with_lens(mut self, kv_lens: &[usize]) -> DecodeProblem {
        let DecodeShape { batch, max_kv_len, .. } = self.shape;
        let packed = |cache: &[f64]| -> Vec<f64> {
            let row = cache.len() / (batch * max_kv_len).max(1);
            (0..batch).flat_map(|b| &cache[b * max_kv_len * row..][..kv_lens[b] * row]).copied().collect()
        };
        self.reference.problem.k = packed(&self.k_cache);
        self.reference.problem.v = packed(&self.v_cache);
        self.reference.cu_seqlens_k = prefix_sums(kv_lens);
        self.kv_lens = kv_lens.to_vec();
        self
    }

    /// The same step with packed queries: sequence `b` keeps the first
    /// `q_lens[b]` (at most `q_len`) of its drawn queries, the spec's `q_len`
    /// its count.
    pub fn with_q_lens(mut self, q_lens: &[usize]) -> DecodeProblem {
        let DecodeShape { batch, q_len, .. } = self.shape;
        let row = self.padded_q.len() / (batch * q_len).max(1);
        let q = (0..batch).flat_map(|b| &self.padded_q[b * q_len * row..][..q_lens[b] * row]);
        self.reference.problem.q = q.copied().collect();
        self.reference.cu_seqlens_q = prefix_sums(q_lens);
        self.q_lens = Some(q_lens.to_vec());
        self
    }

    /// The step's query tokens: `batch · q_len` padded, fewer packed.
    fn total_q(&self) -> usize {
        self.reference.cu_seqlens_q.last().copied().unwrap_or(0)
    }

    /// The step's keys and values in pages of `page_size` rows, drawn from
    /// a shuffled pool with two spare pages of noise (`paged::into_pages`);
    /// a sequence's pages hold `max_kv_len` keys, so every problem of one
    /// shape and page size has the same caches' sizes.
    pub fn paged(&self, spec: &Spec, page_size: usize, seed: u64) -> PagedProblem {
        super::paged::into_pages(spec, &self.reference, page_size, 2, seed)
    }
}

/// `[0, lens[0], lens[0] + lens[1], ...]`.
fn prefix_sums(lens: &[usize]) -> Vec<usize> {
    let mut sums = vec![0];
    for &n in lens {
        sums.push(sums[sums.len() - 1] + n);
    }
    sums
}

/// Packed queries of a [`DeviceDecode`]: their prefix sums, Q's and O's
/// layouts (the plan's `batch · q_len` tokens) and the step's tokens.
struct Packed {
    cu_seqlens_q: CudaSlice<i32>,
    layouts: [PackedLayout; 2],
    total_q: usize,
}

/// The paged caches of a [`DeviceDecode`] (whose K and V operands are then
/// the pages): the block table and the caches' layouts.
struct Pages {
    block_table: CudaSlice<i32>,
    pages_per_seq: usize,
    caches: [PagedLayout; 2],
}

/// A decode problem's operands, LSE, lengths and tensors on the GPU.
pub struct DeviceDecode {
    operands: Operands,
    lse: CudaSlice<f32>,
    kv_lens: CudaSlice<i32>,
    tensors: Vec<DeviceTensor>,
    layouts: [Layout; 4],
    shape: DecodeShape,
    stream: Arc<CudaStream>,
    /// Paged caches; `None`: the dense cache.
    pages: Option<Pages>,
    /// Packed queries; `None`: padded ones.
    packed: Option<Packed>,
    /// E4m3 caches the runs read instead of the 16-bit ones.
    e4m3: Option<DeviceE4m3>,
    /// Runs pass K's buffer as V, at V's layout (K's strides).
    v_in_k: bool,
}

impl DeviceDecode {
    /// Uploads `problem` (contiguous BSHD operands), O and the LSE poisoned.
    pub fn upload(rt: &Runtime, spec: &Spec, problem: &DecodeProblem) -> Result<Self, Error> {
        let DecodeShape { batch, heads_kv, max_kv_len, .. } = problem.shape;
        let caches =
            [spec.head_dims.qk, spec.head_dims.v].map(|d| Layout::bshd(batch, max_kv_len, heads_kv, d as usize));
        Self::upload_with(rt, spec, problem, [&problem.k_cache, &problem.v_cache], caches, None)
    }

    /// Uploads `problem` with its keys and values in `paged`'s pages
    /// (contiguous paged caches; [`DecodeProblem::paged`]), O and the LSE
    /// poisoned: runs go to [`DecodePlan::run_paged`].
    pub fn upload_paged(
        rt: &Runtime,
        spec: &Spec,
        problem: &DecodeProblem,
        paged: &PagedProblem,
    ) -> Result<Self, Error> {
        let caches = paged_layouts(spec, problem.shape, paged);
        let table: Vec<i32> = paged.block_table.iter().map(|&p| p as i32).collect();
        let block_table = rt.stream().clone_htod(&table).map_err(driver("upload the block table"))?;
        let pages = Pages { block_table, pages_per_seq: paged.pages_per_seq, caches };
        let host = [&paged.problem.k, &paged.problem.v];
        Self::upload_with(rt, spec, problem, host, caches.map(|c| c.as_layout()), Some(pages))
    }

    /// Uploads `problem` (MLA's cache: [`DecodeProblem::v_in_k`]) with V
    /// as a view of K, dense or in `paged`'s pages: V's layout is K's at V's
    /// head dim, and runs pass K's buffer as V (`DecodeOptions::v_in_k`).
    pub fn upload_v_in_k(
        rt: &Runtime,
        spec: &Spec,
        problem: &DecodeProblem,
        paged: Option<&PagedProblem>,
    ) -> Result<Self, Error> {
        let dv = spec.head_dims.v as usize;
        let mut gpu = match paged {
            None => {
                let DecodeShape { batch, heads_kv, max_kv_len, .. } = problem.shape;
                let k = Layout::bshd(batch, max_kv_len, heads_kv, spec.head_dims.qk as usize);
                let host = [&problem.k_cache, &problem.v_cache];
                Self::upload_with(rt, spec, problem, host, [k, Layout { dim: dv, ..k }], None)?
            }
            Some(paged) => {
                let [k, _] = paged_layouts(spec, problem.shape, paged);
                let caches = [k, PagedLayout { dim: dv, ..k }];
                let table: Vec<i32> = paged.block_table.iter().map(|&p| p as i32).collect();
                let block_table = rt.stream().clone_htod(&table).map_err(driver("upload the block table"))?;
                let pages = Pages { block_table, pages_per_seq: paged.pages_per_seq, caches };
                let host = [&paged.problem.k, &paged.problem.v];
                Self::upload_with(rt, spec, problem, host, caches.map(|c| c.as_layout()), Some(pages))?
            }
        };
        gpu.v_in_k = true;
        Ok(gpu)
    }

    /// Uploads `problem` (quantized: [`DecodeProblem::quantized`]) with its
    /// caches as e4m3 bytes under `scales`, dense or in `paged`'s pages:
    /// runs go to the `_e4m3` runs of [`DecodePlan`].
    pub fn upload_e4m3(
        rt: &Runtime,
        spec: &Spec,
        problem: &DecodeProblem,
        scales: &E4m3Scales,
        paged: Option<&PagedProblem>,
    ) -> Result<Self, Error> {
        let mut gpu = match paged {
            Some(paged) => Self::upload_paged(rt, spec, problem, paged)?,
            None => Self::upload(rt, spec, problem)?,
        };
        let host = paged.map_or([&problem.k_cache, &problem.v_cache], |p| [&p.problem.k, &p.problem.v]);
        let dims = [spec.head_dims.qk, spec.head_dims.v].map(|d| d as usize);
        let heads_kv = problem.shape.heads_kv;
        gpu.e4m3 = Some(DeviceE4m3::upload(&gpu.stream, host.map(|c| &c[..]), dims, heads_kv, scales)?);
        Ok(gpu)
    }

    /// Overwrites an e4m3 upload's descales (as many as uploaded), in
    /// stream order: what a captured step reads on its next replay.
    pub fn set_descales(&mut self, k: &[f32], v: &[f32]) -> Result<(), Error> {
        self.e4m3.as_mut().expect("an e4m3 upload").set_descales(&self.stream, k, v)
    }

    fn upload_with(
        rt: &Runtime,
        spec: &Spec,
        problem: &DecodeProblem,
        caches: [&Vec<f64>; 2],
        cache_layouts: [Layout; 2],
        pages: Option<Pages>,
    ) -> Result<Self, Error> {
        let stream = rt.stream().clone();
        let shape = problem.shape;
        let DecodeShape { batch, heads, q_len, .. } = shape;
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        // Packed queries: the plan's tokens, the step's first.
        let packed_layouts = [dqk, dv].map(|d| PackedLayout::thd(batch * q_len, heads, d));
        let packed = match &problem.q_lens {
            None => None,
            Some(_) => Some(Packed {
                cu_seqlens_q: stream.clone_htod(&cu_seqlens(problem)).map_err(driver("upload cu_seqlens_q"))?,
                layouts: packed_layouts,
                total_q: problem.total_q(),
            }),
        };
        let [q_layout, o_layout] = match packed {
            None => [dqk, dv].map(|d| Layout::bshd(batch, q_len, heads, d)),
            Some(_) => packed_layouts.map(|l| l.as_layout()),
        };
        let layouts = [q_layout, cache_layouts[0], cache_layouts[1], o_layout];
        let o_poison = vec![f64::NAN; layouts[3].len()];
        let q = padded_queries(problem, layouts[0].len());
        let host = [&q, caches[0], caches[1], &o_poison];
        let operands = match spec.dtype {
            Dtype::F16 => Operands::F16(upload_operands(&stream, host, &layouts)?),
            Dtype::Bf16 => Operands::Bf16(upload_operands(&stream, host, &layouts)?),
        };
        let lse = stream.clone_htod(&vec![f32::NAN; batch * heads * q_len]).map_err(driver("upload LSE"))?;
        let lens: Vec<i32> = problem.kv_lens.iter().map(|&n| n as i32).collect();
        let kv_lens = stream.clone_htod(&lens).map_err(driver("upload kv_lens"))?;
        let tensors = upload_tensors(&stream, spec, &problem.reference.problem.tensors)?;
        Ok(DeviceDecode {
            operands,
            lse,
            kv_lens,
            tensors,
            layouts,
            shape,
            stream,
            pages,
            packed,
            e4m3: None,
            v_in_k: false,
        })
    }

    /// Overwrites the packed queries and their prefix sums with `step`'s
    /// (of the problem uploaded, other token counts) and poisons O and the
    /// LSE again, in stream order: what a captured step reads on its next
    /// replay.
    pub fn set_queries(&mut self, step: &DecodeProblem) -> Result<(), Error> {
        self.set_cu_seqlens(&cu_seqlens(step))?;
        self.packed.as_mut().expect("a packed upload").total_q = step.total_q();
        let [lq, _, _, lo] = self.layouts;
        let q = padded_queries(step, lq.len());
        let o = vec![f64::NAN; lo.len()];
        fn write<T: Storage>(
            s: &Arc<CudaStream>,
            ops: &mut [CudaSlice<T>; 4],
            [q, o]: [(&[f64], &Layout); 2],
        ) -> Result<(), Error> {
            s.memcpy_htod(&scatter::<T>(q.0, q.1), &mut ops[0]).map_err(driver("upload the packed queries"))?;
            s.memcpy_htod(&scatter::<T>(o.0, o.1), &mut ops[3]).map_err(driver("poison O"))
        }
        match &mut self.operands {
            Operands::F16(ops) => write(&self.stream, ops, [(&q, &lq), (&o, &lo)])?,
            Operands::Bf16(ops) => write(&self.stream, ops, [(&q, &lq), (&o, &lo)])?,
        }
        let poison = vec![f32::NAN; self.lse.len()];
        self.stream.memcpy_htod(&poison, &mut self.lse).map_err(driver("poison the LSE"))
    }

    /// Overwrites the paged caches, block table and lengths with `paged`'s
    /// (caches of the sizes uploaded), in stream order: what a captured
    /// step reads on its next replay.
    pub fn set_pages(&mut self, paged: &PagedProblem) -> Result<(), Error> {
        let err = driver("upload the paged caches");
        let pages = self.pages.as_mut().expect("a paged upload");
        let table: Vec<i32> = paged.block_table.iter().map(|&p| p as i32).collect();
        self.stream.memcpy_htod(&table, &mut pages.block_table).map_err(err)?;
        let [lk, lv] = pages.caches.map(|c| c.as_layout());
        fn write<T: Storage>(
            s: &Arc<CudaStream>,
            to: &mut CudaSlice<T>,
            host: &[f64],
            l: &Layout,
        ) -> Result<(), Error> {
            s.memcpy_htod(&scatter::<T>(host, l), to).map_err(driver("upload the paged caches"))
        }
        match &mut self.operands {
            Operands::F16([_, k, v, _]) => {
                write(&self.stream, k, &paged.problem.k, &lk)?;
                write(&self.stream, v, &paged.problem.v, &lv)?;
            }
            Operands::Bf16([_, k, v, _]) => {
                write(&self.stream, k, &paged.problem.k, &lk)?;
                write(&self.stream, v, &paged.problem.v, &lv)?;
            }
        }
        self.set_kv_lens(&paged.kv_lens.iter().map(|&n| n as i32).collect::<Vec<_>>())
    }

    /// Overwrites the packed queries' prefix sums on the device (anything:
    /// the kernel clamps each sequence into Q and to the plan's `q_len`),
    /// in stream order.
    pub fn set_cu_seqlens(&mut self, cu: &[i32]) -> Result<(), Error> {
        let packed = self.packed.as_mut().expect("a packed upload");
        self.stream.memcpy_htod(cu, &mut packed.cu_seqlens_q).map_err(driver("upload cu_seqlens_q"))
    }

    /// Overwrites the block table on the device (anything: the kernel
    /// clamps page ids into the caches), in stream order.
    pub fn set_block_table(&mut self, table: &[i32]) -> Result<(), Error> {
        let pages = self.pages.as_mut().expect("a paged upload");
        self.stream.memcpy_htod(table, &mut pages.block_table).map_err(driver("upload the block table"))
    }

    /// Overwrites the lengths on the device (anything: the kernel clamps
    /// them into the cache), in stream order.
    pub fn set_kv_lens(&mut self, lens: &[i32]) -> Result<(), Error> {
        self.stream.memcpy_htod(lens, &mut self.kv_lens).map_err(driver("upload kv_lens"))
    }

    /// Queues one decode step in `plan` (asynchronous): [`DecodePlan::run`]
    /// on a dense cache, [`DecodePlan::run_paged`] on pages, and
    /// [`DecodePlan::run_varlen`] on either with packed queries (their
    /// `_e4m3` twins on an e4m3 upload).
    pub fn run(&mut self, rt: &Runtime, plan: &DecodePlan, problem: &DecodeProblem) -> Result<(), Error> {
        let args = launch_args(&self.tensors, &problem.reference.problem);
        let DeviceDecode { operands, lse, kv_lens, layouts, shape, pages, packed, e4m3, v_in_k, .. } = self;
        let parts = StepParts {
            v_in_k: *v_in_k,
            layouts: *layouts,
            lse,
            kv_lens,
            shape: *shape,
            pages: pages.as_ref(),
            packed: packed.as_ref(),
            e4m3: e4m3.as_ref(),
        };
        match operands {
            Operands::F16(ops) => run_step(rt, plan, ops, parts, &args),
            Operands::Bf16(ops) => run_step(rt, plan, ops, parts, &args),
        }
    }

    /// Median milliseconds (CUDA events) of a decode step, timed as the
    /// peers are (at least `min_runs` steps), each after `flush_bytes` of
    /// zeros written (cold L2).
    pub fn time(
        &mut self,
        rt: &Runtime,
        plan: &DecodePlan,
        problem: &DecodeProblem,
        flush_bytes: usize,
        min_runs: usize,
    ) -> Result<f64, Error> {
        let stream = self.stream.clone();
        super::cold_median_ms(&stream, flush_bytes, min_runs, || self.run(rt, plan, problem))
    }

    /// Waits for the stream and reads O (`[total_q, heads, d_v]`: the
    /// step's tokens) and the LSE, reordered to the varlen reference's
    /// `[heads, total_q]`.
    pub fn download(&self) -> Result<GpuOutput, Error> {
        let (o, lse) = self.fetch()?;
        let DecodeShape { batch, heads, q_len, .. } = self.shape;
        if let Some(packed) = &self.packed {
            // O's tokens and the LSE's `[heads, batch · q_len]` rows, the step's first.
            let (total_q, tokens) = (packed.total_q, batch * q_len);
            let o = o[..o.len() / tokens.max(1) * total_q].to_vec();
            let lse = (0..heads).flat_map(|h| &lse[h * tokens..][..total_q]).map(|&x| f64::from(x)).collect();
            return Ok(GpuOutput { o, lse });
        }
        let total_q = batch * q_len;
        let mut varlen = vec![0.0; heads * total_q];
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..q_len {
                    varlen[h * total_q + b * q_len + i] = f64::from(lse[(b * heads + h) * q_len + i]);
                }
            }
        }
        Ok(GpuOutput { o, lse: varlen })
    }

    /// How many elements of O and the LSE past the step's tokens a packed
    /// step wrote (they must stay poisoned: rows of no sequence).
    pub fn spare_rows_written(&self) -> Result<usize, Error> {
        let Some(packed) = &self.packed else { return Ok(0) };
        let (o, lse) = self.fetch()?;
        let DecodeShape { batch, heads, q_len, .. } = self.shape;
        let tokens = batch * q_len;
        let o_spare = &o[o.len() / tokens.max(1) * packed.total_q..];
        let lse_spare = (0..heads).flat_map(|h| &lse[h * tokens + packed.total_q..(h + 1) * tokens]);
        Ok(o_spare.iter().filter(|x| !x.is_nan()).count() + lse_spare.filter(|x| !x.is_nan()).count())
    }

    /// Waits for the stream and reads all of O (in its layout's logical
    /// order) and the LSE.
    fn fetch(&self) -> Result<(Vec<f64>, Vec<f32>), Error> {
        let err = driver("download results");
        self.stream.synchronize().map_err(err)?;
        let o = match &self.operands {
            Operands::F16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &self.layouts[3]),
            Operands::Bf16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &self.layouts[3]),
        };
        Ok((o, self.stream.clone_dtoh(&self.lse).map_err(err)?))
    }
}

/// A [`DeviceDecode`]'s buffers but its operands, for one step.
struct StepParts<'a> {
    layouts: [Layout; 4],
    lse: &'a mut CudaSlice<f32>,
    kv_lens: &'a CudaSlice<i32>,
    shape: DecodeShape,
    pages: Option<&'a Pages>,
    packed: Option<&'a Packed>,
    e4m3: Option<&'a DeviceE4m3>,
    /// V is a view of K: K's buffer at V's layout.
    v_in_k: bool,
}

/// One step on operands `[q, k, v, o]` (or the e4m3 caches), through the
/// run its cache and queries call for.
fn run_step<T: Element>(
    rt: &Runtime,
    plan: &DecodePlan,
    [q, k, v, o]: &mut [CudaSlice<T>; 4],
    parts: StepParts<'_>,
    args: &[ArgValue<'_>],
) -> Result<(), Error> {
    let StepParts { layouts: [lq, lk, lv, lo], lse, kv_lens, shape, pages, packed, e4m3, v_in_k } = parts;
    let (k, v) = (&*k, if v_in_k { &*k } else { &*v });
    let (lse, cache) = (Some(lse), CacheParts { layouts: [lk, lv], kv_lens, shape, pages });
    if let Some(e4m3) = e4m3 {
        let (kv, descale) = (step_kv(&e4m3.k, &e4m3.v, cache), e4m3.descale());
        return match (packed, kv) {
            (Some(p), kv) => {
                let (q, o, cu_seqlens_q) = ((q as _, p.layouts[0]), (o as _, p.layouts[1]), &p.cu_seqlens_q);
                plan.run_varlen_e4m3(rt, VarlenDecodeIo { q, o, lse, cu_seqlens_q, kv }, descale, args)
            }
            (None, DecodeKv::Paged(kv)) => {
                plan.run_paged_e4m3(rt, PagedDecodeIo { q: (q, lq), o: (o, lo), lse, kv }, descale, args)
            }
            (None, DecodeKv::Dense { k, v, kv_lens }) => {
                plan.run_e4m3(rt, DecodeIo { q: (q, lq), k, v, o: (o, lo), lse, kv_lens }, descale, args)
            }
        };
    }
    let kv = step_kv(k, v, cache);
    match (packed, kv) {
        (Some(p), kv) => {
            let (q, o, cu_seqlens_q) = ((q as _, p.layouts[0]), (o as _, p.layouts[1]), &p.cu_seqlens_q);
            plan.run_varlen(rt, VarlenDecodeIo { q, o, lse, cu_seqlens_q, kv }, args)
        }
        (None, DecodeKv::Paged(kv)) => plan.run_paged(rt, PagedDecodeIo { q: (q, lq), o: (o, lo), lse, kv }, args),
        (None, DecodeKv::Dense { k, v, kv_lens }) => {
            plan.run(rt, DecodeIo { q: (q, lq), k, v, o: (o, lo), lse, kv_lens }, args)
        }
    }
}

/// What a step's cache is besides its K and V buffers.
#[derive(Clone, Copy)]
struct CacheParts<'a> {
    /// A dense cache's K and V layouts.
    layouts: [Layout; 2],
    kv_lens: &'a CudaSlice<i32>,
    shape: DecodeShape,
    pages: Option<&'a Pages>,
}

/// A step's cache of `k` and `v`: dense, or `parts`' pages.
fn step_kv<'a, C>(k: &'a CudaSlice<C>, v: &'a CudaSlice<C>, parts: CacheParts<'a>) -> DecodeKv<'a, C> {
    let CacheParts { layouts: [lk, lv], kv_lens, .. } = parts;
    match parts.pages {
        Some(p) => DecodeKv::Paged(PagedKv {
            k: (k, p.caches[0]),
            v: (v, p.caches[1]),
            block_table: &p.block_table,
            pages_per_seq: p.pages_per_seq,
            kv_lens,
            max_kv_len: parts.shape.max_kv_len,
            batch: parts.shape.batch,
        }),
        None => DecodeKv::Dense { k: (k, lk), v: (v, lv), kv_lens },
    }
}

/// `problem`'s prefix sums of its query tokens, as i32.
fn cu_seqlens(problem: &DecodeProblem) -> Vec<i32> {
    problem.reference.cu_seqlens_q.iter().map(|&n| n as i32).collect()
}

/// `problem`'s queries (its step's tokens) followed by zeros up to `len`
/// elements (the plan's tokens).
fn padded_queries(problem: &DecodeProblem, len: usize) -> Vec<f64> {
    let mut q = problem.reference.problem.q.clone();
    q.resize(len, 0.0);
    q
}

/// Contiguous K and V caches of `paged`'s pages.
fn paged_layouts(spec: &Spec, shape: DecodeShape, paged: &PagedProblem) -> [PagedLayout; 2] {
    let row = paged.page_size * shape.heads_kv * spec.head_dims.qk as usize;
    let num_pages = paged.problem.k.len() / row.max(1);
    [spec.head_dims.qk, spec.head_dims.v]
        .map(|d| PagedLayout::contiguous(num_pages, paged.page_size, shape.heads_kv, d as usize))
}

/// Random lengths for `batch` sequences in `[lo, hi]`.
pub fn random_lens(rng: &mut impl Rng, batch: usize, (lo, hi): (usize, usize)) -> Vec<usize> {
    (0..batch).map(|_| rng.random_range(lo..=hi)).collect()
}

impl DecodeProblem {
    /// The same step with MLA's cache: each V row is its K row's first
    /// `head_dims.v` columns (V a view of K, as the absorbed decode reads
    /// it), the reference seeing those values.
    pub fn v_in_k(mut self, spec: &Spec) -> DecodeProblem {
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        self.v_cache = self.k_cache.chunks(dqk).flat_map(|row| &row[..dv]).copied().collect();
        let lens = self.kv_lens.clone();
        self.with_lens(&lens)
    }

    /// The same step with every query times 2^`exponent` and the softmax
    /// scale times 2^-`exponent`: the same scores in exact arithmetic, the
    /// queries past f16's largest value (exponent 20) or below its normals
    /// (-20). Exact for bf16 queries.
    pub fn with_queries_scaled(mut self, exponent: i32) -> DecodeProblem {
        let factor = 2f64.powi(exponent);
        self.padded_q.iter_mut().for_each(|x| *x *= factor);
        self.reference.problem.q.iter_mut().for_each(|x| *x *= factor);
        self.reference.problem.scale /= factor;
        self
    }

    /// The same step with its caches quantized to e4m3 under `granularity`,
    /// and the descales: each K/V head's rows are first scaled by a factor
    /// of its own (so per-head descales differ, and a per-tensor one serves
    /// heads of different ranges), then rounded to `descale · e4m3`, which
    /// the caches and the reference then hold.
    pub fn quantized(mut self, granularity: Granularity) -> (DecodeProblem, E4m3Scales) {
        let DecodeShape { batch, heads_kv, max_kv_len, .. } = self.shape;
        let cells = (batch * max_kv_len * heads_kv).max(1);
        let (k_factor, v_factor) = (|h: usize| 0.5 + 0.75 * h as f64, |h: usize| 1.0 / (1.0 + h as f64));
        let dim = self.k_cache.len() / cells;
        let k = quantize_cache(&mut self.k_cache, (heads_kv, dim), granularity, k_factor);
        let dim = self.v_cache.len() / cells;
        let v = quantize_cache(&mut self.v_cache, (heads_kv, dim), granularity, v_factor);
        let lens = self.kv_lens.clone();
        (self.with_lens(&lens), E4m3Scales { granularity, k, v })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_sees_each_sequences_first_rows() {
        let spec = flashgen::parse_one(
            "S { dtype: bf16, head_dim: 8, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        )
        .unwrap();
        let shape = DecodeShape { batch: 3, heads: 4, heads_kv: 2, q_len: 2, max_kv_len: 5 };
        let p = random_decode_problem(&spec, shape, &[5, 0, 3], vec![], 7);
        let r = &p.reference;
        assert_eq!((r.cu_seqlens_q.clone(), r.cu_seqlens_k.clone()), (vec![0, 2, 4, 6], vec![0, 5, 5, 8]));
        assert_eq!(r.problem.k.len(), 8 * 2 * 8);
        // Sequence 2's first key row is cache row (b = 2, s = 0).
        assert_eq!(r.problem.k[5 * 16..][..16], p.k_cache[2 * 5 * 16..][..16]);
        assert_eq!(r.problem.shape.kv_len, 5, "tensors are sized by the cache");
        let flashgen::codegen::reference::TensorData::I32(doc) = &r.problem.tensors[0] else { panic!("ids") };
        assert_eq!(doc.len(), 3 * 5);
    }

    #[test]
    fn mla_caches_hold_v_as_ks_first_columns() {
        let spec = flashgen::parse_one("S { dtype: bf16, head_dim: 12, v_head_dim: 8 }").unwrap();
        let shape = DecodeShape { batch: 2, heads: 4, heads_kv: 1, q_len: 1, max_kv_len: 3 };
        let p = random_decode_problem(&spec, shape, &[3, 2], vec![], 7).v_in_k(&spec);
        assert_eq!(p.v_cache.len(), 2 * 3 * 8);
        // Cache row (b = 1, s = 2): V is K's first 8 of 12 columns.
        assert_eq!(p.v_cache[5 * 8..][..8], p.k_cache[5 * 12..][..8]);
        // The reference's values are sequence 1's first key's: token 3.
        assert_eq!(p.reference.problem.v[3 * 8..][..8], p.k_cache[3 * 12..][..8]);
    }

    #[test]
    fn packed_steps_keep_each_sequences_first_tokens() {
        let spec = flashgen::parse_one("S { dtype: bf16, head_dim: 8 }").unwrap();
        let shape = DecodeShape { batch: 3, heads: 2, heads_kv: 1, q_len: 4, max_kv_len: 5 };
        let p = random_decode_problem(&spec, shape, &[5, 0, 3], vec![], 7).with_q_lens(&[2, 0, 4]);
        let (r, row) = (&p.reference, 2 * 8);
        assert_eq!(r.cu_seqlens_q, vec![0, 2, 2, 6]);
        assert_eq!((p.total_q(), r.problem.q.len()), (6, 6 * row));
        // Sequence 2's tokens are its drawn tokens 0 .. 4 (drawn token 8 on).
        assert_eq!(r.problem.q[2 * row..], p.padded_q[8 * row..12 * row]);
        assert_eq!(r.problem.q[..2 * row], p.padded_q[..2 * row]);
    }
}
