//! Dropout on P in the forward (`Plan::dropout`), between the softmax and
//! P V: the row sums have already taken every pair, so the LSE stays the
//! softmax's and O = (P ⊙ keep / (1 − p)) V.

use super::logit::write_s_groups;
use super::plan::Plan;
use crate::cuda::kit::dropout::dropout_decl;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// Each element of this warp's P (in `s`) times its pair's factor, one
/// Philox call per two keys of a row; nothing without dropout.
pub(super) fn write_dropout(w: &mut Writer<String>, plan: &Plan) -> fmt::Result {
    if !plan.dropout {
        return Ok(());
    }
    writeln!(w, "// Dropout: each pair of P zeroed or scaled by 1 / (1 - p) (library/dropout.cuh).")?;
    writeln!(w, "{{")?;
    w.indented(|w| {
        writeln!(w, "{}", dropout_decl(plan.spec))?;
        write_s_groups(
            w,
            "\
            const DropoutPair f = dropout_keys(drop, drop_bh, q, kv0 + n * 8 + 2 * t);\n\
            s[mt][n][2 * r] *= f.first;\n\
            s[mt][n][2 * r + 1] *= f.second;",
        )
    })?;
    writeln!(w, "}}")
}
