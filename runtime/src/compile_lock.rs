//! One compile per cache entry across processes: the ranks of a training
//! job start together on one cache folder and all miss the same kernels.
//! Before compiling a missing entry a process takes an advisory lock on the
//! entry's lock file (`locks/<key>.lock`); the others wait for it, then find
//! the entry on disk. The lock is only an optimization: it is released
//! when its holder exits (crashes included), a waiter that times out (a
//! hung holder) or cannot lock (a file system without locks) compiles
//! anyway, and entries are still written atomically. Lock files go with
//! their entries (eviction, `flashgen cache clear`); one removed while held
//! can at worst let a second process compile the same entry.

use std::fs::{self, File, TryLockError};
use std::path::Path;
use std::time::{Duration, Instant};

/// Longer than any one compile: past it the holder is taken to be hung.
pub(crate) const WAIT_LIMIT: Duration = Duration::from_secs(120);

/// An entry's compile lock, held until dropped.
pub(crate) struct CompileLock {
    _file: File,
}

/// Waits up to `limit` for the lock file at `path` (created with its
/// folder), polling: a compile takes about a second, so a 10–100 ms poll
/// costs little and needs no blocking call that could not time out. `None`
/// when the limit passed or the file system refused.
pub(crate) fn lock_entry(path: &Path, limit: Duration) -> Option<CompileLock> {
    let file = match path
        .parent()
        .map_or(Ok(()), fs::create_dir_all)
        .and_then(|()| File::options().create(true).truncate(false).write(true).open(path))
    {
        Ok(file) => file,
        Err(_) => return None,
    };
    let start = Instant::now();
    let mut poll = Duration::from_millis(10);
    loop {
        match file.try_lock() {
            Ok(()) => return Some(CompileLock { _file: file }),
            Err(TryLockError::WouldBlock) if start.elapsed() < limit => {
                std::thread::sleep(poll);
                poll = (poll * 2).min(Duration::from_millis(100));
            }
            Err(TryLockError::WouldBlock | TryLockError::Error(_)) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::TempDir;

    #[test]
    fn a_second_locker_waits_for_the_first() {
        let tmp = TempDir::new("compile-lock");
        let path = tmp.0.join("locks").join("k.lock");
        let held = lock_entry(&path, WAIT_LIMIT).expect("a free lock");
        assert!(lock_entry(&path, Duration::from_millis(50)).is_none(), "held elsewhere");
        let waiter = std::thread::spawn({
            let path = path.clone();
            move || {
                let start = Instant::now();
                lock_entry(&path, WAIT_LIMIT).map(|_| start.elapsed())
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(held);
        let waited = waiter.join().unwrap().expect("the waiter gets the lock once it is let go");
        assert!(waited >= Duration::from_millis(150), "it waited for the holder: {waited:?}");
        assert!(lock_entry(&path, WAIT_LIMIT).is_some());
    }

    #[test]
    fn an_unusable_folder_gives_no_lock() {
        let tmp = TempDir::new("compile-lock-file");
        let blocker = tmp.0.join("locks");
        fs::create_dir_all(&tmp.0).unwrap();
        fs::write(&blocker, b"a file where the folder should be").unwrap();
        assert!(lock_entry(&blocker.join("k.lock"), WAIT_LIMIT).is_none());
    }
}
