//! Tensor indices that may leave their dimension. Kernels and reference clamp
//! every index into range, so no spec reads out of bounds, but a clamped read
//! is silent: `doc[b][q]` with `doc: i32[B, KV_LEN]` reads the last id for
//! every query past `kv_len`. [`index_warnings`] finds such reads with the
//! interval analysis ([`crate::analysis::int_range`]) over whole launches of
//! a fixed set of probe shapes; `flashgen check` prints them.
//!
//! The analysis over-approximates (it ignores the mask that guards a score,
//! the branch an `if` takes, params' values), so a warning says an index
//! *may* leave its dimension; no warning means it stays inside for every
//! probe shape.

use crate::analysis::{int_range, Region};
use crate::spec::{Dim, Expr, ExprKind, Shape, Spec};
use crate::syntax::expr_source;
use std::fmt;

/// One index of one tensor read that may leave its dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexWarning {
    /// The read as written, e.g. `doc[b][q]`.
    pub read: String,
    /// Which index of the read, from 1.
    pub position: usize,
    pub index: String,
    /// The dimension as declared, e.g. `KV_LEN`.
    pub dim: String,
    pub problem: IndexProblem,
}

/// How an index may leave its dimension.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexProblem {
    /// Past the last element (`size − 1`) at `shape`.
    Above { reaches: i64, size: i64, shape: Shape },
    /// Below 0 at `shape`.
    Below { reaches: i64, shape: Shape },
    /// No bound could be proven: the index reads a param, a tensor or a
    /// float, or may wrap.
    Unbounded,
}

impl fmt::Display for IndexWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let IndexWarning { read, position, index, dim, problem } = self;
        write!(f, "`{read}`: index {position} `{index}` ")?;
        // A constant dimension is its own size; a symbol's is the probe's.
        let constant = dim.parse::<u32>().is_ok();
        match problem {
            IndexProblem::Above { reaches, size, shape } if constant => {
                write!(f, "can reach {reaches}, past dimension {size}, at {}", ShapeText(shape))?
            }
            IndexProblem::Above { reaches, size, shape } => {
                write!(f, "can reach {reaches}, past dimension `{dim}` = {size}, at {}", ShapeText(shape))?
            }
            IndexProblem::Below { reaches, shape } => write!(f, "can be {reaches}, below 0, at {}", ShapeText(shape))?,
            IndexProblem::Unbounded => {
                let dim = if constant { dim.clone() } else { format!("`{dim}`") };
                write!(
                    f,
                    "has no bound the analysis can prove against dimension {dim} (it reads a param, a tensor or a \
                     float, or may wrap)"
                )?
            }
        }
        f.write_str("; out-of-range indices read the nearest element")
    }
}

struct ShapeText<'a>(&'a Shape);

impl fmt::Display for ShapeText<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Shape { batch, heads, heads_kv, q_len, kv_len } = self.0;
        write!(f, "B = {batch}, H = {heads}, H_KV = {heads_kv}, Q_LEN = {q_len}, KV_LEN = {kv_len}")
    }
}

/// The launch shapes indices are checked at, most telling first (a warning
/// names the first that shows it): equal and unequal lengths either way,
/// one query or key, long sequences; one and several heads, GQA and MQA.
fn probe_shapes() -> impl Iterator<Item = Shape> {
    const LENGTHS: [(usize, usize); 8] =
        [(1024, 1024), (1024, 512), (512, 1024), (1, 4096), (4096, 1), (3, 100_000), (100_000, 3), (1 << 20, 1 << 20)];
    const HEADS: [(usize, usize); 4] = [(1, 1), (8, 8), (8, 2), (8, 1)];
    LENGTHS.into_iter().flat_map(|(q_len, kv_len)| {
        HEADS
            .into_iter()
            .flat_map(move |(heads, heads_kv)| [1, 4].map(|batch| Shape { batch, heads, heads_kv, q_len, kv_len }))
    })
}

/// Every index of a tensor read in `spec`'s mask, score or sink that may
/// leave its dimension at some probe shape, each read once, in the order
/// written.
pub fn index_warnings(spec: &Spec) -> Vec<IndexWarning> {
    let mut reads: Vec<(Expr, String)> = Vec::new();
    for e in spec.mask.iter().chain(&spec.score).chain(&spec.sink) {
        e.walk(&mut |n| {
            if matches!(n.kind, ExprKind::Load(..)) {
                let text = expr_source(spec, n);
                if !reads.iter().any(|(_, t)| *t == text) {
                    reads.push((n.clone(), text));
                }
            }
        });
    }
    let mut warnings = Vec::new();
    for (read, text) in reads {
        let ExprKind::Load(slot, indices) = &read.kind else { continue };
        let tensor = &spec.tensors[*slot];
        for (i, (index, dim)) in indices.iter().zip(&tensor.dims).enumerate() {
            if let Some(problem) = problem(index, dim, |shape| tensor.check_dims(shape).is_ok()) {
                let index = expr_source(spec, index);
                warnings.push(IndexWarning {
                    read: text.clone(),
                    position: i + 1,
                    index,
                    dim: dim.to_string(),
                    problem,
                });
            }
        }
    }
    warnings
}

/// The first way `index` leaves `dim` over the probe shapes that `legal`
/// admits (a dimension expression is not legal everywhere).
fn problem(index: &Expr, dim: &Dim, legal: impl Fn(&Shape) -> bool) -> Option<IndexProblem> {
    let int = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    for shape in probe_shapes().filter(|s| legal(s)) {
        let last = |n: usize| (0, int(n) - 1);
        let region = Region { b: last(shape.batch), h: last(shape.heads), q: last(shape.q_len), k: last(shape.kv_len) };
        let (lo, hi) = int_range(index, &shape, region);
        if lo <= i64::from(i32::MIN) || hi >= i64::from(i32::MAX) {
            return Some(IndexProblem::Unbounded);
        }
        let size = dim.value(&shape).unwrap_or(i64::MAX);
        if hi >= size {
            return Some(IndexProblem::Above { reaches: hi, size, shape });
        }
        if lo < 0 {
            return Some(IndexProblem::Below { reaches: lo, shape });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_one;

    fn warnings(fields: &str) -> Vec<String> {
        let spec = parse_one(&format!("S {{ dtype: bf16, head_dim: 64, {fields} }}")).unwrap();
        index_warnings(&spec).iter().map(|w| w.to_string()).collect()
    }

    #[test]
    fn a_query_index_into_a_key_dimension_warns() {
        assert_eq!(
            warnings("tensor doc: i32[B, KV_LEN], mask: doc[b][q] == doc[b][k] && q >= k"),
            ["`doc[b][q]`: index 2 `q` can reach 1023, past dimension `KV_LEN` = 512, at B = 1, H = 1, H_KV = 1, \
              Q_LEN = 1024, KV_LEN = 512; out-of-range indices read the nearest element"]
        );
    }

    #[test]
    fn indices_inside_their_dimensions_do_not() {
        for fields in [
            "tensor slopes: f32[H], score: score + slopes[h] * (k - q) as f32",
            "tensor rel: f32[H, 257], score: score + rel[h][clamp(k - q, -128, 128) + 128]",
            "tensor rel: f32[H, Q_LEN + KV_LEN - 1], score: score + rel[h][k - q + q_len - 1]",
            "tensor packed: i32[B, (Q_LEN + 63) / 64], mask: packed[b][q >> 6] & 1 == 1",
            "param w: i32, tensor t: f32[16], score: score + t[clamp(k - w, 0, 15)] + t[rem_euclid(q, 16)]",
        ] {
            assert_eq!(warnings(fields), Vec::<String>::new(), "{fields}");
        }
    }

    #[test]
    fn every_kind_of_problem() {
        assert_eq!(
            warnings("tensor rel: f32[H, KV_LEN], score: score + rel[h][k - q]"),
            ["`rel[h][k - q]`: index 2 `k - q` can be -1023, below 0, at B = 1, H = 1, H_KV = 1, Q_LEN = 1024, \
              KV_LEN = 1024; out-of-range indices read the nearest element"]
        );
        assert_eq!(
            warnings("tensor t: f32[H_KV], tensor u: f32[16], param w: i32, score: score + t[h] + u[k + w] + u[k + w]"),
            [
                "`t[h]`: index 1 `h` can reach 7, past dimension `H_KV` = 2, at B = 1, H = 8, H_KV = 2, Q_LEN = 1024, \
                 KV_LEN = 1024; out-of-range indices read the nearest element",
                "`u[k + w]`: index 1 `k + w` has no bound the analysis can prove against dimension 16 (it reads a \
                 param, a tensor or a float, or may wrap); out-of-range indices read the nearest element",
            ]
        );
        // A layout of 16 × 16 blocks of 128 covers 2048 positions.
        assert_eq!(
            warnings("tensor layout: i32[H, 16, 16], mask: layout[h][q / 128][k / 128] != 0"),
            [
                "`layout[h][q / 128][k / 128]`: index 2 `q / 128` can reach 31, past dimension 16, at B = 1, H = 1, \
                 H_KV = 1, Q_LEN = 4096, KV_LEN = 1; out-of-range indices read the nearest element",
                "`layout[h][q / 128][k / 128]`: index 3 `k / 128` can reach 31, past dimension 16, at B = 1, H = 1, \
                 H_KV = 1, Q_LEN = 1, KV_LEN = 4096; out-of-range indices read the nearest element",
            ]
        );
    }
}
