//! The spec IR: one checked attention variant.
//!
//! A [`Spec`] is only ever built by [`crate::syntax`] after type checking, so
//! every later stage (reference interpreter, CUDA emitter, runtime) may rely on
//! its invariants: names resolve, expressions are well typed, tensor indexing
//! has the declared rank, `score` appears only in the score expression.

use std::fmt;

/// Storage type of Q, K, V and O. Accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F16,
    Bf16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Scalar type of an expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    Bool,
    I32,
    F32,
}

impl Ty {
    pub fn name(self) -> &'static str {
        match self {
            Ty::Bool => "bool",
            Ty::I32 => "i32",
            Ty::F32 => "f32",
        }
    }
}

impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type of a captured tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemTy {
    I32,
    F32,
    F16,
    Bf16,
}

impl ElemTy {
    pub fn name(self) -> &'static str {
        match self {
            ElemTy::I32 => "i32",
            ElemTy::F32 => "f32",
            ElemTy::F16 => "f16",
            ElemTy::Bf16 => "bf16",
        }
    }

    /// The expression type an element reads as: integers stay integers,
    /// every float storage type widens to f32.
    pub fn value_ty(self) -> Ty {
        match self {
            ElemTy::I32 => Ty::I32,
            _ => Ty::F32,
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            ElemTy::I32 | ElemTy::F32 => 4,
            ElemTy::F16 | ElemTy::Bf16 => 2,
        }
    }
}

/// One dimension of a captured tensor: a launch-shape symbol, a constant,
/// or `+ - * /` of dimensions (`2 * KV_LEN - 1`, `(Q_LEN + 63) / 64`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// `B`: the batch size.
    Batch,
    /// `H`: the number of query heads.
    Heads,
    /// `H_KV`: the number of key/value heads.
    HeadsKv,
    /// `Q_LEN`: the query sequence length.
    QLen,
    /// `KV_LEN`: the key/value sequence length.
    KvLen,
    Const(u32),
    /// Two dimensions combined; a divisor is a positive constant. Every
    /// value along the way must fit an i32 ([`Dim::value`]).
    Op(DimOp, Box<Dim>, Box<Dim>),
    /// `Q_LEN` of a tensor read by a varlen kernel, where the built-in
    /// `q_len` is one sequence's length: the longest sequence's, so the
    /// tensor keeps one row-major layout for the launch. Only in the view a
    /// varlen kernel is emitted from ([`Spec::varlen_view`]); it resolves
    /// and prints as `Q_LEN`.
    MaxQLen,
    /// `KV_LEN` in a varlen kernel's view, as [`Dim::MaxQLen`].
    MaxKvLen,
    /// A spec's i32 param: only in a shard's view ([`crate::shard::view`]),
    /// whose `Q_LEN` and `KV_LEN` are the whole sequence's lengths, passed
    /// as params. Host checks first bind it to its value
    /// ([`TensorDecl::bind_params`]); unbound it fits no buffer.
    Param(usize),
}

/// An operator of a dimension expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DimOp {
    Add,
    Sub,
    Mul,
    /// Truncating, by a positive constant.
    Div,
}

impl DimOp {
    pub fn symbol(self) -> &'static str {
        match self {
            DimOp::Add => "+",
            DimOp::Sub => "-",
            DimOp::Mul => "*",
            DimOp::Div => "/",
        }
    }

    fn precedence(self) -> u8 {
        match self {
            DimOp::Add | DimOp::Sub => 1,
            DimOp::Mul | DimOp::Div => 2,
        }
    }
}

impl Dim {
    pub const SYMBOLS: [(&'static str, Dim); 5] =
        [("B", Dim::Batch), ("H", Dim::Heads), ("H_KV", Dim::HeadsKv), ("Q_LEN", Dim::QLen), ("KV_LEN", Dim::KvLen)];

    /// Resolves the dimension against a launch shape: a symbol's or
    /// constant's size, an expression's once [`TensorDecl::check_dims`]
    /// accepted the shape (else a negative value reads as 0, one past i32
    /// as `usize::MAX`: no buffer is large enough).
    pub fn resolve(&self, shape: &Shape) -> usize {
        match self {
            Dim::Batch => shape.batch,
            Dim::Heads => shape.heads,
            Dim::HeadsKv => shape.heads_kv,
            Dim::QLen | Dim::MaxQLen => shape.q_len,
            Dim::KvLen | Dim::MaxKvLen => shape.kv_len,
            Dim::Const(n) => *n as usize,
            Dim::Param(_) => usize::MAX,
            Dim::Op(..) => self.value(shape).map_or(usize::MAX, |v| usize::try_from(v).unwrap_or(0)),
        }
    }

    /// The dimension's value at `shape`, `None` if it or any value along
    /// the way leaves i32 (the kernels compute it in i32, exactly then).
    pub fn value(&self, shape: &Shape) -> Option<i64> {
        let int = |n: usize| i64::try_from(n).ok().filter(|&v| v <= i64::from(i32::MAX));
        let v = match self {
            Dim::Op(op, a, b) => {
                let (a, b) = (a.value(shape)?, b.value(shape)?);
                match op {
                    DimOp::Add => a + b,
                    DimOp::Sub => a - b,
                    DimOp::Mul => a * b,
                    DimOp::Div if b > 0 => a / b,
                    DimOp::Div => return None,
                }
            }
            // A constant past i32 stands alone (the kernels clip in 64 bits).
            Dim::Const(n) => return Some(i64::from(*n)),
            Dim::Param(_) => return None,
            _ => return int(self.resolve(shape)),
        };
        i32::try_from(v).is_ok().then_some(v)
    }

    /// This dimension with `Q_LEN` and `KV_LEN` read as the longest
    /// sequence's ([`Spec::varlen_view`]), inside expressions too.
    fn longest(&self) -> Dim {
        match self {
            Dim::QLen => Dim::MaxQLen,
            Dim::KvLen => Dim::MaxKvLen,
            Dim::Op(op, a, b) => Dim::Op(*op, Box::new(a.longest()), Box::new(b.longest())),
            other => other.clone(),
        }
    }

    /// Writes the dimension, parenthesizing operands that bind looser than
    /// `min_prec`.
    fn write(&self, f: &mut fmt::Formatter<'_>, min_prec: u8) -> fmt::Result {
        match self {
            Dim::Const(n) => write!(f, "{n}"),
            Dim::Op(op, a, b) => {
                let prec = op.precedence();
                let open = prec < min_prec;
                if open {
                    f.write_str("(")?;
                }
                // Left-associative: the right operand must bind tighter.
                a.write(f, prec)?;
                write!(f, " {} ", op.symbol())?;
                b.write(f, prec + 1)?;
                if open {
                    f.write_str(")")?;
                }
                Ok(())
            }
            Dim::MaxQLen => Dim::QLen.write(f, min_prec),
            Dim::MaxKvLen => Dim::KvLen.write(f, min_prec),
            Dim::Param(i) => write!(f, "param[{i}]"),
            sym => {
                let name = Dim::SYMBOLS.iter().find(|(_, d)| d == sym).map(|(n, _)| *n);
                f.write_str(name.unwrap_or("?"))
            }
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write(f, 0)
    }
}

/// A dimension expression a launch's shape makes invalid: below 1, or
/// leaving i32 along the way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DimError {
    pub tensor: String,
    /// The dimension as written in the spec.
    pub dim: String,
    /// Its value, `None` where it left i32.
    pub value: Option<i64>,
}

impl fmt::Display for DimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let DimError { tensor, dim, value } = self;
        match value {
            Some(v) => write!(f, "tensor `{tensor}`: dimension `{dim}` is {v} for this launch; it must be at least 1"),
            None => write!(f, "tensor `{tensor}`: dimension `{dim}` leaves the i32 range for this launch"),
        }
    }
}

impl std::error::Error for DimError {}

/// The sizes of one launch. Everything here is a kernel argument, never a
/// compile-time constant, so changing it never recompiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub batch: usize,
    pub heads: usize,
    pub heads_kv: usize,
    pub q_len: usize,
    pub kv_len: usize,
}

/// A runtime scalar parameter (`param window: i32`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    pub name: String,
    pub ty: Ty,
}

/// A captured tensor (`tensor slopes: f32[H]`), row-major and contiguous.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorDecl {
    pub name: String,
    pub elem: ElemTy,
    pub dims: Vec<Dim>,
}

impl TensorDecl {
    /// Checks every dimension expression at `shape`: each value along the
    /// way fits an i32 and the dimension is at least 1 (a kernel clips
    /// indices into it, so an empty one could not be read).
    pub fn check_dims(&self, shape: &Shape) -> Result<(), DimError> {
        for dim in self.dims.iter().filter(|d| matches!(d, Dim::Op(..))) {
            match dim.value(shape) {
                Some(v) if v >= 1 => {}
                value => return Err(DimError { tensor: self.name.clone(), dim: dim.to_string(), value }),
            }
        }
        Ok(())
    }

    /// The declaration with each [`Dim::Param`] replaced by the param's
    /// value (`None`: not an i32 param, which leaves it unbound).
    pub fn bind_params(&self, value: &dyn Fn(usize) -> Option<i32>) -> TensorDecl {
        fn bind(d: &Dim, value: &dyn Fn(usize) -> Option<i32>) -> Dim {
            match d {
                Dim::Param(i) => match value(*i).map(u32::try_from) {
                    Some(Ok(v)) => Dim::Const(v),
                    _ => d.clone(),
                },
                Dim::Op(op, a, b) => Dim::Op(*op, Box::new(bind(a, value)), Box::new(bind(b, value))),
                other => other.clone(),
            }
        }
        TensorDecl { dims: self.dims.iter().map(|d| bind(d, value)).collect(), ..self.clone() }
    }

    /// Number of elements the tensor must hold for `shape`, saturating: a
    /// shape whose count overflows needs more than any buffer holds.
    pub fn len(&self, shape: &Shape) -> usize {
        self.dims.iter().fold(1usize, |n, d| n.saturating_mul(d.resolve(shape)))
    }

    pub fn is_empty(&self, shape: &Shape) -> bool {
        self.len(shape) == 0
    }
}

/// A built-in variable of the expression language.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Builtin {
    /// Batch index.
    B,
    /// Query head index.
    H,
    /// Query index within the sequence.
    Q,
    /// Key index within the sequence.
    K,
    QLen,
    KvLen,
    /// The scaled score `scale · q·k` (score expression only).
    Score,
}

impl Builtin {
    pub const ALL: [(&'static str, Builtin); 7] = [
        ("b", Builtin::B),
        ("h", Builtin::H),
        ("q", Builtin::Q),
        ("k", Builtin::K),
        ("q_len", Builtin::QLen),
        ("kv_len", Builtin::KvLen),
        ("score", Builtin::Score),
    ];

    pub fn name(self) -> &'static str {
        Builtin::ALL.iter().find(|(_, b)| *b == self).map(|(n, _)| *n).unwrap_or("?")
    }

    pub fn ty(self) -> Ty {
        match self {
            Builtin::Score => Ty::F32,
            _ => Ty::I32,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnOp {
    Neg,
    /// Logical not of a bool.
    Not,
    /// Bitwise complement of an i32, written `!` as in Rust.
    BitNot,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinOp {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    And,
    Or,
    BitAnd,
    BitOr,
    BitXor,
    /// `a << n`: shifts by `n`'s low 5 bits, zeros in (Rust's `wrapping_shl`).
    Shl,
    /// `a >> n`: shifts by `n`'s low 5 bits, copies of the sign bit in
    /// (Rust's `wrapping_shr` on i32).
    Shr,
}

impl BinOp {
    pub fn symbol(self) -> &'static str {
        match self {
            BinOp::Add => "+",
            BinOp::Sub => "-",
            BinOp::Mul => "*",
            BinOp::Div => "/",
            BinOp::Rem => "%",
            BinOp::Lt => "<",
            BinOp::Le => "<=",
            BinOp::Gt => ">",
            BinOp::Ge => ">=",
            BinOp::Eq => "==",
            BinOp::Ne => "!=",
            BinOp::And => "&&",
            BinOp::Or => "||",
            BinOp::BitAnd => "&",
            BinOp::BitOr => "|",
            BinOp::BitXor => "^",
            BinOp::Shl => "<<",
            BinOp::Shr => ">>",
        }
    }

    /// Binding strength, Rust's order (higher binds tighter).
    pub const fn precedence(self) -> u8 {
        match self {
            BinOp::Or => 1,
            BinOp::And => 2,
            BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne => 3,
            BinOp::BitOr => 4,
            BinOp::BitXor => 5,
            BinOp::BitAnd => 6,
            BinOp::Shl | BinOp::Shr => 7,
            BinOp::Add | BinOp::Sub => 8,
            BinOp::Mul | BinOp::Div | BinOp::Rem => 9,
        }
    }

    pub fn is_comparison(self) -> bool {
        matches!(self, BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge | BinOp::Eq | BinOp::Ne)
    }

    pub fn is_logical(self) -> bool {
        matches!(self, BinOp::And | BinOp::Or)
    }

    /// The operators defined on i32 only: `& | ^ << >>`.
    pub fn is_bitwise(self) -> bool {
        matches!(self, BinOp::BitAnd | BinOp::BitOr | BinOp::BitXor | BinOp::Shl | BinOp::Shr)
    }
}

/// The argument types a [`Func`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// f32 only (`exp`, `floor`, ...).
    Float,
    /// i32 or f32, the result of the arguments' type (`min`, `abs`, ...).
    Numeric,
    /// i32 only (`rem_euclid`, `div_euclid`).
    Int,
}

/// Built-in functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Func {
    Min,
    Max,
    Abs,
    Clamp,
    Exp,
    Exp2,
    Log,
    Log2,
    Tanh,
    Sigmoid,
    Sqrt,
    Floor,
    /// `rem_euclid(a, b)`: the remainder of Euclidean division, in
    /// `0..|b|` (Rust's `wrapping_rem_euclid`); by 0 it is 0.
    RemEuclid,
    /// `div_euclid(a, b)`: the quotient with `a = q * b + rem_euclid(a, b)`
    /// (Rust's `wrapping_div_euclid`); by 0 it is 0.
    DivEuclid,
}

impl Func {
    pub const ALL: [(&'static str, Func); 14] = [
        ("min", Func::Min),
        ("max", Func::Max),
        ("abs", Func::Abs),
        ("clamp", Func::Clamp),
        ("exp", Func::Exp),
        ("exp2", Func::Exp2),
        ("log", Func::Log),
        ("log2", Func::Log2),
        ("tanh", Func::Tanh),
        ("sigmoid", Func::Sigmoid),
        ("sqrt", Func::Sqrt),
        ("floor", Func::Floor),
        ("rem_euclid", Func::RemEuclid),
        ("div_euclid", Func::DivEuclid),
    ];

    pub fn name(self) -> &'static str {
        Func::ALL.iter().find(|(_, f)| *f == self).map(|(n, _)| *n).unwrap_or("?")
    }

    pub fn arity(self) -> usize {
        match self {
            Func::Min | Func::Max | Func::RemEuclid | Func::DivEuclid => 2,
            Func::Clamp => 3,
            _ => 1,
        }
    }

    pub fn domain(self) -> Domain {
        match self {
            Func::Min | Func::Max | Func::Abs | Func::Clamp => Domain::Numeric,
            Func::RemEuclid | Func::DivEuclid => Domain::Int,
            _ => Domain::Float,
        }
    }

    /// A float library function worth a register when hoisted (everything
    /// but the cheap arithmetic of `min`, `floor`, `rem_euclid`, ...).
    pub fn is_transcendental(self) -> bool {
        matches!(self, Func::Exp | Func::Exp2 | Func::Log | Func::Log2 | Func::Tanh | Func::Sigmoid | Func::Sqrt)
    }
}

/// A typed expression. Every node carries its result type.
#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub ty: Ty,
    pub kind: ExprKind,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    Bool(bool),
    Int(i32),
    Float(f32),
    Builtin(Builtin),
    /// Index into [`Spec::params`].
    Param(usize),
    /// Index into [`Spec::tensors`], one index expression per dimension.
    Load(usize, Vec<Expr>),
    Unary(UnOp, Box<Expr>),
    Binary(BinOp, Box<Expr>, Box<Expr>),
    /// A cast to [`Expr::ty`].
    Cast(Box<Expr>),
    Call(Func, Vec<Expr>),
    If(Box<Expr>, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// Calls `f` on this node and every node below it, parents first.
    pub fn walk(&self, f: &mut impl FnMut(&Expr)) {
        f(self);
        match &self.kind {
            ExprKind::Bool(_) | ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Builtin(_) | ExprKind::Param(_) => {}
            ExprKind::Load(_, args) | ExprKind::Call(_, args) => args.iter().for_each(|a| a.walk(f)),
            ExprKind::Unary(_, a) | ExprKind::Cast(a) => a.walk(f),
            ExprKind::Binary(_, a, b) => {
                a.walk(f);
                b.walk(f);
            }
            ExprKind::If(c, t, e) => {
                c.walk(f);
                t.walk(f);
                e.walk(f);
            }
        }
    }

    /// The expression with q and k swapped: the mask seen from the key's
    /// side, as the dK/dV kernels test it (their columns are queries).
    pub fn with_q_and_k_swapped(&self) -> Expr {
        let mut e = self.clone();
        e.walk_mut(&mut |x| match x.kind {
            ExprKind::Builtin(Builtin::Q) => x.kind = ExprKind::Builtin(Builtin::K),
            ExprKind::Builtin(Builtin::K) => x.kind = ExprKind::Builtin(Builtin::Q),
            _ => {}
        });
        e
    }

    /// [`Expr::walk`], mutably.
    fn walk_mut(&mut self, f: &mut impl FnMut(&mut Expr)) {
        f(self);
        match &mut self.kind {
            ExprKind::Bool(_) | ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Builtin(_) | ExprKind::Param(_) => {}
            ExprKind::Load(_, args) | ExprKind::Call(_, args) => args.iter_mut().for_each(|a| a.walk_mut(f)),
            ExprKind::Unary(_, a) | ExprKind::Cast(a) => a.walk_mut(f),
            ExprKind::Binary(_, a, b) => {
                a.walk_mut(f);
                b.walk_mut(f);
            }
            ExprKind::If(c, t, e) => {
                c.walk_mut(f);
                t.walk_mut(f);
                e.walk_mut(f);
            }
        }
    }

    /// Whether the expression reads `var`.
    pub fn uses(&self, var: Builtin) -> bool {
        let mut found = false;
        self.walk(&mut |e| found |= e.kind == ExprKind::Builtin(var));
        found
    }

    /// Whether the expression reads a captured tensor (a mask that does
    /// needs a block mask to skip tiles: interval analysis can't bound it).
    pub fn reads_tensor(&self) -> bool {
        let mut found = false;
        self.walk(&mut |e| found |= matches!(e.kind, ExprKind::Load(..)));
        found
    }
}

/// Head dimensions: QK and V may differ (e.g. 192/128).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HeadDims {
    pub qk: u32,
    pub v: u32,
}

/// The largest head dimension the forward and backward kernels support.
pub const MAX_HEAD_DIM: u32 = 256;

/// The largest head dimension a spec may declare: the decode kernels' (MLA's
/// absorbed decode, QK 576 / V 512). Past [`MAX_HEAD_DIM`] only they run it.
pub const MAX_DECODE_HEAD_DIM: u32 = 576;

/// One checked attention variant.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub name: String,
    /// The `///` doc comment, one entry per line.
    pub doc: Vec<String>,
    /// Whether the macro should make the generated items `pub`.
    pub public: bool,
    pub dtype: Dtype,
    pub head_dims: HeadDims,
    pub params: Vec<Param>,
    pub tensors: Vec<TensorDecl>,
    /// Boolean; `None` keeps every (q, k) pair.
    pub mask: Option<Expr>,
    /// f32; `None` leaves the score unchanged.
    pub score: Option<Expr>,
    /// f32 over `b`, `h`, params and tensors: a learned sink, one more
    /// logit in each row's softmax denominator with no value row, in the
    /// units of the score expression's result; `None` for no sink.
    pub sink: Option<Expr>,
}

impl Spec {
    /// The spec as a varlen kernel reads it: the same spec, its tensors'
    /// `Q_LEN` and `KV_LEN` dims the longest sequence's lengths
    /// ([`Dim::MaxQLen`]) while `q_len` and `kv_len` in its expressions are
    /// each sequence's own. Prints as the spec itself.
    pub fn varlen_view(&self) -> Spec {
        let mut view = self.clone();
        for dim in view.tensors.iter_mut().flat_map(|t| t.dims.iter_mut()) {
            *dim = dim.longest();
        }
        view
    }
}
