//! The deterministic dQ kernel: one CTA per (query tile, head, batch),
//! queries as the rows of every warp's tiles (the forward's orientation),
//! walking the kv tiles and keeping dQ in registers. See the module note.

use super::common::dropout_kind;
use super::common::{
    write_column_terms, write_row_terms, write_source, write_spec_lambdas, write_tile_walk, Sections, SpecTerms, Walk,
};
use super::orientation::Rows;
use super::packing::Packing;
use super::step::{write_register_products, write_scores, write_split_elements, FromRegisters, Part};
use super::{BackwardConfig, KeyColumns};
use crate::abi::{ArgKind, Axis, Grid, Kernel, Operand};
use crate::cuda::kit::hoist::hoist;
use crate::cuda::kit::terms::{interior_decl, KeyTerms};
use crate::cuda::kit::tile_walk::write_mask_tiles;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::backward_args;
use crate::cuda::signature::names::DELTA;
use crate::cuda::signature::with_dropout;
use crate::cuda::source::kernel_name;
use crate::cuda::target::pad16;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const OPERANDS: [Operand; 5] = [Operand::Q, Operand::K, Operand::V, Operand::DO, Operand::DQ];
const WARPS: u32 = 4;

pub(super) fn emit(spec: &Spec, config: BackwardConfig, packing: Packing) -> Kernel {
    let name = kernel_name(&packing.prefix(&dropout_kind("bwd_dq", config.dropout)), spec);
    let terms = SpecTerms::new(spec, false, config.dropout);
    let args = with_dropout(spec, packing.args(spec, backward_args(spec, OPERANDS, &[])), config.dropout);
    let block_n = config.dq_block_n;
    let source = write_source(
        spec,
        Sections::Tiles,
        &name,
        &args,
        |w| write_config(w, spec, block_n),
        |w| write_body(w, spec, &terms, packing),
    );
    Kernel {
        name,
        source,
        grid: Grid::QueryTiles,
        block_m: 16 * WARPS,
        block_n,
        threads: 32 * WARPS,
        dynamic_smem: smem_bytes(spec, config),
        args,
    }
}

/// The CTA's Q and dO rows and a key step's K and V (16-bit).
pub(super) fn smem_bytes(spec: &Spec, config: BackwardConfig) -> u32 {
    let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
    2 * (16 * WARPS + config.dq_block_n) * (dp + dvp)
}

fn write_config(w: &mut Writer<String>, spec: &Spec, block_n: u32) -> fmt::Result {
    write!(
        w,
        "\
        constexpr int WARPS = {WARPS};\n\
        constexpr int THREADS = 32 * WARPS;\n\
        constexpr int BLOCK_M = 16 * WARPS;  // queries per CTA, 16 per warp: grid.x = ceil(q_len / BLOCK_M)\n\
        constexpr int BLOCK_N = {block_n};  // keys per step\n\
        constexpr int S_TILES = BLOCK_N / 8;  // m16n8 tiles of a warp's S and dP (16 queries x BLOCK_N keys)\n\
        constexpr int DQ_TILES = DP / 8;  // m16n8 tiles of a warp's dQ\n"
    )?;
    write_mask_tiles(w, spec)?;
    write!(
        w,
        "\
        // Shared memory: this CTA's Q and dO tiles, then per step the K and V tiles.\n\
        constexpr int Q_TILE = BLOCK_M * DP;\n\
        constexpr int DO_TILE = BLOCK_M * DVP;\n\
        constexpr int K_TILE = BLOCK_N * DP;\n"
    )
}

/// Shared memory, the CTA's batch row (or sequence), head and queries; a
/// varlen CTA past its sequence's queries returns.
fn write_cta(w: &mut Writer<String>, spec: &Spec, packing: Packing) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [q_len, kv_len, heads, heads_kv] = [ArgKind::QLen, ArgKind::KvLen, ArgKind::Heads, ArgKind::HeadsKv].map(n);
    write!(
        w,
        "\
        extern __shared__ __align__(128) unsigned short smem[];\n\
        unsigned short* q_tile = smem;  // [BLOCK_M][DP], for every step\n\
        unsigned short* dout_tile = q_tile + Q_TILE;  // [BLOCK_M][DVP]\n\
        unsigned short* k_tile = dout_tile + DO_TILE;  // [BLOCK_N][DP], this step's keys\n\
        unsigned short* v_tile = k_tile + K_TILE;  // [BLOCK_N][DVP]\n\
        \n\
        // The spec's built-ins b and h (q and k are bound per element below).\n\
        const int b = blockIdx.z;\n\
        const int h = blockIdx.y;\n\
        const int q0 = blockIdx.x * BLOCK_M;\n"
    )?;
    packing.write_sequence(w, spec, true, "q0", &q_len)?;
    write!(
        w,
        "\
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;\n\
        const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair\n\
        const int kv_head = h / ({heads} / {heads_kv});\n\
        const int kv_tiles = ({kv_len} + BLOCK_N - 1) / BLOCK_N;\n\
        [[maybe_unused]] const int q_lo = q0, q_hi = min_i32(q0 + BLOCK_M, {q_len}) - 1;  // this CTA's queries (for the classes)\n\
        \n"
    )?;
    Ok(())
}

fn write_body(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms, packing: Packing) -> fmt::Result {
    let n = |kind| arg_name(spec, kind);
    let [q_len, kv_len, lse, scale] = [ArgKind::QLen, ArgKind::KvLen, ArgKind::Lse, ArgKind::Scale].map(n);
    let seq = |op| n(ArgKind::Stride(op, Axis::Seq));
    let [q_stride, k_stride, v_stride, do_stride, dq_stride] = OPERANDS.map(seq);
    let statistic_row = packing.statistic_row(spec, "h");
    write_cta(w, spec, packing)?;
    for (op, rows, head) in [
        (Operand::Q, "q_rows", "h"),
        (Operand::DO, "dout_rows", "h"),
        (Operand::K, "k_rows", "kv_head"),
        (Operand::V, "v_rows", "kv_head"),
        (Operand::DQ, "dq_rows", "h"),
    ] {
        packing.write_rows(w, spec, op, rows, head)?;
    }
    write!(
        w,
        "\
        const bool vector = aligned16(q_rows, {q_stride}) && aligned16(dout_rows, {do_stride})\n\
        \x20   && aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});\n\
        load_tile<BLOCK_M, DP, D, THREADS>(q_tile, q_rows + (long long)q0 * {q_stride}, {q_stride}, {q_len} - q0, vector);\n\
        load_tile<BLOCK_M, DVP, DV, THREADS>(dout_tile, dout_rows + (long long)q0 * {do_stride}, {do_stride}, {q_len} - q0, vector);\n\
        cp_async_commit();\n\
        \n\
        // The statistics of this lane's rows: LSE in log2 units (+inf where the row\n\
        // is fully masked or past q_len, so P = 0) and D.\n\
        float lse_r[2], delta_r[2];\n\
        #pragma unroll\n\
        for (int i = 0; i < 2; ++i) {{\n\
        \x20   const int q = q0 + warp * 16 + g + 8 * i;\n\
        \x20   const long long row = {statistic_row} + q;\n\
        \x20   const float l = q < {q_len} ? {lse}[row] : neg_inf();\n\
        \x20   lse_r[i] = l == neg_inf() ? -neg_inf() : l * LOG2E;\n\
        \x20   delta_r[i] = q < {q_len} ? {DELTA}[row] : 0.0f;\n\
        }}\n\
        \n\
        // ldmatrix rows of this lane (see LdmLane): *_a the A-operand pattern (also\n\
        // B operands through .trans), *_b the B-operand pattern.\n\
        const LdmLane<DP> d_a(lane % 8 + (lane / 8 % 2) * 8, lane / 16), d_b(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
        const LdmLane<DVP> dv_a(lane % 8 + (lane / 8 % 2) * 8, lane / 16), dv_b(lane % 8 + lane / 16 * 8, lane / 8 % 2);\n\
        const unsigned q_smem = smem_addr(q_tile), dout_smem = smem_addr(dout_tile);\n\
        const unsigned k_smem = smem_addr(k_tile), v_smem = smem_addr(v_tile);\n\
        \n"
    )?;
    let exprs = terms.exprs(spec);
    let hoisted = hoist(&exprs);
    write_row_terms(w, spec, &hoisted, (Rows::Queries, KeyTerms::PerThread), Some("q0 + warp * 16"))?;
    write_spec_lambdas(w, spec, terms, &hoisted, Rows::Queries)?;
    write_tile_walk(w, spec, &Walk { axis: "k", tiles: "kv_tiles", size: "BLOCK_N", len: &kv_len })?;
    write!(
        w,
        "\
        \n\
        // This warp's 16 rows of dQ (f32), over every key: no atomics.\n\
        float dq_acc[DQ_TILES][4] = {{}};\n"
    )?;
    let interior = interior_decl(spec, "kv0");
    w.block(format_args!("for (int j = next_tile(0); j < kv_tiles; j = next_tile(j + 1))"), |w| {
        write!(
            w,
            "\
            const int kv0 = j * BLOCK_N;\n\
            const bool full = tile_full(j);  // the mask keeps every pair: skip evaluating it\n\
            {interior}\
            __syncthreads();  // every warp is done with the previous step's K and V\n\
            load_tile<BLOCK_N, DP, D, THREADS>(k_tile, k_rows + (long long)kv0 * {k_stride}, {k_stride}, {kv_len} - kv0, vector);\n\
            load_tile<BLOCK_N, DVP, DV, THREADS>(v_tile, v_rows + (long long)kv0 * {v_stride}, {v_stride}, {kv_len} - kv0, vector);\n\
            cp_async_commit();\n\
            cp_async_wait_all();\n\
            __syncthreads();  // K and V are visible\n"
        )?;
        write_column_terms(w, spec, &hoisted, Rows::Queries, "kv0")?;
        write_scores(w, Rows::Queries, KeyColumns::Whole)?;
        write_split_elements(w, spec, terms, Rows::Queries, ("q0 + warp * 16", "kv0"), Part::Both)?;
        write!(
            w,
            "\
            \n\
            // dQ += dS K, dS straight from the registers (key tiles 2kk and 2kk + 1\n\
            // form the A fragment of the kk-th 16-key step).\n"
        )?;
        let dq = FromRegisters { a: "dsa", from: "dp", acc: "dq_acc", tiles: "DQ_TILES", b: "kb", smem: "k_smem", lane: "d_a", first_col: None };
        write_register_products(w, "BLOCK_N / 16", &[dq])
    })?;
    write!(
        w,
        "\
        cp_async_wait_all();  // nothing may stay in flight past the kernel (no step visited)\n\
        \n\
        // Epilogue: dQ = scale * sum dS K for the rows and columns that exist,\n\
        // staged in this warp's rows of the Q tile once every product has read it.\n\
        __syncthreads();\n\
        store_warp_rows(storage{{}}, q_tile + warp * 16 * DP, dq_acc, {scale}, dq_rows, {dq_stride}, q0 + warp * 16, {q_len}, D);\n"
    )
}
