//! The connection to fabricd, multiplexed: callers on any thread send requests under the
//! writer lock and wait for their own answer (by request id). Whoever waits reads: a
//! caller that finds no one reading reads frames itself until its answer comes, handing
//! other callers' answers over and events to the session's handler, so a lone caller gets
//! its answer on its own thread with no hand-off (one wake-up per round trip, as a plain
//! blocking client). While no caller waits, a background thread watches the socket
//! (`poll`, without reading) and reads what arrives (events, late answers), so events are
//! delivered when the session is idle too. Asynchronous operations (copies) wait on the
//! same path ([`Pending::wait`]).

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use fabric_proto::wire::{
    CodecError, Connection, Event, FrameKind, Header, Message, Opcode, Request, Response, SUPPORTED_VERSIONS,
    SessionToken, Version, connect_unix, recv_message, send_message,
};

use crate::error::{Error, Result};

/// An answer: the response and its descriptors, or why there is none.
pub(crate) type Reply = Result<(Response, Vec<OwnedFd>)>;

/// What the connection tells the session besides answers.
pub(crate) enum Notice {
    /// An event fabricd sent.
    Event(Event),
    /// An event read by a wait inside one of the session's callbacks, at once: what the
    /// library itself must do then (a revocation's mark and fence: the memory is not
    /// reached meanwhile). The same event follows as [`Notice::Event`] once that callback
    /// returns, for the application's callbacks.
    Arrived(Event),
    /// The connection is over (fabricd went, or [`Client::disconnect`]); told once. Nothing
    /// that was still to come on it (a copy's completion) will.
    Closed,
}

/// The session's handler of notices (runs on whichever thread read the event or saw the
/// end: the reader thread, or a caller's thread inside a call or a disconnect).
type OnEvent = Box<dyn Fn(Notice) + Send + Sync>;

/// Runs `callback`, an application's callback the library calls (`what` names it); a
/// panic in it is caught, logged and dropped: it would otherwise unwind through the
/// library's reading (leaving the read side taken), through an unrelated call that
/// happened to read the event (dropping that call's answer), or past other callbacks
/// still to run.
pub(crate) fn guarded(what: &'static str, callback: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(callback)) {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_owned());
        tracing::error!(callback = what, panic = %message, "an application callback panicked; the panic is dropped");
    }
}

thread_local! {
    /// The sessions ([`Shared`], by address) whose frames this thread is reading while it
    /// runs their event callbacks, innermost last (a callback of one session may drop
    /// another's objects, whose wait may run that one's callbacks): a call of any of them
    /// made from a callback would wait for an answer only this thread can read.
    static READING: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks this thread as reading a session's frames while it lives.
struct Reading;

impl Reading {
    fn enter(shared: &Shared) -> Self {
        Self::at(std::ptr::from_ref(shared) as usize)
    }

    /// (Past the thread's thread-locals' end — a drop in another thread-local's
    /// destructor, a C `atexit` handler — nothing is marked: no callback runs there.)
    fn at(session: usize) -> Self {
        let _ = READING.try_with(|r| r.borrow_mut().push(session));
        Self
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        let _ = READING.try_with(|r| r.borrow_mut().pop());
    }
}

/// Whether this thread is running one of `shared`'s callbacks, at any depth.
fn in_callback(shared: &Shared) -> bool {
    reading(std::ptr::from_ref(shared) as usize)
}

/// Whether this thread reads the session at `session` (by address), at any depth.
fn reading(session: usize) -> bool {
    READING.try_with(|r| r.borrow().contains(&session)).unwrap_or(false)
}

/// A request in flight.
struct Entry {
    op: Opcode,
    reply: Option<Reply>,
    /// Its [`Pending`] was dropped: the answer is discarded when it comes.
    abandoned: bool,
}

/// Who is reading the socket (at most one at a time: frames are read whole).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    Nobody,
    Background,
    Caller,
}

struct State {
    pending: HashMap<u64, Entry>,
    reader: Reader,
    /// Callers blocked in [`Pending::wait`]; while any is, the background thread stays off.
    waiting: usize,
    closed: bool,
}

/// What callers and the background thread share.
struct Shared {
    state: Mutex<State>,
    /// Callers wait on this for their answers or for the read side.
    changed: Condvar,
    /// The background thread waits on this (with a timeout) while callers read: callers
    /// notify it only where [`Shared::prompt`] is set, so a busy session that awaits no
    /// event does not wake it once per call.
    idle: Condvar,
    /// Events are awaited ([`Client::events_promptly`]: a revocation callback, a copy's
    /// completion): the last caller done reading wakes the background thread, which reads
    /// the next event at once instead of at its next look ([`IDLE_CHECK`]).
    prompt: std::sync::atomic::AtomicBool,
    /// `State::closed`, readable without the lock ([`Client::ended`]).
    closed: std::sync::atomic::AtomicBool,
    stream: UnixStream,
    on_event: OnEvent,
    /// Events read by a wait inside one of this session's callbacks
    /// ([`Client::undo_waiting`]): passed on, in order, once that callback returns.
    deferred: Mutex<std::collections::VecDeque<Event>>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn wait<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads one frame (the caller holds the read side) and routes it; false when the
    /// connection is over (every request still waiting then fails with `Disconnected`).
    fn read_one(&self) -> bool {
        self.read_frame(false)
    }

    /// The first event a wait in a callback kept, taken off the queue.
    fn next_deferred(&self) -> Option<Event> {
        self.deferred.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop_front()
    }

    /// [`Self::read_one`]; `nested` in one of this session's callbacks (whose thread holds
    /// the read side), where an event is kept for when the callback returns rather than
    /// run inside it.
    fn read_frame(&self, nested: bool) -> bool {
        match recv_message(&self.stream) {
            Ok((h, Message::Event(ev), _)) if h.kind == FrameKind::Event && nested => {
                guarded("event", || (self.on_event)(Notice::Arrived(ev.clone())));
                self.deferred.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push_back(ev);
                true
            }
            Ok((h, Message::Event(ev), _)) if h.kind == FrameKind::Event => {
                let _reading = Reading::enter(self);
                guarded("event", || (self.on_event)(Notice::Event(ev)));
                // What a wait in that callback read meanwhile, in order (the queue's lock
                // let go before each call: a callback may wait, and queue, again).
                while let Some(ev) = self.next_deferred() {
                    guarded("event", || (self.on_event)(Notice::Event(ev)));
                }
                true
            }
            Ok((h, msg, fds)) => {
                let mut st = self.state();
                let Some(e) = st.pending.get_mut(&h.request_id) else {
                    tracing::warn!(
                        request_id = h.request_id,
                        opcode = h.opcode.name(),
                        "answer to no request; dropped"
                    );
                    return true;
                };
                if e.abandoned {
                    st.pending.remove(&h.request_id);
                    return true;
                }
                let op = e.op;
                e.reply = Some(match msg {
                    Message::Response(r) => Ok((r, fds)),
                    Message::Error(body) => Err(Error::from_codec(op, CodecError::Refused { opcode: op, body })),
                    _ => Err(Error::Unexpected(op)),
                });
                true
            }
            Err(e) => {
                match e {
                    CodecError::Closed => tracing::debug!("fabricd closed the connection"),
                    e => tracing::warn!(error = %e, "connection to fabricd failed"),
                }
                self.close();
                false
            }
        }
    }

    /// Marks the connection over: every request still waiting fails with `Disconnected`,
    /// and the first time, the session is told ([`Notice::Closed`], outside the lock).
    fn close(&self) {
        let first = {
            let mut st = self.state();
            let first = !st.closed;
            st.closed = true;
            self.closed.store(true, Ordering::Release);
            st.pending.retain(|_, e| !e.abandoned);
            for e in st.pending.values_mut() {
                e.reply.get_or_insert(Err(Error::Disconnected));
            }
            first
        };
        self.changed.notify_all();
        self.idle.notify_all();
        if first {
            guarded("connection closed", || (self.on_event)(Notice::Closed));
        }
    }

    /// Whether the socket has something to read (or hung up) within `timeout_ms`.
    fn readable(&self, timeout_ms: i32) -> bool {
        let mut p = libc::pollfd { fd: self.stream.as_fd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
        loop {
            // SAFETY: `p` is one valid pollfd for the duration of the call; the descriptor
            // is the stream's, open while `self` lives.
            let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
            if n >= 0 {
                return n > 0;
            }
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                // Not expected for one valid descriptor; let a read find out what is wrong.
                return true;
            }
        }
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
    background: Option<JoinHandle<()>>,
    /// The process whose connection it is.
    origin: crate::origin::Origin,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("version", &self.version).field("session", &self.session).finish()
    }
}

/// The refusal of a wait made in one of the session's own callbacks ([`Pending::wait`],
/// [`crate::Copy::wait`]): what it waits for can only be read once the callback returns.
pub(crate) fn waited_in_callback() -> Error {
    Error::InvalidArgument(
        "a call that waits for the daemon, made in one of this session's callbacks: make it after the callback returns"
            .into(),
    )
}

/// A request in flight.
pub(crate) struct Pending {
    shared: Arc<Shared>,
    id: u64,
    done: bool,
}

impl Pending {
    /// Blocks until the answer arrives, reading the socket itself when no one else does.
    /// Refused in one of the session's own callbacks, whose thread is the one that reads
    /// the answer (the request stays sent; its answer is discarded).
    pub(crate) fn wait(mut self) -> Reply {
        if in_callback(&self.shared) {
            return Err(waited_in_callback());
        }
        self.done = true;
        let shared = &*self.shared;
        let mut st = shared.state();
        st.waiting += 1;
        let reply = loop {
            if let Some(e) = st.pending.get_mut(&self.id)
                && let Some(r) = e.reply.take()
            {
                st.pending.remove(&self.id);
                break r;
            }
            if !st.pending.contains_key(&self.id) || st.closed {
                st.pending.remove(&self.id);
                break Err(Error::Disconnected);
            }
            if st.reader == Reader::Nobody {
                st.reader = Reader::Caller;
                drop(st);
                shared.read_one();
                st = shared.state();
                st.reader = Reader::Nobody;
                if st.waiting > 1 {
                    // Others may have their answer now, or may take over the reading.
                    shared.changed.notify_all();
                }
                continue;
            }
            st = shared.wait(st);
        };
        st.waiting -= 1;
        if st.waiting == 0 && st.reader == Reader::Nobody && shared.prompt.load(std::sync::atomic::Ordering::Relaxed) {
            shared.idle.notify_one();
        }
        reply
    }
}

impl Pending {
    /// [`Self::wait`] in one of this session's callbacks: this thread holds the read side
    /// (the callback's frame was read by it), so it reads on until the answer comes,
    /// keeping the events it reads for when the callback returns.
    fn wait_reading(mut self) -> Reply {
        self.done = true;
        let shared = &*self.shared;
        loop {
            {
                let mut st = shared.state();
                if let Some(e) = st.pending.get_mut(&self.id)
                    && let Some(r) = e.reply.take()
                {
                    st.pending.remove(&self.id);
                    return r;
                }
                if !st.pending.contains_key(&self.id) || st.closed {
                    st.pending.remove(&self.id);
                    return Err(Error::Disconnected);
                }
            }
            let open = shared.read_frame(true);
            // Other callers may have their answer now.
            shared.changed.notify_all();
            if !open {
                let mut st = shared.state();
                st.pending.remove(&self.id);
                return Err(Error::Disconnected);
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut st = self.shared.state();
        match st.pending.get_mut(&self.id) {
            Some(e) if e.reply.is_none() => e.abandoned = true,
            _ => {
                st.pending.remove(&self.id);
            }
        }
    }
}

/// How long [`Client::connect`] waits for fabricd to take the connection and answer the
/// hello.
pub(crate) const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How often the background thread looks whether callers stopped reading (unless woken:
/// [`Shared::prompt`]).
const IDLE_CHECK: std::time::Duration = std::time::Duration::from_millis(2);

/// While no caller waits: watch the socket and read what comes (events, answers to
/// requests no one waits for yet); stop when the connection is over. While callers read,
/// it looks every [`IDLE_CHECK`] whether they stopped, so events wait at most that long
/// longer than they would for a dedicated reader — none longer where the session awaits
/// events ([`Client::events_promptly`]): the last caller done wakes it.
fn background(shared: &Shared) {
    loop {
        {
            let mut st = shared.state();
            while !st.closed && (st.reader != Reader::Nobody || st.waiting > 0) {
                st = shared.idle.wait_timeout(st, IDLE_CHECK).unwrap_or_else(std::sync::PoisonError::into_inner).0;
            }
            if st.closed {
                return;
            }
        }
        if !shared.readable(-1) {
            continue;
        }
        let mut st = shared.state();
        if st.closed {
            return;
        }
        if st.reader != Reader::Nobody || st.waiting > 0 {
            // A caller reads (what woke us was likely its answer).
            continue;
        }
        st.reader = Reader::Background;
        drop(st);
        // A caller may have taken the bytes between the poll and the lock: read only when
        // a frame is still there, so the socket is never held by a blocked read.
        let open = !shared.readable(0) || shared.read_one();
        let mut st = shared.state();
        st.reader = Reader::Nobody;
        if st.waiting > 0 {
            shared.changed.notify_all();
        }
        if !open || st.closed {
            return;
        }
    }
}

impl Client {
    /// Connects to `socket`, negotiates a version (taking back the session `resume`
    /// names, when given), and starts the background reader, which passes events to
    /// `on_event` while no caller waits (callers that read pass them on too).
    /// A wedged daemon (its accept queue full, or no answer to the hello) is
    /// [`Error::Connect`] after [`CONNECT_TIMEOUT`], not a hang.
    pub(crate) fn connect(socket: &Path, name: &str, resume: Option<SessionToken>, on_event: OnEvent) -> Result<Self> {
        let unreachable = |source| Error::Connect { path: socket.to_owned(), source };
        let stream = connect_unix(socket, Some(CONNECT_TIMEOUT)).map_err(unreachable)?;
        let mut conn = Connection::new(stream);
        conn.set_call_timeout(Some(CONNECT_TIMEOUT));
        let hello = conn.hello_with(name, SUPPORTED_VERSIONS, resume).map_err(|e| match e {
            CodecError::TimedOut { after } => unreachable(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer to the hello within {after:?}"),
            )),
            e => Error::from_codec(Opcode::Hello, e),
        })?;
        // Requests and the reader wait as long as the daemon takes from here on (each
        // has its own rules): the hello's bound did not stay on the socket.
        let stream = conn.stream().try_clone().map_err(Error::os("cloning the daemon socket"))?;
        let read_half = stream.try_clone().map_err(Error::os("cloning the daemon socket"))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State { pending: HashMap::new(), reader: Reader::Nobody, waiting: 0, closed: false }),
            changed: Condvar::new(),
            idle: Condvar::new(),
            prompt: std::sync::atomic::AtomicBool::new(false),
            closed: std::sync::atomic::AtomicBool::new(false),
            stream: read_half,
            on_event,
            deferred: Mutex::new(std::collections::VecDeque::new()),
        });
        let bg = shared.clone();
        let background = std::thread::Builder::new()
            .name("fabric-mm-reader".into())
            .spawn(move || background(&bg))
            .map_err(Error::os("starting the reader thread"))?;
        Ok(Self {
            writer: Mutex::new(stream),
            shared,
            next_id: AtomicU64::new(1),
            version: hello.version,
            session: hello.session,
            token: hello.token,
            background: Some(background),
            origin: crate::origin::Origin::here(),
        })
    }

    /// The negotiated protocol version.
    pub(crate) fn version(&self) -> Version {
        self.version
    }

    /// From now on events are read as soon as no caller reads, not at the background
    /// thread's next look: the session awaits them (a revocation callback, copies).
    pub(crate) fn events_promptly(&self) {
        self.shared.prompt.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether this thread is running one of this session's callbacks, where a wait for
    /// anything the daemon sends (an answer, a copy's completion) would wait for this
    /// very thread.
    pub(crate) fn in_callback(&self) -> bool {
        in_callback(&self.shared)
    }

    /// Whether this is a forked child's copy of the connection: the parent's, never used
    /// here (a request would act on the parent's session, and its answer would be read
    /// here, not by the parent).
    pub(crate) fn forked(&self) -> bool {
        self.origin.forked()
    }

    /// Whether the connection is gone.
    pub(crate) fn is_closed(&self) -> bool {
        self.shared.state().closed
    }

    /// Whether the connection is gone or this is a forked child's copy of it, as far as
    /// a look without a lock or a system call tells (a child made by a raw `clone` system
    /// call is found by the requests' own check): for paths that answer without asking
    /// the daemon, such as a registration cache hit.
    pub(crate) fn ended(&self) -> bool {
        self.origin.forked_cheaply() || self.shared.closed.load(Ordering::Acquire)
    }

    /// The daemon's id for this session.
    pub(crate) fn session(&self) -> u64 {
        self.session
    }

    /// The session's resume token (protocol 1.1 and later).
    pub(crate) fn token(&self) -> Option<SessionToken> {
        self.token
    }

    /// Closes the connection now (both directions); whoever reads sees the end and every
    /// request still waiting fails with `Disconnected`.
    pub(crate) fn disconnect(&self) {
        // A forked child's copy: the socket is the parent's (see `Drop`).
        if self.forked() {
            return;
        }
        if let Ok(w) = self.writer.lock() {
            let _ = w.shutdown(std::net::Shutdown::Both);
        }
        self.shared.close();
    }

    /// Sends a request; the answer arrives on the returned [`Pending`].
    pub(crate) fn start(&self, req: Request, fds: &[BorrowedFd<'_>]) -> Result<Pending> {
        let op = req.opcode();
        if self.forked() {
            tracing::debug!(?op, "a forked child's copy of a session is not used: no request sent");
            return Err(Error::Disconnected);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        {
            let mut st = self.shared.state();
            if st.closed {
                return Err(Error::Disconnected);
            }
            st.pending.insert(id, Entry { op, reply: None, abandoned: false });
        }
        let pending = Pending { shared: self.shared.clone(), id, done: false };
        let header = Header { version: self.version, ..Header::new(op, FrameKind::Request, id) };
        let sent = {
            let w = self.writer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            send_message(&w, &header, &Message::Request(req), fds)
        };
        match sent {
            Ok(()) => Ok(pending),
            Err(e) => {
                let mut p = pending;
                p.done = true;
                let mut st = self.shared.state();
                st.pending.remove(&id);
                let gone = matches!(&e, CodecError::Io(io)
                    if matches!(io.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset));
                Err(if st.closed || gone { Error::Disconnected } else { Error::from_codec(op, e) })
            }
        }
    }

    /// Sends a request and waits for its answer.
    pub(crate) fn call(&self, req: Request, fds: &[BorrowedFd<'_>]) -> Reply {
        self.start(req, fds)?.wait()
    }

    /// Sends an undo whose answer nobody needs (a free, release or unregister on drop)
    /// and waits for it — but in one of the session's own callbacks (one that drops a
    /// library object), where waiting would wait for this thread: there it is sent, and
    /// its answer discarded.
    pub(crate) fn undo(&self, req: Request) -> Result<()> {
        let pending = self.start(req, &[])?;
        if in_callback(&self.shared) {
            return Ok(());
        }
        pending.wait().map(drop)
    }

    /// [`Self::undo`] that waits for the answer even in one of the session's callbacks
    /// (reading the frames itself there): for an undo after whose answer the caller's own
    /// memory may be reused — an unregister of a bare pointer, which the daemon answers
    /// once no copy writes those bytes any more.
    pub(crate) fn undo_waiting(&self, req: Request) -> Result<()> {
        let pending = self.start(req, &[])?;
        if in_callback(&self.shared) {
            return pending.wait_reading().map(drop);
        }
        pending.wait().map(drop)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        if self.forked() {
            // The socket is the parent's: a shutdown would end its connection. The reader
            // thread is not in this process: nothing to join (its handle is let go).
            std::mem::forget(self.background.take());
            return;
        }
        self.disconnect();
        // Not joined from itself: a callback may drop the session's last object (then the
        // thread ends on its own once the callback returns, the connection closed).
        if let Some(r) = self.background.take().filter(|r| r.thread().id() != std::thread::current().id()) {
            let _ = r.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Reading, reading};

    #[test]
    fn a_callback_of_one_session_inside_anothers_still_counts_for_both() {
        let x = Reading::at(0x1000);
        {
            // X's callback drops an object of Y, whose wait runs Y's callback.
            let _y = Reading::at(0x2000);
            // There, a call of X would wait for an answer only this thread (further up its
            // stack) reads: it must be seen (before, only the innermost session was).
            assert!(reading(0x1000) && reading(0x2000));
        }
        assert!(reading(0x1000) && !reading(0x2000));
        drop(x);
        assert!(!reading(0x1000));
    }
}
