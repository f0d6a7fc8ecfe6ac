//! Random inputs, a GPU run and a check against the CPU reference: the loop
//! shared by the CLI, the benchmark and the GPU tests.
//!
//! Every run draws fresh inputs from its seed, poisons O and LSE with NaN
//! before the launch (an element the kernel forgets to write fails the
//! check), and judges the result with FlashAttention's rule against the f64
//! reference.

use flashgen::codegen::cuda::{BackwardTile, TileConfig};
use flashgen::codegen::reference::{self, ParamValue, Problem, TensorData};
use flashgen::codegen::{Dropout, Dtype, ElemTy, Shape, Spec};
use flashgen::cudarc::driver::{CudaSlice, CudaStream, DriverError};
use flashgen::half::{bf16, f16};
use flashgen::runtime::{
    sustained_median_ms, ArgValue, BackwardIo, BackwardOptions, BackwardWorkspace, BlockMask, Element, Error,
    ForwardE4m3Io, ForwardIo, ForwardOptions, Layout, Runtime,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::StandardNormal;
use std::sync::Arc;

pub mod decode;
pub mod decode_e4m3;
pub mod forward_e4m3;
mod judge;
pub mod paged;
pub mod shard;
mod tune;
pub mod varlen;

use forward_e4m3::{DeviceQkv, E4m3Operands};
use judge::judge_gradients;
pub use judge::{check, check_backward, check_backward_dropout, BackwardReport, Expected, Report};

/// How Q/K/V/O sit in memory on the GPU. The reference always sees BSHD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperandLayout {
    /// Contiguous `[batch, seq, heads, dim]`.
    Bshd,
    /// Contiguous `[batch, heads, seq, dim]`.
    Bhsd,
    /// BSHD inside a larger buffer: padded heads and batches, so every
    /// stride differs from the dense one.
    Padded,
}

impl OperandLayout {
    pub fn layout(self, batch: usize, seq: usize, heads: usize, dim: usize) -> Layout {
        match self {
            OperandLayout::Bshd => Layout::bshd(batch, seq, heads, dim),
            OperandLayout::Bhsd => Layout::bhsd(batch, seq, heads, dim),
            OperandLayout::Padded => {
                let head = dim as i64 + 8;
                let seq_stride = heads as i64 * head;
                Layout { batch, seq, heads, dim, strides: [seq as i64 * seq_stride + 24, seq_stride, head], offset: 0 }
            }
        }
    }
}

/// Median milliseconds (CUDA events) of `launch`, timed as the peers are
/// ([`sustained_median_ms`], at least `min_runs` runs), each run after
/// `flush_bytes` of zeros written (a cold L2, as
/// [`DeviceProblem::flush_l2`] gives the dense launches).
pub(crate) fn cold_median_ms(
    stream: &Arc<CudaStream>,
    flush_bytes: usize,
    min_runs: usize,
    launch: impl FnMut() -> Result<(), Error>,
) -> Result<f64, Error> {
    let mut flush = stream.alloc_zeros::<u8>(flush_bytes).map_err(driver("allocate the L2 flush buffer"))?;
    let zero = || stream.memset_zeros(&mut flush).map_err(driver("flush the L2"));
    sustained_median_ms(stream, min_runs, zero, launch)
}

/// Draws an attention problem for `spec`: Q/K/V ~ N(0, 1) rounded to the
/// spec's dtype; captured tensors not given in `tensors` filled with
/// plausible random values (sorted small ids for i32, as document ids are;
/// uniform [0, 1) for floats, rounded to their storage type).
pub fn random_problem(
    spec: &Spec,
    shape: Shape,
    params: Vec<ParamValue>,
    mut tensors: Vec<Option<TensorData>>,
    scale: Option<f32>,
    seed: u64,
) -> Problem {
    let mut rng = StdRng::seed_from_u64(seed);
    let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let Shape { batch, heads, heads_kv, q_len, kv_len } = shape;
    let mut normal =
        |n: usize| -> Vec<f64> { (0..n).map(|_| round(spec.dtype, rng.sample::<f64, _>(StandardNormal))).collect() };
    let q = normal(batch * q_len * heads * dqk);
    let k = normal(batch * kv_len * heads_kv * dqk);
    let v = normal(batch * kv_len * heads_kv * dv);
    tensors.resize(spec.tensors.len(), None);
    let tensors = random_tensors(spec, &shape, tensors, &mut rng);
    let scale = scale.unwrap_or(1.0 / (dqk as f32).sqrt());
    Problem { shape, q, k, v, scale: scale as f64, params, tensors }
}

/// The captured tensors for `shape`: each `given` one, the others drawn as
/// [`random_problem`] draws them.
fn random_tensors(spec: &Spec, shape: &Shape, given: Vec<Option<TensorData>>, rng: &mut StdRng) -> Vec<TensorData> {
    spec.tensors
        .iter()
        .zip(given)
        .map(|(decl, given)| {
            let row = decl.dims.last().map_or(1, |d| d.resolve(shape));
            given.unwrap_or_else(|| random_tensor(decl.elem, decl.len(shape), row, rng))
        })
        .collect()
}

fn random_tensor(elem: ElemTy, len: usize, row: usize, rng: &mut StdRng) -> TensorData {
    match elem {
        ElemTy::I32 => {
            // Non-decreasing ids in 0..4 along the last axis: document-like.
            let mut ids = Vec::with_capacity(len);
            for _ in 0..len.div_ceil(row.max(1)) {
                let mut cuts: Vec<usize> = (0..3).map(|_| rng.random_range(0..=row)).collect();
                cuts.sort_unstable();
                ids.extend((0..row).map(|i| cuts.iter().filter(|&&c| c <= i).count() as i32));
            }
            ids.truncate(len);
            TensorData::I32(ids)
        }
        ElemTy::F32 => TensorData::Float((0..len).map(|_| rng.random::<f32>() as f64).collect()),
        ElemTy::F16 => TensorData::Float((0..len).map(|_| round(Dtype::F16, rng.random())).collect()),
        ElemTy::Bf16 => TensorData::Float((0..len).map(|_| round(Dtype::Bf16, rng.random())).collect()),
    }
}

fn round(dtype: Dtype, x: f64) -> f64 {
    reference::round_dtype(dtype, x)
}

/// A GPU result, gathered back into the reference's layouts: O BSHD, LSE
/// `[batch, heads, q_len]`.
#[derive(Clone, Debug)]
pub struct GpuOutput {
    pub o: Vec<f64>,
    pub lse: Vec<f64>,
}

/// Q/K/V/O, LSE and captured tensors resident on the GPU for one problem.
pub struct DeviceProblem {
    operands: Operands,
    lse: CudaSlice<f32>,
    tensors: Vec<DeviceTensor>,
    layouts: [Layout; 4],
    stream: Arc<CudaStream>,
    block_mask: Option<BlockMask>,
    config: Option<TileConfig>,
    /// The backward launches' dK/dV tile ([`Self::pin_backward_tile`]).
    backward_tile: Option<BackwardTile>,
    /// The launches' dropout ([`Self::set_dropout`]).
    dropout: Option<Dropout>,
    /// Written with zeros ahead of every timed run ([`Self::flush_l2`]).
    l2_flush: Option<CudaSlice<u8>>,
    /// e4m3 Q, K and V ([`Self::use_e4m3`]): launches run the e4m3 forward.
    e4m3: Option<DeviceQkv>,
}

enum Operands {
    F16([CudaSlice<f16>; 4]),
    Bf16([CudaSlice<bf16>; 4]),
}

enum DeviceTensor {
    I32(CudaSlice<i32>),
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    Bf16(CudaSlice<bf16>),
}

impl DeviceTensor {
    fn arg(&self) -> ArgValue<'_> {
        match self {
            DeviceTensor::I32(t) => t.into(),
            DeviceTensor::F32(t) => t.into(),
            DeviceTensor::F16(t) => t.into(),
            DeviceTensor::Bf16(t) => t.into(),
        }
    }
}

/// A host element type Q/K/V/O can be converted from and to.
trait Storage: Element {
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    /// A NaN bit pattern, to poison outputs.
    const NAN: Self;
    /// Q, K, V and O when they hold this type.
    fn operands(ops: &Operands) -> Option<&[CudaSlice<Self>; 4]>;
}

/// `Storage` for a 16-bit type held by the `Operands` variant `$mine`.
macro_rules! storage {
    ($t:ident, $mine:ident, $other:ident) => {
        impl Storage for $t {
            fn from_f64(x: f64) -> Self {
                $t::from_f64(x)
            }
            fn to_f64(self) -> f64 {
                $t::to_f64(self)
            }
            const NAN: Self = $t::NAN;
            fn operands(ops: &Operands) -> Option<&[CudaSlice<Self>; 4]> {
                match ops {
                    Operands::$mine(ops) => Some(ops),
                    Operands::$other(_) => None,
                }
            }
        }
    };
}
storage!(f16, F16, Bf16);
storage!(bf16, Bf16, F16);

/// Scatters a BSHD host array into a buffer laid out as `layout`; elements
/// the layout does not address are NaN.
fn scatter<T: Storage>(bshd: &[f64], layout: &Layout) -> Vec<T> {
    let mut buf = vec![T::NAN; buffer_len(layout)];
    for_each_offset(layout, |i, off| buf[off] = T::from_f64(bshd[i]));
    buf
}

/// [`scatter`] for bytes (e4m3 operands), the gaps zero.
fn scatter_bytes(bshd: &[u8], layout: &Layout) -> Vec<u8> {
    let mut buf = vec![0; buffer_len(layout)];
    for_each_offset(layout, |i, off| buf[off] = bshd[i]);
    buf
}

fn gather<T: Storage>(buf: &[T], layout: &Layout) -> Vec<f64> {
    let mut out = vec![0.0; layout.len()];
    for_each_offset(layout, |i, off| out[i] = buf[off].to_f64());
    out
}

/// Elements a buffer needs to hold `layout` (its largest offset + 1).
fn buffer_len(layout: &Layout) -> usize {
    if layout.is_empty() {
        return 0;
    }
    let [sb, ss, sh] = layout.strides;
    let last = (layout.batch - 1) as i64 * sb + (layout.seq - 1) as i64 * ss + (layout.heads - 1) as i64 * sh;
    last as usize + layout.dim
}

/// Calls `f(bshd_index, buffer_offset)` for every element of `layout`.
fn for_each_offset(layout: &Layout, mut f: impl FnMut(usize, usize)) {
    let [sb, ss, sh] = layout.strides.map(|s| s as usize);
    let mut i = 0;
    for b in 0..layout.batch {
        for s in 0..layout.seq {
            for h in 0..layout.heads {
                let base = b * sb + s * ss + h * sh;
                for d in 0..layout.dim {
                    f(i, base + d);
                    i += 1;
                }
            }
        }
    }
}

/// Uploads Q, K, V and O (`host`, BSHD) into buffers laid out as `layouts`.
fn upload_operands<T: Storage>(
    stream: &Arc<CudaStream>,
    host: [&Vec<f64>; 4],
    layouts: &[Layout; 4],
) -> Result<[CudaSlice<T>; 4], Error> {
    let one = |i: usize| stream.clone_htod(&scatter::<T>(host[i], &layouts[i])).map_err(driver("upload operands"));
    Ok([one(0)?, one(1)?, one(2)?, one(3)?])
}

/// Uploads the captured tensors `data` as the spec declares them.
fn upload_tensors(stream: &Arc<CudaStream>, spec: &Spec, data: &[TensorData]) -> Result<Vec<DeviceTensor>, Error> {
    spec.tensors
        .iter()
        .zip(data)
        .map(|(decl, data)| {
            let up = driver("upload a captured tensor");
            Ok(match (decl.elem, data) {
                (ElemTy::I32, TensorData::I32(v)) => DeviceTensor::I32(stream.clone_htod(v).map_err(up)?),
                (ElemTy::F32, TensorData::Float(v)) => {
                    DeviceTensor::F32(stream.clone_htod(&v.iter().map(|&x| x as f32).collect::<Vec<_>>()).map_err(up)?)
                }
                (ElemTy::F16, TensorData::Float(v)) => DeviceTensor::F16(
                    stream.clone_htod(&v.iter().map(|&x| f16::from_f64(x)).collect::<Vec<_>>()).map_err(up)?,
                ),
                (ElemTy::Bf16, TensorData::Float(v)) => DeviceTensor::Bf16(
                    stream.clone_htod(&v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>()).map_err(up)?,
                ),
                _ => {
                    return Err(Error::ArgType {
                        name: decl.name.clone(),
                        expected: decl.elem.name().to_string(),
                        got: "host tensor of another element type",
                    })
                }
            })
        })
        .collect()
}

/// Evaluates `$call` with this problem's forward operands as `$io` (whichever
/// element type they hold), its params and tensors as `$args` and its
/// options as `$opts`.
macro_rules! forward_io {
    ($me:ident, $problem:ident, |$io:ident, $args:ident, $opts:ident| $call:expr) => {{
        let $args = launch_args(&$me.tensors, $problem);
        let $opts = ForwardOptions {
            scale: Some($problem.scale as f32),
            block_mask: $me.block_mask.as_ref(),
            config: $me.config,
            dropout: $me.dropout,
        };
        let [lq, lk, lv, lo] = $me.layouts;
        match &mut $me.operands {
            Operands::F16([q, k, v, o]) => {
                let $io = ForwardIo { q: (q, lq), k: (k, lk), v: (v, lv), o: (o, lo), lse: Some(&mut $me.lse) };
                $call
            }
            Operands::Bf16([q, k, v, o]) => {
                let $io = ForwardIo { q: (q, lq), k: (k, lk), v: (v, lv), o: (o, lo), lse: Some(&mut $me.lse) };
                $call
            }
        }
    }};
}
use forward_io;

impl DeviceProblem {
    /// Uploads `problem` in `layout`, with O and LSE poisoned.
    pub fn upload(rt: &Runtime, spec: &Spec, problem: &Problem, layout: OperandLayout) -> Result<Self, Error> {
        let stream = rt.stream().clone();
        let Shape { batch, heads, heads_kv, q_len, kv_len } = problem.shape;
        let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
        let layouts = [
            layout.layout(batch, q_len, heads, dqk),
            layout.layout(batch, kv_len, heads_kv, dqk),
            layout.layout(batch, kv_len, heads_kv, dv),
            layout.layout(batch, q_len, heads, dv),
        ];
        let o_poison = vec![f64::NAN; layouts[3].len()];
        let host = [&problem.q, &problem.k, &problem.v, &o_poison];
        let operands = match spec.dtype {
            Dtype::F16 => Operands::F16(upload_operands(&stream, host, &layouts)?),
            Dtype::Bf16 => Operands::Bf16(upload_operands(&stream, host, &layouts)?),
        };
        let lse = stream.clone_htod(&vec![f32::NAN; batch * heads * q_len]).map_err(driver("upload LSE"))?;
        let tensors = upload_tensors(&stream, spec, &problem.tensors)?;
        let (block_mask, config, backward_tile, dropout, l2_flush, e4m3) = (None, None, None, None, None, None);
        Ok(DeviceProblem {
            operands,
            lse,
            tensors,
            layouts,
            stream,
            block_mask,
            config,
            backward_tile,
            dropout,
            l2_flush,
            e4m3,
        })
    }

    /// Serves `problem` of `spec` from now on, the problem uploaded with the
    /// same Q, K and V (a benchmark's next variant): its captured tensors
    /// are uploaded, and the block mask, pinned configurations, dropout and
    /// e4m3 operands of earlier launches dropped. O and LSE keep what the
    /// last launch wrote, and the L2 flush buffer stays.
    pub fn reuse_for(&mut self, spec: &Spec, problem: &Problem) -> Result<(), Error> {
        self.tensors = upload_tensors(&self.stream, spec, &problem.tensors)?;
        (self.block_mask, self.config, self.backward_tile, self.dropout, self.e4m3) = (None, None, None, None, None);
        Ok(())
    }

    /// Later launches use tile configuration `config` (one of the spec's
    /// candidates), or with `None` the runtime's own choice.
    pub fn pin_config(&mut self, config: Option<TileConfig>) {
        self.config = config;
    }

    /// Later backward launches run the dK/dV kernel in `tile` (one of
    /// `BackwardConfig::tiles`), or with `None` the runtime's own choice.
    pub fn pin_backward_tile(&mut self, tile: Option<BackwardTile>) {
        self.backward_tile = tile;
    }

    /// Later forward and backward launches drop out P with `dropout`
    /// (`None`: not at all).
    pub fn set_dropout(&mut self, dropout: Option<Dropout>) {
        self.dropout = dropout;
    }

    /// Builds the spec's block mask for this problem; later launches use it.
    pub fn build_block_mask(&mut self, rt: &Runtime, spec: &Spec, problem: &Problem) -> Result<&BlockMask, Error> {
        let mask = rt.block_mask(spec, problem.shape, &launch_args(&self.tensors, problem))?;
        Ok(self.block_mask.insert(mask))
    }

    /// Later launches run the e4m3 forward on `operands` (uploaded in
    /// this problem's layouts), writing this problem's O and LSE.
    pub fn use_e4m3(&mut self, operands: &E4m3Operands) -> Result<(), Error> {
        let [q, k, v, _] = &self.layouts;
        self.e4m3 = Some(DeviceQkv::upload(&self.stream, operands, [q, k, v], scatter_bytes)?);
        Ok(())
    }

    /// Enqueues one forward launch (asynchronous).
    pub fn launch(&mut self, rt: &Runtime, spec: &Spec, problem: &Problem) -> Result<(), Error> {
        if self.e4m3.is_some() {
            return self.launch_e4m3(rt, spec, problem);
        }
        forward_io!(self, problem, |io, args, opts| rt.forward(spec, io, &args, &opts))
    }

    /// One e4m3 forward launch on the operands of [`Self::use_e4m3`].
    fn launch_e4m3(&mut self, rt: &Runtime, spec: &Spec, problem: &Problem) -> Result<(), Error> {
        let Some(qkv) = &self.e4m3 else { return Ok(()) };
        let descale = qkv.descale();
        let [q, k, v] = &qkv.qkv;
        let [lq, lk, lv, _] = self.layouts;
        forward_io!(self, problem, |io, args, opts| {
            let ForwardIo { o, lse, .. } = io;
            let io = ForwardE4m3Io { q: (q, lq), k: (k, lk), v: (v, lv), o, lse };
            rt.forward_e4m3(spec, io, descale, &args, &opts)
        })
    }

    /// Waits for the stream and reads O and LSE back.
    pub fn download(&self) -> Result<GpuOutput, Error> {
        let err = driver("download results");
        self.stream.synchronize().map_err(err)?;
        let o = match &self.operands {
            Operands::F16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &self.layouts[3]),
            Operands::Bf16(ops) => gather(&self.stream.clone_dtoh(&ops[3]).map_err(err)?, &self.layouts[3]),
        };
        let lse = self.stream.clone_dtoh(&self.lse).map_err(err)?.into_iter().map(f64::from).collect();
        Ok(GpuOutput { o, lse })
    }

    /// Median milliseconds of one launch, timed with CUDA events as the
    /// peers are ([`sustained_median_ms`], at least `min_runs` launches).
    pub fn time(&mut self, rt: &Runtime, spec: &Spec, problem: &Problem, min_runs: usize) -> Result<f64, Error> {
        self.time_steps(rt, spec, problem, min_runs, |_| Ok(()))
    }

    /// Median milliseconds (CUDA events) of a forward launch followed by
    /// `then`, timed as [`Self::time`].
    fn time_steps(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        min_runs: usize,
        mut then: impl FnMut(&Self) -> Result<(), Error>,
    ) -> Result<f64, Error> {
        let stream = self.stream.clone();
        let mut flush = self.l2_flush.take();
        let zero = |buf: &mut Option<CudaSlice<u8>>| match buf {
            Some(buf) => stream.memset_zeros(buf).map_err(driver("flush the L2")),
            None => Ok(()),
        };
        let ms = sustained_median_ms(
            &stream,
            min_runs,
            || zero(&mut flush),
            || {
                self.launch(rt, spec, problem)?;
                then(self)
            },
        );
        self.l2_flush = flush;
        ms
    }

    /// Makes every timed run (and warm-up run) start from a cold L2: `bytes`
    /// of zeros written ahead of it, outside its events, as triton's
    /// `do_bench` writes 256 MB before each repetition of the peers. Without
    /// it a run finds the L2 as the previous one left it.
    pub fn flush_l2(&mut self, bytes: usize) -> Result<(), Error> {
        self.l2_flush = Some(self.stream.alloc_zeros::<u8>(bytes).map_err(driver("allocate the L2 flush buffer"))?);
        Ok(())
    }
}

/// Backward GPU results, gathered into the reference's layouts (dQ, dK, dV
/// BSHD; tensor gradients row-major, `None` where the tensor has none).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuGradients {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    pub d_tensors: Vec<Option<Vec<f64>>>,
}

impl DeviceProblem {
    /// Runs the backward pass from this problem's O and LSE (run
    /// [`Self::launch`] first) with the incoming gradient `d_out` (BSHD, like
    /// O), asking for every tensor gradient the spec has (with
    /// `tensor_grads`, else for none), in `workspace` if given; dQ, dK, dV
    /// and the tensor gradients start NaN-poisoned. Waits and reads them
    /// back.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        d_out: &[f64],
        deterministic: bool,
        tensor_grads: bool,
        workspace: Option<&BackwardWorkspace>,
    ) -> Result<GpuGradients, Error> {
        let opts = BackwardOptions {
            scale: Some(problem.scale as f32),
            block_mask: self.block_mask.as_ref(),
            deterministic,
            workspace,
            dropout: self.dropout,
            tile: self.backward_tile,
        };
        match &self.operands {
            Operands::F16(ops) => self.backward_as(rt, spec, problem, ops, (d_out, tensor_grads), &opts),
            Operands::Bf16(ops) => self.backward_as(rt, spec, problem, ops, (d_out, tensor_grads), &opts),
        }
    }

    /// Median milliseconds of one training step's attention, forward and
    /// backward into Q, K and V (no tensor gradients, as the peers' steps),
    /// queued back to back with buffers (the backward's workspace included)
    /// allocated once, timed as [`Self::time`].
    pub fn time_forward_backward(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        min_runs: usize,
    ) -> Result<f64, Error> {
        match self.operands {
            Operands::F16(_) => self.time_training::<f16>(rt, spec, problem, min_runs),
            Operands::Bf16(_) => self.time_training::<bf16>(rt, spec, problem, min_runs),
        }
    }

    fn time_training<T: Storage>(
        &mut self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        min_runs: usize,
    ) -> Result<f64, Error> {
        let d_out = random_d_out(spec, problem.shape, 7);
        let mut grads = grad_buffers::<T>(&self.stream, spec, problem.shape, self.layouts, &d_out, false)?;
        let workspace = BackwardWorkspace::default();
        self.time_steps(rt, spec, problem, min_runs, |me| {
            let ops = T::operands(&me.operands).ok_or(Error::Dtype { spec: spec.dtype, got: T::DTYPE })?;
            let opts = BackwardOptions {
                scale: Some(problem.scale as f32),
                block_mask: me.block_mask.as_ref(),
                deterministic: false,
                workspace: Some(&workspace),
                dropout: me.dropout,
                tile: me.backward_tile,
            };
            me.queue_backward(rt, spec, problem, ops, &mut grads, &opts)
        })
    }

    fn backward_as<T: Storage>(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        ops: &[CudaSlice<T>; 4],
        (d_out, tensor_grads): (&[f64], bool),
        opts: &BackwardOptions<'_>,
    ) -> Result<GpuGradients, Error> {
        gradients_of::<T>(&self.stream, spec, problem.shape, self.layouts, (d_out, tensor_grads), |grads| {
            self.queue_backward(rt, spec, problem, ops, grads, opts)
        })
    }

    /// Queues the backward kernels into `grads` without waiting.
    fn queue_backward<T: Storage>(
        &self,
        rt: &Runtime,
        spec: &Spec,
        problem: &Problem,
        [q, k, v, o]: &[CudaSlice<T>; 4],
        grads: &mut GradBuffers<T>,
        opts: &BackwardOptions<'_>,
    ) -> Result<(), Error> {
        let io = backward_io!(BackwardIo, [q, k, v, o], &self.lse, grads, self.layouts);
        rt.backward(spec, io, &launch_args(&self.tensors, problem), opts)
    }
}

/// A backward launch's operands, `$io` (`BackwardIo` or `VarlenBackwardIo`):
/// the forward's Q, K, V, O and LSE with the gradient buffers `$grads`, in
/// `$layouts` (Q's, K's, V's, O's; dO as O, each gradient as its input),
/// then `$field: $value`, the struct's own further fields.
macro_rules! backward_io {
    ($io:ident, [$q:ident, $k:ident, $v:ident, $o:ident], $lse:expr, $grads:expr, $layouts:expr $(, $field:ident: $value:expr)*) => {{
        let [lq, lk, lv, lo] = $layouts;
        let grads: &mut GradBuffers<_> = $grads;
        $io {
            q: ($q, lq),
            k: ($k, lk),
            v: ($v, lv),
            o: ($o, lo),
            lse: $lse,
            d_o: (&grads.d_o, lo),
            dq: (&mut grads.dq, lq),
            dk: (&mut grads.dk, lk),
            dv: (&mut grads.dv, lv),
            d_tensors: grads.tensors.iter_mut().map(Option::as_mut).collect(),
            $($field: $value,)*
        }
    }};
}
pub(crate) use backward_io;

/// Gradient buffers made by [`grad_buffers`], filled by `queue` (which
/// queues the backward kernels into them) and read back by
/// [`download_gradients`].
fn gradients_of<T: Storage>(
    s: &Arc<CudaStream>,
    spec: &Spec,
    shape: Shape,
    layouts: [Layout; 4],
    (d_out, tensor_grads): (&[f64], bool),
    queue: impl FnOnce(&mut GradBuffers<T>) -> Result<(), Error>,
) -> Result<GpuGradients, Error> {
    let mut grads = grad_buffers::<T>(s, spec, shape, layouts, d_out, tensor_grads)?;
    queue(&mut grads)?;
    download_gradients(s, spec, shape, layouts, &grads)
}

/// dO uploaded as laid out in `layouts[3]` (O's); dQ, dK, dV and (with
/// `tensor_grads`) every tensor gradient the spec has at `shape`,
/// NaN-poisoned.
fn grad_buffers<T: Storage>(
    s: &Arc<CudaStream>,
    spec: &Spec,
    shape: Shape,
    [lq, lk, lv, lo]: [Layout; 4],
    d_out: &[f64],
    tensor_grads: bool,
) -> Result<GradBuffers<T>, Error> {
    let up = driver("upload backward operands");
    let poisoned = |l: &Layout| s.clone_htod(&vec![T::NAN; buffer_len(l)]).map_err(up);
    let trainable = if tensor_grads { flashgen::codegen::cuda::trainable_tensors(spec) } else { vec![] };
    let tensors = (0..spec.tensors.len())
        .map(|i| {
            let len = spec.tensors[i].len(&shape);
            trainable.contains(&i).then(|| s.clone_htod(&vec![f32::NAN; len.max(1)]).map_err(up)).transpose()
        })
        .collect::<Result<_, Error>>()?;
    Ok(GradBuffers {
        d_o: s.clone_htod(&scatter::<T>(d_out, &lo)).map_err(up)?,
        dq: poisoned(&lq)?,
        dk: poisoned(&lk)?,
        dv: poisoned(&lv)?,
        tensors,
    })
}

/// Waits for `s` and reads `grads` back in the reference's layouts.
fn download_gradients<T: Storage>(
    s: &Arc<CudaStream>,
    spec: &Spec,
    shape: Shape,
    [lq, lk, lv, _]: [Layout; 4],
    grads: &GradBuffers<T>,
) -> Result<GpuGradients, Error> {
    let down = driver("download gradients");
    s.synchronize().map_err(down)?;
    let d_tensors = grads
        .tensors
        .iter()
        .zip(&spec.tensors)
        .map(|(g, decl)| {
            let len = decl.len(&shape);
            g.as_ref()
                .map(|g| Ok(s.clone_dtoh(g).map_err(down)?.into_iter().take(len).map(f64::from).collect()))
                .transpose()
        })
        .collect::<Result<_, Error>>()?;
    Ok(GpuGradients {
        dq: gather(&s.clone_dtoh(&grads.dq).map_err(down)?, &lq),
        dk: gather(&s.clone_dtoh(&grads.dk).map_err(down)?, &lk),
        dv: gather(&s.clone_dtoh(&grads.dv).map_err(down)?, &lv),
        d_tensors,
    })
}

/// The backward pass's own buffers: dO in, gradients out.
struct GradBuffers<T> {
    d_o: CudaSlice<T>,
    dq: CudaSlice<T>,
    dk: CudaSlice<T>,
    dv: CudaSlice<T>,
    tensors: Vec<Option<CudaSlice<f32>>>,
}

/// The params and captured tensors as launch arguments.
fn launch_args<'a>(tensors: &'a [DeviceTensor], problem: &Problem) -> Vec<ArgValue<'a>> {
    let params = problem.params.iter().map(|&p| ArgValue::from(p));
    params.chain(tensors.iter().map(DeviceTensor::arg)).collect()
}

/// Wraps a driver error with what was being done.
pub(crate) fn driver(during: &'static str) -> impl Fn(DriverError) -> Error + Copy {
    move |source| Error::driver(during, source)
}

/// dL/dO ~ N(0, 1), rounded to the spec's dtype, BSHD like O.
pub fn random_d_out(spec: &Spec, shape: Shape, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let n = shape.batch * shape.q_len * shape.heads * spec.head_dims.v as usize;
    (0..n).map(|_| round(spec.dtype, rng.sample::<f64, _>(StandardNormal))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout the GPU tests use places each BSHD element at a distinct
    /// offset inside the buffer, and gathering inverts scattering.
    #[test]
    fn layouts_scatter_and_gather_exactly() {
        let (b, s, h, d) = (2, 5, 3, 4);
        let bshd: Vec<f64> = (0..b * s * h * d).map(|i| i as f64).collect();
        for kind in [OperandLayout::Bshd, OperandLayout::Bhsd, OperandLayout::Padded] {
            let layout = kind.layout(b, s, h, d);
            let buf: Vec<bf16> = scatter(&bshd, &layout);
            let written = buf.iter().filter(|x| !x.is_nan()).count();
            assert_eq!(written, bshd.len(), "{kind:?}: distinct offsets");
            assert_eq!(gather(&buf, &layout), bshd, "{kind:?}");
            if kind != OperandLayout::Padded {
                assert_eq!(buf.len(), bshd.len(), "{kind:?} is dense");
            }
        }
    }

    #[test]
    fn random_problems_are_rounded_and_sized() {
        let spec = flashgen::parse_one(
            "S { dtype: bf16, head_dim: 8, tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] }",
        )
        .unwrap();
        let shape = Shape { batch: 2, heads: 4, heads_kv: 2, q_len: 3, kv_len: 7 };
        let p = random_problem(&spec, shape, vec![], vec![], None, 1);
        assert_eq!((p.q.len(), p.k.len(), p.v.len()), (2 * 3 * 4 * 8, 2 * 7 * 2 * 8, 2 * 7 * 2 * 8));
        assert!(p.q.iter().all(|&x| reference::round_dtype(Dtype::Bf16, x) == x));
        let TensorData::I32(ids) = &p.tensors[0] else { panic!("i32 ids") };
        assert_eq!(ids.len(), 2 * 7);
        assert!(ids.chunks(7).all(|row| row.windows(2).all(|w| w[0] <= w[1])), "sorted document ids: {ids:?}");
        assert_eq!(p.scale, (1.0 / 8f32.sqrt()) as f64);
        assert_ne!(random_problem(&spec, shape, vec![], vec![], None, 2).q, p.q, "seeds differ");
    }
}
