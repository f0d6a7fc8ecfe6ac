//! The warp-tile code both tiled backward kernels emit, in either tile
//! orientation ([`Rows`]): per step, S and dP on the warp's 16 rows, P and
//! dS on every element, and MMAs whose A operands are those accumulators
//! packed in registers; at the end, the stores of the f32 accumulators.

use super::common::{per_head, SpecTerms};
use super::orientation::Rows;
use super::KeyColumns;
use crate::abi::ArgKind;
use crate::cuda::kit::dropout::dropout_decl;
use crate::cuda::signature::arg_name;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// `s` = S and `dp` = dP on this warp's 16 rows × S_TILES m16n8 tiles: the
/// row operands (K and V, or Q and dO) are the A operands, the column
/// operands the B operands, all in shared memory (`*_smem`, read through
/// the lane patterns `d_a`, `d_b`, `dv_a`, `dv_b`). With halved columns
/// the warp sums its `part` of the head dims' 16-column steps only.
pub(super) fn write_scores(w: &mut Writer<String>, rows: Rows, columns: KeyColumns) -> fmt::Result {
    // (A tile, B tile, B fragment) of S, then of dP.
    let (what, [s_operands, dp_operands]) = match rows {
        Rows::Keys => (
            "S^T = K Q^T and dP^T = V dO^T on this warp's 16 keys x BLOCK_M queries",
            [("k_smem", "q_smem", "qb"), ("v_smem", "dout_smem", "ob")],
        ),
        Rows::Queries => (
            "S = Q K^T and dP = dO V^T on this warp's 16 queries x BLOCK_N keys",
            [("q_smem", "k_smem", "kb"), ("dout_smem", "v_smem", "vb")],
        ),
    };
    writeln!(w)?;
    writeln!(w, "// {what}.")?;
    writeln!(w, "float s[S_TILES][4] = {{}};")?;
    writeln!(w, "float dp[S_TILES][4] = {{}};")?;
    for (acc, steps, (a_smem, b_smem, b), (a_lane, b_lane)) in
        [("s", "DP / 16", s_operands, ("d_a", "d_b")), ("dp", "DVP / 16", dp_operands, ("dv_a", "dv_b"))]
    {
        let range = match columns {
            KeyColumns::Whole | KeyColumns::Transposed => format!("int kk = 0; kk < {steps}; ++kk"),
            KeyColumns::Halves => {
                format!("int kk = part * ({steps} / COL_PARTS); kk < (part + 1) * ({steps} / COL_PARTS); ++kk")
            }
        };
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for ({range})"), |w| {
            writeln!(w, "unsigned a[4];")?;
            writeln!(w, "ldmatrix_x4(a, {a_smem} + {a_lane}.at(warp * 16, kk));")?;
            let load = format!("ldmatrix_x4({b}, {b_smem} + {b_lane}.at(n * 8, kk))");
            write_tile_pairs(w, "S_TILES", acc, "a", b, &load)
        })?;
    }
    Ok(())
}

/// Which part of the element step [`write_elements`] writes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// P and dS together.
    Both,
    /// P alone (`s` may be read before `dp` is ready) ...
    P,
    /// ... then dS from P: only where dS needs nothing but P and dP, i.e.
    /// without a score mod or tensor gradients ([`Part::splits`]).
    Ds,
    /// [`Part::Ds`] with P read back from its 16-bit A fragments `pa`
    /// (dS is rounded to 16 bits for its products all the same).
    DsFromFragments,
}

impl Part {
    /// Whether the element step of `terms` may run as [`Part::P`] then
    /// [`Part::Ds`]: ∂score′/∂score and the tensor-gradient terms read the
    /// raw dot product, which P overwrites, and dropout needs P both before
    /// (dS) and after (dV) its factor.
    pub fn splits(terms: &SpecTerms) -> bool {
        terms.d_score.is_none() && terms.grads.is_empty() && !terms.dropout
    }
}

/// P and dS on every element of the warp's `s` and `dp` tiles, rows from
/// `first_row` and columns from `first_col`, in place (P in `s`, dS in
/// `dp`), and each tensor-gradient term of `terms` added where P > 0, or
/// one `part` of that. With `whole` (a tile the mask keeps whole, every key
/// present) the logit is `logit_whole`, without mask or bounds (see
/// [`write_whole_logit`](super::common::write_whole_logit)). The
/// per-query statistics (log2-domain LSE and D) come from registers by row
/// slot (`lse_r`, `delta_r`) where queries are rows, from shared memory by
/// column (`lse_col`, `delta_col`) where they are columns. Where P = 0,
/// ∂score′/∂score is not evaluated (it may be infinite there).
pub(super) fn write_elements(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    rows: Rows,
    (first_row, first_col): (&str, &str),
    part: Part,
    whole: bool,
) -> fmt::Result {
    let (row_var, col_var) = rows.vars();
    let (row_what, col_what) = match rows {
        Rows::Keys => ("key", "query"),
        Rows::Queries => ("query", "key"),
    };
    writeln!(w)?;
    writeln!(
        w,
        "// P and dS on every element: row slot i is {row_what} {row_var}, column slot (n, c) {col_what} {col_var}."
    )?;
    // dS alone reads no position (but dropout's).
    let positions = matches!(part, Part::Both | Part::P) || terms.dropout;
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int i = 0; i < 2; ++i)"), |w| {
        if positions {
            writeln!(w, "const int {row_var} = {first_row} + g + 8 * i;")?;
        }
        if terms.dropout {
            writeln!(w, "{}", dropout_decl(spec))?;
        }
        // The statistics this part reads, by row slot or column.
        let stats = match part {
            Part::Both => "const float lse2 = {lse}, delta_q = {delta};",
            Part::P => "const float lse2 = {lse};",
            Part::Ds | Part::DsFromFragments => "const float delta_q = {delta};",
        };
        let stats = |lse: &str, delta: &str| stats.replace("{lse}", lse).replace("{delta}", delta);
        if rows == Rows::Queries {
            writeln!(w, "{}", stats("lse_r[i]", "delta_r[i]"))?;
        }
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for (int n = 0; n < S_TILES; ++n)"), |w| {
            if terms.dropout {
                // The element pair (c = 0, 1) of one Philox block: two keys of a
                // query row, or two queries of a key row.
                let pair = match rows {
                    Rows::Keys => format!("dropout_queries(drop, drop_bh, {first_col} + n * 8 + 2 * t, k)"),
                    Rows::Queries => format!("dropout_keys(drop, drop_bh, q, {first_col} + n * 8 + 2 * t)"),
                };
                writeln!(w, "const DropoutPair keep = {pair};")?;
            }
            writeln!(w, "#pragma unroll")?;
            w.block(format_args!("for (int c = 0; c < 2; ++c)"), |w| {
                match (rows, positions) {
                    (_, false) => writeln!(w, "const int e = 2 * i + c;")?,
                    (Rows::Keys, true) => {
                        writeln!(w, "const int col = n * 8 + 2 * t + c, q = {first_col} + col, e = 2 * i + c;")?
                    }
                    (Rows::Queries, true) => {
                        writeln!(w, "const int k = {first_col} + n * 8 + 2 * t + c, e = 2 * i + c;")?
                    }
                }
                if rows == Rows::Keys {
                    writeln!(w, "{}", stats("col_stat(lse_col, n, t, c)", "col_stat(delta_col, n, t, c)"))?;
                }
                let logit = match whole {
                    true => "logit_whole(dot, q, k, i, n, c)",
                    false => "logit(dot, q, k, i, n, c)",
                };
                match part {
                    Part::Both => write_element(w, spec, terms, logit),
                    Part::P => {
                        writeln!(w, "const float dot = s[n][e];")?;
                        writeln!(w, "s[n][e] = fast_exp2({logit} - lse2);")
                    }
                    Part::Ds => writeln!(w, "dp[n][e] = s[n][e] * (dp[n][e] - delta_q);  // dS = P (dP - D)"),
                    Part::DsFromFragments => {
                        writeln!(
                            w,
                            "dp[n][e] = unpack_p(storage{{}}, pa, n, e) * (dp[n][e] - delta_q);  // dS = P (dP - D)"
                        )
                    }
                }
            })
        })
    })
}

/// [`write_elements`] on the whole path (`interior` tiles, see
/// [`interior_decl`](crate::cuda::kit::terms::interior_decl)) and on the
/// masked one.
pub(super) fn write_split_elements(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    rows: Rows,
    firsts: (&str, &str),
    part: Part,
) -> fmt::Result {
    writeln!(w, "// A tile the mask keeps whole, with every key: no mask or bounds.")?;
    w.block(format_args!("if (interior)"), |w| write_elements(w, spec, terms, rows, firsts, part, true))?;
    w.block(format_args!("else"), |w| write_elements(w, spec, terms, rows, firsts, part, false))
}

/// The gradient step on accumulator element `e` of tile `n` (locals `q`,
/// `k`, `i`, `n`, `c`, `e`, `lse2` and `delta_q` bound): P, dS′ =
/// P (dP − D) in `ds_mod`, dS, and the tensor-gradient terms dS′ ·
/// ∂score′/∂t, summed per thread into `acc_t` for reads of one element per
/// head, else added by atomics.
fn write_element(w: &mut Writer<String>, spec: &Spec, terms: &SpecTerms, logit: &str) -> fmt::Result {
    let scale = arg_name(spec, ArgKind::Scale);
    writeln!(w, "const float dot = s[n][e];")?;
    writeln!(w, "const float p = fast_exp2({logit} - lse2);")?;
    if terms.dropout {
        // dV takes P as O did, dropped out; dP reaches S through the same factor.
        writeln!(w, "const float z = c == 0 ? keep.first : keep.second;  // dropout's factor")?;
        writeln!(w, "const float ds_mod = p * (z * dp[n][e] - delta_q);  // dS' = P (Z dP - D)")?;
        writeln!(w, "s[n][e] = p * z;")?;
    } else {
        writeln!(w, "const float ds_mod = p * (dp[n][e] - delta_q);  // dS' = P (dP - D)")?;
        writeln!(w, "s[n][e] = p;")?;
    }
    match &terms.d_score {
        None => writeln!(w, "dp[n][e] = ds_mod;")?,
        Some(_) => {
            writeln!(w, "// dS = dS' d score'/d score, evaluated only where P > 0.")?;
            writeln!(w, "dp[n][e] = p == 0.0f ? 0.0f : ds_mod * d_score(dot * {scale}, q, k, i, n, c);")?;
        }
    }
    for (slot, _, indices) in &terms.grads {
        let t = &spec.tensors[*slot].name;
        let term = format!("ds_mod * d_{t}(dot * {scale}, q, k, i, n, c)");
        if per_head(indices) {
            writeln!(w, "if (p != 0.0f) acc_{t} += {term};")?;
        } else {
            let dt = arg_name(spec, ArgKind::TensorGrad(*slot));
            let owner = terms.owner_clause();
            writeln!(w, "if ({owner}{dt} != nullptr && p != 0.0f) atomicAdd(&{dt}[at_{t}(q, k, i, n, c)], {term});")?;
        }
    }
    Ok(())
}

/// One product of [`write_register_products`]: `acc += from · B`, with the
/// 16-bit A fragment `a` packed from the accumulator tiles `from` and B
/// (`tiles` m16n8 tiles of `acc`) read transposed from `smem` through the
/// lane pattern `lane` into fragment `b`.
pub(super) struct FromRegisters<'a> {
    pub a: &'a str,
    pub from: &'a str,
    pub acc: &'a str,
    pub tiles: &'a str,
    pub b: &'a str,
    pub smem: &'a str,
    pub lane: &'a str,
    /// The 16-column step of B where the warp's columns start, as C (a warp
    /// that holds only some of `acc`'s columns); `None`: the first.
    pub first_col: Option<&'a str>,
}

/// The loop over `steps` 16-column steps of the warp's accumulators that
/// runs `products`: accumulator tiles 2kk and 2kk + 1 are exactly the A
/// fragment of step kk, so P and dS need no trip through shared memory.
pub(super) fn write_register_products(w: &mut Writer<String>, steps: &str, products: &[FromRegisters]) -> fmt::Result {
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int kk = 0; kk < {steps}; ++kk)"), |w| {
        let fragments: Vec<String> = products.iter().map(|p| format!("{}[4]", p.a)).collect();
        writeln!(w, "unsigned {};", fragments.join(", "))?;
        for FromRegisters { a, from, .. } in products {
            for (r, (tile, e)) in
                [("2 * kk", 0), ("2 * kk", 2), ("2 * kk + 1", 0), ("2 * kk + 1", 2)].into_iter().enumerate()
            {
                writeln!(w, "{a}[{r}] = pack2(storage{{}}, {from}[{tile}][{e}], {from}[{tile}][{}]);", e + 1)?;
            }
        }
        for p in products {
            let col = match p.first_col {
                Some(first) => format!("n / 2 + {first}"),
                None => "n / 2".to_string(),
            };
            let load = format!("ldmatrix_x4_trans({}, {} + {}.at(kk * 16, {col}))", p.b, p.smem, p.lane);
            write_tile_pairs(w, p.tiles, p.acc, p.a, p.b, &load)?;
        }
        Ok(())
    })
}

/// `acc[n]` and `acc[n + 1]` += `a` · B for each pair of 8-column tiles
/// n < `tiles`, `load` filling fragment `b` with both tiles' B.
fn write_tile_pairs(w: &mut Writer<String>, tiles: &str, acc: &str, a: &str, b: &str, load: &str) -> fmt::Result {
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int n = 0; n < {tiles}; n += 2)"), |w| {
        writeln!(w, "unsigned {b}[4];")?;
        writeln!(w, "{load};")?;
        writeln!(w, "mma_16816(storage{{}}, {acc}[n], {a}, {b}[0], {b}[1]);")?;
        writeln!(w, "mma_16816(storage{{}}, {acc}[n + 1], {a}, {b}[2], {b}[3]);")
    })
}
