//! The row-wise backward kernels around the gradient kernels: the
//! preprocess (D = rowsum(dO ∘ O)) and the postprocess (dQ from its f32
//! accumulator). Memory-bound: one warp per query row, lanes across the row;
//! an accumulator in fragment order is read in its own order instead, one
//! 16-byte chunk per thread, mapped back to rows and columns in a shared
//! tile, so that dQ's rows still go out 16 bytes per thread.

use super::common::{write_source, Sections};
use super::dkdv::write_rows;
use super::dkdv_wgmma::{self, DQ_FRAGMENTS};
use super::DqAccum;
use crate::abi::{ArgKind, Axis, Grid, Kernel, KernelArg, Operand};
use crate::cuda::signature::arg_name;
use crate::cuda::signature::{backward_post_args, backward_pre_args};
use crate::cuda::source::kernel_name;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const WARPS: u32 = 4;
/// Query rows per CTA: one step of the wgmma dK/dV kernel, whose dQ
/// accumulator tiles the postprocess reads whole.
const BLOCK_M: u32 = dkdv_wgmma::BLOCK_M;

pub(super) fn emit_preprocess(spec: &Spec) -> Kernel {
    let name = kernel_name("bwd_pre", spec);
    let args = backward_pre_args(spec);
    let n = |kind| arg_name(spec, kind);
    let [heads, q_len] = [ArgKind::Heads, ArgKind::QLen].map(n);
    let (o_stride, do_stride) = (n(ArgKind::Stride(Operand::O, Axis::Seq)), n(ArgKind::Stride(Operand::DO, Axis::Seq)));
    let source = write_source(spec, Sections::Rows, &name, &args, write_config, |w| {
        write_prologue(w)?;
        write_rows(w, spec, Operand::O, "o_rows", "h")?;
        write_rows(w, spec, Operand::DO, "dout_rows", "h")?;
        write!(
            w,
            "\
            float* delta_row = delta + ((long long)b * {heads} + h) * {q_len};\n\
            // D = rowsum(dO * O) in f32, one warp per query row.\n\
            for (int r = warp; r < BLOCK_M; r += WARPS) {{\n\
            \x20   const int q = blockIdx.x * BLOCK_M + r;\n\
            \x20   if (q >= {q_len}) break;\n\
            \x20   const unsigned short* o = o_rows + (long long)q * {o_stride};\n\
            \x20   const unsigned short* dout = dout_rows + (long long)q * {do_stride};\n\
            \x20   float sum = 0.0f;\n\
            \x20   for (int col = lane; col < DV; col += 32) sum += storage::to_f32(o[col]) * storage::to_f32(dout[col]);\n\
            \x20   sum = warp_sum(sum);\n\
            \x20   if (lane == 0) delta_row[q] = sum;\n\
            }}\n"
        )
    });
    row_kernel(name, source, args)
}

pub(super) fn emit_postprocess(spec: &Spec, accum: DqAccum) -> Kernel {
    let name = kernel_name("bwd_post", spec);
    let args = backward_post_args(spec);
    let n = |kind| arg_name(spec, kind);
    let [heads, q_len, scale] = [ArgKind::Heads, ArgKind::QLen, ArgKind::Scale].map(n);
    let dq_stride = n(ArgKind::Stride(Operand::DQ, Axis::Seq));
    let config = |w: &mut Writer<String>| {
        write_config(w)?;
        match accum {
            DqAccum::Fragments => w.write_str(DQ_FRAGMENTS),
            DqAccum::Rows => Ok(()),
        }
    };
    let source = write_source(spec, Sections::Rows, &name, &args, config, |w| {
        write_prologue(w)?;
        write_rows(w, spec, Operand::DQ, "dq_rows", "h")?;
        if accum == DqAccum::Fragments {
            return write!(
                w,
                "\
                const int q0 = blockIdx.x * BLOCK_M, q_tiles = ({q_len} + BLOCK_M - 1) / BLOCK_M;\n\
                const float* acc_tile = dq_accum + (((long long)b * {heads} + h) * q_tiles + blockIdx.x) * (BLOCK_M * DP);\n\
                // dQ = scale * accumulator, in the operand dtype. The tile's 16-byte chunks\n\
                // are read in order (coalesced) and land as two column pairs of two rows\n\
                // in a shared row-major tile (its 8-element pad spreads the pairs of a\n\
                // warp over all 32 banks); the rows then go out 16 bytes per thread.\n\
                __shared__ __align__(16) unsigned short tile[BLOCK_M][DP + 8];\n\
                auto pair = [&](float x, float y) {{\n\
                \x20   return (unsigned)storage::from_f32(x * {scale}) | (unsigned)storage::from_f32(y * {scale}) << 16;\n\
                }};\n\
                for (int c = threadIdx.x; c < BLOCK_M * DP / 4; c += THREADS) {{\n\
                \x20   const float4 v = reinterpret_cast<const float4*>(acc_tile)[c];\n\
                \x20   int row, col;\n\
                \x20   dq_chunk_origin(DP / 16, c, row, col);\n\
                \x20   *reinterpret_cast<unsigned*>(&tile[row][col]) = pair(v.x, v.y);\n\
                \x20   *reinterpret_cast<unsigned*>(&tile[row + 8][col]) = pair(v.z, v.w);\n\
                }}\n\
                __syncthreads();\n\
                const bool vector = D % 8 == 0 && (unsigned long long)dq_rows % 16 == 0 && {dq_stride} % 8 == 0;\n\
                for (int i = threadIdx.x; i < BLOCK_M * DP / 8; i += THREADS) {{\n\
                \x20   const int row = i / (DP / 8), col = i % (DP / 8) * 8, q = q0 + row;\n\
                \x20   if (q >= {q_len} || col >= D) continue;\n\
                \x20   unsigned short* out = dq_rows + (long long)q * {dq_stride} + col;\n\
                \x20   if (vector) {{\n\
                \x20       *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(&tile[row][col]);\n\
                \x20   }} else {{\n\
                \x20       for (int e = 0; e < 8 && col + e < D; ++e) out[e] = tile[row][col + e];\n\
                \x20   }}\n\
                }}\n"
            );
        }
        write!(
            w,
            "\
            const float* acc_rows = dq_accum + ((long long)b * {heads} + h) * {q_len} * D;\n\
            // dQ = scale * accumulator, in the operand dtype, one warp per query row.\n\
            for (int r = warp; r < BLOCK_M; r += WARPS) {{\n\
            \x20   const int q = blockIdx.x * BLOCK_M + r;\n\
            \x20   if (q >= {q_len}) break;\n\
            \x20   for (int col = lane; col < D; col += 32) {{\n\
            \x20       dq_rows[(long long)q * {dq_stride} + col] = storage::from_f32(acc_rows[(long long)q * D + col] * {scale});\n\
            \x20   }}\n\
            }}\n"
        )
    });
    row_kernel(name, source, args)
}

fn write_config(w: &mut Writer<String>) -> fmt::Result {
    writeln!(w, "constexpr int WARPS = {WARPS};")?;
    writeln!(w, "constexpr int THREADS = 32 * WARPS;")?;
    writeln!(w, "constexpr int BLOCK_M = {BLOCK_M};  // query rows per CTA: grid.x = ceil(q_len / BLOCK_M)")
}

fn write_prologue(w: &mut Writer<String>) -> fmt::Result {
    writeln!(w, "const int b = blockIdx.z;")?;
    writeln!(w, "const int h = blockIdx.y;")?;
    writeln!(w, "const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;")
}

fn row_kernel(name: String, source: String, args: Vec<KernelArg>) -> Kernel {
    Kernel {
        name,
        source,
        grid: Grid::QueryTiles,
        block_m: BLOCK_M,
        block_n: 0,
        threads: 32 * WARPS,
        dynamic_smem: 0,
        args,
    }
}
