//! The block-mask kernel: exact tile classes for masks interval analysis
//! cannot bound (captured tensors such as document ids, float arithmetic).
//!
//! One thread block per (q tile, kv tile, batch', head'): tiles the analysis
//! already decides are written at once; the rest evaluate the mask on every
//! pair of the tile and reduce with `__syncthreads_or` / `__syncthreads_and`.
//! The output, one byte per tile (0 empty, 1 partial, 2 full), is what the
//! forward kernel's `next_tile` / `tile_full` read. Batch and head get their
//! own slices only if the mask reads `b` or `h`; otherwise one slice is
//! broadcast, so a document mask costs one pass per batch, not per head.
//! Tiles use the forward kernel's `BLOCK_M` × `BLOCK_N`, so the two must be
//! built from the same [`TileConfig`].

use super::expr::{c_expr, c_expr_in, c_type};
use super::hoist::{hoist, Hoisted, Level};
use super::prelude::PRELUDE;
use super::ranges::RANGES;
use super::signature::{arg_name, block_mask_args};
use super::source::{kernel_name, write_entry, write_header};
use super::tile_class::tile_class_expr;
use super::writer::Writer;
use super::TileConfig;
use crate::abi::{ArgKind, Grid, Kernel};
use crate::analysis::block_uniform;
use crate::spec::{Builtin, Expr, Spec};
use std::fmt::{self, Write};

const THREADS: u32 = 128;

/// Emits the block-mask kernel of `spec` for the tiles of `config`; `None`
/// when the spec has no mask (every tile is kept whole).
pub fn emit_block_mask(spec: &Spec, config: TileConfig) -> Option<Kernel> {
    let mask = spec.mask.as_ref()?;
    let class = tile_class_expr(spec)?;
    let name = kernel_name("mask", spec);
    let args = block_mask_args(spec);
    let mut w = Writer::new(String::new());
    let body = |w: &mut Writer<String>| -> fmt::Result {
        write_header(w, spec)?;
        w.write_str(PRELUDE)?;
        writeln!(w)?;
        w.write_str(RANGES)?;
        writeln!(w)?;
        writeln!(w, "constexpr int BLOCK_M = {};  // the forward kernel's query rows per tile", config.block_m())?;
        writeln!(w, "constexpr int BLOCK_N = {};  // the forward kernel's keys per tile", config.block_n)?;
        writeln!(w, "constexpr int THREADS = {THREADS};\n")?;
        write_entry(w, spec, &name, &args, |w| {
            let arg = |kind| arg_name(spec, kind);
            let [q_len, kv_len, heads, out] =
                [ArgKind::QLen, ArgKind::KvLen, ArgKind::Heads, ArgKind::BlockMaskOut].map(arg);
            let (uses_b, uses_h) = (mask.uses(Builtin::B), mask.uses(Builtin::H));
            let slice_heads = if uses_h { heads.as_str() } else { "1" };
            let b = if uses_b { format!("(int)blockIdx.z / {slice_heads}") } else { "0".into() };
            let h = if uses_h { format!("(int)blockIdx.z % {heads}") } else { "0".into() };
            write!(
                w,
                "\
                // Tile (blockIdx.y, blockIdx.x) of slice blockIdx.z; a mask that ignores b\n\
                // (or h) is evaluated at b = 0 (h = 0) and broadcast.\n\
                const int b = {b};\n\
                const int h = {h};\n\
                const int q_lo = blockIdx.y * BLOCK_M, q_hi = min_i32(q_lo + BLOCK_M, {q_len}) - 1;\n\
                const int k_lo = blockIdx.x * BLOCK_N, k_hi = min_i32(k_lo + BLOCK_N, {kv_len}) - 1;\n\
                unsigned char* cls = {out} + ((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;\n\
                // Tiles the interval analysis decides need no evaluation.\n\
                const Range bounds = {class};\n\
                if (bounds.hi == 0 || bounds.lo == 1) {{\n\
                \x20   if (threadIdx.x == 0) *cls = bounds.hi == 0 ? 0 : 2;\n\
                \x20   return;\n\
                }}\n",
            )?;
            if block_uniform(mask, config.block_m(), config.block_n) {
                return write!(
                    w,
                    "\
                    // The mask reads q and k only through tile-aligned blocks (declared\n\
                    // block sparsity): the tile's first pair decides it.\n\
                    if (threadIdx.x == 0) {{\n\
                    \x20   const int q = q_lo, k = k_lo;\n\
                    \x20   *cls = {} ? 2 : 0;\n\
                    }}\n",
                    c_expr(spec, mask)
                );
            }
            write_evaluation(w, spec, mask)
        })
    };
    body(&mut w).expect("formatting into a String cannot fail");
    Some(Kernel {
        name,
        source: w.into_inner(),
        grid: Grid::MaskTiles,
        block_m: config.block_m(),
        block_n: config.block_n,
        threads: THREADS,
        dynamic_smem: 0,
        args,
    })
}

/// Exact evaluation of an undecided tile: one query row per thread, its
/// row-level terms computed once, the tile's column-level terms (`doc[b][k]`)
/// staged once in shared memory, so each pair costs a compare or two; a
/// thread stops at the first pair that proves the tile partial.
fn write_evaluation(w: &mut Writer<String>, spec: &Spec, mask: &Expr) -> fmt::Result {
    let hoisted = hoist(&[mask]);
    let lookup = |e: &Expr| {
        let h = hoisted.iter().find(|h| std::ptr::eq(h.expr, e))?;
        Some(match h.level {
            Level::Cta | Level::Row => h.name.clone(),
            Level::Column => format!("{}[k - k_lo]", h.name),
        })
    };
    let at = |level| hoisted.iter().filter(move |h: &&Hoisted| h.level == level);
    for h in at(Level::Cta) {
        writeln!(w, "const {} {} = {};", c_type(h.expr.ty), h.name, c_expr(spec, h.expr))?;
    }
    if at(Level::Column).next().is_some() {
        writeln!(w, "// The mask's terms per key of the tile, computed once.")?;
        for h in at(Level::Column) {
            writeln!(w, "__shared__ {} {}[BLOCK_N];", c_type(h.expr.ty), h.name)?;
        }
        w.block(format_args!("for (int k = k_lo + threadIdx.x; k <= k_hi; k += THREADS)"), |w| {
            at(Level::Column).try_for_each(|h| writeln!(w, "{}[k - k_lo] = {};", h.name, c_expr(spec, h.expr)))
        })?;
        writeln!(w, "__syncthreads();")?;
    }
    writeln!(w, "bool any = false, all = true;")?;
    w.block(format_args!("for (int q = q_lo + threadIdx.x; q <= q_hi && (all || !any); q += THREADS)"), |w| {
        for h in at(Level::Row) {
            writeln!(w, "const {} {} = {};", c_type(h.expr.ty), h.name, c_expr(spec, h.expr))?;
        }
        w.block(format_args!("for (int k = k_lo; k <= k_hi; ++k)"), |w| {
            writeln!(w, "const bool keep = {};", c_expr_in(spec, mask, &lookup))?;
            writeln!(w, "any |= keep;")?;
            writeln!(w, "all &= keep;")?;
            writeln!(w, "if (any && !all) break;  // partial: nothing left to learn")
        })
    })?;
    write!(
        w,
        "\
        any = __syncthreads_or(any);\n\
        all = __syncthreads_and(all);\n\
        if (threadIdx.x == 0) *cls = !any ? 0 : all ? 2 : 1;\n"
    )
}
