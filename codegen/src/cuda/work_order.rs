//! Work orders: under a data-dependent mask, a kernel's units of work
//! longest first within windows of a few heads.
//!
//! A dK/dV CTA owns one key tile of one (batch, K/V head) and walks the
//! query tiles its keys see; a persistent forward's item is one query tile
//! of one (batch, head) and walks the key tiles its queries see. Under a
//! document mask either's length is its document's. In launch order the
//! last wave holds units of every length, and SMs that drew short ones idle
//! while the long ones finish (a few percent of the kernels' SM time under
//! a document mask; docs/kernels.md). Issued longest first,
//! the grid ends on short units instead, as a causal grid does by
//! construction (`dkdv::write_cta_order`, the forward's last rows first).
//!
//! The sort stays inside windows of HEADS_PER_BLOCK heads of one batch, and
//! windows keep launch order, so the units in flight still share a few
//! heads' K/V (forward) or Q/dO (dK/dV) in L2. A sort across all heads moved
//! the tiles that straddle two documents, the longest, away from both
//! documents' other tiles, and about doubled the kernels' DRAM reads.
//!
//! Lengths come from a built block mask, so an order is made once per block
//! mask and tile size (the runtime keeps it with the mask), by one thread
//! block per window: each unit's count of visited mask tiles, then a stable
//! counting sort into BUCKETS length classes, longest class first. Within a
//! class units keep launch order (no kernel's results depend on the order).
//! The output holds the order, then each unit's count.

use crate::abi::{ArgKind, Axis, Grid, Kernel};
use crate::cuda::library::Part;
use crate::cuda::signature::{arg_name, work_order_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::tile_config::TileConfig;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const THREADS: u32 = 256;

/// Length classes of the sort: units of a window within 1/BUCKETS of its
/// longest's length of each other keep launch order.
pub const BUCKETS: u32 = 64;

/// Heads (K/V heads for key tiles) a window sorts together: enough units
/// that the grid's last wave ends on short ones, few enough heads that their
/// operands stay in L2 while the window is in flight (1, 4 and 8 heads
/// were within 1% of each other; docs/kernels.md).
pub const HEADS_PER_BLOCK: u32 = 4;

/// What a work order orders.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Work {
    /// The dK/dV kernel's CTAs of `block_n` keys, numbered in launch order:
    /// key tile, then K/V head, then batch.
    KeyTiles { block_n: u32 },
    /// A persistent forward's items of `block_m` queries, numbered as it
    /// claims them: query tiles last first, then head, then batch.
    QueryTiles { block_m: u32 },
}

/// Emits the kernel that orders `spec`'s `work`; `None` unless the spec's
/// mask reads a tensor (no block mask, or lengths follow from the analytic
/// mask).
pub fn emit_work_order(spec: &Spec, work: Work) -> Option<Kernel> {
    if !spec.mask.as_ref()?.reads_tensor() {
        return None;
    }
    let (mask_m, mask_n) = TileConfig::mask_tile(spec);
    let (kind, (tile_line, tile)) = match work {
        Work::KeyTiles { block_n } => ("key_order", ("keys per dK/dV CTA", block_n)),
        Work::QueryTiles { block_m } => ("item_order", ("queries per forward item", block_m)),
    };
    let name = kernel_name(kind, spec);
    let args = work_order_args(spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        writeln!(w, "constexpr int MASK_M = {mask_m}, MASK_N = {mask_n};  // the block mask's tiles")?;
        writeln!(w, "constexpr int TILE = {tile};  // {tile_line}")?;
        writeln!(w, "constexpr int THREADS = {THREADS}, BUCKETS = {BUCKETS}, HEADS_PER_BLOCK = {HEADS_PER_BLOCK};\n")?;
        Ok(())
    };
    let library = [vec![Piece::Part(Part::Prelude)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, |w| write_order(w, spec, work));
    Some(Kernel {
        name,
        source,
        grid: match work {
            Work::KeyTiles { .. } => Grid::KvHeads { per_block: HEADS_PER_BLOCK },
            Work::QueryTiles { .. } => Grid::Heads { per_block: HEADS_PER_BLOCK },
        },
        block_m: mask_m,
        block_n: mask_n,
        threads: THREADS,
        dynamic_smem: 0,
        args,
    })
}

/// The block of one (window of heads, batch): every unit's count of visited
/// tiles, then a stable counting sort of the units, longest first.
fn write_order(w: &mut Writer<String>, spec: &Spec, work: Work) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [batch, heads, heads_kv, q_len, kv_len, mask, order] = [
        ArgKind::Batch,
        ArgKind::Heads,
        ArgKind::HeadsKv,
        ArgKind::QLen,
        ArgKind::KvLen,
        ArgKind::BlockMask,
        ArgKind::WorkOrder,
    ]
    .map(n);
    let [batch_stride, head_stride] = [Axis::Batch, Axis::Head].map(|a| n(ArgKind::BlockMaskStride(a)));
    writeln!(
        w,
        "const int mask_q_tiles = ({q_len} + MASK_M - 1) / MASK_M, mask_kv_tiles = ({kv_len} + MASK_N - 1) / MASK_N;"
    )?;
    // Block (window, batch) orders the units of heads head0 .. head0 +
    // HEADS_PER_BLOCK, first .. first + span of them all: unit c is tile
    // c % tiles of head c / tiles % heads (K/V heads for key tiles), batch
    // c / tiles / heads.
    let (len, heads_of_units) = match work {
        Work::KeyTiles { .. } => (&kv_len, &heads_kv),
        Work::QueryTiles { .. } => (&q_len, &heads),
    };
    write!(
        w,
        "\
        const int tiles = ({len} + TILE - 1) / TILE, units = {batch} * {heads_of_units} * tiles;\n\
        const int b = blockIdx.z, head0 = blockIdx.y * HEADS_PER_BLOCK, first = (b * {heads_of_units} + head0) * tiles;\n\
        const int span = min_i32(HEADS_PER_BLOCK, {heads_of_units} - head0) * tiles;\n"
    )?;
    write_count_of(w, work, [&heads, &heads_kv, &mask, &batch_stride, &head_stride])?;
    write!(
        w,
        "\
        int* counts = {order} + units + first;  // after the order\n\
        __shared__ int longest, starts[BUCKETS];\n\
        if (threadIdx.x == 0) longest = 0;\n\
        if (threadIdx.x < BUCKETS) starts[threadIdx.x] = 0;\n\
        __syncthreads();\n\
        for (int i = threadIdx.x; i < span; i += THREADS) {{\n\
        \x20   counts[i] = count_of(i);\n\
        \x20   atomicMax(&longest, counts[i]);\n\
        }}\n\
        __syncthreads();\n\
        // Bucket 0 holds the window's longest units.\n\
        auto bucket = [&](int count) {{\n\
        \x20   return (int)((long long)(longest - count) * (BUCKETS - 1) / max_i32(longest, 1));\n\
        }};\n\
        for (int i = threadIdx.x; i < span; i += THREADS) atomicAdd(&starts[bucket(counts[i])], 1);\n\
        __syncthreads();\n\
        if (threadIdx.x == 0) {{\n\
        \x20   int sum = 0;\n\
        \x20   for (int k = 0; k < BUCKETS; ++k) {{\n\
        \x20       const int size = starts[k];\n\
        \x20       starts[k] = sum;\n\
        \x20       sum += size;\n\
        \x20   }}\n\
        }}\n\
        __syncthreads();\n\
        // Stable: a warp writes a class's units in launch order, 32 at a time.\n\
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;\n\
        for (int k = warp; k < BUCKETS; k += THREADS / 32) {{\n\
        \x20   int at = first + starts[k];\n\
        \x20   for (int i0 = 0; i0 < span; i0 += 32) {{\n\
        \x20       const int i = i0 + lane;\n\
        \x20       const bool mine = i < span && bucket(counts[i]) == k;\n\
        \x20       const unsigned ballot = __ballot_sync(0xffffffffu, mine);\n\
        \x20       if (mine) {order}[at + __popc(ballot & ((1u << lane) - 1))] = first + i;\n\
        \x20       at += __popc(ballot);\n\
        \x20   }}\n\
        }}\n"
    )
}

/// The lambda `count_of(i)`: the tiles unit i visits, from the block mask
/// (`names`: heads, K/V heads, the mask and its batch and head strides).
fn write_count_of(w: &mut Writer<String>, work: Work, names: [&str; 5]) -> fmt::Result {
    let [heads, heads_kv, mask, batch_stride, head_stride] = names;
    match work {
        Work::KeyTiles { .. } => write!(
            w,
            "\
            // Unit i is key tile i % tiles of K/V head head0 + i / tiles; its count:\n\
            // the mask query tiles with a pair kept by its keys, over the query heads\n\
            // of its K/V head.\n\
            const int group = {heads} / {heads_kv};\n\
            auto count_of = [&](int i) {{\n\
            \x20   const int head = head0 + i / tiles, t = i % tiles;\n\
            \x20   const int col0 = t * TILE / MASK_N, col1 = min_i32(((t + 1) * TILE + MASK_N - 1) / MASK_N, mask_kv_tiles);\n\
            \x20   int count = 0;\n\
            \x20   for (int h = head * group; h < (head + 1) * group; ++h) {{\n\
            \x20       const unsigned char* slice = {mask} + b * {batch_stride} + h * {head_stride};\n\
            \x20       #pragma unroll 4\n\
            \x20       for (int j = 0; j < mask_q_tiles; ++j) {{\n\
            \x20           bool kept = false;\n\
            \x20           for (int col = col0; col < col1; ++col) kept |= slice[(long long)j * mask_kv_tiles + col] != 0;\n\
            \x20           count += kept;\n\
            \x20       }}\n\
            \x20   }}\n\
            \x20   return count;\n\
            }};\n"
        ),
        Work::QueryTiles { .. } => write!(
            w,
            "\
            // Unit i is query tile tiles - 1 - i % tiles (claims start at the last\n\
            // rows) of head head0 + i / tiles; its count: the mask key tiles with a\n\
            // pair kept for its queries.\n\
            auto count_of = [&](int i) {{\n\
            \x20   const int head = head0 + i / tiles, t = tiles - 1 - i % tiles;\n\
            \x20   const unsigned char* slice = {mask} + b * {batch_stride} + head * {head_stride};\n\
            \x20   const int row0 = t * TILE / MASK_M, row1 = min_i32(((t + 1) * TILE + MASK_M - 1) / MASK_M, mask_q_tiles);\n\
            \x20   int count = 0;\n\
            \x20   #pragma unroll 4\n\
            \x20   for (int j = 0; j < mask_kv_tiles; ++j) {{\n\
            \x20       bool kept = false;\n\
            \x20       for (int row = row0; row < row1; ++row) kept |= slice[(long long)row * mask_kv_tiles + j] != 0;\n\
            \x20       count += kept;\n\
            \x20   }}\n\
            \x20   return count;\n\
            }};\n"
        ),
    }
}
