//! The consumer warpgroups of the persistent forward: per claimed item they
//! take their turns on the tensor cores over the ring's tiles, then write
//! the item's LSE and O.

use super::{q_slot, write_item_coords, write_pass_turn, write_ring_loop, Roles};
use crate::abi::ArgKind;
use crate::cuda::forward::e4m3::{write_descales, Operands};
use crate::cuda::forward::epilogue::{write_epilogue, OStaging};
use crate::cuda::forward::global_columns::write_consumer_columns;
use crate::cuda::forward::item::{write_accumulators, write_spec_terms, ItemRole};
use crate::cuda::forward::softmax::RowSums;
use crate::cuda::forward::trace::{self, Event};
use crate::cuda::forward::wgmma_step::{write_q_fragments, write_wgmma_step};
use crate::cuda::signature::arg_name;
use crate::cuda::tile_config::{ping_pong, TileCopy};
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// The consumers' item loop.
pub(super) fn write_consumers(w: &mut Writer<String>, roles: &Roles) -> fmt::Result {
    let (plan, copy, groups) = (roles.plan, roles.copy, roles.groups);
    let (spec, config, sums) = (plan.spec, plan.config, plan.row_sums);
    let item_terms = roles.staged.items;
    let kv_len = arg_name(spec, ArgKind::KvLen);
    let turns = ping_pong(config);
    match turns {
        true => write!(
            w,
            "\
            // The warpgroups take turns issuing their products, in a cycle (named\n\
            // barrier 1 + warpgroup: wait for the turn; arrive on the next one's):\n\
            // the tensor cores then run one warpgroup's S and P V while the others\n\
            // run their softmax (FlashAttention-3's ping-pong). Warpgroup 0 goes\n\
            // first: the last one has passed it the turn. Every warpgroup takes a\n\
            // turn per visited tile, so the cycle runs on across items.\n"
        )?,
        // One warpgroup overlaps the other CTA on its SM instead.
        false => write!(
            w,
            "\
            // One warpgroup: the other CTA on this SM runs its products while this\n\
            // one's softmax does.\n"
        )?,
    }
    writeln!(w, "[[maybe_unused]] const int warpgroup = warp / 4;  // unread where one warpgroup multiplies")?;
    if turns {
        writeln!(w, "if (warpgroup == WARPGROUPS - 1) named_barrier_arrive(1, 256);")?;
    }
    writeln!(w, "int it = 0;  // visited tiles so far, as the producer counts them")?;
    if sums == RowSums::TensorCores {
        writeln!(w, "const unsigned long long ones = gmma_desc(smem_addr(ones_tile), 16, 1024);")?;
    }
    if groups {
        write_pass_turn(w, plan)?;
    }
    let (slot, round) = q_slot(plan);
    w.block(format_args!("for (int done = 0;; ++done)"), |w| {
        write!(
            w,
            "\
            const int qb = {slot};\n\
            mbar_wait(item_full + 8 * qb, {round} % 2);  // the producer's claim\n"
        )?;
        trace::point(w, plan, Event::Item)?;
        writeln!(w, "const long long item = item_slot[qb];")?;
        writeln!(w, "if (item >= items) break;")?;
        write_item_coords(w, plan, ItemRole::Consumers(copy))?;
        if plan.operands == Operands::E4m3 {
            write_descales(w, spec)?;
        }
        writeln!(w)?;
        // The item's staged spec terms come with Q.
        if item_terms {
            writeln!(w, "mbar_wait(q_full + 8 * qb, {round} % 2);  // Q, and the item's spec terms")?;
            trace::point(w, plan, Event::QFull)?;
        }
        let hoisted = write_spec_terms(w, plan, &kv_len, item_terms)?;
        writeln!(w, "unsigned short* q_tile = q_bufs + qb * Q_TILE;")?;
        write_accumulators(w, plan)?;
        writeln!(w)?;
        if !item_terms {
            writeln!(w, "mbar_wait(q_full + 8 * qb, {round} % 2);")?;
            trace::point(w, plan, Event::QFull)?;
        }
        write_q_fragments(w, plan)?;
        if let Some(columns) = plan.columns {
            write_consumer_columns(w, plan, columns)?;
        }
        write_ring_loop(w, plan, groups, |w| write_wgmma_step(w, plan, &hoisted))?;
        let staging = match plan.o_buffer {
            true => OStaging::OBuffer(copy),
            false => OStaging::QBuffer(copy),
        };
        write_epilogue(w, plan, &hoisted, staging)
    })?;
    if copy == TileCopy::Tma {
        writeln!(w, "if (lane == 0) tma_store_wait();  // the last O is written before the CTA exits")?;
    }
    match turns {
        true => {
            writeln!(w, "if (warpgroup == 0) named_barrier_sync(1, 256);  // the turn the last warpgroup passed last")
        }
        false => Ok(()),
    }
}
