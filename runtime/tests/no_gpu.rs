//! Opening a device, or NCCL, reports a typed error, never a panic, on
//! machines without a driver, a GPU, NVRTC or NCCL.

use flashgen_runtime::{Arch, CommError, Error, Runtime};

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

/// Without libnccl, NCCL's first call is a typed error naming the fix,
/// never cudarc's panic.
#[cfg(feature = "nccl")]
#[test]
fn nccl_is_found_or_reported() {
    use flashgen_runtime::UniqueId;
    match UniqueId::new() {
        Ok(id) => assert_eq!(UniqueId::from_bytes(id.to_bytes()).to_bytes(), id.to_bytes()),
        Err(e) => {
            assert!(matches!(e, Error::Comm(CommError::Missing { .. }) | Error::Comm(CommError::Failed { .. })), "{e}")
        }
    }
}

#[cfg(feature = "nccl")]
#[test]
fn communicators_move_to_their_ranks_threads() {
    fn send<T: Send>() {}
    send::<flashgen_runtime::Communicator>();
}
