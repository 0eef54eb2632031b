//! Vendor memory objects as regions: `Adopt` takes an object a vendor API made (a CUDA
//! POSIX export of GPU memory, or a CUDA fabric handle's bytes) and places it in a device's
//! memory resource, so that it has a GFA, counts against its owner's limits and is
//! exported, revoked and reclaimed like any region; `ImportObject` hands a duplicate of the
//! descriptor, or the handle's bytes, to an admitted importer, which gives it to its own
//! driver. The daemon holds a descriptor (which keeps the allocation alive while the region
//! lives; a fabric handle keeps nothing alive: the exporter's allocation does) and never
//! maps or reads it. Adopted regions are not journaled: the allocation belongs to the
//! exporting process and ends with it.

use std::os::fd::{AsFd, OwnedFd};

use crate::memory::Identity;
use fabric_proto::wire::{AccessMode, ExportHandle, ObjectKind, Version};
use fabric_topology::{DeviceId, MemoryKind};

use super::alloc::{AllocError, round_len};
use super::backings::Backing;
use super::{Memory, MemoryError, Place, Region, State, Usage, kind_name};

/// A vendor memory object behind a region.
#[derive(Debug)]
pub(super) struct Object {
    /// The descriptor the owner handed over (none for an object that is bytes).
    fd: Option<OwnedFd>,
    /// What it is (for a fabric handle, the handle).
    kind: ObjectKind,
    /// Bytes of the object as its owner stated them (the region's range is this rounded
    /// up to the allocation granule).
    size: u64,
}

impl Object {
    /// What it is.
    pub(super) fn kind(&self) -> ObjectKind {
        self.kind
    }

    /// Whether it keeps a descriptor open (counted in `held.rs`).
    pub(super) fn holds_fd(&self) -> bool {
        self.fd.is_some()
    }

    /// A CUDA descriptor object of `size` bytes holding `fd` (the ledger's tests).
    #[cfg(test)]
    pub(super) fn cuda_fd(fd: OwnedFd, size: u64) -> Self {
        Object { fd: Some(fd), kind: ObjectKind::CudaPosixFd, size }
    }
}

/// An adopted region as its owner gets it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes of the object.
    pub size: u64,
}

/// An import of an adopted region.
#[derive(Debug)]
pub struct ObjectGrant {
    /// Import id.
    pub import: u64,
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes of the object.
    pub size: u64,
    /// A duplicate of the object's descriptor, for a kind that is one.
    pub fd: Option<OwnedFd>,
    /// What the object is (for a fabric handle, the handle).
    pub kind: ObjectKind,
    /// The device whose memory it is.
    pub device: DeviceId,
}

/// What memory an object kind is.
fn memory_of(kind: ObjectKind) -> MemoryKind {
    match kind {
        ObjectKind::CudaPosixFd | ObjectKind::CudaFabric(_) => MemoryKind::Hbm,
    }
}

/// Checks that the object came the way its kind travels: a descriptor kind with exactly the
/// one descriptor, a bytes kind with none (and not all zero: no driver makes that handle).
/// Returns the descriptor and what to log about the object.
fn check_object(
    kind: &ObjectKind,
    fd: Option<OwnedFd>,
    regions: &std::path::Path,
) -> Result<(Option<OwnedFd>, String), MemoryError> {
    match (kind, fd) {
        (ObjectKind::CudaPosixFd, Some(fd)) => check_descriptor(&fd, regions).map(|link| (Some(fd), link)),
        (ObjectKind::CudaPosixFd, None) => Err(bad("a CUDA POSIX object needs its descriptor")),
        (ObjectKind::CudaFabric(h), None) if h.0.iter().all(|b| *b == 0) => {
            Err(bad("an all-zero fabric handle is no CUDA allocation"))
        }
        (ObjectKind::CudaFabric(_), None) => Ok((None, "fabric handle (64 bytes)".into())),
        (ObjectKind::CudaFabric(_), Some(_)) => {
            Err(bad("a fabric handle travels in the request's body, with no descriptor"))
        }
    }
}

/// Refuses descriptors that cannot be a CUDA export (`fdkind`: an NVIDIA device or a
/// memfd; never an eventfd, `/dev/zero`, `/proc/self/mem` or a file on disk, which an
/// importer would be handed as GPU memory). Returns the descriptor's `/proc` link for the
/// log.
fn check_descriptor(fd: &OwnedFd, regions: &std::path::Path) -> Result<String, MemoryError> {
    super::fdkind::check_cuda_export(fd.as_fd(), regions).map_err(|e| bad(crate::error_chain(&e)))?;
    Ok(super::fdkind::link(fd.as_fd()))
}

fn bad(msg: impl Into<String>) -> MemoryError {
    MemoryError::BadRequest(msg.into())
}

impl Memory {
    /// Makes `fd`, a vendor memory object of `size` bytes on the resource `place` names, a
    /// region of `session`: its range is reserved in the resource (rounded up to the 2 MiB
    /// granule), its bytes count against the owner's `allocated_bytes`.
    pub fn adopt(
        &self,
        owner: &Identity,
        session: u64,
        place: &Place,
        size: u64,
        kind: ObjectKind,
        fd: Option<OwnedFd>,
    ) -> Result<Adopted, MemoryError> {
        let Place { device, kind: memory, .. } = place;
        if *memory != memory_of(kind) {
            return Err(bad(format!(
                "a {} is {} memory, not {}",
                kind.name(),
                kind_name(memory_of(kind)),
                kind_name(*memory)
            )));
        }
        let (fd, link) = check_object(&kind, fd, &self.root)?;
        let len = round_len(size).ok_or_else(|| bad(format!("size {size} is not adoptable")))?;
        self.ensure_session(session, owner)?;
        let mut st = self.state();
        self.check(&st, owner.uid, len, 1)?;
        if fd.is_some() {
            self.check_held(&st, owner.uid, session)?;
        }
        let sess = st.session(session)?;
        let candidates = st.candidates(place);
        if candidates.is_empty() {
            return Err(MemoryError::NotFound(format!("device {device} has no {} memory", kind_name(*memory))));
        }
        // Not on a lost device, nor in a share withdrawn (another host may hold it now).
        let refusals: Vec<Option<String>> = candidates.iter().map(|&i| st.resources[i].refusal()).collect();
        let live: Vec<(usize, u64)> =
            candidates.into_iter().zip(&refusals).filter(|(_, why)| why.is_none()).map(|(i, _)| (i, 0)).collect();
        if live.is_empty() {
            let why = refusals.into_iter().flatten().next();
            return Err(MemoryError::DeviceLost(why.unwrap_or_else(|| format!("device {device} vanished or failed"))));
        }
        let (resource, offset) =
            st.ledger.space.place(live, len).map_err(|last| {
                MemoryError::NoSpace(last.unwrap_or(AllocError::NoSpace { len, align: 0, capacity: 0 }))
            })?;
        let id = st.ledger.take_id();
        let holds = u64::from(fd.is_some());
        st.ledger.publish_region(
            id,
            Region {
                generation: id,
                owner: *owner,
                pid_start: sess.owner.pid_start,
                token: sess.token,
                session,
                resource,
                offset,
                len,
                // No file: the object is the descriptor (or the handle's bytes).
                backing: Backing::Object(Object { fd, kind, size }),
                lost: false,
            },
        );
        st.ledger.charge(owner.uid, Usage::region(len, holds));
        tracing::info!(uid = owner.uid, pid = owner.pid, session, region = id, %device, offset, size, kind = kind.name(), object = %link, "vendor object adopted");
        Ok(Adopted { region: id, generation: id, size })
    }

    /// Imports an adopted region by handle (checked as [`Memory::import`] checks): the
    /// import, a duplicate of the object's descriptor or the object's bytes, its kind and
    /// its device. `version` is the connection's protocol: an object kind newer than it is
    /// refused before anything is recorded.
    pub fn import_object(
        &self,
        who: &Identity,
        session: u64,
        handle: &ExportHandle,
        access: AccessMode,
        version: Version,
    ) -> Result<ObjectGrant, MemoryError> {
        let mut st = self.state();
        let via = st.ledger.admit(who, handle, access)?;
        let Some(obj) = st.ledger.regions.get(&handle.region).and_then(|r| r.object()) else {
            return Err(bad(format!(
                "region {} is fabric memory, not a vendor object: import it with Import and map it",
                handle.region
            )));
        };
        let (kind, size) = (obj.kind, obj.size);
        if kind.since() > version {
            return Err(MemoryError::NotImplemented(format!(
                "region {} is a {}, which needs protocol {}; this connection speaks {version}",
                handle.region,
                kind.name(),
                kind.since()
            )));
        }
        let fd = match &obj.fd {
            Some(fd) => Some(
                fd.as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| MemoryError::Io { path: std::path::PathBuf::new(), source: e })?,
            ),
            None => None,
        };
        let device = Self::region_device(&st, handle.region)?;
        self.check_import(&st, who.uid, session)?;
        let (import, generation) = Self::record_import(&mut st, who, session, handle, via, access)?;
        Ok(ObjectGrant { import, region: handle.region, generation, size, fd, kind, device })
    }

    fn region_device(st: &State, region: u64) -> Result<DeviceId, MemoryError> {
        let r = st.ledger.regions.get(&region).ok_or(MemoryError::InvalidHandle)?;
        Ok(st.resources[r.resource].device.clone())
    }

    /// Refuses what the daemon cannot do with an adopted region's bytes (it never maps
    /// them): DMA registration and the copy engine.
    pub(super) fn refuse_object(st: &State, region: u64, what: &str) -> Result<(), MemoryError> {
        match st.ledger.regions.get(&region).and_then(|r| r.object()) {
            Some(o) => Err(MemoryError::NotImplemented(format!(
                "region {region} is a vendor object ({}): fabricd does not map it, so it cannot {what}; \
                 use the vendor's API in a process that imported it (docs/gpu.md)",
                o.kind.name()
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::os::fd::FromRawFd;

    use fabric_topology::{Device, DeviceKind, Inventory, MemoryResource};

    use super::*;
    use crate::config::LimitsConfig;

    const MIB: u64 = 1 << 20;

    fn inventory(sources: &[&str]) -> (Inventory, DeviceId) {
        let id = DeviceId::uuid("GPU-74ea8f39-337d-2bff-f79c-f2f5ed86e4ee");
        let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 1 << 30, hpa: None, numa_node: None });
        d.memory.push(MemoryResource { kind: MemoryKind::Dram, size: 1 << 30, hpa: None, numa_node: None });
        d.sources = sources.iter().map(|s| (*s).to_owned()).collect();
        let mut inv = Inventory::default();
        inv.add_device(d).unwrap();
        (inv, id)
    }

    fn memfd() -> OwnedFd {
        // SAFETY: a NUL-terminated name and no flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"object".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: the descriptor was just created and is owned by nothing else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    const ME: Identity = Identity { pid: 1, uid: 1000, gid: 1000 };

    #[test]
    fn a_real_gpus_hbm_is_adopted_not_allocated() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory(&["pci", "nvml"]);
        let m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        let hbm = Place { device: gpu.clone(), kind: MemoryKind::Hbm, ordinal: None };
        // A file per region would only pretend to be HBM: refused, with the way to do it.
        let e = m.alloc(&ME, 1, &hbm, 2 * MIB, 0).unwrap_err();
        assert!(matches!(&e, MemoryError::NotImplemented(w) if w.contains("Adopt")), "{e}");
        // Host memory is real memory either way.
        let dram = Place { device: gpu.clone(), kind: MemoryKind::Dram, ordinal: None };
        m.alloc(&ME, 1, &dram, 2 * MIB, 0).unwrap();
        // The driver's allocation, adopted, takes the resource's lowest range.
        let a = m.adopt(&ME, 1, &hbm, 3 * MIB, ObjectKind::CudaPosixFd, Some(memfd())).unwrap();
        assert_eq!(a.size, 3 * MIB);
        let Some(super::super::Whereabouts::Resource { offset, len, .. }) = m.whereabouts(a.region) else { panic!() };
        assert_eq!((offset, len), (0, 4 * MIB));
        assert_eq!(m.counts().allocated_bytes, 6 * MIB);
    }

    /// A resource whose share was withdrawn (collected while this node was away; another
    /// host may hold it now) places no adopted object, as it places no region. Before,
    /// adopt looked only at lost devices.
    #[test]
    fn a_withdrawn_share_takes_no_adopted_object() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory(&["pci", "nvml"]);
        let m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        let hbm = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        for r in m.state().resources.iter_mut().filter(|r| r.kind == MemoryKind::Hbm) {
            r.withdrawn = Some("the share was collected".into());
        }
        let e = m.adopt(&ME, 1, &hbm, 2 * MIB, ObjectKind::CudaPosixFd, Some(memfd())).unwrap_err();
        assert!(matches!(&e, MemoryError::DeviceLost(w) if w.contains("collected")), "{e}");
        assert_eq!(m.counts().allocated_bytes, 0);
    }

    #[test]
    fn a_sim_gpus_hbm_is_allocated_as_files() {
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory(&["sim"]);
        let m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        let hbm = Place { device: gpu, kind: MemoryKind::Hbm, ordinal: None };
        m.alloc(&ME, 1, &hbm, 2 * MIB, 0).unwrap();
    }

    #[test]
    fn a_fabric_handle_is_adopted_as_bytes_and_only_new_connections_get_it() {
        use fabric_proto::wire::{BoundedVec, ExportPolicy, FabricHandleBytes};
        let dir = tempfile::tempdir().unwrap();
        let (inv, gpu) = inventory(&["pci", "nvml"]);
        let m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        let hbm = Place { device: gpu.clone(), kind: MemoryKind::Hbm, ordinal: None };
        let handle = ObjectKind::CudaFabric(FabricHandleBytes([7; 64]));
        // Bytes and a descriptor, a POSIX kind without one, an all-zero handle: refused.
        for (kind, fd) in [
            (handle, Some(memfd())),
            (ObjectKind::CudaPosixFd, None),
            (ObjectKind::CudaFabric(FabricHandleBytes([0; 64])), None),
        ] {
            let e = m.adopt(&ME, 1, &hbm, 2 * MIB, kind, fd).unwrap_err();
            assert!(matches!(e, MemoryError::BadRequest(_)), "{e}");
        }
        assert_eq!(m.counts().allocated_bytes, 0, "nothing placed by a refusal");
        let a = m.adopt(&ME, 1, &hbm, 2 * MIB, handle, None).unwrap();
        let policy = ExportPolicy {
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
            partition: None,
            access: AccessMode::ReadWrite,
        };
        let h = m.export(&ME, 1, a.region, policy).unwrap();
        // A connection at 1.3 could not decode the bytes: refused before any import exists.
        let e = m.import_object(&ME, 2, &h, AccessMode::ReadWrite, Version::new(1, 3)).unwrap_err();
        assert!(matches!(&e, MemoryError::NotImplemented(w) if w.contains("1.4")), "{e}");
        let g = m.import_object(&ME, 2, &h, AccessMode::ReadWrite, Version::new(1, 4)).unwrap();
        assert_eq!((g.kind, g.size, g.region, g.fd.is_none(), g.device), (handle, 2 * MIB, a.region, true, gpu));
        // The daemon cannot reach the bytes either way.
        let st = m.state();
        assert!(Memory::refuse_object(&st, a.region, "copy").is_err());
    }
}
