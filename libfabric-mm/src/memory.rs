//! Memory objects: a [`Region`] this session allocated, an [`Import`] of another's
//! export, a [`Mapping`] of either at its GFA in the window, and the [`Handle`] an export
//! gives. Each owns what it names: dropping it undoes it (free, release, unmap). A region
//! is freed only when the region and every mapping of it are dropped.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::str::FromStr;
use std::sync::Arc;

use fabric_proto::wire::{Coherence, ExportHandle, FreeRequest, NodeId, RegisterSource, ReleaseRequest, Request};

use crate::error::{Error, Result};
use crate::session::Inner;

/// The bit of an import id that marks another node's region (fabricd's
/// `peer::importer::REMOTE_IMPORT`).
const REMOTE_IMPORT: u64 = 1 << 62;

/// Whose memory it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Allocated by this session.
    Owned,
    /// Imported by this session.
    Imported {
        /// The daemon's import id.
        import: u64,
    },
}

/// The shared state of one region or import (opaque).
#[doc(hidden)]
pub struct Mem {
    pub(crate) session: Arc<Inner>,
    pub(crate) kind: MemKind,
    pub(crate) region: u64,
    pub(crate) generation: u64,
    pub(crate) size: u64,
    pub(crate) gfa: Option<u64>,
    pub(crate) offset: u64,
    pub(crate) writable: bool,
    /// The node that owns the region, when the daemon said (protocol 1.5).
    pub(crate) owner: Option<NodeId>,
    /// Whether the hardware keeps this host's caches coherent with it, when the daemon
    /// said (protocol 1.9).
    pub(crate) coherence: Option<Coherence>,
    /// The memory object; `None` when the grant is copy-only.
    pub(crate) fd: Option<OwnedFd>,
}

impl fmt::Debug for Mem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mem")
            .field("kind", &self.kind)
            .field("region", &self.region)
            .field("generation", &self.generation)
            .field("size", &self.size)
            .field("gfa", &self.gfa)
            .field("writable", &self.writable)
            .field("owner", &self.owner)
            .field("coherence", &self.coherence)
            .field("copy_only", &self.fd.is_none())
            .finish()
    }
}

impl Mem {
    /// What a `Register` of this memory names: its region, with the region's node
    /// (protocol 1.8), or its import.
    pub(crate) fn register_source(&self) -> (RegisterSource, Option<NodeId>) {
        match self.kind {
            MemKind::Owned => (RegisterSource::Region(self.region), self.session.region_node(self.owner)),
            MemKind::Imported { import } => (RegisterSource::Import(import), None),
        }
    }

    /// The import whose mappings [`crate::window::Window::fence`] takes back when it is
    /// revoked: an import of another node's memory, whose owner's revocation tears the
    /// mapping down as a fabric's would. An import of this node's memory keeps its pages
    /// until it is unmapped, as a local IPC mapping keeps its memory (docs/libfabric-mm.md,
    /// "Revocation").
    pub(crate) fn fenced_import(&self) -> Option<u64> {
        match self.kind {
            MemKind::Imported { import } if import & REMOTE_IMPORT != 0 => Some(import),
            MemKind::Imported { .. } | MemKind::Owned => None,
        }
    }

    /// What the registration cache knows it by: an allocation by its owner node, region
    /// and generation (a region of another node may have the id and generation of one of
    /// this node's); an import by its id, since the daemon ends an import's registrations
    /// with that import (two imports of one region, or a region and an import of it, never
    /// answer for each other).
    pub(crate) fn cache_owner(&self) -> crate::regcache::Owner {
        match self.kind {
            MemKind::Owned => {
                let node = self.owner.map_or(0, |n| u64::from_be_bytes(n.0));
                crate::regcache::Owner::Fabric { node, region: self.region, generation: self.generation }
            }
            MemKind::Imported { import } => crate::regcache::Owner::Import { import },
        }
    }

    /// `Err(Revoked)` once the daemon revoked this import, or lost this region (its
    /// device went: the daemon ended its registrations).
    pub(crate) fn check_live(&self) -> Result<()> {
        let revoked = match self.kind {
            MemKind::Imported { import } => self.session.revocations.of_import(import),
            MemKind::Owned => self.session.revocations.of_owned(self.region, self.generation),
        };
        match revoked {
            Some(r) => Err(Error::Revoked { region: r.region, generation: r.generation, reason: r.reason }),
            None => Ok(()),
        }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // A forked child's copy: the region or import is the parent's, and so are the
        // locks its reader thread may have held at the fork.
        if self.session.client.forked() {
            return;
        }
        // Registrations the cache still holds go first (the daemon would drop them with
        // the region anyway; this keeps the cache from answering with a dead one).
        self.session.registrations.invalidate(self.cache_owner());
        let req = match self.kind {
            MemKind::Owned => {
                Request::Free(FreeRequest { region: self.region, node: self.session.region_node(self.owner) })
            }
            MemKind::Imported { import } => Request::Release(ReleaseRequest { import }),
        };
        // Best effort: a daemon that is gone reclaimed everything already, and a revoked
        // import is already released on its side.
        if let Err(e) = self.session.client.undo(req) {
            tracing::debug!(region = self.region, error = %e, "undoing on drop");
        }
        // Forgotten once released: a revocation the daemon sent before the release was
        // read before its answer, and is forgotten with it.
        match self.kind {
            MemKind::Imported { import } => self.session.revocations.forget(import),
            MemKind::Owned => self.session.revocations.forget_owned(self.region, self.generation),
        }
    }
}

mod sealed {
    /// Gives the library the shared state behind a memory object.
    pub trait Sealed {
        fn mem(&self) -> &std::sync::Arc<super::Mem>;
    }
}

/// Anything that can be mapped and registered: [`Region`] and [`Import`].
pub trait Memory: sealed::Sealed {
    /// The daemon's region id.
    fn id(&self) -> u64 {
        self.mem().region
    }

    /// The region's generation (a new allocation never reuses an id and generation pair).
    fn generation(&self) -> u64 {
        self.mem().generation
    }

    /// Bytes.
    fn len(&self) -> u64 {
        self.mem().size
    }

    /// Whether the memory is empty (never, for memory the daemon handed out).
    fn is_empty(&self) -> bool {
        self.mem().size == 0
    }

    /// GFA of the first byte, when the daemon placed the region in the map.
    fn gfa(&self) -> Option<u64> {
        self.mem().gfa
    }

    /// Whether stores are allowed.
    fn writable(&self) -> bool {
        self.mem().writable
    }

    /// The memory object (a file descriptor), e.g. to `mmap` it anywhere;
    /// [`Error::CopyOnly`] when the daemon granted the memory copy-only.
    fn fd(&self) -> Result<BorrowedFd<'_>> {
        let m = self.mem();
        m.fd.as_ref().map(AsFd::as_fd).ok_or(Error::CopyOnly(m.region))
    }

    /// Whether the daemon granted the memory copy-only (protocol 1.5): it has no
    /// descriptor and cannot be mapped; [`crate::Session::copy`] reaches it by GFA.
    fn copy_only(&self) -> bool {
        self.mem().fd.is_none()
    }

    /// The node that owns the region (protocol 1.5; `None` from an older daemon, whose
    /// regions are its own).
    fn owner(&self) -> Option<NodeId> {
        self.mem().owner
    }

    /// Byte offset of the region in [`Memory::fd`].
    fn fd_offset(&self) -> u64 {
        self.mem().offset
    }
}

/// A region this session allocated; freed when it and its mappings are dropped.
#[derive(Debug)]
pub struct Region(Arc<Mem>);

impl Region {
    pub(crate) fn new(m: Mem) -> Self {
        Self(Arc::new(m))
    }

    pub(crate) fn mem_arc(&self) -> &Arc<Mem> {
        &self.0
    }
}

impl sealed::Sealed for Region {
    fn mem(&self) -> &Arc<Mem> {
        &self.0
    }
}

impl Memory for Region {}

/// Another session's region, imported by handle; released when it and its mappings are
/// dropped. After a revocation, every new use fails with [`Error::Revoked`].
#[derive(Debug)]
pub struct Import(Arc<Mem>);

impl Import {
    pub(crate) fn new(m: Mem) -> Self {
        Self(Arc::new(m))
    }

    pub(crate) fn mem_arc(&self) -> &Arc<Mem> {
        &self.0
    }

    /// The daemon's import id.
    pub fn import_id(&self) -> u64 {
        match self.0.kind {
            MemKind::Imported { import } => import,
            MemKind::Owned => 0,
        }
    }

    /// `Err(Revoked)` with the reason once the daemon revoked it.
    pub fn check(&self) -> Result<()> {
        self.0.check_live()
    }
}

impl sealed::Sealed for Import {
    fn mem(&self) -> &Arc<Mem> {
        &self.0
    }
}

impl Memory for Import {}

/// Memory placed at its GFA in the window; unmapped (the reservation restored) on drop.
#[derive(Debug)]
pub struct Mapping {
    mem: Arc<Mem>,
    ptr: *mut u8,
    gfa: u64,
    /// Whether the window fenced it (a revoked import of another node's memory).
    access: Arc<crate::window::Access>,
}

// SAFETY: the mapping is process-wide memory; the pointer is only an address, and the
// Mem it keeps alive is Send + Sync.
unsafe impl Send for Mapping {}
// SAFETY: as above; concurrent loads and stores through the pointer are the caller's
// business (they are to shared memory, like any mmap).
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(crate) fn new(mem: Arc<Mem>, (ptr, access): (*mut u8, Arc<crate::window::Access>), gfa: u64) -> Self {
        Self { mem, ptr, gfa, access }
    }

    /// Runs `f` on the lines of `[offset, offset + len)` unless the mapping is coherent, with
    /// a fence held off meanwhile; `Err(Revoked)` once the mapping is fenced, coherent or not.
    fn each_line(&self, offset: u64, len: u64, f: fn(usize, usize)) -> Result<()> {
        let (first, count) = crate::coherence::lines(self.ptr, self.len(), offset, len)?;
        let Some(_live) = self.access.enter() else {
            self.mem.check_live()?;
            return Err(Error::InvalidArgument("the mapping was fenced".into()));
        };
        if !self.coherent() {
            f(first, count);
        }
        Ok(())
    }

    pub(crate) fn mem_arc(&self) -> &Arc<Mem> {
        &self.mem
    }

    /// First byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// GFA of the first byte (`as_ptr() == window.base + (gfa - window.gfa)`).
    pub fn gfa(&self) -> u64 {
        self.gfa
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.mem.size as usize
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        self.mem.size == 0
    }

    /// Whether stores are allowed.
    pub fn writable(&self) -> bool {
        self.mem.writable
    }

    /// `Err(Revoked)` once the memory behind the mapping was revoked. The pages stay
    /// mapped until the mapping is dropped, except for an import of another node's memory,
    /// whose pages the revocation fences — softly, with private zero pages, in a session
    /// that keeps revoked mappings (see docs/libfabric-mm.md, "Revocation").
    pub fn check(&self) -> Result<()> {
        self.mem.check_live()
    }

    /// Whether this host's caches are kept coherent with the memory by the hardware, so
    /// that [`Mapping::flush`] and [`Mapping::invalidate`] are no-ops, as the daemon's
    /// grant says (protocol 1.9; docs/libfabric-mm.md has the table per fabric): not for
    /// CXL.mem shared by several hosts (another node's region on it, or this node's own
    /// region on a device its `[[memory.shares]]` lists, unless declared `coherent`); yes
    /// for memory only this host reaches, the sim's shared files and NVLink. From an older
    /// daemon, whose grant does not say: this node's own memory is, another node's is
    /// treated as not.
    pub fn coherent(&self) -> bool {
        match (self.mem.coherence, &self.mem.kind) {
            (Some(c), _) => c == Coherence::Hardware,
            (None, MemKind::Owned) => true,
            (None, MemKind::Imported { import }) => import & REMOTE_IMPORT == 0,
        }
    }

    /// Writes this host's stores to `[offset, offset + len)` of the mapping back to memory
    /// (`clwb`/`clflushopt` per cache line, then `sfence` on x86-64), so that another
    /// host's next load sees them on a fabric without hardware coherence; a no-op where the
    /// mapping is [`coherent`](Mapping::coherent). `Err(InvalidArgument)` for an empty
    /// range or one not inside the mapping; `Err(Revoked)` once the mapping is fenced (a
    /// revoked import of another node's memory: docs/libfabric-mm.md, "Revocation").
    pub fn flush(&self, offset: u64, len: u64) -> Result<()> {
        self.each_line(offset, len, crate::coherence::flush)
    }

    /// Drops this host's cached copies of `[offset, offset + len)` (written back first:
    /// `clflushopt` per cache line, then `mfence` on x86-64), so that the next load reads
    /// what another host stored; a no-op where the mapping is
    /// [`coherent`](Mapping::coherent). Errors as for [`Mapping::flush`].
    pub fn invalidate(&self, offset: u64, len: u64) -> Result<()> {
        self.each_line(offset, len, crate::coherence::invalidate)
    }

    /// The bytes, for reading.
    ///
    /// # Safety
    /// Other processes may store to shared memory at any time: the caller must not rely
    /// on the contents staying unchanged while the slice lives. A mapping of an import of
    /// another node's memory is fenced when the import is revoked (the revocation
    /// callback runs after it): from then on a load or store through the slice faults
    /// (`SIGSEGV`), so the caller stops using it by then — or, in a session that fences
    /// softly ([`crate::SessionConfig::keep_revoked_mappings`]), reads zeros. A region's owner can
    /// shrink a file-backed region (sim, NUMA host memory) under every mapping of it: a
    /// load past the new end raises `SIGBUS` until the daemon restores the size
    /// (docs/libfabric-mm.md, "A mapping can fault with SIGBUS").
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len stays reserved for this mapping for as long as self lives,
        // mapped readable until a fence (the caller's contract above covers that).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len()) }
    }

    /// The bytes, for writing; `Err` when the mapping is read-only.
    ///
    /// # Safety
    /// As for [`Mapping::as_slice`], and the caller must not create two live mutable
    /// slices of one mapping.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> Result<&mut [u8]> {
        if !self.mem.writable {
            return Err(Error::InvalidArgument("the mapping is read-only".into()));
        }
        // SAFETY: ptr..ptr+len is mapped read-write for as long as self lives (until a
        // fence: the caller's contract); aliasing is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len()) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // A forked child's copy: the window's lock may have been held at the fork, and
        // its placements are the parent's.
        if self.mem.session.client.forked() {
            return;
        }
        if let Err(e) = self.mem.session.window.unplace(self.gfa) {
            tracing::warn!(gfa = self.gfa, error = %e, "unmapping from the window");
        }
    }
}

/// An export's handle: owner node (protocol 1.5), region id, generation and a 128-bit
/// secret. Its text form ([`fmt::Display`] / [`FromStr`]) is how it travels to another
/// process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handle(pub(crate) ExportHandle);

impl Handle {
    /// The region it names.
    pub fn region(&self) -> u64 {
        self.0.region
    }

    /// The generation it names.
    pub fn generation(&self) -> u64 {
        self.0.generation
    }

    /// The node that owns the region (`None`: a handle from a daemon older than 1.5).
    pub fn node(&self) -> Option<NodeId> {
        self.0.node
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for Handle {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        s.parse::<ExportHandle>().map(Handle).map_err(|e| Error::InvalidArgument(format!("handle: {e}")))
    }
}
