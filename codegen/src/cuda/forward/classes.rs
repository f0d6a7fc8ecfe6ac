//! Block sparsity in the forward: which K/V tiles an item visits
//! (`next_tile`) and which it keeps whole (`tile_full`, or the ring
//! producer's `tile_bits`), from interval arithmetic over the mask and,
//! under a data-dependent mask, the block mask.

use super::plan::STAGED_CLASS_TILES;
use crate::analysis::block_uniform;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::tile_class::{class_expr, tile_class_expr};
use crate::cuda::kit::tile_walk::{write_block_class, write_next_tile};
use crate::cuda::signature::names::BLOCK_MASK;
use crate::cuda::tile_config::TileConfig;
use crate::cuda::writer::Writer;
use crate::mask_parts::MaskParts;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Block sparsity by analysis: `next_tile(j)` is the first K/V tile from `j`
/// on that the mask does not remove entirely, and `tile_full(j)` says the
/// mask keeps every pair of tile `j`. Both come from interval arithmetic over
/// the mask with this CTA's query rows and the tile's keys (see `ranges`),
/// evaluated with the launch's params, so they cost a few integer ops per
/// tile and need no mask tensor or precompute pass. A mask that reads
/// positions only as tile-aligned blocks (declared block sparsity, see
/// [`block_uniform`]) is evaluated once per tile instead.
pub(super) fn write_tile_classes(
    w: &mut Writer<String>,
    spec: &Spec,
    config: TileConfig,
    q_len: &str,
    kv_len: &str,
    stagers: &Stagers,
    reader: ClassReader,
) -> fmt::Result {
    let (Some(mask), Some(class)) = (&spec.mask, tile_class_expr(spec)) else {
        writeln!(w, "// No mask: every tile is visited and kept whole.")?;
        writeln!(w, "auto next_tile = [](int j) {{ return j; }};")?;
        return match reader {
            ClassReader::Cta => writeln!(w, "auto tile_full = [](int) {{ return true; }};"),
            ClassReader::RingWord { .. } => writeln!(w, "auto tile_bits = [](int) {{ return (int)TILE_FULL; }};"),
        };
    };
    let (skip, full) = if block_uniform(mask, config.block_m(), config.block_n) {
        write!(
            w,
            "\
            // The mask reads q and k only through tile-aligned blocks (declared\n\
            // block sparsity): its value at a tile's first pair holds for the tile.\n\
            auto block_kept = [&](int j) -> bool {{\n\
            \x20   [[maybe_unused]] const int q = q0, k = j * BLOCK_N;  // hoisted terms may stand in for both\n\
            \x20   return {};\n\
            }};\n",
            c_expr(spec, mask)
        )?;
        (" || !block_kept(j)", " || block_kept(j)")
    } else {
        ("", "")
    };
    write!(
        w,
        "\
        // Tile classes: the mask over rows [q_lo, q_hi] x the keys of tiles\n\
        // [j0, j1), in interval arithmetic (lo = 1: keeps every pair; hi = 0:\n\
        // keeps none); span_class over this CTA's rows.\n\
        auto rows_class = [&](int q_lo, int q_hi, int j0, int j1) -> Range {{\n\
        \x20   [[maybe_unused]] const int k_lo = j0 * BLOCK_N;  // a class may not read every bound\n\
        \x20   [[maybe_unused]] const int k_hi = (int)(j1 * (long long)BLOCK_N < {kv_len} ? j1 * (long long)BLOCK_N : {kv_len}) - 1;\n\
        \x20   return {class};\n\
        }};\n\
        const int q_lo = q0, q_hi = min_i32(q0 + BLOCK_M, {q_len}) - 1;\n\
        auto span_class = [&](int j0, int j1) {{ return rows_class(q_lo, q_hi, j0, j1); }};\n\
        // A block mask built for data-dependent masks (tensor reads) refines\n\
        // them: 0 = no pair kept, 2 = every pair kept, exact per tile.\n"
    )?;
    let parts = MaskParts::of(Some(mask));
    let classes: Option<Vec<String>> = parts.as_ref().map(|p| p.exprs().iter().map(|e| class_expr(spec, e)).collect());
    let parts = parts.as_ref().zip(classes.as_deref());
    if let (Some(parts), ClassReader::Cta) = (parts, reader) {
        write_cta_selector(w, parts, kv_len)?;
    }
    let keys = format!("j * BLOCK_N, min_i32((j + 1) * BLOCK_N, {kv_len}) - 1");
    if !mask.reads_tensor() {
        write_block_class(w, "mask_class", kv_len, "q_lo, q_hi", &keys)?;
    } else {
        write_block_class(w, "block_class", kv_len, "q_lo, q_hi", &keys)?;
        let Stagers { first, count, after } = stagers;
        write!(
            w,
            "\
            // The mask reads tensors, so the block mask decides most tiles: its\n\
            // classes for this tile's rows are staged in shared memory once, and\n\
            // next_tile's scan over removed tiles costs no dependent global loads\n\
            // (they would stall a CTA that has the SM to itself).\n\
            constexpr int STAGED_TILES = {STAGED_CLASS_TILES};\n\
            __shared__ unsigned char staged_class[STAGED_TILES];\n\
            const bool staged = {BLOCK_MASK} != nullptr && kv_tiles <= STAGED_TILES;\n\
            if (staged) {{\n\
            \x20   for (int j = {first}; j < kv_tiles; j += {count}) staged_class[j] = (unsigned char)block_class(j);\n\
            }}\n\
            {after}\n\
            auto mask_class = [&](int j) {{ return staged ? (int)staged_class[j] : block_class(j); }};\n"
        )?;
    }
    write!(
        w,
        "\
        // The next tile from j on that keeps a pair. Runs of tiles the analysis\n\
        // rules out are skipped by binary search, so a sliding window does not\n\
        // pay for a scan over every tile of the row.\n"
    )?;
    write_next_tile(w, "kv_tiles", &format!("mask_class(j) == 0{skip}"), mask.reads_tensor())?;
    // The block mask's tiles kept whole, where they are the kernel's mask's.
    let full = match reader {
        ClassReader::RingWord { block_full: false } => full.to_string(),
        _ => format!(" || mask_class(j) == 2{full}"),
    };
    let full = full.as_str();
    let keeps_all = format!("span_class(j, j + 1).lo == 1{full}");
    match (reader, parts) {
        (ClassReader::Cta, _) => writeln!(w, "auto tile_full = [&](int j) {{ return {keeps_all}; }};"),
        (ClassReader::RingWord { .. }, Some(parts)) => write_tile_bits(w, parts, kv_len, full),
        (ClassReader::RingWord { .. }, None) => {
            writeln!(w, "auto tile_bits = [&](int j) -> int {{ return {keeps_all} ? TILE_FULL : 0; }};")
        }
    }
}

/// A CTA's selector of tile j ([`MaskParts::selector`]) from the parts'
/// classes (C `Range`s): `whole_conjuncts` or `lone_disjunct`.
fn write_cta_selector(w: &mut Writer<String>, (parts, classes): (&MaskParts, &[String]), kv_len: &str) -> fmt::Result {
    match (parts, classes) {
        (MaskParts::Conjuncts(_), [a, b]) => write!(
            w,
            "\
            // Bit x: conjunct x of the mask keeps every pair of tile j, and every\n\
            // key of the tile exists (logit_only tests no bound at kv_len).\n\
            auto whole_conjuncts = [&](int j) -> int {{\n\
            \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
            \x20   const int k_lo = j * BLOCK_N, k_hi = k_lo + BLOCK_N - 1;\n\
            \x20   return ({a}.lo == 1 ? 1 : 0) | ({b}.lo == 1 ? 2 : 0);\n\
            }};\n"
        ),
        (split @ MaskParts::Disjuncts(_), ranges) => {
            let names = range_names(ranges.len());
            write!(
                w,
                "\
                // 1 + x where disjunct x alone of the mask keeps pairs of tile j and\n\
                // every key of the tile exists (logit_only tests no bound at kv_len),\n\
                // else 0.\n\
                auto lone_disjunct = [&](int j) -> int {{\n\
                \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
                \x20   const int k_lo = j * BLOCK_N, k_hi = k_lo + BLOCK_N - 1;\n\
                \x20   const Range {decl};\n\
                \x20   return {lone};\n\
                }};\n",
                decl = range_decls(&names, ranges),
                lone = lone_expr(split, &names),
            )
        }
        _ => Ok(()),
    }
}

/// A ring producer's `tile_bits` under a mask with parts, each part's
/// class (C `Range`s) evaluated once per tile: TILE_FULL, and the selector
/// in TILE_WHOLE units. `full` is the C that also keeps a tile whole.
fn write_tile_bits(
    w: &mut Writer<String>,
    (parts, classes): (&MaskParts, &[String]),
    kv_len: &str,
    full: &str,
) -> fmt::Result {
    match (parts, classes) {
        (MaskParts::Conjuncts(_), [a, b]) => write!(
            w,
            "\
            // Tile j's bits of its word: TILE_FULL where the mask keeps every pair,\n\
            // else bit x (in TILE_WHOLE units) where conjunct x keeps every pair\n\
            // and every key exists (logit_only tests no bound at kv_len).\n\
            auto tile_bits = [&](int j) -> int {{\n\
            \x20   const int k_lo = j * BLOCK_N, k_hi = min_i32((j + 1) * BLOCK_N, {kv_len}) - 1;\n\
            \x20   const Range c0 = {a}, c1 = {b};  // not `b`: the spec's batch index\n\
            \x20   if (r_and(c0, c1).lo == 1{full}) return TILE_FULL;\n\
            \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
            \x20   return ((c0.lo == 1 ? 1 : 0) | (c1.lo == 1 ? 2 : 0)) * TILE_WHOLE;\n\
            }};\n"
        ),
        // Each disjunct once: their union decides a full tile, and a partial
        // one where one disjunct alone keeps pairs is that disjunct's.
        (split @ MaskParts::Disjuncts(_), ranges) => {
            let names = range_names(ranges.len());
            let union = names[1..].iter().fold(names[0].clone(), |acc, x| format!("r_or({acc}, {x})"));
            write!(
                w,
                "\
                // Tile j's bits of its word: TILE_FULL where the mask keeps every pair,\n\
                // else 1 + x (in TILE_WHOLE units) where disjunct x alone keeps pairs\n\
                // of it and every key exists (logit_only tests no bound at kv_len).\n\
                auto tile_bits = [&](int j) -> int {{\n\
                \x20   const int k_lo = j * BLOCK_N, k_hi = min_i32((j + 1) * BLOCK_N, {kv_len}) - 1;\n\
                \x20   const Range {decl};\n\
                \x20   if ({union}.lo == 1{full}) return TILE_FULL;\n\
                \x20   if ((j + 1) * (long long)BLOCK_N > {kv_len}) return 0;\n\
                \x20   return ({lone}) * TILE_WHOLE;\n\
                }};\n",
                decl = range_decls(&names, ranges),
                lone = lone_expr(split, &names),
            )
        }
        _ => Ok(()),
    }
}

/// The C names of the disjuncts' `Range`s: `d0`, `d1`, ...
fn range_names(n: usize) -> Vec<String> {
    (0..n).map(|x| format!("d{x}")).collect()
}

/// `d0 = <class of disjunct 0>, d1 = ...`: one declaration's declarators.
fn range_decls(names: &[String], ranges: &[String]) -> String {
    names.iter().zip(ranges).map(|(n, r)| format!("{n} = {r}")).collect::<Vec<_>>().join(", ")
}

/// The selector ([`MaskParts::selector`]) as one C expression over the
/// disjuncts' ranges `names`: 1 + x where only disjunct x may keep a pair
/// (its `hi` is not 0) and it decides alone, else 0.
fn lone_expr(parts: &MaskParts, names: &[String]) -> String {
    let live: Vec<String> = names.iter().map(|n| format!("({n}.hi != 0)")).collect();
    let value = |x: usize| if parts.decides(x) { x + 1 } else { 0 };
    let last = value(names.len() - 1).to_string();
    let which = (0..names.len() - 1).rev().fold(last, |acc, x| format!("{} ? {} : {acc}", live[x], value(x)));
    format!("{} != 1 ? 0 : {which}", live.join(" + "))
}

/// The C of a CTA's selector for tile j ([`MaskParts`]): the lambda
/// [`write_tile_classes`] declares for the mask's parts.
pub(super) fn cta_selector(spec: &Spec) -> &'static str {
    match MaskParts::of(spec.mask.as_ref()) {
        Some(MaskParts::Disjuncts(_)) => "lone_disjunct(j)",
        _ => "whole_conjuncts(j)",
    }
}

/// Who reads the tile classes: a CTA's own main loop (`tile_full`, and the
/// selector of a mask with parts: `whole_conjuncts` or `lone_disjunct`), or
/// a ring producer that packs them into each tile's word (`tile_bits`).
#[derive(Clone, Copy)]
pub(super) enum ClassReader {
    Cta,
    /// `block_full`: a block mask's tiles kept whole are the kernel's too
    /// (not where it walks a narrower mask than the spec's: `walked_view`).
    RingWord {
        block_full: bool,
    },
}

/// The threads that stage a tensor mask's block classes in shared memory
/// (`staged_class`), C: the first one's index among them, their count, and
/// the barrier that publishes the classes (`after`). Every reader of the
/// previous item's classes has passed a barrier of theirs since.
pub(super) struct Stagers {
    first: &'static str,
    count: &'static str,
    after: &'static str,
}

impl Stagers {
    /// Every thread of a CTA that owns one query tile.
    pub(super) const CTA: Stagers = Stagers { first: "threadIdx.x", count: "CTA_THREADS", after: "__syncthreads();" };
    /// A warp-specialized kernel's producer, per item, past the barrier on
    /// which it reads its claim (named barrier 2 + WARPGROUPS: the consumers
    /// pass their turns on 1..=WARPGROUPS, and each warpgroup meets its own
    /// threads on 3 + WARPGROUPS + warpgroup). Its consumers take each
    /// tile's class from it.
    pub(super) const PRODUCER: Stagers = Stagers {
        first: "threadIdx.x - THREADS",
        count: "PRODUCER_THREADS",
        after: "named_barrier_sync(2 + WARPGROUPS, PRODUCER_THREADS);",
    };
}
