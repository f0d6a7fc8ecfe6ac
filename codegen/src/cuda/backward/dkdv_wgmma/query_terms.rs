//! The dK/dV kernel's per-query spec terms (a document mask's `doc[b][q]`),
//! staged: the producer's threads that store a step's statistics evaluate
//! them too, into the step's stage (`staged_N[STAGES][BLOCK_M]`), and the
//! consumers read them in place, as the forward's per-key terms
//! ([`KeyTerms::Staged`]). Held per thread they take 2 × S_TILES registers
//! each beside Sᵀ, dPᵀ, dK and dV, and every consumer thread loads its
//! columns' terms each step.
//!
//! A stage's terms live as long as its Q and dO: the consumers read them in
//! the element code, before they release the stage.

use super::{DqSplit, Layout};
use crate::cuda::backward::common::write_column_terms;
use crate::cuda::backward::orientation::Rows;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::hoist::Hoisted;
use crate::cuda::kit::terms::{interior_decl, splits_on_interior, write_split_terms, write_stage_pointers, KeyTerms};
use crate::cuda::signature::c_type;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// Bytes of one staged term: four at most (`i32`, `f32`) per query of
/// each stage.
const TERM_BYTES: u32 = 4;

/// How a kernel's per-query terms reach its consumers.
pub(super) struct QueryTerms<'h, 's> {
    spec: &'s Spec,
    hoisted: &'h [Hoisted<'s>],
    /// `Staged` in 128-query steps (whole columns, d = 64), where the spec
    /// has such terms and their stages fit beside the layout's shared
    /// memory: there a thread's arrays (32 registers a term) spill the
    /// consumers. In shorter steps they fit, and registers beat reading
    /// shared memory in both element passes.
    pub columns: KeyTerms,
}

impl<'h, 's> QueryTerms<'h, 's> {
    pub(super) fn of(spec: &'s Spec, hoisted: &'h [Hoisted<'s>], layout: &Layout) -> Self {
        let level = Rows::Keys.column_level();
        let count = hoisted.iter().filter(|h| h.level == level).count() as u32;
        let bytes = count * TERM_BYTES * layout.stages * layout.block_m;
        let staged = layout.dq_split() == DqSplit::Rows && count > 0 && bytes <= layout.spare_smem(spec);
        let columns = if staged { KeyTerms::Staged } else { KeyTerms::PerThread };
        QueryTerms { spec, hoisted, columns }
    }

    fn staged(&self) -> impl Iterator<Item = &'h Hoisted<'s>> {
        let staged = self.columns == KeyTerms::Staged;
        self.hoisted.iter().filter(move |h| staged && h.level == Rows::Keys.column_level())
    }

    /// The stages' shared arrays.
    pub(super) fn write_buffers(&self, w: &mut Writer<String>) -> fmt::Result {
        for h in self.staged() {
            let (ty, name) = (c_type(h.expr.ty), &h.name);
            writeln!(
                w,
                "__shared__ {ty} staged_{name}[STAGES][BLOCK_M];  // per-query spec term of each stage's step"
            )?;
        }
        Ok(())
    }

    /// The producer, before it waits for the stage: the step's terms into
    /// registers, rows as its statistics' (`STAT_ROWS`), those of the mask
    /// alone only where the consumers evaluate it (the tile not interior).
    pub(super) fn write_loads(&self, w: &mut Writer<String>) -> fmt::Result {
        let staged: Vec<&Hoisted> = self.staged().collect();
        if staged.is_empty() {
            return Ok(());
        }
        writeln!(w, "// The step's per-query spec terms, for the consumers.")?;
        for h in &staged {
            writeln!(w, "{} term_{}[STAT_ROWS] = {{}};", c_type(h.expr.ty), h.name)?;
        }
        let spec = self.spec;
        let level = Rows::Keys.column_level();
        if splits_on_interior(spec, self.hoisted, level) {
            write!(w, "{}", interior_decl(spec, "k0"))?;
        }
        write_split_terms(w, spec, self.hoisted, level, |w, terms| {
            writeln!(w, "#pragma unroll")?;
            w.block(format_args!("for (int i = 0; i < STAT_ROWS; ++i)"), |w| {
                writeln!(w, "const int q = q0 + threadIdx.x - THREADS + i * COPIERS;")?;
                terms.iter().try_for_each(|h| writeln!(w, "term_{}[i] = {};", h.name, c_expr(spec, h.expr)))
            })
        })
    }

    /// The producer, once the stage is free: the terms into it, published
    /// with the statistics on the stage's full barrier.
    pub(super) fn write_stores(&self, w: &mut Writer<String>) -> fmt::Result {
        let staged: Vec<&Hoisted> = self.staged().collect();
        if staged.is_empty() {
            return Ok(());
        }
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for (int i = 0; i < STAT_ROWS; ++i)"), |w| {
            writeln!(w, "const int r = threadIdx.x - THREADS + i * COPIERS;")?;
            let store = |h: &&Hoisted| writeln!(w, "if (r < BLOCK_M) staged_{0}[stage][r] = term_{0}[i];", h.name);
            staged.iter().try_for_each(store)
        })
    }

    /// The consumers, per step: the terms of the step's queries, pointed at
    /// in its stage, or loaded into this thread's arrays while the products
    /// run.
    pub(super) fn write_columns(&self, w: &mut Writer<String>) -> fmt::Result {
        let level = Rows::Keys.column_level();
        if !self.hoisted.iter().any(|h| h.level == level) {
            return Ok(());
        }
        match self.columns {
            KeyTerms::Staged => {
                writeln!(w, "// The spec's terms of the step's queries, where the producer staged them.")?;
                write_split_terms(w, self.spec, self.hoisted, level, |w, terms| write_stage_pointers(w, terms, "stage"))
            }
            KeyTerms::PerThread => {
                writeln!(w, "// The spec's terms of the tile's queries, loaded while the products run.")?;
                write_column_terms(w, self.spec, self.hoisted, Rows::Keys, "q0")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::backward::common::SpecTerms;
    use crate::cuda::backward::{BackwardConfig, BackwardTile, KeyColumns};
    use crate::cuda::kit::hoist::hoist;
    use crate::cuda::target::Target;

    /// A document mask's per-query ids are staged in 128-query steps only,
    /// and their stages fit beside the layout; a spec without per-query
    /// terms stages nothing.
    #[test]
    fn per_query_terms_are_staged_in_128_query_steps() {
        let spec = |d: u32, mask: &str| {
            crate::parse_one(&format!("S {{ dtype: bf16, head_dim: {d}, tensor doc: i32[B, KV_LEN], mask: {mask} }}"))
                .unwrap()
        };
        let staged = |spec: &Spec, block_m| {
            let tile = BackwardTile::hopper(KeyColumns::Whole, block_m);
            let config = BackwardConfig::preferred(spec, Target::HOPPER).with_tile(tile);
            let layout = Layout::of(spec, config).unwrap();
            let terms = SpecTerms::new(spec, config.tensor_grads, config.dropout);
            let exprs = terms.exprs(spec);
            let hoisted = hoist(&exprs);
            let columns = QueryTerms::of(spec, &hoisted, &layout).columns;
            let level = Rows::Keys.column_level();
            let count = hoisted.iter().filter(|h| h.level == level).count() as u32;
            if columns == KeyTerms::Staged {
                assert!(count * TERM_BYTES * layout.stages * layout.block_m <= layout.spare_smem(spec));
            }
            (layout.block_m, columns == KeyTerms::Staged)
        };
        let documents = "doc[b][q] == doc[b][k]";
        assert_eq!(staged(&spec(64, documents), 128), (128, true));
        assert_eq!(staged(&spec(64, documents), 64), (64, false));
        assert_eq!(staged(&spec(128, documents), 80), (80, false));
        assert_eq!(staged(&spec(64, "doc[b][k] > 0"), 128), (128, false));
    }
}
