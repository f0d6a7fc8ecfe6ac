//! The decode tile step where warps split O's columns
//! ([`WarpSplit::Columns`](super::WarpSplit::Columns)): V head dims past
//! 256 (MLA's 512), whose O does not fit one warp's registers. Each warp
//! still computes S for its share of the tile's keys (8 of 32, every row,
//! the whole QK head dim), so K is read from shared memory once; the rows'
//! max then goes through shared memory, so every warp rescales by the same
//! factor and P is one softmax over the tile, and P itself (16-bit, as the
//! key split's MMA takes it) goes through shared memory to every warp,
//! which multiplies it by its quarter of V's columns. Two barriers a tile
//! more than the key split; each warp's l sums only its keys, which the
//! epilogue's merge adds (its max factors are all 1).

/// P's ldmatrix rows for this lane (as Q's) and the tile's address.
pub(super) const P_LANE: &str = "\
// Warps split O's columns: P's ldmatrix rows of this lane (as Q's).
const LdmLane<BLOCK_N> p_lane(lane % 8 + (lane / 8 % 2) * 8, lane / 16);
const unsigned p_smem = smem_addr(p_tile);
";

/// S = Q·Kᵀ over a warp's 8 keys: one m16n8 tile a k-step, its K fragments
/// two 8x8 matrices (lanes 0-15 address them as `k_lane`'s first half).
/// With one row tile the 36 k-steps of a 576-column K feed two
/// accumulators in turn, not one, whose every MMA would wait on the last;
/// two row tiles are two chains already (more chains spill the kernels
/// whose V has tiles of its own). Four k-steps a loop iteration: unrolled
/// further, ptxas hoists their fragment loads until two row tiles' O spill
/// (four keep `LdmLane`'s steps and the chain compile-time).
pub(super) const SCORES: &str = "    float s[M_TILES][S_TILES][4] = {};
    constexpr int STEPS = DP / 16, CHAINS = M_TILES == 1 && STEPS % 2 == 0 ? 2 : 1;
    float chain[CHAINS][M_TILES][4] = {};
    #pragma unroll 4
    for (int kk = 0; kk < STEPS; ++kk) {
        unsigned a[M_TILES][4];
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(a[mt], q_smem + q_lane.at(mt * 16, kk));
        unsigned kb[2];  // keys kw .. kw + 7, dims 16 kk .. 16 kk + 15
        ldmatrix_x2(kb, k_smem + k_lane.at(kw, kk));
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) mma_16816(operand{}, chain[kk % CHAINS][mt], a[mt], kb[0], kb[1]);
    }
    #pragma unroll
    for (int c = 0; c < CHAINS; ++c) {
        #pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) s[mt][0][i] += chain[c][mt][i];
        }
    }

";

/// The row's max over every warp's keys of the tile, as `m_new`: each
/// warp's max through shared memory, the row loop closed and reopened
/// around the barrier.
pub(super) const TILE_MAX: &str = "        // Warps split O's columns: every warp's max of the row goes through
        // shared memory, so all of them rescale alike and P is one softmax.
        const float warp_max = quad_max(row_max(s[mt], r));
        if (t == 0) p_max[warp * BLOCK_M + mt * 16 + g + 8 * r] = warp_max;
    }
    __syncthreads();
    #pragma unroll
    for (int i = 0; i < 2 * M_TILES; ++i) {
        const int mt = i / 2, r = i % 2, row = mt * 16 + g + 8 * r;
        float tile_max = p_max[row];
        #pragma unroll
        for (int w = 1; w < WARPS; ++w) tile_max = fmaxf(tile_max, p_max[w * BLOCK_M + row]);
        const float m_new = fmaxf(m[mt][r], tile_max);
";

/// P (16-bit) into shared memory for every warp's P·V. The barrier after it
/// also orders this tile's reads of the maxima before the next tile's
/// writes; the next tile's first barrier orders P's reads before its writes.
pub(super) const SHARE_P: &str = "    // P to shared memory: every warp multiplies all of the tile's keys by
    // its own columns of V.
    #pragma unroll
    for (int i = 0; i < 2 * M_TILES; ++i) {
        const int mt = i / 2, r = i % 2, row = mt * 16 + g + 8 * r;
        #pragma unroll
        for (int n = 0; n < S_TILES; ++n) {
            const unsigned pair = pack2(operand{}, s[mt][n][2 * r], s[mt][n][2 * r + 1]);
            *(unsigned*)(p_tile + swizzle<BLOCK_N>(row, kw + n * 8 + 2 * t)) = pair;
        }
    }
    __syncthreads();
    // O += P V: all of the tile's keys, this warp's WARP_DV columns of V.
";

/// P·V's A fragments (from the shared P) and V's address: the tile's keys
/// from 0, the warp's columns from `warp * WARP_DV` (a multiple of 64
/// columns, so the byte offset keeps the swizzle's pattern and `v_lane`'s
/// steps stay compile-time).
pub(super) const VALUES: (&str, &str) =
    ("ldmatrix_x4(p[mt], p_smem + p_lane.at(mt * 16, kk))", "v_smem + 2 * warp * WARP_DV + v_lane.at(kk * 16, n / 2)");
