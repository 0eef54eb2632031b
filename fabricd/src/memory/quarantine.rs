//! Quarantine of memory other nodes may still map (`docs/domain.md`, "Faults"): a region
//! imported over the node link by a node that then left (its imports released after the
//! lease TTL), or freed while another node's import of it was not yet acknowledged as
//! ended, keeps its range out of the allocator when its owner frees it — the freeing
//! client is answered and charged nothing, but the range is not handed out again, since
//! the departed node's devices may still store to it. The range comes back when every
//! node that held it acknowledged the revocation, rejoined with a new incarnation (it then
//! holds nothing) or was collected by an admin. It outlives a restart of the owner:
//! `holds.rs` saves who may map what before an import across nodes is granted.

use std::collections::BTreeMap;

use super::{Memory, MemoryError, Reclaimed, State};

/// An importer node's registry session (the node link's owner side).
#[derive(Debug)]
pub(super) struct RemoteSession {
    pub(super) node: String,
    /// Whether its imports count against their uid's limits too (the domain shares
    /// identities; otherwise its clients' uids mean nothing here).
    pub(super) per_uid: bool,
    /// Its live imports: bounded by `limits.imports_per_node`, and counted as descriptors
    /// kept (`held.rs`).
    pub(super) imports: u64,
}

/// What one node holds in quarantine on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quarantine {
    /// The node that may still map the memory.
    pub node: String,
    /// Freed regions whose ranges it holds out of reuse.
    pub regions: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl State {
    /// Bytes held out of the allocators (each range once).
    pub(super) fn quarantined(&self) -> u64 {
        self.ledger.space.parked_bytes()
    }

    /// The nodes that may map region `id` once it is freed, with the acknowledgements
    /// awaited from each ([`Parked::nodes`]): those that imported it and left, and those
    /// whose imports of it are live now (told of each import's end, they acknowledge it).
    pub(super) fn holders(&mut self, id: u64) -> BTreeMap<String, u32> {
        let mut nodes: BTreeMap<String, u32> =
            self.mapped_by.remove(&id).unwrap_or_default().into_iter().map(|n| (n, 1)).collect();
        let live = self
            .ledger
            .imports
            .values()
            .filter(|i| i.region == id)
            .filter_map(|i| self.remote.get(&i.session).map(|r| &r.node));
        for n in live {
            *nodes.entry(n.clone()).or_default() += 1;
        }
        nodes
    }

    /// A freed region's range (`offset` in each of `resources`; a carved DAX device's
    /// once the device is deleted) is free again, or parked while `holders` (other nodes,
    /// [`State::holders`]) may still map it.
    pub(super) fn release_range(
        &mut self,
        region: u64,
        holders: BTreeMap<String, u32>,
        resources: Vec<usize>,
        offset: u64,
        len: u64,
    ) {
        if self.unmap_failed.remove(&region) {
            self.keep_unmapped_range(region, offset, len);
            return;
        }
        // A registration of it is being unmapped (another operation's, outside the lock):
        // released when that is done, kept out if it fails.
        if self.ledger.unmapping.get(&region).is_some_and(|&n| n > 0) {
            self.awaiting_unmap.insert(region, Release { holders, resources, offset, len });
            return;
        }
        if !holders.is_empty() {
            tracing::info!(region, len, nodes = ?holders, "a freed region's range is quarantined: another node may still map it");
        }
        self.ledger.space.release(region, holders, resources, offset, len);
    }

    /// Keeps a freed region's range out of use until a restart: an IOMMU mapping of it
    /// could not be undone, and device memory has no page pin to keep it from reuse, so a
    /// device may still write there.
    fn keep_unmapped_range(&mut self, region: u64, offset: u64, len: u64) {
        tracing::error!(
            region,
            len,
            "a freed region's range stays out of use until a restart: an IOMMU mapping of it could not be undone"
        );
        if self.problems.len() < 256 {
            self.problems.push(format!(
                "region {region}'s range (offset {offset:#x}, +{len:#x}) is kept out of use until a restart: an IOMMU mapping of it could not be undone"
            ));
        }
    }

    /// One unmap of a registration of `region` is done (`unmapped`: it succeeded). A
    /// failed one keeps the region's range out of use, now if it was freed already, else
    /// when it is; the last successful one releases a range that waited for it.
    pub(super) fn unmap_done(&mut self, region: u64, unmapped: bool) {
        let left = match self.ledger.unmapping.get_mut(&region) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n
            }
            None => 0,
        };
        if left == 0 {
            self.ledger.unmapping.remove(&region);
        }
        if !unmapped {
            match self.awaiting_unmap.remove(&region) {
                Some(r) => self.keep_unmapped_range(region, r.offset, r.len),
                None => {
                    self.unmap_failed.insert(region);
                }
            }
            return;
        }
        if left == 0
            && let Some(r) = self.awaiting_unmap.remove(&region)
        {
            self.release_range(region, r.holders, r.resources, r.offset, r.len);
        }
    }

    /// Takes `node` off what it held: one acknowledgement of `region`'s end, or all of
    /// it (`None`); ranges no node holds any more go back to their allocator. Returns the
    /// bytes that did.
    fn unpark(&mut self, node: &str, region: Option<u64>) -> u64 {
        let mut back = 0;
        for p in self.ledger.space.unpark(node, region) {
            back += p.len;
            tracing::info!(region = p.region, len = p.len, node, "a quarantined range is free again");
        }
        if region.is_none() {
            self.mapped_by.retain(|_, nodes| {
                nodes.remove(node);
                !nodes.is_empty()
            });
        }
        back
    }
}

/// A freed region's range to give back, held until its registrations are unmapped.
#[derive(Debug)]
pub(super) struct Release {
    holders: BTreeMap<String, u32>,
    resources: Vec<usize>,
    offset: u64,
    len: u64,
}

impl Memory {
    /// Records `session` as the registry session of importer node `node` at
    /// `incarnation` (the node link's owner side): what it imports is quarantined when
    /// freed until `node` lets go, and counts against the node's own allowance
    /// (`limits.imports_per_node`), against its clients' uids too only when `per_uid` (the
    /// domain shares identities).
    pub fn remote_session(&self, session: u64, node: &str, incarnation: u64, per_uid: bool) {
        let mut st = self.state();
        st.remote.insert(session, RemoteSession { node: node.to_owned(), per_uid, imports: 0 });
        st.incarnations.insert(node.to_owned(), incarnation);
    }

    /// Saves who may map what (`quarantine.record`) when it changed since the last save:
    /// before an import across nodes is granted (the import is then undone if this
    /// fails), and after holds went. The state is read under the registry lock, written
    /// outside it; saves are ordered by their own lock, so the file never goes back to an
    /// older state.
    pub fn save_holds(&self) -> Result<(), MemoryError> {
        let mut saved = self.holds_saved.lock().unwrap_or_else(|p| p.into_inner());
        let holds = self.state().holds();
        if saved.1.as_ref() == Some(&holds) {
            return Ok(());
        }
        let path = self.root.join(super::holds::FILE);
        let bytes = super::holds::encode(saved.0 + 1, &holds);
        fabric_addrmap::durable::write_whole(&path, &bytes)
            .map_err(|e| MemoryError::Io { path: e.path, source: e.source })?;
        *saved = (saved.0 + 1, Some(holds));
        Ok(())
    }

    /// Whether the quarantine record holds what this state needs saved now
    /// ([`Memory::save_holds`] would write nothing). Never waits for a save in progress
    /// (its lock is held across the write and its fsyncs): `false` then, and the caller's
    /// save, off the domain runtime's workers, waits for it.
    pub fn holds_are_saved(&self) -> bool {
        let saved = match self.holds_saved.try_lock() {
            Ok(saved) => saved,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return false,
        };
        saved.1.as_ref() == Some(&self.state().holds())
    }

    /// [`Memory::save_holds`] where a failure only delays dropping holds: logged.
    pub fn save_holds_or_log(&self) {
        if let Err(e) = self.save_holds() {
            tracing::warn!(error = %crate::error_chain(&e), "the quarantine record was not updated; it keeps holds that went");
        }
    }

    /// The importer nodes whose holds came back from `quarantine.record` at start, with the
    /// incarnation they held them at; taken once.
    pub fn take_restored_holders(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut self.state().restored)
    }

    /// Ends importer node `node`'s `session`: its imports released. When the node
    /// `departed` (rather than restarted), the regions it imported stay marked as mapped
    /// by it, and are quarantined when freed.
    pub fn end_remote_session(&self, session: u64, departed: bool) -> Reclaimed {
        let mut st = self.state();
        if let Some(RemoteSession { node, .. }) = st.remote.remove(&session)
            && departed
        {
            let regions: Vec<u64> =
                st.ledger.imports.values().filter(|i| i.session == session).map(|i| i.region).collect();
            for r in regions {
                st.mapped_by.entry(r).or_default().insert(node.clone());
            }
        }
        drop(st);
        let reclaimed = self.close_session(session);
        self.save_holds_or_log();
        reclaimed
    }

    /// Node `node` acknowledged the end of one of its imports of `region`, or maps nothing
    /// at all (`None`: it rejoined with a new incarnation, or an admin collected it); a
    /// range comes back once every node let go of it. Returns the bytes given back to the
    /// allocators.
    pub fn lift_quarantine(&self, node: &str, region: Option<u64>) -> u64 {
        let back = self.state().unpark(node, region);
        self.save_holds_or_log();
        back
    }

    /// [`Memory::lift_quarantine`] of one region, without saving the quarantine record
    /// (a burst of acknowledgements is saved once, by [`Memory::save_holds_or_log`]).
    pub fn acknowledged(&self, node: &str, region: u64) -> u64 {
        self.state().unpark(node, Some(region))
    }

    /// What is quarantined, by node.
    pub fn quarantine(&self) -> Vec<Quarantine> {
        let st = self.state();
        let mut by: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for p in st.ledger.space.parked() {
            for n in p.nodes.keys() {
                let e = by.entry(n.as_str()).or_default();
                e.0 += 1;
                e.1 += p.len;
            }
        }
        by.into_iter().map(|(node, (regions, bytes))| Quarantine { node: node.to_owned(), regions, bytes }).collect()
    }

    /// Bytes held out of the allocators (each range once).
    pub fn quarantined_bytes(&self) -> u64 {
        self.state().quarantined()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::memory::Identity;
    use fabric_proto::wire::{AccessMode, BoundedVec, ExportPolicy};
    use fabric_topology::MemoryKind;

    use super::super::{Memory, MemoryError, Place};
    use crate::config::LimitsConfig;

    const MIB: u64 = 1 << 20;

    fn cred(uid: u32) -> Identity {
        Identity { pid: 1, uid, gid: uid }
    }

    /// A registry over one 256 MiB resource; region of 256 MiB (all of it) of session 1,
    /// exported, imported by session 2.
    fn setup() -> (tempfile::TempDir, Memory, Place, u64, u64) {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = super::super::ledger_tests::inventory();
        let limits = LimitsConfig { allocated_bytes_per_uid: Some(1 << 40), ..LimitsConfig::default() };
        let memory = Memory::open(dir.path(), &inv, limits).unwrap();
        let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        let region = memory.alloc(&cred(0), 1, &place, 256 * MIB, 0).unwrap().region;
        let policy = ExportPolicy {
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
            partition: None,
            access: AccessMode::ReadWrite,
        };
        let handle = memory.export(&cred(0), 1, region, policy).unwrap();
        let import = memory.import(&cred(0), 2, &handle, AccessMode::ReadWrite).unwrap().import;
        (dir, memory, place, region, import)
    }

    #[test]
    fn each_importer_node_has_its_own_allowance_and_none_fills_a_shared_one() {
        use crate::memory::limits::Holder;
        use crate::sys::fdbudget::Budget;
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = super::super::ledger_tests::inventory();
        // Two imports per node, and (for this test) two objects per uid: every node's
        // clients have the same placeholder uid where identities are not shared.
        let limits = LimitsConfig { imports_per_node: 2, objects_per_uid: 2, ..LimitsConfig::default() };
        let mut m = Memory::open(dir.path(), &inv, limits).unwrap();
        // Four descriptors kept in all, three per connection.
        let budget = Budget { clients: 4, held: 4, held_unprivileged: 4, held_per_uid: 3, held_per_connection: 3 };
        m.set_fd_budget(budget, 999);
        let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        let region = m.alloc(&cred(0), 1, &place, 2 * MIB, 0).unwrap().region;
        let policy = ExportPolicy {
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
            partition: Some(fabric_proto::wire::Name::truncated("p")),
            access: AccessMode::ReadWrite,
        };
        let handle = m.export(&cred(0), 1, region, policy).unwrap();
        let nobody = cred(65534);
        let import = |m: &Memory, session| m.import(&nobody, session, &handle, AccessMode::ReadWrite).map(|g| g.import);
        let refused = |r: Result<u64, MemoryError>| match r {
            Err(MemoryError::Limit { who, what, used, max, .. }) => (who, what, used, max),
            other => panic!("expected a limit, got {other:?}"),
        };
        m.remote_session(2, "b", 1, false);
        m.remote_session(3, "c", 1, false);
        let first = import(&m, 2).unwrap();
        import(&m, 2).unwrap();
        assert_eq!(refused(import(&m, 2)), (Holder::Node("b".into()), "imports_per_node", 2, 2));
        // c is not held back by b's imports, though the uid is the same (objects_per_uid
        // is 2): a shared placeholder's allowance would refuse it.
        import(&m, 3).unwrap();
        import(&m, 3).unwrap();
        m.release(2, first).unwrap();
        import(&m, 2).unwrap();
        // A new incarnation of b starts with its own count (the old session's imports go).
        m.end_remote_session(2, false);
        m.remote_session(4, "b", 2, false);
        import(&m, 4).unwrap();
        // Other nodes' imports count as kept descriptors, never privileged ones: c's two
        // and b's one, then d's first fill the four.
        m.remote_session(5, "d", 1, false);
        import(&m, 5).unwrap();
        assert_eq!(refused(import(&m, 5)), (Holder::Node("d".into()), "descriptors_unprivileged", 4, 4));
        // Where identities are shared, the uid's allowance counts too.
        m.end_remote_session(3, false);
        m.end_remote_session(5, false);
        m.remote_session(6, "e", 1, true);
        let alice = cred(1000);
        m.import(&alice, 6, &handle, AccessMode::ReadWrite).unwrap();
        m.import(&alice, 6, &handle, AccessMode::ReadWrite).unwrap();
        m.remote_session(7, "f", 1, true);
        let r = m.import(&alice, 7, &handle, AccessMode::ReadWrite).map(|g| g.import);
        assert_eq!(refused(r), (Holder::Uid(1000), "objects", 2, 2));
    }

    fn full(m: &Memory, place: &Place) -> bool {
        matches!(m.alloc(&cred(0), 3, place, 256 * MIB, 0), Err(MemoryError::NoSpace(_)))
    }

    #[test]
    fn a_region_a_departed_node_imported_is_not_reused_until_the_node_returns() {
        let (_dir, m, place, region, _) = setup();
        m.remote_session(2, "b", 1, true);
        m.end_remote_session(2, true);
        m.free(1, region).unwrap();
        assert!(full(&m, &place), "the range is quarantined");
        assert_eq!(m.quarantined_bytes(), 256 * MIB);
        assert_eq!(m.quarantine()[0].node, "b");
        assert_eq!(m.lift_quarantine("c", None), 0, "another node's return lifts nothing");
        assert_eq!(m.lift_quarantine("b", None), 256 * MIB);
        assert!(!full(&m, &place), "the range is free again");
        assert!(m.quarantine().is_empty());
    }

    #[test]
    fn a_region_freed_under_a_live_remote_import_waits_for_its_acknowledgement() {
        let (_dir, m, place, region, _) = setup();
        m.remote_session(2, "b", 1, true);
        m.free(1, region).unwrap();
        assert!(full(&m, &place));
        assert_eq!(m.lift_quarantine("b", Some(region + 1)), 0);
        assert_eq!(m.lift_quarantine("b", Some(region)), 256 * MIB);
        assert!(!full(&m, &place));
    }

    #[test]
    fn a_carved_regions_range_is_parked_once_its_device_is_gone_while_another_node_may_map_it() {
        let (_dir, m, place, region, _) = setup();
        let (resource, offset, len) = {
            let st = m.state();
            let r = &st.ledger.regions[&region];
            (r.resource, r.offset, r.len)
        };
        m.free(1, region).unwrap();
        // What a carved region's free leaves: its range taken by its device until the
        // device is deleted (the effect), then free, or parked while b may map it.
        use std::collections::BTreeMap;
        let carved = |holders: BTreeMap<String, u32>| {
            let mut st = m.state();
            assert!(st.ledger.space.take(&[resource], offset, len));
            st.release_range(region, holders, vec![resource], offset, len);
        };
        carved(BTreeMap::new());
        assert!(
            m.state().ledger.space.is_free(&[resource], offset, len),
            "no other node: free once the device is gone"
        );
        carved(BTreeMap::from([("b".to_owned(), 1)]));
        assert!(full(&m, &place), "b's device over the same DPAs may still map it");
        assert_eq!(m.quarantine()[0].node, "b");
        assert_eq!(m.acknowledged("b", region), 256 * MIB);
        assert!(!full(&m, &place));
    }

    #[test]
    fn a_region_two_remote_imports_held_waits_for_both_acknowledgements() {
        // Two clients of node b imported the region (b maps it through one device for
        // both): the first acknowledged end says nothing of the second.
        let (_dir, m, place, region, _) = setup();
        m.remote_session(2, "b", 1, true);
        let handle = m
            .export(
                &cred(0),
                1,
                region,
                ExportPolicy {
                    uids: BoundedVec::default(),
                    gids: BoundedVec::default(),
                    partition: None,
                    access: AccessMode::ReadOnly,
                },
            )
            .unwrap();
        m.import(&cred(0), 2, &handle, AccessMode::ReadOnly).unwrap();
        m.free(1, region).unwrap();
        assert_eq!(m.acknowledged("b", region), 0, "one of b's two imports is still to be acknowledged");
        assert!(full(&m, &place));
        assert_eq!(m.acknowledged("b", region), 256 * MIB);
        assert!(!full(&m, &place));
    }

    #[test]
    fn the_quarantine_outlives_a_restart_of_the_owner() {
        use super::super::ledger_tests::{inventory, me, open};
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory();
        let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        let policy = ExportPolicy {
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
            partition: None,
            access: AccessMode::ReadWrite,
        };
        let (freed, kept) = {
            let m = open(dir.path(), &inv);
            let freed = m.alloc(&me(), 1, &place, 64 * MIB, 0).unwrap().region;
            let kept = m.alloc(&me(), 1, &place, 64 * MIB, 0).unwrap().region;
            m.remote_session(2, "b", 5, true);
            for r in [freed, kept] {
                let handle = m.export(&me(), 1, r, policy.clone()).unwrap();
                m.import(&me(), 2, &handle, AccessMode::ReadWrite).unwrap();
            }
            assert!(!m.holds_are_saved(), "two holds for b that no record has");
            m.save_holds().unwrap();
            assert!(m.holds_are_saved());
            // b imports a region it holds already: nothing to write.
            let handle = m.export(&me(), 1, kept, policy.clone()).unwrap();
            m.import(&me(), 2, &handle, AccessMode::ReadWrite).unwrap();
            assert!(m.holds_are_saved(), "the record needs no write for a hold it has");
            {
                // A save in progress (its lock held across the write and its fsyncs) is
                // not waited for: the domain runtime's worker asking goes on at once.
                let _saving = m.holds_saved.lock().unwrap();
                assert!(!m.holds_are_saved(), "answered without waiting for the save");
            }
            m.free(1, freed).unwrap();
            assert_eq!(m.quarantined_bytes(), 64 * MIB);
            (freed, kept)
            // The daemon dies here: b's session never ends.
        };
        let m = open(dir.path(), &inv);
        assert_eq!(m.quarantined_bytes(), 64 * MIB, "the freed region's range is still held for b");
        assert_eq!(m.quarantine()[0].node, "b");
        assert!(m.state().mapped_by.get(&kept).is_some_and(|n| n.contains("b")), "the live one is marked");
        assert!(!m.state().mapped_by.contains_key(&freed));
        assert_eq!(m.take_restored_holders(), [("b".to_owned(), 5)]);
        assert!(m.take_restored_holders().is_empty(), "taken once");
        assert!(!m.state().ledger.space.is_free(&[0], 0, 64 * MIB), "the range is out of the allocator");
        // b reached the new incarnation: everything lifts, and the lift is saved.
        assert_eq!(m.lift_quarantine("b", None), 64 * MIB);
        drop(m);
        let m = open(dir.path(), &inv);
        assert_eq!(m.quarantined_bytes(), 0);
        assert!(m.state().ledger.space.is_free(&[0], 0, 64 * MIB));
        assert!(m.take_restored_holders().is_empty());
        assert!(!m.state().mapped_by.contains_key(&kept));
    }

    #[test]
    fn a_restarted_node_or_a_local_importer_quarantines_nothing() {
        let (_dir, m, place, region, _) = setup();
        m.remote_session(2, "b", 1, true);
        m.end_remote_session(2, false);
        m.free(1, region).unwrap();
        assert!(!full(&m, &place));
        let (_dir, m, place, region, import) = setup();
        m.release(2, import).unwrap();
        m.free(1, region).unwrap();
        assert!(!full(&m, &place), "a local import never quarantines");
    }
}
