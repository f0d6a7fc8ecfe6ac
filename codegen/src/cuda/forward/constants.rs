//! The kernel's `constexpr` block: dtype, head dims, tile sizes, stages,
//! the warp-specialized register split and the shared tiles' sizes.

use super::e4m3::{write_e4m3_tiles, Operands};
use super::global_columns::write_column_constants;
use super::mma::{tile_cols, ShmemCols};
use super::plan::{Plan, Regs};
use crate::cuda::kit::tile_walk::write_mask_tiles;
use crate::cuda::target::{pad16, Mma};
use crate::cuda::tile_config::{warp_specialized, TileConfig, PRODUCER_THREADS};
use crate::cuda::writer::Writer;
use crate::spec::Dtype;
use std::fmt::{self, Write};

pub(super) fn write_config(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let (spec, config) = (plan.spec, plan.config);
    let storage = match spec.dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    let formats = match plan.operands {
        Operands::Sixteen => "Q, K, V and O",
        Operands::E4m3 => "O (Q, K and V are e4m3)",
    };
    let (d, dv) = (spec.head_dims.qk, spec.head_dims.v);
    let (dp, dvp) = (pad16(d), pad16(dv));
    let TileConfig { mma, warps, m_tiles, block_n } = config;
    write!(
        w,
        "\
        // ---- kernel configuration ---------------------------------------------------\n\
        using storage = {storage};  // element format of {formats}\n\
        constexpr int D = {d};  // Q/K head dim\n\
        constexpr int DV = {dv};  // V/O head dim\n\
        constexpr int DP = (D + 15) / 16 * 16;  // D padded to the MMA k-step (zeros beyond D)\n\
        constexpr int DVP = (DV + 15) / 16 * 16;  // DV padded to pairs of 8-wide MMA tiles\n\
        constexpr int WARPS = {warps};\n\
        constexpr int THREADS = 32 * WARPS;  // the threads that multiply\n\
        constexpr int M_TILES = {m_tiles};  // 16-row MMA tiles per warp\n\
        constexpr int WARP_M = 16 * M_TILES;  // query rows per warp\n\
        constexpr int BLOCK_M = WARP_M * WARPS;  // query rows per CTA: grid.x = ceil(q_len / BLOCK_M)\n\
        constexpr int BLOCK_N = {block_n};  // keys per K/V tile\n\
        constexpr int S_TILES = BLOCK_N / 8;  // m16n8 accumulator tiles of a warp's S\n\
        constexpr int O_TILES = DVP / 8;  // m16n8 accumulator tiles of a warp's O\n\
        // Shared memory: the Q tile, then STAGES pipeline stages of K and of V tiles.\n"
    )?;
    write_tile_row(w, mma)?;
    if let Some(Regs { launch, producer, consumer }) = plan.regs {
        let groups = config.warps / 4;
        write!(
            w,
            "\
            // Warp specialization: one more warpgroup copies Q and the K/V tiles into\n\
            // a ring of STAGES stages (see the stage ring above) and hands most of its\n\
            // registers to the {groups} warpgroups that multiply ({launch} each at launch: {producer} + {groups} x {consumer}).\n\
            constexpr int WARPGROUPS = WARPS / 4;  // consumer warpgroups, 64 * M_TILES rows each\n\
            constexpr int PRODUCER_THREADS = {PRODUCER_THREADS};\n\
            constexpr int CTA_THREADS = THREADS + PRODUCER_THREADS;\n\
            constexpr int PRODUCER_REGS = {producer};\n\
            constexpr int CONSUMER_REGS = {consumer};\n"
        )?;
    } else {
        writeln!(w, "constexpr int CTA_THREADS = THREADS;")?;
    }
    writeln!(w, "constexpr int STAGES = {};  // K/V pipeline stages", plan.stages)?;
    let cols = ShmemCols::of(mma);
    if plan.operands == Operands::E4m3 {
        write_e4m3_tiles(w, spec, config)?;
    } else if mma == Mma::Wgmma {
        writeln!(w, "// wgmma reads whole 64-column panels (zeros beyond DP and DVP).")?;
        writeln!(w, "constexpr int QK_COLS = {};", tile_cols(mma, dp))?;
        writeln!(w, "constexpr int V_COLS = {};", tile_cols(mma, dvp))?;
    }
    let ShmemCols { qk, v, .. } = cols;
    if warp_specialized(config) {
        let (q_note, o_tile) = match plan.o_buffer {
            true => ("", "BLOCK_M * V_COLS;  // O's own staging buffer"),
            false => ("; it also stages O", "0;  // O is staged in the item's Q buffer"),
        };
        writeln!(w, "constexpr int Q_TILE = BLOCK_M * (QK_COLS > V_COLS ? QK_COLS : V_COLS);  // a Q buffer{q_note}")?;
        // Inline: the trace harness sizes shared memory from it where no
        // pointer into the layout reads it.
        writeln!(w, "inline constexpr int O_TILE = {o_tile}")?;
    } else {
        writeln!(w, "constexpr int Q_TILE = BLOCK_M * {qk};")?;
    }
    writeln!(w, "constexpr int K_TILE = BLOCK_N * {qk};")?;
    match plan.operands {
        Operands::Sixteen => writeln!(w, "constexpr int V_TILE = BLOCK_N * {v};")?,
        Operands::E4m3 => {
            writeln!(w, "constexpr int V_TILE = DVP * V_PANELS * 64;  // DVP rows of the tile's keys' bytes")?
        }
    }
    if let Some(columns) = plan.columns {
        write_column_constants(w, columns)?;
    }
    write_mask_tiles(w, spec)
}

/// `tile_row(warp, mt)`: the first of BLOCK_M's rows in a warp's MMA tile
/// `mt` (the lane's rows are g and g + 8 past it).
fn write_tile_row(w: &mut Writer<String>, mma: Mma) -> fmt::Result {
    let (layout, row) = match mma {
        Mma::Sync => ("a warp holds WARP_M consecutive rows", "warp * WARP_M + mt * 16"),
        Mma::Wgmma => (
            "a warpgroup holds 64 * M_TILES\n// consecutive rows, its m64 product mt rows mt * 64 on, 16 of them per warp",
            "warp / 4 * 64 * M_TILES + mt * 64 + warp % 4 * 16",
        ),
    };
    writeln!(w, "// The first row of a warp's MMA tile mt: {layout}.")?;
    writeln!(w, "__device__ __forceinline__ int tile_row(int warp, int mt) {{ return {row}; }}")
}
