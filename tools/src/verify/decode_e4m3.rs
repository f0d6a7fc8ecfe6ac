//! Decode problems over e4m3 caches: a decode problem's caches quantized
//! (`DecodeProblem::quantized`, by `quantize_cache`) to the bytes an e4m3 plan reads
//! and their descale factors, per tensor or per K/V head, while the
//! problem's caches, and so the f64 reference's keys and values, become
//! the dequantized values `descale · e4m3`: the reference dequantizes the
//! same cache the kernel reads. Pages of such a problem
//! (`DecodeProblem::paged`) hold those values too (and noise), which
//! [`e4m3_bytes`] turns back into the same bytes.

use super::driver;
use flashgen::cudarc::driver::{CudaSlice, CudaStream};
use flashgen::runtime::e4m3;
use flashgen::runtime::{Descale, Error, KvDescale};
use std::sync::Arc;

/// How an e4m3 step's descale factors divide the cache: one per tensor or
/// one per K/V head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Granularity {
    PerTensor,
    PerKvHead,
}

impl Granularity {
    /// `buffer`'s factors as a run takes them.
    pub fn of(self, buffer: &CudaSlice<f32>) -> Descale<'_> {
        match self {
            Granularity::PerTensor => Descale::PerTensor(buffer),
            Granularity::PerKvHead => Descale::PerKvHead(buffer),
        }
    }
}

/// An e4m3 step's K and V descale factors: one each, or one per K/V head.
#[derive(Clone, Debug)]
pub struct E4m3Scales {
    pub granularity: Granularity,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Scales K/V head `h`'s values of `cache` (rows of `heads_kv` heads of
/// `dim` elements) by
/// `factor(h)`, picks the descales that map each head's (or the tensor's)
/// largest magnitude to 448, and rounds the values to `descale · e4m3`.
pub(crate) fn quantize_cache(
    cache: &mut [f64],
    (heads_kv, dim): (usize, usize),
    granularity: Granularity,
    factor: impl Fn(usize) -> f64,
) -> Vec<f32> {
    let head = |i: usize| i / dim % heads_kv;
    for (i, x) in cache.iter_mut().enumerate() {
        *x *= factor(head(i));
    }
    // One pass for every head's largest magnitude (a benchmark's operands
    // run to hundreds of millions of values): the descale of a head's
    // values is that of their largest magnitude alone.
    let heads = match granularity {
        Granularity::PerTensor => 1,
        Granularity::PerKvHead => heads_kv,
    };
    let mut amax = vec![0f32; heads];
    for (i, &x) in cache.iter().enumerate() {
        let m = &mut amax[head(i) % heads];
        *m = m.max((x as f32).abs());
    }
    let descales: Vec<f32> = amax.iter().map(|&m| e4m3::descale_for(&[m])).collect();
    let bytes = e4m3_bytes(cache, &descales, heads_kv, dim);
    for (i, (x, &b)) in cache.iter_mut().zip(&bytes).enumerate() {
        *x = dequantize(b, descales[head(i) % descales.len()]);
    }
    descales
}

/// The e4m3 bytes of `cache` (rows of `heads_kv` heads of `dim` elements)
/// under `descales` (one, or one per head): `e4m3(x / descale)`, exact for
/// values that are `descale · e4m3` already.
pub fn e4m3_bytes(cache: &[f64], descales: &[f32], heads_kv: usize, dim: usize) -> Vec<u8> {
    let descale = |i: usize| f64::from(descales[i / dim % heads_kv % descales.len()]);
    cache.iter().enumerate().map(|(i, &x)| e4m3::from_f32((x / descale(i)) as f32)).collect()
}

/// `descale · e4m3`, exactly.
fn dequantize(b: u8, descale: f32) -> f64 {
    f64::from(descale) * f64::from(e4m3::to_f32(b))
}

/// An e4m3 step's byte caches and descales on the GPU.
pub(crate) struct DeviceE4m3 {
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
    k_descale: CudaSlice<f32>,
    v_descale: CudaSlice<f32>,
    granularity: Granularity,
}

impl DeviceE4m3 {
    /// Uploads the bytes of `caches` (K's and V's host values, rows of
    /// `heads_kv` heads of `dims`) under `scales`.
    pub fn upload(
        stream: &Arc<CudaStream>,
        caches: [&[f64]; 2],
        dims: [usize; 2],
        heads_kv: usize,
        scales: &E4m3Scales,
    ) -> Result<DeviceE4m3, Error> {
        let bytes = |i: usize, descales: &[f32]| {
            let host = e4m3_bytes(caches[i], descales, heads_kv, dims[i]);
            stream.clone_htod(&host).map_err(driver("upload an e4m3 cache"))
        };
        let descales = |d: &[f32]| stream.clone_htod(d).map_err(driver("upload descales"));
        Ok(DeviceE4m3 {
            k: bytes(0, &scales.k)?,
            v: bytes(1, &scales.v)?,
            k_descale: descales(&scales.k)?,
            v_descale: descales(&scales.v)?,
            granularity: scales.granularity,
        })
    }

    /// Overwrites the descales on the device, in stream order (what a
    /// captured step reads on its next replay).
    pub fn set_descales(&mut self, stream: &Arc<CudaStream>, k: &[f32], v: &[f32]) -> Result<(), Error> {
        stream.memcpy_htod(k, &mut self.k_descale).map_err(driver("upload descales"))?;
        stream.memcpy_htod(v, &mut self.v_descale).map_err(driver("upload descales"))
    }

    /// The descales as a run takes them.
    pub fn descale(&self) -> KvDescale<'_> {
        KvDescale { k: self.granularity.of(&self.k_descale), v: self.granularity.of(&self.v_descale) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::decode::random_decode_problem;
    use flashgen::runtime::DecodeShape;

    #[test]
    fn the_reference_reads_the_dequantized_bytes() {
        let spec = flashgen::parse_one("S { dtype: bf16, head_dim: 8 }").unwrap();
        let shape = DecodeShape { batch: 2, heads: 4, heads_kv: 2, q_len: 1, max_kv_len: 5 };
        for granularity in [Granularity::PerTensor, Granularity::PerKvHead] {
            let p = random_decode_problem(&spec, shape, &[5, 3], vec![], 3);
            let (q, scales) = p.quantized(granularity);
            assert_eq!(scales.k.len(), if granularity == Granularity::PerTensor { 1 } else { 2 });
            let bytes = e4m3_bytes(&q.k_cache, &scales.k, 2, 8);
            let again: Vec<f64> =
                bytes.iter().enumerate().map(|(i, &b)| dequantize(b, scales.k[i / 8 % 2 % scales.k.len()])).collect();
            assert_eq!(again, q.k_cache, "{granularity:?}: the bytes give the reference's values back");
            assert_eq!(q.reference.problem.v[..8], q.v_cache[..8]);
            let amax = q.k_cache.iter().fold(0f64, |m, x| m.max(x.abs()));
            let top = scales.k.iter().fold(0f32, |m, &d| m.max(d));
            assert_eq!(amax, 448.0 * f64::from(top), "{granularity:?}: the largest value maps to 448");
        }
    }

    #[test]
    fn each_head_maps_its_own_largest_magnitude_to_448() {
        // Two rows of three heads of four values, head h's values of order 10^h.
        let (heads, dim) = (3, 4);
        let head = |i: usize| i / dim % heads;
        let values: Vec<f64> =
            (0..2 * heads * dim).map(|i| ((i * 7 % 11) as f64 - 5.0) * 10f64.powi(head(i) as i32)).collect();
        let amax = |h: Option<usize>| {
            let of = values.iter().enumerate().filter(|&(i, _)| h.is_none_or(|h| head(i) == h));
            of.fold(0f64, |m, (_, x)| m.max(x.abs())) as f32
        };
        let per_head = quantize_cache(&mut values.clone(), (heads, dim), Granularity::PerKvHead, |_| 1.0);
        assert_eq!(per_head, (0..heads).map(|h| amax(Some(h)) / 448.0).collect::<Vec<_>>());
        let per_tensor = quantize_cache(&mut values.clone(), (heads, dim), Granularity::PerTensor, |_| 1.0);
        assert_eq!(per_tensor, [amax(None) / 448.0]);
    }
}
