//! Finding libnccl, or saying how to make it reachable. cudarc loads NCCL
//! only by the names `libnccl.so` and `libnccl.so.<CUDA major>` and panics
//! where none loads. NVIDIA's wheels (`nvidia-nccl-cu13`, `-cu12`, which
//! PyTorch installs under `site-packages/nvidia/nccl/lib`) and distribution
//! packages without their `-dev` part ship only `libnccl.so.2`, NCCL's
//! soname. Unlike NVRTC's (`nvrtc_lib`), that name is none of cudarc's, and
//! the loader matches a library loaded by full path to a later load by
//! bare name only through its soname: loading it here would not help. So
//! before the first NCCL call this module checks cudarc's load, and where
//! it fails looks for a `libnccl.so.2` (on `LD_LIBRARY_PATH`, in the
//! system's and a CUDA toolkit's directories, in the Python environments'
//! wheels) to name in the error, with the link that makes it reachable.

use crate::comm_error::CommError;
use crate::error::Error;
use crate::lib_search::{dedup, env_site_packages, python_site_packages, toolkit_dirs, under};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library's file name in every package that ships it: its soname.
const SONAME: &str = "libnccl.so.2";
/// Where the wheels put it under `site-packages`.
const WHEEL_LIB_DIR: &str = "nvidia/nccl/lib";
/// Where distributions put it (Debian's and Ubuntu's `libnccl2`, RHEL's).
const SYSTEM_DIRS: [&str; 4] = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"];

/// Where a `libnccl.so.2` was looked for, and the first one found.
struct Missing {
    searched: Vec<PathBuf>,
    found: Option<PathBuf>,
}

/// Whether cudarc can load NCCL; else what [`Missing`] says. Checked once
/// per process.
pub(crate) fn ensure_nccl() -> Result<(), Error> {
    static CHECKED: OnceLock<Result<(), Missing>> = OnceLock::new();
    match CHECKED.get_or_init(check) {
        Ok(()) => Ok(()),
        Err(Missing { searched, found }) => {
            let fix = fix(found.as_deref());
            Err(Error::Comm(CommError::Missing { searched: searched.clone(), found: found.clone(), fix }))
        }
    }
}

fn check() -> Result<(), Missing> {
    // SAFETY: only tries to dlopen cudarc's candidate file names.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Ok(());
    }
    let var = |name: &str| std::env::var_os(name);
    let mut dirs = search_dirs(&var);
    // Last, as it starts a process: the site-packages of the `python3` on PATH.
    dirs.extend(under(&python_site_packages(), &[WHEEL_LIB_DIR]));
    let searched = dedup(&dirs);
    let found = searched.iter().map(|dir| dir.join(SONAME)).find(|file| file.is_file());
    Err(Missing { searched, found })
}

/// The directories to look in, in order: `LD_LIBRARY_PATH`'s, the
/// system's, a CUDA toolkit's, the active Python environments' wheels.
fn search_dirs(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        var("LD_LIBRARY_PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    dirs.retain(|dir| !dir.as_os_str().is_empty());
    dirs.extend(SYSTEM_DIRS.map(PathBuf::from));
    dirs.extend(toolkit_dirs(var));
    dirs.extend(under(&env_site_packages(var), &[WHEEL_LIB_DIR]));
    dirs
}

/// What to do: link a found library under a name cudarc loads, in a
/// directory the loader searches; else install NVIDIA's wheel, after which
/// this error names what to link.
fn fix(found: Option<&Path>) -> String {
    let Some(lib) = found else {
        return "python3 -m pip install nvidia-nccl-cu13 (for a CUDA 12 driver: nvidia-nccl-cu12), \
                then run again: this error then names the library and how to make it reachable"
            .to_string();
    };
    let links = "$HOME/.local/lib/flashgen-nccl";
    format!(
        "link it as libnccl.so in a directory on LD_LIBRARY_PATH before starting the program, e.g.\n  \
         mkdir -p {links} && ln -sf '{}' {links}/libnccl.so && export LD_LIBRARY_PATH={links}:$LD_LIBRARY_PATH",
        lib.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lib_search::tests::{paths, vars};
    use crate::test_dir::TempDir;

    #[test]
    fn the_library_path_comes_first_then_the_system_and_toolkits() {
        let var = vars(&[("LD_LIBRARY_PATH", "/a::/b/lib"), ("CUDA_HOME", "/cuda")]);
        let dirs = search_dirs(&var);
        let expected = paths(&[
            "/a",
            "/b/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
            "/usr/lib64",
            "/usr/lib",
            "/cuda/lib64",
            "/cuda/lib",
        ]);
        assert_eq!(dirs[..8], expected, "{dirs:?}");
        assert_eq!(
            dirs[8..],
            paths(&["/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/opt/cuda/lib64", "/opt/cuda/lib"])
        );
    }

    #[test]
    fn a_virtualenvs_wheel_is_searched() {
        let tmp = TempDir::new("nccl-lib-venv");
        let lib_dir = tmp.0.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib_dir).unwrap();
        let var = |name: &str| (name == "VIRTUAL_ENV").then(|| tmp.0.clone().into_os_string());
        assert_eq!(search_dirs(&var).last(), Some(&lib_dir));
    }

    #[test]
    fn a_found_library_is_linked_under_a_name_cudarc_loads() {
        let fix = fix(Some(Path::new("/venv/site-packages/nvidia/nccl/lib/libnccl.so.2")));
        assert!(fix.contains("ln -sf '/venv/site-packages/nvidia/nccl/lib/libnccl.so.2' "), "{fix}");
        assert!(fix.contains("/libnccl.so && export LD_LIBRARY_PATH="), "{fix}");
        let err = Error::Comm(CommError::Missing {
            searched: paths(&["/a"]),
            found: Some(PathBuf::from("/a/libnccl.so.2")),
            fix,
        });
        let text = err.to_string();
        assert!(text.contains("it is at /a/libnccl.so.2") && text.contains("\nfix: link it"), "{text}");
    }

    #[test]
    fn without_a_library_the_fix_installs_the_wheel() {
        let err = Error::Comm(CommError::Missing { searched: paths(&["/a", "/b"]), found: None, fix: fix(None) });
        let text = err.to_string();
        assert!(text.contains("no libnccl.so.2 is in:\n  /a\n  /b\n"), "{text}");
        assert!(text.contains("fix: python3 -m pip install nvidia-nccl-cu13"), "{text}");
    }
}
