//! One K/V tile on `mma.sync`: S, the spec, the softmax and P V, back to
//! back (two CTAs per SM overlap each other's phases).

use super::classes::cta_selector;
use super::dropout::write_dropout;
use super::item::write_key_terms;
use super::logit::write_logits;
use super::plan::Plan;
use super::softmax::{write_softmax, Rescale};
use crate::cuda::kit::hoist::Hoisted;
use crate::cuda::writer::Writer;
use std::fmt::{self, Write};

/// One K/V tile of the `mma.sync` kernel: S, the spec, the softmax and P V,
/// back to back (two CTAs per SM overlap each other's phases).
pub(super) fn write_sync_step(w: &mut Writer<String>, plan: &Plan, hoisted: &[Hoisted]) -> fmt::Result {
    let spec = plan.spec;
    write_key_terms(w, spec, hoisted, plan.key_terms)?;
    write!(
        w,
        "\
        \n\
        // S = Q K^T on this warp's WARP_M rows x BLOCK_N keys; each K fragment\n\
        // feeds all M_TILES row tiles.\n\
        float s[M_TILES][S_TILES][4] = {{}};\n\
        #pragma unroll\n\
        for (int kk = 0; kk < DP / 16; ++kk) {{\n\
        \x20   unsigned a[M_TILES][4];\n\
        \x20   #pragma unroll\n\
        \x20   for (int mt = 0; mt < M_TILES; ++mt) ldmatrix_x4(a[mt], q_smem + q_lane.at(mt * 16, kk));\n\
        {sweep}\
        }}\n",
        sweep = mma_sweep("s", "a", "S_TILES", "kb", "ldmatrix_x4(kb, k_smem + k_lane.at(n * 8, kk))")
    )?;
    write_logits(w, spec, cta_selector(spec))?;
    write_softmax(w, plan.units, Rescale::Inline, plan.row_sums)?;
    write_dropout(w, plan)?;
    write!(
        w,
        "\
        // O += P V, with P taken straight from the S registers (pack_p).\n\
        #pragma unroll\n\
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
        \x20   unsigned p[M_TILES][4];\n\
        \x20   #pragma unroll\n\
        \x20   for (int mt = 0; mt < M_TILES; ++mt) pack_p(storage{{}}, p[mt], s[mt], kk);\n\
        {sweep}\
        }}\n",
        sweep = mma_sweep("o", "p", "O_TILES", "vb", "ldmatrix_x4_trans(vb, v_smem + v_lane.at(kk * 16, n / 2))")
    )
}

/// One k-step of an `mma.sync` product, inside a loop over `kk`:
/// `acc[mt][n]` += `a[mt]` x B for every pair of 8-column tiles n of
/// `tiles`, B's fragments for the pair loaded into `b` by `load_b` (C,
/// with `n` and `kk` bound), each feeding all M_TILES row tiles.
pub(super) fn mma_sweep(acc: &str, a: &str, tiles: &str, b: &str, load_b: &str) -> String {
    format!(
        "\
        \x20   #pragma unroll\n\
        \x20   for (int n = 0; n < {tiles}; n += 2) {{\n\
        \x20       unsigned {b}[4];\n\
        \x20       {load_b};\n\
        \x20       #pragma unroll\n\
        \x20       for (int mt = 0; mt < M_TILES; ++mt) {{\n\
        \x20           mma_16816(storage{{}}, {acc}[mt][n], {a}[mt], {b}[0], {b}[1]);\n\
        \x20           mma_16816(storage{{}}, {acc}[mt][n + 1], {a}[mt], {b}[2], {b}[3]);\n\
        \x20       }}\n\
        \x20   }}\n"
    )
}
