//! The split decode's combine kernel: one CTA per query row (token, head,
//! sequence) weighs the splits' partial rows by their LSEs
//! (`exp(lse_s − lse)`) into O and the row's LSE. Spec-independent but for
//! the dtype and the V head dim.

use super::plan::MAX_SPLITS;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// Threads per combine CTA: they share a row's columns.
pub(super) const COMBINE_THREADS: u32 = 128;

pub(super) fn write_combine_config(w: &mut Writer<String>, storage: &str, dv: u32) -> fmt::Result {
    writeln!(w, "// ---- kernel configuration ---------------------------------------------------")?;
    writeln!(w, "using storage = {storage};  // element format of O")?;
    writeln!(w, "constexpr int DV = {dv};  // V/O head dim")?;
    writeln!(w, "constexpr int THREADS = {COMBINE_THREADS};")?;
    writeln!(w, "constexpr int MAX_SPLITS = {MAX_SPLITS};  // the most splits a launch has")?;
    writeln!(w)
}

pub(super) fn write_combine_body(w: &mut Writer<String>) -> fmt::Result {
    w.write_str(
        "\
__shared__ float weight[MAX_SPLITS];
const int q = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
const long long all_rows = (long long)batch * heads * q_len;
const long long row = ((long long)b * heads + h) * q_len + q;
const int splits = min(num_splits, MAX_SPLITS);
// The row's LSE over the splits (a split without kept keys has -inf).
float row_top = neg_inf();
for (int s = 0; s < splits; ++s) row_top = fmaxf(row_top, partial_lse[s * all_rows + row]);
const float m_use = finite_or_zero(row_top);
float sum = 0.0f;
for (int s = 0; s < splits; ++s) sum += fast_exp2((partial_lse[s * all_rows + row] - m_use) * LOG2E);
const float total = sum > 0.0f ? m_use + fast_log2(sum) * LN2 : neg_inf();
for (int s = threadIdx.x; s < splits; s += THREADS) {
    weight[s] = sum > 0.0f ? fast_exp2((partial_lse[s * all_rows + row] - total) * LOG2E) : 0.0f;
}
__syncthreads();
for (int c = threadIdx.x; c < DV; c += THREADS) {
    float x = 0.0f;
    for (int s = 0; s < splits; ++s) x += weight[s] * partial_o[(s * all_rows + row) * DV + c];
    o_ptr[b * o_batch_stride + q * o_seq_stride + h * o_head_stride + c] = storage::from_f32(x);
}
if (threadIdx.x == 0 && lse != nullptr) lse[row] = total;
",
    )
}
