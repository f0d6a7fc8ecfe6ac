//! The kernel cache on disk: `precompile` fills it, `cache list|clear|stats`
//! inspects and empties it.

use crate::{specs, Failure};
use clap::Subcommand;
use flashgen::codegen::Spec;
use flashgen::runtime::{Arch, DiskCache, Error, KernelSet};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

#[derive(Subcommand)]
pub enum CacheAction {
    /// Every kernel and tuning record with its size and age, most recently used first.
    List,
    /// Delete every kernel and tuning record.
    Clear,
    /// Kernel and tuning record counts, sizes, the size cap and the directory.
    Stats,
}

pub fn precompile(files: &[PathBuf], archs: &[String], set: KernelSet) -> Result<bool, Failure> {
    let archs: Vec<Arch> = archs.iter().map(|a| specs::arch(a)).collect::<Result<_, _>>()?;
    let specs: Vec<Spec> = files.iter().map(|f| specs::load(f, None)).collect::<Result<Vec<_>, _>>()?.concat();
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
    let report = report.map_err(|e| specs::arch_error(&e).unwrap_or_else(|| e.to_string()))?;
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

pub fn run(action: CacheAction) -> Result<bool, String> {
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
