//! The gate of a registration of a client's own memory: what lets an `Unregister` wait for
//! the accesses to that memory in flight without anyone else waiting on them.

use std::sync::{RwLock, RwLockReadGuard};

/// The gate of one registration of a client's own memory ([`super::Backing::Process`]).
///
/// Every access to that memory — a copy's chunk on an engine, a copy across nodes, a
/// device's DMA — holds it read-locked ([`ClientGate::enter`]) around its
/// `process_vm_readv`/`writev`, and nothing else: the daemon-held side of a copy is
/// reached under the copy's own gate, never under this one. Undoing the registration
/// closes it ([`ClientGate::close`]), which waits for the accesses in flight, so no byte of
/// the client's memory moves once its `Unregister` (or its session's end) is answered.
///
/// Why a gate of its own: an access to a client's memory can stall for as long as the
/// client likes — a page whose fault it never serves (userfaultfd, a FUSE file mapped
/// there). Held here, such a stall holds up only that client's own `Unregister` or session
/// end; the sweeps of every other operation (a `Free`, another tenant's `Unregister`) wait
/// on the copies' gates only, and those are held for daemon memory only, which never waits
/// on a client.
#[derive(Debug, Default)]
pub struct ClientGate {
    /// Closed: the registration is undone, and no access may begin.
    closed: RwLock<bool>,
}

/// An access to a client's memory in flight: [`ClientGate::close`] waits for it to drop.
#[derive(Debug)]
#[must_use = "the access is in flight while this is held"]
pub struct ClientAccess<'a> {
    _open: RwLockReadGuard<'a, bool>,
}

impl ClientGate {
    /// An open gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begins an access; `None` once the registration is undone.
    pub fn enter(&self) -> Option<ClientAccess<'_>> {
        let open = self.closed.read().unwrap_or_else(|p| p.into_inner());
        (!*open).then_some(ClientAccess { _open: open })
    }

    /// Closes the gate once the accesses in flight are over: later ones are refused.
    /// Blocks for as long as an access stalls in the client's memory; called only where
    /// the client's own operation waits (the undoing of its registration, off every
    /// shared lock).
    pub fn close(&self) {
        *self.closed.write().unwrap_or_else(|p| p.into_inner()) = true;
    }

    /// Whether the gate is closed.
    pub fn closed(&self) -> bool {
        *self.closed.read().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn closing_waits_for_the_access_in_flight_and_refuses_later_ones() {
        let gate = Arc::new(ClientGate::new());
        let access = gate.enter().unwrap();
        let closed = Arc::new(AtomicBool::new(false));
        let closer = {
            let (gate, closed) = (gate.clone(), closed.clone());
            std::thread::spawn(move || {
                gate.close();
                closed.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!closed.load(Ordering::SeqCst), "closed with an access in flight");
        drop(access);
        closer.join().unwrap();
        assert!(closed.load(Ordering::SeqCst));
        assert!(gate.closed());
        assert!(gate.enter().is_none(), "an access began after the close");
    }
}
