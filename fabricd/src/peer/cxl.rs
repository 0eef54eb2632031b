//! Shared CXL memory across hosts: a region on an interleave set of CXL devices that the
//! importer's host reaches too (one device shared by several hosts, or a multi-headed one)
//! is granted by what is the same on every host — the members' serials, kinds and
//! ordinals, the set's granularity and the region's offset in the set ([`SharedCxl`]) —
//! and the importer hands its client its own DAX device over the same members, at the
//! same offset in the set: the same DPAs, no copy — unless this node holds regions of its
//! own on those DPAs (hosts sharing a device allocate from their own allocators), which it
//! never hands out. A host with no such set (or none backed by a DAX device) gets a
//! copy-only grant instead.
//!
//! Where this host's set gives each region a DAX device of its own (`dax_per_region`), an
//! import gets one too: carved here at the region's range when it is first imported,
//! shared by this node's imports of that region, and deleted when the last of them ends
//! or the owner revokes it ([`ImportDevices`]) — deleting a device zaps its mappings, so
//! the client's next access faults instead of reading memory the owner took back.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use fabric_addrmap::{InterleaveSet, Presence};
use fabric_proto::wire::{Coherence, ErrorBody, ErrorCode};
use fabric_topology::DeviceId;

use super::wire::{CxlMember, SharedCxl};
use crate::daemon::Daemon;
use crate::memory::Whereabouts;
use crate::memory::carve::DaxRegion;
use crate::ops::dispatch::errors::refusal;

/// The serial of a CXL memory device whose identity is its serial (`serial:cxl/0x…`); a
/// device known only by its place on this host (a PCI function) names nothing another
/// host could find.
fn serial_of(id: &DeviceId) -> Option<u64> {
    let hex = id.as_str().strip_prefix("serial:cxl/0x")?;
    u64::from_str_radix(hex, 16).ok()
}

/// The members of `set` as another host names them, when every one has a serial.
fn members_of(set: &InterleaveSet) -> Option<Vec<CxlMember>> {
    set.members
        .iter()
        .map(|k| Some(CxlMember { serial: serial_of(&k.device)?, kind: k.kind, ordinal: k.ordinal }))
        .collect()
}

/// Whether `set` is over the members `c` names, striped alike (the granularity matters
/// only with more than one way).
fn same_set(set: &InterleaveSet, c: &SharedCxl) -> bool {
    set.presence == Presence::Present
        && members_of(set).is_some_and(|m| m == c.members)
        && (c.members.len() == 1 || set.geometry.granularity() == c.granularity)
        && c.set_offset < set.size()
}

/// The owner's side: region `region` as shared CXL memory, when it is a range of a DAX
/// device over an interleave set whose members all have serials.
pub fn grant(d: &Daemon, region: u64) -> Option<SharedCxl> {
    let Whereabouts::Set { name, offset, .. } = d.memory.whereabouts(region)? else { return None };
    if !d.memory.on_device(region) {
        // A sim set region is a file of this host's: nobody else reaches it.
        return None;
    }
    let snap = d.map_snapshot();
    let set = snap.state().interleaves.iter().find(|s| s.name == name)?;
    Some(SharedCxl { members: members_of(set)?, granularity: set.geometry.granularity(), set_offset: offset })
}

/// What the importer's client maps: a DAX device of this host at the region's DPAs.
#[derive(Debug)]
pub struct Reach {
    /// The device, opened for the access granted.
    pub fd: OwnedFd,
    /// The region's offset in it.
    pub offset: u64,
    /// What the import holds here until it ends.
    pub hold: Hold,
    /// Whether this host's caches are kept coherent with it ([`coherence`]).
    pub coherence: Coherence,
}

/// Whether the hardware keeps this host's caches coherent with what other hosts store to a
/// range of `c`: `Hardware` only where this node's `[[memory.shares]]` declares every
/// member device `coherent`; CXL.mem shared by hosts is not, by default.
pub fn coherence(d: &Daemon, c: &SharedCxl) -> Coherence {
    let shares = &d.config.memory.shares;
    let declared = |m: &CxlMember| {
        let id = DeviceId::cxl(m.serial).to_string();
        shares.iter().any(|s| s.coherent && s.device == id)
    };
    if !c.members.is_empty() && c.members.iter().all(declared) { Coherence::Hardware } else { Coherence::Software }
}

/// What an import of shared CXL memory holds on the importer: the region's DPAs, out of
/// this node's allocators, and the device carved for it (per-region DAX). Not `Clone`:
/// each is given back once.
#[derive(Debug)]
pub struct Hold {
    range: crate::memory::ForeignRange,
    device: Option<DeviceKey>,
    /// The client maps a whole DAX device (at the region's offset), which outlives the
    /// import: nothing here can take that mapping away. False for a carved device,
    /// whose deletion ends its mappings.
    whole: bool,
}

impl Hold {
    /// A hold of `range` with no carved device: a whole DAX device's import (for tests).
    #[cfg(test)]
    pub fn whole_device_for_tests(range: crate::memory::ForeignRange) -> Self {
        Hold { range, device: None, whole: true }
    }

    /// A hold whose carved device was already taken (a revocation deleted it: for tests).
    #[cfg(test)]
    pub fn device_taken_for_tests(range: crate::memory::ForeignRange) -> Self {
        Hold { range, device: None, whole: false }
    }

    /// Whether the client maps a whole DAX device, which outlives the import.
    pub fn whole(&self) -> bool {
        self.whole
    }

    /// The carved device, to delete as soon as the owner ends or revokes the import (its
    /// mappings end with it); the DPAs stay held until the client releases the import,
    /// and, should the client release it first, until the device is gone
    /// ([`Deleting::finish`]).
    pub fn take_device(&mut self, d: &Daemon) -> Option<Deleting> {
        let key = self.device.take()?;
        d.memory.keep_foreign(&self.range);
        Some(Deleting { key, range: self.range.clone(), done: false })
    }

    /// Gives everything back as the client releases the import: the device first (its
    /// mappings end), then the DPAs.
    pub fn end(mut self, d: &Daemon, devices: &ImportDevices) {
        if let Some(key) = self.device.take() {
            devices.put(d, &key);
        }
        d.memory.release_foreign(&self.range);
    }
}

/// A carved device taken from its import, to delete outside the importer's locks: its
/// DPAs stay out of this node's allocators until it is gone, whatever the import does
/// meanwhile.
#[derive(Debug)]
#[must_use = "the device is deleted and its DPAs let go by finish"]
pub struct Deleting {
    key: DeviceKey,
    range: crate::memory::ForeignRange,
    done: bool,
}

impl Deleting {
    /// One user of the device less (the last deletes it), then the DPAs' extra hold.
    pub fn finish(mut self, d: &Daemon, devices: &ImportDevices) {
        devices.put(d, &self.key);
        d.memory.release_foreign(&self.range);
        self.done = true;
    }
}

impl Drop for Deleting {
    fn drop(&mut self) {
        if !self.done {
            // A bug (or a panic on the way): the safe side, but said.
            tracing::error!(owner = %self.key.owner, region = self.key.region, "a carved import device was let go without being deleted; its DPAs stay out of the allocators until the next start");
        }
    }
}

/// The importer's side: the DAX device of this node's set over the members `c` names,
/// opened, and the offset in it of the granted `len` bytes of the owner's region
/// `(region, generation)` — on a per-region DAX set a device carved for it by `devices`;
/// `None` when this node has no such set backed by a DAX device (the import is then
/// copy-only).
pub fn open(
    d: &Daemon,
    devices: &ImportDevices,
    owner: &str,
    (region, generation): (u64, u64),
    c: &SharedCxl,
    len: u64,
    write: bool,
) -> Result<Option<Reach>, ErrorBody> {
    let snap = d.map_snapshot();
    let found = snap
        .state()
        .interleaves
        .iter()
        .filter(|s| same_set(s, c))
        .find_map(|s| d.memory.set_device(&s.name).map(|b| (crate::placement::spec_of(s), b)));
    let Some((spec, b)) = found else {
        tracing::info!(
            owner,
            members = c.members.len(),
            "no set here over the owner's shared CXL members, or none with a DAX device: copy-only"
        );
        return Ok(None);
    };
    let refuse = |what: String| {
        Err(refusal(ErrorCode::Unavailable, format!("node {owner}'s region on shared CXL memory: {what}")))
    };
    // Hosts sharing a device each allocate from their own allocator: a range another node
    // names may be DPAs this node handed its own clients. Never hand those out, and keep
    // this node's regions off them while the import lives.
    let set = &spec.name;
    let Some(range) = d.memory.hold_foreign(&spec, c.set_offset, len) else {
        return Err(refusal(
            ErrorCode::PermissionDenied,
            format!(
                "node {owner}'s region is at {:#x}+{len:#x} of set {set}, DPAs this node holds regions on (or not whole granules): hosts sharing a CXL device must allocate disjoint parts of it",
                c.set_offset
            ),
        ));
    };
    let reached = (|| {
        // Saved before the client is handed the range: a restart of this daemon keeps it
        // out of the allocators while the client may still map it (`memory/foreign.rs`).
        d.memory.save_foreign().map_err(|e| format!("the range could not be saved: {}", crate::error_chain(&e)))?;
        let Some(offset) = b.file_offset(c.set_offset, len) else {
            return Err(format!(
                "{} here does not hold set offset {:#x} + {len:#x} of set {set}",
                b.name, c.set_offset
            ));
        };
        if let Some(dax) = &b.carve {
            let key = DeviceKey { owner: owner.to_owned(), region, generation };
            let fd = devices
                .take(d, &key, dax, (dax.start + offset, len), &range, write)
                .map_err(|why| format!("a DAX device of set {set} for it: {why}"))?;
            return Ok((fd, 0, Some(key)));
        }
        if !offset.is_multiple_of(b.align) || !len.is_multiple_of(b.align) {
            return Err(format!(
                "{} maps only multiples of {:#x}; the region is {len:#x} bytes at {offset:#x}",
                b.name, b.align
            ));
        }
        let f = b.open(write).map_err(|e| format!("{}: {e}", b.path.display()))?;
        Ok((OwnedFd::from(f), offset, None))
    })();
    match reached {
        Ok((fd, offset, device)) => {
            let whole = device.is_none();
            Ok(Some(Reach { fd, offset, hold: Hold { range, device, whole }, coherence: coherence(d, c) }))
        }
        Err(why) => {
            d.memory.release_foreign(&range);
            refuse(why)
        }
    }
}

/// Which owner's region a device carved for imports holds: regions of one owner are
/// disjoint, so one device serves every import of a region here.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceKey {
    /// The owner node.
    owner: String,
    /// Its region and the region's generation.
    region: u64,
    generation: u64,
}

/// A device carved for imports of one region, and how many imports use it.
#[derive(Debug)]
struct ImportDevice {
    from: DaxRegion,
    name: String,
    path: PathBuf,
    /// Its HPAs.
    start: u64,
    len: u64,
    /// The region's DPAs, which the imports hold out of this node's allocators.
    range: crate::memory::ForeignRange,
    users: usize,
}

/// The DAX devices this node carved for its clients' imports of other nodes' regions
/// (per-region DAX sets), by the region they hold. A device is carved and deleted outside
/// the table's lock (`peer/carving.rs`): an import of a region whose device is being
/// carved or deleted waits for that region alone, so that one region's device is never
/// carved twice nor deleted under a new user, and imports of other regions never wait
/// behind the bind's wait for a device node. Never on the domain runtime's workers.
/// Devices left by a daemon that died are deleted at its next start, with every device no
/// region of its own names (`memory/carved.rs`).
#[derive(Debug, Default)]
pub struct ImportDevices {
    carved: super::carving::Table<DeviceKey, ImportDevice>,
}

impl ImportDevices {
    /// Opens the device of `key`'s region, carving it from `from` at `[start, start + len)`
    /// (HPAs, the DPAs `range` holds) on its first import, and counts one more user. A
    /// device of the key at other HPAs (an owner that reused a region id) is refused.
    fn take(
        &self,
        d: &Daemon,
        key: &DeviceKey,
        from: &DaxRegion,
        (start, len): (u64, u64),
        range: &crate::memory::ForeignRange,
        write: bool,
    ) -> Result<OwnedFd, String> {
        let open = |path: &PathBuf| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(path)
                .map(OwnedFd::from)
                .map_err(|e| format!("{}: {e}", path.display()))
        };
        let found = self.carved.begin(key, |dev| {
            if (dev.start, dev.len) != (start, len) {
                return Err(format!(
                    "{} holds region {} of node {} at {:#x}+{:#x}, not {start:#x}+{len:#x}: release the earlier import first",
                    dev.name, key.region, key.owner, dev.start, dev.len
                ));
            }
            dev.users += 1;
            Ok(dev.path.clone())
        });
        let making = match found {
            super::carving::Begin::Found(path) => {
                // Counted first, so that the device stays while it is opened.
                return open(&path?).inspect_err(|_| self.put(d, key));
            }
            super::carving::Begin::Make(making) => making,
        };
        let made = from.carve(start, len).map_err(|e| {
            // A device the carve made and could not delete keeps its DPAs, as below.
            if matches!(e, crate::memory::carve::CarveError::Stranded { .. }) {
                d.memory.keep_foreign(range);
            }
            crate::error_chain(&e)
        })?;
        match open(&made.path) {
            Ok(fd) => {
                tracing::info!(owner = %key.owner, region = key.region, device = %made.name, "DAX device carved for an import");
                let (name, path, range) = (made.name, made.path, range.clone());
                making.fill(ImportDevice { from: from.clone(), name, path, start, len, range, users: 1 });
                Ok(fd)
            }
            Err(e) => {
                if let Err(undo) = from.destroy(&made.name) {
                    // It may be opened yet: its DPAs stay out of the allocators until the
                    // next start deletes it, as for a device `put` cannot delete.
                    d.memory.keep_foreign(range);
                    tracing::warn!(device = %made.name, error = %undo, "cannot delete a DAX device no import got; its DPAs stay out of the allocators until the next start");
                }
                Err(e)
            }
        }
    }

    /// One user of `key`'s device less; the last one deletes it, which zaps every mapping
    /// of it. A device the kernel does not delete may still be mapped: its DPAs then stay
    /// out of this node's allocators until the daemon restarts (whose start deletes it).
    pub fn put(&self, d: &Daemon, key: &DeviceKey) {
        let last = |dev: &mut ImportDevice| {
            dev.users = dev.users.saturating_sub(1);
            dev.users == 0
        };
        let Some((dev, _deleting)) = self.carved.end(key, last) else { return };
        match dev.from.destroy(&dev.name) {
            Ok(()) => {
                tracing::info!(owner = %key.owner, region = key.region, device = %dev.name, "DAX device of an import deleted")
            }
            Err(e) => {
                d.memory.keep_foreign(&dev.range);
                tracing::warn!(
                    owner = %key.owner,
                    region = key.region,
                    device = %dev.name,
                    error = %crate::error_chain(&e),
                    "cannot delete the DAX device of an ended import; it goes at the next start, its DPAs stay out of the allocators until then"
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use fabric_addrmap::{Geometry, ResourceKey};
    use fabric_topology::MemoryKind;

    use super::*;

    fn set(ids: &[&str], granularity: u64) -> InterleaveSet {
        InterleaveSet {
            name: "s".into(),
            geometry: Geometry::new(ids.len() as u32, granularity).unwrap(),
            members: ids
                .iter()
                .map(|i| ResourceKey {
                    device: i.parse::<DeviceId>().unwrap(),
                    kind: MemoryKind::CxlVolatile,
                    ordinal: 0,
                })
                .collect(),
            member_size: 1 << 30,
            node: "n".into(),
            start: 0,
            reserved: 0,
            presence: Presence::Present,
        }
    }

    fn shared(serials: &[u64], granularity: u64, set_offset: u64) -> SharedCxl {
        let members =
            serials.iter().map(|&serial| CxlMember { serial, kind: MemoryKind::CxlVolatile, ordinal: 0 }).collect();
        SharedCxl { members, granularity, set_offset }
    }

    #[test]
    fn a_set_matches_only_the_same_members_in_the_same_order_striped_alike() {
        let two = set(&["serial:cxl/0xa1", "serial:cxl/0xb2"], 4096);
        assert!(same_set(&two, &shared(&[0xa1, 0xb2], 4096, 0)));
        assert!(!same_set(&two, &shared(&[0xb2, 0xa1], 4096, 0)), "another position order is other DPAs");
        assert!(!same_set(&two, &shared(&[0xa1, 0xb2], 256, 0)), "another granularity is other DPAs");
        assert!(!same_set(&two, &shared(&[0xa1], 4096, 0)));
        assert!(!same_set(&two, &shared(&[0xa1, 0xb2], 4096, 2 << 30)), "past the set");
        let one = set(&["serial:cxl/0xa1"], 256);
        assert!(same_set(&one, &shared(&[0xa1], 4096, 0)), "one way: the granularity does not matter");
        let mut cold = shared(&[0xa1], 256, 0);
        cold.members[0].kind = MemoryKind::CxlPersistent;
        assert!(!same_set(&one, &cold));
        let gone = InterleaveSet { presence: Presence::Vanished { since: 1 }, ..one };
        assert!(!same_set(&gone, &shared(&[0xa1], 256, 0)));
    }

    #[test]
    fn only_devices_named_by_their_serial_are_named_to_other_hosts() {
        assert_eq!(serial_of(&"serial:cxl/0x5eed".parse::<DeviceId>().unwrap()), Some(0x5eed));
        assert_eq!(serial_of(&"pci:n/0000:0d:00.0".parse::<DeviceId>().unwrap()), None);
        assert_eq!(serial_of(&"serial:nvswitch/0x5eed".parse::<DeviceId>().unwrap()), None);
        assert_eq!(serial_of(&"serial:cxl/0xzz".parse::<DeviceId>().unwrap()), None);
        let mixed = set(&["serial:cxl/0xa1", "pci:n/0000:0d:00.0"], 4096);
        assert_eq!(members_of(&mixed), None);
    }
}
