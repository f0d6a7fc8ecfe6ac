//! Whether a spec's per-element code is light enough for the d <= 64 tiles
//! that hold the most registers: a fact about the generated code that the
//! runtime's tile preferences need.

use crate::cuda::kit::key_bounds::key_bounds;
use crate::mask_parts::MaskParts;
use crate::spec::{Expr, ExprKind, Spec};

/// Whether a spec's partial-tile code and score fit the registers of the
/// d <= 64 tiles that hold the most (192-key S, three warpgroups): no mask
/// of two conjuncts unless each bounds k (a sliding window: its partial
/// tiles keep an interval of columns per row, `key_bounds`), no
/// transcendental score. A mask of disjuncts fits as the whole mask does:
/// each of its partial-tile loops tests one disjunct or the whole mask.
pub fn is_light(spec: &Spec) -> bool {
    let mask_fits = match MaskParts::of(spec.mask.as_ref()) {
        Some(MaskParts::Conjuncts(_)) => key_bounds(spec.mask.as_ref()).is_some(),
        None | Some(MaskParts::Disjuncts(_)) => true,
    };
    mask_fits && !spec.score.as_ref().is_some_and(transcendental)
}

/// Whether `e` calls a transcendental function (tanh, exp, …).
fn transcendental(e: &Expr) -> bool {
    let mut found = false;
    e.walk(&mut |n| found |= matches!(&n.kind, ExprKind::Call(f, _) if f.is_transcendental()));
    found
}
