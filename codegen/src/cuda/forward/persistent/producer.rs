//! The producer warpgroup of the persistent forward: it claims each item,
//! copies its Q, classifies its K/V tiles and walks them into the stage
//! ring, handing the consumers each tile's word (and per-key spec terms).

use super::{copy_tile, kv_tiles_decl, q_slot, write_group_classes, write_item_coords, Roles};
use crate::abi::{ArgKind, Operand};
use crate::cuda::forward::classes::{write_tile_classes, ClassReader, Stagers};
use crate::cuda::forward::e4m3::Operands;
use crate::cuda::forward::global_columns::write_producer_columns;
use crate::cuda::forward::item::{q_load, ItemRole};
use crate::cuda::forward::item_order::write_claim_decode;
use crate::cuda::forward::kv_loads::KvLoads;
use crate::cuda::forward::trace::{self, Event};
use crate::cuda::forward::varlen::tile_has_rows;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::{K_MAP, Q_MAP, V_MAP};
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// The producer's item loop.
pub(super) fn write_producer(w: &mut Writer<String>, roles: &Roles) -> fmt::Result {
    let (spec, config, copy, groups) = (roles.plan.spec, roles.plan.config, roles.copy, roles.groups);
    let staged = &roles.staged;
    let name = |kind| arg_name(spec, kind);
    let [q_len, kv_len] = [ArgKind::QLen, ArgKind::KvLen].map(name);
    let counter = name(ArgKind::WorkCounter);
    // Under a data-dependent mask the claims walk the block mask's work
    // order (longest items first within windows of a few heads) where the
    // launch has one.
    let claim = match spec.mask.as_ref().is_some_and(|m| m.reads_tensor()) {
        true if !roles.plan.varlen => {
            let order = name(ArgKind::WorkOrder);
            format!(
                "claim({counter}, done, items);\n\
                 if ({order} != nullptr && item_slot[qb] < items) item_slot[qb] = {order}[item_slot[qb]]"
            )
        }
        _ => format!("claim({counter}, done, items)"),
    };
    let (has_rows, next) = (tile_has_rows(roles.plan), format!("claim({counter}, done + 1, items)"));
    let rows = roles.plan.varlen.then_some((has_rows.as_str(), next.as_str()));
    writeln!(w, "int it = 0;  // visited tiles so far, over all items: tile `it` goes to stage it % STAGES")?;
    let (slot, round) = q_slot(roles.plan);
    w.block(format_args!("for (int done = 0;; ++done)"), |w| {
        write!(
            w,
            "\
            // Item `done` of this CTA goes to Q buffer and slot qb, once the\n\
            // consumers have stored the O of the item that had them before.\n\
            const int qb = {slot};\n\
            mbar_wait(q_empty + 8 * qb, ({round} + 1) % 2);\n"
        )?;
        trace::point(w, roles.plan, Event::PQEmpty)?;
        writeln!(w, "const bool leader = threadIdx.x == THREADS;  // claims, and writes what the consumers read")?;
        w.block(format_args!("if (leader)"), |w| {
            writeln!(w, "item_slot[qb] = {claim};")?;
            write_claim_decode(w, roles.plan, rows)?;
            writeln!(w, "mbar_arrive(item_full + 8 * qb);")
        })?;
        write!(
            w,
            "\
            named_barrier_sync(2 + WARPGROUPS, PRODUCER_THREADS);  // every producer thread sees the claim\n\
            const long long item = item_slot[qb];\n"
        )?;
        trace::point(w, roles.plan, Event::PClaim)?;
        writeln!(w, "if (item >= items) break;  // the consumers stop at the same claim")?;
        write_item_coords(w, roles.plan, ItemRole::Producer(copy))?;
        if roles.plan.varlen {
            w.write_str(&kv_tiles_decl(spec))?;
        }
        writeln!(w, "// Q first: its copy runs while the tiles are classified.")?;
        writeln!(w, "unsigned short* q_tile = q_bufs + qb * Q_TILE;")?;
        let q_coords = format!("q0, h, {}", roles.plan.tma_seq(Operand::Q));
        copy_tile(w, copy, "q_full + 8 * qb", &format!("<BLOCK_M, QK_COLS>(q_tile, {Q_MAP}"), &q_coords, |w| {
            writeln!(w, "load_tile<BLOCK_M, QK_COLS, D, PRODUCER_THREADS, true, THREADS>{}", q_load(spec))?;
            writeln!(w, "mbar_arrive_loaded<D>(q_full + 8 * qb, vector);")
        })?;
        // The global columns' copies too where every item takes them (their
        // latency then runs beside the classes), else once the first tile's
        // class says whether the item does.
        let apart = roles.plan.walks_apart();
        let (early, late) = match roles.plan.columns {
            Some(columns) if apart => (Some(columns), None),
            columns => (None, columns),
        };
        early.into_iter().try_for_each(|columns| write_producer_columns(w, roles.plan, columns))?;
        staged.write_item_loads(w)?;
        let reader = ClassReader::RingWord { block_full: !apart };
        write_tile_classes(w, spec, config, &q_len, &kv_len, &Stagers::PRODUCER, reader)?;
        if groups {
            write_group_classes(w, &q_len)?;
        }
        staged.write_item_stores(w)?;
        writeln!(w, "int j = next_tile(0);")?;
        late.into_iter().try_for_each(|columns| write_producer_columns(w, roles.plan, columns))?;
        trace::point(w, roles.plan, Event::PFirst)?;
        w.block(format_args!("if (leader)"), |w| {
            writeln!(w, "item_visits[qb] = j < kv_tiles;")?;
            if roles.plan.columns.is_some() {
                writeln!(w, "item_columns[qb] = columns_first;")?;
            }
            writeln!(w, "mbar_arrive(q_full + 8 * qb);")
        })?;
        match copy {
            _ if roles.plan.paged && copy == TileCopy::Tma => writeln!(
                w,
                "const int box = lane * 2 + (warp - WARPS) % 2;  // this lane's box of each K or V tile (paged_tma.cuh)"
            )?,
            TileCopy::Tma => writeln!(w, "if (warp != WARPS) continue;  // the leader's warp alone walks the tiles; the others wait for the next claim")?,
            TileCopy::Threads => {}
        }
        write_tile_walk(w, roles)
    })?;
    writeln!(w, "cp_async_wait_all();  // no copy outlives its thread")?;
    writeln!(w, "return;")
}

/// The walk over an item's visited tiles: each tile's word, its K (and
/// per-key terms) and V into the next stage of the ring.
fn write_tile_walk(w: &mut Writer<String>, roles: &Roles) -> fmt::Result {
    let (copy, groups) = (roles.copy, roles.groups);
    let (staged, per_key) = (&roles.staged, roles.staged.per_key());
    let kv = KvLoads::of(roles.plan);
    // A paged kernel copying with TMA: the walking warp's lanes copy a
    // tile's boxes, a page each.
    let boxes = roles.plan.paged && copy == TileCopy::Tma;
    let seq = roles.plan.tma_seq(Operand::K);
    kv.keys(w, "", "j", false)?;
    w.block(format_args!("while (j < kv_tiles)"), |w| {
        writeln!(w, "const int next = next_tile(j + 1);")?;
        kv.keys(w, "_next", "next", true)?;
        writeln!(w, "// The tile's classes, ahead of the wait: the K copy waits for none of them.")?;
        if groups {
            writeln!(w, "const int groups = group_classes(j);")?;
        }
        writeln!(w, "const int word = j << TILE_SHIFT | tile_bits(j) | (next < kv_tiles ? 0 : TILE_LAST);")?;
        if staged.reads_class() {
            writeln!(w, "const bool full = word & TILE_FULL;  // the key terms' writers need the class too")?;
        }
        writeln!(w, "const int stage = it % STAGES, empty_parity = (it / STAGES + 1) % 2;")?;
        trace::point(w, roles.plan, Event::PTile)?;
        writeln!(w, "mbar_wait(k_empty + 8 * stage, empty_parity);")?;
        trace::point(w, roles.plan, Event::PKEmpty)?;
        w.block(format_args!("if (leader)"), |w| {
            if groups {
                writeln!(w, "group_word[stage] = groups;")?;
            }
            writeln!(w, "tile_word[stage] = word;")?;
            match (copy, per_key) {
                _ if boxes => Ok(()),
                (TileCopy::Tma, _) => writeln!(
                    w,
                    "tma_load_tile<BLOCK_N, QK_COLS>(k_tiles + stage * K_TILE, {K_MAP}, k_full + 8 * stage, j * BLOCK_N, kv_head, {seq});"
                ),
                (TileCopy::Threads, false) => writeln!(w, "mbar_arrive(k_full + 8 * stage);"),
                (TileCopy::Threads, true) => Ok(()),
            }
        })?;
        match copy {
            _ if boxes => kv.boxes(w, true, ["k_tiles + stage * K_TILE", "k_full + 8 * stage", "j"])?,
            TileCopy::Threads => {
                kv.k(w, "k_tiles + stage * K_TILE", "j")?;
                writeln!(w, "mbar_arrive_loaded<D>(k_full + 8 * stage, vector);")?;
            }
            TileCopy::Tma => {}
        }
        if per_key {
            staged.write_key_terms(w)?;
        }
        writeln!(w, "mbar_wait(v_empty + 8 * stage, empty_parity);")?;
        trace::point(w, roles.plan, Event::PVEmpty)?;
        if boxes {
            kv.boxes(w, false, ["v_tiles + stage * V_TILE", "v_full + 8 * stage", "j"])?;
        } else {
            // An e4m3 kernel's V tiles lie DVP rows a tile (`e4m3`).
            let (v_box, v_coords) = match roles.plan.operands {
                Operands::Sixteen => ("BLOCK_N, V_COLS", format!("j * BLOCK_N, kv_head, {seq}")),
                Operands::E4m3 => ("DVP, V_PANELS * 64", "j * DVP, kv_head, b".to_string()),
            };
            let v_tile = format!("<{v_box}>(v_tiles + stage * V_TILE, {V_MAP}");
            copy_tile(w, copy, "v_full + 8 * stage", &v_tile, &v_coords, |w| {
                kv.v(w, "v_tiles + stage * V_TILE", "j")?;
                writeln!(w, "mbar_arrive_loaded<DV>(v_full + 8 * stage, vector);")
            })?;
        }
        kv.advance_keys(w)?;
        writeln!(w, "j = next;")?;
        writeln!(w, "++it;")
    })
}
