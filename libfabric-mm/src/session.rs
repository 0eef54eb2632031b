//! A session with fabricd: the connection, the unified window, and the revocations the
//! daemon reports for this session's imports. Every memory object holds the session alive.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use fabric_proto::wire::{
    Access, AccessMode, AllocRequest, AllocTarget, BoundedVec, DeviceName, DomainAction, DomainRequest, Event,
    ExportPolicy, ExportRequest, Grant, ImportRequest, MemoryClass, Name, NodeId, Opcode, Request, ResourceName,
    Response, Revocation, RevokeRequest, SubscribeRequest, Topics, TranslateQuery, TranslateRequest, Translation,
};

use crate::client::{Client, Notice};
use crate::error::{Error, Result};
use crate::memory::{Handle, Import, Mapping, Mem, MemKind, Memory, Region};
use crate::window::{Protection, Window, WindowConfig};

/// How to open a session.
#[derive(Debug, Clone, Default)]
pub struct SessionConfig {
    /// The daemon's socket; `None`: [`default_socket`].
    pub socket: Option<PathBuf>,
    /// The unified window; `None`: `FABRIC_MM_WINDOW_GFA`/`_SIZE` when set
    /// ([`WindowConfig::from_env`]), else on a node of a domain a window of node spans
    /// ([`Window::for_domain`]), else [`WindowConfig::default`].
    pub window: Option<WindowConfig>,
    /// A name for the daemon's logs.
    pub client_name: Option<String>,
    /// Take back the session this token names (its regions and exports), after a daemon
    /// restart or a dropped connection, within the daemon's grace period (`resume.rs`).
    pub resume: Option<crate::resume::Token>,
    /// Fence a revoked import of another node's memory softly: its mappings get private
    /// zero pages of the same protection when the revocation is told, instead of the
    /// window's `PROT_NONE` reservation (loads and stores through a fenced mapping fault
    /// with `SIGSEGV`). Neither way reaches the revoked memory. For callers that cannot
    /// survive a fault in code that reads a mapping: the Python binding sets it
    /// (docs/libfabric-mm.md, "Revocation").
    pub keep_revoked_mappings: bool,
}

/// The socket fabricd listens on by default: `$FABRIC_SOCKET`, else
/// `/run/fabric/fabricd.sock` for root, else `$XDG_RUNTIME_DIR/fabric/fabricd.sock`.
pub fn default_socket() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("FABRIC_SOCKET") {
        return Ok(p);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return Ok(PathBuf::from("/run/fabric/fabricd.sock"));
    }
    var("XDG_RUNTIME_DIR")
        .map(|d| d.join("fabric/fabricd.sock"))
        .ok_or_else(|| Error::InvalidArgument("no daemon socket: set FABRIC_SOCKET or XDG_RUNTIME_DIR".into()))
}

type RevocationCallback = Arc<dyn Fn(&Revocation) + Send + Sync>;

/// The revocation callback and the threads running it.
#[derive(Default)]
struct Calls {
    callback: Option<RevocationCallback>,
    /// Threads inside a call of a callback (the reader, or a caller's thread reading an
    /// answer): a replacement waits until none but its own is.
    running: Vec<std::thread::ThreadId>,
}

/// What the reader thread records for the session.
#[derive(Default)]
pub(crate) struct Revocations {
    /// Revoked imports by import id.
    by_import: Mutex<HashMap<u64, Revocation>>,
    /// This session's own regions the daemon lost (a revocation with import 0: their
    /// device went), by region and generation: the daemon ended their registrations.
    lost_owned: Mutex<HashMap<(u64, u64), Revocation>>,
    /// Whether `lost_owned` ever held one: the check of owned memory costs no lock before.
    any_lost_owned: std::sync::atomic::AtomicBool,
    calls: Mutex<Calls>,
    /// Signalled when a call of the callback ends.
    call_ended: std::sync::Condvar,
    /// The session's window, once reserved: a revoked import's mappings in it are fenced.
    window: std::sync::OnceLock<Arc<Window>>,
}

impl Revocations {
    fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
        m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn record(&self, r: Revocation) {
        self.mark(r);
        // Called outside the lock, so that the callback may replace itself.
        let me = std::thread::current().id();
        let cb = {
            let mut calls = Self::lock(&self.calls);
            let Some(cb) = calls.callback.clone() else { return };
            calls.running.push(me);
            cb
        };
        // Leaves the running list when the call ends, a panicking call included: a
        // replacement waiting for it would otherwise wait for good.
        let _ended = CallEnded { revocations: self, thread: me };
        cb(&r);
    }

    /// What the library does on a revocation before anyone is told: the mark that refuses
    /// the memory, and the fence of its mappings (both idempotent: a revocation read by a
    /// wait inside a callback is marked at once, and recorded again once it returns).
    fn mark(&self, r: Revocation) {
        tracing::info!(region = r.region, import = r.import, reason = ?r.reason, "import revoked");
        // Marked first: a `map` racing with this either is fenced below or sees the mark
        // after it placed (`Session::map`).
        if r.import == 0 {
            Self::lock(&self.lost_owned).insert((r.region, r.generation), r);
            self.any_lost_owned.store(true, std::sync::atomic::Ordering::Release);
        } else {
            Self::lock(&self.by_import).insert(r.import, r);
        }
        // Fenced before anyone is told (an import of another node's memory: see
        // `Mem::fenced_import`): from now on a load or store through its mappings faults
        // instead of reaching memory its owner took back.
        if r.import != 0
            && let Some(w) = self.window.get()
        {
            let fenced = w.fence(r.import);
            if fenced > 0 {
                tracing::info!(import = r.import, mappings = fenced, "revoked import's mappings fenced");
            }
        }
    }

    /// Sets (or, with `None`, removes) the callback. Once this returns the one it replaced
    /// runs on no other thread, and is never called again; from inside a call of the
    /// callback (which replaces itself) it returns at once, that call going on.
    fn set_callback(&self, cb: Option<RevocationCallback>) {
        let me = std::thread::current().id();
        let mut calls = Self::lock(&self.calls);
        let old = std::mem::replace(&mut calls.callback, cb);
        while calls.running.iter().any(|t| *t != me) {
            calls = self.call_ended.wait(calls).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        drop(calls);
        // Dropped outside the lock: what it holds may take locks of its own.
        drop(old);
    }

    pub(crate) fn of_import(&self, import: u64) -> Option<Revocation> {
        Self::lock(&self.by_import).get(&import).copied()
    }

    pub(crate) fn forget(&self, import: u64) {
        Self::lock(&self.by_import).remove(&import);
    }

    /// The daemon's word that it lost this session's region `region` of `generation`.
    pub(crate) fn of_owned(&self, region: u64, generation: u64) -> Option<Revocation> {
        if !self.any_lost_owned.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        Self::lock(&self.lost_owned).get(&(region, generation)).copied()
    }

    /// Forgets a lost region once it is freed.
    pub(crate) fn forget_owned(&self, region: u64, generation: u64) {
        if self.any_lost_owned.load(std::sync::atomic::Ordering::Acquire) {
            Self::lock(&self.lost_owned).remove(&(region, generation));
        }
    }
}

/// A call of the revocation callback in progress on `thread`: when dropped, the thread
/// leaves the running list and waiting replacements are woken.
struct CallEnded<'a> {
    revocations: &'a Revocations,
    thread: std::thread::ThreadId,
}

impl Drop for CallEnded<'_> {
    fn drop(&mut self) {
        let mut calls = Revocations::lock(&self.revocations.calls);
        if let Some(i) = calls.running.iter().position(|t| *t == self.thread) {
            calls.running.swap_remove(i);
        }
        drop(calls);
        self.revocations.call_ended.notify_all();
    }
}

/// The shared part of a session: memory objects and mappings hold it.
pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) window: Arc<Window>,
    pub(crate) revocations: Arc<Revocations>,
    pub(crate) socket: PathBuf,
    /// The registration cache and counters (crate::register).
    pub(crate) registrations: crate::register::Registrations,
    /// Copies in flight (`crate::copy`).
    pub(crate) copies: Arc<crate::copy::Copies>,
}

impl Inner {
    /// The node to name with a request about this session's region owned by `owner`:
    /// `owner` once the daemon speaks 1.8, so that a region id never acts on another
    /// daemon's region of the same number; nothing with an older one, which reads a bare
    /// id as its own.
    pub(crate) fn region_node(&self, owner: Option<NodeId>) -> Option<NodeId> {
        owner.filter(|_| self.client.version() >= fabric_proto::wire::QUALIFIED_REGIONS)
    }
}

/// A session with fabricd. Cheap to clone (all clones are one session); the connection
/// closes when the last clone and the last memory object of the session are dropped, and
/// the daemon then reclaims whatever the session still held.
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("socket", &self.inner.socket)
            .field("session", &self.inner.client.session())
            .field("window", &self.inner.window.config())
            .finish()
    }
}

/// Where to allocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Memory of this class on a device (identity in text form, e.g. `uuid:GPU-…`).
    Device {
        /// The device.
        device: String,
        /// The class of memory.
        memory: MemoryClass,
    },
    /// An interleave set, by name.
    Set(String),
}

/// Who may import an export.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Policy {
    /// Allowed uids (with `gids` empty too: the owner's uid only).
    pub uids: Vec<u32>,
    /// Allowed primary gids.
    pub gids: Vec<u32>,
    /// Importers must be bound to this partition.
    pub partition: Option<String>,
    /// Read-only exports refuse read-write imports.
    pub read_only: bool,
}

/// Where a GFA lands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// In a device's memory resource.
    Resource {
        /// The device.
        device: String,
        /// The class of memory.
        memory: MemoryClass,
        /// Which resource of that class.
        ordinal: u16,
        /// Byte offset in the resource.
        offset: u64,
        /// The interleave set the address went through, if any.
        set: Option<String>,
    },
    /// A hole reserved for a vanished owner.
    Hole {
        /// The owner.
        owner: String,
    },
    /// Nothing holds the address.
    Unmapped,
    /// Mapped, but outside the caller's partition.
    NotInPartition,
    /// In another node's slot of the domain (`docs/domain.md`).
    Remote {
        /// The node whose slot holds the address.
        node: String,
        /// Whether that node is a live member now (a gone node's slot is kept as a hole).
        live: bool,
        /// Where in that node's memory.
        place: RemotePlace,
    },
}

/// Where a GFA in another node's slot lands ([`Location::Remote`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemotePlace {
    /// In a memory resource of that node's device.
    Resource {
        /// The device.
        device: String,
        /// The class of memory.
        memory: MemoryClass,
        /// Which resource of that class.
        ordinal: u16,
        /// Byte offset in the resource.
        offset: u64,
    },
    /// In an interleave set of that node; which member holds the byte is that node's to say.
    Set {
        /// The set.
        set: String,
        /// Byte offset in the set's range.
        offset: u64,
    },
    /// In a hole of that node's slot.
    Hole,
}

/// What a daemon's answer to a translate query says to a client.
fn location(t: &Translation) -> Location {
    match t {
        Translation::Resource { resource, offset, set } => Location::Resource {
            device: resource.device.to_string(),
            memory: resource.memory,
            ordinal: resource.ordinal,
            offset: *offset,
            set: set.as_ref().map(ToString::to_string),
        },
        Translation::Hole { owner } => Location::Hole { owner: owner.to_string() },
        Translation::Remote { node, live, resource, set, offset } => {
            let place = match (resource, set) {
                (Some(r), _) => RemotePlace::Resource {
                    device: r.device.to_string(),
                    memory: r.memory,
                    ordinal: r.ordinal,
                    offset: *offset,
                },
                (None, Some(set)) => RemotePlace::Set { set: set.to_string(), offset: *offset },
                (None, None) => RemotePlace::Hole,
            };
            Location::Remote { node: node.to_string(), live: *live, place }
        }
        Translation::NotInPartition => Location::NotInPartition,
        Translation::Gfa(_) | Translation::Unmapped | Translation::UnknownResource => Location::Unmapped,
    }
}

/// A byte of a device's memory resource, to find the GFA of ([`Session::reverse`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceOffset {
    /// The device's identity (as [`Location::Resource`] gives it).
    pub device: String,
    /// The class of memory.
    pub memory: MemoryClass,
    /// Which resource of that class.
    pub ordinal: u16,
    /// Byte offset in the resource (a DPA offset for a member of an interleave set).
    pub offset: u64,
}

/// This node's slot (its first GFA) and the node span, when the daemon is a node of a
/// domain that answers this client its status; `None` for a daemon on its own (or one
/// that refuses: the default window is the right one for its clients).
fn domain_slot(client: &Client) -> Option<(u64, u64)> {
    let req = Request::Domain(DomainRequest { action: DomainAction::Status });
    let Ok((Response::Domain(d), _)) = client.call(req, &[]) else { return None };
    let doc: fabric_proto::domain::DomainDoc = serde_json::from_str(&d.json).ok()?;
    let span = doc.settings?.node_span;
    let own = u64::from(doc.this?.slot).checked_mul(span)?;
    tracing::debug!(own, span, "a domain node: the window mirrors node spans");
    Some((own, span))
}

fn bounded<const N: usize>(v: &[u32], what: &str) -> Result<BoundedVec<u32, N>> {
    BoundedVec::new(v.to_vec()).map_err(|_| Error::InvalidArgument(format!("more than {N} {what}")))
}

impl Session {
    /// Opens a session on the default socket with the default window.
    pub fn open() -> Result<Self> {
        Self::open_with(SessionConfig::default())
    }

    /// Opens a session as configured: connects, negotiates, subscribes to revocations of
    /// this session's imports, and reserves the unified window.
    pub fn open_with(config: SessionConfig) -> Result<Self> {
        let socket = match config.socket {
            Some(s) => s,
            None => default_socket()?,
        };
        let revocations = Arc::new(Revocations::default());
        let copies = Arc::new(crate::copy::Copies::default());
        let sink = revocations.clone();
        let copy_sink = copies.clone();
        let on_event = Box::new(move |n: Notice| match n {
            Notice::Event(Event::Revocation(r)) => sink.record(r),
            Notice::Event(Event::CopyDone(d)) => copy_sink.complete(d),
            Notice::Arrived(Event::Revocation(r)) => sink.mark(r),
            Notice::Event(_) | Notice::Arrived(_) => {}
            Notice::Closed => copy_sink.disconnected(),
        });
        let name = config.client_name.as_deref().unwrap_or("libfabric-mm");
        let client = Client::connect(&socket, name, config.resume.map(|t| t.0), on_event)?;
        let window = match config.window {
            Some(w) => Window::reserve(w)?,
            None => match WindowConfig::env()? {
                Some(w) => Window::reserve(w)?,
                None => match domain_slot(&client) {
                    Some((own, span)) => Window::for_domain(own, span)?,
                    None => Window::reserve(WindowConfig::default())?,
                },
            },
        };
        // Revoked imports' mappings are blanked rather than taken back where a fault
        // cannot be survived.
        let window = Arc::new(if config.keep_revoked_mappings { window.fence_softly() } else { window });
        // Set once, before any memory is placed in it.
        let _ = revocations.window.set(window.clone());
        let registrations = Default::default();
        let inner = Arc::new(Inner { client, window, revocations, socket, registrations, copies });
        let s = Self { inner };
        match s.call(Request::Subscribe(SubscribeRequest { topics: Topics::REVOCATION }))? {
            Response::Subscribe(_) => Ok(s),
            _ => Err(Error::Unexpected(Opcode::Subscribe)),
        }
    }

    pub(crate) fn call(&self, req: Request) -> Result<Response> {
        self.inner.client.call(req, &[]).map(|(r, _)| r)
    }

    /// The socket this session talks to.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// The protocol version agreed with the daemon.
    pub fn protocol_version(&self) -> fabric_proto::wire::Version {
        self.inner.client.version()
    }

    /// The daemon's id of this session.
    pub fn id(&self) -> u64 {
        self.inner.client.session()
    }

    /// The unified window.
    pub fn window(&self) -> &Window {
        &self.inner.window
    }

    /// Runs `f` (on the thread that reads the event: the library's reader thread, or a
    /// thread of this session waiting for an answer) for every revocation of one of this
    /// session's imports, after the import is marked revoked. Replaces an earlier callback:
    /// once this returns, that one is running on no other thread and is never called
    /// again. `f` must not block or call the session (answers to this session's calls wait
    /// behind it), except to replace or remove itself with `on_revocation`, which from
    /// inside `f` returns at once.
    pub fn on_revocation(&self, f: impl Fn(&Revocation) + Send + Sync + 'static) {
        self.inner.revocations.set_callback(Some(Arc::new(f)));
        // Revocations reach `f` as they come, not at the reader's next look.
        self.inner.client.events_promptly();
    }

    /// Allocates `size` bytes (rounded up by the daemon to its granule).
    pub fn alloc(&self, target: &Target, size: u64) -> Result<Region> {
        let target = match target {
            Target::Device { device, memory } => {
                AllocTarget::Device { device: DeviceName::truncated(device), memory: *memory }
            }
            Target::Set(name) => AllocTarget::Set(Name::truncated(name)),
        };
        let (resp, fds) = self.inner.client.call(Request::Alloc(AllocRequest { target, size, align: 0 }), &[])?;
        let Response::Alloc(a) = resp else { return Err(Error::Unexpected(Opcode::Alloc)) };
        // Held before its grant is checked: one the library cannot use frees the region
        // again (the drop of `Mem`), rather than leave it to the session's end.
        let mut mem = Mem {
            session: self.inner.clone(),
            kind: MemKind::Owned,
            region: a.region,
            generation: a.generation,
            size: a.size,
            gfa: a.gfa,
            offset: a.offset,
            writable: true,
            owner: a.grant.map(|g| g.owner),
            coherence: a.grant.and_then(|g| g.coherence),
            fd: None,
        };
        mem.fd = granted_fd(Opcode::Alloc, a.grant, fds)?;
        Ok(Region::new(mem))
    }

    /// Exports a region: a handle another process can import, under `policy`.
    pub fn export(&self, region: &Region, policy: &Policy) -> Result<Handle> {
        self.export_region(region.id(), region.owner(), policy)
    }

    /// Exports region `id` of this session, owned by node `owner`, under `policy`.
    pub(crate) fn export_region(&self, id: u64, owner: Option<NodeId>, policy: &Policy) -> Result<Handle> {
        let policy = ExportPolicy {
            uids: bounded(&policy.uids, "uids")?,
            gids: bounded(&policy.gids, "gids")?,
            partition: policy.partition.as_deref().map(Name::truncated),
            access: if policy.read_only { AccessMode::ReadOnly } else { AccessMode::ReadWrite },
        };
        match self.call(Request::Export(ExportRequest { region: id, policy, node: self.inner.region_node(owner) }))? {
            Response::Export(e) => Ok(Handle(e.handle)),
            _ => Err(Error::Unexpected(Opcode::Export)),
        }
    }

    /// Revokes an export: its importers are told, new imports fail.
    pub fn revoke(&self, handle: &Handle) -> Result<()> {
        match self.call(Request::Revoke(RevokeRequest { handle: handle.0 }))? {
            Response::Revoke => Ok(()),
            _ => Err(Error::Unexpected(Opcode::Revoke)),
        }
    }

    /// Imports the region a handle names, read-write or read-only.
    pub fn import(&self, handle: &Handle, writable: bool) -> Result<Import> {
        let access = if writable { AccessMode::ReadWrite } else { AccessMode::ReadOnly };
        let (resp, fds) = self.inner.client.call(Request::Import(ImportRequest { handle: handle.0, access }), &[])?;
        let Response::Import(i) = resp else { return Err(Error::Unexpected(Opcode::Import)) };
        // Held before its grant is checked, as in `alloc`: an unusable one is released.
        let mut mem = Mem {
            session: self.inner.clone(),
            kind: MemKind::Imported { import: i.import },
            region: i.region,
            generation: i.generation,
            size: i.size,
            gfa: i.gfa,
            offset: i.offset,
            writable: i.access == AccessMode::ReadWrite,
            owner: i.grant.map(|g| g.owner),
            coherence: i.grant.and_then(|g| g.coherence),
            fd: None,
        };
        mem.fd = granted_fd(Opcode::Import, i.grant, fds)?;
        Ok(Import::new(mem))
    }

    /// `Ok` when `mem` was allocated or imported on this session; else refused, naming
    /// what to do (`what`) on the session it came from: its ids are that session's.
    pub(crate) fn check_own(&self, mem: &crate::memory::Mem, what: &str) -> Result<()> {
        if Arc::ptr_eq(&mem.session, &self.inner) {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "region {} was allocated or imported on another session: {what} it there",
            mem.region
        )))
    }

    /// Maps memory at its GFA in the unified window: read-write when the memory is
    /// writable, else read-only. The mapping holds the memory alive. The memory must be
    /// this session's (allocated or imported on it): another session's window and
    /// revocations are that session's.
    pub fn map(&self, memory: &impl Memory) -> Result<Mapping> {
        let mem = memory.mem().clone();
        self.check_own(&mem, "map")?;
        mem.check_live()?;
        let fd = mem.fd.as_ref().ok_or(Error::CopyOnly(mem.region))?;
        let gfa = mem.gfa.ok_or(Error::NoGfa(mem.region))?;
        let prot = if mem.writable { Protection::ReadWrite } else { Protection::Read };
        let fenced = mem.fenced_import();
        let placed = self.inner.window.place_as(gfa, mem.size, fd.as_fd(), mem.offset, prot, fenced)?;
        let mapping = Mapping::new(mem, placed, gfa);
        // Revoked while it was placed: refused (dropping it unplaces it).
        mapping.mem_arc().check_live()?;
        Ok(mapping)
    }

    /// Where each GFA lands (at most 1,024 per call).
    pub fn translate(&self, gfas: &[u64]) -> Result<Vec<Location>> {
        let queries = gfas.iter().map(|g| TranslateQuery::Gfa(*g)).collect();
        Ok(self.query(queries, "at most 1024 GFAs per translate")?.iter().map(location).collect())
    }

    /// The GFA of each resource offset — the reverse of [`Session::translate`], at most
    /// 1,024 per call, one round trip. `None` where that byte has no GFA the caller may
    /// see: the resource is unknown to the map or vanished, it is a member of an interleave
    /// set that is a hole, it lies outside the caller's partitions, or the offset is past its
    /// mapped bytes (for a set member, past the set's `member_size`).
    pub fn reverse(&self, items: &[ResourceOffset]) -> Result<Vec<Option<u64>>> {
        let queries = items
            .iter()
            .map(|r| {
                let device = DeviceName::new(r.device.clone())
                    .map_err(|e| Error::InvalidArgument(format!("device {:?}: {e}", r.device)))?;
                let resource = ResourceName { device, memory: r.memory, ordinal: r.ordinal };
                Ok(TranslateQuery::Resource { resource, offset: r.offset })
            })
            .collect::<Result<Vec<_>>>()?;
        let answers = self.query(queries, "at most 1024 resource offsets per reverse")?;
        Ok(answers.iter().map(|a| if let Translation::Gfa(g) = a { Some(*g) } else { None }).collect())
    }

    /// One `Translate` round trip: the daemon's answers, in order; `too_many` is the
    /// refusal when the queries exceed the protocol's bound.
    fn query(&self, queries: Vec<TranslateQuery>, too_many: &str) -> Result<Vec<Translation>> {
        let queries = BoundedVec::new(queries).map_err(|_| Error::InvalidArgument(too_many.into()))?;
        let Response::Translate(t) = self.call(Request::Translate(TranslateRequest { queries }))? else {
            return Err(Error::Unexpected(Opcode::Translate));
        };
        Ok(t.results.into_vec())
    }
}

/// The descriptor an `Alloc` or `Import` answer (`op`) hands over, as its grant says: one
/// for an [`Access::Fd`] grant and for every answer of a daemon older than 1.5 (which sends
/// no grant), none for a copy-only one. A vendor object is not an answer to these.
fn granted_fd(op: Opcode, grant: Option<Grant>, fds: Vec<OwnedFd>) -> Result<Option<OwnedFd>> {
    let access = grant.map_or(Access::Fd, |g| g.access);
    match (access, <[OwnedFd; 1]>::try_from(fds)) {
        (Access::Fd, Ok([fd])) => Ok(Some(fd)),
        (Access::CopyOnly, Err(none)) if none.is_empty() => Ok(None),
        _ => Err(Error::Unexpected(op)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fds(n: usize) -> Vec<OwnedFd> {
        (0..n).map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap())).collect()
    }

    fn grant(access: Access) -> Option<Grant> {
        Some(Grant::new(NodeId([7; 8]), access))
    }

    #[test]
    fn each_kind_of_grant_hands_over_what_it_says() {
        let op = Opcode::Import;
        assert!(granted_fd(op, None, fds(1)).unwrap().is_some(), "a 1.4 daemon: always a descriptor");
        assert!(granted_fd(op, grant(Access::Fd), fds(1)).unwrap().is_some());
        assert!(granted_fd(op, grant(Access::CopyOnly), fds(0)).unwrap().is_none());
        for (g, n) in [(None, 0), (grant(Access::Fd), 0), (grant(Access::Fd), 2), (grant(Access::CopyOnly), 1)] {
            assert!(matches!(granted_fd(op, g, fds(n)), Err(Error::Unexpected(Opcode::Import))), "{g:?} with {n}");
        }
        assert!(matches!(granted_fd(op, grant(Access::Vendor), fds(0)), Err(Error::Unexpected(_))));
        assert_eq!(Error::CopyOnly(3).code(), crate::ffi::FMM_E_COPY_ONLY);
    }
}
