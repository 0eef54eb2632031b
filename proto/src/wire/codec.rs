//! The blocking transport: whole frames with their descriptors over a
//! [`UnixStream`], a small client [`Connection`] (hello, calls, queued events), and the
//! peer's credentials. A daemon on tokio reuses the pure functions instead.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use super::body::{BodyError, Message, decode_body, encode_message};
use super::bounded::Name;
use super::decoder::{DecodeError, DecoderConfig, FrameDecoder, FrameView};
use super::event::Event;
use super::handle::SessionToken;
use super::header::{FrameError, FrameKind, Header, encode_frame};
use super::opcode::Opcode;
use super::request::{HelloRequest, Request};
use super::response::{ErrorBody, HelloResponse, Response};
use super::sys;
use super::version::{SUPPORTED_VERSIONS, Version, VersionRange};

/// Why a frame could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The socket failed (a read timeout shows as `WouldBlock`/`TimedOut`).
    #[error("socket I/O failed")]
    Io(#[from] io::Error),
    /// The peer closed the connection between frames.
    #[error("connection closed")]
    Closed,
    /// The peer closed the connection inside a frame.
    #[error("connection closed after {read} of {need} bytes")]
    Truncated {
        /// Bytes of the part being read.
        read: usize,
        /// Bytes it needed.
        need: usize,
    },
    /// The header is refused.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The body is refused.
    #[error(transparent)]
    Body(#[from] BodyError),
    /// The kernel truncated the control data (`MSG_CTRUNC`): descriptors were lost.
    #[error("descriptors truncated by the kernel")]
    ControlTruncated,
    /// Fewer descriptors arrived than the header announced.
    #[error("header announced {announced} descriptors, {received} arrived")]
    MissingFds {
        /// From the header.
        announced: u8,
        /// Arrived.
        received: usize,
    },
    /// The message needs a different number of descriptors than came with it.
    #[error("{opcode} {kind:?} needs {required} descriptors, got {received}")]
    FdsMismatch {
        /// Opcode.
        opcode: Opcode,
        /// Frame kind.
        kind: FrameKind,
        /// Needed.
        required: u8,
        /// Got.
        received: usize,
    },
    /// The server answered with an error.
    #[error("server refused {opcode}: {:?}: {}", .body.code, .body.message)]
    Refused {
        /// The request's opcode.
        opcode: Opcode,
        /// The error body.
        body: ErrorBody,
    },
    /// The answer does not match the request (wrong id, opcode or kind).
    #[error("unexpected {opcode} {kind:?} frame for request {request_id}")]
    Unexpected {
        /// Opcode of the frame.
        opcode: Opcode,
        /// Kind of the frame.
        kind: FrameKind,
        /// Its request id.
        request_id: u64,
    },
    /// The server chose a version outside the offered range.
    #[error("server chose version {chosen}, offered {offered}")]
    BadVersion {
        /// Chosen.
        chosen: Version,
        /// Offered.
        offered: VersionRange,
    },
    /// The call was not over within the time it was given
    /// ([`Connection::set_call_timeout`]): the request could not be written or its whole
    /// answer did not arrive.
    #[error("no answer within {after:?}")]
    TimedOut {
        /// The time the call was given.
        after: Duration,
    },
}

/// When a call must be over, and the time it was given (for the error).
#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: Instant,
    after: Duration,
}

impl Deadline {
    /// `after` from now; none when that is past what an `Instant` holds (no bound).
    fn after(after: Duration) -> Option<Self> {
        Some(Self { at: Instant::now().checked_add(after)?, after })
    }

    /// Bounds the stream's next blocking reads and writes by the time left; `TimedOut`
    /// once none is left.
    fn arm(&self, stream: &UnixStream) -> Result<(), CodecError> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(CodecError::TimedOut { after: self.after });
        }
        stream.set_read_timeout(Some(left))?;
        stream.set_write_timeout(Some(left))?;
        Ok(())
    }
}

/// One blocking socket call `op` on `stream`, bounded by the time left until `deadline`
/// (when there is one): its timeout is `TimedOut`.
fn bounded<T>(
    stream: &UnixStream,
    deadline: Option<&Deadline>,
    op: impl FnOnce() -> io::Result<T>,
) -> Result<T, CodecError> {
    let Some(d) = deadline else { return Ok(op()?) };
    d.arm(stream)?;
    op().map_err(|e| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => CodecError::TimedOut { after: d.after },
        _ => e.into(),
    })
}

/// A frame as read: checked header, body bytes, descriptors (exactly as many as the
/// header announced).
#[derive(Debug)]
pub struct Frame {
    /// The header.
    pub header: Header,
    /// The body.
    pub body: Vec<u8>,
    /// The descriptors, owned.
    pub fds: Vec<OwnedFd>,
}

/// Credentials of the peer process, from `SO_PEERCRED`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerCred {
    /// Process id (at connect time).
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// The credentials the kernel recorded for the other end of `stream` when it connected.
/// A server must take identity from here, never from a request body.
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let (pid, uid, gid) = sys::peer_cred(stream)?;
    Ok(PeerCred { pid, uid, gid })
}

/// Writes one frame: `header` (its `body_len` and `fd_count` are taken from `body` and
/// `fds`), `body`, and `fds` as `SCM_RIGHTS` with the first byte.
pub fn send_frame(stream: &UnixStream, header: &Header, body: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), CodecError> {
    let fd_count = u8::try_from(fds.len()).unwrap_or(u8::MAX);
    let mut buf = Vec::new();
    encode_frame(&Header { fd_count, ..*header }, body, &mut buf)?;
    send_bytes(stream, &buf, fds, None)
}

fn send_bytes(
    stream: &UnixStream,
    buf: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<&Deadline>,
) -> Result<(), CodecError> {
    let send = |bytes: &[u8], fds: &[BorrowedFd<'_>]| {
        bounded(stream, deadline, || sys::send_with_fds(stream.as_fd(), &[IoSlice::new(bytes)], fds))
    };
    let mut sent = send(buf, fds)?;
    while sent < buf.len() {
        // The descriptors went with the first byte; the rest is plain data.
        let n = send(&buf[sent..], &[])?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::WriteZero).into());
        }
        sent += n;
    }
    Ok(())
}

/// Reads one frame, driving a [`FrameDecoder`] that reads no byte past it (so the stream
/// holds nothing between calls): the header is checked before the body is allocated, so
/// the body is never larger than its opcode allows; descriptors beyond what the header
/// announces, and any that arrive after the frame's first bytes, are closed.
pub fn recv_frame(stream: &UnixStream) -> Result<Frame, CodecError> {
    recv_frame_by(stream, None)
}

/// [`recv_frame`], each read bounded by the time left until `deadline`.
fn recv_frame_by(stream: &UnixStream, deadline: Option<&Deadline>) -> Result<Frame, CodecError> {
    let mut decoder = FrameDecoder::new(DecoderConfig::CLIENT);
    let room = usize::from(decoder.config().fds_per_read);
    loop {
        if let Some(r) = decoder.next_frame() {
            return r.map(FrameView::into_frame).map_err(CodecError::from);
        }
        let progress = decoder.progress();
        let got =
            bounded(stream, deadline, || sys::recv_with_fds(stream.as_fd(), decoder.read_buf(false), room, false))?;
        if got.bytes == 0 {
            return Err(match progress {
                None => CodecError::Closed,
                Some(p) => CodecError::Truncated { read: p.read, need: p.need },
            });
        }
        decoder.filled(got.bytes, got.fds, got.truncated);
    }
}

impl From<DecodeError> for CodecError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Header(e) => CodecError::Frame(e),
            DecodeError::UnknownOpcode { code, request_id, body_len } => {
                CodecError::Frame(FrameError::UnknownOpcode { code, request_id, body_len })
            }
            DecodeError::UnexpectedKind { header } => {
                CodecError::Unexpected { opcode: header.opcode, kind: header.kind, request_id: header.request_id }
            }
            DecodeError::FdsTruncated { .. } => CodecError::ControlTruncated,
            DecodeError::MissingFds { announced, received, .. } => CodecError::MissingFds { announced, received },
            DecodeError::ExtraFds { header, announced, received } => {
                CodecError::FdsMismatch { opcode: header.opcode, kind: header.kind, required: announced, received }
            }
        }
    }
}

/// Reads one frame and decodes its body, checking that the descriptors are the ones the
/// message needs.
pub fn recv_message(stream: &UnixStream) -> Result<(Header, Message, Vec<OwnedFd>), CodecError> {
    recv_message_by(stream, None)
}

/// [`recv_message`], each read bounded by the time left until `deadline`.
fn recv_message_by(
    stream: &UnixStream,
    deadline: Option<&Deadline>,
) -> Result<(Header, Message, Vec<OwnedFd>), CodecError> {
    let frame = recv_frame_by(stream, deadline)?;
    let msg = decode_body(&frame.header, &frame.body)?;
    let required = msg.fds_required();
    if usize::from(required) != frame.fds.len() {
        let h = frame.header;
        return Err(CodecError::FdsMismatch { opcode: h.opcode, kind: h.kind, required, received: frame.fds.len() });
    }
    Ok((frame.header, msg, frame.fds))
}

/// Writes one message with its descriptors under `header` (kind and opcode must match).
pub fn send_message(
    stream: &UnixStream,
    header: &Header,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
) -> Result<(), CodecError> {
    send_message_by(stream, header, msg, fds, None)
}

/// [`send_message`], each write bounded by the time left until `deadline`.
fn send_message_by(
    stream: &UnixStream,
    header: &Header,
    msg: &Message,
    fds: &[BorrowedFd<'_>],
    deadline: Option<&Deadline>,
) -> Result<(), CodecError> {
    let fd_count = u8::try_from(fds.len()).unwrap_or(u8::MAX);
    let mut buf = Vec::new();
    encode_message(&Header { fd_count, ..*header }, msg, &mut buf)?;
    send_bytes(stream, &buf, fds, deadline)
}

/// A socket's read and write timeouts as they were, put back when dropped (a bounded
/// call changes them as it goes).
struct Timeouts<'a> {
    stream: &'a UnixStream,
    read: Option<Duration>,
    write: Option<Duration>,
}

impl<'a> Timeouts<'a> {
    fn save(stream: &'a UnixStream) -> io::Result<Self> {
        Ok(Self { stream, read: stream.read_timeout()?, write: stream.write_timeout()? })
    }
}

impl Drop for Timeouts<'_> {
    fn drop(&mut self) {
        // Values the socket held a moment ago: setting them back cannot be refused.
        let _ = self.stream.set_read_timeout(self.read);
        let _ = self.stream.set_write_timeout(self.write);
    }
}

/// A blocking client connection: negotiates a version, numbers requests, matches
/// answers to them, and queues events that arrive in between.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    version: Version,
    next_id: u64,
    events: VecDeque<Event>,
    call_timeout: Option<Duration>,
}

impl Connection {
    /// Wraps a connected stream; call [`Connection::hello`] first.
    pub fn new(stream: UnixStream) -> Self {
        Self { stream, version: SUPPORTED_VERSIONS.max, next_id: 1, events: VecDeque::new(), call_timeout: None }
    }

    /// Bounds each call from now on (the hello included): writing the request and
    /// reading its whole answer must be over within `timeout`, or the call fails with
    /// [`CodecError::TimedOut`] (a server that trickles its answer a byte at a time is
    /// bounded too, which a read timeout alone does not do). The connection should then
    /// be dropped: the answer may still come. The stream's own read and write timeouts
    /// are changed during a bounded call and set back after it. `None` (the default):
    /// calls wait as those timeouts say. Waiting for an event
    /// ([`Connection::next_event`]) is never bounded by it; a timeout past what an
    /// `Instant` holds bounds nothing.
    pub fn set_call_timeout(&mut self, timeout: Option<Duration>) {
        self.call_timeout = timeout;
    }

    /// The stream (to set timeouts).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// The version in use.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Offers `versions`, checks the server's choice and uses it from now on.
    pub fn hello(&mut self, client: &str, versions: VersionRange) -> Result<HelloResponse, CodecError> {
        self.hello_with(client, versions, None)
    }

    /// [`Connection::hello`] that also asks to take back the session `resume` names (a
    /// token from an earlier `Hello` response, after a daemon restart). Send it only to a
    /// server that gave out that token (so one that speaks 1.1 or later).
    pub fn hello_with(
        &mut self,
        client: &str,
        versions: VersionRange,
        resume: Option<SessionToken>,
    ) -> Result<HelloResponse, CodecError> {
        let req = Request::Hello(HelloRequest { versions, client: Name::truncated(client), resume });
        // The hello frame is always sent at the oldest version offered, so that a server
        // that knows only that one can read it.
        self.version = versions.min;
        let (resp, _) = self.call(req, &[])?;
        let Response::Hello(hello) = resp else {
            return Err(CodecError::Unexpected {
                opcode: resp.opcode(),
                kind: FrameKind::Response,
                request_id: self.next_id - 1,
            });
        };
        if !versions.contains(hello.version) {
            return Err(CodecError::BadVersion { chosen: hello.version, offered: versions });
        }
        self.version = hello.version;
        Ok(hello)
    }

    /// Sends a request and waits for its answer; an error answer is
    /// [`CodecError::Refused`]. Events that arrive meanwhile are queued.
    pub fn call(&mut self, req: Request, fds: &[BorrowedFd<'_>]) -> Result<(Response, Vec<OwnedFd>), CodecError> {
        let id = self.next_id;
        self.next_id += 1;
        let opcode = req.opcode();
        let header = Header { version: self.version, ..Header::new(opcode, FrameKind::Request, id) };
        let deadline = self.call_timeout.and_then(Deadline::after);
        // The socket's own timeouts come back when the call ends, however it ends.
        let _restore = match deadline {
            Some(_) => Some(Timeouts::save(&self.stream)?),
            None => None,
        };
        let deadline = deadline.as_ref();
        if let Err(e) = send_message_by(&self.stream, &header, &Message::Request(req), fds, deadline) {
            // A server that refused the connection (request id 0, below) may have closed it
            // before this request went: its error frame is still there to read.
            let closed = matches!(&e, CodecError::Io(io) if matches!(io.kind(), io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset));
            if closed
                && let Ok((h, Message::Error(body), _)) = recv_message_by(&self.stream, deadline)
                && h.request_id == 0
            {
                return Err(CodecError::Refused { opcode, body });
            }
            return Err(e);
        }
        loop {
            let (h, msg, fds) = recv_message_by(&self.stream, deadline)?;
            match msg {
                Message::Event(ev) => self.events.push_back(ev),
                Message::Response(r) if h.request_id == id && h.opcode == opcode => return Ok((r, fds)),
                // Request id 0 (never a request's): the server refused the connection, or
                // the stream, and closes it.
                Message::Error(body) if h.request_id == id || h.request_id == 0 => {
                    return Err(CodecError::Refused { opcode, body });
                }
                _ => return Err(CodecError::Unexpected { opcode: h.opcode, kind: h.kind, request_id: h.request_id }),
            }
        }
    }

    /// The next event: a queued one, or the next frame (which must be an event).
    pub fn next_event(&mut self) -> Result<Event, CodecError> {
        if let Some(ev) = self.events.pop_front() {
            return Ok(ev);
        }
        match recv_message(&self.stream)? {
            (_, Message::Event(ev), _) => Ok(ev),
            (h, ..) => Err(CodecError::Unexpected { opcode: h.opcode, kind: h.kind, request_id: h.request_id }),
        }
    }
}
