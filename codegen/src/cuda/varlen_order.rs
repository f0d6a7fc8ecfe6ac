//! The varlen forward's item order: the (sequence, head, query tile) items
//! with rows, longest first, for the persistent kernel to claim.
//!
//! Numbered over the longest sequence's query tiles for every sequence, most
//! of a ragged batch's items lie past their sequence's end, and claimed in
//! that numbering (each (sequence, head)'s tiles last rows first) the launch
//! ends on whatever sequence came last, long or short. This kernel, queued
//! before the forward on its stream, lists only the items with rows, those
//! with the most key tiles first, so the last claims are short ones, as in a
//! causal grid. Its output: the number of listed items, then their indices
//! in the forward's numbering, which the kernel decodes as before.
//!
//! An item's work is the count of key tiles the mask's interval analysis
//! keeps for its rows: what the forward's producer walks (`next_tile` over
//! the same classes), up to the tiles a finer test removes. That is right
//! for causal masks (the tiles up to the diagonal), windows and full
//! attention (every key tile of the sequence) alike. The estimate is taken
//! at head 0 (per-head masks order by head 0's tiles) and is the same for
//! every head, so a unit is a (sequence, query tile) and its heads are
//! listed together.
//!
//! One block of 1024 threads: a count of the units per work class
//! ([`WORK_CLASSES`]) in shared memory, a scan, then each unit takes the
//! next slots of its class. Equal classes order as the atomics fall (a work
//! order never changes results). `flashgen_codegen::varlen::item_order` is
//! its CPU twin.

use crate::abi::{ArgKind, Grid, Kernel, Side};
use crate::cuda::kit::tile_class::tile_class_expr;
use crate::cuda::kit::varlen::seq_span;
use crate::cuda::library::Part;
use crate::cuda::signature::{arg_name, varlen_order_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::writer::Writer;
use crate::spec::{Builtin, Spec};
use crate::varlen::WORK_CLASSES;
use std::fmt::{self, Write};

/// Threads of the one block: a warp-shuffle scan of one work class each.
const THREADS: u32 = 1024;
const _: () = assert!(WORK_CLASSES as u32 == THREADS);

/// Emits the item order of `spec`'s persistent varlen forward with query
/// tiles of `block_m` rows and key tiles of `block_n` keys.
pub fn emit_varlen_order(spec: &Spec, block_m: u32, block_n: u32) -> Kernel {
    let name = kernel_name("varlen_order", spec);
    let args = varlen_order_args(spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        writeln!(w, "constexpr int BLOCK_M = {block_m}, BLOCK_N = {block_n};  // the forward's tiles")?;
        writeln!(w, "constexpr int THREADS = {THREADS}, WORK_CLASSES = {WORK_CLASSES};\n")
    };
    let library = [vec![Piece::Part(Part::Prelude), Piece::Part(Part::Ranges), Piece::Part(Part::Varlen)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, |w| write_order(w, spec));
    Kernel { name, source, grid: Grid::Single, block_m, block_n, threads: THREADS, dynamic_smem: 0, args }
}

/// The block: units per class, their first slots, then the items.
fn write_order(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [batch, heads, order, total_q, max_q] = [
        ArgKind::Batch,
        ArgKind::Heads,
        ArgKind::WorkOrder,
        ArgKind::Tokens(Side::Queries),
        ArgKind::MaxLen(Side::Queries),
    ]
    .map(n);
    write!(
        w,
        "\
        // Unit u is query tile u % q_tiles of sequence u / q_tiles; items number\n\
        // as the forward decodes them. The capacity holds every item with rows of\n\
        // well-formed prefix sums (flashgen_codegen::varlen::order_capacity).\n\
        const int q_tiles = ({max_q} + BLOCK_M - 1) / BLOCK_M;\n\
        const long long units = (long long){batch} * q_tiles;\n\
        const long long compact = (long long){heads} * (((long long){total_q} + BLOCK_M - 1) / BLOCK_M + {batch});\n\
        const long long capacity = units * {heads} < compact ? units * {heads} : compact;\n"
    )?;
    write_work_class(w, spec)?;
    write!(
        w,
        "\
        __shared__ int first[WORK_CLASSES];  // units per class, then each class's next slot\n\
        __shared__ int warp_sums[THREADS / 32];\n\
        first[threadIdx.x] = 0;\n\
        __syncthreads();\n\
        for (long long u = threadIdx.x; u < units; u += THREADS) {{\n\
        \x20   const int c = work_class(u);\n\
        \x20   if (c >= 0) atomicAdd(&first[c], 1);\n\
        }}\n\
        __syncthreads();\n\
        // Exclusive scan over the classes, most work first: a shuffle scan per\n\
        // warp, then over the warps' sums.\n\
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;\n\
        const int count = first[threadIdx.x];\n\
        int upto = count;  // inclusive, within the warp\n\
        for (int d = 1; d < 32; d *= 2) {{\n\
        \x20   const int x = __shfl_up_sync(0xffffffffu, upto, d);\n\
        \x20   if (lane >= d) upto += x;\n\
        }}\n\
        if (lane == 31) warp_sums[warp] = upto;\n\
        __syncthreads();\n\
        if (warp == 0) {{\n\
        \x20   const int sum = warp_sums[lane];\n\
        \x20   int before = sum;\n\
        \x20   for (int d = 1; d < 32; d *= 2) {{\n\
        \x20       const int x = __shfl_up_sync(0xffffffffu, before, d);\n\
        \x20       if (lane >= d) before += x;\n\
        \x20   }}\n\
        \x20   warp_sums[lane] = before - sum;\n\
        \x20   const long long listed = (long long)before * {heads};\n\
        \x20   if (lane == 31) {order}[0] = (int)(listed < capacity ? listed : capacity);\n\
        }}\n\
        __syncthreads();\n\
        first[threadIdx.x] = warp_sums[warp] + upto - count;\n\
        __syncthreads();\n\
        // Each unit's heads take consecutive slots after the count.\n\
        for (long long u = threadIdx.x; u < units; u += THREADS) {{\n\
        \x20   const int c = work_class(u);\n\
        \x20   if (c < 0) continue;\n\
        \x20   const long long slot = (long long)atomicAdd(&first[c], 1) * {heads};\n\
        \x20   const long long b = u / q_tiles, item0 = b * {heads} * q_tiles + (q_tiles - 1 - (u - b * q_tiles));\n\
        \x20   for (int h = 0; h < {heads} && slot + h < capacity; ++h) {order}[1 + slot + h] = (int)(item0 + (long long)h * q_tiles);\n\
        }}\n"
    )
}

/// The lambda `work_class(u)`: unit u's class, 0 for the most key tiles
/// (`WORK_CLASSES - 1` or more), −1 for a tile past its sequence's end.
fn write_work_class(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [q_seq, kv_seq] = [Side::Queries, Side::Keys].map(|side| seq_span(spec, side, "b"));
    let head = match spec.mask.as_ref().is_some_and(|mask| mask.uses(Builtin::H)) {
        true => "    const int h = 0;  // the estimate's head\n",
        false => "",
    };
    let count = match tile_class_expr(spec) {
        Some(class) => format!(
            "\
            \x20   // The key tiles the mask's interval analysis keeps for the tile's rows.\n\
            \x20   const int q_lo = q_block * BLOCK_M, q_hi = min_i32(q_lo + BLOCK_M, q_len) - 1;\n\
            \x20   int tiles = 0;\n\
            \x20   for (int j = 0; j < kv_tiles; ++j) {{\n\
            \x20       const int k_lo = j * BLOCK_N, k_hi = min_i32(k_lo + BLOCK_N, kv_len) - 1;\n\
            \x20       tiles += ({class}).hi != 0;\n\
            \x20   }}\n"
        ),
        None => "    const int tiles = kv_tiles;  // no mask: every key tile\n".into(),
    };
    write!(
        w,
        "\
        auto work_class = [&](long long u) -> int {{\n\
        \x20   const int b = (int)(u / q_tiles), q_block = (int)(u - (long long)b * q_tiles);\n\
        {head}\
        \x20   const SeqSpan q_seq = {q_seq}, kv_seq = {kv_seq};\n\
        \x20   const int q_len = q_seq.len, kv_len = kv_seq.len;\n\
        \x20   if ((long long)q_block * BLOCK_M >= q_len) return -1;\n\
        \x20   const int kv_tiles = (kv_len + BLOCK_N - 1) / BLOCK_N;\n\
        {count}\
        \x20   return WORK_CLASSES - 1 - min_i32(tiles, WORK_CLASSES - 1);\n\
        }};\n"
    )
}
