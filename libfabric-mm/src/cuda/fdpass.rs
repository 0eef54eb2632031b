//! Passing a CUDA POSIX descriptor to another process over a Unix socket (`SCM_RIGHTS`),
//! with a small payload (the allocation size the importer needs).
//!
//! fabricd's `Register` and memory-object paths accept only memfds and regular files
//! (docs/protocol.md: received descriptors are `fstat`-checked), so a CUDA export — an
//! anonymous-inode descriptor of the NVIDIA driver — travels between the two processes
//! directly rather than through the daemon.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::errno::Errno;
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

use super::CudaError;

/// The most payload bytes one message carries.
pub const MAX_PAYLOAD: usize = 256;

fn io(op: &'static str, e: impl std::fmt::Display) -> CudaError {
    CudaError::Io { op, message: e.to_string() }
}

/// Sends `payload` (at most [`MAX_PAYLOAD`] bytes, not empty) with `fd` attached.
pub fn send_fd(sock: &UnixStream, fd: BorrowedFd<'_>, payload: &[u8]) -> Result<(), CudaError> {
    if payload.is_empty() || payload.len() > MAX_PAYLOAD {
        return Err(CudaError::InvalidArgument(format!("payload of {} bytes", payload.len())));
    }
    let raw = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let iov = [IoSlice::new(payload)];
    let sent = loop {
        match sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None) {
            Err(Errno::EINTR) => continue,
            r => break r.map_err(|e| io("sendmsg", e))?,
        }
    };
    if sent != payload.len() {
        return Err(io("sendmsg", format!("sent {sent} of {} bytes", payload.len())));
    }
    Ok(())
}

/// Receives one message sent by [`send_fd`]: its payload and its one descriptor.
pub fn recv_fd(sock: &UnixStream) -> Result<(Vec<u8>, OwnedFd), CudaError> {
    let mut buf = [0u8; MAX_PAYLOAD];
    let mut cmsg = nix::cmsg_space!([RawFd; 4]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = loop {
        match recvmsg::<UnixAddr>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(Errno::EINTR) => continue,
            r => break r.map_err(|e| io("recvmsg", e))?,
        }
    };
    let bytes = msg.bytes;
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(|e| io("recvmsg", e))? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel installed `fd` in this process for this message; nothing
                // else knows of it, so it is owned here exactly once.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        return Err(io("recvmsg", "control data truncated: descriptors lost"));
    }
    if bytes == 0 {
        return Err(io("recvmsg", "the peer closed the socket"));
    }
    let mut fds = fds.into_iter();
    let fd = fds.next().ok_or_else(|| io("recvmsg", "no descriptor attached"))?;
    if fds.next().is_some() {
        return Err(io("recvmsg", "more than one descriptor attached"));
    }
    Ok((buf[..bytes].to_vec(), fd))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};

    use super::*;

    #[test]
    fn a_descriptor_and_its_payload_cross_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(b"hbm stand-in").unwrap();
        send_fd(&a, std::os::fd::AsFd::as_fd(&file), b"size=2097152").unwrap();
        let (payload, fd) = recv_fd(&b).unwrap();
        assert_eq!(payload, b"size=2097152");
        let mut got = std::fs::File::from(fd);
        got.rewind().unwrap();
        let mut s = String::new();
        got.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hbm stand-in", "the received descriptor is the same open file");
    }

    #[test]
    fn a_message_without_descriptor_or_after_close_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(b"no fd").unwrap();
        assert!(matches!(recv_fd(&b), Err(CudaError::Io { .. })));
        drop(a);
        let e = recv_fd(&b).unwrap_err();
        assert!(e.to_string().contains("closed"), "{e}");
        let (c, _d) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        assert!(matches!(send_fd(&c, std::os::fd::AsFd::as_fd(&f), b""), Err(CudaError::InvalidArgument(_))));
    }
}
