//! The consumers of the Hopper dK/dV kernel in transposed tiles
//! ([`Transposed`](crate::cuda::backward::KeyColumns::Transposed), head
//! dims 129 through 256: FlashAttention-4's sm90 tile). Each warpgroup owns
//! [`keys`] of the CTA's keys (48, or 32 above 192) and computes, per step,
//! queries as rows:
//!
//! - S = Q·Kᵀ and dP = dO·Vᵀ on its keys (64 queries × KEYS), both operands
//!   K-major from shared memory;
//! - P and dS with the deterministic dQ kernel's element code
//!   (`step::write_elements`, [`Rows::Queries`]), stored to shared memory
//!   transposed by `stmatrix.trans` (keys as rows: K-major B operands);
//! - dVᵀ += dOᵀ·P and dKᵀ += Qᵀ·dS, head dims as wgmma's rows (one m64
//!   product per 64-column panel of the stage's dO and Q, MN-major): KEYS
//!   keys' dKᵀ and dVᵀ take 72 registers each at 192, where 64 keys' rows
//!   of dK and dV would take 192 together;
//! - once both warpgroups' dSᵀ are in place, dQ = dS·K on its half of dQ's
//!   columns (dSᵀ the MN-major A operand, K's panels in [`Chunk`]s), staged
//!   for the producer's bulk addition as in the other layouts.
//!
//! Nothing is computed twice (column halves repeat Sᵀ and dPᵀ). At the end
//! dKᵀ and dVᵀ are transposed back through the freed K and V tiles.

use super::consumers::{chunk_offset, write_dq_tile_store, write_score_products, write_step_entry, Consumers};
use super::{Chunk, Layout};
use crate::abi::{ArgKind, Axis, Operand};
use crate::cuda::backward::common::{write_column_terms, write_row_refill, write_row_terms, write_spec_lambdas};
use crate::cuda::backward::dkdv::{write_head_grad_adds, write_head_grad_sums};
use crate::cuda::backward::orientation::Rows;
use crate::cuda::backward::step::{write_elements, write_split_elements, Part};
use crate::cuda::kit::terms::KeyTerms;
use crate::cuda::kit::tile_walk::write_mask_tiles;
use crate::cuda::library;
use crate::cuda::library::wgmma_ops::AFrom;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::DQ_ACCUM;
use crate::cuda::source::Piece;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Keys per consumer warpgroup (the CTA has two), the N of S's, dP's,
/// dKᵀ's and dVᵀ's products: 48 up to 192 columns (dKᵀ and dVᵀ 72
/// registers each), 32 above (64 each at 256).
pub(super) fn keys(padded: [u32; 2]) -> u32 {
    match padded[0].max(padded[1]) {
        0..=192 => 48,
        _ => 32,
    }
}

/// The products the kernel issues: S and dP (K-major both), dKᵀ and dVᵀ
/// (A MN-major), dQ's chunks (both MN-major).
pub(super) fn products(layout: &Layout) -> Vec<Piece> {
    let keys = keys(layout.padded);
    let mut pieces = vec![
        Piece::Part(library::Part::Wgmma),
        Piece::Wgmma(keys, AFrom::Shared),
        Piece::Wgmma(keys, AFrom::SharedMnA),
    ];
    let mut widths: Vec<u32> = layout.dq.iter().map(|chunk| chunk.width).collect();
    widths.sort_unstable();
    widths.dedup();
    pieces.extend(widths.into_iter().map(|n| Piece::Wgmma(n, AFrom::SharedMnAB)));
    pieces
}

/// The tile constants after the shared configuration.
pub(super) fn write_tiles(w: &mut Writer<String>, spec: &Spec, layout: &Layout) -> fmt::Result {
    let chunks = layout.dq;
    let dq_shift = match *chunks {
        [first, second] if first.first[1] > second.first[1] => second.width / 8,
        _ => 0,
    };
    write!(
        w,
        "\
        constexpr int KEYS = {keys};  // keys per consumer warpgroup\n\
        constexpr int S_TILES = KEYS / 8;  // m16n8 tiles of a warp's S and dP (16 queries x KEYS keys)\n\
        constexpr int DK_PANELS = DP / 64, DV_PANELS = DVP / 64;  // 64-row products of dK^T and dV^T\n\
        // The second warpgroup's dQ chunks end its columns' first panel last: its tile n\n\
        // is tile (n + DQ_SHIFT) % DQ_TILES of its columns.\n\
        constexpr int DQ_SHIFT = {dq_shift};\n",
        keys = keys(layout.padded),
    )?;
    write_mask_tiles(w, spec)?;
    w.write_str(
        "\
        // Shared memory, every tile in wgmma's 64-column panels: this CTA's K and V;\n\
        // STAGES stages of a step's Q and dO tiles and two statistics per query; two\n\
        // dS^T tiles and one P^T tile (keys as rows); DQ_BUFS steps' dQ.\n\
        constexpr int K_TILE = BLOCK_N * DPC;\n\
        constexpr int V_TILE = BLOCK_N * DVPC;\n\
        constexpr int Q_TILE = BLOCK_M * DPC;\n\
        constexpr int DO_TILE = BLOCK_M * DVPC;\n\
        constexpr int DS_TILE = BLOCK_N * BLOCK_M;\n",
    )
}

/// The consumer warpgroups: per head and visited step the products of the
/// module note; at the end dK and dV.
pub(super) fn write(w: &mut Writer<String>, c: &Consumers) -> fmt::Result {
    let Consumers { spec, terms, hoisted, .. } = *c;
    write!(
        w,
        "\
        const int warpgroup = warp / 4;\n\
        const int query_warp = warp % 4;  // this warp's 16 queries of a step\n\
        const int key0 = warpgroup * KEYS;  // this warpgroup's first key of the CTA's\n\
        const unsigned k_smem = smem_addr(k_tile), v_smem = smem_addr(v_tile), pt_smem = smem_addr(pt_tile);\n\
        // Descriptors of this warpgroup's keys, K-major: of K and V (S, dP) and\n\
        // of P^T (dV^T); of K MN-major (dQ = dS K: its rows are the reduction).\n\
        const unsigned long long k_own = gmma_desc(k_smem + key0 * 128, 16, 1024);\n\
        const unsigned long long v_own = gmma_desc(v_smem + key0 * 128, 16, 1024);\n\
        const unsigned long long pt_own = gmma_desc(pt_smem + key0 * 128, 16, 1024);\n\
        const unsigned long long k_mn = gmma_desc(k_smem, BLOCK_N * 128, 1024);\n\
        // dK^T and dV^T of this warpgroup's keys (f32, head dims as rows), summed\n\
        // over every query of every head of the group: no atomics.\n\
        float dkt[DK_PANELS][S_TILES][4] = {{}};\n\
        float dvt[DV_PANELS][S_TILES][4] = {{}};\n\
        mbar_wait(kv_full, 0);\n\
        int next_h = first_head;  // the head of the next visited step (the producer's word)\n"
    )?;
    w.block(format_args!("for (int h = kv_head * group; h < (kv_head + 1) * group; ++h)"), |w| {
        writeln!(w, "if (h != next_h) continue;  // the head visits no step")?;
        write_row_terms(w, spec, hoisted, (Rows::Queries, KeyTerms::PerThread), None)?;
        write_spec_lambdas(w, spec, terms, hoisted, Rows::Queries)?;
        write_head_grad_sums(w, spec, terms)?;
        w.block(format_args!("for (; next_h == h; ++it)"), |w| write_step(w, c))?;
        write_head_grad_adds(w, spec, terms)
    })?;
    write_epilogue(w, spec)
}

/// One step: the producer's query tile j of head h against this
/// warpgroup's keys.
fn write_step(w: &mut Writer<String>, c: &Consumers) -> fmt::Result {
    let Consumers { spec, terms, hoisted, layout, .. } = *c;
    let keys = keys(layout.padded);
    write_step_entry(w, spec, c.copy, "K-major (S, dP) and MN-major\n// (dK^T, dV^T: their head dims are the rows)")?;
    write!(
        w,
        "\
        \n\
        // S = Q K^T, then dP = dO V^T, each in a group of its own, on BLOCK_M\n\
        // queries x this warpgroup's keys; the first k-step overwrites them.\n\
        float s[S_TILES][4], dp[S_TILES][4];\n\
        wgmma_fence();\n"
    )?;
    write_score_products(w, keys, ("s", "DP"), [("q_smem_k", "BLOCK_M"), ("k_own", "BLOCK_N")])?;
    write_score_products(w, keys, ("dp", "DVP"), [("dout_smem_k", "BLOCK_M"), ("v_own", "BLOCK_N")])?;
    write!(
        w,
        "\
        // While the products run: this lane's rows' statistics (LSE in log2 units,\n\
        // D) and the spec's terms of the step's queries and this warpgroup's keys.\n\
        float lse_r[2], delta_r[2];\n\
        #pragma unroll\n\
        for (int i = 0; i < 2; ++i) {{\n\
        \x20   const int r = query_warp * 16 + g + 8 * i;\n\
        \x20   lse_r[i] = lse_cols[stage * BLOCK_M + r];\n\
        \x20   delta_r[i] = delta_cols[stage * BLOCK_M + r];\n\
        }}\n"
    )?;
    let rows = ("q0 + query_warp * 16", "k0 + key0");
    write_row_refill(w, spec, hoisted, Rows::Queries, rows.0)?;
    write_column_terms(w, spec, hoisted, Rows::Queries, rows.1)?;
    let store_p = "\
        // P^T into this warpgroup's rows of its tile, for dV^T = dO^T P once all four\n\
        // warps' queries are there.\n\
        store_key_major(storage{}, pt_smem, s, key0, query_warp * 16);\n\
        fence_async_smem();\n\
        named_barrier_sync(2 + warpgroup, 128);\n";
    let dv = "// dV^T += dO^T P: dV's head dims as rows, in 64-row panels of dO (MN-major).";
    // P alone while dP still runs where the element pass splits, else P and
    // dS together; either way dV^T is issued once P is stored.
    let splits = Part::splits(terms);
    if splits {
        writeln!(w, "wgmma_wait<1>();  // S is done; dP may still run")?;
        writeln!(w, "fence_operands(s);")?;
    } else {
        writeln!(w, "wgmma_wait<0>();")?;
        writeln!(w, "fence_operands(s);")?;
        writeln!(w, "fence_operands(dp);")?;
    }
    let first_pass = if splits { Part::P } else { Part::Both };
    write_split_elements(w, spec, terms, Rows::Queries, rows, first_pass)?;
    w.write_str(store_p)?;
    writeln!(w, "{dv}")?;
    write_key_products(w, keys, ("dvt", "DV_PANELS"), ("dout_smem_mn", "pt_own"))?;
    if splits {
        writeln!(w, "wgmma_wait<1>();  // dP is done; dV^T may still run")?;
        writeln!(w, "fence_operands(dp);")?;
        write_elements(w, spec, terms, Rows::Queries, rows, Part::Ds, false)?;
    }
    write!(
        w,
        "\
        // dS^T into this warpgroup's rows of the step's tile (they alternate per\n\
        // step: the barrier below keeps either warpgroup from reusing one the\n\
        // other's dQ reads), for dK^T and both warpgroups' dQ.\n\
        const unsigned ds_smem = smem_addr(ds_tiles + it % 2 * DS_TILE);\n\
        store_key_major(storage{{}}, ds_smem, dp, key0, query_warp * 16);\n\
        fence_async_smem();\n\
        named_barrier_sync(1, THREADS);  // both warpgroups' dS^T are in place\n\
        // dK^T += Q^T dS.\n\
        const unsigned long long ds_own = gmma_desc(ds_smem + key0 * 128, 16, 1024);\n"
    )?;
    write_key_products(w, keys, ("dkt", "DK_PANELS"), ("q_smem_mn", "ds_own"))?;
    write_step_dq(w, layout)
}

/// `acc[p] += A_p^T B` for each of `panels` 64-row panels: A the stage's
/// tile `a` (MN-major: its head dims as rows), B `b`, this warpgroup's
/// `keys` rows of a key-major tile; one commit group.
fn write_key_products(
    w: &mut Writer<String>,
    keys: u32,
    (acc, panels): (&str, &str),
    (a, b): (&str, &str),
) -> fmt::Result {
    write!(
        w,
        "\
        wgmma_fence();\n\
        #pragma unroll\n\
        for (int kk = 0; kk < BLOCK_M / 16; ++kk) {{\n\
        \x20   #pragma unroll\n\
        \x20   for (int p = 0; p < {panels}; ++p) {{\n\
        \x20       wgmma_ss_mna_n{keys}({acc}[p], desc_plus({a}, p * BLOCK_M * 128 + kk * 16 * 128), desc_plus({b}, kk * 32), 1);\n\
        \x20   }}\n\
        }}\n\
        wgmma_commit();\n"
    )
}

/// The end of a step: dQ = dS·K for this warpgroup's half of the columns
/// (with a dQ accumulator), staged for the producer's bulk addition; the
/// stage is released once the products that read it are done.
fn write_step_dq(w: &mut Writer<String>, layout: &Layout) -> fmt::Result {
    let release = "if (lane == 0) mbar_arrive(stage_empty + 8 * stage);  // this warp is done with the stage\n";
    w.block(format_args!("if ({DQ_ACCUM} != nullptr)"), |w| {
        writeln!(w, "// dQ = dS K on BLOCK_M queries x this warpgroup's half of the columns (dS^T")?;
        writeln!(w, "// and K both MN-major), added to the f32 accumulator.")?;
        writeln!(w, "const unsigned long long ds_mn = gmma_desc(ds_smem, BLOCK_N * 128, 1024);")?;
        writeln!(w, "float dq[DQ_TILES][4];")?;
        writeln!(w, "wgmma_fence();")?;
        writeln!(w, "#pragma unroll")?;
        let chunks = layout.dq;
        w.block(format_args!("for (int kk = 0; kk < BLOCK_N / 16; ++kk)"), |w| {
            let mut tile = 0;
            for &Chunk { width, first } in chunks.iter() {
                let acc = match chunks.len() {
                    1 => "dq".to_string(),
                    _ => format!("acc_cols<{tile}, {width}>(dq)"),
                };
                let offset = chunk_offset(first, "BLOCK_N", "warpgroup");
                writeln!(
                    w,
                    "wgmma_ss_mnab_n{width}({acc}, desc_plus(ds_mn, kk * 16 * 128), desc_plus(k_mn, kk * 16 * 128{offset}), kk);"
                )?;
                tile += width / 8;
            }
            Ok(())
        })?;
        writeln!(w, "wgmma_commit();")?;
        writeln!(w, "// dQ reads no stage: the producer may refill it while dQ runs.")?;
        writeln!(w, "wgmma_wait<1>();  // dV^T and dK^T are done")?;
        w.write_str(release)?;
        writeln!(w, "wgmma_wait<0>();")?;
        writeln!(w, "fence_operands(dq);")?;
        let chunk = "dq_chunk(DQ_TILES, warpgroup, (n + warpgroup * DQ_SHIFT) % DQ_TILES, threadIdx.x % 128)";
        write_dq_tile_store(w, chunk)
    })?;
    w.block(format_args!("else"), |w| {
        writeln!(w, "// Deterministic mode: a separate kernel computes dQ.")?;
        writeln!(w, "wgmma_wait<0>();")?;
        w.write_str(release)
    })
}

/// dK = scale · dKᵀᵀ and dV = dVᵀᵀ, transposed back through the K and V
/// tiles (free once every warpgroup's last dQ has read K) and stored as
/// whole rows for the keys and columns that exist.
fn write_epilogue(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [kv_len, scale] = [ArgKind::KvLen, ArgKind::Scale].map(|kind| arg_name(spec, kind));
    let [dk_stride, dv_stride] = [Operand::DK, Operand::DV].map(|op| arg_name(spec, ArgKind::Stride(op, Axis::Seq)));
    write!(
        w,
        "\
        \n\
        // Epilogue (every product was waited for in its step).\n\
        #pragma unroll\n\
        for (int p = 0; p < DK_PANELS; ++p) fence_operands(dkt[p]);\n\
        #pragma unroll\n\
        for (int p = 0; p < DV_PANELS; ++p) fence_operands(dvt[p]);\n\
        // dQ = dS K reads both warpgroups' keys: the consumers' barrier frees K and V.\n\
        named_barrier_sync(1, THREADS);\n\
        stage_key_rows<storage, DPC>(storage{{}}, k_smem, dkt, {scale}, key0);\n\
        stage_key_rows<storage, DVPC>(storage{{}}, v_smem, dvt, 1.0f, key0);\n\
        named_barrier_sync(1, THREADS);  // every key's rows are staged\n\
        const int keys = min_i32(BLOCK_N, {kv_len} - k0);\n\
        const bool dk_vector = aligned16(dk_rows, {dk_stride}), dv_vector = aligned16(dv_rows, {dv_stride});\n\
        store_key_rows<DPC>(k_tile, dk_rows + (long long)k0 * {dk_stride}, {dk_stride}, keys, D, dk_vector, threadIdx.x, THREADS);\n\
        store_key_rows<DVPC>(v_tile, dv_rows + (long long)k0 * {dv_stride}, {dv_stride}, keys, DV, dv_vector, threadIdx.x, THREADS);\n"
    )
}
