//! Context parallelism on one GPU: a problem's whole-sequence operands dealt
//! to ranks by a sharding, every rank run on the one device
//! ([`Runtime::forward_sharded_local`]), and the ranks' results gathered
//! back into the whole sequence's order for the judge.

use super::{driver, launch_args, upload_tensors, GpuGradients, GpuOutput, Storage};
use flashgen::codegen::reference::Problem;
use flashgen::codegen::shard::{Partition, Segment, Sharding};
use flashgen::codegen::{Dtype, Shape, Spec};
use flashgen::context_parallel::{ContextParallel, Schedule, ShardIo, Whole};
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::cudarc::nccl::NcclType;
use flashgen::half::{bf16, f16};
use flashgen::runtime::Communicator;
use flashgen::{BackwardIo, BackwardOptions, Error, ForwardOptions, Layout, Runtime};
use std::sync::Arc;

/// Where a sharded run's ranks are.
#[derive(Clone, Copy)]
pub enum Ranks<'r> {
    /// Every rank of `sharding` on this one GPU.
    OneGpu(&'r Runtime, Sharding),
    /// Rank r on `runtimes[r]`'s GPU, through NCCL, one thread a rank.
    Nccl(&'r [Runtime], Partition, Schedule),
}

/// Runs `problem` sharded over `ranks`: the forward, and with `d_out` the
/// backward (every trainable tensor's gradient asked for, summed over the
/// ranks); outputs start NaN-poisoned.
pub fn run_sharded(
    ranks: Ranks<'_>,
    spec: &Spec,
    problem: &Problem,
    d_out: Option<&[f64]>,
) -> Result<(GpuOutput, Option<GpuGradients>), Error> {
    match (spec.dtype, ranks) {
        (Dtype::F16, Ranks::OneGpu(rt, sharding)) => run_as::<f16>(rt, spec, problem, sharding, d_out),
        (Dtype::Bf16, Ranks::OneGpu(rt, sharding)) => run_as::<bf16>(rt, spec, problem, sharding, d_out),
        (Dtype::F16, Ranks::Nccl(rts, partition, schedule)) => {
            nccl_as::<f16>(rts, spec, problem, (partition, schedule), d_out)
        }
        (Dtype::Bf16, Ranks::Nccl(rts, partition, schedule)) => {
            nccl_as::<bf16>(rts, spec, problem, (partition, schedule), d_out)
        }
    }
}

/// One rank's rows of a whole BSHD operand, or the way back.
struct Rows {
    shape: Shape,
    sharding: Sharding,
}

impl Rows {
    fn segments(&self, rank: usize, queries: bool) -> Vec<Segment> {
        let len = if queries { self.shape.q_len } else { self.shape.kv_len };
        self.sharding.segments(len, rank)
    }

    /// Rank `rank`'s rows of `whole` (`[batch, len, heads, dim]`), BSHD.
    fn deal(&self, whole: &[f64], rank: usize, queries: bool, heads: usize, dim: usize) -> Vec<f64> {
        let len = if queries { self.shape.q_len } else { self.shape.kv_len };
        let row = heads * dim;
        let mut out = Vec::new();
        for b in 0..self.shape.batch {
            for s in self.segments(rank, queries) {
                let at = (b * len + s.start) * row;
                out.extend_from_slice(&whole[at..at + s.len * row]);
            }
        }
        out
    }

    /// Writes rank `rank`'s rows `local` (BSHD) into `whole`.
    fn gather(&self, whole: &mut [f64], local: &[f64], rank: usize, queries: bool, heads: usize, dim: usize) {
        let len = if queries { self.shape.q_len } else { self.shape.kv_len };
        let (row, segments) = (heads * dim, self.segments(rank, queries));
        let local_len: usize = segments.iter().map(|s| s.len).sum();
        for b in 0..self.shape.batch {
            for s in &segments {
                let (to, from) = ((b * len + s.start) * row, (b * local_len + s.local) * row);
                whole[to..to + s.len * row].copy_from_slice(&local[from..from + s.len * row]);
            }
        }
    }

    /// Writes rank `rank`'s LSE (segment after segment, each `[batch,
    /// heads, len]`) into the whole `[batch, heads, q_len]`.
    fn gather_lse(&self, whole: &mut [f64], local: &[f32], rank: usize) {
        let Shape { batch, heads, q_len, .. } = self.shape;
        for s in self.segments(rank, true) {
            let base = batch * heads * s.local;
            for bh in 0..batch * heads {
                for i in 0..s.len {
                    whole[bh * q_len + s.start + i] = f64::from(local[base + bh * s.len + i]);
                }
            }
        }
    }
}

fn up<T: Storage>(s: &Arc<CudaStream>, host: &[f64]) -> Result<CudaSlice<T>, Error> {
    let v: Vec<T> = host.iter().map(|&x| T::from_f64(x)).collect();
    s.clone_htod(&v).map_err(driver("upload a shard"))
}

fn down<T: Storage>(s: &Arc<CudaStream>, buf: &CudaSlice<T>) -> Result<Vec<f64>, Error> {
    Ok(s.clone_dtoh(buf).map_err(driver("download a shard"))?.into_iter().map(T::to_f64).collect())
}

/// One rank's operands, outputs (NaN-poisoned) and, for a backward, its
/// dO and gradients, on the rank's device.
struct RankData<T> {
    qkv: [CudaSlice<T>; 3],
    o: CudaSlice<T>,
    lse: CudaSlice<f32>,
    /// [Q, K, V, O] layouts of the rank's rows.
    layouts: [Layout; 4],
    grads: Option<RankGrads<T>>,
}

struct RankGrads<T> {
    d_o: CudaSlice<T>,
    dqkv: [CudaSlice<T>; 3],
    d_tensors: Vec<Option<CudaSlice<f32>>>,
}

impl<T: Storage> RankData<T> {
    fn upload(
        s: &Arc<CudaStream>,
        spec: &Spec,
        problem: &Problem,
        rows: &Rows,
        r: usize,
        d_out: Option<&[f64]>,
    ) -> Result<Self, Error> {
        let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let (n, m) = (rows.sharding.local_len(q_len, r), rows.sharding.local_len(kv_len, r));
        let layouts = [
            Layout::bshd(batch, n, heads, dqk),
            Layout::bshd(batch, m, heads_kv, dqk),
            Layout::bshd(batch, m, heads_kv, dv),
            Layout::bshd(batch, n, heads, dv),
        ];
        let qkv = [
            up::<T>(s, &rows.deal(&problem.q, r, true, heads, dqk))?,
            up::<T>(s, &rows.deal(&problem.k, r, false, heads_kv, dqk))?,
            up::<T>(s, &rows.deal(&problem.v, r, false, heads_kv, dv))?,
        ];
        let poison = |l: &Layout| up::<T>(s, &vec![f64::NAN; l.len()]);
        let grads = match d_out {
            None => None,
            Some(d_out) => {
                let trainable = flashgen::codegen::cuda::trainable_tensors(spec);
                let d_tensors = (0..spec.tensors.len())
                    .map(|i| {
                        let len = spec.tensors[i].len(&problem.shape).max(1);
                        let nan = || s.clone_htod(&vec![f32::NAN; len]).map_err(driver("poison a tensor gradient"));
                        trainable.contains(&i).then(nan).transpose()
                    })
                    .collect::<Result<_, _>>()?;
                let d_o = up::<T>(s, &rows.deal(d_out, r, true, heads, dv))?;
                Some(RankGrads {
                    d_o,
                    dqkv: [poison(&layouts[0])?, poison(&layouts[1])?, poison(&layouts[2])?],
                    d_tensors,
                })
            }
        };
        let lse = s.clone_htod(&vec![f32::NAN; (batch * heads * n).max(1)]).map_err(driver("poison LSE"))?;
        Ok(RankData { qkv, o: poison(&layouts[3])?, lse, layouts, grads })
    }

    fn forward_io(&mut self) -> ShardIo<'_, T> {
        let [lq, lk, lv, lo] = self.layouts;
        let [q, k, v] = &self.qkv;
        ShardIo { q: (q, lq), k: (k, lk), v: (v, lv), o: (&mut self.o, lo), lse: &mut self.lse }
    }

    fn grad_io(&mut self) -> Option<BackwardIo<'_, T>> {
        let [lq, lk, lv, lo] = self.layouts;
        let [q, k, v] = &self.qkv;
        let g = self.grads.as_mut()?;
        let [dq, dk, dv] = &mut g.dqkv;
        Some(BackwardIo {
            q: (q, lq),
            k: (k, lk),
            v: (v, lv),
            o: (&self.o, lo),
            lse: &self.lse,
            d_o: (&g.d_o, lo),
            dq: (dq, lq),
            dk: (dk, lk),
            dv: (dv, lv),
            d_tensors: g.d_tensors.iter_mut().map(Option::as_mut).collect(),
        })
    }

    /// Waits for `s` and writes the rank's results into the whole arrays
    /// (tensor gradients added).
    fn download(
        &self,
        s: &Arc<CudaStream>,
        spec: &Spec,
        rows: &Rows,
        r: usize,
        out: &mut Gathered,
    ) -> Result<(), Error> {
        s.synchronize().map_err(driver("a sharded run"))?;
        let Shape { heads, heads_kv, .. } = rows.shape;
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        rows.gather(&mut out.output.o, &down(s, &self.o)?, r, true, heads, dv);
        rows.gather_lse(&mut out.output.lse, &s.clone_dtoh(&self.lse).map_err(driver("download LSE"))?, r);
        let (Some(g), Some(grads)) = (&self.grads, &mut out.grads) else { return Ok(()) };
        rows.gather(&mut grads.dq, &down(s, &g.dqkv[0])?, r, true, heads, dqk);
        rows.gather(&mut grads.dk, &down(s, &g.dqkv[1])?, r, false, heads_kv, dqk);
        rows.gather(&mut grads.dv, &down(s, &g.dqkv[2])?, r, false, heads_kv, dv);
        for (slot, t) in g.d_tensors.iter().enumerate() {
            let Some(t) = t else { continue };
            let len = spec.tensors[slot].len(&rows.shape);
            let host = s.clone_dtoh(t).map_err(driver("download a tensor gradient"))?;
            let sum = grads.d_tensors[slot].get_or_insert_with(|| vec![0.0; len]);
            sum.iter_mut().zip(host).for_each(|(a, b)| *a += f64::from(b));
        }
        Ok(())
    }
}

/// The ranks' results in the whole sequence's order.
struct Gathered {
    output: GpuOutput,
    grads: Option<GpuGradients>,
}

impl Gathered {
    fn new(spec: &Spec, shape: Shape, backward: bool) -> Gathered {
        let Shape { batch, heads, heads_kv, q_len, kv_len } = shape;
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let nan = |n: usize| vec![f64::NAN; n];
        Gathered {
            output: GpuOutput { o: nan(batch * q_len * heads * dv), lse: nan(batch * heads * q_len) },
            grads: backward.then(|| GpuGradients {
                dq: nan(batch * q_len * heads * dqk),
                dk: nan(batch * kv_len * heads_kv * dqk),
                dv: nan(batch * kv_len * heads_kv * dv),
                d_tensors: vec![None; spec.tensors.len()],
            }),
        }
    }
}

fn run_as<T: Storage>(
    rt: &Runtime,
    spec: &Spec,
    problem: &Problem,
    sharding: Sharding,
    d_out: Option<&[f64]>,
) -> Result<(GpuOutput, Option<GpuGradients>), Error> {
    let s = rt.stream().clone();
    let rows = Rows { shape: problem.shape, sharding };
    let tensors = upload_tensors(&s, spec, &problem.tensors)?;
    let args = launch_args(&tensors, problem);
    let whole = Whole { q_len: problem.shape.q_len, kv_len: problem.shape.kv_len };
    let mut ranks: Vec<RankData<T>> =
        (0..sharding.ranks).map(|r| RankData::upload(&s, spec, problem, &rows, r, d_out)).collect::<Result<_, _>>()?;
    let opts = ForwardOptions { scale: Some(problem.scale as f32), ..ForwardOptions::default() };
    let io = ranks.iter_mut().map(RankData::forward_io).collect();
    rt.forward_sharded_local(spec, sharding, whole, io, &args, &opts)?;
    if d_out.is_some() {
        let opts = BackwardOptions { scale: Some(problem.scale as f32), ..BackwardOptions::default() };
        let io = ranks.iter_mut().filter_map(RankData::grad_io).collect();
        rt.backward_sharded_local(spec, sharding, whole, io, &args, &opts)?;
    }
    let mut out = Gathered::new(spec, problem.shape, d_out.is_some());
    for (r, rank) in ranks.iter().enumerate() {
        rank.download(&s, spec, &rows, r, &mut out)?;
    }
    Ok((out.output, out.grads))
}

fn nccl_as<T: Storage + NcclType>(
    runtimes: &[Runtime],
    spec: &Spec,
    problem: &Problem,
    (partition, schedule): (Partition, Schedule),
    d_out: Option<&[f64]>,
) -> Result<(GpuOutput, Option<GpuGradients>), Error> {
    let sharding = Sharding { ranks: runtimes.len(), partition };
    let rows = Rows { shape: problem.shape, sharding };
    let whole = Whole { q_len: problem.shape.q_len, kv_len: problem.shape.kv_len };
    let comms = Communicator::all_local(&runtimes.iter().collect::<Vec<_>>())?;
    let rank = |(r, (rt, comm)): (usize, (&Runtime, Communicator))| -> Result<RankData<T>, Error> {
        let s = rt.stream().clone();
        let tensors = upload_tensors(&s, spec, &problem.tensors)?;
        let args = launch_args(&tensors, problem);
        let mut data = RankData::upload(&s, spec, problem, &rows, r, d_out)?;
        let cp = ContextParallel { sharding, whole, schedule, comm: &comm };
        let opts = ForwardOptions { scale: Some(problem.scale as f32), ..ForwardOptions::default() };
        rt.forward_sharded(spec, cp, data.forward_io(), &args, &opts)?;
        if let Some(io) = data.grad_io() {
            let opts = BackwardOptions { scale: Some(problem.scale as f32), ..BackwardOptions::default() };
            rt.backward_sharded(spec, cp, io, &args, &opts)?;
        }
        s.synchronize().map_err(driver("a rank's launches"))?;
        comm.stream().synchronize().map_err(driver("a rank's exchanges"))?;
        Ok(data)
    };
    let ranks: Vec<Result<RankData<T>, Error>> = std::thread::scope(|scope| {
        let handles: Vec<_> =
            runtimes.iter().zip(comms).enumerate().map(|job| scope.spawn(move || rank(job))).collect();
        handles.into_iter().map(|h| h.join().expect("a rank's thread panicked")).collect()
    });
    let mut out = Gathered::new(spec, problem.shape, d_out.is_some());
    for (r, data) in ranks.into_iter().enumerate() {
        data?.download(runtimes[r].stream(), spec, &rows, r, &mut out)?;
    }
    Ok((out.output, out.grads))
}
