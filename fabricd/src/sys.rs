//! The few system calls the daemon makes directly (and the descriptor-passing `sendmsg`);
//! everything else goes through std, nix or tokio.

/// The effective user id of this process.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions, cannot fail and touches no memory of ours.
    unsafe { libc::geteuid() }
}

/// Sends `buf` on the socket `sock` with `fd` attached as `SCM_RIGHTS`, in one
/// non-blocking `sendmsg`; returns the bytes sent (the descriptor travels with the first).
pub fn send_with_fd(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<usize> {
    use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
    use std::os::fd::AsRawFd;
    let raw = [fd.as_raw_fd()];
    let cmsgs = [ControlMessage::ScmRights(&raw)];
    let iov = [std::io::IoSlice::new(buf)];
    loop {
        match sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT, None)
        {
            Err(nix::errno::Errno::EINTR) => continue,
            r => return r.map_err(std::io::Error::from),
        }
    }
}

/// Reads into `buf` with one non-blocking `recvmsg`, taking the `SCM_RIGHTS` descriptors
/// that come with the bytes (owned, close-on-exec). Returns the bytes read and them.
pub fn recv_with_fds(
    sock: std::os::fd::BorrowedFd<'_>,
    buf: &mut [u8],
) -> std::io::Result<(usize, Vec<std::os::fd::OwnedFd>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, UnixAddr, recvmsg};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    let mut cmsg = nix::cmsg_space!([RawFd; 8]);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let flags = MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT;
    let msg = loop {
        match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), flags) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => break r.map_err(std::io::Error::from)?,
        }
    };
    let mut fds = Vec::new();
    if let Ok(iter) = msg.cmsgs() {
        for c in iter {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel installed `fd` in this process for this message
                    // (SCM_RIGHTS); nothing else knows of it, so it is owned here once.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
    }
    Ok((msg.bytes, fds))
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
