//! The socket server: accept loop, one task per connection, framing over tokio, hello
//! negotiation and the request loop. Shutdown stops accepting, lets requests in flight
//! finish (bounded) and returns.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    BodyError, CopyDone, ErrorBody, ErrorCode, Event, FrameError, FrameKind, HEADER_LEN, Header, HelloResponse,
    MAX_FDS, MAX_REQUEST_BODY, Message, Name, Opcode, PeerCred, Request, Response, SUPPORTED_VERSIONS, SessionToken,
    SubscribeResponse, Version, decode_header, decode_request, encode_message, negotiate,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::daemon::Daemon;
use crate::memops;
use crate::memory::Reclaimed;
use crate::ops::{self, refusal};
use crate::sys;

/// How long requests in flight get to finish after shutdown is asked for.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// A client that stops sending in the middle of a frame is dropped after this long.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that does not read its answers is dropped after this long.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Accepting failed in a way that will not recover.
    #[error("accepting connections")]
    Accept(#[source] std::io::Error),
}

/// Serves `listener` until `shutdown` is cancelled, then stops accepting, waits up to
/// [`DRAIN_TIMEOUT`] for connections to finish their current request, and returns.
pub async fn run(listener: UnixListener, daemon: Arc<Daemon>, shutdown: CancellationToken) -> Result<(), ServeError> {
    let tracker = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(daemon.config.limits.clients as usize));
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)) => {
                tracing::warn!(error = %e, "accept failed for lack of resources; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionAborted || e.kind() == std::io::ErrorKind::Interrupted =>
            {
                continue;
            }
            Err(e) => return Err(ServeError::Accept(e)),
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::warn!(limit = daemon.config.limits.clients, "client limit reached; dropping a new connection");
            continue;
        };
        let daemon = daemon.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let _slot = slot;
            serve_connection(stream, &daemon, &shutdown).await;
        });
    }
    drop(listener);
    tracker.close();
    tracing::info!(connections = tracker.len(), "no longer accepting; draining connections");
    if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait()).await.is_err() {
        tracing::warn!(connections = tracker.len(), "connections still busy after the drain timeout; closing them");
    }
    Ok(())
}

/// What reading a frame gave.
enum Read {
    /// A request, decoded, with the descriptors that came with it.
    Request(Header, Request, Vec<OwnedFd>),
    /// A frame to refuse while the stream stays in sync.
    Refuse(Header, ErrorBody),
    /// A frame after which the stream is out of sync: answer (when possible) and close.
    Fatal(ErrorBody),
    /// The peer closed, stalled or failed; just close.
    Gone,
}

struct Conn<'a> {
    stream: UnixStream,
    peer: PeerCred,
    daemon: &'a Daemon,
    version: Option<Version>,
    /// The subscribe request's id and the queue of its events.
    events: Option<(u64, mpsc::Receiver<Event>)>,
    /// Descriptors that came with the current frame's first byte.
    fds: Vec<OwnedFd>,
    /// Where the copy engine sends this connection's copy completions, and where they
    /// are read from (bounded by `copy.max_in_flight_per_session`).
    copies: (crate::copy::Sink, mpsc::UnboundedReceiver<(u64, CopyDone)>),
}

/// The next queued event with its subscribe request's id (`None`: the subscriber was
/// dropped for falling behind); pending forever without a subscription.
async fn next_event(events: &mut Option<(u64, mpsc::Receiver<Event>)>) -> (u64, Option<Event>) {
    match events {
        Some((id, rx)) => (*id, rx.recv().await),
        None => std::future::pending().await,
    }
}

async fn serve_connection(stream: UnixStream, daemon: &Daemon, shutdown: &CancellationToken) {
    let peer = match stream.peer_cred() {
        Ok(c) => PeerCred { pid: c.pid().unwrap_or(0), uid: c.uid(), gid: c.gid() },
        Err(e) => {
            tracing::warn!(error = %e, "cannot read peer credentials; closing");
            return;
        }
    };
    let session = daemon.open_session();
    let span = tracing::debug_span!("session", id = session.id, uid = peer.uid, pid = peer.pid);
    serve_session(stream, peer, daemon, session.id, shutdown).instrument(span).await;
}

async fn serve_session(
    stream: UnixStream,
    peer: PeerCred,
    daemon: &Daemon,
    session: u64,
    shutdown: &CancellationToken,
) {
    tracing::debug!("connected");
    let mut conn =
        Conn { stream, peer, daemon, version: None, events: None, fds: Vec::new(), copies: mpsc::unbounded_channel() };
    let mut first = [0u8; 1];
    loop {
        // Waiting for a frame to start and for an event are both cancel-safe; a frame that
        // has started is read whole (bounded by FRAME_TIMEOUT) before any event is sent.
        let next = tokio::select! {
            () = shutdown.cancelled() => break,
            r = read_first(&conn.stream, &mut conn.fds, &mut first) => r.map(|n| if n == 0 { None } else { Some(None) }),
            ev = next_event(&mut conn.events) => Ok(Some(Some(ev))),
            Some((id, done)) = conn.copies.1.recv() => Ok(Some(Some((id, Some(Event::CopyDone(done)))))),
        };
        let Ok(Some(next)) = next else { break };
        match next {
            None => {}
            Some((id, Some(ev))) => {
                let h = Header::new(Opcode::Subscribe, FrameKind::Event, id);
                if !conn.send(&h, Message::Event(ev)).await {
                    break;
                }
                continue;
            }
            Some((_, None)) => {
                tracing::warn!(uid = peer.uid, pid = peer.pid, "subscriber fell behind its events; closing");
                break;
            }
        }
        let read = tokio::select! {
            () = shutdown.cancelled() => break,
            r = conn.read_frame(first[0]) => r,
        };
        // Counted before the answer is sent, so that a client that has its answer also
        // sees it counted.
        let start = Instant::now();
        let ok = match read {
            Read::Gone => break,
            Read::Fatal(err) => {
                tracing::warn!(uid = peer.uid, pid = peer.pid, code = ?err.code, "closing connection: {}", err.message);
                let h = Header::new(Opcode::Hello, FrameKind::Error, 0);
                daemon.metrics.record(None, Some(err.code), start.elapsed());
                let _ = conn.send(&h, Message::Error(err)).await;
                break;
            }
            Read::Refuse(h, err) => {
                tracing::warn!(uid = peer.uid, pid = peer.pid, op = h.opcode.name(), code = ?err.code, "refused: {}", err.message);
                // An unknown opcode travels under Hello; count it as op="unknown".
                let op = (err.code != ErrorCode::UnknownOpcode).then_some(h.opcode);
                daemon.metrics.record(op, Some(err.code), start.elapsed());
                conn.send(&h, Message::Error(err)).await
            }
            Read::Request(h, req, fds) => {
                let answer = conn.answer(req, session, h.request_id, fds);
                daemon.metrics.record(Some(h.opcode), answer.as_ref().err().map(|e| e.code), start.elapsed());
                match answer {
                    Ok((resp, None)) => conn.send(&h, Message::Response(resp)).await,
                    Ok((resp, Some(fd))) => conn.send_fd(&h, Message::Response(resp), fd).await,
                    Err(err) => conn.send(&h, Message::Error(err)).await,
                }
            }
        };
        if !ok {
            break;
        }
    }
    daemon.events.unsubscribe(session);
    let stopped = daemon.copies.end_session(session);
    if stopped > 0 {
        tracing::info!(copies = stopped, "session ended with copies in flight; stopped them");
    }
    if shutdown.is_cancelled() {
        // A daemon restart is not a client death: the session's regions stay journaled
        // for the client to take back (docs/fabricd.md, "Durability").
        tracing::debug!("disconnected by shutdown; regions kept for resume");
        return;
    }
    let r = daemon.memory.close_session(session);
    daemon.flush_revocations();
    if r != Reclaimed::default() {
        tracing::info!(
            uid = peer.uid,
            pid = peer.pid,
            regions = r.regions,
            exports = r.exports,
            imports = r.imports,
            registrations = r.registrations,
            "session closed; reclaimed its regions, imports and registrations, revoked its exports"
        );
    }
    tracing::debug!("disconnected");
}

/// Reads a frame's first byte with `recvmsg` into `buf`, keeping in `fds` the descriptors
/// that travel with it (at most [`MAX_FDS`]; the kernel closes any beyond its buffer).
/// Cancel-safe: nothing is consumed until the readiness wait is over.
async fn read_first(stream: &UnixStream, fds: &mut Vec<OwnedFd>, buf: &mut [u8; 1]) -> std::io::Result<usize> {
    loop {
        stream.readable().await?;
        match stream.try_io(Interest::READABLE, || sys::recv_with_fds(stream.as_fd(), buf)) {
            Ok((n, mut got)) => {
                got.truncate(usize::from(MAX_FDS));
                *fds = got;
                return Ok(n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

impl Conn<'_> {
    /// Reads the rest of a frame whose first byte was `first`. Waiting for the first byte
    /// has no time limit (the caller does it); the rest of the frame has one.
    async fn read_frame(&mut self, first: u8) -> Read {
        let mut raw = [0u8; HEADER_LEN];
        raw[0] = first;
        match tokio::time::timeout(FRAME_TIMEOUT, self.stream.read_exact(&mut raw[1..])).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return Read::Gone,
            Err(_) => {
                tracing::warn!(
                    uid = self.peer.uid,
                    pid = self.peer.pid,
                    "client stalled inside a frame header; closing"
                );
                return Read::Gone;
            }
        }
        let header = match decode_header(&raw) {
            Ok(h) => h,
            Err(FrameError::UnknownOpcode { code, request_id, body_len }) if body_len <= MAX_REQUEST_BODY => {
                if !self.skip(body_len).await {
                    return Read::Gone;
                }
                // The unknown code cannot be echoed (no receiver could decode it); the error
                // travels under Hello with the request's id.
                let h = Header::new(Opcode::Hello, FrameKind::Request, request_id);
                return Read::Refuse(h, refusal(ErrorCode::UnknownOpcode, format!("unknown opcode {code:#06x}")));
            }
            Err(e) => return Read::Fatal(refusal(ErrorCode::BadFrame, e.to_string())),
        };
        if header.kind != FrameKind::Request {
            // Only requests come from clients; the body length was bounded by decode_header.
            if !self.skip(header.body_len).await {
                return Read::Gone;
            }
            return Read::Refuse(
                header,
                refusal(ErrorCode::BadRequest, format!("a client sent a {:?} frame", header.kind)),
            );
        }
        // decode_header bounded body_len by the opcode's request limit (at most 64 KiB).
        let mut body = vec![0u8; header.body_len as usize];
        match tokio::time::timeout(FRAME_TIMEOUT, self.stream.read_exact(&mut body)).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return Read::Gone,
            Err(_) => {
                tracing::warn!(uid = self.peer.uid, pid = self.peer.pid, "client stalled inside a frame body; closing");
                return Read::Gone;
            }
        }
        // Descriptors travel with a frame's first byte (decode_header bounded the count by
        // the opcode's limit); any that came otherwise were closed by the kernel.
        let fds = std::mem::take(&mut self.fds);
        if fds.len() != usize::from(header.fd_count) {
            return Read::Refuse(
                header,
                refusal(
                    ErrorCode::BadFds,
                    format!(
                        "the header announced {} descriptors and {} came with the frame's first byte",
                        header.fd_count,
                        fds.len()
                    ),
                ),
            );
        }
        match decode_request(header.opcode, &body) {
            Ok(req) if usize::from(req.fds_required()) != fds.len() => Read::Refuse(
                header,
                refusal(
                    ErrorCode::BadFds,
                    format!("{} takes {} descriptors, {} came", header.opcode, req.fds_required(), fds.len()),
                ),
            ),
            Ok(req) => Read::Request(header, req, fds),
            Err(e) => Read::Refuse(header, refusal(ErrorCode::BadRequest, body_error(&e))),
        }
    }

    /// Reads and discards `len` bytes (bounded by the caller); false if the peer went.
    async fn skip(&mut self, len: u32) -> bool {
        let mut left = len as usize;
        let mut buf = [0u8; 4096];
        while left > 0 {
            let n = left.min(buf.len());
            match tokio::time::timeout(FRAME_TIMEOUT, self.stream.read_exact(&mut buf[..n])).await {
                Ok(Ok(_)) => left -= n,
                _ => return false,
            }
        }
        true
    }

    fn answer(
        &mut self,
        req: Request,
        session: u64,
        request_id: u64,
        fds: Vec<OwnedFd>,
    ) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
        if let Request::Hello(h) = &req {
            return match negotiate(h.versions, SUPPORTED_VERSIONS) {
                Ok(v) => {
                    let token = self.session_token(v, h.resume.as_ref(), session)?;
                    self.version = Some(v);
                    tracing::debug!(client = %h.client, version = %v, "hello");
                    let hello = HelloResponse {
                        version: v,
                        server: Name::truncated(concat!("fabricd ", env!("CARGO_PKG_VERSION"))),
                        session,
                        max_request_body: self.daemon.config.limits.max_request_bytes.min(MAX_REQUEST_BODY),
                        max_fds: MAX_FDS,
                        token,
                    };
                    Ok((Response::Hello(hello), None))
                }
                Err(e) => {
                    let body = ErrorBody::from(e);
                    tracing::warn!(uid = self.peer.uid, pid = self.peer.pid, op = "hello", "refused: {}", body.message);
                    Err(body)
                }
            };
        }
        if self.version.is_none() {
            let body = refusal(ErrorCode::NotNegotiated, "send hello first");
            tracing::warn!(
                uid = self.peer.uid,
                pid = self.peer.pid,
                op = req.opcode().name(),
                "refused: send hello first"
            );
            return Err(body);
        }
        if let Some(v) = self.version
            && req.opcode().since() > v
        {
            let op = req.opcode();
            let body = refusal(
                ErrorCode::UnknownOpcode,
                format!("{op} needs protocol {}; this connection speaks {v}", op.since()),
            );
            tracing::warn!(uid = self.peer.uid, pid = self.peer.pid, op = op.name(), "refused: {}", body.message);
            return Err(body);
        }
        if let Request::Subscribe(sub) = req {
            // Events travel under this request's id until the next subscribe.
            self.events = self.daemon.events.subscribe(session, sub.topics).map(|rx| (request_id, rx));
            tracing::debug!(topics = ?sub.topics, "subscribed");
            return Ok((Response::Subscribe(SubscribeResponse { topics: sub.topics }), None));
        }
        if let Request::Copy(c) = req {
            // The connection's sink travels with the copy; the answer is only its id.
            let caller = crate::scope::Caller::of(self.daemon, &self.peer);
            let r = crate::copyops::copy(self.daemon, &caller, session, request_id, c, self.copies.0.clone());
            if let Err(e) = &r {
                tracing::warn!(uid = self.peer.uid, pid = self.peer.pid, op = "copy", code = ?e.code, "refused: {}", e.message);
            }
            self.daemon.flush_revocations();
            return r.map(|r| (r, None));
        }
        ops::handle_session_fds(self.daemon, &self.peer, session, req, fds)
    }

    /// The token for the `Hello` response (1.1 and later): the session's own, or the one
    /// it resumed (whose regions and exports it now owns). A failed resume refuses the
    /// hello; the client may say hello again without it.
    fn session_token(
        &self,
        v: Version,
        resume: Option<&SessionToken>,
        session: u64,
    ) -> Result<Option<SessionToken>, ErrorBody> {
        let (peer, memory) = (&self.peer, &self.daemon.memory);
        let refused = |e: &crate::memory::MemoryError| {
            let body = memops::refused(e);
            tracing::warn!(uid = peer.uid, pid = peer.pid, op = "hello", "refused: {}", body.message);
            body
        };
        if v < Version::new(1, 1) {
            return match resume {
                Some(_) => Err(refusal(ErrorCode::BadRequest, "resuming a session needs protocol 1.1")),
                None => Ok(None),
            };
        }
        match resume {
            Some(t) => {
                memory.resume(session, peer, t).map_err(|e| refused(&e))?;
                Ok(Some(*t))
            }
            None => memory.session_token(session, peer).map(Some).map_err(|e| refused(&e)),
        }
    }

    /// Sends one answer with its descriptor (`SCM_RIGHTS` with the first bytes, the rest
    /// plainly); false when the connection is unusable. The descriptor is closed here
    /// once sent (the client has its own).
    async fn send_fd(&mut self, h: &Header, msg: Message, fd: OwnedFd) -> bool {
        let version = self.version.unwrap_or(h.version);
        let header = Header { version, fd_count: 1, ..h.answer(msg.kind()) };
        let mut buf = Vec::new();
        if let Err(e) = encode_message(&header, &msg, &mut buf) {
            tracing::error!(error = %e, op = h.opcode.name(), "cannot encode an answer");
            let err = Message::Error(refusal(ErrorCode::Internal, format!("answer does not encode: {e}")));
            return self.send(h, err).await;
        }
        let first = async {
            loop {
                self.stream.writable().await?;
                match self
                    .stream
                    .try_io(Interest::WRITABLE, || sys::send_with_fd(self.stream.as_fd(), &buf, fd.as_fd()))
                {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                    r => return r,
                }
            }
        };
        let sent = match tokio::time::timeout(WRITE_TIMEOUT, first).await {
            Ok(Ok(n)) => n,
            _ => return false,
        };
        drop(fd);
        let rest = buf.get(sent..).unwrap_or_default();
        matches!(tokio::time::timeout(WRITE_TIMEOUT, self.stream.write_all(rest)).await, Ok(Ok(())))
    }

    /// Sends one answer to the request `h`; false when the connection is unusable.
    async fn send(&mut self, h: &Header, msg: Message) -> bool {
        let kind = msg.kind();
        let version = self.version.unwrap_or(h.version);
        let header = Header { version, ..h.answer(kind) };
        let mut buf = Vec::new();
        if let Err(e) = encode_message(&header, &msg, &mut buf) {
            tracing::error!(error = %e, op = h.opcode.name(), "cannot encode an answer");
            buf.clear();
            let err = Message::Error(refusal(ErrorCode::Internal, format!("answer does not encode: {e}")));
            if encode_message(&Header { version, ..h.answer(FrameKind::Error) }, &err, &mut buf).is_err() {
                return false;
            }
        }
        matches!(tokio::time::timeout(WRITE_TIMEOUT, self.stream.write_all(&buf)).await, Ok(Ok(())))
    }
}

fn body_error(e: &BodyError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}
