//! The system calls of the copy engine: a region's kept mapping, and
//! `process_vm_readv`/`process_vm_writev` between a daemon mapping and a process (the
//! daemon itself included), `pread` from a file; and the plain CPU copy, between mappings
//! of files that cannot shrink. Every `unsafe` block of the copy engine is here, but for
//! the recovering copy's (`fault/`).
//!
//! The daemon loads and stores through a mapping of a file a client may shrink (it holds
//! a descriptor) only inside the recovering copy ([`super::fault`]), where the `SIGBUS`
//! of a shrunk file is an error; elsewhere the kernel copies, where such a fault is an
//! `EFAULT` return. [`cpu_copy`] is for memory that cannot shrink only (sealed memfds:
//! [`crate::dma::sys::cannot_shrink`]), on targets without the recovering copy.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

/// Page size the mappings align to.
const PAGE: u64 = 4096;

/// A shared mapping of part of a file, made for one chunk (or kept for a region) and
/// unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<libc::c_void>,
    map_len: usize,
    /// Offset of the wanted byte from `base`.
    lead: usize,
}

// SAFETY: the mapping is only handed to the kernel and unmapped by its owner; the pointer
// carries no thread affinity.
unsafe impl Send for Mapping {}
// SAFETY: shared references only read the pointer value.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` from `offset` (any alignment), writable when
    /// `writable`, populated when `populate` (else the kernel's copies fault pages in as
    /// they go, and the mapping asks for huge pages).
    pub fn new(file: &File, offset: u64, len: u64, writable: bool, populate: bool) -> io::Result<Self> {
        let overflow = || io::Error::from_raw_os_error(libc::EOVERFLOW);
        let first = offset - offset % PAGE;
        let lead = offset - first;
        let map_len = usize::try_from(lead.checked_add(len).ok_or_else(overflow)?).map_err(|_| overflow())?;
        let off = libc::off_t::try_from(first).map_err(|_| overflow())?;
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a new mapping at an address the kernel chooses; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                prot,
                libc::MAP_SHARED | if populate { libc::MAP_POPULATE } else { 0 },
                file.as_raw_fd(),
                off,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(p).ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        if !populate {
            // Advice only (tmpfs `huge=advise`); failure changes nothing.
            // SAFETY: advice on the mapping just made, `map_len` bytes.
            unsafe { libc::madvise(p, map_len, libc::MADV_HUGEPAGE) };
        }
        Ok(Self { base, map_len, lead: usize::try_from(lead).map_err(|_| overflow())? })
    }

    /// The address of the wanted byte (for the kernel, or the recovering copy).
    pub fn addr(&self) -> usize {
        self.base.as_ptr() as usize + self.lead
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, `map_len` bytes; nothing refers to it after.
        unsafe {
            libc::munmap(self.base.as_ptr(), self.map_len);
        }
    }
}

/// The daemon's own pid (the "remote" process of a copy between two daemon mappings).
pub fn own_pid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// Copies `len` bytes from address `remote` of process `pid` into address `local` of the
/// daemon, retrying short transfers. `local` must be a mapping (or buffer) of the daemon
/// writable for `len` bytes that no Rust reference covers; faults on either side come
/// back as errors, never as signals.
pub fn vm_read(pid: i32, local: usize, remote: u64, len: u64) -> io::Result<()> {
    vm_move(pid, local, remote, len, false)
}

/// Copies `len` bytes from address `local` of the daemon to address `remote` of process
/// `pid`, retrying short transfers (see [`vm_read`]).
pub fn vm_write(pid: i32, local: usize, remote: u64, len: u64) -> io::Result<()> {
    vm_move(pid, local, remote, len, true)
}

/// Copies `len` bytes from address `src` to address `dst` with the CPU (`memcpy`).
///
/// # Safety
/// Both ranges lie inside live mappings of files that cannot shrink (so no load or store
/// can fault), `dst` writable, the two ranges do not overlap, and no Rust reference
/// covers either: the memory is shared with clients, which may touch it meanwhile (a
/// copy racing with its own client's stores gets torn bytes, as a device's DMA would).
pub unsafe fn cpu_copy(dst: usize, src: usize, len: u64) {
    // SAFETY: the caller's contract: valid, non-overlapping, fault-free ranges.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len as usize) }
}

/// At most this many bytes per call, so that a huge chunk cannot overflow `ssize_t`.
const MAX_CALL: u64 = 1 << 30;

fn vm_move(pid: i32, local: usize, remote: u64, len: u64, write: bool) -> io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(MAX_CALL);
        let l = libc::iovec { iov_base: (local + done as usize) as *mut libc::c_void, iov_len: n as usize };
        let r = libc::iovec {
            iov_base: usize::try_from(remote + done).map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?
                as *mut libc::c_void,
            iov_len: n as usize,
        };
        let got = if write {
            // SAFETY: one local and one remote iovec that live across the call; the kernel
            // checks both ranges and reports faults as EFAULT; `local` is daemon memory
            // no Rust reference covers (the caller's contract).
            unsafe { libc::process_vm_writev(pid, &l, 1, &r, 1, 0) }
        } else {
            // SAFETY: as above; the kernel writes only inside the local iovec.
            unsafe { libc::process_vm_readv(pid, &l, 1, &r, 1, 0) }
        };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("moved {done} of {len} bytes")));
        }
        done += got as u64;
    }
    Ok(())
}

/// Reads `len` bytes at offset `off` of `file` into address `local` of the daemon
/// (`pread`, retrying short reads): one copy from the file's page cache, no mapping of
/// the file needed. `local` must be daemon memory writable for `len` bytes that no Rust
/// reference covers; a file shorter than `off + len` is an `UnexpectedEof` error.
pub fn pread_into(file: &File, local: usize, off: u64, len: u64) -> io::Result<()> {
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(MAX_CALL) as usize;
        let at = libc::off_t::try_from(off + done).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        // SAFETY: the kernel writes at most `n` bytes at `local + done`, inside the
        // caller's writable range; faults there come back as EFAULT.
        let got = unsafe { libc::pread(file.as_raw_fd(), (local + done as usize) as *mut libc::c_void, n, at) };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("read {done} of {len} bytes: the file is shorter"),
            ));
        }
        done += got as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::io::{Read, Seek, Write};

    #[test]
    fn a_file_mapping_copies_through_the_kernel_and_a_shrunk_file_is_an_error() {
        let mut src = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3 * PAGE as usize).map(|i| (i % 251) as u8).collect();
        src.write_all(&data).unwrap();
        let mut dst = tempfile::tempfile().unwrap();
        dst.set_len(3 * PAGE).unwrap();
        let s = Mapping::new(&src, 100, 2 * PAGE, false, true).unwrap();
        let d = Mapping::new(&dst, 7, 2 * PAGE, true, false).unwrap();
        vm_read(own_pid(), d.addr(), s.addr() as u64, 2 * PAGE).unwrap();
        drop(d);
        let mut out = Vec::new();
        dst.rewind().unwrap();
        dst.read_to_end(&mut out).unwrap();
        assert_eq!(&out[7..7 + 2 * PAGE as usize], &data[100..100 + 2 * PAGE as usize]);
        // The same through pread, without mapping the source.
        let d = Mapping::new(&dst, 0, PAGE, true, true).unwrap();
        pread_into(&src, d.addr(), 5, PAGE).unwrap();
        drop(d);
        let mut out = vec![0; PAGE as usize];
        std::os::unix::fs::FileExt::read_exact_at(&dst, &mut out, 0).unwrap();
        assert_eq!(out, &data[5..5 + PAGE as usize]);
        // The source shrinks under the mapping: the kernel reports it, no SIGBUS.
        let d = Mapping::new(&dst, 0, 2 * PAGE, true, true).unwrap();
        src.set_len(0).unwrap();
        assert!(vm_read(own_pid(), d.addr(), s.addr() as u64, 2 * PAGE).is_err());
        assert!(pread_into(&src, d.addr(), 0, PAGE).is_err());
    }
}
