//! Decoding: a few new query tokens per sequence against a KV cache, in a
//! [`DecodePlan`] made once for the batch's upper bounds and run every step.
//!
//! The plan makes every decision on the host up front (the kernel's rows
//! per tile and stages, the split count from the shapes and the SM count,
//! the compiled kernels, the split workspace); [`DecodePlan::run`] checks
//! the operands against it and queues one or two launches: no allocation
//! (host or device), no copy between host and device, no synchronization,
//! no spec hashing. The sequences' key counts are read on the device, so a
//! step can be captured into a CUDA graph once and replayed with new
//! lengths written to the same `kv_lens` buffer. A plan made with
//! [`DecodeOptions::paged`] runs on paged caches instead
//! (`decode_paged`: [`DecodePlan::run_paged`]), one made with
//! [`DecodeOptions::varlen`] on packed queries, a token count per sequence
//! (`decode_varlen`: [`DecodePlan::run_varlen`]), one made with
//! [`DecodeOptions::kv_cache`] on e4m3 caches (`decode_e4m3`:
//! [`DecodePlan::run_e4m3`] and its paged and varlen twins), one made with
//! [`DecodeOptions::v_in_k`] on MLA's cache, V a view of K's first columns
//! (checked at launch); all share the launch here
//! ([`DecodePlan::queue`]).

use crate::args::{signature, ArgInfo, ArgValue};
use crate::check::{check_forward, softmax_scale, Problem};
use crate::check_decode::{check_launch, check_plan_shape, check_run_kind, check_splits, check_v_in_k};
use crate::check_decode::{DecodeShape, RunKind};
use crate::descale::KvDescale;
use crate::element::Element;
use crate::error::{Error, RaggedError};
use crate::kernels::{LoadedKernel, Which};
use crate::layout::Layout;
use crate::marshal::{
    launch_config, launch_inline, marshal_into, Bindings, DecodeBindings, PagedBindings, Value, VarlenBindings,
    INLINE_ARGS,
};
use crate::operand::{DeviceInput, DeviceOutput};
use crate::paged::PagedKv;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use flashgen_codegen::cuda::{DecodeCache, DecodeConfig, DecodeQueries, KvCacheDtype};
use flashgen_codegen::{Shape, Spec};
use std::sync::Arc;

/// The most params and tensors a decode spec declares: a launch keeps
/// their values and guards in arrays of this size (no host allocation).
const SPEC_ARGS: usize = 16;

/// How a plan runs: the softmax scale, to override the plan's choice the
/// split count, and the kind of cache and queries it reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeOptions {
    /// Softmax scale, positive and finite; `None`: `1 / sqrt(head_dims.qk)`.
    pub scale: Option<f32>,
    /// Split each sequence's keys this many ways (1 to
    /// [`MAX_SPLITS`](flashgen_codegen::cuda::MAX_SPLITS)); `None`: the
    /// plan's choice from the shapes and the SM count.
    pub splits: Option<usize>,
    /// The plan runs on paged caches ([`DecodePlan::run_paged`]) rather
    /// than dense ones ([`DecodePlan::run`]).
    pub paged: bool,
    /// The plan runs on packed queries, each sequence 0 to `q_len` tokens
    /// ([`DecodePlan::run_varlen`], on the cache `paged` names), rather
    /// than `q_len` tokens each.
    pub varlen: bool,
    /// The cache's element format: the spec's dtype (runs take K and V of
    /// the plan's element type), or [`KvCacheDtype::E4m3`] (runs take byte
    /// caches and their descale factors: [`DecodePlan::run_e4m3`],
    /// [`DecodePlan::run_paged_e4m3`], [`DecodePlan::run_varlen_e4m3`]).
    pub kv_cache: KvCacheDtype,
    /// V is K's first `head_dims.v` columns (MLA's absorbed cache: runs
    /// pass V as a view of K, the same buffer, start and strides; any other
    /// V is refused with [`RaggedError::VNotInK`](crate::RaggedError::VNotInK)):
    /// the kernel reads V's fragments from K's tiles, so each cache byte is
    /// copied once and a stage holds K alone. Needs V's head dim at most
    /// K's and a 16-bit cache. At QK 576 / V 512 a V of its own still runs
    /// where its stages fit (sm_80, sm_90), reading the shared columns twice.
    pub v_in_k: bool,
}

/// The operands of one decode step. Q and O are `[batch, q_len, heads, d]`,
/// K and V the cache `[batch, max_kv_len, heads_kv, d]` (any [`Layout`]
/// strides); sequence `b`'s keys are its cache rows `0 .. kv_lens[b]`, and
/// its query `i` is the spec's `q = i` with `q_len` / `kv_len` the step's,
/// exactly as [`Runtime::forward`] on the same queries and keys. The LSE,
/// if asked, is `f32[batch, heads, q_len]`. `C` is the cache's element:
/// `T`, or `u8` holding e4m3 ([`DecodePlan::run_e4m3`]).
pub struct DecodeIo<'a, T, C = T> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub k: (&'a dyn DeviceInput<C>, Layout),
    pub v: (&'a dyn DeviceInput<C>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    /// `i32[batch]` each sequence's key count, on the device. Values past
    /// the cache (or negative) are clamped into `[0, max_kv_len]`: wrong
    /// rows, never a read outside the cache.
    pub kv_lens: &'a dyn DeviceInput<i32>,
}

/// A decode step's K/V cache: dense, as [`DecodeIo`]'s, or paged, as
/// [`PagedDecodeIo`](crate::PagedDecodeIo)'s.
pub enum DecodeKv<'a, T> {
    /// `[batch, max_kv_len, heads_kv, d]` (any [`Layout`] strides) and the
    /// sequences' key counts, clamped into `[0, max_kv_len]` on the device.
    Dense {
        k: (&'a dyn DeviceInput<T>, Layout),
        v: (&'a dyn DeviceInput<T>, Layout),
        kv_lens: &'a dyn DeviceInput<i32>,
    },
    Paged(PagedKv<'a, T>),
}

impl<T> DecodeKv<'_, T> {
    /// The sequences' key counts.
    pub(crate) fn kv_lens(&self) -> &dyn DeviceInput<i32> {
        match self {
            DecodeKv::Dense { kv_lens, .. } => *kv_lens,
            DecodeKv::Paged(kv) => kv.kv_lens,
        }
    }

    /// The kind of cache: a plan's kernel reads one.
    pub(crate) fn cache(&self) -> DecodeCache {
        match self {
            DecodeKv::Dense { .. } => DecodeCache::Dense,
            DecodeKv::Paged(_) => DecodeCache::Paged,
        }
    }
}

/// One checked step's operands as [`DecodePlan::queue`] launches them: Q
/// and O (packed ones as [`PackedLayout::as_layout`](crate::PackedLayout::as_layout)),
/// the LSE, the cache (of `C`), and packed queries' prefix sums with Q's
/// tokens.
pub(crate) struct StepIo<'a, T, C> {
    pub q: (&'a dyn DeviceInput<T>, Layout),
    pub o: (&'a mut dyn DeviceOutput<T>, Layout),
    pub lse: Option<&'a mut CudaSlice<f32>>,
    pub kv: DecodeKv<'a, C>,
    pub packed: Option<(&'a dyn DeviceInput<i32>, usize)>,
}

/// A decode step's decisions and resources, made once for its bounds.
pub struct DecodePlan {
    spec: Spec,
    shape: DecodeShape,
    scale: f32,
    config: DecodeConfig,
    splits: u32,
    cache: DecodeCache,
    queries: DecodeQueries,
    decode: Arc<LoadedKernel>,
    grid: LaunchConfig,
    /// With more than one split: the partial O and LSE and the counters
    /// the kernel's last split of each row tile combines them by.
    split: Option<SplitResources>,
}

/// The device addresses one decode run binds, read off cudarc's guards by
/// [`DecodePlan::queue`]; [`run_bindings`] turns them into the launch's
/// bindings without touching the GPU, so that a test can run what a launch
/// does between its guards and the driver.
pub(crate) struct RunAddresses<'a> {
    /// Q, K, V and O: each buffer's address and its layout.
    pub operands: [(u64, Layout); 4],
    /// The LSE's address (0: none).
    pub lse: u64,
    /// `kv_lens`, `i32[batch]`.
    pub kv_lens: u64,
    pub paged: Option<PagedBindings>,
    pub varlen: Option<VarlenBindings>,
    /// The spec's tensors, in declaration order.
    pub tensors: &'a [u64],
    /// With more than one split: the workspace's parts and its base.
    pub workspace: Option<(SplitParts, u64)>,
    /// An e4m3 cache's K and V descale buffers (address, K/V-head stride).
    pub descales: Option<[(u64, i32); 2]>,
}

/// What a run binds from its plan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlanWords {
    pub splits: u32,
    pub scale: f32,
    /// V must be a view of K's buffer ([`DecodeOptions::v_in_k`]).
    pub v_in_k: bool,
}

/// The bindings of one decode run at `addresses` (see [`RunAddresses`]);
/// refuses a V that is not K's view where the plan reads V from K.
pub(crate) fn run_bindings<'a>(
    plan: PlanWords,
    shape: Shape,
    infos: &'a [ArgInfo],
    addresses: &RunAddresses<'a>,
) -> Result<Bindings<'a>, Error> {
    let [(q, q_layout), k, v, (o, o_layout)] = addresses.operands;
    if plan.v_in_k {
        check_v_in_k(k, v)?;
    }
    let [partial_o, partial_lse, counters] = addresses.workspace.map_or([0; 3], |(parts, base)| parts.addresses(base));
    let decode =
        DecodeBindings { kv_lens: addresses.kv_lens, splits: plan.splits, partial: [partial_o, partial_lse], counters };
    Ok(Bindings {
        decode: Some(decode),
        // Q is not e4m3: its slot is never read.
        descales: addresses.descales.map(|[k, v]| [(0, 0), k, v]),
        paged: addresses.paged,
        varlen: addresses.varlen,
        ..Bindings::without_operands(shape, infos, addresses.tensors).with_operands(
            [q, k.0, v.0, o],
            [q_layout, k.1, v.1, o_layout],
            addresses.lse,
            plan.scale,
        )
    })
}

/// The split combine's workspace in one allocation, so that a run takes
/// one buffer's guard for it, not three (each guard records an event under
/// cudarc's tracking). Zeroed once; each launch's last splits set the
/// counters back to zero.
struct SplitResources {
    workspace: CudaSlice<u32>,
    parts: SplitParts,
}

/// Where the split workspace's parts lie, in 4-byte elements: the partial
/// O (f32) first, then the partial LSE (f32) and the counters (u32), each
/// from a 256-byte boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SplitParts {
    lse_at: usize,
    counters_at: usize,
    len: usize,
}

impl SplitParts {
    /// The parts of `o` partial O values, `lse` partial LSEs and `counters`
    /// counters.
    pub(crate) fn carve(o: usize, lse: usize, counters: usize) -> SplitParts {
        const ALIGN: usize = 256 / 4;
        let lse_at = o.next_multiple_of(ALIGN);
        let counters_at = (lse_at + lse).next_multiple_of(ALIGN);
        SplitParts { lse_at, counters_at, len: counters_at + counters.max(1) }
    }

    /// The device addresses of the partial O, the partial LSE and the
    /// counters in a workspace at `base`.
    fn addresses(self, base: u64) -> [u64; 3] {
        [base, base + 4 * self.lse_at as u64, base + 4 * self.counters_at as u64]
    }
}

impl Runtime {
    /// A decode plan for `spec` within `shape`'s bounds on this runtime's
    /// GPU: compiles (or loads) its kernels (the paged decode kernel with
    /// [`DecodeOptions::paged`], over packed queries with
    /// [`DecodeOptions::varlen`]) and allocates the split workspace; the
    /// workspace and grid hold `q_len` tokens per sequence. Errors:
    /// heads not in groups, no queries, a split count out of range, head
    /// dims the decode kernels do not take or whose stages do not fit the
    /// GPU (`DecodeOptions::v_in_k` where V's own stages do not), more than
    /// 16 params and tensors.
    pub fn decode_plan(&self, spec: &Spec, shape: DecodeShape, opts: &DecodeOptions) -> Result<DecodePlan, Error> {
        check_plan_shape(&shape)?;
        if spec.params.len() + spec.tensors.len() > SPEC_ARGS {
            let problem = format!("spec `{}` declares more than {SPEC_ARGS} params and tensors", spec.name);
            return Err(Error::Ragged(RaggedError::DecodeShape { problem }));
        }
        let scale = softmax_scale(spec, opts.scale)?;
        let rows = u32::try_from(shape.group_rows()).unwrap_or(u32::MAX);
        let config = DecodeConfig::choose(spec, self.target(), rows, opts.kv_cache, opts.v_in_k)
            .map_err(|unfit| Error::Ragged(RaggedError::DecodeShape { problem: unfit.to_string() }))?;
        let ctas = (shape.group_rows().div_ceil(config.block_m() as usize) * shape.heads_kv * shape.batch) as u64;
        let kv_tiles = kv_tiles(&shape, config);
        let cache = if opts.paged { DecodeCache::Paged } else { DecodeCache::Dense };
        let splits = match opts.splits {
            Some(n) => check_splits(n)?,
            None => config.splits(spec, cache, rows, kv_tiles, ctas, self.sm_count()),
        };
        let queries = if opts.varlen { DecodeQueries::Packed } else { DecodeQueries::Padded };
        let decode = self.load_which(spec, Which::Decode(config, cache, queries))?;
        let (grid, split) = split_launch(self, (spec, shape), &decode, splits)?;
        Ok(DecodePlan { spec: spec.clone(), shape, scale, config, splits, cache, queries, decode, grid, split })
    }
}

/// `args`' infos (a run of `spec`'s plan) in an array, not a vector (a
/// run allocates nothing): the first `args.len()` entries are theirs.
pub(crate) fn arg_infos(spec: &Spec, args: &[ArgValue<'_>]) -> Result<[ArgInfo; SPEC_ARGS], Error> {
    if args.len() > SPEC_ARGS {
        let expected = spec.params.len() + spec.tensors.len();
        return Err(Error::ArgCount { expected, got: args.len(), signature: signature(spec) });
    }
    Ok(std::array::from_fn(|i| args.get(i).map_or(ArgInfo::I32(0), ArgValue::info)))
}

/// The tiles of `config`'s keys the longest sequence of `shape` holds.
fn kv_tiles(shape: &DecodeShape, config: DecodeConfig) -> u32 {
    u32::try_from(shape.max_kv_len.div_ceil(config.block_n() as usize)).unwrap_or(u32::MAX)
}

/// The grid of `decode` over `shape`'s bounds with each sequence's keys
/// split `splits` ways, and, split, the workspace its combine reads.
fn split_launch(
    rt: &Runtime,
    (spec, shape): (&Spec, DecodeShape),
    decode: &LoadedKernel,
    splits: u32,
) -> Result<(LaunchConfig, Option<SplitResources>), Error> {
    let grid = launch_config(decode.kernel(), &shape.as_shape(), splits as usize, rt.sm_count())?;
    if splits == 1 {
        return Ok((grid, None));
    }
    let rows = splits as usize * shape.batch * shape.heads * shape.q_len;
    // One counter per row tile: the grid's CTAs over the splits.
    let (x, y, z) = grid.grid_dim;
    let tiles = (x / splits) as usize * y as usize * z as usize;
    let parts = SplitParts::carve(rows * spec.head_dims.v as usize, rows, tiles);
    let during = |e| Error::driver("allocating the split decode's workspace", e);
    let workspace = rt.stream().alloc_zeros::<u32>(parts.len).map_err(during)?;
    Ok((grid, Some(SplitResources { workspace, parts })))
}

impl DecodePlan {
    /// Splits each sequence's keys `splits` ways from now on (1 to
    /// [`MAX_SPLITS`](flashgen_codegen::cuda::MAX_SPLITS)): a new grid and
    /// split workspace on `rt`, the runtime the plan was made on.
    pub(crate) fn resplit(&mut self, rt: &Runtime, splits: u32) -> Result<(), Error> {
        let (grid, split) = split_launch(rt, (&self.spec, self.shape), &self.decode, splits)?;
        (self.splits, self.grid, self.split) = (splits, grid, split);
        Ok(())
    }

    /// The tiles of keys of the plan's longest sequence.
    pub(crate) fn kv_tiles(&self) -> u32 {
        kv_tiles(&self.shape, self.config)
    }

    /// The bounds the plan was made for.
    pub fn shape(&self) -> DecodeShape {
        self.shape
    }

    /// The spec the plan runs.
    pub(crate) fn spec(&self) -> &Spec {
        &self.spec
    }

    /// How many ways each sequence's keys are split.
    pub fn splits(&self) -> usize {
        self.splits as usize
    }

    /// The decode kernel's configuration.
    pub fn config(&self) -> DecodeConfig {
        self.config
    }

    /// Queues one decode step on `rt`'s stream (the runtime the plan was
    /// made on) without waiting: checks the operands and `args` (the spec's
    /// params, then its tensors) against the plan, then launches the decode
    /// kernel (one launch, splits or not). A dense cache: a plan
    /// made for paged ones refuses it ([`RaggedError::DecodeCache`](crate::RaggedError::DecodeCache)),
    /// one made for packed queries ([`RaggedError::DecodeQueries`](crate::RaggedError::DecodeQueries)),
    /// one made for e4m3 caches ([`RaggedError::DecodeKvDtype`](crate::RaggedError::DecodeKvDtype)).
    pub fn run<T: Element>(&self, rt: &Runtime, io: DecodeIo<'_, T>, args: &[ArgValue<'_>]) -> Result<(), Error> {
        self.run_dense(rt, io, None, args)
    }

    /// [`DecodePlan::run`] over a cache of `C` (`T`, or e4m3 bytes with
    /// their `descale`).
    pub(crate) fn run_dense<T: Element, C>(
        &self,
        rt: &Runtime,
        io: DecodeIo<'_, T, C>,
        descale: Option<&KvDescale<'_>>,
        args: &[ArgValue<'_>],
    ) -> Result<(), Error> {
        self.check_kind(DecodeCache::Dense, DecodeQueries::Padded, descale)?;
        let infos = arg_infos(&self.spec, args)?;
        let infos = &infos[..args.len()];
        let DecodeIo { q, k, v, o, lse, kv_lens } = io;
        let operands = [(q.1, q.0.len()), (k.1, k.0.len()), (v.1, v.0.len()), (o.1, o.0.len())];
        let problem = Problem::new(T::DTYPE, operands, lse.as_ref().map(|l| l.len()));
        let Some(shape) = check_forward(&self.spec, &problem, infos)? else {
            return Ok(());
        };
        check_launch(&self.shape, &shape, kv_lens.len())?;
        let kv = DecodeKv::Dense { k, v, kv_lens };
        self.queue(rt, (shape, infos, args), StepIo { q, o, lse, kv, packed: None }, descale)
    }

    /// Refuses a run on another kind of cache, queries or cache elements
    /// than the plan's kernel reads (`descale`: the run's e4m3 descales,
    /// checked against the plan's K/V heads; `None`: a 16-bit cache).
    pub(crate) fn check_kind(
        &self,
        cache: DecodeCache,
        queries: DecodeQueries,
        descale: Option<&KvDescale<'_>>,
    ) -> Result<(), Error> {
        let plan = RunKind { cache: self.cache, queries: self.queries, kv: self.config.kv };
        let lens = descale.map(KvDescale::lens);
        check_run_kind(plan, self.shape.heads_kv, (cache, queries), lens.as_ref().map(|l| &l[..]))
    }

    /// Queues the plan's launch for a checked step of `shape` (its cache's
    /// rows as `kv_len`, the plan's `q_len`) with `args` and their `infos`,
    /// and an e4m3 cache's `descale`.
    pub(crate) fn queue<T, C>(
        &self,
        rt: &Runtime,
        (shape, infos, args): (Shape, &[ArgInfo], &[ArgValue<'_>]),
        io: StepIo<'_, T, C>,
        descale: Option<&KvDescale<'_>>,
    ) -> Result<(), Error> {
        debug_assert!(io.kv.cache() == self.cache && io.packed.is_some() == (self.queries == DecodeQueries::Packed));
        // The guards order the launch after pending work on each buffer and
        // record it for later work; they must live until after it.
        let stream = rt.stream().as_ref();
        let StepIo { q, o, lse, kv, packed } = io;
        let (q_ptr, _q) = q.0.device_ptr(stream);
        let (o_ptr, _o) = o.0.device_ptr_mut(stream);
        let lse = lse.map(|l| l.device_ptr_mut(stream));
        let (cu_q, _cu_q) = packed.map(|(cu, _)| cu.device_ptr(stream)).unzip();
        let (lens_ptr, _lens) = kv.kv_lens().device_ptr(stream);
        let (k, v, [k_layout, v_layout]) = match &kv {
            DecodeKv::Dense { k, v, .. } => (k.0, v.0, [k.1, v.1]),
            DecodeKv::Paged(kv) => (kv.k.0, kv.v.0, [kv.k.1.as_layout(), kv.v.1.as_layout()]),
        };
        let (k_ptr, _k) = k.device_ptr(stream);
        let (v_ptr, _v) = v.device_ptr(stream);
        let (paged, _table) = match &kv {
            DecodeKv::Dense { .. } => (None, None),
            DecodeKv::Paged(kv) => {
                let (block_table, guard) = kv.block_table.device_ptr(stream);
                let (pages_per_seq, page_size, num_pages) = (kv.pages_per_seq, kv.k.1.page_size, kv.k.1.num_pages);
                let paged = PagedBindings { kv_lens: lens_ptr, block_table, pages_per_seq, page_size, num_pages };
                (Some(paged), Some(guard))
            }
        };
        let varlen =
            cu_q.zip(packed).map(|(cu, (_, tokens))| VarlenBindings { cu_seqlens: [cu, 0], tokens: [tokens, 0] });

        // The checks put params first: the tensors are the arguments with
        // device pointers, in declaration order.
        let tensors: [_; SPEC_ARGS] = std::array::from_fn(|i| args.get(i).and_then(|a| a.device_ptr(stream)));
        let mut tensor_ptrs = [0u64; SPEC_ARGS];
        let mut count = 0;
        for (ptr, _) in tensors.iter().flatten() {
            tensor_ptrs[count] = *ptr;
            count += 1;
        }
        let workspace = self.split.as_ref().map(|s| (s.parts, s.workspace.device_ptr(stream)));
        let descales = descale.map(|d| d.bind(stream));
        let addresses = RunAddresses {
            operands: [(q_ptr, q.1), (k_ptr, k_layout), (v_ptr, v_layout), (o_ptr, o.1)],
            lse: lse.as_ref().map_or(0, |(ptr, _)| *ptr),
            kv_lens: lens_ptr,
            paged,
            varlen,
            tensors: &tensor_ptrs[..count],
            workspace: workspace.as_ref().map(|(parts, (base, _))| (*parts, *base)),
            descales: descales.as_ref().map(|[k, v]| [k.binding, v.binding]),
        };
        let words = PlanWords { splits: self.splits, scale: self.scale, v_in_k: self.config.v_in_k };
        let bindings = run_bindings(words, shape, infos, &addresses)?;
        self.launch(rt, &bindings)
    }

    fn launch(&self, rt: &Runtime, b: &Bindings) -> Result<(), Error> {
        let kernel = self.decode.kernel();
        let mut values = [Value::I32(0); INLINE_ARGS];
        let count = marshal_into(kernel, b, &mut values)?;
        let launching = |e| Error::driver(format!("launching `{}`", kernel.name), e);
        // Stream waits queued by the guards report failures here.
        rt.context().check_err().map_err(launching)?;
        // SAFETY: `marshal_into` followed the kernel's own argument list, so the
        // values match its parameters in order and type; `check_forward` (or,
        // paged, `check_paged_launch`; packed, `check_varlen_decode` or
        // `check_paged`) proved every element Q, K, V, O and the LSE's
        // layouts address is inside its buffer, `check_launch` that the
        // shape is the plan's (the workspace's and the grid's) and that
        // `kv_lens` (and a block table, and packed queries' prefix sums)
        // holds an entry per sequence; the kernel clamps each length into
        // the cache, each page id into its pages and each sequence's tokens
        // into Q and O and to the plan's q_len; the split workspace and
        // counters are sized for the plan's grid. `marshal_into` wrote at
        // most INLINE_ARGS values.
        unsafe { launch_inline(rt.stream(), self.decode.function(), &values[..count], self.grid) }.map_err(launching)
    }
}

#[cfg(test)]
mod tests {
    use super::SplitParts;

    #[test]
    fn the_split_workspace_parts_start_on_256_byte_boundaries_and_do_not_overlap() {
        for (o, lse, counters) in [(1, 1, 1), (64, 1, 0), (4 * 32 * 128, 4 * 32, 16), (100, 65, 3)] {
            let parts = SplitParts::carve(o, lse, counters);
            let SplitParts { lse_at, counters_at, len } = parts;
            assert!(lse_at >= o && counters_at >= lse_at + lse && len >= counters_at + counters.max(1));
            assert_eq!((lse_at % 64, counters_at % 64), (0, 0), "{o} {lse} {counters}");
            let at = |i: usize| 0x1000 + 4 * i as u64;
            assert_eq!(parts.addresses(0x1000), [at(0), at(lse_at), at(counters_at)]);
        }
    }
}
