//! Hoisted spec terms per tile: filling a tile's per-column terms, split
//! so that the mask's own terms load only where a tile is not `interior`.
//! Shared by the forward and the backward.

use crate::abi::ArgKind;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::{Hoisted, Level};
use crate::cuda::signature::{arg_name, c_type};
use crate::cuda::writer::Writer;
use crate::spec::{Expr, Spec};
use std::fmt::{self, Write};

/// How a tile's per-key spec terms reach the threads that read them.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyTerms {
    /// Each thread evaluates the terms of its own 32 keys.
    PerThread,
    /// The producer evaluates each visited tile's terms into a slot of
    /// shared memory (`staged_inv_N[KEY_SLOTS][BLOCK_N]`, visited tile `it`
    /// in slot `it % KEY_SLOTS`) and publishes them with its K; the
    /// consumers' logit reads them there. One evaluation per key instead of
    /// 32 per consumer thread (a tensor read is ~7 instructions: clip,
    /// 64-bit offset, load), and no load latency or barrier on the
    /// consumers' path. Read in place, not copied to registers: 32 of them
    /// beside S, O and P spill the three-warpgroup kernel.
    ///
    /// One slot more than the ring has stages, so K's stage still goes back
    /// once S is done: the producer fills tile `it`'s slot after every
    /// consumer warp released tile `it - STAGES`'s K, so after each is done
    /// with the logit of tile `it - STAGES - 1`, the slot's last reader.
    Staged,
}

/// Fills the per-column arrays of the hoisted terms at `level` for the tile
/// whose first column is `first_col`, with the column's built-in bound as
/// `var`. The forward's columns are keys (`Level::Column`, `k`, from `kv0`);
/// the backward's dK/dV kernel has queries as columns (`Level::Row`).
pub(crate) fn write_column_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[&Hoisted],
    level: Level,
    var: &str,
    first_col: &str,
) -> fmt::Result {
    for h in hoisted.iter().filter(|h| h.level == level) {
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for (int n = 0; n < S_TILES; ++n)"), |w| {
            writeln!(w, "#pragma unroll")?;
            w.block(format_args!("for (int c = 0; c < 2; ++c)"), |w| {
                writeln!(w, "const int {var} = {first_col} + n * 8 + 2 * t + c;")?;
                writeln!(w, "{}[n][c] = {};", h.name, c_expr(spec, h.expr))
            })
        })?;
    }
    Ok(())
}

/// Fills the hoisted terms of `level` for the tile whose first column
/// (`var`) is `first_col` (see [`write_split_terms`]).
pub(crate) fn write_tile_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    level: Level,
    var: &str,
    first_col: &str,
    keys: KeyTerms,
) -> fmt::Result {
    write_split_terms(w, spec, hoisted, level, |w, terms| match keys {
        KeyTerms::PerThread => write_column_terms(w, spec, terms, level, var, first_col),
        KeyTerms::Staged => write_stage_pointers(w, terms, "it % KEY_SLOTS"),
    })
}

/// `write`s the hoisted terms of `level`: those of the mask alone only
/// where a tile is not `interior` ([`interior_decl`]): the logit never
/// reads them there, and under a document mask most visited tiles are such.
pub(crate) fn write_split_terms<'h, 's>(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &'h [Hoisted<'s>],
    level: Level,
    write: impl Fn(&mut Writer<String>, &[&'h Hoisted<'s>]) -> fmt::Result,
) -> fmt::Result {
    let (mask_terms, terms): (Vec<&Hoisted>, Vec<&Hoisted>) =
        hoisted.iter().filter(|h| h.level == level).partition(|h| in_mask(spec, h));
    if !terms.is_empty() {
        write(w, &terms)?;
    }
    if mask_terms.is_empty() {
        return Ok(());
    }
    w.block(format_args!("if (!interior)"), |w| write(w, &mask_terms))
}

/// Whether [`write_split_terms`] reads `interior`: some of `hoisted`'s
/// terms at `level` are the mask's.
pub(crate) fn splits_on_interior(spec: &Spec, hoisted: &[Hoisted], level: Level) -> bool {
    hoisted.iter().any(|h| h.level == level && in_mask(spec, h))
}

/// Whether hoisted term `h` is one of the mask's (not the score's alone).
fn in_mask(spec: &Spec, h: &Hoisted) -> bool {
    let mut found = false;
    if let Some(mask) = &spec.mask {
        mask.walk(&mut |e| found |= std::ptr::eq(e, h.expr));
    }
    found
}

/// [`KeyTerms::Staged`], the consumers: each term's name points at the
/// lane's columns in the tile's `slot` of its staging (`staged_N[slot]`),
/// where the producer put them: `N[n][c]` is column `n * 8 + 2 * t + c`.
pub(crate) fn write_stage_pointers(w: &mut Writer<String>, hoisted: &[&Hoisted], slot: &str) -> fmt::Result {
    for h in hoisted {
        let (ty, name) = (c_type(h.expr.ty), &h.name);
        writeln!(w, "{name} = (const {ty} (*)[8])&staged_{name}[{slot}][2 * t];")?;
    }
    Ok(())
}

/// The declaration of a staged term's pointer (see [`write_stage_pointers`]),
/// at slot 0 until a tile points it at its own.
pub(crate) fn stage_pointer_decl(h: &Hoisted) -> String {
    let (ty, name) = (c_type(h.expr.ty), &h.name);
    format!("const {ty} (*{name})[8] = (const {ty} (*)[8])&staged_{name}[0][2 * t];")
}

/// The spec's mask and score, the expressions its terms are hoisted from.
pub(crate) fn spec_exprs(spec: &Spec) -> Vec<&Expr> {
    spec.mask.iter().chain(spec.score.iter()).collect()
}

/// The per-key terms among `hoisted`.
pub(crate) fn key_terms<'h, 's>(hoisted: &'h [Hoisted<'s>]) -> impl Iterator<Item = &'h Hoisted<'s>> {
    hoisted.iter().filter(|h| h.level == Level::Column)
}

/// `interior`: the tile whose first key is `first_key` is kept whole and
/// every key exists, so the spec runs without mask or bounds code there
/// (`logit_interior`, `logit_whole`) and the mask's per-column terms are not
/// loaded. Everywhere else they are, and the logit may evaluate the mask.
pub(crate) fn interior_decl(spec: &Spec, first_key: &str) -> String {
    let kv_len = arg_name(spec, ArgKind::KvLen);
    format!("const bool interior = full && {first_key} + BLOCK_N <= {kv_len};  // kept whole, every key present\n")
}
