// ---- varlen (packed) operands ----------------------------------------------------
// Sequence b's tokens in a packed operand: [start, start + len) of the
// buffer's `total` tokens, from the prefix sums `cu` (i32[batch + 1] on the
// device, which the host cannot read before the launch). The values are
// clamped, so bad prefix sums give wrong rows but never an access outside
// the buffer: 0 <= start <= start + len <= total, and len <= max_len (the
// grid covers no more query tiles). `flashgen_codegen::cuda::varlen` is the
// CPU twin the schedule's tests run on.
struct SeqSpan {
    int start, len;
};
__device__ __forceinline__ SeqSpan seq_span(const int* __restrict__ cu, int b, int total, int max_len) {
    const int start = min(max(cu[b], 0), total);
    const int end = min(max(cu[b + 1], start), total);
    return {start, min(end - start, max_len)};
}
