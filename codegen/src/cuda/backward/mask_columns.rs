//! The backward's mask on partial tiles as a union of column bounds
//! (`kit::key_bounds`, as the forward tests it): where the mask's
//! disjuncts each compare the column's built-in linearly or read the row's
//! alone, a lane's row keeps a union of intervals of its columns, tested by
//! one inline-PTX compare and select per element and part, whose max is
//! the logit. Where there are three parts (Longformer's band, global rows
//! and global columns) or one of them is a band (sinks beside a window),
//! the whole mask as C spills the 128-query dK/dV kernel, carrying its
//! booleans; prefix-LM's two one-sided parts compile shorter as C. Other
//! masks stay as written: LLVM already tests a conjunction's elements
//! against per-row bounds, and the inline selects there cost moves (the
//! causal d = 128 step ran 1% slower).
//!
//! The dK/dV kernels' columns are queries: they test the mask with q and k
//! swapped ([`Columns::queries`]); the dQ kernels' are keys, as the
//! forward's.

use super::orientation::Rows;
use crate::abi::ArgKind;
use crate::cuda::kit::key_bounds::{row_parts, union_test, Columns, RowPart, FIRST_KEY, FIRST_QUERY};
use crate::cuda::signature::arg_name;
use crate::spec::{Expr, Spec};

/// A logit lambda's test of the mask as column bounds.
pub(super) struct ColumnMask {
    /// The lambda's statements: the lane's first column, then the bounds.
    lines: Vec<String>,
    /// One call per part, each ending in `(logit)`.
    calls: Vec<String>,
}

impl ColumnMask {
    /// The test of `spec`'s mask for elements of orientation `rows`, R of
    /// each bound as C by `c` (in the spec's own q and k); `None` without a
    /// mask or where the mask is no such union.
    pub(super) fn of(spec: &Spec, rows: Rows, c: impl Fn(&Expr) -> String) -> Option<ColumnMask> {
        let mask = spec.mask.as_ref()?;
        let kv_len = arg_name(spec, ArgKind::KvLen);
        let (columns, first, mask) = match rows {
            Rows::Keys => (Columns::queries(&kv_len), FIRST_QUERY, mask.with_q_and_k_swapped()),
            Rows::Queries => (Columns::keys(&kv_len, false), FIRST_KEY, mask.clone()),
        };
        // R in the spec's own q and k again, where the test swapped them.
        let c_rest = |e: &Expr| match rows {
            Rows::Keys => c(&e.with_q_and_k_swapped()),
            Rows::Queries => c(e),
        };
        let band = |part: &RowPart| matches!(part, RowPart::Bounds(bounds) if bounds.len() >= 2);
        let parts = row_parts(Some(&mask)).filter(|parts| parts.len() >= 3 || parts.iter().any(band))?;
        let (lines, calls) = union_test(&columns, &parts, None, c_rest);
        let lines = std::iter::once(first.to_string()).chain(lines).collect();
        Some(ColumnMask { lines, calls })
    }

    /// The lambda's statements.
    pub(super) fn lines(&self) -> &[String] {
        &self.lines
    }

    /// `logit` where the mask keeps the element and its row and column
    /// exist, else −inf: the max of each part's kept logit.
    pub(super) fn keep(&self, logit: &str) -> String {
        let kept: Vec<String> = self.calls.iter().map(|call| format!("{call}{logit})")).collect();
        kept[1..].iter().fold(kept[0].clone(), |acc, k| format!("fmaxf({acc}, {k})"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mask: &str) -> Spec {
        crate::parse_one(&format!("S {{ dtype: bf16, head_dim: 64, param w: i32, param g: i32, mask: {mask} }}"))
            .unwrap()
    }

    /// Three parts, or two with a band among them, take the union in both
    /// orientations; two one-sided parts and conjunctions stay as written.
    #[test]
    fn unions_of_three_parts_or_a_band() {
        let takes = |mask: &str| {
            let spec = spec(mask);
            let c = |e: &Expr| crate::cuda::kit::expr::c_expr(&spec, e);
            [Rows::Keys, Rows::Queries].map(|rows| ColumnMask::of(&spec, rows, c).map(|m| m.calls.len()))
        };
        assert_eq!(takes("(q - k <= w && k - q <= w) || q < g || k < g"), [Some(3); 2]);
        assert_eq!(takes("k < g || (q >= k && q - k < w)"), [Some(2); 2]);
        assert_eq!(takes("k < g || q >= k"), [None; 2]);
        assert_eq!(takes("q >= k && q - k < w"), [None; 2]);
        assert_eq!(takes("k < g || q + k < w || q < g"), [None; 2]);
    }

    /// The dK/dV kernels read R in the spec's own q and k, on query columns.
    #[test]
    fn swapped_tests_read_the_spec_own_built_ins() {
        let spec = spec("(q - k <= w && k - q <= w) || q < g || k < g");
        let c = |e: &Expr| crate::cuda::kit::expr::c_expr(&spec, e);
        let mask = ColumnMask::of(&spec, Rows::Keys, c).unwrap();
        let lines = mask.lines().join("\n");
        assert!(lines.starts_with(FIRST_QUERY), "{lines}");
        assert!(
            lines.contains("(k < p_g)") && lines.contains("key_bound<BLOCK_M>((long long)p_g - q0_lane)"),
            "{lines}"
        );
        assert!(mask.keep("x").starts_with("fmaxf(fmaxf(kept_between(n * 8 + c, lo0, hi0, x)"), "{}", mask.keep("x"));
    }

    /// A hoisted term of the mask (a division of params, once per CTA) is
    /// read from its register in both kernels, though the test reads a
    /// rewritten copy of the mask.
    #[test]
    fn union_tests_read_hoisted_terms() {
        use crate::cuda::backward::{emit_backward_with, BackwardConfig, BackwardPass};
        use crate::cuda::target::Target;
        let spec = spec("(q - k <= w / g && k - q <= w / g) || q < g || k < g");
        let config = BackwardConfig::preferred(&spec, Target::HOPPER);
        let key_value = emit_backward_with(&spec, BackwardPass::KeyValue, config).source;
        assert!(key_value.contains("key_bound<BLOCK_M>((long long)k - inv_0 - q0_lane)"), "{key_value}");
        let query = emit_backward_with(&spec, BackwardPass::Query, config).source;
        assert!(query.contains("key_bound<BLOCK_N>((long long)q - inv_0 - k0)"), "{query}");
    }
}
