//! Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a), the tile operations
//! of `Mma::Wgmma` kernels (the forward's, and the backward's dK/dV).
//!
//! A warpgroup (four warps) multiplies a 64-row A tile by an N-column B
//! tile that the tensor cores read straight from shared memory through a
//! 64-bit *matrix descriptor*: no `ldmatrix`, no B fragments in registers.
//! Operands sit in the 128-byte-swizzle layout (`tile_offset<…, true>`:
//! 64-column panels of 128-byte rows, eight rows per 1024-byte atom), the
//! one layout wgmma reads both K-major (Q and K: the reduction runs along the
//! row) and MN-major (V, with the transpose flag). The instruction is
//! asynchronous: `wgmma_fence` orders earlier register writes before it,
//! `wgmma_commit` closes a group and `wgmma_wait<N>` blocks until at most N
//! groups are still running, so one product can run behind the code that
//! consumes another.
//!
//! The accumulator layout per warp equals `mma.sync.m16n8k16`'s m16n8 tiles
//! side by side (warp w of the warpgroup holds rows 16w..16w + 15), and P
//! feeds the second product from registers in the m16n8k16 A-fragment
//! layout, so the element loop and the online softmax are the same code
//! for both MMA kinds. Instruction wrappers are generated per N because each
//! accumulator register is its own asm operand.

use super::writer::Writer;
use crate::spec::Dtype;
use std::fmt::{self, Write};

pub(super) const WGMMA: &str = r#"// ---- warpgroup MMA (sm_90a) --------------------------------------------------
// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start
// address, leading and stride byte offsets (16-byte units), 128-byte swizzle.
__device__ __forceinline__ unsigned long long gmma_desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16
         | (unsigned long long)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Blocks until at most N committed groups are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Pins accumulator registers at this point of the asm order: without it the
// compiler may move their reads or writes across a wgmma_wait (they are not
// its operands) and touch registers the tensor cores still own.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N][4]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
        #pragma unroll
        for (int c = 0; c < 4; ++c) asm volatile("" : "+f"(d[i][c]) :: "memory");
    }
}
// Named barriers (id 1..15; 0 is __syncthreads) over `threads` threads:
// sync waits for the barrier to complete, arrive only counts towards it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
// Makes this thread's shared-memory writes (cp.async, stores) visible to the
// tensor cores' async proxy; a barrier then publishes them to the warpgroup.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
"#;

/// Where a wgmma's A operand comes from.
#[derive(Clone, Copy)]
pub(super) enum AFrom {
    /// Shared memory, K-major, like B (`wgmma_ss_n{n}`: S = Q·Kᵀ; the
    /// accumulator is overwritten when `accumulate` is 0).
    Shared,
    /// Shared memory, K-major, with B MN-major (`wgmma_ss_mn_n{n}`: the
    /// backward's dQ = dS·K, K's rows being the reduction).
    SharedMnB,
    /// Registers in the m16n8k16 A-fragment layout, with B MN-major
    /// (`wgmma_rs_n{n}`: O += P·V, always accumulating).
    Registers,
}

/// Writes the m64n{n}k16 wrapper taking A from `a`, f32 accumulators
/// `d[n / 8][4]`.
pub(super) fn write_wgmma_op(w: &mut Writer<String>, dtype: Dtype, n: u32, a: AFrom) -> fmt::Result {
    let ty = match dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    let regs = n / 2;
    let d_list = (0..regs).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", ");
    let d_operands = (0..regs).map(|i| format!("\"+f\"(d[{}][{}])", i / 4, i % 4)).collect::<Vec<_>>().join(", ");
    let op = format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty}");
    let (name, params, scale_d, operands, inputs) = match a {
        AFrom::Shared | AFrom::SharedMnB => {
            let (name, transpose_b) = if matches!(a, AFrom::Shared) { ("ss", 0) } else { ("ss_mn", 1) };
            (
                name,
                "unsigned long long a, unsigned long long b, int accumulate",
                format!("%{}", regs + 2),
                format!("%{}, %{}, p, 1, 1, 0, {transpose_b}", regs, regs + 1),
                "\"l\"(a), \"l\"(b), \"r\"(accumulate)",
            )
        }
        AFrom::Registers => (
            "rs",
            "const unsigned (&a)[4], unsigned long long b",
            "1".to_string(),
            format!("{{%{}, %{}, %{}, %{}}}, %{}, p, 1, 1, 1", regs, regs + 1, regs + 2, regs + 3, regs + 4),
            "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(b)",
        ),
    };
    writeln!(w, "__device__ __forceinline__ void wgmma_{name}_n{n}(float (&d)[{}][4], {params}) {{", n / 8)?;
    w.indented(|w| {
        writeln!(w, "asm volatile(\"{{ .reg .pred p; setp.ne.b32 p, {scale_d}, 0; \"")?;
        writeln!(w, "             \"{op} {{{d_list}}}, {operands}; }}\"")?;
        writeln!(w, "             : {d_operands}")?;
        writeln!(w, "             : {inputs});")
    })?;
    writeln!(w, "}}")
}
