//! The dK/dV kernel's tiles a launch may choose among ([`BackwardTile`]):
//! the runtime's preferred one first, then every other the emitters
//! generate for the spec that fits the target's shared memory.

use super::{dkdv, dkdv_wgmma, BackwardConfig, KeyColumns};
use crate::cuda::target::{pad16, Mma, Target};
use crate::cuda::tile_config::TileCopy;
use crate::spec::Spec;
use std::fmt;

/// The dK/dV kernel's tile: its MMA, its warps, how they hold dK's and dV's
/// columns, and the queries of a step. The other backward kernels do not
/// depend on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardTile {
    pub mma: Mma,
    pub warps: u32,
    pub columns: KeyColumns,
    pub block_m: u32,
}

impl fmt::Display for BackwardTile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mma = match self.mma {
            Mma::Sync => "mma.sync",
            Mma::Wgmma => "wgmma",
        };
        let columns = match self.columns {
            KeyColumns::Whole => "whole columns",
            KeyColumns::Halves => "column halves",
            KeyColumns::Transposed => "transposed",
        };
        write!(f, "{mma}, {} warps, {columns}, {}-query steps", self.warps, self.block_m)
    }
}

/// Warps, query steps and column splits the `mma.sync` kernel is generated
/// in: warps a multiple of its column parts, steps of 16 to 64 queries.
const SYNC_WARPS: [u32; 3] = [2, 4, 8];
const SYNC_BLOCK_M: [u32; 3] = [16, 32, 64];

impl BackwardTile {
    /// The Hopper kernel's tile with `columns` and `block_m`-query steps
    /// (see `dkdv_wgmma::Layout`).
    pub(super) fn hopper(columns: KeyColumns, block_m: u32) -> BackwardTile {
        BackwardTile { mma: Mma::Wgmma, warps: dkdv_wgmma::WARPS, columns, block_m }
    }

    /// The Hopper kernel's tiles, preferred first: whole columns in
    /// 128-query steps (d = 64 only), in 80-query steps (d = 128 only), in
    /// 64-query steps, transposed (129 to 256), then column halves.
    pub(super) fn hopper_tiles() -> [BackwardTile; 5] {
        let steps = dkdv_wgmma::DQ_ROWS;
        [
            BackwardTile::hopper(KeyColumns::Whole, 2 * steps),
            BackwardTile::hopper(KeyColumns::Whole, dkdv_wgmma::TRANSPOSED_DQ_STEP),
            BackwardTile::hopper(KeyColumns::Whole, steps),
            BackwardTile::hopper(KeyColumns::Transposed, steps),
            BackwardTile::hopper(KeyColumns::Halves, steps),
        ]
    }
}

impl BackwardConfig {
    /// This configuration's dK/dV tile.
    pub fn tile(self) -> BackwardTile {
        let BackwardConfig { mma, warps, columns, block_m, .. } = self;
        BackwardTile { mma, warps, columns, block_m }
    }

    /// This configuration with the dK/dV kernel in `tile` (one of
    /// [`Self::tiles`]): the Hopper kernel copies with TMA where the runtime
    /// can address the operands, the `mma.sync` one with its threads.
    pub fn with_tile(self, tile: BackwardTile) -> BackwardConfig {
        let BackwardTile { mma, warps, columns, block_m } = tile;
        let copy = match mma {
            Mma::Wgmma => TileCopy::Tma,
            Mma::Sync => TileCopy::Threads,
        };
        BackwardConfig { mma, warps, columns, block_m, copy, ..self }
    }

    /// The dK/dV tiles of `spec` on `target`, [`Self::preferred`]'s first:
    /// on Hopper the wgmma kernel's (whole columns or halves) where it
    /// covers the head dims, then
    /// every `mma.sync` tile whose shared memory fits a CTA (column halves
    /// where both head dims' halves are whole 16-column steps). Each
    /// computes the same gradients.
    pub fn tiles(spec: &Spec, target: Target) -> Vec<BackwardTile> {
        let preferred = BackwardConfig::preferred(spec, target);
        let mut tiles = vec![preferred.tile()];
        for hopper in BackwardTile::hopper_tiles() {
            if target.mma == Mma::Wgmma && preferred.with_tile(hopper).lays_out(spec) {
                tiles.push(hopper);
            }
        }
        let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
        let halves = dp % 32 == 0 && dvp % 32 == 0;
        let limit = target.smem_per_sm - target.smem_reserved_per_cta;
        for columns in [KeyColumns::Whole, KeyColumns::Halves].into_iter().filter(|&c| halves || c == KeyColumns::Whole)
        {
            for warps in SYNC_WARPS.into_iter().filter(|w| w % (2 * columns.parts()) == 0) {
                for block_m in SYNC_BLOCK_M {
                    let tile = BackwardTile { mma: Mma::Sync, warps, columns, block_m };
                    if dkdv::smem_bytes(spec, preferred.with_tile(tile)) <= limit {
                        tiles.push(tile);
                    }
                }
            }
        }
        let mut unique = Vec::with_capacity(tiles.len());
        for tile in tiles {
            if !unique.contains(&tile) {
                unique.push(tile);
            }
        }
        unique
    }
}
