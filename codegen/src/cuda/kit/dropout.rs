//! Dropout in a kernel's text, for the forward and the backward alike: the
//! mask's state from the kernel's arguments and the (batch, head) word of
//! its Philox counter (`library/dropout.cuh`).

use crate::abi::{ArgKind, DropoutArg};
use crate::cuda::signature::arg_name;
use crate::spec::Spec;

/// `const Dropout drop = …; const unsigned drop_bh = …;` where `b` and `h`
/// (the query head) are bound: the mask's state and the counter word of (b, h).
pub(crate) fn dropout_decl(spec: &Spec) -> String {
    let [seed, offset, threshold, scale] = DropoutArg::ALL.map(|part| arg_name(spec, ArgKind::Dropout(part)));
    let heads = arg_name(spec, ArgKind::Heads);
    format!(
        "const Dropout drop = dropout_of({seed}, {offset}, {threshold}, {scale});\n\
         const unsigned drop_bh = (unsigned)b * (unsigned){heads} + (unsigned)h;"
    )
}
