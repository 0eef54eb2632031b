//! A connection's receive buffer: frames are read with as few `recvmsg` calls as the
//! bytes allow (usually one per frame: header, body and descriptors together), and each
//! frame is handed out with the descriptors that came with its first bytes.
//!
//! Descriptors: the kernel ends a `recvmsg` right after the first chunk that carries
//! `SCM_RIGHTS`, so the descriptors of a read belong to its last chunk. A read is made at a
//! frame boundary only when the buffer is empty; then its descriptors go to the last frame
//! that starts within the bytes it brought (for a client that sends each frame with one
//! `sendmsg`, that frame's own). Every other read stays inside the frame being read (up to
//! the end of its header, then of its body), where no frame starts, so whatever descriptors
//! it brings are closed at once, as a plain `read` would have the kernel do.
//!
//! Each `recvmsg` makes room for [`MAX_REQUEST_FDS`] descriptors (the most any request
//! carries): the kernel installs no more than that in the daemon, whatever a peer sends,
//! and reports the rest as truncation (`MSG_CTRUNC`; also when the daemon's open-file
//! table is full). A boundary read's truncation travels with its descriptors to the frame
//! that takes them, which is then refused; the descriptors that did arrive are owned and
//! closed like any. So at most one read's descriptors (at most [`MAX_REQUEST_FDS`]) are
//! ever held, and none is lost track of.

use std::os::fd::{AsFd, OwnedFd};

use fabric_proto::wire::{HEADER_LEN, MAX_REQUEST_BODY, MAX_REQUEST_FDS, recv_with_fds};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// The most a frame the server reads can hold: a header and the largest request body.
pub const MAX_FRAME: usize = HEADER_LEN + MAX_REQUEST_BODY as usize;
/// The buffer a connection starts with (it grows only for frames larger than this).
const INITIAL: usize = 4096;

/// Descriptors that came with the bytes `start..end` of the buffer.
#[derive(Debug)]
struct Arrived {
    start: usize,
    end: usize,
    fds: FrameFds,
}

/// The descriptors a frame came with.
#[derive(Debug, Default)]
pub struct FrameFds {
    /// Those the kernel installed, owned.
    pub fds: Vec<OwnedFd>,
    /// More came than were installed (more than [`MAX_REQUEST_FDS`], or the daemon's
    /// open-file table was full): the frame must be refused.
    pub truncated: bool,
}

/// The receive buffer of one connection.
#[derive(Debug)]
pub struct Inbox {
    buf: Vec<u8>,
    /// The first byte not yet handed out (the start of the current frame).
    start: usize,
    /// The end of the bytes read.
    end: usize,
    /// The descriptors of the last boundary read, until a frame takes them.
    arrived: Option<Arrived>,
}

impl Default for Inbox {
    fn default() -> Self {
        Self::new()
    }
}

impl Inbox {
    /// An empty inbox.
    pub fn new() -> Self {
        Self { buf: vec![0; INITIAL], start: 0, end: 0, arrived: None }
    }

    /// The bytes read and not yet handed out (the current frame, and maybe more).
    pub fn pending(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Whether no bytes wait.
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Reads more with one `recvmsg`, waiting for the socket to be readable: `None`, at a
    /// frame boundary with nothing pending, up to the buffer's end; `Some(want)`, at most
    /// `want` (> 0) more bytes of the current frame. Returns the bytes read (0: the peer
    /// closed). Cancel-safe: nothing is consumed until the readiness wait is over.
    pub async fn fill(&mut self, stream: &UnixStream, want: Option<usize>) -> std::io::Result<usize> {
        let boundary = want.is_none() && self.is_empty();
        let want = want.unwrap_or(1).max(1);
        if self.is_empty() {
            self.start = 0;
            self.end = 0;
        }
        self.make_room(want);
        let limit = if boundary { self.buf.len() } else { (self.end + want).min(self.buf.len()) };
        let max_fds = usize::from(MAX_REQUEST_FDS);
        let got = loop {
            let dst = &mut self.buf[self.end..limit];
            match stream.try_io(Interest::READABLE, || recv_with_fds(stream.as_fd(), dst, max_fds, true)) {
                Ok(r) => break r,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => stream.readable().await?,
                Err(e) => return Err(e),
            }
        };
        let n = got.bytes;
        if boundary && (!got.fds.is_empty() || got.truncated) {
            // A boundary read happens only when nothing was held: this replaces nothing.
            let fds = FrameFds { fds: got.fds, truncated: got.truncated };
            self.arrived = Some(Arrived { start: self.end, end: self.end + n, fds });
        }
        // Inside a frame: dropped here, closed (see the module's note).
        self.end += n;
        Ok(n)
    }

    /// Makes room for `want` more bytes after the current frame's start: moves the pending
    /// bytes to the front, and grows the buffer up to [`MAX_FRAME`].
    fn make_room(&mut self, want: usize) {
        let len = self.end - self.start;
        let need = (len + want).min(MAX_FRAME);
        if self.end + want <= self.buf.len() {
            return;
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            if let Some(a) = &mut self.arrived {
                // Ranges before the current frame were settled when it was handed out.
                a.start = a.start.saturating_sub(self.start);
                a.end = a.end.saturating_sub(self.start);
            }
            self.start = 0;
            self.end = len;
        }
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
    }

    /// Hands out the current frame, `len` bytes from the start (all read), with the
    /// descriptors that came with it, and moves past it.
    pub fn take(&mut self, len: usize) -> (std::ops::Range<usize>, FrameFds) {
        let (f, next) = (self.start, self.start + len);
        let fds = match self.arrived.take() {
            // The last frame that starts within the read that brought them takes them.
            Some(a) if a.start <= f && f < a.end && next >= a.end => a.fds,
            // They belong to a later frame of the same read.
            Some(a) if next < a.end && f < a.end => {
                self.arrived = Some(a);
                FrameFds::default()
            }
            // No frame started where they came (or it is gone): closed.
            _ => FrameFds::default(),
        };
        self.start = next;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        (f..next, fds)
    }

    /// The bytes of a range [`Inbox::take`] handed out; valid until the next `fill`.
    pub fn bytes(&self, r: std::ops::Range<usize>) -> &[u8] {
        &self.buf[r]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;
    use std::os::fd::AsFd;

    fn pair() -> (std::os::unix::net::UnixStream, UnixStream) {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        (a, UnixStream::from_std(b).unwrap())
    }

    fn send(s: &std::os::unix::net::UnixStream, bytes: &[u8], nfds: usize) {
        let files: Vec<std::fs::File> = (0..nfds).map(|_| tempfile::tempfile().unwrap()).collect();
        let fds: Vec<_> = files.iter().map(AsFd::as_fd).collect();
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

    #[tokio::test(flavor = "current_thread")]
    async fn one_read_per_frame_and_descriptors_go_to_their_frame() {
        let (a, b) = pair();
        let mut inbox = Inbox::new();
        // Two frames (40 and 50 bytes) sent at once: one read; the descriptor rides with
        // the second sendmsg, so the second frame takes it.
        send(&a, &[1; 40], 0);
        send(&a, &[2; 50], 1);
        assert_eq!(inbox.fill(&b, None).await.unwrap(), 90);
        let (r, fds) = inbox.take(40);
        assert_eq!((r.clone(), fds.fds.len(), fds.truncated), (0..40, 0, false));
        assert_eq!(inbox.bytes(r), &[1; 40]);
        let (r, fds) = inbox.take(50);
        assert_eq!((r.clone(), fds.fds.len(), fds.truncated), (40..90, 1, false));
        assert!(inbox.is_empty());
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
    async fn more_descriptors_than_a_request_carries_are_reported_and_none_is_kept() {
        let (a, b) = pair();
        let mut inbox = Inbox::new();
        // 250 descriptors with a frame, as a hostile client sends them: the daemon gets
        // one installed and the truncation, and once the frame is dropped holds none
        // (the old receive path kept 8 of them open forever).
        let pipes: Vec<_> = (0..250).map(|_| pipe()).collect();
        let raw: Vec<std::os::fd::RawFd> = pipes.iter().map(|(_, w)| std::os::fd::AsRawFd::as_raw_fd(w)).collect();
        let cmsgs = [nix::sys::socket::ControlMessage::ScmRights(&raw)];
        let iov = [IoSlice::new(&[3; 32])];
        let fd = std::os::fd::AsRawFd::as_raw_fd(&a);
        nix::sys::socket::sendmsg::<nix::sys::socket::UnixAddr>(
            fd,
            &iov,
            &cmsgs,
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(inbox.fill(&b, None).await.unwrap(), 32);
        let (_, fds) = inbox.take(32);
        assert_eq!((fds.fds.len(), fds.truncated), (1, true));
        drop(fds);
        for (mut r, w) in pipes {
            drop(w);
            assert!(write_ends_closed(&mut r), "a received descriptor is still open");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn descriptors_inside_a_frame_are_closed_and_reads_stay_in_the_frame() {
        let (a, b) = pair();
        let mut inbox = Inbox::new();
        send(&a, &[7; 10], 0);
        assert_eq!(inbox.fill(&b, None).await.unwrap(), 10);
        // The rest of a 40-byte frame with descriptors, then the next frame: the read
        // stops at the frame's end, and the descriptors (mid-frame) are not handed out.
        send(&a, &[8; 30], 3);
        send(&a, &[9; 5], 0);
        assert_eq!(inbox.fill(&b, Some(30)).await.unwrap(), 30);
        let (_, fds) = inbox.take(40);
        assert!(fds.fds.is_empty() && !fds.truncated);
        assert_eq!(inbox.fill(&b, None).await.unwrap(), 5);
        assert_eq!(inbox.pending(), &[9; 5]);
    }

    /// Frames of random lengths (a 4-byte length prefix stands in for the header), sent
    /// in random chunks, some with descriptors, and read the way the server reads: every
    /// frame comes back byte for byte, and a frame gets descriptors only when a chunk that
    /// carried them began at or before its first byte and ended after it.
    #[tokio::test(flavor = "current_thread")]
    async fn random_chunking_keeps_frames_whole_and_descriptors_with_frame_starts() {
        let (a, b) = pair();
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut stream = Vec::new();
        let mut starts = Vec::new();
        for i in 0..200u32 {
            let len = 4 + next(300) as usize;
            starts.push(stream.len());
            stream.extend_from_slice(&(len as u32).to_le_bytes());
            stream.extend((4..len).map(|k| (i as usize + k) as u8));
        }
        // Chunks: (start, end, descriptors).
        let mut chunks = Vec::new();
        let mut at = 0;
        while at < stream.len() {
            let end = (at + 1 + next(400) as usize).min(stream.len());
            chunks.push((at, end, if next(4) == 0 { 1 + next(3) as usize } else { 0 }));
            at = end;
        }
        let sent: Vec<_> = chunks.clone();
        let bytes = stream.clone();
        let writer = std::thread::spawn(move || {
            for (s, e, n) in sent {
                send(&a, &bytes[s..e], n);
            }
            a
        });
        let mut inbox = Inbox::new();
        for (i, &start) in starts.iter().enumerate() {
            if inbox.is_empty() {
                assert!(inbox.fill(&b, None).await.unwrap() > 0);
            }
            while inbox.pending().len() < 4 {
                let want = 4 - inbox.pending().len();
                assert!(inbox.fill(&b, Some(want)).await.unwrap() > 0);
            }
            let p = inbox.pending();
            let len = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize;
            while inbox.pending().len() < len {
                let want = len - inbox.pending().len();
                assert!(inbox.fill(&b, Some(want)).await.unwrap() > 0);
            }
            let (r, fds) = inbox.take(len);
            assert_eq!(inbox.bytes(r), &stream[start..start + len], "frame {i}");
            if !fds.fds.is_empty() || fds.truncated {
                let carried = chunks.iter().any(|&(s, e, n)| n > 0 && s <= start && start < e);
                let later = chunks.iter().any(|&(s, e, n)| n > 0 && s > start && s < start + len && e > 0);
                assert!(carried || later, "frame {i} got descriptors no chunk at its start carried");
                // One installed at most; more sent is reported, never handed out.
                assert!(fds.fds.len() <= 1);
                let many = chunks.iter().any(|&(s, e, n)| n > 1 && s <= start && start < e);
                assert!(!fds.truncated || many || later, "frame {i} reported a truncation no chunk caused");
            }
        }
        drop(writer.join().unwrap());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn frames_larger_than_the_buffer_grow_it_and_keep_their_bytes() {
        let (a, b) = pair();
        let mut inbox = Inbox::new();
        let big: Vec<u8> = (0..MAX_FRAME).map(|i| i as u8).collect();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            (&a).write_all(&[0xEE; 100]).unwrap();
            (&a).write_all(&big).unwrap();
            a
        });
        while inbox.pending().len() < 100 {
            let want = 100 - inbox.pending().len();
            inbox.fill(&b, Some(want)).await.unwrap();
        }
        let _ = inbox.take(100);
        while inbox.pending().len() < MAX_FRAME {
            let want = MAX_FRAME - inbox.pending().len();
            assert!(inbox.fill(&b, Some(want)).await.unwrap() > 0);
        }
        let (r, _) = inbox.take(MAX_FRAME);
        let got = inbox.bytes(r).to_vec();
        assert!(got.iter().enumerate().all(|(i, b)| *b == i as u8));
        drop(writer.join().unwrap());
        assert_eq!(inbox.fill(&b, None).await.unwrap(), 0, "closed");
    }
}
