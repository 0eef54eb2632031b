//! A new region in three steps, so that no slow work happens under the registry lock:
//! under the lock, the request is checked and a [`Reservation`] taken (its id, its range in
//! every resource it spans, its bytes and object in the owner's usage), which keeps
//! concurrent allocations from colliding; without the lock, its backing is made (a sim
//! file created and fsynced with its directory, a device range zeroed, a DAX device
//! carved, a NUMA file placed); then it is committed: its record queued in state order
//! and made durable by group commit, and only then published. A failure at any step
//! gives the reservation back and undoes the backing.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::memory::Identity;
use fabric_proto::wire::SessionToken;

use super::alloc::{AllocError, GRANULE, round_len};
use super::backings::{Backing, Offer};
use super::durable::Change;
use super::set::SetRegion;
use super::{Granted, Memory, MemoryError, Place, Region, State, Usage, backing, io_err, kind_name, numa, zero};

/// What an allocation holds while its backing is made: nothing else can take its id, its
/// range or its share of the owner's limits.
#[derive(Debug)]
pub(super) struct Reservation {
    pub(super) id: u64,
    pub(super) owner: Identity,
    pub(super) session: u64,
    pub(super) pid_start: Option<u64>,
    pub(super) token: SessionToken,
    /// The resource the region records, then the other members of its set (same offset).
    pub(super) resources: Vec<usize>,
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// The backing to make for a reservation, outside the lock.
#[derive(Debug)]
pub(super) enum Make {
    /// A file on a NUMA node's tmpfs.
    Node(numa::NodeBacking, PathBuf),
    /// A range at `offset` of a device file (zeroed; carved first on a carved set), or
    /// else a sim file at `path` (fsynced with its directory when `durable`).
    File { device: Option<backing::DeviceBacking>, offset: u64, path: PathBuf, durable: bool },
}

/// A backing made: the descriptor, opened read-write, and what it is.
pub(super) type Made = (OwnedFd, Backing);

impl Make {
    fn run(&self, len: u64) -> Result<Made, MemoryError> {
        match self {
            Make::Node(n, path) => Memory::make_node_region(n, path, len),
            Make::File { device, offset, path, durable } => {
                Memory::make_backing(device.as_ref(), *offset, path, len, *durable)
            }
        }
    }
}

impl State {
    /// Why a region over `resources` cannot be trusted: one of them is lost (its device
    /// vanished or failed) or withdrawn (its share is another host's now).
    pub(super) fn lost_among(&self, resources: &[usize]) -> Option<String> {
        resources.iter().filter_map(|&i| self.resources.get(i)).find_map(super::Resource::refusal)
    }

    /// Why a region on `resources` is lost, if one of their devices went. A share taken
    /// since is no reason: its regions placed before stay (a region committed as its share
    /// was withdrawn is one of them).
    pub(super) fn device_lost_among(&self, resources: &[usize]) -> Option<String> {
        resources.iter().filter_map(|&i| self.resources.get(i)).find_map(super::Resource::lost_why)
    }

    /// Gives back a reservation whose region was not made: its usage, and its range unless
    /// `held` (what was made of its backing could not be taken away — a carved DAX device
    /// the kernel would not delete — and holds the range until the next start).
    pub(super) fn abandon(&mut self, res: &Reservation, held: bool) {
        if !held {
            self.ledger.space.give_back(&res.resources, res.offset);
        }
        self.ledger.discharge(res.owner.uid, Usage::region(res.len, 0));
    }

    /// Takes the id and counts the region in its owner's usage (its ranges are taken by
    /// the caller): the rest of a [`Reservation`].
    pub(super) fn reserve(
        &mut self,
        owner: &Identity,
        session: u64,
        resources: Vec<usize>,
        offset: u64,
        len: u64,
    ) -> Result<Reservation, MemoryError> {
        let sess = match self.session(session) {
            Ok(s) => s,
            Err(e) => {
                self.ledger.space.give_back(&resources, offset);
                return Err(e);
            }
        };
        let id = self.ledger.take_id();
        self.ledger.charge(owner.uid, Usage::region(len, 0));
        Ok(Reservation {
            id,
            owner: *owner,
            session,
            pid_start: sess.owner.pid_start,
            token: sess.token,
            resources,
            offset,
            len,
        })
    }
}

impl Memory {
    /// Allocates `size` bytes (rounded up to 2 MiB) on the resource `place` names.
    pub fn alloc(
        &self,
        owner: &Identity,
        session: u64,
        place: &Place,
        size: u64,
        align: u64,
    ) -> Result<Granted, MemoryError> {
        self.ensure_session(session, owner)?;
        let (res, make) = self.reserve_on(owner, session, place, size, align)?;
        let device = &place.device;
        let g = self.make_and_commit(res, &make, None)?;
        tracing::info!(uid = owner.uid, pid = owner.pid, session, region = g.region, %device, len = g.len, "region allocated");
        Ok(g)
    }

    /// Makes the backing `make` for `res` (outside the lock), then commits the region
    /// (with its set part, for a set region).
    pub(super) fn make_and_commit(
        &self,
        res: Reservation,
        make: &Make,
        set: Option<SetRegion>,
    ) -> Result<Granted, MemoryError> {
        let made = match make.run(res.len) {
            Ok(m) => m,
            Err(e) => {
                self.state().abandon(&res, e.strands_range());
                return Err(e);
            }
        };
        self.commit_region(res, made, set)
    }

    /// The reservation step of [`Memory::alloc`], under the lock: the checks, the range
    /// (first fit over the resources `place` names), the id and the usage.
    pub(super) fn reserve_on(
        &self,
        owner: &Identity,
        session: u64,
        place: &Place,
        size: u64,
        align: u64,
    ) -> Result<(Reservation, Make), MemoryError> {
        let Place { device, kind, ordinal } = place;
        let (kind, ordinal) = (*kind, *ordinal);
        let len = round_len(size).ok_or_else(|| MemoryError::BadRequest(format!("size {size} is not allocatable")))?;
        let mut st = self.state();
        let candidates = st.candidates(place);
        // Device memory maps in whole multiples of its align (a BAR's is a page).
        let dev_align =
            candidates.iter().filter_map(|&i| st.resources[i].offer.device().map(|b| b.align)).max().unwrap_or(GRANULE);
        let len = len
            .checked_next_multiple_of(dev_align)
            .ok_or_else(|| MemoryError::BadRequest(format!("size {size} is not allocatable")))?;
        self.check(&st, owner.uid, len, 1)?;
        if candidates.is_empty() {
            let which = ordinal.map(|o| format!(" #{o}")).unwrap_or_default();
            return Err(MemoryError::NotFound(format!("device {device} has no {} memory{which}", kind_name(kind))));
        }
        if let Some(why) = candidates.iter().map(|&i| st.resources[i].refusal()).collect::<Option<Vec<_>>>() {
            return Err(MemoryError::DeviceLost(why.into_iter().next().unwrap_or_default()));
        }
        if let Some(why) = candidates.iter().map(|&i| st.resources[i].unserved()).collect::<Option<Vec<_>>>() {
            return Err(MemoryError::NotImplemented(why.into_iter().next().unwrap_or_default()));
        }
        let candidates: Vec<usize> = candidates
            .into_iter()
            .filter(|&i| st.resources[i].refusal().is_none() && st.resources[i].unserved().is_none())
            .collect();
        // Device memory maps only at its own alignment (a DAX device's `align`).
        let aligned: Vec<(usize, u64)> = candidates
            .into_iter()
            .map(|i| match st.resources[i].offer.device() {
                Some(b) if align == 0 || align.is_power_of_two() => (i, align.max(b.align)),
                _ => (i, align),
            })
            .collect();
        let (resource, offset) = st.ledger.space.place(aligned, len).map_err(|last| match last {
            Some(AllocError::BadAlign(a)) => MemoryError::BadRequest(format!("alignment {a} is not a power of two")),
            Some(e) => MemoryError::NoSpace(e),
            None => MemoryError::NotFound(format!("device {device}")),
        })?;
        let res = st.reserve(owner, session, vec![resource], offset, len)?;
        let r = &st.resources[resource];
        let path = r.dir.join(format!("r{}", res.id));
        let durable = st.log.is_some();
        let make = match &r.offer {
            Offer::Node(n) => Make::Node(n.clone(), path),
            Offer::Device(b) => Make::File { device: Some(b.clone()), offset, path, durable },
            // A driver's memory was refused above (`Resource::unserved`).
            Offer::Files | Offer::Driver => Make::File { device: None, offset, path, durable },
        };
        Ok((res, make))
    }

    /// The commit step: the region's record queued in state order, waited for outside the
    /// lock (group commit), then the region published. Acknowledged only once journaled; a
    /// crash before leaves a file no record names, which the next start removes.
    fn commit_region(&self, res: Reservation, made: Made, set: Option<SetRegion>) -> Result<Granted, MemoryError> {
        let (fd, backing) = made;
        let fd_offset = backing.offset();
        let region = Region {
            generation: res.id,
            owner: res.owner,
            pid_start: res.pid_start,
            token: res.token,
            session: res.session,
            resource: res.resources.first().copied().unwrap_or_default(),
            offset: res.offset,
            len: res.len,
            backing,
            lost: false,
        };
        let mut st = self.state();
        // Its device went while the backing was made (a device range is zeroed for
        // seconds): nothing of it is trusted, and no record names it yet.
        if let Some(why) = st.lost_among(&res.resources) {
            drop(st);
            drop(fd);
            self.undo_reservation(&res, &region.backing);
            return Err(MemoryError::DeviceLost(why));
        }
        let record = match &set {
            Some(part) => Change::SetRegionAllocated(st.set_region_record(res.id, &region, part)),
            None => Change::RegionAllocated(st.region_record(res.id, &region)),
        };
        let queued = st.journal(&record);
        drop(st);
        let done = match queued {
            Ok(ticket) => self.commit(ticket),
            Err(e) => (self.state(), Err(e)),
        };
        let (mut st, done) = done;
        if let Err(e) = done {
            drop(st);
            drop(fd);
            self.undo_reservation(&res, &region.backing);
            return Err(e);
        }
        let (id, len) = (res.id, res.len);
        // Its device went while the record was written: published lost, as a loss
        // marks the regions it finds (`Memory::device_lost`), and its loss saved too.
        let mut region = region;
        let lost = st.device_lost_among(&res.resources).map(|why| {
            tracing::warn!(region = id, why, "a new region's device went while it was committed; the region is lost");
            region.lost = true;
            st.journal(&Change::RegionLost { id })
        });
        st.ledger.publish_region(id, region);
        if let Some(part) = set {
            st.set_regions.insert(id, part);
        }
        let coherence = st.coherence(id);
        self.finish(st);
        match lost {
            Some(Ok(Some(ticket))) => {
                let waited = ticket.wait();
                self.state().settle(&waited);
                if let Err(e) = waited {
                    Self::loss_unsaved(id, &MemoryError::Journal(e));
                }
            }
            Some(Err(e)) => Self::loss_unsaved(id, &e),
            Some(Ok(None)) | None => {}
        }
        Ok(Granted { region: id, generation: id, len, fd, offset: fd_offset, import: 0, coherence })
    }

    /// Undoes `backing`, made for `res` and refused (outside the lock), then gives back
    /// what `res` held: its range only once the backing is gone, so that no allocation
    /// takes the range while a carved DAX device still holds it (one that cannot be
    /// deleted keeps its range until a restart clears the device).
    fn undo_reservation(&self, res: &Reservation, backing: &Backing) {
        let gone = backing.undo();
        self.state().abandon(res, !gone);
    }

    /// The memory behind a new region of `len` bytes: a range at `offset` of the device
    /// file of `device` (or a DAX device carved for it), else a new sim file at `path`.
    ///
    /// With `durable` (a journaled registry), a new sim file and its size are fsynced, and
    /// so is its directory, before the caller journals the allocation: the record names the
    /// file, and a power loss that kept the record but not the file (its directory entry
    /// or its size are metadata that another file's `fdatasync` need not flush) would make
    /// the next start drop an acknowledged region.
    pub(super) fn make_backing(
        device: Option<&backing::DeviceBacking>,
        offset: u64,
        path: &Path,
        len: u64,
        durable: bool,
    ) -> Result<Made, MemoryError> {
        if let Some(b) = device {
            if let Some(c) = &b.carve {
                return Self::make_carved(b, c, offset, len);
            }
            let (fd, offset) = Self::open_device(b, offset, len)?;
            return Ok((fd, Backing::DeviceRange { path: b.path.clone(), offset }));
        }
        let made = (|| {
            // 0600 whatever the umask: the file is a capability to the region's bytes.
            let f = crate::sys::privdir::file_options().read(true).write(true).create_new(true).open(path)?;
            crate::sys::privdir::check_file(&f, path)?;
            f.set_len(len)?;
            if durable {
                f.sync_all()?;
                if let Some(dir) = path.parent() {
                    crate::journal::sys::fsync_dir(dir)?;
                }
            }
            Ok::<_, std::io::Error>(OwnedFd::from(f))
        })();
        if made.is_err() {
            let _ = std::fs::remove_file(path);
        }
        made.map(|fd| (fd, Backing::SimFile(path.to_owned()))).map_err(io_err(path))
    }

    /// A new region of `len` bytes on NUMA node `n`: the tmpfs file `path`, which outlives
    /// the daemon (a restart finds it, `persist.rs`).
    fn make_node_region(n: &numa::NodeBacking, path: &Path, len: u64) -> Result<Made, MemoryError> {
        let fd = n.make_region(path, len).map_err(MemoryError::Node)?;
        Ok((fd, Backing::NodeFile { path: path.to_owned(), node: n.node }))
    }

    /// Opens device file `b` read-write for the range `[offset, offset + len)` of what it
    /// backs and zeroes that range (it holds its previous holder's bytes): the descriptor
    /// and the range's offset in the file.
    fn open_device(b: &backing::DeviceBacking, offset: u64, len: u64) -> Result<(OwnedFd, u64), MemoryError> {
        let at = b.file_offset(offset, len).ok_or(MemoryError::NoSpace(AllocError::NoSpace {
            len,
            align: b.align,
            capacity: b.len,
        }))?;
        let f = b.open(true).map_err(io_err(&b.path))?;
        zero::zero_range(&f, at, len).map_err(MemoryError::Zero)?;
        Ok((OwnedFd::from(f), at))
    }
}
