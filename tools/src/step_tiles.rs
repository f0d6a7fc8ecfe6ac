//! `flashgen-bench --bwd-tiles` and `--e4m3-tiles`: which dK/dV tiles a
//! suite times the training step in, and the names its rows give them; the
//! e4m3 forward's tiles.

use flashgen::codegen::cuda::{BackwardConfig, BackwardTile, KeyColumns, Mma, Target, TileConfig};
use flashgen::Spec;

/// The dK/dV tiles a suite times the training step in.
pub enum StepTiles {
    /// The runtime's choice.
    Preferred,
    Listed(Vec<BackwardTile>),
    /// Every tile of the spec on the GPU (`BackwardConfig::tiles`).
    All,
}

impl StepTiles {
    /// The tiles a training step of `spec` on `target` is timed in, each
    /// a row ([`step_row`]); `None` is the runtime's choice.
    pub fn of(&self, spec: &Spec, target: Target) -> Vec<Option<BackwardTile>> {
        match self {
            StepTiles::Preferred => vec![None],
            StepTiles::Listed(tiles) => tiles.iter().copied().map(Some).collect(),
            StepTiles::All => BackwardConfig::tiles(spec, target).into_iter().map(Some).collect(),
        }
    }
}

/// The row of forward row `name`'s training step in `tile`:
/// `<name>+bwd`, or `<name>+bwd@<tile>` for a tile asked for.
pub fn step_row(name: &str, tile: Option<BackwardTile>) -> String {
    tile.map_or(format!("{name}+bwd"), |t| format!("{name}+bwd@{}", tile_label(t)))
}

/// `--bwd-tiles`' value: `all`, or tiles separated by `/`.
pub fn parse_step_tiles(text: &str) -> Result<StepTiles, String> {
    match text {
        "" => Ok(StepTiles::Preferred),
        "all" => Ok(StepTiles::All),
        _ => text
            .split('/')
            .map(|t| {
                parse_backward_tile(t)
                    .ok_or(format!("`{t}` is not `warps,whole|halves,block_m`, `wgmma`, `wgmma,128`, `wgmma,80`, `wgmma,transposed` or `wgmma,halves`"))
            })
            .collect::<Result<_, _>>()
            .map(StepTiles::Listed),
    }
}

/// A dK/dV tile as `--bwd-tiles` names it (and its rows, [`tile_label`]):
/// `warps,whole|halves,block_m`, `wgmma` (64-query steps), `wgmma,128`,
/// `wgmma,80`, `wgmma,transposed` or `wgmma,halves`.
pub fn parse_backward_tile(text: &str) -> Option<BackwardTile> {
    let hopper = |columns, block_m| BackwardTile { mma: Mma::Wgmma, warps: 8, columns, block_m };
    match text {
        "wgmma" => return Some(hopper(KeyColumns::Whole, 64)),
        "wgmma,128" => return Some(hopper(KeyColumns::Whole, 128)),
        "wgmma,80" => return Some(hopper(KeyColumns::Whole, 80)),
        "wgmma,halves" => return Some(hopper(KeyColumns::Halves, 64)),
        "wgmma,transposed" => return Some(hopper(KeyColumns::Transposed, 64)),
        _ => {}
    }
    let [warps, columns, block_m] = text.split(',').collect::<Vec<_>>().try_into().ok()?;
    let columns = match columns {
        "whole" => KeyColumns::Whole,
        "halves" => KeyColumns::Halves,
        _ => return None,
    };
    Some(BackwardTile { mma: Mma::Sync, warps: warps.parse().ok()?, columns, block_m: block_m.parse().ok()? })
}

/// `tile` as [`parse_backward_tile`] reads it.
pub fn tile_label(tile: BackwardTile) -> String {
    let columns = match tile.columns {
        KeyColumns::Whole | KeyColumns::Transposed => "whole",
        KeyColumns::Halves => "halves",
    };
    match (tile.mma, tile.columns) {
        (Mma::Wgmma, KeyColumns::Whole) if tile.block_m == 64 => "wgmma".to_string(),
        (Mma::Wgmma, KeyColumns::Whole) => format!("wgmma,{}", tile.block_m),
        (Mma::Wgmma, KeyColumns::Halves) => "wgmma,halves".to_string(),
        (Mma::Wgmma, KeyColumns::Transposed) => "wgmma,transposed".to_string(),
        (Mma::Sync, _) => format!("{},{columns},{}", tile.warps, tile.block_m),
    }
}

/// A `--e4m3-tiles` entry: `n` keys with two consumer warpgroups, or
/// `wW:n` with W warps.
pub fn parse_e4m3_tile(text: &str) -> Option<TileConfig> {
    let (warps, keys) = match text.strip_prefix('w').and_then(|t| t.split_once(':')) {
        Some((warps, keys)) => (warps.parse().ok()?, keys),
        None => (8, text),
    };
    Some(TileConfig { mma: Mma::Wgmma, warps, m_tiles: 1, block_n: keys.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every tile a spec lists reads back from its row's name.
    #[test]
    fn tile_labels_read_back() {
        for d in [64, 128, 192, 256] {
            let spec = flashgen::parse_one(&format!("S {{ dtype: bf16, head_dim: {d} }}")).unwrap();
            for tile in BackwardConfig::tiles(&spec, Target::HOPPER) {
                assert_eq!(parse_backward_tile(&tile_label(tile)), Some(tile), "d = {d}: {tile}");
            }
        }
    }

    #[test]
    fn step_tiles_parse() {
        assert!(matches!(parse_step_tiles(""), Ok(StepTiles::Preferred)));
        assert!(matches!(parse_step_tiles("all"), Ok(StepTiles::All)));
        let Ok(StepTiles::Listed(tiles)) = parse_step_tiles("4,halves,32/wgmma") else { panic!("two tiles") };
        assert_eq!(tiles[0], BackwardTile { mma: Mma::Sync, warps: 4, columns: KeyColumns::Halves, block_m: 32 });
        assert_eq!(tiles[1].mma, Mma::Wgmma);
        for bad in ["4,thirds,32", "4,whole", "x,whole,32", "wgmma/"] {
            assert!(parse_step_tiles(bad).is_err(), "{bad}");
        }
    }

    /// A suite's tiles for a spec, and the rows they name.
    #[test]
    fn step_rows_per_tile() {
        let spec = flashgen::parse_one("S { dtype: bf16, head_dim: 128 }").unwrap();
        assert_eq!(StepTiles::Preferred.of(&spec, Target::HOPPER), [None]);
        let all = StepTiles::All.of(&spec, Target::HOPPER);
        assert_eq!(all, BackwardConfig::tiles(&spec, Target::HOPPER).into_iter().map(Some).collect::<Vec<_>>());
        let Ok(listed) = parse_step_tiles("wgmma/wgmma,80") else { panic!("two tiles") };
        let rows: Vec<String> =
            listed.of(&spec, Target::HOPPER).into_iter().map(|t| step_row("doc-varlen", t)).collect();
        assert_eq!(rows, ["doc-varlen+bwd@wgmma", "doc-varlen+bwd@wgmma,80"]);
        assert_eq!(step_row("full", None), "full+bwd");
    }
}
