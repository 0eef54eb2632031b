//! The ledger alone, against the journal's replay model: random sequences of allocations,
//! frees, exports, revocations, imports, releases, sessions ending and devices lost are
//! applied to a [`Ledger`] the way the registry's shell applies them (no files, no
//! journal, no lock); after every step the ledger must agree with
//! - [`Replayed`] fed the journal records the steps produced (the regions and exports a
//!   restart would rebuild; a device lost is not journaled),
//! - its own usage counted again from what it holds,
//! - and the revocations it queued, which must name exactly the imports the step ended.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use fabric_proto::wire::{
    AccessMode, BoundedVec, DeviceName, ExportHandle, ExportPolicy, MemoryClass, PeerCred, RevocationReason, Secret,
    SessionToken,
};
use proptest::prelude::*;

use super::MemoryError;
use super::backings::Backing;
use super::durable::{Change, RegionRecord, Replayed, ResourceKey};
use super::ledger::{Ledger, Region, Usage};

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Alloc { session: u64, mib: u64 },
    Free { pick: usize },
    Export { pick: usize, read_only: bool },
    Revoke { pick: usize },
    Import { pick: usize, session: u64, write: bool, per_uid: bool },
    Release { pick: usize },
    CloseSession { session: u64 },
    Lose { pick: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..4, 1u64..9).prop_map(|(session, mib)| Op::Alloc { session, mib }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(pick, read_only)| Op::Export { pick, read_only }),
        1 => any::<usize>().prop_map(|pick| Op::Revoke { pick }),
        4 => (any::<usize>(), 4u64..7, any::<bool>(), any::<bool>())
            .prop_map(|(pick, session, write, per_uid)| Op::Import { pick, session, write, per_uid }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => (1u64..7).prop_map(|session| Op::CloseSession { session }),
        1 => any::<usize>().prop_map(|pick| Op::Lose { pick }),
    ]
}

/// Session `s`'s process: sessions 1 and 3 are uid 1001, the others uid 1000 + s % 2 too
/// (so a uid holds objects of several sessions).
fn peer(session: u64) -> PeerCred {
    PeerCred { pid: 100 + i32::try_from(session).unwrap(), uid: 1000 + u32::try_from(session % 2).unwrap(), gid: 50 }
}

fn token(session: u64) -> SessionToken {
    SessionToken([u8::try_from(session).unwrap(); 16])
}

fn key() -> ResourceKey {
    ResourceKey { device: DeviceName::truncated("GPU-0"), kind: MemoryClass::Hbm, ordinal: 0 }
}

/// The keys of `map`, in order.
fn ids_of<V>(map: &std::collections::HashMap<u64, V>) -> Vec<u64> {
    let mut ids: Vec<u64> = map.keys().copied().collect();
    ids.sort_unstable();
    ids
}

/// What the test plays: the shell around the ledger, and what it journaled.
struct Shell {
    ledger: Ledger,
    journal: Vec<Change>,
    handles: Vec<(u64, ExportHandle)>,
    next_secret: u8,
}

impl Shell {
    fn new() -> Self {
        Shell {
            ledger: Ledger { next_id: 1, ..Ledger::default() },
            journal: Vec::new(),
            handles: Vec::new(),
            next_secret: 0,
        }
    }

    /// Applies `op`; returns the imports it must have told (with the reason), by id.
    fn apply(&mut self, op: &Op) -> BTreeMap<u64, RevocationReason> {
        let l = &mut self.ledger;
        let mut told = BTreeMap::new();
        let ended_by_region = |l: &Ledger, id: u64, reason| {
            l.imports.iter().filter(|(_, i)| i.region == id).map(|(k, _)| (*k, reason)).collect::<BTreeMap<_, _>>()
        };
        match *op {
            Op::Alloc { session, mib } => {
                let owner = peer(session);
                let (id, len) = (l.take_id(), mib * 2 * MIB);
                l.charge(owner.uid, Usage::region(len, 0));
                let region = Region {
                    generation: id,
                    owner,
                    pid_start: None,
                    token: token(session),
                    session,
                    resource: 0,
                    offset: id * 64 * MIB,
                    len,
                    backing: Backing::SimFile(PathBuf::from(format!("r{id}"))),
                    lost: false,
                };
                self.journal.push(Change::RegionAllocated(RegionRecord {
                    id,
                    generation: id,
                    token: *region.token.expose(),
                    owner: region.durable_owner(),
                    resource: key(),
                    offset: region.offset,
                    len,
                }));
                l.publish_region(id, region);
            }
            Op::Free { pick } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return told };
                let session = l.regions[&id].session;
                // Another session may not free it.
                assert!(matches!(l.owned(id, session + 10), Err(MemoryError::PermissionDenied(_))));
                l.owned(id, session).unwrap();
                told = ended_by_region(l, id, RevocationReason::Freed);
                self.journal.push(Change::RegionFreed { id });
                l.remove_region(id, RevocationReason::Freed).unwrap();
            }
            Op::Export { pick, read_only } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return told };
                let (session, lost) = (l.regions[&id].session, l.regions[&id].lost);
                let owner = peer(session);
                self.next_secret = self.next_secret.wrapping_add(1);
                let secret = Secret([self.next_secret; 16]);
                let access = if read_only { AccessMode::ReadOnly } else { AccessMode::ReadWrite };
                // Admits the owner's uid and gid 50 (every test process).
                let policy = ExportPolicy {
                    uids: BoundedVec::new(vec![owner.uid]).unwrap(),
                    gids: BoundedVec::new(if session == 1 { vec![50] } else { vec![] }).unwrap(),
                    partition: None,
                    access,
                };
                let planned = l.plan_export(&owner, session, id, policy, secret);
                if lost {
                    assert!(matches!(planned, Err(MemoryError::DeviceLost(_))), "{planned:?}");
                    return told;
                }
                let export = planned.unwrap();
                l.charge(owner.uid, Usage::OBJECT);
                self.journal.push(Change::ExportCreated(export.record()));
                let handle = export.handle;
                l.publish_export(export).unwrap();
                self.handles.push((session, handle));
            }
            Op::Revoke { pick } => {
                let Some(&(session, h)) = self.handles.get(pick % self.handles.len().max(1)) else { return told };
                let via = match l.revocable(session, &h) {
                    Ok(v) => v,
                    Err(e) => {
                        // Only a handle whose region went is refused to its owner.
                        assert!(matches!(e, MemoryError::InvalidHandle), "{e:?}");
                        assert!(!l.regions.contains_key(&h.region));
                        return told;
                    }
                };
                assert!(matches!(l.revocable(session + 10, &h), Err(MemoryError::PermissionDenied(_))));
                told = l
                    .imports
                    .iter()
                    .filter(|(_, i)| i.via.verify(&via))
                    .map(|(k, _)| (*k, RevocationReason::Revoked))
                    .collect();
                self.journal.push(Change::ExportRevoked {
                    region: via.region,
                    generation: via.generation,
                    secret: *via.secret.expose(),
                });
                let ids: BTreeSet<u64> = l.revoke(&via).into_iter().collect();
                assert_eq!(ids, told.keys().copied().collect());
            }
            Op::Import { pick, session, write, per_uid } => {
                let Some(&(_, h)) = self.handles.get(pick % self.handles.len().max(1)) else { return told };
                let importer = peer(session);
                let access = if write { AccessMode::ReadWrite } else { AccessMode::ReadOnly };
                let expected = match (l.exports.iter().find(|e| e.handle.verify(&h)), l.regions.get(&h.region)) {
                    (None, _) | (_, None) => Err("invalid"),
                    (Some(e), Some(_)) if e.revoked => Err("revoked"),
                    (Some(e), Some(_))
                        if !(e.policy.uids.contains(&importer.uid) || e.policy.gids.contains(&importer.gid)) =>
                    {
                        Err("denied")
                    }
                    (Some(e), Some(_)) if write && e.policy.access == AccessMode::ReadOnly => Err("denied"),
                    (Some(_), Some(_)) => Ok(()),
                };
                let admitted = l.admit(&importer, &h, access);
                match (expected, admitted) {
                    (Ok(()), Ok(via)) => {
                        let (_, generation) = l.record_import(&importer, session, (&h, via), access, per_uid).unwrap();
                        assert_eq!(generation, h.generation);
                    }
                    (Err("invalid"), Err(MemoryError::InvalidHandle))
                    | (Err("revoked"), Err(MemoryError::Revoked))
                    | (Err("denied"), Err(MemoryError::PermissionDenied(_))) => {}
                    (e, got) => panic!("expected {e:?}, got {got:?}"),
                }
            }
            Op::Release { pick } => {
                let ids = ids_of(&l.imports);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return told };
                let session = l.imports[&id].session;
                assert!(matches!(l.releasable(session + 10, id), Err(MemoryError::PermissionDenied(_))));
                l.releasable(session, id).unwrap();
                l.remove_import(id).unwrap();
            }
            Op::CloseSession { session } => {
                let regions = l.regions_of(session);
                if !regions.is_empty() {
                    self.journal.push(Change::SessionEnded { token: *token(session).expose() });
                }
                let imports: Vec<u64> =
                    l.imports.iter().filter(|(_, i)| i.session == session).map(|(k, _)| *k).collect();
                for id in imports {
                    l.remove_import(id).unwrap();
                }
                for id in regions {
                    told.extend(ended_by_region(l, id, RevocationReason::OwnerExited));
                    l.remove_region(id, RevocationReason::OwnerExited).unwrap();
                }
            }
            Op::Lose { pick } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return told };
                if !l.regions[&id].lost {
                    told = ended_by_region(l, id, RevocationReason::DeviceLost);
                    // The owner is told too, as import 0.
                    told.insert(0, RevocationReason::DeviceLost);
                }
                let (lost, _) = l.lose(vec![id]);
                assert_eq!(lost.imports, told.len().saturating_sub(1) as u64);
            }
        }
        told
    }

    /// Every invariant the ledger keeps (see the module doc).
    fn check(&mut self, told: &BTreeMap<u64, RevocationReason>) {
        let l = &mut self.ledger;
        // What was queued is what the step ended, each once.
        let queued: Vec<(u64, RevocationReason)> =
            std::mem::take(&mut l.revocations).into_iter().map(|(_, r)| (r.import, r.reason)).collect();
        assert_eq!(queued.len(), told.len(), "{queued:?} against {told:?}");
        assert_eq!(queued.into_iter().collect::<BTreeMap<_, _>>(), *told);
        // Usage is what the ledger holds.
        let mut recount: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        for r in l.regions.values() {
            let u = recount.entry(r.owner.uid).or_default();
            u.0 += r.len;
            u.1 += 1;
        }
        for e in &l.exports {
            recount.entry(e.owner_uid).or_default().1 += 1;
        }
        for i in l.imports.values().filter(|i| i.per_uid) {
            recount.entry(i.uid).or_default().1 += 1;
        }
        for uid in [1000, 1001] {
            let u = l.usage_of(uid);
            let want = recount.get(&uid).copied().unwrap_or_default();
            assert_eq!((u.bytes, u.objects, u.pinned, u.fds), (want.0, want.1, 0, 0), "uid {uid}");
        }
        // Nothing names a region that is gone.
        for e in &l.exports {
            assert_eq!(l.regions.get(&e.handle.region).map(|r| r.generation), Some(e.handle.generation));
        }
        for i in l.imports.values() {
            assert_eq!(l.regions.get(&i.region).map(|r| r.generation), Some(i.generation));
        }
        // The journal rebuilds what the ledger holds.
        let mut model = Replayed::default();
        for c in self.journal.iter().cloned() {
            model.apply(c).unwrap();
        }
        let held: BTreeMap<u64, (u64, [u8; 16], u32)> =
            l.regions.iter().map(|(id, r)| (*id, (r.generation, *r.token.expose(), r.owner.uid))).collect();
        let rebuilt: BTreeMap<u64, (u64, [u8; 16], u32)> =
            model.regions.iter().map(|(id, r)| (*id, (r.generation, r.token, r.owner.uid))).collect();
        assert_eq!(held, rebuilt);
        // A device lost is not journaled (the next start finds what is there): its
        // regions' exports are revoked here only.
        let lost = |region: u64| l.regions.get(&region).is_some_and(|r| r.lost);
        let mut held: Vec<_> = l.exports.iter().map(super::ledger::Export::record).collect();
        let mut rebuilt = model.exports.clone();
        for e in held.iter_mut().chain(rebuilt.iter_mut()).filter(|e| lost(e.region)) {
            e.revoked = true;
        }
        held.sort_by_key(|e| (e.region, e.secret));
        rebuilt.sort_by_key(|e| (e.region, e.secret));
        assert_eq!(held, rebuilt);
        assert!(model.next_id <= l.next_id);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_agrees_with_its_journal_its_usage_and_its_revocations(ops in prop::collection::vec(op(), 1..60)) {
        let mut shell = Shell::new();
        for op in &ops {
            let told = shell.apply(op);
            shell.check(&told);
        }
    }
}

/// A region freed while one of its exports is being written: the export is refused and
/// its object given back (the shell's commit wait, played in one thread).
#[test]
fn an_export_whose_region_went_while_its_record_was_written_is_refused_and_uncounted() {
    let mut shell = Shell::new();
    shell.apply(&Op::Alloc { session: 1, mib: 1 });
    let l = &mut shell.ledger;
    let owner = peer(1);
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let export = l.plan_export(&owner, 1, 1, policy, Secret([7; 16])).unwrap();
    l.charge(owner.uid, Usage::OBJECT);
    assert_eq!(l.usage_of(owner.uid).objects, 2);
    l.remove_region(1, RevocationReason::Freed).unwrap();
    assert!(matches!(l.publish_export(export), Err(MemoryError::NotFound(_))));
    assert_eq!(l.usage_of(owner.uid).objects, 0);
    assert!(l.exports.is_empty());
}
