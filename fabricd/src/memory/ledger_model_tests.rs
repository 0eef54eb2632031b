//! The ledger alone, against the journal's replay model: random sequences of allocations,
//! frees, exports, revocations, imports, releases, sessions ending and devices lost are
//! applied to a [`Ledger`] the way the registry's shell applies them (no files, no
//! journal, no lock); after every step the ledger must agree with
//! - [`Replayed`] fed the journal records the steps produced (the regions, exports and
//!   losses a restart would rebuild),
//! - its own usage counted again from what it holds (DMA registrations' pins included,
//!   given back when the shell undoes what an operation detached),
//! - every live registration's cover: its region live and not lost, its import live and
//!   not revoked,
//! - the revocations it queued, which must be exactly those the step ended (session,
//!   region, generation, import, reason), and its `ended` flag, set by exactly the steps
//!   that ended something,
//! - where regions lie (`space.rs`): a small resource, so that it fills; every live
//!   region's range and every parked one taken, none overlapping another, the rest free
//!   (a region freed while another node may map it stays parked until that node lets go).
//!
//! Some regions are vendor objects holding a descriptor (counted in usage, never
//! journaled); importers include the owners' own sessions; policies list uids and gids,
//! admit the owner only, or name a partition.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::memory::Identity;
use fabric_proto::wire::{
    AccessMode, BoundedVec, DeviceName, ExportHandle, ExportPolicy, MemoryClass, Name, Revocation, RevocationReason,
    Secret, SessionToken,
};
use proptest::prelude::*;

use super::adopt::Object;
use super::backings::Backing;
use super::durable::{Change, RegionRecord, Replayed, ResourceKey};
use super::ledger::{Ledger, Region, Usage};
use super::ledger_tests::owner_only;
use super::space::Space;
use super::{MemoryError, Reclaimed};
use crate::dma::{Covers, Registration};

const MIB: u64 = 1 << 20;

/// The resource's bytes: a few regions fill it.
const CAPACITY: u64 = 48 * MIB;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        session: u64,
        mib: u64,
        object: bool,
    },
    Free {
        pick: usize,
        /// Another node may still map it: its range is parked.
        held: bool,
    },
    /// A node that held parked ranges lets go of one.
    LetGo {
        pick: usize,
    },
    Export {
        pick: usize,
        read_only: bool,
        policy: u8,
    },
    Revoke {
        pick: usize,
    },
    Import {
        pick: usize,
        session: u64,
        write: bool,
        per_uid: bool,
    },
    Release {
        pick: usize,
    },
    CloseSession {
        session: u64,
    },
    Lose {
        pick: usize,
    },
    /// A DMA registration of a region (its owner's), an import (its holder's) or a
    /// session's own memory.
    Register {
        pick: usize,
        cover: u8,
        pages: u64,
    },
    Unregister {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..4, 1u64..9, prop::bool::weighted(0.2)).prop_map(|(session, mib, object)| Op::Alloc { session, mib, object }),
        2 => (any::<usize>(), prop::bool::weighted(0.3)).prop_map(|(pick, held)| Op::Free { pick, held }),
        1 => any::<usize>().prop_map(|pick| Op::LetGo { pick }),
        3 => (any::<usize>(), any::<bool>(), 0u8..4).prop_map(|(pick, read_only, policy)| Op::Export { pick, read_only, policy }),
        1 => any::<usize>().prop_map(|pick| Op::Revoke { pick }),
        4 => (any::<usize>(), 1u64..7, any::<bool>(), any::<bool>())
            .prop_map(|(pick, session, write, per_uid)| Op::Import { pick, session, write, per_uid }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        1 => (1u64..7).prop_map(|session| Op::CloseSession { session }),
        1 => any::<usize>().prop_map(|pick| Op::Lose { pick }),
        3 => (any::<usize>(), 0u8..3, 1u64..5).prop_map(|(pick, cover, pages)| Op::Register { pick, cover, pages }),
        1 => any::<usize>().prop_map(|pick| Op::Unregister { pick }),
    ]
}

/// Session `s`'s process: sessions 1 and 3 are uid 1001, the others uid 1000 + s % 2 too
/// (so a uid holds objects of several sessions).
fn peer(session: u64) -> Identity {
    Identity { pid: 100 + i32::try_from(session).unwrap(), uid: 1000 + u32::try_from(session % 2).unwrap(), gid: 50 }
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
    /// This process, standing for every session's (registrations of a session's own
    /// memory follow it).
    process: crate::transport::peer::Process,
}

impl Shell {
    fn new() -> Self {
        Shell {
            ledger: Ledger { next_id: 1, space: Space::new([CAPACITY]), ..Ledger::default() },
            journal: Vec::new(),
            handles: Vec::new(),
            next_secret: 0,
            process: crate::transport::peer::Process::this().unwrap(),
        }
    }

    /// How many live registrations `pred` matches.
    fn registrations(l: &Ledger, pred: impl Fn(&Registration) -> bool) -> u64 {
        l.dma.ids_where(pred).len() as u64
    }

    /// The registrations through region `id` and its imports.
    fn through_region(l: &Ledger, id: u64) -> u64 {
        Self::registrations(l, |g| match g.covers {
            Covers::Region(k) => k == id,
            Covers::Import(k) => l.imports.get(&k).is_some_and(|i| i.region == id),
            Covers::Fd | Covers::Process => false,
        })
    }

    /// Whether region `id` is journaled (a vendor object is not).
    fn journaled(l: &Ledger, id: u64) -> bool {
        l.regions.get(&id).is_some_and(|r| r.object().is_none())
    }

    /// Applies `op` as the shell does; returns what it must have ended.
    fn apply(&mut self, op: &Op) -> Expect {
        let l = &mut self.ledger;
        let mut want = Expect::default();
        // Every import of region `id`, told for `reason`.
        let ended_by_region = |l: &Ledger, id: u64, reason| -> Vec<(u64, Revocation)> {
            l.imports
                .iter()
                .filter(|(_, i)| i.region == id)
                .map(|(k, i)| (i.session, Revocation { region: id, generation: i.generation, import: *k, reason }))
                .collect()
        };
        match *op {
            Op::Alloc { session, mib, object } => {
                let owner = peer(session);
                let len = mib * 2 * MIB;
                // Placed first: a full resource takes no id.
                let Ok((resource, offset)) = l.space.place([(0, 0)], len) else {
                    let free_somewhere =
                        (0..CAPACITY / (2 * MIB)).map(|g| g * 2 * MIB).any(|o| l.space.is_free(&[0], o, len));
                    assert!(!free_somewhere, "{len} bytes refused with room for them");
                    return want;
                };
                let id = l.take_id();
                let backing = if object {
                    let fd = std::fs::File::open("/dev/null").unwrap();
                    Backing::Object(Object::cuda_fd(fd.into(), len))
                } else {
                    Backing::SimFile(PathBuf::from(format!("r{id}")))
                };
                l.charge(owner.uid, Usage::region(len, u64::from(object)));
                let region = Region {
                    generation: id,
                    owner,
                    pid_start: None,
                    token: token(session),
                    session,
                    resource,
                    offset,
                    len,
                    backing,
                    lost: false,
                };
                if !object {
                    self.journal.push(Change::RegionAllocated(RegionRecord {
                        id,
                        generation: id,
                        token: *region.token.expose(),
                        owner: region.durable_owner(),
                        resource: key(),
                        offset: region.offset,
                        len,
                    }));
                }
                l.publish_region(id, region);
            }
            Op::Free { pick, held } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                let session = l.regions[&id].session;
                // Another session may not free it.
                assert!(matches!(l.owned(id, session + 10), Err(MemoryError::PermissionDenied(_))));
                l.owned(id, session).unwrap();
                want.told = ended_by_region(l, id, RevocationReason::Freed);
                want.ended = true;
                if Self::journaled(l, id) {
                    self.journal.push(Change::RegionFreed { id });
                }
                let through = Self::through_region(l, id);
                let removed = l.remove_region(id, RevocationReason::Freed).unwrap();
                assert_eq!(removed.registrations, through);
                let (r, holders) = (removed.region, if held { [("b".to_owned(), 1)].into() } else { BTreeMap::new() });
                l.space.release(id, holders, vec![r.resource], r.offset, r.len);
            }
            Op::LetGo { pick } => {
                let parked: Vec<u64> = l.space.parked().iter().map(|p| p.region).collect();
                let Some(&region) = parked.get(pick % parked.len().max(1)) else { return want };
                let back = l.space.unpark("b", Some(region));
                assert_eq!(back.iter().map(|p| p.region).collect::<Vec<_>>(), vec![region]);
                assert!(l.space.is_free(&[0], back[0].offset, back[0].len), "a range let go of is free");
            }
            Op::Export { pick, read_only, policy } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                let r = &l.regions[&id];
                let (session, lost, object) = (r.session, r.lost, r.object().is_some());
                let owner = peer(session);
                self.next_secret = self.next_secret.wrapping_add(1);
                let secret = Secret([self.next_secret; 16]);
                let access = if read_only { AccessMode::ReadOnly } else { AccessMode::ReadWrite };
                let list = |v: Vec<u32>| BoundedVec::new(v).unwrap();
                let (uids, gids, partition) = match policy {
                    // The owner's uid, and gid 50 (every test process) for session 1's.
                    0 => (list(vec![owner.uid]), list(if session == 1 { vec![50] } else { vec![] }), None),
                    // The owner's uid only, by leaving both lists empty.
                    1 => (list(vec![]), list(vec![]), None),
                    // A partition's clients (the daemon checked the binding before).
                    2 => (list(vec![]), list(vec![]), Some(Name::truncated("p0"))),
                    // The other uid only.
                    _ => (list(vec![owner.uid ^ 1]), list(vec![]), None),
                };
                let policy = ExportPolicy { uids, gids, partition, access };
                let planned = l.plan_export(&owner, session, id, policy, secret);
                if lost {
                    assert!(matches!(planned, Err(MemoryError::DeviceLost(_))), "{planned:?}");
                    return want;
                }
                if object && read_only {
                    assert!(matches!(planned, Err(MemoryError::BadRequest(_))), "{planned:?}");
                    return want;
                }
                let export = planned.unwrap();
                l.charge(owner.uid, Usage::OBJECT);
                if !object {
                    self.journal.push(Change::ExportCreated(export.record()));
                }
                let handle = export.handle;
                l.publish_export(export).unwrap();
                self.handles.push((session, handle));
            }
            Op::Revoke { pick } => {
                let Some(&(session, h)) = self.handles.get(pick % self.handles.len().max(1)) else { return want };
                let via = match l.revocable(session, &h) {
                    Ok(v) => v,
                    Err(e) => {
                        // Only a handle whose region went is refused to its owner.
                        assert!(matches!(e, MemoryError::InvalidHandle), "{e:?}");
                        assert!(!l.regions.contains_key(&h.region));
                        return want;
                    }
                };
                assert!(matches!(l.revocable(session + 10, &h), Err(MemoryError::PermissionDenied(_))));
                want.told = l
                    .imports
                    .iter()
                    .filter(|(_, i)| i.via.verify(&via))
                    .map(|(k, i)| {
                        let reason = RevocationReason::Revoked;
                        (i.session, Revocation { region: i.region, generation: i.generation, import: *k, reason })
                    })
                    .collect();
                want.ended = true;
                if Self::journaled(l, via.region) {
                    self.journal.push(Change::ExportRevoked {
                        region: via.region,
                        generation: via.generation,
                        secret: *via.secret.expose(),
                    });
                }
                let told: Vec<u64> = want.told.iter().map(|(_, r)| r.import).collect();
                let through = Self::registrations(l, |g| matches!(g.covers, Covers::Import(k) if told.contains(&k)));
                assert_eq!(l.revoke(&via), through, "DMA through the revoked imports ends");
            }
            Op::Import { pick, session, write, per_uid } => {
                let Some(&(_, h)) = self.handles.get(pick % self.handles.len().max(1)) else { return want };
                let importer = peer(session);
                let access = if write { AccessMode::ReadWrite } else { AccessMode::ReadOnly };
                let admits = |e: &super::ledger::Export| {
                    let p = &e.policy;
                    if p.uids.is_empty() && p.gids.is_empty() {
                        importer.uid == e.owner_uid || p.partition.is_some()
                    } else {
                        p.uids.contains(&importer.uid) || p.gids.contains(&importer.gid)
                    }
                };
                let expected = match (l.exports.iter().find(|e| e.handle.verify(&h)), l.regions.get(&h.region)) {
                    (None, _) | (_, None) => Err("invalid"),
                    (Some(e), Some(_)) if e.revoked => Err("revoked"),
                    (Some(e), Some(_)) if !admits(e) => Err("denied"),
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
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                let session = l.imports[&id].session;
                assert!(matches!(l.releasable(session + 10, id), Err(MemoryError::PermissionDenied(_))));
                l.releasable(session, id).unwrap();
                l.remove_import(id).unwrap();
                want.ended = true;
            }
            Op::CloseSession { session } => {
                let regions = l.regions_of(session);
                if !regions.is_empty() {
                    self.journal.push(Change::SessionEnded { token: *token(session).expose() });
                }
                // What the session's connection held goes first, untold (its holder is gone).
                let registered = l.detach_registrations(|g| g.session == session);
                let imports: Vec<u64> =
                    l.imports.iter().filter(|(_, i)| i.session == session).map(|(k, _)| *k).collect();
                want.ended = registered > 0 || !imports.is_empty() || !regions.is_empty();
                for id in imports {
                    l.remove_import(id).unwrap();
                }
                for id in regions {
                    want.told.extend(ended_by_region(l, id, RevocationReason::OwnerExited));
                    let r = l.remove_region(id, RevocationReason::OwnerExited).unwrap().region;
                    l.space.release(id, BTreeMap::new(), vec![r.resource], r.offset, r.len);
                }
            }
            Op::Lose { pick } => {
                let ids = ids_of(&l.regions);
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                let r = &l.regions[&id];
                let mut counts = Reclaimed::default();
                if !r.lost {
                    let (generation, owner) = (r.generation, r.session);
                    let mut told: Vec<(u64, Revocation)> = ended_by_region(l, id, RevocationReason::DeviceLost);
                    told.sort_unstable_by_key(|(_, r)| r.import);
                    counts.regions = 1;
                    counts.exports = l.exports.iter().filter(|e| e.handle.region == id && !e.revoked).count() as u64;
                    counts.imports = told.len() as u64;
                    counts.registrations = Self::through_region(l, id);
                    // The owner is told last, as import 0.
                    let reason = RevocationReason::DeviceLost;
                    told.push((owner, Revocation { region: id, generation, import: 0, reason }));
                    want.told = told;
                    want.ended = true;
                    want.ordered = true;
                }
                let (lost, now) = l.lose(vec![id]);
                assert_eq!(lost, counts);
                // The shell journals each region lost now (a vendor object's changes never).
                if !now.is_empty() && Self::journaled(l, id) {
                    self.journal.push(Change::RegionLost { id });
                }
            }
            Op::Register { pick, cover, pages } => {
                // What the shell's `covered` admits: a region its owner's session holds, not
                // lost and not a vendor object; an import its holder's, not revoked.
                let (covers, session, uid) = match cover {
                    0 => {
                        let ids = ids_of(&l.regions);
                        let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                        let r = &l.regions[&id];
                        if r.lost || r.object().is_some() {
                            return want;
                        }
                        (Covers::Region(id), r.session, r.owner.uid)
                    }
                    1 => {
                        let ids = ids_of(&l.imports);
                        let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                        let i = &l.imports[&id];
                        if l.import_revoked(i) {
                            return want;
                        }
                        (Covers::Import(id), i.session, i.uid)
                    }
                    _ => {
                        let session = 1 + (pick % 6) as u64;
                        (Covers::Process, session, peer(session).uid)
                    }
                };
                let (id, span) = (l.take_id(), pages * 4096);
                l.charge(uid, Usage::registration(span));
                let backing =
                    crate::dma::Backing::Process { process: self.process.clone(), addr: 0, gate: Default::default() };
                let registration = Registration {
                    device: "uuid:GPU-0".parse().unwrap(),
                    domain: "iommu0".into(),
                    iova: id << 30,
                    span,
                    lead: 0,
                    len: span,
                    access: AccessMode::ReadWrite,
                    uid,
                    session,
                    covers,
                    region: None,
                    vfio: None,
                    backing,
                };
                l.dma.insert(id, registration);
            }
            Op::Unregister { pick } => {
                let mut ids = l.dma.ids_where(|_| true);
                ids.sort_unstable();
                let Some(&id) = ids.get(pick % ids.len().max(1)) else { return want };
                assert!(l.detach_registration(id));
                assert!(!l.detach_registration(id), "detached once");
                want.ended = true;
            }
        }
        want
    }

    /// Every invariant the ledger keeps (see the module doc).
    fn check(&mut self, want: Expect) {
        let l = &mut self.ledger;
        // What was queued is what the step ended, each once (in order where the ledger
        // promises one).
        let mut queued = std::mem::take(&mut l.revocations);
        let mut told = want.told;
        if !want.ordered {
            queued.sort_unstable_by_key(|(s, r)| (r.import, *s));
            told.sort_unstable_by_key(|(s, r)| (r.import, *s));
        }
        assert_eq!(queued, told);
        assert_eq!(std::mem::take(&mut l.ended), want.ended);
        // The shell undoes what the step detached (after the lock): its usage given back.
        for (id, g) in std::mem::take(&mut l.unregistered) {
            assert!(l.dma.get(id).is_none(), "registration {id} detached and live");
            l.discharge(g.uid, Usage::registration(g.span));
        }
        // Every live registration's cover is live, and may still be reached by DMA.
        for id in l.dma.ids_where(|_| true) {
            let g = l.dma.get(id).unwrap();
            match g.covers {
                Covers::Region(k) => assert!(l.regions.get(&k).is_some_and(|r| !r.lost), "registration {id}: {k}"),
                Covers::Import(k) => {
                    let i = l.imports.get(&k);
                    assert!(i.is_some_and(|i| !l.import_revoked(i)), "registration {id}: {k}");
                }
                Covers::Fd | Covers::Process => {}
            }
        }
        // Usage is what the ledger holds.
        let mut recount: BTreeMap<u32, (u64, u64, u64, u64)> = BTreeMap::new();
        for r in l.regions.values() {
            let u = recount.entry(r.owner.uid).or_default();
            u.0 += r.len;
            u.1 += 1;
            u.2 += u64::from(r.object().is_some_and(|o| o.holds_fd()));
        }
        for e in &l.exports {
            recount.entry(e.owner_uid).or_default().1 += 1;
        }
        for i in l.imports.values().filter(|i| i.per_uid) {
            recount.entry(i.uid).or_default().1 += 1;
        }
        for id in l.dma.ids_where(|_| true) {
            let g = l.dma.get(id).unwrap();
            let u = recount.entry(g.uid).or_default();
            (u.1, u.2, u.3) = (u.1 + 1, u.2 + 1, u.3 + g.span);
        }
        for uid in [1000, 1001] {
            let u = l.usage_of(uid);
            let want = recount.get(&uid).copied().unwrap_or_default();
            assert_eq!((u.bytes, u.objects, u.fds, u.pinned), want, "uid {uid}");
        }
        // Nothing names a region that is gone.
        for e in &l.exports {
            assert_eq!(l.regions.get(&e.handle.region).map(|r| r.generation), Some(e.handle.generation));
        }
        for i in l.imports.values() {
            assert_eq!(l.regions.get(&i.region).map(|r| r.generation), Some(i.generation));
        }
        // The journal rebuilds what the ledger holds, vendor objects aside (never journaled).
        let mut model = Replayed::default();
        for c in self.journal.iter().cloned() {
            model.apply(c).unwrap();
        }
        let journaled = |id: &u64| Self::journaled(l, *id);
        let held: BTreeMap<u64, (u64, [u8; 16], u32)> = l
            .regions
            .iter()
            .filter(|(id, _)| journaled(id))
            .map(|(id, r)| (*id, (r.generation, *r.token.expose(), r.owner.uid)))
            .collect();
        let rebuilt: BTreeMap<u64, (u64, [u8; 16], u32)> =
            model.regions.iter().map(|(id, r)| (*id, (r.generation, r.token, r.owner.uid))).collect();
        assert_eq!(held, rebuilt);
        // Lost regions (their exports revoked by the loss) are lost after a restart too.
        let lost: std::collections::BTreeSet<u64> =
            l.regions.iter().filter(|(id, r)| r.lost && journaled(id)).map(|(id, _)| *id).collect();
        assert_eq!(lost, model.lost);
        let mut held: Vec<_> =
            l.exports.iter().filter(|e| journaled(&e.handle.region)).map(super::ledger::Export::record).collect();
        let mut rebuilt: Vec<_> = model.exports().cloned().collect();
        held.sort_by_key(|e| (e.region, e.secret));
        rebuilt.sort_by_key(|e| (e.region, e.secret));
        assert_eq!(held, rebuilt);
        assert!(model.next_id <= l.next_id);
        // Where regions lie: live and parked ranges taken, apart, the rest free.
        let mut taken: Vec<(u64, u64)> = l.regions.values().map(|r| (r.offset, r.len)).collect();
        taken.extend(l.space.parked().iter().map(|p| (p.offset, p.len)));
        taken.sort_unstable();
        for w in taken.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "ranges {:x?} and {:x?} overlap", w[0], w[1]);
        }
        for g in (0..CAPACITY).step_by(2 * MIB as usize) {
            let held = taken.iter().any(|&(o, n)| o <= g && g < o + n);
            assert_eq!(l.space.is_free(&[0], g, 2 * MIB), !held, "granule at {g:#x}");
        }
        assert_eq!(l.space.parked_bytes(), l.space.parked().iter().map(|p| p.len).sum::<u64>());
    }
}

/// What a step must have ended.
#[derive(Debug, Default)]
struct Expect {
    /// The revocations it queued, each with the session to tell.
    told: Vec<(u64, Revocation)>,
    /// In this order (else in any).
    ordered: bool,
    /// Whether it ended something (a region, an import, an export's use).
    ended: bool,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_agrees_with_its_journal_its_usage_and_its_revocations(ops in prop::collection::vec(op(), 1..60)) {
        let mut shell = Shell::new();
        for op in &ops {
            let want = shell.apply(op);
            shell.check(want);
        }
    }
}

/// A region freed while one of its exports is being written: the export is refused and
/// its object given back (the shell's commit wait, played in one thread).
#[test]
fn an_export_whose_region_went_while_its_record_was_written_is_refused_and_uncounted() {
    let mut shell = Shell::new();
    shell.apply(&Op::Alloc { session: 1, mib: 1, object: false });
    let l = &mut shell.ledger;
    let owner = peer(1);
    let policy = owner_only();
    let export = l.plan_export(&owner, 1, 1, policy, Secret([7; 16])).unwrap();
    l.charge(owner.uid, Usage::OBJECT);
    assert_eq!(l.usage_of(owner.uid).objects, 2);
    l.remove_region(1, RevocationReason::Freed).unwrap();
    assert!(matches!(l.publish_export(export), Err(MemoryError::NotFound(_))));
    assert_eq!(l.usage_of(owner.uid).objects, 0);
    assert!(l.exports.is_empty());
}

/// An export whose region was lost while its record was written is published revoked:
/// what the journal's replay makes of `ExportCreated` then `RegionLost`.
#[test]
fn an_export_whose_region_was_lost_while_its_record_was_written_is_published_revoked() {
    let mut shell = Shell::new();
    shell.apply(&Op::Alloc { session: 1, mib: 1, object: false });
    let owner = peer(1);
    let policy = owner_only();
    let l = &mut shell.ledger;
    let export = l.plan_export(&owner, 1, 1, policy, Secret([7; 16])).unwrap();
    l.charge(owner.uid, Usage::OBJECT);
    shell.journal.push(Change::ExportCreated(export.record()));
    let handle = export.handle;
    let (lost, _) = l.lose(vec![1]);
    shell.journal.push(Change::RegionLost { id: 1 });
    assert_eq!(lost.exports, 0, "not published yet");
    l.publish_export(export).unwrap();
    assert!(matches!(l.admit(&owner, &handle, AccessMode::ReadOnly), Err(MemoryError::Revoked)));
    let want = Expect { told: shell.ledger.revocations.clone(), ordered: true, ended: true };
    shell.check(want);
}

/// A device lost tells the importers of each region in import order, then its owner
/// (import 0): the order subscribers hear them in.
#[test]
fn a_lost_regions_importers_are_told_in_import_order_and_its_owner_last() {
    let mut shell = Shell::new();
    shell.apply(&Op::Alloc { session: 1, mib: 1, object: false });
    shell.apply(&Op::Export { pick: 0, read_only: false, policy: 2 });
    for session in [4, 5, 6, 4, 5, 6, 4, 5] {
        shell.apply(&Op::Import { pick: 0, session, write: true, per_uid: true });
    }
    let want = shell.apply(&Op::Lose { pick: 0 });
    let told: Vec<(u64, u64)> = want.told.iter().map(|(s, r)| (r.import, *s)).collect();
    assert_eq!(told.len(), 9);
    let queued: Vec<(u64, u64)> = shell.ledger.revocations.iter().map(|(s, r)| (r.import, *s)).collect();
    assert_eq!(queued, told);
    assert_eq!(queued.last(), Some(&(0, 1)), "the owner last");
    assert!(queued[..8].windows(2).all(|w| w[0].0 < w[1].0), "{queued:?}");
    shell.check(want);
}
