//! The row-wise backward kernels around the gradient kernels: the
//! preprocess (D = rowsum(dO ∘ O), and the dQ accumulator or its tickets
//! zeroed) and the postprocess (dQ from its f32 accumulator).
//! Memory-bound: the preprocess gives each row a power-of-two group of
//! lanes with one 16-byte chunk each and keeps all of a thread's rows'
//! loads in flight; the postprocess reads
//! rows with one warp each, or an accumulator in fragment order in its own
//! order, one 16-byte chunk per thread, mapped back to rows and columns in a
//! shared tile, so that dQ's rows still go out 16 bytes per thread.

use super::common::{write_source, Sections};
use super::dkdv_wgmma;
use super::packing::Packing;
use super::sink;
use super::{DqAccum, DqOrder};
use crate::abi::{ArgKind, Axis, Grid, Kernel, KernelArg, Operand};
use crate::cuda::library::Part;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::names::{DELTA, DQ_ACCUM, DQ_TICKETS};
use crate::cuda::signature::{backward_post_args, backward_pre_args, with_dq_tickets};
use crate::cuda::source::kernel_name;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

const WARPS: u32 = 4;
/// Query rows per CTA: one step of the wgmma dK/dV kernel, whose dQ
/// accumulator tiles the postprocess reads whole.
const BLOCK_M: u32 = dkdv_wgmma::DQ_ROWS;

pub(super) fn emit_preprocess(spec: &Spec, accum: DqAccum, packing: Packing) -> Kernel {
    let name = kernel_name(&packing.prefix("bwd_pre"), spec);
    let tickets = accum.has_tickets(spec);
    let args = packing.args(spec, with_dq_tickets(spec, backward_pre_args(spec, &sink::sink_grads(spec)), tickets));
    let n = |kind| arg_name(spec, kind);
    let q_len = n(ArgKind::QLen);
    let (o_stride, do_stride) = (n(ArgKind::Stride(Operand::O, Axis::Seq)), n(ArgKind::Stride(Operand::DO, Axis::Seq)));
    // Lanes per row: a power of two with one 8-element chunk each (at least
    // two, so that a pass of the CTA covers at most BLOCK_M rows).
    let lanes = spec.head_dims.v.div_ceil(8).next_power_of_two().max(2);
    // This CTA's part of the accumulator: one contiguous range in either
    // layout; a tile's ticket, where the accumulator has them, stands for it.
    let (zero_from, zero_len, ticket) = match accum {
        DqAccum::Fragments { .. } => {
            let tile = packing.accum_tile(spec, "h", "gridDim.x", "blockIdx.x");
            let ticket = match tickets {
                false => String::new(),
                true => format!(
                    "\
                    // With tickets it zeroes its tile's ticket instead: the dK/dV kernel's\n\
                    // first CTA at a step stores its tiles, the others add to them.\n\
                    if ({DQ_TICKETS} != nullptr) {{\n\
                    \x20   if (threadIdx.x == 0) {DQ_TICKETS}[{tile}] = 0u;\n\
                    }} else "
                ),
            };
            (format!("({tile}) * (BLOCK_M * DQ_COLS)"), "BLOCK_M * DQ_COLS", ticket)
        }
        DqAccum::Rows => {
            (format!("({} + q0) * D", packing.statistic_row(spec, "h")), "(long long)rows * D", String::new())
        }
    };
    let delta_row = packing.statistic_row(spec, "h");
    let source = write_source(
        spec,
        Sections::Rows,
        &name,
        &args,
        |w| write_config(w, accum),
        |w| {
            write_prologue(w, spec, packing)?;
            packing.write_rows(w, spec, Operand::O, "o_rows", "h")?;
            packing.write_rows(w, spec, Operand::DO, "dout_rows", "h")?;
            write!(
            w,
            "\
            const int q0 = blockIdx.x * BLOCK_M, rows = min_i32(BLOCK_M, {q_len} - q0);\n\
            // The dK/dV kernel adds to the dQ accumulator: this CTA zeroes its rows of\n\
            // it, so that no separate pass over it runs.\n\
            {ticket}if ({DQ_ACCUM} != nullptr) {{\n\
            \x20   float* zero = {DQ_ACCUM} + {zero_from};\n\
            \x20   const long long len = {zero_len};\n\
            \x20   if ((unsigned long long)zero % 16 == 0 && len % 4 == 0) {{\n\
            \x20       for (long long i = threadIdx.x; i < len / 4; i += THREADS) reinterpret_cast<float4*>(zero)[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n\
            \x20   }} else {{\n\
            \x20       for (long long i = threadIdx.x; i < len; i += THREADS) zero[i] = 0.0f;\n\
            \x20   }}\n\
            }}\n\
            // D = rowsum(dO * O) in f32: LANES lanes per row, each dotting one 8-element\n\
            // chunk (16-byte loads where rows allow), every row of a thread's loads in\n\
            // flight at once; then a shuffle sum in a fixed order, so D is the same on\n\
            // every run.\n\
            constexpr int CHUNKS = (DV + 7) / 8, LANES = {lanes}, PASS = THREADS / LANES;\n\
            const bool vector = DV % 8 == 0 && (unsigned long long)o_rows % 16 == 0 && (unsigned long long)dout_rows % 16 == 0\n\
            \x20   && {o_stride} % 8 == 0 && {do_stride} % 8 == 0;\n\
            const int part = threadIdx.x % LANES, col = part * 8;\n\
            float sums[BLOCK_M / PASS];\n\
            #pragma unroll\n\
            for (int i = 0; i < BLOCK_M / PASS; ++i) {{\n\
            \x20   const int r = i * PASS + threadIdx.x / LANES;\n\
            \x20   const unsigned short* o = o_rows + (long long)(q0 + r) * {o_stride} + col;\n\
            \x20   const unsigned short* dout = dout_rows + (long long)(q0 + r) * {do_stride} + col;\n\
            \x20   float sum = 0.0f;\n\
            \x20   if (r < rows && part < CHUNKS) {{\n\
            \x20       if (vector) {{\n\
            \x20           const uint4 x = *reinterpret_cast<const uint4*>(o), y = *reinterpret_cast<const uint4*>(dout);\n\
            \x20           const unsigned xs[4] = {{x.x, x.y, x.z, x.w}}, ys[4] = {{y.x, y.y, y.z, y.w}};\n\
            \x20           #pragma unroll\n\
            \x20           for (int e = 0; e < 4; ++e) {{\n\
            \x20               sum += storage::to_f32(xs[e] & 0xffff) * storage::to_f32(ys[e] & 0xffff);\n\
            \x20               sum += storage::to_f32(xs[e] >> 16) * storage::to_f32(ys[e] >> 16);\n\
            \x20           }}\n\
            \x20       }} else {{\n\
            \x20           for (int e = 0; e < 8 && col + e < DV; ++e) sum += storage::to_f32(o[e]) * storage::to_f32(dout[e]);\n\
            \x20       }}\n\
            \x20   }}\n\
            \x20   sums[i] = sum;\n\
            }}\n\
            float* delta_row = {DELTA} + {delta_row};\n\
            #pragma unroll\n\
            for (int i = 0; i < BLOCK_M / PASS; ++i) {{\n\
            \x20   #pragma unroll\n\
            \x20   for (int off = LANES / 2; off > 0; off /= 2) sums[i] += __shfl_xor_sync(0xffffffffu, sums[i], off);\n\
            \x20   const int r = i * PASS + threadIdx.x / LANES;\n\
            \x20   if (part == 0 && r < rows) delta_row[q0 + r] = sums[i];\n\
            }}\n"
        )?;
            sink::write_sink_gradient(w, spec, packing)
        },
    );
    row_kernel(name, source, args)
}

pub(super) fn emit_postprocess(spec: &Spec, accum: DqAccum, packing: Packing) -> Kernel {
    let name = kernel_name(&packing.prefix("bwd_post"), spec);
    let tickets = accum.has_tickets(spec);
    let args = packing.args(spec, with_dq_tickets(spec, backward_post_args(spec), tickets));
    let n = |kind| arg_name(spec, kind);
    let [q_len, scale] = [ArgKind::QLen, ArgKind::Scale].map(n);
    let dq_stride = n(ArgKind::Stride(Operand::DQ, Axis::Seq));
    let config = |w: &mut Writer<String>| {
        write_config(w, accum)?;
        match accum {
            DqAccum::Fragments { step_rows, .. } => {
                if tickets {
                    writeln!(w, "constexpr int STEP_ROWS = {step_rows};  // queries per step of the dK/dV kernel")?;
                    w.write_str(Part::DqTickets.text())?;
                }
                w.write_str(Part::DqFragments.text())
            }
            DqAccum::Rows => Ok(()),
        }
    };
    let source = write_source(spec, Sections::Rows, &name, &args, config, |w| {
        write_prologue(w, spec, packing)?;
        packing.write_rows(w, spec, Operand::DQ, "dq_rows", "h")?;
        if let DqAccum::Fragments { order, .. } = accum {
            let unpack = match order {
                DqOrder::Queries => {
                    "\
                    \x20   dq_chunk_origin(DQ_COLS / 16, c, row, col);\n\
                    \x20   *reinterpret_cast<unsigned*>(&tile[row][col]) = pair(v.x, v.y);\n\
                    \x20   *reinterpret_cast<unsigned*>(&tile[row + 8][col]) = pair(v.z, v.w);\n"
                }
                DqOrder::HeadDims => {
                    "\
                    \x20   dqt_chunk_origin(c, row, col);\n\
                    \x20   const unsigned lo = pair(v.x, v.z), hi = pair(v.y, v.w);  // (row, col), (row, col + 8); row + 1's\n\
                    \x20   tile[row][col] = lo & 0xffff;\n\
                    \x20   tile[row][col + 8] = lo >> 16;\n\
                    \x20   tile[row + 1][col] = hi & 0xffff;\n\
                    \x20   tile[row + 1][col + 8] = hi >> 16;\n"
                }
            };
            let q_tiles = format!("(({q_len} + BLOCK_M - 1) / BLOCK_M)");
            let first_tile = packing.accum_first_tile(spec, "h", &q_tiles);
            let (stored, unstored) = if tickets { unstored_rows() } else { (String::new(), "") };
            return write!(
                w,
                "\
                const int q0 = blockIdx.x * BLOCK_M;\n\
                const long long first_tile = {first_tile};  // the head's\n\
                const float* acc_tile = {DQ_ACCUM} + (first_tile + blockIdx.x) * (BLOCK_M * DQ_COLS);\n\
                {stored}\
                // dQ = scale * accumulator, in the operand dtype. The tile's 16-byte chunks\n\
                // are read in order (coalesced) and land as four elements of two rows in a\n\
                // shared row-major tile (its 8-element pad spreads a warp's writes over\n\
                // the banks); the rows then go out 16 bytes per thread.\n\
                __shared__ __align__(16) unsigned short tile[BLOCK_M][DQ_COLS + 8];\n\
                auto pair = [&](float x, float y) {{\n\
                \x20   return (unsigned)storage::from_f32(x * {scale}) | (unsigned)storage::from_f32(y * {scale}) << 16;\n\
                }};\n\
                for (int c = threadIdx.x; c < BLOCK_M * DQ_COLS / 4; c += THREADS) {{\n\
                \x20   const float4 v = reinterpret_cast<const float4*>(acc_tile)[c];\n\
                \x20   int row, col;\n\
                {unpack}\
                }}\n\
                __syncthreads();\n\
                const bool vector = D % 8 == 0 && (unsigned long long)dq_rows % 16 == 0 && {dq_stride} % 8 == 0;\n\
                for (int i = threadIdx.x; i < BLOCK_M * DQ_COLS / 8; i += THREADS) {{\n\
                \x20   const int row = i / (DQ_COLS / 8), col = i % (DQ_COLS / 8) * 8, q = q0 + row;\n\
                \x20   if (q >= {q_len} || col >= D) continue;\n\
                \x20   unsigned short* out = dq_rows + (long long)q * {dq_stride} + col;\n\
                \x20   {unstored}if (vector) {{\n\
                \x20       *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(&tile[row][col]);\n\
                \x20   }} else {{\n\
                \x20       for (int e = 0; e < 8 && col + e < D; ++e) out[e] = tile[row][col + e];\n\
                \x20   }}\n\
                }}\n"
            );
        }
        let acc_rows = packing.accum_rows(spec);
        write!(
            w,
            "\
            const float* acc_rows = {DQ_ACCUM} + {acc_rows};\n\
            // dQ = scale * accumulator, in the operand dtype, one warp per query row.\n\
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;\n\
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

/// Where the accumulator has tickets, the postprocess's flags for the rows
/// of steps no CTA stored (its tile's rows lie in at most two steps, the
/// second from `split`), and the branch that writes 0 there.
fn unstored_rows() -> (String, &'static str) {
    let flags = format!(
        "\
        // With tickets, rows of a step no CTA visited were never stored (its\n\
        // ticket unmarked): dQ is 0 there. The tile's rows lie in at most two\n\
        // steps, the second from `split`.\n\
        const int step = q0 / STEP_ROWS, split = (step + 1) * STEP_ROWS - q0;\n\
        auto stored = [&](int s) {{\n\
        \x20   return {DQ_TICKETS} == nullptr || ({DQ_TICKETS}[first_tile + s * STEP_ROWS / BLOCK_M] & DQ_STORED) != 0;\n\
        }};\n\
        const bool stored_first = stored(step), stored_second = split < BLOCK_M && stored(step + 1);\n"
    );
    let branch = "\
        if (!(row < split ? stored_first : stored_second)) {\n\
        \x20       for (int e = 0; e < 8 && col + e < D; ++e) out[e] = 0;\n\
        \x20   } else ";
    (flags, branch)
}

fn write_config(w: &mut Writer<String>, accum: DqAccum) -> fmt::Result {
    writeln!(w, "constexpr int WARPS = {WARPS};")?;
    writeln!(w, "constexpr int THREADS = 32 * WARPS;")?;
    writeln!(w, "constexpr int BLOCK_M = {BLOCK_M};  // query rows per CTA: grid.x = ceil(q_len / BLOCK_M)")?;
    match accum {
        DqAccum::Fragments { cols, .. } => {
            writeln!(w, "constexpr int DQ_COLS = {cols};  // columns of a dQ accumulator tile")
        }
        DqAccum::Rows => Ok(()),
    }
}

/// The CTA's batch row (or sequence) and head; a varlen CTA past its
/// sequence's rows returns.
fn write_prologue(w: &mut Writer<String>, spec: &Spec, packing: Packing) -> fmt::Result {
    writeln!(w, "const int b = blockIdx.z;")?;
    writeln!(w, "const int h = blockIdx.y;")?;
    packing.write_sequence(w, spec, false, "blockIdx.x * BLOCK_M", &arg_name(spec, ArgKind::QLen))
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
