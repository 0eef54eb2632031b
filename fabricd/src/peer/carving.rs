//! A table of things that take slow work to make and to unmake (the DAX devices an importer
//! carves for its clients' imports: `peer/cxl.rs`), by key, whose lock is never held across
//! that work: a key being made or unmade is marked busy, and whoever wants it meanwhile
//! waits for that key alone; other keys go on.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Condvar, Mutex, MutexGuard};

#[derive(Debug)]
enum Slot<V> {
    /// Being made or unmade, outside the lock.
    Busy,
    Ready(V),
}

/// The table.
#[derive(Debug)]
pub struct Table<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
    changed: Condvar,
}

impl<K, V> Default for Table<K, V> {
    fn default() -> Self {
        Self { slots: Mutex::new(HashMap::new()), changed: Condvar::new() }
    }
}

/// What [`Table::begin`] found.
#[derive(Debug)]
pub enum Begin<'a, K: Hash + Eq + Clone, V, R> {
    /// The key's value, as `use_it` took it.
    Found(R),
    /// None: the caller makes it and [`Making::fill`]s the slot (dropped unfilled, the
    /// slot is let go).
    Make(Making<'a, K, V>),
}

/// A slot reserved for a value being made, or one being unmade; the slot is let go (and
/// its waiters woken) when this drops, unless filled.
#[derive(Debug)]
#[must_use = "the slot stays busy until this is filled or dropped"]
pub struct Making<'a, K: Hash + Eq + Clone, V> {
    table: &'a Table<K, V>,
    key: K,
    filled: bool,
}

impl<K: Hash + Eq + Clone, V> Making<'_, K, V> {
    /// The value is made: the key holds it from now on.
    pub fn fill(mut self, value: V) {
        self.table.lock().insert(self.key.clone(), Slot::Ready(value));
        self.filled = true;
    }
}

impl<K: Hash + Eq + Clone, V> Drop for Making<'_, K, V> {
    fn drop(&mut self) {
        if !self.filled {
            let mut slots = self.table.lock();
            if matches!(slots.get(&self.key), Some(Slot::Busy)) {
                slots.remove(&self.key);
            }
        }
        self.table.changed.notify_all();
    }
}

impl<K: Hash + Eq + Clone, V> Table<K, V> {
    fn lock(&self) -> MutexGuard<'_, HashMap<K, Slot<V>>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value of `key` taken by `use_it` (under the lock: no I/O), after waiting for a
    /// make or unmake of it in progress; or, when there is none, the key reserved for the
    /// caller to make it.
    pub fn begin<R>(&self, key: &K, use_it: impl FnOnce(&mut V) -> R) -> Begin<'_, K, V, R> {
        let mut slots = self.lock();
        loop {
            match slots.get_mut(key) {
                Some(Slot::Busy) => slots = self.changed.wait(slots).unwrap_or_else(|p| p.into_inner()),
                Some(Slot::Ready(v)) => return Begin::Found(use_it(v)),
                None => {
                    slots.insert(key.clone(), Slot::Busy);
                    return Begin::Make(Making { table: self, key: key.clone(), filled: false });
                }
            }
        }
    }

    /// Lets `done` see the value of `key` (under the lock: no I/O); when it says the value
    /// is done with, the value is taken out to unmake, its key busy until the returned
    /// guard drops. Nothing for a key that holds no value.
    pub fn end(&self, key: &K, done: impl FnOnce(&mut V) -> bool) -> Option<(V, Making<'_, K, V>)> {
        let mut slots = self.lock();
        let Some(Slot::Ready(v)) = slots.get_mut(key) else { return None };
        if !done(v) {
            return None;
        }
        let Some(Slot::Ready(v)) = slots.insert(key.clone(), Slot::Busy) else { return None };
        Some((v, Making { table: self, key: key.clone(), filled: false }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    fn take(t: &Table<u32, u32>, key: u32) -> Option<u32> {
        match t.begin(&key, |users| {
            *users += 1;
            *users
        }) {
            Begin::Found(users) => Some(users),
            Begin::Make(m) => {
                m.fill(1);
                None
            }
        }
    }

    #[test]
    fn a_key_is_made_once_and_its_users_counted() {
        let t = Table::default();
        assert_eq!(take(&t, 1), None, "made");
        assert_eq!(take(&t, 1), Some(2));
        assert!(
            t.end(&1, |u| {
                *u -= 1;
                *u == 0
            })
            .is_none()
        );
        let (v, unmaking) = t
            .end(&1, |u| {
                *u -= 1;
                *u == 0
            })
            .unwrap();
        assert_eq!(v, 0);
        drop(unmaking);
        assert_eq!(take(&t, 1), None, "made again once unmade");
        assert!(t.end(&7, |_| true).is_none(), "no value, nothing to end");
    }

    #[test]
    fn a_key_being_made_or_unmade_is_waited_for_and_other_keys_are_not() {
        let t = Arc::new(Table::<u32, u32>::default());
        let Begin::Make(making) = t.begin(&1, |_| ()) else { panic!() };
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let (t, tx) = (t.clone(), tx.clone());
            std::thread::spawn(move || tx.send(("waiter", take(&t, 1))).unwrap())
        };
        // Another key is served while key 1 is being made.
        assert_eq!(take(&t, 2), None);
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "key 1 is waited for");
        making.fill(5);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), ("waiter", Some(6)));
        waiter.join().unwrap();

        // Unmade: a new user waits, then makes it anew.
        let (_, unmaking) = t.end(&1, |_| true).unwrap();
        let waiter = {
            let t = t.clone();
            std::thread::spawn(move || tx.send(("waiter", take(&t, 1))).unwrap())
        };
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "key 1 is being unmade");
        drop(unmaking);
        assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), ("waiter", None), "made anew");
        waiter.join().unwrap();
    }

    #[test]
    fn a_make_that_fails_lets_the_key_go() {
        let t = Table::<u32, u32>::default();
        let Begin::Make(making) = t.begin(&1, |_| ()) else { panic!() };
        drop(making);
        assert_eq!(take(&t, 1), None, "free to make again");
    }
}
