//! NVRTC: generated CUDA C++ → CUBIN for one exact GPU architecture.
//!
//! cudarc's safe `compile_ptx` stops at PTX, which the driver would JIT on
//! first load; asking NVRTC for a CUBIN of the device's own `sm_XY` skips
//! that and lets [`compile_cubin`] run (and be tested) without a GPU.

use crate::arch::Arch;
use crate::cuda_libs::ensure_nvrtc;
use crate::error::Error;
use cudarc::nvrtc::result::{self as nvrtc, NvrtcError};
use cudarc::nvrtc::sys;
use flashgen_codegen::abi::Kernel;
use std::ffi::{c_char, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// Environment variable naming a directory that receives `<kernel>.cu` and
/// `<kernel>.log` (the NVRTC log) on every compilation: the source before
/// NVRTC starts, so that a compile that never ends leaves it to read.
pub const DUMP_ENV: &str = "FLASHGEN_DUMP";

/// NVRTC compilations started by this process.
static COMPILES: AtomicU64 = AtomicU64::new(0);

/// How many NVRTC compilations this process has started, so tests can prove
/// a cache served a kernel (no GPU needed).
pub fn compile_count() -> u64 {
    COMPILES.load(Ordering::Relaxed)
}

/// The NVRTC library's version, e.g. `(13, 0)`.
pub fn nvrtc_version() -> Result<(i32, i32), Error> {
    ensure_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(nvrtc_error("querying the NVRTC version"))?;
    Ok((major, minor))
}

/// Compiles `kernel` to a CUBIN for `arch`. Needs libnvrtc, not a GPU.
pub fn compile_cubin(kernel: &Kernel, arch: Arch) -> Result<Vec<u8>, Error> {
    compile_cubin_with_log(kernel, arch).map(|(cubin, _)| cubin)
}

/// [`compile_cubin`], with the compile log of a successful compile: ptxas's
/// notes, e.g. that it serialized a kernel's wgmma pipeline.
pub fn compile_cubin_with_log(kernel: &Kernel, arch: Arch) -> Result<(Vec<u8>, String), Error> {
    compile_with(kernel, arch, &[])
}

/// What ptxas reports of a compiled kernel's resources (`-v`), per thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelResources {
    pub registers: u32,
    /// Bytes of local memory a thread's stack frame takes (spills, and
    /// arrays indexed at run time).
    pub stack_frame: u32,
    /// Bytes spilled to local memory by stores, and read back by loads.
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Compiles `kernel` for `arch` as [`compile_cubin`] does and returns
/// ptxas's report of its registers and spills (no GPU needed): spills in
/// a generated kernel are a defect its tests look for.
pub fn kernel_resources(kernel: &Kernel, arch: Arch) -> Result<KernelResources, Error> {
    let (_, log) = compile_with(kernel, arch, &["--ptxas-options=-v".to_string()])?;
    Ok(resources_in(&log))
}

/// The resources ptxas's `-v` lines in `log` report (the largest of each,
/// should several functions be listed).
fn resources_in(log: &str) -> KernelResources {
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let head = &line[..line.find(unit)?];
        head.rsplit(|c: char| !c.is_ascii_digit()).find(|w| !w.is_empty())?.parse().ok()
    };
    let mut resources = KernelResources::default();
    for line in log.lines().filter(|l| l.trim_start().starts_with("ptxas")) {
        for (unit, field) in [
            (" registers", &mut resources.registers),
            (" bytes stack frame", &mut resources.stack_frame),
            (" bytes spill stores", &mut resources.spill_stores),
            (" bytes spill loads", &mut resources.spill_loads),
        ] {
            if let Some(n) = number_before(line, unit) {
                *field = (*field).max(n);
            }
        }
    }
    resources
}

/// [`compile_cubin_with_log`] with `extra` NVRTC options after the
/// runtime's own: ones that only report (`--time`), never ones that change
/// the code, which the kernel cache would not see.
pub(crate) fn compile_with(kernel: &Kernel, arch: Arch, extra: &[String]) -> Result<(Vec<u8>, String), Error> {
    ensure_nvrtc()?;
    let compile_error = |log: String| Error::Compile {
        kernel: kernel.name.clone(),
        arch,
        log,
        numbered_source: numbered_source(&kernel.source),
    };
    let source = CString::new(kernel.source.as_str())
        .map_err(|e| compile_error(format!("the source contains a NUL byte at offset {}", e.nul_position())))?;
    // The program name is what NVRTC's log prints before line numbers.
    let file_name = CString::new(format!("{}.cu", kernel.name)).ok();
    let program =
        Program(nvrtc::create_program(&source, file_name.as_deref()).map_err(nvrtc_error("creating a program"))?);

    COMPILES.fetch_add(1, Ordering::Relaxed);
    dump(kernel, "cu", &kernel.source)?;
    // SAFETY (all `unsafe` below): `program.0` is live until `program` drops.
    let options: Vec<String> = options(arch).into_iter().chain(extra.iter().cloned()).collect();
    let compiled = unsafe { nvrtc::compile_program(program.0, &options) };
    let log = unsafe { nvrtc::get_program_log(program.0) }.map_err(nvrtc_error("reading the compile log"))?;
    let log = c_chars_to_string(&log);
    dump(kernel, "log", &log)?;
    if let Err(e) = compiled {
        return Err(compile_error(if log.is_empty() { e.to_string() } else { log }));
    }

    let mut size = 0;
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }.result().map_err(nvrtc_error("reading the CUBIN size"))?;
    let mut cubin = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(nvrtc_error("reading the CUBIN"))?;
    Ok((cubin, log))
}

/// NVRTC options for `arch`; part of the kernel cache key. No fast math:
/// the kernels must match the reference to IEEE precision.
pub(crate) fn options(arch: Arch) -> Vec<String> {
    // Hopper's wgmma/TMA instructions exist only in the arch-specific target.
    let suffix = if arch == Arch::new(9, 0) { "a" } else { "" };
    vec![format!("--gpu-architecture={arch}{suffix}"), "-std=c++17".to_string()]
}

/// Destroys the program on every exit path.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed only here. A failure
        // would only leak the program, so it is ignored.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

fn nvrtc_error(during: &'static str) -> impl FnOnce(NvrtcError) -> Error {
    move |source| Error::Nvrtc { during, source }
}

/// NVRTC returns logs as NUL-terminated `char` buffers.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
    String::from_utf8_lossy(&bytes).trim_end().to_string()
}

/// The source with right-aligned 1-based line numbers, to read beside NVRTC's
/// `file.cu(LINE): error` references.
pub(crate) fn numbered_source(source: &str) -> String {
    let width = source.lines().count().max(1).to_string().len();
    source.lines().enumerate().map(|(i, line)| format!("{:>width$} | {line}\n", i + 1)).collect()
}

/// Writes `<kernel>.<extension>` under `$FLASHGEN_DUMP` when it is set.
fn dump(kernel: &Kernel, extension: &str, text: &str) -> Result<(), Error> {
    let Some(dir) = std::env::var_os(DUMP_ENV).filter(|d| !d.is_empty()) else {
        return Ok(());
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).map_err(|source| Error::Dump { path: dir.clone(), source })?;
    let path = dir.join(format!("{}.{extension}", kernel.name));
    std::fs::write(&path, text).map_err(|source| Error::Dump { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_resource_report() {
        let log = "ptxas info    : 98 bytes gmem\n\
                   ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
                   ptxas info    : Function properties for k\n\
                   ptxas         .     64 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info    : Used 255 registers, used 1 barriers, 64 bytes cumulative stack size\n";
        let want = KernelResources { registers: 255, stack_frame: 64, spill_stores: 8, spill_loads: 12 };
        assert_eq!(resources_in(log), want);
        assert_eq!(resources_in("warning: unused\n"), KernelResources::default());
    }

    #[test]
    fn numbers_lines_right_aligned() {
        let source: String = (1..=10).map(|i| format!("line{i}\n")).collect();
        let numbered = numbered_source(&source);
        assert!(numbered.starts_with(" 1 | line1\n 2 | line2\n"), "{numbered}");
        assert!(numbered.ends_with("10 | line10\n"), "{numbered}");
    }

    #[test]
    fn hopper_gets_the_arch_specific_target() {
        assert_eq!(options(Arch::new(9, 0))[0], "--gpu-architecture=sm_90a");
        assert_eq!(options(Arch::new(8, 0))[0], "--gpu-architecture=sm_80");
        assert!(!options(Arch::new(8, 0)).iter().any(|o| o.contains("fast-math") || o.contains("fast_math")));
    }
}
