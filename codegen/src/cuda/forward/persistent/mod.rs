//! The warp-specialized forward kernel's body: persistent CTAs, one per SM
//! (two with one consumer warpgroup each), walk work items (query tiles of
//! every (batch, head)), claiming each further item from a work counter. A producer warpgroup claims an item,
//! loads its Q into one of two Q buffers and its K/V tiles into the stage
//! ring (`library/ring.cuh`), which runs on across items; the consumer warpgroups
//! take turns on the tensor cores, finish the item and stage its O in its
//! own Q buffer, from where each warp's rows leave by TMA, while the
//! producer already loads the next one. The producer
//! alone walks an item's tiles (skipping and classifying them) and hands
//! each tile's index, class and per-key spec terms to the consumers with its
//! K (and an item's per-query terms with its Q), so the
//! consumers' instruction stream is the products and the softmax; the two
//! roles never meet at a CTA barrier.
//!
//! `producer` prints the producer warpgroup's item loop and tile walk,
//! `consumers` the consumer warpgroups'; this module the shared setup (smem
//! carve-up, work items, the ring's barriers) and what both roles use.

mod consumers;
mod producer;

use super::item::{write_item_rows, ItemRole};
use super::item_order::write_item_decoders;
use super::plan::{Plan, ONES_TILE_BYTES};
use super::softmax::RowSums;
use super::staged_terms::StagedTerms;
use super::trace::{self, Event};
use super::wgmma_step::write_last_pv;
use crate::abi::{ArgKind, Side};
use crate::cuda::kit::terms::interior_decl;
use crate::cuda::kit::warp_roles::write_roles;
use crate::cuda::signature::arg_name;
use crate::cuda::tile_config::{ping_pong, TileConfig, TileCopy};
use crate::cuda::writer::Writer;
use crate::mask_parts::MaskParts;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// What both roles' code is printed from: the plan, how the kernel copies,
/// the producer's share of the spec, and whether tiles are classified per
/// consumer warpgroup ([`per_warpgroup_classes`]).
struct Roles<'p, 's> {
    plan: &'p Plan<'s>,
    copy: TileCopy,
    staged: StagedTerms<'s>,
    groups: bool,
}

/// The body of a warp-specialized kernel (see the module note): the
/// producer runs ahead into the next item while the consumers finish the
/// current one and write its O, so neither an item's loads nor a CTA's
/// start-up leave the tensor cores idle.
pub(super) fn write_body(w: &mut Writer<String>, plan: &Plan, copy: TileCopy) -> fmt::Result {
    let roles =
        Roles { plan, copy, staged: StagedTerms::of(plan), groups: per_warpgroup_classes(plan.spec, plan.config) };
    write_setup(w, &roles)?;
    roles.staged.write_buffers(w)?;
    writeln!(w)?;
    write_roles(w, |w| producer::write_producer(w, &roles), |w| consumers::write_consumers(w, &roles))
}

/// Shared memory, the work items and the ring's barriers, set up by every
/// thread before the roles part.
fn write_setup(w: &mut Writer<String>, roles: &Roles) -> fmt::Result {
    let (plan, copy) = (roles.plan, roles.copy);
    let name = |kind| arg_name(plan.spec, kind);
    let [heads, batch] = [ArgKind::Heads, ArgKind::Batch].map(name);
    // A varlen kernel's items cover its longest sequence's query tiles for
    // every sequence; its key tiles are counted per item.
    let (q_len, kv_tiles) = match plan.varlen {
        true => (name(ArgKind::MaxLen(Side::Queries)), String::new()),
        false => (name(ArgKind::QLen), kv_tiles_decl(plan.spec)),
    };
    let (per_key, groups) = (roles.staged.per_key(), roles.groups);
    let group_decl = match groups {
        true => GROUP_WORD,
        false => "",
    };
    let k_writers = match (per_key, copy) {
        (true, _) => "copiers + 1);  // + the writer of the tile word and key terms",
        (false, TileCopy::Tma) => "1);  // the tile word's writer, its copier",
        (false, TileCopy::Threads) => "copiers + 1);  // + the tile word's writer",
    };
    let o_buf = match plan.o_buffer {
        true => "unsigned short* o_buf = v_tiles + STAGES * V_TILE;  // [O_TILE]: the epilogue stages O here\n",
        false => "",
    };
    let (column_tiles, item_columns, column_copiers) = match plan.columns {
        Some(_) => (
            "unsigned short* column_tiles = v_tiles + STAGES * V_TILE + O_TILE;  // [Q buffers][COLUMN_TILE]\n",
            "__shared__ bool item_columns[2];  // the item's global columns go first (global_columns.rs)\n",
            " + PRODUCER_THREADS);  // + the item_visits writer, + each producer thread's column copies",
        ),
        None => ("", "", ");  // + the item_visits writer"),
    };
    // The threads whose copies complete a tile.
    let copiers = match copy {
        TileCopy::Tma => "1;  // one producer thread hands each tile to the copy engine",
        TileCopy::Threads => "PRODUCER_THREADS;  // each producer thread copies a share of it",
    };
    let mut decoders = Writer::new(String::new());
    write_item_decoders(&mut decoders, plan, &q_len)?;
    let decoders = decoders.into_inner();
    let q_bufs = match plan.q_buffers {
        1 => "unsigned short* q_bufs = smem;  // [Q_TILE]: one item's at a time\nunsigned short* k_tiles = q_bufs + Q_TILE;",
        _ => "unsigned short* q_bufs = smem;  // [2][Q_TILE]: this item's and the next one's\nunsigned short* k_tiles = q_bufs + 2 * Q_TILE;",
    };
    write!(
        w,
        "\
        {q_bufs}  // [STAGES][K_TILE]\n\
        unsigned short* v_tiles = k_tiles + STAGES * K_TILE;  // [STAGES][V_TILE]\n\
        {o_buf}\
        {column_tiles}\
        const int warp = warp_index(), lane = threadIdx.x % 32;\n\
        const int g = lane / 4, t = lane % 4;  // accumulator row group and column pair\n\
        \n\
        // Work items: the query tiles of every (batch, head), the tiles of one\n\
        // (batch, head) consecutive and last rows first (under a causal mask\n\
        // they do the most work), so the CTAs at work at one time share K/V\n\
        // through L2, as a grid of one CTA per tile would. A CTA's first item is\n\
        // its index; it claims each further one from the work counter when it\n\
        // is ready for it, so a CTA whose items were light takes more of them.\n\
        const int q_tiles = ({q_len} + BLOCK_M - 1) / BLOCK_M;\n\
        const long long items = (long long)q_tiles * {heads} * {batch};\n\
        {decoders}\
        {kv_tiles}\
        \n\
        // The stage ring's barriers (see the stage ring above): per Q buffer the\n\
        // claimed item (its slot), Q full (with Q, whether the item visits a\n\
        // tile) and Q empty, then per stage K full, V full, K empty, V empty.\n\
        // With each K the producer sends the tile's word (TILE_* bits, index\n\
        // above them).\n\
        __shared__ long long item_slot[2];\n\
        __shared__ int4 item_coords[2];  // the claimed item's b, h and query tile\n\
        __shared__ bool item_visits[2];\n\
        {item_columns}\
        __shared__ int tile_word[STAGES];\n\
        enum : int {{ TILE_FULL = 1, TILE_WHOLE = 2, TILE_LAST = 8, TILE_SHIFT = 4 }};  // TILE_WHOLE: 2 bits\n\
        {group_decl}\
        __shared__ __align__(8) unsigned long long ring_bars[6 + 4 * STAGES];\n\
        const unsigned item_full = smem_addr(ring_bars), q_full = item_full + 16, q_empty = q_full + 16;\n\
        const unsigned k_full = q_empty + 16, v_full = k_full + 8 * STAGES, k_empty = v_full + 8 * STAGES;\n\
        const unsigned v_empty = k_empty + 8 * STAGES;\n\
        const int copiers = {copiers}\n\
        if (threadIdx.x == 0) {{\n\
        \x20   for (int s = 0; s < 2; ++s) {{\n\
        \x20       mbar_init(item_full + 8 * s, 1);  // the claiming thread\n\
        \x20       mbar_init(q_full + 8 * s, copiers + 1{column_copiers}\n\
        \x20       mbar_init(q_empty + 8 * s, WARPS);  // one arrival per consumer warp\n\
        \x20   }}\n\
        \x20   for (int s = 0; s < STAGES; ++s) {{\n\
        \x20       mbar_init(k_full + 8 * s, {k_writers}\n\
        \x20       mbar_init(v_full + 8 * s, copiers);\n\
        \x20       mbar_init(k_empty + 8 * s, WARPS);\n\
        \x20       mbar_init(v_empty + 8 * s, WARPS);\n\
        \x20   }}\n\
        }}\n"
    )?;
    if plan.row_sums == RowSums::TensorCores {
        let ones = ONES_TILE_BYTES / 2;
        write!(
            w,
            "\
            // The B operand of the row sums (RowSums::TensorCores): ones, in any\n\
            // layout; an m64n8k16 product reads two 8-key groups 1024 bytes apart.\n\
            __shared__ __align__(1024) unsigned short ones_tile[{ones}];\n\
            for (int i = threadIdx.x; i < {ones}; i += CTA_THREADS) ones_tile[i] = storage::from_f32(1.0f);\n\
            fence_async_smem();  // the tensor cores read it through the async proxy\n"
        )?;
    }
    writeln!(w, "__syncthreads();")
}

/// Item `done`'s Q buffer and slot `qb`, and how many items its barriers
/// completed for before it (C expressions, parities are theirs mod 2).
fn q_slot(plan: &Plan) -> (&'static str, &'static str) {
    match plan.q_buffers {
        1 => ("0", "done"),
        _ => ("done % 2", "done / 2"),
    }
}

/// Copies a tile into shared memory and completes barrier `bar` with it:
/// with TMA the leader issues `tma_load_tile{tile}, bar, {coords})` (row,
/// head and batch row or sequence), else every producer thread runs
/// `cp_async` (its copies and arrival).
fn copy_tile(
    w: &mut Writer<String>,
    copy: TileCopy,
    bar: &str,
    tile: &str,
    coords: &str,
    cp_async: impl Fn(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    match copy {
        TileCopy::Tma => writeln!(w, "if (leader) tma_load_tile{tile}, {bar}, {coords});"),
        TileCopy::Threads => cp_async(w),
    }
}

/// `kv_tiles`, the item's key tiles (C declaration and newline).
fn kv_tiles_decl(spec: &Spec) -> String {
    format!("const int kv_tiles = ({} + BLOCK_N - 1) / BLOCK_N;\n", arg_name(spec, ArgKind::KvLen))
}

/// A warp-specialized kernel's work item: its (batch, head) and query tile
/// (`item_order::write_claim_decode`), then what `role` needs of its rows (see
/// [`write_item_rows`]).
fn write_item_coords(w: &mut Writer<String>, plan: &Plan, role: ItemRole) -> fmt::Result {
    write!(
        w,
        "\
        // The spec's built-ins b and h (q and k are bound per element below).\n\
        const int4 coords = item_coords[qb];\n\
        const int b = coords.x, h = coords.y, q_block = coords.z;\n"
    )?;
    write_item_rows(w, plan, role)
}

/// The tile loop of a warp-specialized kernel's consumers: each tile waits
/// for its stage of the ring; the step releases the stages it is done with.
/// With `groups` ([`per_warpgroup_classes`]) a warpgroup passes its turn on the
/// tiles before and after those its rows keep pairs of.
fn write_ring_loop(
    w: &mut Writer<String>,
    plan: &Plan,
    groups: bool,
    step: impl Fn(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    let interior = interior_decl(plan.spec, "kv0");
    if groups {
        writeln!(w, "bool finished = false;  // this warpgroup's rows keep no pair of the item's remaining tiles")?;
    }
    w.block(format_args!("for (bool more = item_visits[qb]; more; ++it)"), |w| {
        write!(
            w,
            "\
            // K of this tile, and V of the previous one (its P V runs in this step).\n\
            const int stage = it % STAGES, v_stage = (it + STAGES - 1) % STAGES;\n\
            const unsigned k_smem = smem_addr(k_tiles + stage * K_TILE);\n\
            const unsigned v_smem = smem_addr(v_tiles + v_stage * V_TILE);\n\
            mbar_wait(k_full + 8 * stage, it / STAGES % 2);\n"
        )?;
        trace::point(w, plan, Event::KFull)?;
        writeln!(w, "const int tile = tile_word[stage];  // which tile, and its class (the producer's word)")?;
        writeln!(w, "const int j = tile >> TILE_SHIFT, kv0 = j * BLOCK_N;")?;
        match groups {
            true => write!(
                w,
                "\
                const int group = group_word[stage] >> warpgroup;  // this warpgroup's classes (GROUP_*)\n\
                // The mask keeps every pair (of the CTA's rows, or of this warpgroup's): skip evaluating it.\n\
                const bool full = (tile & TILE_FULL) || (group & GROUP_FULL);\n\
                {interior}\
                more = !(tile & TILE_LAST);\n\
                // Branches on warp votes, which ptxas knows to be uniform: on the\n\
                // shared word itself it moves the loop's stage arithmetic out of\n\
                // the uniform registers (10-15% slower).\n\
                if (__all_sync(0xffffffffu, group & GROUP_BEFORE)) {{\n\
                \x20   pass_turn();  // no pair of this tile or of one before it\n\
                \x20   continue;\n\
                }}\n\
                if (__all_sync(0xffffffffu, group & GROUP_AFTER)) {{  // none of this tile or of one after it: finish the item\n\
                \x20   finished = true;\n\
                \x20   break;\n\
                }}\n"
            )?,
            false => write!(
                w,
                "\
                const bool full = tile & TILE_FULL;  // the mask keeps every pair: skip evaluating it\n\
                {interior}\
                more = !(tile & TILE_LAST);\n"
            )?,
        }
        write!(
            w,
            "\
            if (pv_pending) mbar_wait(v_full + 8 * v_stage, (it - 1) / STAGES % 2);\n\
            fence_async_smem();  // the tensor cores read the stages through the async proxy\n"
        )?;
        step(w)
    })?;
    let wait = [
        "const int v_stage = (it - 1) % STAGES;",
        "mbar_wait(v_full + 8 * v_stage, (it - 1) / STAGES % 2);",
        "fence_async_smem();",
    ];
    // The ring runs on into the next item: the stage goes back to the producer.
    let done = ["if (lane == 0) mbar_arrive(v_empty + 8 * v_stage);  // done with its V"];
    trace::point(w, plan, Event::LoopExit)?;
    write_last_pv(w, plan, &wait, "v_stage", &done)?;
    trace::point(w, plan, Event::LastPv)?;
    if !groups {
        return Ok(());
    }
    writeln!(w, "// The item's remaining tiles, from the one this warpgroup finished at.")?;
    w.block(format_args!("for (bool more = finished; more; ++it)"), |w| {
        write!(
            w,
            "\
            const int stage = it % STAGES;\n\
            mbar_wait(k_full + 8 * stage, it / STAGES % 2);\n\
            more = !(tile_word[stage] & TILE_LAST);\n\
            pass_turn();\n"
        )
    })
}

/// Whether the producer classifies each tile for each consumer warpgroup's
/// rows besides the CTA's (`group_word`), so that a warpgroup passes its
/// turn on the tiles at an item's ends that its rows keep no pair of and
/// skips the mask on tiles its rows keep whole. That pays where an item is
/// taller than a key tile and the mask is a band of two conjuncts, whose
/// both ends move with the rows: a sliding window's three-warpgroup items
/// visit ten tiles, each warpgroup's rows keep pairs of nine (causal
/// masks pass at one end only and gain nothing: three warpgroups' causal
/// kernels ran level at 1k keys and 1.5-2.5% slower from 2k; two
/// warpgroups' 128-row items pass no turn and only pay for the classes).
/// It needs turns and a mask the interval arithmetic bounds without
/// reading tensors.
pub fn per_warpgroup_classes(spec: &Spec, config: TileConfig) -> bool {
    ping_pong(config)
        && config.block_m() > config.block_n
        && spec.mask.as_ref().is_some_and(|m| !m.reads_tensor())
        && matches!(MaskParts::of(spec.mask.as_ref()), Some(MaskParts::Conjuncts(_)))
}

/// The per-warpgroup classes of each ring stage's tile ([`per_warpgroup_classes`]).
const GROUP_WORD: &str = "\
// Per consumer warpgroup w (bit w of each class; the consumer shifts by w):
// its rows keep no pair of the tile or of one before it in the item, none
// of it or of one after it, every pair of it.
__shared__ int group_word[STAGES];
enum : int { GROUP_BEFORE = 1, GROUP_AFTER = 1 << WARPGROUPS, GROUP_FULL = 1 << 2 * WARPGROUPS };
";

/// The producer's lambda that fills `group_word` for tile j: lane
/// `x * WARPGROUPS + w` answers class x for warpgroup w, the walking warp
/// votes.
fn write_group_classes(w: &mut Writer<String>, q_len: &str) -> fmt::Result {
    write!(
        w,
        "\
        // Tile j's classes over each consumer warpgroup's 64 rows (GROUP_*):\n\
        // lane x * WARPGROUPS + w answers class x for warpgroup w. Rows past\n\
        // the sequence keep no pair.\n\
        auto group_classes = [&](int j) -> int {{\n\
        \x20   const int x = lane / WARPGROUPS, w_lo = q0 + lane % WARPGROUPS * 64;\n\
        \x20   const int w_hi = min_i32(w_lo + 64, {q_len}) - 1;\n\
        \x20   bool bit = x < 2 && w_lo > w_hi;\n\
        \x20   if (x < 3 && w_lo <= w_hi) {{\n\
        \x20       const Range r = rows_class(w_lo, w_hi, x == 0 ? 0 : j, x == 1 ? kv_tiles : j + 1);\n\
        \x20       bit = x == 2 ? r.lo == 1 : r.hi == 0;\n\
        \x20   }}\n\
        \x20   return (int)__ballot_sync(0xffffffffu, bit);\n\
        }};\n"
    )
}

/// A consumer warpgroup's turn on a tile its rows keep no pair of: it
/// passes the turn on and releases the tile's stage. It waits for the
/// stage's V, which it never reads, before it releases it: then the
/// stage's previous tile has been released by every warp (the producer
/// waited for that before it loaded V), so these arrivals count towards
/// this tile, and no copy outlives the CTA's last reader. (K is there: the
/// step has waited for it.)
fn write_pass_turn(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    w.write_str(PASS_TURN)?;
    w.indented(|w| trace::point(w, plan, Event::Pass))?;
    writeln!(w, "}};")
}

/// [`write_pass_turn`]'s lambda up to its end.
const PASS_TURN: &str = "\
auto pass_turn = [&]() {  // on tile `it`
    const int stage = it % STAGES;
    named_barrier_sync(1 + warpgroup, 256);
    named_barrier_arrive(1 + (warpgroup + 1) % WARPGROUPS, 256);
    mbar_wait(v_full + 8 * stage, it / STAGES % 2);
    if (lane == 0) {
        mbar_arrive(k_empty + 8 * stage);
        mbar_arrive(v_empty + 8 * stage);
    }
";
