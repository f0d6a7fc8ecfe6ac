//! What the backward kernels share: the source frame, the spec as lambdas
//! (logit, ∂score′/∂score, tensor-gradient terms), hoisted spec terms in
//! either tile orientation and the walk over the tiles block sparsity keeps
//! (the math of a step is in `step`).

use crate::abi::{ArgKind, KernelArg};
use crate::cuda::kit::expr::{c_expr, c_expr_in, load_offset};
use crate::cuda::kit::hoist::{lookup_indexed, Hoisted, Level};
use crate::cuda::kit::terms::{write_tile_terms, KeyTerms};
use crate::cuda::kit::tile_class::tile_class_expr;
use crate::cuda::kit::tile_walk::{write_block_class, write_next_tile};
use crate::cuda::prelude::PRELUDE;
use crate::cuda::ranges::RANGES;
use crate::cuda::signature::arg_name;
use crate::cuda::signature::c_type;
use crate::cuda::source::{write_entry, write_header};
use crate::cuda::target::pad16;
use crate::cuda::tiles::TILES;
use crate::cuda::tma::TileCopy;
use crate::cuda::writer::Writer;
use crate::grad::{d_load, d_score, load_indices};
use crate::spec::{Builtin, Dtype, Expr, ExprKind, Spec};
use std::fmt::{self, Write};

/// Device helpers every backward kernel may use.
const BACKWARD_ROWS: &str = r#"// ---- backward helpers -----------------------------------------------------------
// Sum across the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
    #pragma unroll
    for (int m = 16; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}
"#;

/// Device helpers of the tiled backward kernels.
const BACKWARD_TILES: &str = r#"// A warp's 16 rows of an f32 accumulator (TILES m16n8 tiles) times
// `factor`, rows first..first + 15 of the 16-bit `rows` (`len` of them exist,
// `cols` columns), out to global memory through `stage`: this warp's 16 rows
// of a free shared tile 8 * TILES columns wide. The column pairs land with
// each row's 16-byte chunks XORed with the row (a warp's pair stores then
// hit all 32 banks where TILES is a multiple of 8); the rows leave 16 bytes
// per lane where they are 16-byte aligned and the chunk holds only columns
// below `cols`, else element by element.
template <class S, int TILES>
__device__ __forceinline__ void store_warp_rows(S, unsigned short* stage, const float (&acc)[TILES][4], float factor,
                                                unsigned short* rows, long long stride, int first, int len, int cols) {
    constexpr int PERIOD = TILES % 8 == 0 ? 8 : TILES % 4 == 0 ? 4 : TILES % 2 == 0 ? 2 : 1;
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    unsigned char* bytes = reinterpret_cast<unsigned char*>(stage);
    #pragma unroll
    for (int n = 0; n < TILES; ++n) {
        #pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = g + 8 * i;
            const unsigned pair = (unsigned)S::from_f32(acc[n][2 * i] * factor) | (unsigned)S::from_f32(acc[n][2 * i + 1] * factor) << 16;
            *reinterpret_cast<unsigned*>(bytes + row * 16 * TILES + (n ^ row % PERIOD) * 16 + 4 * t) = pair;
        }
    }
    __syncwarp();
    unsigned short* out = rows + first * stride;
    const int count = min_i32(16, len - first);
    const bool vector = aligned16(rows, stride);
    #pragma unroll
    for (int c = lane; c < 16 * TILES; c += 32) {
        const int row = c / TILES, chunk = c % TILES;
        if (row >= count) break;
        const unsigned char* from = bytes + row * 16 * TILES + (chunk ^ row % PERIOD) * 16;
        unsigned short* to = out + row * stride + chunk * 8;
        if (vector && chunk * 8 + 8 <= cols) {
            *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
        } else {
            for (int e = 0; e < 8 && chunk * 8 + e < cols; ++e) to[e] = reinterpret_cast<const unsigned short*>(from)[e];
        }
    }
}
// Byte offset of a lane's ldmatrix row (see LdmLane) for a (row_step, step)
// known only at run time: the swizzle computed in full.
template <int COLS>
__device__ __forceinline__ unsigned ldm_at(const LdmLane<COLS>& lane, int row_step, int step) {
    return 2 * swizzle<COLS>(lane.row + row_step, 16 * step + 8 * lane.half);
}
// dst[0..4) += (a, b, c, d): one 16-byte f32 reduction on sm_90 (dst 16-byte
// aligned), four scalar atomics before it.
__device__ __forceinline__ void red_add4(float* dst, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    atomicAdd(dst, a);
    atomicAdd(dst + 1, b);
    atomicAdd(dst + 2, c);
    atomicAdd(dst + 3, d);
#endif
}
// Adds a warp's m16n8 f32 accumulator tile to rows [row0, row0 + 16) x
// columns [col0, col0 + 8) of a row-major f32 matrix of `rows` x COLS (rows
// and columns past the end are dropped). Lanes t and t ^ 1 swap half their
// elements, so that each lane holds four consecutive columns of one row
// (row g for even t, g + 8 for odd): one red_add4 per lane, not four atomics.
template <int COLS>
__device__ __forceinline__ void red_add_tile(float* m, int rows, int row0, int col0, const float (&acc)[4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    if constexpr (COLS % 4 == 0) {
        const bool odd = t % 2 == 1;
        const float x0 = __shfl_xor_sync(0xffffffffu, odd ? acc[0] : acc[2], 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, odd ? acc[1] : acc[3], 1);
        const int row = row0 + g + (odd ? 8 : 0), col = col0 + 2 * (t & ~1);
        const float v0 = odd ? x0 : acc[0], v1 = odd ? x1 : acc[1];
        const float v2 = odd ? acc[2] : x0, v3 = odd ? acc[3] : x1;
        if (row < rows && col < COLS) red_add4(m + (long long)row * COLS + col, v0, v1, v2, v3);
    } else {
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int row = row0 + g + 8 * (e / 2), col = col0 + 2 * t + e % 2;
            if (row < rows && col < COLS) atomicAdd(&m[(long long)row * COLS + col], acc[e]);
        }
    }
}
"#;

/// Which prelude sections a kernel needs.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sections {
    /// Scalars and `warp_sum` (the row kernels).
    Rows,
    /// Everything: tile classes, tensor-core tiles, backward helpers.
    Tiles,
    /// Those, Hopper's warpgroup MMA and the stage ring (and the TMA
    /// copies, if it copies with them), for a kernel of `CTA_THREADS`
    /// threads (`dkdv_wgmma`).
    Hopper(TileCopy),
}

/// Header, prelude sections, the configuration `config` writes, and the
/// entry point around `body`.
pub(super) fn write_source(
    spec: &Spec,
    sections: Sections,
    name: &str,
    args: &[KernelArg],
    config: impl FnOnce(&mut Writer<String>) -> fmt::Result,
    body: impl FnOnce(&mut Writer<String>) -> fmt::Result,
) -> String {
    let mut w = Writer::new(String::new());
    let emit = || -> fmt::Result {
        write_header(&mut w, spec)?;
        w.write_str(PRELUDE)?;
        writeln!(w)?;
        let tiles = sections != Sections::Rows;
        if tiles {
            w.write_str(RANGES)?;
            writeln!(w)?;
            w.write_str(TILES)?;
            writeln!(w)?;
        }
        if let Sections::Hopper(copy) = sections {
            super::dkdv_wgmma::write_prelude(&mut w, spec, copy)?;
        }
        w.write_str(BACKWARD_ROWS)?;
        if tiles {
            w.write_str(BACKWARD_TILES)?;
        }
        writeln!(w)?;
        writeln!(w, "// ---- kernel configuration ---------------------------------------------------")?;
        write_dims(&mut w, spec)?;
        config(&mut w)?;
        writeln!(w)?;
        let threads = if matches!(sections, Sections::Hopper(_)) { "CTA_THREADS" } else { "THREADS" };
        write_entry(&mut w, spec, (name, threads), args, body)
    };
    emit().expect("formatting into a String cannot fail");
    w.into_inner()
}

fn write_dims(w: &mut Writer<String>, spec: &Spec) -> fmt::Result {
    let storage = match spec.dtype {
        Dtype::F16 => "f16",
        Dtype::Bf16 => "bf16",
    };
    let (d, dv) = (spec.head_dims.qk, spec.head_dims.v);
    writeln!(w, "using storage = {storage};  // element format of Q, K, V, O and their gradients")?;
    writeln!(w, "constexpr int D = {d};  // Q/K head dim")?;
    writeln!(w, "constexpr int DV = {dv};  // V/O head dim")?;
    writeln!(w, "constexpr int DP = {};  // D padded to the MMA k-step (zeros beyond D)", pad16(d))?;
    writeln!(w, "constexpr int DVP = {};  // DV padded to pairs of 8-wide MMA tiles", pad16(dv))
}

/// Which built-in the rows of a warp's accumulator tiles run over. Lane
/// slot `i` (0, 1: rows g and g + 8) indexes row-level terms, `(n, c)`
/// (8-wide tile n, column 2t + c) column-level ones.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Rows {
    /// Sᵀ: keys are rows, queries columns (the dK/dV kernel).
    Keys,
    /// S: queries are rows, keys columns (the dQ kernel, like the forward).
    Queries,
}

impl Rows {
    /// The hoisting level of terms that vary per row.
    fn row_level(self) -> Level {
        match self {
            Rows::Keys => Level::Column,
            Rows::Queries => Level::Row,
        }
    }

    /// The hoisting level of terms that vary per column: the other one.
    pub(super) fn column_level(self) -> Level {
        match self {
            Rows::Keys => Level::Row,
            Rows::Queries => Level::Column,
        }
    }

    /// The built-ins of the rows and of the columns: `("k", "q")` or `("q", "k")`.
    pub(super) fn vars(self) -> (&'static str, &'static str) {
        match self {
            Rows::Keys => ("k", "q"),
            Rows::Queries => ("q", "k"),
        }
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
}

impl SpecTerms {
    /// `with_grads`: also the tensor-gradient terms.
    pub fn new(spec: &Spec, with_grads: bool) -> SpecTerms {
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
        SpecTerms { d_score, grads }
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
    lookup_indexed(hoisted, e, |level| match level {
        Level::Cta => "",
        level if level == rows.row_level() => "[i]",
        _ => "[n][c]",
    })
}

/// Hoisted terms that vary per (batch, head) at most, and per row of the
/// warp's tiles (rows from `first_row`), computed once here; the arrays of
/// the per-column ones, which [`write_column_terms`] fills per tile.
pub(super) fn write_row_terms(
    w: &mut Writer<String>,
    spec: &Spec,
    hoisted: &[Hoisted],
    rows: Rows,
    first_row: &str,
) -> fmt::Result {
    if hoisted.is_empty() {
        return Ok(());
    }
    writeln!(w, "// Spec terms that vary per head or per row of this warp, computed once here.")?;
    let (row_var, _) = rows.vars();
    for h in hoisted {
        let (ty, value) = (c_type(h.expr.ty), c_expr(spec, h.expr));
        if h.level == Level::Cta {
            writeln!(w, "const {ty} {} = {value};", h.name)?;
        } else if h.level == rows.row_level() {
            writeln!(w, "{ty} {}[2];", h.name)?;
            writeln!(w, "#pragma unroll")?;
            w.block(format_args!("for (int i = 0; i < 2; ++i)"), |w| {
                writeln!(w, "const int {row_var} = {first_row} + g + 8 * i;")?;
                writeln!(w, "{}[i] = {value};", h.name)
            })?;
        } else {
            writeln!(w, "{ty} {}[S_TILES][2];  // filled per tile", h.name)?;
        }
    }
    Ok(())
}

/// Fills the hoisted terms that vary per column, for the tile whose first
/// column is `first_col`; those of the mask alone only where the tile is not
/// `interior` (which the caller defines, see [`forward::interior_decl`]).
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
    match &spec.score {
        None => {
            writeln!(w, "const float scale_log2 = {scale} * LOG2E;")?;
            writeln!(w, "auto logit = [&](float dot, {slots}) -> float {{")?;
            w.indented(|w| {
                writeln!(w, "const bool keep = k < {kv_len}{mask};")?;
                writeln!(w, "return kept_or_neg_inf(keep, dot * scale_log2);")
            })?;
        }
        Some(e) => {
            writeln!(w, "auto logit = [&](float dot, {slots}) -> float {{")?;
            w.indented(|w| {
                writeln!(w, "const float score = dot * {scale};")?;
                writeln!(w, "const bool keep = k < {kv_len}{mask};")?;
                writeln!(w, "return kept_or_neg_inf(keep, {} * LOG2E);", c(e))
            })?;
        }
    }
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
    match &spec.score {
        None => writeln!(w, "auto logit_whole = [&](float dot, {slots}) -> float {{ return dot * scale_log2; }};"),
        Some(e) => {
            let scale = arg_name(spec, ArgKind::Scale);
            let score = c_expr_in(spec, e, &|x| lookup(hoisted, rows, x));
            writeln!(w, "auto logit_whole = [&](float dot, {slots}) -> float {{")?;
            w.indented(|w| {
                writeln!(w, "const float score = dot * {scale};")?;
                writeln!(w, "return {score} * LOG2E;")
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
        \x20   const int {axis}_lo = j0 * {size};\n\
        \x20   const int {axis}_hi = (int)(j1 * (long long){size} < {len} ? j1 * (long long){size} : {len}) - 1;\n\
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
