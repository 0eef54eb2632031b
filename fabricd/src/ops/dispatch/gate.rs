//! The policy gate: an operation authorized against the partition state has finished
//! before a change of that state is acknowledged.
//!
//! Why: authorization reads the partition state (bindings and members) lock-free, and the
//! operation it admits then runs under the memory registry's lock, possibly for long (an
//! allocation zeroes or carves its backing). Without the gate an administrator could
//! move a device out of a tenant's partition, be told it is done, list the device's
//! regions, hand it to another tenant — and only then see the first tenant's allocation,
//! checked against the old partition, land on it. The check and the act did not see the
//! same state.
//!
//! The gate is a grace period, as in RCU: each such operation holds a [`Pass`] from before
//! its authorization until its effects are in place, stamped with the policy epoch it
//! entered under. A change publishes the new state, opens a new epoch and waits until
//! no pass of an earlier epoch is left ([`PolicyGate::changed`]). Operations that enter
//! after the new epoch opened read the new state. Nobody else waits: passes of the new
//! epoch are taken and dropped freely while the change waits, and the only waiting side
//! is the change's own answer. Critical sections are a counter update each; no I/O.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};

/// How long a change waits before each line saying it still waits.
const SLOW_CHANGE: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Debug, Default)]
struct Epochs {
    /// The epoch new passes enter under.
    current: u64,
    /// Passes held, by the epoch they entered under (no zero counts).
    held: BTreeMap<u64, usize>,
}

/// Orders operations authorized against the partition state before changes to it.
#[derive(Debug, Default)]
pub struct PolicyGate {
    epochs: Mutex<Epochs>,
    released: Condvar,
}

/// Held by an operation from before its authorization until its effects are in place.
#[derive(Debug)]
#[must_use = "the pass covers the operation only while it is held"]
pub struct Pass<'a> {
    gate: &'a PolicyGate,
    epoch: u64,
}

impl PolicyGate {
    /// A gate with no pass held.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Epochs> {
        // A counter map stays consistent even if a holder panicked.
        self.epochs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pass for one operation; take it before reading the partition state.
    pub fn enter(&self) -> Pass<'_> {
        let mut e = self.lock();
        let epoch = e.current;
        *e.held.entry(epoch).or_insert(0) += 1;
        Pass { gate: self, epoch }
    }

    /// Call after a change to the partition state is published and before it is
    /// acknowledged: opens a new epoch and returns once every pass taken before it has
    /// been dropped. Must not be called while holding a pass (it would wait for itself).
    pub fn changed(&self) {
        let mut e = self.lock();
        e.current += 1;
        let opened = e.current;
        let started = std::time::Instant::now();
        while e.held.range(..opened).next().is_some() {
            let (next, waited) = self.released.wait_timeout(e, SLOW_CHANGE).unwrap_or_else(|p| p.into_inner());
            e = next;
            if waited.timed_out() {
                // A client's slow pin holds the answer, never the new state (already in force).
                let older: usize = e.held.range(..opened).map(|(_, n)| n).sum();
                drop(e);
                tracing::warn!(
                    operations = older,
                    waited_s = started.elapsed().as_secs(),
                    "a partition change waits for operations checked against the old partitions"
                );
                e = self.lock();
            }
        }
    }

    /// Passes held now (for tests).
    pub fn held(&self) -> usize {
        self.lock().held.values().sum()
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        let mut e = self.gate.lock();
        if let Some(n) = e.held.get_mut(&self.epoch) {
            *n -= 1;
            if *n == 0 {
                e.held.remove(&self.epoch);
                self.gate.released.notify_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn a_change_waits_for_passes_taken_before_it_and_for_no_later_one() {
        let gate = Arc::new(PolicyGate::new());
        let done = Arc::new(AtomicBool::new(false));
        std::thread::scope(|s| {
            let before = gate.enter();
            let change = s.spawn(|| {
                gate.changed();
                done.store(true, Ordering::SeqCst);
            });
            // Passes taken after the change opened its epoch neither block it nor wait.
            while gate.lock().current == 0 {
                std::thread::yield_now();
            }
            let after = gate.enter();
            assert_eq!(after.epoch, 1);
            drop(after);
            std::thread::sleep(Duration::from_millis(100));
            assert!(!done.load(Ordering::SeqCst), "acknowledged while an operation checked before it was in flight");
            drop(before);
            change.join().unwrap();
            assert!(done.load(Ordering::SeqCst));
        });
        assert_eq!(gate.held(), 0);
    }

    #[test]
    fn a_change_with_nothing_in_flight_returns_at_once() {
        let gate = PolicyGate::new();
        gate.changed();
        let p = gate.enter();
        assert_eq!(p.epoch, 1);
        assert_eq!(gate.held(), 1);
    }
}
