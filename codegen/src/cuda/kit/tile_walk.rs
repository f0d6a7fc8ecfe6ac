//! Walking the K/V (or query) tiles a mask keeps: the block mask's tile
//! sizes, a tile's class in the block mask, and `next_tile`, which skips
//! runs of removed tiles by binary search. Shared by every kernel.

use crate::cuda::signature::names::{BLOCK_MASK, BLOCK_MASK_BATCH_STRIDE, BLOCK_MASK_HEAD_STRIDE};
use crate::cuda::tile_config::TileConfig;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// The tile sizes at which a block mask is built ([`TileConfig::mask_tile`]);
/// nothing for a spec without a mask, which no block mask refines.
pub(crate) fn write_mask_tiles(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    if spec.mask.is_none() {
        return Ok(());
    }
    let (rows, keys) = TileConfig::mask_tile(spec);
    writeln!(w, "// A block mask holds one class per MASK_M x MASK_N tile.")?;
    writeln!(w, "constexpr int MASK_M = {rows};")?;
    writeln!(w, "constexpr int MASK_N = {keys};")
}

/// The lambda `name(j)`: the class of tile j (queries `q_span`, keys
/// `k_span`, each "lo, hi" in C) in the block mask's slice of (`b`, `h`) at
/// the call (a walk over several heads moves `h`), combined over the mask
/// tiles it overlaps; 1 (undecided) without a mask.
pub(crate) fn write_block_class(
    w: &mut Writer<String>,
    name: &str,
    kv_len: &str,
    q_span: &str,
    k_span: &str,
) -> fmt::Result {
    write!(
        w,
        "\
        const int mask_kv_tiles = ({kv_len} + MASK_N - 1) / MASK_N;\n\
        auto {name} = [&](int j) {{\n\
        \x20   if ({BLOCK_MASK} == nullptr) return 1;\n\
        \x20   const unsigned char* slice = {BLOCK_MASK} + b * {BLOCK_MASK_BATCH_STRIDE} + h * {BLOCK_MASK_HEAD_STRIDE};\n\
        \x20   return coarse_class<MASK_M, MASK_N>(slice, mask_kv_tiles, {q_span}, {k_span});\n\
        }};\n"
    )
}

/// The `next_tile` lambda over `tiles` tiles: the first tile from j on that
/// keeps a pair, by the `span_class` lambda and, per tile, the C condition
/// `empty` (true where a finer source says the tile keeps no pair). A
/// visited next tile costs one span evaluation; a run of tiles the analysis
/// rules out whole (the far side of a sliding window, other documents) is
/// skipped by binary search over the spans from j, which only grow.
///
/// With `warp_scan`, a whole warp calls it with the same j (C `lane` is the
/// lane), and where the analysis keeps tile j the warp tests tiles j to
/// j + 31 at once: a run of tiles that only `empty` removes (other documents
/// of a block mask) then costs one round of independent loads per 32 tiles,
/// not a dependent load per tile.
pub(crate) fn write_next_tile(w: &mut Writer<String>, tiles: &str, empty: &str, warp_scan: bool) -> fmt::Result {
    let kept = if warp_scan {
        format!(
            "\
            \x20           const int mine = j + lane;\n\
            \x20           const bool kept = mine < {tiles} && span_class(mine, mine + 1).hi != 0 && !removed(mine);\n\
            \x20           const unsigned ahead = __ballot_sync(0xffffffffu, kept);\n\
            \x20           if (ahead != 0) return j + __ffs(ahead) - 1;\n\
            \x20           j += 32;\n"
        )
    } else {
        format!("\x20           if (!({empty})) return j;\n\x20           ++j;\n")
    };
    if warp_scan {
        writeln!(w, "// Where the block mask alone removes tiles (other documents), a warp")?;
        writeln!(w, "// tests 32 at once: every lane of a warp walks with the same j.")?;
        writeln!(w, "auto removed = [&](int j) {{ return {empty}; }};")?;
    }
    write!(
        w,
        "\
        auto next_tile = [&](int j) {{\n\
        \x20   while (j < {tiles}) {{\n\
        \x20       if (span_class(j, j + 1).hi != 0) {{\n\
        {kept}\
        \x20           continue;\n\
        \x20       }}\n\
        \x20       // Tiles [j, lo) keep no pair; [j, hi) keeps one, or hi is the end.\n\
        \x20       int lo = j + 1, hi = {tiles};\n\
        \x20       if (span_class(j, hi).hi == 0) return hi;\n\
        \x20       while (hi - lo > 1) {{\n\
        \x20           const int mid = lo + (hi - lo) / 2;\n\
        \x20           if (span_class(j, mid).hi == 0) lo = mid; else hi = mid;\n\
        \x20       }}\n\
        \x20       j = lo;\n\
        \x20   }}\n\
        \x20   return j;\n\
        }};\n"
    )
}
