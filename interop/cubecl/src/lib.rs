//! flashgen beside cubecl-cuda in one binary: the same cudarc, configured
//! compatibly (cubecl's `fallback-dynamic-loading` with flashgen's
//! `dynamic-loading`; flashgen's `cuda-13000` fixes the bindings' version).

/// Names from both crates, so that both are compiled and linked together.
pub fn runtimes() -> (&'static str, &'static str) {
    (std::any::type_name::<flashgen::Runtime>(), std::any::type_name::<cubecl_cuda::CudaRuntime>())
}
