//! Random well-typed specs, as text: masks, scores and sinks of bounded
//! depth over every operator, builtin, cast, param and tensor kind the
//! language has, at random dtypes and head dims. Every one must parse, check, emit and
//! compile for every kernel, and agree with the f64 reference on the GPU
//! (`tools/tests/random_specs.rs`, `tools/tests/gpu_random_specs.rs`).
//!
//! i32 expressions use every operator freely (the language defines them all:
//! wrapping, shifts by the low 5 bits, division by zero gives 0, indices are
//! clamped). f32 expressions are drawn so that they stay finite — logarithms,
//! roots and divisors get non-negative or non-zero arguments and
//! exponentials bounded ones — so that a kernel and the reference are
//! compared on numbers, not on how each spells an infinity.

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::Rng;

/// A drawn spec's text and the values its params should run with.
pub struct DrawnSpec {
    pub source: String,
    /// Per declared param, in order: i32 params in `-64..=64`, f32 ones in
    /// `[-2, 2]`.
    pub params: Vec<flashgen::codegen::reference::ParamValue>,
}

#[derive(Clone, Copy, PartialEq)]
enum Ty {
    I32,
    F32,
    Bool,
}

struct Tensor {
    name: String,
    elem: &'static str,
    dims: Vec<&'static str>,
}

/// What an expression may name: the params and tensors of the spec, the
/// built-ins its field allows, and `score` in the score expression.
struct Scope<'a> {
    int_params: &'a [String],
    float_params: &'a [String],
    tensors: &'a [Tensor],
    field: Field,
}

/// The spec field an expression is drawn for.
#[derive(Clone, Copy, PartialEq)]
enum Field {
    Mask,
    Score,
    /// Over `b`, `h`, params and tensors only.
    Sink,
}

impl Scope<'_> {
    /// An i32 built-in the field may name.
    fn builtin(&self, rng: &mut StdRng) -> String {
        let names: &[&str] = match self.field {
            Field::Sink => &INT_BUILTINS[..2],
            _ => &INT_BUILTINS,
        };
        names.choose(rng).copied().unwrap_or("b").to_string()
    }
}

const INT_BUILTINS: [&str; 6] = ["b", "h", "q", "k", "q_len", "kv_len"];
const DIMS: [&str; 6] = ["B", "H", "H_KV", "Q_LEN", "KV_LEN", "8"];

/// Draws spec number `n` (its name) from `rng`.
pub fn random_spec(rng: &mut StdRng, n: usize) -> DrawnSpec {
    let dtype = ["bf16", "f16"].choose(rng).copied().unwrap_or("bf16");
    // Above 128 the Hopper forward's wide tiles and the backward's column
    // parts (DP + DVP > 384) run.
    let head_dim = [16, 32, 64, 80, 128, 160, 256].choose(rng).copied().unwrap_or(64);
    let mut fields = vec![format!("dtype: {dtype}"), format!("head_dim: {head_dim}")];
    if rng.random_bool(0.2) {
        fields.push(format!("v_head_dim: {}", [32, 64, 128].choose(rng).copied().unwrap_or(64)));
    }
    let (mut int_params, mut float_params, mut params) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..rng.random_range(0..=2) {
        let name = format!("p{i}");
        if rng.random_bool(0.5) {
            fields.push(format!("param {name}: i32"));
            params.push(flashgen::codegen::reference::ParamValue::I32(rng.random_range(-64..=64)));
            int_params.push(name);
        } else {
            fields.push(format!("param {name}: f32"));
            params.push(flashgen::codegen::reference::ParamValue::F32(rng.random_range(-2.0..=2.0)));
            float_params.push(name);
        }
    }
    let tensors: Vec<Tensor> = (0..rng.random_range(0..=2))
        .map(|i| Tensor {
            name: format!("t{i}"),
            elem: ["i32", "f32", "f16", "bf16"].choose(rng).copied().unwrap_or("f32"),
            dims: (0..rng.random_range(1..=3)).map(|_| DIMS.choose(rng).copied().unwrap_or("H")).collect(),
        })
        .collect();
    for t in &tensors {
        fields.push(format!("tensor {}: {}[{}]", t.name, t.elem, t.dims.join(", ")));
    }
    let mut scope =
        Scope { int_params: &int_params, float_params: &float_params, tensors: &tensors, field: Field::Mask };
    if rng.random_bool(0.8) {
        let mask = expr(rng, &scope, Ty::Bool, 4);
        // A quarter of masks keep global columns (attention sinks) beside
        // the drawn rest: the forward's column tile, where it applies.
        let mask = match rng.random_bool(0.25) {
            true => format!("k < {} || ({mask})", global_columns(rng, &scope)),
            false => mask,
        };
        fields.push(format!("mask: {mask}"));
    }
    scope.field = Field::Score;
    if rng.random_bool(0.8) {
        fields.push(format!("score: score + {}", expr(rng, &scope, Ty::F32, 4)));
    }
    scope.field = Field::Sink;
    if rng.random_bool(0.3) {
        fields.push(format!("sink: {}", expr(rng, &scope, Ty::F32, 3)));
    }
    DrawnSpec { source: format!("Drawn{n} {{\n    {},\n}}\n", fields.join(",\n    ")), params }
}

/// The end of a mask's global columns: an i32 param where the spec has one
/// (its values reach past a column tile and below zero), else a literal.
fn global_columns(rng: &mut StdRng, scope: &Scope) -> String {
    match scope.int_params.choose(rng) {
        Some(param) if rng.random_bool(0.5) => param.clone(),
        _ => rng.random_range(1..=40).to_string(),
    }
}

/// An expression of type `ty`, at most `depth` operators deep.
fn expr(rng: &mut StdRng, scope: &Scope, ty: Ty, depth: u32) -> String {
    if depth == 0 || rng.random_bool(0.25) {
        return leaf(rng, scope, ty);
    }
    let d = depth - 1;
    match ty {
        Ty::I32 => int_expr(rng, scope, d),
        Ty::F32 => float_expr(rng, scope, d),
        Ty::Bool => bool_expr(rng, scope, d),
    }
}

fn leaf(rng: &mut StdRng, scope: &Scope, ty: Ty) -> String {
    let read = |rng: &mut StdRng, kinds: &[&str]| {
        let tensors: Vec<&Tensor> = scope.tensors.iter().filter(|t| kinds.contains(&t.elem)).collect();
        let tensor = tensors.choose(rng)?;
        // Indices read no tensor: a chain of reads nests without bound.
        let index = |rng: &mut StdRng| match rng.random_range(0..3) {
            0 => rng.random_range(-4..=20).to_string(),
            _ => scope.builtin(rng),
        };
        let indices: Vec<String> = tensor.dims.iter().map(|_| format!("[{}]", index(rng))).collect();
        Some(format!("{}{}", tensor.name, indices.concat()))
    };
    match ty {
        Ty::I32 => match rng.random_range(0..4) {
            0 => rng.random_range(-40..=40).to_string(),
            1 => scope.int_params.choose(rng).cloned().unwrap_or_else(|| scope.builtin(rng)),
            2 => read(rng, &["i32"]).unwrap_or_else(|| scope.builtin(rng)),
            _ => scope.builtin(rng),
        },
        Ty::F32 => match rng.random_range(0..4) {
            0 => format!("{:.2}", rng.random_range(-4.0..4.0f32)),
            1 => scope.float_params.choose(rng).cloned().unwrap_or_else(|| "0.5".into()),
            2 => read(rng, &["f32", "f16", "bf16"]).unwrap_or_else(|| "1.5".into()),
            _ if scope.field == Field::Score => "score".into(),
            _ => format!("({} as f32)", leaf(rng, scope, Ty::I32)),
        },
        Ty::Bool => {
            let op = ["<", "<=", ">", ">=", "==", "!="].choose(rng).copied().unwrap_or("<");
            format!("{} {op} {}", leaf(rng, scope, Ty::I32), leaf(rng, scope, Ty::I32))
        }
    }
}

fn int_expr(rng: &mut StdRng, scope: &Scope, d: u32) -> String {
    let sub = |rng: &mut StdRng| expr(rng, scope, Ty::I32, d);
    match rng.random_range(0..7) {
        0 | 1 => {
            let op = ["+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>"].choose(rng).copied().unwrap_or("+");
            format!("({} {op} {})", sub(rng), sub(rng))
        }
        2 => format!("{}({})", ["-", "!"].choose(rng).copied().unwrap_or("-"), sub(rng)),
        3 => {
            let f = ["min", "max", "rem_euclid", "div_euclid"].choose(rng).copied().unwrap_or("min");
            format!("{f}({}, {})", sub(rng), sub(rng))
        }
        4 => format!("{}({})", ["abs"].choose(rng).copied().unwrap_or("abs"), sub(rng)),
        5 => format!("clamp({}, {}, {})", sub(rng), sub(rng), sub(rng)),
        _ => {
            let cond = expr(rng, scope, Ty::Bool, d);
            format!("(if {cond} {{ {} }} else {{ {} }})", sub(rng), sub(rng))
        }
    }
}

/// A finite f32 expression (see the module note).
fn float_expr(rng: &mut StdRng, scope: &Scope, d: u32) -> String {
    let sub = |rng: &mut StdRng| expr(rng, scope, Ty::F32, d);
    match rng.random_range(0..9) {
        0 => format!("({} {} {})", sub(rng), ["+", "-", "*"].choose(rng).copied().unwrap_or("+"), sub(rng)),
        1 => format!("({} / (abs({}) + 1.0))", sub(rng), sub(rng)),
        2 => {
            format!("{}({})", ["tanh", "sigmoid", "floor", "abs", "-"].choose(rng).copied().unwrap_or("tanh"), sub(rng))
        }
        3 => format!("{}(abs({}) + 0.5)", ["log", "log2", "sqrt"].choose(rng).copied().unwrap_or("log"), sub(rng)),
        4 => format!("{}(tanh({}))", ["exp", "exp2"].choose(rng).copied().unwrap_or("exp"), sub(rng)),
        5 => format!("{}({}, {})", ["min", "max"].choose(rng).copied().unwrap_or("min"), sub(rng), sub(rng)),
        6 => format!("clamp({}, -3.0, 3.0)", sub(rng)),
        7 => format!("(clamp({}, -1000, 1000) as f32)", expr(rng, scope, Ty::I32, d)),
        _ => {
            let cond = expr(rng, scope, Ty::Bool, d);
            format!("(if {cond} {{ {} }} else {{ {} }})", sub(rng), sub(rng))
        }
    }
}

fn bool_expr(rng: &mut StdRng, scope: &Scope, d: u32) -> String {
    match rng.random_range(0..5) {
        0 | 1 => {
            let op = ["<", "<=", ">", ">=", "==", "!="].choose(rng).copied().unwrap_or("<");
            format!("{} {op} {}", expr(rng, scope, Ty::I32, d), expr(rng, scope, Ty::I32, d))
        }
        2 => {
            let op = ["<", ">"].choose(rng).copied().unwrap_or("<");
            format!("{} {op} {}", expr(rng, scope, Ty::F32, d), expr(rng, scope, Ty::F32, d))
        }
        3 => {
            let op = ["&&", "||"].choose(rng).copied().unwrap_or("&&");
            format!("({} {op} {})", expr(rng, scope, Ty::Bool, d), expr(rng, scope, Ty::Bool, d))
        }
        _ => format!("!({})", expr(rng, scope, Ty::Bool, d)),
    }
}
