//! The persistent form of the Hopper dK/dV kernel (`Layout::persistent`,
//! `Grid::KeyUnits`): one CTA per SM claims units, each a non-persistent
//! CTA's work (a key tile of a (batch, K/V head) pair), from the work
//! counter until none are left.
//!
//! The producer's leader claims unit u into slot u % 2 (`unit_full`) once
//! every producer thread that walks has read the unit two before
//! (`unit_empty`); the consumers read the slot behind `kv_full`, which the
//! leader completes (its K and V copies, or past the last unit none: the
//! end) only once they have freed the last unit's K and V (`kv_empty`),
//! that is after they read that unit's slot. The unit's first head takes a
//! slot of the same parity. The ring, the dQ additions and the tickets run
//! on across units.

use super::{adder_warp_walks, Layout, TMA_COPIERS};
use crate::abi::ArgKind;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::DQ_ACCUM;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Static shared memory the persistent form adds: `kv_empty` and the two
/// slots' full and empty barriers, the unit and first-head slots.
pub(super) const STATIC_SMEM: u32 = 8 * 5 + 4 * 3;

/// The units of the launch, after the CTA's lanes.
pub(super) fn write_count(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let [kv_len, heads_kv, batch] = [ArgKind::KvLen, ArgKind::HeadsKv, ArgKind::Batch].map(|kind| arg_name(spec, kind));
    write!(
        w,
        "\
        // Persistent: this CTA claims units (each a key tile of a (batch, K/V head)\n\
        // pair) until none are left; their dK and dV rows go out through the dS tiles.\n\
        const int key_tiles = ({kv_len} + BLOCK_N - 1) / BLOCK_N, units = key_tiles * {heads_kv} * {batch};\n\
        static_assert(WARPS * 16 * DP <= 2 * DS_TILE, \"a warp's rows of dK fit its part of the dS tiles\");\n"
    )
}

/// The barriers and slots (C declarations), and their initialization by
/// thread 0: `unit_empty` counts every producer thread that walks, the
/// copiers and the adder (a warp of them under a mask that reads tensors).
pub(super) fn barriers(spec: &Spec) -> (&'static str, String) {
    let adder = if adder_warp_walks(spec) { 32 } else { 1 };
    let decls = "\
        // Persistent: K and V freed by the consumers, the unit slots' full and empty\n\
        // barriers, the slots.\n\
        __shared__ __align__(8) unsigned long long unit_bars[5];\n\
        __shared__ int unit_slot[2];\n\
        const unsigned kv_empty = smem_addr(unit_bars), unit_full = kv_empty + 8, unit_empty = unit_full + 16;\n";
    let inits = format!(
        "\
        \x20   mbar_init(kv_empty, 1);  // one consumer thread, behind their barrier\n\
        \x20   for (int s = 0; s < 2; ++s) {{\n\
        \x20       mbar_init(unit_full + 8 * s, 1);  // the leader\n\
        \x20       mbar_init(unit_empty + 8 * s, {TMA_COPIERS} + ({DQ_ACCUM} != nullptr ? {adder} : 0));  // the walkers\n\
        \x20   }}\n"
    );
    (decls, inits)
}

/// The producer's unit u: the leader claims it, the other walkers read it;
/// past the last, the leader ends the consumers' loop behind `kv_full` and
/// every walker leaves its own.
pub(super) fn write_claim(w: &mut Writer<String>, spec: &Spec, layout: &Layout) -> fmt::Result {
    let counter = arg_name(spec, ArgKind::WorkCounter);
    // `kv_full`'s arrivals: the leader's per TMA copy, and its own.
    let kv_arrivals = layout.kv_tiles() + 1;
    write!(
        w,
        "\
        int unit;\n\
        if (leader) {{\n\
        \x20   mbar_wait(unit_empty + 8 * (u % 2), (u / 2 + 1) % 2);\n\
        \x20   unit = (int)claim({counter}, u, units);\n\
        \x20   unit_slot[u % 2] = unit;\n\
        \x20   mbar_arrive(unit_full + 8 * (u % 2));\n\
        }} else {{\n\
        \x20   mbar_wait(unit_full + 8 * (u % 2), u / 2 % 2);\n\
        \x20   unit = unit_slot[u % 2];\n\
        }}\n\
        mbar_arrive(unit_empty + 8 * (u % 2));\n\
        if (unit >= units) {{\n\
        \x20   if (leader) {{\n\
        \x20       mbar_wait(kv_empty, (u + 1) % 2);\n\
        \x20       for (int i = 0; i < {kv_arrivals}; ++i) mbar_arrive(kv_full);  // no K and V: the end\n\
        \x20   }}\n\
        \x20   break;\n\
        }}\n"
    )
}

/// The consumers' unit u: its K and V, or the end.
pub(super) fn write_consumer_entry(w: &mut Writer<String>) -> fmt::Result {
    w.write_str(
        "\
        mbar_wait(kv_full, u % 2);\n\
        const int unit = unit_slot[u % 2];  // the producer's claim, or past the last: the end\n\
        if (unit >= units) break;\n",
    )
}
