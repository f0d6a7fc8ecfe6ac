//! The split decode's combine, in the decode kernel itself: the last of a
//! row tile's splits to finish (`last_split`, `library/decode.cuh`: an
//! atomic count per row tile, back to 0 after) weighs every split's rows by
//! their LSEs (`exp(lse_s − lse)`) into O and the rows' LSE. One launch per
//! step: no second kernel, no gap between them. Spec-independent.

use super::queries::DecodeQueries;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

pub(super) fn write_split_combine(w: &mut Writer<String>, spec: &Spec, queries: DecodeQueries) -> fmt::Result {
    w.write_str(&queries.fill(
        spec,
        "
// Split-KV: the last of this row tile's splits to finish combines them,
// a warp per row; its flag takes the Q tile's memory, the weights the
// stages'.
if (num_splits > 1) {
    unsigned int* counter = split_counters + ((long long)b * heads_kv + kv_head) * (gridDim.x / num_splits)
                            + blockIdx.x / num_splits;
    if (last_split(counter, num_splits, (int*)smem)) {
        static_assert(STAGES_UNITS * 2 >= WARPS * MAX_SPLITS * 4, \"the weights fit the stages\");
        float* weight = (float*)(smem + Q_TILE) + warp * MAX_SPLITS;
        for (int r = warp; r < BLOCK_M && row0 + r < rows; r += WARPS) {
            const int row = row0 + r, q = row / group, h = kv_head * group + row % group;
            const long long at = ((long long)b * heads + h) * @SEQ_ROWS@ + q;
            float top = neg_inf();
            for (int s = lane; s < num_splits; s += 32) top = fmaxf(top, __ldcg(&partial_lse[s * all_rows + at]));
            top = warp_all(top, [](float x, float y) { return fmaxf(x, y); });
            const float m_use = finite_or_zero(top);
            float sum = 0.0f;
            for (int s = lane; s < num_splits; s += 32) {
                sum += fast_exp2((__ldcg(&partial_lse[s * all_rows + at]) - m_use) * LOG2E);
            }
            sum = warp_all(sum, [](float x, float y) { return x + y; });
            const float total = sum > 0.0f ? m_use + fast_log2(sum) * LN2 : neg_inf();
            for (int s = lane; s < num_splits; s += 32) {
                weight[s] = sum > 0.0f ? fast_exp2((__ldcg(&partial_lse[s * all_rows + at]) - total) * LOG2E) : 0.0f;
            }
            __syncwarp();
            for (int c = lane; c < DV; c += 32) {
                float x = 0.0f;
                for (int s = 0; s < num_splits; ++s) x += weight[s] * __ldcg(&partial_o[(s * all_rows + at) * DV + c]);
                o_ptr[@O_AT@] = storage::from_f32(x);
            }
            if (lane == 0 && lse != nullptr) lse[@LSE_AT@] = total;
            __syncwarp();
        }
    }
}
",
    ))
}
