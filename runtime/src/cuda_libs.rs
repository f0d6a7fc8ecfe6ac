//! Whether the CUDA libraries can be used. With the `dynamic-loading`
//! feature (the default) they are loaded on first use, and cudarc panics
//! where one is missing: the driver is looked for first, NVRTC found where
//! users have it (`nvrtc_lib`), NCCL's absence reported with how to make it
//! reachable (`nccl_lib`). Linked at build time (`dynamic-linking`), they
//! are there whenever the program runs.

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

/// Makes sure cudarc can load NCCL, or says how to make it reachable.
#[cfg(feature = "nccl")]
pub(crate) fn ensure_nccl() -> Result<(), Error> {
    #[cfg(feature = "dynamic-loading")]
    return crate::nccl_lib::ensure_nccl();
    #[cfg(not(feature = "dynamic-loading"))]
    Ok(())
}

/// The newest CUDA version the driver supports, e.g. `(13, 0)`.
pub(crate) fn driver_version() -> Result<(i32, i32), Error> {
    let mut version = 0;
    // SAFETY: writes one int; the driver was loaded by the caller's checks.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| Error::driver("reading the driver's CUDA version", e))?;
    Ok((version / 1000, version % 1000 / 10))
}

/// NVRTC's CUBINs load on a driver of its CUDA major version or newer (a
/// newer minor version within one major is fine: minor version
/// compatibility).
pub(crate) fn check_nvrtc_fits(nvrtc: (i32, i32), driver: (i32, i32)) -> Result<(), Error> {
    match nvrtc.0 > driver.0 {
        true => Err(Error::NvrtcNewerThanDriver { nvrtc, driver }),
        false => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_must_not_be_of_a_newer_major_version_than_the_driver() {
        assert!(check_nvrtc_fits((12, 9), (13, 0)).is_ok());
        assert!(check_nvrtc_fits((12, 9), (12, 4)).is_ok(), "minor version compatibility");
        let err = check_nvrtc_fits((13, 0), (12, 8)).unwrap_err();
        assert!(matches!(err, Error::NvrtcNewerThanDriver { nvrtc: (13, 0), driver: (12, 8) }));
        let text = err.to_string();
        assert!(text.contains("NVRTC 13.0") && text.contains("CUDA 12.8 driver"), "{text}");
        assert!(text.contains("nvidia-cuda-nvrtc-cu12"), "{text}");
    }
}
