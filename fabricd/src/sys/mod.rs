//! The system layer: the daemon's private files and directories ([`privdir`]), the shares
//! of its open-file table ([`fdbudget`]), bulk work at a lower CPU priority ([`bulk`]), `sd_notify` ([`notify`]), and the few system calls
//! it makes directly (here); descriptors are passed by
//! `fabric_proto::wire::{send_with_fds, recv_with_fds}`, everything else goes through std,
//! nix or tokio.

pub mod bulk;
pub mod fdbudget;
pub mod notify;
pub mod privdir;

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// The soft `RLIMIT_NOFILE` of this process (`None`: unlimited or unreadable).
pub fn open_file_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Whether the peer of the connected socket `sock` has closed it (`POLLHUP`, or an error
/// pending), asked without waiting. A peer that only shut down its writing half is not.
pub fn hung_up(sock: std::os::fd::BorrowedFd<'_>) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: 0, revents: 0 };
    // SAFETY: poll reads and writes the one pollfd `p` points to, which lives across the
    // call; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// `N` bytes from the kernel's random source (`/dev/urandom`): secrets, session tokens,
/// node ids.
pub fn random_bytes<const N: usize>() -> std::io::Result<[u8; N]> {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}
