//! `FLASHGEN_DUMP` writes the source and NVRTC log of every compile, and an
//! unwritable dump directory is an error, not a panic. A test binary of its
//! own: it sets an environment variable.

mod support;

use flashgen_runtime::{compile_cubin, Arch, Error, DUMP_ENV};
use std::path::Path;

#[test]
fn dumps_source_and_log() {
    support::require_nvrtc();
    let kernel =
        support::raw_kernel("dumped", "extern \"C\" __global__ void dumped(float* o) { int unused; o[0] = 1.0f; }\n");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flashgen-dump");
    std::env::set_var(DUMP_ENV, &dir);
    compile_cubin(&kernel, Arch::new(8, 0)).unwrap();
    assert_eq!(std::fs::read_to_string(dir.join("dumped.cu")).unwrap(), kernel.source);
    let log = std::fs::read_to_string(dir.join("dumped.log")).unwrap();
    assert!(log.contains("unused"), "expected NVRTC's unused-variable warning, got {log:?}");

    // A dump "directory" below a regular file cannot be created.
    std::env::set_var(DUMP_ENV, dir.join("dumped.cu").join("sub"));
    let err = compile_cubin(&kernel, Arch::new(8, 0)).unwrap_err();
    assert!(matches!(err, Error::Dump { .. }), "{err}");
    assert!(err.to_string().contains("FLASHGEN_DUMP"), "{err}");
}
