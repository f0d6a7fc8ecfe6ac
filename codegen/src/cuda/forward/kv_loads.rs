//! How a forward kernel copies one K or V tile into shared memory with
//! `cp.async` (every thread, or the producer warpgroup's): strided rows,
//! or a paged kernel's rows gathered through its block table; and how a
//! paged kernel's walking warp copies them by TMA, a box per page.

use super::mma::ShmemCols;
use super::plan::Plan;
use super::varlen::{key_var, pages_var};
use crate::abi::{ArgKind, Axis, Operand};
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::{KV_BOX_ROWS, K_MAP, V_MAP};
use crate::cuda::tile_config::{warp_specialized, TileCopy};
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// How the kernel copies one K or V tile (keys from `tile * BLOCK_N`) into
/// shared memory.
pub(super) struct KvLoads {
    /// Copied by a warp-specialized kernel's producer warpgroup (else by
    /// every thread).
    ws: bool,
    /// Rows gathered from pages (`load_paged_tile`), else strided.
    paged: bool,
    /// How a warp-specialized kernel copies.
    copy: TileCopy,
    cols: ShmemCols,
    k_stride: String,
    v_stride: String,
    kv_len: String,
}

impl KvLoads {
    pub(super) fn of(plan: &Plan) -> KvLoads {
        let (spec, config) = (plan.spec, plan.config);
        let name = |kind| arg_name(spec, kind);
        KvLoads {
            ws: warp_specialized(config),
            paged: plan.paged,
            copy: plan.copy.unwrap_or(TileCopy::Threads),
            cols: ShmemCols::of(config.mma),
            k_stride: name(ArgKind::Stride(Operand::K, Axis::Seq)),
            v_stride: name(ArgKind::Stride(Operand::V, Axis::Seq)),
            kv_len: name(ArgKind::KvLen),
        }
    }

    /// When `cond` holds: K of `tile`, and V with it when `with_v`, into the
    /// stage `k_tiles{stage} * K_TILE` (`stage` empty: the first one).
    pub(super) fn load_if(
        &self,
        w: &mut Writer<String>,
        cond: &str,
        stage: &str,
        tile: &str,
        with_v: bool,
    ) -> fmt::Result {
        let dst = |tiles: &str, size: &str| match stage {
            "" => tiles.to_string(),
            _ => format!("{tiles}{stage} * {size}"),
        };
        w.block(format_args!("if ({cond})"), |w| {
            self.k(w, &dst("k_tiles", "K_TILE"), tile)?;
            if with_v {
                self.v(w, &dst("v_tiles", "V_TILE"), tile)?;
            }
            Ok(())
        })
    }

    pub(super) fn k(&self, w: &mut Writer<String>, dst: &str, tile: &str) -> fmt::Result {
        self.load(w, ["k_rows", self.cols.qk, "D", &self.k_stride], dst, tile)
    }

    pub(super) fn v(&self, w: &mut Writer<String>, dst: &str, tile: &str) -> fmt::Result {
        self.load(w, ["v_rows", self.cols.v, "DV", &self.v_stride], dst, tile)
    }

    /// A warp-specialized paged kernel's producer reads each tile's page
    /// ids a tile ahead of its copies, so that the table's latency hides
    /// behind them: declares, of `tile` (`const` ones when `fixed`), the
    /// threads' `k_key{suffix}` and `v_key{suffix}`, or with TMA the
    /// walking warp's `box_page{suffix}` (K and V share their pages).
    pub(super) fn keys(&self, w: &mut Writer<String>, suffix: &str, tile: &str, fixed: bool) -> fmt::Result {
        if !(self.paged && self.ws) {
            return Ok(());
        }
        let qualifier = if fixed { "const " } else { "" };
        if self.copy == TileCopy::Tma {
            let (pages, kv_len) = (pages_var("k_rows"), &self.kv_len);
            return writeln!(
                w,
                "{qualifier}int box_page{suffix} = paged_box_page<BLOCK_N>({pages}, {tile} * BLOCK_N, {kv_len}, {KV_BOX_ROWS}, box);"
            );
        }
        for (rows, cols, width) in [("k_rows", self.cols.qk, "D"), ("v_rows", self.cols.v, "DV")] {
            let call = self.key_call(rows, cols, width, tile);
            writeln!(w, "{qualifier}PagedKey {}{suffix} = {call};", key_var(rows))?;
        }
        Ok(())
    }

    /// The keys of [`KvLoads::keys`] moved on to the next tile's.
    pub(super) fn advance_keys(&self, w: &mut Writer<String>) -> fmt::Result {
        match (self.paged && self.ws, self.copy) {
            (false, _) => Ok(()),
            (true, TileCopy::Tma) => writeln!(w, "box_page = box_page_next;"),
            (true, TileCopy::Threads) => writeln!(w, "k_key = k_key_next;\nv_key = v_key_next;"),
        }
    }

    /// A paged kernel's producer warps' TMA copy of K (`key` true) or V of
    /// `tile` into `dst`, completing on `bar`: box `box` of each from two
    /// of the warps (`library/paged_tma.cuh`), the first lane of the first
    /// of them arriving with the tile's bytes.
    pub(super) fn boxes(&self, w: &mut Writer<String>, key: bool, [dst, bar, tile]: [&str; 3]) -> fmt::Result {
        let (cols, map, first) = match key {
            true => (self.cols.qk, K_MAP, "WARPS"),
            false => (self.cols.v, V_MAP, "WARPS + 2"),
        };
        let (pages, kv_len) = (pages_var("k_rows"), &self.kv_len);
        writeln!(
            w,
            "if (warp / 2 == ({first}) / 2) load_paged_boxes<BLOCK_N, {cols}>({dst}, {map}, {bar}, {pages}, {tile} * BLOCK_N, {kv_len}, {KV_BOX_ROWS}, kv_head, box_page, box, warp == {first} && lane == 0);"
        )
    }

    /// This lane's `paged_key` of `tile` in the pages of `rows`.
    fn key_call(&self, rows: &str, cols: &str, width: &str, tile: &str) -> String {
        let threads = if self.ws { "PRODUCER_THREADS, THREADS" } else { "THREADS" };
        let (pages, kv_len) = (pages_var(rows), &self.kv_len);
        format!(
            "paged_key<BLOCK_N, {cols}, {width}, {threads}>({pages}, {tile} * BLOCK_N, {kv_len} - {tile} * BLOCK_N)"
        )
    }

    /// `source`: the operand's rows, shared-tile columns, valid width and
    /// row stride.
    pub(super) fn load(&self, w: &mut Writer<String>, source: [&str; 4], dst: &str, tile: &str) -> fmt::Result {
        let [rows, cols, width, stride] = source;
        let kv_len = &self.kv_len;
        let threads = match self.ws {
            true => "PRODUCER_THREADS, true, THREADS".to_string(),
            false => format!("THREADS{}", self.cols.panels),
        };
        if self.paged {
            let pages = pages_var(rows);
            let key = match self.ws {
                true => key_var(rows),
                false => self.key_call(rows, cols, width, tile),
            };
            return writeln!(
                w,
                "load_paged_tile<BLOCK_N, {cols}, {width}, {threads}>({dst}, {rows}, {pages}, {key}, {tile} * BLOCK_N, {kv_len} - {tile} * BLOCK_N, vector);"
            );
        }
        writeln!(
            w,
            "load_tile<BLOCK_N, {cols}, {width}, {threads}>({dst}, {rows} + (long long){tile} * BLOCK_N * {stride}, {stride}, {kv_len} - {tile} * BLOCK_N, vector);"
        )
    }
}
