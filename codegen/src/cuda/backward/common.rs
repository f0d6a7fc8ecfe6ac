//! What the backward kernels share: the source frame, the spec as lambdas
//! (logit, ∂score′/∂score, tensor-gradient terms), hoisted spec terms in
//! either tile orientation and the walk over the tiles block sparsity keeps
//! (the math of a step is in `step`).

use super::mask_columns::ColumnMask;
use super::orientation::Rows;
use crate::abi::{ArgKind, KernelArg};
use crate::cuda::kit::expr::{c_expr, c_expr_in, load_offset};
use crate::cuda::kit::hoist::{lookup_equal_indexed, lookup_indexed, Hoisted, Level};
use crate::cuda::kit::logit::{kept, ScoredLogit};
use crate::cuda::kit::terms::{stage_pointer_decl, write_tile_terms, KeyTerms};
use crate::cuda::kit::tile_class::tile_class_expr;
use crate::cuda::kit::tile_walk::{write_block_class, write_next_tile};
use crate::cuda::library::Part;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::c_type;
use crate::cuda::source::{assemble, Entry, Piece};
use crate::cuda::target::pad16;
use crate::cuda::writer::Writer;
use crate::grad::{d_load, d_score, load_indices};
use crate::spec::{Builtin, Dtype, Expr, ExprKind, Spec};
use std::fmt::{self, Write};

/// Which library sections a kernel needs.
pub(super) enum Sections {
    /// Scalars and `warp_sum` (the row kernels).
    Rows,
    /// Everything: tile classes, tensor-core tiles, backward helpers.
    Tiles,
    /// Those and the given Hopper sections (warpgroup MMA, the stage ring,
    /// TMA copies), for a kernel of `CTA_THREADS` threads (`dkdv_wgmma`)
    /// whose products span `padded` columns of Q/K and V (`DP`, `DVP`).
    Hopper { library: Vec<Vec<Piece>>, padded: [u32; 2] },
}

/// A kernel's kind in its name (`bwd`, `bwd_dq`), marked where it drops
/// out P.
pub(super) fn dropout_kind(kind: &str, dropout: bool) -> String {
    match dropout {
        true => format!("{kind}_dropout"),
        false => kind.to_string(),
    }
}

/// Header, library sections, the configuration `config` writes, and the
/// entry point around `body`.
pub(super) fn write_source(
    spec: &Spec,
    sections: Sections,
    name: &str,
    args: &[KernelArg],
    config: impl FnOnce(&mut Writer<String>) -> fmt::Result,
    body: impl FnOnce(&mut Writer<String>) -> fmt::Result,
) -> String {
    let tiles = !matches!(sections, Sections::Rows);
    let (dp, dvp) = (pad16(spec.head_dims.qk), pad16(spec.head_dims.v));
    let padded = match sections {
        Sections::Hopper { padded, .. } => padded,
        _ => [dp, dvp],
    };
    let mut library = vec![vec![Piece::Part(Part::Prelude)]];
    if tiles {
        library.extend([vec![Piece::Part(Part::Ranges)], vec![Piece::Part(Part::Tiles)]]);
    }
    let bounds = match sections {
        // One CTA per SM fixes the register count at entry: without it
        // ptxas may ignore `setmaxnreg` and serialize every wgmma.
        Sections::Hopper { library: hopper, .. } => {
            library.extend(hopper);
            "CTA_THREADS, 1"
        }
        _ => "THREADS",
    };
    // A kernel that takes prefix sums reads its sequences' spans, and its
    // TMA descriptors are ragged.
    if args.iter().any(|arg| matches!(arg.kind, ArgKind::CuSeqlens(_))) {
        library.push(vec![Piece::Part(Part::Varlen)]);
        if args.iter().any(|arg| matches!(arg.kind, ArgKind::TensorMap(_))) {
            library.push(vec![Piece::Part(Part::TmaRagged)]);
        }
    }
    if args.iter().any(|arg| matches!(arg.kind, ArgKind::Dropout(_))) {
        library.push(vec![Piece::Part(Part::Dropout)]);
    }
    let helpers = [Part::BackwardRows, Part::BackwardTiles];
    library.push(helpers[..1 + tiles as usize].iter().map(|&part| Piece::Part(part)).collect());
    let config = |w: &mut Writer<String>| {
        writeln!(w, "// ---- kernel configuration ---------------------------------------------------")?;
        write_dims(w, spec, padded)?;
        config(w)?;
        writeln!(w)
    };
    assemble(spec, &library, config, Entry { name, bounds, args }, body)
}

/// `D`, `DV` and the `padded` widths the kernel's products span (`DP`,
/// `DVP`; zeros beyond the head dims).
fn write_dims(w: &mut Writer<String>, spec: &Spec, [dp, dvp]: [u32; 2]) -> fmt::Result {
    let storage = match spec.dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    let (d, dv) = (spec.head_dims.qk, spec.head_dims.v);
    writeln!(w, "using storage = {storage};  // element format of Q, K, V, O and their gradients")?;
    writeln!(w, "// The head dims every backward kernel declares (inline: not each reads all).")?;
    writeln!(w, "inline constexpr int D = {d};  // Q/K head dim")?;
    writeln!(w, "inline constexpr int DV = {dv};  // V/O head dim")?;
    match dp == pad16(d) && dvp == pad16(dv) {
        true => {
            writeln!(w, "inline constexpr int DP = {dp};  // D padded to the MMA k-step (zeros beyond D)")?;
            writeln!(w, "inline constexpr int DVP = {dvp};  // DV padded to pairs of 8-wide MMA tiles")
        }
        false => writeln!(
            w,
            "inline constexpr int DP = {dp}, DVP = {dvp};  // D and DV padded to whole panels (zeros beyond)"
        ),
    }
}

/// The spec's expressions the backward evaluates: mask, score, ∂score′/∂score
/// and, per trainable tensor, ∂score′/∂t and the read's indices.
pub(super) struct SpecTerms {
    /// ∂score′/∂score; `None` where it is 1 (no score mod, or one that only
    /// adds terms).
    pub d_score: Option<Expr>,
    /// (slot, ∂score′/∂t, indices of the read).
    pub grads: Vec<(usize, Expr, Vec<Expr>)>,
    /// Whether P is dropped out (`BackwardConfig::dropout`).
    pub dropout: bool,
    /// Where threads of two warpgroups compute the same elements, the
    /// condition only one of them meets: it alone adds tensor gradients.
    pub owner: Option<&'static str>,
}

impl SpecTerms {
    /// `with_grads`: also the tensor-gradient terms; `dropout`: P dropped out.
    pub fn new(spec: &Spec, with_grads: bool, dropout: bool) -> SpecTerms {
        let grads = if with_grads {
            super::trainable_tensors(spec)
                .into_iter()
                .filter_map(|i| Some((i, d_load(spec, i)?, load_indices(spec, i)?)))
                .collect()
        } else {
            Vec::new()
        };
        // A score mod that only adds terms has ∂score′/∂score = 1: dS = dS′.
        let d_score = d_score(spec).filter(|d| !matches!(d.kind, ExprKind::Float(x) if x == 1.0));
        SpecTerms { d_score, grads, dropout, owner: None }
    }

    /// `cond && ` where [`Self::owner`] names a condition, else nothing.
    pub fn owner_clause(&self) -> String {
        self.owner.map_or(String::new(), |owner| format!("{owner} && "))
    }

    /// Every expression hoisting may draw from.
    pub fn exprs<'a>(&'a self, spec: &'a Spec) -> Vec<&'a Expr> {
        let mut all: Vec<&Expr> = spec.mask.iter().chain(spec.score.iter()).chain(self.d_score.iter()).collect();
        for (_, d, indices) in &self.grads {
            all.push(d);
            all.extend(indices);
        }
        all
    }
}

/// `e`'s hoisted value in the element loop of orientation `rows`.
fn lookup(hoisted: &[Hoisted], rows: Rows, e: &Expr) -> Option<String> {
    lookup_indexed(hoisted, e, slot_index(rows))
}

/// The index of a hoisted value of each level in the element loop of
/// orientation `rows`.
fn slot_index(rows: Rows) -> impl Fn(Level) -> &'static str {
    move |level| match level {
        Level::Cta => "",
        level if level == rows.row_level() => "[i]",
        _ => "[n][c]",
    }
}

/// Hoisted terms that vary per (batch, head) at most, and per row of the
/// warp's tiles (rows from `first_row`), computed once here (`None`: only
/// declared, for rows that change per step: [`write_row_refill`]); the
/// arrays of the per-column ones, which [`write_column_terms`] fills per
/// tile, or where `columns` are staged the pointers that each tile points
/// at its slot.
pub(super) fn write_row_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    (rows, columns): (Rows, KeyTerms),
    first_row: Option<&str>,
) -> fmt::Result {
    if hoisted.is_empty() {
        return Ok(());
    }
    writeln!(w, "// Spec terms that vary per head or per row of this warp, computed once here.")?;
    for h in hoisted {
        let ty = c_type(h.expr.ty);
        if h.level == Level::Cta {
            writeln!(w, "const {ty} {} = {};", h.name, c_expr(spec, h.expr))?;
        } else if h.level == rows.row_level() {
            writeln!(w, "{ty} {}[2];", h.name)?;
            if let Some(first_row) = first_row {
                write_row_fill(w, spec, h, rows, first_row)?;
            }
        } else if columns == KeyTerms::Staged {
            writeln!(w, "{}  // this lane's columns of a step's slot", stage_pointer_decl(h))?;
        } else {
            // Zeroed: NVRTC's front end cannot see a tile fill it before a logit reads it.
            writeln!(w, "{ty} {}[S_TILES][2] = {{}};  // filled per tile", h.name)?;
        }
    }
    Ok(())
}

/// Fills the per-row hoisted terms [`write_row_terms`] declared, for the
/// rows from `first_row` (a step's queries, where they change per step).
pub(super) fn write_row_refill(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    rows: Rows,
    first_row: &str,
) -> fmt::Result {
    hoisted.iter().filter(|h| h.level == rows.row_level()).try_for_each(|h| write_row_fill(w, spec, h, rows, first_row))
}

fn write_row_fill(w: &mut Writer<String>, spec: &Spec, h: &Hoisted, rows: Rows, first_row: &str) -> fmt::Result {
    let (row_var, _) = rows.vars();
    writeln!(w, "#pragma unroll")?;
    w.block(format_args!("for (int i = 0; i < 2; ++i)"), |w| {
        writeln!(w, "const int {row_var} = {first_row} + g + 8 * i;")?;
        writeln!(w, "{}[i] = {};", h.name, c_expr(spec, h.expr))
    })
}

/// Fills the hoisted terms that vary per column, for the tile whose first
/// column is `first_col`; those of the mask alone only where the tile is not
/// `interior` (which the caller defines, see [`interior_decl`](crate::cuda::kit::terms::interior_decl)).
pub(super) fn write_column_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    rows: Rows,
    first_col: &str,
) -> fmt::Result {
    let (_, col_var) = rows.vars();
    write_tile_terms(w, spec, hoisted, rows.column_level(), col_var, first_col, KeyTerms::PerThread)
}

/// The spec as lambdas of one element (dot product at (q, k), row slot i,
/// column slot (n, c)): `logit`, the forward's log2-domain logit or −∞;
/// `logit_whole`, the same on `interior` tiles;
/// `d_score`, ∂score′/∂score at the scaled score; per trainable tensor `t`,
/// `d_t` (∂score′/∂t) and `at_t` (the element offset its read hits).
pub(super) fn write_spec_lambdas(
    w: &mut Writer<String>,
    spec: &Spec,
    terms: &SpecTerms,
    hoisted: &[Hoisted],
    rows: Rows,
) -> fmt::Result {
    let c = |e: &Expr| c_expr_in(spec, e, &|x| lookup(hoisted, rows, x));
    let (scale, kv_len) = (arg_name(spec, ArgKind::Scale), arg_name(spec, ArgKind::KvLen));
    let mask = spec.mask.as_ref().map(|e| format!(" && ({})", c(e))).unwrap_or_default();
    let slots = "int q, int k, int i, int n, int c";
    writeln!(w, "// The spec on one element, as the forward evaluates it: the log2-domain logit,")?;
    writeln!(w, "// or -inf where the mask drops the pair or k is past the end.")?;
    // The column test reads a rewritten copy of the mask: its hoisted terms by value.
    let c_copy = |e: &Expr| c_expr_in(spec, e, &|x| lookup_equal_indexed(hoisted, x, slot_index(rows)));
    let column_mask = ColumnMask::of(spec, rows, c_copy);
    let (binding, log2) = match ScoredLogit::of(spec, &scale, c) {
        None => {
            writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
            (None, "dot * scale_log2".to_string())
        }
        Some(ScoredLogit { binding, log2 }) => (Some(binding), log2),
    };
    writeln!(w, "auto logit = [&](float dot, {slots}) -> float {{")?;
    w.indented(|w| {
        let lines = column_mask.iter().flat_map(|m| m.lines());
        lines.chain(&binding).try_for_each(|line| writeln!(w, "{line}"))?;
        match &column_mask {
            Some(m) => writeln!(w, "return {};", m.keep(&log2)),
            None => {
                writeln!(w, "const bool keep = {};", kept(&kv_len, &mask))?;
                writeln!(w, "return kept_or_neg_inf(keep, {log2});")
            }
        }
    })?;
    w.write_str("};\n")?;
    write_whole_logit(w, spec, hoisted, rows)?;
    if let Some(d) = &terms.d_score {
        writeln!(w, "// d score' / d score at the scaled score (symbolic, from the spec).")?;
        writeln!(w, "auto d_score = [&](float score, {slots}) -> float {{ return {}; }};", c(d))?;
    }
    for (slot, d, indices) in &terms.grads {
        let t = &spec.tensors[*slot].name;
        writeln!(w, "// Tensor `{t}`: d score' / d {t}[at_{t}(..)] at the scaled score.")?;
        writeln!(w, "auto d_{t} = [&](float score, {slots}) -> float {{ return {}; }};", c(d))?;
        let offset = load_offset(spec, *slot, indices, &|x| lookup(hoisted, rows, x));
        writeln!(w, "auto at_{t} = [&]({slots}) -> long long {{ return {offset}; }};")?;
    }
    Ok(())
}

/// `logit_whole`: the `logit` of [`write_spec_lambdas`] (which it follows)
/// for a pair the mask keeps and whose key exists, without testing either.
fn write_whole_logit(w: &mut Writer<String>, spec: &Spec, hoisted: &[Hoisted], rows: Rows) -> fmt::Result {
    let slots = "int q, int k, int i, int n, int c";
    writeln!(w, "// The logit of a pair the mask keeps and whose key exists.")?;
    let scale = arg_name(spec, ArgKind::Scale);
    match ScoredLogit::of(spec, &scale, |e| c_expr_in(spec, e, &|x| lookup(hoisted, rows, x))) {
        None => writeln!(w, "auto logit_whole = [&](float dot, {slots}) -> float {{ return dot * scale_log2; }};"),
        Some(ScoredLogit { binding, log2 }) => {
            writeln!(w, "auto logit_whole = [&](float dot, {slots}) -> float {{")?;
            w.indented(|w| {
                writeln!(w, "{binding}")?;
                writeln!(w, "return {log2};")
            })?;
            w.write_str("};\n")
        }
    }
}

/// Whether tensor gradient `indices` hit one element per (batch, head):
/// then a thread sums its terms in a register and a warp adds them once.
pub(super) fn per_head(indices: &[Expr]) -> bool {
    !indices.iter().any(|e| e.uses(Builtin::Q) || e.uses(Builtin::K))
}

/// The walk over the tiles of one axis that block sparsity keeps:
/// `next_tile(j)` is the first tile from `j` on that keeps a pair and
/// `tile_full(j)` says the mask keeps every pair of tile `j`, by interval
/// analysis over the fixed range of the other axis (locals `q_lo`/`q_hi` or
/// `k_lo`/`k_hi`, which the caller defines) and, given one, a block mask.
pub(super) struct Walk<'a> {
    /// `q` or `k`: the axis whose tiles are walked.
    pub axis: &'a str,
    /// Tile count, tile size and sequence length of that axis, as C.
    pub tiles: &'a str,
    pub size: &'a str,
    pub len: &'a str,
}

pub(super) fn write_tile_walk(w: &mut Writer<String>, spec: &Spec, walk: &Walk) -> fmt::Result {
    let Some(class) = tile_class_expr(spec) else {
        writeln!(w, "// No mask: every tile is visited and kept whole.")?;
        writeln!(w, "auto next_tile = [](int j) {{ return j; }};")?;
        return writeln!(w, "auto tile_full = [](int) {{ return true; }};");
    };
    let Walk { axis, tiles, size, len } = walk;
    let kv_len = arg_name(spec, ArgKind::KvLen);
    let (q_range, k_range) = if *axis == "q" {
        ("j * {size}, min_i32((j + 1) * {size}, {len}) - 1", "k_lo, k_hi")
    } else {
        ("q_lo, q_hi", "j * {size}, min_i32((j + 1) * {size}, {len}) - 1")
    };
    let tile_range = |r: &str| r.replace("{size}", size).replace("{len}", len);
    write!(
        w,
        "\
        // Tile classes: the mask over tiles [j0, j1) of {axis} x the fixed range of the\n\
        // other axis, in interval arithmetic (lo = 1: keeps every pair; hi = 0: none).\n\
        auto span_class = [&](int j0, int j1) -> Range {{\n\
        \x20   [[maybe_unused]] const int {axis}_lo = j0 * {size};  // a class may not read every bound\n\
        \x20   [[maybe_unused]] const int {axis}_hi = (int)(j1 * (long long){size} < {len} ? j1 * (long long){size} : {len}) - 1;\n\
        \x20   return {class};\n\
        }};\n\
        // A block mask (built for data-dependent masks) refines them: 0 = no\n\
        // pair kept, 2 = every pair kept.\n"
    )?;
    write_block_class(w, "mask_class", &kv_len, &tile_range(q_range), &tile_range(k_range))?;
    writeln!(w, "// The next tile from j on that keeps a pair; runs of tiles the analysis")?;
    writeln!(w, "// rules out are skipped by binary search.")?;
    let data_dependent = spec.mask.as_ref().is_some_and(|m| m.reads_tensor());
    write_next_tile(w, tiles, "mask_class(j) == 0", data_dependent)?;
    writeln!(w, "auto tile_full = [&](int j) {{ return span_class(j, j + 1).lo == 1 || mask_class(j) == 2; }};")
}
