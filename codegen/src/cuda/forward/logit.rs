//! The spec in the forward: the `logit` lambdas (dot product at (q, k) to a
//! log2-domain logit, or -inf where the mask drops the pair) and their
//! application to every element of S, interior tiles without mask code.

use super::bias::{additive_bias, biased_logit, reads_first_key};
use crate::cuda::kit::expr::c_expr_in;
use crate::cuda::kit::hoist::{lookup, Hoisted};
use crate::cuda::kit::key_bounds::{column_test, key_bounds, row_parts, union_test, Columns, FIRST_KEY};
use crate::cuda::kit::logit::{kept, ScoredLogit};
use crate::cuda::writer::Writer;
use crate::mask_parts::MaskParts;
use crate::spec::{BinOp, Expr, ExprKind, Spec};
use std::fmt::{self, Write};

/// The `logit` lambda: dot product at (q, k) → log2-domain logit, or −∞
/// where the pair is masked or k is past the end of the sequence. `i` is
/// the row slot and `(n, c)` the column slot, for hoisted terms.
/// `logit_interior` is the same on `interior` tiles ([`interior_decl`]):
/// no mask or bounds code. (Two lambdas rather than one generic
/// lambda: NVRTC 13.0 rejects generic lambdas in device code.) With
/// `columns` (a mask's global columns, `k < C`), `logit_columns` keeps
/// those alone, for the column tile (`global_columns`).
pub(super) fn write_logit(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    (scale, kv_len): (&str, &str),
    columns: Option<&Expr>,
) -> fmt::Result {
    let c_expr = |e: &Expr| c_expr_in(spec, e, &|x| lookup(hoisted, x));
    let (prologue, logit) = match &spec.score {
        None => {
            // S stays in dot-product units (see `SUnits::Dots`).
            writeln!(w, "// The spec: mask each element of S (-inf where masked); the softmax scales it.")?;
            writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
            (None, "dot".to_string())
        }
        Some(e) => match additive_bias(e) {
            None => {
                writeln!(w, "// The spec: score and mask each element of S (log2 units, -inf where masked).")?;
                let ScoredLogit { binding, log2 } = ScoredLogit::for_score(e, scale, c_expr);
                (Some(binding), log2)
            }
            Some(bias) => {
                writeln!(w, "// The spec: score and mask each element of S (log2 units, -inf where masked);")?;
                writeln!(w, "// the score adds a bias to the scaled dot product, one FFMA.")?;
                writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
                biased_logit(spec, bias, hoisted)
            }
        },
    };
    let bias_reads_k0 = spec.score.as_ref().and_then(additive_bias).is_some_and(reads_first_key);
    // A lambda's statements: k0 where it tests column bounds or the bias
    // reads it, then the score's.
    let statements = |k0: bool| -> Vec<String> {
        let k0 = k0.then(|| FIRST_KEY.to_string());
        k0.into_iter().chain(prologue.clone()).collect()
    };
    // How a lambda keeps the pairs `mask` (all of it, or one conjunct)
    // keeps, given the C condition `full` that skips it: as an interval of
    // columns where every conjunct bounds k (`key_bounds`), else as written.
    // `in_bounds`: the lambda only sees tiles whose keys all exist.
    let keep = |mask: Option<&Expr>, full: Option<&str>, in_bounds: bool| -> (Vec<String>, String) {
        // A union of such intervals (and whole rows): the max of each
        // part's kept logit, each -inf where its part drops the column.
        // Three parts or more: ptxas's counts (sm_90a, the three-warpgroup
        // d = 64 kernel) had Longformer's whole mask as C compares spill 94
        // loads in the consumers and its union none, while two disjuncts
        // (prefix-LM, sinks plus a window) spilled more as a union.
        let union = row_parts(mask).filter(|parts| parts.len() >= 3);
        if let (Some(parts), Some(full)) = (union, full) {
            let (test, calls) = union_test(&Columns::keys(kv_len, false), &parts, Some(full), c_expr);
            let lines = [FIRST_KEY.to_string()].into_iter().chain(test).chain(statements(false)).collect();
            let kept: Vec<String> = calls.iter().map(|call| format!("{call}{logit})")).collect();
            let max = kept[1..].iter().fold(kept[0].clone(), |acc, k| format!("fmaxf({acc}, {k})"));
            return (lines, max);
        }
        match key_bounds(mask) {
            Some(bounds) => {
                let (test, call) = column_test(&Columns::keys(kv_len, in_bounds), &bounds, full, "", c_expr);
                let lines = [FIRST_KEY.to_string()].into_iter().chain(test).chain(statements(false)).collect();
                (lines, format!("{call}{logit})"))
            }
            // A tensor mask: the column against the keys left (one compare
            // with an immediate) and, not short-circuited, the mask, so each
            // column's staged key term loads once for both of a lane's rows
            // (its reads are clipped, so in bounds past kv_len too).
            None => match mask {
                Some(e) if e.reads_tensor() => {
                    let kept = format!("(n * 8 + c < {kv_len} - (k - n * 8 - c)) & ({})", c_expr(e));
                    (statements(bias_reads_k0), format!("kept_or_neg_inf({kept}, {logit})"))
                }
                _ => {
                    let cond = match (mask, full) {
                        (Some(e), Some(_)) => skip_if_full(e, &c_expr(e)),
                        (Some(e), None) => format!(" && {}", c_expr(e)),
                        (None, _) => String::new(),
                    };
                    (statements(bias_reads_k0), format!("kept_or_neg_inf({}, {logit})", kept(kv_len, &cond)))
                }
            },
        }
    };
    let params = "float dot, int q, int k, int i, int n, int c";
    let lambda = |w: &mut Writer<String>, head: &str, (lines, kept): (Vec<String>, String)| {
        writeln!(w, "{head} {{")?;
        w.indented(|w| {
            lines.iter().try_for_each(|line| writeln!(w, "{line}"))?;
            writeln!(w, "return {kept};")
        })?;
        writeln!(w, "}};")
    };
    lambda(
        w,
        &format!("auto logit = [&]({params}, bool full) -> float"),
        keep(spec.mask.as_ref(), Some("full"), false),
    )?;
    let interior: String = statements(bias_reads_k0).iter().map(|line| format!("{line} ")).collect();
    writeln!(w, "auto logit_interior = [&]({params}) -> float {{ {interior}return {logit}; }};")?;
    if let Some(parts) = MaskParts::of(spec.mask.as_ref()) {
        match parts {
            MaskParts::Conjuncts(_) => {
                writeln!(w, "// Partial tiles on which one conjunct of the mask holds throughout, every")?;
                writeln!(w, "// key present (whole_conjuncts): the other conjunct alone.")?;
            }
            MaskParts::Disjuncts(_) => {
                writeln!(w, "// Partial tiles of which one disjunct of the mask alone keeps pairs, every")?;
                writeln!(w, "// key present (lone_disjunct): that disjunct alone.")?;
            }
        }
        for (x, e) in parts.exprs().iter().enumerate().filter(|&(x, _)| parts.decides(x)) {
            lambda(w, &format!("auto logit_only{x} = [&]({params}) -> float"), keep(Some(e), None, true))?;
        }
    }
    if let Some(columns) = columns {
        writeln!(w, "// The global columns' tile: those columns alone, up to kv_len.")?;
        lambda(w, &format!("auto logit_columns = [&]({params}) -> float"), keep(Some(columns), None, false))?;
    }
    Ok(())
}

/// The mask term of `logit`, ` && (full || mask)`: a tile kept whole but
/// cut by kv_len skips the mask. Not for a mask that reads tensors: there LLVM
/// moves each element's compare up to the loads of the tile's column terms
/// and carries the results across the wait for S, and ptxas packs them into
/// bits of a register and unpacks them again: ~12 instructions per element
/// instead of 2 (the document-mask forward lost a seventh of its speed).
/// Masks without tensors keep the `full ||`: without it, the sliding window
/// and softcap forward lost 2–3% to a spill in the tile loop.
pub(super) fn skip_if_full(mask: &Expr, c_mask: &str) -> String {
    match mask.reads_tensor() {
        true => format!(" && {c_mask}"),
        false => format!(" && (full || {c_mask})"),
    }
}

/// The spec on every element of S (see `write_logit`). `whole` is the C
/// expression of the tile's selector ([`MaskParts`]): which part of the
/// mask decides it alone.
pub(super) fn write_logits(w: &mut Writer<String>, spec: &Spec, whole: &str) -> fmt::Result {
    write!(
        w,
        "\
        \n\
        // The spec on every element of S (-inf where masked).\n\
        // Interior tiles (kept whole, no key past kv_len) run without mask\n\
        // and bounds code.\n"
    )?;
    let parts = MaskParts::of(spec.mask.as_ref());
    if parts.is_some() {
        writeln!(w, "const int whole = {whole};  // read only where the tile is not interior")?;
    }
    writeln!(w, "if (interior) {{")?;
    w.indented(write_interior_logits)?;
    let logit = CUT.to_string();
    let only = |x| format!("logit_only{x}(x, q, kv0 + n * 8 + 2 * t + c, i, n, c)");
    let Some(parts) = parts else {
        writeln!(w, "}} else {{")?;
        w.indented(|w| write_apply_logits(w, &logit))?;
        return writeln!(w, "}}");
    };
    // The branches by selector, the last one falling through into the
    // softmax. Conjuncts: where conjunct 1 holds whole (conjunct 0 alone
    // decides) last: with a causal conjunct first (sliding windows) they are
    // the diagonal tiles that every item visits. Disjuncts: the whole mask
    // first, then each alone, the one of most conjuncts last (a band's two
    // edges cut the most tiles).
    let mut branches: Vec<(u32, String)> = match &parts {
        MaskParts::Conjuncts(_) => vec![(1, only(1)), (0, logit), (2, only(0))],
        MaskParts::Disjuncts(list) => {
            let mut order: Vec<usize> = (0..list.len()).filter(|&x| parts.decides(x)).collect();
            order.sort_by_key(|&x| conjunct_count(list[x]));
            std::iter::once((0, logit)).chain(order.into_iter().map(|x| (x as u32 + 1, only(x)))).collect()
        }
    };
    let (last, last_call) = branches.pop().unwrap_or_default();
    for (selector, call) in &branches {
        writeln!(w, "}} else if (whole == {selector}) {{")?;
        w.indented(|w| write_apply_logits(w, call))?;
    }
    writeln!(w, "}} else {{  // whole == {last}")?;
    w.indented(|w| write_apply_logits(w, &last_call))?;
    writeln!(w, "}}")
}

/// The spec on an interior tile's S: the score alone.
pub(super) fn write_interior_logits(w: &mut Writer<String>) -> fmt::Result {
    write_apply_logits(w, "logit_interior(x, q, kv0 + n * 8 + 2 * t + c, i, n, c)")
}

/// The spec on the S of a tile that is not interior, for a mask that has
/// no parts deciding tiles alone ([`MaskParts`]): the mask and the bounds
/// on kv_len.
pub(super) fn write_cut_logits(w: &mut Writer<String>) -> fmt::Result {
    write_apply_logits(w, CUT)
}

/// The `logit` lambda's call on an element of S.
const CUT: &str = "logit(x, q, kv0 + n * 8 + 2 * t + c, i, n, c, full)";

/// How many conjuncts `e` is a `&&` of (1 if it is none).
fn conjunct_count(e: &Expr) -> usize {
    match &e.kind {
        ExprKind::Binary(BinOp::And, a, b) => conjunct_count(a) + conjunct_count(b),
        _ => 1,
    }
}

/// Maps this warp's S tile (keys from `kv0`) through `call`, element by
/// element.
pub(super) fn write_apply_logits(w: &mut Writer<String>, call: &str) -> fmt::Result {
    write_s_groups(
        w,
        &format!(
            "\
            #pragma unroll\n\
            for (int c = 0; c < 2; ++c) {{\n\
            \x20   float& x = s[mt][n][2 * r + c];\n\
            \x20   x = {call};\n\
            }}"
        ),
    )
}

/// A loop over this warp's S tile: per row slot `i` (its m-tile `mt`, half
/// `r` and query `q`) and 8-key group `n`, the lines of `body`.
pub(super) fn write_s_groups(w: &mut Writer<String>, body: &str) -> fmt::Result {
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const int q = q0 + tile_row(warp, mt) + g + 8 * r;\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < S_TILES; ++n) {{\n"
    )?;
    body.lines().try_for_each(|line| writeln!(w, "        {line}"))?;
    writeln!(w, "    }}\n}}")
}
