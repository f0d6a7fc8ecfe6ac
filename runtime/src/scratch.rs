//! Device memory for context parallelism's intermediates (partial outputs,
//! f32 sums, K/V in flight). A launch needs gigabytes of it for a few
//! milliseconds; from the device's default pool, which returns freed
//! memory to the driver at every synchronization, each launch would map it
//! again, which cost a sharded forward at 128k tokens a tenth of its time.
//! So it comes from a pool of flashgen's own per device that keeps what
//! was freed for the next launch (freed, as any stream-ordered allocation,
//! by `cuMemFreeAsync` when its `CudaSlice` drops). Devices without memory
//! pools allocate as cudarc does.

use crate::error::Error;
use cudarc::driver::sys::{self, CUmemoryPool};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A device's pool; `None` where the device has no memory pools or one
/// could not be made.
#[derive(Clone, Copy)]
struct Pool(Option<CUmemoryPool>);

// SAFETY: a CUDA memory pool handle may be used from any thread.
unsafe impl Send for Pool {}

/// `len` zeroed elements on `stream`'s device, ordered on `stream`.
pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, Error> {
    // SAFETY: zeroed at once, in stream order, before anything reads it.
    let mut slice = unsafe { uninit::<T>(stream, len)? };
    stream.memset_zeros(&mut slice).map_err(|e| Error::driver("allocating scratch memory", e))?;
    Ok(slice)
}

/// `len` elements on `stream`'s device, ordered on `stream`, their values
/// whatever the memory held.
///
/// # Safety
/// Every element a later read reaches must be written first (in stream
/// order): a kernel that writes the whole buffer, say.
pub(crate) unsafe fn uninit<T: DeviceRepr>(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<T>, Error> {
    let len = len.max(1);
    let failed = |e| Error::driver("allocating scratch memory", e);
    let Pool(Some(pool)) = pool_of(stream)? else {
        // SAFETY: the caller writes before reading.
        return unsafe { stream.alloc::<T>(len) }.map_err(failed);
    };
    let max = usize::MAX / std::mem::size_of::<T>().max(1);
    let bytes = len.checked_mul(std::mem::size_of::<T>()).ok_or(Error::TooLarge {
        what: "scratch elements",
        value: len,
        max,
    })?;
    let mut ptr = 0;
    // SAFETY: the pool belongs to the stream's device; the pointer is
    // handed to a CudaSlice of exactly `len` elements, which frees it on
    // the stream (cuMemFreeAsync) when dropped.
    unsafe {
        sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool, stream.cu_stream()).result().map_err(failed)?;
        Ok(stream.upgrade_device_ptr::<T>(ptr, len))
    }
}

/// The pool of `stream`'s device, made on first use.
fn pool_of(stream: &Arc<CudaStream>) -> Result<Pool, Error> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Pool>>> = OnceLock::new();
    let ctx = stream.context();
    let mut pools = POOLS.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(pool) = pools.get(&ctx.ordinal()) {
        return Ok(*pool);
    }
    let supported = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
    let pool = match supported {
        Ok(n) if n > 0 => Pool(new_pool(ctx.cu_device())),
        _ => Pool(None),
    };
    pools.insert(ctx.ordinal(), pool);
    Ok(pool)
}

/// A device-local pool that keeps every freed byte; `None` if the driver
/// refuses one.
fn new_pool(device: sys::CUdevice) -> Option<CUmemoryPool> {
    // SAFETY: zeroed properties are valid (no handle types, no maximum);
    // the fields set name a pinned pool on `device`.
    unsafe {
        let mut props: sys::CUmemPoolProps = std::mem::zeroed();
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = device;
        let mut pool = std::ptr::null_mut();
        sys::cuMemPoolCreate(&mut pool, &props).result().ok()?;
        let mut keep = u64::MAX;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        sys::cuMemPoolSetAttribute(pool, attr, (&mut keep as *mut u64).cast()).result().ok()?;
        Some(pool)
    }
}
