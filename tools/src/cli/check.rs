//! `flashgen check`: compile a file's specs with NVRTC, no GPU needed — the
//! forward kernel the runtime launches untuned, or with `--all` every kernel
//! a launch of the spec may use (every tile configuration, copy mode,
//! varlen, paged, append, block mask, work orders, backward, decode,
//! partials), compiled in parallel.

use crate::specs;
use crate::Failure;
use flashgen::codegen::abi::Kernel;
use flashgen::codegen::cuda;
use flashgen::codegen::index_check::index_warnings;
use flashgen::runtime::{compile_cubin, nvrtc_version, spec_kernels, tile_choice, Arch, KernelSet};
use flashgen::Spec;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

pub fn run(file: &Path, arch: &str, only: Option<&str>, all: bool) -> Result<bool, Failure> {
    let arch = specs::arch(arch)?;
    let (major, minor) = nvrtc_version().map_err(|e| e.to_string())?;
    for spec in specs::load(file, only)? {
        for warning in index_warnings(&spec) {
            eprintln!("warning: {}: {warning}", spec.name);
        }
        // A spec past the forward's head dims (MLA's 576) has its decode kernels alone.
        let wide = spec.head_dims.qk.max(spec.head_dims.v) > flashgen::codegen::MAX_HEAD_DIM;
        let kernels = match all || wide {
            true => spec_kernels(&spec, KernelSet::Every, arch),
            false => vec![cuda::emit_forward_with(&spec, tile_choice::preferred(&spec, arch.target()))],
        };
        let start = Instant::now();
        let bytes = compile_all(&spec, &kernels, arch)?;
        let what = match kernels.as_slice() {
            [one] => one.name.clone(),
            _ => format!("{} kernels", kernels.len()),
        };
        println!(
            "{}: compiled {what} for {arch} with NVRTC {major}.{minor} in {:.0} ms ({bytes} bytes of CUBIN)",
            spec.name,
            start.elapsed().as_secs_f64() * 1e3,
        );
    }
    Ok(true)
}

/// Compiles `kernels` on every core; the CUBINs' total size, or the first
/// failure (in kernel order) with NVRTC's log.
fn compile_all(spec: &Spec, kernels: &[Kernel], arch: Arch) -> Result<usize, Failure> {
    let next = AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(kernels.len());
    let mut results: Vec<(usize, Result<usize, flashgen::Error>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(kernel) = kernels.get(i) else { return done };
                        done.push((i, compile_cubin(kernel, arch).map(|cubin| cubin.len())));
                    }
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("a compile thread panicked")).collect()
    });
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().try_fold(0, |total, (_, result)| {
        result.map(|bytes| total + bytes).map_err(|e| Failure::from(specs::compile_error(spec, e)))
    })
}
