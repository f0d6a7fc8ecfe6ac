//! The spec in a decode kernel: one `logit` lambda over a dot product at
//! (h, q, k), from the kit's definition of the logit. Every element runs
//! the mask as written: a decode tile is 16 to 32 rows and the kernel waits
//! on memory, so the forward's interior-tile and column-bound reductions
//! would buy little here.

use crate::abi::ArgKind;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::kit::logit::{kept, ScoredLogit};
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::spec::{Expr, Spec};
use std::fmt::{self, Write};

/// `logit(dot, h, q, k)`: the log2-domain logit, or −∞ where the mask drops
/// the pair or `k` is past the sequence's keys. `h` and `q` are per row
/// (the rows of a tile are several heads' queries), `b` and `kv_len` the
/// CTA's locals. `scale` names the softmax scale the dot product takes
/// (an e4m3 kernel's has K's descale folded in).
pub(super) fn write_logit(w: &mut Writer<String>, spec: &Spec, scale: &str) -> fmt::Result {
    let c = |e: &Expr| c_expr(spec, e);
    let mask = spec.mask.as_ref().map_or(String::new(), |m| format!(" && {}", c(m)));
    let keep = kept(&arg_name(spec, ArgKind::KvLen), &mask);
    writeln!(w, "// The spec: a dot product at (h, q, k) as a log2-domain logit, -inf where masked.")?;
    let (binding, log2) = match ScoredLogit::of(spec, scale, c) {
        Some(ScoredLogit { binding, log2 }) => (binding, log2),
        None => {
            writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
            (String::new(), "dot * scale_log2".to_string())
        }
    };
    writeln!(w, "auto logit = [&](float dot, int h, int q, int k) -> float {{")?;
    w.indented(|w| {
        if !binding.is_empty() {
            writeln!(w, "{binding}")?;
        }
        writeln!(w, "return kept_or_neg_inf({keep}, {log2});")
    })?;
    writeln!(w, "}};")
}
