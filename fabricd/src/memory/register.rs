//! Registration on the memory registry: [`Memory::register`] pins a region, an import, a
//! memory object or the caller's own memory for a device's DMA and gives it an IOVA;
//! [`Memory::unregister`] undoes it (the unmap and unpin run as an effect, after the lock,
//! and the IOVA range is freed only then: [`super::effects::Effect::Unregister`]); the copy path resolves
//! `(device, iova)` back to the memory ([`Memory::dma_read`], [`Memory::dma_write`]),
//! reading and writing it without the lock. The registry itself is
//! [`crate::dma`]; it lives in the memory state so that the objects a registration covers
//! cannot go without it.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::memory::Identity;
use fabric_proto::wire::AccessMode;

use super::{Memory, MemoryError, State, Usage, io_err};
use crate::dma::iova::PAGE;
use crate::dma::sys::{self, Pinned};
use crate::dma::{Backing, Covers, DmaError, Reach, Registration, Target, span_of};
use crate::transport::peer::Process;

/// What to register.
#[derive(Debug)]
pub enum Source {
    /// A region the session owns.
    Region(u64),
    /// An import the session holds.
    Import(u64),
    /// A memory object (memfd, tmpfs or hugetlbfs file, region file) sent with the request.
    Fd(OwnedFd),
    /// The caller's own memory at this address, locked by the caller.
    Process {
        /// First byte.
        addr: u64,
        /// The caller's process, as its connection was accepted with it.
        process: Process,
    },
}

/// A registration as the client gets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    /// Registration id.
    pub registration: u64,
    /// IOVA of the first registered byte.
    pub iova: u64,
    /// Bytes registered.
    pub len: u64,
}

fn bad(m: impl Into<String>) -> MemoryError {
    MemoryError::BadRequest(m.into())
}

/// Checks that `[start, start + span)` of the caller's `process` is mapped, locked and as
/// accessible as `access` needs. The mappings are read by pid and kept only when the
/// pidfd shows the process still running afterwards: then they were its own. Refusals
/// name only the range the caller asked for, never a mapping.
fn check_process_range(process: &Process, start: u64, span: u64, access: AccessMode) -> Result<(), MemoryError> {
    let vmas = match process.with(sys::process_maps) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            tracing::debug!(pid = process.pid(), error = %e, "cannot read the caller's mappings");
            return Err(MemoryError::PermissionDenied("cannot read the calling process's mappings".into()));
        }
        Err(gone) => return Err(MemoryError::PermissionDenied(gone.to_string())),
    };
    let Some(end) = start.checked_add(span) else {
        return Err(MemoryError::BadRequest(format!("{span} bytes at {start:#x} run past the address space")));
    };
    let range = format!("{start:#x}..{end:#x}");
    let mut at = start;
    for v in vmas.iter().filter(|v| v.end > start && v.start < end) {
        if v.start > at {
            break;
        }
        if !v.read || (access == AccessMode::ReadWrite && !v.write) {
            return Err(MemoryError::PermissionDenied(format!(
                "{range} is not {} memory of the calling process",
                if access == AccessMode::ReadWrite { "readable and writable" } else { "readable" }
            )));
        }
        if !v.locked {
            return Err(bad(format!(
                "{range} is not locked memory of the calling process: mlock it before registering"
            )));
        }
        at = v.end;
        if at >= end {
            return Ok(());
        }
    }
    Err(bad(format!("{range} is not mapped in the calling process")))
}

/// What a registration pins, found under the lock: a region's file (the daemon's own), or
/// what the request brought.
enum Found {
    /// A region's file and the region's offset in it.
    File { file: super::RegionFile, fd_offset: u64 },
    /// The memory object or the caller's memory, as the request named it.
    Request,
}

/// What a registration in progress holds: its usage (its pinned bytes, one object and one
/// kept descriptor of its uid), so that pins running at once cannot together pass a limit,
/// and its IOVA range, so that no other registration of the domain is mapped there. Taken
/// before the pin and the map; given back on drop unless [`Reservation::commit`]ted.
/// Dropped only while the registry lock is not held (it takes the lock), and after the
/// backing and mapping it reserved for (so the range is freed only once unmapped).
struct Reservation<'m> {
    memory: &'m Memory,
    uid: u32,
    span: u64,
    domain: &'m str,
    iova: u64,
    held: bool,
}

impl Reservation<'_> {
    /// The registration is inserted: its accounting stays with it.
    fn commit(mut self) {
        self.held = false;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.held {
            let mut st = self.memory.state();
            st.ledger.dma.free_iova(self.domain, self.iova);
            st.unpin_usage(self.uid, self.span);
        }
    }
}

impl State {
    /// Gives back the usage of a registration of `span` bytes of `uid`.
    fn unpin_usage(&mut self, uid: u32, span: u64) {
        self.ledger.discharge(uid, Usage::registration(span));
    }
}

fn pin(file: File, first: u64, span: u64, access: AccessMode, abandon: Abandon<'_>) -> Result<Backing, MemoryError> {
    let pinned = Pinned::new(file, first, span, access == AccessMode::ReadWrite, abandon).map_err(MemoryError::Pin)?;
    Ok(Backing::Mapped(std::sync::Arc::new(pinned)))
}

/// Asked between the pieces of a pin: `Some(why)` gives it up (the client hung up, the
/// daemon is stopping).
pub type Abandon<'a> = &'a dyn Fn() -> Option<&'static str>;

impl Memory {
    fn check_pinned(&self, st: &State, uid: u32, span: u64) -> Result<(), MemoryError> {
        let used = st.ledger.usage_of(uid).pinned;
        let max = self.pinned_max;
        if used.saturating_add(span) > max {
            return Err(MemoryError::Limit {
                who: super::limits::Holder::Uid(uid),
                what: "pinned_bytes",
                used,
                requested: span,
                max,
            });
        }
        Ok(())
    }

    /// The region or import a registration covers, checked for `session` (it exists, is
    /// the session's, the import's export is not revoked, the access is granted) and for
    /// `[at, at + len)` lying within it: its file and offset; `Found::Request` for the
    /// other sources.
    fn covered(
        st: &State,
        covers: Covers,
        session: u64,
        at: u64,
        len: u64,
        access: AccessMode,
    ) -> Result<Found, MemoryError> {
        let in_bounds = |size: u64, what: &str| {
            if at.checked_add(len).is_some_and(|e| e <= size) {
                Ok(())
            } else {
                Err(bad(format!("{len} bytes at offset {at} run past the {size} bytes of {what}")))
            }
        };
        let (region, r) = match covers {
            Covers::Region(id) => {
                let r = st.ledger.owned(id, session)?;
                if r.lost {
                    return Err(MemoryError::DeviceLost(format!("region {id} lies on a device that was lost")));
                }
                in_bounds(r.len, &format!("region {id}"))?;
                Self::refuse_object(st, id, "pin it for DMA")?;
                (id, r)
            }
            Covers::Import(id) => {
                let i = st.ledger.imports.get(&id).ok_or_else(|| MemoryError::NotFound(format!("no import {id}")))?;
                if i.session != session {
                    return Err(MemoryError::PermissionDenied(format!("import {id} belongs to another session")));
                }
                if access == AccessMode::ReadWrite && i.access == AccessMode::ReadOnly {
                    return Err(MemoryError::PermissionDenied(format!(
                        "import {id} is read-only; the device may only read it"
                    )));
                }
                if st.ledger.import_revoked(i) {
                    return Err(MemoryError::Revoked);
                }
                let r = st
                    .ledger
                    .regions
                    .get(&i.region)
                    .ok_or_else(|| MemoryError::NotFound(format!("no region {}", i.region)))?;
                in_bounds(r.len, &format!("import {id}"))?;
                Self::refuse_object(st, i.region, "pin it for DMA")?;
                (i.region, r)
            }
            Covers::Fd | Covers::Process => return Ok(Found::Request),
        };
        Ok(Found::File { file: st.region_file(region, r)?, fd_offset: r.backing.offset() })
    }

    /// The memory of a registration, pinned or followed, outside the registry lock: what
    /// a client chose (its file, its process) may take long to fault in or read.
    fn back(
        target: &Target,
        source: Source,
        found: Found,
        (at, len, first, span): (u64, u64, u64, u64),
        access: AccessMode,
        abandon: Abandon<'_>,
    ) -> Result<Backing, MemoryError> {
        match (source, found) {
            (_, Found::File { file, fd_offset }) => {
                let f = file.open(access == AccessMode::ReadWrite).map_err(io_err(file.path()))?;
                pin(f, first + fd_offset, span, access, abandon)
            }
            (Source::Fd(fd), Found::Request) => {
                let f = File::from(fd);
                let meta = f.metadata().map_err(|e| bad(format!("the descriptor cannot be inspected: {e}")))?;
                if !meta.file_type().is_file() {
                    return Err(bad("the descriptor is not a memory object (memfd or regular file)"));
                }
                let size = meta.len();
                if at.checked_add(len).is_none_or(|e| e > size) {
                    return Err(bad(format!(
                        "{len} bytes at offset {at} run past the {size} bytes of the memory object"
                    )));
                }
                pin(f, first, span, access, abandon)
            }
            (Source::Process { process, .. }, Found::Request) => {
                if let Some(v) = &target.vfio {
                    return Err(MemoryError::BadRequest(format!(
                        "{} is a VFIO device: its IOMMU maps memory of the daemon only; register a region, an import or a memory object (memfd) instead of the caller's own memory",
                        v.bdf
                    )));
                }
                check_process_range(&process, first, span, access)?;
                Ok(Backing::Process { process, addr: first, gate: Default::default() })
            }
            (Source::Region(_) | Source::Import(_), Found::Request) => {
                Err(MemoryError::NotFound("the registered object is gone".into()))
            }
        }
    }

    /// Registers `len` bytes at `offset` of `source` (for [`Source::Process`], `offset`
    /// adds to the address) for DMA by `target` with `access`: pins them, takes an IOVA
    /// range below the device's mask (mapped there in a VFIO device's IOMMU), and accounts
    /// the whole pages against the caller's `pinned_bytes` and `objects` limits.
    ///
    /// The registry lock is held only to check and reserve (the limits, the region or
    /// import, the IOVA range) and then to insert; the pin runs outside it, piece by
    /// piece, asking `abandon` between pieces, and so does the map, so that a client's
    /// large or slow memory holds up only its own request. What the registration covers
    /// is checked again at insert (a region freed or an export revoked meanwhile refuses
    /// it). A failure unmaps and unpins what was done, then gives the reservation back.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &self,
        who: &Identity,
        session: u64,
        target: &Target,
        source: Source,
        offset: u64,
        len: u64,
        access: AccessMode,
        abandon: Abandon<'_>,
    ) -> Result<Registered, MemoryError> {
        if len == 0 {
            return Err(bad("a registration needs at least one byte"));
        }
        let at = match &source {
            Source::Process { addr, .. } => {
                addr.checked_add(offset).ok_or_else(|| bad("address + offset overflows"))?
            }
            _ => offset,
        };
        let (first, lead, span) = span_of(at, len).ok_or_else(|| bad(format!("{len} bytes at {at:#x} overflow")))?;
        // Before the lock: what the descriptor is, checked without waiting on its filesystem;
        // one of this daemon's region files stands for its region or import.
        let source = match source {
            Source::Fd(fd) => {
                super::fdkind::check_register(fd.as_fd(), &self.root).map_err(|e| bad(crate::error_chain(&e)))?;
                self.region_file_source(fd, session, access)?
            }
            other => other,
        };
        let covers = match &source {
            Source::Region(id) => Covers::Region(*id),
            Source::Import(id) => Covers::Import(*id),
            Source::Fd(_) => Covers::Fd,
            Source::Process { .. } => Covers::Process,
        };
        let (found, iova) = {
            let mut st = self.state();
            self.check(&st, who.uid, 0, 1)?;
            self.check_pinned(&st, who.uid, span)?;
            // Every registration keeps a descriptor: its pinned file, or the caller's pidfd.
            self.check_held(&st, who.uid, session)?;
            let found = Self::covered(&st, covers, session, at, len, access)?;
            let iova = st.ledger.dma.alloc_iova(target, span).map_err(MemoryError::Iova)?;
            st.ledger.charge(who.uid, Usage::registration(span));
            (found, iova)
        };
        // Declared first, so that on failure it drops last: after the lock taken again
        // below, the mapping (unmapped) and the backing (unpinned).
        let reservation = Reservation { memory: self, uid: who.uid, span, domain: &target.domain, iova, held: true };
        let backing = Self::back(target, source, found, (at, len, first, span), access, abandon)?;
        let vfio = match (&target.vfio, &backing) {
            (Some(dev), Backing::Mapped(p)) => {
                Some(dev.map(iova, p.clone(), access == AccessMode::ReadWrite).map_err(MemoryError::Vfio)?)
            }
            _ => None,
        };
        let mut st = self.state();
        if let Err(e) = Self::covered(&st, covers, session, at, len, access) {
            drop(st);
            // Unmapped before the reservation frees the range; a range the IOMMU keeps
            // mapped stays taken, as an unregistration's does.
            if vfio.is_some_and(|m| !m.unmap()) {
                self.keep_unmapped(None, &target.device, iova, span);
                reservation.commit();
            }
            return Err(e);
        }
        // Memory no one can shrink (a sealed memfd): the copy engine may memcpy through it.
        let cpu_copy = matches!(&backing, Backing::Mapped(p) if p.cannot_shrink());
        let region = match covers {
            Covers::Region(id) => Some(id),
            Covers::Import(id) => st.ledger.imports.get(&id).map(|i| i.region),
            Covers::Fd | Covers::Process => None,
        };
        let id = st.ledger.take_id();
        st.ledger.dma.insert(
            id,
            Registration {
                device: target.device.clone(),
                domain: target.domain.clone(),
                iova,
                span,
                lead,
                len,
                access,
                uid: who.uid,
                session,
                covers,
                region,
                vfio,
                backing,
            },
        );
        reservation.commit();
        tracing::info!(
            uid = who.uid,
            pid = who.pid,
            session,
            registration = id,
            device = %target.device,
            domain = %target.domain,
            iova,
            span,
            ?covers,
            ?access,
            cpu_copy,
            "registered for DMA"
        );
        debug_assert!(iova.is_multiple_of(PAGE));
        Ok(Registered { registration: id, iova: iova + lead, len })
    }

    /// What a descriptor sent with `Register` stands for. A region's own file (a sim or
    /// NUMA region's `r<id>`, the very inode the registry keeps for that region) stands for
    /// the region when the session owns it, or for the session's import of it that grants
    /// `access`; anything else is refused. So freeing the region or revoking the export
    /// ends the registration as it ends one made by region or import id: registered as a
    /// plain memory object, the device would go on reaching the region's bytes. Other
    /// descriptors stay memory objects. A region file's offset 0 is the region's.
    fn region_file_source(&self, fd: OwnedFd, session: u64, access: AccessMode) -> Result<Source, MemoryError> {
        let Some((id, seen)) = super::fdkind::named_region(fd.as_fd()) else { return self.plain_file(fd) };
        let file = {
            let st = self.state();
            match st.ledger.regions.get(&id) {
                Some(r) if r.backing.own_file().is_some() => st.region_file(id, r).ok(),
                _ => None,
            }
        };
        // Compared outside the lock (a stat of the daemon's own file): the region cannot
        // take another file, and its id is never given to another region.
        if file.and_then(|f| f.id().ok()) != Some(seen) {
            return self.plain_file(fd);
        }
        let st = self.state();
        if st.ledger.owned(id, session).is_ok() {
            return Ok(Source::Region(id));
        }
        let import = st.ledger.imports.iter().find(|(_, i)| {
            i.region == id
                && i.session == session
                && (access == AccessMode::ReadOnly || i.access == AccessMode::ReadWrite)
                && !st.ledger.import_revoked(i)
        });
        match import {
            Some((&import, _)) => Ok(Source::Import(import)),
            None => Err(MemoryError::PermissionDenied(format!(
                "the descriptor is region {id}'s file, and this session neither owns that region nor holds {} of it",
                if access == AccessMode::ReadWrite { "a live read-write import" } else { "a live import" }
            ))),
        }
    }

    /// A descriptor that is no region's file by its name, as a plain memory object —
    /// unless it may be a region's file under another name (a hard link): refused, as the
    /// region's free could not end its registration.
    fn plain_file(&self, fd: OwnedFd) -> Result<Source, MemoryError> {
        let dirs: Vec<Arc<OwnedFd>> = self.state().resources.iter().map(|r| r.dir_fd.clone()).collect();
        let dirs: Vec<BorrowedFd<'_>> = dirs.iter().map(|d| d.as_fd()).collect();
        if super::fdkind::may_be_linked_region_file(fd.as_fd(), &dirs) {
            return Err(MemoryError::PermissionDenied(
                "the descriptor is a file of fabricd's with another link, on its memory's filesystem: it may be a region's file under another name, which cannot be registered as plain memory (register the region or import by id)".into(),
            ));
        }
        Ok(Source::Fd(fd))
    }

    /// Undoes a registration the session made.
    pub fn unregister(&self, session: u64, registration: u64) -> Result<(), MemoryError> {
        let mut st = self.state();
        match st.ledger.dma.get(registration) {
            None => Err(MemoryError::NotFound(format!("no registration {registration}"))),
            Some(r) if r.session != session => {
                Err(MemoryError::PermissionDenied(format!("registration {registration} belongs to another session")))
            }
            Some(_) => {
                st.ledger.detach_registration(registration);
                self.finish(st);
                Ok(())
            }
        }
    }

    /// Undoes a detached registration, without the lock: unmaps it (VFIO) and unpins it,
    /// then, under the lock, frees its IOVA range and gives back its accounting — in that
    /// order, so that no registration is mapped at the range before its unmap is done. A
    /// range whose unmap failed stays taken (the device may still reach its pages; the
    /// kernel refuses another mapping over it), and its bytes stay counted, until a
    /// restart; `status` names it. So does the range of the region it mapped, when that
    /// region is freed: the device may still reach it there. A region freed while the
    /// unmap runs waits for it (`State::unmap_done`).
    pub(super) fn undo_registration(&self, id: u64, r: crate::dma::Registration) {
        let (uid, device, domain, iova, span) = (r.uid, r.device.clone(), r.domain.clone(), r.iova, r.span);
        let region = r.iommu_region();
        let unmapped = r.undo();
        if let Some(region) = region {
            self.state().unmap_done(region, unmapped);
        }
        if !unmapped {
            self.keep_unmapped(Some(id), &device, iova, span);
            return;
        }
        let mut st = self.state();
        st.ledger.dma.free_iova(&domain, iova);
        st.unpin_usage(uid, span);
        drop(st);
        tracing::info!(registration = id, uid, device = %device, iova, span, "unregistered");
    }

    /// Names in `status` an IOVA range of `device` whose IOMMU mapping could not be undone
    /// (registration `id`'s, or one refused before it was made): the range and its pinned
    /// bytes stay taken until a restart, since the device may still reach the pages.
    fn keep_unmapped(&self, id: Option<u64>, device: &fabric_topology::DeviceId, iova: u64, span: u64) {
        let whose = id.map_or_else(|| "a refused registration".to_owned(), |id| format!("registration {id}"));
        let mut st = self.state();
        if st.problems.len() < 256 {
            st.problems.push(format!(
                "{whose}'s IOVA range {iova:#x} (+{span:#x}) of {device} could not be unmapped; kept out of use until a restart"
            ));
        }
        drop(st);
        tracing::error!(registration = ?id, device = %device, iova, span, "an IOMMU mapping could not be undone: its IOVA range is kept out of use");
    }

    /// The registration of `target`'s domain holding `[iova, iova + len)`, resolved under
    /// the lock, to be read or written without it.
    fn dma_reach(&self, target: &Target, iova: u64, len: usize) -> Result<(u64, Reach, u64), DmaError> {
        let st = self.state();
        let (id, r, at) = st.ledger.dma.resolve(&target.domain, iova, len as u64)?;
        Ok((id, r.reach(), at))
    }

    /// Reads `buf.len()` bytes at `iova` of `target`'s domain: what the device would read.
    pub fn dma_read(&self, target: &Target, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let (id, reach, at) = self.dma_reach(target, iova, buf.len())?;
        reach.read(id, at, buf)
    }

    /// Writes `buf` at `iova` of `target`'s domain: what the device would write.
    pub fn dma_write(&self, target: &Target, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        let (id, reach, at) = self.dma_reach(target, iova, buf.len())?;
        reach.write(id, at, buf)
    }
}
