//! The `flashgen` command line: emit, NVRTC-check, precompile and run `.attn`
//! specs, and manage the kernel cache.

mod arrays;
mod cache;
mod check;
mod run;
mod specs;

use clap::{Parser, Subcommand};
use flashgen::codegen::cuda::{self, BackwardConfig, BackwardPass, TileConfig, TileCopy};
use flashgen::runtime::tile_choice;
use flashgen::runtime::{config_name, KernelSet};
use std::path::PathBuf;
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
        /// The kernel the runtime would use on this architecture (e.g. sm_90:
        /// Hopper's wgmma) instead of the portable one.
        #[arg(long)]
        arch: Option<String>,
        /// The kernel of this tile configuration, named as tuning reports name
        /// them (e.g. wgmma.w12.m1.n128); one of the architecture's candidates.
        #[arg(long, requires = "arch")]
        config: Option<String>,
        /// With clock64() trace points, for scripts/trace/harness.cu (see
        /// scripts/gpu-trace-pack.sh); needs a warp-specialized --config
        /// (e.g. --arch sm_90 --config wgmma.w8.m1.n128).
        #[arg(long, requires = "config")]
        trace: bool,
        /// The varlen kernel, on packed sequences (Runtime::forward_varlen).
        #[arg(long, conflicts_with = "trace")]
        varlen: bool,
        /// The paged kernel, over paged K/V caches (Runtime::forward_paged).
        #[arg(long, conflicts_with_all = ["trace", "varlen"])]
        paged: bool,
        /// One backward kernel instead of the forward, in the configuration
        /// the runtime takes without tuning (for --arch) for 16k queries.
        #[arg(long, value_enum, conflicts_with_all = ["config", "trace", "paged"])]
        backward: Option<Pass>,
    },
    /// Compile every spec in FILE with NVRTC (no GPU needed), warning of
    /// tensor indices that may leave their dimension (they are clamped).
    Check {
        file: PathBuf,
        /// Target architecture, sm_80 or newer (e.g. sm_80 or sm_90).
        #[arg(long, default_value = "sm_90")]
        arch: String,
        #[arg(long)]
        spec: Option<String>,
        /// Every kernel a launch may use (every tile configuration, varlen,
        /// block mask, backward), not only the untuned forward.
        #[arg(long)]
        all: bool,
    },
    /// Compile every spec in the FILEs into the kernel cache (no GPU needed).
    Precompile {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Target architecture, sm_80 or newer (repeatable).
        #[arg(long = "arch", required = true)]
        archs: Vec<String>,
        /// Also the backward kernels (for training).
        #[arg(long)]
        backward: bool,
    },
    /// Inspect or empty the kernel cache (compiled kernels and autotuning records).
    Cache {
        #[command(subcommand)]
        action: cache::CacheAction,
    },
    /// Run a spec on the GPU on random inputs and check it against the CPU reference.
    Run(Box<run::RunArgs>),
}

/// The query count `emit --backward` chooses its configuration for: long
/// enough that no short-sequence tile applies.
const EMITTED_BACKWARD_QUERIES: usize = 16384;

/// A backward kernel, as `emit --backward` names it.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Pass {
    Preprocess,
    KeyValue,
    Query,
    Postprocess,
}

impl From<Pass> for BackwardPass {
    fn from(pass: Pass) -> Self {
        match pass {
            Pass::Preprocess => BackwardPass::Preprocess,
            Pass::KeyValue => BackwardPass::KeyValue,
            Pass::Query => BackwardPass::Query,
            Pass::Postprocess => BackwardPass::Postprocess,
        }
    }
}

/// Why a command failed.
enum Failure {
    /// A message, printed after `error: `.
    Message(String),
    /// A spec error rendered rustc-style (`file:line:col: error: ...` and
    /// the source line), printed as it is.
    Rendered(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Message(message)
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(failure) => {
            match failure {
                Failure::Message(message) => eprintln!("error: {message}"),
                Failure::Rendered(diagnostic) => eprintln!("{diagnostic}"),
            }
            ExitCode::from(2)
        }
    }
}

/// Runs one command; `Ok(false)` is a completed run whose check failed.
fn run(cli: Cli) -> Result<bool, Failure> {
    match cli.command {
        Command::Emit { file, spec, arch, config, trace, varlen, paged, backward } => {
            let arch = arch.as_deref().map(specs::arch).transpose()?;
            for s in specs::load(&file, spec.as_deref())? {
                let (qk, v, max) = (s.head_dims.qk, s.head_dims.v, flashgen::codegen::MAX_HEAD_DIM);
                if qk.max(v) > max {
                    let why = format!(
                        "{}: head dims {qk}/{v}: the forward takes up to {max}; `check` compiles its decode kernels",
                        s.name
                    );
                    return Err(why.into());
                }
                if let Some(pass) = backward {
                    let config = match arch {
                        Some(a) => BackwardConfig::preferred_for(&s, a.target(), EMITTED_BACKWARD_QUERIES),
                        None => BackwardConfig::default_for(&s),
                    }
                    .for_pass(pass.into());
                    let kernel = match varlen {
                        true => cuda::emit_backward_varlen(&s, pass.into(), config),
                        false => cuda::emit_backward_with(&s, pass.into(), config),
                    };
                    print!("{}", kernel.source);
                    continue;
                }
                let config = match (arch, &config) {
                    (Some(a), Some(name)) => specs::named_config(&s, a, name)?,
                    (Some(a), None) => tile_choice::preferred(&s, a.target()),
                    (None, _) => TileConfig::default_for(&s),
                };
                let kernel = match trace {
                    // The trace points are the producer's and the consumers' events.
                    true => cuda::emit_forward_traced(&s, config, TileCopy::Tma).ok_or_else(|| {
                        format!(
                            "--trace needs a warp-specialized --config (wgmma.w4/w8/w12 with 128-key tiles on sm_90); \
                             {} is not one",
                            config_name(config)
                        )
                    })?,
                    false if varlen => cuda::emit_forward_varlen(&s, config, TileCopy::Tma),
                    false if paged => cuda::emit_forward_paged(&s, config, TileCopy::Tma),
                    false => cuda::emit_forward_with(&s, config),
                };
                print!("{}", kernel.source);
            }
            Ok(true)
        }
        Command::Check { file, arch, spec, all } => check::run(&file, &arch, spec.as_deref(), all),
        Command::Precompile { files, archs, backward } => {
            cache::precompile(&files, &archs, if backward { KernelSet::Training } else { KernelSet::Inference })
        }
        Command::Cache { action } => Ok(cache::run(action)?),
        Command::Run(args) => run::on_gpu(*args),
    }
}
