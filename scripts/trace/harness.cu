// Times one traced forward kernel (`flashgen emit --trace`, with the
// KERNEL and EXTRA_ARGS defines of scripts/trace/harness_args.py) on the
// bench suite's shape (16 heads, 32k tokens per batch, bshd, random bf16)
// (O and the LSE written) and writes the trace of one more launch.
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 \
//        -DKERNEL_FILE='"traced.cu"' [-DTRACE_ON=0] harness.cu -o h
//   ./h SEQ TRACE_FILE
//
// Prints the median and best of 30 launches (CUDA events) after 5 warm-up
// ones, and a hash of O. The trace file holds the header {TRACE_CTAS, 5,
// TRACE_N}, the event count of each (CTA, warpgroup), then every row of
// g_trace.
#include KERNEL_FILE
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                          \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

typedef CUresult (*Encode)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                           const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                           CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The runtime's descriptor (runtime/src/tma.rs): [dim, seq, head, batch],
// boxes of 64 columns by `rows`, 128-byte swizzle.
static TensorMap tensor_map(Encode encode, void* ptr, int batch, int seq, int heads, int dim, int rows) {
    TensorMap map;
    const cuuint64_t dims[4] = {(cuuint64_t)dim, (cuuint64_t)seq, (cuuint64_t)heads, (cuuint64_t)batch};
    const cuuint64_t strides[3] = {2ull * heads * dim, 2ull * dim, batch == 1 ? 16ull : 2ull * seq * heads * dim};
    const cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1}, element_strides[4] = {1, 1, 1, 1};
    if (encode((CUtensorMap*)&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, ptr, dims, strides, box, element_strides,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed\n");
        exit(1);
    }
    return map;
}

// bf16 values uniform in [-1.7, 1.7) from a hash of the index.
__global__ void fill(unsigned short* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = (unsigned short)(__float_as_uint(((x & 0xffff) / 65536.0f - 0.5f) * 3.4f) >> 16);
    }
}

int main(int argc, char** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s SEQ TRACE_FILE\n", argv[0]);
        return 2;
    }
    const int seq = atoi(argv[1]), heads = 16, batch = 32768 / seq, launches = 30;
    const size_t qk = (size_t)batch * seq * heads * D, vo = (size_t)batch * seq * heads * DV;
    unsigned short *q, *k, *v, *o;
    float* lse;  // written, as a training forward writes it for the backward
    unsigned long long* counter;
    CHECK(cudaMalloc(&q, 2 * qk));
    CHECK(cudaMalloc(&k, 2 * qk));
    CHECK(cudaMalloc(&v, 2 * vo));
    CHECK(cudaMalloc(&o, 2 * vo));
    CHECK(cudaMalloc(&lse, sizeof(float) * batch * heads * seq));
    CHECK(cudaMalloc(&counter, 16));
    CHECK(cudaMemset(counter, 0, 16));
    fill<<<1024, 256>>>(q, qk, 1);
    fill<<<1024, 256>>>(k, qk, 2);
    fill<<<1024, 256>>>(v, vo, 3);
    Encode encode;
    cudaDriverEntryPointQueryResult found;
    CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", (void**)&encode, cudaEnableDefault, &found));
    const TensorMap q_map = tensor_map(encode, q, batch, seq, heads, D, BLOCK_M);
    const TensorMap k_map = tensor_map(encode, k, batch, seq, heads, D, BLOCK_N);
    const TensorMap v_map = tensor_map(encode, v, batch, seq, heads, DV, BLOCK_N);
    const TensorMap o_map = tensor_map(encode, o, batch, seq, heads, DV, 16);  // O_STORE_ROWS
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int per_sm;  // the occupancy the runtime's grid assumes
    const int smem = (2 * Q_TILE + STAGES * (K_TILE + V_TILE) + O_TILE + COLUMN_TILES) * 2 + 1024;
    CHECK(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, KERNEL, CTA_THREADS, smem));
    const long long items = (long long)((seq + BLOCK_M - 1) / BLOCK_M) * heads * batch;
    const int grid = (int)std::min<long long>(items, (long long)sms * per_sm);
    const long long qs = (long long)heads * D, vs = (long long)heads * DV;
    auto launch = [&]() {
        KERNEL<<<grid, CTA_THREADS, smem>>>(q, k, v, o, lse, batch, heads, heads, seq, seq, seq * qs, qs, D, seq * qs, qs, D,
                                            seq * vs, vs, DV, seq * vs, vs, DV, 0.125f, EXTRA_ARGS counter, q_map, k_map,
                                            v_map, o_map);
    };
    for (int i = 0; i < 5; ++i) launch();
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    std::vector<float> ms;
    for (int i = 0; i < launches; ++i) {
        CHECK(cudaEventRecord(start));
        launch();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        float t;
        CHECK(cudaEventElapsedTime(&t, start, stop));
        ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());

    static int counts[TRACE_CTAS * 5];
    std::fill(counts, counts + TRACE_CTAS * 5, 0);
    CHECK(cudaMemcpyToSymbol(g_trace_n, counts, sizeof counts));
    launch();
    CHECK(cudaDeviceSynchronize());
    std::vector<unsigned long long> rows((size_t)TRACE_CTAS * 5 * TRACE_N);
    CHECK(cudaMemcpyFromSymbol(rows.data(), g_trace, rows.size() * 8));
    CHECK(cudaMemcpyFromSymbol(counts, g_trace_n, sizeof counts));
    FILE* f = fopen(argv[2], "wb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    const int header[3] = {TRACE_CTAS, 5, TRACE_N};
    fwrite(header, 4, 3, f);
    fwrite(counts, 4, TRACE_CTAS * 5, f);
    fwrite(rows.data(), 8, rows.size(), f);
    fclose(f);
    // O's bytes hashed (FNV-1a): a hand edit that keeps each row's arithmetic
    // must keep the hash.
    std::vector<unsigned short> out(vo);
    CHECK(cudaMemcpy(out.data(), o, 2 * vo, cudaMemcpyDeviceToHost));
    unsigned long long hash = 1469598103934665603ull;
    for (unsigned short x : out) hash = (hash ^ x) * 1099511628211ull;
    printf("s=%-6d b=%-3d grid=%d median %.4f ms, best %.4f ms, O %016llx\n", seq, batch, grid, ms[launches / 2], ms[0],
           hash);
}
