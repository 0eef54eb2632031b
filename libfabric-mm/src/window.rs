//! The unified window: one large reservation of the process's virtual address space (no
//! backing, no commit: `PROT_NONE`, `MAP_NORESERVE`) that mirrors a range of the global
//! fabric address space, so that `ptr = base + (gfa - window.gfa)` and pointer arithmetic
//! is GFA arithmetic. Memory is placed at its GFA with `MAP_FIXED` over the reservation,
//! and unplacing puts the reservation back (never `munmap`, which would open a hole another
//! allocation could take). A revoked import's placements are *fenced*: the reservation is
//! put back over them at once, while they stay placed until their mapping is dropped, so a
//! load or store through them faults. Placements are `MADV_DONTFORK`: a forked child has the
//! reservation but none of the memory placed in it.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use crate::error::{Error, Result};

/// Default bytes the window mirrors: 16 TiB (16 sim nodes of 1 TiB each, or 1/8 of the
/// 47-bit user address space of x86-64 with 4-level page tables).
pub const DEFAULT_WINDOW_LEN: u64 = 16 << 40;

/// The window's base address is congruent to its first GFA modulo this (1 GiB), so that a
/// GFA aligned to a huge page (2 MiB or 1 GiB) has an address aligned the same way, as
/// device-DAX mappings require.
pub(crate) const WINDOW_ALIGN: u64 = 1 << 30;

/// Where the window sits in GFA space and how large it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowConfig {
    /// First GFA the window mirrors (page-aligned).
    pub gfa: u64,
    /// Bytes mirrored (page-aligned, non-zero).
    pub len: u64,
}

impl Default for WindowConfig {
    fn default() -> Self {
        Self { gfa: 0, len: DEFAULT_WINDOW_LEN }
    }
}

impl WindowConfig {
    /// The default, overridden by `FABRIC_MM_WINDOW_GFA` and `FABRIC_MM_WINDOW_SIZE`
    /// (decimal or `0x` hex bytes) when set.
    pub fn from_env() -> Result<Self> {
        Ok(Self::env()?.unwrap_or_default())
    }

    /// The window `FABRIC_MM_WINDOW_GFA` and `FABRIC_MM_WINDOW_SIZE` name (the default's
    /// for the one not set), or `None` when neither is set.
    pub fn env() -> Result<Option<Self>> {
        let (gfa, len) = (env_u64("FABRIC_MM_WINDOW_GFA")?, env_u64("FABRIC_MM_WINDOW_SIZE")?);
        if gfa.is_none() && len.is_none() {
            return Ok(None);
        }
        let d = Self::default();
        Ok(Some(Self { gfa: gfa.unwrap_or(d.gfa), len: len.unwrap_or(d.len) }))
    }
}

fn env_u64(name: &str) -> Result<Option<u64>> {
    let Ok(v) = std::env::var(name) else { return Ok(None) };
    let t = v.trim();
    let parsed = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => t.parse(),
    };
    parsed.map(Some).map_err(|_| Error::InvalidArgument(format!("{name}={v:?} is not a byte count")))
}

/// The page size.
pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

/// The largest user virtual address on this machine: 2^47 with 4-level page tables, 2^56
/// with 5-level ones (the kernel hands out addresses above 2^47 only when asked with a
/// hint above it, so 2^47 is what a reservation can count on).
pub const USER_VA_LIMIT: u64 = 1 << 47;

/// One reserved range of addresses mirroring `len` bytes of GFA space from `gfa`.
#[derive(Debug, Clone, Copy)]
struct Aperture {
    base: usize,
    gfa: u64,
    len: u64,
}

impl Aperture {
    /// Reserves the aperture for `config` (checked by the caller).
    fn reserve(config: WindowConfig) -> Result<Self> {
        let len = usize::try_from(config.len)
            .map_err(|_| Error::WindowReserve { len: config.len, why: "larger than a pointer".into() })?;
        // Over-reserve so that the base can sit at the GFA's offset modulo WINDOW_ALIGN:
        // device memory (a DAX device) maps only at addresses aligned like its GFA (2 MiB,
        // or 1 GiB for a DAX device with that `align`).
        let slack = 2 * WINDOW_ALIGN as usize;
        let total = len
            .checked_add(slack)
            .ok_or_else(|| Error::WindowReserve { len: config.len, why: "larger than a pointer".into() })?;
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address the kernel picks; it
        // aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::WindowReserve { len: config.len, why: format!("the kernel refused: {e}") });
        }
        let start = p as usize;
        let base = start.next_multiple_of(WINDOW_ALIGN as usize) + (config.gfa % WINDOW_ALIGN) as usize;
        let (head, tail) = (base - start, start + total - (base + len));
        // SAFETY: `start..base` and `base+len..start+total` lie inside the reservation just
        // made, which nothing references yet; only the aperture's own range stays.
        unsafe {
            if head > 0 {
                libc::munmap(p, head);
            }
            if tail > 0 {
                libc::munmap((base + len) as *mut libc::c_void, tail);
            }
        }
        tracing::debug!(base = ?(base as *const u8), gfa = config.gfa, len = config.len, "reserved a window aperture");
        Ok(Self { base, gfa: config.gfa, len: config.len })
    }

    /// The offset of `gfa..gfa+len` in the aperture, when it lies inside.
    fn offset(&self, gfa: u64, len: u64) -> Option<u64> {
        let off = gfa.checked_sub(self.gfa)?;
        (off.checked_add(len)? <= self.len && off < self.len).then_some(off)
    }
}

/// The apertures and what is placed in them.
#[derive(Debug, Default)]
struct Placements {
    /// Apertures beyond the first (a domain window's other node spans): first GFA → it.
    more: BTreeMap<u64, Aperture>,
    /// Placed ranges by start GFA.
    placed: BTreeMap<u64, Placed>,
}

/// One placed range.
#[derive(Debug)]
struct Placed {
    len: u64,
    /// Its protection (`PROT_*`), which a soft fence keeps.
    prot: libc::c_int,
    /// The import it maps, when a revocation of that import fences it
    /// ([`Window::fence`]).
    import: Option<u64>,
    /// Whether it is fenced, and what keeps a fence out while the library touches it.
    access: Arc<Access>,
    /// Its pages stay out of forked children while it is placed, whatever page locks of
    /// bare pointers inside it come and go.
    _kept: crate::hostmem::KeptOut,
}

/// Whether a placement is fenced (the reservation back over it), behind a lock that the
/// library's own accesses to its pages (`Mapping::flush`, `Mapping::invalidate`) hold
/// shared, so that a fence, which takes it exclusive, never lands under them.
#[derive(Debug, Default)]
pub(crate) struct Access(RwLock<bool>);

impl Access {
    /// The pages may be touched while the guard lives; `None` once fenced.
    pub(crate) fn enter(&self) -> Option<RwLockReadGuard<'_, bool>> {
        let g = self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        (!*g).then_some(g)
    }
}

/// The reserved range: one aperture of [`WindowConfig`], and in a domain one more aperture
/// of a node span for each other node whose memory is placed (see [`Window::for_domain`]).
#[derive(Debug)]
pub struct Window {
    first: Aperture,
    /// A domain's node span: GFAs outside `first` get an aperture of their node's span.
    span: Option<u64>,
    state: Mutex<Placements>,
    /// Fences are soft ([`Window::fence_softly`]).
    soft: bool,
    /// The process that reserved it: in a forked child the placements are holes
    /// (`MADV_DONTFORK`) where the child's own mappings may lie, so neither they nor the
    /// apertures are touched there.
    origin: crate::origin::Origin,
}

/// Protection for a placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// Loads only.
    Read,
    /// Loads and stores.
    ReadWrite,
}

fn checked(config: WindowConfig) -> Result<WindowConfig> {
    let page = page_size();
    if config.len == 0 || !config.len.is_multiple_of(page) || !config.gfa.is_multiple_of(page) {
        return Err(Error::InvalidArgument(format!(
            "window gfa {:#x} and len {:#x} must be non-zero multiples of the page size {page:#x}",
            config.gfa, config.len
        )));
    }
    if config.gfa.checked_add(config.len).is_none_or(|end| end > 1 << 57) {
        return Err(Error::InvalidArgument(format!(
            "window {:#x}+{:#x} exceeds the 57-bit GFA space",
            config.gfa, config.len
        )));
    }
    if config.len >= USER_VA_LIMIT {
        return Err(Error::WindowReserve {
            len: config.len,
            why: format!("larger than the {USER_VA_LIMIT:#x}-byte (47-bit) user address space"),
        });
    }
    Ok(config)
}

impl Window {
    /// Reserves the window: one range mirroring `config`.
    pub fn reserve(config: WindowConfig) -> Result<Self> {
        let first = Aperture::reserve(checked(config)?)?;
        Ok(Self {
            first,
            span: None,
            state: Mutex::new(Placements::default()),
            soft: false,
            origin: crate::origin::Origin::here(),
        })
    }

    /// Reserves the window of a domain node's client: an aperture mirroring the node span
    /// from `own` (this node's slot) now, and one more of the span's size, at its node's
    /// slot, the first time memory of another node is placed. A domain's address space
    /// (up to 2^57 bytes over thousands of slots) is larger than a process's, so the
    /// window mirrors the node spans in use, not the whole map; pointer arithmetic is GFA
    /// arithmetic within each node's span.
    pub fn for_domain(own: u64, span: u64) -> Result<Self> {
        if !span.is_power_of_two() || !own.is_multiple_of(span) {
            return Err(Error::InvalidArgument(format!(
                "a domain window needs a power-of-two node span ({span:#x}) and a slot at a multiple of it ({own:#x})"
            )));
        }
        let first = Aperture::reserve(checked(WindowConfig { gfa: own, len: span })?)?;
        Ok(Self {
            first,
            span: Some(span),
            state: Mutex::new(Placements::default()),
            soft: false,
            origin: crate::origin::Origin::here(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Placements> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// First byte of the window (of its first aperture, in a domain this node's span).
    pub fn base(&self) -> *mut u8 {
        self.first.base as *mut u8
    }

    /// Where the window (its first aperture) sits in GFA space.
    pub fn config(&self) -> WindowConfig {
        WindowConfig { gfa: self.first.gfa, len: self.first.len }
    }

    /// A domain window's node span; `None` for a window of one range.
    pub fn node_span(&self) -> Option<u64> {
        self.span
    }

    /// The aperture holding `gfa..gfa+len`, among those reserved.
    fn aperture(&self, st: &Placements, gfa: u64, len: u64) -> Option<(Aperture, u64)> {
        if let Some(off) = self.first.offset(gfa, len) {
            return Some((self.first, off));
        }
        let (_, a) = st.more.range(..=gfa).next_back()?;
        a.offset(gfa, len).map(|off| (*a, off))
    }

    /// The address of `gfa`, if the window mirrors it now.
    pub fn ptr_of(&self, gfa: u64) -> Option<*mut u8> {
        let st = self.lock();
        let (a, off) = self.aperture(&st, gfa, 1)?;
        Some((a.base as *mut u8).wrapping_add(off as usize))
    }

    /// The GFA an address inside the window mirrors.
    pub fn gfa_of(&self, ptr: *const u8) -> Option<u64> {
        let at = |a: &Aperture| {
            let off = (ptr as usize).checked_sub(a.base).filter(|o| (*o as u64) < a.len)?;
            Some(a.gfa + off as u64)
        };
        if let Some(g) = at(&self.first) {
            return Some(g);
        }
        self.lock().more.values().find_map(at)
    }

    /// The aperture for `gfa..gfa+len` and its offset there, reserving its node span's
    /// aperture in a domain window.
    fn check(&self, st: &mut Placements, gfa: u64, len: u64) -> Result<(Aperture, u64)> {
        let page = page_size();
        if len == 0 || !gfa.is_multiple_of(page) || !len.is_multiple_of(page) {
            return Err(Error::InvalidArgument(format!("GFA range {gfa:#x}+{len:#x} is not page-aligned")));
        }
        if let Some(found) = self.aperture(st, gfa, len) {
            return Ok(found);
        }
        let outside = || Error::OutsideWindow { gfa, len, window_gfa: self.first.gfa, window_len: self.first.len };
        let Some(span) = self.span else { return Err(outside()) };
        let node = gfa - gfa % span;
        if gfa.checked_add(len).is_none_or(|end| end > node.saturating_add(span)) {
            // Memory never straddles two node spans; such a range is not one node's.
            return Err(outside());
        }
        let a = Aperture::reserve(checked(WindowConfig { gfa: node, len: span })?)?;
        st.more.insert(node, a);
        Ok((a, gfa - node))
    }

    /// Maps `len` bytes of `fd` from `offset` at `gfa`'s place in the window.
    pub fn place(&self, gfa: u64, len: u64, fd: BorrowedFd<'_>, offset: u64, prot: Protection) -> Result<*mut u8> {
        self.place_as(gfa, len, fd, offset, prot, None).map(|(p, _)| p)
    }

    /// [`Window::place`], tagged with `import` when a revocation of that import is to
    /// fence it ([`Window::fence`]); with the placement's [`Access`].
    pub(crate) fn place_as(
        &self,
        gfa: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
        prot: Protection,
        import: Option<u64>,
    ) -> Result<(*mut u8, Arc<Access>)> {
        if self.origin.forked() {
            return Err(Error::InvalidArgument(
                "this window is a forked child's copy of its parent's: open a session in the child".into(),
            ));
        }
        let mut st = self.lock();
        let (a, off) = self.check(&mut st, gfa, len)?;
        let overlaps = st.placed.range(..gfa + len).next_back().is_some_and(|(s, p)| s + p.len > gfa);
        if overlaps {
            return Err(Error::AlreadyMapped { gfa, len });
        }
        let addr = (a.base as *mut u8).wrapping_add(off as usize);
        let prot = match prot {
            Protection::Read => libc::PROT_READ,
            Protection::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        };
        let file_off = libc::off_t::try_from(offset)
            .map_err(|_| Error::InvalidArgument(format!("offset {offset:#x} too large")))?;
        // No fork from the map to the advice and the listing (`hostmem::unforked`).
        let kept = crate::hostmem::unforked(|| {
            // SAFETY: `addr..addr+len` lies inside one of our apertures (checked above) and
            // no other placement covers it (checked under the lock), so MAP_FIXED replaces
            // only reserved PROT_NONE pages that nothing references.
            let p = unsafe {
                libc::mmap(
                    addr.cast(),
                    len as usize,
                    prot,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.as_raw_fd(),
                    file_off,
                )
            };
            if p == libc::MAP_FAILED {
                let source = std::io::Error::last_os_error();
                refill(addr, len);
                return Err(Error::Os { what: "mapping memory into the window", source });
            }
            // Listed before the advice: a child has the range reserved.
            let kept = crate::hostmem::KeptOut::new(addr, len);
            // Not inherited by a forked child (the child has the parent's sessions but not
            // their reader threads: it must not reach the parent's memory through them).
            // The fresh reservation `reserve_again` maps over a placement is a new mapping
            // without the advice, so unplacing needs no `MADV_DOFORK`.
            if !crate::hostmem::madvise(addr.cast(), len as usize, libc::MADV_DONTFORK) {
                let source = std::io::Error::last_os_error();
                drop(kept);
                if let Err(e) = self.reserve_again(&st, gfa, len) {
                    tracing::warn!(gfa, len, error = %e, "cannot take back a placement refused MADV_DONTFORK");
                }
                return Err(Error::Os {
                    what: "keeping a window mapping out of forked children (MADV_DONTFORK)",
                    source,
                });
            }
            Ok(kept)
        })?;
        let access = Arc::new(Access::default());
        st.placed.insert(gfa, Placed { len, prot, import, access: access.clone(), _kept: kept });
        Ok((addr, access))
    }

    /// Puts the reservation back over every placement of `import` now, keeping them placed
    /// (nothing else is placed there until their mappings are dropped): from now on a load
    /// or store through them faults (`SIGSEGV`). Returns how many were fenced.
    pub(crate) fn fence(&self, import: u64) -> usize {
        // Found under the window lock, fenced one by one without holding it across the
        // wait below: a flush in progress holds up this fence only, never another
        // placement. (Lock order: a placement's access, then the window.)
        let found: Vec<(u64, u64, libc::c_int, Arc<Access>)> = (self.lock().placed.iter())
            .filter(|(_, p)| p.import == Some(import))
            .map(|(g, p)| (*g, p.len, p.prot, p.access.clone()))
            .collect();
        let mut fenced = 0;
        for (gfa, len, prot, access) in found {
            // Waits for the library's own accesses to the pages (a flush) to end.
            let mut done = access.0.write().unwrap_or_else(std::sync::PoisonError::into_inner);
            if *done {
                continue;
            }
            let st = self.lock();
            // Unplaced meanwhile (and perhaps placed again, for another mapping): skipped.
            if !st.placed.get(&gfa).is_some_and(|p| Arc::ptr_eq(&p.access, &access)) {
                continue;
            }
            // A soft fence that cannot be made (its writable pages charged where memory is
            // not overcommitted) is made read-only (never charged), else hard: the
            // revoked memory is never left mapped.
            let fence = if self.soft {
                self.blank(&st, gfa, len, prot)
                    .or_else(|_| self.blank(&st, gfa, len, libc::PROT_READ))
                    .or_else(|_| self.reserve_again(&st, gfa, len))
            } else {
                self.reserve_again(&st, gfa, len)
            };
            match fence {
                Ok(()) => {
                    *done = true;
                    fenced += 1;
                }
                Err(e) => tracing::warn!(gfa, import, error = %e, "cannot fence a revoked import's mapping"),
            }
        }
        fenced
    }

    /// Puts the reservation back over a placement made by [`Window::place`].
    pub fn unplace(&self, gfa: u64) -> Result<()> {
        let mut st = self.lock();
        let Some(len) = st.placed.get(&gfa).map(|p| p.len) else {
            return Err(Error::InvalidArgument(format!("nothing is placed at GFA {gfa:#x}")));
        };
        self.reserve_again(&st, gfa, len)?;
        st.placed.remove(&gfa);
        Ok(())
    }

    /// Makes fences soft: a fenced placement gets private zero pages of its protection
    /// instead of the reservation, so loads through it read zeros and stores land in this
    /// process's own memory — neither faults, and neither reaches the revoked memory. For
    /// callers that cannot survive a fault in code that reads a mapping (a Python view).
    pub fn fence_softly(mut self) -> Self {
        self.soft = true;
        self
    }

    /// Private zero pages of protection `prot` over the placement at `gfa` (the caller
    /// holds the lock): a soft fence.
    fn blank(&self, st: &Placements, gfa: u64, len: u64, prot: libc::c_int) -> Result<()> {
        let Some(addr) = self.placed_at(st, gfa, len)? else { return Ok(()) };
        // SAFETY: the range is one of our placements inside an aperture; private zero
        // pages replace the mapping of the revoked memory. What points into it reads and
        // writes those pages from now on.
        let p = unsafe { anon_at(addr, len, prot, libc::MAP_FIXED) };
        if p == libc::MAP_FAILED {
            let source = std::io::Error::last_os_error();
            // A kernel before 6.12 may have taken the old mapping away first.
            refill(addr, len);
            return Err(Error::Os { what: "blanking a revoked mapping", source });
        }
        // Kept out of forked children as the placement was (what is written here after
        // the revocation is this process's).
        crate::hostmem::madvise(addr.cast(), len as usize, libc::MADV_DONTFORK);
        Ok(())
    }

    /// The address of the placement at `gfa` (`len` bytes) to map over; `None` in a forked
    /// child, where it is a hole the child's own mappings may lie in, not to be touched.
    fn placed_at(&self, st: &Placements, gfa: u64, len: u64) -> Result<Option<*mut u8>> {
        if self.origin.forked() {
            return Ok(None);
        }
        let (a, off) =
            self.aperture(st, gfa, len).ok_or(Error::InvalidArgument(format!("GFA {gfa:#x} outside the window")))?;
        Ok(Some((a.base as *mut u8).wrapping_add(off as usize)))
    }

    /// Fresh reservation pages over the placement at `gfa` (the caller holds the lock).
    fn reserve_again(&self, st: &Placements, gfa: u64, len: u64) -> Result<()> {
        let Some(addr) = self.placed_at(st, gfa, len)? else { return Ok(()) };
        // SAFETY: the range is one of our placements inside an aperture; replacing it with
        // fresh PROT_NONE pages drops the mapping. What still points into it (a Mapping
        // not yet dropped, when fencing) faults on access instead of reaching the memory.
        let p = unsafe { anon_at(addr, len, libc::PROT_NONE, libc::MAP_FIXED) };
        if p == libc::MAP_FAILED {
            return Err(Error::Os {
                what: "restoring the window reservation",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// Ranges placed now: (GFA, bytes).
    pub fn placements(&self) -> Vec<(u64, u64)> {
        self.lock().placed.iter().map(|(g, p)| (*g, p.len)).collect()
    }

    /// The apertures reserved now: (first GFA, bytes), the first one first.
    pub fn apertures(&self) -> Vec<(u64, u64)> {
        let more = self.lock().more.values().map(|a| (a.gfa, a.len)).collect::<Vec<_>>();
        std::iter::once((self.first.gfa, self.first.len)).chain(more).collect()
    }
}

/// Maps `len` bytes of private anonymous pages of protection `prot` (a reservation with
/// `PROT_NONE`; nothing committed) at `addr` with `fixed` (`MAP_FIXED` or
/// `MAP_FIXED_NOREPLACE`); what `mmap` returns.
///
/// # Safety
/// With `MAP_FIXED`, whatever is mapped at the range is replaced: it must be the window's.
unsafe fn anon_at(addr: *mut u8, len: u64, prot: libc::c_int, fixed: libc::c_int) -> *mut libc::c_void {
    // SAFETY: the caller's contract.
    unsafe {
        libc::mmap(
            addr.cast(),
            len as usize,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed,
            -1,
            0,
        )
    }
}

/// Reserves `len` bytes at `addr` where nothing is mapped (`MAP_FIXED_NOREPLACE`);
/// whether they are reserved now. A kernel that takes the flag for a hint and maps them
/// elsewhere has that mapping undone.
pub(crate) fn reserve_hole(addr: *mut u8, len: u64) -> bool {
    // SAFETY: NOREPLACE maps only where nothing is mapped: it replaces nothing.
    let r = unsafe { anon_at(addr, len, libc::PROT_NONE, libc::MAP_FIXED_NOREPLACE) };
    if r != libc::MAP_FAILED && r != addr.cast() {
        // SAFETY: the mapping just made at `r`, not ours to keep.
        unsafe { libc::munmap(r, len as usize) };
    }
    r == addr.cast()
}

/// Puts reservation pages back where they are missing in `len` bytes at `addr`, after a
/// placement there was refused: a kernel before 6.12 removes the reservation before the
/// file's own `mmap` may refuse, and leaves a hole that any mapping of the process could
/// take (and a later placement would replace, or the window's end unmap). Never replaces
/// anything (`MAP_FIXED_NOREPLACE`): where the reservation survived, or something else
/// took the range meanwhile, it is left alone.
fn refill(addr: *mut u8, len: u64) {
    use crate::hostmem::PAGE;
    crate::hostmem::reserve_holes_in(addr as u64 / PAGE, (addr as u64).saturating_add(len).div_ceil(PAGE));
}

impl Drop for Window {
    fn drop(&mut self) {
        if self.origin.forked() {
            return;
        }
        let st = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        for a in std::iter::once(&self.first).chain(st.more.values()) {
            // SAFETY: each aperture (with any placements still in it) is ours; the Session
            // that owns the window outlives every Mapping (they borrow it).
            unsafe {
                libc::munmap(a.base as *mut libc::c_void, a.len as usize);
            }
        }
    }
}

// SAFETY: the window's address range is process-global memory; all mutation of the
// placement table goes through the mutex, and mmap is thread-safe.
unsafe impl Send for Window {}
// SAFETY: as above.
unsafe impl Sync for Window {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn small() -> WindowConfig {
        WindowConfig { gfa: 1 << 30, len: 1 << 30 }
    }

    #[test]
    fn pointer_arithmetic_is_gfa_arithmetic() {
        let w = Window::reserve(small()).unwrap();
        let p = w.ptr_of((1 << 30) + 4096).unwrap();
        assert_eq!(p as usize - w.base() as usize, 4096);
        assert_eq!(w.gfa_of(p), Some((1 << 30) + 4096));
        assert_eq!(w.ptr_of(0), None);
        assert_eq!(w.ptr_of(2 << 30), None);
        assert_eq!(w.gfa_of(w.base().wrapping_add(1 << 30)), None);
    }

    /// Whether the page at `p` is mapped at all (`mincore` says `ENOMEM` for a hole).
    fn mapped(p: *mut u8) -> bool {
        let mut v = [0u8; 1];
        // SAFETY: mincore reads nothing at `p`; it only asks the kernel about the page.
        unsafe { libc::mincore(p.cast(), 4096, v.as_mut_ptr()) == 0 }
    }

    /// A placement the file's own `mmap` refuses (a read-write mapping of a memfd sealed
    /// against writes) leaves the reservation in place, not a hole another mapping of the
    /// process could take (and a later placement or the window's end would then replace
    /// or unmap). Before, the range was left unmapped.
    #[test]
    fn a_refused_placement_leaves_the_reservation() {
        let w = Window::reserve(small()).unwrap();
        // SAFETY: a NUL-terminated name and flags; the result is checked.
        let fd = unsafe { libc::memfd_create(c"sealed".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: just created, owned by nothing else.
        let f = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(8192).unwrap();
        // SAFETY: F_ADD_SEALS on our own memfd.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_WRITE) }, 0);
        let gfa = (1 << 30) + (1 << 20);
        let at = w.ptr_of(gfa).unwrap();
        assert!(w.place(gfa, 8192, f.as_fd(), 0, Protection::ReadWrite).is_err());
        assert!(mapped(at), "the refused placement left a hole in the window");
        assert!(w.placements().is_empty());
        // The same range takes a placement the file allows.
        w.place(gfa, 8192, f.as_fd(), 0, Protection::Read).unwrap();
    }

    /// What a refused placement's clean-up does where the kernel left a hole (this test's
    /// kernel keeps the reservation: the hole is made by hand): the missing pages are
    /// reserved again, and pages that are there are left as they are.
    #[test]
    fn holes_after_a_refused_placement_are_reserved_again() {
        let w = Window::reserve(small()).unwrap();
        let at = w.ptr_of((1 << 30) + (1 << 20)).unwrap();
        // SAFETY: one page of the window's own reservation.
        assert_eq!(unsafe { libc::munmap(at.wrapping_add(4096).cast(), 4096) }, 0);
        assert!(!mapped(at.wrapping_add(4096)));
        refill(at, 3 * 4096);
        assert!((0..3).all(|i| mapped(at.wrapping_add(i * 4096))), "the hole is reserved again");
    }

    #[test]
    fn placements_map_files_and_refuse_overlap_and_outside() {
        let w = Window::reserve(small()).unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        let gfa = (1 << 30) + (1 << 20);
        let p = w.place(gfa, 8192, f.as_fd(), 0, Protection::ReadWrite).unwrap();
        // SAFETY: p..p+8192 was just mapped read-write from an 8 KiB file.
        unsafe {
            assert_eq!(*p.add(4096), 7);
            *p = 9;
        }
        assert!(matches!(w.place(gfa + 4096, 4096, f.as_fd(), 0, Protection::Read), Err(Error::AlreadyMapped { .. })));
        assert!(matches!(w.place(0, 4096, f.as_fd(), 0, Protection::Read), Err(Error::OutsideWindow { .. })));
        assert!(matches!(
            w.place((2 << 30) - 4096, 8192, f.as_fd(), 0, Protection::Read),
            Err(Error::OutsideWindow { .. })
        ));
        assert_eq!(w.placements(), vec![(gfa, 8192)]);
        w.unplace(gfa).unwrap();
        assert!(w.placements().is_empty());
        let mut back = [0u8; 1];
        std::os::unix::fs::FileExt::read_at(&f, &mut back, 0).unwrap();
        assert_eq!(back[0], 9, "the store went to the file");
        // The range is placeable again.
        w.place(gfa, 4096, f.as_fd(), 0, Protection::Read).unwrap();
    }

    /// A child forked while another thread places and unplaces a file never has the
    /// placement's shared mapping: a fork waits for a placement between its `mmap` and
    /// its `MADV_DONTFORK` (before, a child forked in between kept the memory, which the
    /// parent's fence of a revoked import never reaches).
    #[test]
    fn a_child_forked_while_another_thread_places_never_has_the_placement() {
        let w = Arc::new(Window::reserve(small()).unwrap());
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        let gfa = (1 << 30) + (1 << 20);
        let at = w.ptr_of(gfa).unwrap() as usize;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let placer = {
            let (w, stop) = (w.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    w.place(gfa, 1 << 20, f.as_fd(), 0, Protection::Read).unwrap();
                    w.unplace(gfa).unwrap();
                    rounds += 1;
                }
                rounds
            })
        };
        let mut inherited = 0;
        for _ in 0..300 {
            // SAFETY: the child only reads /proc/self/maps (glibc's malloc is fork-safe)
            // and leaves with _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
                let shared = maps.lines().any(|l| {
                    let mut f = l.split_whitespace();
                    let (range, perms) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
                    let (lo, hi) = range.split_once('-').unwrap_or(("0", "0"));
                    let (lo, hi) =
                        (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
                    (lo..hi).contains(&at) && perms.ends_with('s')
                });
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(i32::from(shared)) };
            }
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            assert!(libc::WIFEXITED(status));
            inherited += libc::WEXITSTATUS(status);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let rounds = placer.join().unwrap();
        assert_eq!(inherited, 0, "{inherited} of 300 children had the placement ({rounds} placements meanwhile)");
        assert!(rounds > 0);
    }

    /// The permissions `/proc/self/maps` gives the page at `p` (`rw-s`, `---p`, …).
    fn perms(p: *const u8) -> String {
        let at = p as usize;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        for line in maps.lines() {
            let mut f = line.split_whitespace();
            let (range, perms) = (f.next().unwrap(), f.next().unwrap());
            let (lo, hi) = range.split_once('-').unwrap();
            let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap(), usize::from_str_radix(hi, 16).unwrap());
            if (lo..hi).contains(&at) {
                return perms.to_owned();
            }
        }
        panic!("{at:#x} is not mapped");
    }

    use crate::hostmem::tests::vm_flags;

    #[test]
    fn placements_are_not_inherited_by_a_forked_child_and_unplacing_takes_that_back() {
        let w = Window::reserve(small()).unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        let gfa = (1 << 30) + (1 << 20);
        assert!(!vm_flags(w.ptr_of(gfa).unwrap()).contains(&"dc".to_owned()), "the reservation is inherited");
        let p = w.place(gfa, 8192, f.as_fd(), 0, Protection::ReadWrite).unwrap();
        // `dc`: VM_DONTCOPY, what MADV_DONTFORK sets; on every page of the placement.
        for page in [p, p.wrapping_add(4096)] {
            assert!(vm_flags(page).contains(&"dc".to_owned()), "{:?}", vm_flags(page));
        }
        let (_, access) = w.place_as(gfa + (1 << 20), 4096, f.as_fd(), 0, Protection::Read, Some(3)).unwrap();
        assert!(vm_flags(p.wrapping_add(1 << 20)).contains(&"dc".to_owned()), "an import's placement too");
        // Unplaced or fenced, the range is the reservation again: inherited, as before.
        w.unplace(gfa).unwrap();
        assert!(!vm_flags(p).contains(&"dc".to_owned()), "{:?}", vm_flags(p));
        assert_eq!(w.fence(3), 1);
        assert!(access.enter().is_none());
        assert!(!vm_flags(p.wrapping_add(1 << 20)).contains(&"dc".to_owned()));
    }

    /// A soft fence puts private zero pages of the placement's protection over it: loads
    /// read zeros, stores stay in this process, nothing reaches the file any more, and the
    /// placement stays (kept out of forked children) until it is unplaced.
    #[test]
    fn a_soft_fence_blanks_a_placement_and_keeps_it_placed() {
        let w = Window::reserve(small()).unwrap().fence_softly();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        let gfa = (1 << 30) + (1 << 20);
        let (p, access) = w.place_as(gfa, 8192, f.as_fd(), 0, Protection::ReadWrite, Some(9)).unwrap();
        assert_eq!(w.fence(9), 1);
        assert!(access.enter().is_none(), "fenced");
        assert_eq!(perms(p), "rw-p");
        assert!(vm_flags(p).contains(&"dc".to_owned()), "still kept out of forked children");
        // SAFETY: the blanked pages are this process's, mapped read-write.
        unsafe {
            assert_eq!(p.read_volatile(), 0);
            p.write_volatile(1);
        }
        let mut back = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 0).unwrap();
        assert_eq!(back[0], 7, "the store did not reach the file");
        assert_eq!(w.placements(), vec![(gfa, 8192)]);
        w.unplace(gfa).unwrap();
        assert_eq!(perms(p), "---p");
    }

    #[test]
    fn fencing_an_import_takes_its_placements_back_and_keeps_them_placed() {
        let w = Window::reserve(small()).unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        let (a, b, c) = ((1 << 30) + (1 << 20), (1 << 30) + (2 << 20), (1 << 30) + (3 << 20));
        let (pa, access) = w.place_as(a, 4096, f.as_fd(), 0, Protection::ReadWrite, Some(5)).unwrap();
        let (pb, _) = w.place_as(b, 4096, f.as_fd(), 4096, Protection::Read, Some(6)).unwrap();
        let pc = w.place(c, 4096, f.as_fd(), 0, Protection::Read).unwrap();
        assert_eq!((perms(pa), perms(pb), perms(pc)), ("rw-s".into(), "r--s".into(), "r--s".into()));
        // A fence waits for the library's own access to the pages to end.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            let inside = access.enter().expect("not fenced yet");
            s.spawn(|| {
                let _ = tx.send(w.fence(5));
            });
            assert!(rx.recv_timeout(std::time::Duration::from_millis(100)).is_err(), "fenced under an access");
            // Meanwhile the window places and unplaces other memory: the waiting fence
            // does not hold its lock.
            let d = (1 << 30) + (4 << 20);
            w.place(d, 4096, f.as_fd(), 0, Protection::Read).unwrap();
            w.unplace(d).unwrap();
            // SAFETY: a..a+4096 is mapped read-write from the file, and held unfenced.
            assert_eq!(unsafe { *pa }, 7);
            drop(inside);
            assert_eq!(rx.recv().unwrap(), 1);
        });
        assert!(access.enter().is_none());
        assert_eq!(perms(pa), "---p", "the file is no longer mapped there");
        assert_eq!((perms(pb), perms(pc)), ("r--s".into(), "r--s".into()), "other placements untouched");
        assert_eq!(w.fence(5), 0, "fenced once");
        assert_eq!(w.fence(9), 0);
        // Still placed: nothing else lands there until it is unplaced.
        assert_eq!(w.placements().len(), 3);
        assert!(matches!(w.place(a, 4096, f.as_fd(), 0, Protection::Read), Err(Error::AlreadyMapped { .. })));
        w.unplace(a).unwrap();
        w.place(a, 4096, f.as_fd(), 0, Protection::Read).unwrap();
        // SAFETY: a..a+4096 was just mapped read-only from the file.
        assert_eq!(unsafe { *pa }, 7);
    }

    #[test]
    fn a_domain_window_mirrors_each_node_span_placed_in() {
        let span = 1u64 << 30;
        let own = 4 * span;
        assert!(matches!(Window::for_domain(own, 3 << 29), Err(Error::InvalidArgument(_))));
        assert!(matches!(Window::for_domain(own + 4096, span), Err(Error::InvalidArgument(_))));
        let w = Window::for_domain(own, span).unwrap();
        assert_eq!(w.config(), WindowConfig { gfa: own, len: span });
        assert_eq!(w.node_span(), Some(span));
        assert_eq!(w.ptr_of(9 * span), None, "no aperture before memory of that node is placed");
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[5u8; 8192]).unwrap();
        let mine = w.place(own + 8192, 4096, f.as_fd(), 0, Protection::ReadWrite).unwrap();
        assert_eq!(mine as usize - w.base() as usize, 8192);
        // Another node's memory: its span gets an aperture, and within it addresses keep
        // the GFA arithmetic.
        let far = 9 * span + (6 << 20);
        let p = w.place(far, 8192, f.as_fd(), 0, Protection::ReadWrite).unwrap();
        assert_eq!(w.apertures(), vec![(own, span), (9 * span, span)]);
        assert_eq!(w.ptr_of(far + 4096), Some(p.wrapping_add(4096)));
        assert_eq!(w.gfa_of(p.wrapping_add(4096)), Some(far + 4096));
        assert_eq!(p as usize % (2 << 20), 0, "a 2 MiB-aligned GFA keeps its alignment");
        // SAFETY: p..p+8192 was just mapped read-write from an 8 KiB file, and `mine` maps
        // its first page.
        unsafe {
            *p = 1;
            assert_eq!(*mine, 1, "both placements map the same file page");
        }
        // A range across two node spans is no node's memory.
        let e = w.place(10 * span - 4096, 8192, f.as_fd(), 0, Protection::Read).unwrap_err();
        assert!(matches!(e, Error::OutsideWindow { .. }), "{e}");
        assert!(matches!(w.place(far, 4096, f.as_fd(), 0, Protection::Read), Err(Error::AlreadyMapped { .. })));
        w.unplace(far).unwrap();
        w.place(far, 4096, f.as_fd(), 0, Protection::Read).unwrap();
        assert_eq!(w.apertures().len(), 2, "the aperture is reused");
    }

    #[test]
    fn oversize_windows_fail_with_the_address_space_limit() {
        let e = Window::reserve(WindowConfig { gfa: 0, len: 1 << 47 }).unwrap_err();
        assert!(matches!(e, Error::WindowReserve { .. }), "{e}");
        assert!(e.to_string().contains("47-bit"), "{e}");
        let e = Window::reserve(WindowConfig { gfa: 1 << 57, len: 4096 }).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
        let e = Window::reserve(WindowConfig { gfa: 0, len: 100 }).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }

    #[test]
    fn huge_page_aligned_gfas_get_aligned_addresses() {
        for gfa in [0u64, 1 << 30, (1 << 30) + (6 << 20), 4096] {
            let w = Window::reserve(WindowConfig { gfa, len: 8 << 30 }).unwrap();
            let p = w.ptr_of(gfa.next_multiple_of(2 << 20)).unwrap() as usize;
            assert_eq!(p % (2 << 20), 0, "window gfa {gfa:#x}: a 2 MiB-aligned GFA at {p:#x}");
            let g = gfa.next_multiple_of(WINDOW_ALIGN);
            let p = w.ptr_of(g).unwrap() as usize;
            assert_eq!(p as u64 % WINDOW_ALIGN, 0, "window gfa {gfa:#x}: a 1 GiB-aligned GFA at {p:#x}");
        }
    }

    #[test]
    fn a_large_reservation_commits_nothing() {
        let w = Window::reserve(WindowConfig::default()).unwrap();
        assert_eq!(w.config().len, DEFAULT_WINDOW_LEN);
    }
}
