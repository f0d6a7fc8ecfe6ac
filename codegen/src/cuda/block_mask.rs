//! The block-mask kernel: exact tile classes for masks interval analysis
//! cannot bound (captured tensors such as document ids, float arithmetic).
//!
//! One thread block per (q tile, kv tile, batch', head'), in three steps,
//! each only for the tiles the previous one leaves undecided: the static
//! interval analysis; the same analysis with each hoisted i32 term (such as
//! `doc[b][q]`) bounded by its min and max over the tile, computed at run
//! time; and evaluation of the mask on the tile's pairs, reduced with
//! `__syncthreads_or` / `__syncthreads_and`. A mask that reads positions only
//! as tile-aligned blocks (declared block sparsity) is decided by its first
//! pair. The output, one byte per tile (0 empty, 1 partial, 2 full), is what
//! the forward kernel's `next_tile` / `tile_full` read. Batch and head get
//! their own slices only if the mask reads `b` or `h`; otherwise one slice is
//! broadcast, so a document mask costs one pass per batch, not per head.
//! Tiles are the spec's mask tile ([`TileConfig::mask_tile`]); forward
//! kernels of any tile size combine the ones their tiles overlap.

use crate::abi::{ArgKind, Grid, Kernel};
use crate::analysis::block_uniform;
use crate::cuda::kit::expr::{c_expr, c_expr_in};
use crate::cuda::kit::hoist::{hoist, lookup_indexed, Hoisted, Level};
use crate::cuda::kit::tile_class::{bounded_class_expr, tile_class_expr};
use crate::cuda::library::Part;
use crate::cuda::signature::c_type;
use crate::cuda::signature::{arg_name, block_mask_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::tile_config::TileConfig;
use crate::cuda::writer::Writer;
use crate::spec::{Builtin, Expr, Spec, Ty};
use std::fmt::{self, Write};

const THREADS: u32 = 128;

/// Emits the block-mask kernel of `spec` (tiles of [`TileConfig::mask_tile`]);
/// `None` when the spec has no mask (every tile is kept whole).
pub fn emit_block_mask(spec: &Spec) -> Option<Kernel> {
    let (block_m, block_n) = TileConfig::mask_tile(spec);
    let mask = spec.mask.as_ref()?;
    let class = tile_class_expr(spec)?;
    let name = kernel_name("mask", spec);
    let args = block_mask_args(spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        writeln!(w, "constexpr int BLOCK_M = {block_m};  // query rows per mask tile")?;
        writeln!(w, "constexpr int BLOCK_N = {block_n};  // keys per mask tile")?;
        writeln!(w, "constexpr int THREADS = {THREADS};\n")?;
        Ok(())
    };
    let library = [vec![Piece::Part(Part::Prelude)], vec![Piece::Part(Part::Ranges)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, |w| {
        let arg = |kind| arg_name(spec, kind);
        let [q_len, kv_len, heads, out] =
            [ArgKind::QLen, ArgKind::KvLen, ArgKind::Heads, ArgKind::BlockMaskOut].map(arg);
        let (uses_b, uses_h) = (mask.uses(Builtin::B), mask.uses(Builtin::H));
        let slice_heads = if uses_h { heads.as_str() } else { "1" };
        writeln!(w, "// Tile (blockIdx.y, blockIdx.x) of slice blockIdx.z: a (b, h) pair where the")?;
        writeln!(w, "// mask reads both, else one slice per b or h it reads, broadcast over the rest.")?;
        if uses_b {
            writeln!(w, "const int b = (int)blockIdx.z / {slice_heads};")?;
        }
        if uses_h {
            writeln!(w, "const int h = (int)blockIdx.z % {heads};")?;
        }
        write!(
            w,
            "\
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
        if block_uniform(mask, block_m, block_n) {
            return write!(
                w,
                "\
                // The mask reads q and k only through tile-aligned blocks (declared\n\
                // block sparsity): the tile's first pair decides it.\n\
                if (threadIdx.x == 0) {{\n\
                \x20   [[maybe_unused]] const int q = q_lo, k = k_lo;  // hoisted terms may stand in for both\n\
                \x20   *cls = {} ? 2 : 0;\n\
                }}\n",
                c_expr(spec, mask)
            );
        }
        write_evaluation(w, spec, mask)
    });
    Some(Kernel { name, source, grid: Grid::MaskTiles, block_m, block_n, threads: THREADS, dynamic_smem: 0, args })
}

/// Exact classes for tiles the static analysis leaves undecided. First the
/// tile's range of each hoisted i32 term (row terms over its queries,
/// column terms over its keys, e.g. `doc[b][q]` and `doc[b][k]`) tightens
/// the interval analysis: a document mask is then only undecided where a
/// document boundary falls inside the tile. The rest are evaluated one query
/// row per thread, row terms computed once, column terms staged in shared
/// memory, each thread stopping at the first pair that proves the tile
/// partial.
fn write_evaluation(w: &mut Writer<String>, spec: &Spec, mask: &Expr) -> fmt::Result {
    let hoisted = hoist(&[mask]);
    // Row and CTA terms are scalars here; column terms sit in shared memory.
    let lookup = |e: &Expr| lookup_indexed(&hoisted, e, |level| if level == Level::Column { "[k - k_lo]" } else { "" });
    let at = |level| hoisted.iter().filter(move |h: &&Hoisted| h.level == level);
    let bounded: Vec<&Hoisted> = hoisted.iter().filter(|h| h.level != Level::Cta && h.expr.ty == Ty::I32).collect();
    for h in at(Level::Cta) {
        writeln!(w, "const {} {} = {};", c_type(h.expr.ty), h.name, c_expr(spec, h.expr))?;
    }
    for h in at(Level::Column) {
        writeln!(w, "__shared__ {} {}[BLOCK_N];  // per key of the tile", c_type(h.expr.ty), h.name)?;
    }
    if !bounded.is_empty() {
        writeln!(w, "// Each term's min and max over the tile.")?;
        for h in &bounded {
            writeln!(w, "__shared__ int {0}_lo, {0}_hi;", h.name)?;
        }
        w.block(format_args!("if (threadIdx.x == 0)"), |w| {
            bounded.iter().try_for_each(|h| writeln!(w, "{0}_lo = 2147483647, {0}_hi = -2147483647 - 1;", h.name))
        })?;
        writeln!(w, "__syncthreads();")?;
    }
    for (level, var, lo, hi) in [(Level::Column, "k", "k_lo", "k_hi"), (Level::Row, "q", "q_lo", "q_hi")] {
        let terms: Vec<&Hoisted> = bounded.iter().copied().filter(|h| h.level == level).collect();
        // Column terms are also staged in shared memory by the same loop.
        let staged: Vec<&Hoisted> = if level == Level::Column { at(level).collect() } else { Vec::new() };
        if terms.is_empty() && staged.is_empty() {
            continue;
        }
        for h in &terms {
            writeln!(w, "int {0}_min = 2147483647, {0}_max = -2147483647 - 1;", h.name)?;
        }
        w.block(format_args!("for (int {var} = {lo} + threadIdx.x; {var} <= {hi}; {var} += THREADS)"), |w| {
            for h in &staged {
                writeln!(w, "{}[k - k_lo] = {};", h.name, c_expr(spec, h.expr))?;
            }
            for h in &terms {
                let value = if level == Level::Column { format!("{}[k - k_lo]", h.name) } else { c_expr(spec, h.expr) };
                writeln!(w, "const int {}_v = {value};", h.name)?;
                writeln!(w, "{0}_min = min_i32({0}_min, {0}_v);", h.name)?;
                writeln!(w, "{0}_max = max_i32({0}_max, {0}_v);", h.name)?;
            }
            Ok(())
        })?;
        for h in &terms {
            writeln!(w, "{0}_min = __reduce_min_sync(0xffffffffu, {0}_min);", h.name)?;
            writeln!(w, "{0}_max = __reduce_max_sync(0xffffffffu, {0}_max);", h.name)?;
            w.block(format_args!("if (threadIdx.x % 32 == 0)"), |w| {
                writeln!(w, "atomicMin(&{0}_lo, {0}_min);", h.name)?;
                writeln!(w, "atomicMax(&{0}_hi, {0}_max);", h.name)
            })?;
        }
    }
    if !bounded.is_empty() || at(Level::Column).next().is_some() {
        writeln!(w, "__syncthreads();")?;
    }
    if !bounded.is_empty() {
        let names: Vec<(&Expr, &str)> = bounded.iter().map(|h| (h.expr, h.name.as_str())).collect();
        write!(
            w,
            "\
            const Range tight = {};\n\
            if (tight.hi == 0 || tight.lo == 1) {{\n\
            \x20   if (threadIdx.x == 0) *cls = tight.hi == 0 ? 0 : 2;\n\
            \x20   return;\n\
            }}\n",
            bounded_class_expr(spec, mask, &names)
        )?;
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
