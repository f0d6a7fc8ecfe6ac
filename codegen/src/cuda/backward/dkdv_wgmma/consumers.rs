//! The consumer warpgroups of the Hopper dK/dV kernel: per visited step
//! the products and element code of the module note, then dK and dV.

use super::query_terms::QueryTerms;
use super::{units, Chunk, DqSplit, Layout};
use crate::cuda::backward::common::{write_row_terms, write_spec_lambdas, SpecTerms};
use crate::cuda::backward::dkdv::{
    write_head_grad_adds, write_head_grad_sums, write_key_stores, write_key_unit, write_unit_rows, Staging,
};
use crate::cuda::backward::orientation::Rows;
use crate::cuda::backward::step::{write_elements, write_split_elements, Part};
use crate::cuda::backward::KeyColumns;
use crate::cuda::kit::hoist::Hoisted;
use crate::cuda::kit::terms::interior_decl;
use crate::cuda::signature::names::DQ_ACCUM;
use crate::cuda::tile_config::TileCopy;
use crate::cuda::writer::Writer;
use crate::spec::Spec;
use std::fmt::{self, Write};

/// What the consumers' code is written from: the spec, its terms and those
/// hoisted per row or column, and the kernel's layout.
pub(super) struct Consumers<'a> {
    pub spec: &'a Spec,
    pub terms: &'a SpecTerms,
    pub layout: &'a Layout,
    pub hoisted: &'a [Hoisted<'a>],
    /// How the per-query terms reach the consumers (not read in transposed
    /// tiles, whose columns are keys).
    pub query_terms: &'a QueryTerms<'a, 'a>,
    /// Whether the CTA is persistent (`Layout::persistent`): it takes unit
    /// after unit, each a non-persistent CTA's keys.
    pub units: bool,
    /// How the producer fills the stages.
    pub copy: TileCopy,
}

/// The consumer warpgroups: per head and visited step, the products of the
/// module note; at the end dK and dV.
pub(super) fn write(w: &mut Writer<String>, c: &Consumers) -> fmt::Result {
    let Consumers { spec, layout, .. } = *c;
    let k_dq = match (layout.dq_split(), layout.k_half_cols()) {
        (DqSplit::Rows, _) => "\
            // dQ by rows: every warpgroup reads every column of K.\n\
            const unsigned long long k_dq = gmma_desc(k_smem, BLOCK_N * 128, 1024);\n",
        (DqSplit::HeadDims, _) => "\
            // dQ^T = K^T dS^T: K^T is the A operand, MN-major, its rows this warpgroup's\n\
            // panel of K's columns.\n\
            const unsigned long long k_dq = gmma_desc(k_smem + warpgroup * BLOCK_N * 128, BLOCK_N * 128, 1024);\n",
        (DqSplit::Columns, Some(_)) => "\
            // The second warpgroup's columns cross a panel boundary: it reads their copy.\n\
            const unsigned long long k_dq = gmma_desc(warpgroup == 0 ? k_smem : smem_addr(k_half_tile), BLOCK_N * 128, 1024);\n",
        (DqSplit::Columns, None) => "\
            const int half_col = warpgroup * (DP / 2);  // the first of its dQ columns\n\
            const unsigned long long k_dq = gmma_desc(k_smem + half_col / 64 * BLOCK_N * 128 + half_col % 64 * 2, BLOCK_N * 128, 1024);\n",
    };
    let (roles, own_keys) = match layout.columns {
        KeyColumns::Whole | KeyColumns::Transposed => (
            "\
            const int warpgroup = warp / 4;\n\
            const int key_warp = warp;  // this warp's 16 keys of the CTA's\n",
            "warpgroup * 64 * 128",
        ),
        KeyColumns::Halves => (
            "\
            // Both warpgroups hold the CTA's 64 keys; each its part of the columns.\n\
            const int warpgroup = warp / 4, part = warpgroup;\n\
            const int key_warp = warp % 4;  // this warp's 16 keys of the CTA's\n",
            "0",
        ),
    };
    write!(
        w,
        "\
        {roles}\
        // This warpgroup's 64 keys of the K and V tiles (128-byte rows in each panel).\n\
        const unsigned k_smem = smem_addr(k_tile), v_smem = smem_addr(v_tile);\n\
        // Descriptors of those rows, K-major (S^T, dP^T), and of K's columns of\n\
        // this warpgroup's dQ, MN-major (dQ = dS K).\n\
        const unsigned long long k_own = gmma_desc(k_smem + {own_keys}, 16, 1024);\n\
        const unsigned long long v_own = gmma_desc(v_smem + {own_keys}, 16, 1024);\n\
        {k_dq}"
    )?;
    if !c.units {
        return write_keys(w, c, "mbar_wait(kv_full, 0);\n", "first_head");
    }
    w.block(format_args!("for (int u = 0;; ++u)"), |w| {
        units::write_consumer_entry(w)?;
        write_key_unit(w, spec)?;
        write_keys(w, c, "", "first_head[u % 2]")
    })
}

/// The consumers' work on one CTA's keys (a persistent kernel's unit): dK
/// and dV over every visited step from `first_head`'s, behind `wait_kv`
/// (where the caller has not waited for K and V), then stored.
fn write_keys(w: &mut Writer<String>, c: &Consumers, wait_kv: &str, first_head: &str) -> fmt::Result {
    let Consumers { spec, terms, layout, hoisted, query_terms, .. } = *c;
    write!(
        w,
        "\
        // This warp's 16 keys of dK and dV (f32), summed over every query of every\n\
        // head of the group: no atomics.\n\
        float dk_acc[DK_TILES][4] = {{}};\n\
        float dv_acc[DV_TILES][4] = {{}};\n\
        {wait_kv}\
        int next_h = {first_head};  // the head of the next visited step (the producer's word)\n"
    )?;
    w.block(format_args!("for (int h = kv_head * group; h < (kv_head + 1) * group; ++h)"), |w| {
        writeln!(w, "if (h != next_h) continue;  // the head visits no step")?;
        write_row_terms(w, spec, hoisted, (Rows::Keys, query_terms.columns), Some("k0 + key_warp * 16"))?;
        write_spec_lambdas(w, spec, terms, hoisted, Rows::Keys)?;
        write_head_grad_sums(w, spec, terms)?;
        w.block(format_args!("for (; next_h == h; ++it)"), |w| write_step(w, c))?;
        write_head_grad_adds(w, spec, terms)
    })?;
    writeln!(w)?;
    writeln!(w, "// Epilogue (every product was waited for in its step).")?;
    writeln!(w, "fence_operands(dk_acc);")?;
    writeln!(w, "fence_operands(dv_acc);")?;
    writeln!(w, "// dQ = dS K reads both warpgroups' keys: the consumers' barrier frees K and V.")?;
    writeln!(w, "named_barrier_sync(1, THREADS);")?;
    write_column_order(w, "dk_acc", &layout.dk)?;
    write_column_order(w, "dv_acc", &layout.dv)?;
    if !c.units {
        return write_key_stores(w, spec, layout.columns, "key_warp", Staging::KeyTiles);
    }
    write!(
        w,
        "\
        // The next unit's K and V may come: dK and dV go out through the dS tiles,\n\
        // which the barrier freed too.\n\
        if (threadIdx.x == 0) mbar_arrive(kv_empty);\n"
    )?;
    write_unit_rows(w, spec)?;
    write_key_stores(w, spec, layout.columns, "key_warp", Staging::DsTiles)?;
    writeln!(w, "named_barrier_sync(1, THREADS);  // every warp's rows are out before the next unit's dS")
}

/// One step: the producer's query tile j of head h against this
/// warpgroup's keys.
fn write_step(w: &mut Writer<String>, c: &Consumers) -> fmt::Result {
    let Consumers { spec, terms, layout, .. } = *c;
    write_step_entry(w, spec, c.copy, "K-major (S^T, dP^T) and\n// MN-major (dK, dV)")?;
    write!(
        w,
        "\
        const float* lse_col = lse_cols + stage * BLOCK_M;\n\
        const float* delta_col = delta_cols + stage * BLOCK_M;\n"
    )?;
    write!(
        w,
        "\
        \n\
        // S^T = K Q^T, then dP^T = V dO^T, each in a group of its own, on this\n\
        // warpgroup's 64 keys x BLOCK_M queries, both operands from shared memory;\n\
        // the first k-step overwrites them.\n\
        float s[S_TILES][4], dp[S_TILES][4];\n\
        wgmma_fence();\n"
    )?;
    let block_m = layout.block_m;
    write_score_products(w, block_m, ("s", "DP"), [("k_own", "BLOCK_N"), ("q_smem_k", "BLOCK_M")])?;
    write_score_products(w, block_m, ("dp", "DVP"), [("v_own", "BLOCK_N"), ("dout_smem_k", "BLOCK_M")])?;
    // With 128- and 80-query steps dS reads P back from its 16-bit fragments: P in
    // f32, its fragments, dP^T, dK and dV would not fit the registers at once.
    let ds = match layout.dq_split() {
        DqSplit::Rows | DqSplit::HeadDims => Part::DsFromFragments,
        DqSplit::Columns => Part::Ds,
    };
    c.query_terms.write_columns(w)?;
    let rows = ("k0 + key_warp * 16", "q0");
    writeln!(w)?;
    writeln!(w, "// The A fragments of dV += P^T dO and dK += dS^T Q: the accumulators of query")?;
    writeln!(w, "// tiles 2kk and 2kk + 1 are the kk-th 16-query step's fragment.")?;
    writeln!(w, "unsigned pa[BLOCK_M / 16][4], dsa[BLOCK_M / 16][4];")?;
    let first_pass = |w: &mut Writer<String>, part: Part| write_split_elements(w, spec, terms, Rows::Keys, rows, part);
    let dv = Products { acc: "dv_acc", fragment: "pa", from: "s", b: "dout_smem", chunks: &layout.dv };
    if Part::splits(terms) {
        writeln!(w, "wgmma_wait<1>();  // S^T is done; dP^T may still run")?;
        writeln!(w, "fence_operands(s);")?;
        first_pass(w, Part::P)?;
        writeln!(w, "// dV += P^T dO behind dP^T, while dS waits for it.")?;
        dv.write(w)?;
        writeln!(w, "wgmma_wait<1>();  // dP^T is done; dV may still run")?;
        writeln!(w, "fence_operands(dp);")?;
        write_elements(w, spec, terms, Rows::Keys, rows, ds, false)?;
    } else {
        writeln!(w, "wgmma_wait<0>();")?;
        writeln!(w, "fence_operands(s);")?;
        writeln!(w, "fence_operands(dp);")?;
        first_pass(w, Part::Both)?;
        writeln!(w, "// dV += P^T dO.")?;
        dv.write(w)?;
    }
    let dk = Products { acc: "dk_acc", fragment: "dsa", from: "dp", b: "q_smem", chunks: &layout.dk };
    match layout.columns {
        KeyColumns::Halves => {
            writeln!(w, "// dK += dS^T Q.")?;
            dk.write(w)?;
            write_step_dq(w, layout, None)
        }
        KeyColumns::Whole | KeyColumns::Transposed => {
            dk.pack(w)?;
            write_step_dq(w, layout, Some(&dk))
        }
    }
}

/// `acc = A·Bᵀ` over `dims` columns, m64n`n`, both operands K-major from
/// tiles of 64-column panels (each a descriptor and the constant naming its
/// panels' rows), in a commit group of its own; the first k-step overwrites
/// `acc`.
pub(super) fn write_score_products(
    w: &mut Writer<String>,
    n: u32,
    (acc, dims): (&str, &str),
    [(a, a_rows), (b, b_rows)]: [(&str, &str); 2],
) -> fmt::Result {
    write!(
        w,
        "\
        #pragma unroll\n\
        for (int kk = 0; kk < {dims} / 16; ++kk) {{\n\
        \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
        \x20   wgmma_ss_n{n}({acc}, desc_plus({a}, panel * {a_rows} * 128 + step),\n\
        \x20                   desc_plus({b}, panel * {b_rows} * 128 + step), kk);\n\
        }}\n\
        wgmma_commit();\n"
    )
}

/// The start of a step: the stage's wait, the producer's words, and
/// descriptors of the stage's Q and dO tiles, K-major and MN-major (`what`
/// each serves, for the comment); where threads filled the stage (`copy`),
/// the fence that shows their writes to the tensor cores (TMA's copies
/// already write through the async proxy that wgmma reads through).
pub(super) fn write_step_entry(w: &mut Writer<String>, spec: &Spec, copy: TileCopy, what: &str) -> fmt::Result {
    let interior = interior_decl(spec, "k0");
    let fence = match copy {
        TileCopy::Threads => "fence_async_smem();  // the tensor cores read the stage through the async proxy\n",
        TileCopy::Tma => "",
    };
    write!(
        w,
        "\
        const int stage = it % STAGES;\n\
        mbar_wait(stage_full + 8 * stage, it / STAGES % 2);\n\
        const int tile = step_tile[stage];\n\
        next_h = step_next[stage];\n\
        const int j = tile >> 1, q0 = j * BLOCK_M;\n\
        const bool full = tile & 1;  // the mask keeps every pair: skip evaluating it\n\
        {interior}\
        const unsigned q_smem = smem_addr(q_tiles + stage * Q_TILE), dout_smem = smem_addr(dout_tiles + stage * DO_TILE);\n\
        // Descriptors of the stage's Q and dO tiles: {what}.\n\
        const unsigned long long q_smem_k = gmma_desc(q_smem, 16, 1024), q_smem_mn = gmma_desc(q_smem, BLOCK_M * 128, 1024);\n\
        const unsigned long long dout_smem_k = gmma_desc(dout_smem, 16, 1024), dout_smem_mn = gmma_desc(dout_smem, BLOCK_M * 128, 1024);\n\
        {fence}"
    )
}

/// The step's dQ accumulator tiles `dq`, tile n at 16-byte `chunk`, into
/// the shared tile the producer adds to global memory.
pub(super) fn write_dq_tile_store(w: &mut Writer<String>, chunk: &str) -> fmt::Result {
    write!(
        w,
        "\
        // The step's dQ tiles in fragment order (dq_chunk), into shared tiles\n\
        // it % DQ_BUFS once the copy engine has read what step it - DQ_BUFS left there;\n\
        // a producer thread adds them to the accumulator (add_dq).\n\
        const unsigned dq_tile = smem_addr(dq_tiles + it % DQ_BUFS * DQ_TILE);\n\
        mbar_wait(dq_empty + 8 * (it % DQ_BUFS), (it / DQ_BUFS + 1) % 2);\n\
        #pragma unroll\n\
        for (int n = 0; n < DQ_TILES; ++n) st_shared_v4(dq_tile + 16 * ({chunk}), dq[n]);\n\
        fence_async_smem();  // the copy engine reads the tile through the async proxy\n\
        __syncwarp();\n\
        if (lane == 0) mbar_arrive(dq_full + 8 * (it % DQ_BUFS));\n"
    )
}

/// `acc += from^T B` (dV += P^T dO, dK += dS^T Q): `from` packed into the
/// register A fragments `fragment`, B the stage's tile `b`, MN-major, in
/// `chunks` of the warpgroup's columns.
struct Products<'a> {
    acc: &'a str,
    fragment: &'a str,
    from: &'a str,
    b: &'a str,
    chunks: &'a [Chunk],
}

impl Products<'_> {
    /// Packs the fragments and issues the products.
    fn write(&self, w: &mut Writer<String>) -> fmt::Result {
        self.pack(w)?;
        self.issue(w)
    }

    fn pack(&self, w: &mut Writer<String>) -> fmt::Result {
        let Products { fragment, from, .. } = *self;
        writeln!(w, "#pragma unroll")?;
        writeln!(w, "for (int kk = 0; kk < BLOCK_M / 16; ++kk) pack_p(storage{{}}, {fragment}[kk], {from}, kk);")
    }

    /// The products on packed fragments, in a commit group of their own.
    fn issue(&self, w: &mut Writer<String>) -> fmt::Result {
        let Products { acc, fragment, b, chunks, .. } = *self;
        writeln!(w, "wgmma_fence();")?;
        writeln!(w, "#pragma unroll")?;
        w.block(format_args!("for (int kk = 0; kk < BLOCK_M / 16; ++kk)"), |w| {
            let mut tile = 0;
            for Chunk { width, first } in chunks {
                let acc = match chunks.len() {
                    1 => acc.to_string(),
                    _ => format!("acc_cols<{tile}, {width}>({acc})"),
                };
                let offset = chunk_offset(*first, "BLOCK_M", "part");
                writeln!(w, "wgmma_rs_n{width}({acc}, {fragment}[kk], desc_plus({b}_mn, kk * 16 * 128{offset}));")?;
                tile += width / 8;
            }
            Ok(())
        })?;
        writeln!(w, "wgmma_commit();")
    }
}

/// ` + ` the byte offset of each warpgroup's `first` column (`who`: 0 or
/// 1) in a tile of 64-column panels of `rows` rows; nothing for column 0.
pub(super) fn chunk_offset(first: [u32; 2], rows: &str, who: &str) -> String {
    match first.map(|col| panel_offset(col, rows)) {
        [ours, theirs] if ours == theirs => ours.map_or(String::new(), |bytes| format!(" + {bytes}")),
        [ours, theirs] => {
            let [ours, theirs] = [ours, theirs].map(|bytes| bytes.unwrap_or_else(|| "0".to_string()));
            format!(" + ({who} == 0 ? {ours} : {theirs})")
        }
    }
}

/// The byte offset of column `col` in a tile of 64-column panels of `rows`
/// rows each (a constant's name); `None` for column 0.
fn panel_offset(col: u32, rows: &str) -> Option<String> {
    match (col / 64, col % 64) {
        (0, 0) => None,
        (0, inner) => Some(format!("{}", 2 * inner)),
        (panel, 0) => Some(format!("{panel} * {rows} * 128")),
        (panel, inner) => Some(format!("{panel} * {rows} * 128 + {}", 2 * inner)),
    }
}

/// Where the second warpgroup's chunks of `acc` are out of column order,
/// its accumulator rotated into it for the epilogue's stores.
fn write_column_order(w: &mut Writer<String>, acc: &str, chunks: &[Chunk]) -> fmt::Result {
    if let [first, second] = chunks {
        if first.first[1] > second.first[1] {
            let shift = first.width / 8;
            writeln!(w, "if (part == 1) rotate_tiles<{shift}>({acc});  // its chunks into column order")?;
        }
    }
    Ok(())
}

/// The end of a step: with a dQ accumulator, dQ = dS K from a transposed dS
/// tile, staged in fragment order for the producer's bulk add; the stage is
/// released once the products that read it are done. `dk`, packed but not
/// yet issued (whole columns), goes behind dQ, so that dQ's tile is stored
/// while dK runs instead of with the tensor cores idle.
fn write_step_dq(w: &mut Writer<String>, layout: &Layout, dk: Option<&Products>) -> fmt::Result {
    // With column halves both warpgroups hold the same dS: each stores half.
    let ours = match layout.columns {
        KeyColumns::Whole | KeyColumns::Transposed => "",
        KeyColumns::Halves => "\x20   if (kk % 2 != part) continue;  // the other warpgroup's half of the queries\n",
    };
    let release = "\
        keep_operands(pa);\n\
        keep_operands(dsa);\n\
        if (lane == 0) mbar_arrive(stage_empty + 8 * stage);  // this warp is done with the stage\n";
    // Halves first wait for dK and dV, so that their A fragments are free
    // before dQ's accumulator (as wide as dK's half) takes registers, and the
    // stage goes back to the producer earlier.
    let before_dq = match dk {
        Some(_) => String::new(),
        None => format!("wgmma_wait<0>();  // dK and dV are done\n{release}"),
    };
    // What a warpgroup's product covers, its k-step kk over 16 of the CTA's
    // keys (in dS's key panel `panel`, at byte `step` of its rows), and the
    // 16-byte chunk of dq[n] in the step's tiles.
    let n = layout.dq_n();
    let by_queries = |what: &str, rows: &str| {
        (
            format!("dQ = dS K on {what} (K\n// MN-major: its rows are the reduction)"),
            format!("wgmma_ss_mn_n{n}(dq, desc_plus(ds_k, panel * BLOCK_M * 128 + step{rows}), desc_plus(k_dq, kk * 16 * 128), kk)"),
        )
    };
    let ((what, product), chunk) = match layout.dq_split() {
        DqSplit::Columns => (
            by_queries("BLOCK_M queries x this warpgroup's half of the columns", ""),
            "dq_chunk(DQ_TILES, warpgroup, n, threadIdx.x % 128)",
        ),
        DqSplit::Rows => (
            by_queries("this warpgroup's 64 of the BLOCK_M queries x every column", " + warpgroup * DQ_ROWS * 128"),
            "warpgroup * DQ_ROWS * DP / 4 + dq_chunk(DQ_TILES, 0, n, threadIdx.x % 128)",
        ),
        DqSplit::HeadDims => (
            (
                "dQ^T = K^T dS^T on this warpgroup's 64 head dims x BLOCK_M queries\n// (dS K-major as B: its keys are the reduction)".to_string(),
                format!("wgmma_ss_mna_n{n}(dq, desc_plus(k_dq, kk * 16 * 128), desc_plus(ds_k, panel * BLOCK_M * 128 + step), kk)"),
            ),
            "dqt_chunk(n, threadIdx.x)",
        ),
    };
    w.block(format_args!("if ({DQ_ACCUM} != nullptr)"), |w| {
        write!(
            w,
            "\
            // dS with queries as rows, for dQ = dS K: stmatrix transposes each warp's\n\
            // 16 keys x 16 queries per instruction. Buffers alternate per step: the\n\
            // barrier below keeps either warpgroup from reusing one the other reads.\n\
            const unsigned ds_smem = smem_addr(ds_tiles + it % 2 * DS_TILE);\n\
            const unsigned long long ds_k = gmma_desc(ds_smem, 16, 1024);\n\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_M / 16; ++kk) {{\n\
            {ours}\
            \x20   const int row = kk * 16 + lane / 16 * 8 + lane % 8, col = key_warp * 16 + lane / 8 % 2 * 8;\n\
            \x20   stmatrix_x4_trans(dsa[kk], ds_smem + 2 * tile_offset<BLOCK_M, BLOCK_N, true>(row, col));\n\
            }}\n\
            fence_async_smem();\n\
            {before_dq}\
            named_barrier_sync(1, THREADS);  // both warpgroups' dS are in place\n\
            // {what}, added to the f32 accumulator.\n\
            float dq[DQ_TILES][4];\n\
            wgmma_fence();\n\
            #pragma unroll\n\
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {{\n\
            \x20   const unsigned panel = kk / 4, step = kk % 4 * 32;\n\
            \x20   {product};\n\
            }}\n\
            wgmma_commit();\n"
        )?;
        match dk {
            Some(dk) => {
                writeln!(w, "// dK += dS^T Q, behind dQ.")?;
                dk.issue(w)?;
                writeln!(w, "wgmma_wait<1>();  // dQ is done; dK may still run")?;
                writeln!(w, "fence_operands(dq);")?;
                write_dq_tile_store(w, chunk)?;
                writeln!(w, "wgmma_wait<0>();")?;
                w.write_str(release)
            }
            None => {
                writeln!(w, "wgmma_wait<0>();")?;
                writeln!(w, "fence_operands(dq);")?;
                write_dq_tile_store(w, chunk)
            }
        }
    })?;
    w.block(format_args!("else"), |w| {
        writeln!(w, "// Deterministic mode: a separate kernel computes dQ.")?;
        if let Some(dk) = dk {
            writeln!(w, "// dK += dS^T Q.")?;
            dk.issue(w)?;
        }
        writeln!(w, "wgmma_wait<0>();")?;
        w.write_str(release)
    })
}
