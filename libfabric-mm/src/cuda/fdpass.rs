//! Passing a CUDA POSIX descriptor to another process over a Unix socket (`SCM_RIGHTS`),
//! with a small payload (the allocation size the importer needs).
//!
//! fabricd's `Register` and memory-object paths accept only memfds and regular files
//! (docs/protocol.md: received descriptors are `fstat`-checked), so a CUDA export — an
//! anonymous-inode descriptor of the NVIDIA driver — travels between the two processes
//! directly rather than through the daemon.

use std::io::IoSlice;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

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
    let sent = fabric_proto::wire::send_with_fds(sock.as_fd(), &[IoSlice::new(payload)], &[fd])
        .map_err(|e| io("sendmsg", e))?;
    if sent != payload.len() {
        return Err(io("sendmsg", format!("sent {sent} of {} bytes", payload.len())));
    }
    Ok(())
}

/// Receives one message sent by [`send_fd`]: its payload and its one descriptor. A message
/// with more descriptors is refused, and every descriptor it brought is closed.
pub fn recv_fd(sock: &UnixStream) -> Result<(Vec<u8>, OwnedFd), CudaError> {
    let mut buf = [0u8; MAX_PAYLOAD];
    // Room for one: the kernel closes what does not fit and says so (`truncated`).
    let got = fabric_proto::wire::recv_with_fds(sock.as_fd(), &mut buf, 1, false).map_err(|e| io("recvmsg", e))?;
    if got.truncated {
        return Err(io("recvmsg", "more than one descriptor attached (all closed)"));
    }
    if got.bytes == 0 {
        return Err(io("recvmsg", "the peer closed the socket"));
    }
    let fd = got.fds.into_iter().next().ok_or_else(|| io("recvmsg", "no descriptor attached"))?;
    Ok((buf[..got.bytes].to_vec(), fd))
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

    /// More descriptors than one: refused, and none of them stays open here (each pipe's
    /// reader sees end of file once the sender's copy is closed too). Before, the kernel
    /// installed four, the rest were lost and the four were never closed.
    #[test]
    fn a_message_with_many_descriptors_is_refused_and_leaves_none_open() {
        let (a, b) = UnixStream::pair().unwrap();
        let pipes: Vec<_> = (0..8).map(|_| std::io::pipe().unwrap()).collect();
        let ends: Vec<BorrowedFd<'_>> = pipes.iter().map(|(_, w)| w.as_fd()).collect();
        fabric_proto::wire::send_with_fds(a.as_fd(), &[IoSlice::new(b"size=1")], &ends).unwrap();
        let e = recv_fd(&b).unwrap_err();
        assert!(e.to_string().contains("more than one"), "{e}");
        for (mut r, w) in pipes {
            drop(w);
            let mut byte = [0u8; 1];
            assert_eq!(r.read(&mut byte).unwrap(), 0, "a write end is still open in this process");
        }
    }
}
