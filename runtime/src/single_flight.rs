//! Per-key single flight: a map of values computed at most once per key.
//!
//! Callers asking for the same key wait for the one computing it; different
//! keys compute in parallel, because the map's lock is held only to find a
//! key's slot, never while computing. Kernel compiles take seconds, so a
//! single lock over all of them would serialize unrelated variants.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError, TryLockError};

type Slot<V> = Arc<Mutex<Option<V>>>;

pub(crate) struct SingleFlight<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
}

impl<K, V> Default for SingleFlight<K, V> {
    fn default() -> Self {
        SingleFlight { slots: Mutex::default() }
    }
}

impl<K: Eq + Hash, V: Clone> SingleFlight<K, V> {
    /// The value of `key` (any borrowed form of a key) if it was computed,
    /// without waiting for a computation in flight.
    pub fn get<Q: Eq + Hash + ?Sized>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
    {
        let slot = self.slots.lock().unwrap_or_else(PoisonError::into_inner).get(key)?.clone();
        let value = match slot.try_lock() {
            Ok(value) => value,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        value.clone()
    }

    /// The value of `key` and whether it was already there, computing it
    /// with `init` if not. A failed `init` stores nothing: its error goes to
    /// its caller and the next caller (a waiting one included) tries again,
    /// so a transient failure is not remembered forever. A panicking `init`
    /// likewise leaves the slot empty.
    pub fn get_or_try_init<E>(&self, key: K, init: impl FnOnce() -> Result<V, E>) -> Result<(V, bool), E> {
        let slot = self.slots.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default().clone();
        let mut value = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = &*value {
            return Ok((v.clone(), true));
        }
        let v = init()?;
        *value = Some(v.clone());
        Ok((v, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn same_key_computes_once() {
        let flight = SingleFlight::<u32, u32>::default();
        let calls = AtomicUsize::new(0);
        let hits = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let (v, hit) = flight
                        .get_or_try_init(7, || {
                            calls.fetch_add(1, Ordering::SeqCst);
                            std::thread::sleep(Duration::from_millis(50));
                            Ok::<_, ()>(49)
                        })
                        .unwrap();
                    assert_eq!(v, 49);
                    hits.fetch_add(hit as usize, Ordering::SeqCst);
                });
            }
        });
        assert_eq!(calls.into_inner(), 1);
        assert_eq!(hits.into_inner(), 7);
    }

    #[test]
    fn different_keys_compute_in_parallel() {
        // Key 1's init waits for key 2's: under one global lock it would time out.
        let flight = SingleFlight::<u32, bool>::default();
        let (tx, rx) = mpsc::channel();
        let flight = &flight;
        std::thread::scope(|s| {
            let waiter = s.spawn(move || {
                flight.get_or_try_init(1, || Ok::<_, ()>(rx.recv_timeout(Duration::from_secs(10)).is_ok()))
            });
            std::thread::sleep(Duration::from_millis(50));
            flight.get_or_try_init(2, || Ok::<_, ()>(tx.send(()).is_ok())).unwrap();
            assert_eq!(waiter.join().unwrap(), Ok((true, false)));
        });
    }

    #[test]
    fn get_answers_only_computed_values() {
        let flight = SingleFlight::<u32, u32>::default();
        assert_eq!(flight.get(&1), None, "never asked for");
        let _ = flight.get_or_try_init(1, || Err::<u32, _>("failed"));
        assert_eq!(flight.get(&1), None, "a failed init leaves nothing");
        let (started_tx, started_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        std::thread::scope(|s| {
            let flight = &flight;
            s.spawn(move || {
                flight.get_or_try_init(2, || {
                    started_tx.send(()).unwrap();
                    release_rx.recv().unwrap();
                    Ok::<_, ()>(4)
                })
            });
            started_rx.recv().unwrap();
            assert_eq!(flight.get(&2), None, "in flight: no wait");
            release_tx.send(()).unwrap();
        });
        assert_eq!(flight.get(&2), Some(4));
    }

    #[test]
    fn errors_are_not_cached() {
        let flight = SingleFlight::<u32, u32>::default();
        assert_eq!(flight.get_or_try_init(1, || Err("transient")), Err("transient"));
        assert_eq!(flight.get_or_try_init(1, || Ok::<_, &str>(5)), Ok((5, false)));
        assert_eq!(flight.get_or_try_init(1, || Err("unused")), Ok((5, true)));
    }
}
