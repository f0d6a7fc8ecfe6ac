//! The JIT's costs per example spec. `flashgen-bench --jit` ([`run_gpu`])
//! on a GPU: the cold compile, a training step's kernels at once, a disk
//! hit and a warm launch's host time. `flashgen-bench --jit-cpu [--arch
//! sm_90]` ([`run`]): cold NVRTC compiles, no GPU needed. Per spec: the forward the runtime launches
//! untuned (the kernel `--jit` times on a GPU), then every kernel of a
//! training step (`KernelSet::Training`: forward, block mask, work orders,
//! backward) compiled one after another, as first launches used to compile
//! them, and all at once, as `Runtime::prepare` and a launch's own kernels
//! now compile (`DiskCache::precompile` into an empty folder: the same
//! threads, compiles and stores). NVRTC's own cache is off. Times depend on
//! the CPU: compare runs on one machine. The forward compiles once more with
//! NVRTC's `--time` for its phases (front end, NVVM optimizer, ptxas):
//! each has its own levers.

use crate::examples::SPECS;
use crate::verify::{self, DeviceProblem, OperandLayout};
use flashgen::codegen::cuda::emit_forward_with;
use flashgen::codegen::reference::ParamValue;
use flashgen::codegen::Shape;
use flashgen::runtime::{
    compile_cubin, compile_phases, spec_kernels, tile_choice, Arch, CompilePhases, DiskCache, Error, KernelSet,
};
use flashgen::{Runtime, Spec};
use std::time::Instant;

/// One spec's compile times, in ms.
struct SpecTimes {
    forward: f64,
    phases: Option<CompilePhases>,
    kernels: usize,
    slowest: f64,
    one_by_one: f64,
    together: f64,
}

/// Times every example spec for `arch` and prints a table and its medians
/// and maxima.
pub fn run(arch: Arch) -> Result<(), Error> {
    // Before NVRTC loads: its compute cache would answer repeated sources.
    std::env::set_var("CUDA_CACHE_DISABLE", "1");
    let specs: Vec<Spec> = SPECS.iter().filter_map(|(_, s)| flashgen::parse_one(s).ok()).collect();
    let forward = |spec: &Spec| emit_forward_with(spec, tile_choice::preferred(spec, arch.target()));
    // Load NVRTC and its builtins once, unmeasured, as a warm process would.
    if let Some(first) = specs.first() {
        compile_cubin(&forward(first), arch)?;
    }
    println!(
        "cold NVRTC compiles for {arch}, {} threads; ms",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:<20} {:>8} {:>20} {:>8} {:>8} {:>11} {:>9}",
        "spec", "forward", "front/NVVM/ptxas", "kernels", "slowest", "one by one", "together"
    );
    let mut rows = Vec::new();
    for spec in &specs {
        let row = time_spec(spec, arch, &forward(spec))?;
        let phases = row
            .phases
            .map_or("-".to_string(), |p| format!("{:.0}/{:.0}/{:.0}", p.front_end_ms, p.optimizer_ms, p.ptxas_ms));
        println!(
            "{:<20} {:>8.0} {phases:>20} {:>8} {:>8.0} {:>11.0} {:>9.0}",
            spec.name, row.forward, row.kernels, row.slowest, row.one_by_one, row.together
        );
        rows.push(row);
    }
    let summary = |what: &str, ms: Vec<f64>| {
        let (median, max) = median_max(ms);
        println!("{what}: median {median:.0} ms, max {max:.0} ms");
    };
    summary("forward (cold)", rows.iter().map(|r| r.forward).collect());
    let phases: Vec<CompilePhases> = rows.iter().filter_map(|r| r.phases).collect();
    summary("  its front end", phases.iter().map(|p| p.front_end_ms).collect());
    summary("  its NVVM optimizer", phases.iter().map(|p| p.optimizer_ms).collect());
    summary("  its ptxas", phases.iter().map(|p| p.ptxas_ms).collect());
    summary("training kernels one by one", rows.iter().map(|r| r.one_by_one).collect());
    summary("training kernels together", rows.iter().map(|r| r.together).collect());
    Ok(())
}

/// `forward` alone, the training set's other kernels one by one, then the
/// whole set at once.
fn time_spec(spec: &Spec, arch: Arch, forward: &flashgen::codegen::abi::Kernel) -> Result<SpecTimes, Error> {
    let timed = |kernel| {
        let start = Instant::now();
        compile_cubin(kernel, arch).map(|_| ms_since(start))
    };
    let forward_ms = timed(forward)?;
    let phases = compile_phases(forward, arch)?;
    let kernels = spec_kernels(spec, KernelSet::Training, arch);
    let (mut one_by_one, mut slowest) = (forward_ms, forward_ms);
    for kernel in kernels.iter().filter(|k| k.source != forward.source) {
        let ms = timed(kernel)?;
        one_by_one += ms;
        slowest = slowest.max(ms);
    }
    let dir = std::env::temp_dir().join(format!("flashgen-jit-cpu-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let start = Instant::now();
    let report = DiskCache::at(&dir).precompile(std::slice::from_ref(spec), &[arch], KernelSet::Training, &|_, _| {});
    let together = ms_since(start);
    let _ = std::fs::remove_dir_all(&dir);
    report?;
    Ok(SpecTimes { forward: forward_ms, phases, kernels: kernels.len(), slowest, one_by_one, together })
}

/// `--jit`: JIT costs per example spec on `rt`'s GPU (see the bench's
/// module note), then a summary. NVRTC's own cache must be off.
pub fn run_gpu(rt: &Runtime) {
    let specs: Vec<flashgen::Spec> =
        SPECS.iter().map(|(_, s)| flashgen::parse_one(s).expect("valid example")).collect();
    // The kernel the runtime launches untuned on this GPU.
    let emit = |spec: &flashgen::Spec| {
        flashgen::codegen::cuda::emit_forward_with(spec, tile_choice::preferred(spec, rt.target()))
    };
    // Load NVRTC and its builtins once, unmeasured, as a warm process would.
    let _ = compile_cubin(&emit(&specs[0]), rt.arch());
    println!("device: {} ({}); JIT per example spec", rt.device_name(), rt.arch());
    println!("{:<20} {:>12} {:>12} {:>14} {:>16}", "spec", "cold ms", "training ms", "disk hit ms", "launch µs (host)");
    let (mut cold, mut training, mut disk, mut launch) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for spec in &specs {
        let start = Instant::now();
        let compiled = compile_cubin(&emit(spec), rt.arch());
        let cold_ms = ms_since(start);
        // Every training kernel, all at once, in a fresh runtime without a disk cache.
        let prepared = Runtime::new(0).and_then(|fresh| {
            let start = Instant::now();
            fresh.with_disk_cache(None).prepare(spec, KernelSet::Training)?;
            Ok(ms_since(start))
        });
        // Fill the disk cache with one runtime, then time a hit in a fresh one.
        let hit = rt.load(spec).and_then(|_| {
            let fresh = Runtime::new(0)?;
            let start = Instant::now();
            fresh.load(spec)?;
            let ms = ms_since(start);
            assert_eq!(fresh.cache_stats().compiles, 0, "a disk hit must not compile");
            Ok(ms)
        });
        let host_us = launch_overhead(rt, spec);
        match (compiled.and(prepared), hit, host_us) {
            (Ok(training_ms), Ok(hit_ms), Ok(us)) => {
                println!("{:<20} {cold_ms:>12.1} {training_ms:>12.0} {hit_ms:>14.2} {us:>16.2}", spec.name);
                cold.push(cold_ms);
                training.push(training_ms);
                disk.push(hit_ms);
                launch.push(us);
            }
            (c, h, l) => println!("{:<20} error: {:?} {:?} {:?}", spec.name, c.err(), h.err(), l.err()),
        }
    }
    if !cold.is_empty() {
        let [(cold, cold_max), (training, training_max), (disk, _), (launch, _)] =
            [cold, training, disk, launch].map(median_max);
        println!(
            "cold compile median {cold:.0} ms, max {cold_max:.0} ms; training kernels all at once median \
             {training:.0} ms, max {training_max:.0} ms; disk hit median {disk:.1} ms; launch median {launch:.1} µs"
        );
    }
}

/// Host microseconds per `forward` on an in-memory hit (checks, marshalling
/// and the driver's launch call), averaged over 500 launches of a tiny
/// problem so the GPU never holds the host back for long.
fn launch_overhead(rt: &Runtime, spec: &flashgen::Spec) -> Result<f64, flashgen::Error> {
    let shape = Shape { batch: 1, heads: 2, heads_kv: 2, q_len: 16, kv_len: 16 };
    let params = spec
        .params
        .iter()
        .map(|p| match p.ty {
            flashgen::codegen::Ty::I32 => ParamValue::I32(8),
            _ => ParamValue::F32(30.0),
        })
        .collect();
    let problem = verify::random_problem(spec, shape, params, vec![], None, 1);
    let mut gpu = DeviceProblem::upload(rt, spec, &problem, OperandLayout::Bshd)?;
    gpu.launch(rt, spec, &problem)?;
    let sync = || rt.stream().synchronize().map_err(|e| flashgen::Error::driver("sync", e));
    sync()?;
    let n = 500;
    let start = Instant::now();
    for _ in 0..n {
        gpu.launch(rt, spec, &problem)?;
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    sync()?;
    Ok(us)
}

fn ms_since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// The median (upper of the middle two) and maximum; zeros for none.
fn median_max(mut ms: Vec<f64>) -> (f64, f64) {
    ms.sort_by(f64::total_cmp);
    (ms.get(ms.len() / 2).copied().unwrap_or(0.0), ms.last().copied().unwrap_or(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_max() {
        assert_eq!(median_max(vec![3.0, 1.0, 2.0]), (2.0, 3.0));
        assert_eq!(median_max(vec![4.0, 1.0, 3.0, 2.0]), (3.0, 4.0));
        assert_eq!(median_max(vec![]), (0.0, 0.0));
    }
}
