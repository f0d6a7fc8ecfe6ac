//! The split decode's combine, in the decode kernel itself: the last of a
//! row tile's splits to finish (`last_split`, `library/decode.cuh`: an
//! atomic count per row tile, back to 0 after) weighs every split's rows by
//! their LSEs (`exp(lse_s − lse)`) into O and the rows' LSE. One launch per
//! step: no second kernel, no gap between them. Spec-independent.
//!
//! The combine is one CTA's work after every other split has finished, so
//! it is latency, not bandwidth: a lane reads its splits' LSEs once, and
//! each thread takes four columns of a row (a 16-byte load a split) and
//! reads its splits in rounds of `COMBINE_IN_FLIGHT` loads in flight (the
//! last round's surplus loads predicated off and weighed 0), so a row
//! chunk costs `ceil(splits / COMBINE_IN_FLIGHT)` round trips to L2, where
//! a lane per column and one split at a time would wait once per split
//! (and a loop's remainder once per leftover split: MLA's 512-column rows
//! have sixteen chunks a thread).

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
            // Splits past the count weigh 0: the last round of loads reads them as 0.
            #pragma unroll
            for (int k = 0; k < MAX_SPLITS / 32; ++k) {
                const int s = lane + 32 * k;
                weights[r * MAX_SPLITS + s] = s < num_splits && sum > 0.0f ? fast_exp2((lse_s[k] - total) * LOG2E) : 0.0f;
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
            static_assert(MAX_SPLITS % COMBINE_IN_FLIGHT == 0, \"rounds of loads stay within the weights\");
            float x[VEC] = {};
            for (int s0 = 0; s0 < num_splits; s0 += COMBINE_IN_FLIGHT) {
                float v[COMBINE_IN_FLIGHT][VEC];
                #pragma unroll
                for (int k = 0; k < COMBINE_IN_FLIGHT; ++k) {
                    const bool split_in = s0 + k < num_splits;
                    const float* at_split = column + (s0 + k) * split_stride;
                    if constexpr (VEC == 4) {
                        const float4 f = split_in ? __ldcg((const float4*)at_split) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                        v[k][0] = f.x;
                        v[k][1] = f.y;
                        v[k][2] = f.z;
                        v[k][3] = f.w;
                    } else {
                        v[k][0] = split_in ? __ldcg(at_split) : 0.0f;
                    }
                }
                #pragma unroll
                for (int k = 0; k < COMBINE_IN_FLIGHT; ++k) {
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) x[j] += weight[s0 + k] * v[k][j];
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
