//! Global columns first: under a mask `k < C || rest` (attention sinks
//! beside a window, Longformer's global columns) every query keeps the
//! first C keys, so without more every item would visit the first key tile
//! for a handful of keys, one visited tile in ten beside a 1024-key
//! window. The warp-specialized forward instead takes keys [0, C) from a
//! narrow tile of their own, which the producer copies with the item's Q:
//! each consumer warpgroup runs S over it, a softmax step and P V before
//! its tile walk. The plan says how the walk shares the columns
//! ([`ColumnShare`]): where `rest` is a band the walk keeps `rest && k >=
//! C` alone and every item takes the columns first, the blocks of
//! `COLUMN_KEYS` past the producer's copied by the consumers; elsewhere
//! the walk keeps the whole mask, and an item whose `rest` keeps no pair of
//! its first tile starts past it where C fits the tile. Any C is exact
//! either way.

use super::item::dense_rows;
use super::logit::write_apply_logits;
use super::plan::{ColumnShare, ColumnsFirst, Plan};
use super::softmax::{write_softmax, Rescale};
use super::trace::{self, Event};
use super::wgmma_step::{write_fence_accumulators, write_wgmma_pv_over, write_wgmma_s_over};
use crate::abi::{ArgKind, Axis, Operand};
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// The kernel's constants of the column tile.
pub(super) fn write_column_constants(w: &mut Writer<String>, columns: ColumnsFirst) -> fmt::Result {
    writeln!(w, "constexpr int COLUMN_KEYS = {};  // the global columns' own tile, per Q buffer", columns.keys)?;
    writeln!(w, "constexpr int COLUMN_TILE = COLUMN_KEYS * (QK_COLS + V_COLS);  // its K, then its V")
}

/// The producer's choice for item `qb` (where the columns go apart, ahead
/// of the tile classes; else after `int j = next_tile(0);`):
/// `columns_first` where the item takes the columns from the column tile
/// ([`ColumnShare`]); then every producer thread copies its share of the
/// first `COLUMN_KEYS` columns of K and V and arrives on Q full (its copies
/// complete first).
pub(super) fn write_producer_columns(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    let kv_len = arg_name(plan.spec, ArgKind::KvLen);
    writeln!(
        w,
        "const int column_end = {};  // every query keeps keys [0, column_end)",
        columns.end(plan.spec, &kv_len)
    )?;
    let skip_first = match columns.share {
        ColumnShare::FirstTile => {
            let selector = columns.global.disjunct + 1;
            write!(
                w,
                "\
                // Where of the first tile's pairs only the global columns keep any,\n\
                // the consumers take them from the column tile before their walk,\n\
                // which starts past the first tile.\n\
                const bool columns_first = j == 0 && column_end <= COLUMN_KEYS && tile_bits(0) == {selector} * TILE_WHOLE;\n"
            )?;
            "j = next_tile(1);\n"
        }
        ColumnShare::Apart => {
            writeln!(w, "const bool columns_first = column_end > 0;  // the walk keeps none of them")?;
            ""
        }
    };
    writeln!(w, "bool columns_async = true;  // this thread's column copies complete asynchronously")?;
    w.block(format_args!("if (columns_first)"), |w| {
        write!(w, "{skip_first}")?;
        writeln!(w, "unsigned short* column_k = column_tiles + qb * COLUMN_TILE;")?;
        write_column_copies(w, plan, "PRODUCER_THREADS, true, THREADS", "columns_async", None)
    })?;
    writeln!(
        w,
        "mbar_arrive_loaded<D>(q_full + 8 * qb, columns_async);  // every producer thread, once its copies land"
    )
}

/// The copies of the column block from key `c0` (C; `None`: 0) into
/// `column_k` by `threads` (load_tile's thread count, panels and first
/// thread), from K's and V's rows of (b, kv_head), up to `column_end`, 16
/// bytes at a time where `vector` ends up true.
fn write_column_copies(
    w: &mut Writer<String>,
    plan: &Plan,
    threads: &str,
    vector: &str,
    c0: Option<&str>,
) -> fmt::Result {
    let spec = plan.spec;
    let rows = |op| {
        let stride = arg_name(spec, ArgKind::Stride(op, Axis::Seq));
        let first = c0.map_or(String::new(), |c0| format!(" + (long long){c0} * {stride}"));
        (format!("{}{first}", dense_rows(spec, op, "kv_head")), stride)
    };
    let [(k_rows, k_stride), (v_rows, v_stride)] = [Operand::K, Operand::V].map(rows);
    let count = c0.map_or("column_end".to_string(), |c0| format!("column_end - {c0}"));
    write!(
        w,
        "\
        const unsigned short* k_rows = {k_rows};\n\
        const unsigned short* v_rows = {v_rows};\n\
        {vector} = aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});  // else element by element\n\
        load_tile<COLUMN_KEYS, QK_COLS, D, {threads}>(column_k, k_rows, {k_stride}, {count}, {vector});\n\
        load_tile<COLUMN_KEYS, V_COLS, DV, {threads}>(column_k + COLUMN_KEYS * QK_COLS, v_rows, {v_stride}, {count}, {vector});\n"
    )
}

/// The consumers' column tile of an item whose producer chose
/// `columns_first` (`item_columns`): per block of `COLUMN_KEYS` keys, S
/// over them, the columns' logits (`logit_columns`), a softmax step and P
/// V, waited for: the walk's pipeline starts behind it as on any item.
pub(super) fn write_consumer_columns(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    w.block(format_args!("if (item_columns[qb])"), |w| {
        write!(
            w,
            "\
            // The global columns' tile: its S, the columns' logits, a softmax\n\
            // step and P V.\n\
            constexpr int S_TILES = COLUMN_KEYS / 8;  // this tile's, not the walk's\n\
            unsigned short* column_k = column_tiles + qb * COLUMN_TILE;\n\
            const unsigned k_smem = smem_addr(column_k);\n\
            const unsigned v_smem = k_smem + 2 * COLUMN_KEYS * QK_COLS;\n"
        )?;
        match columns.share {
            ColumnShare::FirstTile => {
                writeln!(w, "const int c0 = 0;  // the producer's block holds every column")?;
                write_column_block(w, plan, columns)?;
            }
            ColumnShare::Apart => {
                let kv_len = arg_name(plan.spec, ArgKind::KvLen);
                writeln!(w, "const int column_end = {};", columns.end(plan.spec, &kv_len))?;
                writeln!(w, "#pragma unroll 1")?;
                w.block(format_args!("for (int c0 = 0; c0 < column_end; c0 += COLUMN_KEYS)"), |w| {
                    w.block(format_args!("if (c0 > 0)"), |w| write_consumer_copies(w, plan))?;
                    write_column_block(w, plan, columns)
                })?;
            }
        }
        trace::point(w, plan, Event::Columns)
    })
}

/// The keys past the producer's block: every consumer thread copies its
/// share of block `c0` once each warpgroup is done with the block before.
fn write_consumer_copies(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    let [heads, heads_kv] = [ArgKind::Heads, ArgKind::HeadsKv].map(|kind| arg_name(plan.spec, kind));
    write!(
        w,
        "\
        named_barrier_sync(1 + WARPGROUPS, THREADS);  // every warpgroup is done with the block before\n\
        const int kv_head = h / ({heads} / {heads_kv});\n\
        bool vector;\n"
    )?;
    write_column_copies(w, plan, "THREADS, true, 0", "vector", Some("c0"))?;
    write!(
        w,
        "\
        cp_async_commit();\n\
        cp_async_wait_all();\n\
        fence_async_smem();  // for the tensor cores\n\
        named_barrier_sync(1 + WARPGROUPS, THREADS);\n"
    )
}

/// One block of the column tile, keys [c0, c0 + COLUMN_KEYS): S, the
/// columns' logits, a softmax step and P V, waited for.
fn write_column_block(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    writeln!(w, "fence_async_smem();  // element-wise copies (unaligned rows) reach the tensor cores")?;
    write_wgmma_s_over(w, plan, columns.keys, "COLUMN_KEYS")?;
    writeln!(w, "wgmma_wait<0>();")?;
    writeln!(w, "fence_operands(s[0]);")?;
    write_apply_logits(w, "logit_columns(x, q, c0 + n * 8 + 2 * t + c, i, n, c)")?;
    write_softmax(w, plan.units, Rescale::Inline, plan.row_sums)?;
    writeln!(w, "unsigned p[COLUMN_KEYS / 16][4];")?;
    writeln!(w, "#pragma unroll")?;
    writeln!(w, "for (int kk = 0; kk < COLUMN_KEYS / 16; ++kk) pack_p(storage{{}}, p[kk], s[0], kk);")?;
    // The softmax's rescale of O and the row sums lands before P V reads them.
    write_fence_accumulators(w, plan.row_sums)?;
    writeln!(w, "wgmma_fence();")?;
    write_wgmma_pv_over(w, plan, "COLUMN_KEYS")?;
    writeln!(w, "wgmma_commit();")?;
    writeln!(w, "wgmma_wait<0>();")?;
    write_fence_accumulators(w, plan.row_sums)
}

#[cfg(test)]
mod tests {
    use super::super::plan::walked_view;
    use super::*;
    use crate::cuda::target::Mma;
    use crate::cuda::tile_config::TileConfig;

    const TWO: TileConfig = TileConfig { mma: Mma::Wgmma, warps: 8, m_tiles: 1, block_n: 128 };

    fn keys(head_dim: u32, config: TileConfig, rest: &str) -> Option<u32> {
        let source = format!("S {{ dtype: bf16, head_dim: {head_dim}, param c: i32, {rest} }}");
        let spec = crate::parse_one(&source).unwrap();
        ColumnsFirst::of(&spec, config).map(|columns| columns.keys)
    }

    #[test]
    fn column_tiles_hold_the_global_columns_rounded_to_16_keys() {
        let window = "(q >= k && q - k < 100)";
        assert_eq!(keys(64, TWO, &format!("mask: k < c || {window}")), Some(32));
        assert_eq!(keys(64, TWO, &format!("mask: {window} || 4 >= k")), Some(16));
        assert_eq!(keys(64, TWO, &format!("mask: k < 40 || {window}")), Some(48));
        assert_eq!(keys(64, TWO, &format!("mask: k <= 63 || {window}")), Some(64));
        assert_eq!(keys(32, TWO, "mask: k < 1 || q >= k"), Some(16));
    }

    #[test]
    fn the_walk_leaves_the_columns_beside_a_band() {
        let share = |mask: &str| {
            let spec =
                crate::parse_one(&format!("S {{ dtype: bf16, head_dim: 64, param c: i32, mask: {mask} }}")).unwrap();
            let columns = ColumnsFirst::of(&spec, TWO).map(|columns| columns.share);
            let view = walked_view(&spec, TWO)
                .and_then(|view| view.mask.as_ref().map(|mask| crate::syntax::expr_source(&view, mask)));
            (columns, view)
        };
        let apart = Some(ColumnShare::Apart);
        assert_eq!(
            share("k < c || (q >= k && q - k < 100)"),
            (apart, Some("q >= k && (q - k < 100 && k >= c)".into()))
        );
        assert_eq!(
            share("(k - q < 9 && q - k < 9) || 4 >= k"),
            (apart, Some("k - q < 9 && (q - k < 9 && k > 4)".into()))
        );
        // A prefix beside causal attention, and global rows: the walk keeps the whole mask.
        assert_eq!(share("k < c || q >= k"), (Some(ColumnShare::FirstTile), None));
        assert_eq!(share("(q - k <= 8 && k - q <= 8) || q < c || k < c"), (Some(ColumnShare::FirstTile), None));
    }

    #[test]
    fn column_tiles_only_where_they_pay_and_fit() {
        let window = "(q >= k && q - k < 100)";
        let sinks = format!("mask: k < c || {window}");
        assert_eq!(keys(64, TWO, &format!("mask: k < 65 || {window}")), None);
        assert_eq!(keys(64, TWO, &format!("mask: k < 0 || {window}")), None);
        assert_eq!(keys(128, TWO, &sinks), None);
        assert_eq!(keys(64, TileConfig { warps: 4, ..TWO }, &sinks), None);
        assert_eq!(keys(64, TileConfig { block_n: 16, ..TWO }, &sinks), None);
        assert_eq!(keys(64, TileConfig { mma: Mma::Sync, warps: 4, m_tiles: 2, block_n: 64 }, &sinks), None);
        // A per-key term (staged per ring tile) or no global columns.
        let bias = "tensor bias: f32[KV_LEN], score: score + bias[k]";
        assert_eq!(keys(64, TWO, &format!("{bias}, mask: k < c || {window}")), None);
        assert_eq!(keys(64, TWO, &format!("mask: q < c || {window}")), None);
        assert_eq!(keys(64, TWO, "mask: k < c && q >= k"), None);
    }
}
