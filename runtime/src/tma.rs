//! TMA descriptors (`CUtensorMap`) for the Hopper kernels whose producer
//! copies a tile with one instruction (`codegen/src/cuda/library/tma.cuh`): Q, K and
//! V of the persistent forward (and O, which its consumers store), Q, K, V
//! and dO of the dK/dV kernel. A descriptor describes an operand as the
//! 4-d tensor `[batch, seq, heads, dim]` with its element strides, copied
//! in the boxes codegen defines (`abi::TmaBox`); rows and columns past the
//! tensor's end read zeros, as the cp.async copies' zero fill does.
//!
//! The varlen and paged forwards take ragged descriptors
//! ([`ragged_maps`], `library/tma_ragged.cuh`): an operand's rows as one
//! run of tokens, addressed per sequence so that rows past its end lie
//! outside the tensor; a paged cache whose pages lie a page apart is such
//! a run of rows, copied a page per box ([`paged_box_rows`]).
//!
//! Where the copy engine cannot address a layout (an address or stride not
//! a multiple of 16 bytes, a zero stride), there are no descriptors and the
//! launch runs the kernel generated to copy with cp.async
//! (`cuda::TileCopy::Threads`).

use crate::layout::Layout;
use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;
use flashgen_codegen::abi::{Operand, TmaBox};
use flashgen_codegen::cuda::{TileConfig, TileCopy};
use flashgen_codegen::Dtype;

/// Environment variable: `0` keeps the Hopper kernels on cp.async copies
/// (for comparison and for testing that path).
pub const TMA_ENV: &str = "FLASHGEN_TMA";

/// A descriptor as the kernel parameter it is passed as.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(transparent)]
pub(crate) struct TensorMap(CUtensorMap);

// SAFETY: a plain 128-byte, 128-byte aligned C struct, passed by value.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// All zeros, for the driver to fill (or a launch that reads none).
    pub(crate) const ZERO: TensorMap = TensorMap(CUtensorMap { opaque: [0; 16] });
}

/// A launch's descriptors, at most one per operand (the first given), held
/// inline: a launch that copies with TMA allocates none for them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMaps([Option<TensorMap>; 8]);

impl TensorMaps {
    /// The descriptor of `op`, if the launch has one.
    pub(crate) fn get(&self, op: Operand) -> Option<TensorMap> {
        self.0[Self::slot(op)]
    }

    /// Exhaustive, so a new operand cannot go without a slot.
    fn slot(op: Operand) -> usize {
        match op {
            Operand::Q => 0,
            Operand::K => 1,
            Operand::V => 2,
            Operand::O => 3,
            Operand::DO => 4,
            Operand::DQ => 5,
            Operand::DK => 6,
            Operand::DV => 7,
        }
    }
}

impl FromIterator<(Operand, TensorMap)> for TensorMaps {
    fn from_iter<I: IntoIterator<Item = (Operand, TensorMap)>>(maps: I) -> TensorMaps {
        let mut all = TensorMaps([None; 8]);
        for (op, map) in maps {
            all.0[Self::slot(op)].get_or_insert(map);
        }
        all
    }
}

/// How a launch's descriptors address its operands' rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rows {
    /// `[batch, seq, heads, dim]` ([`encode`]).
    Batched,
    /// One run of rows, addressed per sequence ([`encode_ragged`]): a
    /// varlen or paged launch's.
    Ragged,
}

/// TMA descriptors of `operands` (each with its address and layout) in
/// the boxes of a kernel with `tile` ([`TmaBox::of`]), addressing rows as
/// `rows` says. `None` when TMA is off (`on`) or a layout rules it out for
/// one of them: the launch then runs the kernel that copies with its
/// threads.
pub(crate) fn tensor_maps(
    operands: &[(Operand, u64, &Layout)],
    tile: Tile,
    dtype: Dtype,
    on: bool,
    rows: Rows,
) -> Option<TensorMaps> {
    if !on {
        return None;
    }
    let map = |op, ptr, layout| {
        let tma_box = TmaBox::of(op, tile.block_m, tile.block_n);
        match rows {
            Rows::Batched => encode(ptr, layout, dtype, tma_box),
            Rows::Ragged => encode_ragged(ptr, layout, dtype, tma_box.rows),
        }
    };
    operands.iter().map(|&(op, ptr, layout)| Some((op, map(op, ptr, layout)?))).collect()
}

/// The ragged descriptors of Q, K, V and O of a varlen or paged forward
/// in `config` (`operands`: each one's first element's address and its
/// rows as one [`Layout`]), K and V in boxes of `kv_rows` rows. `None`
/// unless the configuration is warp-specialized and TMA on (`on`), or
/// where `kv_rows` is 0 or a layout rules TMA out: the launch then runs
/// the kernel that copies with its threads.
pub(crate) fn ragged_forward_maps(
    config: TileConfig,
    operands: [(u64, &Layout); 4],
    kv_rows: u32,
    dtype: Dtype,
    on: bool,
) -> Option<TensorMaps> {
    let [q, k, v, o] = operands;
    let operands = [(Operand::Q, q), (Operand::K, k), (Operand::V, v), (Operand::O, o)].map(|(op, (p, l))| (op, p, l));
    let tile = Tile { block_m: config.block_m(), block_n: kv_rows };
    tensor_maps(&operands, tile, dtype, on && config.persistent() && kv_rows > 0, Rows::Ragged)
}

/// Keys per box of a paged launch's K/V descriptors: a tile's (`block_n`)
/// where pages hold whole tiles, a page's where tiles are whole pages, else
/// 0; and 0 under 8 rows (the 128-byte swizzle's period).
pub(crate) fn paged_box_rows(block_n: u32, page_size: usize) -> u32 {
    let rows = u32::try_from(page_size).unwrap_or(u32::MAX).min(block_n);
    let whole = match page_size >= block_n as usize {
        true => page_size.is_multiple_of(block_n as usize),
        false => rows > 0 && block_n.is_multiple_of(rows),
    };
    if whole && rows % 8 == 0 && rows > 0 {
        rows
    } else {
        0
    }
}

/// The copy of the kernel a launch with `maps` runs.
pub(crate) fn copy_with(maps: &Option<TensorMaps>) -> TileCopy {
    match maps {
        Some(_) => TileCopy::Tma,
        None => TileCopy::Threads,
    }
}

/// A kernel's query and key rows per tile: its TMA boxes' rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tile {
    pub block_m: u32,
    pub block_n: u32,
}

/// The descriptor of the operand at `ptr` with `layout` (16-bit elements:
/// a copy moves bits, so an e4m3 operand is described as half as many),
/// copied in boxes of `tma_box`; `None` where TMA cannot address it.
pub(crate) fn encode(ptr: u64, layout: &Layout, dtype: Dtype, tma_box: TmaBox) -> Option<TensorMap> {
    let [batch, seq, head] = layout.strides;
    // Innermost first. An empty axis is never read (no tile is visited),
    // but a descriptor's sizes must be at least 1.
    let dims = [layout.dim, layout.seq, layout.heads, layout.batch].map(|n| (n as u64).max(1));
    let mut strides = [0u64; 3];
    for (out, (stride, size)) in strides.iter_mut().zip([(seq, dims[1]), (head, dims[2]), (batch, dims[3])]) {
        // A size-1 axis is only ever read at index 0: any legal stride does.
        *out = if size == 1 { 16 } else { stride_bytes(stride)? };
    }
    encode_tiled(ptr, &dims, &strides, [tma_box.cols, tma_box.rows], dtype)
}

/// The ragged descriptor (`library/tma_ragged.cuh`) of the rows of
/// `layout` at `ptr` as one run of `batch · seq` tokens (its batch rows
/// must lie a sequence apart), copied in boxes of `rows` rows: dims
/// `(dim, 2^30, heads, 2^31 - 2^16, 2^31 - 2^16)`, strides of a row, a
/// head, a row and 2^34 bytes less a row. `None` where TMA cannot address
/// it.
pub(crate) fn encode_ragged(ptr: u64, layout: &Layout, dtype: Dtype, rows: u32) -> Option<TensorMap> {
    const SPAN_ROWS: u64 = 1 << 30;
    const ENDS: u64 = 0x7fff_0000;
    let [batch, seq, head] = layout.strides;
    let tokens = (layout.batch as u64).checked_mul(layout.seq as u64)?;
    if (layout.batch > 1 && batch != seq.checked_mul(layout.seq as i64)?) || tokens >= SPAN_ROWS {
        return None;
    }
    let row = stride_bytes(seq)?;
    let head = if layout.heads <= 1 { 16 } else { stride_bytes(head)? };
    // 2^30 of these wrap to -2^30 rows: a nonzero multiple of 16 as well.
    let back = stride_bytes_of((1u64 << 34).checked_sub(row)?)?;
    let dims = [(layout.dim as u64).max(1), SPAN_ROWS, (layout.heads as u64).max(1), ENDS, ENDS];
    encode_tiled(ptr, &dims, &[row, head, row, back], [TmaBox::COLS, rows], dtype)
}

/// An element stride in bytes, as a descriptor takes it (a nonzero
/// multiple of 16 under 2^40), or `None`.
fn stride_bytes(stride: i64) -> Option<u64> {
    stride_bytes_of(u64::try_from(stride).ok()?.checked_mul(2)?)
}

/// `bytes` where a descriptor takes it as a stride.
fn stride_bytes_of(bytes: u64) -> Option<u64> {
    (bytes != 0 && bytes.is_multiple_of(16) && bytes < 1 << 40).then_some(bytes)
}

/// `cuTensorMapEncodeTiled` of a tensor of 16-bit elements with `dims`
/// (innermost first) and byte `strides` of all but the innermost, in boxes
/// of `[cols, rows]` (1 along the other dims), 128-byte swizzled.
fn encode_tiled(ptr: u64, dims: &[u64], strides: &[u64], [cols, rows]: [u32; 2], dtype: Dtype) -> Option<TensorMap> {
    if !ptr.is_multiple_of(16) || dims.iter().any(|&n| n > u64::from(u32::MAX)) || rows == 0 || rows > 256 {
        return None;
    }
    let data_type = match dtype {
        Dtype::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Dtype::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let mut boxes = [1u32; 5];
    boxes[..2].copy_from_slice(&[cols, rows]);
    let element_strides = [1u32; 5];
    let mut map = TensorMap::ZERO;
    // SAFETY: `dims` has the rank's length and `strides` one less, the box
    // and element-stride arrays at least the rank's; `map` is a 128-byte
    // aligned CUtensorMap, and the driver only reads `ptr`.
    let result = unsafe {
        cuTensorMapEncodeTiled(
            &mut map.0,
            data_type,
            dims.len() as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    (result == CUresult::CUDA_SUCCESS).then_some(map)
}

/// Whether `FLASHGEN_TMA` allows TMA (anything but `0`).
pub(crate) fn tma_from(value: Option<std::ffi::OsString>) -> bool {
    value.is_none_or(|v| v != "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_tma_cannot_address_get_no_descriptor() {
        // Checked before the driver is called, so no GPU is needed.
        let odd_heads = Layout::bshd(2, 100, 8, 59);
        assert!(
            encode(0x1000, &odd_heads, Dtype::Bf16, TmaBox { cols: TmaBox::COLS, rows: 128 }).is_none(),
            "head stride 118 bytes"
        );
        assert!(
            encode(0x1008, &Layout::bshd(2, 100, 8, 64), Dtype::Bf16, TmaBox { cols: TmaBox::COLS, rows: 128 })
                .is_none(),
            "address"
        );
        let broadcast = Layout { strides: [0, 64, 0], ..Layout::bshd(2, 100, 8, 64) };
        assert!(
            encode(0x1000, &broadcast, Dtype::Bf16, TmaBox { cols: TmaBox::COLS, rows: 128 }).is_none(),
            "zero stride"
        );
        assert!(
            encode(0x1000, &Layout::bshd(2, 100, 8, 64), Dtype::Bf16, TmaBox { cols: TmaBox::COLS, rows: 512 })
                .is_none(),
            "box rows"
        );
    }

    #[test]
    fn ragged_descriptors_need_one_run_of_rows() {
        // Checked before the driver is called, so no GPU is needed.
        let rows = |layout: &Layout| encode_ragged(0x1000, layout, Dtype::Bf16, 128);
        let apart = Layout { strides: [100 * 8 * 64 + 64, 8 * 64, 64], ..Layout::bshd(2, 100, 8, 64) };
        assert!(rows(&apart).is_none(), "batch rows not a sequence apart");
        assert!(rows(&Layout::bshd(1, 100, 8, 59)).is_none(), "row stride 944 bytes");
        assert!(rows(&Layout::bshd(1, 1 << 30, 1, 64)).is_none(), "2^30 rows");
        assert!(encode_ragged(0x1008, &Layout::bshd(1, 100, 8, 64), Dtype::Bf16, 128).is_none(), "address");
    }

    #[test]
    fn paged_boxes_are_whole_tiles_or_whole_pages() {
        for (block_n, page_size, rows) in
            [(128, 256, 128), (128, 128, 128), (128, 16, 16), (128, 64, 64), (48, 16, 16), (80, 16, 16)]
        {
            assert_eq!(paged_box_rows(block_n, page_size), rows, "{block_n} keys, pages of {page_size}");
        }
        // A box would cross a page, or fall under the swizzle's 8 rows.
        for (block_n, page_size) in [(128, 192), (48, 32), (128, 1), (128, 4), (112, 64), (128, 0)] {
            assert_eq!(paged_box_rows(block_n, page_size), 0, "{block_n} keys, pages of {page_size}");
        }
    }

    #[test]
    fn tma_is_on_unless_the_environment_says_0() {
        assert!(tma_from(None));
        assert!(tma_from(Some("1".into())));
        assert!(!tma_from(Some("0".into())));
    }
}
