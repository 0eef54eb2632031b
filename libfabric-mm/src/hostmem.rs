//! Host memory for DMA registration and the system calls behind it: [`HostBuffer`] (a
//! library-owned buffer on a memfd, which the daemon maps and pins itself) and the page
//! locks (`mlock` + `MADV_DONTFORK`, reference-counted per page) that registering a bare
//! pointer takes. Every `unsafe` block of registration is here.
//!
//! Why a memfd for host buffers rather than `mlock` + the daemon reaching into this
//! process: the daemon maps the very same pages from the descriptor and pins them under
//! its own accounting (`limits.pinned_bytes_per_uid`), so a process with the default
//! 8 MiB `RLIMIT_MEMLOCK` can still register gigabytes; the daemon's copy engine reads
//! and writes through the descriptor instead of `process_vm_readv`; and the buffer is
//! `MADV_DONTFORK`, so a forked child never shares or copies its pages.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::regcache::{Owner, PageCounts, PageRun};
use crate::session::Inner;

/// Bytes of a page (the daemon's IOVA granule too).
pub(crate) const PAGE: u64 = 4096;

static NEXT_BUFFER: AtomicU64 = AtomicU64::new(1);
static LOCKED: Mutex<PageCounts> = Mutex::new(PageCounts::new());
/// Pages of memory this library owns and keeps out of forked children for as long as it
/// lives (host buffers, window placements), as `[first, end)` page numbers: the end of a
/// page lock over them (a bare pointer registered inside one) leaves them so. Taken after
/// `LOCKED` when both are.
static KEPT_OUT: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());

/// Memory of this library's own that stays `MADV_DONTFORK` while this value lives, whatever
/// page locks over it come and go ([`KEPT_OUT`]).
#[derive(Debug)]
pub(crate) struct KeptOut {
    pages: (u64, u64),
    /// In a forked child the list is left alone (another of the parent's threads may have
    /// held its lock at the fork).
    origin: crate::origin::Origin,
}

impl KeptOut {
    /// Keeps the pages under `len` bytes at `addr` out of forked children.
    pub(crate) fn new(addr: *const u8, len: u64) -> Self {
        reserve_in_children();
        let first = addr as u64 / PAGE;
        let pages = (first, (addr as u64).saturating_add(len).div_ceil(PAGE));
        // No fork while the list's lock is held: the child would find it held for good.
        unforked(|| KEPT_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(pages));
        Self { pages, origin: crate::origin::Origin::here() }
    }
}

impl Drop for KeptOut {
    fn drop(&mut self) {
        if self.origin.forked() {
            return;
        }
        unforked(|| {
            let mut kept = KEPT_OUT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(i) = kept.iter().position(|&r| r == self.pages) {
                kept.swap_remove(i);
            }
        });
    }
}

/// Installs, once per process, the fork handler that reserves in each forked child the
/// pages kept out of it: there they are holes, where the child's own mappings could land
/// under a pointer, view or array it inherited, which would then read and write the
/// child's memory instead of faulting. Reserved (`PROT_NONE`), every access through such a
/// pointer faults.
fn reserve_in_children() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers handlers that only touch atomics (before the fork, in the
        // parent after it) and, in the child, map anonymous PROT_NONE pages where nothing
        // is mapped.
        let rc = unsafe { libc::pthread_atfork(Some(hold_forks), Some(forked_parent), Some(reserve_kept_out)) };
        if rc != 0 {
            tracing::warn!(rc, "cannot install the fork handler: a forked child's kept-out pages stay holes");
        }
    });
}

/// Threads inside [`unforked`]; a fork waits for none to be.
static MAPPING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Forks under way (their prepare handler ran, their parent handler not yet).
static FORKING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs `f` — a mapping made and advised `MADV_DONTFORK`, and listed kept out — with no
/// fork in between: a child forked while a placement's live mapping was not yet advised
/// would keep the memory (a remote import's, which the parent's fence never reaches), and
/// one forked before it was listed would have a hole the fork handler does not reserve.
/// A bare pointer's page lock and the kept-out list's changes run here too, so that no
/// child is forked holding their locks. A fork started meanwhile waits for `f` to end (its
/// prepare handler); `f` must not fork. A call inside another (a placement undone, its
/// kept-out pages given back) just runs `f`: waiting there for a fork would wait for
/// itself.
pub(crate) fn unforked<T>(f: impl FnOnce() -> T) -> T {
    use std::sync::atomic::Ordering::SeqCst;
    thread_local! {
        /// How deep this thread is in `unforked`.
        static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    struct Deeper;
    impl Drop for Deeper {
        fn drop(&mut self) {
            let _ = DEPTH.try_with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    // Without the thread-local (a thread's destructors running): taken as outermost.
    let outer = DEPTH.try_with(|d| d.replace(d.get() + 1)).map_or(true, |was| was == 0);
    let _deeper = Deeper;
    if !outer {
        return f();
    }
    reserve_in_children();
    loop {
        MAPPING.fetch_add(1, SeqCst);
        if FORKING.load(SeqCst) == 0 {
            break;
        }
        MAPPING.fetch_sub(1, SeqCst);
        while FORKING.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
    }
    struct Done;
    impl Drop for Done {
        fn drop(&mut self) {
            MAPPING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    let _done = Done;
    f()
}

/// The prepare handler: no fork while a thread is inside [`unforked`].
extern "C" fn hold_forks() {
    use std::sync::atomic::Ordering::SeqCst;
    FORKING.fetch_add(1, SeqCst);
    while MAPPING.load(SeqCst) != 0 {
        // SAFETY: yields the CPU; no memory of ours is touched.
        unsafe { libc::sched_yield() };
    }
}

/// The parent's handler after a fork: mappings go on.
extern "C" fn forked_parent() {
    FORKING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
}

/// The fork handler of [`reserve_in_children`], in the child (one thread, the one that
/// forked). The list's lock is never held at a fork (it is taken only inside [`unforked`],
/// which a fork waits for); should it be all the same, nothing is done (the holes stay)
/// rather than wait for a thread the child does not have. Allocates nothing and cannot
/// panic.
extern "C" fn reserve_kept_out() {
    // The forking thread is the child's only one: nothing maps, and the counts start over.
    FORKING.store(0, std::sync::atomic::Ordering::SeqCst);
    MAPPING.store(0, std::sync::atomic::Ordering::SeqCst);
    let kept = match KEPT_OUT.try_lock() {
        Ok(k) => k,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return,
    };
    for &(first, end) in kept.iter() {
        // The holes the parent's MADV_DONTFORK pages left; nothing of the child's is
        // replaced.
        if !crate::window::reserve_hole((first * PAGE) as *mut u8, (end - first) * PAGE) {
            reserve_holes_in(first, end);
        }
    }
}

/// Pages looked at by one `mincore` in [`reserve_holes_in`].
const CHUNK: u64 = 4096;

/// Reserves the holes among the pages `[first, end)`, which are partly mapped (a fenced
/// placement's reservation, inherited; what another fork handler mapped first): chunks
/// with no hole are passed over with one `mincore`, so a large range mapped whole costs a
/// few calls, not one per page. Allocates nothing.
pub(crate) fn reserve_holes_in(first: u64, end: u64) {
    let mut page = first;
    while page < end {
        let n = (end - page).min(CHUNK);
        let mut v = [0u8; CHUNK as usize];
        // SAFETY: mincore reads nothing at the address; `v` has a byte per page of the chunk.
        let whole =
            unsafe { libc::mincore((page * PAGE) as *mut libc::c_void, (n * PAGE) as usize, v.as_mut_ptr()) } == 0;
        if !whole {
            for p in page..page + n {
                crate::window::reserve_hole((p * PAGE) as *mut u8, PAGE);
            }
        }
        page += n;
    }
}

/// The parts of the pages `[first, end)` that no [`KeptOut`] covers.
fn not_kept(first: u64, end: u64) -> Vec<(u64, u64)> {
    let mut kept: Vec<(u64, u64)> = KEPT_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .iter()
        .filter(|&&(a, b)| a < end && b > first)
        .copied()
        .collect();
    kept.sort_unstable();
    let (mut out, mut at) = (Vec::new(), first);
    for (a, b) in kept {
        if a > at {
            out.push((at, a.min(end)));
        }
        at = at.max(b);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

/// The shared state of a host buffer (opaque).
#[doc(hidden)]
pub struct HostMem {
    pub(crate) session: Arc<Inner>,
    pub(crate) id: u64,
    pub(crate) ptr: *mut u8,
    pub(crate) len: u64,
    pub(crate) fd: OwnedFd,
    /// Its pages stay out of forked children while it lives.
    pub(crate) _kept: KeptOut,
}

// SAFETY: the pointer names a process-wide shared mapping that lives as long as the value;
// it is never dereferenced by the library, and the rest is Send + Sync.
unsafe impl Send for HostMem {}
// SAFETY: as above.
unsafe impl Sync for HostMem {}

impl std::fmt::Debug for HostMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMem").field("id", &self.id).field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // In a forked child the buffer is a hole (`MADV_DONTFORK`), where the child's own
        // memory may lie now: left alone, as the parent's registrations are.
        if self.session.client.forked() {
            return;
        }
        // Undo the cached registrations first: the daemon holds the pages until then.
        self.session.registrations.invalidate(Owner::Host { buffer: self.id });
        // SAFETY: the mapping made in `HostBuffer::new`, `len` bytes; no registration of
        // it is left (each holds this value alive) and the buffer is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
    }
}

/// A page-aligned host buffer on a memfd, mapped shared in this process and excluded from
/// forked children (`MADV_DONTFORK`). Register it with [`crate::Session::register`]: the
/// daemon pins the same pages. Unmapped when it and every registration of it are dropped.
#[derive(Debug, Clone)]
pub struct HostBuffer(pub(crate) Arc<HostMem>);

impl HostBuffer {
    pub(crate) fn new(session: Arc<Inner>, len: u64) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("a host buffer needs at least one byte".into()));
        }
        let len = len
            .checked_next_multiple_of(PAGE)
            .filter(|l| usize::try_from(*l).is_ok() && i64::try_from(*l).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("{len} bytes is too large for a host buffer")))?;
        let name = c"fabric-mm-host";
        // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if raw < 0 {
            return Err(Error::os("memfd_create for a host buffer")(std::io::Error::last_os_error()));
        }
        // SAFETY: raw is a new descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: ftruncate on our own descriptor; len fits off_t (checked above).
        if unsafe { libc::ftruncate(raw, len as libc::off_t) } != 0 {
            return Err(Error::os("sizing a host buffer")(std::io::Error::last_os_error()));
        }
        // A host buffer never changes size: sealed so, fabricd may copy it with the CPU (a
        // memory object no one can shrink cannot fault under the daemon). Best effort: an
        // unsealed buffer is copied by the kernel, only slower.
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: F_ADD_SEALS on our own descriptor takes an int and touches no memory.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, seals) } != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "host buffer not sealed");
        }
        let ulen = len as usize;
        let (p, kept) = unforked(|| {
            // SAFETY: a new shared mapping of our memfd at an address the kernel picks; it
            // aliases no Rust object.
            let p = unsafe {
                libc::mmap(std::ptr::null_mut(), ulen, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, raw, 0)
            };
            if p == libc::MAP_FAILED {
                return Err(Error::os("mapping a host buffer")(std::io::Error::last_os_error()));
            }
            let kept = KeptOut::new(p.cast(), len);
            // SAFETY: advice on the mapping made above.
            if unsafe { libc::madvise(p, ulen, libc::MADV_DONTFORK) } != 0 {
                let e = std::io::Error::last_os_error();
                drop(kept);
                // SAFETY: the mapping made above, not handed out.
                unsafe { libc::munmap(p, ulen) };
                return Err(Error::os("MADV_DONTFORK on a host buffer")(e));
            }
            Ok((p, kept))
        })?;
        let id = NEXT_BUFFER.fetch_add(1, Ordering::Relaxed);
        Ok(Self(Arc::new(HostMem { session, id, ptr: p.cast(), len, fd, _kept: kept })))
    }

    /// First byte. Loads and stores through it are the caller's (see the safety note on
    /// [`crate::Registration`]: no Rust reference may be live while a device writes).
    pub fn as_ptr(&self) -> *mut u8 {
        self.0.ptr
    }

    /// Bytes (a whole number of pages).
    pub fn len(&self) -> u64 {
        self.0.len
    }

    /// Never empty.
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The buffer's process-wide id (never reused): its identity in the registration cache.
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The bytes.
    ///
    /// # Safety
    /// No device may write the buffer (through a read-write registration) while the slice
    /// lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is mapped read-write for as long as self lives; aliasing
        // with DMA is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.0.ptr, self.0.len as usize) }
    }

    /// The bytes, for writing.
    ///
    /// # Safety
    /// As for [`HostBuffer::as_slice`], and no other slice of the buffer may be live.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> &mut [u8] {
        // SAFETY: as above; exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.ptr, self.0.len as usize) }
    }
}

/// The soft `RLIMIT_MEMLOCK` (`u64::MAX`: unlimited or unknown).
pub fn memlock_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    r.rlim_cur
}

/// `mlock`, `munlock` and `madvise` as raw system calls: sanitizer runtimes (ASan, for one)
/// intercept the libc wrappers and turn `mlock` into a no-op, and the daemon would then
/// refuse the registration because the pages are not locked.
fn mlock(p: *mut libc::c_void, n: usize) -> bool {
    // SAFETY: mlock changes no memory contents; the kernel checks that the range is mapped.
    unsafe { libc::syscall(libc::SYS_mlock, p, n) == 0 }
}

fn munlock(p: *mut libc::c_void, n: usize) {
    // SAFETY: as for mlock.
    unsafe { libc::syscall(libc::SYS_munlock, p, n) };
}

/// `madvise` as a raw system call (see `mlock`), for `MADV_DONTFORK`/`MADV_DOFORK` only
/// (other advice may change contents); true when it succeeded.
pub(crate) fn madvise(p: *mut libc::c_void, n: usize, advice: libc::c_int) -> bool {
    // SAFETY: MADV_DONTFORK/MADV_DOFORK change what a child inherits, not contents.
    unsafe { libc::syscall(libc::SYS_madvise, p, n, advice) == 0 }
}

/// Bytes this process has locked now (`VmLck` of /proc/self/status; 0 when unreadable).
fn locked_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmLck:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn run_bytes((first, n): PageRun) -> (*mut libc::c_void, usize) {
    ((first * PAGE) as usize as *mut libc::c_void, (n * PAGE) as usize)
}

/// Unlocks runs and lets children inherit them again, except the pages of memory this
/// library keeps out of children for its own reasons ([`KeptOut`]).
fn unlock_runs(runs: &[PageRun]) {
    for run in runs {
        // These pages were locked by `PageLock::new`; if the caller unmapped them already
        // the calls fail harmlessly.
        let (p, n) = run_bytes(*run);
        munlock(p, n);
        for (first, end) in not_kept(run.0, run.0 + run.1) {
            let (p, n) = run_bytes((first, end - first));
            madvise(p, n, libc::MADV_DOFORK);
        }
    }
}

/// Pages of this process locked (`mlock`) and kept out of forked children
/// (`MADV_DONTFORK`) for a registration of a bare pointer; undone on drop for the pages no
/// other live registration holds.
#[derive(Debug)]
pub(crate) struct PageLock {
    first: u64,
    pages: u64,
    /// In a forked child the pages are holes (or the child's own memory now): not unlocked
    /// there.
    origin: crate::origin::Origin,
}

impl PageLock {
    /// Locks the pages under `len` bytes at `addr`.
    pub(crate) fn new(addr: u64, len: u64) -> Result<Self> {
        let end = addr
            .checked_add(len)
            .and_then(|e| e.checked_next_multiple_of(PAGE))
            .ok_or_else(|| Error::InvalidArgument(format!("{len} bytes at {addr:#x} overflow")))?;
        let first = addr / PAGE;
        let pages = end / PAGE - first;
        // No fork while the counts' lock is held (a child would find it held for good) or
        // between a run's `mlock` and its `MADV_DONTFORK` (the child would share the pages).
        unforked(|| Self::lock_pages(first, pages))?;
        Ok(Self { first, pages, origin: crate::origin::Origin::here() })
    }

    /// Counts, locks and advises the pages `[first, first + pages)`; inside [`unforked`].
    fn lock_pages(first: u64, pages: u64) -> Result<()> {
        let mut counts = LOCKED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let runs = counts.acquire(first, pages);
        for (i, run) in runs.iter().enumerate() {
            let (p, n) = run_bytes(*run);
            let locked = mlock(p, n);
            let err = std::io::Error::last_os_error();
            let advised = locked && madvise(p, n, libc::MADV_DONTFORK);
            if !advised {
                let err = if locked { std::io::Error::last_os_error() } else { err };
                if locked {
                    munlock(p, n);
                }
                unlock_runs(&runs[..i]);
                counts.release(first, pages);
                let limit = memlock_limit();
                let requested = pages * PAGE;
                // ENOMEM is also what an unmapped range gets: name the limit only when
                // the request would pass it.
                let over = limit != u64::MAX && locked_bytes().saturating_add(requested) > limit;
                return Err(match err.raw_os_error() {
                    Some(libc::ENOMEM | libc::EPERM | libc::EAGAIN) if !locked && over => {
                        Error::MemlockLimit { requested, limit }
                    }
                    _ => Error::Os { what: "locking memory for a registration (is it mapped?)", source: err },
                });
            }
        }
        Ok(())
    }
}

impl Drop for PageLock {
    fn drop(&mut self) {
        if self.origin.forked() {
            return;
        }
        unforked(|| {
            let mut counts = LOCKED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let runs = counts.release(self.first, self.pages);
            unlock_runs(&runs);
        });
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `len` bytes of new anonymous read-write memory, `MAP_PRIVATE` or `MAP_SHARED`.
    fn anon(len: usize, share: libc::c_int) -> *mut u8 {
        // SAFETY: a new anonymous mapping at an address the kernel picks; it aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                share | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    /// In a range partly mapped, only the holes are reserved; what is mapped is left as it
    /// is, and a range mapped whole costs one look per chunk.
    #[test]
    fn only_the_holes_of_a_range_are_reserved() {
        let len = 3 * PAGE as usize;
        let p = anon(len, libc::MAP_PRIVATE);
        // SAFETY: the first page of the mapping above.
        unsafe { p.write(5) };
        // SAFETY: its middle page, made a hole.
        assert_eq!(unsafe { libc::munmap(p.wrapping_add(PAGE as usize).cast(), PAGE as usize) }, 0);
        let first = p as u64 / PAGE;
        reserve_holes_in(first, first + 3);
        let mut v = [0u8; 3];
        // SAFETY: mincore reads nothing; the range is ours.
        assert_eq!(unsafe { libc::mincore(p.cast(), len, v.as_mut_ptr()) }, 0, "no hole left");
        // SAFETY: the first page, still the data it held.
        assert_eq!(unsafe { p.read() }, 5);
        // SAFETY: the whole range is this test's.
        unsafe { libc::munmap(p.cast(), len) };
    }

    /// Forks 200 children while another thread runs `churn` in a loop; each child runs
    /// `child` (true: it went well) under a 5 s alarm. Whether no child hung.
    fn forks_while(
        churn: impl Fn() + Send + Sync + 'static,
        child: impl Fn() -> bool,
    ) -> std::result::Result<u64, u64> {
        // The fork handler installed before the churn: a fork during its installation
        // would leave the child waiting on the `Once`.
        reserve_in_children();
        /// Stops the churn however this returns (a failed assertion included).
        struct Stop(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl Drop for Stop {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = Stop(stop.clone());
        let churner = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    churn();
                    rounds += 1;
                }
                rounds
            })
        };
        let mut hung = false;
        for _ in 0..200 {
            // SAFETY: the child runs `child` and leaves with _exit; an alarm ends it if it
            // hangs.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0);
            if pid == 0 {
                // SAFETY: as above, in the child.
                unsafe { libc::alarm(5) };
                let ok = child();
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(i32::from(!ok)) };
            }
            let mut status = 0;
            // SAFETY: waits for the child forked above.
            assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
            if libc::WIFSIGNALED(status) {
                hung = true;
                break;
            }
            assert_eq!(libc::WEXITSTATUS(status), 0, "the child's step failed");
        }
        drop(stopping);
        let rounds = churner.join().unwrap();
        assert!(rounds > 0);
        if hung { Err(rounds) } else { Ok(rounds) }
    }

    /// A child forked while another thread locks and unlocks pages can lock pages of its
    /// own: no fork lands while the page counts' lock is held (before, a child forked then
    /// found it held for good and its first registration hung).
    #[test]
    fn a_child_forked_while_another_thread_locks_pages_can_lock_its_own() {
        let theirs = anon(64 * PAGE as usize, libc::MAP_PRIVATE) as u64;
        let churn = move || drop(PageLock::new(theirs, 64 * PAGE).unwrap());
        let child = || PageLock::new(anon(PAGE as usize, libc::MAP_PRIVATE) as u64, PAGE).is_ok();
        if let Err(rounds) = forks_while(churn, child) {
            panic!("a child hung on the page counts ({rounds} locks meanwhile)");
        }
    }

    /// Likewise for the kept-out list: a child forked while another thread keeps memory
    /// out and gives it back can keep its own out (its first host buffer or placement).
    #[test]
    fn a_child_forked_while_another_thread_keeps_memory_out_can_keep_its_own() {
        let theirs = anon(PAGE as usize, libc::MAP_PRIVATE) as usize;
        let churn = move || drop(KeptOut::new(theirs as *const u8, PAGE));
        let child = || {
            drop(KeptOut::new(anon(PAGE as usize, libc::MAP_PRIVATE), PAGE));
            true
        };
        if let Err(rounds) = forks_while(churn, child) {
            panic!("a child hung on the kept-out list ({rounds} changes meanwhile)");
        }
    }

    /// The `VmFlags` `/proc/self/smaps` gives the mapping holding the page at `p`.
    pub(crate) fn vm_flags(p: *const u8) -> Vec<String> {
        let at = p as usize;
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&at);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("{at:#x} is not mapped (or smaps has no VmFlags)");
    }

    /// A bare pointer registered inside memory the library keeps out of forked children (a
    /// host buffer, a window placement) and unregistered leaves it out of them: before, the
    /// page lock's end advised `MADV_DOFORK` on its pages, and a child forked afterwards
    /// shared pages a device may still be writing. Memory no one keeps gets its advice
    /// undone, as before.
    #[test]
    fn a_page_lock_inside_kept_memory_leaves_it_out_of_children() {
        let len = 4 * PAGE;
        let p = anon(len as usize, libc::MAP_SHARED);
        let inner = p.wrapping_add(PAGE as usize);
        assert!(madvise(p.cast(), len as usize, libc::MADV_DONTFORK));
        let dontfork = |at: *const u8| vm_flags(at).contains(&"dc".to_owned());
        let kept = KeptOut::new(p, len);
        drop(PageLock::new(inner as u64, PAGE).unwrap());
        assert!(dontfork(inner) && dontfork(p), "kept memory left to forked children");
        drop(kept);
        drop(PageLock::new(inner as u64, PAGE).unwrap());
        assert!(!dontfork(inner), "a page lock of memory no one keeps undoes its advice");
        assert!(dontfork(p), "and only on its own pages");
        // SAFETY: the mapping made above; nothing refers to it any more.
        unsafe { libc::munmap(p.cast(), len as usize) };
    }

    #[test]
    fn the_pages_not_kept_are_what_the_kept_ranges_leave() {
        let _a = KeptOut::new((100 * PAGE) as *const u8, 10 * PAGE);
        let _b = KeptOut::new((105 * PAGE) as *const u8, 20 * PAGE);
        assert_eq!(not_kept(90, 140), [(90, 100), (125, 140)]);
        assert_eq!(not_kept(101, 120), []);
        assert_eq!(not_kept(200, 210), [(200, 210)]);
    }
}
