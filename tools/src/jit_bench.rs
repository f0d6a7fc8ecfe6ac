//! `flashgen-bench --jit-cpu [--arch sm_90]`: cold NVRTC compiles per
//! example spec, no GPU needed. Per spec: the forward the runtime launches
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
use flashgen::codegen::cuda::emit_forward_with;
use flashgen::runtime::{
    compile_cubin, compile_phases, spec_kernels, tile_choice, Arch, CompilePhases, DiskCache, Error, KernelSet,
};
use flashgen::Spec;
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
