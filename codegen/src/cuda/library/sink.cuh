// ---- learned sinks ----------------------------------------------------------
// Included only by kernels of specs with a sink: one more logit in each row's
// softmax denominator, with no value row. A row's keys leave a max m (log2
// units, -inf if none is kept) and a sum l of exp2(x - m); the sink s2 (log2
// units, in m's frame) joins them at top = max(m, s2): the row's total is
// l * 2^(m - top) + 2^(s2 - top), O's factor 2^(m - top) / total and the LSE
// top + log2(total). A row with no kept key gets O = 0 and LSE = s2; only a
// sink of -inf as well leaves total = 0 (O = 0, LSE = -inf).
struct SinkRow {
    float o_scale;  // what O (relative to m) is multiplied by
    float lse2;     // the row's log-sum-exp, log2 units, in m's frame
};
__device__ __forceinline__ SinkRow sink_row(float m, float l, float s2) {
    const float top = finite_or_zero(fmaxf(m, s2));
    const float keep = fast_exp2(m - top);  // 0 where m = -inf
    const float total = l * keep + fast_exp2(s2 - top);
    if (total > 0.0f) return SinkRow{keep * fast_rcp(total), top + fast_log2(total)};
    return SinkRow{0.0f, neg_inf()};
}
