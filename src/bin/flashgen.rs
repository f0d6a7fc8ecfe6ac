//! The `flashgen` command line: emit, NVRTC-check and run `.attn` specs.

use clap::{Parser, Subcommand};
use flashgen::codegen::reference::{ParamValue, TensorData};
use flashgen::codegen::{cuda, ElemTy, Shape, Spec, Ty};
use flashgen::runtime::{compile_cubin, Arch, Runtime};
use flashgen::verify::{self, DeviceProblem, OperandLayout};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "flashgen", version, about = "Fast, exact attention kernels for any attention variant")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the generated CUDA source of every spec in FILE.
    Emit {
        file: PathBuf,
        /// Only this spec of the file.
        #[arg(long)]
        spec: Option<String>,
    },
    /// Compile every spec in FILE with NVRTC (no GPU needed).
    Check {
        file: PathBuf,
        /// Target architecture, e.g. sm_80 or sm_90.
        #[arg(long, default_value = "sm_90")]
        arch: String,
        #[arg(long)]
        spec: Option<String>,
    },
    /// Run a spec on the GPU on random inputs and check it against the CPU reference.
    Run(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
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

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

/// Runs one command; `Ok(false)` is a completed run whose check failed.
fn run(cli: Cli) -> Result<bool, String> {
    match cli.command {
        Command::Emit { file, spec } => {
            for s in load(&file, spec.as_deref())? {
                print!("{}", cuda::emit_forward(&s).source);
            }
            Ok(true)
        }
        Command::Check { file, arch, spec } => {
            let arch: Arch = arch.parse().map_err(|e| format!("{e}"))?;
            for s in load(&file, spec.as_deref())? {
                let kernel = cuda::emit_forward(&s);
                let start = std::time::Instant::now();
                let cubin = compile_cubin(&kernel, arch).map_err(|e| format!("{}: {e}", s.name))?;
                println!(
                    "{}: compiled {} for {arch} in {:.0} ms ({} bytes of CUBIN)",
                    s.name,
                    kernel.name,
                    start.elapsed().as_secs_f64() * 1e3,
                    cubin.len()
                );
            }
            Ok(true)
        }
        Command::Run(args) => run_on_gpu(args),
    }
}

fn load(file: &Path, only: Option<&str>) -> Result<Vec<Spec>, String> {
    let source = std::fs::read_to_string(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let specs = flashgen::parse_str(&source).map_err(|e| e.render(&file.display().to_string(), &source))?;
    match only {
        None => Ok(specs),
        Some(name) => match specs.into_iter().find(|s| s.name == name) {
            Some(s) => Ok(vec![s]),
            None => Err(format!("{} has no spec named `{name}`", file.display())),
        },
    }
}

fn run_on_gpu(args: RunArgs) -> Result<bool, String> {
    let specs = load(&args.file, args.spec.as_deref())?;
    let [spec] = specs.as_slice() else {
        return Err(format!("{} holds {} specs: pick one with --spec NAME", args.file.display(), specs.len()));
    };
    let (heads, heads_kv) = pair(&args.heads, "--heads")?;
    let (q_len, kv_len) = pair(&args.seq, "--seq")?;
    let shape = Shape { batch: args.batch, heads, heads_kv, q_len, kv_len };
    let layout = match args.layout.as_str() {
        "bshd" => OperandLayout::Bshd,
        "bhsd" => OperandLayout::Bhsd,
        "padded" => OperandLayout::Padded,
        other => return Err(format!("unknown layout `{other}`: expected bshd, bhsd or padded")),
    };
    let params = param_values(spec, &args.params)?;
    let tensors = tensor_files(spec, &args.tensors)?;

    let rt = Runtime::new(0).map_err(|e| e.to_string())?;
    let problem = verify::random_problem(spec, shape, params, tensors, args.scale, args.seed);
    let mut gpu = DeviceProblem::upload(&rt, spec, &problem, layout).map_err(|e| e.to_string())?;
    let start = std::time::Instant::now();
    rt.load(spec).map_err(|e| e.to_string())?;
    let jit_ms = start.elapsed().as_secs_f64() * 1e3;
    gpu.launch(&rt, spec, &problem).map_err(|e| e.to_string())?;
    let out = gpu.download().map_err(|e| e.to_string())?;
    let report = verify::check(spec, &problem, &out).map_err(|e| e.to_string())?;
    let ms = gpu.time(&rt, spec, &problem, 3, args.iters).map_err(|e| e.to_string())?;

    println!("{} on {} ({}), {shape:?}, {:?}", spec.name, rt.device_name(), rt.arch(), layout);
    println!("  JIT compile + load: {jit_ms:.0} ms");
    println!("  O:   {}", report.output);
    println!("  LSE: {}", report.lse);
    println!("  kernel: {ms:.3} ms (median of {})", args.iters);
    Ok(report.passed())
}

/// Parses `N` or `N/M` (M defaults to N).
fn pair(text: &str, flag: &str) -> Result<(usize, usize), String> {
    let parse = |s: &str| s.trim().parse::<usize>().map_err(|_| format!("{flag}: `{text}` is not N or N/M"));
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
