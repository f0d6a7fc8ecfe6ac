//! Block sparsity by analysis: classifies a spec's mask over a tile of
//! (query, key) pairs as empty, full or partial, by interval arithmetic
//! (and bounds any i32 expression over a whole launch: [`int_range`]).
//!
//! Every i32 value is over-approximated by an inclusive interval `[lo, hi]`
//! and every bool by a sub-interval of `[0, 1]` (`[1, 1]`: always true,
//! `[0, 0]`: always false). Soundness: each rule returns an interval holding
//! every value the interpreter ([`crate::reference::Env::eval`]) can produce
//! for operands inside the operand intervals, so `Empty` only when the mask
//! is false at every pair of the tile and `Full` only when it is true at
//! every pair.
//!
//! Wrapping: bounds are computed exactly in i64 from i32 bounds (a product
//! of two i32 fits). If both result bounds lie in i32 range then no value in
//! between overflowed, so the wrapping result equals the exact one; if a bound
//! leaves i32 range, some operand choice wraps to an arbitrary value and the
//! interval widens to all of i32. Anything not tracked (captured tensor loads,
//! f32 values, float comparisons) is "unknown": all of i32, or `[0, 1]`.
//!
//! The mask is first lowered to a `RangeExpr`, a tree of interval
//! operations; [`classify`] evaluates it here and the CUDA emitter prints the
//! same tree as calls to prelude helpers of the same names
//! (`RangeBinOp::c_name`), so host and kernel apply identical rules.

use crate::reference::ParamValue;
use crate::spec::{BinOp, Builtin, Expr, ExprKind, Func, Shape, Spec, Ty, UnOp};

/// How a spec's mask covers one tile of (query, key) pairs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    /// No pair is kept: the tile can be skipped.
    Empty,
    /// Some pairs may be kept and some masked: evaluate the mask per pair.
    Partial,
    /// Every pair is kept: no per-pair mask evaluation is needed.
    Full,
}

/// Classifies `spec`'s mask over queries `q.0..=q.1` × keys `k.0..=k.1` of
/// batch `b` and query head `h`. Sound for any input: an empty tile is
/// `Empty`, a spec without mask `Full`, and a mismatched param reads as
/// unknown.
pub fn classify(
    spec: &Spec,
    shape: &Shape,
    params: &[ParamValue],
    b: i32,
    h: i32,
    q: (i32, i32),
    k: (i32, i32),
) -> TileClass {
    match &spec.mask {
        Some(mask) => classify_expr(mask, shape, params, b, h, q, k),
        None if q.0 > q.1 || k.0 > k.1 => TileClass::Empty,
        None => TileClass::Full,
    }
}

/// [`classify`] for the bool expression `e` (a mask, or a part of one, see
/// [`crate::mask_parts`]) in place of the spec's mask.
pub fn classify_expr(
    e: &Expr,
    shape: &Shape,
    params: &[ParamValue],
    b: i32,
    h: i32,
    q: (i32, i32),
    k: (i32, i32),
) -> TileClass {
    classify_region(e, shape, params, Region { b: (b, b), h: (h, h), q, k })
}

/// [`classify_expr`] over every batch, head, query and key of `region`.
pub fn classify_region(e: &Expr, shape: &Shape, params: &[ParamValue], region: Region) -> TileClass {
    let Region { b, h, q, k } = region;
    if b.0 > b.1 || h.0 > h.1 || q.0 > q.1 || k.0 > k.1 {
        return TileClass::Empty;
    }
    let r = lower(e).eval(&Tile::new(shape, params, region));
    // A bool-typed expression stays within [0, 1].
    match (r.lo, r.hi) {
        (_, 0) => TileClass::Empty,
        (1, _) => TileClass::Full,
        _ => TileClass::Partial,
    }
}

/// Batches, heads, queries and keys of a launch (inclusive ranges).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub b: (i32, i32),
    pub h: (i32, i32),
    pub q: (i32, i32),
    pub k: (i32, i32),
}

/// Bounds on the values the i32 expression `e` takes over `region` of a
/// launch of `shape`, params unknown: sound as [`classify`] is, so a
/// bound of i32's own means none could be proven.
pub fn int_range(e: &Expr, shape: &Shape, region: Region) -> (i64, i64) {
    let r = lower(e).eval(&Tile::new(shape, &[], region));
    (r.lo, r.hi)
}

/// Whether `mask` is constant over every aligned `block_m` × `block_n` tile:
/// it reads `q` only as `q / Cq` and `k` only as `k / Ck` with literal block
/// sizes that are multiples of the tile's (positions are non-negative, so an
/// aligned tile never straddles a block). Declared block sparsity: a mask
/// like `layout[h][q / 128][k / 128] != 0` is decided by one pair per tile,
/// so tiles are never partial and need no per-pair evaluation.
pub fn block_uniform(mask: &Expr, block_m: u32, block_n: u32) -> bool {
    let aligned = |divisor: &Expr, tile: u32| matches!(divisor.kind, ExprKind::Int(c) if c > 0 && (c as u32).is_multiple_of(tile));
    match &mask.kind {
        ExprKind::Builtin(Builtin::Q | Builtin::K) => false,
        ExprKind::Binary(BinOp::Div, a, d) if a.kind == ExprKind::Builtin(Builtin::Q) => aligned(d, block_m),
        ExprKind::Binary(BinOp::Div, a, d) if a.kind == ExprKind::Builtin(Builtin::K) => aligned(d, block_n),
        ExprKind::Bool(_) | ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Builtin(_) | ExprKind::Param(_) => true,
        ExprKind::Load(_, args) | ExprKind::Call(_, args) => args.iter().all(|a| block_uniform(a, block_m, block_n)),
        ExprKind::Unary(_, a) | ExprKind::Cast(a) => block_uniform(a, block_m, block_n),
        ExprKind::Binary(_, a, b) => block_uniform(a, block_m, block_n) && block_uniform(b, block_m, block_n),
        ExprKind::If(c, t, f) => [c, t, f].iter().all(|e| block_uniform(e, block_m, block_n)),
    }
}

/// An inclusive interval of i64 values, always within i32 range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Range {
    lo: i64,
    hi: i64,
}

const INT: Range = Range { lo: i32::MIN as i64, hi: i32::MAX as i64 };
const BOOL: Range = Range { lo: 0, hi: 1 };

impl Range {
    fn point(v: i64) -> Range {
        Range { lo: v, hi: v }
    }

    /// The wrapping result: exact bounds if they fit i32, else anything.
    fn norm(lo: i64, hi: i64) -> Range {
        if lo < INT.lo || hi > INT.hi {
            INT
        } else {
            Range { lo, hi }
        }
    }

    fn from_bool(always: bool, possibly: bool) -> Range {
        Range { lo: i64::from(always), hi: i64::from(possibly) }
    }

    /// C truthiness (non-zero is true) as a tri-state.
    fn truth(self) -> Range {
        Range::from_bool(self.lo > 0 || self.hi < 0, self.lo != 0 || self.hi != 0)
    }

    fn unary(op: RangeUnOp, a: Range) -> Range {
        match op {
            RangeUnOp::Neg => Range::norm(-a.hi, -a.lo),
            RangeUnOp::Abs if a.lo >= 0 => a,
            RangeUnOp::Abs if a.hi <= 0 => Range::norm(-a.hi, -a.lo),
            RangeUnOp::Abs => Range::norm(0, (-a.lo).max(a.hi)),
            RangeUnOp::Not => {
                let t = a.truth();
                Range { lo: 1 - t.hi, hi: 1 - t.lo }
            }
            RangeUnOp::Truth => a.truth(),
        }
    }

    fn binary(op: RangeBinOp, a: Range, b: Range) -> Range {
        match op {
            RangeBinOp::Add => Range::norm(a.lo + b.lo, a.hi + b.hi),
            RangeBinOp::Sub => Range::norm(a.lo - b.hi, a.hi - b.lo),
            RangeBinOp::Mul => {
                let c = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi];
                Range::norm(c.into_iter().min().unwrap_or(0), c.into_iter().max().unwrap_or(0))
            }
            RangeBinOp::Div => div(a, b),
            RangeBinOp::Rem => rem(a, b),
            RangeBinOp::DivEuclid => div_euclid(a, b),
            RangeBinOp::RemEuclid => rem_euclid(a, b),
            RangeBinOp::Shl => shl(a, b),
            RangeBinOp::Shr => shr(a, b),
            RangeBinOp::BitAnd => bit_and(a, b),
            RangeBinOp::BitOr => bit_or(a, b),
            RangeBinOp::BitXor => bit_xor(a, b),
            RangeBinOp::Min => Range { lo: a.lo.min(b.lo), hi: a.hi.min(b.hi) },
            RangeBinOp::Max => Range { lo: a.lo.max(b.lo), hi: a.hi.max(b.hi) },
            RangeBinOp::Lt => Range::from_bool(a.hi < b.lo, a.lo < b.hi),
            RangeBinOp::Le => Range::from_bool(a.hi <= b.lo, a.lo <= b.hi),
            RangeBinOp::Gt => Range::from_bool(a.lo > b.hi, a.hi > b.lo),
            RangeBinOp::Ge => Range::from_bool(a.lo >= b.hi, a.hi >= b.lo),
            RangeBinOp::Eq => Range::from_bool(a.lo == a.hi && a == b, a.lo <= b.hi && b.lo <= a.hi),
            RangeBinOp::Ne => Range::from_bool(a.hi < b.lo || b.hi < a.lo, !(a.lo == a.hi && a == b)),
            RangeBinOp::And => {
                let (a, b) = (a.truth(), b.truth());
                Range { lo: a.lo.min(b.lo), hi: a.hi.min(b.hi) }
            }
            RangeBinOp::Or => {
                let (a, b) = (a.truth(), b.truth());
                Range { lo: a.lo.max(b.lo), hi: a.hi.max(b.hi) }
            }
        }
    }
}

/// Truncating division. By a positive constant it is monotone; otherwise
/// `|x / y| <= |x|` for y ≠ 0 (x / 0 = 0), except that `i32::MIN / -1`
/// wraps, which the bound 2^31 then widens to everything.
fn div(a: Range, d: Range) -> Range {
    if d.lo == d.hi && d.lo > 0 {
        return Range { lo: a.lo / d.lo, hi: a.hi / d.lo };
    }
    let m = a.lo.abs().max(a.hi.abs());
    Range::norm(-m, m)
}

/// Remainder: it has the dividend's sign, `|x % y| <= |x|` and
/// `|x % y| < |y|` (x % 0 = x % -1 = 0). By a positive constant p, if the
/// whole interval has one quotient, x % p = x − quotient·p is monotone.
fn rem(a: Range, d: Range) -> Range {
    if d.lo == d.hi && d.lo > 0 && a.lo / d.lo == a.hi / d.lo {
        return Range { lo: a.lo % d.lo, hi: a.hi % d.lo };
    }
    let m = d.lo.abs().max(d.hi.abs()).max(1);
    Range { lo: a.lo.min(0).max(1 - m), hi: a.hi.max(0).min(m - 1) }
}

/// Euclidean division: by a positive constant it is floor division,
/// monotone; otherwise `|q| <= |x|` as for `/` (x = q·y + r with
/// 0 <= r < |y| gives |q| <= (|x| + |y| − 1) / |y|), and `i32::MIN` by −1
/// wraps, which the bound 2^31 widens to everything.
fn div_euclid(a: Range, d: Range) -> Range {
    if d.lo == d.hi && d.lo > 0 {
        return Range { lo: a.lo.div_euclid(d.lo), hi: a.hi.div_euclid(d.lo) };
    }
    div(a, INT)
}

/// The Euclidean remainder lies in [0, |y| − 1] (0 by 0), and for x >= 0
/// at most x. By a positive constant, over one quotient, it is monotone.
fn rem_euclid(a: Range, d: Range) -> Range {
    if d.lo == d.hi && d.lo > 0 && a.lo.div_euclid(d.lo) == a.hi.div_euclid(d.lo) {
        return Range { lo: a.lo.rem_euclid(d.lo), hi: a.hi.rem_euclid(d.lo) };
    }
    let m = d.lo.abs().max(d.hi.abs()).max(1);
    Range { lo: 0, hi: if a.lo >= 0 { a.hi.min(m - 1) } else { m - 1 } }
}

/// By a constant amount (low 5 bits: c), `x << c` is x·2^c, exact unless a
/// bound leaves i32; otherwise anything.
fn shl(a: Range, n: Range) -> Range {
    if n.lo != n.hi {
        return INT;
    }
    let scale = 1i64 << (n.lo & 31);
    Range::norm(a.lo * scale, a.hi * scale)
}

/// `x >> c` is ⌊x / 2^c⌋: monotone for a constant c, and for any c between
/// 0 and x (−1 and x for negative x).
fn shr(a: Range, n: Range) -> Range {
    if n.lo == n.hi {
        let c = n.lo & 31;
        return Range { lo: a.lo >> c, hi: a.hi >> c };
    }
    Range { lo: a.lo.min(0), hi: a.hi.max(0) }
}

/// An and only clears bits: with a non-negative operand it lies in
/// [0, that operand]; of two negative ones it is at most either; in any
/// case at most the larger operand.
fn bit_and(a: Range, b: Range) -> Range {
    let hi = match (a.lo >= 0, b.lo >= 0) {
        (true, true) => a.hi.min(b.hi),
        (true, false) => a.hi,
        (false, true) => b.hi,
        (false, false) if a.hi < 0 && b.hi < 0 => a.hi.min(b.hi),
        (false, false) => a.hi.max(b.hi),
    };
    Range { lo: if a.lo >= 0 || b.lo >= 0 { 0 } else { INT.lo }, hi }
}

/// Of non-negative operands, an or is at least either and has no more bits
/// than the wider; anything otherwise.
fn bit_or(a: Range, b: Range) -> Range {
    if a.lo < 0 || b.lo < 0 {
        return INT;
    }
    Range { lo: a.lo.max(b.lo), hi: bit_fill(a.hi.max(b.hi)) }
}

/// Of non-negative operands, an xor has no more bits than the wider.
fn bit_xor(a: Range, b: Range) -> Range {
    if a.lo < 0 || b.lo < 0 {
        return INT;
    }
    Range { lo: 0, hi: bit_fill(a.hi.max(b.hi)) }
}

/// The largest value of `v`'s bit length, 2^k − 1 (v >= 0).
fn bit_fill(v: i64) -> i64 {
    (1i64 << (64 - v.leading_zeros())) - 1
}

/// The known values of one tile (None: a size that does not fit i32). A
/// kernel's tile has one batch and head; a region of [`int_range`] spans
/// several.
struct Tile<'a> {
    b: (i32, i32),
    h: (i32, i32),
    q: (i32, i32),
    k: (i32, i32),
    q_len: Option<i32>,
    kv_len: Option<i32>,
    params: &'a [ParamValue],
}

impl<'a> Tile<'a> {
    fn new(shape: &Shape, params: &'a [ParamValue], region: Region) -> Self {
        let len = |n: usize| i32::try_from(n).ok();
        let Region { b, h, q, k } = region;
        Tile { b, h, q, k, q_len: len(shape.q_len), kv_len: len(shape.kv_len), params }
    }
}

/// A unary interval operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RangeUnOp {
    Neg,
    Abs,
    Not,
    /// C truthiness, for a cast to bool.
    Truth,
}

/// A binary interval operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RangeBinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    DivEuclid,
    RemEuclid,
    Shl,
    Shr,
    BitAnd,
    BitOr,
    BitXor,
    Min,
    Max,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
}

impl RangeUnOp {
    /// The prelude helper implementing the operation in the kernel.
    pub(crate) fn c_name(self) -> &'static str {
        match self {
            RangeUnOp::Neg => "r_neg",
            RangeUnOp::Abs => "r_abs",
            RangeUnOp::Not => "r_not",
            RangeUnOp::Truth => "r_truth",
        }
    }
}

impl RangeBinOp {
    /// The prelude helper implementing the operation in the kernel.
    pub(crate) fn c_name(self) -> &'static str {
        match self {
            RangeBinOp::Add => "r_add",
            RangeBinOp::Sub => "r_sub",
            RangeBinOp::Mul => "r_mul",
            RangeBinOp::Div => "r_div",
            RangeBinOp::Rem => "r_rem",
            RangeBinOp::DivEuclid => "r_div_euclid",
            RangeBinOp::RemEuclid => "r_rem_euclid",
            RangeBinOp::Shl => "r_shl",
            RangeBinOp::Shr => "r_shr",
            RangeBinOp::BitAnd => "r_bit_and",
            RangeBinOp::BitOr => "r_bit_or",
            RangeBinOp::BitXor => "r_bit_xor",
            RangeBinOp::Min => "r_min",
            RangeBinOp::Max => "r_max",
            RangeBinOp::Lt => "r_lt",
            RangeBinOp::Le => "r_le",
            RangeBinOp::Gt => "r_gt",
            RangeBinOp::Ge => "r_ge",
            RangeBinOp::Eq => "r_eq",
            RangeBinOp::Ne => "r_ne",
            RangeBinOp::And => "r_and",
            RangeBinOp::Or => "r_or",
        }
    }
}

/// A value known exactly once the tile is: `r_point(value)` in C.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    Int(i32),
    B,
    H,
    QLen,
    KvLen,
    /// An i32 param, by index into [`Spec::params`].
    Param(usize),
}

/// A mask lowered to interval operations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum RangeExpr {
    Point(Known),
    /// `[q_lo, q_hi]`.
    Query,
    /// `[k_lo, k_hi]`.
    Key,
    UnknownInt,
    UnknownBool,
    /// An i32 subexpression the kernel bounds at run time (the i-th of the
    /// caller's list, e.g. a tensor read's min and max over the tile);
    /// unknown here.
    Bounded(usize),
    Unary(RangeUnOp, Box<RangeExpr>),
    Binary(RangeBinOp, Box<RangeExpr>, Box<RangeExpr>),
    /// `clamp(x, lo, hi)` = `min(max(x, lo), hi)`.
    Clamp(Box<[RangeExpr; 3]>),
    /// The taken branch when the condition is known, else the hull of both.
    If(Box<[RangeExpr; 3]>),
}

/// What nothing is known about, by type. f32 values only reach integers and
/// bools through casts and comparisons, which the full i32 range and [0, 1]
/// over-approximate.
fn unknown(ty: Ty) -> RangeExpr {
    match ty {
        Ty::Bool => RangeExpr::UnknownBool,
        Ty::I32 | Ty::F32 => RangeExpr::UnknownInt,
    }
}

/// Lowers a spec expression, following the interpreter's typing: operands
/// of i32/bool operations are read as i32, conditions and logic by truth.
pub(crate) fn lower(e: &Expr) -> RangeExpr {
    lower_with(e, &|_| None)
}

/// [`lower`], with the i32 subexpressions `bounded` numbers lowered to
/// [`RangeExpr::Bounded`].
pub(crate) fn lower_with(e: &Expr, bounded: &dyn Fn(&Expr) -> Option<usize>) -> RangeExpr {
    use RangeExpr as R;
    let lower = |a: &Expr| lower_with(a, bounded);
    let un = |op, a: &Expr| R::Unary(op, Box::new(lower(a)));
    let bin = |op, a: &Expr, b: &Expr| R::Binary(op, Box::new(lower(a)), Box::new(lower(b)));
    if e.ty == Ty::F32 {
        return R::UnknownInt;
    }
    if let Some(i) = bounded(e).filter(|_| e.ty == Ty::I32) {
        return R::Bounded(i);
    }
    match &e.kind {
        ExprKind::Bool(v) => R::Point(Known::Int(i32::from(*v))),
        ExprKind::Int(v) => R::Point(Known::Int(*v)),
        ExprKind::Builtin(Builtin::B) => R::Point(Known::B),
        ExprKind::Builtin(Builtin::H) => R::Point(Known::H),
        ExprKind::Builtin(Builtin::QLen) => R::Point(Known::QLen),
        ExprKind::Builtin(Builtin::KvLen) => R::Point(Known::KvLen),
        ExprKind::Builtin(Builtin::Q) => R::Query,
        ExprKind::Builtin(Builtin::K) => R::Key,
        ExprKind::Param(i) if e.ty == Ty::I32 => R::Point(Known::Param(*i)),
        ExprKind::Unary(UnOp::Neg, a) => un(RangeUnOp::Neg, a),
        ExprKind::Unary(UnOp::Not, a) => un(RangeUnOp::Not, a),
        // !x = −1 − x exactly, and never wraps.
        ExprKind::Unary(UnOp::BitNot, a) => {
            R::Binary(RangeBinOp::Sub, Box::new(R::Point(Known::Int(-1))), Box::new(lower(a)))
        }
        ExprKind::Binary(_, a, _) if a.ty == Ty::F32 => unknown(e.ty),
        ExprKind::Binary(op, a, b) => {
            let op = match op {
                BinOp::Add => RangeBinOp::Add,
                BinOp::Sub => RangeBinOp::Sub,
                BinOp::Mul => RangeBinOp::Mul,
                BinOp::Div => RangeBinOp::Div,
                BinOp::Rem => RangeBinOp::Rem,
                BinOp::Lt => RangeBinOp::Lt,
                BinOp::Le => RangeBinOp::Le,
                BinOp::Gt => RangeBinOp::Gt,
                BinOp::Ge => RangeBinOp::Ge,
                BinOp::Eq => RangeBinOp::Eq,
                BinOp::Ne => RangeBinOp::Ne,
                BinOp::And => RangeBinOp::And,
                BinOp::Or => RangeBinOp::Or,
                BinOp::BitAnd => RangeBinOp::BitAnd,
                BinOp::BitOr => RangeBinOp::BitOr,
                BinOp::BitXor => RangeBinOp::BitXor,
                BinOp::Shl => RangeBinOp::Shl,
                BinOp::Shr => RangeBinOp::Shr,
            };
            bin(op, a, b)
        }
        ExprKind::Cast(a) if e.ty == Ty::Bool => un(RangeUnOp::Truth, a),
        // i32 → i32 and bool → i32 keep the value; f32 → i32 lowers to unknown.
        ExprKind::Cast(a) => lower(a),
        ExprKind::Call(Func::Min, args) if args.len() == 2 => bin(RangeBinOp::Min, &args[0], &args[1]),
        ExprKind::Call(Func::Max, args) if args.len() == 2 => bin(RangeBinOp::Max, &args[0], &args[1]),
        ExprKind::Call(Func::Abs, args) if args.len() == 1 => un(RangeUnOp::Abs, &args[0]),
        ExprKind::Call(Func::RemEuclid, args) if args.len() == 2 => bin(RangeBinOp::RemEuclid, &args[0], &args[1]),
        ExprKind::Call(Func::DivEuclid, args) if args.len() == 2 => bin(RangeBinOp::DivEuclid, &args[0], &args[1]),
        ExprKind::Call(Func::Clamp, args) if args.len() == 3 => {
            R::Clamp(Box::new([lower(&args[0]), lower(&args[1]), lower(&args[2])]))
        }
        ExprKind::If(c, t, f) => R::If(Box::new([lower(c), lower(t), lower(f)])),
        // Tensor loads, other params, f32-only functions.
        _ => unknown(e.ty),
    }
}

impl RangeExpr {
    fn eval(&self, tile: &Tile) -> Range {
        let point = |v: Option<i32>| v.map_or(INT, |v| Range::point(i64::from(v)));
        match self {
            RangeExpr::Point(known) => match *known {
                Known::Int(v) => point(Some(v)),
                Known::B => Range { lo: tile.b.0.into(), hi: tile.b.1.into() },
                Known::H => Range { lo: tile.h.0.into(), hi: tile.h.1.into() },
                Known::QLen => point(tile.q_len),
                Known::KvLen => point(tile.kv_len),
                Known::Param(i) => match tile.params.get(i) {
                    Some(ParamValue::I32(v)) => point(Some(*v)),
                    _ => INT,
                },
            },
            RangeExpr::Query => Range { lo: tile.q.0.into(), hi: tile.q.1.into() },
            RangeExpr::Key => Range { lo: tile.k.0.into(), hi: tile.k.1.into() },
            RangeExpr::UnknownInt | RangeExpr::Bounded(_) => INT,
            RangeExpr::UnknownBool => BOOL,
            RangeExpr::Unary(op, a) => Range::unary(*op, a.eval(tile)),
            RangeExpr::Binary(op, a, b) => Range::binary(*op, a.eval(tile), b.eval(tile)),
            RangeExpr::Clamp(args) => {
                let [x, lo, hi] = args.as_ref().each_ref().map(|a| a.eval(tile));
                Range::binary(RangeBinOp::Min, Range::binary(RangeBinOp::Max, x, lo), hi)
            }
            RangeExpr::If(args) => {
                let [c, t, f] = args.as_ref().each_ref().map(|a| a.eval(tile));
                match c.truth() {
                    Range { lo: 1, .. } => t,
                    Range { hi: 0, .. } => f,
                    _ => Range { lo: t.lo.min(f.lo), hi: t.hi.max(f.hi) },
                }
            }
        }
    }
}
