//! Whether the CUDA libraries can be used. With the `dynamic-loading`
//! feature (the default) they are loaded on first use, and cudarc panics
//! where one is missing: the driver is looked for first, NVRTC found where
//! users have it (`nvrtc_lib`). Linked at build time (`dynamic-linking`),
//! they are there whenever the program runs.

use crate::error::Error;

/// Whether libcuda (the driver) can be loaded.
pub(crate) fn driver_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    // SAFETY: only tries to dlopen the candidate library names.
    return unsafe { cudarc::driver::sys::is_culib_present() };
    #[cfg(not(feature = "dynamic-loading"))]
    true
}

/// Makes NVRTC usable, or says where it looked.
pub(crate) fn ensure_nvrtc() -> Result<(), Error> {
    #[cfg(feature = "dynamic-loading")]
    return crate::nvrtc_lib::ensure_nvrtc();
    #[cfg(not(feature = "dynamic-loading"))]
    Ok(())
}
