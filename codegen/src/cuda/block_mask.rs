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

use super::expr::c_expr;
use super::prelude::PRELUDE;
use super::ranges::RANGES;
use super::signature::{arg_name, block_mask_args};
use super::source::{kernel_name, write_entry, write_header};
use super::tile_class::tile_class_expr;
use super::writer::Writer;
use super::TileConfig;
use crate::abi::{ArgKind, Grid, Kernel};
use crate::spec::{Builtin, Spec};
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
                }}\n\
                bool any = false, all = true;\n\
                for (int i = threadIdx.x; i < BLOCK_M * BLOCK_N; i += THREADS) {{\n\
                \x20   const int q = q_lo + i / BLOCK_N, k = k_lo + i % BLOCK_N;\n\
                \x20   if (q > q_hi || k > k_hi) continue;\n\
                \x20   const bool keep = {};\n\
                \x20   any |= keep;\n\
                \x20   all &= keep;\n\
                }}\n\
                any = __syncthreads_or(any);\n\
                all = __syncthreads_and(all);\n\
                if (threadIdx.x == 0) *cls = !any ? 0 : all ? 2 : 1;\n",
                c_expr(spec, mask)
            )
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
