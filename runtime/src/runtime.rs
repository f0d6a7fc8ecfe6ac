//! One GPU: its context, a stream, and the kernels compiled for it. Runtimes
//! on other streams of the same device ([`Runtime::on_stream`]) share its
//! kernels; each has its own stream and work counter.
//!
//! A kernel is looked up in memory, then in the disk cache, and only then
//! compiled with NVRTC (and stored on disk), once per key however many
//! threads ask for it at the same time. The kernels one launch needs, and
//! those [`Runtime::prepare`] names, are compiled at the same time, one per
//! core: NVRTC compiles on several threads at once, and a kernel's compile
//! (about a second on a host CPU) is NVVM's and ptxas's work on one function.

use crate::arch::Arch;
use crate::bounded_columns::BoundedSpecs;
use crate::choices::Choices;
use crate::cuda_libs::{check_nvrtc_fits, driver_present, driver_version, ensure_nvrtc};
use crate::disk_cache::{load_or_compile, DiskCache};
use crate::error::Error;
use crate::kernels::{KernelSet, LoadedKernel, Which};
use crate::nvrtc::nvrtc_version;
use crate::single_flight::SingleFlight;
use crate::spec_key::{Keyed, SpecKey};
use crate::tile_choice::KeyClass;
use crate::tma::{tma_from, TMA_ENV};
use crate::tuning::{autotune_from, AUTOTUNE_ENV};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use flashgen_codegen::abi::Kernel;
use flashgen_codegen::cuda::{BackwardTile, Target, TileConfig, TileCopy};
use flashgen_codegen::parallel;
use flashgen_codegen::Spec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A CUDA device ready to run flashgen kernels. Launches are asynchronous on
/// [`Runtime::stream`] (flashgen's own, or a caller's: [`Runtime::from_stream`],
/// [`Runtime::on_stream`]) and ordered with the caller's work on it; no call
/// synchronizes the stream unless it documents so. Kernels are compiled on
/// first use and cached in memory, per device, and in the disk cache
/// ([`DiskCache::from_env`]).
pub struct Runtime {
    device: Arc<Device>,
    stream: Arc<CudaStream>,
    pub(crate) disk: Option<DiskCache>,
    /// Tile configurations per spec and shape class (see `crate::autotune`).
    pub(crate) choices: Arc<Choices>,
    /// The backward's dK/dV tiles per spec and shape class (see
    /// `crate::autotune_backward`).
    pub(crate) backward_choices: Arc<Choices<BackwardTile>>,
    /// Ragged forwards' configurations per spec and whether the longest
    /// sequence is long (see `Runtime::ragged_config`).
    pub(crate) ragged_choices: Arc<Choices<TileConfig, KeyClass>>,
    /// Specs whose global columns a forward launch's param bounds (see
    /// `crate::bounded_columns`).
    pub(crate) bounded: Arc<BoundedSpecs>,
    /// Whether a forward or dense backward launch of an untuned shape class
    /// tunes first.
    pub(crate) autotune_launches: bool,
    /// Whether the Hopper kernels copy with TMA where the layout allows
    /// (`FLASHGEN_TMA`, on unless `0`): see [`Runtime::with_tma`].
    pub(crate) tma: bool,
    /// The work counter of persistent forward kernels, one per stream; see
    /// [`Runtime::work_counter`].
    work_counter: CudaSlice<u64>,
}

/// What the runtimes of one device share, whatever their streams: the
/// context, the device's facts and the kernels loaded on it.
struct Device {
    ctx: Arc<CudaContext>,
    arch: Arch,
    name: String,
    sm_count: u32,
    kernels: SingleFlight<CacheKey, Arc<LoadedKernel>>,
    memory_hits: AtomicU64,
    disk_hits: AtomicU64,
    compiles: AtomicU64,
}

/// How this runtime's kernel loads were served, so tests and timings can
/// tell a compile from a cache hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub memory_hits: u64,
    pub disk_hits: u64,
    /// NVRTC compiles.
    pub compiles: u64,
}

/// What selects a kernel within one runtime, without generating it: the
/// spec and `Which`, found by a borrowed spec ([`SpecKey`]). The arch,
/// NVRTC options and codegen version are fixed for a runtime, so they
/// belong only to the disk cache's key.
type CacheKey = SpecKey<Which>;

impl Runtime {
    /// Opens GPU `ordinal` with a fresh stream.
    pub fn new(ordinal: usize) -> Result<Runtime, Error> {
        let ctx = Device::context(ordinal)?;
        let stream =
            ctx.new_stream().map_err(|e| Error::driver(format!("creating a stream on device {ordinal}"), e))?;
        Runtime::with_device(Arc::new(Device::open(ctx)?), stream)
    }

    /// A runtime that queues every launch on the caller's `stream` (and
    /// uses its context), in order with the caller's own work there: no
    /// copies between streams, no hidden synchronization.
    pub fn from_stream(stream: Arc<CudaStream>) -> Result<Runtime, Error> {
        Device::check_libraries()?;
        let device = Device::open(stream.context().clone())?;
        Runtime::with_device(Arc::new(device), stream)
    }

    /// This runtime on another `stream` of the same device: the compiled
    /// kernels, the disk cache and the tuning choices are shared; launches
    /// go to `stream`, with a work counter of their own. A stream of another
    /// device is an error.
    pub fn on_stream(&self, stream: Arc<CudaStream>) -> Result<Runtime, Error> {
        let (ordinal, expected) = (stream.context().ordinal(), self.device.ctx.ordinal());
        if ordinal != expected {
            return Err(Error::StreamDevice { stream: ordinal, runtime: expected });
        }
        let work_counter = Device::work_counter(&stream)?;
        Ok(Runtime {
            device: self.device.clone(),
            stream,
            disk: self.disk.clone(),
            choices: self.choices.clone(),
            backward_choices: self.backward_choices.clone(),
            ragged_choices: self.ragged_choices.clone(),
            bounded: self.bounded.clone(),
            autotune_launches: self.autotune_launches,
            tma: self.tma,
            work_counter,
        })
    }

    fn with_device(device: Arc<Device>, stream: Arc<CudaStream>) -> Result<Runtime, Error> {
        let work_counter = Device::work_counter(&stream)?;
        Ok(Runtime {
            device,
            stream,
            disk: DiskCache::from_env(),
            choices: Arc::default(),
            backward_choices: Arc::default(),
            ragged_choices: Arc::default(),
            bounded: Arc::default(),
            autotune_launches: autotune_from(std::env::var_os(AUTOTUNE_ENV)),
            tma: tma_from(std::env::var_os(TMA_ENV)),
            work_counter,
        })
    }

    /// This runtime with `cache` (or none) for kernels and tuning records
    /// instead of the one the environment names ([`DiskCache::from_env`]).
    pub fn with_disk_cache(self, cache: Option<DiskCache>) -> Runtime {
        Runtime { disk: cache, ..self }
    }

    /// This runtime with autotuning on forward and dense backward launches
    /// on or off (default: on iff `FLASHGEN_AUTOTUNE=1`): see
    /// [`Runtime::forward`] and [`Runtime::backward`].
    pub fn with_autotune(self, on: bool) -> Runtime {
        Runtime { autotune_launches: on, ..self }
    }

    /// The same runtime with the Hopper kernels' TMA copies (the persistent
    /// forward, the backward's dK/dV kernel) on or off (off: every producer
    /// thread copies with cp.async, as on layouts TMA cannot address).
    pub fn with_tma(self, on: bool) -> Runtime {
        Runtime { tma: on, ..self }
    }

    pub fn arch(&self) -> Arch {
        self.device.arch
    }

    /// The persistent kernels' work counter: claims and CTAs done claiming,
    /// zero from the start. A launch leaves it zero (its last CTA done
    /// claiming resets it), and launches on the stream run in order, so each
    /// finds it zero.
    pub(crate) fn work_counter(&self) -> &CudaSlice<u64> {
        &self.work_counter
    }

    /// Streaming multiprocessors: what a launch's grid fills in waves.
    pub fn sm_count(&self) -> u32 {
        self.device.sm_count
    }

    pub fn device_name(&self) -> String {
        self.device.name.clone()
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.device.ctx
    }

    /// The stream every launch is queued on; allocate and copy on it too.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// How the device's kernel loads were served, over every stream's
    /// runtime.
    pub fn cache_stats(&self) -> CacheStats {
        let d = &self.device;
        CacheStats {
            memory_hits: d.memory_hits.load(Ordering::Relaxed),
            disk_hits: d.disk_hits.load(Ordering::Relaxed),
            compiles: d.compiles.load(Ordering::Relaxed),
        }
    }

    /// What this device's kernels may use beyond sm_80.
    pub fn target(&self) -> Target {
        self.device.arch.target()
    }

    /// The forward kernel of `spec` in its configuration without tuning for
    /// keys of unknown length ([`tile_choice::preferred`](crate::tile_choice::preferred); untuned launches
    /// of long keys may use [`tile_choice::preferred_for`](crate::tile_choice::preferred_for)'s): generated,
    /// compiled and loaded on first use, then served from the cache.
    pub fn load(&self, spec: &Spec) -> Result<Arc<LoadedKernel>, Error> {
        self.load_forward(spec, crate::tile_choice::preferred(spec, self.target()))
    }

    /// The forward kernel of `spec` in tile configuration `config` (copying
    /// with TMA where it is warp-specialized, as launches on operands TMA
    /// can address do).
    pub fn load_forward(&self, spec: &Spec, config: TileConfig) -> Result<Arc<LoadedKernel>, Error> {
        self.load_which(spec, Which::forward(config, TileCopy::Tma))
    }

    /// The forward kernels of `spec` in `configs`, in that order, loaded
    /// like [`Runtime::load_forward`] but compiled in parallel over the
    /// CPU's cores, where one after another they would take seconds each.
    pub fn load_forwards(&self, spec: &Spec, configs: &[TileConfig]) -> Vec<Result<Arc<LoadedKernel>, Error>> {
        let which: Vec<_> = configs.iter().map(|&config| Which::forward(config, TileCopy::Tma)).collect();
        self.load_all(spec, &which)
    }

    /// The kernels `which` of `spec`, in that order: those in memory at
    /// once, the others compiled (or read from disk) in parallel.
    pub(crate) fn load_all(&self, spec: &Spec, which: &[Which]) -> Vec<Result<Arc<LoadedKernel>, Error>> {
        let kernels: Vec<(&Spec, Which)> = which.iter().map(|&which| (spec, which)).collect();
        self.load_kernels(&kernels)
    }

    /// [`Runtime::load_all`] over kernels of several specs.
    fn load_kernels(&self, kernels: &[(&Spec, Which)]) -> Vec<Result<Arc<LoadedKernel>, Error>> {
        let mut loads: Vec<_> = kernels.iter().map(|&(spec, which)| self.in_memory(spec, which).map(Ok)).collect();
        let missing: Vec<usize> = (0..kernels.len()).filter(|&i| loads[i].is_none()).collect();
        let loaded = parallel::map(&missing, |&i| self.load_which(kernels[i].0, kernels[i].1));
        for (i, load) in missing.into_iter().zip(loaded) {
            loads[i] = Some(load);
        }
        loads.into_iter().flatten().collect()
    }

    /// The kernels `which` of one launch, and `next`, a kernel it may load
    /// after them (a block mask's work order), compiled together: a cold
    /// launch waits for its slowest compile, not for each in turn. `next`'s
    /// error, if any, is its own load's to report (errors are not cached).
    /// A warm launch, every kernel loaded, allocates nothing here.
    pub(crate) fn load_launch<const N: usize>(
        &self,
        spec: &Spec,
        which: [Which; N],
        next: Option<Which>,
    ) -> [Result<Arc<LoadedKernel>, Error>; N] {
        let loaded = |which| self.device.kernels.get(&(spec, which) as &dyn Keyed<Which>);
        let warm = which.map(|which| (which, loaded(which)));
        if next.is_none_or(|next| loaded(next).is_some()) && warm.iter().all(|(_, kernel)| kernel.is_some()) {
            let hits = N as u64 + u64::from(next.is_some());
            self.device.memory_hits.fetch_add(hits, Ordering::Relaxed);
            // All found; the fallback only keeps this total.
            return warm.map(|(which, kernel)| kernel.map_or_else(|| self.load_which(spec, which), Ok));
        }
        let all: Vec<Which> = which.iter().copied().chain(next).collect();
        let mut loads = self.load_all(spec, &all).into_iter();
        // `load_all` answers every kernel in order; the fallback only keeps this total.
        which.map(|which| loads.next().unwrap_or_else(|| self.load_which(spec, which)))
    }

    /// Compiles and loads the kernels `set` names for `spec` (those
    /// `flashgen precompile` stores; with, where a launch's param may bound
    /// the mask's global columns, the bounded forms' forwards: see
    /// [`Runtime::forward`]) all at once, over the CPU's cores, so
    /// that the launches that need them find them in memory: a training
    /// run that calls this before its first step waits about as long as
    /// its slowest kernel takes, not for each kernel at its first use.
    /// Runs on the calling thread; call it from one of your own to overlap
    /// the compiles with other start-up work. The first failure, in the
    /// set's order, is returned; the other kernels are loaded regardless.
    pub fn prepare(&self, spec: &Spec, set: KernelSet) -> Result<(), Error> {
        let specs = Which::launch_kernels(spec, set, self.target());
        let kernels: Vec<(&Spec, Which)> =
            specs.iter().flat_map(|(spec, which)| which.iter().map(move |&which| (&**spec, which))).collect();
        self.load_kernels(&kernels).into_iter().try_for_each(|load| load.map(drop))
    }

    /// The kernel `which` of `spec` if it is loaded already (not waiting for
    /// one being compiled), counted as a memory hit.
    fn in_memory(&self, spec: &Spec, which: Which) -> Option<Arc<LoadedKernel>> {
        let loaded = self.device.kernels.get(&(spec, which) as &dyn Keyed<Which>)?;
        self.device.memory_hits.fetch_add(1, Ordering::Relaxed);
        Some(loaded)
    }

    /// The kernel `which` of `spec`: found in memory by the borrowed spec,
    /// else (the spec copied into its key) loaded or compiled once, however
    /// many threads ask.
    pub(crate) fn load_which(&self, spec: &Spec, which: Which) -> Result<Arc<LoadedKernel>, Error> {
        if Which::wide_heads(spec) && !matches!(which, Which::Decode(..)) {
            let (qk, v, max) = (spec.head_dims.qk, spec.head_dims.v, flashgen_codegen::MAX_HEAD_DIM);
            return Err(Error::WideHeadDims { spec: spec.name.clone(), kernel: which.family(), qk, v, max });
        }
        if let Some(loaded) = self.in_memory(spec, which) {
            return Ok(loaded);
        }
        let (loaded, hit) = self.device.kernels.get_or_try_init(CacheKey::new(spec, which), || {
            let kernel = which.emit(spec).ok_or_else(|| Error::NoMask { spec: spec.name.clone() })?;
            self.compile_and_load(kernel).map(Arc::new)
        })?;
        if hit {
            self.device.memory_hits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(loaded)
    }

    fn compile_and_load(&self, kernel: Kernel) -> Result<LoadedKernel, Error> {
        let during = |what: &str| format!("{what} `{}`", kernel.name);
        let ctx = &self.device.ctx;
        let available = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| Error::driver("reading the shared memory limit", e))?;
        let available = u32::try_from(available).unwrap_or(0);
        if kernel.dynamic_smem > available {
            return Err(Error::SharedMemory { kernel: kernel.name, needed: kernel.dynamic_smem, available });
        }
        let (cubin, from_disk) = load_or_compile(self.disk.as_ref(), &kernel, self.device.arch)?;
        let counter = if from_disk { &self.device.disk_hits } else { &self.device.compiles };
        counter.fetch_add(1, Ordering::Relaxed);
        // Loads run on any thread (see `load_forwards`): bind the context for
        // the driver calls below, as cudarc's `load_function` and
        // `set_attribute` do not.
        ctx.bind_to_thread().map_err(|e| Error::driver("binding the context to a loading thread", e))?;
        let module =
            ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| Error::driver(during("loading the CUBIN of"), e))?;
        let function = module.load_function(&kernel.name).map_err(|e| Error::driver(during("finding"), e))?;
        // The limit covers the kernel's static shared memory too (barriers,
        // staged block-mask classes), which only the CUBIN knows.
        let fixed = function
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(|e| Error::driver(during("reading the static shared memory of"), e))?;
        let needed = kernel.dynamic_smem + u32::try_from(fixed).unwrap_or(0);
        if needed > available {
            return Err(Error::SharedMemory { kernel: kernel.name, needed, available });
        }
        // Dynamic shared memory beyond 48 KiB must be opted into per function.
        function
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernel.dynamic_smem as i32,
            )
            .map_err(|e| Error::driver(during("raising the shared memory limit of"), e))?;
        Ok(LoadedKernel::new(kernel, function))
    }
}

impl Device {
    /// The driver and NVRTC are there: cudarc panics on first use of a
    /// missing library, so this runs first; NVRTC too, so a runtime that
    /// opens can always compile.
    fn check_libraries() -> Result<(), Error> {
        if !driver_present() {
            return Err(Error::DriverMissing);
        }
        ensure_nvrtc()
    }

    /// The context of GPU `ordinal`, after checking the libraries and that
    /// the GPU exists.
    fn context(ordinal: usize) -> Result<Arc<CudaContext>, Error> {
        Device::check_libraries()?;
        let count = match CudaContext::device_count() {
            Ok(n) => usize::try_from(n).unwrap_or(0),
            Err(e) if e.0 == CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => return Err(Error::driver("initializing the CUDA driver", e)),
        };
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        CudaContext::new(ordinal).map_err(|e| Error::driver(format!("creating a context on device {ordinal}"), e))
    }

    /// The device of `ctx`, refused where it is older than the kernels
    /// support.
    fn open(ctx: Arc<CudaContext>) -> Result<Device, Error> {
        let ordinal = ctx.ordinal();
        let on_device = |what: &str| format!("{what} on device {ordinal}");
        let (major, minor) =
            ctx.compute_capability().map_err(|e| Error::driver(on_device("reading the compute capability"), e))?;
        let arch = Arch::new(major as u32, minor as u32);
        let name = ctx.name().map_err(|e| Error::driver(on_device("reading the name"), e))?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| Error::driver(on_device("reading the SM count"), e))?;
        if arch < Arch::MIN {
            return Err(Error::UnsupportedArch { arch, device: name });
        }
        check_nvrtc_fits(nvrtc_version()?, driver_version()?)?;
        Ok(Device {
            ctx,
            arch,
            name,
            sm_count: u32::try_from(sm_count).unwrap_or(1),
            kernels: SingleFlight::default(),
            memory_hits: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            compiles: AtomicU64::new(0),
        })
    }

    /// A zeroed work counter for the persistent kernels launched on `stream`.
    fn work_counter(stream: &Arc<CudaStream>) -> Result<CudaSlice<u64>, Error> {
        stream.alloc_zeros::<u64>(2).map_err(|e| Error::driver("allocating the work counter", e))
    }
}
