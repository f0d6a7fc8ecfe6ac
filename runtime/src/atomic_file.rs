//! Files that several processes share safely: written whole through a temp
//! file and a rename, removed without minding another remover.

use std::fs;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// The extension of a file still being written (`.<name>.<pid>.<n>.tmp`);
/// one left behind belongs to a writer that crashed.
pub(crate) const TEMP_EXTENSION: &str = "tmp";

/// Writes `bytes` to `path` through a temp file and a rename (creating the
/// directory), so readers see the whole file or none.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    // Unique per process and call: concurrent writers never share a temp file.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a file path"));
    };
    fs::create_dir_all(dir)?;
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let temp = dir.join(format!(".{}.{}.{n}.{TEMP_EXTENSION}", name.to_string_lossy(), std::process::id()));
    let written = fs::write(&temp, bytes).and_then(|()| fs::rename(&temp, path));
    if written.is_err() {
        let _ = fs::remove_file(&temp);
    }
    written
}

/// Removes a file another process may have removed first.
pub(crate) fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TempDir;

    #[test]
    fn writes_whole_files_and_removes_missing_ones() {
        let tmp = TempDir::new("atomic-file");
        let path = tmp.0.join("sub").join("f.txt");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "no temp file left");
        remove_if_present(&path).unwrap();
        remove_if_present(&path).unwrap();
        assert!(!path.exists());
        assert!(write_atomic(Path::new("/"), b"x").is_err(), "not a file path");
    }
}
