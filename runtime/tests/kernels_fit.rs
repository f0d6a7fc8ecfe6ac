//! Every kernel a launch may use (`KernelSet::Every`: the forwards the
//! autotuner may pick, varlen, paged, decode, dropout, the backward) fits
//! one CTA's shared memory on each GPU family the runtime targets, for head
//! dims up to 256, unequal QK / V dims and MLA's absorbed decode. Needs no
//! GPU: the kernels are generated, not compiled.

use flashgen_codegen::parse_one;
use flashgen_runtime::{spec_kernels, Arch, KernelSet};

/// A100 (163 KiB per CTA), RTX 30 / 40 and sm_120 (99 KiB), Hopper (227).
const ARCHS: [(u32, u32); 5] = [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)];

#[test]
fn kernels_fit_shared_memory() {
    let mut dims: Vec<(u32, u32)> = (8..=256).step_by(8).map(|d| (d, d)).collect();
    dims.extend([(192, 128), (128, 64), (576, 512)]);
    for (qk, v) in dims {
        for mask in ["", ", mask: q >= k"] {
            let source = format!("S {{ dtype: bf16, head_dim: {qk}, v_head_dim: {v}{mask} }}");
            let spec = parse_one(&source).unwrap();
            for (major, minor) in ARCHS {
                let arch = Arch::new(major, minor);
                let target = arch.target();
                let limit = target.smem_per_sm - target.smem_reserved_per_cta;
                for kernel in spec_kernels(&spec, KernelSet::Every, arch) {
                    assert!(
                        kernel.dynamic_smem <= limit,
                        "{source} on {arch}: {} takes {} bytes of {limit}",
                        kernel.name,
                        kernel.dynamic_smem
                    );
                }
            }
        }
    }
}
