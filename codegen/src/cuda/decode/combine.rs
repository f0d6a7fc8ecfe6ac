//! The split decode's combine, in the decode kernel itself: the last of a
//! row tile's splits to finish (`last_split`, `library/decode.cuh`: an
//! atomic count per row tile, back to 0 after) weighs every split's rows by
//! their LSEs (`exp(lse_s − lse)`) into O and the rows' LSE. One launch per
//! step: no second kernel, no gap between them. Spec-independent.
//!
//! The combine is one CTA's work after every other split has finished, so
//! it is latency, not bandwidth: a lane reads its splits' LSEs once, and
//! each thread takes four columns of a row (a 16-byte load a split) and
//! keeps sixteen splits' loads in flight, where a lane per column and one
//! split at a time would wait on L2 once per split and column.

use super::queries::DecodeQueries;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

pub(super) fn write_split_combine(w: &mut Writer<String>, spec: &Spec, queries: DecodeQueries) -> fmt::Result {
    w.write_str(&queries.fill(
        spec,
        "
// Split-KV: the last of this row tile's splits to finish combines them. A
// warp per row weighs the splits (its flag takes the Q tile's memory, the
// weights the scratch's), then every thread sums a row's columns.
if (num_splits > 1) {
    unsigned int* counter = split_counters + ((long long)b * heads_kv + kv_head) * (gridDim.x / num_splits)
                            + blockIdx.x / num_splits;
    if (last_split(counter, num_splits, (int*)smem)) {
        static_assert(SCRATCH_BYTES >= BLOCK_M * MAX_SPLITS * 4, \"the weights fit the scratch\");
        static_assert(MAX_SPLITS % 32 == 0, \"a lane's splits are whole registers\");
        float* weights = (float*)(smem + Q_TILE);  // [BLOCK_M][MAX_SPLITS]
        for (int r = warp; r < tile_rows; r += WARPS) {
            const int row = row0 + r, q = row / group, h = kv_head * group + row % group;
            const long long at = ((long long)b * heads + h) * @SEQ_ROWS@ + q;
            // Each lane's splits' LSEs, read once (one wait on L2, not three).
            float lse_s[MAX_SPLITS / 32];
            #pragma unroll
            for (int k = 0; k < MAX_SPLITS / 32; ++k) {
                const int s = lane + 32 * k;
                lse_s[k] = s < num_splits ? __ldcg(&partial_lse[s * all_rows + at]) : neg_inf();
            }
            float top = neg_inf();
            #pragma unroll
            for (int k = 0; k < MAX_SPLITS / 32; ++k) top = fmaxf(top, lse_s[k]);
            top = warp_all(top, [](float x, float y) { return fmaxf(x, y); });
            const float m_use = finite_or_zero(top);
            float sum = 0.0f;
            #pragma unroll
            for (int k = 0; k < MAX_SPLITS / 32; ++k) sum += fast_exp2((lse_s[k] - m_use) * LOG2E);
            sum = warp_all(sum, [](float x, float y) { return x + y; });
            const float total = sum > 0.0f ? m_use + fast_log2(sum) * LN2 : neg_inf();
            #pragma unroll
            for (int k = 0; k < MAX_SPLITS / 32; ++k) {
                const int s = lane + 32 * k;
                if (s < num_splits) weights[r * MAX_SPLITS + s] = sum > 0.0f ? fast_exp2((lse_s[k] - total) * LOG2E) : 0.0f;
            }
            if (lane == 0 && lse != nullptr) lse[@LSE_AT@] = total;
        }
        __syncthreads();
        // VEC columns a thread (16-byte loads where rows allow them; the
        // workspace is the plan's own allocation, 256-byte aligned).
        constexpr int VEC = DV % 4 == 0 ? 4 : 1, CHUNKS = DV / VEC;
        for (int i = threadIdx.x; i < tile_rows * CHUNKS; i += THREADS) {
            const int r = i / CHUNKS, c0 = i % CHUNKS * VEC, row = row0 + r;
            const int q = row / group, h = kv_head * group + row % group;
            const long long at = ((long long)b * heads + h) * @SEQ_ROWS@ + q;
            const float* weight = weights + r * MAX_SPLITS;
            const float* column = partial_o + at * DV + c0;
            const long long split_stride = all_rows * DV;
            float x[VEC] = {};
            #pragma unroll 16
            for (int s = 0; s < num_splits; ++s) {
                if constexpr (VEC == 4) {
                    const float4 v = __ldcg((const float4*)(column + s * split_stride));
                    x[0] += weight[s] * v.x;
                    x[1] += weight[s] * v.y;
                    x[2] += weight[s] * v.z;
                    x[3] += weight[s] * v.w;
                } else {
                    x[0] += weight[s] * __ldcg(column + s * split_stride);
                }
            }
            #pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const int c = c0 + j;
                o_ptr[@O_AT@] = storage::from_f32(x[j]);
            }
        }
    }
}
",
    ))
}
