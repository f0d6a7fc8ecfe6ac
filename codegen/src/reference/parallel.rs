//! Independent pieces of a reference computation on every core: the
//! reference is f64 and interprets the spec per element, so a GPU test's
//! shapes (hundreds of millions of pairs) would otherwise take minutes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `task` of every item, in the items' order, computed on up to
/// `available_parallelism` threads that each take the next item as they
/// finish one (items may differ in cost: a causal row of heads, a short
/// sequence). A panic in a task resumes in the caller.
pub(super) fn map_parallel<T: Sync, R: Send>(items: &[T], task: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(items.len());
    if workers <= 1 {
        return items.iter().map(task).collect();
    }
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new(items.iter().map(|_| None).collect());
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    let result = task(item);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(result);
                })
            })
            .collect();
        for handle in handles {
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
    let results = results.into_inner().unwrap_or_else(|e| e.into_inner());
    results.into_iter().map(|r| r.expect("every item was computed")).collect()
}

#[cfg(test)]
mod tests {
    use super::map_parallel;

    #[test]
    fn results_keep_the_items_order() {
        let items: Vec<u64> = (0..1000).collect();
        // Uneven costs, so that workers finish items out of order.
        let squares = map_parallel(&items, |&x| {
            (0..(x % 7) * 1000).fold(0u64, |a, b| a.wrapping_add(b));
            x * x
        });
        assert_eq!(squares, items.iter().map(|x| x * x).collect::<Vec<_>>());
    }

    #[test]
    fn no_items_no_results() {
        assert!(map_parallel(&[] as &[u8], |&x| x).is_empty());
    }

    #[test]
    #[should_panic(expected = "item 3")]
    fn a_task_panic_reaches_the_caller() {
        map_parallel(&[1, 2, 3, 4], |&x| assert!(x != 3, "item {x}"));
    }
}
