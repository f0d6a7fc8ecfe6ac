//! The device memory an attention operand may live in: a whole `CudaSlice`,
//! or a `CudaView` / `CudaViewMut` of part of one (a framework's tensor at an
//! offset into its storage). The operand's `Layout` addresses elements from
//! the start of that memory, and the launch checks them against its length.

use cudarc::driver::{DevicePtr, DevicePtrMut};

/// Memory an operand is read from: a `CudaSlice<T>`, `CudaView<T>` or
/// `CudaViewMut<T>`.
pub trait DeviceInput<T>: DevicePtr<T> {}
impl<T, S: DevicePtr<T> + ?Sized> DeviceInput<T> for S {}

/// Memory an operand is written to: a `CudaSlice<T>` or `CudaViewMut<T>`.
/// (Readable too: its address goes into a TMA descriptor before the launch
/// that writes it.)
pub trait DeviceOutput<T>: DevicePtr<T> + DevicePtrMut<T> {}
impl<T, S: DevicePtr<T> + DevicePtrMut<T> + ?Sized> DeviceOutput<T> for S {}
