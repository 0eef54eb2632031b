//! The copy engine's view of the registry: a copy endpoint (a registration of the
//! session, or a GFA inside a region the session owns or imported) resolved, under the
//! registry lock, to memory the engine can reach without that lock — a shared pinned
//! mapping, a descriptor of the region's file, or a followed process — and the check that
//! what a copy depends on is still there ([`Memory::copy_dep_gone`]).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use fabric_addrmap::Snapshot;
use fabric_proto::wire::{AccessMode, CopyEndpoint};
use fabric_topology::DeviceId;

use super::{Memory, MemoryError, State, io_err};
use crate::dma::Backing;
use crate::dma::sys::Pinned;
use crate::placement::gfa_in;

/// Memory one side of a copy reaches, holding it alive for the copy.
#[derive(Debug, Clone)]
pub enum Side {
    /// A registration's pinned mapping, from byte `base` of it.
    Pinned {
        /// The mapping (shared with the registration).
        map: Arc<Pinned>,
        /// Offset of the endpoint's byte 0 in the mapping.
        base: u64,
    },
    /// A region's memory file, from byte `offset` of the file.
    File {
        /// The file (its own descriptor).
        file: Arc<File>,
        /// Offset of the endpoint's byte 0 in the file.
        offset: u64,
        /// Opened for writing.
        writable: bool,
        /// The region whose file it is (its kept mapping is found by this id).
        region: u64,
        /// Offset of the region's byte 0 in the file (a range of a DAX device or BAR; 0
        /// for a file of its own).
        base: u64,
        /// Bytes of the region, from byte `base` of the file.
        region_len: u64,
        /// The file is device memory (a DAX device, a BAR), which serves `mmap` only: its
        /// bytes are reached through the region's mapping, never `pread`/`pwrite`.
        device: bool,
    },
    /// A client's own memory (a process-backed registration).
    Process {
        /// The process, followed by its pidfd: the copy stops once it exits, and never
        /// reaches a process that got its pid since.
        process: crate::transport::peer::Process,
        /// Address of the endpoint's byte 0.
        addr: u64,
        /// The registration's gate, held around each access to that memory (and the
        /// copy's own gate never is: [`crate::dma::ClientGate`]).
        gate: Arc<crate::dma::ClientGate>,
    },
}

impl Side {
    /// Whether it is a client's own memory, reached under its registration's gate
    /// ([`crate::dma::ClientGate`]) rather than a copy's.
    pub fn is_client(&self) -> bool {
        matches!(self, Side::Process { .. })
    }
}

/// What a copy depends on: when any of it goes, the copy stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dep {
    /// A registration.
    Registration(u64),
    /// A region.
    Region(u64),
    /// An import.
    Import(u64),
}

/// An endpoint resolved.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The memory.
    pub side: Side,
    /// What it depends on.
    pub deps: Vec<Dep>,
    /// The devices whose memory it is (GFA endpoints, every member of an interleave set's
    /// region; for the partition check).
    pub devices: Vec<DeviceId>,
    /// Identity of the underlying object and the offset of byte 0 in it, to find
    /// overlapping copies: `(kind, a, b, offset)` with files as `(0, dev, inode)` and
    /// processes as `(1, pid, 0)`.
    pub key: (u8, u64, u64, u64),
    /// For a registration mapped in a VFIO container: the device and the IOVA of the
    /// endpoint's byte 0, so that a copy between two such endpoints can run on the device.
    pub dma: Option<(Arc<crate::dma::vfio::VfioDevice>, crate::dma::vfio::engine::End)>,
}

/// How a session reaches a region: `None` as its owner, else through an import (its id
/// and access).
type Via = Option<(u64, AccessMode)>;

/// A GFA endpoint as resolved under the lock.
enum GfaSide {
    /// Resolved.
    Resolved(Resolved),
    /// The region's file is not kept yet: it is opened without the lock, and the endpoint
    /// resolved again.
    Open {
        /// The region.
        region: u64,
        /// Its generation when it was found.
        generation: u64,
        /// Its file.
        file: super::RegionFile,
    },
}

/// A region's file kept for copies by GFA, with its identity (`file_key` without the offset).
pub(super) type CopyFile = (Arc<File>, (u8, u64, u64));

/// Region files kept open at most at once (descriptors are a daemon-wide resource: a
/// session copying into many regions must not exhaust them); past that, an arbitrary one
/// is closed and reopened on its next copy.
const MAX_COPY_FILES: usize = 256;

fn bad(m: impl Into<String>) -> MemoryError {
    MemoryError::BadRequest(m.into())
}

fn file_key(f: &File, offset: u64) -> (u8, u64, u64, u64) {
    match f.metadata() {
        Ok(m) => (0, m.dev(), m.ino(), offset),
        // An unknown identity cannot be compared; make it unique.
        Err(_) => {
            static UNKNOWN: AtomicU64 = AtomicU64::new(0);
            (2, UNKNOWN.fetch_add(1, Ordering::Relaxed), 0, offset)
        }
    }
}

impl Memory {
    /// Resolves `ep` for `len` bytes of a copy by `session`, for writing when `write`.
    /// `snap` is the address map GFAs are looked up in.
    pub fn copy_endpoint(
        &self,
        session: u64,
        snap: &Snapshot,
        ep: CopyEndpoint,
        len: u64,
        write: bool,
    ) -> Result<Resolved, MemoryError> {
        self.endpoint(session, snap, ep, len, write, None)
    }

    /// [`Memory::copy_endpoint`] for `len` bytes at `gfa` reached through `import` of
    /// `session` only (another node's chunk names the import it holds: neither a region
    /// of that session nor another import of the same region counts).
    pub fn copy_endpoint_through(
        &self,
        session: u64,
        snap: &Snapshot,
        import: u64,
        gfa: u64,
        len: u64,
        write: bool,
    ) -> Result<Resolved, MemoryError> {
        self.endpoint(session, snap, CopyEndpoint::Gfa(gfa), len, write, Some(import))
    }

    fn endpoint(
        &self,
        session: u64,
        snap: &Snapshot,
        ep: CopyEndpoint,
        len: u64,
        write: bool,
        through: Option<u64>,
    ) -> Result<Resolved, MemoryError> {
        let mut st = self.state();
        let gfa = match ep {
            CopyEndpoint::Registration { id, offset } => {
                return Self::registration_side(&st, session, id, offset, len, write);
            }
            CopyEndpoint::Gfa(gfa) => gfa,
        };
        let (region, generation, file) = match Self::gfa_side(&mut st, session, snap, gfa, len, write, through)? {
            GfaSide::Resolved(r) => return Ok(r),
            GfaSide::Open { region, generation, file } => (region, generation, file),
        };
        drop(st);
        // Opened outside the lock, once per region, read-write (the access check is done;
        // the engine maps it read-only for a source), and kept until the region ends: a
        // copy by GFA then costs no open and no fstat. Kept only if the region is still
        // the one it was (a region freed meanwhile is not found again below).
        let f = file.open(true).map_err(io_err(file.path()))?;
        let (kind, dev, ino, _) = file_key(&f, 0);
        let mut st = self.state();
        if st.ledger.regions.get(&region).is_some_and(|r| r.generation == generation)
            && !st.copy_files.contains_key(&region)
        {
            if st.copy_files.len() >= MAX_COPY_FILES
                && let Some(victim) = st.copy_files.keys().next().copied()
            {
                // Bounded: a chunk still running keeps its own `Arc` of the file.
                st.copy_files.remove(&victim);
            }
            st.copy_files.insert(region, (Arc::new(f), (kind, dev, ino)));
        }
        match Self::gfa_side(&mut st, session, snap, gfa, len, write, through)? {
            GfaSide::Resolved(r) => Ok(r),
            GfaSide::Open { region, .. } => {
                Err(MemoryError::NotFound(format!("region {region}'s file could not be kept for copies")))
            }
        }
    }

    fn registration_side(
        st: &State,
        session: u64,
        id: u64,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Resolved, MemoryError> {
        let r = st.ledger.dma.get(id).ok_or_else(|| MemoryError::NotFound(format!("no registration {id}")))?;
        if r.session != session {
            return Err(MemoryError::PermissionDenied(format!("registration {id} belongs to another session")));
        }
        if offset.checked_add(len).is_none_or(|e| e > r.len) {
            return Err(bad(format!(
                "{len} bytes at offset {offset} run past the {} bytes of registration {id}",
                r.len
            )));
        }
        if write && r.access != AccessMode::ReadWrite {
            return Err(MemoryError::PermissionDenied(format!(
                "registration {id} is read-only: it cannot be a copy's destination"
            )));
        }
        let at = r.lead + offset;
        let (side, key) = match &r.backing {
            Backing::Mapped(p) => {
                let key = file_key(p.file(), p.offset() + at);
                (Side::Pinned { map: p.clone(), base: at }, key)
            }
            Backing::Process { process, addr, gate } => {
                let key = (1, process.pid() as u64, 0, addr + at);
                (Side::Process { process: process.clone(), addr: addr + at, gate: gate.clone() }, key)
            }
        };
        let mut deps = vec![Dep::Registration(id)];
        match r.covers {
            crate::dma::Covers::Region(g) => deps.push(Dep::Region(g)),
            crate::dma::Covers::Import(i) => deps.push(Dep::Import(i)),
            crate::dma::Covers::Fd | crate::dma::Covers::Process => {}
        }
        let dma = r
            .vfio
            .as_ref()
            .map(|m| (m.device().clone(), crate::dma::vfio::engine::End { map: m.id(), iova: r.iova + at }));
        Ok(Resolved { side, deps, devices: Vec::new(), key, dma })
    }

    /// A GFA endpoint resolved under the lock, or the region file to open without it first
    /// (a region's first copy by GFA).
    fn gfa_side(
        st: &mut State,
        session: u64,
        snap: &Snapshot,
        gfa: u64,
        len: u64,
        write: bool,
        through: Option<u64>,
    ) -> Result<GfaSide, MemoryError> {
        let end = gfa.checked_add(len).ok_or_else(|| bad(format!("{len} bytes at GFA {gfa:#x} overflow")))?;
        // The regions this session reaches: its own, and those it imported (with the import).
        // Through one import: that import alone, looked up (a copy across nodes asks this
        // for every chunk; it used to walk every region and import of the node).
        let ledger = &st.ledger;
        let every = if through.is_none() { usize::MAX } else { 0 };
        let owned = ledger.regions.iter().take(every).filter(|(_, r)| r.session == session).map(|(id, _)| (*id, None));
        let one = through.and_then(|t| ledger.imports.get(&t).map(|i| (t, i)));
        let imported = (ledger.imports.iter().take(every).map(|(iid, i)| (*iid, i)))
            .chain(one)
            .filter(|(_, i)| i.session == session)
            .map(|(iid, i)| (i.region, Some((iid, i.access))));
        // Which way in wins, whatever order the maps hold them in: an owned region (it
        // grants more), then an import not revoked, then a writable one, then the newest.
        let rank = |via: Via| match via {
            None => (2u8, true, u64::MAX),
            Some((iid, access)) => {
                let live = st.ledger.imports.get(&iid).is_some_and(|i| !st.ledger.import_revoked(i));
                (u8::from(live), access == AccessMode::ReadWrite, iid)
            }
        };
        let mut found: Option<(u64, Via, u64)> = None;
        for (rid, via) in owned.chain(imported) {
            let Some(w) = Self::whereabouts_in(st, rid) else { continue };
            let Some(start) = gfa_in(snap, &w) else { continue };
            let Some(r) = st.ledger.regions.get(&rid) else { continue };
            if start <= gfa && gfa < start + r.len && found.is_none_or(|(_, was, _)| rank(via) > rank(was)) {
                found = Some((rid, via, start));
            }
        }
        let Some((rid, via, start)) = found else {
            return Err(MemoryError::NotFound(format!("GFA {gfa:#x} is in no region this session owns or imported")));
        };
        let r = st.ledger.regions.get(&rid).ok_or_else(|| MemoryError::NotFound(format!("no region {rid}")))?;
        if end > start + r.len {
            return Err(bad(format!("{len} bytes at GFA {gfa:#x} run past region {rid} ({start:#x}+{})", r.len)));
        }
        if r.lost {
            return Err(MemoryError::DeviceLost(format!("region {rid} lies on a device that was lost")));
        }
        let mut deps = vec![Dep::Region(rid)];
        if let Some((iid, access)) = via {
            if st.ledger.imports.get(&iid).is_some_and(|i| st.ledger.import_revoked(i)) {
                return Err(MemoryError::Revoked);
            }
            if write && access != AccessMode::ReadWrite {
                return Err(MemoryError::PermissionDenied(format!(
                    "import {iid} of region {rid} is read-only: it cannot be a copy's destination"
                )));
            }
            deps.push(Dep::Import(iid));
        }
        Self::refuse_object(st, rid, "copy its bytes")?;
        let (region_len, base, device_memory) = (r.len, r.backing.offset(), r.backing.is_device());
        let devices = st.devices_of(rid);
        let Some((file, ident)) = st.copy_files.get(&rid).cloned() else {
            return Ok(GfaSide::Open { region: rid, generation: r.generation, file: st.region_file(rid, r)? });
        };
        // Regions on one device share its file: the overlap key is the file offset.
        let offset = base + (gfa - start);
        Ok(GfaSide::Resolved(Resolved {
            side: Side::File { file, offset, writable: write, region: rid, base, region_len, device: device_memory },
            deps,
            devices,
            key: (ident.0, ident.1, ident.2, offset),
            dma: None,
        }))
    }

    /// Why a copy that depends on `deps` must stop, when one of them is gone.
    pub fn copy_dep_gone(&self, deps: &[Dep]) -> Option<String> {
        dep_gone(&self.state(), deps)
    }

    /// [`Self::copy_dep_gone`] for each of `sets`, under one hold of the registry's lock.
    pub fn copy_deps_gone(&self, sets: &[&[Dep]]) -> Vec<Option<String>> {
        let st = self.state();
        sets.iter().map(|deps| dep_gone(&st, deps)).collect()
    }
}

/// Why a copy that depends on `deps` must stop, as `st` stands.
fn dep_gone(st: &State, deps: &[Dep]) -> Option<String> {
    deps.iter().find_map(|d| match *d {
        Dep::Registration(id) if st.ledger.dma.get(id).is_none() => Some(format!("registration {id} was unregistered")),
        Dep::Region(id) => match st.ledger.regions.get(&id) {
            None => Some(format!("region {id} was freed")),
            Some(r) if r.lost => Some(format!("region {id} lies on a device that was lost")),
            Some(_) => None,
        },
        Dep::Import(id) => match st.ledger.imports.get(&id) {
            None => Some(format!("import {id} ended")),
            Some(i) if st.ledger.import_revoked(i) => Some(format!("the export behind import {id} was revoked")),
            Some(_) => None,
        },
        _ => None,
    })
}
