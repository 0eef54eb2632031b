//! The engine threads as a crew: started, watched for a chunk stalled in a client's own
//! memory (then replaced), and ended with the engine.
//!
//! Reaching a client's memory (`process_vm_readv`/`writev`) can block for as long as the
//! client likes: a page whose fault it never serves (userfaultfd, a FUSE file mapped
//! there). No lock of anyone else's is held then (`chunk.rs`, [`crate::dma::ClientGate`]),
//! but the engine thread itself is taken. So a watchdog looks at the crew every
//! [`TICK`]: an engine in one chunk of a client's memory for longer than [`STALL`] is
//! *retired* — a new thread takes its place, and its session is parked in the queue, so
//! that no other engine is taken by the same memory. The retired thread ends once its
//! chunk does (the session is then unparked). The threads a stalling client holds are at
//! most `copy.engines` per session (the chunks already running when it was parked); a uid
//! whose stalls took [`UID_SHARE`] replacements has all its sessions parked until every
//! one of its retired threads returned, so one uid holds at most `UID_SHARE +
//! copy.engines` of them whatever its sessions; and at most [`MAX_RETIRED`] are retired
//! in all: past that, stalled engines are left in service.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Chunk, Shared, engine, lock};

/// How often the watchdog looks.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// How long one chunk may stay in a client's memory before its engine is replaced. A
/// chunk is at most `copy.chunk_bytes` (4 MiB by default): milliseconds at memory speed.
pub(super) const STALL: Duration = Duration::from_millis(500);
/// How long the engine's drop waits for its threads before leaving the stalled ones.
const STOP_WAIT: Duration = Duration::from_secs(2);
/// Most retired threads still in a client's memory: past it, a stalled engine is not
/// replaced (every session's copies then share the engines left).
pub(super) const MAX_RETIRED: usize = 256;
/// Replacements one uid's stalls may take before all its sessions are parked: so that
/// one uid (up to `clients_per_uid` sessions) cannot use up [`MAX_RETIRED`] and leave
/// every other user's copies to stalled engines. Above what one session can take (its
/// chunks running when it was parked: at most `copy.engines`, at most 64), so that one
/// stalling process never parks its uid's other sessions; it takes two or more.
pub(super) const UID_SHARE: usize = 96;
/// How often the watchdog says it could not replace a stalled engine.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// One engine thread as the watchdog sees it.
#[derive(Debug, Default)]
pub(super) struct Slot(Mutex<SlotState>);

#[derive(Debug, Default)]
struct SlotState {
    /// The chunk of a client's memory in flight: since when, whose session.
    stint: Option<(Instant, u32, u64)>,
    /// Retired by the watchdog, and the session it parked (uid, session).
    retired: Option<(u32, u64)>,
}

/// An access to a client's memory in flight on an engine ([`Slot::stint`]).
pub(super) struct Stint<'a> {
    slot: &'a Slot,
}

impl Slot {
    /// Marks an access to the memory of a client of `chunk`'s session in flight, until
    /// the stint drops.
    pub(super) fn stint(&self, chunk: &Chunk) -> Stint<'_> {
        lock(&self.0).stint = Some((Instant::now(), chunk.job.uid, chunk.job.session));
        Stint { slot: self }
    }

    /// After a chunk: the session to unpark when the watchdog retired this engine (which
    /// then ends).
    pub(super) fn retired(&self) -> Option<(u32, u64)> {
        lock(&self.0).retired
    }
}

impl Drop for Stint<'_> {
    fn drop(&mut self) {
        lock(&self.slot.0).stint = None;
    }
}

/// The engine threads in service (retired ones have left it).
#[derive(Debug, Default)]
pub(super) struct Crew {
    members: Vec<(Arc<Slot>, JoinHandle<()>)>,
    /// Threads started, for their names.
    started: u32,
    /// Members that have ended (after the engine's stop), for [`stop`] to wait on.
    ended: usize,
    /// Retired threads not ended yet (still in a client's memory).
    retired: usize,
    /// Of those, by the uid whose memory holds them.
    retired_of: std::collections::HashMap<u32, usize>,
    /// Uids parked whole for taking their share ([`UID_SHARE`]).
    parked_uids: std::collections::HashSet<u32>,
    /// When the watchdog last said it could not replace a stalled engine.
    warned: Option<Instant>,
}

impl Crew {
    /// A thread retired from `uid`'s memory returned: whether that uid, parked whole,
    /// holds none any more (then it is unparked).
    fn returned(&mut self, uid: u32) -> bool {
        self.retired -= 1;
        let left = self.retired_of.get_mut(&uid).map_or(0, |n| {
            *n -= 1;
            *n
        });
        if left == 0 {
            self.retired_of.remove(&uid);
            return self.parked_uids.remove(&uid);
        }
        false
    }

    /// Says, at most every [`WARN_EVERY`], that a stalled engine stays in service.
    fn cannot_replace(&mut self, why: &str) {
        if self.warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            self.warned = Some(Instant::now());
            tracing::warn!(
                retired = self.retired,
                reason = why,
                "a copy engine is stalled in a client's memory and is not replaced"
            );
        }
    }
}

/// Starts one engine thread and adds it to the crew.
pub(super) fn hire(shared: &Arc<Shared>, crew: &mut Crew) -> std::io::Result<()> {
    let slot = Arc::new(Slot::default());
    let (s, me) = (shared.clone(), slot.clone());
    let thread = std::thread::Builder::new().name(format!("copy-engine-{}", crew.started)).spawn(move || {
        engine(&s, &me);
        // A retired thread has left the crew: nobody waits for it.
        let mut crew = lock(&s.crew);
        if let Some((uid, _)) = me.retired() {
            if crew.returned(uid) {
                lock(&s.queue).unpark_uid(uid);
                s.ready.notify_all();
                tracing::info!(uid, "every copy engine stalled in a uid's memory returned: its copies go on");
            }
        } else {
            crew.ended += 1;
            s.crew_ended.notify_all();
        }
    })?;
    crew.started += 1;
    crew.members.push((slot, thread));
    Ok(())
}

/// Engine threads in service.
pub(super) fn size(shared: &Shared) -> usize {
    lock(&shared.crew).members.len()
}

/// Retired threads still in a client's memory.
#[cfg(test)]
pub(super) fn retired(shared: &Shared) -> usize {
    lock(&shared.crew).retired
}

/// Retired threads still in `uid`'s memory.
#[cfg(test)]
pub(super) fn retired_of(shared: &Shared, uid: u32) -> usize {
    lock(&shared.crew).retired_of.get(&uid).copied().unwrap_or(0)
}

/// The watchdog's loop, until the engine stops.
pub(super) fn watch(shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::Acquire) {
        std::thread::park_timeout(TICK);
        let mut crew = lock(&shared.crew);
        let mut i = 0;
        while i < crew.members.len() {
            if retire(shared, &mut crew, i) { continue } else { i += 1 }
        }
    }
}

/// Retires member `i` if its chunk stalled in a client's memory: a new engine first, then
/// the member's session parked and the member out of the crew (its thread left to end on
/// its own). Whether it did.
fn retire(shared: &Arc<Shared>, crew: &mut Crew, i: usize) -> bool {
    let slot = crew.members[i].0.clone();
    let mut st = lock(&slot.0);
    let Some((since, uid, session)) = st.stint else { return false };
    if st.retired.is_some() || since.elapsed() < STALL {
        return false;
    }
    if crew.retired >= MAX_RETIRED {
        crew.cannot_replace("too many engines already retired, stalled");
        return false;
    }
    if let Err(e) = hire(shared, crew) {
        crew.cannot_replace(&format!("no thread could be started: {e}"));
        return false;
    }
    crew.retired += 1;
    let of_uid = crew.retired_of.entry(uid).or_default();
    *of_uid += 1;
    let of_uid = *of_uid;
    st.retired = Some((uid, session));
    let mut queue = lock(&shared.queue);
    queue.park(uid, session);
    if of_uid >= UID_SHARE && crew.parked_uids.insert(uid) {
        queue.park_uid(uid);
        tracing::warn!(
            uid,
            retired = of_uid,
            "copies stalled in one uid's memory took its share of engine replacements: all its copies wait until they return"
        );
    }
    drop(queue);
    drop(st);
    crew.members.swap_remove(i);
    shared.metrics.copy_engine_stalled();
    tracing::warn!(
        uid,
        session,
        stalled_ms = since.elapsed().as_millis() as u64,
        "a copy chunk is stalled in the client's own memory (a fault it does not serve?): its engine is replaced, and the session's copies wait until it returns"
    );
    true
}

/// Ends the crew: waits up to [`STOP_WAIT`] for its threads (the engine's stop flag set
/// and the engines woken), joins those that ended and leaves any still in a client's
/// memory.
pub(super) fn stop(shared: &Shared) {
    let crew = lock(&shared.crew);
    let n = crew.members.len();
    let (mut crew, _) =
        shared.crew_ended.wait_timeout_while(crew, STOP_WAIT, |c| c.ended < n).unwrap_or_else(|p| p.into_inner());
    let members = std::mem::take(&mut crew.members);
    drop(crew);
    for (_, t) in members {
        if t.is_finished() {
            let _ = t.join();
        } else {
            tracing::warn!("a copy engine thread is still in a client's memory at stop; left to end on its own");
        }
    }
}
