//! e4m3 forward problems: a problem's Q, K and V quantized
//! ([`quantize_operands`]) to the bytes an e4m3 forward reads and their
//! descale factors, per tensor or per K/V head (Q's per K/V head of its
//! query heads), while the problem's operands, and so the f64 reference's,
//! become the dequantized values `descale · e4m3`: the reference reads the
//! very values the kernel reads, and only the kernel's arithmetic is judged
//! (against [`Expected::e4m3`](super::Expected::e4m3), FlashAttention-3's
//! FP8 rule). A [`DeviceProblem`](super::DeviceProblem) holding them
//! launches [`Runtime::forward_e4m3`](flashgen::Runtime::forward_e4m3).

use super::decode_e4m3::{e4m3_bytes, quantize_cache, Granularity};
use super::driver;
use flashgen::codegen::reference::Problem;
use flashgen::codegen::Spec;
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::runtime::{Error, Layout, QkvDescale};
use std::sync::Arc;

/// Q, K and V of a problem as e4m3 bytes (BSHD) with their descales.
#[derive(Clone, Debug)]
pub struct E4m3Operands {
    pub granularity: Granularity,
    /// Q's, K's and V's bytes.
    pub bytes: [Vec<u8>; 3],
    /// Q's, K's and V's descale factors (one, or one per K/V head).
    pub descales: [Vec<f32>; 3],
}

/// Quantizes `problem`'s Q, K and V in place to `descale · e4m3` values
/// and returns their bytes and descales. Per K/V head, each head's values
/// are first scaled by its own factor (0.25, 1 or 4), so the heads'
/// descales differ.
pub fn quantize_operands(spec: &Spec, problem: &mut Problem, granularity: Granularity) -> E4m3Operands {
    let shape = problem.shape;
    let group = shape.heads / shape.heads_kv.max(1);
    let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let factor = |h: usize| match granularity {
        Granularity::PerTensor => 1.0,
        Granularity::PerKvHead => [0.25, 1.0, 4.0][h % 3],
    };
    // A row of Q holds a K/V head's query heads side by side: each K/V
    // head's share is `group · dqk` wide.
    let rows = [(shape.heads_kv, group * dqk), (shape.heads_kv, dqk), (shape.heads_kv, dv)];
    let operands = [&mut problem.q, &mut problem.k, &mut problem.v];
    let mut bytes: [Vec<u8>; 3] = Default::default();
    let mut descales: [Vec<f32>; 3] = Default::default();
    for (i, (values, (heads_kv, width))) in operands.into_iter().zip(rows).enumerate() {
        descales[i] = quantize_cache(values, (heads_kv, width), granularity, factor);
        bytes[i] = e4m3_bytes(values, &descales[i], heads_kv, width);
    }
    E4m3Operands { granularity, bytes, descales }
}

/// An e4m3 problem's operands and descales on the GPU.
pub(crate) struct DeviceQkv {
    pub qkv: [CudaSlice<u8>; 3],
    descales: [CudaSlice<f32>; 3],
    granularity: Granularity,
}

impl DeviceQkv {
    /// Uploads `operands` into buffers laid out as `layouts` (Q's, K's and
    /// V's), with `scatter` placing BSHD bytes.
    pub fn upload(
        stream: &Arc<CudaStream>,
        operands: &E4m3Operands,
        layouts: [&Layout; 3],
        scatter: impl Fn(&[u8], &Layout) -> Vec<u8>,
    ) -> Result<DeviceQkv, Error> {
        let bytes = |i: usize| {
            stream.clone_htod(&scatter(&operands.bytes[i], layouts[i])).map_err(driver("upload an e4m3 operand"))
        };
        let descales = |i: usize| stream.clone_htod(&operands.descales[i]).map_err(driver("upload descales"));
        Ok(DeviceQkv {
            qkv: [bytes(0)?, bytes(1)?, bytes(2)?],
            descales: [descales(0)?, descales(1)?, descales(2)?],
            granularity: operands.granularity,
        })
    }

    /// The descales as a launch takes them.
    pub fn descale(&self) -> QkvDescale<'_> {
        let [q, k, v] = self.descales.each_ref().map(|d| self.granularity.of(d));
        QkvDescale { q, k, v }
    }
}
