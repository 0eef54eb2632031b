//! Copies across nodes (class NET; `docs/domain.md`, "Copy across nodes"): a client's
//! `Copy` (or a `CopyBatch` of such copies, moved in parallel with one completion) between a registration or a GFA on this node (a region of its session or one it
//! imported from this node) and a GFA of another node's region it imported is moved over the node link, chunk by chunk ([`CopyAsk`], at most
//! [`PEER_DATA_CHUNK`] bytes, [`LANES`] chunks in flight per job: memory is bounded by
//! them), on the peer's data lanes so that control requests never wait behind it. Push writes to
//! the owner, pull reads from it; the completion is the usual `CopyDone`. Such a copy is
//! authorized by the one dispatch as a copy on this node is (`ops::dispatch`, [`route`]
//! called from its `Copy` arm): scope required, its local end within the caller's
//! partitions. The owner
//! ([`serve`]) checks every chunk against the import it names: held by the asking node's
//! current incarnation, not released nor revoked, the range inside the region, write
//! access for a push. A chunk refused, a link that drops or an owner that dies ends the
//! copy with the error and the bytes done, never a hang (every wait has the link's
//! deadlines).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError, Weak};

use fabric_nodelink::{PeerError, PeerOp, PeerResponse};
use fabric_proto::wire::{
    CopyDone, CopyEndpoint, CopyRequest, CopyResponse, CopyResult, ErrorBody, ErrorCode, ErrorText, PEER_DATA_CHUNK,
    Response,
};

use super::DialError;
use super::importer::RemoteReach;
use super::wire::CopyAsk;
use crate::copy::{Sink, bytes};
use crate::daemon::Daemon;
use crate::memory::{Dep, Resolved, Side};
use crate::ops::copyops;
use crate::ops::dispatch::errors::{memory as refused, refusal};
use crate::ops::dispatch::{Context, Outcome};

/// The bit that marks a copy id as a copy across nodes (the engine's ids count up from 1).
pub const REMOTE_COPY: u64 = 1 << 62;

/// Copies across nodes in flight at once on this node (each holds one chunk's buffer).
pub const MAX_IN_FLIGHT: usize = 64;

/// Copies across nodes one uid may have in flight at once (over all its connections): a
/// quarter of the node's, so that one user's long copies cannot refuse every other's.
pub const MAX_IN_FLIGHT_PER_UID: usize = MAX_IN_FLIGHT / 4;

/// This node's copies to and from other nodes.
#[derive(Debug, Default)]
pub struct Copies {
    next: AtomicU64,
    in_flight: Mutex<InFlight>,
}

/// Copies across nodes in flight: on the node, and by uid.
#[derive(Debug, Default)]
struct InFlight {
    all: usize,
    by_uid: std::collections::HashMap<u32, usize>,
}

impl Copies {
    fn in_flight(&self) -> std::sync::MutexGuard<'_, InFlight> {
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One more copy of `uid` in flight, unless the node or the uid is at its bound
    /// ([`MAX_IN_FLIGHT`], [`MAX_IN_FLIGHT_PER_UID`]).
    fn take(&self, uid: u32) -> Result<(), ErrorBody> {
        let mut f = self.in_flight();
        if f.all >= MAX_IN_FLIGHT {
            return Err(refusal(
                ErrorCode::LimitExceeded,
                format!("{MAX_IN_FLIGHT} copies across nodes are in flight on this node; wait for one to complete"),
            ));
        }
        let mine = f.by_uid.entry(uid).or_default();
        if *mine >= MAX_IN_FLIGHT_PER_UID {
            return Err(refusal(
                ErrorCode::LimitExceeded,
                format!(
                    "uid {uid} has {MAX_IN_FLIGHT_PER_UID} copies across nodes in flight; wait for one to complete"
                ),
            ));
        }
        *mine += 1;
        f.all += 1;
        Ok(())
    }

    /// A copy of `uid` ended.
    fn give_back(&self, uid: u32) {
        let mut f = self.in_flight();
        f.all = f.all.saturating_sub(1);
        if let Some(n) = f.by_uid.get_mut(&uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                f.by_uid.remove(&uid);
            }
        }
    }
}

/// One copy across nodes (or a batch of them), running: its parts' chunks on [`LANES`]
/// lanes, one completion.
struct Job {
    id: u64,
    /// The uid that asked (its copies in flight are counted).
    uid: u32,
    request_id: u64,
    sink: Sink,
    parts: Vec<Part>,
}

/// One copy of a job: between a local end and a GFA of another node's region.
struct Part {
    /// The local import (this node's id) and where it reaches.
    import: u64,
    reach: RemoteReach,
    /// The first GFA of the copy on the owner.
    gfa: u64,
    len: u64,
    /// Push: local to remote.
    push: bool,
    local: Resolved,
}

/// A part as the client asked it, before its local end is resolved.
struct Asked {
    push: bool,
    gfa: u64,
    import: u64,
    reach: RemoteReach,
    local: CopyEndpoint,
    len: u64,
}

/// Which end of `c` is another node's memory this session imported: `None` when neither.
fn remote_end(importer: &super::importer::Importer, session: u64, c: &CopyRequest) -> Result<Option<Asked>, ErrorBody> {
    let remote = |ep| match ep {
        CopyEndpoint::Gfa(g) => importer.reach(session, g).map(|r| (g, r)),
        CopyEndpoint::Registration { .. } => None,
    };
    let (push, (gfa, (import, reach)), local) = match (remote(c.dst), remote(c.src)) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => {
            return Err(refusal(
                ErrorCode::NotImplemented,
                "both ends of the copy are other nodes' memory: copy through a registration on this node",
            ));
        }
        (Some(r), None) => (true, r, c.src),
        (None, Some(r)) => (false, r, c.dst),
    };
    Ok(Some(Asked { push, gfa, import, reach, local, len: c.len }))
}

/// Answers a client's `Copy`, or `CopyBatch`, authorized by the one dispatch (`issuer`),
/// whose copies each have one end in another node's region this session imported: one
/// job, its copies in parallel on its lanes, one completion. `None`: every copy is this
/// node's own. A batch that mixes such copies with copies on this node is refused: the
/// engine and the node link complete apart.
pub fn route(
    d: &Daemon,
    cx: &Context<'_>,
    issuer: &copyops::Copies<'_>,
    copies: &[CopyRequest],
    batch: bool,
) -> Option<Result<Outcome, ErrorBody>> {
    let link = d.domain.as_ref()?.link()?;
    let importer = link.service().importer();
    let mut parts = Vec::with_capacity(copies.len());
    let mut local = None;
    for (i, c) in copies.iter().enumerate() {
        match remote_end(importer, issuer.session, c) {
            Ok(Some(a)) => parts.push(a),
            Ok(None) => local = local.or(Some(i)),
            Err(mut e) => {
                if batch {
                    e.message = ErrorText::truncated(&format!("copy {i} of the batch: {}", e.message));
                }
                return Some(Err(e));
            }
        }
    }
    match (parts.is_empty(), local) {
        (true, _) => None,
        (false, None) => Some(start(d, cx, issuer, parts, batch)),
        (false, Some(i)) => Some(Err(refusal(
            ErrorCode::NotImplemented,
            format!(
                "copy {i} of the batch is on this node, others reach other nodes' memory: submit the copies across nodes as a batch of their own"
            ),
        ))),
    }
}

/// Checks one part as far as this node knows it and resolves its local end, which the
/// issuer's partitions must reach as for a copy on this node.
fn part(d: &Daemon, issuer: &copyops::Copies<'_>, a: Asked) -> Result<Part, ErrorBody> {
    let Asked { push, gfa, import, reach, local, len } = a;
    if len == 0 {
        return Err(refusal(ErrorCode::BadRequest, "a copy needs at least one byte"));
    }
    let end = reach.gfa.saturating_add(reach.len);
    if gfa.checked_add(len).is_none_or(|e| e > end) {
        return Err(refusal(
            ErrorCode::BadRequest,
            format!(
                "{len} bytes at GFA {gfa:#x} run past node {}'s region ({:#x}+{})",
                reach.owner, reach.gfa, reach.len
            ),
        ));
    }
    if push && !reach.writable {
        return Err(refusal(
            ErrorCode::PermissionDenied,
            format!("import {import} of node {}'s region is read-only: it cannot be a copy's destination", reach.owner),
        ));
    }
    let local =
        d.memory.copy_endpoint(issuer.session, &d.map_snapshot(), local, len, !push).map_err(|e| refused(&e))?;
    issuer.reaches(&local)?;
    Ok(Part { import, reach, gfa, len, push, local })
}

fn start(
    d: &Daemon,
    cx: &Context<'_>,
    issuer: &copyops::Copies<'_>,
    asked: Vec<Asked>,
    batch: bool,
) -> Result<Outcome, ErrorBody> {
    let sink = cx.copies.ok_or_else(|| refusal(ErrorCode::BadRequest, "a copy needs a connection"))?.clone();
    let many = asked.len() > 1;
    let mut parts = Vec::with_capacity(asked.len());
    for (i, a) in asked.into_iter().enumerate() {
        parts.push(part(d, issuer, a).map_err(|mut e| {
            if many {
                e.message = ErrorText::truncated(&format!("copy {i} of the batch: {}", e.message));
            }
            e
        })?);
    }
    let (Some(domain), Some(link)) = (d.domain.as_ref(), d.domain.as_ref().and_then(|x| x.link())) else {
        return Err(refusal(ErrorCode::WrongNode, "this node has no node link"));
    };
    let copies = link.service().copies();
    let uid = cx.client.principal.uid();
    copies.take(uid)?;
    let id = REMOTE_COPY | (copies.next.fetch_add(1, Ordering::Relaxed) + 1);
    let job = Job { id, uid, request_id: cx.request_id, sink, parts };
    tracing::debug!(copy = id, parts = job.parts.len(), "copy across nodes started");
    let Some(weak) = link.service().daemon() else {
        copies.give_back(uid);
        return Err(refusal(ErrorCode::Unavailable, "the node link is starting"));
    };
    domain.runtime().spawn(run(weak, job));
    let response = CopyResponse { copy: id };
    let response = if batch { Response::CopyBatch(response) } else { Response::Copy(response) };
    Ok(Outcome { response, fd: None, events: None })
}

/// Why a copy stopped: a code and words.
type Stop = (ErrorCode, String);

async fn run(d: Weak<Daemon>, job: Job) {
    let (moved, stop, cursor) = (AtomicU64::new(0), AtomicBool::new(false), Mutex::new(Cursor::default()));
    let (a, b) = tokio::join!(lane(&d, &job, 0, &cursor, &moved, &stop), lane(&d, &job, 1, &cursor, &moved, &stop));
    // A failure ends the job: the other lane stops at its next chunk (when both failed,
    // lane 0's is told).
    let end = a.and(b);
    let done = moved.load(Ordering::Acquire);
    let result = match &end {
        Ok(()) => CopyResult::Ok,
        Err((code, why)) => CopyResult::Failed { code: *code, message: ErrorText::truncated(why) },
    };
    match &end {
        Ok(()) => tracing::debug!(copy = job.id, bytes = done, "copy across nodes done"),
        Err((code, why)) => tracing::info!(copy = job.id, bytes = done, ?code, why, "copy across nodes stopped"),
    }
    // A closed connection has no one to tell.
    let _ = job.sink.send((job.request_id, CopyDone { copy: job.id, result, bytes: done }));
    if let Some(d) = d.upgrade()
        && let Some(link) = d.domain.as_ref().and_then(|x| x.link())
    {
        link.service().copies().give_back(job.uid);
    }
}

/// Chunks of one job in flight at once, each on a data lane of its own: while the owner
/// takes one, the next is read and encrypted here (a job drives this many).
pub const LANES: u64 = 2;

/// The next chunk of a job to move: its parts' chunks in order, whichever lane asks.
#[derive(Debug, Default)]
struct Cursor {
    part: usize,
    at: u64,
}

impl Cursor {
    /// The next chunk, `(part, offset in it, bytes)`, or `None` when every one was taken.
    fn take(&mut self, parts: &[Part]) -> Option<(usize, u64, u64)> {
        let chunk = u64::from(PEER_DATA_CHUNK);
        while let Some(p) = parts.get(self.part) {
            if self.at < p.len {
                let n = (p.len - self.at).min(chunk);
                let next = (self.part, self.at, n);
                self.at += n;
                return Some(next);
            }
            self.part += 1;
            self.at = 0;
        }
        None
    }
}

/// Lane `lane` of a job: takes the job's next chunk, of whichever part, until none is left
/// — so a batch of copies smaller than a chunk keeps every lane busy, and its copies move
/// in parallel — counting the bytes moved (whole chunks, not a prefix); the first failure
/// stops every lane at its next chunk.
async fn lane(
    d: &Weak<Daemon>,
    job: &Job,
    lane: u64,
    cursor: &Mutex<Cursor>,
    moved: &AtomicU64,
    stop: &AtomicBool,
) -> Result<(), Stop> {
    let mut buf = Vec::new();
    while !stop.load(Ordering::Acquire) {
        let next = cursor.lock().unwrap_or_else(PoisonError::into_inner).take(&job.parts);
        let Some((i, at, n)) = next else { break };
        if let Err((code, mut why)) = move_chunk(d, job, &job.parts[i], lane, at, n, &mut buf).await {
            stop.store(true, Ordering::Release);
            if job.parts.len() > 1 {
                why = format!("copy {i} of the batch: {why}");
            }
            return Err((code, why));
        }
        moved.fetch_add(n, Ordering::AcqRel);
    }
    Ok(())
}

/// Moves `n` bytes at offset `at` of the copy on lane `lane`.
async fn move_chunk(
    d: &Weak<Daemon>,
    job: &Job,
    part: &Part,
    lane: u64,
    at: u64,
    n: u64,
    buf: &mut Vec<u8>,
) -> Result<(), Stop> {
    let gone = || (ErrorCode::Unavailable, "the daemon is stopping".to_owned());
    let d = d.upgrade().ok_or_else(gone)?;
    let (Some(domain), Some(link)) = (d.domain.as_ref(), d.domain.as_ref().and_then(|x| x.link())) else {
        return Err(gone());
    };
    // What the copy depends on on this side: the session, the import, the local end.
    if job.sink.is_closed() {
        return Err((ErrorCode::NotFound, "the session ended".into()));
    }
    if !link.service().importer().holds(part.import) {
        return Err((ErrorCode::NotFound, format!("import {} ended", part.import)));
    }
    local_end_gone(&d, &part.local.deps)?;
    let ask = CopyAsk { import: part.reach.owner_import, gfa: part.gfa + at, len: n as u32, write: part.push };
    let owner = part.reach.owner.as_str();
    let failed = |e: DialError| match e {
        DialError::Peer { source: PeerError::Denied { code, message }, .. } => {
            (code, format!("node {owner}: {message}"))
        }
        e => (ErrorCode::Unavailable, format!("node {owner}: {}", crate::error_chain(&e))),
    };
    let local = |e: crate::copy::chunk::ChunkError| (e.code(), crate::error_chain(&e));
    // The local end's bytes move on a blocking thread, off the domain runtime's worker.
    // The local end is checked again with the chunk in flight (the sweep of an operation
    // that ends it waits for that), so no byte lands in memory freed meanwhile. A client's
    // own memory is in flight under its registration's gate instead (`bytes`): a client
    // that stalls it holds up its own unregister, not every operation's sweep.
    let (side, daemon, deps) = (part.local.side.clone(), d.clone(), part.local.deps.clone());
    let joined = |e: tokio::task::JoinError| (ErrorCode::Internal, format!("the copy's task failed: {e}"));
    if part.push {
        let mut chunk = std::mem::take(buf);
        chunk.resize(n as usize, 0);
        let read = tokio::task::spawn_blocking(move || {
            let _in_flight = loose_unless_client(&daemon, &side);
            local_end_gone(&daemon, &deps)?;
            bytes::read(&side, at, &mut chunk, daemon.copies.region_maps()).map_err(local).map(|()| chunk)
        });
        let chunk = read.await.map_err(joined)??;
        link.call_data(domain, owner, part.reach.owner_incarnation, lane, ask.request(&chunk)).await.map_err(failed)?;
        *buf = chunk;
    } else {
        let r = link
            .call_data(domain, owner, part.reach.owner_incarnation, lane, ask.request(&[]))
            .await
            .map_err(failed)?;
        if r.body.len() as u64 != n {
            return Err((ErrorCode::Internal, format!("node {owner} answered {} bytes for {n}", r.body.len())));
        }
        tokio::task::spawn_blocking(move || {
            let _in_flight = loose_unless_client(&daemon, &side);
            local_end_gone(&daemon, &deps)?;
            bytes::write(&side, at, &r.body, daemon.copies.region_maps()).map_err(local)
        })
        .await
        .map_err(joined)??;
    }
    Ok(())
}

/// The local end's chunk in flight for the sweeps ([`crate::copy::CopyEngine::loose_chunk`]),
/// unless it is a client's own memory, which its registration's gate covers.
fn loose_unless_client<'a>(d: &'a Daemon, side: &Side) -> Option<crate::copy::LooseChunk<'a>> {
    (!side.is_client()).then(|| d.copies.loose_chunk())
}

/// Refuses a chunk whose local end went (unregistered, freed, released, revoked).
fn local_end_gone(d: &Daemon, deps: &[Dep]) -> Result<(), Stop> {
    match d.memory.copy_dep_gone(deps) {
        Some(why) => Err((ErrorCode::NotFound, why)),
        None => Ok(()),
    }
}

/// Serves a peer's copy chunk: read from or written to a region of this node through the
/// import it names, which the peer's current incarnation must hold (`session`: its
/// registry session, [`super::owner::Owner::session_of`]). Blocking: the bytes move here.
pub fn serve(d: &Daemon, session: Option<u64>, body: &[u8]) -> Result<PeerResponse, PeerError> {
    let (ask, data) = CopyAsk::decode(body)?;
    let denied = |code, message: String| PeerError::Denied { code, message };
    let session =
        session.ok_or_else(|| denied(ErrorCode::NotFound, format!("no import {} of this incarnation", ask.import)))?;
    let len = u64::from(ask.len);
    let snap = d.map_snapshot();
    // In flight from before the import is resolved until the bytes have moved: a free or
    // revocation of what it reaches waits for it before it is answered and the range reused.
    let _in_flight = d.copies.loose_chunk();
    let r = d.memory.copy_endpoint_through(session, &snap, ask.import, ask.gfa, len, ask.write).map_err(|e| {
        let body = refused(&e);
        denied(body.code, body.message.to_string())
    })?;
    debug_assert!(r.deps.contains(&Dep::Import(ask.import)));
    let io = |e: crate::copy::chunk::ChunkError| denied(e.code(), crate::error_chain(&e));
    if ask.write {
        bytes::write(&r.side, 0, data, d.copies.region_maps()).map_err(io)?;
        Ok(PeerResponse { op: PeerOp::Copy, body: Vec::new() })
    } else {
        let mut buf = vec![0; ask.len as usize];
        bytes::read(&r.side, 0, &mut buf, d.copies.region_maps()).map_err(io)?;
        Ok(PeerResponse { op: PeerOp::Copy, body: buf })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_uid_takes_at_most_its_share_of_the_nodes_copies() {
        let c = Copies::default();
        for _ in 0..MAX_IN_FLIGHT_PER_UID {
            c.take(1000).unwrap();
        }
        let refused = c.take(1000).unwrap_err();
        assert_eq!(refused.code, ErrorCode::LimitExceeded);
        assert!(refused.message.to_string().contains("uid 1000"), "{refused:?}");
        // Others still get theirs, up to the node's bound.
        for uid in 1001..1004 {
            for _ in 0..MAX_IN_FLIGHT_PER_UID {
                c.take(uid).unwrap();
            }
        }
        let full = c.take(1009).unwrap_err();
        assert!(full.message.to_string().contains("on this node"), "{full:?}");
        c.give_back(1000);
        c.take(1000).unwrap();
        assert_eq!(c.in_flight().by_uid.len(), 4);
    }
}
