// Four 8x8 16-bit matrices from registers (the m16n8k16 A-fragment layout)
// to shared memory, each transposed: lane l gives the address of row l % 8 of
// matrix l / 8 as stored.
__device__ __forceinline__ void stmatrix_x4_trans(const unsigned (&r)[4], unsigned addr) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
// 16 bytes to shared memory.
__device__ __forceinline__ void st_shared_v4(unsigned addr, const float (&v)[4]) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]) : "memory");
}
// Adds `bytes` of f32 from shared memory to global memory in one bulk
// reduction by the copy engine (both 16-byte aligned); commit_group closes
// the thread's group of them, and wait_read<N> waits until all but its last N
// groups have read their source.
__device__ __forceinline__ void bulk_reduce_add(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory"); }
// Stores `bytes` of f32 from shared memory to global memory in one bulk copy;
// bulk_wait<N> waits until all but the thread's last N groups have written.
__device__ __forceinline__ void bulk_store(float* dst, unsigned src, unsigned bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory"); }
// Keeps register A operands alive up to this point: the tensor cores read
// them until their wgmma group has been waited for.
template <int N>
__device__ __forceinline__ void keep_operands(const unsigned (&a)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" :: "r"(a[i][c]) : "memory");
    }
}
// Tiles [OFF, OFF + N / 8) of an m16n8-tiled accumulator, as the accumulator
// of an m64nN product: a warpgroup whose columns a product takes in chunks
// (each within a 64-column panel) gives each chunk its tiles.
template <int N>
using acc_tiles = float[N / 8][4];
template <int OFF, int N, int T>
__device__ __forceinline__ acc_tiles<N>& acc_cols(float (&acc)[T][4]) {
    static_assert(OFF + N / 8 <= T, "the chunk lies within the accumulator");
    return *reinterpret_cast<acc_tiles<N>*>(&acc[OFF]);
}
// The accumulator's tiles rotated by S: tile t takes tile (t + S) % T's.
template <int S, int T>
__device__ __forceinline__ void rotate_tiles(float (&acc)[T][4]) {
    float from[T][4];
    #pragma unroll
    for (int t = 0; t < T; ++t) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) from[t][c] = acc[t][c];
    }
    #pragma unroll
    for (int t = 0; t < T; ++t) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) acc[t][c] = from[(t + S) % T][c];
    }
}
