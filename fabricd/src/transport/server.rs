//! The socket server: accept loop, one task per connection, framing over tokio, hello
//! negotiation and the request loop. Shutdown stops accepting, lets requests in flight
//! finish (bounded) and returns.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    CopyDone, DecodeError, ErrorBody, ErrorCode, Event, FrameDecoder, FrameKind, FramePart, FrameView, Header,
    HelloResponse, MAX_FDS, MAX_REQUEST_BODY, Message, Name, Opcode, PROTOCOL_VERSION, PeerCred, Request, Response,
    SUPPORTED_VERSIONS, SessionToken, Version, decode_request, encode_message, negotiate,
};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::daemon::Daemon;
use crate::memory::Reclaimed;
use crate::ops::dispatch::Context;
use crate::ops::principal::{Client, Principal};
use crate::ops::{self, refusal};
use crate::sys;
use crate::transport::admission::{Admission, Admitted, Refused};
use crate::transport::inbox;
use crate::transport::peer::Peer;

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
    // Peers' requests reach the daemon from now on, and the domain task's news of shares.
    if let Some(domain) = daemon.domain.as_ref() {
        domain.attach(Arc::downgrade(&daemon));
        if let Some(link) = domain.link() {
            link.attach(Arc::downgrade(&daemon));
        }
    }
    let configured = daemon.config.limits.clients;
    let clients = daemon.fd_budget.clients;
    if clients < configured {
        tracing::warn!(
            limits.clients = configured,
            served = clients,
            open_files = sys::open_file_limit().unwrap_or(0),
            per_connection = crate::sys::fdbudget::FDS_PER_CONNECTION,
            reserved = crate::sys::fdbudget::RESERVED_FDS,
            "the open-file limit holds fewer connections than limits.clients; serving fewer (raise LimitNOFILE= or ulimit -n)"
        );
    }
    let admission = Admission::new(clients, daemon.config.limits.clients_per_uid, sys::effective_uid());
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
        // Identity is the connecting process's, read once here and never again (the
        // per-uid count needs it before the connection takes a thread): credentials and
        // groups as the kernel recorded them at connect, and a pidfd for the process.
        let cred = match stream.peer_cred() {
            Ok(c) => PeerCred { pid: c.pid().unwrap_or(0), uid: c.uid(), gid: c.gid() },
            Err(e) => {
                tracing::warn!(error = %e, "cannot read peer credentials; closing");
                continue;
            }
        };
        let peer = match Peer::accept(stream.as_fd(), cred) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(uid = cred.uid, pid = cred.pid, error = %crate::error_chain(&e), "cannot read the peer's identity; closing");
                continue;
            }
        };
        // The principal and its standing, once for the connection's life.
        let client = Arc::new(Client::accept(&peer, daemon.admin_gid));
        let admitted = match admission.admit(client.principal.uid()) {
            Ok(a) => a,
            Err(r) => {
                refuse(&stream, &client.principal, &r, &daemon);
                continue;
            }
        };
        spawn_connection(stream, client, daemon.clone(), shutdown.clone(), admitted, &tracker);
    }
    drop(listener);
    tracker.close();
    tracing::info!(connections = tracker.len(), "no longer accepting; draining connections");
    if tokio::time::timeout(DRAIN_TIMEOUT, tracker.wait()).await.is_err() {
        tracing::warn!(connections = tracker.len(), "connections still busy after the drain timeout; closing them");
    }
    Ok(())
}

/// Closes a connection at accept: a `warn` line naming the uid and the limit, the refusal
/// counted, and a `LimitExceeded` error frame (request id 0, before any hello: the
/// connection is refused, not a request) when the socket takes it at once. A new
/// socket's send buffer is empty, so it does; the accept loop never waits on a client.
fn refuse(stream: &UnixStream, who: &Principal, r: &Refused, daemon: &Daemon) {
    let body = r.body();
    let line = match r.limit {
        crate::metrics::ClientLimit::Clients => {
            format!("client limit reached; refusing a new connection ({})", body.message)
        }
        crate::metrics::ClientLimit::ClientsPerUid => {
            format!(
                "limits.clients_per_uid reached for uid {}; refusing a new connection (open={} limit={})",
                who.uid(),
                r.used,
                r.max
            )
        }
    };
    daemon.refused_line(who, "connect", body.code, &line);
    daemon.metrics.connection_refused(r.limit);
    let mut out = Vec::with_capacity(256);
    let h = Header::new(Opcode::Hello, FrameKind::Error, 0);
    if encode_message(&h, &Message::Error(body), &mut out).is_ok() {
        // Straight to the kernel, which takes it (a new socket's send buffer is empty):
        // tokio's `try_write` answers `WouldBlock` without writing while the reactor has
        // not yet recorded the new socket as writable.
        use nix::sys::socket::{MsgFlags, send};
        let _ = send(std::os::fd::AsRawFd::as_raw_fd(stream), &out, MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL);
    }
}

/// Serves one connection on its own thread with its own single-threaded runtime, tracked
/// by `tracker` (the drain waits for it).
///
/// Why a thread: on the shared multi-threaded runtime each request woke the worker that
/// owned the socket's readiness and, often, a second idle worker that found nothing to do
/// (tokio unparks a sibling whenever a task becomes runnable), and the task could move
/// between workers; a request then paid several futex wake-ups and cross-core hand-offs
/// on top of its two socket system calls (docs/BENCHMARKS.md, "Control path"). On its own
/// thread a connection waits in its own `epoll_wait` and answers from there. Handlers are
/// synchronous and may block (a journal `fdatasync`), which now holds up only their own
/// connection. A handler that needs to start background work must use the daemon's
/// runtime (a handle it keeps), not `tokio::spawn`, which would land on this connection's
/// runtime and end with it.
fn spawn_connection(
    stream: UnixStream,
    client: Arc<Client>,
    daemon: Arc<Daemon>,
    shutdown: CancellationToken,
    slot: Admitted,
    tracker: &TaskTracker,
) {
    let std_stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot take a new connection off the runtime; closing it");
            return;
        }
    };
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let detach_grace = Duration::from_secs(daemon.config.memory.detach_grace_s);
    let main = MainRuntime { handle: tokio::runtime::Handle::current(), daemon, detach_grace };
    // The slots go back when the thread ends, whichever way (a closed or failed connection,
    // a timeout, shutdown, a panic), or with the closure when the thread does not start.
    let spawned = std::thread::Builder::new().name("fabricd-conn".into()).spawn(move || {
        let _slot = slot;
        let _done = done_tx;
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!(error = %e, "cannot start a connection's runtime; closing it");
                return;
            }
        };
        rt.block_on(async move {
            match UnixStream::from_std(std_stream) {
                Ok(stream) => serve_connection(stream, client, &main, &shutdown).await,
                Err(e) => tracing::warn!(error = %e, "cannot register a connection; closing it"),
            }
        });
    });
    match spawned {
        // Done when the thread ends (the sender is dropped), whatever way it ends.
        Ok(_) => {
            tracker.spawn(async move {
                let _ = done_rx.await;
            });
        }
        Err(e) => tracing::warn!(error = %e, "cannot start a connection's thread; closing it"),
    }
}

/// What a connection's thread needs from the daemon's runtime.
#[derive(Clone)]
struct MainRuntime {
    handle: tokio::runtime::Handle,
    daemon: Arc<Daemon>,
    detach_grace: Duration,
}

/// Detaches `session` (keeps its regions and exports for a resume) when
/// `memory.detach_grace_s` is set and the peer's process still runs (asked through its
/// pidfd: its pid may name another process by now); its token, or `None` when the session
/// is to be closed (nothing to keep, or the process is gone).
fn detach(daemon: &Daemon, who: &Principal, session: u64) -> Option<SessionToken> {
    if daemon.config.memory.detach_grace_s == 0 || !who.process().is_ok_and(|p| p.running()) {
        return None;
    }
    let (token, r) = daemon.memory.detach_session(session);
    if let Some(t) = token {
        tracing::info!(
            uid = who.uid(),
            pid = who.pid(),
            imports = r.imports,
            registrations = r.registrations,
            grace_s = daemon.config.memory.detach_grace_s,
            "connection closed; session kept for resume, its imports and registrations ended"
        );
        return Some(t);
    }
    None
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

/// What a decoded frame, or its refusal, asks of the server. Descriptors travel with a
/// frame's first bytes (the decoder bounded their count by the opcode's limit and checked
/// it against the header); refused frames close theirs when dropped; the stream stays in
/// sync (every byte was read) except after a refused header.
fn read_of(r: Result<FrameView<'_>, DecodeError>) -> Read {
    let frame = match r {
        Ok(f) => f,
        Err(DecodeError::UnknownOpcode { code, request_id, .. }) => {
            // The unknown code cannot be echoed (no receiver could decode it); the error
            // travels under Hello with the request's id.
            let h = Header::new(Opcode::Hello, FrameKind::Request, request_id);
            return Read::Refuse(h, refusal(ErrorCode::UnknownOpcode, format!("unknown opcode {code:#06x}")));
        }
        Err(e @ DecodeError::Header(_)) => return Read::Fatal(refusal(ErrorCode::BadFrame, e.to_string())),
        Err(DecodeError::UnexpectedKind { header }) => {
            // Only requests come from clients.
            let why = format!("a client sent a {:?} frame", header.kind);
            return Read::Refuse(header, refusal(ErrorCode::BadRequest, why));
        }
        Err(
            e @ (DecodeError::FdsTruncated { header, .. }
            | DecodeError::MissingFds { header, .. }
            | DecodeError::ExtraFds { header, .. }),
        ) => return Read::Refuse(header, refusal(ErrorCode::BadFds, e.to_string())),
    };
    let (header, fds) = (frame.header, frame.fds);
    match decode_request(header.opcode, frame.body) {
        Ok(req) if usize::from(req.fds_required()) != fds.len() => Read::Refuse(
            header,
            refusal(
                ErrorCode::BadFds,
                format!("{} takes {} descriptors, {} came", header.opcode, req.fds_required(), fds.len()),
            ),
        ),
        Ok(req) => Read::Request(header, req, fds),
        Err(e) => Read::Refuse(header, refusal(ErrorCode::BadRequest, crate::error_chain(&e))),
    }
}

/// The answer buffer a connection starts with.
const OUT_FRESH: usize = 256;

/// The largest answer buffer a connection keeps for its next answer.
const OUT_KEPT: usize = 64 * 1024;

struct Conn<'a> {
    stream: UnixStream,
    /// Who is at the other end, fixed at accept.
    client: Arc<Client>,
    daemon: &'a Daemon,
    version: Option<Version>,
    /// The subscribe request's id and the queue of its events.
    events: Option<(u64, mpsc::Receiver<Event>)>,
    /// Where the copy engine sends this connection's copy completions, and where they
    /// are read from: every ready one is sent before the next request is handled, which
    /// bounds the queue by `copy.max_in_flight_per_session` (a copy is started only by a
    /// request).
    copies: (crate::copy::Sink, mpsc::UnboundedReceiver<(u64, CopyDone)>),
    /// Bytes read and not yet handled, with their descriptors.
    decoder: FrameDecoder,
    /// The daemon's shutdown: a long request (a pin) gives up when it comes.
    shutdown: CancellationToken,
    /// The answer being sent (kept to reuse its allocation).
    out: Vec<u8>,
}

/// The next queued event with its subscribe request's id (`None`: the subscriber was
/// dropped for falling behind); pending forever without a subscription.
async fn next_event(events: &mut Option<(u64, mpsc::Receiver<Event>)>) -> (u64, Option<Event>) {
    match events {
        Some((id, rx)) => (*id, rx.recv().await),
        None => std::future::pending().await,
    }
}

async fn serve_connection(stream: UnixStream, client: Arc<Client>, main: &MainRuntime, shutdown: &CancellationToken) {
    let daemon = &*main.daemon;
    let session = daemon.open_session();
    let (uid, pid) = (client.principal.uid(), client.principal.pid());
    let span = tracing::debug_span!("session", id = session.id, uid, pid);
    serve_session(stream, client, main, session.id, shutdown).instrument(span).await;
}

async fn serve_session(
    stream: UnixStream,
    client: Arc<Client>,
    main: &MainRuntime,
    session: u64,
    shutdown: &CancellationToken,
) {
    let daemon = &*main.daemon;
    tracing::debug!("connected");
    let mut conn = Conn {
        stream,
        client: client.clone(),
        daemon,
        version: None,
        events: None,
        decoder: inbox::decoder(),
        shutdown: shutdown.clone(),
        out: Vec::with_capacity(OUT_FRESH),
        copies: mpsc::unbounded_channel(),
    };
    // Dropped before the connection: the session ends before the client sees it closed.
    let _end = SessionEnd { main, client: client.clone(), session, shutdown };
    'serve: loop {
        // Completions first, every one ready, unless a frame is half read (it is read whole
        // first): a client that pipelines copies always has a request buffered, and
        // without this its completions queued behind its requests without bound.
        if conn.decoder.at_boundary() || conn.decoder.want() == 0 {
            while let Ok((id, done)) = conn.copies.1.try_recv() {
                let h = Header::new(Opcode::Subscribe, FrameKind::Event, id);
                if !conn.send(&h, Message::Event(Event::CopyDone(done))).await {
                    break 'serve;
                }
            }
        }
        // Waiting for a frame to start and for an event are both cancel-safe; a frame that
        // has started is read whole (bounded by FRAME_TIMEOUT) before any event is sent.
        // Bytes already read (a client that sent several frames at once) are handled first.
        if conn.decoder.at_boundary() {
            let next = tokio::select! {
                () = shutdown.cancelled() => break,
                r = inbox::fill(&mut conn.decoder, &conn.stream) => r.map(|n| if n == 0 { None } else { Some(None) }),
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
                    tracing::warn!(
                        uid = client.principal.uid(),
                        pid = client.principal.pid(),
                        "subscriber fell behind its events; closing"
                    );
                    break;
                }
            }
        }
        let read = tokio::select! {
            () = shutdown.cancelled() => break,
            r = conn.read_frame() => r,
        };
        // Counted before the answer is sent, so that a client that has its answer also
        // sees it counted.
        let start = Instant::now();
        let (h, counted, answer, close) = match read {
            Read::Gone => break,
            Read::Fatal(err) => {
                let line = format!("closing connection: {}", err.message);
                daemon.refused_line(&client.principal, "frame", err.code, &line);
                (Header::new(Opcode::Hello, FrameKind::Error, 0), None, Err(err), true)
            }
            Read::Refuse(h, err) => {
                daemon.refused(&client.principal, h.opcode.name(), &err);
                // An unknown opcode travels under Hello; count it as op="unknown".
                let op = (err.code != ErrorCode::UnknownOpcode).then_some(h.opcode);
                (h, op, Err(err), false)
            }
            Read::Request(h, req, fds) => (h, Some(h.opcode), conn.answer(req, session, h.request_id, fds), false),
        };
        daemon.metrics.record(counted, answer.as_ref().err().map(|e| e.code), start.elapsed());
        let ok = match answer {
            Ok((resp, None)) => conn.send(&h, Message::Response(resp)).await,
            Ok((resp, Some(fd))) => conn.send_fd(&h, Message::Response(resp), fd).await,
            Err(err) => conn.send(&h, Message::Error(err)).await,
        };
        if close {
            break;
        }
        if !ok {
            break;
        }
    }
}

/// Ends a session when serving it ends, whichever way: the connection closed or failed,
/// the daemon stops, or a request's handler panicked — its regions, registrations, imports
/// and copies would otherwise outlive the session until a restart.
struct SessionEnd<'a> {
    main: &'a MainRuntime,
    client: Arc<Client>,
    session: u64,
    shutdown: &'a CancellationToken,
}

impl Drop for SessionEnd<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(session = self.session, "a request's handler panicked; ending its session");
        }
        end_session(self.main, &self.client, self.session, self.shutdown);
    }
}

/// What a session leaves behind when it ends: its subscription and copies stop; unless the
/// daemon is stopping (a restart is no client death), its imports of other nodes' regions
/// go back, and it is kept for resume (`memory.detach_grace_s`) or closed.
fn end_session(main: &MainRuntime, client: &Client, session: u64, shutdown: &CancellationToken) {
    let daemon = &*main.daemon;
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
    // Its imports of other nodes' regions go back to their owners, whether the session
    // ends or is kept for resume (a kept session's imports end too).
    if let Some(link) = daemon.domain.as_ref().and_then(|d| d.link()) {
        link.service().importer().close_session(daemon, session);
    }
    if let Some(detached) = detach(daemon, &client.principal, session) {
        // The connection's runtime ends with it: the grace timer runs on the daemon's.
        let (daemon, token, grace) = (main.daemon.clone(), detached, main.detach_grace);
        main.handle.spawn(async move {
            tokio::time::sleep(grace).await;
            let r = daemon.memory.reclaim_orphan(&token, session);
            if r.regions > 0 {
                tracing::info!(
                    regions = r.regions,
                    exports = r.exports,
                    "detached session not resumed in time; reclaimed"
                );
            }
        });
        tracing::debug!("disconnected; session kept for resume");
        return;
    }
    let r = daemon.memory.close_session(session);
    if r != Reclaimed::default() {
        tracing::info!(
            uid = client.principal.uid(),
            pid = client.principal.pid(),
            regions = r.regions,
            exports = r.exports,
            imports = r.imports,
            registrations = r.registrations,
            "session closed; reclaimed its regions, imports and registrations, revoked its exports"
        );
    }
    tracing::debug!("disconnected");
}

impl Conn<'_> {
    /// Reads more of the current frame (at most the rest of its part), within the frame's
    /// one deadline (set when the frame first needs a wait); false when the peer went or
    /// stalled.
    async fn more(&mut self, deadline: &mut Option<tokio::time::Instant>) -> bool {
        let by = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + FRAME_TIMEOUT);
        let part = match self.decoder.progress() {
            Some(p) if p.part == FramePart::Header => "header",
            _ => "body",
        };
        match tokio::time::timeout_at(by, inbox::fill(&mut self.decoder, &self.stream)).await {
            Ok(Ok(n)) => n > 0,
            Ok(Err(_)) => false,
            Err(_) => {
                tracing::warn!(
                    uid = self.client.principal.uid(),
                    pid = self.client.principal.pid(),
                    "client stalled inside a frame {part}; closing"
                );
                false
            }
        }
    }

    /// Reads the current frame (some of it may be in the decoder already). Waiting for it
    /// to start has no time limit (the caller does it); the rest of the frame has one.
    async fn read_frame(&mut self) -> Read {
        let mut deadline = None;
        loop {
            if let Some(r) = self.decoder.next_frame() {
                return read_of(r);
            }
            if !self.more(&mut deadline).await {
                return Read::Gone;
            }
        }
    }

    fn answer(
        &mut self,
        req: Request,
        session: u64,
        request_id: u64,
        fds: Vec<OwnedFd>,
    ) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
        if let Request::Hello(h) = &req {
            // Agreed once: events and copy completions already queued were made for it.
            if let Some(v) = self.version {
                let body = refusal(
                    ErrorCode::BadRequest,
                    format!("this connection speaks {v} already; another version needs a new connection"),
                );
                self.daemon.refused(&self.client.principal, "hello", &body);
                return Err(body);
            }
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
                    self.daemon.refused(&self.client.principal, "hello", &body);
                    Err(body)
                }
            };
        }
        if self.version.is_none() {
            let body = refusal(ErrorCode::NotNegotiated, "send hello first");
            self.daemon.refused(&self.client.principal, req.opcode().name(), &body);
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
            self.daemon.refused(&self.client.principal, op.name(), &body);
            return Err(body);
        }
        #[cfg(test)]
        if matches!(req, Request::Ping) && tests::PANIC_ON_PING.load(std::sync::atomic::Ordering::Relaxed) {
            panic!("a handler's bug, injected by a test");
        }
        if matches!(req, Request::Ping) {
            // Liveness and round-trip latency: answered with nothing else done
            // (docs/protocol.md).
            return Ok((Response::Ping, None));
        }
        // Asked between the pieces of a pin: no one waits for its answer any more.
        let (stream, shutdown) = (&self.stream, &self.shutdown);
        let abandon = || {
            if shutdown.is_cancelled() {
                Some("the daemon is stopping")
            } else if sys::hung_up(stream.as_fd()) {
                Some("the client hung up")
            } else {
                None
            }
        };
        let cx = Context {
            client: &self.client,
            session,
            request_id,
            version: self.version.unwrap_or(PROTOCOL_VERSION),
            abandon: &abandon,
            copies: Some(&self.copies.0),
        };
        let out = ops::request(self.daemon, &cx, req, fds)?;
        if let Response::Subscribe(_) = out.response {
            // Events travel under this request's id until the next subscribe.
            self.events = out.events.map(|rx| (request_id, rx));
        }
        Ok((out.response, out.fd))
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
        let (who, memory, daemon) = (&self.client.principal, &self.daemon.memory, self.daemon);
        let peer = &who.owner();
        let refused = |e: &crate::memory::MemoryError| {
            let body = crate::ops::dispatch::errors::memory(e);
            daemon.refused(who, "hello", &body);
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

    /// Encodes an answer to the request `h` into `self.out`: `Some(true)`; an `Internal`
    /// error in its place when it does not encode: `Some(false)`; `None` when not even
    /// that encodes.
    fn encode(&mut self, h: &Header, msg: &Message, fd_count: u8) -> Option<bool> {
        let version = self.version.unwrap_or(h.version);
        let header = Header { version, fd_count, ..h.answer(msg.kind()) };
        self.out.clear();
        if let Err(e) = encode_message(&header, msg, &mut self.out) {
            tracing::error!(error = %e, op = h.opcode.name(), "cannot encode an answer");
            self.out.clear();
            let err = Message::Error(refusal(ErrorCode::Internal, format!("answer does not encode: {e}")));
            let h = Header { version, ..h.answer(FrameKind::Error) };
            return encode_message(&h, &err, &mut self.out).ok().map(|()| false);
        }
        Some(true)
    }

    /// Writes `self.out` from byte `sent` on ([`Conn::write_out`]), then lets go of an
    /// allocation larger than [`OUT_KEPT`]: an idle connection does not keep its largest
    /// answer's buffer (a topology answer may be 16 MiB, and idle connections never time
    /// out).
    async fn flush(&mut self, sent: usize) -> bool {
        let written = self.write_out(sent).await;
        if self.out.capacity() > OUT_KEPT {
            self.out = Vec::with_capacity(OUT_FRESH);
        }
        written
    }

    /// Writes `self.out` from byte `sent` on: straight away when the socket takes it (the
    /// usual case, no timer), else within [`WRITE_TIMEOUT`]. False when unusable.
    async fn write_out(&mut self, mut sent: usize) -> bool {
        if sent < self.out.len() {
            match self.stream.try_write(&self.out[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return false,
            }
        }
        if sent >= self.out.len() {
            return true;
        }
        let rest = &self.out[sent..];
        matches!(tokio::time::timeout(WRITE_TIMEOUT, self.stream.write_all(rest)).await, Ok(Ok(())))
    }

    /// Sends one answer with its descriptor (`SCM_RIGHTS` with the first bytes, the rest
    /// plainly); false when the connection is unusable. The descriptor is closed here
    /// once sent (the client has its own).
    async fn send_fd(&mut self, h: &Header, msg: Message, fd: OwnedFd) -> bool {
        match self.encode(h, &msg, 1) {
            None => return false,
            // The answer did not encode and an error went in its place: no descriptor.
            Some(false) => return self.flush(0).await,
            Some(true) => {}
        }
        let (stream, out) = (&self.stream, &self.out);
        let attempt = || {
            stream.try_io(Interest::WRITABLE, || {
                fabric_proto::wire::send_with_fds(stream.as_fd(), &[std::io::IoSlice::new(out)], &[fd.as_fd()])
            })
        };
        let sent = match attempt() {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let wait = async {
                    loop {
                        stream.writable().await?;
                        match attempt() {
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                            r => return r,
                        }
                    }
                };
                match tokio::time::timeout(WRITE_TIMEOUT, wait).await {
                    Ok(Ok(n)) => n,
                    _ => return false,
                }
            }
            Err(_) => return false,
        };
        drop(fd);
        self.flush(sent).await
    }

    /// Sends one answer to the request `h`; false when the connection is unusable.
    async fn send(&mut self, h: &Header, msg: Message) -> bool {
        self.encode(h, &msg, 0).is_some() && self.flush(0).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    use fabric_proto::wire::{AllocRequest, AllocTarget, Connection, DeviceName, MemoryClass, Request, Response};

    use super::*;

    /// A `Ping` panics in its handler.
    pub(super) static PANIC_ON_PING: AtomicBool = AtomicBool::new(false);

    /// A connection refused at accept gets its `LimitExceeded` frame, on a runtime with one
    /// worker too. Before, `try_write` refused until the reactor had seen the new socket
    /// writable, so the client mostly read a bare EOF.
    #[test]
    fn a_connection_refused_at_accept_gets_its_error_frame() {
        use fabric_proto::wire::{ErrorCode, Message, recv_message};
        let dir = tempfile::tempdir().expect("tempdir");
        let sim = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
        let daemon = Arc::new(Daemon::on_sim_configured_for_tests(dir.path(), &sim, "[limits]\nclients = 1\n"));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        let path = dir.path().join("t.sock");
        let shutdown = CancellationToken::new();
        let listener = rt.block_on(async { UnixListener::bind(&path) }).expect("bind");
        let served = rt.spawn(run(listener, daemon, shutdown.clone()));
        let mut first = Connection::new(std::os::unix::net::UnixStream::connect(&path).expect("connect"));
        first.hello("first", fabric_proto::wire::SUPPORTED_VERSIONS).expect("hello");
        for _ in 0..5 {
            let second = std::os::unix::net::UnixStream::connect(&path).expect("connect");
            second.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            match recv_message(&second) {
                Ok((_, Message::Error(e), _)) => assert_eq!(e.code, ErrorCode::LimitExceeded),
                other => panic!("expected the LimitExceeded frame, got {other:?}"),
            }
        }
        shutdown.cancel();
        rt.block_on(served).expect("joined").expect("served");
    }

    /// A handler that panics ends its connection's thread; the session it served still
    /// ends, its region reclaimed (before, only the client slots went back: the region
    /// stayed, counted against its uid, until a restart).
    #[test]
    fn a_session_whose_handler_panics_still_ends_and_gives_its_regions_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let daemon = Arc::new(Daemon::on_sim_for_tests(dir.path()));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        let path = dir.path().join("t.sock");
        let shutdown = CancellationToken::new();
        let listener = rt.block_on(async { UnixListener::bind(&path) }).expect("bind");
        let served = rt.spawn(run(listener, daemon.clone(), shutdown.clone()));
        let mut c = Connection::new(std::os::unix::net::UnixStream::connect(&path).expect("connect"));
        c.hello("panic-test", fabric_proto::wire::SUPPORTED_VERSIONS).expect("hello");
        let view = daemon.view();
        let gpu = view.fabric.inventory().devices.iter().find(|d| d.gpu.is_some()).expect("a GPU").id.to_string();
        let target = AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm };
        let alloc = AllocRequest { target, size: 2 << 20, align: 4096 };
        assert!(matches!(c.call(Request::Alloc(alloc), &[]), Ok((Response::Alloc(_), _))));
        assert_eq!(daemon.memory.counts().regions, 1);
        PANIC_ON_PING.store(true, Ordering::Relaxed);
        assert!(c.call(Request::Ping, &[]).is_err(), "the connection ends with its thread");
        let deadline = Instant::now() + Duration::from_secs(10);
        while daemon.memory.counts().regions != 0 {
            assert!(Instant::now() < deadline, "the session's region outlived it");
            std::thread::sleep(Duration::from_millis(20));
        }
        shutdown.cancel();
        rt.block_on(served).expect("joined").expect("served");
    }
}
