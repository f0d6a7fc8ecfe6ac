//! Global columns first: under a mask `k < C || rest` (attention sinks
//! beside a window, Longformer's global columns) every query keeps the
//! first C keys, so without more every item would visit the first key tile
//! for a handful of keys, one visited tile in ten beside a 1024-key
//! window. Where no other disjunct keeps a pair of an item's first tile,
//! the warp-specialized forward instead takes keys [0, C) from a narrow
//! tile of their own, which the producer copies with the item's Q: each
//! consumer warpgroup runs S over it, the first softmax step and P V
//! before its tile walk, which then starts at the second tile. Items whose
//! other disjuncts reach the first tile (the rows near it, global rows)
//! walk it as before, so any C is exact: the narrow tile only serves
//! items with C <= `COLUMN_KEYS`.

use super::item::dense_rows;
use super::logit::write_apply_logits;
use super::plan::{ColumnsFirst, Plan};
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

/// The producer's choice for item `qb`, after `int j = next_tile(0);`:
/// `columns_first` where the first tile is visited, its pairs are the
/// global columns' alone (every key of it present) and they fit the column
/// tile; then every producer thread copies its share of the columns' K and
/// V and arrives on Q full (its copies complete first), and the walk starts
/// past the first tile.
pub(super) fn write_producer_columns(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    let spec = plan.spec;
    // This (batch, K/V head)'s rows of K and V, and their row strides.
    let [(k_rows, k_stride), (v_rows, v_stride)] = [Operand::K, Operand::V]
        .map(|op| (dense_rows(spec, op, "kv_head"), arg_name(spec, ArgKind::Stride(op, Axis::Seq))));
    let selector = columns.global.disjunct + 1;
    write!(
        w,
        "\
        // Global columns first: where of the first tile's pairs only the keys\n\
        // below the columns' end keep any, the consumers take those keys from\n\
        // the column tile before their walk, which starts past the first tile.\n\
        const int column_end = {end};\n\
        const bool columns_first = j == 0 && column_end <= COLUMN_KEYS && tile_bits(0) == {selector} * TILE_WHOLE;\n\
        bool columns_async = true;  // this thread's column copies complete asynchronously\n\
        if (columns_first) {{\n\
        \x20   j = next_tile(1);\n\
        \x20   unsigned short* column_k = column_tiles + qb * COLUMN_TILE;\n\
        \x20   const unsigned short* k_rows = {k_rows};\n\
        \x20   const unsigned short* v_rows = {v_rows};\n\
        \x20   columns_async = aligned16(k_rows, {k_stride}) && aligned16(v_rows, {v_stride});  // else element by element\n\
        \x20   load_tile<COLUMN_KEYS, QK_COLS, D, PRODUCER_THREADS, true, THREADS>(column_k, k_rows, {k_stride}, column_end, columns_async);\n\
        \x20   load_tile<COLUMN_KEYS, V_COLS, DV, PRODUCER_THREADS, true, THREADS>(column_k + COLUMN_KEYS * QK_COLS, v_rows, {v_stride}, column_end, columns_async);\n\
        }}\n\
        mbar_arrive_loaded<D>(q_full + 8 * qb, columns_async);  // every producer thread, once its copies land\n",
        end = columns.end(spec),
    )
}

/// The consumers' column tile of an item whose producer chose
/// `columns_first` (`item_columns`): S over its keys, the mask's global
/// columns alone, the first softmax step of every row and P V, waited for:
/// the walk's pipeline starts behind it as on any item.
pub(super) fn write_consumer_columns(w: &mut Writer<String>, plan: &Plan, columns: ColumnsFirst) -> fmt::Result {
    w.block(format_args!("if (item_columns[qb])"), |w| {
        write!(
            w,
            "\
            // The global columns' tile (COLUMN_KEYS keys from key 0): its S, the\n\
            // columns' disjunct alone, the softmax's first step and P V.\n\
            constexpr int S_TILES = COLUMN_KEYS / 8;  // this tile's, not the walk's\n\
            const unsigned k_smem = smem_addr(column_tiles + qb * COLUMN_TILE);\n\
            const unsigned v_smem = k_smem + 2 * COLUMN_KEYS * QK_COLS;\n\
            fence_async_smem();  // the producer's element-wise copies (unaligned rows) reach the tensor cores\n"
        )?;
        write_wgmma_s_over(w, plan, columns.keys, "COLUMN_KEYS")?;
        writeln!(w, "wgmma_wait<0>();")?;
        writeln!(w, "fence_operands(s[0]);")?;
        let only = columns.global.disjunct;
        write_apply_logits(w, &format!("logit_only{only}(x, q, n * 8 + 2 * t + c, i, n, c)"))?;
        write_softmax(w, plan.units, Rescale::Inline, plan.row_sums)?;
        writeln!(w, "unsigned p[COLUMN_KEYS / 16][4];")?;
        writeln!(w, "#pragma unroll")?;
        writeln!(w, "for (int kk = 0; kk < COLUMN_KEYS / 16; ++kk) pack_p(storage{{}}, p[kk], s[0], kk);")?;
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
