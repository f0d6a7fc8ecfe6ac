//! The wgmma instruction wrappers, generated per N (m64nNk16): each
//! accumulator register is its own asm operand, so a wrapper's text depends
//! on the width it multiplies.

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
    /// Registers in the m16n8k16 A-fragment layout, with B MN-major
    /// (`wgmma_rs_n{n}`: O += P·V, always accumulating).
    Registers,
}

/// Writes the m64n{n}k16 wrapper taking A from `a`, f32 accumulators
/// `d[n / 8][4]`.
pub(crate) fn write_wgmma_op(w: &mut Writer<String>, dtype: Dtype, n: u32, a: AFrom) -> fmt::Result {
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
