//! DMA registration: [`Session::register`] pins memory — a fabric [`Region`], an
//! [`Import`], a [`Mapping`] of either, or a [`HostBuffer`] — and maps it at an IOVA in a
//! device's DMA domain (the daemon's `Register`); [`Session::register_ptr`] does the same
//! for any memory of this process, which the library locks first. A [`Registration`] is
//! undone (`Unregister`) when it and the cache's hold on it are gone.
//!
//! Registrations of regions, imports and host buffers go through a bounded cache
//! ([`crate::regcache`]) keyed by allocation identity and generation, never by address (a
//! sub-range of a cached range is answered from it, at its offset);
//! bare pointers are never cached, because nothing tells the library when the memory
//! under an address is freed and reused (see docs/libfabric-mm.md, "Registration").
//!
//! # Safety of DMA
//! While memory is registered read-write, a device (or the daemon's copy engine acting for
//! it) may write it at any time: no Rust reference to those bytes may be live across a
//! copy. Access registered memory through raw pointers or volatile/raw copies.

use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use fabric_proto::wire::{
    AccessMode, DeviceName, ErrorCode, Opcode, RegisterRequest, RegisterSource, Request, Response, UnregisterRequest,
};

use crate::error::{Error, Result};
use crate::hostmem::{HostBuffer, HostMem, PageLock};
use crate::memory::{Import, Mapping, Mem, Region};
use crate::regcache::{CacheLimits, CacheStats, FxHashMap, Owner, RegCache, RegKey};
use crate::session::{Inner, Session};

/// What the device may do with registered memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// The device reads only.
    ReadOnly,
    /// The device reads and writes.
    ReadWrite,
}

impl Access {
    fn wire(self) -> AccessMode {
        match self {
            Access::ReadOnly => AccessMode::ReadOnly,
            Access::ReadWrite => AccessMode::ReadWrite,
        }
    }
}

/// The registration cache's counters and this session's live registrations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistrationStats {
    /// The cache: hits, misses, evictions, invalidations, entries and bytes cached.
    pub cache: CacheStats,
    /// Registrations of this session alive in the daemon (cached or held).
    pub live: u64,
    /// Bytes those registrations cover.
    pub registered_bytes: u64,
}

/// One registration in the daemon; unregistered when the last holder (a [`Registration`]
/// or the cache) drops it.
#[derive(Debug)]
struct DaemonReg {
    session: Weak<Inner>,
    session_id: u64,
    id: u64,
    iova: u64,
    len: u64,
    device: String,
    access: Access,
    /// For bare pointers: the pages the library locked; unlocked after the unregister.
    _lock: Option<PageLock>,
}

/// Whether a `Register` answer fits the request: `asked` bytes, at an IOVA range that does
/// not wrap.
fn check_answer(asked: u64, iova: u64, len: u64) -> std::result::Result<(), String> {
    if len != asked {
        return Err(format!("{len} bytes registered, {asked} asked for"));
    }
    if iova.checked_add(len).is_none() {
        return Err(format!("IOVA {iova:#x} + {len:#x} wraps"));
    }
    Ok(())
}

impl Drop for DaemonReg {
    fn drop(&mut self) {
        // A session that is gone took its registrations with it in the daemon.
        let Some(s) = self.session.upgrade() else { return };
        // A forked child's copy: the registration is the parent's.
        if s.client.forked() {
            return;
        }
        s.registrations.live.fetch_sub(1, Ordering::Relaxed);
        s.registrations.bytes.fetch_sub(self.len, Ordering::Relaxed);
        let req = Request::Unregister(UnregisterRequest { registration: self.id });
        // A bare pointer's bytes are the caller's to free once this drop returns, and the
        // daemon answers the unregister only once no copy writes them: that answer is
        // awaited even in a callback (where a copy into them may still run). Other
        // memory is the library's, kept until its own drop.
        let undone = if self._lock.is_some() { s.client.undo_waiting(req) } else { s.client.undo(req) };
        if let Err(e) = undone {
            tracing::debug!(registration = self.id, error = %e, "unregistering on drop");
        }
        // `_lock` drops after this body: the pages are unlocked once the daemon let go.
    }
}

/// What a registration keeps alive: its memory, which holds the session too (for a bare
/// pointer, the session alone).
enum Keep {
    Fabric(#[allow(dead_code)] Arc<Mem>),
    Host(#[allow(dead_code)] Arc<HostMem>),
    Pointer(#[allow(dead_code)] Arc<Inner>),
}

/// Memory registered for DMA by a device: the IOVA the device uses, the bytes, the access.
/// Keeps the memory it covers alive; dropping it unregisters (unless the session's cache
/// still holds the registration for reuse; then the cache unregisters it on eviction, on
/// invalidation or when the memory goes) and unlocks what the library locked.
pub struct Registration {
    // Field order is drop order: unregister before the memory can go.
    reg: Arc<DaemonReg>,
    /// Where this registration's bytes start in `reg` (not 0 for a sub-range the cache
    /// answered from a registration of a larger range).
    offset: u64,
    len: u64,
    _keep: Keep,
    cached: bool,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.reg.id)
            .field("id_offset", &self.offset)
            .field("iova", &self.iova())
            .field("len", &self.len)
            .field("device", &self.reg.device)
            .field("access", &self.reg.access)
            .field("cached", &self.cached)
            .finish()
    }
}

impl Registration {
    /// All of the daemon registration `reg`.
    fn whole(reg: Arc<DaemonReg>, keep: Keep, cached: bool) -> Self {
        let len = reg.len;
        Self { reg, offset: 0, len, _keep: keep, cached }
    }

    /// The daemon's registration id (what a copy names).
    pub fn id(&self) -> u64 {
        self.reg.id
    }

    /// Where this registration's first byte lies in the daemon registration [`id`](Self::id)
    /// names: 0, unless the cache answered this registration from a registration of a
    /// larger range of the same memory. A copy endpoint names `id` and an offset from
    /// there ([`Registration::at`] adds this).
    pub fn id_offset(&self) -> u64 {
        self.offset
    }

    /// IOVA of the first registered byte, in the device's DMA domain.
    pub fn iova(&self) -> u64 {
        self.reg.iova + self.offset
    }

    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device it was registered for.
    pub fn device(&self) -> &str {
        &self.reg.device
    }

    /// What the device may do.
    pub fn access(&self) -> Access {
        self.reg.access
    }

    /// Whether it came from (or went into) the session's registration cache.
    pub fn cached(&self) -> bool {
        self.cached
    }

    /// The daemon's id of the session it belongs to.
    pub fn session_id(&self) -> u64 {
        self.reg.session_id
    }
}

struct CacheState {
    cache: RegCache<Arc<DaemonReg>>,
    devices: FxHashMap<String, u32>,
}

/// The session's registration state: the cache and the live counters.
pub(crate) struct Registrations {
    state: Mutex<CacheState>,
    live: AtomicU64,
    bytes: AtomicU64,
}

impl Default for Registrations {
    fn default() -> Self {
        Self {
            state: Mutex::new(CacheState {
                cache: RegCache::new(CacheLimits::default()),
                devices: FxHashMap::default(),
            }),
            live: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }
}

impl Registrations {
    fn lock(&self) -> MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drops every cached registration of `owner` (freed, released, revoked): each is
    /// unregistered unless a user still holds it.
    pub(crate) fn invalidate(&self, owner: Owner) {
        let gone = self.lock().cache.invalidate(owner);
        drop(gone);
    }
}

/// Memory [`Session::register`] accepts: [`Region`], [`Import`], [`Mapping`],
/// [`HostBuffer`].
pub trait Registrable: sealed::Sealed {}

mod sealed {
    /// What the library registers.
    pub trait Sealed {
        fn source(&self) -> super::Src<'_>;
    }
}

/// The memory behind a [`Registrable`] (opaque).
#[doc(hidden)]
#[derive(Debug)]
pub enum Src<'a> {
    Fabric(&'a Arc<Mem>),
    Host(&'a Arc<HostMem>),
}

macro_rules! registrable {
    ($t:ty, $s:ident => $e:expr) => {
        impl sealed::Sealed for $t {
            fn source(&self) -> Src<'_> {
                let $s = self;
                $e
            }
        }
        impl Registrable for $t {}
    };
}
registrable!(Region, s => Src::Fabric(s.mem_arc()));
registrable!(Import, s => Src::Fabric(s.mem_arc()));
registrable!(Mapping, s => Src::Fabric(s.mem_arc()));
registrable!(HostBuffer, s => Src::Host(&s.0));

/// A daemon refusal made specific where the library can say more.
fn refusal(e: Error) -> Error {
    match e {
        Error::Refused { code: ErrorCode::LimitExceeded, limit: Some((ref what, used, requested, max)), .. } => {
            match what.as_str() {
                "pinned_bytes" => Error::PinnedLimit { used, requested, max },
                "RLIMIT_MEMLOCK" => Error::DaemonMemlockLimit { locked: used, requested, limit: max },
                _ => e,
            }
        }
        other => other,
    }
}

impl Session {
    /// Registers all of `memory` for DMA by `device` (its identity in text form). See
    /// [`Session::register_range`].
    pub fn register(&self, memory: &impl Registrable, device: &str, access: Access) -> Result<Registration> {
        let len = match memory.source() {
            Src::Fabric(m) => m.size,
            Src::Host(h) => h.len,
        };
        self.register_range(memory, 0, len, device, access)
    }

    /// Registers `len` bytes at `offset` of `memory` for DMA by `device`: the daemon pins
    /// them and maps them at an IOVA below the device's DMA mask. A registration of the
    /// same memory (same allocation and generation), device and access whose range is
    /// this one or contains it is answered from the session's cache without a round trip:
    /// for a containing range, the same daemon registration at this range's offset in it
    /// ([`Registration::id_offset`]; the IOVA is its IOVA plus that offset).
    ///
    /// Errors: [`Error::PinnedLimit`] past the daemon's per-user pinned-bytes limit,
    /// [`Error::DaemonMemlockLimit`] when the daemon's own `RLIMIT_MEMLOCK` refuses,
    /// [`Error::Revoked`] for a revoked import, [`Error::Disconnected`] once the session's
    /// connection ended and in a forked child (cached or not), and the daemon's other
    /// refusals.
    pub fn register_range(
        &self,
        memory: &impl Registrable,
        offset: u64,
        len: u64,
        device: &str,
        access: Access,
    ) -> Result<Registration> {
        // A cache hit asks the daemon nothing: a session whose connection ended (whose
        // registrations the daemon ended with it), or a forked child's copy, must not
        // answer one. Before the cache's lock, which another of the parent's threads may
        // have held at the fork.
        if self.inner.client.ended() {
            return Err(Error::Disconnected);
        }
        let (owner, size, keep) = match memory.source() {
            Src::Fabric(m) => {
                self.check_own(m, "register")?;
                self.live_or_forget(m)?;
                (m.cache_owner(), m.size, Keep::Fabric(m.clone()))
            }
            Src::Host(h) => (Owner::Host { buffer: h.id }, h.len, Keep::Host(h.clone())),
        };
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} do not fit the {size} bytes of the memory"
            )));
        }
        // Another session's host buffer: its drop empties its own session's cache, not
        // this one's, where an entry would keep the bytes pinned until evicted. Uncached.
        if let Src::Host(h) = memory.source()
            && !Arc::ptr_eq(&h.session, &self.inner)
        {
            let source = (RegisterSource::Fd, None);
            let reg = self.register_raw(source, offset, len, device, access, Some(h.fd.as_fd()), None)?;
            return Ok(Registration::whole(Arc::new(reg), keep, false));
        }
        let regs = &self.inner.registrations;
        let key = {
            let mut st = regs.lock();
            let next = st.devices.len() as u32;
            let dev = match st.devices.get(device) {
                Some(d) => *d,
                None => *st.devices.entry(device.to_owned()).or_insert(next),
            };
            let key = RegKey { owner, device: dev, writable: access == Access::ReadWrite, offset, len };
            st.cache.get(&key).map(|hit| (hit, key)).ok_or(key)
        };
        let key = match key {
            Ok(((reg, at), _)) => {
                // A revocation read since the check above: the daemon dropped the
                // registrations of that import.
                if let Keep::Fabric(m) = &keep {
                    self.live_or_forget(m)?;
                }
                return Ok(Registration { reg, offset: at, len, _keep: keep, cached: true });
            }
            Err(key) => key,
        };
        let (source, fd) = match (memory.source(), &keep) {
            (Src::Fabric(m), _) => (m.register_source(), None),
            (Src::Host(h), _) => ((RegisterSource::Fd, None), Some(h.fd.as_fd())),
        };
        let reg = Arc::new(self.register_raw(source, offset, len, device, access, fd, None)?);
        let out = regs.lock().cache.insert(key, reg.clone());
        let cached = !out.iter().any(|r| Arc::ptr_eq(r, &reg));
        drop(out);
        Ok(Registration::whole(reg, keep, cached))
    }

    /// Registers `len` bytes of this process's memory at `ptr` for DMA by `device`. The
    /// library locks the pages (`mlock`; [`Error::MemlockLimit`] names `RLIMIT_MEMLOCK`
    /// when that refuses) and marks them `MADV_DONTFORK`, so that a forked child never
    /// shares or copy-on-writes them; both are undone when the registration drops (for the
    /// pages no other registration holds). Never cached: an address says nothing about
    /// which allocation is there now.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory of this process that stays mapped until the
    /// registration is dropped (its drop returns once the daemon writes none of it, in a
    /// callback too); while it is registered read-write, no Rust reference to it
    /// may be live across a copy (a device may write it at any time). A child forked while
    /// it is registered does not have those pages at all: it must not touch them.
    pub unsafe fn register_ptr(
        &self,
        ptr: *const u8,
        len: usize,
        device: &str,
        access: Access,
    ) -> Result<Registration> {
        if ptr.is_null() || len == 0 {
            return Err(Error::InvalidArgument("register_ptr needs a non-NULL pointer and at least one byte".into()));
        }
        let addr = ptr as u64;
        let lock = PageLock::new(addr, len as u64)?;
        let reg = self.register_raw(
            (RegisterSource::Process { addr }, None),
            0,
            len as u64,
            device,
            access,
            None,
            Some(lock),
        )?;
        Ok(Registration::whole(Arc::new(reg), Keep::Pointer(self.inner.clone()), false))
    }

    /// Registers without the cache (a fresh daemon registration every time), e.g. to
    /// measure the miss path.
    pub fn register_uncached(&self, memory: &impl Registrable, device: &str, access: Access) -> Result<Registration> {
        let (source, len, fd, keep) = match memory.source() {
            Src::Fabric(m) => {
                self.check_own(m, "register")?;
                m.check_live()?;
                (m.register_source(), m.size, None, Keep::Fabric(m.clone()))
            }
            Src::Host(h) => ((RegisterSource::Fd, None), h.len, Some(h.fd.as_fd()), Keep::Host(h.clone())),
        };
        let reg = self.register_raw(source, 0, len, device, access, fd, None)?;
        Ok(Registration::whole(Arc::new(reg), keep, false))
    }

    /// `Ok` while `m` is live; a revoked import's cached registrations (which the daemon
    /// dropped with it) are forgotten, and the revocation returned.
    fn live_or_forget(&self, m: &Mem) -> Result<()> {
        m.check_live().inspect_err(|_| self.inner.registrations.invalidate(m.cache_owner()))
    }

    #[allow(clippy::too_many_arguments)]
    fn register_raw(
        &self,
        (source, node): (RegisterSource, Option<fabric_proto::wire::NodeId>),
        offset: u64,
        len: u64,
        device: &str,
        access: Access,
        fd: Option<BorrowedFd<'_>>,
        lock: Option<PageLock>,
    ) -> Result<DaemonReg> {
        let req = Request::Register(RegisterRequest {
            device: DeviceName::truncated(device),
            source,
            offset,
            len,
            access: access.wire(),
            node,
        });
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        let (resp, _) = match self.inner.client.call(req.clone(), &fds).map_err(refusal) {
            // Cached registrations no one holds count against the same limits: give them
            // back and try once more.
            Err(Error::PinnedLimit { .. } | Error::DaemonMemlockLimit { .. }) if self.evict_unused() > 0 => {
                self.inner.client.call(req, &fds).map_err(refusal)?
            }
            other => other?,
        };
        let Response::Register(r) = resp else { return Err(Error::Unexpected(Opcode::Register)) };
        // What the cache and `iova()` rely on: the bytes asked for, in an IOVA range that
        // does not wrap. Anything else is given back.
        if let Err(why) = check_answer(len, r.iova, r.len) {
            let undo = Request::Unregister(UnregisterRequest { registration: r.registration });
            // A bare pointer's pages stay locked until the daemon let go of them.
            let undone =
                if lock.is_some() { self.inner.client.undo_waiting(undo) } else { self.inner.client.undo(undo) };
            tracing::warn!(registration = r.registration, %why, ?undone, "a registration answer refused");
            return Err(Error::Unexpected(Opcode::Register));
        }
        let regs = &self.inner.registrations;
        regs.live.fetch_add(1, Ordering::Relaxed);
        regs.bytes.fetch_add(r.len, Ordering::Relaxed);
        tracing::debug!(registration = r.registration, iova = r.iova, len = r.len, device, "registered");
        Ok(DaemonReg {
            session: Arc::downgrade(&self.inner),
            session_id: self.inner.client.session(),
            id: r.registration,
            iova: r.iova,
            len: r.len,
            device: device.to_owned(),
            access,
            _lock: lock,
        })
    }

    /// Unregisters the cached registrations no user holds; returns how many.
    fn evict_unused(&self) -> usize {
        let gone = self.inner.registrations.lock().cache.evict_unused(|r| Arc::strong_count(r) == 1);
        let n = gone.len();
        drop(gone);
        tracing::debug!(evicted = n, "pinned limit reached: cached registrations given back");
        n
    }

    /// Allocates a page-aligned host buffer of at least `len` bytes for registration
    /// (memfd-backed; see [`HostBuffer`]).
    pub fn alloc_host(&self, len: u64) -> Result<HostBuffer> {
        HostBuffer::new(self.inner.clone(), len)
    }

    /// The registration cache's statistics and the session's live registrations.
    pub fn registration_stats(&self) -> RegistrationStats {
        let regs = &self.inner.registrations;
        RegistrationStats {
            cache: regs.lock().cache.stats(),
            live: regs.live.load(Ordering::Relaxed),
            registered_bytes: regs.bytes.load(Ordering::Relaxed),
        }
    }

    /// Bounds the registration cache (`entries` 0 turns it off); evicts what no longer
    /// fits.
    pub fn set_registration_cache(&self, limits: CacheLimits) {
        let gone = self.inner.registrations.lock().cache.set_limits(limits);
        drop(gone);
    }

    /// Empties the registration cache (each registration no user holds is unregistered).
    pub fn clear_registration_cache(&self) {
        let gone = self.inner.registrations.lock().cache.clear();
        drop(gone);
    }
}

#[cfg(test)]
mod tests {
    use super::check_answer;

    #[test]
    fn a_register_answer_of_other_bytes_or_a_wrapping_iova_is_refused() {
        assert_eq!(check_answer(4096, 0x1000, 4096), Ok(()));
        assert_eq!(check_answer(4096, u64::MAX - 4096, 4096), Ok(()));
        // Shorter than asked: a cached sub-range would describe IOVAs past it.
        assert!(check_answer(8192, 0x1000, 4096).unwrap_err().contains("8192 asked for"));
        // `iova()` would overflow (a panic in a debug build, inside a C call).
        assert!(check_answer(4096, u64::MAX - 4095, 4096).unwrap_err().contains("wraps"));
    }
}
