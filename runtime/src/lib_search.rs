//! Where users have NVIDIA's libraries, for the modules that find one cudarc
//! would not (`nvrtc_lib`, `nccl_lib`): a CUDA toolkit's directories, the
//! active Python environments' site-packages (where NVIDIA's wheels, and
//! PyTorch's, put them) and those of the `python3` on `PATH`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A CUDA toolkit's library directories: `CUDA_PATH`, `CUDA_HOME`,
/// `CUDA_ROOT`, then the usual install places; `lib64`, then `lib` of each.
pub(crate) fn toolkit_dirs(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    let roots = ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"].iter().filter_map(|name| var(name)).filter(|v| !v.is_empty());
    let roots = roots.map(PathBuf::from).chain(["/usr/local/cuda", "/opt/cuda"].map(PathBuf::from));
    roots.flat_map(|root| [root.join("lib64"), root.join("lib")]).collect()
}

/// The site-packages of the active Python environments: a virtualenv's, a
/// conda environment's.
pub(crate) fn env_site_packages(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    env_prefixes(var).iter().flat_map(|prefix| site_packages_under(prefix)).collect()
}

/// The prefixes of the active Python environments.
fn env_prefixes(var: &dyn Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|name| var(name))
        .filter(|v| !v.is_empty())
        .map(Into::into)
        .collect()
}

/// `prefix/lib/python3.*/site-packages`, the versions in name order.
fn site_packages_under(prefix: &Path) -> Vec<PathBuf> {
    let Ok(listing) = prefix.join("lib").read_dir() else {
        return Vec::new();
    };
    let mut versions: Vec<PathBuf> = listing
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages"))
        .collect();
    versions.sort();
    versions
}

/// The site-packages directories of the `python3` on `PATH` (its
/// environment's and the user's), or none where there is no such Python.
/// It starts a process: callers ask it last.
pub(crate) fn python_site_packages() -> Vec<PathBuf> {
    let script = "import site, sysconfig; print(sysconfig.get_paths()['purelib']); print(site.getusersitepackages())";
    match Command::new("python3").args(["-c", script]).output() {
        Ok(out) if out.status.success() => parse_lines(&out.stdout),
        _ => Vec::new(),
    }
}

/// One path per non-empty line.
fn parse_lines(stdout: &[u8]) -> Vec<PathBuf> {
    String::from_utf8_lossy(stdout).lines().map(str::trim).filter(|l| !l.is_empty()).map(PathBuf::from).collect()
}

/// Each of `subdirs` under each of `roots`, roots first.
pub(crate) fn under(roots: &[PathBuf], subdirs: &[&str]) -> Vec<PathBuf> {
    roots.iter().flat_map(|root| subdirs.iter().map(|dir| root.join(dir))).collect()
}

/// `dirs` without repeats, in first-seen order.
pub(crate) fn dedup(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut unique: Vec<PathBuf> = Vec::with_capacity(dirs.len());
    for dir in dirs {
        if !unique.contains(dir) {
            unique.push(dir.clone());
        }
    }
    unique
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::test_dir::TempDir;

    /// An environment of these variables only.
    pub(crate) fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<OsString> {
        move |name| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| OsString::from(v))
    }

    pub(crate) fn paths(list: &[&str]) -> Vec<PathBuf> {
        list.iter().map(PathBuf::from).collect()
    }

    #[test]
    fn toolkits_are_named_by_the_environment_then_the_usual_places() {
        let var = vars(&[("CUDA_HOME", "/cuda-home"), ("CUDA_PATH", ""), ("CUDA_ROOT", "/cuda-root")]);
        let expected = paths(&[
            "/cuda-home/lib64",
            "/cuda-home/lib",
            "/cuda-root/lib64",
            "/cuda-root/lib",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/lib",
            "/opt/cuda/lib64",
            "/opt/cuda/lib",
        ]);
        assert_eq!(toolkit_dirs(&var), expected);
    }

    #[test]
    fn python_environments_are_found_by_prefix() {
        let var = vars(&[("VIRTUAL_ENV", "/venv"), ("CONDA_PREFIX", "")]);
        assert_eq!(env_prefixes(&var), paths(&["/venv"]));
        let tmp = TempDir::new("lib-search-prefix");
        for dir in ["lib/python3.12/site-packages", "lib/python3.10/site-packages", "lib/pkgconfig"] {
            std::fs::create_dir_all(tmp.0.join(dir)).unwrap();
        }
        let found = site_packages_under(&tmp.0);
        assert_eq!(found, [tmp.0.join("lib/python3.10/site-packages"), tmp.0.join("lib/python3.12/site-packages")]);
        assert!(site_packages_under(&tmp.0.join("missing")).is_empty());
        let wheels = under(&found[..1], &["nvidia/a/lib", "nvidia/b/lib"]);
        assert_eq!(wheels[1], tmp.0.join("lib/python3.10/site-packages/nvidia/b/lib"));
    }

    #[test]
    fn pythons_answer_is_read_line_by_line() {
        let lines = parse_lines(b"/usr/lib/python3/dist-packages\n\n/root/.local/lib/python3.12/site-packages\n");
        assert_eq!(lines, paths(&["/usr/lib/python3/dist-packages", "/root/.local/lib/python3.12/site-packages"]));
        assert!(parse_lines(b"").is_empty());
    }

    #[test]
    fn repeats_are_dropped_in_order() {
        assert_eq!(dedup(&paths(&["/a", "/b", "/a", "/c", "/b"])), paths(&["/a", "/b", "/c"]));
    }
}
