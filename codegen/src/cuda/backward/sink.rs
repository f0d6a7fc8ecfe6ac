//! The gradient of a learned sink, in the preprocess. The sink is one more
//! logit of each row's softmax with no value row, so dQ, dK and dV are
//! untouched (P from the LSE already has the sink in its denominator); the
//! sink itself gets dsink = −exp(sink − LSE) · D per row, which the
//! preprocess has at hand once it has D. A CTA's rows share (b, h) and so the
//! sink's value and the tensor elements it reads: each warp sums its rows'
//! terms and adds them with one atomic per tensor it trains.

use super::packing::Packing;
use crate::abi::ArgKind;
use crate::cuda::kit::expr::{c_expr, load_offset};
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::grad::{d_sink_load, sink_load_indices, trainable};
use crate::spec::Spec;
use std::fmt::{self, Write};

/// The trainable tensors the sink reads: the preprocess's gradients.
pub(super) fn sink_grads(spec: &Spec) -> Vec<usize> {
    (0..spec.tensors.len()).filter(|&i| trainable(spec, i) && d_sink_load(spec, i).is_some()).collect()
}

/// After D: each row's dsink (`sums[i]` holds the thread's rows' D, `part`
/// is the lane's chunk of its row), then per warp one atomic per tensor.
pub(super) fn write_sink_gradient(w: &mut Writer<String>, spec: &Spec, packing: Packing) -> fmt::Result {
    let (Some(sink), slots) = (&spec.sink, sink_grads(spec)) else { return Ok(()) };
    if slots.is_empty() {
        return Ok(());
    }
    let lse = arg_name(spec, ArgKind::Lse);
    let lse_row = packing.statistic_row(spec, "h");
    write!(
        w,
        "\
        // The sink's gradient: dsink = -exp(sink - LSE) * D per row (no sink of\n\
        // -inf, no LSE of -inf: then 0).\n\
        const float sink = {sink};\n\
        const float* lse_row = {lse} + {lse_row};\n\
        float d_sink = 0.0f;\n\
        #pragma unroll\n\
        for (int i = 0; i < BLOCK_M / PASS; ++i) {{\n\
        \x20   const int r = i * PASS + threadIdx.x / LANES;\n\
        \x20   if (part != 0 || r >= rows) continue;\n\
        \x20   const float l = lse_row[q0 + r];\n\
        \x20   if (l != neg_inf() && sink != neg_inf()) d_sink -= expf(sink - l) * sums[i];\n\
        }}\n\
        d_sink = warp_sum(d_sink);\n",
        sink = c_expr(spec, sink),
    )?;
    for slot in slots {
        let (Some(d), Some(indices)) = (d_sink_load(spec, slot), sink_load_indices(spec, slot)) else { continue };
        let dt = arg_name(spec, ArgKind::TensorGrad(slot));
        let offset = load_offset(spec, slot, &indices, &|_| None);
        writeln!(
            w,
            "if ({dt} != nullptr && threadIdx.x % 32 == 0) atomicAdd(&{dt}[{offset}], d_sink * {});",
            c_expr(spec, &d)
        )?;
    }
    Ok(())
}
