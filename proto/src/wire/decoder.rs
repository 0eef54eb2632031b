//! The sans-IO frame decoder: received bytes, and any descriptors that came with them, go
//! in; whole checked frames — header, body bytes and the descriptors that belong to the
//! frame — or typed refusals come out. No I/O: the daemon's tokio reader, the blocking
//! client transport and a node-to-node link (bytes only) all drive this one decoder.
//!
//! Bounded: the decoder holds at most one frame of [`DecoderConfig::max_body`] plus a
//! header, whatever a peer sends. It reads as a receiver must: the header is checked
//! ([`super::decode_header`]) before any body byte is buffered; the body of a frame this
//! side does not take (an unknown opcode, or a kind it does not expect) is read past
//! without being kept; a header that cannot be trusted stops the stream for good.
//! Resumable at any byte boundary: bytes may arrive one at a time or many frames at once.
//!
//! Descriptors (`SCM_RIGHTS` on a Unix socket; none on other links): a sender attaches a
//! frame's descriptors to its first byte, and the kernel ends a `recvmsg` right after the
//! chunk that carries them, so the descriptors of a read belong to the last frame that
//! starts within the bytes it brought. The decoder offers room past the current frame only
//! at a frame boundary (nothing buffered): every other read stays inside the frame being
//! read, where no frame starts, so the descriptors it brings are closed at once. At most one
//! read's descriptors are held until a frame takes them; a frame that is refused, or read
//! past, closes its own.

use std::os::fd::OwnedFd;

use super::codec::Frame;
use super::header::{FrameError, FrameKind, HEADER_LEN, Header, decode_header};
use super::{MAX_BODY, MAX_FDS, MAX_REQUEST_BODY, MAX_REQUEST_FDS};

/// The buffer a decoder starts with when it reads greedily (it grows only for frames larger
/// than this, up to one frame).
const INITIAL: usize = 4096;

/// What to do with descriptors beyond the count a header announces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraFds {
    /// Close them and hand the frame out with the ones announced (a client: what the
    /// daemon sends is trusted to be meant, the rest is noise).
    Close,
    /// Refuse the frame ([`DecodeError::ExtraFds`]; a server: a request is exactly what it
    /// says).
    Refuse,
}

/// What a decoder takes: the limits of one side of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecoderConfig {
    /// The largest body buffered. A frame this side takes with a longer body stops the
    /// stream; one it reads past may be longer (only up to its opcode's limit).
    pub max_body: u32,
    /// The only kind handed out (`None`: every kind); frames of other kinds are read past
    /// and reported as [`DecodeError::UnexpectedKind`].
    pub expect: Option<FrameKind>,
    /// The most descriptors the receiver makes room for in one read: what the kernel may
    /// install in this process per `recvmsg` (links without descriptors ignore it).
    pub fds_per_read: u8,
    /// Descriptors beyond a header's count.
    pub extra_fds: ExtraFds,
}

impl DecoderConfig {
    /// A server reading requests: bodies up to [`MAX_REQUEST_BODY`], room for
    /// [`MAX_REQUEST_FDS`] descriptors per read, exactly the descriptors announced.
    pub const SERVER: Self = Self {
        max_body: MAX_REQUEST_BODY,
        expect: Some(FrameKind::Request),
        fds_per_read: MAX_REQUEST_FDS,
        extra_fds: ExtraFds::Refuse,
    };

    /// A client reading answers and events: bodies up to [`MAX_BODY`], room for
    /// [`MAX_FDS`] descriptors per read, those beyond the announced count closed.
    pub const CLIENT: Self =
        Self { max_body: MAX_BODY, expect: None, fds_per_read: MAX_FDS, extra_fds: ExtraFds::Close };

    /// The largest frame buffered.
    pub const fn max_frame(&self) -> usize {
        HEADER_LEN + self.max_body as usize
    }
}

/// Why a frame is refused. After [`DecodeError::is_fatal`] ones the stream cannot be read
/// further; after the others the whole frame was read (its descriptors closed), and the
/// next one can be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The header is refused ([`super::decode_header`]), or announces a body larger than
    /// the decoder buffers: the stream cannot be resynchronised.
    #[error(transparent)]
    Header(FrameError),
    /// An opcode this side does not know, with a body it could read past.
    #[error("unknown opcode {code:#06x}")]
    UnknownOpcode {
        /// The code.
        code: u16,
        /// The frame's request id.
        request_id: u64,
        /// Its body length.
        body_len: u32,
    },
    /// A frame of a kind this side does not take (a client sending a response).
    #[error("a peer sent a {:?} frame", .header.kind)]
    UnexpectedKind {
        /// Its header.
        header: Header,
    },
    /// More descriptors came with the frame than a read makes room for, or the receiver
    /// could install no more: none is kept.
    #[error(
        "more descriptors came with the frame than it may carry (at most {room} a read), or no more could be installed; none is kept"
    )]
    FdsTruncated {
        /// Its header.
        header: Header,
        /// The room made per read.
        room: u8,
    },
    /// Fewer descriptors came with the frame's first bytes than its header announced.
    #[error("the header announced {announced} descriptors and {received} came with the frame's first bytes")]
    MissingFds {
        /// Its header.
        header: Header,
        /// From the header.
        announced: u8,
        /// Arrived.
        received: usize,
    },
    /// More descriptors came with the frame than its header announced ([`ExtraFds::Refuse`]).
    #[error("the header announced {announced} descriptors and {received} came with the frame's first bytes")]
    ExtraFds {
        /// Its header.
        header: Header,
        /// From the header.
        announced: u8,
        /// Arrived.
        received: usize,
    },
}

impl DecodeError {
    /// Whether the stream is out of sync after this refusal.
    pub fn is_fatal(&self) -> bool {
        matches!(self, DecodeError::Header(_))
    }

    /// The header of the refused frame, when it was read.
    pub fn header(&self) -> Option<&Header> {
        match self {
            DecodeError::Header(_) | DecodeError::UnknownOpcode { .. } => None,
            DecodeError::UnexpectedKind { header }
            | DecodeError::FdsTruncated { header, .. }
            | DecodeError::MissingFds { header, .. }
            | DecodeError::ExtraFds { header, .. } => Some(header),
        }
    }
}

/// A decoded frame, borrowing its body from the decoder until the next call that changes
/// it.
#[derive(Debug)]
pub struct FrameView<'a, D = OwnedFd> {
    /// The checked header.
    pub header: Header,
    /// The body: exactly `header.body_len` bytes.
    pub body: &'a [u8],
    /// The descriptors that came with the frame: exactly `header.fd_count`.
    pub fds: Vec<D>,
}

impl FrameView<'_, OwnedFd> {
    /// The frame with a body of its own.
    pub fn into_frame(self) -> Frame {
        Frame { header: self.header, body: self.body.to_vec(), fds: self.fds }
    }
}

/// Which part of a frame is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FramePart {
    /// The 32-byte header.
    Header,
    /// The body.
    Body,
}

/// How far the frame being read has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The part being read.
    pub part: FramePart,
    /// Bytes of that part read.
    pub read: usize,
    /// Bytes of that part in all.
    pub need: usize,
}

/// Descriptors that came with the stream bytes `start..end`.
#[derive(Debug)]
struct Arrived<D> {
    start: u64,
    end: u64,
    fds: Vec<D>,
    truncated: bool,
}

/// A refused frame's body being read past, and the refusal to report once it is.
#[derive(Debug)]
struct Skip {
    left: usize,
    body_len: usize,
    refusal: DecodeError,
}

/// The sans-IO decoder of one direction of one connection. Drive it by calling
/// [`FrameDecoder::next_frame`] until it gives `None`, then receiving into
/// [`FrameDecoder::read_buf`] and telling it with [`FrameDecoder::filled`] (or handing it
/// bytes with [`FrameDecoder::push`]). `D` is what a descriptor is: [`OwnedFd`] on a Unix
/// socket; a link that carries none (TCP) hands in empty lists, and tests use stand-ins.
#[derive(Debug)]
pub struct FrameDecoder<D = OwnedFd> {
    config: DecoderConfig,
    buf: Vec<u8>,
    /// The first byte not yet handed out (the start of the current frame).
    start: usize,
    /// The end of the bytes received.
    end: usize,
    /// The stream offset of `buf[0]`.
    base: u64,
    /// The current frame's header, once checked.
    header: Option<Header>,
    /// The descriptors of the last boundary read, until a frame takes them.
    arrived: Option<Arrived<D>>,
    skip: Option<Skip>,
    /// The refusal that stopped the stream.
    failed: Option<FrameError>,
}

impl<D> FrameDecoder<D> {
    /// A decoder at the start of a stream; it allocates nothing until it first receives.
    pub fn new(config: DecoderConfig) -> Self {
        Self {
            config,
            buf: Vec::new(),
            start: 0,
            end: 0,
            base: 0,
            header: None,
            arrived: None,
            skip: None,
            failed: None,
        }
    }

    /// Its limits.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// Changes its limits for the frames whose headers it checks from now on (a frame
    /// whose header was checked keeps the limits it was checked against): a link that
    /// takes a small handshake first, then larger frames.
    pub fn set_config(&mut self, config: DecoderConfig) {
        self.config = config;
    }

    /// How far the current frame has come; `None` at a frame boundary with nothing
    /// buffered (the next byte received starts a frame).
    pub fn progress(&self) -> Option<Progress> {
        if let Some(s) = &self.skip {
            return Some(Progress { part: FramePart::Body, read: s.body_len - s.left, need: s.body_len });
        }
        let pending = self.end - self.start;
        match self.header {
            _ if pending == 0 => None,
            // A whole header not yet checked counts as read (next_frame checks it).
            None => Some(Progress { part: FramePart::Header, read: pending.min(HEADER_LEN), need: HEADER_LEN }),
            Some(h) => Some(Progress { part: FramePart::Body, read: pending - HEADER_LEN, need: h.body_len as usize }),
        }
    }

    /// Whether nothing is buffered and no frame has begun.
    pub fn at_boundary(&self) -> bool {
        self.progress().is_none()
    }

    /// Whether the stream was stopped by a refused header.
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// The bytes the current frame still needs before it can be decoded (the rest of its
    /// header, then of its body); 0 when a frame is complete (call
    /// [`FrameDecoder::next_frame`]) or the stream failed.
    pub fn want(&self) -> usize {
        if self.failed.is_some() {
            return 0;
        }
        if let Some(s) = &self.skip {
            return s.left;
        }
        let pending = self.end - self.start;
        match self.header {
            None => HEADER_LEN.saturating_sub(pending),
            Some(h) => (HEADER_LEN + h.body_len as usize).saturating_sub(pending),
        }
    }

    /// Where to receive next. At a frame boundary: up to the buffer's end when `greedy`
    /// (several frames in one read), else one header. Inside a frame: exactly the rest of
    /// its current part, so that no read brings bytes past the frame it is in. Empty after
    /// a fatal refusal, or while a complete frame waits for [`FrameDecoder::next_frame`].
    pub fn read_buf(&mut self, greedy: bool) -> &mut [u8] {
        if self.failed.is_some() {
            return &mut [];
        }
        if let Some(s) = &self.skip {
            // Nothing is buffered while a body is read past: the buffer is scratch.
            let n = s.left.min(INITIAL.max(self.buf.len()));
            if self.buf.len() < n {
                self.buf.resize(n, 0);
            }
            return &mut self.buf[..n];
        }
        let want = if self.at_boundary() && greedy {
            self.buf.len().max(INITIAL).min(self.config.max_frame())
        } else {
            self.want()
        };
        self.make_room(want);
        let end = (self.end + want).min(self.buf.len());
        &mut self.buf[self.end..end]
    }

    /// Makes room for `want` more bytes after the current frame's start: moves the pending
    /// bytes to the front, and grows the buffer up to one frame.
    fn make_room(&mut self, want: usize) {
        if self.start == self.end {
            self.base += self.end as u64;
            self.start = 0;
            self.end = 0;
        }
        if self.end + want <= self.buf.len() {
            return;
        }
        let len = self.end - self.start;
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.base += self.start as u64;
            self.start = 0;
            self.end = len;
        }
        let need = (len + want).min(self.config.max_frame());
        if self.buf.len() < need {
            self.buf.resize(need, 0);
        }
    }

    /// Records that `n` bytes were received into [`FrameDecoder::read_buf`], with `fds`
    /// (`truncated`: descriptors were lost: more came than the room made, or the receiver
    /// could install no more). A read at a frame boundary keeps its descriptors for the
    /// last frame that starts within it; any other read's are closed here.
    pub fn filled(&mut self, n: usize, fds: Vec<D>, truncated: bool) {
        if self.failed.is_some() {
            return;
        }
        if let Some(s) = &mut self.skip {
            s.left -= n.min(s.left);
            return;
        }
        let boundary = self.at_boundary();
        let n = n.min(self.buf.len() - self.end);
        let at = self.base + self.end as u64;
        self.end += n;
        if boundary && (!fds.is_empty() || truncated) {
            // A boundary read happens only when nothing was held: this replaces nothing.
            self.arrived = Some(Arrived { start: at, end: at + n as u64, fds, truncated });
        }
        // Inside a frame: dropped here, closed (see the module's note).
    }

    /// Hands the decoder received bytes (a link that reads into its own buffer): takes
    /// as many as [`FrameDecoder::read_buf`] offers (`greedy`) and returns how many; push
    /// the rest after the frames they complete are taken. The descriptors go with the
    /// bytes taken.
    pub fn push(&mut self, bytes: &[u8], fds: Vec<D>, truncated: bool) -> usize {
        let room = self.read_buf(true);
        let n = room.len().min(bytes.len());
        room[..n].copy_from_slice(&bytes[..n]);
        self.filled(n, fds, truncated);
        n
    }

    /// The descriptors of the frame at stream bytes `start..end`: those of the read that
    /// brought its first byte, when it is the last frame to start within that read.
    fn claim(&mut self, start: u64, end: u64) -> (Vec<D>, bool) {
        match self.arrived.take() {
            Some(a) if a.start <= start && start < a.end && end >= a.end => (a.fds, a.truncated),
            // They belong to a later frame of the same read.
            Some(a) if start < a.end && end < a.end => {
                self.arrived = Some(a);
                (Vec::new(), false)
            }
            // No frame started where they came (or it is gone): closed.
            _ => (Vec::new(), false),
        }
    }

    /// Moves past `len` buffered bytes.
    fn consume(&mut self, len: usize) {
        self.start += len;
        if self.start == self.end {
            self.base += self.end as u64;
            self.start = 0;
            self.end = 0;
        }
    }

    fn fail(&mut self, e: FrameError) -> Option<Result<FrameView<'_, D>, DecodeError>> {
        self.failed = Some(e);
        self.arrived = None;
        self.header = None;
        self.start = self.end;
        Some(Err(DecodeError::Header(e)))
    }

    /// Starts reading past a frame whose header was just read: its descriptors are closed,
    /// the body bytes already buffered dropped; `refusal` is reported once the rest is.
    fn skip(&mut self, body_len: usize, refusal: DecodeError) -> Option<Result<FrameView<'_, D>, DecodeError>> {
        let at = self.base + self.start as u64;
        drop(self.claim(at, at + (HEADER_LEN + body_len) as u64));
        let buffered = (self.end - self.start - HEADER_LEN).min(body_len);
        self.consume(HEADER_LEN + buffered);
        let left = body_len - buffered;
        if left == 0 {
            return Some(Err(refusal));
        }
        self.skip = Some(Skip { left, body_len, refusal });
        None
    }

    /// The next complete frame, or refusal; `None` when more bytes are needed.
    pub fn next_frame(&mut self) -> Option<Result<FrameView<'_, D>, DecodeError>> {
        if let Some(e) = self.failed {
            return Some(Err(DecodeError::Header(e)));
        }
        if let Some(s) = &self.skip {
            if s.left > 0 {
                return None;
            }
            let refusal = s.refusal;
            self.skip = None;
            return Some(Err(refusal));
        }
        let header = match self.header {
            Some(h) => h,
            None => {
                let pending = &self.buf[self.start..self.end];
                if pending.len() < HEADER_LEN {
                    return None;
                }
                match decode_header(pending) {
                    Ok(h) if self.config.expect.is_some_and(|k| k != h.kind) => {
                        // decode_header bounded the body by its opcode's limit.
                        return self.skip(h.body_len as usize, DecodeError::UnexpectedKind { header: h });
                    }
                    Ok(h) if h.body_len > self.config.max_body => {
                        let (opcode, kind, max) = (h.opcode, h.kind, self.config.max_body);
                        return self.fail(FrameError::BodyTooLarge { opcode, kind, len: h.body_len.into(), max });
                    }
                    Ok(h) => {
                        self.header = Some(h);
                        h
                    }
                    Err(FrameError::UnknownOpcode { code, request_id, body_len })
                        if body_len <= self.config.max_body =>
                    {
                        let refusal = DecodeError::UnknownOpcode { code, request_id, body_len };
                        return self.skip(body_len as usize, refusal);
                    }
                    Err(e) => return self.fail(e),
                }
            }
        };
        let len = HEADER_LEN + header.body_len as usize;
        if self.end - self.start < len {
            return None;
        }
        let f = self.start;
        let at = self.base + f as u64;
        let (mut fds, truncated) = self.claim(at, at + len as u64);
        self.header = None;
        self.consume(len);
        let announced = header.fd_count;
        let refusal = if truncated {
            Some(DecodeError::FdsTruncated { header, room: self.config.fds_per_read })
        } else if fds.len() < usize::from(announced) {
            Some(DecodeError::MissingFds { header, announced, received: fds.len() })
        } else if fds.len() > usize::from(announced) && self.config.extra_fds == ExtraFds::Refuse {
            Some(DecodeError::ExtraFds { header, announced, received: fds.len() })
        } else {
            fds.truncate(usize::from(announced));
            None
        };
        if let Some(r) = refusal {
            // The frame's descriptors are closed with it; the stream stays in sync.
            return Some(Err(r));
        }
        // `consume` may reset the indices; the bytes stay where they are until the next
        // receive.
        Some(Ok(FrameView { header, body: &self.buf[f + HEADER_LEN..f + len], fds }))
    }

    /// Gives back a buffer grown past its starting size for a large frame, when nothing is
    /// buffered and no frame has begun (a link between bursts); the next receive allocates
    /// what it needs again. Whether anything was given back.
    pub fn shrink(&mut self) -> bool {
        if self.buf.len() <= INITIAL || !self.at_boundary() || self.failed.is_some() {
            return false;
        }
        self.base += self.end as u64;
        self.start = 0;
        self.end = 0;
        self.buf = Vec::new();
        true
    }

    /// The bytes buffered and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The buffer's size (bounded by one frame: [`DecoderConfig::max_frame`]).
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Opcode;

    /// A descriptor stand-in: its number.
    type Fd = u32;

    fn frame(opcode: Opcode, kind: FrameKind, id: u64, body: &[u8], fds: u8) -> Vec<u8> {
        let mut out = Vec::new();
        let h = Header { fd_count: fds, ..Header::new(opcode, kind, id) };
        super::super::encode_frame(&h, body, &mut out).unwrap();
        out
    }

    fn server() -> FrameDecoder<Fd> {
        FrameDecoder::new(DecoderConfig::SERVER)
    }

    /// Pushes all of `bytes` (the first push with `fds`), taking frames out as they come:
    /// each frame's (opcode, request id, body, descriptors) or its refusal.
    #[allow(clippy::type_complexity)]
    fn feed(
        d: &mut FrameDecoder<Fd>,
        mut bytes: &[u8],
        mut fds: Vec<Fd>,
    ) -> Vec<Result<(Opcode, u64, Vec<u8>, Vec<Fd>), DecodeError>> {
        let mut out = Vec::new();
        loop {
            while let Some(r) = d.next_frame() {
                let fatal = r.as_ref().is_err_and(DecodeError::is_fatal);
                out.push(r.map(|f| (f.header.opcode, f.header.request_id, f.body.to_vec(), f.fds)));
                if fatal {
                    return out;
                }
            }
            if bytes.is_empty() {
                return out;
            }
            let n = d.push(bytes, std::mem::take(&mut fds), false);
            assert!(n > 0, "no room with no frame to take");
            bytes = &bytes[n..];
        }
    }

    #[test]
    fn frames_a_server_does_not_take_are_read_past_and_the_next_is_served() {
        let mut d = server();
        // A response from a client (1 MiB allowed for Status: never buffered), an unknown
        // opcode with a small body, then a request; pushed a byte at a time.
        let mut stream = frame(Opcode::Status, FrameKind::Response, 1, &vec![9; 200_000], 0);
        let mut unknown = frame(Opcode::Ping, FrameKind::Request, 2, &[5; 40], 0);
        unknown[6..8].copy_from_slice(&0x7777u16.to_le_bytes());
        stream.extend_from_slice(&unknown);
        stream.extend_from_slice(&frame(Opcode::Free, FrameKind::Request, 3, &[1, 2, 3], 0));
        let mut got = Vec::new();
        for chunk in stream.chunks(7) {
            got.extend(feed(&mut d, chunk, Vec::new()));
            assert!(d.capacity() <= DecoderConfig::SERVER.max_frame());
        }
        assert!(matches!(got[0], Err(DecodeError::UnexpectedKind { header }) if header.request_id == 1));
        assert_eq!(got[1], Err(DecodeError::UnknownOpcode { code: 0x7777, request_id: 2, body_len: 40 }));
        assert_eq!(got[2], Ok((Opcode::Free, 3, vec![1, 2, 3], vec![])));
        assert_eq!(got.len(), 3);
        assert!(d.at_boundary());
    }

    #[test]
    fn a_refused_header_stops_the_stream_and_closes_what_it_holds() {
        let mut d = server();
        let mut bad = frame(Opcode::Ping, FrameKind::Request, 1, &[], 0);
        bad[0] = b'X';
        let got = feed(&mut d, &bad, vec![7]);
        assert_eq!(got, vec![Err(DecodeError::Header(FrameError::BadMagic { found: *b"XBRC" }))]);
        assert!(d.is_failed() && d.arrived.is_none());
        assert!(d.read_buf(true).is_empty() && d.want() == 0);
        assert_eq!(d.push(&[1, 2, 3], vec![8], false), 0);
        assert!(matches!(d.next_frame(), Some(Err(DecodeError::Header(FrameError::BadMagic { .. })))));
        // An unknown opcode whose body is more than the decoder would read past.
        let mut d = server();
        let mut raw = frame(Opcode::Ping, FrameKind::Request, 4, &[], 0);
        raw[6..8].copy_from_slice(&0x7777u16.to_le_bytes());
        raw[12..16].copy_from_slice(&(MAX_REQUEST_BODY + 1).to_le_bytes());
        let got = feed(&mut d, &raw, vec![]);
        assert!(matches!(got[..], [Err(DecodeError::Header(FrameError::UnknownOpcode { request_id: 4, .. }))]));
        // A body within the opcode's limit but beyond the decoder's.
        let config = DecoderConfig { max_body: 100, ..DecoderConfig::CLIENT };
        let mut d = FrameDecoder::<Fd>::new(config);
        let got = feed(&mut d, &frame(Opcode::Status, FrameKind::Response, 1, &[0; 101], 0), vec![]);
        assert!(matches!(got[..], [Err(DecodeError::Header(FrameError::BodyTooLarge { len: 101, max: 100, .. }))]));
    }

    #[test]
    fn descriptors_are_counted_against_the_header_by_each_sides_rule() {
        let with_one = frame(Opcode::Register, FrameKind::Request, 1, &[0; 4], 1);
        let with_none = frame(Opcode::Ping, FrameKind::Request, 2, &[], 0);
        // The server refuses a frame whose descriptors are not exactly the announced ones.
        let mut d = server();
        assert!(matches!(
            feed(&mut d, &with_one, vec![])[..],
            [Err(DecodeError::MissingFds { announced: 1, received: 0, .. })]
        ));
        assert!(matches!(
            feed(&mut d, &with_none, vec![3])[..],
            [Err(DecodeError::ExtraFds { announced: 0, received: 1, .. })]
        ));
        assert_eq!(feed(&mut d, &with_one, vec![4]), vec![Ok((Opcode::Register, 1, vec![0; 4], vec![4]))]);
        d.push(&with_one, vec![5], true);
        assert!(matches!(d.next_frame(), Some(Err(DecodeError::FdsTruncated { room: 1, .. }))));
        // A client keeps the announced ones and closes the rest.
        let mut d = FrameDecoder::<Fd>::new(DecoderConfig::CLIENT);
        let alloc = frame(Opcode::Alloc, FrameKind::Response, 3, &[1], 1);
        assert_eq!(feed(&mut d, &alloc, vec![6, 7, 8]), vec![Ok((Opcode::Alloc, 3, vec![1], vec![6]))]);
    }

    #[test]
    fn descriptors_go_to_the_last_frame_that_starts_in_their_read_and_none_inside_a_frame() {
        let mut d = server();
        let first = frame(Opcode::Ping, FrameKind::Request, 1, &[], 0);
        let second = frame(Opcode::Register, FrameKind::Request, 2, &[0; 4], 1);
        let mut both = first.clone();
        both.extend_from_slice(&second[..10]);
        // One read brings the first frame and the start of the second with a descriptor.
        assert_eq!(d.push(&both, vec![9], false), both.len());
        assert_eq!(d.next_frame().unwrap().unwrap().fds, Vec::<Fd>::new());
        assert!(d.next_frame().is_none());
        // A read inside the frame: its descriptor is dropped, and the room stops at the
        // end of the header.
        assert_eq!(d.read_buf(true).len(), HEADER_LEN - 10);
        assert_eq!(d.progress(), Some(Progress { part: FramePart::Header, read: 10, need: HEADER_LEN }));
        assert_eq!(d.push(&second[10..], vec![10], false), HEADER_LEN - 10);
        assert!(d.next_frame().is_none());
        assert_eq!(d.progress(), Some(Progress { part: FramePart::Body, read: 0, need: 4 }));
        assert_eq!(d.push(&second[HEADER_LEN..], vec![], false), 4);
        assert_eq!(d.next_frame().unwrap().unwrap().fds, vec![9]);
        assert!(d.at_boundary() && d.arrived.is_none());
    }

    /// A link that once carried a large frame gives its buffer back between bursts, and
    /// reads on as before. Before, the buffer kept the largest frame's size for good.
    #[test]
    fn a_buffer_grown_for_a_large_frame_is_given_back_at_a_boundary() {
        let mut d = server();
        let big = frame(Opcode::Translate, FrameKind::Request, 1, &[7; 40_000], 0);
        let mut at = d.push(&big, vec![], false);
        let body = loop {
            if let Some(f) = d.next_frame() {
                break f.unwrap().body.len();
            }
            assert!(!d.shrink(), "nothing given back inside a frame");
            at += d.push(&big[at..], vec![], false);
        };
        assert_eq!((at, body), (big.len(), 40_000));
        assert!(d.capacity() > 40_000);
        assert!(d.shrink());
        assert_eq!(d.capacity(), 0);
        assert!(!d.shrink(), "nothing left to give back");
        let small = frame(Opcode::Free, FrameKind::Request, 2, &[1; 9], 0);
        assert_eq!(d.push(&small, vec![], false), small.len());
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!((f.header.request_id, f.body), (2, &[1; 9][..]));
        assert!(d.capacity() <= INITIAL);
    }

    #[test]
    fn an_exact_reader_allocates_only_what_the_frame_needs() {
        // The blocking transport makes a decoder per frame: it must not cost a greedy buffer.
        let mut d = server();
        assert_eq!(d.read_buf(false).len(), HEADER_LEN);
        assert_eq!(d.capacity(), HEADER_LEN);
        let f = frame(Opcode::Free, FrameKind::Request, 1, &[1; 9], 0);
        d.read_buf(false).copy_from_slice(&f[..HEADER_LEN]);
        d.filled(HEADER_LEN, vec![], false);
        assert!(d.next_frame().is_none());
        assert_eq!(d.read_buf(false).len(), 9);
        assert_eq!(d.capacity(), HEADER_LEN + 9);
    }
}
