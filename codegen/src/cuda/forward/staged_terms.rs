//! A warp-specialized forward's spec terms that its producer evaluates for
//! the consumers: per key with each tile's K, per item with its Q.

use super::plan::Plan;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::{hoist, Hoisted, Level};
use crate::cuda::kit::terms::{interior_decl, key_terms, spec_exprs, splits_on_interior, write_split_terms};
use crate::cuda::signature::c_type;
use crate::cuda::tile_config::warp_specialized;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// A warp-specialized kernel's spec terms that its producer evaluates for
/// the consumers ([`KeyTerms::Staged`]): the spec's hoisted terms, once.
pub(super) struct StagedTerms<'s> {
    spec: &'s Spec,
    hoisted: Vec<Hoisted<'s>>,
    /// The item's per-CTA and per-query terms come with its Q: where the
    /// ring has three stages. The consumers then meet no global load at an
    /// item's first tile, but the producer's item prologue grows, and with
    /// two stages it has too little lead to hide that.
    pub items: bool,
}

impl<'s> StagedTerms<'s> {
    pub(super) fn of(plan: &Plan<'s>) -> Self {
        let spec = plan.spec;
        let hoisted = hoist(&spec_exprs(spec));
        let any_item = hoisted.iter().any(|h| h.level != Level::Column);
        let items = any_item && warp_specialized(plan.config) && plan.stages >= 3;
        StagedTerms { spec, hoisted, items }
    }

    /// Whether the spec has per-key terms, which come with each tile's K.
    pub(super) fn per_key(&self) -> bool {
        key_terms(&self.hoisted).next().is_some()
    }

    /// Whether the per-key terms' writers read the tile's class: some of
    /// them are the mask's, which interior tiles do not need.
    pub(super) fn reads_class(&self) -> bool {
        splits_on_interior(self.spec, &self.hoisted, Level::Column)
    }

    /// The item terms (per CTA and per query) this kernel stages.
    pub(super) fn item_terms(&self) -> impl Iterator<Item = &Hoisted<'s>> {
        self.hoisted.iter().filter(|h| self.items && h.level != Level::Column)
    }

    /// The shared staging (per CTA and per query for each Q buffer's item,
    /// per key in slots of visited tiles), declared where producer and
    /// consumers both see it.
    pub(super) fn write_buffers(&self, w: &mut Writer<String>) -> fmt::Result {
        for h in self.item_terms() {
            let (ty, name) = (c_type(h.expr.ty), &h.name);
            match h.level {
                Level::Cta => writeln!(w, "__shared__ {ty} staged_{name}[2];  // spec term of each Q buffer's item")?,
                _ => writeln!(
                    w,
                    "__shared__ {ty} staged_{name}[2][BLOCK_M];  // per-query spec terms of each Q buffer's item"
                )?,
            }
        }
        if !self.per_key() {
            return Ok(());
        }
        writeln!(w, "// Per-key spec terms of the visited tiles, tile it in slot it % KEY_SLOTS: one")?;
        writeln!(w, "// slot more than stages, so K's stage goes back before the logit reads them.")?;
        writeln!(w, "constexpr int KEY_SLOTS = STAGES + 1;")?;
        for h in key_terms(&self.hoisted) {
            writeln!(w, "__shared__ {} staged_{}[KEY_SLOTS][BLOCK_N];", c_type(h.expr.ty), h.name)?;
        }
        Ok(())
    }

    /// With item `qb`'s Q on its way: the producer threads load the item's
    /// terms into registers (`item_inv_N`; per query, the thread's slot `i`
    /// holds row `threadIdx.x - THREADS + i * PRODUCER_THREADS`), so that
    /// their latency overlaps the tile classes' loads;
    /// [`StagedTerms::write_item_stores`] stages them.
    pub(super) fn write_item_loads(&self, w: &mut Writer<String>) -> fmt::Result {
        let (ctas, rows): (Vec<&Hoisted>, Vec<&Hoisted>) = self.item_terms().partition(|h| h.level == Level::Cta);
        if ctas.is_empty() && rows.is_empty() {
            return Ok(());
        }
        writeln!(w, "// The item's spec terms per CTA and per query, for its consumers.")?;
        for h in &ctas {
            writeln!(w, "const {} item_{} = {};", c_type(h.expr.ty), h.name, c_expr(self.spec, h.expr))?;
        }
        if rows.is_empty() {
            return Ok(());
        }
        writeln!(w, "constexpr int ITEM_ROWS = (BLOCK_M + PRODUCER_THREADS - 1) / PRODUCER_THREADS;")?;
        for h in &rows {
            writeln!(w, "{} item_{}[ITEM_ROWS];", c_type(h.expr.ty), h.name)?;
        }
        write_item_rows_loop(w, |w| {
            writeln!(w, "const int q = q0 + threadIdx.x - THREADS + i * PRODUCER_THREADS;")?;
            rows.iter().try_for_each(|h| writeln!(w, "item_{}[i] = {};", h.name, c_expr(self.spec, h.expr)))
        })
    }

    /// The stores of [`StagedTerms::write_item_loads`]' terms into the Q
    /// buffer's staging; after the producer threads' barrier, the leader
    /// publishes them on Q's barrier, and the consumers read them once Q is
    /// in: no global load latency at an item's first tile.
    pub(super) fn write_item_stores(&self, w: &mut Writer<String>) -> fmt::Result {
        if self.item_terms().next().is_none() {
            return Ok(());
        }
        for h in self.item_terms().filter(|h| h.level == Level::Cta) {
            writeln!(w, "if (leader) staged_{0}[qb] = item_{0};", h.name)?;
        }
        let rows: Vec<&Hoisted> = self.item_terms().filter(|h| h.level == Level::Row).collect();
        if !rows.is_empty() {
            write_item_rows_loop(w, |w| {
                writeln!(w, "const int r = threadIdx.x - THREADS + i * PRODUCER_THREADS;")?;
                let store = |h: &&Hoisted| writeln!(w, "if (r < BLOCK_M) staged_{0}[qb][r] = item_{0}[i];", h.name);
                rows.iter().try_for_each(store)
            })?;
        }
        writeln!(w, "named_barrier_sync(2 + WARPGROUPS, PRODUCER_THREADS);  // the leader publishes them with Q")
    }

    /// Once tile `j`'s K is on its way: the leader's warp evaluates the
    /// tile's per-key terms into its slot (those of the mask alone only
    /// where the consumers evaluate the mask), and the leader publishes
    /// them, with the tile's word, on K's barrier.
    pub(super) fn write_key_terms(&self, w: &mut Writer<String>) -> fmt::Result {
        let spec = self.spec;
        w.block(format_args!("if (warp == WARPS)"), |w| {
            writeln!(w, "const int kv0 = j * BLOCK_N;")?;
            if self.reads_class() {
                write!(w, "{}", interior_decl(spec, "kv0"))?;
            }
            write_split_terms(w, spec, &self.hoisted, Level::Column, |w, terms| {
                w.block(format_args!("for (int col = lane; col < BLOCK_N; col += 32)"), |w| {
                    writeln!(w, "const int k = kv0 + col;")?;
                    let store = |h: &&Hoisted| {
                        writeln!(w, "staged_{}[it % KEY_SLOTS][col] = {};", h.name, c_expr(spec, h.expr))
                    };
                    terms.iter().try_for_each(store)
                })
            })?;
            writeln!(w, "__syncwarp();  // the warp's terms are in, for the leader's release")?;
            writeln!(w, "if (leader) mbar_arrive(k_full + 8 * stage);")
        })
    }
}

/// A loop over a producer thread's slots of the item's query rows.
pub(super) fn write_item_rows_loop(
    w: &mut Writer<String>,
    body: impl FnOnce(&mut Writer<String>) -> fmt::Result,
) -> fmt::Result {
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int i = 0; i < ITEM_ROWS; ++i)"), body)
}
