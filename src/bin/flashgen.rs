//! The `flashgen` command line: emit, NVRTC-check, precompile and run `.attn`
//! specs, and manage the kernel cache.

use clap::{Parser, Subcommand};
use flashgen::codegen::cuda::{self, TileConfig};
use flashgen::codegen::reference::{ParamValue, TensorData};
use flashgen::codegen::{ElemTy, Shape, Spec, Ty};
use flashgen::runtime::{compile_cubin, config_name, Arch, DiskCache, Error, KernelSet, Runtime};
use flashgen::verify::{self, DeviceProblem, OperandLayout};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Instant, SystemTime};

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
        /// The kernel the runtime would use on this architecture (e.g. sm_90:
        /// Hopper's wgmma) instead of the portable one.
        #[arg(long)]
        arch: Option<String>,
        /// The kernel of this tile configuration, named as tuning reports name
        /// them (e.g. wgmma.w12.m1.n128); one of the architecture's candidates.
        #[arg(long, requires = "arch")]
        config: Option<String>,
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
    /// Compile every spec in the FILEs into the kernel cache (no GPU needed).
    Precompile {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Target architecture, e.g. sm_90 (repeatable).
        #[arg(long = "arch", required = true)]
        archs: Vec<String>,
        /// Also the backward kernels (for training).
        #[arg(long)]
        backward: bool,
    },
    /// Inspect or empty the kernel cache (compiled kernels and autotuning records).
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Run a spec on the GPU on random inputs and check it against the CPU reference.
    Run(RunArgs),
}

#[derive(Subcommand)]
enum CacheAction {
    /// Every kernel and tuning record with its size and age, most recently used first.
    List,
    /// Delete every kernel and tuning record.
    Clear,
    /// Kernel and tuning record counts, sizes, the size cap and the directory.
    Stats,
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
        Command::Emit { file, spec, arch, config } => {
            let arch: Option<Arch> = arch.map(|a| a.parse()).transpose().map_err(|e| format!("{e}"))?;
            for s in load(&file, spec.as_deref())? {
                let config = match (arch, &config) {
                    (Some(a), Some(name)) => named_config(&s, a, name)?,
                    (Some(a), None) => TileConfig::preferred(&s, a.target()),
                    (None, _) => TileConfig::default_for(&s),
                };
                print!("{}", cuda::emit_forward_with(&s, config).source);
            }
            Ok(true)
        }
        Command::Check { file, arch, spec } => {
            let arch: Arch = arch.parse().map_err(|e| format!("{e}"))?;
            for s in load(&file, spec.as_deref())? {
                let kernel = cuda::emit_forward_with(&s, TileConfig::preferred(&s, arch.target()));
                let start = Instant::now();
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
        Command::Precompile { files, archs, backward } => {
            precompile(&files, &archs, if backward { KernelSet::Training } else { KernelSet::Inference })
        }
        Command::Cache { action } => cache(action),
        Command::Run(args) => run_on_gpu(args),
    }
}

fn precompile(files: &[PathBuf], archs: &[String], set: KernelSet) -> Result<bool, String> {
    let archs: Vec<Arch> = archs.iter().map(|a| a.parse()).collect::<Result<_, Error>>().map_err(|e| e.to_string())?;
    let specs: Vec<Spec> = files.iter().map(|f| load(f, None)).collect::<Result<Vec<_>, _>>()?.concat();
    let cache = disk_cache()?;
    // A live counter for people; logs and pipes get only the summary.
    let tty = std::io::stderr().is_terminal();
    let progress = |done: usize, total: usize| {
        if tty {
            eprint!("\rprecompiling: {done}/{total} kernels");
        }
    };
    let start = Instant::now();
    let report = cache.precompile(&specs, &archs, set, &progress);
    if tty {
        eprintln!();
    }
    let report = report.map_err(|e| e.to_string())?;
    let archs: Vec<String> = archs.iter().map(Arch::to_string).collect();
    println!(
        "{} kernel(s) of {} spec(s) for {}: {} compiled, {} already cached, in {:.1} s ({})",
        report.kernels,
        specs.len(),
        archs.join(", "),
        report.compiled,
        report.cached,
        start.elapsed().as_secs_f64(),
        cache.dir().display()
    );
    Ok(true)
}

fn cache(action: CacheAction) -> Result<bool, String> {
    let cache = disk_cache()?;
    let io_error = |e: std::io::Error| format!("kernel cache at {}: {e}", cache.dir().display());
    match action {
        CacheAction::List => {
            // Tuning records by their path in the cache: `tuning/<key>.txt`.
            let tunings = cache.tunings().map_err(io_error)?.into_iter().map(|e| (Path::new("tuning"), e));
            let mut entries: Vec<_> =
                cache.entries().map_err(io_error)?.into_iter().map(|e| (Path::new(""), e)).collect();
            entries.extend(tunings);
            entries.sort_by_key(|(_, e)| std::cmp::Reverse(e.modified));
            let now = SystemTime::now();
            for (dir, e) in entries {
                let name = dir.join(e.path.file_name().unwrap_or_default());
                let age = now.duration_since(e.modified).unwrap_or_default().as_secs();
                let age = format!("{} ago", human_age(age));
                println!("{}  {:>10}  {age:>8}", name.display(), human_bytes(e.bytes));
            }
        }
        CacheAction::Clear => {
            let removed = cache.clear().map_err(io_error)?;
            println!(
                "removed {} kernels and {} tuning records from {}",
                removed.kernels,
                removed.tunings,
                cache.dir().display()
            );
        }
        CacheAction::Stats => {
            let entries = cache.entries().map_err(io_error)?;
            let total: u64 = entries.iter().map(|e| e.bytes).sum();
            let tunings = cache.tunings().map_err(io_error)?;
            println!("entries: {}", entries.len());
            println!("total:   {} ({total} bytes)", human_bytes(total));
            println!("limit:   {}", human_bytes(cache.max_bytes()));
            println!("tuning:  {} records ({})", tunings.len(), human_bytes(tunings.iter().map(|e| e.bytes).sum()));
            println!("dir:     {}", cache.dir().display());
        }
    }
    Ok(true)
}

fn disk_cache() -> Result<DiskCache, String> {
    DiskCache::from_env().ok_or_else(|| Error::CacheDisabled.to_string())
}

fn human_bytes(bytes: u64) -> String {
    match bytes {
        0..1024 => format!("{bytes} B"),
        1024..0x10_0000 => format!("{:.1} KiB", bytes as f64 / 1024.0),
        _ => format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64),
    }
}

fn human_age(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

/// The candidate tile configuration of `spec` on `arch` called `name`.
fn named_config(spec: &Spec, arch: Arch, name: &str) -> Result<TileConfig, String> {
    let candidates = TileConfig::candidates(spec, arch.target());
    candidates.iter().copied().find(|&c| config_name(c) == name).ok_or_else(|| {
        let names: Vec<String> = candidates.into_iter().map(config_name).collect();
        format!("{}: no tile configuration `{name}` on {arch}; its candidates: {}", spec.name, names.join(", "))
    })
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
    let preferred = TileConfig::preferred_for(spec, rt.target(), shape.kv_len);
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
