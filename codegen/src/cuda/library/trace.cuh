// ---- trace points (traced forward kernels) ----------------------------------
// A traced forward kernel (emit_forward_traced) prints TR(code) at its events:
// thread 0 of each warpgroup of the first TRACE_CTAS CTAs appends
// (event << 56 | clock64) to its row of g_trace (scripts/trace/harness.cu
// reads them). Compiled with -DTRACE_ON=0 the points vanish: the same
// kernel, untimed.
#ifndef TRACE_ON
#define TRACE_ON 1
#endif
#define TRACE_CTAS 8
#define TRACE_N 8192
__device__ unsigned long long g_trace[TRACE_CTAS][5][TRACE_N];
__device__ int g_trace_n[TRACE_CTAS][5];
#if TRACE_ON
// The count lives in a register (trace_n_, declared at the kernel's top) and
// is only stored: a load of it from global memory would put an L2 round trip
// into every traced span.
#define TR(code) do { if (blockIdx.x < TRACE_CTAS && threadIdx.x % 128 == 0) { \
    const int role_ = threadIdx.x / 128, n_ = trace_n_++; \
    if (n_ < TRACE_N) g_trace[blockIdx.x][role_][n_] = (unsigned long long)(code) << 56 | ((unsigned long long)clock64() & ((1ull << 56) - 1)); \
    g_trace_n[blockIdx.x][role_] = trace_n_; } } while (0)
#define TRACE_COUNTER int trace_n_ = 0;
#else
#define TR(code) do {} while (0)
#define TRACE_COUNTER
#endif
