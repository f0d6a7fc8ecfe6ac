//! The e4m3 forward's V tiles: V rewritten with its keys along the rows,
//! per (batch, K/V head) and tile of the forward's keys a block of
//! `pad16(DV)` rows of [`e4m3_v_row`] bytes (whole 128-key panels), zero
//! past kv_len, DV and the tile's keys, keys in the order the
//! forward packs P in (`library/e4m3_v_tiles.cuh`). 8-bit wgmma reads its B operand
//! K-major only, so the forward's P·V cannot read V as it lies; the
//! runtime runs this kernel before each e4m3 forward, a copy of V's bytes
//! against the forward's quadratic work.

use crate::abi::{ArgKind, Axis, Grid, Kernel, Operand};
use crate::cuda::library::Part;
use crate::cuda::signature::{arg_name, e4m3_v_tiles_args};
use crate::cuda::source::{assemble, kernel_name, Entry, Piece};
use crate::cuda::target::pad16;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const THREADS: u32 = 256;

/// Bytes of a V tile's row for tiles of `block_n` keys: whole 128-byte
/// panels (an 8-bit wgmma's K-major operand reads 128-byte rows).
pub fn e4m3_v_row(block_n: u32) -> u32 {
    block_n.next_multiple_of(128)
}

/// Emits the V-tile kernel for `spec`'s e4m3 forward with tiles of
/// `block_n` keys (its V head dim sizes the rows); one block per tile,
/// `Grid::KeyTiles`.
pub fn emit_e4m3_v_tiles(spec: &Spec, block_n: u32) -> Kernel {
    let name = kernel_name(&format!("e4m3_v_tiles_{block_n}"), spec);
    let args = e4m3_v_tiles_args(spec);
    let config = |w: &mut Writer<String>| -> fmt::Result {
        let dv = spec.head_dims.v;
        writeln!(w, "constexpr int DV = {dv}, DVP = {};  // V's head dim, and padded to 16", pad16(dv))?;
        writeln!(
            w,
            "constexpr int KEYS = {block_n}, ROW = {};  // a tile's keys, and its rows' bytes",
            e4m3_v_row(block_n)
        )?;
        writeln!(w, "constexpr int THREADS = {THREADS};\n")
    };
    let library = [vec![Piece::Part(Part::Prelude)], vec![Piece::Part(Part::E4m3VTiles)]];
    let entry = Entry { name: &name, bounds: "THREADS", args: &args };
    let source = assemble(spec, &library, config, entry, |w| write_tile(w, spec));
    Kernel {
        name,
        source,
        grid: Grid::KeyTiles,
        // A block's rows: its tile's keys.
        block_m: block_n,
        block_n,
        threads: THREADS,
        dynamic_smem: 0,
        args,
    }
}

/// Block (tile, K/V head, batch): its keys' rows of V into its tile.
fn write_tile(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [v, heads_kv, kv_len, out] =
        [ArgKind::E4m3(Operand::V), ArgKind::HeadsKv, ArgKind::KvLen, ArgKind::E4m3VTiles].map(n);
    let [batch_stride, seq_stride, head_stride] =
        [Axis::Batch, Axis::Seq, Axis::Head].map(|axis| n(ArgKind::Stride(Operand::V, axis)));
    write!(
        w,
        "\
        const int tile = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;\n\
        const int tiles = ({kv_len} + KEYS - 1) / KEYS;\n\
        const unsigned char* v_rows = {v} + b * {batch_stride} + (long long)tile * KEYS * {seq_stride} + kv_head * {head_stride};\n\
        unsigned char* tile_out = {out} + (((long long)b * {heads_kv} + kv_head) * tiles + tile) * DVP * ROW;\n\
        e4m3_v_tile<DV, DVP, KEYS, ROW, THREADS>(v_rows, {seq_stride}, {kv_len} - tile * KEYS, tile_out);\n"
    )
}
