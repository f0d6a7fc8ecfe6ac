//! Which K/V tiles a decode CTA visits: those the mask may keep for one of
//! its rows, by the kit's interval analysis of the mask (`tile_class`),
//! so a sliding window's step reads the window, not the whole cache. A tile
//! the analysis drops is neither loaded nor multiplied; its pipeline slot
//! still commits an (empty) group, so the waits keep their count.

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
/// the CTA's query tokens.
pub(super) fn write_tile_kept(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let class = match tile_class_expr(spec) {
        Some(class) if classifies(spec) => class,
        _ => return writeln!(w, "auto tile_kept = [](int) {{ return true; }};  // every tile may hold kept pairs"),
    };
    writeln!(w, "// Tiles the mask drops for every row (interval analysis over the CTA's")?;
    writeln!(w, "// query tokens and the tile's keys) are neither loaded nor multiplied.")?;
    writeln!(w, "const int q_first = row0 / group, q_last = (min(row0 + BLOCK_M, rows) - 1) / group;")?;
    writeln!(w, "auto tile_kept = [&](int j) -> bool {{")?;
    w.indented(|w| {
        writeln!(w, "const int q_lo = q_first, q_hi = q_last, k_lo = j * BLOCK_N, k_hi = k_lo + BLOCK_N - 1;")?;
        writeln!(w, "return {class}.hi != 0;")
    })?;
    writeln!(w, "}};")
}
