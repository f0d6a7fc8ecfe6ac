//! What the NVRTC test files share.

use flashgen_codegen::abi::{Grid, Kernel};
use flashgen_runtime::nvrtc_version;

/// Fails (never skips) without NVRTC: these tests are the compile gate.
pub fn require_nvrtc() {
    if let Err(e) = nvrtc_version() {
        panic!("{e}\n(scripts/test.sh installs NVRTC from PyPI into target/pypi-nvrtc and sets LD_LIBRARY_PATH)");
    }
}

/// A hand-written kernel `name` with no arguments, for compile-path tests.
#[allow(dead_code)] // not every test binary compiles a hand-written kernel
pub fn raw_kernel(name: &str, source: &str) -> Kernel {
    Kernel {
        name: name.into(),
        source: source.into(),
        grid: Grid::QueryTiles,
        block_m: 64,
        block_n: 32,
        threads: 128,
        dynamic_smem: 0,
        args: vec![],
    }
}
