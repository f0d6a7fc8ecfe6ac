//! `flashgen run`: one spec on the GPU on random inputs or the caller's
//! (Q, K, V, captured tensors, dO from `.npy` or raw files), checked against
//! the CPU reference and timed; O, the LSE and with `--backward` the
//! gradients can be written out as `.npy`. Every argument and file is
//! checked before the GPU is looked for.

use crate::arrays;
use crate::{specs, Failure};
use flashgen::codegen::reference::{round_dtype, ParamValue, TensorData};
use flashgen::codegen::{Dtype, ElemTy, Shape, Spec, Ty};
use flashgen::runtime::tile_choice;
use flashgen::runtime::{config_name, ArgValue, Runtime};
use flashgen_tools::verify::{self, DeviceProblem, OperandLayout};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct RunArgs {
    file: PathBuf,
    #[arg(long)]
    spec: Option<String>,
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Query heads, or QUERY/KV heads for GQA and MQA (e.g. 16/4).
    #[arg(long, default_value = "8")]
    heads: String,
    /// Sequence length, or Q/KV lengths (e.g. 1024/2048).
    #[arg(long, default_value = "1024")]
    seq: String,
    /// A runtime param, NAME=VALUE (repeatable).
    #[arg(long = "param")]
    params: Vec<String>,
    /// Load a captured tensor, NAME=PATH (repeatable): `.npy`, or raw
    /// little-endian values of the tensor's element type.
    #[arg(long = "tensor")]
    tensors: Vec<String>,
    /// Q from a file (`.npy` or raw little-endian f32), [batch, q_len,
    /// heads, head_dim] in C order, rounded to the spec's dtype; random if
    /// not given. Likewise --k and --v ([batch, kv_len, kv_heads, d]).
    #[arg(long)]
    q: Option<PathBuf>,
    #[arg(long)]
    k: Option<PathBuf>,
    #[arg(long)]
    v: Option<PathBuf>,
    /// Also run the backward (dQ, dK, dV and tensor gradients) and check it.
    #[arg(long)]
    backward: bool,
    /// dO for --backward, shaped like O ([batch, q_len, heads, v_head_dim]); random if not given.
    #[arg(long = "d-out", requires = "backward")]
    d_out: Option<PathBuf>,
    /// Write o.npy and lse.npy (and with --backward dq, dk, dv and d_NAME.npy
    /// for each trainable tensor NAME) as f32 into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f32>,
    /// Operand layout: bshd, bhsd or padded.
    #[arg(long, default_value = "bshd")]
    layout: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The fewest timed launches: launches fill 100 ms back to back after
    /// 25 ms of warm-up, as triton's do_bench times (median reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

pub fn on_gpu(args: RunArgs) -> Result<bool, Failure> {
    let specs = specs::load(&args.file, args.spec.as_deref())?;
    let [spec] = specs.as_slice() else {
        let names: Vec<String> = specs.iter().map(|s| format!("`{}`", s.name)).collect();
        let file = args.file.display();
        return Err(
            format!("{file} holds {} specs ({}): pick one with --spec NAME", specs.len(), names.join(", ")).into()
        );
    };
    let shape = shape(&args, spec)?;
    if args.iters == 0 {
        return Err(Failure::Message("--iters 0: time at least 1 launch".into()));
    }
    let layout = match args.layout.as_str() {
        "bshd" => OperandLayout::Bshd,
        "bhsd" => OperandLayout::Bhsd,
        "padded" => OperandLayout::Padded,
        other => return Err(format!("unknown layout `{other}`: expected bshd, bhsd or padded").into()),
    };
    let params = param_values(spec, &args.params)?;
    let tensors = tensor_files(spec, &shape, &args.tensors)?;
    let mut problem = verify::random_problem(spec, shape, params, tensors, args.scale, args.seed);
    let (dqk, dv) = (spec.head_dims.qk as usize, spec.head_dims.v as usize);
    let rows = |len: usize, heads: usize, d: usize| shape.batch * len * heads * d;
    let operand = |path: &Option<PathBuf>, len| path.as_deref().map(|p| floats(spec, p, len)).transpose();
    let (q_rows, kv_rows) = (rows(shape.q_len, shape.heads, dqk), rows(shape.kv_len, shape.heads_kv, dqk));
    for (slot, path, len) in [(&mut problem.q, &args.q, q_rows), (&mut problem.k, &args.k, kv_rows)] {
        if let Some(values) = operand(path, len)? {
            *slot = values;
        }
    }
    if let Some(values) = operand(&args.v, rows(shape.kv_len, shape.heads_kv, dv))? {
        problem.v = values;
    }
    let d_out = match operand(&args.d_out, rows(shape.q_len, shape.heads, dv))? {
        Some(values) => values,
        None => verify::random_d_out(spec, shape, args.seed),
    };
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }

    let rt = Runtime::new(0).map_err(|e| e.to_string())?;
    let mut gpu = DeviceProblem::upload(&rt, spec, &problem, layout).map_err(|e| e.to_string())?;
    // The kernel the launch uses: its spec's (the spec, or a param's global
    // columns bounded), in an earlier tuning's choice, else the preferred one.
    let params: Vec<ArgValue> = problem.params.iter().map(|&p| p.into()).collect();
    let kernel_spec = rt.forward_spec(spec, &params);
    let preferred = tile_choice::preferred_for(&kernel_spec, rt.target(), shape.kv_len);
    let (start, before) = (Instant::now(), rt.cache_stats());
    rt.load_forward(&kernel_spec, rt.tuned_config(&kernel_spec, &shape).unwrap_or(preferred))
        .map_err(|e| e.to_string())?;
    let jit_ms = start.elapsed().as_secs_f64() * 1e3;
    let served_by = match rt.cache_stats() {
        after if after.compiles > before.compiles => "NVRTC compile",
        after if after.disk_hits > before.disk_hits => "disk cache hit",
        _ => "memory cache hit",
    };
    gpu.launch(&rt, spec, &problem).map_err(|e| e.to_string())?;
    let out = gpu.download().map_err(|e| e.to_string())?;
    let report = verify::check(spec, &problem, &out).map_err(|e| e.to_string())?;
    let ms = gpu.time(&rt, spec, &problem, args.iters).map_err(|e| e.to_string())?;
    let config = match rt.tuned_config(&kernel_spec, &shape) {
        Some(tuned) => format!("{} (tuned)", config_name(tuned)),
        None => format!("{} (preferred, untuned)", config_name(preferred)),
    };

    println!("{} on {} ({}), {shape:?}, {:?}", spec.name, rt.device_name(), rt.arch(), layout);
    println!("  JIT compile + load: {jit_ms:.0} ms ({served_by})");
    println!("  O:   {}", report.output);
    println!("  LSE: {}", report.lse);
    println!("  kernel: {ms:.3} ms (median over 100 ms of launches), tile config {config}");
    let out_dir = args.out.as_deref();
    let save = |name: &str, dims: &[usize], values: &[f64]| match out_dir {
        Some(dir) => arrays::write_f32(&dir.join(format!("{name}.npy")), dims, values),
        None => Ok(()),
    };
    let Shape { batch, heads, heads_kv, q_len, kv_len } = shape;
    save("o", &[batch, q_len, heads, dv], &out.o)?;
    save("lse", &[batch, heads, q_len], &out.lse)?;
    if !args.backward {
        return Ok(report.passed());
    }
    gpu.launch(&rt, spec, &problem).map_err(|e| e.to_string())?;
    let grads = gpu.backward(&rt, spec, &problem, &d_out, true, true, None).map_err(|e| e.to_string())?;
    let backward = verify::check_backward(spec, &problem, &d_out, &grads).map_err(|e| e.to_string())?;
    println!("  dQ:  {}\n  dK:  {}\n  dV:  {}", backward.dq, backward.dk, backward.dv);
    for (name, check) in &backward.d_tensors {
        println!("  d{name}: {check}");
    }
    save("dq", &[batch, q_len, heads, dqk], &grads.dq)?;
    save("dk", &[batch, kv_len, heads_kv, dqk], &grads.dk)?;
    save("dv", &[batch, kv_len, heads_kv, dv], &grads.dv)?;
    for (decl, grad) in spec.tensors.iter().zip(&grads.d_tensors) {
        if let Some(grad) = grad {
            let dims: Vec<usize> = decl.dims.iter().map(|d| d.resolve(&shape)).collect();
            save(&format!("d_{}", decl.name), &dims, grad)?;
        }
    }
    Ok(report.passed() && backward.passed())
}

/// A float operand of `len` elements from `path`, rounded to the spec's dtype.
fn floats(spec: &Spec, path: &Path, len: usize) -> Result<Vec<f64>, String> {
    match arrays::read(path, ElemTy::F32, len)? {
        TensorData::Float(values) => Ok(values.into_iter().map(|x| round_dtype(spec.dtype, x)).collect()),
        TensorData::I32(_) => Err(format!("{}: integers where Q, K, V or dO need floats", path.display())),
    }
}

/// The most elements an operand of `flashgen run` holds: the f64 inputs
/// and reference live in host memory (8 bytes each, several copies).
const MAX_OPERAND_ELEMENTS: usize = 1 << 32;

/// The problem shape of `--batch`, `--heads` and `--seq`: every size at
/// least 1, query heads a multiple of K/V heads, and no operand of
/// `spec`'s head dims past [`MAX_OPERAND_ELEMENTS`].
fn shape(args: &RunArgs, spec: &Spec) -> Result<Shape, String> {
    let (heads, heads_kv) = pair(&args.heads, "--heads")?;
    let (q_len, kv_len) = pair(&args.seq, "--seq")?;
    if args.batch == 0 {
        return Err("--batch 0: the batch must be at least 1".into());
    }
    if heads % heads_kv != 0 {
        return Err(format!(
            "--heads {}: {heads} query heads cannot share {heads_kv} K/V heads (query heads must be a multiple of K/V heads)",
            args.heads
        ));
    }
    let shape = Shape { batch: args.batch, heads, heads_kv, q_len, kv_len };
    let d = spec.head_dims.qk.max(spec.head_dims.v) as usize;
    let rows = [args.batch, q_len.max(kv_len), heads, d].into_iter().try_fold(1usize, usize::checked_mul);
    let operands = std::iter::once((format!("an operand of head dim {d}"), rows.unwrap_or(usize::MAX)));
    let tensors = spec.tensors.iter().map(|t| (format!("tensor `{}`", t.name), t.len(&shape)));
    match operands.chain(tensors).find(|(_, n)| *n > MAX_OPERAND_ELEMENTS) {
        Some((what, _)) => Err(format!(
            "--batch {} --seq {} --heads {}: {what} would hold more than the {MAX_OPERAND_ELEMENTS} elements \
             `flashgen run` takes (its inputs and f64 reference live in host memory)",
            args.batch, args.seq, args.heads
        )),
        None => Ok(shape),
    }
}

/// Parses `N` or `N/M` (M defaults to N), each at least 1.
fn pair(text: &str, flag: &str) -> Result<(usize, usize), String> {
    let parse = |s: &str| match s.trim().parse::<usize>() {
        Ok(0) => Err(format!("{flag} {text}: sizes must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{flag} {text}: expected N or N/M, e.g. 16 or 16/4")),
    };
    match text.split_once('/') {
        Some((a, b)) => Ok((parse(a)?, parse(b)?)),
        None => parse(text).map(|n| (n, n)),
    }
}

fn param_values(spec: &Spec, given: &[String]) -> Result<Vec<ParamValue>, String> {
    let pairs: Vec<(&str, &str)> = given
        .iter()
        .map(|p| p.split_once('=').ok_or_else(|| format!("--param `{p}`: expected NAME=VALUE")))
        .collect::<Result<_, _>>()?;
    if let Some((name, _)) = pairs.iter().find(|(n, _)| !spec.params.iter().any(|p| p.name == *n)) {
        return Err(format!("{} has no param `{name}`", spec.name));
    }
    spec.params
        .iter()
        .map(|p| {
            let (_, value) = pairs
                .iter()
                .rev()
                .find(|(n, _)| *n == p.name)
                .ok_or_else(|| format!("missing --param {}=<{}>", p.name, p.ty))?;
            let parsed = match p.ty {
                Ty::I32 => value.parse().ok().map(ParamValue::I32),
                _ => value.parse().ok().map(ParamValue::F32),
            };
            parsed.ok_or_else(|| format!("--param {}: `{value}` is not an {}", p.name, p.ty))
        })
        .collect()
}

fn tensor_files(spec: &Spec, shape: &Shape, given: &[String]) -> Result<Vec<Option<TensorData>>, String> {
    let mut tensors = vec![None; spec.tensors.len()];
    for entry in given {
        let (name, path) = entry.split_once('=').ok_or_else(|| format!("--tensor `{entry}`: expected NAME=PATH"))?;
        let slot = spec
            .tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| format!("{} has no tensor `{name}`", spec.name))?;
        let decl = &spec.tensors[slot];
        let data = arrays::read(Path::new(path), decl.elem, decl.len(shape))?;
        let kind_matches = matches!((&data, decl.elem), (TensorData::I32(_), ElemTy::I32))
            || matches!((&data, decl.elem), (TensorData::Float(_), ElemTy::F32 | ElemTy::F16 | ElemTy::Bf16));
        if !kind_matches {
            return Err(format!("{path}: tensor `{name}` holds {} values", decl.elem.name()));
        }
        // Half-precision tensors hold what their element type can: the
        // reference must read the values the GPU reads.
        let dtype = match decl.elem {
            ElemTy::F16 => Some(Dtype::F16),
            ElemTy::Bf16 => Some(Dtype::Bf16),
            _ => None,
        };
        tensors[slot] = Some(match (data, dtype) {
            (TensorData::Float(v), Some(dtype)) => {
                TensorData::Float(v.into_iter().map(|x| round_dtype(dtype, x)).collect())
            }
            (data, _) => data,
        });
    }
    Ok(tensors)
}
