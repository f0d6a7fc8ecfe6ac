//! The on-disk CUBIN cache: a kernel compiled once on a machine is not
//! compiled again, by any process, until its source, the NVRTC options, the
//! NVRTC version, the arch or the codegen version change (all are in the key).
//!
//! One file per kernel, `<key>.cubin`: a header (magic, format version, key,
//! payload length, payload checksum) followed by the CUBIN. Writers go through
//! a temp file and a rename, so readers see a whole entry or none; an entry
//! that fails validation (a crash, a full disk, bit rot) is deleted and
//! recompiled, never loaded. The directory is kept under a size cap by
//! evicting the least recently used entries; hits touch their file's mtime.
//! Cache I/O never fails a launch: the kernel is compiled as if there were no
//! cache, with one warning on stderr per process.
//!
//! Autotuning's remembered choices live next to the kernels, in the
//! `tuning/` subdirectory (see `crate::tuning`): small text files outside
//! the size cap, removed by [`DiskCache::clear`] with the kernels.

use crate::arch::Arch;
use crate::atomic_file::{remove_if_present, write_atomic, TEMP_EXTENSION};
use crate::compile_lock::{lock_entry, WAIT_LIMIT};
use crate::error::Error;
use crate::kernels::{KernelSet, Which};
use crate::nvrtc::{compile_cubin, nvrtc_version, options};
use crate::stable_hash::Fnv1a;
use flashgen_codegen::abi::Kernel;
use flashgen_codegen::parallel;
use flashgen_codegen::{Spec, CODEGEN_VERSION};
use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Once;
use std::time::{Duration, SystemTime};

/// `off` (or `0`) disables the disk cache; anything else leaves it on.
pub const CACHE_ENV: &str = "FLASHGEN_CACHE";
/// The cache directory; defaults to `$XDG_CACHE_HOME/flashgen`, else `$HOME/.cache/flashgen`.
pub const CACHE_DIR_ENV: &str = "FLASHGEN_CACHE_DIR";
/// The size cap in bytes; defaults to [`DEFAULT_MAX_BYTES`].
pub const CACHE_MAX_BYTES_ENV: &str = "FLASHGEN_CACHE_MAX_BYTES";
pub const DEFAULT_MAX_BYTES: u64 = 512 << 20;

const MAGIC: &[u8; 8] = b"FGCUBIN\0";
/// Bump when the header layout changes; old entries then fail validation.
const FORMAT_VERSION: u32 = 1;
/// Magic, format version, key, payload length, payload checksum.
const HEADER_LEN: usize = 8 + 4 + 16 + 8 + 16;
const EXTENSION: &str = "cubin";
/// Compile locks: `locks/<key>.lock` (see `crate::compile_lock`).
const LOCK_EXTENSION: &str = "lock";
/// Tuning records: `tuning/<key>.txt`.
pub(crate) const TUNING_EXTENSION: &str = "txt";
/// Temp files this old were left by a crashed writer.
const STALE_TEMP: Duration = Duration::from_secs(3600);

/// The disk cache key of one kernel compiled for one arch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EntryKey(u128);

impl EntryKey {
    /// Shapes, strides and param values are kernel arguments, so they are
    /// not in the key: only the generated source, the NVRTC options (from
    /// `arch`), the NVRTC version and the codegen version are.
    pub fn new(kernel: &Kernel, arch: Arch) -> Result<EntryKey, Error> {
        Ok(Self::from_parts(&kernel.source, &options(arch), nvrtc_version()?, arch, CODEGEN_VERSION))
    }

    fn from_parts(source: &str, options: &[String], nvrtc: (i32, i32), arch: Arch, codegen: u32) -> EntryKey {
        let mut h = Fnv1a::new();
        let fields = [source, &options.join("\0"), &format!("{}.{}", nvrtc.0, nvrtc.1), &arch.to_string()];
        for field in fields {
            h.field(field.as_bytes());
        }
        h.write(&codegen.to_le_bytes());
        EntryKey(h.0)
    }
}

impl fmt::Display for EntryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A directory of cached CUBINs under a size cap.
#[derive(Clone, Debug)]
pub struct DiskCache {
    dir: PathBuf,
    max_bytes: u64,
}

/// One cached CUBIN file.
#[derive(Clone, Debug)]
pub struct Entry {
    pub path: PathBuf,
    /// The file's size, header included.
    pub bytes: u64,
    /// Last written or hit.
    pub modified: SystemTime,
}

/// What [`DiskCache::clear`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleared {
    /// Cached CUBINs.
    pub kernels: usize,
    /// Autotuning records.
    pub tunings: usize,
}

/// What [`precompile`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrecompileReport {
    /// Distinct (kernel, arch) pairs.
    pub kernels: usize,
    /// Compiled with NVRTC and stored.
    pub compiled: usize,
    /// Already in the cache.
    pub cached: usize,
}

/// Where a CUBIN came from; a compiled one says whether storing it worked.
pub(crate) enum Origin {
    Disk,
    Compiled { stored: io::Result<()> },
}

impl DiskCache {
    /// A cache in `dir` (created on first store) with the default size cap.
    pub fn at(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into(), max_bytes: DEFAULT_MAX_BYTES }
    }

    pub fn with_max_bytes(self, max_bytes: u64) -> DiskCache {
        DiskCache { max_bytes, ..self }
    }

    /// The cache the environment asks for (see [`CACHE_ENV`], [`CACHE_DIR_ENV`],
    /// [`CACHE_MAX_BYTES_ENV`]); `None` when disabled or no directory is known.
    pub fn from_env() -> Option<DiskCache> {
        Self::from_vars(|name| std::env::var_os(name))
    }

    fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> Option<DiskCache> {
        let var = |name: &str| var(name).filter(|v| !v.is_empty());
        if var(CACHE_ENV).is_some_and(|v| v.eq_ignore_ascii_case("off") || v == "0") {
            return None;
        }
        let dir = var(CACHE_DIR_ENV)
            .map(PathBuf::from)
            // The XDG spec says to ignore relative paths.
            .or_else(|| {
                var("XDG_CACHE_HOME").map(PathBuf::from).filter(|p| p.is_absolute()).map(|p| p.join("flashgen"))
            })
            .or_else(|| var("HOME").map(|home| PathBuf::from(home).join(".cache").join("flashgen")))?;
        let max_bytes = var(CACHE_MAX_BYTES_ENV).map_or(DEFAULT_MAX_BYTES, |v| {
            v.to_str().and_then(|s| s.trim().parse().ok()).unwrap_or_else(|| {
                eprintln!("flashgen: warning: ignoring {CACHE_MAX_BYTES_ENV}={v:?} (not a byte count)");
                DEFAULT_MAX_BYTES
            })
        });
        Some(DiskCache { dir, max_bytes })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Where autotuning remembers its choices: `tuning/` in the cache directory.
    pub fn tuning_dir(&self) -> PathBuf {
        self.dir.join("tuning")
    }

    /// The cached CUBINs, in no particular order.
    pub fn entries(&self) -> io::Result<Vec<Entry>> {
        scan(&self.dir, EXTENSION, |_, _| {})
    }

    /// The autotuning records (text files), in no particular order.
    pub fn tunings(&self) -> io::Result<Vec<Entry>> {
        scan(&self.tuning_dir(), TUNING_EXTENSION, |_, _| {})
    }

    /// Removes every entry and tuning record and, best effort, temp files.
    pub fn clear(&self) -> io::Result<Cleared> {
        let remove_temp = |temp: &Path, _| {
            let _ = fs::remove_file(temp);
        };
        let entries = scan(&self.dir, EXTENSION, remove_temp)?;
        let tunings = scan(&self.tuning_dir(), TUNING_EXTENSION, remove_temp)?;
        let locks = scan(&self.locks_dir(), LOCK_EXTENSION, remove_temp)?;
        entries.iter().chain(&tunings).chain(&locks).try_for_each(|e| remove_if_present(&e.path))?;
        Ok(Cleared { kernels: entries.len(), tunings: tunings.len() })
    }

    /// Compiles the kernels `set` names of `specs` for every arch into this
    /// cache, different kernels in parallel over the available cores. Needs
    /// NVRTC, not a GPU. `progress(done, total)` is called after each
    /// kernel. Stops at the first compile error and returns it.
    pub fn precompile(
        &self,
        specs: &[Spec],
        archs: &[Arch],
        set: KernelSet,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<PrecompileReport, Error> {
        let cache_error = |source| Error::Cache { path: self.dir.clone(), source };
        fs::create_dir_all(&self.dir).map_err(cache_error)?;
        let mut seen = HashSet::new();
        let mut jobs = Vec::new();
        for &arch in archs {
            for spec in specs {
                let specs = Which::launch_kernels(spec, set, arch.target());
                for kernel in specs.iter().flat_map(|(spec, which)| which.iter().filter_map(|w| w.emit(spec))) {
                    let key = EntryKey::new(&kernel, arch)?;
                    if seen.insert(key) {
                        jobs.push((key, kernel, arch));
                    }
                }
            }
        }
        let (done, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
        // Per job, whether NVRTC compiled it (else it was cached); `None`
        // where skipped after another job failed.
        let outcomes = parallel::map(&jobs, |(key, kernel, arch)| {
            if failed.load(Ordering::Relaxed) {
                return None;
            }
            // A precompile that stores nothing must not look like success.
            let outcome = self.get_or_compile(*key, kernel, *arch).and_then(|(_, origin)| match origin {
                Origin::Disk => Ok(false),
                Origin::Compiled { stored } => stored.map(|()| true).map_err(cache_error),
            });
            match &outcome {
                Ok(_) => progress(done.fetch_add(1, Ordering::Relaxed) + 1, jobs.len()),
                Err(_) => failed.store(true, Ordering::Relaxed),
            }
            Some(outcome)
        });
        let compiled =
            outcomes.into_iter().flatten().try_fold(0, |n, compiled| compiled.map(|c| n + usize::from(c)))?;
        Ok(PrecompileReport { kernels: jobs.len(), compiled, cached: jobs.len() - compiled })
    }

    /// The CUBIN of `kernel` from the cache, else compiled and stored.
    fn get_or_compile(&self, key: EntryKey, kernel: &Kernel, arch: Arch) -> Result<(Vec<u8>, Origin), Error> {
        self.get_or_make(key, || compile_cubin(kernel, arch))
    }

    /// The entry of `key`, else made by `make` and stored, under the
    /// entry's compile lock: a process that waited for another's compile
    /// finds the entry and makes nothing.
    fn get_or_make(
        &self,
        key: EntryKey,
        make: impl FnOnce() -> Result<Vec<u8>, Error>,
    ) -> Result<(Vec<u8>, Origin), Error> {
        if let Some(cubin) = self.get(key) {
            return Ok((cubin, Origin::Disk));
        }
        let _lock = lock_entry(&self.lock_path(key), WAIT_LIMIT);
        if let Some(cubin) = self.get(key) {
            return Ok((cubin, Origin::Disk));
        }
        let cubin = make()?;
        let stored = self.put(key, &cubin);
        Ok((cubin, Origin::Compiled { stored }))
    }

    fn lock_path(&self, key: EntryKey) -> PathBuf {
        self.locks_dir().join(format!("{key}.{LOCK_EXTENSION}"))
    }

    fn locks_dir(&self) -> PathBuf {
        self.dir.join("locks")
    }

    fn path(&self, key: EntryKey) -> PathBuf {
        self.dir.join(format!("{key}.{EXTENSION}"))
    }

    /// The valid entry of `key`, touched as recently used. An invalid one is
    /// deleted; an unreadable one is reported once and treated as missing.
    fn get(&self, key: EntryKey) -> Option<Vec<u8>> {
        let path = self.path(key);
        let mut bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                warn(&path, &e);
                return None;
            }
        };
        if bytes.get(..HEADER_LEN) != Some(header(key, bytes.get(HEADER_LEN..).unwrap_or_default()).as_slice()) {
            // Best effort: the caller recompiles and overwrites it anyway.
            let _ = fs::remove_file(&path);
            return None;
        }
        // Best effort too: a failed touch only makes eviction less accurate.
        let _ = fs::File::open(&path).and_then(|f| f.set_modified(SystemTime::now()));
        bytes.drain(..HEADER_LEN);
        Some(bytes)
    }

    /// Stores `cubin` atomically, then evicts down to the cap.
    fn put(&self, key: EntryKey, cubin: &[u8]) -> io::Result<()> {
        // No fsync: an entry torn by a power loss fails validation and is recompiled.
        write_atomic(&self.path(key), &[header(key, cubin).as_slice(), cubin].concat())?;
        self.evict(&self.path(key))
    }

    /// Deletes least recently used entries until the total fits the cap,
    /// never `keep` (the entry just stored), and stale temp files.
    fn evict(&self, keep: &Path) -> io::Result<()> {
        let now = SystemTime::now();
        let mut entries = scan(&self.dir, EXTENSION, |temp, modified| {
            // Younger ones may be another writer's entry in flight.
            if now.duration_since(modified).is_ok_and(|age| age > STALE_TEMP) {
                let _ = fs::remove_file(temp);
            }
        })?;
        let mut total: u64 = entries.iter().map(|e| e.bytes).sum();
        entries.sort_by_key(|e| e.modified);
        for entry in entries.iter().filter(|e| e.path != keep) {
            if total <= self.max_bytes {
                break;
            }
            remove_if_present(&entry.path)?;
            if let Some(key) = entry.path.file_stem() {
                remove_if_present(&self.locks_dir().join(key).with_extension(LOCK_EXTENSION))?;
            }
            total -= entry.bytes;
        }
        Ok(())
    }
}

/// The files of `dir` named `*.{extension}` (none if `dir` does not exist);
/// temp files go to `on_temp` with their modification time.
fn scan(dir: &Path, extension: &str, mut on_temp: impl FnMut(&Path, SystemTime)) -> io::Result<Vec<Entry>> {
    let listing = match fs::read_dir(dir) {
        Ok(listing) => listing,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut entries = Vec::new();
    for item in listing {
        let item = item?;
        let path = item.path();
        // Vanished since listed: another process evicted or cleared it.
        let Ok(meta) = item.metadata() else { continue };
        let (Some(ext), true) = (path.extension(), meta.is_file()) else { continue };
        let modified = meta.modified()?;
        if ext == extension {
            entries.push(Entry { path, bytes: meta.len(), modified });
        } else if ext == TEMP_EXTENSION {
            on_temp(&path, modified);
        }
    }
    Ok(entries)
}

/// Compiles the kernels `set` names of `specs` for `archs` into the cache the environment
/// names (see [`DiskCache::from_env`]), so later launches load them from disk.
pub fn precompile(specs: &[Spec], archs: &[Arch], set: KernelSet) -> Result<PrecompileReport, Error> {
    DiskCache::from_env().ok_or(Error::CacheDisabled)?.precompile(specs, archs, set, &|_, _| {})
}

/// The CUBIN of `kernel` for a launch: from `disk` if there, else compiled
/// (and stored). Cache failures only warn. Returns whether it came from disk.
pub(crate) fn load_or_compile(disk: Option<&DiskCache>, kernel: &Kernel, arch: Arch) -> Result<(Vec<u8>, bool), Error> {
    let Some(disk) = disk else {
        return Ok((compile_cubin(kernel, arch)?, false));
    };
    match disk.get_or_compile(EntryKey::new(kernel, arch)?, kernel, arch)? {
        (cubin, Origin::Disk) => Ok((cubin, true)),
        (cubin, Origin::Compiled { stored }) => {
            if let Err(e) = stored {
                warn(disk.dir(), &e);
            }
            Ok((cubin, false))
        }
    }
}

/// The header of an entry holding `payload`; an entry is valid iff it starts
/// with exactly these bytes, so one comparison checks every field.
fn header(key: EntryKey, payload: &[u8]) -> Vec<u8> {
    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&key.0.to_le_bytes());
    header.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    header.extend_from_slice(&Fnv1a::of(payload).to_le_bytes());
    header
}

/// One warning per process: a broken cache directory would otherwise print
/// on every launch.
fn warn(path: &Path, error: &io::Error) {
    static WARNED: Once = Once::new();
    WARNED.call_once(|| {
        eprintln!("flashgen: warning: kernel cache at {}: {error}; compiling without it", path.display());
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TempDir;

    fn key(n: u128) -> EntryKey {
        EntryKey(n)
    }

    #[test]
    fn key_covers_every_input() {
        let options = vec!["--gpu-architecture=sm_90a".to_string(), "-std=c++17".to_string()];
        let base = || EntryKey::from_parts("src", &options, (13, 0), Arch::new(9, 0), 1);
        assert_eq!(base(), base());
        assert_eq!(base().to_string().len(), 32);
        for other in [
            EntryKey::from_parts("src2", &options, (13, 0), Arch::new(9, 0), 1),
            EntryKey::from_parts("src", &options[..1], (13, 0), Arch::new(9, 0), 1),
            EntryKey::from_parts("src", &options, (13, 1), Arch::new(9, 0), 1),
            EntryKey::from_parts("src", &options, (13, 0), Arch::new(8, 0), 1),
            EntryKey::from_parts("src", &options, (13, 0), Arch::new(9, 0), 2),
        ] {
            assert_ne!(base(), other);
        }
    }

    #[test]
    fn round_trip() {
        let tmp = TempDir::new("disk-cache-round-trip");
        let cache = DiskCache::at(&tmp.0);
        assert_eq!(cache.get(key(1)), None);
        assert_eq!(cache.entries().unwrap().len(), 0, "a missing directory is an empty cache");
        cache.put(key(1), b"\x7fELF cubin").unwrap();
        assert_eq!(cache.get(key(1)).as_deref(), Some(&b"\x7fELF cubin"[..]));
        assert_eq!(cache.get(key(2)), None);
        let entries = cache.entries().unwrap();
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].bytes, (HEADER_LEN + 10) as u64);
        assert!(fs::read(&entries[0].path).unwrap().starts_with(MAGIC));
        assert_eq!(cache.clear().unwrap(), Cleared { kernels: 1, tunings: 0 });
        assert_eq!(cache.get(key(1)), None);
    }

    #[test]
    fn corrupt_entries_are_deleted_not_loaded() {
        let tmp = TempDir::new("disk-cache-corrupt");
        let cache = DiskCache::at(&tmp.0);
        let path = cache.path(key(1));
        let good = || {
            cache.put(key(1), &[7; 100]).unwrap();
            fs::read(&path).unwrap()
        };
        let flip = |at: usize| {
            let mut bytes = good();
            bytes[at] ^= 1;
            bytes
        };
        let damaged: [(&str, Vec<u8>); 6] = [
            ("payload bit flip", flip(HEADER_LEN + 50)),
            ("bad magic", flip(0)),
            ("format version", flip(8)),
            ("checksum", flip(HEADER_LEN - 1)),
            ("truncated payload", good()[..HEADER_LEN + 60].to_vec()),
            ("truncated header", good()[..5].to_vec()),
        ];
        for (what, bytes) in damaged {
            fs::write(&path, bytes).unwrap();
            assert_eq!(cache.get(key(1)), None, "{what}");
            assert!(!path.exists(), "{what}: the entry should be deleted");
            cache.put(key(1), &[7; 100]).unwrap();
            assert_eq!(cache.get(key(1)), Some(vec![7; 100]), "{what}: replaced");
        }
        // An entry renamed to another key's name is not that key's.
        fs::rename(&path, cache.path(key(2))).unwrap();
        assert_eq!(cache.get(key(2)), None);
    }

    #[test]
    fn evicts_least_recently_used_under_the_cap() {
        let tmp = TempDir::new("disk-cache-evict");
        let entry = (HEADER_LEN + 1000) as u64;
        let cache = DiskCache::at(&tmp.0).with_max_bytes(2 * entry);
        let pause = || std::thread::sleep(Duration::from_millis(20));
        cache.put(key(1), &[1; 1000]).unwrap();
        pause();
        cache.put(key(2), &[2; 1000]).unwrap();
        pause();
        assert!(cache.get(key(1)).is_some(), "a hit makes 1 more recent than 2");
        pause();
        cache.put(key(3), &[3; 1000]).unwrap();
        let present: Vec<bool> = (1..=3).map(|k| cache.path(key(k)).exists()).collect();
        assert_eq!(present, [true, false, true]);
        // An entry larger than the cap is still kept until the next store.
        let tiny = DiskCache::at(&tmp.0).with_max_bytes(10);
        tiny.put(key(4), &[4; 1000]).unwrap();
        assert_eq!(tiny.entries().unwrap().len(), 1);
        assert_eq!(tiny.get(key(4)), Some(vec![4; 1000]));
    }

    #[test]
    fn stale_temp_files_are_cleared() {
        let tmp = TempDir::new("disk-cache-temp");
        let cache = DiskCache::at(&tmp.0);
        cache.put(key(1), b"x").unwrap();
        let (fresh, stale) = (tmp.0.join(".a.1.0.tmp"), tmp.0.join(".b.1.1.tmp"));
        fs::write(&fresh, b"partial").unwrap();
        fs::write(&stale, b"partial").unwrap();
        let old = SystemTime::now() - 2 * STALE_TEMP;
        fs::File::options().write(true).open(&stale).unwrap().set_modified(old).unwrap();
        cache.put(key(2), b"y").unwrap();
        assert!(fresh.exists() && !stale.exists());
        assert_eq!(cache.clear().unwrap().kernels, 2);
        assert!(!fresh.exists());
    }

    #[test]
    fn concurrent_writers_never_expose_a_partial_entry() {
        let tmp = TempDir::new("disk-cache-concurrent");
        let cache = DiskCache::at(&tmp.0);
        let len = 256 * 1024;
        std::thread::scope(|s| {
            for writer in 0..4u8 {
                let cache = &cache;
                s.spawn(move || {
                    for round in 0..20u8 {
                        cache.put(key(1), &vec![writer * 20 + round; len]).unwrap();
                    }
                });
            }
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        if let Some(cubin) = cache.get(key(1)) {
                            assert_eq!(cubin.len(), len);
                            assert!(cubin.iter().all(|&b| b == cubin[0]), "mixed writes");
                        }
                    }
                });
            }
        });
        assert_eq!(cache.get(key(1)).map(|c| c.len()), Some(len));
        let files = fs::read_dir(&tmp.0).unwrap().count();
        assert_eq!(files, 1, "temp files are renamed away");
    }

    #[test]
    fn callers_missing_one_entry_together_make_it_once() {
        let tmp = TempDir::new("disk-cache-one-compile");
        let cache = DiskCache::at(&tmp.0);
        let made = AtomicUsize::new(0);
        let origins: Vec<bool> = std::thread::scope(|s| {
            let callers: Vec<_> = (0..4)
                .map(|_| {
                    s.spawn(|| {
                        let make = || {
                            made.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(200));
                            Ok(vec![7u8; 1000])
                        };
                        let (cubin, origin) = cache.get_or_make(key(3), make).unwrap();
                        assert_eq!(cubin, vec![7u8; 1000]);
                        matches!(origin, Origin::Disk)
                    })
                })
                .collect();
            callers.into_iter().map(|c| c.join().unwrap()).collect()
        });
        assert_eq!(made.load(Ordering::SeqCst), 1, "one compile for four callers");
        assert_eq!(origins.iter().filter(|&&disk| disk).count(), 3, "the others load it");
        assert_eq!(cache.clear().unwrap(), Cleared { kernels: 1, tunings: 0 });
        assert_eq!(fs::read_dir(cache.locks_dir()).unwrap().count(), 0, "clear removes the lock files");
    }

    #[test]
    fn environment_picks_the_directory() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| OsString::from(v))
        };
        let dir = |pairs| DiskCache::from_vars(vars(pairs)).map(|c| c.dir);
        assert_eq!(dir(&[("HOME", "/h")]), Some(PathBuf::from("/h/.cache/flashgen")));
        assert_eq!(dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]), Some(PathBuf::from("/x/flashgen")));
        assert_eq!(dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "rel")]), Some(PathBuf::from("/h/.cache/flashgen")));
        assert_eq!(dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x"), (CACHE_DIR_ENV, "/c")]), Some(PathBuf::from("/c")));
        assert_eq!(dir(&[(CACHE_DIR_ENV, "/c"), (CACHE_ENV, "off")]), None);
        assert_eq!(dir(&[(CACHE_DIR_ENV, "/c"), (CACHE_ENV, "on")]), Some(PathBuf::from("/c")));
        assert_eq!(dir(&[]), None);
        let max = |pairs| DiskCache::from_vars(vars(pairs)).unwrap().max_bytes;
        assert_eq!(max(&[("HOME", "/h")]), DEFAULT_MAX_BYTES);
        assert_eq!(max(&[("HOME", "/h"), (CACHE_MAX_BYTES_ENV, "1000")]), 1000);
        assert_eq!(max(&[("HOME", "/h"), (CACHE_MAX_BYTES_ENV, "lots")]), DEFAULT_MAX_BYTES);
    }
}
