//! `flashgen run`: one spec on the GPU on random (or captured) inputs,
//! checked against the CPU reference and timed. Every argument is checked
//! before the GPU is looked for.

use crate::{specs, Failure};
use flashgen::codegen::reference::{ParamValue, TensorData};
use flashgen::codegen::{ElemTy, Shape, Spec, Ty};
use flashgen::runtime::tile_choice;
use flashgen::runtime::{config_name, Runtime};
use flashgen_tools::verify::{self, DeviceProblem, OperandLayout};
use std::path::PathBuf;
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
    /// Load a captured tensor from a raw little-endian file, NAME=PATH (repeatable).
    #[arg(long = "tensor")]
    tensors: Vec<String>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f32>,
    /// Operand layout: bshd, bhsd or padded.
    #[arg(long, default_value = "bshd")]
    layout: String,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Timed launches (median reported).
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
    let shape = shape(&args)?;
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
    let tensors = tensor_files(spec, &args.tensors)?;

    let rt = Runtime::new(0).map_err(|e| e.to_string())?;
    let problem = verify::random_problem(spec, shape, params, tensors, args.scale, args.seed);
    let mut gpu = DeviceProblem::upload(&rt, spec, &problem, layout).map_err(|e| e.to_string())?;
    let preferred = tile_choice::preferred_for(spec, rt.target(), shape.kv_len);
    let (start, before) = (Instant::now(), rt.cache_stats());
    // The kernel the launch uses: an earlier tuning's choice, else the preferred one.
    rt.load_forward(spec, rt.tuned_config(spec, &shape).unwrap_or(preferred)).map_err(|e| e.to_string())?;
    let jit_ms = start.elapsed().as_secs_f64() * 1e3;
    let served_by = match rt.cache_stats() {
        after if after.compiles > before.compiles => "NVRTC compile",
        after if after.disk_hits > before.disk_hits => "disk cache hit",
        _ => "memory cache hit",
    };
    gpu.launch(&rt, spec, &problem).map_err(|e| e.to_string())?;
    let out = gpu.download().map_err(|e| e.to_string())?;
    let report = verify::check(spec, &problem, &out).map_err(|e| e.to_string())?;
    let ms = gpu.time(&rt, spec, &problem, 3, args.iters).map_err(|e| e.to_string())?;
    let config = match rt.tuned_config(spec, &shape) {
        Some(tuned) => format!("{} (tuned)", config_name(tuned)),
        None => format!("{} (preferred, untuned)", config_name(preferred)),
    };

    println!("{} on {} ({}), {shape:?}, {:?}", spec.name, rt.device_name(), rt.arch(), layout);
    println!("  JIT compile + load: {jit_ms:.0} ms ({served_by})");
    println!("  O:   {}", report.output);
    println!("  LSE: {}", report.lse);
    println!("  kernel: {ms:.3} ms (median of {}), tile config {config}", args.iters);
    Ok(report.passed())
}

/// The problem shape of `--batch`, `--heads` and `--seq`: every size at
/// least 1, and query heads a multiple of K/V heads.
fn shape(args: &RunArgs) -> Result<Shape, String> {
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
    Ok(Shape { batch: args.batch, heads, heads_kv, q_len, kv_len })
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

fn tensor_files(spec: &Spec, given: &[String]) -> Result<Vec<Option<TensorData>>, String> {
    let mut tensors = vec![None; spec.tensors.len()];
    for entry in given {
        let (name, path) = entry.split_once('=').ok_or_else(|| format!("--tensor `{entry}`: expected NAME=PATH"))?;
        let slot = spec
            .tensors
            .iter()
            .position(|t| t.name == name)
            .ok_or_else(|| format!("{} has no tensor `{name}`", spec.name))?;
        let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        let elem = spec.tensors[slot].elem;
        if bytes.len() % elem.size_bytes() != 0 {
            return Err(format!("{path}: {} bytes is not a whole number of {} elements", bytes.len(), elem.name()));
        }
        let words = bytes.chunks_exact(elem.size_bytes());
        tensors[slot] = Some(match elem {
            ElemTy::I32 => TensorData::I32(words.map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect()),
            ElemTy::F32 => {
                TensorData::Float(words.map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]) as f64).collect())
            }
            ElemTy::F16 => {
                TensorData::Float(words.map(|w| flashgen::half::f16::from_le_bytes([w[0], w[1]]).to_f64()).collect())
            }
            ElemTy::Bf16 => {
                TensorData::Float(words.map(|w| flashgen::half::bf16::from_le_bytes([w[0], w[1]]).to_f64()).collect())
            }
        });
    }
    Ok(tensors)
}
