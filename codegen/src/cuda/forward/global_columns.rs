//! Global columns first: under a mask `k < C || rest` (attention sinks
//! beside a window, Longformer's global columns) every query keeps the
//! first C keys, so without more every item would visit the first key tile
//! for a handful of keys, one visited tile in ten beside a 1024-key
//! window. The warp-specialized forward instead takes keys [0, C) from a
//! narrow tile of their own, which the producer copies with the item's Q:
//! each consumer warpgroup runs S over it, a softmax step and P V before
//! its tile walk. The plan says how the walk shares the columns
//! ([`ColumnShare`]): where `rest` is a band and C a literal the walk keeps
//! `rest && k >= C` alone and every item takes the columns first;
//! elsewhere the walk keeps the whole mask, and an item whose `rest` keeps
//! no pair of its first tile starts past it where C fits the tile. Any C
//! is exact either way.

use super::item::dense_rows;
use super::logit::write_apply_logits;
use super::plan::{ColumnShare, ColumnsFirst, Plan};
use super::softmax::{write_softmax, Rescale};
use super::trace::{self, Event};
use super::wgmma_step::{write_fence_accumulators, write_fence_s, write_wgmma_pv_over, write_wgmma_s_over};
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
    let spec = plan.spec;
    let [(k_rows, k_stride), (v_rows, v_stride)] = [Operand::K, Operand::V]
        .map(|op| (dense_rows(spec, op, "kv_head"), arg_name(spec, ArgKind::Stride(op, Axis::Seq))));
    writeln!(w, "bool columns_async = true;  // this thread's column copies complete asynchronously")?;
    w.block(format_args!("if (columns_first)"), |w| {
        write!(
            w,
            "\
            {skip_first}\
            unsigned short* column_k = column_tiles + qb * COLUMN_TILE;\n\
            const unsigned short* k_rows = {k_rows};\n\
            const unsigned short* v_rows = {v_rows};\n\
            columns_async = aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});  // else element by element\n\
            load_tile<COLUMN_KEYS, QK_COLS, D, PRODUCER_THREADS, true, THREADS>(column_k, k_rows, {k_stride}, column_end, columns_async);\n\
            load_tile<COLUMN_KEYS, V_COLS, DV, PRODUCER_THREADS, true, THREADS>(column_k + COLUMN_KEYS * QK_COLS, v_rows, {v_stride}, column_end, columns_async);\n"
        )
    })?;
    writeln!(
        w,
        "mbar_arrive_loaded<D>(q_full + 8 * qb, columns_async);  // every producer thread, once its copies land"
    )
}

/// The consumers' column tile of an item whose producer chose
/// `columns_first` (`item_columns`): S over its keys, the columns' logits
/// (`logit_columns`), a softmax step and P V, waited for: the walk's
/// pipeline starts behind it as on any item.
pub(super) fn write_consumer_columns(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    w.block(format_args!("if (item_columns[qb])"), |w| {
        write!(
            w,
            "\
            // The global columns' tile: its S, the columns' logits, a softmax\n\
            // step and P V.\n\
            constexpr int S_TILES = COLUMN_KEYS / 8;  // this tile's, not the walk's\n\
            const unsigned k_smem = smem_addr(column_tiles + qb * COLUMN_TILE);\n\
            const unsigned v_smem = k_smem + 2 * COLUMN_KEYS * QK_COLS;\n\
            fence_async_smem();  // the producer's element-wise copies (unaligned rows) reach the tensor cores\n"
        )?;
        write_wgmma_s_over(w, plan, columns.keys, "COLUMN_KEYS")?;
        writeln!(w, "wgmma_wait<0>();")?;
        write_fence_s(w)?;
        write_apply_logits(w, "logit_columns(x, q, n * 8 + 2 * t + c, i, n, c)")?;
        write_softmax(w, plan.units, Rescale::Inline, plan.row_sums)?;
        writeln!(w, "unsigned p[M_TILES][COLUMN_KEYS / 16][4];")?;
        writeln!(w, "#pragma unroll")?;
        writeln!(w, "for (int kk = 0; kk < COLUMN_KEYS / 16; ++kk) pack_p(storage{{}}, p[0][kk], s[0], kk);")?;
        // The softmax's rescale of O and the row sums lands before P V reads them.
        write_fence_accumulators(w, plan.row_sums)?;
        writeln!(w, "wgmma_fence();")?;
        write_wgmma_pv_over(w, plan, "COLUMN_KEYS")?;
        writeln!(w, "wgmma_commit();")?;
        writeln!(w, "wgmma_wait<0>();")?;
        write_fence_accumulators(w, plan.row_sums)?;
        trace::point(w, plan, Event::Columns)
    })
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
        assert_eq!(share("k < 4 || (q >= k && q - k < c)"), (apart, Some("q >= k && (q - k < c && k >= 4)".into())));
        assert_eq!(
            share("(k - q < 9 && q - k < 9) || 40 >= k"),
            (apart, Some("k - q < 9 && (q - k < 9 && k > 40)".into()))
        );
        // A param's C, which may pass the tile; a prefix beside causal
        // attention; global rows: the walk keeps the whole mask.
        let first_tile = (Some(ColumnShare::FirstTile), None);
        assert_eq!(share("k < c || (q >= k && q - k < 100)"), first_tile);
        assert_eq!(share("k < 4 || q >= k"), first_tile);
        assert_eq!(share("(q - k <= 8 && k - q <= 8) || q < c || k < c"), first_tile);
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
