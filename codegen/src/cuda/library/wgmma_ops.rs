//! The wgmma instruction wrappers, generated per N (m64nNk16, and m64nNk32
//! for e4m3 operands): each accumulator register is its own asm operand, so
//! a wrapper's text depends on the width it multiplies.

use crate::cuda::writer::Writer;
use crate::spec::Dtype;
use std::fmt::{self, Write};

/// Where a wgmma's A operand comes from.
#[derive(Clone, Copy)]
pub(crate) enum AFrom {
    /// Shared memory, K-major, like B (`wgmma_ss_n{n}`: S = Q·Kᵀ; the
    /// accumulator is overwritten when `accumulate` is 0).
    Shared,
    /// Shared memory, K-major, with B MN-major (`wgmma_ss_mn_n{n}`: the
    /// backward's dQ = dS·K, K's rows being the reduction).
    SharedMnB,
    /// Shared memory, MN-major, with B K-major (`wgmma_ss_mna_n{n}`: the
    /// transposed backward's dVᵀ = dOᵀ·P, dO's head dims as M).
    SharedMnA,
    /// Shared memory, both MN-major (`wgmma_ss_mnab_n{n}`: the transposed
    /// backward's dQ = dS·K from a stored dSᵀ).
    SharedMnAB,
    /// Registers in the m16n8k16 A-fragment layout, with B MN-major
    /// (`wgmma_rs_n{n}`: O += P·V, always accumulating).
    Registers,
    /// Registers in the m16n8k16 A-fragment layout, with B K-major
    /// (`wgmma_rs_kb_n{n}`: S = Q·Kᵀ with Q's fragments held, the
    /// accumulator overwritten when `accumulate` is 0).
    RegistersKMajorB,
    /// e4m3 operands, m64nNk32, both K-major (8-bit wgmma has no transpose):
    /// A from shared memory (`wgmma_ss_e4m3_n{n}`: S = Q·Kᵀ, the
    /// accumulator overwritten when `accumulate` is 0).
    E4m3Shared,
    /// e4m3 operands, A from registers in the m16n8k32 A-fragment layout
    /// (four bytes of one row per register), B K-major
    /// (`wgmma_rs_e4m3_n{n}`: O += P·Vᵀᵀ, always accumulating).
    E4m3Registers,
}

/// Writes the m64n{n} wrapper taking A from `a`, f32 accumulators
/// `d[n / 8][4]`; 16-bit operands are `dtype`, e4m3 ones as `a` says.
pub(crate) fn write_wgmma_op(w: &mut Writer<String>, dtype: Dtype, n: u32, a: AFrom) -> fmt::Result {
    let ty = match (a, dtype) {
        (AFrom::E4m3Shared | AFrom::E4m3Registers, _) => "e4m3",
        (_, Dtype::F16) => "f16",
        (_, Dtype::Bf16) => "bf16",
    };
    let k = if ty == "e4m3" { 32 } else { 16 };
    let regs = n / 2;
    let d_list = (0..regs).map(|i| format!("%{i}")).collect::<Vec<_>>().join(", ");
    let d_operands = (0..regs).map(|i| format!("\"+f\"(d[{}][{}])", i / 4, i % 4)).collect::<Vec<_>>().join(", ");
    let op = format!("wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty}");
    // The transpose immediates (A's, if from shared memory, then B's); 8-bit
    // operands take none: both are K-major.
    let transposes = match a {
        AFrom::Shared => ", 0, 0",
        AFrom::SharedMnB => ", 0, 1",
        AFrom::SharedMnA => ", 1, 0",
        AFrom::SharedMnAB => ", 1, 1",
        AFrom::Registers => ", 1",
        AFrom::RegistersKMajorB => ", 0",
        AFrom::E4m3Shared | AFrom::E4m3Registers => "",
    };
    let (name, params, scale_d, operands, inputs) = match a {
        AFrom::Shared | AFrom::SharedMnB | AFrom::SharedMnA | AFrom::SharedMnAB | AFrom::E4m3Shared => (
            match a {
                AFrom::Shared => "ss",
                AFrom::SharedMnB => "ss_mn",
                AFrom::SharedMnA => "ss_mna",
                AFrom::SharedMnAB => "ss_mnab",
                _ => "ss_e4m3",
            },
            "unsigned long long a, unsigned long long b, int accumulate",
            format!("%{}", regs + 2),
            format!("%{}, %{}, p, 1, 1{transposes}", regs, regs + 1),
            "\"l\"(a), \"l\"(b), \"r\"(accumulate)".to_string(),
        ),
        AFrom::Registers | AFrom::RegistersKMajorB | AFrom::E4m3Registers => {
            let a_regs = "\"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"l\"(b)";
            let operands = format!(
                "{{%{}, %{}, %{}, %{}}}, %{}, p, 1, 1{transposes}",
                regs,
                regs + 1,
                regs + 2,
                regs + 3,
                regs + 4
            );
            // S from Q's fragments may overwrite its accumulator; P V always adds.
            match a {
                AFrom::RegistersKMajorB => (
                    "rs_kb",
                    "const unsigned (&a)[4], unsigned long long b, int accumulate",
                    format!("%{}", regs + 5),
                    operands,
                    format!("{a_regs}, \"r\"(accumulate)"),
                ),
                _ => (
                    if matches!(a, AFrom::Registers) { "rs" } else { "rs_e4m3" },
                    "const unsigned (&a)[4], unsigned long long b",
                    "1".to_string(),
                    operands,
                    a_regs.to_string(),
                ),
            }
        }
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
