//! Finding libnvrtc where users have it. cudarc loads NVRTC by file name
//! only, from the system's library path, and panics where it is not there.
//! Before its first NVRTC call this module looks, in order, on that path,
//! in a CUDA toolkit, in this workspace's `target/pypi-nvrtc` (where
//! `scripts/nvrtc-env.sh` installs NVIDIA's wheel) and in the active Python
//! environment's `nvidia-cuda-nvrtc` wheel. A library found by full path is
//! loaded once and kept loaded: the dynamic loader then hands it to cudarc's
//! load by name, which matches the library's soname (`libnvrtc.so.13`).

use crate::error::Error;
use crate::lib_search::{dedup, env_site_packages, python_site_packages, toolkit_dirs, under};
use libloading::Library;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The wheel that provides NVRTC 13, as pip names it.
const WHEEL: &str = "nvidia-cuda-nvrtc>=13,<14";
/// Where the wheels put the library under `site-packages` (or a pip
/// `--target`): CUDA 13's, then CUDA 12's (PyTorch's cu12x builds).
const WHEEL_LIB_DIRS: [&str; 2] = ["nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"];
/// File names to load from a directory, the version the bindings target first.
const FILE_NAMES: [&str; 3] = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Makes NVRTC loadable by cudarc, or says where it looked. Searches once
/// per process; what it found stays loaded for the process's lifetime.
pub(crate) fn ensure_nvrtc() -> Result<(), Error> {
    static FOUND: OnceLock<Result<Option<Library>, Vec<PathBuf>>> = OnceLock::new();
    match FOUND.get_or_init(find) {
        Ok(_) => Ok(()),
        Err(searched) => Err(Error::NvrtcMissing { searched: searched.clone(), fix: install_command() }),
    }
}

/// The library: `None` where cudarc finds one on its own, else the one
/// loaded from the first directory that has it; else every directory
/// searched.
fn find() -> Result<Option<Library>, Vec<PathBuf>> {
    if cudarc_finds_nvrtc() {
        return Ok(None);
    }
    let var = |name: &str| std::env::var_os(name);
    let exe = std::env::current_exe().ok();
    let mut dirs = search_dirs(&var, Path::new(env!("CARGO_MANIFEST_DIR")), exe.as_deref());
    dirs.extend(wheel_dirs(&env_site_packages(&var)));
    let mut searched = dedup(&dirs);
    if let Some(lib) = load_first(&searched) {
        return Ok(Some(lib));
    }
    // Last, as it starts a process: the site-packages of the `python3` on PATH.
    let asked = dedup(&wheel_dirs(&python_site_packages()));
    let asked: Vec<PathBuf> = asked.into_iter().filter(|dir| !searched.contains(dir)).collect();
    let found = load_first(&asked);
    searched.extend(asked);
    found.map(Some).ok_or(searched)
}

/// Whether cudarc's own load by name succeeds.
fn cudarc_finds_nvrtc() -> bool {
    // SAFETY: only tries to dlopen cudarc's candidate file names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The first library in `dirs` that loads and that cudarc then finds.
fn load_first(dirs: &[PathBuf]) -> Option<Library> {
    let files = dirs.iter().flat_map(|dir| FILE_NAMES.map(|name| dir.join(name)));
    files.filter(|file| file.is_file()).find_map(|file| match open(&file) {
        Ok(lib) if cudarc_finds_nvrtc() => Some(lib),
        Ok(_) => None,
        Err(e) => {
            eprintln!("flashgen: warning: cannot load {}: {e}", file.display());
            None
        }
    })
}

/// Loads the library at `path` for the whole process.
#[cfg(unix)]
fn open(path: &Path) -> Result<Library, libloading::Error> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVRTC runs no initializers beyond the C runtime's own.
    // RTLD_GLOBAL lets the loader match cudarc's load by soname.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }.map(Into::into)
}

/// Loads the library at `path`; Windows matches a later load by file name.
#[cfg(not(unix))]
fn open(path: &Path) -> Result<Library, libloading::Error> {
    // SAFETY: loading NVRTC runs no initializers beyond the C runtime's own.
    unsafe { Library::new(path) }
}

/// The directories to search after the system's library path, in order:
/// a CUDA toolkit's (`CUDA_PATH`, `CUDA_HOME`, `CUDA_ROOT`, then the usual
/// install places), then `target/pypi-nvrtc` of the workspace that holds
/// `manifest_dir` (the runtime crate's) and of the one `exe` was built in.
fn search_dirs(var: &dyn Fn(&str) -> Option<OsString>, manifest_dir: &Path, exe: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs = toolkit_dirs(var);
    let built_in = manifest_dir.parent().map(|workspace| workspace.join("target"));
    // A cargo-built executable lies under `target/<profile>/`, tests under `deps/` too.
    let running_from = exe.and_then(|exe| exe.ancestors().find(|dir| dir.file_name() == Some("target".as_ref())));
    for target in built_in.iter().map(PathBuf::as_path).chain(running_from) {
        dirs.extend(wheel_dirs(&[target.join("pypi-nvrtc")]));
    }
    dirs
}

/// Where the wheels put the library under each of `roots`.
fn wheel_dirs(roots: &[PathBuf]) -> Vec<PathBuf> {
    under(roots, &WHEEL_LIB_DIRS)
}

/// The one command that installs NVRTC where [`ensure_nvrtc`] looks.
fn install_command() -> String {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = manifest_dir.parent().unwrap_or(manifest_dir).join("target").join("pypi-nvrtc");
    format!("python3 -m pip install --target '{}' '{WHEEL}'", target.display())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lib_search::tests::{paths, vars};

    #[test]
    fn toolkits_come_first_then_the_workspace_and_the_executables_target() {
        let var = vars(&[("CUDA_HOME", "/cuda-home"), ("CUDA_PATH", ""), ("CUDA_ROOT", "/cuda-root")]);
        let exe = Path::new("/other/target/debug/deps/runtime-0123");
        let dirs = search_dirs(&var, Path::new("/ws/runtime"), Some(exe));
        let toolkits = crate::lib_search::toolkit_dirs(&var);
        assert_eq!(dirs[..toolkits.len()], toolkits[..], "the toolkits first");
        let expected = paths(&[
            "/ws/target/pypi-nvrtc/nvidia/cu13/lib",
            "/ws/target/pypi-nvrtc/nvidia/cuda_nvrtc/lib",
            "/other/target/pypi-nvrtc/nvidia/cu13/lib",
            "/other/target/pypi-nvrtc/nvidia/cuda_nvrtc/lib",
        ]);
        assert_eq!(dirs[toolkits.len()..], expected[..]);
    }

    #[test]
    fn an_executable_outside_a_target_dir_adds_nothing() {
        let dirs = search_dirs(&vars(&[]), Path::new("/ws/runtime"), Some(Path::new("/usr/bin/flashgen")));
        assert_eq!(dirs.len(), 6, "{dirs:?}");
        assert_eq!(search_dirs(&vars(&[]), Path::new("/ws/runtime"), None), dirs);
    }

    #[test]
    fn the_fix_installs_the_wheel_where_the_search_looks() {
        let fix = install_command();
        assert!(fix.starts_with("python3 -m pip install --target '"), "{fix}");
        assert!(fix.ends_with("/target/pypi-nvrtc' 'nvidia-cuda-nvrtc>=13,<14'"), "{fix}");
        let installed = PathBuf::from(fix.split('\'').nth(1).unwrap()).join(WHEEL_LIB_DIRS[0]);
        assert!(search_dirs(&vars(&[]), Path::new(env!("CARGO_MANIFEST_DIR")), None).contains(&installed));
    }
}
