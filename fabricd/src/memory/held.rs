//! Descriptors that objects keep open while they live — an adopted CUDA export's, a DMA
//! registration's pinned file or pidfd, the region file an import by another node keeps
//! here — counted against the open-file table's shares ([`crate::sys::fdbudget`]): per uid,
//! per connection (its session; an importer node's session is its connection), for all
//! uids other than root and the daemon's own together (another node's imports always
//! among them), and for everyone. A request that would pass one is refused with
//! `LimitExceeded` naming it, before anything is opened or kept.

use super::limits::Holder;
use super::{Memory, MemoryError, State};
use crate::sys::fdbudget::Budget;

/// The shares, and whose objects may use the part kept back from other uids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HeldLimits {
    budget: Budget,
    /// The daemon's effective uid: like root's, its objects count only against the whole
    /// share and the connection's.
    own_uid: u32,
}

impl Default for HeldLimits {
    /// No bound (a registry without a daemon: tests, tools).
    fn default() -> Self {
        Self { budget: Budget::unlimited(u32::MAX), own_uid: 0 }
    }
}

impl Memory {
    /// Bounds the descriptors objects keep by `budget`; root's and `own_uid`'s objects may
    /// use the share kept back from other uids.
    pub fn set_fd_budget(&mut self, budget: Budget, own_uid: u32) {
        self.held = HeldLimits { budget, own_uid };
    }

    /// Refuses one more kept descriptor for `uid` in `session` when a share is full. An
    /// importer node's session is never privileged (its uid is not one of this host's
    /// users) and its share is its session's.
    pub(super) fn check_held(&self, st: &State, uid: u32, session: u64) -> Result<(), MemoryError> {
        let HeldLimits { budget: b, own_uid } = self.held;
        let remote = st.remote.get(&session);
        let privileged = remote.is_none() && (uid == 0 || uid == own_uid);
        let who = remote.map_or(Holder::Uid(uid), |r| Holder::Node(r.node.clone()));
        let limit = |what, used: u64, max| {
            if used.saturating_add(1) > max {
                Err(MemoryError::Limit { who: who.clone(), what, used, requested: 1, max })
            } else {
                Ok(())
            }
        };
        // What other nodes' imports keep, unprivileged whatever their uids.
        let nodes: u64 = st.remote.values().map(|r| r.imports).sum();
        let sum = |all: bool| -> u64 {
            let uids: u64 =
                st.ledger.usage.iter().filter(|(u, _)| all || (**u != 0 && **u != own_uid)).map(|(_, x)| x.fds).sum();
            uids.saturating_add(nodes)
        };
        if !privileged {
            if remote.is_none() {
                limit("descriptors_per_uid", st.ledger.usage_of(uid).fds, b.held_per_uid)?;
            }
            limit("descriptors_unprivileged", sum(false), b.held_unprivileged)?;
        }
        limit("descriptors", sum(true), b.held)?;
        limit("descriptors_per_connection", Self::held_by_session(st, session), b.held_per_connection)
    }

    /// Descriptors `session`'s objects keep: its registrations and its adopted objects',
    /// and for an importer node's session its imports.
    fn held_by_session(st: &State, session: u64) -> u64 {
        let registrations = st.ledger.dma.ids_where(|g| g.session == session).len() as u64;
        let objects = st
            .ledger
            .regions
            .values()
            .filter(|r| r.session == session && r.object().is_some_and(|o| o.holds_fd()))
            .count() as u64;
        let imports = st.remote.get(&session).map_or(0, |r| r.imports);
        registrations + objects + imports
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::fd::{FromRawFd, OwnedFd};

    use crate::memory::Identity;
    use fabric_proto::wire::ObjectKind;
    use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};

    use super::*;
    use crate::config::LimitsConfig;
    use crate::memory::Place;

    fn memfd() -> OwnedFd {
        // SAFETY: a NUL-terminated name and no flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"object".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: the descriptor was just created and is owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    fn who(uid: u32) -> Identity {
        Identity { pid: 1, uid, gid: uid }
    }

    #[test]
    fn each_share_refuses_the_descriptor_past_it_and_gives_it_back_when_the_object_goes() {
        let id = DeviceId::uuid("GPU-74ea8f39-337d-2bff-f79c-f2f5ed86e4ee");
        let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 1 << 30, hpa: None, numa_node: None });
        d.sources = vec!["pci".into()];
        let mut inv = Inventory::default();
        inv.add_device(d).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        // Two per connection and per uid, three for other uids together, six in all.
        let budget = Budget { clients: 4, held: 6, held_unprivileged: 3, held_per_uid: 2, held_per_connection: 2 };
        m.set_fd_budget(budget, 999);
        let hbm = Place { device: id, kind: MemoryKind::Hbm, ordinal: None };
        let adopt = |m: &Memory, uid: u32, session: u64| {
            m.adopt(&who(uid), session, &hbm, 2 << 20, ObjectKind::CudaPosixFd, Some(memfd()))
        };
        let what = |r: Result<_, MemoryError>| match r {
            Err(MemoryError::Limit { what, .. }) => what,
            other => panic!("expected a limit, got {other:?}"),
        };
        let a = adopt(&m, 1000, 1).unwrap();
        adopt(&m, 1000, 1).unwrap();
        assert_eq!(what(adopt(&m, 1000, 2)), "descriptors_per_uid");
        adopt(&m, 1001, 3).unwrap();
        assert_eq!(what(adopt(&m, 1002, 4)), "descriptors_unprivileged");
        // Root and the daemon's uid use the share kept back, up to the whole table.
        adopt(&m, 0, 5).unwrap();
        adopt(&m, 0, 5).unwrap();
        assert_eq!(what(adopt(&m, 0, 5)), "descriptors_per_connection");
        adopt(&m, 999, 6).unwrap();
        assert_eq!(what(adopt(&m, 0, 7)), "descriptors");
        // Freeing an object gives its descriptor back.
        m.free(1, a.region).unwrap();
        adopt(&m, 1002, 4).unwrap();
    }
}
