//! The copy engine: `copy.engines` threads that move the bytes of `Copy` requests, so
//! that neither the client's thread nor the daemon's request loop does.
//!
//! A copy is resolved (endpoints to memory the engine reaches without the registry lock,
//! see [`crate::memory::Side`]) and queued as one job split in chunks of at most
//! `copy.chunk_bytes` (and at most a 1/`engines` share of the copy, so that every engine
//! takes part); any engine takes any chunk. Chunks are taken fairly (`fair.rs`): round
//! robin over the uids with chunks queued and, within a uid, over its sessions, so that
//! one session's backlog delays another's copy by at most a chunk per engine. The engine that finishes a job's last chunk
//! sends its [`CopyDone`] to the issuing connection.
//!
//! How bytes move (`chunk.rs`). A client holds a descriptor of the memory it copies and
//! may shrink the file under the daemon's mapping, so a plain load or store of the daemon
//! could be `SIGBUS`; every CPU copy is therefore the recovering one (`fault.rs`), which
//! turns such a fault into the chunk's error:
//! - between two daemon-held sides — registrations of region files, memory objects and
//!   memfds (their pinned mappings), regions by GFA (mapped once per region and kept for
//!   later chunks and copies: `regionmap.rs`; for a region on a DAX device or a BAR, its
//!   range of the device file, which serves `mmap` only) — the CPU, one `rep movsb`
//!   between the mappings;
//! - a client's memory (a process registration) to or from anything: `process_vm_readv`/
//!   `writev` between the client and a per-engine buffer, then the daemon-held side from
//!   or into that buffer (two copies: another process's memory cannot be mapped, and the
//!   client's end must move outside the job's gate, below).
//!
//! Where there is no recovering copy (not x86_64 Linux, or Miri) the kernel copies between
//! daemon-held sides too (`pread` from the source's file into the destination's mapping),
//! and the CPU only between memfds sealed with `F_SEAL_SHRINK`, which cannot shrink
//! ([`crate::dma::sys::cannot_shrink`]).
//!
//! A copy between two registrations of a VFIO device with an engine driver is not moved
//! by the kernel at all: the chunk runs on the device's own DMA ([`crate::dma::vfio`]).
//!
//! # Lifetimes
//! A job holds what it touches alive: the pinned mapping of a registration (shared), its
//! own descriptor of a region file, a pidfd. So the engine never touches unmapped memory,
//! whatever happens to the registry. What the registry says still counts: every job has a
//! gate (read-locked around each chunk), and when something a job depends on goes —
//! `Unregister`, `Free`, `Release`, a revocation, a lost device, the issuing session's end
//! — [`CopyEngine::sweep`] write-locks the gate, which waits for the chunk in flight, and
//! marks the job stopped: no byte moves after the operation that ended the dependency has
//! been answered, and the copy completes with `NotFound` and the bytes done.
//!
//! The gate is held around loads and stores of daemon-held memory only, which never wait
//! on a client. A client's own memory is reached under its registration's gate instead
//! ([`crate::dma::ClientGate`]), shut by that registration's undoing and drained last by
//! the operation that undid it: a client that stalls a copy in its own memory (a page
//! whose fault it never serves) holds up its own `Unregister` and no one else's operation.
//! (So bytes a chunk read from daemon memory before an operation was answered may still
//! land in the client's memory after: they were read while the copy was entitled to them,
//! and nothing is read from or written to that operation's memory after the answer.)
//! The engine thread such a stall takes is replaced by a watchdog (`crew.rs`).
//!
//! A chunk of a copy across nodes moves outside the jobs (`crate::peer::copy`: the owner
//! serves a peer's chunk, the importer moves its local end's bytes). It holds the engine's
//! [`CopyEngine::loose_chunk`] gate while it resolves or rechecks what it touches and moves
//! the bytes, and every sweep waits for the chunks under it: the same promise, for them too.

pub(crate) mod bytes;
mod crew;
mod fair;
pub mod fault;
mod regionmap;
mod sys;

pub(crate) use regionmap::RegionMaps;
pub(crate) use sys::Mapping;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;

use fabric_proto::wire::{CopyDone, CopyResult, ErrorCode, ErrorText};

use crate::config::CopyConfig;
use crate::dma::vfio::VfioError;
use crate::dma::vfio::engine::End;
use crate::memory::{Dep, Memory, Side};
use crate::metrics::Metrics;

/// Where a copy's completion goes: the issuing connection, with the `Copy` request's id.
pub type Sink = tokio::sync::mpsc::UnboundedSender<(u64, CopyDone)>;

/// The smallest chunk a copy is split into (smaller copies are one chunk).
pub const MIN_CHUNK: u64 = 256 << 10;
/// Bytes of the per-engine buffer for client-to-client copies.
const BOUNCE: usize = 1 << 20;

/// Why a copy could not be queued.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// The session has `copy.max_in_flight_per_session` copies queued or running.
    #[error("session has {in_flight} copies in flight, the limit (copy.max_in_flight_per_session) is {max}")]
    TooMany {
        /// Copies in flight.
        in_flight: u32,
        /// The limit.
        max: u32,
    },
    /// Queuing the copy's chunks would pass what the engine queues for one uid
    /// ([`MAX_QUEUED_PER_UID`]) or for all ([`MAX_QUEUED`]): each queued chunk is the
    /// daemon's memory, whoever asked.
    #[error("the copy engine has {queued} chunks queued for {whose}; with this copy's {requested} that passes {max}")]
    Queue {
        /// `this uid` or `all uids`.
        whose: &'static str,
        /// Chunks queued now.
        queued: usize,
        /// This copy's chunks.
        requested: usize,
        /// The bound.
        max: usize,
    },
    /// The engine threads could not be started.
    #[error("starting copy engine thread")]
    Spawn(#[source] std::io::Error),
}

/// Most chunks one copy (one part of a batch) is split into: 2,048 ([`chunk_size`]), so a
/// batch of [`fabric_proto::wire::MAX_BATCH`] parts is at most 131,072 chunks.
pub const MAX_PART_CHUNKS: u64 = 2048;
/// Most chunks queued for one uid: 262,144 (8 MiB of queue; two of the largest batches). A
/// copy that would pass it is refused, `LimitExceeded`; one request alone always fits.
pub const MAX_QUEUED_PER_UID: usize = 1 << 18;
/// Most chunks queued for all uids: 1,048,576 (32 MiB of queue).
pub const MAX_QUEUED: usize = 1 << 20;

/// One copy (or batch of copies), queued or running.
struct Job {
    id: u64,
    /// Whose: the issuing connection's uid and session (the queue's turns).
    uid: u32,
    session: u64,
    request_id: u64,
    /// Bytes of all its parts.
    len: u64,
    /// What it moves: one part for a `Copy`, up to 64 for a `CopyBatch`.
    parts: Vec<Part>,
    deps: Vec<Dep>,
    /// `Some(why)` once stopped; read-locked while a chunk moves.
    gate: RwLock<Option<String>>,
    /// Chunks not yet taken to the end.
    left: AtomicUsize,
    /// Bytes of the chunks done.
    done: AtomicU64,
    /// Whether the CPU moved a chunk (sealed memory on both sides), for the log.
    cpu: AtomicBool,
    /// The first chunk failure: code and words.
    failed: Mutex<Option<(ErrorCode, String)>>,
    sink: Sink,
}

impl Job {
    /// Begins an access to daemon-held memory for one of its chunks: its gate read-locked
    /// (a sweep's [`stop`] waits for it), `None` once it is stopped or failed.
    fn enter(&self) -> Option<std::sync::RwLockReadGuard<'_, Option<String>>> {
        let gate = self.gate.read().unwrap_or_else(|p| p.into_inner());
        (gate.is_none() && lock(&self.failed).is_none()).then_some(gate)
    }

    fn fail(&self, code: ErrorCode, why: String) {
        let mut f = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert((code, why));
    }
}

/// One copy of a job: its resolved sides.
struct Part {
    dst: Side,
    src: Side,
    /// Set when the device's DMA engine moves it.
    device: Option<DeviceCopy>,
}

struct Chunk {
    job: Arc<Job>,
    /// Which part.
    part: usize,
    at: u64,
    len: u64,
}

/// What the engine threads share with the request path.
struct Shared {
    queue: Mutex<fair::FairQueue<Chunk>>,
    ready: Condvar,
    stop: AtomicBool,
    /// Jobs by id.
    jobs: Mutex<HashMap<u64, Arc<Job>>>,
    /// Sweeps begun. A copy resolves outside every lock of the engine; a sweep that
    /// begins while it does is seen by the submitter, which rechecks the copy's
    /// dependencies once its job is in the table. Counted before a sweep lists the jobs,
    /// and read under the table's lock, so no copy falls between the two.
    sweeps: AtomicU64,
    /// Jobs in flight per session.
    per_session: Mutex<HashMap<u64, u32>>,
    next_id: AtomicU64,
    metrics: Arc<Metrics>,
    /// Regions' kept destination mappings.
    maps: regionmap::RegionMaps,
    /// Read-held by each chunk moving outside the jobs ([`CopyEngine::loose_chunk`]);
    /// a sweep write-locks it once, which waits for those in flight.
    loose: RwLock<()>,
    /// The engine threads in service ([`crew`]), and the signal of one ending at stop.
    crew: Mutex<crew::Crew>,
    crew_ended: Condvar,
    /// Tests: held, every engine waits before it moves its next chunk.
    #[cfg(test)]
    held: Mutex<()>,
    /// Tests: the next chunk an engine takes panics.
    #[cfg(test)]
    panic_next: AtomicBool,
    /// Tests: held, every access to a client's memory waits in it, as in a page whose
    /// fault the client does not serve.
    #[cfg(test)]
    client_held: Mutex<()>,
}

/// A chunk moving outside the engine's jobs, in flight: a sweep waits for it to drop.
#[derive(Debug)]
#[must_use = "the chunk is in flight while this is held"]
pub struct LooseChunk<'a> {
    _in_flight: std::sync::RwLockReadGuard<'a, ()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The copy engine: its threads, queue and jobs.
pub struct CopyEngine {
    shared: Arc<Shared>,
    config: CopyConfig,
    /// The watchdog of the engine threads ([`crew`]).
    watchdog: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine").field("config", &self.config).field("engines", &crew::size(&self.shared)).finish()
    }
}

/// Copies to queue as one job (a batch; one completion).
#[derive(Debug, Default)]
pub struct NewBatch {
    /// The copies.
    pub copies: Vec<NewCopy>,
}

/// A copy to queue: its resolved sides and what they depend on.
#[derive(Debug)]
pub struct NewCopy {
    /// Destination.
    pub dst: Side,
    /// Source.
    pub src: Side,
    /// Bytes.
    pub len: u64,
    /// What both sides depend on.
    pub deps: Vec<Dep>,
    /// Set when the copy runs on a device's DMA engine rather than by the kernel.
    pub device: Option<DeviceCopy>,
}

/// A copy the device moves: both ends are IOVAs in its VFIO container.
#[derive(Debug, Clone)]
pub struct DeviceCopy {
    /// The device, with its engine.
    pub device: Arc<crate::dma::vfio::VfioDevice>,
    /// The destination's mapping and the IOVA of its byte 0.
    pub dst: End,
    /// The source's mapping and the IOVA of its byte 0.
    pub src: End,
}

/// The chunk size for a copy of `len` bytes on `engines` engines with `max` the largest
/// chunk: an even share per engine, at least [`MIN_CHUNK`], at most `max`, in pages — but
/// large enough that the copy takes at most [`MAX_PART_CHUNKS`] chunks (a copy past
/// `max × MAX_PART_CHUNKS` bytes moves in larger chunks), so that one request always fits
/// what the engine queues for a uid.
pub fn chunk_size(len: u64, engines: u32, max: u64) -> u64 {
    let share = len.div_ceil(u64::from(engines.max(1)));
    let size = share.clamp(MIN_CHUNK, max.max(MIN_CHUNK));
    size.max(len.div_ceil(MAX_PART_CHUNKS)).next_multiple_of(4096)
}

impl CopyEngine {
    /// The regions' kept mappings, shared with the copies across nodes (`bytes.rs`).
    pub(crate) fn region_maps(&self) -> &RegionMaps {
        &self.shared.maps
    }

    /// Holds a chunk that moves outside the jobs (a copy across nodes) in flight: take it
    /// before resolving or rechecking what the chunk touches, keep it until its bytes
    /// have moved. A sweep after an operation that ended what the chunk touches waits for
    /// it, and a chunk that starts after that operation finds it ended.
    pub fn loose_chunk(&self) -> LooseChunk<'_> {
        LooseChunk { _in_flight: self.shared.loose.read().unwrap_or_else(|p| p.into_inner()) }
    }

    /// Starts `config.engines` threads.
    pub fn start(config: CopyConfig, metrics: Arc<Metrics>) -> Result<Self, CopyError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(fair::FairQueue::default()),
            ready: Condvar::new(),
            stop: AtomicBool::new(false),
            jobs: Mutex::new(HashMap::new()),
            sweeps: AtomicU64::new(0),
            per_session: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            metrics,
            maps: regionmap::RegionMaps::default(),
            loose: RwLock::new(()),
            crew: Mutex::new(crew::Crew::default()),
            crew_ended: Condvar::new(),
            #[cfg(test)]
            held: Mutex::new(()),
            #[cfg(test)]
            panic_next: AtomicBool::new(false),
            #[cfg(test)]
            client_held: Mutex::new(()),
        });
        // Built before the threads, so that a failed start stops those it started.
        let mut this = Self { shared: shared.clone(), config: config.clone(), watchdog: None };
        for _ in 0..config.engines {
            crew::hire(&shared, &mut lock(&shared.crew)).map_err(CopyError::Spawn)?;
        }
        let s = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name("copy-watchdog".into())
            .spawn(move || crew::watch(&s))
            .map_err(CopyError::Spawn)?;
        this.watchdog = Some(watchdog);
        // Installed before the first chunk, so that the handler is in place while the
        // daemon is still single-purpose; without it the kernel copies (`chunk.rs`).
        let cpu = fault::ready();
        tracing::info!(
            engines = config.engines,
            chunk_bytes = config.chunk_bytes,
            recovering_cpu_copy = cpu,
            "copy engine started"
        );
        Ok(this)
    }

    /// Resolves and queues a copy of `session` (of `uid`): `resolve` gives the copy or a
    /// refusal, and runs under no lock of the engine (it opens files and takes the
    /// registry's lock). `memory` rechecks what the copy depends on when a sweep ran
    /// while it resolved (see `Shared::sweeps`). Returns the copy id.
    pub fn submit<E>(
        &self,
        uid: u32,
        session: u64,
        request_id: u64,
        sink: Sink,
        memory: &Memory,
        resolve: impl FnOnce() -> Result<NewCopy, E>,
    ) -> Result<Result<u64, E>, CopyError> {
        self.submit_batch(uid, session, request_id, sink, memory, || resolve().map(|c| NewBatch { copies: vec![c] }))
    }

    /// [`CopyEngine::submit`] for a batch: one job, its copies' chunks queued together,
    /// one completion with the bytes of all of them.
    pub fn submit_batch<E>(
        &self,
        uid: u32,
        session: u64,
        request_id: u64,
        sink: Sink,
        memory: &Memory,
        resolve: impl FnOnce() -> Result<NewBatch, E>,
    ) -> Result<Result<u64, E>, CopyError> {
        // The session's place is taken before resolving, so that two of its requests at
        // once cannot both pass the limit; a refusal gives it back.
        let place = SessionPlace::take(&self.shared, session, self.config.max_in_flight_per_session)?;
        let sweeps = self.shared.sweeps.load(Ordering::SeqCst);
        let batch = match resolve() {
            Ok(b) => b,
            Err(e) => return Ok(Err(e)),
        };
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        // Each part is split as a copy of its own would be.
        let mut chunks: Vec<(usize, u64, u64)> = Vec::new();
        let (mut parts, mut deps, mut total) = (Vec::new(), Vec::new(), 0u64);
        for (i, c) in batch.copies.into_iter().enumerate() {
            let size = chunk_size(c.len, self.config.engines, self.config.chunk_bytes);
            let mut at = 0;
            while at < c.len {
                let len = size.min(c.len - at);
                chunks.push((i, at, len));
                at += len;
            }
            total = total.saturating_add(c.len);
            deps.extend(c.deps);
            parts.push(Part { dst: c.dst, src: c.src, device: c.device });
        }
        deps.sort_unstable();
        deps.dedup();
        let n = chunks.len();
        let job = Arc::new(Job {
            id,
            uid,
            session,
            request_id,
            len: total,
            parts,
            deps,
            gate: RwLock::new(None),
            left: AtomicUsize::new(n),
            done: AtomicU64::new(0),
            cpu: AtomicBool::new(false),
            failed: Mutex::new(None),
            sink,
        });
        let swept = {
            let mut jobs = lock(&self.shared.jobs);
            jobs.insert(id, job.clone());
            self.shared.sweeps.load(Ordering::SeqCst) != sweeps
        };
        place.keep();
        // A sweep that began while the copy resolved may have listed the jobs before this
        // one was in: what it swept for is rechecked here, before any chunk is queued. A
        // sweep that begins later finds the job in the table.
        if swept && let Some(why) = memory.copy_deps_gone(&[job.deps.as_slice()]).pop().flatten() {
            // Stopped before any chunk of it is queued: none is, and it ends here.
            stop(&self.shared, &job, why);
            job.left.store(0, Ordering::Release);
            finish(&self.shared, &job);
            return Ok(Ok(id));
        }
        let queued = {
            let mut q = lock(&self.shared.queue);
            // Checked where the chunks go in, so that copies of one uid submitted at once
            // cannot pass the bound together.
            let full = [("this uid", q.len_of(uid), MAX_QUEUED_PER_UID), ("all uids", q.len(), MAX_QUEUED)]
                .into_iter()
                .find(|&(_, queued, max)| queued.saturating_add(n) > max);
            if let Some((whose, queued, max)) = full {
                drop(q);
                // Not queued: out of the table (a sweep that listed it stops nothing of
                // it) and its place given back, with no completion.
                lock(&self.shared.jobs).remove(&id);
                give_back_place(&self.shared, session);
                return Err(CopyError::Queue { whose, queued, requested: n, max });
            }
            // A sweep that listed the job since it went into the table stopped it with
            // none of its chunks queued (it took out none): none is, and it ends here.
            if job.gate.read().unwrap_or_else(|p| p.into_inner()).is_some() {
                drop(q);
                job.left.store(0, Ordering::Release);
                finish(&self.shared, &job);
                return Ok(Ok(id));
            }
            q.extend(uid, session, chunks.into_iter().map(|(part, at, len)| Chunk { job: job.clone(), part, at, len }));
            q.len()
        };
        self.shared.ready.notify_all();
        tracing::debug!(
            copy = id,
            uid,
            session,
            len = total,
            parts = job.parts.len(),
            chunks = n,
            queued,
            "copy queued"
        );
        Ok(Ok(id))
    }

    /// Stops every job that depends on something the registry no longer has (after an
    /// unregister, free, release, revocation or lost device), waiting for their chunks
    /// in flight; returns how many were stopped.
    pub fn sweep(&self, memory: &Memory) -> usize {
        self.sweeper().sweep(memory)
    }

    /// A handle that sweeps this engine's jobs ([`CopyEngine::sweep`]), for the registry's
    /// end hook.
    pub fn sweeper(&self) -> Sweeper {
        Sweeper(self.shared.clone())
    }

    /// Stops every job of `session` (its connection ended), waiting for their chunks in
    /// flight.
    pub fn end_session(&self, session: u64) -> usize {
        let jobs: Vec<Arc<Job>> = lock(&self.shared.jobs).values().filter(|j| j.session == session).cloned().collect();
        stop_all(&self.shared, jobs.iter().map(|j| (j, "the session ended".to_owned())))
    }

    /// Copies queued or running.
    pub fn in_flight(&self) -> usize {
        lock(&self.shared.jobs).len()
    }
}

impl Drop for CopyEngine {
    fn drop(&mut self) {
        // Under the queue's lock: an engine reads the flag and goes to wait in one hold of
        // it, so the wake-up below cannot fall between the two (it did: an engine that had
        // just found the queue empty slept on, and this join never returned).
        {
            let _queue = lock(&self.shared.queue);
            self.shared.stop.store(true, Ordering::Release);
        }
        self.shared.ready.notify_all();
        if let Some(w) = self.watchdog.take() {
            w.thread().unpark();
            let _ = w.join();
        }
        crew::stop(&self.shared);
    }
}

/// Stops the copies that depend on what an operation ended: the registry's end hook holds
/// one (`Memory::on_end`), while the engine holds its threads.
#[derive(Clone)]
pub struct Sweeper(Arc<Shared>);

impl std::fmt::Debug for Sweeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweeper").finish_non_exhaustive()
    }
}

impl Sweeper {
    /// [`CopyEngine::sweep`].
    pub fn sweep(&self, memory: &Memory) -> usize {
        let shared = &self.0;
        shared.sweeps.fetch_add(1, Ordering::SeqCst);
        let jobs: Vec<Arc<Job>> = lock(&shared.jobs).values().cloned().collect();
        wait_for_loose_chunks(shared);
        // Listed after the jobs and the loose chunks: a loose chunk, or a job's last one
        // (that job then listed above), may have mapped a region the operation ended.
        // Before, a mapping made meanwhile was never forgotten by this sweep.
        let regions = shared.maps.regions();
        let region_deps: Vec<[Dep; 1]> = regions.iter().map(|&id| [Dep::Region(id)]).collect();
        // What is gone, for the kept mappings and every job, under one hold of the
        // registry's lock (and none of the engine's): one answer per set, in order.
        let sets: Vec<&[Dep]> =
            region_deps.iter().map(|d| d.as_slice()).chain(jobs.iter().map(|j| j.deps.as_slice())).collect();
        let gone = memory.copy_deps_gone(&sets);
        let (maps_gone, jobs_gone) = gone.split_at(regions.len());
        // A gone region's kept mapping goes too (a chunk still using it holds it).
        let mut unmap: Vec<u64> =
            regions.iter().zip(maps_gone).filter(|(_, why)| why.is_some()).map(|(id, _)| *id).collect();
        let gone: Vec<(&Arc<Job>, String)> =
            jobs.iter().zip(jobs_gone).filter_map(|(job, why)| why.clone().map(|why| (job, why))).collect();
        for (job, _) in &gone {
            unmap.extend(job.deps.iter().filter_map(|d| match d {
                Dep::Region(id) => Some(*id),
                _ => None,
            }));
        }
        let stopped = stop_all(shared, gone);
        // With the stopped jobs' regions: a chunk of one that ran after the kept mappings
        // were listed above may have mapped its region again; with the job stopped (no
        // chunk of it runs), that mapping goes too, rather than hold a freed region's
        // pages until evicted. (A live region among them is mapped again when next
        // copied.)
        shared.maps.forget(unmap);
        stopped
    }
}

/// Waits for the loose chunks in flight (copies across nodes): they resolved or checked
/// what they touch before the operation that sweeps ended it.
fn wait_for_loose_chunks(shared: &Shared) {
    drop(shared.loose.write().unwrap_or_else(|p| p.into_inner()));
}

/// Marks `job` stopped once its chunk in flight (if any) is over, and takes its queued
/// chunks out, so that what its parts hold (pinned pages, region files) goes as soon as
/// that chunk is over, not when the chunks' turns come behind the session's other copies;
/// false if it already was stopped.
fn stop(shared: &Shared, job: &Arc<Job>, why: String) -> bool {
    stop_all(shared, [(job, why)]) == 1
}

/// [`stop`] of each of `jobs`, with one pass over each of their sessions' queued chunks
/// (a session's end stops up to its whole limit of copies, each with chunks queued: one
/// pass each made that quadratic under the queue's lock, which every engine needs).
/// Answers how many it stopped.
fn stop_all<'a>(shared: &Shared, jobs: impl IntoIterator<Item = (&'a Arc<Job>, String)>) -> usize {
    let mut stopped: HashMap<u64, (&Arc<Job>, usize)> = HashMap::new();
    for (job, why) in jobs {
        let mut g = job.gate.write().unwrap_or_else(|p| p.into_inner());
        if g.is_some() {
            continue;
        }
        tracing::info!(copy = job.id, session = job.session, reason = %why, "copy stopped");
        *g = Some(why);
        stopped.insert(job.id, (job, 0));
    }
    let sessions: std::collections::BTreeSet<(u32, u64)> =
        stopped.values().map(|(job, _)| (job.uid, job.session)).collect();
    {
        let mut queue = lock(&shared.queue);
        for (uid, session) in sessions {
            queue.remove(uid, session, |c| match stopped.get_mut(&c.job.id) {
                Some((job, n)) if Arc::ptr_eq(&c.job, job) => {
                    *n += 1;
                    true
                }
                _ => false,
            });
        }
    }
    for (job, removed) in stopped.values() {
        // The last of its chunks, unless one is running (whose engine then ends the job).
        if *removed > 0 && job.left.fetch_sub(*removed, Ordering::AcqRel) == *removed {
            finish(shared, job);
        }
    }
    stopped.len()
}

/// An engine thread's loop, until the engine stops or the watchdog retires it
/// ([`crew`]).
fn engine(s: &Shared, slot: &crew::Slot) {
    let mut bounce = Vec::new();
    loop {
        let chunk = {
            let mut q = lock(&s.queue);
            loop {
                if s.stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(c) = q.pop() {
                    break c;
                }
                q = s.ready.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        // A chunk that panics (a bug) fails its job, not the engine: the job still ends
        // with its completion and gives its session's place back, and the thread goes on
        // serving every other session's chunks.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_chunk(s, slot, &chunk, &mut bounce)));
        if ran.is_err() {
            tracing::error!(
                copy = chunk.job.id,
                part = chunk.part,
                at = chunk.at,
                "a copy chunk panicked; the copy fails"
            );
            chunk.job.fail(
                ErrorCode::Internal,
                "the copy engine failed moving a chunk (a bug: see the daemon's log)".into(),
            );
        }
        if chunk.job.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            finish(s, &chunk.job);
        }
        // Replaced while its chunk stalled: the session goes back in the turns and this
        // thread ends.
        if let Some((uid, session)) = slot.retired() {
            lock(&s.queue).unpark(uid, session);
            s.ready.notify_all();
            return;
        }
    }
}

fn run_chunk(shared: &Shared, slot: &crew::Slot, c: &Chunk, bounce: &mut Vec<u8>) {
    let maps = &shared.maps;
    #[cfg(test)]
    drop(lock(&shared.held));
    #[cfg(test)]
    if shared.panic_next.swap(false, Ordering::AcqRel) {
        panic!("a chunk's bug, injected by a test");
    }
    let job = &c.job;
    let part = &job.parts[c.part];
    let moved = match &part.device {
        // The device's DMA through the IOMMU; the CPU touches no byte.
        Some(d) => {
            let Some(_in) = job.enter() else { return };
            d.device
                .copy(End { iova: d.src.iova + c.at, ..d.src }, End { iova: d.dst.iova + c.at, ..d.dst }, c.len)
                .map_err(|e| {
                    let code = match e {
                        VfioError::Unmapped { .. } => ErrorCode::NotFound,
                        _ => ErrorCode::Internal,
                    };
                    (code, crate::error_chain(&e))
                })
        }
        None => match chunk::copy(&part.dst, &part.src, c.at, c.len, bounce, maps, &holds(shared, slot, c)) {
            Ok(cpu) => {
                if cpu {
                    job.cpu.store(true, Ordering::Relaxed);
                }
                Ok(())
            }
            // Stopped: the copy ends with why, from its gate.
            Err(chunk::ChunkError::Stopped) => return,
            Err(e) => Err((e.code(), crate::error_chain(&e))),
        },
    };
    match moved {
        Ok(()) => {
            job.done.fetch_add(c.len, Ordering::Relaxed);
        }
        Err((code, why)) => {
            tracing::warn!(copy = job.id, part = c.part, at = c.at, len = c.len, error = %why, on_device = part.device.is_some(), "copy chunk failed");
            job.fail(code, why);
        }
    }
}

/// How chunk `c` on the engine of `slot` holds its accesses: the job's gate around daemon
/// memory, the slot's stint (which the watchdog times) around a client's.
fn holds<'a>(
    shared: &'a Shared,
    slot: &'a crew::Slot,
    c: &'a Chunk,
) -> chunk::Holds<impl Fn() -> Option<std::sync::RwLockReadGuard<'a, Option<String>>>, impl Fn() -> crew::Stint<'a>> {
    chunk::Holds {
        enter: move || c.job.enter(),
        visit: move || {
            let stint = slot.stint(c);
            // Tests: a client's memory that does not answer while `client_held` is held.
            #[cfg(test)]
            drop(lock(&shared.client_held));
            #[cfg(not(test))]
            let _ = shared;
            stint
        },
    }
}

/// A session's place among its copies in flight, taken before its copy resolves: given
/// back when dropped, unless kept by a queued job (whose end gives it back).
struct SessionPlace<'a> {
    shared: &'a Shared,
    session: u64,
    kept: bool,
}

impl<'a> SessionPlace<'a> {
    fn take(shared: &'a Shared, session: u64, max: u32) -> Result<Self, CopyError> {
        let mut per = lock(&shared.per_session);
        let in_flight = per.get(&session).copied().unwrap_or(0);
        if in_flight >= max {
            return Err(CopyError::TooMany { in_flight, max });
        }
        per.insert(session, in_flight + 1);
        Ok(Self { shared, session, kept: false })
    }

    fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for SessionPlace<'_> {
    fn drop(&mut self) {
        if !self.kept {
            give_back_place(self.shared, self.session);
        }
    }
}

fn give_back_place(s: &Shared, session: u64) {
    let mut per = lock(&s.per_session);
    if let Some(n) = per.get_mut(&session) {
        *n -= 1;
        if *n == 0 {
            per.remove(&session);
        }
    }
}

fn finish(s: &Shared, job: &Arc<Job>) {
    lock(&s.jobs).remove(&job.id);
    give_back_place(s, job.session);
    let bytes = job.done.load(Ordering::Relaxed);
    let stopped = job.gate.read().unwrap_or_else(|p| p.into_inner()).clone();
    let failed = lock(&job.failed).take();
    let result = match (stopped, failed) {
        // Stopped after its last byte moved: it is done.
        (Some(_), None) if bytes == job.len => CopyResult::Ok,
        (Some(why), _) => CopyResult::Failed { code: ErrorCode::NotFound, message: ErrorText::truncated(&why) },
        (None, Some((code, why))) => CopyResult::Failed { code, message: ErrorText::truncated(&why) },
        (None, None) => CopyResult::Ok,
    };
    let code = match &result {
        CopyResult::Ok => None,
        CopyResult::Failed { code, .. } => Some(*code),
    };
    s.metrics.copy_done(code, bytes);
    let cpu = job.cpu.load(Ordering::Relaxed);
    tracing::debug!(
        copy = job.id,
        uid = job.uid,
        session = job.session,
        len = job.len,
        bytes,
        ok = code.is_none(),
        cpu,
        "copy done"
    );
    // A closed connection has no one to tell.
    let _ = job.sink.send((job.request_id, CopyDone { copy: job.id, result, bytes }));
}

pub(crate) mod chunk;

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy stopped while its chunks wait behind another copy (its session ended; an
    /// unregistration swept it) lets go of what its parts hold at once, and its completion
    /// comes: before, the chunks stayed queued, holding pinned pages or a freed region's
    /// file, until their turn came.
    #[test]
    fn a_stopped_copy_lets_go_of_its_memory_before_its_turn() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_with(dir.path(), CopyConfig { engines: 1, ..CopyConfig::default() });
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let held = lock(&engine.shared.held);
        // The one engine takes session 1's copy and waits; session 2's is queued.
        let first = engine.submit(1, 1, 1, sink.clone(), &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let first = first.unwrap().unwrap();
        while lock(&engine.shared.queue).len() > 0 {
            std::thread::yield_now();
        }
        let copy = file_copy(Vec::new());
        let Side::File { file, .. } = &copy.src else { unreachable!() };
        let file = Arc::downgrade(file);
        let second = engine.submit(1, 2, 2, sink, &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        assert_eq!(engine.end_session(2), 1);
        assert!(file.upgrade().is_none(), "the stopped copy still holds its file");
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!(d.copy, second);
        assert!(matches!(d.result, CopyResult::Failed { code: ErrorCode::NotFound, .. }), "{:?}", d.result);
        drop(held);
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!((d.copy, d.result), (first, CopyResult::Ok));
        assert_eq!(engine.in_flight(), 0);
    }

    #[test]
    fn chunks_share_a_copy_over_the_engines_within_bounds() {
        assert_eq!(chunk_size(1, 2, 4 << 20), MIN_CHUNK);
        assert_eq!(chunk_size(1 << 20, 2, 4 << 20), 512 << 10);
        assert_eq!(chunk_size(64 << 20, 4, 4 << 20), 4 << 20);
        assert_eq!(chunk_size(64 << 20, 1, 64 << 10), MIN_CHUNK);
        assert_eq!(chunk_size((1 << 20) + 1, 1, 8 << 20) % 4096, 0);
        // A copy past 2,048 chunks of the largest moves in larger ones.
        assert_eq!(chunk_size(8 << 30, 2, 4 << 20), 4 << 20);
        assert_eq!(chunk_size(1 << 40, 2, 4 << 20), 512 << 20);
        assert!((1u64 << 40).div_ceil(chunk_size((1 << 40) + 1, 2, 4 << 20)) <= MAX_PART_CHUNKS);
    }

    /// Engines started and dropped at once, many times over: every drop ends every engine
    /// thread. Before, the stop flag was set and the engines woken without the queue's
    /// lock, and an engine that had just found the queue empty could miss the wake-up and
    /// sleep on while the drop waited for it (a test hung this way in CI).
    #[test]
    fn an_engine_dropped_at_once_ends_every_thread() {
        let fabric = fabric_topology::Fabric::build(fabric_topology::Inventory::default()).unwrap();
        let metrics = Arc::new(Metrics::new(&fabric));
        let (done, ended) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for _ in 0..3000 {
                drop(CopyEngine::start(CopyConfig { engines: 4, ..CopyConfig::default() }, metrics.clone()).unwrap());
            }
            done.send(()).unwrap();
        });
        ended.recv_timeout(std::time::Duration::from_secs(120)).expect("a drop waited for an engine that slept on");
    }

    #[test]
    fn a_sweep_waits_for_the_loose_chunks_in_flight_and_not_for_later_ones() {
        let fabric = fabric_topology::Fabric::build(fabric_topology::Inventory::default()).unwrap();
        let engine = CopyEngine::start(CopyConfig::default(), Arc::new(Metrics::new(&fabric))).unwrap();
        let moved = AtomicBool::new(false);
        std::thread::scope(|s| {
            let (taken, wait) = std::sync::mpsc::channel();
            let (engine, moved) = (&engine, &moved);
            s.spawn(move || {
                let _in_flight = engine.loose_chunk();
                taken.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(200));
                moved.store(true, Ordering::Release);
            });
            wait.recv().unwrap();
            wait_for_loose_chunks(&engine.shared);
            assert!(moved.load(Ordering::Acquire), "the sweep returned with a chunk still moving");
        });
        // Nothing in flight: no wait, and a chunk taken afterwards is not blocked.
        wait_for_loose_chunks(&engine.shared);
        drop(engine.loose_chunk());
    }

    /// A copy of `src`, this process's own memory (as a client's process-backed
    /// registration is), into a new temporary file (region `region`: the engine keeps one
    /// mapping per region id); the registration's gate.
    fn client_copy(src: &[u8], region: u64) -> (NewCopy, Arc<crate::dma::ClientGate>) {
        let len = src.len() as u64;
        let file = Arc::new(tempfile::tempfile().unwrap());
        file.set_len(len).unwrap();
        let gate = Arc::new(crate::dma::ClientGate::new());
        let process = crate::transport::peer::Process::this().unwrap();
        let dst = Side::File {
            file,
            offset: 0,
            writable: true,
            region,
            base: 0,
            region_len: src.len() as u64,
            device: false,
        };
        let src = Side::Process { process, addr: src.as_ptr() as u64, gate: gate.clone() };
        (NewCopy { dst, src, len, deps: Vec::new(), device: None }, gate)
    }

    /// The next completion `done` gets within `wait`, if any (a copy that may never end
    /// while the test holds something).
    fn completion_within<T>(
        done: &mut tokio::sync::mpsc::UnboundedReceiver<T>,
        wait: std::time::Duration,
    ) -> Option<T> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match done.try_recv() {
                Ok(got) => return Some(got),
                Err(_) if std::time::Instant::now() > deadline => return None,
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            }
        }
    }

    /// Waits up to 10 s for `what` to hold.
    fn eventually(what: impl Fn() -> bool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !what() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        true
    }

    /// A chunk stalled in a client's memory (here, the test hook `client_held`: as a page
    /// whose fault the client never serves) takes its engine: the watchdog replaces the
    /// engine and parks the session. Another session's copy then completes; the stalled
    /// session's next copy waits; once the client's memory answers, both of its copies
    /// complete and the retired thread ends.
    #[test]
    fn a_chunk_stalled_in_a_clients_memory_gets_its_engine_replaced_and_its_session_parked() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_with(dir.path(), CopyConfig { engines: 1, ..CopyConfig::default() });
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let held = lock(&engine.shared.client_held);
        let (copy, _gate) = client_copy(&data, 101);
        let Side::File { file: out, .. } = &copy.dst else { unreachable!() };
        let out = out.clone();
        let stalled = engine.submit(1, 1, 1, sink.clone(), &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        assert!(eventually(|| crew::retired(&engine.shared) == 1), "the stalled engine was not retired");
        assert_eq!(crew::size(&engine.shared), 1, "a new engine took its place");
        // Another session is served.
        let other = engine.submit(2, 2, 2, sink.clone(), &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let other = other.unwrap().unwrap();
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!((d.copy, d.result), (other, CopyResult::Ok));
        // The stalled session's next copy is parked, not run into the same memory.
        let (copy, _gate2) = client_copy(&data, 102);
        let next = engine.submit(1, 1, 3, sink, &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(done.try_recv().is_err(), "a copy of the parked session ran");
        assert_eq!(lock(&engine.shared.queue).len(), 1);
        drop(held);
        let mut ended: Vec<u64> = (0..2)
            .map(|_| done.blocking_recv().unwrap().1)
            .map(|d| {
                assert_eq!(d.result, CopyResult::Ok);
                d.copy
            })
            .collect();
        ended.sort_unstable();
        assert_eq!(ended, [stalled, next]);
        let mut got = vec![0; 4096];
        std::os::unix::fs::FileExt::read_exact_at(&*out, &mut got, 0).unwrap();
        assert!(got == data, "the stalled copy's bytes did not land");
        assert!(eventually(|| crew::retired(&engine.shared) == 0), "the retired thread did not end");
        assert_eq!(engine.in_flight(), 0);
    }

    /// One uid whose copies stall in its memory on many sessions takes at most its share
    /// of engine replacements (plus the engines running its chunks when it was parked
    /// whole): another uid's copy still completes. Before, it took every replacement
    /// (`MAX_RETIRED`), after which the stalled engines stayed in service and no one's
    /// copy ran.
    #[test]
    fn one_uid_stalling_on_many_sessions_takes_only_its_share_of_replacements() {
        let dir = tempfile::tempdir().unwrap();
        let config = CopyConfig { engines: 64, ..CopyConfig::default() };
        let (engine, memory) = engine_with(dir.path(), config);
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let data = vec![3u8; 4096];
        let held = lock(&engine.shared.client_held);
        // More sessions than every replacement there is, one stalling copy each.
        let sessions = crew::MAX_RETIRED as u64 + 8;
        let mut gates = Vec::new();
        for session in 0..sessions {
            let (copy, gate) = client_copy(&data, 1000 + session);
            gates.push(gate);
            engine.submit(1, 100 + session, session, sink.clone(), &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        }
        assert!(
            eventually(|| crew::retired_of(&engine.shared, 1) >= crew::UID_SHARE),
            "uid 1's stalls were not replaced"
        );
        // Until the replacements stop: every engine uid 1 could take, it took.
        let mut last = (crew::retired_of(&engine.shared, 1), std::time::Instant::now());
        while last.1.elapsed() < 3 * crew::STALL {
            std::thread::sleep(crew::TICK);
            let now = crew::retired_of(&engine.shared, 1);
            if now != last.0 {
                last = (now, std::time::Instant::now());
            }
        }
        let other = engine.submit(2, 2, 2, sink.clone(), &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let other = other.unwrap().unwrap();
        let got = completion_within(&mut done, std::time::Duration::from_secs(5));
        let taken = crew::retired_of(&engine.shared, 1);
        let Some((_, d)) = got else {
            drop(held);
            panic!("another uid's copy did not run: uid 1 holds {taken} retired engines");
        };
        assert_eq!((d.copy, d.result), (other, CopyResult::Ok), "another uid's copy ran");
        assert!(taken <= crew::UID_SHARE + 64, "uid 1 holds {taken} retired engines");
        drop(held);
        for _ in 0..sessions {
            assert_eq!(done.blocking_recv().unwrap().1.result, CopyResult::Ok);
        }
        assert!(eventually(|| crew::retired(&engine.shared) == 0), "the retired threads did not end");
        // Unparked: uid 1 copies again.
        let (copy, _gate) = client_copy(&data, 5000);
        engine.submit(1, 100, 9999, sink, &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        assert_eq!(done.blocking_recv().unwrap().1.result, CopyResult::Ok);
    }

    /// One session stalling on every engine (64) does not park its uid's other sessions:
    /// the uid's share is above what one session can take.
    #[test]
    fn one_session_stalling_on_every_engine_leaves_its_uids_other_sessions_running() {
        let dir = tempfile::tempdir().unwrap();
        let config = CopyConfig { engines: 64, max_in_flight_per_session: 4, chunk_bytes: MIN_CHUNK };
        let (engine, memory) = engine_with(dir.path(), config);
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let data = vec![4u8; 64 * MIN_CHUNK as usize];
        let held = lock(&engine.shared.client_held);
        let (copy, _gate) = client_copy(&data, 7000);
        let stalled = engine.submit(1, 1, 1, sink.clone(), &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        assert!(eventually(|| crew::retired_of(&engine.shared, 1) == 64), "not every engine was retired");
        let other = engine.submit(1, 2, 2, sink.clone(), &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let other = other.unwrap().unwrap();
        let got = completion_within(&mut done, std::time::Duration::from_secs(5));
        drop(held);
        let (_, d) = got.expect("the uid's other session's copy did not run");
        assert_eq!((d.copy, d.result), (other, CopyResult::Ok));
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!((d.copy, d.result), (stalled, CopyResult::Ok));
    }

    /// An engine dropped while a chunk is stalled in a client's memory does not wait for
    /// it past its bounded wait.
    #[test]
    fn an_engine_dropped_with_a_chunk_stalled_in_a_clients_memory_returns() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_with(dir.path(), CopyConfig { engines: 1, ..CopyConfig::default() });
        let (sink, _done) = tokio::sync::mpsc::unbounded_channel();
        let data = vec![5u8; 4096];
        let shared = engine.shared.clone();
        let held = lock(&shared.client_held);
        let (copy, _gate) = client_copy(&data, 101);
        engine.submit(1, 1, 1, sink, &memory, || Ok::<_, ()>(copy)).unwrap().unwrap();
        assert!(eventually(|| lock(&shared.queue).len() == 0), "the engine did not take the chunk");
        let (dropped, wait) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(engine);
            dropped.send(()).unwrap();
        });
        wait.recv_timeout(std::time::Duration::from_secs(10)).expect("the drop waited for a stalled engine");
        drop(held);
    }

    fn engine_and_memory(dir: &std::path::Path) -> (CopyEngine, Memory) {
        engine_with(dir, CopyConfig { max_in_flight_per_session: 1, ..CopyConfig::default() })
    }

    /// An engine run with `config` and an empty registry under `dir`.
    fn engine_with(dir: &std::path::Path, config: CopyConfig) -> (CopyEngine, Memory) {
        let inv = fabric_topology::Inventory::default();
        let fabric = fabric_topology::Fabric::build(inv.clone()).unwrap();
        let engine = CopyEngine::start(config, Arc::new(Metrics::new(&fabric))).unwrap();
        (engine, Memory::open(dir, &inv, crate::config::LimitsConfig::default()).unwrap())
    }

    /// A copy of 4 KiB between two halves of a temporary file, depending on `deps`.
    fn file_copy(deps: Vec<Dep>) -> NewCopy {
        NewCopy { deps, ..halves_copy(4096) }
    }

    /// A copy of `half` bytes between the two halves of a temporary (sparse) file.
    fn halves_copy(half: u64) -> NewCopy {
        let file = Arc::new(tempfile::tempfile().unwrap());
        file.set_len(2 * half).unwrap();
        let side = |offset, writable| Side::File {
            file: file.clone(),
            offset,
            writable,
            region: 0,
            base: 0,
            region_len: 2 * half,
            device: false,
        };
        NewCopy { dst: side(0, true), src: side(half, false), len: half, deps: Vec::new(), device: None }
    }

    /// A loose chunk (a copy across nodes) in flight when a sweep starts, which maps a
    /// region the sweep's operation ended, has that mapping forgotten by the sweep, which
    /// waited for it. Before, the sweep listed the mappings before it waited, and kept it.
    #[test]
    fn a_mapping_a_loose_chunk_makes_while_a_sweep_waits_is_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_and_memory(dir.path());
        let file = tempfile::tempfile().unwrap();
        file.set_len(4096).unwrap();
        let chunk = engine.loose_chunk();
        std::thread::scope(|s| {
            let sweeping = s.spawn(|| engine.sweep(&memory));
            // The sweep is waiting for the chunk (no way to see it but time).
            std::thread::sleep(std::time::Duration::from_millis(100));
            // Region 999 is in no registry: gone.
            drop(engine.region_maps().get(999, &file, 0, 4096, true).unwrap());
            drop(chunk);
            sweeping.join().unwrap();
        });
        assert!(!engine.region_maps().regions().contains(&999), "kept after the sweep");
    }

    #[test]
    fn a_copy_resolving_holds_up_no_sweep_and_a_refused_one_gives_its_place_back() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_and_memory(dir.path());
        let (sink, _done) = tokio::sync::mpsc::unbounded_channel();
        let timeout = std::time::Duration::from_secs(5);
        std::thread::scope(|s| {
            let (engine, memory) = (&engine, &memory);
            let (resolving, wait) = std::sync::mpsc::channel();
            let (release, released) = std::sync::mpsc::channel::<()>();
            let sink2 = sink.clone();
            let copy = s.spawn(move || {
                engine.submit(1, 1, 1, sink2, memory, || {
                    resolving.send(()).unwrap();
                    released.recv().unwrap();
                    Err::<NewCopy, &str>("refused")
                })
            });
            wait.recv().unwrap();
            let (swept, sweep_done) = std::sync::mpsc::channel();
            s.spawn(move || swept.send(engine.sweep(memory)).unwrap());
            assert_eq!(sweep_done.recv_timeout(timeout), Ok(0), "the sweep waited for a copy resolving");
            // The session's one place is taken while its copy resolves.
            let second = engine.submit(1, 1, 2, sink.clone(), memory, || -> Result<NewCopy, &str> { unreachable!() });
            assert!(matches!(second, Err(CopyError::TooMany { in_flight: 1, max: 1 })), "{second:?}");
            release.send(()).unwrap();
            assert!(matches!(copy.join().unwrap(), Ok(Err("refused"))));
        });
        // The refusal gave the place back.
        let third = engine.submit(1, 1, 3, sink, &memory, || Err::<NewCopy, &str>("refused again"));
        assert!(matches!(third, Ok(Err("refused again"))), "{third:?}");
    }

    /// A chunk that panics fails its copy with `Internal`; the completion still comes, the
    /// session's place is given back, and the engine moves the next copy (before, the
    /// thread died with the job: no completion, the place kept, one engine fewer).
    #[test]
    fn a_chunk_that_panics_fails_its_copy_and_the_engine_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) =
            engine_with(dir.path(), CopyConfig { engines: 1, max_in_flight_per_session: 1, ..CopyConfig::default() });
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        engine.shared.panic_next.store(true, Ordering::Release);
        let first = engine.submit(1, 1, 1, sink.clone(), &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let first = first.unwrap().unwrap();
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!(d.copy, first);
        assert!(matches!(d.result, CopyResult::Failed { code: ErrorCode::Internal, .. }), "{:?}", d.result);
        // The session's one place is back, and the one engine thread still runs.
        let second = engine.submit(1, 1, 2, sink, &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let second = second.unwrap().unwrap();
        let (_, d) = done.blocking_recv().unwrap();
        assert_eq!((d.copy, d.result, d.bytes), (second, CopyResult::Ok, 4096));
    }

    /// A copy whose chunks would pass what the engine queues for one uid is refused,
    /// typed, before any chunk is queued, and gives its session's place back: before, a
    /// client's batches of huge copies queued chunk records without bound (about 64 MiB of
    /// the daemon's memory per request of 64 parts of 128 GiB). The largest request
    /// alone always fits: here two of them fill the uid's share and a third is refused.
    #[test]
    fn a_copy_past_the_queue_bound_is_refused_and_gives_its_place_back() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) =
            engine_with(dir.path(), CopyConfig { engines: 1, max_in_flight_per_session: 2, chunk_bytes: MIN_CHUNK });
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        // The largest batch: 64 parts of 2,048 chunks each (sparse: nothing is moved).
        let batch = || {
            let copies = (0..fabric_proto::wire::MAX_BATCH).map(|_| halves_copy(MAX_PART_CHUNKS * MIN_CHUNK));
            Ok::<_, ()>(NewBatch { copies: copies.collect() })
        };
        let held = lock(&engine.shared.held);
        let first = engine.submit_batch(1, 1, 1, sink.clone(), &memory, batch).unwrap().unwrap();
        let second = engine.submit_batch(1, 1, 2, sink.clone(), &memory, batch).unwrap().unwrap();
        match engine.submit_batch(1, 2, 3, sink.clone(), &memory, batch) {
            Err(e @ CopyError::Queue { whose: "this uid", requested, max: MAX_QUEUED_PER_UID, .. }) => {
                assert_eq!(requested, 64 * MAX_PART_CHUNKS as usize);
                let body = crate::ops::dispatch::errors::copy(&e);
                assert_eq!(body.code, ErrorCode::LimitExceeded, "{body:?}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert_eq!(engine.in_flight(), 2, "nothing of the refused one is in flight");
        // Session 2's place is back; another uid has its own share.
        let small = engine.submit(2, 2, 4, sink, &memory, || Ok::<_, ()>(file_copy(Vec::new())));
        let small = small.unwrap().unwrap();
        assert_eq!(engine.end_session(1), 2);
        drop(held);
        let mut ended: Vec<u64> = (0..3).map(|_| done.blocking_recv().unwrap().1.copy).collect();
        ended.sort_unstable();
        assert_eq!(ended, [first, second, small]);
    }

    /// A session's end stops all its copies with their chunks queued, in one pass over
    /// its queue: each ends once, `NotFound`, with its place given back, and another
    /// session's queued chunks stay and run.
    #[test]
    fn a_sessions_end_stops_every_copy_of_it_once_and_leaves_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let config = CopyConfig { engines: 1, max_in_flight_per_session: 64, chunk_bytes: MIN_CHUNK };
        let (engine, memory) = engine_with(dir.path(), config);
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let held = lock(&engine.shared.held);
        let copy = || Ok::<_, ()>(halves_copy(8 * MIN_CHUNK));
        let mine: std::collections::BTreeSet<u64> =
            (0..64).map(|i| engine.submit(1, 1, i, sink.clone(), &memory, copy).unwrap().unwrap()).collect();
        let other = engine.submit(1, 2, 99, sink.clone(), &memory, copy).unwrap().unwrap();
        assert_eq!(engine.end_session(1), 64);
        assert_eq!(engine.end_session(1), 0, "stopped once");
        let mut ended = std::collections::BTreeSet::new();
        // All but the one whose chunk the held engine took end at once.
        for _ in 0..63 {
            let (_, d) = done.blocking_recv().unwrap();
            assert!(matches!(d.result, CopyResult::Failed { code: ErrorCode::NotFound, .. }), "{:?}", d.result);
            assert!(ended.insert(d.copy), "ended twice");
        }
        drop(held);
        let mut rest = Vec::new();
        for _ in 0..2 {
            rest.push(done.blocking_recv().unwrap().1);
        }
        let theirs = rest.iter().find(|d| d.copy == other).expect("the other session's copy ended");
        assert_eq!(theirs.result, CopyResult::Ok);
        ended.extend(rest.iter().map(|d| d.copy).filter(|c| *c != other));
        assert_eq!(ended, mine);
        assert!(eventually(|| engine.in_flight() == 0));
        assert!(done.try_recv().is_err(), "nothing ends twice");
    }

    #[test]
    fn a_sweep_while_a_copy_resolves_stops_it_if_what_it_needs_went() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, memory) = engine_and_memory(dir.path());
        let (sink, mut done) = tokio::sync::mpsc::unbounded_channel();
        let id = std::thread::scope(|s| {
            let (engine, memory) = (&engine, &memory);
            let (resolving, wait) = std::sync::mpsc::channel();
            let (release, released) = std::sync::mpsc::channel::<()>();
            let copy = s.spawn(move || {
                engine.submit(1, 1, 7, sink, memory, || {
                    resolving.send(()).unwrap();
                    released.recv().unwrap();
                    // Resolved before the unregistration the sweep below follows.
                    Ok::<_, ()>(file_copy(vec![Dep::Registration(5)]))
                })
            });
            wait.recv().unwrap();
            // Registration 5 is not in the registry: the sweep of its end, while the copy
            // resolves, lists no job.
            assert_eq!(engine.sweep(memory), 0);
            release.send(()).unwrap();
            copy.join().unwrap().unwrap().unwrap()
        });
        let (request, copy_done) = done.blocking_recv().unwrap();
        assert_eq!((request, copy_done.copy, copy_done.bytes), (7, id, 0));
        match copy_done.result {
            CopyResult::Failed { code: ErrorCode::NotFound, message } => {
                assert!(message.as_str().contains("registration 5 was unregistered"), "{message:?}");
            }
            other => panic!("the copy ran after what it needs went: {other:?}"),
        }
    }
}
