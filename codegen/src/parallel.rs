//! Independent jobs over the CPU's cores: the runtime's NVRTC compiles (a
//! precompile, autotuning's candidates), which take seconds each, so a
//! batch should take about as long as its slowest; the reference forward's
//! (sequence, head) pairs, which a GPU test's shapes would otherwise keep
//! on one core for minutes.

use std::sync::atomic::{AtomicUsize, Ordering};

/// `job` of every item, in `items` order, run on at most
/// `available_parallelism` scoped threads that each take the next item not
/// yet taken, so one slow item holds up no other. One item or none (a
/// launch whose kernels are loaded already) runs on the caller's thread
/// without asking for the core count, which reads cgroup files (~50 µs, more
/// than a launch's host time). A job's panic is the caller's.
pub fn map<T: Sync, R: Send>(items: &[T], job: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = match items.len() {
        0 | 1 => 1,
        n => std::thread::available_parallelism().map_or(1, |cores| cores.get()).min(n),
    };
    if workers == 1 {
        return items.iter().map(job).collect();
    }
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { return done };
            done.push((i, job(item)));
        }
    };
    let mut results: Vec<(usize, R)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers).map(|_| scope.spawn(worker)).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))).collect()
    });
    results.sort_unstable_by_key(|&(i, _)| i);
    results.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn results_come_in_item_order() {
        // Earlier items finish later, so completion order is not item order.
        let items: Vec<u64> = (0..64).collect();
        let doubled = map(&items, |&i| {
            std::thread::sleep(Duration::from_micros(64 - i) * 50);
            2 * i
        });
        assert_eq!(doubled, items.iter().map(|i| 2 * i).collect::<Vec<_>>());
    }

    #[test]
    fn one_item_runs_on_the_callers_thread() {
        let caller = std::thread::current().id();
        assert_eq!(map(&[1], |_| std::thread::current().id()), [caller]);
        assert!(map(&[] as &[u8], |_| ()).is_empty());
    }

    #[test]
    fn jobs_run_at_the_same_time() {
        if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
            return; // one core: one worker, by design
        }
        // Each job waits for the other to start: run one after the other, the first gives up.
        let started = AtomicUsize::new(0);
        let met = map(&[0, 1], |_| {
            started.fetch_add(1, Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(10);
            while started.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            started.load(Ordering::SeqCst) == 2
        });
        assert_eq!(met, [true, true]);
    }

    #[test]
    #[should_panic(expected = "job 3 failed")]
    fn a_panicking_job_panics_the_caller_with_its_message() {
        map(&[1, 2, 3, 4], |&i| assert_ne!(i, 3, "job {i} failed"));
    }
}
