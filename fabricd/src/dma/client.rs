//! The gate of a registration of a client's own memory: what lets an `Unregister` wait for
//! the accesses to that memory in flight without anyone else waiting on them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{RwLock, RwLockReadGuard};

/// The gate of one registration of a client's own memory ([`super::Backing::Process`]).
///
/// Every access to that memory — a copy's chunk on an engine, a copy across nodes, a
/// device's DMA — holds it read-locked ([`ClientGate::enter`]) around its
/// `process_vm_readv`/`writev`, and nothing else: the daemon-held side of a copy is
/// reached under the copy's own gate, never under this one. Undoing the registration shuts
/// it ([`ClientGate::shut`]: no access begins after) and, last of what the operation does
/// before it answers, drains it ([`ClientGate::drain`]: the accesses in flight end), so no
/// byte of the client's memory moves once its `Unregister` (or its session's end) is done.
///
/// Why a gate of its own: an access to a client's memory can stall for as long as the
/// client likes — a page whose fault it never serves (userfaultfd, a FUSE file mapped
/// there). Held here, such a stall holds up only that client's own `Unregister` or session
/// end, and only once everything else the operation does is done; the sweeps of every
/// other operation (a `Free`, another tenant's `Unregister`) wait on the copies' gates
/// only, and those are held for daemon memory only, which never waits on a client.
#[derive(Debug, Default)]
pub struct ClientGate {
    /// Read-held by the accesses in flight; write-locked by [`ClientGate::drain`].
    in_flight: RwLock<()>,
    /// Shut: the registration is undone, and no access may begin.
    shut: AtomicBool,
}

/// Why [`ClientGate::reach`] did not reach a client's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreached {
    /// The registration was undone (the gate is shut).
    Unregistered,
    /// The process that registered it has exited (or is no longer the one that
    /// connected).
    ProcessGone,
}

/// An access to a client's memory in flight: [`ClientGate::drain`] waits for it to drop.
#[derive(Debug)]
#[must_use = "the access is in flight while this is held"]
pub struct ClientAccess<'a> {
    _in_flight: RwLockReadGuard<'a, ()>,
}

impl ClientGate {
    /// An open gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begins an access; `None` once the gate is shut.
    pub fn enter(&self) -> Option<ClientAccess<'_>> {
        let in_flight = self.in_flight.read().unwrap_or_else(|p| p.into_inner());
        // Read under the lock: an access that saw the gate open is in flight until it
        // drops the guard, and a drain after the shut waits for it.
        (!self.shut.load(Ordering::Acquire)).then_some(ClientAccess { _in_flight: in_flight })
    }

    /// Runs `f` with the pid of `process` (the registration's, followed by its pidfd:
    /// [`crate::transport::peer::Process::with`]) under the gate: the one way the daemon
    /// reaches a client's registered memory.
    pub fn reach<T>(
        &self,
        process: &crate::transport::peer::Process,
        f: impl FnOnce(i32) -> T,
    ) -> Result<T, Unreached> {
        let _access = self.enter().ok_or(Unreached::Unregistered)?;
        process.with(f).map_err(|_| Unreached::ProcessGone)
    }

    /// Shuts the gate: no access begins after. Never blocks.
    pub fn shut(&self) {
        self.shut.store(true, Ordering::Release);
    }

    /// Waits for the accesses in flight to end (after [`ClientGate::shut`], none begins).
    /// Blocks for as long as an access stalls in the client's memory: called only where
    /// the client's own operation waits, off every shared lock, once the rest of that
    /// operation is done.
    pub fn drain(&self) {
        drop(self.in_flight.write().unwrap_or_else(|p| p.into_inner()));
    }

    /// Whether the gate is shut.
    pub fn is_shut(&self) -> bool {
        self.shut.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_drain_waits_for_the_access_in_flight_and_a_shut_gate_refuses_later_ones() {
        let gate = Arc::new(ClientGate::new());
        let access = gate.enter().unwrap();
        gate.shut();
        assert!(gate.is_shut());
        assert!(gate.enter().is_none(), "an access began after the shut");
        let drained = Arc::new(AtomicBool::new(false));
        let drainer = {
            let (gate, drained) = (gate.clone(), drained.clone());
            std::thread::spawn(move || {
                gate.drain();
                drained.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!drained.load(Ordering::SeqCst), "drained with an access in flight");
        drop(access);
        drainer.join().unwrap();
        assert!(drained.load(Ordering::SeqCst));
    }
}
