//! Which K/V tiles a decode CTA visits: those the mask may keep for one of
//! its rows, by the kit's interval analysis of the mask (`tile_class`),
//! so a sliding window's step reads the window, not the whole cache. The
//! splits divide the band from the first such tile to the last (found by
//! all threads at once, a few tiles each), so a window's tiles spread over
//! every split; a tile the analysis drops inside the band is neither loaded
//! nor multiplied, its pipeline slot committing an empty group so the
//! waits keep their count.

use crate::cuda::kit::tile_class::tile_class_expr;
use crate::cuda::writer::Writer;
use crate::spec::{Builtin, Spec};
use std::fmt::{self, Write};

/// Whether the kernel classifies tiles: a mask that does not read `h`
/// (the rows of a decode tile are several heads, the analysis one point).
pub(super) fn classifies(spec: &Spec) -> bool {
    spec.mask.as_ref().is_some_and(|m| !m.uses(Builtin::H))
}

/// `tile_kept(j)`: whether the mask may keep a pair of tile j's keys and
/// the CTA's query tokens; `[band_begin, band_end)`: the tiles from the
/// first kept one to the last.
pub(super) fn write_tile_kept(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let class = match tile_class_expr(spec) {
        Some(class) if classifies(spec) => class,
        _ => {
            writeln!(w, "auto tile_kept = [](int) {{ return true; }};  // every tile may hold kept pairs")?;
            return writeln!(w, "const int band_begin = 0, band_end = kv_tiles;");
        }
    };
    writeln!(w, "// Tiles the mask drops for every row (interval analysis over the CTA's")?;
    writeln!(w, "// query tokens and the tile's keys) are neither loaded nor multiplied.")?;
    writeln!(w, "const int q_first = row0 / group, q_last = (min(row0 + BLOCK_M, rows) - 1) / group;")?;
    writeln!(w, "auto tile_kept = [&](int j) -> bool {{")?;
    w.indented(|w| {
        // A class may not read every bound.
        writeln!(
            w,
            "[[maybe_unused]] const int q_lo = q_first, q_hi = q_last, k_lo = j * BLOCK_N, k_hi = k_lo + BLOCK_N - 1;"
        )?;
        writeln!(w, "return {class}.hi != 0;")
    })?;
    writeln!(w, "}};")?;
    w.write_str(
        "\
__shared__ int band[2];  // the first and last kept tile
if (threadIdx.x == 0) {
    band[0] = kv_tiles;
    band[1] = -1;
}
__syncthreads();
int first_kept = kv_tiles, last_kept = -1;
for (int j = threadIdx.x; j < kv_tiles; j += THREADS) {
    if (tile_kept(j)) {
        first_kept = min(first_kept, j);
        last_kept = j;
    }
}
if (last_kept >= 0) {
    atomicMin(&band[0], first_kept);
    atomicMax(&band[1], last_kept);
}
__syncthreads();
const int band_begin = band[0], band_end = max(band[1] + 1, band_begin);
",
    )
}
