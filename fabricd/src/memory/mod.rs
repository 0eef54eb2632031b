//! Sim device memory and its registry: regions allocated from the devices' memory
//! resources, exports (capabilities with a random secret and a policy), imports, per-uid
//! limits, and reclaim when a session ends.
//!
//! Each region is backed by its own sparse file under
//! `<state dir>/memory/<sanitised device id>.<kind><ordinal>/r<region id>` (sized with
//! `set_len`, never written by the daemon), so that a descriptor handed to a client
//! reaches exactly that region and nothing else of the device. Each resource's
//! [`alloc::RangeAllocator`], held in the ledger's space (`space.rs`), places regions in
//! the resource's range (first fit, 2 MiB granule), which bounds what a resource holds.
//!
//! Resources and interleave sets the operator exports as real device memory (a DAX device,
//! a PCI BAR: [`backing`]) hold no files: their regions are ranges of the device file, and
//! the client gets the device's descriptor with the region's offset in it. A NUMA node the
//! operator exports ([`numa`]) gives each region a tmpfs file of its own under the node's
//! directory ([`numadir`]), its pages bound to the node ([`nodefd`]).
//!
//! The registry is durable (`memory/persist.rs`, records in [`durable`]): every change to regions
//! and exports is journaled before it is acknowledged, and at start the registry is
//! rebuilt from the journal and reconciled with the region files found
//! ([`Memory::open_durable`]). Imports are not journaled: they end with the daemon, and the
//! importer's mapping stays valid because it holds the descriptor. [`Memory::open`] is the
//! same registry without a journal (region files of an earlier run are removed).

pub mod alloc;
pub mod backing;
mod backings;
pub mod carve;
mod carved;
pub mod durable;
pub mod foreign;
pub mod holds;
pub mod limits;
pub mod nodefd;
pub mod numa;
pub mod numadir;
pub mod offers;
mod persist;
mod quarantine;
mod sizes;
pub mod zero;

pub use persist::{Durability, Resumed, owner_of, pid_start_time};
pub use quarantine::Quarantine;

mod adopt;
mod compactor;
mod copyside;
mod effects;
pub mod fdkind;
mod held;
mod ledger;
#[cfg(test)]
mod ledger_model_tests;
#[cfg(test)]
mod ledger_tests;
mod register;
#[cfg(test)]
mod register_tests;
mod reserve;
mod set;
mod space;

pub use adopt::{Adopted, ObjectGrant};
pub use copyside::{Dep, Resolved, Side};
pub use effects::Aftermath;
pub use register::{Abandon, Registered, Source};
pub use set::{ForeignRange, SetSpec, Whereabouts};

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use fabric_proto::wire::{
    AccessMode, BoundedVec, Coherence, DeviceName, ExportHandle, ExportInfo, ExportPolicy, ImportInfo, ObjectKind,
    RegionInfo, RegionsResponse, ResourceName, Revocation, RevocationReason, Secret,
};
use fabric_topology::{DeviceId, Inventory, MemoryKind};

use crate::config::LimitsConfig;
use alloc::{AllocError, RangeAllocator};
use backings::{Backing, Offer};
use durable::{Change, DurableError};
use ledger::{Export, Import, Ledger, Region, Usage};

/// Who the registry acts for, and records as the owner of what it creates: the uid and
/// gid it charges, lists and judges by, and the process a resume checks (pid 0: no process
/// on this host, as for another node's client). The operations layer makes it from the
/// request's principal ([`crate::ops::principal::Principal::owner`]); the transport's
/// credentials never reach the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    /// The process, on this host; 0 for none.
    pub pid: i32,
    /// The uid charged and listed.
    pub uid: u32,
    /// The primary gid.
    pub gid: u32,
}

/// Why a memory operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// No such device resource, region, export or import.
    #[error("{0}")]
    NotFound(String),
    /// The caller does not own the object or the policy does not admit it.
    #[error("{0}")]
    PermissionDenied(String),
    /// The handle names no live export.
    #[error("the handle does not name a live export")]
    InvalidHandle,
    /// The export was revoked.
    #[error("the export was revoked")]
    Revoked,
    /// A limit of a uid, or of an importer node, would be exceeded.
    #[error("{who}: {what} limit: {used} in use + {requested} asked > {max}")]
    Limit {
        /// Whose allowance.
        who: limits::Holder,
        /// `allocated_bytes`, `objects`, `imports_per_node`, a descriptor share...
        what: &'static str,
        /// In use.
        used: u64,
        /// Asked for.
        requested: u64,
        /// Allowed.
        max: u64,
    },
    /// The resource has no room.
    #[error(transparent)]
    NoSpace(AllocError),
    /// The request is malformed (size 0, bad alignment).
    #[error("{0}")]
    BadRequest(String),
    /// Not served yet.
    #[error("{0}")]
    NotImplemented(String),
    /// The device holding the memory vanished or failed.
    #[error("{0}")]
    DeviceLost(String),
    /// A region on a NUMA node could not be made.
    #[error(transparent)]
    Node(numa::NumaError),
    /// A DAX device of its own could not be carved for the region.
    #[error("per-region DAX device")]
    Carve(#[source] carve::CarveError),
    /// The journal refused the change (it is not made).
    #[error("journal")]
    Journal(#[source] crate::journal::JournalError),
    /// A journal record does not encode or decode.
    #[error("journal record")]
    Record(#[source] DurableError),
    /// The journal failed and is not reopened yet: changes queued before the failure are
    /// still in flight (the reopen waits for them); changes are refused meanwhile.
    #[error("the journal is unavailable after a write failure; changes are refused")]
    JournalUnavailable,
    /// The device's DMA domain has no IOVA range left below its mask.
    #[error(transparent)]
    Iova(crate::dma::iova::IovaError),
    /// Memory could not be pinned (mapped and locked).
    #[error(transparent)]
    Pin(crate::dma::sys::PinError),
    /// The VFIO backend refused the mapping.
    #[error("VFIO")]
    Vfio(#[source] crate::dma::vfio::VfioError),
    /// The device memory of a new region could not be zeroed (it is not handed out).
    #[error("zeroing the region's device memory")]
    Zero(#[source] zero::ZeroError),
    /// A directory of region files is not the daemon's own (`crate::sys::privdir`).
    #[error("region directory")]
    Private(#[source] crate::sys::privdir::DirError),
    /// A backing file could not be created or opened.
    #[error("backing file {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl MemoryError {
    /// Whether what failed left its range held (a carved device that could not be
    /// deleted): the range is then not handed out again before the next start.
    pub(crate) fn strands_range(&self) -> bool {
        matches!(self, MemoryError::Carve(carve::CarveError::Stranded { .. }))
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> MemoryError + '_ {
    move |source| MemoryError::Io { path: path.to_owned(), source }
}

/// One memory resource of a device.
#[derive(Debug)]
struct Resource {
    device: DeviceId,
    kind: MemoryKind,
    ordinal: u16,
    dir: PathBuf,
    /// `dir`, held open since it was checked: region files are opened relative to it.
    dir_fd: Arc<OwnedFd>,
    /// The device vanished or failed: nothing is allocated here until it is back.
    lost: bool,
    /// What backs its regions.
    offer: Offer,
    /// This node's share of it was collected while the node was away and another host
    /// holds the range now (why): no new region goes here until the share is claimed back.
    withdrawn: Option<String>,
    /// Start-up dropped regions here for a change of its memory and could not compact
    /// them out of the journal (why): no new region goes here until a start does. Kept
    /// apart from `withdrawn`, which the domain sets and clears for shares.
    held_back: Option<String>,
    /// Whether this host's caches are kept coherent with what other hosts store to it:
    /// `Software` where this node's share of a device other hosts reach too
    /// (`[[memory.shares]]`) is not declared coherent, else `Hardware` (its own memory).
    coherence: Coherence,
}

/// Where a region's file is, to open it: by name in its resource's directory, held open
/// since start (so nothing done to the directory's path since it was checked changes what
/// is opened), or a device file (a DAX device, a BAR's `resourceN`).
#[derive(Debug, Clone)]
pub(crate) struct RegionFile {
    dir: Option<Arc<OwnedFd>>,
    path: PathBuf,
    /// A device file, opened by path (never through a symlink).
    device_file: bool,
}

impl RegionFile {
    /// Opens the file read-only or read-write, never through a symlink.
    pub(crate) fn open(&self, write: bool) -> std::io::Result<File> {
        if self.device_file {
            return crate::sys::privdir::open_nofollow(&self.path, write);
        }
        match (&self.dir, self.path.file_name()) {
            (Some(dir), Some(name)) => crate::sys::privdir::open_in(dir.as_fd(), name, write),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the region file is not in its resource's directory",
            )),
        }
    }

    /// The file's size, read without opening it (never through a symlink: one there gives
    /// the link's own size, and the open that would follow refuses it).
    pub(crate) fn size(&self) -> std::io::Result<u64> {
        self.stat().map(|st| u64::try_from(st.st_size).unwrap_or(0))
    }

    /// Which file it is, `(st_dev, st_ino)`, read as [`RegionFile::size`] is.
    pub(crate) fn id(&self) -> std::io::Result<fdkind::FileId> {
        self.stat().map(|st| (st.st_dev, st.st_ino))
    }

    fn stat(&self) -> std::io::Result<nix::sys::stat::FileStat> {
        let st = match (&self.dir, self.path.file_name()) {
            (Some(dir), Some(name)) if !self.device_file => {
                nix::sys::stat::fstatat(dir.as_fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
            }
            _ => nix::sys::stat::fstatat(nix::fcntl::AT_FDCWD, &self.path, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW),
        };
        st.map_err(std::io::Error::from)
    }

    /// The file's path (for messages and removal).
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl State {
    /// A registry's state over `resources` (each with its bytes), ids counted from
    /// `next_id`.
    fn new(resources: Vec<(Resource, u64)>, next_id: u64) -> Self {
        let mut st = State { ledger: Ledger { next_id, ..Ledger::default() }, ..State::default() };
        for (r, size) in resources {
            st.add_resource(r, size);
        }
        st
    }

    /// Adds `resource` of `size` bytes, its allocator with it (a resource's index is its
    /// allocator's).
    fn add_resource(&mut self, resource: Resource, size: u64) {
        self.resources.push(resource);
        self.ledger.space.add(size);
    }

    /// How to open the file of region `id` (see [`RegionFile`]); a vendor object has none.
    pub(crate) fn region_file(&self, id: u64, r: &Region) -> Result<RegionFile, MemoryError> {
        self.file_in(r.resource, &r.backing).ok_or_else(|| {
            MemoryError::BadRequest(format!("region {id} is a vendor object: it has no file fabricd opens"))
        })
    }

    /// How to open the file of `backing`, a region of resource `resource`.
    fn file_in(&self, resource: usize, backing: &Backing) -> Option<RegionFile> {
        let path = backing.path()?;
        let dir = self
            .resources
            .get(resource)
            .filter(|res| backing.own_file().is_some() && path.parent() == Some(res.dir.as_path()))
            .map(|res| res.dir_fd.clone());
        Some(RegionFile { dir, path: path.to_owned(), device_file: backing.is_device() })
    }

    /// The resources region `id` lies on: its own, then, for a region of an interleave set,
    /// every other member's.
    fn resources_of(&self, id: u64) -> impl Iterator<Item = &Resource> {
        let first = self.ledger.regions.get(&id).map(|r| r.resource);
        let others = self.set_regions.get(&id).map(|s| s.others.as_slice()).unwrap_or_default();
        first.into_iter().chain(others.iter().copied()).filter_map(|i| self.resources.get(i))
    }

    /// The devices region `id` lies on (every member of a set: a partition check of the
    /// first alone would let a set striped over another tenant's device through).
    fn devices_of(&self, id: u64) -> Vec<DeviceId> {
        self.resources_of(id).map(|res| res.device.clone()).collect()
    }

    /// Whether this host's caches are kept coherent with region `id`'s memory: `Software`
    /// when any resource it lies on (every member of a set) is, else `Hardware`.
    fn coherence(&self, id: u64) -> Coherence {
        let software = self.resources_of(id).any(|res| res.coherence == Coherence::Software);
        if software { Coherence::Software } else { Coherence::Hardware }
    }

    /// Counts the bytes of all resources again (after resources were added or resized).
    fn recount_fabric(&mut self) {
        let sum = |dram: bool| {
            self.ledger
                .space
                .capacity_where(|i| self.resources.get(i).is_some_and(|r| (r.kind == MemoryKind::Dram) == dram))
        };
        self.fabric_bytes = (sum(false), sum(true));
    }

    /// The resources `place` names, in order: the `ordinal`-th of its kind on its device, or
    /// every one of that kind there.
    fn candidates(&self, place: &Place) -> Vec<usize> {
        let Place { device, kind, ordinal } = place;
        (0..self.resources.len())
            .filter(|&i| {
                let r = &self.resources[i];
                r.device == *device && r.kind == *kind && ordinal.is_none_or(|o| o == r.ordinal)
            })
            .collect()
    }
}

impl Resource {
    /// Why `Alloc` cannot make a region here, when it cannot: device memory of a real
    /// device (HBM, CXL) that no configured device file backs. A file per region would
    /// only pretend to be that memory; host memory (DRAM, exported host memory) is real
    /// either way.
    /// Why no new region may go here now: its device went, or its share was taken.
    fn refusal(&self) -> Option<String> {
        self.lost_why().or_else(|| self.held_back.clone()).or_else(|| self.withdrawn.clone())
    }

    /// Why its regions are lost, when its device went.
    fn lost_why(&self) -> Option<String> {
        self.lost.then(|| format!("device {} vanished or failed", self.device))
    }

    fn unserved(&self) -> Option<String> {
        matches!(self.offer, Offer::Driver).then(|| match self.kind {
            MemoryKind::Hbm => format!(
                "{}'s HBM is allocated by its driver: allocate it with the vendor API (fabric_mm::cuda) and hand it to fabricd with Adopt",
                self.device
            ),
            _ => format!(
                "{}'s {} memory is served only through a device file: name its DAX device in [memory] dax",
                self.device,
                kind_name(self.kind)
            ),
        })
    }
}

#[derive(Debug, Default)]
struct State {
    resources: Vec<Resource>,
    /// Who holds what: regions, exports, imports, usage (`ledger.rs`).
    ledger: Ledger,
    /// The journal (`None`: an in-memory registry).
    log: Option<persist::Log>,
    /// Tokens and owners of live sessions, made at first use.
    sessions: HashMap<u64, persist::Session>,
    /// Sessions found in the journal at start that no client has taken back yet.
    orphans: Vec<persist::Orphan>,
    /// What start-up had to drop.
    problems: Vec<String>,
    /// Regions striped over an interleave set, by region id.
    set_regions: HashMap<u64, set::SetRegion>,
    /// Regions a registration of which could not be unmapped from an IOMMU: a device may
    /// still reach their memory, so the range of one is not handed out again when it is
    /// freed (until a restart, which closes the VFIO containers).
    unmap_failed: std::collections::HashSet<u64>,
    /// Freed regions' ranges waiting for their registrations' unmaps
    /// (`Ledger::unmapping`): released once each is done, kept out if one fails.
    awaiting_unmap: HashMap<u64, quarantine::Release>,
    /// DAX devices backing interleave sets, by set name.
    set_backings: HashMap<String, backing::DeviceBacking>,
    /// Their sets' members in position order, by set name (where a device's range lies).
    set_members: HashMap<String, Vec<(DeviceId, MemoryKind, u16)>>,
    /// Region files the copy engine reaches by GFA, opened read-write on a region's first
    /// copy and closed when the region ends, with their identity (`copyside.rs`).
    copy_files: HashMap<u64, copyside::CopyFile>,
    /// Slow steps changes left to do once the lock is released (`effects.rs`).
    effects: Vec<effects::Effect>,
    /// Bytes of the resources together, `(device memory, host DRAM)` (what the default
    /// `allocated_bytes_per_uid` is derived from), counted again whenever resources change.
    fabric_bytes: (u64, u64),
    /// Registry sessions of importer nodes (the node link's owner side), by session.
    remote: HashMap<u64, quarantine::RemoteSession>,
    /// Live regions that importer nodes which left had imported, by region.
    mapped_by: HashMap<u64, std::collections::BTreeSet<String>>,
    /// Set ranges clients map as other hosts' memory, with how many imports hold each
    /// (`set.rs`, [`Memory::hold_foreign`]).
    foreign: HashMap<set::ForeignRange, usize>,
    /// Those of them held again at start for clients that may still map them, each with
    /// one user until the resume grace period ends (`foreign.rs`).
    foreign_restored: Vec<set::ForeignRange>,
    /// The incarnation each importer node last had here (`holds.rs`).
    incarnations: HashMap<String, u64>,
    /// Importer nodes whose holds came back from `quarantine.record` at start, not yet
    /// taken by the node link's owner side ([`Memory::take_restored_holders`]).
    restored: Vec<(String, u64)>,
}

/// Where to allocate: the `ordinal`-th resource of `kind` of `device`, or the first of
/// that kind with room when `ordinal` is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The device.
    pub device: DeviceId,
    /// Kind of memory.
    pub kind: MemoryKind,
    /// Which resource of that kind.
    pub ordinal: Option<u16>,
}

/// A region as the client gets it.
#[derive(Debug)]
pub struct Granted {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes.
    pub len: u64,
    /// The backing file, opened for the access granted.
    pub fd: OwnedFd,
    /// Offset of the region's first byte in `fd` (non-zero for device memory).
    pub offset: u64,
    /// Import id (imports only).
    pub import: u64,
    /// Whether the hardware keeps this host's caches coherent with the region's memory:
    /// `Software` when a resource it lies on is this node's share of a device other hosts
    /// reach too, not declared coherent (`[[memory.shares]]`).
    pub coherence: Coherence,
}

/// An admitted import whose file is being opened outside the lock ([`Memory::import`]).
#[derive(Debug)]
struct PendingImport {
    /// The region's file.
    file: RegionFile,
    /// The region's generation when it was admitted.
    generation: u64,
    /// Bytes.
    len: u64,
    /// Offset of the region's first byte in the file.
    offset: u64,
}

/// What an export is about: see [`Memory::export_subject`].
#[derive(Debug, Clone)]
pub struct ExportSubject {
    /// Who may import.
    pub policy: ExportPolicy,
    /// The devices its region lies on (every member of an interleave set).
    pub devices: Vec<DeviceId>,
    /// Revoked.
    pub revoked: bool,
    /// The vendor object kind of an adopted region (`None`: fabric memory).
    pub object: Option<ObjectKind>,
}

/// Counters for `status`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Live regions.
    pub regions: u64,
    /// Live (unrevoked) exports.
    pub exports: u64,
    /// Live imports.
    pub imports: u64,
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Regions whose device vanished or failed (counted in `regions` too).
    pub lost_regions: u64,
    /// Bytes of the regions behind live imports, per import.
    pub imported_bytes: u64,
    /// Live DMA registrations.
    pub registrations: u64,
    /// Bytes of freed regions held out of reuse while another node may map them.
    pub quarantined_bytes: u64,
    /// Bytes pinned by registrations (whole pages).
    pub pinned_bytes: u64,
}

/// What a closed session held and lost.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reclaimed {
    /// Regions freed.
    pub regions: u64,
    /// Exports revoked (of those regions).
    pub exports: u64,
    /// Imports released.
    pub imports: u64,
    /// Registrations undone.
    pub registrations: u64,
}

impl Reclaimed {
    /// Adds what `other` reclaimed.
    fn add(&mut self, other: Reclaimed) {
        self.regions += other.regions;
        self.exports += other.exports;
        self.imports += other.imports;
        self.registrations += other.registrations;
    }
}

/// The memory broker's state.
#[derive(Debug)]
pub struct Memory {
    /// Declared first: dropped (its thread joined, its last snapshot settled) while the
    /// state is still there.
    compactor: std::sync::OnceLock<Option<compactor::Compactor>>,
    state: Arc<Mutex<State>>,
    limits: LimitsConfig,
    /// `limits.pinned_bytes_per_uid`, or the default derived from the machine's memory.
    pinned_max: u64,
    /// Where resource directories go.
    root: PathBuf,
    /// The shares of the open-file table objects may keep (`held.rs`).
    held: held::HeldLimits,
    /// Who hears what an operation ended ([`Memory::on_end`]).
    ended_hook: std::sync::OnceLock<Hook>,
    /// The holds last saved in `quarantine.record` (`None`: not since start, so the file
    /// may say anything) and the record's generation; its lock orders the saves
    /// (`holds.rs`).
    holds_saved: Mutex<(u64, Option<Vec<holds::Hold>>)>,
    /// The same for the ranges of other hosts' memory in `foreign.record` (`foreign.rs`).
    foreign_saved: Mutex<(u64, Option<Vec<foreign::SavedRange>>)>,
}

/// The end hook, shown by name only.
#[derive(Debug)]
struct Hook(EndHook);

impl std::fmt::Debug for EndHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndHook")
    }
}

/// What the daemon does, without the registry lock, at the end of an operation that
/// ended something ([`Memory::deliver`]): first `stop_copies` (the copies that depended on
/// it), then — once the freed device ranges are given back or parked for the importer
/// nodes, so that their acknowledgements find them parked — `tell` the revocations it
/// caused (each with the session to tell).
pub struct EndHook {
    /// Stops the copies that depend on what ended.
    pub stop_copies: Box<dyn Fn(&Memory) + Send + Sync>,
    /// Tells the revocations.
    pub tell: Tell,
}

/// [`EndHook::tell`]: takes the revocations an operation caused, each with the session to
/// tell.
pub type Tell = Box<dyn Fn(Vec<(u64, Revocation)>) + Send + Sync>;

/// A device id as a file name: characters other than `[A-Za-z0-9._-]` become `_`.
pub fn sanitise(id: &str) -> String {
    id.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') { c } else { '_' }).collect()
}

fn kind_name(k: MemoryKind) -> String {
    format!("{k:?}").to_ascii_lowercase()
}

fn random_secret() -> std::io::Result<Secret> {
    crate::sys::random_bytes().map(Secret)
}

/// One resource per memory resource of each device, its directory under `root` created,
/// with its bytes.
fn resources(root: &Path, inv: &Inventory) -> Result<Vec<(Resource, u64)>, MemoryError> {
    let mut resources = Vec::new();
    for dev in &inv.devices {
        resources.extend(resources_of(root, dev)?);
    }
    Ok(resources)
}

/// The resources of one device, their directories created (region files in them are left
/// alone: a durable registry reconciles them, `Memory::open` removes them).
fn resources_of(root: &Path, dev: &fabric_topology::Device) -> Result<Vec<(Resource, u64)>, MemoryError> {
    let mut out = Vec::new();
    for (kind, ordinal, size) in device_resources(dev) {
        let name = format!("{}.{}{ordinal}", sanitise(&dev.id.to_string()), kind_name(kind));
        // Private (region files are capabilities) and durable (a region file fsynced into a
        // directory a power loss forgets is lost too), both by `PrivateDir`.
        let private = crate::sys::privdir::PrivateDir::create(root)
            .and_then(|r| r.subdir(&name))
            .map_err(MemoryError::Private)?;
        let dir = private.path().to_owned();
        let resource = Resource {
            device: dev.id.clone(),
            kind,
            ordinal,
            dir,
            dir_fd: Arc::new(private.into_fd()),
            lost: false,
            offer: Offer::of(kind, dev.sources.iter().any(|s| s == "sim")),
            withdrawn: None,
            held_back: None,
            coherence: Coherence::Hardware,
        };
        out.push((resource, size));
    }
    Ok(out)
}

/// A device's memory resources as the registry names them: kind, ordinal among the
/// device's resources of that kind (in inventory order), bytes.
pub fn device_resources(dev: &fabric_topology::Device) -> Vec<(MemoryKind, u16, u64)> {
    let mut ordinals: HashMap<MemoryKind, u16> = HashMap::new();
    dev.memory
        .iter()
        .map(|m| {
            let ord = ordinals.entry(m.kind).or_default();
            let ordinal = *ord;
            *ord += 1;
            (m.kind, ordinal, m.size)
        })
        .collect()
}

/// The name a resource has across hosts: `<device id>/<kind><ordinal>`, the kind as the
/// fabric's documents spell it (`serial:cxl/0x5eed0000/cxl_volatile0`; a share's key).
pub fn resource_name(device: &fabric_topology::DeviceId, kind: MemoryKind, ordinal: u16) -> String {
    let kind =
        serde_json::to_value(kind).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| kind_name(kind));
    format!("{device}/{kind}{ordinal}")
}

impl Memory {
    /// One resource per memory resource of each device, with its directory under
    /// `root` created and emptied of region files left by an earlier run.
    pub fn open(root: &Path, inv: &Inventory, limits: LimitsConfig) -> Result<Self, MemoryError> {
        let resources = resources(root, inv)?;
        for (r, _) in &resources {
            let dir = &r.dir;
            let mut stale = 0usize;
            for e in std::fs::read_dir(dir).map_err(io_err(dir))?.flatten() {
                if e.file_name().to_string_lossy().starts_with('r') {
                    std::fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
                    stale += 1;
                }
            }
            if stale > 0 {
                tracing::info!(dir = %dir.display(), stale, "removed region files of an earlier run");
            }
        }
        tracing::info!(resources = resources.len(), dir = %root.display(), "sim device memory ready");
        Ok(Self::with_state(State::new(resources, 1), limits, root))
    }

    /// The registry over `st`, its per-uid limits resolved (the unset ones derived from the
    /// fabric and the machine, `limits.rs`) and logged.
    fn with_state(mut st: State, limits: LimitsConfig, root: &Path) -> Self {
        st.recount_fabric();
        let machine = limits::machine_memory();
        let pinned_max = limits.pinned_bytes_per_uid.unwrap_or_else(|| match machine {
            Some(m) => limits::default_pinned(m),
            None => {
                tracing::warn!("the machine's memory is unknown; limits.pinned_bytes_per_uid defaults to 0: set it");
                0
            }
        });
        let m = Self {
            compactor: std::sync::OnceLock::new(),
            state: Arc::new(Mutex::new(st)),
            limits,
            pinned_max,
            root: root.to_owned(),
            held: held::HeldLimits::default(),
            ended_hook: std::sync::OnceLock::new(),
            holds_saved: Mutex::new((0, None)),
            foreign_saved: Mutex::new((0, None)),
        };
        let fabric = m.state().fabric_bytes;
        tracing::info!(
            allocated_bytes_per_uid = m.allocated_max(fabric),
            allocated_derived = m.limits.allocated_bytes_per_uid.is_none(),
            device_memory_bytes = fabric.0,
            dram_bytes = fabric.1,
            pinned_bytes_per_uid = m.pinned_max,
            pinned_derived = m.limits.pinned_bytes_per_uid.is_none(),
            machine_bytes = machine.unwrap_or(0),
            objects_per_uid = m.limits.objects_per_uid,
            "per-uid memory limits"
        );
        m
    }

    /// `limits.allocated_bytes_per_uid`, or the default for a fabric of `(device memory,
    /// DRAM)` bytes.
    fn allocated_max(&self, (device, dram): (u64, u64)) -> u64 {
        self.limits.allocated_bytes_per_uid.unwrap_or_else(|| limits::default_allocated(device, dram))
    }

    /// Puts the device memory `b` lists behind its resources and sets (their regions
    /// become ranges of the device files). BARs whose resource is not here are skipped with
    /// a warning (the function vanished between discovery and now).
    fn apply_backings(st: &mut State, b: &backing::Backings) {
        for s in &b.sets {
            tracing::info!(set = %s.set, dax = %s.backing.name, len = s.backing.len, "DAX device backs the set");
            st.set_backings.insert(s.set.clone(), s.backing.clone());
            st.set_members.insert(s.set.clone(), s.members.clone());
        }
        for bar in &b.bars {
            let found = bar.resource.as_ref().and_then(|(dev, ord)| {
                st.resources
                    .iter()
                    .position(|r| r.device == *dev && r.kind == MemoryKind::HostExported && r.ordinal == *ord)
            });
            match found {
                Some(i) => {
                    let r = &mut st.resources[i];
                    tracing::info!(device = %r.device, bar = %bar.backing.name, len = bar.backing.len, "BAR backs the resource");
                    r.offer = Offer::Device(bar.backing.clone());
                    if let Some(a) = st.ledger.space.of_mut(i) {
                        *a = RangeAllocator::new(bar.backing.len);
                    }
                }
                None => {
                    tracing::warn!(bar = %bar.backing.name, "exported BAR has no resource in the fabric; not served")
                }
            }
        }
        for n in &b.nodes {
            let found = st
                .resources
                .iter_mut()
                .find(|r| r.kind == MemoryKind::HostExported && r.ordinal == 0 && Some(&r.device) == n.device.as_ref());
            match found {
                Some(r) => {
                    // Its regions are files under the node's tmpfs directory, named as here,
                    // private and held open like every resource directory.
                    let name = r.dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    let private = crate::sys::privdir::PrivateDir::open(&n.dir).and_then(|d| d.subdir(&name));
                    match private {
                        Ok(d) => {
                            r.dir = d.path().to_owned();
                            r.dir_fd = Arc::new(d.into_fd());
                        }
                        Err(e) => {
                            tracing::warn!(node = n.node, error = %crate::error_chain(&e), "cannot make the NUMA region directory; the node is not served");
                            continue;
                        }
                    }
                    tracing::info!(device = %r.device, node = n.node, memory_only = n.memory_only, cxl_regions = n.cxl.len(), dir = %r.dir.display(), "NUMA node backs the resource");
                    r.offer = Offer::Node(n.clone());
                }
                None => tracing::warn!(node = n.node, "exported NUMA node has no resource in the fabric; not served"),
            }
        }
        for share in &b.shares {
            let found = st
                .resources
                .iter()
                .position(|r| r.device == share.device && r.kind == share.kind && r.ordinal == share.ordinal);
            match found {
                Some(i) => {
                    let r = &mut st.resources[i];
                    tracing::info!(device = %r.device, kind = ?r.kind, ordinal = r.ordinal, offset = share.offset, len = share.len, "new regions on the resource go in this node's share");
                    r.coherence = share.coherence;
                    if let Some(a) = st.ledger.space.of_mut(i) {
                        a.confine(share.offset, share.len);
                    }
                }
                None => {
                    tracing::warn!(device = %share.device, "a share of memory this node has no resource of; ignored")
                }
            }
        }
    }

    /// This node's shares of memory other hosts reach too were collected while it was away
    /// and another host holds one now (`why`; `None`: they are this node's again, claimed
    /// back where they were): every resource the node holds a share of refuses new regions
    /// meanwhile, since its window may be another host's memory. Answers the resources.
    pub fn withdraw_shares(&self, why: Option<&str>) -> usize {
        let mut st = self.state();
        let shared: Vec<usize> =
            (0..st.resources.len()).filter(|&i| st.ledger.space.of(i).is_some_and(|a| a.windows().is_some())).collect();
        for &i in &shared {
            st.resources[i].withdrawn = why.map(str::to_owned);
        }
        shared.len()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // Every operation takes what it queued before it lets the lock go (`effects.rs`).
        #[cfg(test)]
        assert!(st.nothing_queued(), "an operation let the registry lock go with its aftermath queued");
        st
    }

    fn check(&self, st: &State, uid: u32, bytes: u64, objects: u64) -> Result<(), MemoryError> {
        let u = st.ledger.usage_of(uid);
        let max_b = self.allocated_max(st.fabric_bytes);
        if u.bytes.saturating_add(bytes) > max_b {
            return Err(MemoryError::Limit {
                who: limits::Holder::Uid(uid),
                what: "allocated_bytes",
                used: u.bytes,
                requested: bytes,
                max: max_b,
            });
        }
        let max_o = u64::from(self.limits.objects_per_uid);
        if u.objects.saturating_add(objects) > max_o {
            return Err(MemoryError::Limit {
                who: limits::Holder::Uid(uid),
                what: "objects",
                used: u.objects,
                requested: objects,
                max: max_o,
            });
        }
        Ok(())
    }

    /// The limits one more import by `uid` in `session` must fit: a local client's, its
    /// uid's objects; an importer node's (the node link's owner side), its node's
    /// `limits.imports_per_node` and the descriptor shares (such an import may keep one
    /// here: the region file truncated when the region goes), and its uid's objects only
    /// where the domain shares identities — not one placeholder uid's shared by every node,
    /// which one busy node would fill for all the others.
    fn check_import(&self, st: &State, uid: u32, session: u64) -> Result<(), MemoryError> {
        let Some(r) = st.remote.get(&session) else { return self.check(st, uid, 0, 1) };
        let max = u64::from(self.limits.imports_per_node);
        if r.imports.saturating_add(1) > max {
            return Err(MemoryError::Limit {
                who: limits::Holder::Node(r.node.clone()),
                what: "imports_per_node",
                used: r.imports,
                requested: 1,
                max,
            });
        }
        self.check_held(st, uid, session)?;
        if r.per_uid {
            self.check(st, uid, 0, 1)?;
        }
        Ok(())
    }

    /// Frees a region the session owns: its exports end and its imports are dropped.
    pub fn free(&self, session: u64, region: u64) -> Result<Reclaimed, MemoryError> {
        let mut st = self.state();
        st.ledger.owned(region, session)?;
        let ticket = st.journal(&Change::RegionFreed { id: region })?;
        drop(st);
        let (mut st, done) = self.commit(ticket);
        done?;
        let out = Self::drop_region(&mut st, region, RevocationReason::Freed);
        self.finish(st);
        Ok(out)
    }

    fn drop_region(st: &mut State, id: u64, reason: RevocationReason) -> Reclaimed {
        let mut out = Reclaimed::default();
        // Read before the region goes: who imported it from other nodes.
        let holders = st.holders(id);
        let Some(removed) = st.ledger.remove_region(id, reason) else { return out };
        let r = removed.region;
        if let Some(file) = st.copy_files.remove(&id) {
            st.effects.push(effects::Effect::Release(Box::new(file)));
        }
        let mut members = vec![r.resource];
        members.extend(st.set_regions.remove(&id).map(|s| s.others).unwrap_or_default());
        let free_now = match &r.backing {
            // A carved DAX device holds the range until it is deleted (an effect, outside
            // the lock).
            Backing::CarvedDax { name, from, .. } => {
                let (carve, device) = (from.clone(), name.clone());
                st.effects.push(effects::Effect::Uncarve {
                    region: id,
                    len: r.len,
                    holders: holders.clone(),
                    carve,
                    device,
                    resources: members,
                    offset: r.offset,
                });
                None
            }
            // The region's own file goes (outside the lock).
            Backing::SimFile(path) | Backing::NodeFile { path, .. } => {
                st.effects.push(effects::Effect::RemoveFile(path.clone()));
                Some(members)
            }
            // Device memory keeps its contents: its range is free again once the copies
            // through it are stopped (an effect, after the end hook).
            Backing::DeviceRange { .. } => {
                st.effects.push(effects::Effect::ReleaseRange {
                    region: id,
                    len: r.len,
                    holders: holders.clone(),
                    resources: members,
                    offset: r.offset,
                });
                None
            }
            // An object is closed with the region.
            Backing::Object(_) => Some(members),
        };
        if let Some(members) = free_now {
            st.release_range(id, holders, members, r.offset, r.len);
        }
        for (_, i) in &removed.imports {
            Self::forget_import(st, i);
        }
        out.regions = 1;
        out.exports = removed.exports;
        out.imports = removed.imports.len() as u64;
        out.registrations = removed.registrations;
        tracing::info!(region = id, uid = r.owner.uid, exports = out.exports, imports = out.imports, "region freed");
        if let Backing::Object(_) = r.backing {
            // Its descriptor is closed outside the lock.
            st.effects.push(effects::Effect::Release(Box::new(r.backing)));
        }
        out
    }

    /// Drops what a session's connection held, which no client can take back: its
    /// registrations and its imports.
    fn drop_connection(st: &mut State, session: u64) -> Reclaimed {
        let mut out = Reclaimed {
            registrations: st.ledger.detach_registrations(|g| g.session == session),
            ..Reclaimed::default()
        };
        for id in st.ledger.imports_of(session) {
            Self::drop_import(st, id);
            out.imports += 1;
        }
        out
    }

    fn drop_import(st: &mut State, id: u64) {
        if let Some(i) = st.ledger.remove_import(id) {
            Self::forget_import(st, &i);
        }
    }

    /// What the shell holds for an import the ledger took out: its count in its importer
    /// node's session.
    fn forget_import(st: &mut State, i: &Import) {
        if let Some(r) = st.remote.get_mut(&i.session) {
            r.imports = r.imports.saturating_sub(1);
        }
    }

    /// Exports a region the session owns under `policy`: a handle with a fresh secret.
    pub fn export(
        &self,
        owner: &Identity,
        session: u64,
        region: u64,
        policy: ExportPolicy,
    ) -> Result<ExportHandle, MemoryError> {
        // Read before the lock: the secret is the handle's, whatever happens next.
        let secret = random_secret().map_err(io_err(Path::new("/dev/urandom")))?;
        let mut st = self.state();
        let export = st.ledger.plan_export(owner, session, region, policy, secret)?;
        self.check(&st, owner.uid, 0, 1)?;
        let ticket = st.journal(&Change::ExportCreated(export.record()))?;
        // Reserved while the record is written: concurrent exports count it.
        st.ledger.charge(owner.uid, Usage::OBJECT);
        drop(st);
        let (mut st, done) = self.commit(ticket);
        if let Err(e) = done {
            st.ledger.discharge(owner.uid, Usage::OBJECT);
            return Err(e);
        }
        let handle = export.handle;
        st.ledger.publish_export(export)?;
        self.finish(st);
        tracing::info!(uid = owner.uid, pid = owner.pid, region, generation = handle.generation, "region exported");
        Ok(handle)
    }

    /// Revokes an export of a region the session owns; later imports are refused.
    pub fn revoke(&self, session: u64, handle: &ExportHandle) -> Result<(), MemoryError> {
        let mut st = self.state();
        let via = st.ledger.revocable(session, handle)?;
        let ticket = st.journal(&Change::ExportRevoked {
            region: via.region,
            generation: via.generation,
            secret: *via.secret.expose(),
        })?;
        drop(st);
        let (mut st, done) = self.commit(ticket);
        done?;
        // The imports stay (their holders release them); DMA through them ends now.
        st.ledger.revoke(&via);
        self.finish(st);
        tracing::info!(region = handle.region, generation = handle.generation, "export revoked");
        Ok(())
    }

    /// Imports by handle: checks the secret, the generation, revocation and the policy,
    /// and opens the region's file read-only or read-write as granted.
    ///
    /// The file is opened without the registry lock, between two checks under it: the
    /// first finds the region's file, the second grants the import only if the export is
    /// still live and admits `who`, and the region is still the one the handle names
    /// (a region freed meanwhile is refused as if it had been freed first; region ids are
    /// never reused).
    pub fn import(
        &self,
        who: &Identity,
        session: u64,
        handle: &ExportHandle,
        access: AccessMode,
    ) -> Result<Granted, MemoryError> {
        let pending = self.plan_import(who, session, handle, access)?;
        // By name in its directory held open, not through a symlink: one planted in a
        // misconfigured directory would hand the importer whatever it points at.
        let file = &pending.file;
        let f = file.open(access == AccessMode::ReadWrite).map_err(io_err(file.path()))?;
        self.grant_import(who, session, handle, access, pending, OwnedFd::from(f))
    }

    /// The first step of [`Memory::import`], under the lock: the import is admitted and the
    /// region's file found.
    fn plan_import(
        &self,
        who: &Identity,
        session: u64,
        handle: &ExportHandle,
        access: AccessMode,
    ) -> Result<PendingImport, MemoryError> {
        let mut st = self.state();
        st.ledger.admit(who, handle, access)?;
        let r = st.ledger.regions.get(&handle.region).ok_or(MemoryError::InvalidHandle)?;
        if r.object().is_some() {
            return Err(MemoryError::BadRequest(format!(
                "region {} is a vendor object: import it with ImportObject (protocol 1.3)",
                handle.region
            )));
        }
        let file = st.region_file(handle.region, r)?;
        let pending = PendingImport { file, generation: r.generation, len: r.len, offset: r.backing.offset() };
        self.check_import(&st, who.uid, session)?;
        Ok(pending)
    }

    /// The last step of [`Memory::import`], under the lock again with the file `fd` opened:
    /// the checks of [`Memory::plan_import`] once more (the export may have been revoked,
    /// the region freed, the limits reached meanwhile), then the import recorded.
    fn grant_import(
        &self,
        who: &Identity,
        session: u64,
        handle: &ExportHandle,
        access: AccessMode,
        pending: PendingImport,
        fd: OwnedFd,
    ) -> Result<Granted, MemoryError> {
        let mut st = self.state();
        let via = st.ledger.admit(who, handle, access)?;
        let same = st.ledger.regions.get(&handle.region).is_some_and(|r| r.generation == pending.generation);
        if !same {
            return Err(MemoryError::InvalidHandle);
        }
        self.check_import(&st, who.uid, session)?;
        let (id, generation) = Self::record_import(&mut st, who, session, handle, via, access)?;
        let PendingImport { len, offset, .. } = pending;
        let coherence = st.coherence(handle.region);
        Ok(Granted { region: handle.region, generation, len, fd, offset, import: id, coherence })
    }

    /// Records an admitted import of `handle`'s region: its id and the region's generation.
    fn record_import(
        st: &mut State,
        who: &Identity,
        session: u64,
        handle: &ExportHandle,
        via: ExportHandle,
        access: AccessMode,
    ) -> Result<(u64, u64), MemoryError> {
        // An importer node's import counts against its node, and its uid only where the
        // domain shares identities.
        let per_uid = st.remote.get(&session).is_none_or(|r| r.per_uid);
        let (id, generation) = st.ledger.record_import(who, session, (handle, via), access, per_uid)?;
        if let Some(r) = st.remote.get_mut(&session) {
            r.imports += 1;
        }
        tracing::info!(uid = who.uid, pid = who.pid, session, region = handle.region, import = id, ?access, "imported");
        Ok((id, generation))
    }

    /// Releases an import the session holds.
    pub fn release(&self, session: u64, import: u64) -> Result<(), MemoryError> {
        let mut st = self.state();
        st.ledger.releasable(session, import)?;
        Self::drop_import(&mut st, import);
        self.finish(st);
        Ok(())
    }

    /// Everything a session held: its regions freed (their exports revoked, their imports
    /// dropped) and its imports released.
    pub fn close_session(&self, session: u64) -> Reclaimed {
        let mut st = self.state();
        let regions = st.ledger.regions_of(session);
        let ended = st.sessions.remove(&session);
        let mut ticket = None;
        if let (Some(s), false) = (ended, regions.is_empty()) {
            // The client is gone either way; if this fails, the journal is brought back
            // in line (a snapshot of what is freed here) before the next change.
            match st.journal(&Change::SessionEnded { token: *s.token.expose() }) {
                Ok(t) => ticket = t,
                Err(e) => {
                    tracing::error!(error = %crate::error_chain(&e), session, "cannot journal the end of a session")
                }
            }
        }
        // The regions go once their end is durable (a crash before brings them back, with
        // their files), their files after that (effects). What the session's connection
        // held goes after the wait too, so that its effects (unmaps, unpins) are this
        // operation's own and run before it returns (another operation's `finish` would
        // run effects queued before the wait).
        drop(st);
        let (mut st, done) = self.commit(ticket);
        if let Err(e) = done {
            tracing::error!(error = %crate::error_chain(&e), session, "cannot journal the end of a session");
        }
        let mut out = Self::drop_connection(&mut st, session);
        for id in regions {
            let r = Self::drop_region(&mut st, id, RevocationReason::OwnerExited);
            out.regions += r.regions;
            out.exports += r.exports;
        }
        self.finish(st);
        out
    }

    /// Sets who hears, at the end of each operation that ended something (a region, an
    /// import, a registration, an export, a device's memory), the revocations it caused:
    /// the daemon tells the importers and stops the copies that depended on it. Set once.
    pub fn on_end(&self, hook: EndHook) {
        if self.ended_hook.set(Hook(hook)).is_err() {
            tracing::warn!("the registry's end hook was already set; kept the first");
        }
    }

    /// The file of region `region` when the region is a file of its own (a sim device's
    /// or host memory's): what the node link's shared sim fabric names to importers.
    pub fn own_file(&self, region: u64) -> Option<PathBuf> {
        let st = self.state();
        match &st.ledger.regions.get(&region)?.backing {
            Backing::SimFile(path) => Some(path.clone()),
            _ => None,
        }
    }

    /// Whether `fd` was opened in one of this registry's resource directories, where its
    /// own region files lie (the memory root's, and a NUMA directory's), by the
    /// directories' identity.
    pub fn opened_in_own_dir(&self, fd: std::os::fd::BorrowedFd<'_>) -> bool {
        let Some(parent) = fdkind::opened_at(fd).and_then(|p| p.parent().map(Path::to_owned)) else { return false };
        let Ok(parent) = nix::sys::stat::stat(&parent) else { return false };
        let dirs: Vec<Arc<OwnedFd>> = self.state().resources.iter().map(|r| r.dir_fd.clone()).collect();
        dirs.iter().any(|d| {
            nix::sys::stat::fstat(d.as_fd()).is_ok_and(|s| (s.st_dev, s.st_ino) == (parent.st_dev, parent.st_ino))
        })
    }

    /// Whether region `region` of generation `generation` is still allocated (region ids
    /// are never reused; the generation guards a tampered or restored record all the same).
    pub fn region_live(&self, region: u64, generation: u64) -> bool {
        self.state().ledger.regions.get(&region).is_some_and(|r| r.generation == generation)
    }

    /// Whether region `region`'s bytes are device memory (a range of a DAX device or a
    /// BAR, or a carved DAX device) rather than a file of its own.
    pub fn on_device(&self, region: u64) -> bool {
        self.state().ledger.regions.get(&region).is_some_and(|r| r.backing.is_device())
    }

    /// The DAX device that backs interleave set `set` here, if one does.
    pub fn set_device(&self, set: &str) -> Option<backing::DeviceBacking> {
        self.state().set_backings.get(set).cloned()
    }

    /// What a handle's export is about (for the partition checks before an import): its
    /// policy, its region's device and whether it was revoked. The handle is verified as
    /// for an import.
    pub fn export_subject(&self, handle: &ExportHandle) -> Result<ExportSubject, MemoryError> {
        let mut st = self.state();
        let (policy, revoked) = {
            let e = st.ledger.find_export(handle).ok_or(MemoryError::InvalidHandle)?;
            (e.policy.clone(), e.revoked)
        };
        let r = st.ledger.regions.get(&handle.region).ok_or(MemoryError::InvalidHandle)?;
        let object = r.object().map(adopt::Object::kind);
        let devices = st.devices_of(handle.region);
        Ok(ExportSubject { policy, devices, revoked, object })
    }

    /// Regions, exports (without their secrets) and imports by id; those of `uid` only
    /// when given. Each list stops at the wire's bound, and `truncated` says so.
    pub fn list(&self, uid: Option<u32>) -> RegionsResponse {
        let st = self.state();
        let mine = |u: u32| uid.is_none_or(|x| x == u);
        let mut regions: Vec<_> = st
            .ledger
            .regions
            .iter()
            .filter(|(_, r)| mine(r.owner.uid))
            .map(|(id, r)| {
                let res = &st.resources[r.resource];
                RegionInfo {
                    region: *id,
                    generation: r.generation,
                    owner_uid: r.owner.uid,
                    owner_pid: r.owner.pid,
                    resource: ResourceName {
                        device: DeviceName::truncated(&res.device.to_string()),
                        memory: res.kind.into(),
                        ordinal: res.ordinal,
                    },
                    offset: r.offset,
                    size: r.len,
                }
            })
            .collect();
        regions.sort_by_key(|r| r.region);
        let mut exports: Vec<_> = st
            .ledger
            .exports
            .iter()
            .filter(|e| mine(e.owner_uid))
            .map(|e| ExportInfo {
                region: e.handle.region,
                generation: e.handle.generation,
                owner_uid: e.owner_uid,
                policy: e.policy.clone(),
                revoked: e.revoked,
            })
            .collect();
        exports.sort_by_key(|e| (e.region, e.generation));
        let mut imports: Vec<_> = st
            .ledger
            .imports
            .iter()
            .filter(|(_, i)| mine(i.uid))
            .map(|(id, i)| ImportInfo { import: *id, region: i.region, generation: i.generation, uid: i.uid })
            .collect();
        imports.sort_by_key(|i| i.import);
        const MAX: usize = 4096;
        let truncated = regions.len() > MAX || exports.len() > MAX || imports.len() > MAX;
        regions.truncate(MAX);
        exports.truncate(MAX);
        imports.truncate(MAX);
        RegionsResponse {
            regions: BoundedVec::new(regions).unwrap_or_default(),
            exports: BoundedVec::new(exports).unwrap_or_default(),
            imports: BoundedVec::new(imports).unwrap_or_default(),
            truncated,
        }
    }

    /// Counters for `status`.
    pub fn counts(&self) -> Counts {
        let st = self.state();
        Counts {
            regions: st.ledger.regions.len() as u64,
            exports: st.ledger.exports.iter().filter(|e| !e.revoked).count() as u64,
            imports: st.ledger.imports.len() as u64,
            allocated_bytes: st.ledger.regions.values().map(|r| r.len).sum(),
            lost_regions: st.ledger.regions.values().filter(|r| r.lost).count() as u64,
            imported_bytes: st
                .ledger
                .imports
                .values()
                .filter_map(|i| st.ledger.regions.get(&i.region))
                .map(|r| r.len)
                .sum(),
            registrations: st.ledger.dma.count(),
            quarantined_bytes: st.quarantined(),
            pinned_bytes: st.ledger.dma.pinned_bytes(),
        }
    }

    /// The device `id` vanished or failed: its resources take no new regions, and every
    /// region on them is lost — each of its exports revoked (a later import is `Revoked`),
    /// each importer told (reason `DeviceLost`) and its owner told too (a revocation with
    /// import 0). Regions and imports stay until freed or released (a mapping cannot be
    /// taken back). Each loss is journaled (`RegionLost`, waited for without the lock),
    /// so a restart keeps the regions lost even with the device back. Returns the regions
    /// lost now, the exports revoked now and the imports told, and the loss's
    /// [`Aftermath`]: the importers and owners are told, and DMA into the regions is undone,
    /// when the caller delivers it ([`Memory::deliver`]) — a rescan, once it has published
    /// why (the device events).
    pub fn device_lost(&self, id: &DeviceId) -> (Reclaimed, Aftermath) {
        let mut guard = self.state();
        let st = &mut *guard;
        let mut on: Vec<usize> = Vec::new();
        for (i, r) in st.resources.iter_mut().enumerate() {
            if r.device == *id {
                r.lost = true;
                on.push(i);
            }
        }
        // A region striped over a set is lost with any of its members.
        let sets = &st.set_regions;
        let on_it = |id: &u64, r: &Region| {
            on.contains(&r.resource) || sets.get(id).is_some_and(|s| s.others.iter().any(|i| on.contains(i)))
        };
        let lost: Vec<u64> =
            st.ledger.regions.iter().filter(|(k, r)| !r.lost && on_it(k, r)).map(|(k, _)| *k).collect();
        // Refused at once (the device is gone whether or not the loss is saved); told when
        // the caller delivers the aftermath, once it published why (the device events).
        let (out, lost) = st.ledger.lose(lost);
        let after = st.aftermath();
        // Saved, so that a restart with the device back keeps the regions lost and their
        // exports revoked; the records share one fsync.
        let mut tickets = Vec::with_capacity(lost.len());
        for (region, generation) in &lost {
            tracing::warn!(%id, region, generation, "region lost with its device; exports revoked");
            match st.journal(&Change::RegionLost { id: *region }) {
                Ok(t) => tickets.extend(t.map(|t| (*region, t))),
                Err(e) => Self::loss_unsaved(*region, &e),
            }
        }
        drop(guard);
        for (region, t) in tickets {
            let waited = t.wait();
            self.state().settle(&waited);
            if let Err(e) = waited {
                Self::loss_unsaved(region, &MemoryError::Journal(e));
            }
        }
        (out, after)
    }

    pub(super) fn loss_unsaved(region: u64, e: &MemoryError) {
        tracing::warn!(region, error = %crate::error_chain(e), "the loss of a region is not journaled; a restart with its device back would restore it");
    }

    /// Brings the resources' sizes in line with `inv` (a rescan found a device's memory
    /// resized: a CXL partition changed): new regions fit the new size. Regions already
    /// past a smaller size keep their ranges until freed; each is logged (`warn`) and
    /// listed in the status's problems, since its bytes past the end may no longer be the
    /// device's. A resource backed by a device file (a BAR) keeps that file's size.
    /// Returns how many resources changed size. No I/O.
    pub fn resize_resources(&self, inv: &Inventory) -> usize {
        let mut st = self.state();
        let mut resized = 0;
        for dev in inv.devices.iter().filter(|d| !d.memory.is_empty()) {
            for (kind, ordinal, size) in device_resources(dev) {
                let Some(i) =
                    st.resources.iter().position(|r| r.device == dev.id && r.kind == kind && r.ordinal == ordinal)
                else {
                    continue;
                };
                if st.resources[i].offer.device().is_some() {
                    continue;
                }
                let Some(a) = st.ledger.space.of_mut(i) else { continue };
                let before = a.capacity();
                if before == size {
                    continue;
                }
                a.resize(size);
                let past: Vec<(u64, u64)> = a.past_end().collect();
                resized += 1;
                let name = resource_name(&dev.id, kind, ordinal);
                tracing::info!(resource = %name, before, after = size, "device memory resized; new regions fit the new size");
                for (offset, len) in past {
                    let region = st
                        .ledger
                        .regions
                        .iter()
                        .find(|(_, r)| r.resource == i && r.offset == offset)
                        .map(|(id, _)| *id);
                    let what = region.map_or_else(|| "a range taken".to_owned(), |id| format!("region {id}"));
                    tracing::warn!(resource = %name, offset, len, size, region, "memory in use lies past the device's new size; it stays in use until freed");
                    if st.problems.len() < 256 {
                        st.problems.push(format!(
                            "{what} ({len} bytes at offset {offset}) lies past the new size ({size} bytes) of {name}"
                        ));
                    }
                }
            }
        }
        if resized > 0 {
            st.recount_fabric();
        }
        resized
    }

    /// The device `id` is back (or healthy again): its resources take new regions again.
    /// Regions lost with it stay lost. Returns whether it has resources here.
    pub fn device_back(&self, id: &DeviceId) -> bool {
        let mut st = self.state();
        let mut any = false;
        for r in st.resources.iter_mut().filter(|r| r.device == *id) {
            r.lost = false;
            any = true;
        }
        any
    }

    /// Adds the resources of devices of `inv` that have none here yet (devices found by a
    /// rescan). Returns how many resources were added.
    ///
    /// Their directories are made without the lock; a device a concurrent rescan added
    /// meanwhile is added once (making a directory that exists is harmless).
    pub fn add_devices(&self, inv: &Inventory) -> Result<usize, MemoryError> {
        let new: Vec<&fabric_topology::Device> = {
            let st = self.state();
            let known = |d: &fabric_topology::Device| st.resources.iter().any(|r| r.device == d.id);
            inv.devices.iter().filter(|d| !d.memory.is_empty() && !known(d)).collect()
        };
        if new.is_empty() {
            return Ok(0);
        }
        let made = new.into_iter().map(|d| resources_of(&self.root, d)).collect::<Result<Vec<_>, _>>()?;
        let mut st = self.state();
        let mut added = 0;
        for resources in made {
            let Some(device) = resources.first().map(|(r, _)| r.device.clone()) else { continue };
            if st.resources.iter().any(|r| r.device == device) {
                continue;
            }
            added += resources.len();
            for (r, size) in resources {
                st.add_resource(r, size);
            }
        }
        st.recount_fabric();
        Ok(added)
    }
}
