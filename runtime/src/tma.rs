//! TMA descriptors (`CUtensorMap`) for the Hopper kernels whose producer
//! copies a tile with one instruction (`codegen/src/cuda/library/tma.cuh`): Q, K and
//! V of the persistent forward (and O, which its consumers store), Q, K, V
//! and dO of the dK/dV kernel, and the K/V tiles of the warp-specialized
//! varlen and paged forwards that lie inside their sequence (`kv_boxes`: a
//! packed buffer is one batch row of tokens, a paged cache one batch per
//! page). A
//! descriptor describes an operand as the 4-d tensor `[batch, seq, heads,
//! dim]` with its element strides, copied in the boxes codegen defines
//! (`abi::TmaBox`); rows and columns past the
//! tensor's end read zeros, as the cp.async copies' zero fill does. Where
//! the copy engine cannot address a layout (an address or stride not a
//! multiple of 16 bytes, a zero stride), there are no descriptors and the
//! launch runs the kernel generated to copy with cp.async
//! (`cuda::TileCopy::Threads`).

use crate::layout::Layout;
use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;
use flashgen_codegen::abi::{ArgKind, Kernel, Operand, TmaBox};
use flashgen_codegen::cuda::TileCopy;
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

/// TMA descriptors of `operands` (each with its address and layout) in
/// the boxes of a kernel with `tile` ([`TmaBox::of`]). `None` when TMA is off (`on`) or a layout rules
/// it out for one of them: the launch then runs the kernel that copies with
/// its threads.
pub(crate) fn tensor_maps(
    operands: &[(Operand, u64, &Layout)],
    tile: Tile,
    dtype: Dtype,
    on: bool,
) -> Option<TensorMaps> {
    if !on {
        return None;
    }
    operands
        .iter()
        .map(|&(op, ptr, layout)| Some((op, encode(ptr, layout, dtype, TmaBox::of(op, tile.block_m, tile.block_n))?)))
        .collect()
}

/// The K/V descriptors and box rows of a varlen or paged launch of
/// `kernel`: none where the kernel takes none (it is not warp-specialized);
/// else descriptors of K and V (`kv`: each buffer's base address and its
/// layout) in boxes of `rows` keys, or zeroed ones and 0 rows where `rows` is 0, TMA is off
/// (`on`) or a layout rules it out: the kernel's threads then copy every
/// tile.
pub(crate) fn kv_boxes(
    kernel: &Kernel,
    kv: [(u64, &Layout); 2],
    rows: u32,
    dtype: Dtype,
    on: bool,
) -> (Option<TensorMaps>, u32) {
    if !kernel.args.iter().any(|a| matches!(a.kind, ArgKind::TensorMap(_))) {
        return (None, 0);
    }
    let ops = [Operand::K, Operand::V];
    let maps: Option<TensorMaps> = (on && rows > 0)
        .then(|| {
            ops.iter()
                .zip(kv)
                .map(|(&op, (base, layout))| {
                    let tma_box = TmaBox { cols: TmaBox::COLS, rows };
                    Some((op, encode(layout.address(base), layout, dtype, tma_box)?))
                })
                .collect()
        })
        .flatten();
    match maps {
        Some(maps) => (Some(maps), rows),
        None => (Some(ops.map(|op| (op, TensorMap::ZERO)).into_iter().collect()), 0),
    }
}

/// Keys per box of a paged launch's [`kv_boxes`]: a tile's (`block_n`)
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
    let rows = tma_box.rows;
    const ELEM: u64 = 2;
    let [batch, seq, head] = layout.strides;
    // Innermost first. An empty axis is never read (no tile is visited),
    // but a descriptor's sizes must be at least 1.
    let dims = [layout.dim, layout.seq, layout.heads, layout.batch].map(|n| (n as u64).max(1));
    let mut strides = [0u64; 3];
    for (out, (stride, size)) in strides.iter_mut().zip([(seq, dims[1]), (head, dims[2]), (batch, dims[3])]) {
        let bytes = u64::try_from(stride).ok()? * ELEM;
        // A size-1 axis is only ever read at index 0: any legal stride does.
        *out = if size == 1 { 16 } else { bytes };
        if *out == 0 || *out % 16 != 0 || *out >= 1 << 40 {
            return None;
        }
    }
    if !ptr.is_multiple_of(16) || dims.iter().any(|&n| n > u64::from(u32::MAX)) || rows == 0 || rows > 256 {
        return None;
    }
    let data_type = match dtype {
        Dtype::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Dtype::Bf16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let boxes = [tma_box.cols, rows, 1, 1];
    let element_strides = [1u32; 4];
    let mut map = TensorMap::ZERO;
    // SAFETY: every array has the rank's length (strides one less), `map`
    // is a 128-byte aligned CUtensorMap, and the driver only reads `ptr`.
    let result = unsafe {
        cuTensorMapEncodeTiled(
            &mut map.0,
            data_type,
            4,
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
