//! The registry against the journal's replay model, without a daemon: a random sequence
//! of changes (allocations, frees, exports, revocations, sessions ending) is applied to a
//! durable registry, which journals them by group commit and compacts every few records;
//! a fresh registry rebuilt from that journal must hold exactly what the first one holds.

#![allow(clippy::unwrap_used)]

use crate::memory::Identity;
use fabric_proto::wire::{AccessMode, BoundedVec, ExportHandle, ExportPolicy, RegionsResponse};
use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};
use proptest::prelude::*;

use super::backing::Backings;
use super::{Durability, Memory, Place};
use crate::config::{LimitsConfig, MemoryConfig};
use crate::journal::{Committer, Journal, JournalOptions};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Op {
    Alloc { session: u64, mib: u64 },
    Free { pick: usize },
    Export { pick: usize },
    Revoke { pick: usize },
    CloseSession { session: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..4, 1u64..9).prop_map(|(session, mib)| Op::Alloc { session, mib }),
        2 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Export { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Revoke { pick }),
        1 => (1u64..4).prop_map(|session| Op::CloseSession { session }),
    ]
}

/// One sim GPU with 256 MiB of HBM.
pub(super) fn inventory() -> (Inventory, DeviceId) {
    let id = DeviceId::uuid("GPU-74ea8f39-337d-2bff-f79c-f2f5ed86e4ee");
    let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
    d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 256 * MIB, hpa: None, numa_node: None });
    d.sources = vec!["sim".to_owned()];
    let mut inv = Inventory::default();
    inv.add_device(d).unwrap();
    (inv, id)
}

/// A durable registry over `dir`, rebuilt from its journal.
pub(super) fn open(dir: &std::path::Path, inv: &Inventory) -> Memory {
    open_with(dir, inv, Backings::default())
}

/// [`open`] with the device memory `backings` exports.
pub(super) fn open_with(dir: &std::path::Path, inv: &Inventory, backings: Backings) -> Memory {
    let (journal, replay) = Journal::open(&dir.join("journal"), JournalOptions::default()).unwrap();
    let config = MemoryConfig { compact_records: 4, resume_grace_s: 600, ..MemoryConfig::default() };
    let durability = Durability { journal, replay, config, backings };
    Memory::open_durable(&dir.join("memory"), inv, LimitsConfig::default(), durability).unwrap()
}

/// What the registry holds, as a client lists it (ids, generations, owners, ranges,
/// exports and their revocation), imports aside (they are not journaled).
fn held(m: &Memory) -> RegionsResponse {
    let mut r = m.list(None);
    r.imports = BoundedVec::default();
    r
}

/// The owner of every region: this process, alive (a rebuilt registry keeps its regions
/// for it).
pub(super) fn me() -> Identity {
    Identity { pid: i32::try_from(std::process::id()).unwrap(), uid: 1000, gid: 1000 }
}

/// An export policy that admits the owner's uid, read-write.
pub(super) fn owner_only() -> ExportPolicy {
    ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    }
}

fn apply(m: &Memory, gpu: &DeviceId, ops: &[Op]) {
    let me = me();
    let place = Place { device: gpu.clone(), kind: MemoryKind::Hbm, ordinal: None };
    let policy = owner_only();
    let mut regions: Vec<(u64, u64)> = Vec::new();
    let mut handles: Vec<(u64, ExportHandle)> = Vec::new();
    for op in ops {
        // Refusals (no room, nothing to pick) are part of the sequence: they change nothing.
        match *op {
            Op::Alloc { session, mib } => {
                if let Ok(g) = m.alloc(&me, session, &place, mib * MIB, 0) {
                    regions.push((session, g.region));
                }
            }
            Op::Free { pick } if !regions.is_empty() => {
                let (session, id) = regions.remove(pick % regions.len());
                m.free(session, id).unwrap();
                handles.retain(|(_, h)| h.region != id);
            }
            Op::Export { pick } if !regions.is_empty() => {
                let (session, id) = regions[pick % regions.len()];
                handles.push((session, m.export(&me, session, id, policy.clone()).unwrap()));
            }
            Op::Revoke { pick } if !handles.is_empty() => {
                let (session, h) = &handles[pick % handles.len()];
                m.revoke(*session, h).unwrap();
            }
            Op::CloseSession { session } => {
                m.close_session(session);
                regions.retain(|(s, _)| *s != session);
                let live: Vec<u64> = regions.iter().map(|(_, id)| *id).collect();
                handles.retain(|(_, h)| live.contains(&h.region));
            }
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn a_registry_rebuilt_from_its_journal_holds_what_the_first_held(ops in prop::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory();
        let before = {
            let m = open(dir.path(), &inv);
            apply(&m, &gpu, &ops);
            held(&m)
        };
        let after = held(&open(dir.path(), &inv));
        prop_assert_eq!(before, after);
    }
}

#[test]
fn concurrent_allocations_never_collide_and_all_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let before = {
        let m = std::sync::Arc::new(open(dir.path(), &inv));
        let threads: Vec<_> = (1..=8u64)
            .map(|session| {
                let (m, gpu) = (m.clone(), gpu.clone());
                std::thread::spawn(move || {
                    let ops: Vec<Op> = (0..4).map(|_| Op::Alloc { session, mib: 2 }).collect();
                    apply(&m, &gpu, &ops);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        held(&m)
    };
    assert_eq!(before.regions.len(), 32);
    let after = held(&open(dir.path(), &inv));
    assert_eq!(before, after);
    // No two regions share a range: the reservations kept them apart.
    let mut ranges: Vec<(u64, u64)> = after.regions.iter().map(|r| (r.offset, r.size)).collect();
    ranges.sort_unstable();
    assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0), "{ranges:?}");
}

/// An import opens the region's file without the lock, between two steps under it: what
/// happens to the export or the region between the open and the grant is seen by the grant.
#[test]
fn an_import_whose_region_is_freed_or_export_revoked_while_its_file_opens_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let me = me();
    let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
    let policy = owner_only();
    let rw = AccessMode::ReadWrite;
    // Plan, open outside the lock, let `meanwhile` change the registry, then grant.
    let import = |h: &ExportHandle, meanwhile: &dyn Fn()| {
        let pending = m.plan_import(&me, 2, h, rw).unwrap();
        let fd = std::os::fd::OwnedFd::from(pending.file.open(true).unwrap());
        meanwhile();
        m.grant_import(&me, 2, h, rw, pending, fd)
    };

    let kept = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    let h = m.export(&me, 1, kept.region, policy.clone()).unwrap();
    let g = import(&h, &|| {}).unwrap();
    assert_eq!((g.region, g.generation, g.len), (kept.region, kept.generation, kept.len));

    let freed = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    let h = m.export(&me, 1, freed.region, policy.clone()).unwrap();
    let refused = import(&h, &|| {
        m.free(1, freed.region).unwrap();
    });
    assert!(matches!(refused, Err(super::MemoryError::InvalidHandle)), "{refused:?}");

    let revoked = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    let h = m.export(&me, 1, revoked.region, policy).unwrap();
    let refused = import(&h, &|| m.revoke(1, &h).unwrap());
    assert!(matches!(refused, Err(super::MemoryError::Revoked)), "{refused:?}");

    // Only the first import was recorded.
    assert_eq!(m.counts().imports, 1);
}

#[test]
fn a_session_ended_before_its_first_allocation_takes_the_lock_gets_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let me = me();
    let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
    // The token is made once, outside the lock, and kept by later uses.
    let token = m.session_token(1, &me).unwrap();
    assert_eq!(m.session_token(1, &me).unwrap(), token);
    m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    // The session ends between its token being made and the reservation: refused, and
    // nothing is left reserved.
    m.ensure_session(2, &me).unwrap();
    m.close_session(2);
    let refused = m.reserve_on(&me, 2, &place, 2 * MIB, 0);
    assert!(matches!(refused, Err(super::MemoryError::NotFound(_))), "{refused:?}");
    assert_eq!(m.counts().regions, 1);
    assert_eq!(m.list(None).regions.len(), 1);
}

/// A resource a device file backs (a BAR's `resourceN`; a plain file stands in): its
/// regions are ranges of that one file, zeroed when allocated, never removed, and a
/// registry rebuilt from the journal finds each at the same offset of the same file.
#[test]
fn a_device_range_region_is_zeroed_kept_and_found_again_at_its_offset() {
    use std::os::unix::fs::{FileExt, MetadataExt};

    use super::backing::{BackingKind, BarBacking, DeviceBacking};

    let dir = tempfile::tempdir().unwrap();
    let id = DeviceId::uuid("GPU-0d5b4c1e-6a3f-4f7e-9c2b-3e1f5a7d9b11");
    let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
    d.memory.push(MemoryResource { kind: MemoryKind::HostExported, size: 64 * MIB, hpa: None, numa_node: None });
    let mut inv = Inventory::default();
    inv.add_device(d).unwrap();
    let bar = dir.path().join("resource2");
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&bar).unwrap();
    f.write_all_at(&vec![0xaa; (8 * MIB) as usize], 0).unwrap();
    let backing = DeviceBacking {
        kind: BackingKind::Bar,
        name: "0000:00:05.0/2".into(),
        path: bar.clone(),
        start: 0,
        len: 8 * MIB,
        align: 4096,
        carve: None,
    };
    let backings = Backings {
        bars: vec![BarBacking {
            address: "0000:00:05.0".parse().unwrap(),
            resource: Some((id.clone(), 0)),
            index: 2,
            backing,
        }],
        ..Backings::default()
    };
    let me = me();
    let place = Place { device: id, kind: MemoryKind::HostExported, ordinal: None };
    let policy = owner_only();
    let same_file = |fd: &std::os::fd::OwnedFd| {
        let a = std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap();
        let b = std::fs::metadata(&bar).unwrap();
        (a.dev(), a.ino()) == (b.dev(), b.ino())
    };
    let byte = |at: u64| {
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        b[0]
    };

    let (kept, handle) = {
        let m = open_with(dir.path(), &inv, backings.clone());
        let freed = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
        let kept = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
        assert!(same_file(&kept.fd) && same_file(&freed.fd));
        assert_eq!((freed.offset, kept.offset), (0, 2 * MIB));
        // Each region's range was zeroed; the rest of the device keeps its bytes.
        assert_eq!((byte(0), byte(2 * MIB), byte(4 * MIB - 1), byte(4 * MIB)), (0, 0, 0, 0xaa));
        // While the end hook stops the copies through the freed region (the kernel does
        // not take their mapping of the device file away), its range is not handed out.
        let during_hook = std::sync::Arc::new(std::sync::Mutex::new(None));
        let seen = during_hook.clone();
        let (who, at) = (me, place.clone());
        m.on_end(super::EndHook {
            stop_copies: Box::new(move |m| {
                let mut seen = seen.lock().unwrap();
                if seen.is_none() {
                    *seen = Some(m.alloc(&who, 1, &at, 2 * MIB, 0).unwrap().region);
                }
            }),
            tell: Box::new(|_| {}),
        });
        m.free(1, freed.region).unwrap();
        let probe = during_hook.lock().unwrap().expect("the hook ran");
        let offsets: Vec<_> = m.list(None).regions.iter().map(|r| (r.region, r.offset)).collect();
        assert!(offsets.contains(&(probe, 4 * MIB)), "allocated past the freed range: {offsets:?}");
        m.free(1, probe).unwrap();
        assert!(bar.exists(), "device memory is never removed");
        let handle = m.export(&me, 1, kept.region, policy).unwrap();
        (kept.region, handle)
    };
    let m = open_with(dir.path(), &inv, backings);
    let listed = m.list(None);
    assert_eq!(listed.regions.len(), 1);
    assert_eq!((listed.regions[0].region, listed.regions[0].offset), (kept, 2 * MIB));
    let g = m.import(&me, 9, &handle, AccessMode::ReadWrite).unwrap();
    assert!(same_file(&g.fd));
    assert_eq!((g.region, g.offset, g.len), (kept, 2 * MIB, 2 * MIB));
    // The freed range is free again, and allocated first.
    assert_eq!(m.alloc(&me, 9, &place, 2 * MIB, 0).unwrap().offset, 0);
}

/// BAR `index` of function 0000:00:05.0 as the resource of `id` at `ordinal`: a file
/// `resource<index>` under `dir` standing in for it (8 MiB of `fill`, made once).
pub(super) fn bar_backing(
    dir: &std::path::Path,
    id: &DeviceId,
    index: u8,
    ordinal: u16,
    fill: u8,
) -> super::backing::BarBacking {
    use std::os::unix::fs::FileExt;

    use super::backing::{BackingKind, BarBacking, DeviceBacking};

    let path = dir.join(format!("resource{index}"));
    if !path.exists() {
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
        f.write_all_at(&vec![fill; (8 * MIB) as usize], 0).unwrap();
    }
    let backing = DeviceBacking {
        kind: BackingKind::Bar,
        name: format!("0000:00:05.0/{index}"),
        path,
        start: 0,
        len: 8 * MIB,
        align: 4096,
        carve: None,
    };
    BarBacking { address: "0000:00:05.0".parse().unwrap(), resource: Some((id.clone(), ordinal)), index, backing }
}

/// A BAR dropped from the configuration moves the next one of its function into its
/// ordinal: a region journaled on the dropped BAR is not restored onto the other (whose
/// bytes another region's owner wrote), and the next start, whose offers match, restores
/// what was allocated since.
#[test]
fn a_region_whose_resource_is_backed_by_other_memory_after_a_restart_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let id = DeviceId::uuid("GPU-0d5b4c1e-6a3f-4f7e-9c2b-3e1f5a7d9b11");
    let inv_of = |bars: usize| {
        let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
        for _ in 0..bars {
            d.memory.push(MemoryResource { kind: MemoryKind::HostExported, size: 8 * MIB, hpa: None, numa_node: None });
        }
        let mut inv = Inventory::default();
        inv.add_device(d).unwrap();
        inv
    };
    let bar = |index, ordinal, fill| bar_backing(dir.path(), &id, index, ordinal, fill);
    let me = me();
    let place = |ordinal| Place { device: id.clone(), kind: MemoryKind::HostExported, ordinal: Some(ordinal) };
    {
        let both = Backings { bars: vec![bar(2, 0, 0xaa), bar(4, 1, 0xbb)], ..Backings::default() };
        let m = open_with(dir.path(), &inv_of(2), both);
        assert_eq!(m.alloc(&me, 1, &place(0), 2 * MIB, 0).unwrap().offset, 0);
        assert_eq!(m.alloc(&me, 1, &place(1), 2 * MIB, 0).unwrap().offset, 0);
    }
    // `memory.bars` loses BAR 2: BAR 4 is the function's first (ordinal 0) now.
    let only_four = || Backings { bars: vec![bar(4, 0, 0xbb)], ..Backings::default() };
    {
        let m = open_with(dir.path(), &inv_of(1), only_four());
        assert!(m.list(None).regions.is_empty(), "neither region is restored: {:?}", m.list(None).regions);
        let problems = m.problems();
        assert!(problems.iter().any(|p| p.contains("memory changed since it was allocated")), "{problems:?}");
        assert_eq!(m.alloc(&me, 1, &place(0), 2 * MIB, 0).unwrap().offset, 0, "BAR 4's range is free");
    }
    // The record was saved for the new layout: what was allocated on it comes back.
    let m = open_with(dir.path(), &inv_of(1), only_four());
    let listed = m.list(None);
    assert_eq!(listed.regions.len(), 1);
    assert_eq!(listed.regions[0].offset, 0);
}

/// A resource the offers record does not list came after that start (a device a rescan
/// added): its regions were files each. A BAR put behind it at the next start does not
/// take them over.
#[test]
fn a_region_of_a_resource_added_after_the_last_start_is_not_restored_onto_a_bar() {
    let dir = tempfile::tempdir().unwrap();
    let id = DeviceId::uuid("GPU-0d5b4c1e-6a3f-4f7e-9c2b-3e1f5a7d9b11");
    let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
    d.memory.push(MemoryResource { kind: MemoryKind::HostExported, size: 8 * MIB, hpa: None, numa_node: None });
    let mut inv = Inventory::default();
    inv.add_device(d).unwrap();
    let me = me();
    let place = Place { device: id.clone(), kind: MemoryKind::HostExported, ordinal: Some(0) };
    {
        let m = open(dir.path(), &inv);
        m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    }
    // What a record saved before the device came looks like: it lists nothing.
    let record = dir.path().join("memory").join(super::offers::FILE);
    fabric_addrmap::durable::write_whole(&record, &super::offers::encode(&[])).unwrap();
    let bars = Backings { bars: vec![bar_backing(dir.path(), &id, 2, 0, 0xbb)], ..Backings::default() };
    let m = open_with(dir.path(), &inv, bars);
    assert!(m.list(None).regions.is_empty(), "{:?}", m.list(None).regions);
    assert!(m.problems().iter().any(|p| p.contains("came after the last start")), "{:?}", m.problems());
}

/// An allocation whose backing failed gives its usage back, and its range too, unless
/// what was made of the backing stays (a carved DAX device the kernel would not delete,
/// which holds the range until the next start deletes it): that range is not handed out.
#[test]
fn a_failed_allocation_whose_device_stays_keeps_its_range_out_of_use() {
    use super::MemoryError;
    use super::carve::CarveError;

    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let me = me();
    let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
    m.ensure_session(1, &me).unwrap();
    let (held, _) = m.reserve_on(&me, 1, &place, 2 * MIB, 0).unwrap();
    let stranded = MemoryError::Carve(CarveError::Stranded { device: "dax0.1".into(), failed: "zeroing".into() });
    assert!(stranded.strands_range());
    m.state().abandon(&held, stranded.strands_range());
    let (freed, _) = m.reserve_on(&me, 1, &place, 2 * MIB, 0).unwrap();
    assert_ne!(freed.offset, held.offset, "the stranded range is not handed out");
    let other = MemoryError::Carve(CarveError::Kernel { device: "dax0.2".into(), why: "refused".into() });
    assert!(!other.strands_range());
    m.state().abandon(&freed, other.strands_range());
    let (again, _) = m.reserve_on(&me, 1, &place, 2 * MIB, 0).unwrap();
    assert_eq!(again.offset, freed.offset, "a range nothing holds is given back");
    // Usage: only the reservation still pending counts.
    assert_eq!(m.state().ledger.usage_of(me.uid).bytes, 2 * MIB);
    // What a carve step reports once its device could not be deleted.
    let e = CarveError::stranding(
        "dax0.3",
        "bind".into(),
        Err(CarveError::Kernel { device: "dax0.3".into(), why: "x".into() }),
    );
    assert!(matches!(e, Err(CarveError::Stranded { device, .. }) if device == "dax0.3"));
    assert!(CarveError::stranding("dax0.3", "bind".into(), Ok(())).is_ok());
}

/// What an operation ended is delivered by that operation: a device lost holds its
/// revocations back (its caller publishes why first), and an unrelated operation that
/// ends something meanwhile delivers only its own.
#[test]
fn a_lost_devices_revocations_wait_for_its_own_delivery_not_another_operations() {
    use std::sync::Mutex;

    use fabric_proto::wire::RevocationReason;

    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let told: Arc<Mutex<Vec<(u64, RevocationReason)>>> = Arc::default();
    let hook = told.clone();
    m.on_end(super::EndHook {
        stop_copies: Box::new(|_| {}),
        tell: Box::new(move |revocations| {
            hook.lock().unwrap().extend(revocations.into_iter().map(|(session, r)| (session, r.reason)));
        }),
    });
    let me = me();
    let place = Place { device: gpu.clone(), kind: MemoryKind::Hbm, ordinal: None };
    let shared = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    let h = m.export(&me, 1, shared.region, owner_only()).unwrap();
    m.import(&me, 2, &h, AccessMode::ReadWrite).unwrap();
    let other = m.alloc(&me, 3, &place, 2 * MIB, 0).unwrap();
    let h3 = m.export(&me, 3, other.region, owner_only()).unwrap();
    m.import(&me, 4, &h3, AccessMode::ReadOnly).unwrap();

    let (lost, after) = m.device_lost(&gpu);
    assert_eq!((lost.regions, lost.imports), (2, 2));
    assert_eq!(after.revocations().len(), 4, "each importer and each owner");
    assert!(told.lock().unwrap().is_empty(), "nothing told before the caller delivers");

    // Another operation ends something (a lost region freed: its importer is told it is
    // gone) before the loss is delivered: it tells its own revocation, not the loss's.
    m.free(3, other.region).unwrap();
    assert_eq!(*told.lock().unwrap(), vec![(4, RevocationReason::Freed)]);

    m.deliver(after);
    let told = told.lock().unwrap();
    let lost: Vec<u64> =
        told.iter().filter(|(_, r)| *r == RevocationReason::DeviceLost).map(|(session, _)| *session).collect();
    assert_eq!(lost.len(), 4, "{told:?}");
    assert!([1, 2, 3, 4].iter().all(|s| lost.contains(s)), "{told:?}");
}

/// A durable registry over [`inventory`], a client and a place on its GPU, and the
/// registry's committer.
struct Journaled {
    inv: Inventory,
    m: Memory,
    me: Identity,
    place: Place,
    committer: Arc<Committer>,
}

fn journaled(dir: &std::path::Path) -> Journaled {
    let (inv, gpu) = inventory();
    let m = open(dir, &inv);
    let committer = m.state().log.as_ref().unwrap().committer().clone();
    Journaled { inv, m, me: me(), place: Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None }, committer }
}

/// A share withdrawn while a new region's record is written: the region is kept whole, as
/// one placed before is. Before, it was published lost (and that loss journaled), for
/// good, though its device never failed.
#[test]
fn a_share_withdrawn_while_a_region_commits_leaves_the_region_whole() {
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let Journaled { m, me, place, committer, .. } = journaled(dir.path());
    let held = committer.write_gate.write().unwrap();
    let granted = std::thread::scope(|s| {
        let alloc = s.spawn(|| m.alloc(&me, 1, &place, 2 * MIB, 0));
        let deadline = Instant::now() + Duration::from_secs(10);
        while m.state().log.as_ref().unwrap().in_flight() == 0 {
            assert!(Instant::now() < deadline, "the allocation never queued its record");
            std::thread::sleep(Duration::from_millis(2));
        }
        for r in &mut m.state().resources {
            r.withdrawn = Some("the share was taken".into());
        }
        drop(held);
        alloc.join().unwrap().unwrap()
    });
    for r in &mut m.state().resources {
        r.withdrawn = None;
    }
    m.export(&me, 1, granted.region, owner_only()).expect("the region is not lost");
}

/// A resource start-up held back (regions dropped for its changed memory still in the
/// journal) stays held back when the domain gives the node its shares back. Before, both
/// were one field, and `withdraw_shares(None)` lifted the start's guard too: regions placed
/// there were dropped at the next start.
#[test]
fn a_resource_held_back_at_start_stays_so_when_shares_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let Journaled { m, me, place, .. } = journaled(dir.path());
    {
        let mut st = m.state();
        st.ledger.space.of_mut(0).unwrap().confine(0, 128 * MIB);
        st.resources[0].held_back = Some("regions dropped at start are still in the journal".into());
    }
    assert_eq!(m.withdraw_shares(Some("away")), 1, "the resource is a share");
    assert_eq!(m.withdraw_shares(None), 1);
    assert!(m.alloc(&me, 1, &place, 2 * MIB, 0).is_err(), "still held back");
    m.state().resources[0].held_back = None;
    m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
}

/// The registry `m` holds is what its journal in `dir` rebuilds.
fn rebuilds_the_same(dir: &std::path::Path, inv: &Inventory, m: Memory, committer: Arc<Committer>) {
    let before = held(&m);
    drop((m, committer));
    assert_eq!(held(&open(dir, inv)), before);
}

/// The operation whose record crosses `memory.compact_records` answers while the snapshot
/// it queued is still being written (by the compaction thread), and the compaction is
/// settled once written: the journal rebuilds the same registry.
#[test]
fn an_operation_that_queues_a_compaction_answers_before_the_snapshot_is_written() {
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let Journaled { inv, m, me, place, committer } = journaled(dir.path());
    // Three records of the four `open` compacts after.
    for _ in 0..3 {
        m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    }
    let stalled = committer.snapshot_gate.write().unwrap();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (m, me, place) = (&m, &me, &place);
        s.spawn(move || tx.send(m.alloc(me, 1, place, 2 * MIB, 0).map(|g| g.region)).unwrap());
        let answered = rx.recv_timeout(Duration::from_secs(5));
        let in_flight = m.state().log.as_ref().unwrap().in_flight();
        drop(stalled);
        assert!(matches!(answered, Ok(Ok(_))), "the fourth allocation waited for the snapshot: {answered:?}");
        assert_eq!(in_flight, 1, "the snapshot, in flight while its write is held");
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while m.state().log.as_ref().unwrap().in_flight() > 0 {
        assert!(Instant::now() < deadline, "the compaction was never settled");
        std::thread::sleep(Duration::from_millis(5));
    }
    rebuilds_the_same(dir.path(), &inv, m, committer);
}

/// After a failed journal write, the next change reopens the journal: the registry's
/// snapshot is taken under its lock, but written by the journal's writer outside it, so
/// other requests read the registry while that write is held; the change is durable after
/// it, and the journal rebuilds the same registry.
#[test]
fn a_failed_journal_is_reopened_outside_the_registry_lock() {
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let Journaled { inv, m, me, place, committer } = journaled(dir.path());
    m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
    // The next write fails (its leader panics): that allocation is refused and undone.
    committer.panic_next.store(true, Ordering::Relaxed);
    assert!(m.alloc(&me, 1, &place, 2 * MIB, 0).is_err());
    assert_eq!(held(&m).regions.len(), 1);
    let stalled = committer.snapshot_gate.write().unwrap();
    std::thread::scope(|s| {
        let (tx, rx) = std::sync::mpsc::channel();
        let (m, me, place) = (&m, &me, &place);
        s.spawn(move || tx.send(m.alloc(me, 1, place, 2 * MIB, 0).map(|g| g.region)).unwrap());
        // The change waits for the reopen's write (held), not under the registry lock.
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "answered before the reopen was written");
        let read = held(m);
        drop(stalled);
        assert_eq!(read.regions.len(), 1, "the registry was read while the reopen's write was held");
        let answered = rx.recv_timeout(Duration::from_secs(10));
        assert!(matches!(answered, Ok(Ok(_))), "{answered:?}");
    });
    assert_eq!(held(&m).regions.len(), 2);
    rebuilds_the_same(dir.path(), &inv, m, committer);
}

/// A detached session's grace timer reclaims that detachment only: the session that
/// resumed it keeps the token, and its own later detachment runs its own grace; the
/// start's grace period reclaims only the sessions found at start.
#[test]
fn a_grace_timer_reclaims_its_own_detachment_not_a_later_one_of_the_same_token() {
    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let place = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
    m.alloc(&me(), 1, &place, 4 * MIB, 0).unwrap();
    let (token, _) = m.detach_session(1);
    let token = token.unwrap();
    m.resume(2, &me(), &token).unwrap();
    let (again, _) = m.detach_session(2);
    assert!(again.is_some_and(|t| t == token), "the resumed session keeps its token");
    assert_eq!(m.reclaim_orphan(&token, 1).regions, 0, "the first detachment's timer: resumed since");
    assert_eq!(m.reclaim_orphans().regions, 0, "the start's grace period: not a session found at start");
    assert_eq!(m.orphans(), 1);
    assert_eq!(m.reclaim_orphan(&token, 2).regions, 1, "the second detachment's own timer");
    assert_eq!(m.orphans(), 0);
}

/// A detached session whose grace period ends while a client's resume of it is being
/// journaled is not reclaimed then (the resume may succeed), nor forgotten when that write
/// fails: it is reclaimed at the failure.
#[test]
fn a_resume_that_fails_after_the_grace_period_ended_reclaims_the_session() {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let Journaled { m, me, place, committer, .. } = journaled(dir.path());
    m.alloc(&me, 1, &place, 4 * MIB, 0).unwrap();
    let (token, _) = m.detach_session(1);
    let token = token.unwrap();
    let stalled = committer.write_gate.write().unwrap();
    std::thread::scope(|s| {
        let (m, me) = (&m, &me);
        let resume = s.spawn(move || m.resume(2, me, &token));
        // The resume's record is queued (under the registry lock, with the orphan marked).
        let deadline = Instant::now() + Duration::from_secs(10);
        while m.state().log.as_ref().unwrap().in_flight() == 0 {
            assert!(Instant::now() < deadline, "the resume never queued its record");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(m.reclaim_orphan(&token, 1).regions, 0, "the timer fires while the resume is written");
        assert!(
            matches!(m.resume(3, me, &token), Err(super::MemoryError::BadRequest(_))),
            "a second resume of it meanwhile"
        );
        committer.panic_next.store(true, Ordering::Relaxed);
        drop(stalled);
        assert!(resume.join().unwrap().is_err(), "the resume's write failed");
    });
    assert_eq!(m.orphans(), 0, "reclaimed at the failure, not left for the next start");
    assert!(held(&m).regions.is_empty());
}

/// A device lost while a new region's backing is made (a device range is zeroed for
/// seconds, outside the lock) is not published as a healthy region: refused, its range
/// given back.
#[test]
fn a_region_whose_device_went_while_its_backing_was_made_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (inv, gpu) = inventory();
    let m = open(dir.path(), &inv);
    let place = Place { device: gpu.clone(), kind: MemoryKind::Hbm, ordinal: None };
    m.ensure_session(1, &me()).unwrap();
    let (res, make) = m.reserve_on(&me(), 1, &place, 4 * MIB, 0).unwrap();
    let _ = m.device_lost(&gpu);
    let made = m.make_and_commit(res, &make, None);
    assert!(matches!(made, Err(crate::memory::MemoryError::DeviceLost(_))), "{made:?}");
    assert!(m.list(None).regions.is_empty(), "nothing published");
    assert!(m.device_back(&gpu));
    let g = m.alloc(&me(), 1, &place, 4 * MIB, 0).unwrap();
    let at = match m.whereabouts(g.region) {
        Some(crate::memory::Whereabouts::Resource { offset, .. }) => offset,
        other => panic!("{other:?}"),
    };
    assert_eq!(at, 0, "the range was given back");
}
