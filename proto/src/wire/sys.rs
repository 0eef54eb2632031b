//! The socket syscalls of the wire transport: `sendmsg` with `SCM_RIGHTS` and `SO_PEERCRED`
//! through nix; `recvmsg` directly, so that the control data the kernel wrote is read by
//! [`super::cmsg`] and every descriptor installed is owned, truncated or not.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr, connect, getsockopt, sendmsg, socket,
    sockopt,
};

/// Linux's cap on descriptors in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub const SCM_MAX_FD: usize = 253;

/// Sends `bufs` as one message with `fds` attached (none when empty). Returns the bytes
/// sent, which may be fewer than asked; the descriptors travel with the first byte. On a
/// non-blocking socket a full buffer is `WouldBlock` with nothing sent. The one
/// `SCM_RIGHTS` sender of the workspace (client, daemon, and libfabric-mm's descriptor
/// passing); [`recv_with_fds`] is the one receiver.
pub fn send_with_fds(sock: BorrowedFd<'_>, bufs: &[IoSlice<'_>], fds: &[BorrowedFd<'_>]) -> io::Result<usize> {
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

/// Connects a Unix stream socket to `path`, waiting at most `timeout` for the listener to
/// take it (`None`: as long as it takes). A listener whose accept queue is full (a wedged
/// server) makes a blocking `connect` wait for ever; here the socket is non-blocking, so
/// Linux answers `EAGAIN` at once and the connect is retried, backing off to 50 ms, until
/// it goes through or the time is up (`TimedOut`; a timeout past what an `Instant` holds
/// is none). Any other failure (nothing listening, no such file, no permission) is
/// returned at once. The stream comes back blocking.
pub fn connect_unix(path: &Path, timeout: Option<Duration>) -> io::Result<UnixStream> {
    let Some((timeout, deadline)) = timeout.and_then(|t| Some((t, Instant::now().checked_add(t)?))) else {
        return UnixStream::connect(path);
    };
    let addr = UnixAddr::new(path).map_err(io::Error::from)?;
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK, None)
        .map_err(io::Error::from)?;
    let mut pause = Duration::from_millis(1);
    loop {
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => break,
            Err(Errno::EINTR) => continue,
            Err(Errno::EAGAIN) => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the listener took no connection within {timeout:?} (its accept queue is full)"),
                    ));
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(50));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let stream = UnixStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// What one `recvmsg` gave.
#[derive(Debug)]
pub struct Received {
    /// Bytes read into the buffer (0 at end of stream).
    pub bytes: usize,
    /// Every descriptor the kernel installed for the message, owned (closed on drop) and
    /// close-on-exec, also when the control data was truncated.
    pub fds: Vec<OwnedFd>,
    /// Descriptors were lost: more came than the receiver made room for, or the kernel
    /// could not install them all (the receiver's open-file limit), or the control data was
    /// not as the kernel writes it (`MSG_CTRUNC`, or [`super::Rights::malformed`]).
    pub truncated: bool,
}

/// The control buffer: room for [`SCM_MAX_FD`] descriptors, aligned for `cmsghdr`.
const CONTROL_WORDS: usize = super::cmsg::rights_len(SCM_MAX_FD).div_ceil(std::mem::size_of::<usize>());

/// Reads into `buf` with one `recvmsg` (`MSG_DONTWAIT` when `nonblocking`), with room for
/// at most `max_fds` descriptors (at most [`SCM_MAX_FD`]): the kernel installs no more than
/// that in this process whatever the peer sends, and reports the rest as truncation. Every
/// descriptor installed is returned owned, so none can leak.
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8], max_fds: usize, nonblocking: bool) -> io::Result<Received> {
    let mut control = [0usize; CONTROL_WORDS];
    let room = super::cmsg::rights_len(max_fds.min(SCM_MAX_FD));
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let flags = libc::MSG_CMSG_CLOEXEC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    let (bytes, msg) = loop {
        // SAFETY: zeroed is a valid msghdr (null pointers, zero lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = room as _;
        // SAFETY: `msg` points at one iovec over `buf` and at `control`, whose first `room`
        // bytes (`room` <= its size) the kernel may write; all outlive the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
        if n >= 0 {
            break (n as usize, msg);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    // `msg_controllen` is a `size_t` on glibc and a `socklen_t` on musl.
    #[allow(clippy::unnecessary_cast)]
    let filled = (msg.msg_controllen as usize).min(room);
    let rights = super::cmsg::parse_rights(&zerocopy::IntoBytes::as_bytes(&control[..])[..filled]);
    let fds = rights
        .fds
        .iter()
        .map(|&fd| {
            // SAFETY: the kernel installed `fd` in this process for this message
            // (SCM_RIGHTS); nothing else knows of it, and the parser names each descriptor
            // once, so it is owned here exactly once and closed when dropped.
            unsafe { OwnedFd::from_raw_fd(fd) }
        })
        .collect();
    let truncated = msg.msg_flags & libc::MSG_CTRUNC != 0 || rights.malformed;
    Ok(Received { bytes, fds, truncated })
}

/// The pid, uid and gid of the process at the other end, as the kernel recorded them
/// when the connection was made (`SO_PEERCRED`).
pub(super) fn peer_cred(sock: &impl std::os::fd::AsFd) -> io::Result<(i32, u32, u32)> {
    let cred = getsockopt(sock, sockopt::PeerCredentials).map_err(io::Error::from)?;
    Ok((cred.pid(), cred.uid(), cred.gid()))
}
