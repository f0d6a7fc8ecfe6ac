//! What the forward does differently per MMA kind, in one place: the
//! shared tiles' layout (row-major 16-column chunks for `mma.sync`'s
//! `ldmatrix`, 64-column panels in 1024-byte atoms for `wgmma`'s
//! descriptors), the operand addressing each lane or warpgroup starts
//! from, how a tile becomes visible to the tensor cores, and which step
//! multiplies a tile (`cta::write_cta_step`). A new MMA kind adds its arms
//! here and its step module (as `sync_step` and `wgmma_step`).

use crate::cuda::target::Mma;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// The shared-tile column counts and layout flag `load_tile` gets, as C.
#[derive(Clone, Copy)]
pub(super) struct ShmemCols {
    pub(super) qk: &'static str,
    pub(super) v: &'static str,
    /// `load_tile`'s trailing template argument: wgmma's panel layout.
    pub(super) panels: &'static str,
}

impl ShmemCols {
    pub(super) fn of(mma: Mma) -> ShmemCols {
        match mma {
            Mma::Sync => ShmemCols { qk: "DP", v: "DVP", panels: "" },
            Mma::Wgmma => ShmemCols { qk: "QK_COLS", v: "V_COLS", panels: ", true" },
        }
    }
}

/// Columns a shared tile of `padded` (a head dim padded to 16) occupies:
/// wgmma reads whole 64-column panels.
pub(super) fn tile_cols(mma: Mma, padded: u32) -> u32 {
    match mma {
        Mma::Sync => padded,
        Mma::Wgmma => padded.next_multiple_of(64),
    }
}

/// Dynamic shared memory reserved beyond the tiles: wgmma's tiles start at
/// a 1024-byte boundary the launch cannot promise.
pub(super) fn smem_slack(mma: Mma) -> u32 {
    match mma {
        Mma::Sync => 0,
        Mma::Wgmma => 1024,
    }
}

/// The dynamic shared memory's declaration, as `smem`.
pub(super) fn write_smem_decl(w: &mut Writer<String>, mma: Mma) -> fmt::Result {
    match mma {
        Mma::Sync => writeln!(w, "extern __shared__ __align__(128) unsigned short smem[];"),
        Mma::Wgmma => write!(
            w,
            "\
            // wgmma's swizzle atoms are 1024-byte aligned; the launch reserves the slack.\n\
            extern __shared__ __align__(1024) unsigned char smem_raw[];\n\
            unsigned short* smem = (unsigned short*)(smem_raw + (1024 - smem_addr(smem_raw) % 1024) % 1024);\n"
        ),
    }
}

/// Where this lane's (or warpgroup's) operands start in the Q, K and V
/// tiles.
pub(super) fn write_operand_lanes(w: &mut Writer<String>, mma: Mma) -> fmt::Result {
    match mma {
        Mma::Sync => write!(
            w,
            "\
            // ldmatrix rows of this lane in the Q, K and V tiles (see LdmLane).\n\
            const LdmLane<DP> q_lane(warp * WARP_M + lane % 8 + (lane / 8 % 2) * 8, lane / 16);\n\
            const LdmLane<DP> k_lane(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
            const LdmLane<DVP> v_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);\n\
            const unsigned q_smem = smem_addr(q_tile);\n"
        ),
        Mma::Wgmma => write!(
            w,
            "\
            // This warpgroup's 64 * M_TILES rows of the Q tile (128-byte rows in each panel).\n\
            const unsigned q_smem = smem_addr(q_tile) + warp / 4 * 64 * M_TILES * 128;\n"
        ),
    }
}

/// A CTA loop's barrier once its copies of tile j have landed: the tile
/// becomes visible (to wgmma through the async proxy), and the stage the
/// next loads overwrite is free.
pub(super) fn write_tiles_visible(w: &mut Writer<String>, mma: Mma) -> fmt::Result {
    match mma {
        Mma::Wgmma => {
            writeln!(w, "fence_async_smem();  // the tensor cores read the tiles through the async proxy")?;
            writeln!(w, "__syncthreads();  // this iteration's tiles are visible; the stages the loads")?;
            writeln!(w, "                  // below overwrite are done with (their products were waited for)")
        }
        Mma::Sync => {
            writeln!(w, "__syncthreads();  // tile j is visible, and every warp is done with the previous one")
        }
    }
}
