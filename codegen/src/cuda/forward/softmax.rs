//! The online softmax over a tile of S (base 2, conditional rescaling),
//! and the policies it is printed with: when O is rescaled, where row sums
//! accumulate, and what S holds when it starts.

use crate::cuda::tile_config::{warp_specialized, TileConfig};
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// When the online softmax's rescale of O happens.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Rescale {
    /// Right where a row's max grows: O is in registers the warp owns.
    Inline,
    /// Later: the previous tile's P V still accumulates into O, so each
    /// row's factor waits in `alpha` (1 where the row is not rescaled).
    Deferred,
}

/// Where the softmax's row sums l accumulate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum RowSums {
    /// One FADD per element of P into the lane's share; the epilogue adds
    /// the four lanes of a row.
    Fadd,
    /// On the tensor cores, beside P V: P times a tile of ones (`ones`, one
    /// m64n8 product per 16 keys) into `row_sum`, each of whose columns
    /// holds the whole row's sum, so the epilogue needs no shuffles. The sum
    /// is then of P as rounded for P V: the weights O averages with.
    TensorCores,
}

impl RowSums {
    /// At d <= 64 a warp's softmax chain, not the tensor cores, bounds a
    /// warp-specialized kernel's tile: the FADDs (one per element of P, 64
    /// per tile and thread) leave it for 1/8 more P V. That gains on plain
    /// masks and loses where a score or a tensor-reading mask already
    /// crowds the consumers' registers: those specs keep the FADDs.
    pub(super) fn of(spec: &Spec, config: TileConfig) -> RowSums {
        let unscored = spec.score.is_none() && !spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
        match warp_specialized(config) && TileConfig::padded_head_dim(spec) <= 64 && unscored {
            true => RowSums::TensorCores,
            false => RowSums::Fadd,
        }
    }
}

/// What S holds when the softmax starts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum SUnits {
    /// Masked dot products, for specs without a score expression: the scale
    /// goes into exp2's argument as one FFMA per element (FlashAttention's
    /// `x * scale - max * scale`), and the row max is taken before scaling,
    /// which the runtime's positive scale (`check::softmax_scale`) allows.
    Dots,
    /// Logits in log2 units: a score expression needs the scaled score.
    Log2,
}

impl SUnits {
    pub(super) fn of(spec: &Spec) -> SUnits {
        match spec.score {
            None => SUnits::Dots,
            Some(_) => SUnits::Log2,
        }
    }
}

/// The online softmax over S, in place: S becomes P.
pub(super) fn write_softmax(w: &mut Writer<String>, units: SUnits, rescale: Rescale, sums: RowSums) -> fmt::Result {
    write!(
        w,
        "\
        \n\
        // Online softmax, base 2, row by row. A row's O and l are rescaled only\n\
        // when its max grew by more than RESCALE_SLACK: until then exp2 runs\n\
        // against the stale max, so P <= 2^RESCALE_SLACK, exact enough for f32\n\
        // sums and 16-bit P (FlashAttention-4's conditional rescaling). The\n\
        // four lanes of a row agree on the branch. While every key so far is\n\
        // masked, m is -inf and exp2 runs against 0 (finite_or_zero).\n"
    )?;
    if rescale == Rescale::Deferred {
        writeln!(w, "float alpha[2 * M_TILES];")?;
    }
    let (alpha, scale_o) = match rescale {
        Rescale::Inline => (
            "const float alpha",
            "\
            \x20       #pragma unroll\n\
            \x20       for (int n = 0; n < O_TILES; ++n) {\n\
            \x20           o[mt][n][2 * r] *= alpha;\n\
            \x20           o[mt][n][2 * r + 1] *= alpha;\n\
            \x20       }\n",
        ),
        Rescale::Deferred => ("alpha[i]", ""),
    };
    let keep = match rescale {
        Rescale::Inline => "",
        Rescale::Deferred => "\x20   alpha[i] = 1.0f;\n",
    };
    // Row sums on the tensor cores are rescaled with O (deferred: by the step).
    let l_scale = match (sums, rescale) {
        (RowSums::Fadd, Rescale::Inline) => "\x20       l[mt][r] *= alpha;\n",
        (RowSums::Fadd, Rescale::Deferred) => "\x20       l[mt][r] *= alpha[i];\n",
        (RowSums::TensorCores, Rescale::Inline) => {
            "\x20       row_sum[mt][0][2 * r] *= alpha;\n\x20       row_sum[mt][0][2 * r + 1] *= alpha;\n"
        }
        (RowSums::TensorCores, Rescale::Deferred) => "",
    };
    let l_add = match sums {
        RowSums::Fadd => "\x20   l[mt][r] += row_sum(s[mt], r);\n",
        RowSums::TensorCores => "",
    };
    let (to_log2, exp2_arg) = match units {
        SUnits::Dots => (" * scale_log2", "fmaf(x, scale_log2, -m_use)"),
        SUnits::Log2 => ("", "x - m_use"),
    };
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int i = 0; i < 2 * M_TILES; ++i) {{\n\
        \x20   const int mt = i / 2, r = i % 2;\n\
        \x20   const float m_new = fmaxf(m[mt][r], quad_max(row_max(s[mt], r)){to_log2});\n\
        {keep}\
        \x20   if (m_new > m[mt][r] + RESCALE_SLACK) {{\n\
        \x20       {alpha} = fast_exp2(m[mt][r] - m_new);\n\
        \x20       m[mt][r] = m_new;\n\
        {l_scale}\
        {scale_o}\
        \x20   }}\n\
        \x20   const float m_use = finite_or_zero(m[mt][r]);\n\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < S_TILES; ++n) {{\n\
        \x20       #pragma unroll\n\
        \x20       for (int c = 0; c < 2; ++c) {{\n\
        \x20           float& x = s[mt][n][2 * r + c];\n\
        \x20           x = fast_exp2({exp2_arg});\n\
        \x20       }}\n\
        \x20   }}\n\
        {l_add}\
        }}\n\
        \n"
    )
}
