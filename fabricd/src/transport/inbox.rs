//! A connection's receive side: one `recvmsg` at a time into the connection's
//! [`FrameDecoder`] (`fabric_proto::wire`), which frames what arrives and says which
//! descriptors belong to which frame. Frames are read with as few `recvmsg` calls as the
//! bytes allow (usually one per frame: header, body and descriptors together): at a frame
//! boundary a read may bring several frames, inside a frame only the rest of it (the
//! decoder's rule for descriptors, in its module note).
//!
//! Each `recvmsg` makes room for [`DecoderConfig::SERVER`]'s `fds_per_read`
//! (`MAX_REQUEST_FDS`, the most any request carries): the kernel installs no more than
//! that in the daemon, whatever a peer sends, and reports the rest as truncation
//! (`MSG_CTRUNC`; also when the daemon's open-file table is full). A boundary read's
//! truncation travels with its descriptors to the frame that takes them, which is then
//! refused; the descriptors that did arrive are owned and closed like any. So at most one
//! read's descriptors (at most `MAX_REQUEST_FDS`) are ever held, and none is lost track of.
//!
//! [`DecoderConfig::SERVER`]: fabric_proto::wire::DecoderConfig::SERVER

use std::os::fd::AsFd;

use fabric_proto::wire::{DecoderConfig, FrameDecoder, recv_with_fds};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The decoder of a connection's requests.
pub fn decoder() -> FrameDecoder {
    FrameDecoder::new(DecoderConfig::SERVER)
}

/// Reads more with one `recvmsg` into `decoder`, waiting for the socket to be readable:
/// at a frame boundary up to the decoder's buffer, else at most the rest of the current
/// frame's part. Returns the bytes read (0: the peer closed). Call it only when
/// [`FrameDecoder::next_frame`] gave `None`. Cancel-safe: nothing is consumed until the
/// readiness wait is over.
pub async fn fill(decoder: &mut FrameDecoder, stream: &UnixStream) -> std::io::Result<usize> {
    let max_fds = usize::from(decoder.config().fds_per_read);
    loop {
        let dst = decoder.read_buf(true);
        if dst.is_empty() {
            // A whole frame waits, or the stream failed: reading would look like a close.
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "no frame to read into"));
        }
        match stream.try_io(Interest::READABLE, || recv_with_fds(stream.as_fd(), dst, max_fds, true)) {
            Ok(got) => {
                decoder.filled(got.bytes, got.fds, got.truncated);
                return Ok(got.bytes);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => stream.readable().await?,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_proto::wire::{DecodeError, FrameKind, HEADER_LEN, Header, MAX_REQUEST_BODY, Opcode, encode_frame};
    use std::io::IoSlice;
    use std::os::fd::OwnedFd;

    /// The largest frame the server reads.
    const MAX_FRAME: usize = HEADER_LEN + MAX_REQUEST_BODY as usize;

    fn pair() -> (std::os::unix::net::UnixStream, UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        (a, UnixStream::from_std(b).unwrap())
    }

    /// A request frame of `opcode` with `body` (the decoder never reads a body) announcing
    /// `fds` descriptors.
    fn frame(opcode: Opcode, body: &[u8], fds: u8) -> Vec<u8> {
        let mut out = Vec::new();
        let h = Header { fd_count: fds, ..Header::new(opcode, FrameKind::Request, 1) };
        encode_frame(&h, body, &mut out).unwrap();
        out
    }

    fn send_raw(s: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
        let raw: Vec<std::os::fd::RawFd> = fds.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
        let cmsgs = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
        let cmsgs = if raw.is_empty() { &cmsgs[..0] } else { &cmsgs[..] };
        let iov = [IoSlice::new(bytes)];
        let n = nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
            std::os::fd::AsRawFd::as_raw_fd(s),
            &iov,
            cmsgs,
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(n, bytes.len());
    }

    /// A pipe whose read end does not block, and whether its write ends are all closed.
    fn pipe() -> (std::fs::File, OwnedFd) {
        let (r, w) = std::io::pipe().unwrap();
        let r = std::fs::File::from(OwnedFd::from(r));
        nix::fcntl::fcntl(r.as_fd(), nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK)).unwrap();
        (r, OwnedFd::from(w))
    }

    fn write_ends_closed(r: &mut std::fs::File) -> bool {
        use std::io::Read;
        matches!(r.read(&mut [0u8; 1]), Ok(0))
    }

    #[tokio::test(flavor = "current_thread")]
    async fn one_read_per_frame_and_descriptors_go_to_their_frame() {
        let (a, b) = pair();
        let mut d = decoder();
        // Two frames sent at once: one read; the descriptor rides with the second
        // sendmsg, so the second frame takes it.
        let (first, second) = (frame(Opcode::Ping, &[], 0), frame(Opcode::Register, &[2; 18], 1));
        let (mut r, w) = pipe();
        send_raw(&a, &first, &[]);
        send_raw(&a, &second, &[w.as_fd()]);
        drop(w);
        assert_eq!(fill(&mut d, &b).await.unwrap(), first.len() + second.len());
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!((f.header.opcode, f.fds.len()), (Opcode::Ping, 0));
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!((f.header.opcode, f.body, f.fds.len()), (Opcode::Register, &[2u8; 18][..], 1));
        drop(f);
        assert!(d.next_frame().is_none() && d.at_boundary());
        assert!(write_ends_closed(&mut r), "the frame's descriptor outlived it");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn more_descriptors_than_a_request_carries_are_reported_and_none_is_kept() {
        let (a, b) = pair();
        let mut d = decoder();
        // 250 descriptors with a frame, as a hostile client sends them: the daemon gets
        // one installed and the truncation, and once the frame is refused holds none
        // (the old receive path kept 8 of them open forever).
        let pipes: Vec<_> = (0..250).map(|_| pipe()).collect();
        let fds: Vec<_> = pipes.iter().map(|(_, w)| w.as_fd()).collect();
        let bytes = frame(Opcode::Register, &[], 1);
        send_raw(&a, &bytes, &fds);
        drop(fds);
        assert_eq!(fill(&mut d, &b).await.unwrap(), HEADER_LEN);
        assert!(matches!(d.next_frame(), Some(Err(DecodeError::FdsTruncated { room: 1, .. }))));
        for (mut r, w) in pipes {
            drop(w);
            assert!(write_ends_closed(&mut r), "a received descriptor is still open");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn descriptors_inside_a_frame_are_closed_and_reads_stay_in_the_frame() {
        let (a, b) = pair();
        let mut d = decoder();
        let bytes = frame(Opcode::Status, &[7; 8], 0);
        send_raw(&a, &bytes[..10], &[]);
        assert_eq!(fill(&mut d, &b).await.unwrap(), 10);
        // The rest of the frame's header with descriptors, then its body and the next
        // frame: each read stops at the end of the part it is in, and the descriptors
        // (mid-frame) are closed at once, never handed out.
        let (mut r, w) = pipe();
        send_raw(&a, &bytes[10..], &[w.as_fd(), w.as_fd(), w.as_fd()]);
        drop(w);
        let next = frame(Opcode::Ping, &[], 0);
        send_raw(&a, &next[..5], &[]);
        assert_eq!(fill(&mut d, &b).await.unwrap(), HEADER_LEN - 10);
        assert!(write_ends_closed(&mut r), "descriptors inside a frame are kept");
        assert!(d.next_frame().is_none());
        assert_eq!(fill(&mut d, &b).await.unwrap(), 8);
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!((f.body, f.fds.len()), (&[7u8; 8][..], 0));
        assert_eq!(fill(&mut d, &b).await.unwrap(), 5);
        assert_eq!(d.buffered(), 5);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn frames_larger_than_the_buffer_grow_it_and_keep_their_bytes() {
        let (a, b) = pair();
        let mut d = decoder();
        let body: Vec<u8> = (0..MAX_REQUEST_BODY).map(|i| i as u8).collect();
        let (small, big) = (frame(Opcode::Status, &[0xee; 68], 0), frame(Opcode::Translate, &body, 0));
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            (&a).write_all(&small).unwrap();
            (&a).write_all(&big).unwrap();
            a
        });
        let mut got = Vec::new();
        while got.len() < 2 {
            while let Some(f) = d.next_frame() {
                let f = f.unwrap();
                got.push((f.header.opcode, f.body.to_vec()));
            }
            if got.len() < 2 {
                assert!(fill(&mut d, &b).await.unwrap() > 0);
            }
        }
        assert_eq!(got[0], (Opcode::Status, vec![0xee; 68]));
        assert_eq!(got[1], (Opcode::Translate, body));
        assert!(d.capacity() <= MAX_FRAME, "the buffer grew past one frame");
        drop(writer.join().unwrap());
        assert_eq!(fill(&mut d, &b).await.unwrap(), 0, "closed");
    }
}
