//! The registry's side of per-region DAX ([`super::carve`]): a region on a carved set gets
//! a DAX device of its own when it is allocated, loses it when it is freed, and finds it
//! again when the daemon restarts (devices outlive the daemon, like region files).

use std::fs::OpenOptions;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::alloc::{AllocError, GRANULE};
use super::backing::DeviceBacking;
use super::backings::Backing;
use super::carve::{CarveError, DaxDevice, DaxRegion, Wanted, plan};
use super::reserve::Made;
use super::{Memory, MemoryError, State, io_err};

impl Memory {
    /// A device of its own for the range `[offset, offset + len)` of the set `b` backs,
    /// carved from `c` and opened read-write (see `Memory::make_backing`).
    pub(super) fn make_carved(b: &DeviceBacking, c: &DaxRegion, offset: u64, len: u64) -> Result<Made, MemoryError> {
        let at = b.file_offset(offset, len).ok_or(MemoryError::NoSpace(AllocError::NoSpace {
            len,
            align: b.align,
            capacity: b.len,
        }))?;
        let carved = c.carve(c.start + at, len).map_err(MemoryError::Carve)?;
        // The new device's range held its previous holder's bytes: zeroed before anyone
        // gets it.
        let opened = OpenOptions::new().read(true).write(true).open(&carved.path).map_err(io_err(&carved.path));
        let zeroed = opened.and_then(|f| super::zero::zero_range(&f, 0, len).map(|()| f).map_err(MemoryError::Zero));
        match zeroed {
            Ok(f) => {
                let backing = Backing::CarvedDax { path: carved.path, name: carved.name, from: c.clone() };
                Ok((OwnedFd::from(f), backing))
            }
            Err(e) => {
                let failed = crate::error_chain(&e);
                CarveError::stranding(&carved.name, failed, c.destroy(&carved.name)).map_err(MemoryError::Carve)?;
                Err(e)
            }
        }
    }
}

impl State {
    /// At start, after the journaled regions are back: gives each region on a carved set
    /// its device — the one found with exactly its range, else a new one at that range
    /// (device memory keeps its bytes, so it holds what it held) — and deletes every other
    /// device of the DAX region ([`plan`]). A region that gets no device is dropped with a
    /// `status` problem.
    pub(super) fn reconcile_carved(&mut self) {
        let carved: Vec<(String, DeviceBacking)> =
            self.set_backings.iter().filter(|(_, b)| b.carve.is_some()).map(|(s, b)| (s.clone(), b.clone())).collect();
        for (set, b) in carved {
            let Some(c) = &b.carve else { continue };
            let mut wanted = Vec::new();
            let mut ids: Vec<u64> = self.set_regions.iter().filter(|(_, s)| s.name == set).map(|(id, _)| *id).collect();
            ids.sort_unstable();
            for id in ids {
                let (Some(r), Some(s)) = (self.ledger.regions.get(&id), self.set_regions.get(&id)) else { continue };
                match b.file_offset(s.set_offset, r.len) {
                    Some(at) => wanted.push(Wanted { region: id, start: c.start + at, len: r.len }),
                    None => self.unrestore(id, &format!("its range is not inside {}'s DAX region", b.name)),
                }
            }
            let devices = match c.devices() {
                Ok(d) => d,
                Err(e) => {
                    // What is carved where is unknown: each range may still be a device's.
                    for w in &wanted {
                        self.lose_restored(
                            w.region,
                            None,
                            &format!("the devices of {}'s DAX region are unreadable: {e}", b.name),
                        );
                    }
                    continue;
                }
            };
            let p = plan(&devices, &wanted);
            for o in &p.orphans {
                // A device bound to another driver (kmem: System RAM; anything else: someone's
                // device) is reported, never deleted, and its range is nobody's to allocate.
                let foreign = devices.iter().find(|d| &d.name == o).and_then(|d| {
                    d.driver.as_deref().filter(|drv| *drv != "device_dax").map(|drv| (d, drv.to_owned()))
                });
                if let Some((dev, drv)) = foreign {
                    let problem = match self.keep_out(&set, &b, c, dev) {
                        Ok(kept) => {
                            tracing::warn!(device = %o, driver = %drv, kept, "DAX device no region names is bound to another driver; left alone, its range kept out of allocations");
                            format!(
                                "DAX device {o} (no region names it) is bound to {drv}: left alone, its range ({kept} bytes of the set's members) kept out of allocations until it is unbound and fabricd restarts"
                            )
                        }
                        Err(why) => {
                            tracing::warn!(device = %o, driver = %drv, why, "DAX device no region names is bound to another driver; left alone");
                            format!(
                                "DAX device {o} (no region names it) is bound to {drv}: left alone; its range could not be kept out of allocations ({why}), and an allocation placed on it fails to carve until it is unbound"
                            )
                        }
                    };
                    if self.problems.len() < 256 {
                        self.problems.push(problem);
                    }
                    continue;
                }
                match c.destroy(o) {
                    Ok(()) => tracing::info!(device = %o, "DAX device no region names deleted"),
                    Err(e) => {
                        tracing::warn!(device = %o, error = %e, "cannot delete a DAX device no region names");
                        if self.problems.len() < 256 {
                            self.problems
                                .push(format!("DAX device {o} (no region names it) could not be deleted: {e}"));
                        }
                    }
                }
            }
            for (id, name) in &p.found {
                let bound = devices.iter().find(|d| &d.name == name).map(|d| c.bind(d));
                match bound {
                    Some(Ok(path)) => {
                        tracing::info!(region = id, device = %name, "region's DAX device found");
                        self.attach_carved(*id, name, path, c);
                    }
                    // The device is there and holds the range (and the region's bytes):
                    // the region stays, lost, until its owner frees it.
                    Some(Err(e)) => self.lose_restored(*id, Some((name, c)), &format!("its DAX device {name}: {e}")),
                    None => self.unrestore(*id, &format!("its DAX device {name} vanished")),
                }
            }
            for w in wanted.iter().filter(|w| p.missing.contains(&w.region)) {
                match c.carve(w.start, w.len) {
                    Ok(d) => {
                        tracing::info!(region = w.region, device = %d.name, "region's DAX device was gone; carved again at its range");
                        self.attach_carved(w.region, &d.name, d.path, c);
                    }
                    // Whatever stands in the way (another driver's device over the range, a
                    // kernel refusing), the range keeps the region's bytes: kept, lost.
                    Err(e) => self.lose_restored(
                        w.region,
                        None,
                        &format!("its DAX device is gone and cannot be carved again: {e}"),
                    ),
                }
            }
        }
    }

    /// Keeps the ranges of `dev`, a device of the DAX region `c` that backs the set `set`
    /// through `b`, out of the set's members' allocators for this run (whole 2 MiB
    /// granules of each member, what regions hold already left as it is); the bytes kept
    /// out, over all members, or why it cannot be.
    fn keep_out(&mut self, set: &str, b: &DeviceBacking, c: &DaxRegion, dev: &DaxDevice) -> Result<u64, &'static str> {
        let members = self.set_members.get(set).map(Vec::as_slice).unwrap_or_default();
        let idx: Vec<usize> = members.iter().map(|m| self.member(m)).collect::<Option<_>>().unwrap_or_default();
        if idx.is_empty() {
            return Err("its set's members are not known here");
        }
        let ways = idx.len() as u64;
        let unit = GRANULE * ways;
        let mut kept = 0;
        for &(hpa, len) in &dev.ranges {
            // HPA → offset in the DAX region's file → offset in the set, widened to whole
            // granules of every member.
            let at = hpa.checked_sub(c.start).and_then(|o| o.checked_add(b.start)).ok_or("it lies outside its set")?;
            let lo = at / unit * unit;
            let hi =
                at.checked_add(len).and_then(|e| e.checked_next_multiple_of(unit)).ok_or("it lies outside its set")?;
            for &i in &idx {
                kept += self.ledger.space.take_free_parts(i, lo / ways, (hi - lo) / ways);
            }
        }
        Ok(kept)
    }

    fn attach_carved(&mut self, id: u64, name: &str, path: PathBuf, from: &DaxRegion) {
        if let Some(r) = self.ledger.regions.get_mut(&id) {
            r.backing = Backing::CarvedDax { path, name: name.to_owned(), from: from.clone() };
        }
    }

    /// Takes region `id`, restored a moment ago, back out: its ranges and usage are given
    /// back and it is reported dropped.
    fn unrestore(&mut self, id: u64, why: &str) {
        if let Some(r) = self.ledger.unpublish_region(id) {
            let mut members = vec![r.resource];
            members.extend(self.set_regions.remove(&id).map(|s| s.others).unwrap_or_default());
            self.ledger.space.give_back(&members, r.offset);
        }
        self.lost(id, why);
    }

    /// Keeps region `id`, restored a moment ago, but lost: a DAX device may hold its range
    /// (and its bytes) in the kernel but cannot serve it — bound to another driver, a bind
    /// that does not take — or what the DAX region holds cannot be read. As for a region
    /// lost with its device (`Ledger::lose`): its range stays taken, its exports come back
    /// revoked, and the snapshot written at start records it lost, so it stays lost across
    /// restarts (quarantine holds on it stay too). Its owner may free it: that deletes its
    /// device (`device`, where known; one bound to another driver is refused, and its range
    /// then stays taken until the next start) or, where unknown, gives the range back.
    fn lose_restored(&mut self, id: u64, device: Option<(&str, &DaxRegion)>, why: &str) {
        let Some(r) = self.ledger.regions.get_mut(&id) else { return };
        r.lost = true;
        if let Some((name, from)) = device {
            let path = from.dev.join(name);
            r.backing = Backing::CarvedDax { path, name: name.to_owned(), from: from.clone() };
        }
        tracing::warn!(region = id, "region lost at start: {why}");
        if self.problems.len() < 256 {
            self.problems.push(format!("region {id} lost at start: {why}; its range stays taken until it is freed"));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::fd::OwnedFd;
    use std::sync::Arc;

    use crate::memory::Identity;
    use fabric_proto::wire::{Coherence, SessionToken};
    use fabric_topology::{DeviceId, MemoryKind};

    use super::super::backing::{BackingKind, DeviceBacking};
    use super::super::backings::{Backing, Offer};
    use super::super::carve::tests::{BASE, M, open, tree};
    use super::super::ledger::Region;
    use super::super::set::SetRegion;
    use super::super::{Resource, State};

    const SET: &str = "cxl-region:test";

    /// A registry restored with regions 1 (at set offset 0) and 2 (at 4 MiB), 4 MiB each,
    /// on one carved set over the fake DAX region of `t` (devices `dax0.1` and `dax0.2`
    /// hold their ranges).
    fn restored(t: &tempfile::TempDir, root: &fabric_drivers::sysfs::SysfsRoot) -> State {
        let region = open(t, root, "dax0.0").unwrap();
        let backing = DeviceBacking {
            kind: BackingKind::Dax,
            name: "dax0.0".into(),
            path: t.path().join("dev/dax0.0"),
            start: 0,
            len: 512 * M,
            align: 2 * M,
            carve: Some(region),
        };
        let dir = t.path().join("res");
        std::fs::create_dir_all(&dir).unwrap();
        let dir_fd = Arc::new(OwnedFd::from(std::fs::File::open(&dir).unwrap()));
        let resource = Resource {
            device: DeviceId::serial("cxl", "0x5eed"),
            kind: MemoryKind::CxlVolatile,
            ordinal: 0,
            dir,
            dir_fd,
            lost: false,
            withdrawn: None,
            held_back: None,
            offer: Offer::Device(backing.clone()),
            coherence: Coherence::Hardware,
        };
        let mut st = State::new(vec![(resource, 512 * M)], 1);
        st.set_backings.insert(SET.into(), backing);
        st.set_members.insert(SET.into(), vec![(DeviceId::serial("cxl", "0x5eed"), MemoryKind::CxlVolatile, 0)]);
        for (id, offset) in [(1u64, 0u64), (2, 4 * M)] {
            assert!(st.ledger.space.take(&[0], offset, 4 * M));
            let owner = Identity { pid: 1, uid: 1000, gid: 1000 };
            st.ledger.charge(owner.uid, super::super::Usage::region(4 * M, 0));
            let backing = Backing::SimFile(t.path().join(format!("r{id}")));
            let r = Region {
                generation: id,
                owner,
                pid_start: None,
                token: SessionToken([0; 16]),
                session: 1,
                resource: 0,
                offset,
                len: 4 * M,
                backing,
                lost: false,
            };
            st.ledger.publish_region(id, r);
            let part = SetRegion { name: SET.into(), set_offset: offset, others: vec![], dax: Some("dax0.0".into()) };
            st.set_regions.insert(id, part);
        }
        st
    }

    /// Rebinds fake device `name` of `t` to driver `driver` (`None`: to none).
    fn rebind(t: &tempfile::TempDir, name: &str, driver: Option<&str>) {
        let link = t.path().join("sys/bus/dax/devices").join(name).join("driver");
        std::fs::remove_file(&link).unwrap();
        if let Some(drv) = driver {
            let dir = t.path().join("sys/bus/dax/drivers").join(drv);
            std::fs::create_dir_all(&dir).unwrap();
            std::os::unix::fs::symlink(&dir, &link).unwrap();
        }
    }

    /// A refused region's carved device that cannot be deleted is not undone: its range
    /// stays taken (`Memory::undo_reservation`), where before it went back to the
    /// allocator while the device still held it.
    #[test]
    fn a_carved_backing_whose_device_cannot_be_deleted_is_not_undone() {
        let (t, root) = tree(0, true, &[(1, BASE, 4 * M), (2, BASE + 4 * M, 4 * M)]);
        rebind(&t, "dax0.1", Some("kmem"));
        let region = open(&t, &root, "dax0.0").unwrap();
        let carved = |name: &str| Backing::CarvedDax {
            path: t.path().join("dev").join(name),
            name: name.into(),
            from: region.clone(),
        };
        assert!(!carved("dax0.1").undo(), "System RAM now: not deleted");
        assert!(!carved("dax0.2").undo(), "still there after its delete (the fake kernel keeps it)");
        assert!(Backing::SimFile(t.path().join("gone")).undo(), "a file is removed, or was never there");
    }

    #[test]
    fn a_region_whose_device_will_not_bind_stays_lost_with_its_range_taken() {
        let (t, root) = tree(0, true, &[(1, BASE, 4 * M), (2, BASE + 4 * M, 4 * M)]);
        // dax0.1 was onlined as System RAM while the daemon was down; dax0.2 lost its
        // driver, and binding it again does not take (the fake kernel ignores the write).
        rebind(&t, "dax0.1", Some("kmem"));
        rebind(&t, "dax0.2", None);
        let mut st = restored(&t, &root);
        st.reconcile_carved();
        assert_eq!(st.problems.len(), 2, "{:?}", st.problems);
        assert!(st.problems[0].contains("bound to kmem") && st.problems[0].contains("lost"), "{:?}", st.problems);
        // Both stay, lost, on their devices: the snapshot written at start keeps them (and
        // what other nodes may map of them), and freeing one deletes its device.
        for (id, name) in [(1u64, "dax0.1"), (2, "dax0.2")] {
            let r = &st.ledger.regions[&id];
            assert!(r.lost, "region {id}");
            assert!(matches!(&r.backing, Backing::CarvedDax { name: n, .. } if n == name), "{:?}", r.backing);
        }
        assert_eq!(st.set_regions.len(), 2);
        // What start compacts the journal to names both, lost: the next start keeps them
        // lost rather than finding their devices orphaned.
        let snap = super::super::durable::Snapshot::decode(&st.snapshot().unwrap()).unwrap();
        assert_eq!((snap.set_regions.len(), snap.lost), (2, vec![1, 2]));
        // Both ranges are still the devices' in the kernel: nothing new lands there.
        for offset in [0, 4 * M] {
            assert!(!st.ledger.space.is_free(&[0], offset, 4 * M), "range at {offset:#x} handed back");
        }
        assert_eq!(st.ledger.space.place([(0, 0)], 4 * M).map(|p| p.1).unwrap(), 8 * M);
        // Neither device was deleted: the kmem one is System RAM, the other holds the
        // region's bytes.
        let dr = t.path().join("sys/bus/dax/devices");
        assert_eq!(std::fs::read_to_string(dr.join("dax0.1/size")).unwrap().trim(), (4 * M).to_string());
        assert_eq!(std::fs::read_to_string(dr.join("dax0.2/size")).unwrap().trim(), (4 * M).to_string());
        assert!(std::fs::read_to_string(dr.join("dax0.0/../dax_region/delete")).unwrap().is_empty());
        // Freeing the kmem one later is refused by the device, not done to System RAM.
        let Backing::CarvedDax { from, .. } = &st.ledger.regions[&1].backing else { unreachable!() };
        let e = from.destroy("dax0.1").unwrap_err();
        assert!(e.to_string().contains("bound to kmem"), "{e}");
        assert!(!t.path().join("sys/bus/dax/drivers/kmem/unbind").exists(), "unbound from kmem");
    }

    #[test]
    fn a_device_no_region_names_bound_to_another_driver_keeps_its_range_out_of_allocations() {
        // Regions 1 and 2 on their devices; dax0.3, no region's, onlined as System RAM at
        // 10 MiB of the set while the daemon was down.
        let devices = [(1, BASE, 4 * M), (2, BASE + 4 * M, 4 * M), (3, BASE + 10 * M, 4 * M)];
        let (t, root) = tree(0, true, &devices);
        rebind(&t, "dax0.3", Some("kmem"));
        let mut st = restored(&t, &root);
        st.reconcile_carved();
        assert_eq!(st.problems.len(), 1, "{:?}", st.problems);
        assert!(st.problems[0].contains("bound to kmem") && st.problems[0].contains("kept out"), "{:?}", st.problems);
        assert!(!st.ledger.space.is_free(&[0], 10 * M, 4 * M), "System RAM is nobody's to allocate");
        // The hole before it is too small for 4 MiB: the next region goes after it.
        assert_eq!(st.ledger.space.place([(0, 0)], 4 * M).map(|p| p.1).unwrap(), 14 * M);
        assert_eq!(st.ledger.space.place([(0, 0)], 2 * M).map(|p| p.1).unwrap(), 8 * M);
        assert!(st.ledger.regions.values().all(|r| !r.lost), "the regions are served");
        let dr = t.path().join("sys/bus/dax/devices");
        assert_eq!(std::fs::read_to_string(dr.join("dax0.3/size")).unwrap().trim(), (4 * M).to_string(), "left alone");

        // Where the set's members are not known, the range cannot be kept out: said so.
        let (t, root) = tree(0, true, &devices);
        rebind(&t, "dax0.3", Some("kmem"));
        let mut st = restored(&t, &root);
        st.set_members.clear();
        st.reconcile_carved();
        assert!(st.problems[0].contains("could not be kept out"), "{:?}", st.problems);
        assert!(st.ledger.space.is_free(&[0], 10 * M, 4 * M));
    }

    #[test]
    fn regions_whose_dax_region_cannot_be_read_stay_lost() {
        let (t, root) = tree(0, true, &[(1, BASE, 4 * M), (2, BASE + 4 * M, 4 * M)]);
        let mut st = restored(&t, &root);
        // A device whose size its mappings do not add up to: the kernel's inconsistency.
        std::fs::write(t.path().join("sys/bus/dax/devices/dax0.2/size"), "4096\n").unwrap();
        st.reconcile_carved();
        assert!(st.ledger.regions.values().all(|r| r.lost), "both lost");
        assert!(st.problems.iter().all(|p| p.contains("unreadable")), "{:?}", st.problems);
        for offset in [0, 4 * M] {
            assert!(!st.ledger.space.is_free(&[0], offset, 4 * M), "range at {offset:#x} handed back");
        }
    }

    #[test]
    fn a_region_whose_device_was_deleted_and_cannot_be_carved_again_stays_lost() {
        // No device for region 1 (someone deleted it) and a `create` that makes nothing;
        // region 2's device is there and bound.
        let (t, root) = tree(0, true, &[(2, BASE + 4 * M, 4 * M)]);
        let mut st = restored(&t, &root);
        st.reconcile_carved();
        assert!(st.ledger.regions[&1].lost, "region 1 kept, lost");
        assert!(st.problems[0].contains("cannot be carved again"), "{:?}", st.problems);
        let r2 = &st.ledger.regions[&2];
        assert!(!r2.lost && matches!(&r2.backing, Backing::CarvedDax { name, .. } if name == "dax0.2"));
        assert!(!st.ledger.space.is_free(&[0], 0, 4 * M) && !st.ledger.space.is_free(&[0], 4 * M, 4 * M));
    }
}
