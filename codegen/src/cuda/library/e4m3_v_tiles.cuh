// ---- V's tiles for the e4m3 forward ------------------------------------------
// An 8-bit wgmma reads both operands K-major, so P V needs V with its keys
// along the rows: per (batch, K/V head) and tile of KEYS keys, a [DVP][ROW]
// block of bytes (ROW: the keys in whole 128-byte panels, which the forward's
// copies take one at a time), zero past kv_len, DV and KEYS. Within each 32-key step, column c holds key
// e4m3_v_key(c) of the step, the order pack_p_e4m3 leaves P's bytes in.
__device__ __forceinline__ int e4m3_v_key(int c) {
    const int half = c / 16, t = c % 16 / 4, j = c % 4;
    return 16 * half + 8 * (j / 2) + 2 * t + j % 2;
}
// The CTA's tile, a panel of 128 keys at a time: their rows of V (DV bytes
// each, 16-byte aligned) into shared memory, then each thread writes four-byte
// words of the panel.
template <int DV, int DVP, int KEYS, int ROW, int THREADS>
__device__ __forceinline__ void e4m3_v_tile(const unsigned char* v_rows, long long row_stride, int keys,
                                            unsigned char* tile_out) {
    constexpr int PITCH = DVP + 4;  // bytes per key in shared memory, off the bank period
    __shared__ __align__(16) unsigned char keys_smem[128 * PITCH];
    constexpr int CHUNKS = DV / 16;
    for (int k0 = 0; k0 < KEYS; k0 += 128) {
        for (int i = threadIdx.x; i < 128 * CHUNKS; i += THREADS) {
            const int key = i / CHUNKS, chunk = i % CHUNKS;
            uint4 bytes = make_uint4(0, 0, 0, 0);
            if (k0 + key < min(keys, KEYS)) bytes = *(const uint4*)(v_rows + (k0 + key) * row_stride + 16 * chunk);
            unsigned* dst = (unsigned*)(keys_smem + key * PITCH + 16 * chunk);
            dst[0] = bytes.x;
            dst[1] = bytes.y;
            dst[2] = bytes.z;
            dst[3] = bytes.w;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < DVP * 32; i += THREADS) {
            const int d = i / 32, c = 4 * (i % 32);
            unsigned word = 0;
            if (d < DV) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int key = c / 32 * 32 + e4m3_v_key(c % 32 + j);
                    word |= (unsigned)keys_smem[key * PITCH + d] << (8 * j);
                }
            }
            *(unsigned*)(tile_out + d * ROW + k0 + c) = word;
        }
        __syncthreads();
    }
}
