//! The system calls of DMA registration: `mmap` + `mlock` of memory the daemon maps,
//! `process_vm_readv`/`process_vm_writev` to reach a client's memory, and the `/proc`
//! reads that check what a client says it pinned (by pid: callers go through
//! [`crate::transport::peer::Process::with`], which follows the process by its pidfd).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// Why memory could not be pinned.
#[derive(Debug, thiserror::Error)]
pub enum PinError {
    /// `mmap` refused the range (a read-only descriptor mapped for writing, a file that
    /// cannot be mapped).
    #[error("mmap of {len} bytes at offset {offset}")]
    Map {
        /// Offset in the file.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `mlock` hit `RLIMIT_MEMLOCK` (the daemon lacks `CAP_IPC_LOCK`).
    #[error(
        "mlock of {requested} bytes refused by RLIMIT_MEMLOCK: the daemon has {locked} bytes locked, its limit is {limit} bytes (raise LimitMEMLOCK= or grant CAP_IPC_LOCK)"
    )]
    MemlockLimit {
        /// Bytes asked for.
        requested: u64,
        /// Bytes the daemon has locked now (`VmLck`).
        locked: u64,
        /// The soft limit (`u64::MAX`: unlimited).
        limit: u64,
    },
    /// `mlock` failed otherwise.
    #[error("mlock of {len} bytes")]
    Lock {
        /// Bytes.
        len: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The pin was given up part way (the client hung up, the daemon is stopping).
    #[error("pinning abandoned after {locked} of {len} bytes: {why}")]
    Abandoned {
        /// Bytes locked when it stopped.
        locked: u64,
        /// Bytes asked for.
        len: u64,
        /// Why.
        why: &'static str,
    },
}

/// Bytes locked at a time by [`Pinned::new`]: between two such pieces it asks whether to
/// go on, so that a large pin can be given up within one piece's time.
pub const PIN_STEP: usize = 64 << 20;

/// A shared mapping of a file range, locked in memory; unlocked and unmapped on drop.
/// The daemon never reads or writes through it with plain loads and stores when a client
/// may shrink the file under it (a load then would be `SIGBUS`): `dma_read`/`dma_write`
/// go through the descriptor ([`Pinned::file`]) with `pread`/`pwrite`, and the copy
/// engine through its recovering copy (`copy/fault`), which turns that fault into an
/// error. Only when the file cannot shrink ([`Pinned::cannot_shrink`]: a memfd sealed with
/// `F_SEAL_SHRINK`) may plain loads and stores go through it.
#[derive(Debug)]
pub struct Pinned {
    ptr: NonNull<libc::c_void>,
    len: usize,
    file: File,
    offset: u64,
    writable: bool,
    cannot_shrink: bool,
    ordinary: bool,
}

// SAFETY: the mapping is only created and destroyed by the owner (others reach its bytes
// with raw copies of shared memory only: the kernel's, the copy engine's), and the kernel
// objects behind the pointer and the file may be used from any thread.
unsafe impl Send for Pinned {}
// SAFETY: shared references give access to the file (whose I/O is thread-safe) and the
// pointer, whose bytes are shared memory reached only with raw copies, from any thread.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// Maps `len` bytes of `file` at `offset` (both page multiples) shared, readable and,
    /// when `writable`, writable, and locks them [`PIN_STEP`] bytes at a time, asking
    /// `abandon` before each piece: `Some(why)` gives the pin up (what was locked is
    /// unlocked and unmapped).
    pub fn new(
        file: File,
        offset: u64,
        len: u64,
        writable: bool,
        abandon: &dyn Fn() -> Option<&'static str>,
    ) -> Result<Self, PinError> {
        let map_err = |source| PinError::Map { offset, len, source };
        let ulen = usize::try_from(len).map_err(|_| map_err(io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        let off = libc::off_t::try_from(offset).map_err(|_| map_err(io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping at an address the kernel chooses; it aliases no Rust object.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), ulen, prot, libc::MAP_SHARED, file.as_raw_fd(), off) };
        if p == libc::MAP_FAILED {
            return Err(map_err(io::Error::last_os_error()));
        }
        let ptr = NonNull::new(p).ok_or_else(|| map_err(io::Error::from_raw_os_error(libc::EFAULT)))?;
        // Checked once, on the descriptor that is mapped: seals are never removed.
        let cannot_shrink = cannot_shrink(&file);
        let ordinary = ordinary_memory(&file);
        let pinned = Self { ptr, len: ulen, file, offset, writable, cannot_shrink, ordinary };
        // Huge pages where the file's filesystem gives them (tmpfs `huge=advise`): fewer
        // pages for the kernel's copies to walk. Advice only; failure changes nothing.
        // SAFETY: advice on the mapping made above, `ulen` bytes.
        unsafe { libc::madvise(ptr.as_ptr(), ulen, libc::MADV_HUGEPAGE) };
        // Locking faults every page in, which for a client's file is the client's to make
        // slow; piece by piece, the caller can stop it. On an early return `pinned` drops,
        // which unlocks what was locked and unmaps.
        let mut at = 0;
        while at < ulen {
            if let Some(why) = abandon() {
                return Err(PinError::Abandoned { locked: at as u64, len, why });
            }
            let step = PIN_STEP.min(ulen - at);
            // SAFETY: locks `step` bytes at `at` of the mapping made above, which is `ulen`
            // bytes long.
            if unsafe { libc::mlock(ptr.as_ptr().cast::<u8>().add(at).cast(), step) } != 0 {
                let e = io::Error::last_os_error();
                return Err(match e.raw_os_error() {
                    Some(libc::ENOMEM | libc::EPERM) if memlock_limit() != u64::MAX => {
                        PinError::MemlockLimit { requested: len, locked: locked_bytes(), limit: memlock_limit() }
                    }
                    _ => PinError::Lock { len, source: e },
                });
            }
            at += step;
        }
        Ok(pinned)
    }

    /// The file whose range is pinned, for `pread`/`pwrite`.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The first byte of the mapping, for the kernel (`process_vm_readv`/
    /// `process_vm_writev` turn a fault on a shrunk file into `EFAULT` where a load in
    /// the daemon would be `SIGBUS`) and the copy engine's recovering copy (which does the
    /// same); never dereferenced by plain loads and stores unless [`Pinned::cannot_shrink`].
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// Whether the mapping is writable.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Whether no one can shrink the file (see [`cannot_shrink`]): then a load or store
    /// through the mapping cannot fault, and the copy engine may `memcpy` through it.
    pub fn cannot_shrink(&self) -> bool {
        self.cannot_shrink
    }

    /// Whether the file is ordinary memory, not device memory (see [`ordinary_memory`]):
    /// the copy engine's CPU copy reaches only such mappings.
    pub fn ordinary(&self) -> bool {
        self.ordinary
    }

    /// Offset of the pinned range in the file.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes pinned.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether nothing is pinned (never: a mapping has at least a page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, `len` bytes, not used after this.
        unsafe {
            libc::munlock(self.ptr.as_ptr(), self.len);
            libc::munmap(self.ptr.as_ptr(), self.len);
        }
    }
}

/// `tmpfs`' `f_type` (`TMPFS_MAGIC`): memfds live there unless made with `MFD_HUGETLB`.
pub(crate) const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Whether no process can ever shrink `file`, so that every page of it a mapping covers
/// (within its size now) stays there: a memfd on tmpfs sealed with `F_SEAL_SHRINK`. Seals
/// cannot be removed, and a regular file (even on tmpfs) cannot be sealed. Holes punched
/// into such a memfd refault as zero pages, never `SIGBUS`; hugetlbfs memfds are left out
/// (a refault there can fail with `SIGBUS` when the huge page pool is empty).
pub fn cannot_shrink(file: &File) -> bool {
    // SAFETY: F_GET_SEALS takes no argument and touches no memory of ours.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return false;
    }
    fs_magic(file) == Some(TMPFS_MAGIC)
}

/// The `f_type` of the filesystem `file` is on (`None`: `fstatfs` failed).
pub(crate) fn fs_magic(file: impl std::os::fd::AsFd) -> Option<i64> {
    // SAFETY: an all-zero statfs is a valid value of the plain C struct.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into `fs`, which lives across the call.
    if unsafe { libc::fstatfs(file.as_fd().as_raw_fd(), &mut fs) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    Some(fs.f_type as i64)
}

/// `sysfs`' `f_type` (`SYSFS_MAGIC`): PCI BAR `resourceN` files live there.
const SYSFS_MAGIC: i64 = 0x6265_6572;

/// Whether `file` is ordinary memory: a regular file (a memfd, a region file, a memory
/// object) not on sysfs — not a device-DAX character device nor a PCI BAR resource file,
/// whose mappings are device memory (a BAR's uncached) that the copy engine does not
/// reach with the CPU.
pub fn ordinary_memory(file: &File) -> bool {
    file.metadata().is_ok_and(|m| m.file_type().is_file()) && fs_magic(file).is_some_and(|m| m != SYSFS_MAGIC)
}

/// The soft `RLIMIT_MEMLOCK` of this process (`u64::MAX`: unlimited).
pub fn memlock_limit() -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return u64::MAX;
    }
    r.rlim_cur
}

/// Bytes this process has locked (`VmLck` of `/proc/self/status`; 0 when unreadable).
pub fn locked_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmLck:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Reads `buf.len()` bytes at `addr` of process `pid`.
pub fn read_process(pid: i32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    use nix::sys::uio::{RemoteIoVec, process_vm_readv};
    let base = usize::try_from(addr).map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?;
    let remote = [RemoteIoVec { base, len: buf.len() }];
    let want = buf.len();
    let n = process_vm_readv(nix::unistd::Pid::from_raw(pid), &mut [io::IoSliceMut::new(buf)], &remote)
        .map_err(io::Error::from)?;
    if n != want {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("read {n} of {want} bytes")));
    }
    Ok(())
}

/// Writes `buf` at `addr` of process `pid`.
pub fn write_process(pid: i32, addr: u64, buf: &[u8]) -> io::Result<()> {
    use nix::sys::uio::{RemoteIoVec, process_vm_writev};
    let base = usize::try_from(addr).map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?;
    let remote = [RemoteIoVec { base, len: buf.len() }];
    let n = process_vm_writev(nix::unistd::Pid::from_raw(pid), &[io::IoSlice::new(buf)], &remote)
        .map_err(io::Error::from)?;
    if n != buf.len() {
        return Err(io::Error::new(io::ErrorKind::WriteZero, format!("wrote {n} of {} bytes", buf.len())));
    }
    Ok(())
}

/// One mapping of a process, from `/proc/<pid>/smaps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    /// First address.
    pub start: u64,
    /// End (exclusive).
    pub end: u64,
    /// Readable.
    pub read: bool,
    /// Writable.
    pub write: bool,
    /// `VM_LOCKED` (`lo` in `VmFlags`): the pages are locked.
    pub locked: bool,
}

/// The mappings in an `smaps` text: each header line (`start-end perms ...`, `start <
/// end`) with the `VmFlags:` line that follows it. Lines of any other shape are skipped
/// (the kernel escapes newlines in the path names a process can choose).
pub fn parse_smaps(text: &str) -> Vec<Vma> {
    let mut out: Vec<Vma> = Vec::new();
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            if let Some(v) = out.last_mut() {
                v.locked = flags.split_whitespace().any(|f| f == "lo");
            }
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else { continue };
        let Some((s, e)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else { continue };
        if perms.len() != 4 || start >= end {
            continue;
        }
        out.push(Vma { start, end, read: perms.starts_with('r'), write: perms.as_bytes()[1] == b'w', locked: false });
    }
    out
}

/// The mappings of process `pid`.
pub fn process_maps(pid: i32) -> io::Result<Vec<Vma>> {
    Ok(parse_smaps(&std::fs::read_to_string(format!("/proc/{pid}/smaps"))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_headers_and_flags_parse() {
        let text = "\
7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n\
Size:                  8 kB\n\
Locked:                8 kB\n\
VmFlags: rd wr mr mw me lo ac \n\
7f0000002000-7f0000003000 r--p 00000000 00:00 0      [heap]\n\
VmFlags: rd mr mw me ac \n";
        let v = parse_smaps(text);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0], Vma { start: 0x7f00_0000_0000, end: 0x7f00_0000_2000, read: true, write: true, locked: true });
        assert!(v[1].read && !v[1].write && !v[1].locked);
        assert!(parse_smaps("garbage\nVmFlags: lo\n").is_empty());
    }

    #[test]
    fn this_process_can_be_read_and_written() {
        let mut buf = vec![7u8; 64];
        let addr = buf.as_mut_ptr() as u64;
        let pid = std::process::id() as i32;
        let mut out = [0u8; 64];
        read_process(pid, addr, &mut out).unwrap();
        assert_eq!(out, [7u8; 64]);
        write_process(pid, addr + 8, &[1, 2, 3]).unwrap();
        // The write went through the kernel, not a Rust reference: read it the same way.
        read_process(pid, addr, &mut out).unwrap();
        assert_eq!(&out[6..12], &[7, 7, 1, 2, 3, 7]);
        drop(buf);
    }

    /// A memfd made with `MFD_ALLOW_SEALING` and `len` bytes, sealed with `seals`.
    fn sealed_memfd(len: u64, seals: i32) -> File {
        use std::os::fd::FromRawFd;
        // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(c"seal-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        assert!(fd >= 0);
        // SAFETY: the descriptor was just made and nothing else owns it.
        let f = unsafe { File::from_raw_fd(fd) };
        f.set_len(len).expect("set_len");
        // SAFETY: F_ADD_SEALS takes an int and touches no memory of ours.
        assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_ADD_SEALS, seals) }, 0);
        f
    }

    #[test]
    fn only_a_memfd_sealed_against_shrinking_cannot_shrink() {
        let sealed = sealed_memfd(8192, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
        assert!(cannot_shrink(&sealed));
        // The seal holds: the kernel refuses to shrink it.
        assert!(sealed.set_len(0).is_err());
        let p = Pinned::new(sealed, 0, 8192, true, &|| None);
        // Pinning may be refused by RLIMIT_MEMLOCK; when it works, the mapping knows.
        if let Ok(p) = p {
            assert!(p.cannot_shrink());
        }
        // Growing sealed, shrinking not: it can shrink.
        assert!(!cannot_shrink(&sealed_memfd(8192, libc::F_SEAL_GROW)));
        // No seals at all.
        assert!(!cannot_shrink(&sealed_memfd(8192, 0)));
        // A regular file cannot be sealed.
        assert!(!cannot_shrink(&tempfile::tempfile().expect("tempfile")));
    }

    #[test]
    fn memfds_and_files_are_ordinary_memory_and_device_and_sysfs_files_are_not() {
        assert!(ordinary_memory(&sealed_memfd(8192, 0)));
        assert!(ordinary_memory(&tempfile::tempfile().expect("tempfile")));
        // A character device, as device-DAX is.
        assert!(!ordinary_memory(&File::open("/dev/zero").expect("/dev/zero")));
        // A regular file on sysfs, as a PCI BAR's resourceN is.
        if let Ok(f) = File::open("/sys/kernel/mm/transparent_hugepage/enabled") {
            assert!(!ordinary_memory(&f));
        }
    }
}
