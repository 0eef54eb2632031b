//! The system calls behind a connection's identity: `SO_PEERGROUPS` and `SO_PEERPIDFD`
//! on the accepted socket, `pidfd_open`, and `poll` on a pidfd.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

// The option numbers of `<asm/socket.h>` (sparc has its own); the libc crate does not
// export them for glibc.
#[cfg(not(any(target_arch = "sparc", target_arch = "sparc64")))]
const SO_PEERGROUPS: libc::c_int = 59;
#[cfg(not(any(target_arch = "sparc", target_arch = "sparc64")))]
const SO_PEERPIDFD: libc::c_int = 77;
#[cfg(any(target_arch = "sparc", target_arch = "sparc64"))]
const SO_PEERGROUPS: libc::c_int = 0x3d;
#[cfg(any(target_arch = "sparc", target_arch = "sparc64"))]
const SO_PEERPIDFD: libc::c_int = 0x56;

/// Most supplementary groups a credential holds (`NGROUPS_MAX`).
const NGROUPS_MAX: usize = 65_536;

/// The supplementary groups the kernel recorded for the other end of `sock` when it
/// connected (`SO_PEERGROUPS`, Linux 4.13): fixed then, whatever the process does later.
pub fn peer_groups(sock: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = libc::socklen_t::try_from(groups.len() * size_of::<libc::gid_t>())
            .map_err(|_| io::Error::from_raw_os_error(libc::ERANGE))?;
        // SAFETY: getsockopt writes at most `len` bytes into `groups`, which holds that
        // many and lives across the call, and sets `len` to what it wrote (or, with
        // ERANGE, to what it needs).
        let r = unsafe {
            libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        let n = len as usize / size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n.min(groups.len()));
            return Ok(groups);
        }
        let e = io::Error::last_os_error();
        // Too small: the kernel said how much it needs (bounded by NGROUPS_MAX).
        if e.raw_os_error() == Some(libc::ERANGE) && n > groups.len() && n <= NGROUPS_MAX {
            groups.resize(n, 0);
            continue;
        }
        return Err(e);
    }
}

/// A pidfd for the process at the other end of `sock`, the one that connected
/// (`SO_PEERPIDFD`, Linux 6.5; `ENOPROTOOPT` before).
pub fn peer_pidfd(sock: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes one int into `fd`, which lives across the call.
    let r =
        unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, SO_PEERPIDFD, (&raw mut fd).cast(), &mut len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: the kernel just installed this descriptor for us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A pidfd for process `pid` (`pidfd_open`): it names that process, never another that
/// later gets the same pid.
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes two integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the process behind `pidfd` is still running: a pidfd becomes readable once
/// its process has exited. A process that has not exited has not been reaped either,
/// so its pid still names it and no other process.
pub fn pidfd_running(pidfd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: poll reads and writes the one pollfd, which lives across the call; a
        // zero timeout never blocks.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        if r < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        // Readable, hung up or failed: exited, or not known to be running.
        return r == 0;
    }
}

/// Clock ticks (`/proc/<pid>/stat`'s unit) since boot, as process start times count them.
pub fn boot_ticks() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec into `ts`, which lives across the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    // SAFETY: sysconf takes an integer and touches no memory of ours.
    let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&h| h > 0)?;
    let secs = u64::try_from(ts.tv_sec).ok()?;
    let nanos = u64::try_from(ts.tv_nsec).ok()?;
    Some(secs.checked_mul(hz)? + nanos * hz / 1_000_000_000)
}
