//! The shard view: the spec a piece's kernels are emitted from. Positions
//! and lengths become the whole sequence's (`q` → `q + q0`, `k` → `k + k0`,
//! `q_len` and `kv_len`, and the tensors' `Q_LEN` and `KV_LEN` dims, → the
//! whole lengths), all four passed as i32 params appended to the spec's, so
//! one compiled kernel serves every piece and every shard size.

use crate::spec::{BinOp, Builtin, Dim, Expr, ExprKind, Param, Spec, TensorDecl, Ty};

/// How many params [`view`] appends to the spec's, in [`ShardParams`] order.
pub const SHARD_PARAMS: usize = 4;

/// The values of the params [`view`] appends: the piece's first query and
/// key positions in the whole sequence, and the whole sequence's lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardParams {
    pub q0: i32,
    pub k0: i32,
    pub q_len: i32,
    pub kv_len: i32,
}

impl ShardParams {
    /// The values in the order [`view`] declares them.
    pub fn values(self) -> [i32; SHARD_PARAMS] {
        [self.q0, self.k0, self.q_len, self.kv_len]
    }
}

/// `spec` as a piece's kernels read it (see the module note). `sink`: keep
/// the spec's learned sink, which joins each row's softmax once: in the one
/// piece of a row whose keys start at position 0.
pub fn view(spec: &Spec, sink: bool) -> Spec {
    let first = spec.params.len();
    let [q0, k0, q_len, kv_len] = [0, 1, 2, 3].map(|i| first + i);
    let mut view = spec.clone();
    view.name = format!("{}Shard", spec.name);
    for (i, base) in ["shard_q0", "shard_k0", "shard_q_len", "shard_kv_len"].into_iter().enumerate() {
        let name = fresh_name(spec, base);
        debug_assert_eq!(view.params.len(), first + i);
        view.params.push(Param { name, ty: Ty::I32 });
    }
    let rewrite = |e: &Expr| shift(e, [q0, k0, q_len, kv_len]);
    view.mask = spec.mask.as_ref().map(rewrite);
    view.score = spec.score.as_ref().map(rewrite);
    view.sink = spec.sink.as_ref().filter(|_| sink).map(rewrite);
    view.tensors = spec.tensors.iter().map(|t| whole_dims(t, q_len, kv_len)).collect();
    view
}

/// `base`, or `base` with underscores appended until no param or tensor of
/// `spec` has the name.
fn fresh_name(spec: &Spec, base: &str) -> String {
    let taken = |n: &str| spec.params.iter().any(|p| p.name == n) || spec.tensors.iter().any(|t| t.name == n);
    let mut name = base.to_string();
    while taken(&name) {
        name.push('_');
    }
    name
}

/// `e` with positions and lengths read from the params at `[q0, k0, q_len,
/// kv_len]`.
fn shift(e: &Expr, params: [usize; SHARD_PARAMS]) -> Expr {
    let [q0, k0, q_len, kv_len] = params;
    let param = |i| Expr { ty: Ty::I32, kind: ExprKind::Param(i) };
    let plus = |var, i| Expr {
        ty: Ty::I32,
        kind: ExprKind::Binary(
            BinOp::Add,
            Box::new(Expr { ty: Ty::I32, kind: ExprKind::Builtin(var) }),
            Box::new(param(i)),
        ),
    };
    let kind = match &e.kind {
        ExprKind::Builtin(Builtin::Q) => return plus(Builtin::Q, q0),
        ExprKind::Builtin(Builtin::K) => return plus(Builtin::K, k0),
        ExprKind::Builtin(Builtin::QLen) => return param(q_len),
        ExprKind::Builtin(Builtin::KvLen) => return param(kv_len),
        ExprKind::Bool(_) | ExprKind::Int(_) | ExprKind::Float(_) | ExprKind::Builtin(_) | ExprKind::Param(_) => {
            e.kind.clone()
        }
        ExprKind::Load(t, args) => ExprKind::Load(*t, args.iter().map(|a| shift(a, params)).collect()),
        ExprKind::Call(f, args) => ExprKind::Call(*f, args.iter().map(|a| shift(a, params)).collect()),
        ExprKind::Unary(op, a) => ExprKind::Unary(*op, Box::new(shift(a, params))),
        ExprKind::Cast(a) => ExprKind::Cast(Box::new(shift(a, params))),
        ExprKind::Binary(op, a, b) => ExprKind::Binary(*op, Box::new(shift(a, params)), Box::new(shift(b, params))),
        ExprKind::If(c, t, f) => {
            ExprKind::If(Box::new(shift(c, params)), Box::new(shift(t, params)), Box::new(shift(f, params)))
        }
    };
    Expr { ty: e.ty, kind }
}

/// `t` with its `Q_LEN` and `KV_LEN` dims the whole sequence's lengths.
fn whole_dims(t: &TensorDecl, q_len: usize, kv_len: usize) -> TensorDecl {
    fn whole(d: &Dim, q_len: usize, kv_len: usize) -> Dim {
        match d {
            Dim::QLen => Dim::Param(q_len),
            Dim::KvLen => Dim::Param(kv_len),
            Dim::Op(op, a, b) => Dim::Op(*op, Box::new(whole(a, q_len, kv_len)), Box::new(whole(b, q_len, kv_len))),
            other => other.clone(),
        }
    }
    TensorDecl { dims: t.dims.iter().map(|d| whole(d, q_len, kv_len)).collect(), ..t.clone() }
}
