//! Asynchronous copies by the daemon's copy engine: [`Session::copy`] asks fabricd to move
//! bytes between registrations and/or GFAs and returns at once with a [`Copy`](struct@Copy); the
//! engine (not the caller's thread) moves the bytes, and its completion arrives on the
//! session's reader thread, which resolves the `Copy`: [`Copy::poll`], [`Copy::wait`],
//! [`Copy::wait_timeout`], or a callback ([`Session::copy_with`], [`Copy::on_complete`]).
//!
//! # Memory safety
//! The engine writes the destination at any time until the copy completes, from another
//! process: while a copy runs, no Rust reference to its destination bytes (or, for the
//! source, no writes) may be live in this process. Read the destination after the copy
//! completed, through the mapping's raw pointer or a fresh slice.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    BoundedVec, CopyBatchRequest, CopyDone, CopyRequest, CopyResult, ErrorCode, MAX_BATCH, Opcode, Request, Response,
};

use crate::error::{Error, Result};
use crate::session::{Inner, Session};

/// One side of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyEndpoint {
    /// A DMA registration of this session, from byte `offset` of the registered bytes.
    Registration {
        /// The registration's id.
        id: u64,
        /// Byte offset in it.
        offset: u64,
    },
    /// A global fabric address inside a region this session owns or imported (with write
    /// access when it is the destination).
    Gfa(u64),
}

impl From<CopyEndpoint> for fabric_proto::wire::CopyEndpoint {
    fn from(e: CopyEndpoint) -> Self {
        match e {
            CopyEndpoint::Registration { id, offset } => Self::Registration { id, offset },
            CopyEndpoint::Gfa(g) => Self::Gfa(g),
        }
    }
}

/// One copy of a batch ([`Session::copy_batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyPart {
    /// Where the bytes go.
    pub dst: CopyEndpoint,
    /// Where they come from.
    pub src: CopyEndpoint,
    /// How many.
    pub len: u64,
}

/// What a completion callback gets: the bytes copied, or why the copy stopped
/// ([`Error::CopyFailed`]).
pub type CopyOutcome = Result<u64>;

type Callback = Box<dyn FnOnce(CopyOutcome) + Send>;

#[derive(Default)]
struct Slot {
    done: Option<CopyDone>,
    callback: Option<Callback>,
    /// The result went (or will go) to a callback.
    handed: bool,
}

/// A copy's shared state: the reader thread fills it, the [`Copy`](struct@Copy) reads it.
#[derive(Default)]
struct State {
    slot: Mutex<Slot>,
    ready: Condvar,
}

impl State {
    fn slot(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The session's copies in flight, and completions that came before their copy was
/// recorded (the reader thread may see the completion before the caller sees the id).
#[derive(Default)]
pub(crate) struct Copies {
    inner: Mutex<CopiesInner>,
}

#[derive(Default)]
struct CopiesInner {
    waiting: HashMap<u64, Arc<State>>,
    early: HashMap<u64, CopyDone>,
}

impl Copies {
    fn lock(&self) -> MutexGuard<'_, CopiesInner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Called on the reader thread for each `CopyDone` event.
    pub(crate) fn complete(&self, done: CopyDone) {
        let state = {
            let mut c = self.lock();
            match c.waiting.remove(&done.copy) {
                Some(s) => s,
                None => {
                    c.early.insert(done.copy, done);
                    return;
                }
            }
        };
        deliver(&state, done);
    }

    /// Called once when the connection is over: no completion will come, so every copy
    /// still waiting ends with [`Error::Disconnected`] — its callback is called with it
    /// now (on this thread), and its waiters wake to find the connection closed.
    pub(crate) fn disconnected(&self) {
        let waiting: Vec<Arc<State>> = {
            let mut c = self.lock();
            c.early.clear();
            c.waiting.drain().map(|(_, s)| s).collect()
        };
        for state in waiting {
            let callback = {
                let mut slot = state.slot();
                let cb = slot.callback.take();
                state.ready.notify_all();
                cb
            };
            if let Some(cb) = callback {
                crate::client::guarded("copy completion", || cb(Err(Error::Disconnected)));
            }
        }
    }

    fn track(&self, id: u64, state: &Arc<State>) {
        let early = {
            let mut c = self.lock();
            match c.early.remove(&id) {
                Some(d) => Some(d),
                None => {
                    c.waiting.insert(id, state.clone());
                    None
                }
            }
        };
        if let Some(d) = early {
            deliver(state, d);
        }
    }
}

fn deliver(state: &State, done: CopyDone) {
    let callback = {
        let mut slot = state.slot();
        let cb = slot.callback.take();
        if cb.is_none() {
            slot.done = Some(done.clone());
        }
        slot.handed |= cb.is_some();
        state.ready.notify_all();
        cb
    };
    if let Some(cb) = callback {
        crate::client::guarded("copy completion", || cb(outcome(&done)));
    }
}

fn outcome(d: &CopyDone) -> CopyOutcome {
    match &d.result {
        CopyResult::Ok => Ok(d.bytes),
        CopyResult::Failed { code, message } => {
            Err(Error::CopyFailed { copy: d.copy, code: *code, message: message.to_string(), bytes: d.bytes })
        }
    }
}

/// A copy in flight or done. Dropping it does not cancel the copy (the daemon finishes
/// it); its result is then discarded.
pub struct Copy {
    id: u64,
    state: Arc<State>,
    session: Arc<Inner>,
}

impl std::fmt::Debug for Copy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copy").field("id", &self.id).finish()
    }
}

/// How often a waiter checks that the connection is still there.
const TICK: Duration = Duration::from_millis(50);

impl Copy {
    /// The daemon's id of the copy.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn closed(&self) -> bool {
        self.session.client.is_closed()
    }

    /// The result when the copy is done (bytes copied, or why it stopped); `None` while it
    /// runs. A copy whose result went to a callback reports [`Error::InvalidArgument`].
    pub fn poll(&self) -> Option<CopyOutcome> {
        let slot = self.state.slot();
        if let Some(d) = &slot.done {
            return Some(outcome(d));
        }
        if slot.handed {
            return Some(Err(Error::InvalidArgument("the copy's result goes to its callback".into())));
        }
        drop(slot);
        self.closed().then_some(Err(Error::Disconnected))
    }

    /// Blocks until the copy is done. Refused ([`Error::InvalidArgument`]) in one of this
    /// session's callbacks (a revocation or copy callback), whose thread is the one that
    /// reads the completion: there, use [`Copy::poll`].
    pub fn wait(&self) -> CopyOutcome {
        loop {
            if let Some(r) = self.wait_timeout(Duration::from_secs(3600)) {
                return r;
            }
        }
    }

    /// Blocks until the copy is done or `timeout` passes (`None`). Refused in one of this
    /// session's callbacks, as [`Copy::wait`] is.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<CopyOutcome> {
        if self.session.client.in_callback() {
            return Some(Err(crate::client::waited_in_callback()));
        }
        let deadline = Instant::now() + timeout;
        let mut slot = self.state.slot();
        loop {
            if let Some(d) = &slot.done {
                return Some(outcome(d));
            }
            if slot.handed {
                return Some(Err(Error::InvalidArgument("the copy's result goes to its callback".into())));
            }
            if self.closed() {
                return Some(Err(Error::Disconnected));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            let step = (deadline - now).min(TICK);
            slot = self.state.ready.wait_timeout(slot, step).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    /// Runs `f` with the result once the copy is done: at once on this thread when it
    /// already is, else on the session's reader thread (so `f` must not block). If the
    /// connection ends first, `f` gets [`Error::Disconnected`] when the library sees the
    /// end. After this, [`Copy::poll`] and [`Copy::wait`] no longer report the result.
    ///
    /// One callback per copy: a second one ([`Session::copy_with`] counts as the first) is
    /// refused with [`Error::InvalidArgument`] and never runs — the result goes to the
    /// first, whether it ran already or is still to run.
    pub fn on_complete(&self, f: impl FnOnce(CopyOutcome) + Send + 'static) -> Result<()> {
        let mut slot = self.state.slot();
        if slot.handed {
            return Err(Error::InvalidArgument(
                "the copy's result already goes to a callback: set one per copy".into(),
            ));
        }
        slot.handed = true;
        if let Some(d) = slot.done.take() {
            drop(slot);
            f(outcome(&d));
            return Ok(());
        }
        // The connection is over and no completion will come (`Copies::disconnected`, which
        // runs after the session is marked closed, may already have passed this copy).
        if self.closed() {
            drop(slot);
            f(Err(Error::Disconnected));
            return Ok(());
        }
        slot.callback = Some(Box::new(f));
        Ok(())
    }
}

impl Session {
    /// Starts copying `len` bytes from `src` to `dst` with the daemon's copy engine and
    /// returns at once. Refusals (an endpoint not found or not this session's, a range
    /// past its memory, overlap, too many copies in flight) come back here; failures
    /// during the copy come with its result.
    ///
    /// While the copy runs, hold no Rust reference to the destination bytes (see the
    /// module documentation).
    pub fn copy(&self, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> Result<Copy> {
        self.needs(Opcode::Copy)?;
        // Its completion is read as it comes (set before the call: the call's own end wakes
        // the reader).
        self.inner.client.events_promptly();
        let req = Request::Copy(CopyRequest { dst: dst.into(), src: src.into(), len });
        let Response::Copy(r) = self.call(req)? else { return Err(Error::Unexpected(Opcode::Copy)) };
        Ok(self.track_copy(r.copy))
    }

    /// Starts up to 64 copies as one batch (like a DMA engine's descriptor list) and
    /// returns at once with one [`Copy`](struct@Copy) for all of them: one request, one
    /// completion, whose byte count is the sum. Every copy is checked before any starts (a
    /// refusal names the copy); the engines run them in any order and in parallel, so
    /// copies of one batch must not overlap each other's destinations or write another's
    /// source. Needs protocol 1.3.
    pub fn copy_batch(&self, copies: &[CopyPart]) -> Result<Copy> {
        self.needs(Opcode::CopyBatch)?;
        self.inner.client.events_promptly();
        let list: Vec<CopyRequest> =
            copies.iter().map(|c| CopyRequest { dst: c.dst.into(), src: c.src.into(), len: c.len }).collect();
        let copies = BoundedVec::new(list)
            .map_err(|_| Error::InvalidArgument(format!("at most {MAX_BATCH} copies per batch")))?;
        let Response::CopyBatch(r) = self.call(Request::CopyBatch(CopyBatchRequest { copies }))? else {
            return Err(Error::Unexpected(Opcode::CopyBatch));
        };
        Ok(self.track_copy(r.copy))
    }

    /// Refuses `op` here when the daemon's protocol is older than the op.
    fn needs(&self, op: Opcode) -> Result<()> {
        let v = self.inner.client.version();
        if v < op.since() {
            return Err(Error::Refused {
                op,
                code: ErrorCode::UnknownOpcode,
                message: format!("the daemon speaks protocol {v}; {op} needs {}", op.since()),
                limit: None,
            });
        }
        Ok(())
    }

    fn track_copy(&self, id: u64) -> Copy {
        let state = Arc::new(State::default());
        self.inner.copies.track(id, &state);
        Copy { id, state, session: self.inner.clone() }
    }

    /// [`Session::copy`] with a callback that gets the result (see [`Copy::on_complete`]).
    pub fn copy_with(
        &self,
        dst: CopyEndpoint,
        src: CopyEndpoint,
        len: u64,
        f: impl FnOnce(CopyOutcome) + Send + 'static,
    ) -> Result<Copy> {
        let c = self.copy(dst, src, len)?;
        c.on_complete(f)?;
        Ok(c)
    }
}

impl crate::Registration {
    /// This registration as a copy endpoint, from byte `offset` of the registered bytes
    /// (for a registration the cache answered from a larger one, the daemon registration
    /// `id` names at [`crate::Registration::id_offset`] + `offset`). An `offset` so large
    /// that the sum overflows names the last byte's end (the copy is refused), never
    /// bytes before the registration's.
    pub fn at(&self, offset: u64) -> CopyEndpoint {
        CopyEndpoint::Registration { id: self.id(), offset: self.id_offset().saturating_add(offset) }
    }
}

impl From<&crate::Registration> for CopyEndpoint {
    /// The registration's first byte.
    fn from(r: &crate::Registration) -> Self {
        r.at(0)
    }
}

impl Drop for Copy {
    fn drop(&mut self) {
        // A forked child's copy: its state is the parent's reader's to take.
        if self.session.client.forked() {
            return;
        }
        // A callback still waits for it: kept. Otherwise a completion that came is let
        // go; one still to come finds the copy waiting (it is recorded there until
        // then), is taken from there and dropped, rather than kept as an early one
        // for a copy no one will record.
        if self.state.slot().callback.is_some() {
            return;
        }
        self.session.copies.lock().early.remove(&self.id);
    }
}
