//! The decode kernel's epilogue: the four warps' rows (each saw a quarter
//! of every tile's keys) meet in shared memory, a slice a warp, and leave
//! summed as O and the LSE, or, in a split launch, as the split's partial O
//! and LSE, which the row tile's last split combines (`combine`).

use super::combine::write_split_combine;
use super::plan::{DecodeConfig, KvCacheDtype, WarpSplit};
use super::queries::DecodeQueries;
use crate::cuda::kit::expr::c_expr;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

pub(super) fn write_epilogue(
    w: &mut Writer<String>,
    spec: &Spec,
    queries: DecodeQueries,
    config: DecodeConfig,
) -> fmt::Result {
    let kv = config.kv;
    w.write_str(
        &"
// Epilogue. Shared memory (the stages) now holds:
float* merged = (float*)(smem + Q_TILE);  // [SLICES][BLOCK_M][DVP]: the warps' O at the rows' common max
float* warp_m = merged + SLICES * BLOCK_M * DVP;  // [WARPS][BLOCK_M]: each warp's row max (log2)
float* warp_l = warp_m + WARPS * BLOCK_M;  // [WARPS][BLOCK_M]: each warp's row sum
float* row_scale = warp_l + WARPS * BLOCK_M;  // [BLOCK_M]: 1 / the row's sum, 0 if no key is kept
float* row_lse = row_scale + BLOCK_M;  // [BLOCK_M]: natural log, -inf if no key is kept
// Rows past the group's end (a GQA group of 4 fills a quarter of a 16-row
// tile) are computed but neither merged nor stored.
const int tile_rows = min(BLOCK_M, rows - row0);
#pragma unroll
for (int i = 0; i < 2 * M_TILES; ++i) {
    const int mt = i / 2, r = i % 2, row = mt * 16 + g + 8 * r;
    const float sum = quad_sum(l[mt][r]);
    if (t == 0) {
        warp_m[warp * BLOCK_M + row] = m[mt][r];
        warp_l[warp * BLOCK_M + row] = sum;
    }
}
__syncthreads();
// Each warp stores its O at the rows' common max, in its own slice (summed
// as the rows leave: plain stores, no shared atomics); one thread per row
// sums l.
float* slice = merged + (SLICES == 1 ? 0 : warp) * BLOCK_M * DVP;
#pragma unroll
for (int i = 0; i < 2 * M_TILES; ++i) {
    const int mt = i / 2, r = i % 2, row = mt * 16 + g + 8 * r;
    float row_top = neg_inf();
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) row_top = fmaxf(row_top, warp_m[w * BLOCK_M + row]);
    const float factor = fast_exp2(m[mt][r] - finite_or_zero(row_top));
    if (row >= tile_rows) continue;
    #pragma unroll
    for (int n = 0; n < O_TILES; ++n) {
        #pragma unroll
        for (int c = 0; c < 2; ++c) slice[row * DVP + @O_COLUMN@] = o[mt][n][2 * r + c] * factor;
    }
}
if (threadIdx.x < BLOCK_M) {
    const int row = threadIdx.x;
    float row_top = neg_inf();
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) row_top = fmaxf(row_top, warp_m[w * BLOCK_M + row]);
    const float m_use = finite_or_zero(row_top);
    float sum = 0.0f;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += warp_l[w * BLOCK_M + row] * fast_exp2(warp_m[w * BLOCK_M + row] - m_use);
"
        .replace("@O_COLUMN@", o_column(config)),
    )?;
    write_row_close(w, spec, kv)?;
    w.write_str(&queries.fill(
        spec,
        "}
__syncthreads();

// The rows leave: O and the LSE when the keys are not split, else this
// split's rows (normalized by their own sums) and LSE for the combine.
const long long all_rows = (long long)batch * heads * @SEQ_ROWS@;
for (int i = threadIdx.x; i < tile_rows * DV; i += THREADS) {
    const int r = i / DV, c = i % DV, row = row0 + r;
    const int q = row / group, h = kv_head * group + row % group;
    float x = 0.0f;
    #pragma unroll
    for (int s = 0; s < SLICES; ++s) x += merged[(s * BLOCK_M + r) * DVP + c];
    x *= row_scale[r];
    if (num_splits == 1) {
        o_ptr[@O_AT@] = storage::from_f32(x);
    } else {
        const long long at = split * all_rows + ((long long)b * heads + h) * @SEQ_ROWS@ + q;
        partial_o[at * DV + c] = x;
    }
}
if (threadIdx.x < BLOCK_M && row0 + (int)threadIdx.x < rows) {
    const int row = row0 + threadIdx.x;
    const int q = row / group, h = kv_head * group + row % group;
    const long long at = ((long long)b * heads + h) * @SEQ_ROWS@ + q;
    if (num_splits > 1) partial_lse[split * all_rows + at] = row_lse[threadIdx.x];
    else if (lse != nullptr) lse[@LSE_AT@] = row_lse[threadIdx.x];
}
",
    ))?;
    write_split_combine(w, spec, queries)
}

/// O's column of a lane's accumulator element `c` of m16n8 tile `n`: an
/// e4m3 kernel's P·V puts a 16-dim chunk's even and odd dims in
/// consecutive tiles; where warps split O's columns, a warp's tiles start
/// at its first column (every warp's max is the rows' max then, so the
/// merge's factors are 1, and the warps share one slice, each column
/// stored once).
fn o_column(config: DecodeConfig) -> &'static str {
    match (config.kv, config.warps) {
        (KvCacheDtype::E4m3, _) => "e4m3_o_column(n, t, c)",
        (KvCacheDtype::Spec, WarpSplit::Keys) => "n * 8 + 2 * t + c",
        (KvCacheDtype::Spec, WarpSplit::Columns) => "warp * WARP_DV + n * 8 + 2 * t + c",
    }
}

/// A row's O factor and LSE from its max `row_top` and sum `sum` (relative
/// to `m_use`). A sink joins each row once, in split 0: the combine weighs
/// the splits by their LSEs, so it counts once in the total. An e4m3
/// kernel's factor takes V's descale: O is linear in V.
fn write_row_close(w: &mut Writer<String>, spec: &Spec, kv: KvCacheDtype) -> fmt::Result {
    let v_scale = if kv == KvCacheDtype::E4m3 { " * v_scale" } else { "" };
    let Some(sink) = &spec.sink else {
        return write!(
            w,
            "    row_scale[row] = sum > 0.0f ? fast_rcp(sum){v_scale} : 0.0f;\n    row_lse[row] = sum > 0.0f ? (row_top + fast_log2(sum)) * LN2 : neg_inf();\n",
        );
    };
    write!(
        w,
        "    // The sink joins the row once, in split 0 (the combine weighs splits by LSE).\n\
        \x20   const int h = kv_head * group + min(row0 + row, rows - 1) % group;\n\
        \x20   const SinkRow closed = sink_row(row_top, sum, split == 0 ? {} * LOG2E : neg_inf());\n\
        \x20   row_scale[row] = closed.o_scale{v_scale};\n\
        \x20   row_lse[row] = closed.lse2 * LN2;\n",
        c_expr(spec, sink)
    )
}
