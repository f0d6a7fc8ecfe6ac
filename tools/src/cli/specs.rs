//! What the command line names: specs in `.attn` files, GPU architectures
//! and tile configurations, each checked before any work starts.

use crate::Failure;
use flashgen::codegen::cuda::TileConfig;
use flashgen::codegen::Spec;
use flashgen::runtime::tile_choice;
use flashgen::runtime::{config_name, Arch, Error};
use std::path::Path;

/// The architectures named when one is refused: every kernel runs on sm_80
/// and newer (sm_90 gets the Hopper `wgmma` kernels).
const SUPPORTED_ARCHES: &str =
    "sm_80, sm_86, sm_87, sm_89, sm_90 (Hopper wgmma kernels) and newer, e.g. sm_100, sm_120";

/// Parses `--arch`, refusing architectures older than the kernels support
/// before NVRTC is asked to compile for them.
pub fn arch(text: &str) -> Result<Arch, String> {
    let arch: Arch = text.parse().map_err(|e| format!("{e}"))?;
    if arch < Arch::MIN {
        return Err(format!(
            "{arch} is not supported: flashgen kernels need {} or newer ({SUPPORTED_ARCHES})",
            Arch::MIN
        ));
    }
    Ok(arch)
}

/// A failed compile of `spec`, with NVRTC's log and the numbered
/// source; only the log's first line when NVRTC does not know the arch (the
/// source is not at fault).
pub fn compile_error(spec: &Spec, error: Error) -> String {
    format!("{}: {}", spec.name, arch_error(&error).unwrap_or_else(|| error.to_string()))
}

/// NVRTC's refusal of the arch itself, in one line; `None` for other errors.
pub fn arch_error(error: &Error) -> Option<String> {
    match error {
        Error::Compile { log, arch, .. } if log.contains("--gpu-architecture") => {
            let reason = log.lines().next().unwrap_or_default();
            Some(format!("this NVRTC cannot compile for {arch} ({reason}); flashgen supports {SUPPORTED_ARCHES}"))
        }
        _ => None,
    }
}

/// Every spec of `file`, or only the one named `only`.
pub fn load(file: &Path, only: Option<&str>) -> Result<Vec<Spec>, Failure> {
    let source = std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let specs =
        flashgen::parse_str(&source).map_err(|e| Failure::Rendered(e.render(&file.display().to_string(), &source)))?;
    let Some(name) = only else { return Ok(specs) };
    let names: Vec<String> = specs.iter().map(|s| format!("`{}`", s.name)).collect();
    match specs.into_iter().find(|s| s.name == name) {
        Some(spec) => Ok(vec![spec]),
        None => Err(format!("{} has no spec named `{name}`; its specs: {}", file.display(), names.join(", ")).into()),
    }
}

/// The candidate tile configuration of `spec` on `arch` called `name`.
pub fn named_config(spec: &Spec, arch: Arch, name: &str) -> Result<TileConfig, String> {
    let candidates = tile_choice::candidates(spec, arch.target());
    candidates.iter().copied().find(|&c| config_name(c) == name).ok_or_else(|| {
        let names: Vec<String> = candidates.into_iter().map(config_name).collect();
        format!("{}: no tile configuration `{name}` on {arch}; its candidates: {}", spec.name, names.join(", "))
    })
}
