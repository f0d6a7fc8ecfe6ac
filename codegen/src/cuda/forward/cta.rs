//! The forward body of kernels whose threads all load and all multiply
//! (mma.sync, and wgmma with 64-key tiles): one CTA per query tile, a
//! two-stage `cp.async` pipeline paced by CTA barriers.

use super::classes::{write_tile_classes, ClassReader, Stagers};
use super::epilogue::{write_epilogue, OStaging};
use super::item::{q_load, write_accumulators, write_item_rows, write_spec_terms, ItemRole};
use super::item_order::write_cta_decode;
use super::kv_loads::KvLoads;
use super::mma::{write_smem_decl, write_tiles_visible, ShmemCols};
use super::persistent;
use super::plan::Plan;
use super::sync_step::write_sync_step;
use super::trace;
use super::wgmma_step::write_wgmma_serial_step;
use crate::abi::ArgKind;
use crate::cuda::kit::hoist::Hoisted;
use crate::cuda::kit::terms::interior_decl;
use crate::cuda::signature::arg_name;
use crate::cuda::target::Mma;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// A forward kernel's body: the persistent one where the plan is
/// warp-specialized, else one CTA per query tile (this module).
pub(super) fn write_body(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let (spec, config) = (plan.spec, plan.config);
    trace::counter(w, plan)?;
    write_smem_decl(w, config.mma)?;
    if let Some(copy) = plan.copy {
        return persistent::write_body(w, plan, copy);
    }
    let name = |kind| arg_name(spec, kind);
    let [q_len, kv_len] = [ArgKind::QLen, ArgKind::KvLen].map(name);
    let ShmemCols { qk: qk_cols, panels, .. } = ShmemCols::of(config.mma);
    write!(
        w,
        "\
        unsigned short* q_tile = smem;\n\
        unsigned short* k_tiles = q_tile + Q_TILE;  // [STAGES][K_TILE]\n\
        unsigned short* v_tiles = k_tiles + STAGES * K_TILE;  // [STAGES][V_TILE]\n\
        \n\
        // The spec's built-ins b and h (q and k are bound per element below).\n"
    )?;
    match plan.global_rows {
        Some(rows) => write_cta_decode(w, spec, rows, &q_len)?,
        None => write!(
            w,
            "\
            const int b = blockIdx.z;\n\
            const int h = blockIdx.y;\n\
            // Query tiles in reverse launch order: under a causal mask the last rows\n\
            // do the most work, and starting them first leaves light tiles for the\n\
            // grid's tail.\n\
            const int q_block = gridDim.x - 1 - blockIdx.x;\n"
        )?,
    }
    write!(
        w,
        "\
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;\n\
        const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair\n"
    )?;
    write_item_rows(w, plan, ItemRole::Cta)?;
    if plan.varlen {
        writeln!(w, "if (q0 >= {q_len}) return;  // a tile past its sequence's end: no rows\n")?;
    }
    let q_load = q_load(spec);
    writeln!(w, "// Prologue: the Q tile, then (once the tile classes say which) the first")?;
    writeln!(w, "// visited K/V tile, in flight together.")?;
    writeln!(w, "load_tile<BLOCK_M, {qk_cols}, D, THREADS{panels}>{q_load}")?;
    writeln!(w, "const int kv_tiles = ({kv_len} + BLOCK_N - 1) / BLOCK_N;")?;
    write_tile_classes(w, spec, config, &q_len, &kv_len, &Stagers::CTA, ClassReader::Cta)?;
    let kv = KvLoads::of(plan);
    writeln!(w, "int j = next_tile(0);")?;
    kv.load_if(w, "j < kv_tiles", "", "j", true)?;
    write!(
        w,
        "\
        cp_async_commit();\n\
        // The tile after j, one ahead: finding it may read the block mask, and a\n\
        // tile's compute hides that load's latency.\n\
        int next = j < kv_tiles ? next_tile(j + 1) : kv_tiles;\n"
    )?;
    writeln!(w)?;
    let hoisted = write_spec_terms(w, plan, &kv_len, false)?;
    write_accumulators(w, plan)?;
    writeln!(w)?;
    let step = |w: &mut Writer<String>| write_cta_step(w, plan, &hoisted);
    write_cta_loop(w, plan, &kv, step)?;
    write_epilogue(w, plan, &hoisted, OStaging::Cta)
}

/// The tile loop of kernels whose threads all load and all multiply: two
/// stages, every thread's copies waited for and published by a CTA barrier.
fn write_cta_loop(
    w: &mut Writer<String>,
    plan: &Plan,
    kv: &KvLoads,
    step: impl Fn(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    writeln!(w, "int stage = 0;")?;
    let interior = interior_decl(plan.spec, "kv0");
    w.block(format_args!("for (; j < kv_tiles; stage ^= 1)"), |w| {
        write!(
            w,
            "\
            const int kv0 = j * BLOCK_N;\n\
            const bool full = tile_full(j);  // the mask keeps every pair: skip evaluating it\n\
            {interior}\
            const unsigned k_smem = smem_addr(k_tiles + stage * K_TILE);\n\
            const unsigned v_smem = smem_addr(v_tiles + stage * V_TILE);\n\
            cp_async_wait_all();\n"
        )?;
        write_tiles_visible(w, plan.config.mma)?;
        // The next loads, K and V of `next`, into the stage the previous
        // iteration finished with, issued ahead of this tile's products.
        kv.load_if(w, "next < kv_tiles", " + (stage ^ 1)", "next", true)?;
        writeln!(w, "cp_async_commit();")?;
        writeln!(w, "const int after = next < kv_tiles ? next_tile(next + 1) : kv_tiles;")?;
        step(w)?;
        writeln!(w, "j = next;")?;
        writeln!(w, "next = after;")
    })?;
    writeln!(w, "cp_async_wait_all();  // nothing may stay in flight past the kernel (kv_len = 0)")
}

/// One K/V tile of a CTA loop, back to back, on the plan's MMA kind.
fn write_cta_step(w: &mut Writer<String>, plan: &Plan, hoisted: &[Hoisted]) -> fmt::Result {
    match plan.config.mma {
        Mma::Sync => write_sync_step(w, plan, hoisted),
        Mma::Wgmma => write_wgmma_serial_step(w, plan, hoisted),
    }
}
