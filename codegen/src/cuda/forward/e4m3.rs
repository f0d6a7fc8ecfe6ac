//! The forward on e4m3 operands (Hopper): Q, K and V one byte an element,
//! each with f32 descale factors, O in the spec's 16-bit dtype. It is the
//! warp-specialized TMA kernel with three differences, all decided here:
//!
//! - Operand tiles are read as 16-bit tiles of half the columns: the copy
//!   engine and the 128-byte swizzle move bytes, so a 128-byte panel holds
//!   128 elements and every address computation stays as it is.
//! - S = Q·Kᵀ and O += P·V run on m64nNk32 e4m3 wgmma. 8-bit wgmma reads B
//!   K-major only, so P·V reads V from tiles the runtime first rewrites with
//!   their keys along the rows (`cuda::e4m3_v_tiles`), in the key order
//!   `pack_p_e4m3` leaves P's bytes in: P goes from the S accumulators to
//!   the A fragment without moving a byte between lanes.
//! - The descales fold into the softmax scale (Q's and K's) and into O's
//!   final factor (V's), per K/V head or per tensor.

use crate::abi::{ArgKind, Operand};
use crate::cuda::e4m3_v_tiles::e4m3_v_row;
use crate::cuda::signature::arg_name;
use crate::cuda::target::{pad16, Mma, Target};
use crate::cuda::tile_config::{pipelined, warp_specialized, TileConfig};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// The element format of Q, K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Operands {
    /// The spec's dtype, as O.
    Sixteen,
    /// e4m3, with descale factors; O in the spec's dtype.
    E4m3,
}

impl Operands {
    /// Elements of one wgmma k-step: 32 bytes of a 128-byte row.
    pub(super) fn k_step(self) -> u32 {
        match self {
            Operands::Sixteen => 16,
            Operands::E4m3 => 32,
        }
    }

    /// The S product's wgmma wrapper, less its width.
    pub(super) fn s_wrapper(self) -> &'static str {
        match self {
            Operands::Sixteen => "wgmma_ss",
            Operands::E4m3 => "wgmma_ss_e4m3",
        }
    }
}

/// Whether `spec` runs on e4m3 operands in `config` on `target`: the
/// pipelined warp-specialized wgmma kernels of one m64 product per
/// warpgroup (its P V and P's packing take one) with tiles of whole 32-key
/// k-steps from 96 keys up to 256 (a TMA box), a QK head dim of whole 32-element k-steps, a V head dim of whole 16-bit
/// columns (its rows a TMA box of at most 256), within the SM's shared
/// memory.
pub fn e4m3_supports(spec: &Spec, config: TileConfig, target: Target) -> bool {
    let (qk, v) = (spec.head_dims.qk, spec.head_dims.v);
    target.mma == Mma::Wgmma
        && config.mma == Mma::Wgmma
        && warp_specialized(config)
        && pipelined(config)
        && config.m_tiles == 1
        && config.block_n.is_multiple_of(32)
        && (96..=256).contains(&config.block_n)
        && qk.is_multiple_of(32)
        && v.is_multiple_of(16)
        && v <= 256
        && {
            let smem = config.smem_with(spec, e4m3_tile_bytes(spec, config));
            smem.bytes <= config.smem_budget(spec)
        }
}

/// Bytes of an e4m3 kernel's Q buffer (as wide as O, which it stages) and
/// of one K/V stage: K's rows of bytes, V's tile of `pad16(DV)` rows of
/// [`e4m3_v_row`] bytes.
pub(super) fn e4m3_tile_bytes(spec: &Spec, config: TileConfig) -> (u32, u32) {
    let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
    let qk_cols = (dp / 2).next_multiple_of(64);
    let o_cols = dvp.next_multiple_of(64);
    (2 * config.block_m() * qk_cols.max(o_cols), 2 * config.block_n * qk_cols + dvp * e4m3_v_row(config.block_n))
}

/// The e4m3 kernel's configuration lines after the 16-bit kernel's
/// (`constants`): its tiles' columns and sizes.
pub(super) fn write_e4m3_tiles(w: &mut Writer<String>, spec: &Spec, config: TileConfig) -> fmt::Result {
    let qk_cols = (pad16(spec.head_dims.qk) / 2).next_multiple_of(64);
    write!(
        w,
        "\
        // e4m3 operands: Q and K tiles hold bytes, read as 16-bit columns (a\n\
        // 128-byte panel holds 128 elements); V_COLS are O's columns.\n\
        constexpr int QK_COLS = {qk_cols};\n\
        constexpr int V_COLS = {};\n\
        // V tiles: DVP rows of the tile's keys in 128-byte panels (`e4m3_v_tiles`).\n\
        constexpr int V_PANELS = {};\n",
        pad16(spec.head_dims.v).next_multiple_of(64),
        e4m3_v_row(config.block_n) / 128
    )
}

/// The consumers' descales of the item's K/V head: Q's and K's times the
/// softmax scale as `qk_scale`, V's as `v_scale`.
pub(super) fn write_descales(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let name = |kind| arg_name(spec, kind);
    let [heads, heads_kv, scale] = [ArgKind::Heads, ArgKind::HeadsKv, ArgKind::Scale].map(name);
    let factor = |op| format!("{}[kv_head * {}]", name(ArgKind::Descale(op)), name(ArgKind::DescaleStride(op)));
    let [q, k, v] = [Operand::Q, Operand::K, Operand::V].map(factor);
    write!(
        w,
        "\
        // e4m3 descales of the item's K/V head: Q's and K's scale the logits,\n\
        // V's the output.\n\
        const int kv_head = h / ({heads} / {heads_kv});\n\
        const float qk_scale = {scale} * {q} * {k};\n\
        const float v_scale = {v};\n"
    )
}

/// O += P·V on e4m3 operands, uncommitted: P from the registers `p` (see
/// `pack_p_e4m3`), V K-major from the V tile at `v_smem`, 32 keys (bytes of
/// a panel's rows) a step.
pub(super) fn write_pv_e4m3(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int kk = 0; kk < BLOCK_N / 32; ++kk) {{\n\
        \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
        \x20   wgmma_rs_e4m3_n{dvp}(o[0], p[0][kk], desc_plus(gmma_desc(v_smem, 16, 1024), panel * DVP * 128 + step));\n\
        }}\n",
        dvp = pad16(spec.head_dims.v)
    )
}
