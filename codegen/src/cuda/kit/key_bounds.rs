//! Mask comparisons linear in k, tested as bounds on the element's column.
//!
//! A mask conjunct that compares a k-free i32 term R with k, q − k or k − q
//! (causal's `q >= k`, a sliding window's `q - k < window`) keeps, along a
//! row of a tile, an interval of keys, and so does `k < kv_len`. The
//! logit's element at key k = k0 + j (k0 = kv0 + 2t, the lane's first key
//! of the tile; j = 8n + c, a constant of the unrolled loop) is then kept
//! where `j OP B`, with a bound B that is the same for every element of a
//! row (LLVM computes it once per row after unrolling, as it does the
//! bias's `X(k0)` in `bias.rs`): a compare with an immediate per bound and
//! the select per element, where `q - k < window` cost a subtraction, a
//! compare and the column's key and bounds check. On partial tiles (a
//! causal diagonal, a window's two edges) that is most of the mask's cost.
//!
//! Exact for every input: the k side never wraps in i32 (k, q ∈ [0, 2^31),
//! so k, q − k and k − q all fit), R is evaluated as the spec says, and the
//! bound in 64 bits, then clamped into [−1, BLOCK_N] (`key_bound`), where
//! every j ∈ [0, BLOCK_N) compares as it does with the unclamped bound.
//!
//! Where every conjunct of a mask is such a bound, the row's bounds meet in
//! one interval [lo, hi] of columns, and the element's test and select are
//! one `kept_between` (an inline-PTX compare pair and select that reads the
//! element: written as C compares, LLVM evaluates them ahead of the wait for
//! S, and ptxas then carries 64 booleans across it in registers), or one
//! `kept_at_most` / `kept_at_least` where the row is bounded on one side
//! only. Masks of other shapes keep the spec's expression.
//!
//! The backward's dK/dV kernels have queries as columns: they read the
//! same bounds off the mask with q and k swapped ([`Columns::queries`],
//! `backward/mask_columns.rs`).

use crate::mask_parts::MaskParts;
use crate::spec::{BinOp, Builtin, Expr, ExprKind, Ty};

/// Declares `k0`, the lane's first key of the tile, in a logit lambda
/// (whose `k` is `k0 + n * 8 + c`).
pub(crate) const FIRST_KEY: &str = "const int k0 = k - (n * 8 + c);";

/// Declares `q0_lane`, the lane's first query of the tile, in a dK/dV
/// kernel's logit lambda (whose `q` is `q0_lane + n * 8 + c`).
pub(crate) const FIRST_QUERY: &str = "const int q0_lane = q - (n * 8 + c);";

/// The conjuncts of `mask` (all of `a && b && ...`) as key bounds, when
/// every one is; no mask is the empty conjunction.
pub(crate) fn key_bounds(mask: Option<&Expr>) -> Option<Vec<KeyBound<'_>>> {
    fn flatten<'e>(e: &'e Expr, out: &mut Vec<KeyBound<'e>>) -> Option<()> {
        match &e.kind {
            ExprKind::Binary(BinOp::And, a, b) => {
                flatten(a, out)?;
                flatten(b, out)
            }
            _ => {
                out.push(KeyBound::of(e)?);
                Some(())
            }
        }
    }
    let mut out = Vec::new();
    match mask {
        Some(e) => flatten(e, &mut out).map(|()| out),
        None => Some(out),
    }
}

/// The names a column test is written in. The forward's columns are keys
/// ([`Columns::keys`]); the dK/dV kernels' are queries
/// ([`Columns::queries`]), which test the mask with q and k swapped.
pub(crate) struct Columns {
    /// The lane's first column of the tile (a column's `j` counts from
    /// it), declared by the lambda; the row's built-in.
    first: &'static str,
    other: &'static str,
    /// The tile's columns, a C constant.
    block: &'static str,
    /// The last column that exists, as C, where not every one does.
    last: Option<String>,
    /// Whether the row exists, as C, where not every one does.
    row: Option<String>,
}

impl Columns {
    /// Keys from `k0` ([`FIRST_KEY`]), rows of `q`; with `in_bounds` every
    /// key of the tile exists, else those below `kv_len`.
    pub(crate) fn keys(kv_len: &str, in_bounds: bool) -> Columns {
        let last = (!in_bounds).then(|| format!("key_bound<BLOCK_N>((long long){kv_len} - k0) - 1"));
        Columns { first: "k0", other: "q", block: "BLOCK_N", last, row: None }
    }

    /// Queries from `q0_lane` ([`FIRST_QUERY`]), rows of `k`: every query
    /// column (a column past `q_len` has no gradient: its statistics see to
    /// that), none of a row past `kv_len`.
    pub(crate) fn queries(kv_len: &str) -> Columns {
        Columns { first: "q0_lane", other: "k", block: "BLOCK_M", last: None, row: Some(format!("k < {kv_len}")) }
    }

    /// The last column a row may keep.
    fn last(&self) -> String {
        self.last.clone().unwrap_or_else(|| format!("{} - 1", self.block))
    }
}

/// How a logit lambda (after [`FIRST_KEY`], or [`FIRST_QUERY`]) keeps the
/// columns of the row that exist ([`Columns`]) and the `bounds` keep (C of
/// each R by `c_rest`), the latter skipped where the C condition `full`
/// holds (if any): its statements (which declare `lo<suffix>` and
/// `hi<suffix>`), and the call that keeps the logit, which ends in
/// `(logit)`. A row bounded on one side only tests that side: one compare
/// and the select per element instead of two and the select (a causal
/// diagonal; each edge of a sliding window, whose other conjunct holds
/// there).
pub(crate) fn column_test(
    columns: &Columns,
    bounds: &[KeyBound],
    full: Option<&str>,
    suffix: &str,
    c_rest: impl Fn(&Expr) -> String,
) -> (Vec<String>, String) {
    let block = columns.block;
    let (mut mask_lo, mut mask_hi) = (Vec::new(), Vec::new());
    for bound in bounds {
        let b = format!("key_bound<{block}>({})", bound.c_bound(columns, &c_rest(bound.rest)));
        match bound.op {
            BinOp::Lt => mask_hi.push(format!("{b} - 1")),
            BinOp::Le => mask_hi.push(b),
            BinOp::Gt => mask_lo.push(format!("{b} + 1")),
            _ => mask_lo.push(b),
        }
    }
    // The bound of `f` over `base` and the mask's `terms`, `base` alone where `full`.
    let fold = |base: String, terms: Vec<String>, f: &str| {
        let with_mask = terms.iter().fold(base.clone(), |acc, t| format!("{f}({acc}, {t})"));
        match full {
            Some(full) if !terms.is_empty() => format!("{full} ? {base} : {with_mask}"),
            _ => with_mask,
        }
    };
    // A side with no bound keeps every column: lo = 0, or hi = the last one.
    let (has_lo, mut has_hi) = (!mask_lo.is_empty(), columns.last.is_some() || !mask_hi.is_empty());
    let (mut lo, mut hi) = (fold("0".to_string(), mask_lo, "max_i32"), fold(columns.last(), mask_hi, "min_i32"));
    // A row that may not exist keeps nothing there, on a side it tests.
    if let Some(row) = &columns.row {
        match has_hi || !has_lo {
            true => (hi, has_hi) = (format!("{row} ? {hi} : -1"), true),
            false => lo = format!("{row} ? {lo} : {block}"),
        }
    }
    let [lo, hi] = [format!("const int lo{suffix} = {lo};"), format!("const int hi{suffix} = {hi};")];
    match (has_lo, has_hi) {
        (true, true) => (vec![lo, hi], format!("kept_between(n * 8 + c, lo{suffix}, hi{suffix}, ")),
        (false, true) => (vec![hi], format!("kept_at_most(n * 8 + c, hi{suffix}, ")),
        (true, false) => (vec![lo], format!("kept_at_least(n * 8 + c, lo{suffix}, ")),
        (false, false) => (Vec::new(), "(".to_string()),
    }
}

/// A disjunct of a mask as the columns of a row it keeps: an interval, by
/// key bounds, or all or none of the row, by a condition free of k (global
/// rows, `q < g`).
pub(crate) enum RowPart<'e> {
    Bounds(Vec<KeyBound<'e>>),
    Row(&'e Expr),
}

/// The disjuncts of `mask` ([`MaskParts::Disjuncts`]) as [`RowPart`]s,
/// when every one is one. Which unions pay is the kernel's to say.
pub(crate) fn row_parts<'e>(mask: Option<&'e Expr>) -> Option<Vec<RowPart<'e>>> {
    let Some(MaskParts::Disjuncts(list)) = MaskParts::of(mask) else { return None };
    let part = |e: &'e Expr| match key_bounds(Some(e)) {
        Some(bounds) => Some(RowPart::Bounds(bounds)),
        None if !e.uses(Builtin::K) => Some(RowPart::Row(e)),
        None => None,
    };
    list.into_iter().map(part).collect()
}

/// How a logit lambda (after [`FIRST_KEY`], or [`FIRST_QUERY`]) keeps the
/// union of `parts`' columns, each as [`column_test`] keeps its own (the
/// row-only ones all or none of the row's existing columns), skipped where
/// `full` holds: the statements, and one call per part that keeps the
/// logit (or −inf), each ending in `(logit)`; the lambda keeps their max.
/// Each part's test stays one inline-PTX select, so no per-element boolean
/// is left for LLVM to carry across the wait for S. The max keeps exactly
/// the pairs the mask keeps; it differs from one select only for a NaN
/// logit, which it drops where some part masks the pair.
pub(crate) fn union_test(
    columns: &Columns,
    parts: &[RowPart],
    full: Option<&str>,
    c_rest: impl Fn(&Expr) -> String,
) -> (Vec<String>, Vec<String>) {
    let (mut lines, mut calls) = (Vec::new(), Vec::new());
    for (x, part) in parts.iter().enumerate() {
        let (test, call) = match part {
            RowPart::Bounds(bounds) => column_test(columns, bounds, full, &x.to_string(), &c_rest),
            RowPart::Row(cond) => {
                let full = full.map_or(String::new(), |full| format!("{full} || "));
                let row = columns.row.as_ref().map_or(String::new(), |row| format!("{row} && "));
                let hi = format!("const int hi{x} = {full}{row}({}) ? {} : -1;", c_rest(cond), columns.last());
                (vec![hi], format!("kept_at_most(n * 8 + c, hi{x}, "))
            }
        };
        lines.extend(test);
        calls.push(call);
    }
    (lines, calls)
}

/// A mask comparison `R OP k`, `R OP q - k`, `R OP k - q` (either side),
/// R free of k.
pub(crate) struct KeyBound<'e> {
    /// The comparison as `k OP bound`, once k is alone on the left.
    op: BinOp,
    /// R, the k-free side.
    rest: &'e Expr,
    /// How the k side reads: `k`, `q - k` or `k - q`.
    side: KeySide,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeySide {
    K,
    QMinusK,
    KMinusQ,
}

impl<'e> KeyBound<'e> {
    pub(crate) fn of(e: &'e Expr) -> Option<Self> {
        let ExprKind::Binary(op, a, b) = &e.kind else { return None };
        if !matches!(op, BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge) || a.ty != Ty::I32 {
            return None;
        }
        // `k side OP R`, the k side on the left.
        let (k_side, rest, op) = match (a.uses(Builtin::K), b.uses(Builtin::K)) {
            (true, false) => (a, b, *op),
            (false, true) => (b, a, swapped(*op)),
            _ => return None,
        };
        let is = |e: &Expr, x| e.kind == ExprKind::Builtin(x);
        let side = match &k_side.kind {
            ExprKind::Builtin(Builtin::K) => KeySide::K,
            ExprKind::Binary(BinOp::Sub, x, y) if is(x, Builtin::Q) && is(y, Builtin::K) => KeySide::QMinusK,
            ExprKind::Binary(BinOp::Sub, x, y) if is(x, Builtin::K) && is(y, Builtin::Q) => KeySide::KMinusQ,
            _ => return None,
        };
        // q - k OP R  <=>  k OP' q - R (OP mirrored).
        let op = if side == KeySide::QMinusK { swapped(op) } else { op };
        Some(KeyBound { op, rest, side })
    }

    /// The 64-bit bound B of `j OP B`, given R as C (`rest`).
    fn c_bound(&self, columns: &Columns, rest: &str) -> String {
        let Columns { first, other, .. } = columns;
        match self.side {
            KeySide::K => format!("(long long){rest} - {first}"),
            KeySide::QMinusK => format!("(long long){other} - {rest} - {first}"),
            KeySide::KMinusQ => format!("(long long){rest} + {other} - {first}"),
        }
    }
}

/// `a OP b` as `b OP' a`.
fn swapped(op: BinOp) -> BinOp {
    match op {
        BinOp::Lt => BinOp::Gt,
        BinOp::Le => BinOp::Ge,
        BinOp::Gt => BinOp::Lt,
        BinOp::Ge => BinOp::Le,
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    fn mask(body: &str) -> Expr {
        parse_one(&format!("S {{ dtype: bf16, head_dim: 64, param w: i32, mask: {body} }}")).unwrap().mask.unwrap()
    }

    /// R's value: q, or the param's.
    fn rest_value(e: &Expr, q: i32, w: i32) -> i32 {
        if e.kind == ExprKind::Builtin(Builtin::Q) {
            q
        } else {
            w
        }
    }

    /// The rewritten test, evaluated as the kernel does: the bound in 64
    /// bits, clamped into [-1, block_n].
    fn column_keeps(bound: &KeyBound, q: i32, k0: i32, j: i32, w: i32, block_n: i32) -> bool {
        let rest = rest_value(bound.rest, q, w);
        let (q, k0, rest) = (q as i64, k0 as i64, rest as i64);
        let b = match bound.side {
            KeySide::K => rest - k0,
            KeySide::QMinusK => q - rest - k0,
            KeySide::KMinusQ => rest + q - k0,
        };
        let b = b.clamp(-1, block_n as i64) as i32;
        match bound.op {
            BinOp::Lt => j < b,
            BinOp::Le => j <= b,
            BinOp::Gt => j > b,
            _ => j >= b,
        }
    }

    /// The spec's comparison with i32 semantics (the k side as written).
    fn spec_keeps(e: &Expr, q: i32, k: i32, w: i32) -> bool {
        let ExprKind::Binary(op, a, b) = &e.kind else { unreachable!() };
        let side = |x: &Expr| match &x.kind {
            ExprKind::Builtin(Builtin::K) => k,
            ExprKind::Binary(BinOp::Sub, l, _) if l.kind == ExprKind::Builtin(Builtin::Q) => q.wrapping_sub(k),
            ExprKind::Binary(BinOp::Sub, ..) => k.wrapping_sub(q),
            _ => rest_value(x, q, w),
        };
        let (x, y) = (side(a), side(b));
        match op {
            BinOp::Lt => x < y,
            BinOp::Le => x <= y,
            BinOp::Gt => x > y,
            _ => x >= y,
        }
    }

    fn iproduct(a: &[i32], b: &[i32], c: &[i32], d: &[i32]) -> Vec<(i32, i32, i32, i32)> {
        let mut out = Vec::new();
        for &x in a {
            for &y in b {
                for &z in c {
                    out.extend(d.iter().map(|&u| (x, y, z, u)));
                }
            }
        }
        out
    }

    /// Each of `bodies` as a bound, read from the key's side where `swap`
    /// (q and k swapped, as the dK/dV kernels' query columns read it),
    /// keeps along a row the columns the mask keeps.
    fn assert_bounds_keep_what_the_mask_keeps(bodies: &[&str], swap: bool) {
        let values = [0, 1, 5, 63, 64, 127, 128, 1000, 1 << 20, i32::MAX - 200, i32::MAX];
        let windows = [i32::MIN, -1_000_000, -129, -1, 0, 1, 7, 127, 1024, 1 << 30, i32::MAX];
        for body in bodies {
            let e = mask(body);
            let tested = if swap { e.with_q_and_k_swapped() } else { e.clone() };
            let bound = KeyBound::of(&tested).unwrap_or_else(|| panic!("{body}"));
            for (row, col0, w, j) in iproduct(&values, &values, &windows, &[0, 1, 7, 8, 63, 126, 127]) {
                let Some(col) = col0.checked_add(j) else { continue };
                let (q, k) = if swap { (col, row) } else { (row, col) };
                let (kept, spec) = (column_keeps(&bound, row, col0, j, w, 128), spec_keeps(&e, q, k, w));
                assert_eq!(kept, spec, "{body}: q={q} k={k} w={w}");
            }
        }
    }

    #[test]
    fn linear_key_comparisons_become_column_bounds() {
        let bodies = ["q >= k", "q - k < w", "k <= q", "w > q - k", "k - q >= w", "k < w", "q - k <= w", "w <= k - q"];
        assert_bounds_keep_what_the_mask_keeps(&bodies, false);
    }

    #[test]
    fn swapped_comparisons_bound_the_query_columns() {
        let bodies = ["q >= k", "q - k < w", "k <= q", "w > q - k", "k - q >= w", "q < w", "q - k <= w"];
        assert_bounds_keep_what_the_mask_keeps(&bodies, true);
    }

    #[test]
    fn rows_bounded_on_one_side_test_one_side() {
        let test = |body: &str, in_bounds| {
            let e = mask(body);
            let bounds = key_bounds(Some(&e)).unwrap();
            let c_rest = |e: &Expr| if e.kind == ExprKind::Builtin(Builtin::Q) { "q" } else { "p_w" }.to_string();
            let (lines, call) = column_test(&Columns::keys("kv_len", in_bounds), &bounds, None, "", c_rest);
            (lines.join(" "), call)
        };
        // Below the diagonal: an upper bound only, and kv_len's where keys may be missing.
        let (lines, call) = test("q >= k", true);
        assert_eq!(
            (lines.as_str(), call.as_str()),
            (
                "const int hi = min_i32(BLOCK_N - 1, key_bound<BLOCK_N>((long long)q - k0));",
                "kept_at_most(n * 8 + c, hi, "
            )
        );
        let (lines, call) = test("q >= k", false);
        assert!(lines.contains("kv_len") && call.starts_with("kept_at_most"), "{lines}");
        // A window's far edge: a lower bound alone, unless keys may be missing.
        let (lines, call) = test("q - k < w", true);
        assert!(!lines.contains("kv_len") && call.starts_with("kept_at_least"), "{lines}");
        assert!(test("q - k < w", false).1.starts_with("kept_between"));
        assert!(test("q >= k && q - k < w", true).1.starts_with("kept_between"));
    }

    #[test]
    fn three_disjuncts_of_bounds_and_rows_are_a_union_of_column_tests() {
        let longformer = mask("(q - k <= w && k - q <= w) || q < w || k < w");
        let parts = row_parts(Some(&longformer)).unwrap();
        assert!(matches!(parts[..], [RowPart::Bounds(_), RowPart::Row(_), RowPart::Bounds(_)]));
        let c_rest = |e: &Expr| if e.kind == ExprKind::Builtin(Builtin::Q) { "q" } else { "p_w" }.to_string();
        let (lines, calls) = union_test(&Columns::keys("kv_len", false), &parts, Some("full"), c_rest);
        assert_eq!(lines.len(), 4, "{lines:?}");
        assert!(lines[2].starts_with("const int hi1 = full || ") && lines[2].ends_with(" : -1;"), "{}", lines[2]);
        assert_eq!(
            calls,
            ["kept_between(n * 8 + c, lo0, hi0, ", "kept_at_most(n * 8 + c, hi1, ", "kept_at_most(n * 8 + c, hi2, "]
        );
        // A k-reading part that is no bound keeps the mask as written.
        assert!(row_parts(Some(&mask("k < w || q >= k"))).is_some_and(|parts| parts.len() == 2));
        assert!(row_parts(Some(&mask("k < w || q < w || q + k < w"))).is_none());
    }

    #[test]
    fn other_comparisons_stay_as_written() {
        for body in ["q + k < w", "2 * k <= q", "k == q", "q - k - 1 < w", "k - q < k", "(k as f32) < 3.0"] {
            assert!(KeyBound::of(&mask(body)).is_none(), "{body}");
        }
    }
}
