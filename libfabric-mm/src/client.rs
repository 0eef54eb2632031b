//! The connection to fabricd, multiplexed: callers on any thread send requests under the
//! writer lock and wait for their own answer, while one reader thread receives every
//! frame, hands each answer to the request it belongs to (by request id) and each event to
//! the session's event handler. Asynchronous operations (copies) wait on the same path.

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use fabric_proto::wire::{
    CodecError, Connection, Event, FrameKind, Header, Message, Opcode, Request, Response, SUPPORTED_VERSIONS,
    SessionToken, Version, recv_message, send_message,
};

use crate::error::{Error, Result};

/// An answer: the response and its descriptors, or why there is none.
pub(crate) type Reply = Result<(Response, Vec<OwnedFd>)>;

/// Where an answer goes: the caller waiting for it.
struct Waiter(Sender<Reply>);

impl Waiter {
    fn deliver(self, reply: Reply) {
        let _ = self.0.send(reply);
    }
}

/// What the reader thread shares with callers.
struct Shared {
    pending: Mutex<HashMap<u64, (Opcode, Waiter)>>,
    closed: AtomicBool,
}

impl Shared {
    fn pending(&self) -> MutexGuard<'_, HashMap<u64, (Opcode, Waiter)>> {
        self.pending.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A negotiated, multiplexed connection.
pub(crate) struct Client {
    writer: Mutex<UnixStream>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    version: Version,
    session: u64,
    token: Option<SessionToken>,
    reader: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("version", &self.version).field("session", &self.session).finish()
    }
}

/// A request in flight.
pub(crate) struct Pending {
    rx: Receiver<Reply>,
}

impl Pending {
    /// Blocks until the answer arrives.
    pub(crate) fn wait(self) -> Reply {
        self.rx.recv().unwrap_or(Err(Error::Disconnected))
    }
}

impl Client {
    /// Connects to `socket`, negotiates a version (taking back the session `resume`
    /// names, when given), and starts the reader thread, which passes every event to
    /// `on_event`.
    pub(crate) fn connect(
        socket: &Path,
        name: &str,
        resume: Option<SessionToken>,
        on_event: Box<dyn Fn(Event) + Send>,
    ) -> Result<Self> {
        let stream =
            UnixStream::connect(socket).map_err(|source| Error::Connect { path: socket.to_owned(), source })?;
        let mut conn = Connection::new(stream);
        let hello =
            conn.hello_with(name, SUPPORTED_VERSIONS, resume).map_err(|e| Error::from_codec(Opcode::Hello, e))?;
        let stream = conn.stream().try_clone().map_err(Error::os("cloning the daemon socket"))?;
        let read_half = stream.try_clone().map_err(Error::os("cloning the daemon socket"))?;
        let shared = Arc::new(Shared { pending: Mutex::new(HashMap::new()), closed: AtomicBool::new(false) });
        let reader_shared = shared.clone();
        let reader = std::thread::Builder::new()
            .name("fabric-mm-reader".into())
            .spawn(move || read_loop(&read_half, &reader_shared, &*on_event))
            .map_err(Error::os("starting the reader thread"))?;
        Ok(Self {
            writer: Mutex::new(stream),
            shared,
            next_id: AtomicU64::new(1),
            version: hello.version,
            session: hello.session,
            token: hello.token,
            reader: Some(reader),
        })
    }

    /// The negotiated protocol version.
    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// The daemon's id for this session.
    pub(crate) fn session(&self) -> u64 {
        self.session
    }

    /// The session's resume token (protocol 1.1 and later).
    pub(crate) fn token(&self) -> Option<SessionToken> {
        self.token
    }

    /// Closes the connection now (both directions); the reader thread sees the end and
    /// fails every request still waiting with `Disconnected`.
    pub(crate) fn disconnect(&self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
    }

    fn send(&self, req: Request, fds: &[BorrowedFd<'_>], waiter: Waiter) -> Result<()> {
        let op = req.opcode();
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(Error::Disconnected);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.pending().insert(id, (op, waiter));
        let header = Header { version: self.version, ..Header::new(op, FrameKind::Request, id) };
        let sent = {
            let w = self.writer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            send_message(&w, &header, &Message::Request(req), fds)
        };
        if let Err(e) = sent {
            self.shared.pending().remove(&id);
            return Err(Error::from_codec(op, e));
        }
        // The reader may have died between the check and the insert: do not wait forever.
        if self.shared.closed.load(Ordering::Acquire)
            && let Some((_, w)) = self.shared.pending().remove(&id)
        {
            w.deliver(Err(Error::Disconnected));
        }
        Ok(())
    }

    /// Sends a request; the answer arrives on the returned [`Pending`].
    pub(crate) fn start(&self, req: Request, fds: &[BorrowedFd<'_>]) -> Result<Pending> {
        let (tx, rx) = mpsc::channel();
        self.send(req, fds, Waiter(tx))?;
        Ok(Pending { rx })
    }

    /// Sends a request and waits for its answer.
    pub(crate) fn call(&self, req: Request, fds: &[BorrowedFd<'_>]) -> Reply {
        self.start(req, fds)?.wait()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn read_loop(stream: &UnixStream, shared: &Shared, on_event: &dyn Fn(Event)) {
    loop {
        match recv_message(stream) {
            Ok((h, Message::Event(ev), _)) if h.kind == FrameKind::Event => on_event(ev),
            Ok((h, msg, fds)) => {
                let Some((op, waiter)) = shared.pending().remove(&h.request_id) else {
                    tracing::warn!(
                        request_id = h.request_id,
                        opcode = h.opcode.name(),
                        "answer to no request; dropped"
                    );
                    continue;
                };
                let reply = match msg {
                    Message::Response(r) => Ok((r, fds)),
                    Message::Error(body) => Err(Error::from_codec(op, CodecError::Refused { opcode: op, body })),
                    _ => Err(Error::Unexpected(op)),
                };
                waiter.deliver(reply);
            }
            Err(e) => {
                match e {
                    CodecError::Closed => tracing::debug!("fabricd closed the connection"),
                    e => tracing::warn!(error = %e, "connection to fabricd failed"),
                }
                break;
            }
        }
    }
    shared.closed.store(true, Ordering::Release);
    let waiters: Vec<_> = shared.pending().drain().collect();
    for (_, (_, w)) in waiters {
        w.deliver(Err(Error::Disconnected));
    }
}
