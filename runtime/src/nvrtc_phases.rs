//! Where one NVRTC compile spends its time, by NVRTC's own `--time` report:
//! the C++ front end, the NVVM optimizer (LLVM, down to PTX) and PTX → SASS
//! (ptxas). Cold JIT work (`flashgen-bench --jit-cpu`) starts from these:
//! each phase has other levers.

use crate::arch::Arch;
use crate::error::Error;
use crate::nvrtc::compile_with;
use flashgen_codegen::abi::Kernel;
use std::sync::atomic::{AtomicU64, Ordering};

/// One compile's phase times, in ms, as NVRTC reports them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompilePhases {
    pub front_end_ms: f64,
    pub optimizer_ms: f64,
    pub ptxas_ms: f64,
}

/// Compiles `kernel` for `arch` as [`crate::compile_cubin`] does, with
/// `--time`, and returns NVRTC's time per phase; `None` where NVRTC wrote
/// no readable report.
pub fn compile_phases(kernel: &Kernel, arch: Arch) -> Result<Option<CompilePhases>, Error> {
    static REPORTS: AtomicU64 = AtomicU64::new(0);
    let n = REPORTS.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("flashgen-nvrtc-time-{}-{n}.csv", std::process::id()));
    let compiled = compile_with(kernel, arch, &[format!("--time={}", path.display())]);
    let report = std::fs::read_to_string(&path);
    let _ = std::fs::remove_file(&path);
    compiled?;
    Ok(report.ok().as_deref().and_then(parse))
}

/// Reads lines such as `k.cu, NVVM Optimizer, 317, ms`; phases NVRTC did
/// not run (none, for a CUBIN) read as missing.
fn parse(csv: &str) -> Option<CompilePhases> {
    let ms = |phase: &str| {
        csv.lines().find_map(|line| {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            match fields[..] {
                [_, name, value, "ms"] if name == phase => value.parse::<f64>().ok(),
                _ => None,
            }
        })
    };
    Some(CompilePhases {
        front_end_ms: ms("CUDA C++ Frontend")?,
        optimizer_ms: ms("NVVM Optimizer")?,
        ptxas_ms: ms("PTX Translation")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_nvrtcs_report() {
        let csv = "File name, phase name, metric, unit\n\
                   k.cu, CUDA C++ Frontend, 35, ms\n\
                   k.cu, NVVM Optimizer, 397, ms\n\
                   k.cu, PTX Translation, 661, ms\n";
        let phases = CompilePhases { front_end_ms: 35.0, optimizer_ms: 397.0, ptxas_ms: 661.0 };
        assert_eq!(parse(csv), Some(phases));
        assert_eq!(parse("File name, phase name, metric, unit\nk.cu, CUDA C++ Frontend, 35, ms\n"), None);
    }
}
