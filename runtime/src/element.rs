//! Storage element types of Q, K, V and O.

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use flashgen_codegen::Dtype;

/// A Q/K/V/O element type; [`crate::Runtime::forward`] checks
/// [`Element::DTYPE`] against the spec's dtype.
pub trait Element: DeviceRepr + ValidAsZeroBits + Copy {
    const DTYPE: Dtype;
}

impl Element for half::f16 {
    const DTYPE: Dtype = Dtype::F16;
}

impl Element for half::bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}
