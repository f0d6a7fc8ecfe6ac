//! The spec's logit, defined once for every kernel: a dot product at
//! (q, k) becomes the scaled score `score = dot * scale`, the spec's score
//! expression over it in log2 units (`* LOG2E`), kept where `k < kv_len`
//! and the mask holds, else −∞. The backward recomputes P from the
//! forward's LSE, so both print their logits from these pieces; each kernel
//! decides only where the scale goes without a score expression and how it
//! skips the mask on tiles the mask keeps whole (the forward also
//! strength-reduces an additive bias, `forward::bias`).

use crate::spec::{Expr, Spec};

/// The spec's score as a log2-domain logit of `dot`.
pub(crate) struct ScoredLogit {
    /// The statement binding the scaled score `score`.
    pub binding: String,
    /// The logit: the score expression (C, from `c`) in log2 units.
    pub log2: String,
}

impl ScoredLogit {
    /// `None` when the spec has no score expression (the logit is then the
    /// scaled dot product). `scale`: the scale argument's C name; `c`
    /// prints the score expression (with the kernel's hoisted terms).
    pub(crate) fn of(spec: &Spec, scale: &str, c: impl Fn(&Expr) -> String) -> Option<ScoredLogit> {
        spec.score.as_ref().map(|e| ScoredLogit::for_score(e, scale, c))
    }

    /// The logit of score expression `e`.
    pub(crate) fn for_score(e: &Expr, scale: &str, c: impl Fn(&Expr) -> String) -> ScoredLogit {
        ScoredLogit { binding: format!("const float score = dot * {scale};"), log2: format!("{} * LOG2E", c(e)) }
    }
}

/// The condition that keeps a pair: its key exists (`k < kv_len`) and
/// `mask`, C text appended to it (` && …`, or empty).
pub(crate) fn kept(kv_len: &str, mask: &str) -> String {
    format!("k < {kv_len}{mask}")
}
