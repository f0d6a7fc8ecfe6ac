//! Opening a device reports a typed error, never a panic, on machines without
//! a driver, a GPU or NVRTC.

use flashgen_runtime::{Arch, Error, Runtime};

#[test]
fn runtime_new_never_panics() {
    match Runtime::new(0) {
        Ok(rt) => assert!(rt.arch() >= Arch::MIN, "{}", rt.device_name()),
        Err(e) => assert!(
            matches!(
                e,
                Error::DriverMissing
                    | Error::NvrtcMissing { .. }
                    | Error::NoDevice { .. }
                    | Error::UnsupportedArch { .. }
                    | Error::Driver { .. }
            ),
            "{e}"
        ),
    }
    let err = Runtime::new(usize::MAX).err().expect("no machine has usize::MAX GPUs");
    assert!(matches!(err, Error::DriverMissing | Error::NvrtcMissing { .. } | Error::NoDevice { .. }), "{err}");
}

#[test]
fn runtime_is_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Runtime>();
}
