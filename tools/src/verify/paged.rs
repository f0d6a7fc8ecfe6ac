//! Paged K/V problems on the GPU: a varlen problem's keys and values
//! scattered into pages of a shuffled block table ([`into_pages`]), a
//! [`Runtime::forward_paged`] launch on NaN-poisoned outputs with packed or
//! dense queries, and the result in the varlen reference's layouts (O
//! `[total_q, heads, d_v]`, LSE `[heads, total_q]`) for [`Expected::paged`].
//! [`hold_back`] and [`DevicePaged::append`] build the same caches with
//! [`Runtime::append_paged`].

use super::{driver, gather, launch_args, scatter, upload_operands, upload_tensors, DeviceTensor, GpuOutput, Operands};
use super::{Expected, Storage};
use flashgen::codegen::cuda::TileConfig;
use flashgen::codegen::reference::{self, PagedProblem, Precision, VarlenProblem};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::runtime::{
    Error, ForwardOptions, PackedLayout, PagedAppend, PagedIo, PagedKv, PagedLayout, PagedQueries, Runtime,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

/// How a paged launch's queries are passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queries {
    /// Packed, split by `cu_seqlens_q`.
    Packed,
    /// Dense: every sequence has the same number of queries (no prefix sums).
    Dense,
}

/// `problem`'s keys and values in pages of `page_size` rows: every
/// sequence's pages drawn from a shuffled pool (so no sequence's pages
/// are contiguous or in order), and `spare` more pages of noise that no
/// sequence names. Unused table entries name page 0.
pub fn into_pages(spec: &Spec, problem: &VarlenProblem, page_size: usize, spare: usize, seed: u64) -> PagedProblem {
    let mut rng = StdRng::seed_from_u64(seed);
    let p = &problem.problem;
    let batch = p.shape.batch;
    let widths = [spec.head_dims.qk, spec.head_dims.v].map(|d| p.shape.heads_kv * d as usize);
    let pages_per_seq = p.shape.kv_len.div_ceil(page_size);
    let num_pages = batch * pages_per_seq + spare;
    let mut pool: Vec<usize> = (0..num_pages).collect();
    pool.shuffle(&mut rng);
    let kv_lens: Vec<usize> = problem.cu_seqlens_k.windows(2).map(|w| w[1] - w[0]).collect();
    let mut block_table = vec![0; batch * pages_per_seq];
    let mut next = pool.into_iter();
    for (b, &len) in kv_lens.iter().enumerate() {
        for slot in 0..len.div_ceil(page_size) {
            block_table[b * pages_per_seq + slot] = next.next().expect("enough pages");
        }
    }
    let noise = |rng: &mut StdRng, n: usize| -> Vec<f64> {
        (0..n).map(|_| reference::round_dtype(spec.dtype, rng.random_range(-30.0..30.0))).collect()
    };
    let (mut k, mut v) =
        (noise(&mut rng, num_pages * page_size * widths[0]), noise(&mut rng, num_pages * page_size * widths[1]));
    for (b, &len) in kv_lens.iter().enumerate() {
        for key in 0..len {
            let row = block_table[b * pages_per_seq + key / page_size] * page_size + key % page_size;
            let token = problem.cu_seqlens_k[b] + key;
            for ((cache, packed), w) in [(&mut k, &p.k), (&mut v, &p.v)].into_iter().zip(widths) {
                cache[row * w..][..w].copy_from_slice(&packed[token * w..][..w]);
            }
        }
    }
    PagedProblem {
        problem: reference::Problem { k, v, ..p.clone() },
        cu_seqlens_q: problem.cu_seqlens_q.clone(),
        block_table,
        pages_per_seq,
        page_size,
        kv_lens,
    }
}

/// The new rows of a paged append: packed K and V, and the prefix sums of
/// each sequence's count.
#[derive(Clone, Debug)]
pub struct NewRows {
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub cu_seqlens: Vec<usize>,
}

/// `problem` before its sequences' last `new[b]` keys were appended: the
/// same pages with those rows overwritten by noise and the lengths short
/// of them, and the rows to append.
pub fn hold_back(spec: &Spec, problem: &PagedProblem, new: &[usize]) -> (PagedProblem, NewRows) {
    let widths = [spec.head_dims.qk, spec.head_dims.v].map(|d| problem.problem.shape.heads_kv * d as usize);
    let mut before = problem.clone();
    let mut rows = NewRows { k: Vec::new(), v: Vec::new(), cu_seqlens: vec![0] };
    for (b, (&len, &n)) in problem.kv_lens.iter().zip(new).enumerate() {
        let n = n.min(len);
        for key in len - n..len {
            let row = problem.block_table[b * problem.pages_per_seq + key / problem.page_size] * problem.page_size
                + key % problem.page_size;
            for ((cache, out), w) in
                [(&mut before.problem.k, &mut rows.k), (&mut before.problem.v, &mut rows.v)].into_iter().zip(widths)
            {
                out.extend_from_slice(&cache[row * w..][..w]);
                cache[row * w..][..w].fill(1e3);
            }
        }
        before.kv_lens[b] = len - n;
        rows.cu_seqlens.push(rows.cu_seqlens[b] + n);
    }
    (before, rows)
}

impl Expected {
    /// The references of a paged problem (as [`Expected::varlen`]'s of its
    /// gathered sequences).
    pub fn paged(spec: &Spec, problem: &PagedProblem) -> Result<Expected, reference::ReferenceError> {
        Ok(Expected {
            golden: reference::forward_paged(spec, problem, Precision::F64)?,
            same: reference::forward_paged(spec, problem, Precision::SameDtype(spec.dtype))?,
        })
    }
}

/// A paged problem's Q, caches, O, LSE, block table, lengths and captured
/// tensors on the GPU.
pub struct DevicePaged {
    /// Q, the K cache, the V cache, O.
    operands: Operands,
    state: State,
    stream: Arc<CudaStream>,
}

/// Everything of a [`DevicePaged`] but its operands.
struct State {
    lse: CudaSlice<f32>,
    tensors: Vec<DeviceTensor>,
    cu_seqlens_q: CudaSlice<i32>,
    block_table: CudaSlice<i32>,
    kv_lens: CudaSlice<i32>,
    pages_per_seq: usize,
    shape: Shape,
    queries: Queries,
    /// Q's and O's layouts.
    q_layouts: [PackedLayout; 2],
    /// The K and V caches'.
    caches: [PagedLayout; 2],
    config: Option<TileConfig>,
}

/// What one append writes: the new rows, their layouts and prefix sums
/// (on the device), and the buffers it reports into.
struct AppendTarget<'a> {
    rows: &'a NewRows,
    layouts: [PackedLayout; 2],
    cu: &'a CudaSlice<i32>,
    max_new_len: usize,
    new_lens: &'a mut CudaSlice<i32>,
    dropped: &'a mut CudaSlice<u32>,
}

impl DevicePaged {
    /// Uploads `problem` (its K and V as contiguous caches), with O and the
    /// LSE poisoned.
    pub fn upload(rt: &Runtime, spec: &Spec, problem: &PagedProblem, queries: Queries) -> Result<Self, Error> {
        let stream = rt.stream().clone();
        let p = &problem.problem;
        let shape = p.shape;
        let total_q = problem.cu_seqlens_q[shape.batch];
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let q_layouts = [PackedLayout::thd(total_q, shape.heads, dqk), PackedLayout::thd(total_q, shape.heads, dv)];
        let num_pages = p.k.len() / (problem.page_size * shape.heads_kv * dqk).max(1);
        let caches = [dqk, dv].map(|d| PagedLayout::contiguous(num_pages, problem.page_size, shape.heads_kv, d));
        let dense = [q_layouts[0].as_layout(), caches[0].as_layout(), caches[1].as_layout(), q_layouts[1].as_layout()];
        let o_poison = vec![f64::NAN; dense[3].len()];
        let host = [&p.q, &p.k, &p.v, &o_poison];
        let operands = match spec.dtype {
            Dtype::F16 => Operands::F16(upload_operands(&stream, host, &dense)?),
            Dtype::Bf16 => Operands::Bf16(upload_operands(&stream, host, &dense)?),
        };
        let lse = stream.clone_htod(&vec![f32::NAN; shape.heads * total_q]).map_err(driver("upload LSE"))?;
        let ints = |xs: &[usize]| xs.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let up = |xs: &[i32]| stream.clone_htod(xs).map_err(driver("upload the block table and lengths"));
        let state = State {
            lse,
            tensors: upload_tensors(&stream, spec, &p.tensors)?,
            cu_seqlens_q: up(&ints(&problem.cu_seqlens_q))?,
            block_table: up(&ints(&problem.block_table))?,
            kv_lens: up(&ints(&problem.kv_lens))?,
            pages_per_seq: problem.pages_per_seq,
            shape,
            queries,
            q_layouts,
            caches,
            config: None,
        };
        Ok(DevicePaged { operands, state, stream })
    }

    /// Replaces the block table and the lengths on the device, which may
    /// hold anything (the kernels clamp both).
    pub fn set_device_table(&mut self, table: &[i32], kv_lens: &[i32]) -> Result<(), Error> {
        let up = driver("upload the block table and lengths");
        self.state.block_table = self.stream.clone_htod(table).map_err(up)?;
        self.state.kv_lens = self.stream.clone_htod(kv_lens).map_err(up)?;
        Ok(())
    }

    /// Later launches use tile configuration `config` (one of the spec's
    /// candidates), or with `None` the runtime's own choice.
    pub fn pin_config(&mut self, config: Option<TileConfig>) {
        self.state.config = config;
    }

    /// Enqueues one paged forward launch (asynchronous).
    pub fn launch(&mut self, rt: &Runtime, spec: &Spec, problem: &PagedProblem) -> Result<(), Error> {
        match &mut self.operands {
            Operands::F16(ops) => forward_on(rt, spec, problem, ops, &mut self.state),
            Operands::Bf16(ops) => forward_on(rt, spec, problem, ops, &mut self.state),
        }
    }

    /// Appends `rows` after each sequence's keys on the device, whose
    /// lengths then become the lengths after the append; returns those and
    /// the count of dropped rows.
    pub fn append(&mut self, rt: &Runtime, spec: &Spec, rows: &NewRows) -> Result<(Vec<i32>, u32), Error> {
        let stream = self.stream.clone();
        let total = rows.cu_seqlens.last().copied().unwrap_or(0);
        let heads_kv = self.state.shape.heads_kv;
        let layouts = [spec.head_dims.qk, spec.head_dims.v].map(|d| PackedLayout::thd(total, heads_kv, d as usize));
        let cu: Vec<i32> = rows.cu_seqlens.iter().map(|&x| x as i32).collect();
        let cu = stream.clone_htod(&cu).map_err(driver("upload the new rows' prefix sums"))?;
        let alloc = driver("allocate the append's reports");
        let mut new_lens = stream.alloc_zeros::<i32>(self.state.shape.batch).map_err(alloc)?;
        let mut dropped = stream.alloc_zeros::<u32>(1).map_err(alloc)?;
        let max_new_len = rows.cu_seqlens.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let target =
            AppendTarget { rows, layouts, cu: &cu, max_new_len, new_lens: &mut new_lens, dropped: &mut dropped };
        match &mut self.operands {
            Operands::F16(ops) => append_on(rt, spec, ops, &self.state, target)?,
            Operands::Bf16(ops) => append_on(rt, spec, ops, &self.state, target)?,
        }
        let err = driver("download the append's reports");
        let lens = stream.clone_dtoh(&new_lens).map_err(err)?;
        let dropped = stream.clone_dtoh(&dropped).map_err(err)?[0];
        self.state.kv_lens = new_lens;
        Ok((lens, dropped))
    }

    /// Median milliseconds (CUDA events) of a paged forward launch, timed
    /// as the peers are (at least `min_runs`), each after `flush_bytes` of
    /// zeros written.
    pub fn time(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &PagedProblem,
        flush_bytes: usize,
        min_runs: usize,
    ) -> Result<f64, Error> {
        let stream = self.stream.clone();
        super::cold_median_ms(&stream, flush_bytes, min_runs, || self.launch(rt, spec, problem))
    }

    /// Waits for the stream and reads O (as THD) and the LSE back.
    pub fn download(&self) -> Result<GpuOutput, Error> {
        let err = driver("download results");
        self.stream.synchronize().map_err(err)?;
        let o_layout = self.state.q_layouts[1].as_layout();
        let o = match &self.operands {
            Operands::F16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &o_layout),
            Operands::Bf16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &o_layout),
        };
        let lse = self.stream.clone_dtoh(&self.state.lse).map_err(err)?.into_iter().map(f64::from).collect();
        Ok(GpuOutput { o, lse })
    }
}

/// One paged forward on operands of type `T`.
fn forward_on<T: Storage>(
    rt: &Runtime,
    spec: &Spec,
    problem: &PagedProblem,
    ops: &mut [CudaSlice<T>; 4],
    s: &mut State,
) -> Result<(), Error> {
    let args = launch_args(&s.tensors, &problem.problem);
    let opts = ForwardOptions { scale: Some(problem.problem.scale as f32), config: s.config, ..Default::default() };
    let [q, k, v, o] = ops;
    let queries = match s.queries {
        Queries::Packed => PagedQueries::Packed { cu_seqlens_q: &s.cu_seqlens_q, max_q_len: s.shape.q_len },
        Queries::Dense => PagedQueries::Dense { q_len: s.shape.q_len },
    };
    let kv = PagedKv {
        k: (&*k, s.caches[0]),
        v: (&*v, s.caches[1]),
        block_table: &s.block_table,
        pages_per_seq: s.pages_per_seq,
        kv_lens: &s.kv_lens,
        max_kv_len: s.shape.kv_len,
        batch: s.shape.batch,
    };
    let io = PagedIo { q: (&*q, s.q_layouts[0]), o: (o, s.q_layouts[1]), lse: Some(&mut s.lse), queries, kv };
    rt.forward_paged(spec, io, &args, &opts)
}

/// One paged append into caches of type `T`.
fn append_on<T: Storage>(
    rt: &Runtime,
    spec: &Spec,
    ops: &mut [CudaSlice<T>; 4],
    s: &State,
    t: AppendTarget,
) -> Result<(), Error> {
    let stream = rt.stream();
    let up = |rows: &[f64], layout: PackedLayout| {
        stream.clone_htod(&scatter::<T>(rows, &layout.as_layout())).map_err(driver("upload the new rows"))
    };
    let (k, v) = (up(&t.rows.k, t.layouts[0])?, up(&t.rows.v, t.layouts[1])?);
    let [_, k_cache, v_cache, _] = ops;
    let append = PagedAppend {
        k: (&k, t.layouts[0]),
        v: (&v, t.layouts[1]),
        cu_seqlens: t.cu,
        max_new_len: t.max_new_len,
        k_cache: (k_cache, s.caches[0]),
        v_cache: (v_cache, s.caches[1]),
        block_table: &s.block_table,
        pages_per_seq: s.pages_per_seq,
        kv_lens: &s.kv_lens,
        new_kv_lens: Some(t.new_lens),
        dropped: Some(t.dropped),
        batch: s.shape.batch,
    };
    rt.append_paged(spec, append)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashgen::codegen::reference::forward_varlen;

    fn spec() -> Spec {
        flashgen::parse_one("S { dtype: bf16, head_dim: 8, mask: q + kv_len - q_len >= k }").unwrap()
    }

    /// Pages hold each sequence's keys whatever their size, so the paged
    /// reference is the varlen one; no sequence's pages are all in order.
    #[test]
    fn pages_hold_the_sequences_keys() {
        let spec = spec();
        let varlen = three_sequences(&spec);
        let expected = forward_varlen(&spec, &varlen, Precision::F64).unwrap();
        for page_size in [1, 3, 16, 256] {
            let paged = into_pages(&spec, &varlen, page_size, 2, 5);
            assert_eq!(reference::forward_paged(&spec, &paged, Precision::F64).unwrap(), expected, "{page_size}");
            assert_eq!(paged.problem.k.len(), (3 * paged.pages_per_seq + 2) * page_size * 2 * 8);
        }
        let paged = into_pages(&spec, &varlen, 1, 0, 5);
        assert!(paged.block_table.windows(2).any(|w| w[1] != w[0] + 1));
    }

    /// Held back rows are the sequences' last keys, and the caches no
    /// longer hold them.
    #[test]
    fn held_back_rows_are_the_last_keys() {
        let spec = spec();
        let varlen = three_sequences(&spec);
        let full = into_pages(&spec, &varlen, 3, 1, 9);
        let (before, rows) = hold_back(&spec, &full, &[2, 0, 5]);
        assert_eq!(before.kv_lens, vec![3, 7, 0]);
        assert_eq!(rows.cu_seqlens, vec![0, 2, 2, 7]);
        // Sequence 0's keys 3 and 4, then sequence 2's 0..5.
        let w = 2 * 8;
        let token = |t: usize| &varlen.problem.k[t * w..][..w];
        assert_eq!(&rows.k[..w], token(3));
        assert_eq!(&rows.k[2 * w..3 * w], token(12));
        assert_ne!(before.problem.k, full.problem.k);
    }

    /// Three sequences of (queries, keys) (2, 5), (1, 7), (4, 5); two K/V heads.
    fn three_sequences(spec: &Spec) -> VarlenProblem {
        super::super::varlen::random_varlen_problem(spec, (2, 2), &[(2, 5), (1, 7), (4, 5)], vec![], 3)
    }
}
