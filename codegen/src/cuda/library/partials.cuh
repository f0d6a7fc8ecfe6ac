// ---- context-parallel partials ----------------------------------------------
// Context parallelism computes attention in pieces (a query segment against
// one key segment); these helpers fold a piece into a running f32 sum. A
// warp owns a row, its lanes the row's columns (coalesced), so each row's
// scalars live in one warp and need no CTA barrier.

// How the accumulator and a piece weigh into their merge, and its LSE
// (natural log): the softmax over both rows' keys. An empty side (-inf)
// weighs 0; two empty sides give O = 0 and LSE = -inf.
struct MergeWeights {
    float acc, piece, lse;
};
__device__ __forceinline__ MergeWeights merge_weights(float lse_acc, float lse_piece) {
    const float m = fmaxf(lse_acc, lse_piece);
    if (m == neg_inf()) return MergeWeights{0.0f, 0.0f, neg_inf()};
    const float e_acc = expf(lse_acc - m), e_piece = expf(lse_piece - m);  // the larger is 1
    const float total = e_acc + e_piece;
    return MergeWeights{e_acc / total, e_piece / total, m + log1pf(fminf(e_acc, e_piece))};
}

// Row `row` of a [batch, rows, heads, dim] operand of head `h` in batch `b`.
template <typename T>
__device__ __forceinline__ T* partial_row(T* base, long long batch_stride, long long row_stride,
                                          long long head_stride, int b, int row, int h) {
    return base + b * batch_stride + row * row_stride + h * head_stride;
}

// One row of the merge, by lane: acc and piece weighed by `w` into `out`
// (S), or back into acc where `out` is null. A side of weight 0 is never
// loaded: a first accumulator, a null or empty piece.
template <typename S, int DIM>
__device__ __forceinline__ void merge_row(float* acc, const unsigned short* piece, unsigned short* out,
                                          MergeWeights w, int lane) {
#pragma unroll
    for (int j = 0; j < (DIM + 31) / 32; ++j) {
        const int c = lane + 32 * j;
        if (c >= DIM) break;
        float x = 0.0f;
        if (w.acc != 0.0f) x = w.acc * acc[c];
        if (w.piece != 0.0f) x += w.piece * S::to_f32(piece[c]);
        if (out != nullptr) out[c] = S::from_f32(x);
        else acc[c] = x;
    }
}

// One row of the add, by lane: acc (zeros where `first`) plus piece (S,
// zeros where null) into `out` (S, rounded), or back into acc where null.
template <typename S>
__device__ __forceinline__ void add_row(float* acc, bool first, const unsigned short* piece, unsigned short* out,
                                        int dim, int lane) {
    for (int c = lane; c < dim; c += 32) {
        float x = first ? 0.0f : acc[c];
        if (piece != nullptr) x += S::to_f32(piece[c]);
        if (out != nullptr) out[c] = S::from_f32(x);
        else acc[c] = x;
    }
}
