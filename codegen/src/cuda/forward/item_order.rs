//! The order of a forward's work items (query tiles of every (batch, head))
//! under a mask with global rows ([`GlobalRows`]: Longformer's `q < g`):
//! their query tiles keep every key, so each is the longest item of its
//! (batch, head), and in the usual order (a (batch, head) after another,
//! last rows first) the last one would start near the launch's end and
//! run alone for a whole row of key tiles. With global rows first, the
//! tiles holding them are the launch's first items, query tile by query
//! tile over every (batch, head); then the other tiles of each (batch,
//! head) follow in the usual order. `mask_parts::global_rows_first` is the
//! decode's twin on the CPU.
//!
//! Global rows go first only on dense operands: a varlen kernel's query
//! tiles are counted by its longest sequence.
//!
//! Without global rows, under an analytic mask a persistent kernel's last items
//! ([`write_tail_setup`]) go tile by tile over the last (batch, head) pairs:
//! in the usual order the last pair's longest tile (under a causal mask)
//! starts a pair's worth of items before the end and finishes alone, where
//! this order starts the longest tiles of the last pairs first and ends on
//! their shortest. Without a mask every item is as long as the others, and
//! the usual order keeps a pair's items together to the end.
//!
//! In a persistent kernel the claiming thread alone decodes an item
//! ([`write_claim_decode`]) and leaves its coordinates in shared memory.

use super::plan::Plan;
use crate::abi::ArgKind;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::mask_parts::{GlobalRows, TAIL_ITEMS};
use crate::spec::Spec;
use std::fmt::{self, Write};

/// `dense_tiles`, the query tiles holding a global row (of `q_tiles`, C
/// names of the launch's rows and query tiles), and `dense_items`, their
/// items over the `bhs` (C) (batch, head) pairs.
fn write_dense_tiles(
    w: &mut Writer<String>,
    spec: &Spec,
    rows: GlobalRows,
    q_len: &str,
    q_tiles: &str,
    bhs: &str,
) -> fmt::Result {
    let bound = c_expr(spec, rows.bound);
    let inclusive = if rows.inclusive { " + 1" } else { "" };
    write!(
        w,
        "\
        // Global rows first (see below): the query tiles holding a row that\n\
        // keeps every key, and their items.\n\
        const long long global_rows = (long long){bound}{inclusive};\n\
        const int dense_tiles = global_rows <= 0 ? 0\n\
        \x20   : global_rows >= {q_len} ? {q_tiles} : (int)((global_rows + BLOCK_M - 1) / BLOCK_M);\n\
        const long long dense_items = (long long)dense_tiles * ({bhs});\n"
    )
}

/// A persistent kernel's divisors for [`write_claim_decode`] (with global
/// rows first, their own; under an analytic mask, the tail's bounds), of
/// `q_tiles` query tiles of `q_len` (C) rows.
pub(super) fn write_item_decoders(w: &mut Writer<String>, plan: &Plan, q_len: &str) -> fmt::Result {
    let [heads, batch] = [ArgKind::Heads, ArgKind::Batch].map(|kind| arg_name(plan.spec, kind));
    let bhs = format!("{heads} * {batch}");
    match plan.global_rows {
        Some(rows) => {
            writeln!(w, "const FastDiv by_heads({heads});  // to decode items")?;
            write_dense_tiles(w, plan.spec, rows, q_len, "q_tiles", &bhs)?;
            writeln!(w, "const FastDiv by_bhs({bhs}), by_rest_tiles(q_tiles - dense_tiles);")
        }
        None => {
            writeln!(w, "const FastDiv by_q_tiles(q_tiles), by_heads({heads});  // to decode items")?;
            match plan.longest_tail {
                true => write_tail_setup(w, &bhs),
                false => Ok(()),
            }
        }
    }
}

/// The claiming thread's decode of a claimed item (`item_slot[qb]`, short
/// of the last) into `item_coords[qb]`: the other threads read its
/// (batch, head) and query tile there, and hold no divisor of their own.
/// With `rows` (a varlen kernel's condition on `b_` and `q_block` that the
/// tile has rows in its sequence, and the claim of the next item) it claims
/// on past tiles without rows.
pub(super) fn write_claim_decode(w: &mut Writer<String>, plan: &Plan, rows: Option<(&str, &str)>) -> fmt::Result {
    let heads = arg_name(plan.spec, ArgKind::Heads);
    let head = match rows {
        Some(_) => "// Varlen: pass over items whose query tile lies past its sequence's end.\nwhile",
        None => "if",
    };
    w.block(format_args!("{head} (item_slot[qb] < items)"), |w| {
        writeln!(w, "const long long item = item_slot[qb];")?;
        if plan.global_rows.is_some() {
            write_persistent_decode(w)?;
        } else {
            write_pairs_decode(w, plan.longest_tail)?;
        }
        writeln!(w, "const unsigned b_ = by_heads.div(bh);  // bh = b * heads + h")?;
        let store = format!("item_coords[qb] = make_int4((int)b_, (int)(bh - b_ * (unsigned){heads}), q_block, 0);");
        match rows {
            Some((has_rows, next)) => {
                w.block(format_args!("if ({has_rows})"), |w| writeln!(w, "{store}\nbreak;"))?;
                writeln!(w, "item_slot[qb] = {next};")
            }
            None => writeln!(w, "{store}"),
        }
    })
}

/// The persistent kernel's tail (without global rows): `tail_bhs`, the last
/// pairs of the `bhs` (C) (batch, head) pairs, whose tiles hold about
/// TAIL_ITEMS items (two waves of CTAs on a 132-SM GPU), and where their
/// items start; `by_tail_bhs` divides by their number.
fn write_tail_setup(w: &mut Writer<String>, bhs: &str) -> fmt::Result {
    write!(
        w,
        "\
        // The launch's last items go tile by tile over the last pairs, about\n\
        // TAIL_ITEMS of them: their longest tiles first, none left to run alone.\n\
        constexpr int TAIL_ITEMS = {TAIL_ITEMS};\n\
        const int tail_bhs = q_tiles == 0 ? 0 : min_i32({bhs}, (TAIL_ITEMS + q_tiles - 1) / q_tiles);\n\
        const unsigned tail_first = (unsigned)({bhs} - tail_bhs), tail_start = tail_first * (unsigned)q_tiles;\n\
        const FastDiv by_tail_bhs(tail_bhs);\n"
    )
}

/// A persistent kernel's decode of `item` into `bh` (b * heads + h) and
/// `q_block` without global rows: each (batch, head)'s tiles in turn, last
/// rows first, and with `tail` (under a mask, whose items differ in
/// length) the tail of [`write_tail_setup`] tile by tile.
/// `mask_parts::longest_tail_last` is its twin on the CPU.
fn write_pairs_decode(w: &mut Writer<String>, tail: bool) -> fmt::Result {
    w.write_str("unsigned bh;\nint q_block;\n")?;
    let pairs = |w: &mut Writer<String>| {
        w.write_str(
            "\
            bh = by_q_tiles.div((unsigned)item);\n\
            q_block = q_tiles - 1 - (int)((unsigned)item - bh * (unsigned)q_tiles);\n",
        )
    };
    if !tail {
        return pairs(w);
    }
    w.write_str("if ((unsigned)item < tail_start) {\n")?;
    w.indented(pairs)?;
    w.write_str("} else {\n")?;
    w.indented(|w| {
        w.write_str(
            "\
            const unsigned rest = (unsigned)item - tail_start, tile = by_tail_bhs.div(rest);\n\
            bh = tail_first + (rest - tile * by_tail_bhs.d);\n\
            q_block = q_tiles - 1 - (int)tile;\n",
        )
    })?;
    w.write_str("}\n")
}

/// A persistent kernel's decode of `item` into `bh` (b * heads + h) and
/// `q_block`, with the `FastDiv`s `by_bhs` and `by_rest_tiles` (by
/// `q_tiles - dense_tiles`) of its setup.
fn write_persistent_decode(w: &mut Writer<String>) -> fmt::Result {
    write!(
        w,
        "\
        // Global rows first: their query tiles tile by tile over every (batch,\n\
        // head), so no long item is left for the launch's end; then the other\n\
        // tiles of each (batch, head), last rows first.\n\
        unsigned bh;\n\
        int q_block;\n\
        if (item < dense_items) {{\n\
        \x20   const unsigned tile = by_bhs.div((unsigned)item);\n\
        \x20   bh = (unsigned)item - tile * by_bhs.d;\n\
        \x20   q_block = (int)tile;\n\
        }} else {{\n\
        \x20   const unsigned rest = (unsigned)(item - dense_items);\n\
        \x20   bh = by_rest_tiles.div(rest);\n\
        \x20   q_block = q_tiles - 1 - (int)(rest - bh * by_rest_tiles.d);\n\
        }}\n"
    )
}

/// A CTA-per-tile kernel's `b`, `h` and `q_block` from its place in the
/// launch order (x fastest: the hardware starts CTAs in that order), with
/// global rows first. Its grid is (query tiles, heads, batch).
pub(super) fn write_cta_decode(w: &mut Writer<String>, spec: &Spec, rows: GlobalRows, q_len: &str) -> fmt::Result {
    writeln!(w, "const int q_tiles = gridDim.x;")?;
    write_dense_tiles(w, spec, rows, q_len, "q_tiles", "gridDim.y * gridDim.z")?;
    write!(
        w,
        "\
        // Global rows first: their query tiles tile by tile over every (batch,\n\
        // head), so no long tile is left for the grid's tail; then the other\n\
        // tiles of each (batch, head), last rows first.\n\
        const unsigned bhs = gridDim.y * gridDim.z;\n\
        const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);\n\
        unsigned bh;\n\
        int q_block;\n\
        if (cta < dense_items) {{\n\
        \x20   q_block = (int)(cta / bhs);\n\
        \x20   bh = cta % bhs;\n\
        }} else {{\n\
        \x20   const unsigned rest = cta - (unsigned)dense_items, tiles = q_tiles - dense_tiles;\n\
        \x20   bh = rest / tiles;\n\
        \x20   q_block = q_tiles - 1 - (int)(rest % tiles);\n\
        }}\n\
        const int b = (int)(bh / gridDim.y), h = (int)(bh % gridDim.y);\n"
    )
}
