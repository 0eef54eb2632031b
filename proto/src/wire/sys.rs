//! The socket syscalls of the wire transport: `sendmsg`/`recvmsg` with `SCM_RIGHTS` and
//! `SO_PEERCRED`, through nix. The one `unsafe` turns descriptors the kernel just
//! installed into owned ones.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, getsockopt, recvmsg, sendmsg, sockopt,
};

/// Linux's cap on descriptors in one `SCM_RIGHTS` message (`SCM_MAX_FD`): a control
/// buffer this large never truncates, whatever a peer sends.
const SCM_MAX_FD: usize = 253;

/// Sends `bufs` as one message with `fds` attached (none when empty). Returns the bytes
/// sent, which may be fewer than asked; the descriptors travel with the first byte.
pub(super) fn send_with_fds(sock: BorrowedFd<'_>, bufs: &[IoSlice<'_>], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let rights = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &rights };
    loop {
        match sendmsg::<UnixAddr>(sock.as_raw_fd(), bufs, cmsgs, MsgFlags::MSG_NOSIGNAL, None) {
            Err(Errno::EINTR) => continue,
            r => return r.map_err(io::Error::from),
        }
    }
}

/// What one `recvmsg` gave.
#[derive(Debug)]
pub(super) struct Received {
    /// Bytes read into the buffer (0 at end of stream).
    pub bytes: usize,
    /// Descriptors that came with them, owned (closed on drop) and close-on-exec.
    pub fds: Vec<OwnedFd>,
    /// The kernel truncated the control data (`MSG_CTRUNC`): descriptors were lost.
    pub truncated: bool,
}

/// Reads into `buf` with one `recvmsg`, taking any descriptors that arrive.
pub(super) fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut cmsg = nix::cmsg_space!([RawFd; SCM_MAX_FD], libc::ucred);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(Errno::EINTR) => continue,
            r => break r.map_err(io::Error::from)?,
        }
    };
    let mut fds = Vec::new();
    let truncated = match msg.cmsgs() {
        // ENOBUFS: MSG_CTRUNC; nix then refuses to walk the control data.
        Err(_) => true,
        Ok(iter) => {
            for c in iter {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    for fd in raw {
                        // SAFETY: the kernel installed `fd` in this process for this
                        // message (SCM_RIGHTS); nothing else knows of it, so it is owned
                        // here exactly once and closed when dropped.
                        fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            msg.flags.contains(MsgFlags::MSG_CTRUNC)
        }
    };
    Ok(Received { bytes: msg.bytes, fds, truncated })
}

/// The pid, uid and gid of the process at the other end, as the kernel recorded them
/// when the connection was made (`SO_PEERCRED`).
pub(super) fn peer_cred(sock: &impl std::os::fd::AsFd) -> io::Result<(i32, u32, u32)> {
    let cred = getsockopt(sock, sockopt::PeerCredentials).map_err(io::Error::from)?;
    Ok((cred.pid(), cred.uid(), cred.gid()))
}
