//! The durable side of the memory registry: journaling each change before it is
//! acknowledged (and compacting), rebuilding the registry at start from the journal and
//! the region files found, and sessions that outlive a daemon restart (tokens, resume,
//! reclaim of owners that are gone or do not come back). docs/fabricd.md, "Durability".

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, MutexGuard};

use crate::memory::Identity;
use fabric_proto::wire::{DeviceName, ExportHandle, ExportPolicy, RevocationReason, Secret, SessionToken};
use fabric_topology::Inventory;

use super::backings::{Backing, Offer};
use super::durable::{Change, Owner, RegionRecord, Replayed, ResourceKey, SetPlacement, SetRegionRecord, Snapshot};
use super::{Export, Memory, MemoryError, Reclaimed, Region, State, Usage, io_err};
use crate::config::{LimitsConfig, MemoryConfig};
use crate::journal::{Committer, Journal, JournalOptions, Replay, Ticket};

/// Session ids given to sessions found in the journal until a client takes them back
/// (live sessions count up from 1, so the two never meet).
const ORPHAN_SESSIONS: u64 = 1 << 62;

/// The journal as the registry uses it: a group committer, and what the registry knows of
/// the records it queued.
#[derive(Debug)]
pub(super) struct Log {
    committer: Arc<Committer>,
    /// Records queued whose changes are neither published nor undone yet (a snapshot is
    /// only taken when there are none, so it is exactly the state the queue ends in).
    in_flight: u32,
    /// A commit failed: the journal is reopened with a snapshot of what was acknowledged
    /// before the next change, once nothing is in flight.
    broken: bool,
    since_snapshot: u32,
    compact_records: u32,
}

#[cfg(test)]
impl Log {
    /// Its committer.
    pub(super) fn committer(&self) -> &Arc<Committer> {
        &self.committer
    }

    /// Records and snapshots queued and not settled yet.
    pub(super) fn in_flight(&self) -> u32 {
        self.in_flight
    }
}

/// A session no client has taken back yet: found in the journal at start, or detached
/// when its connection closed.
#[derive(Debug)]
pub(super) struct Orphan {
    token: SessionToken,
    session: u64,
    owner: Owner,
    /// Found at start: the start's grace period (`memory.resume_grace_s`) ends it; a
    /// detached one has a timer of its own.
    at_start: bool,
    /// A client's resume of it is being journaled: no reclaim takes it meanwhile.
    resuming: bool,
    /// Its grace period ended while it was being resumed: reclaimed if that resume fails.
    expired: bool,
}

impl Orphan {
    fn new(token: SessionToken, session: u64, owner: Owner, at_start: bool) -> Self {
        Self { token, session, owner, at_start, resuming: false, expired: false }
    }
}

/// A live session's token and owner.
#[derive(Debug, Clone, Copy)]
pub(super) struct Session {
    pub(super) token: SessionToken,
    pub(super) owner: Owner,
}

/// What a resumed session got back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// Regions now owned by the session.
    pub regions: u64,
    /// Exports of them (revoked ones included).
    pub exports: u64,
}

/// The journal the daemon opened, and how the registry uses it.
#[derive(Debug)]
pub struct Durability {
    /// The journal.
    pub journal: Journal,
    /// What it replayed.
    pub replay: Replay,
    /// `[memory]`.
    pub config: MemoryConfig,
    /// The device memory `[memory] dax` and `bars` export, resolved.
    pub backings: super::backing::Backings,
}

/// Start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks since boot).
pub fn pid_start_time(pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let mut text = String::new();
    File::open(format!("/proc/{pid}/stat")).ok()?.read_to_string(&mut text).ok()?;
    crate::transport::peer::start_time_in(&text)
}

/// Whether the process that owned a session is still the same process: it exists and
/// has the recorded start time (a recycled pid has another). Unknown (no pid or no start
/// time recorded) counts as alive: the grace period decides.
fn owner_alive(o: &Owner) -> bool {
    match o.pid_start {
        Some(start) => pid_start_time(o.pid) == Some(start),
        None => true,
    }
}

fn random_token() -> std::io::Result<SessionToken> {
    crate::sys::random_bytes().map(SessionToken)
}

/// The durable owner record of `who`: its identity and its process's start time.
pub fn owner_of(who: &Identity) -> Owner {
    Owner { uid: who.uid, gid: who.gid, pid: who.pid, pid_start: pid_start_time(who.pid) }
}

fn identity(o: &Owner) -> Identity {
    Identity { pid: o.pid, uid: o.uid, gid: o.gid }
}

impl State {
    /// The identity of resource `i`, as records name it.
    pub(super) fn resource_key(&self, i: usize) -> ResourceKey {
        let res = &self.resources[i];
        ResourceKey {
            device: DeviceName::truncated(&res.device.to_string()),
            kind: res.kind.into(),
            ordinal: res.ordinal,
        }
    }

    /// The resource a record names, when the fabric has it.
    pub(super) fn find_resource(&self, key: &ResourceKey) -> Option<usize> {
        self.resources.iter().position(|x| {
            x.device.to_string() == key.device.as_str()
                && fabric_proto::wire::MemoryClass::from(x.kind) == key.kind
                && x.ordinal == key.ordinal
        })
    }

    pub(super) fn region_record(&self, id: u64, r: &Region) -> RegionRecord {
        RegionRecord {
            id,
            generation: r.generation,
            token: *r.token.expose(),
            owner: r.durable_owner(),
            resource: self.resource_key(r.resource),
            offset: r.offset,
            len: r.len,
        }
    }

    /// The record of a region striped over an interleave set (`s` its set part).
    pub(super) fn set_region_record(&self, id: u64, r: &Region, s: &super::set::SetRegion) -> SetRegionRecord {
        let others: Vec<ResourceKey> = s.others.iter().map(|&i| self.resource_key(i)).collect();
        SetRegionRecord {
            region: self.region_record(id, r),
            placement: SetPlacement {
                set: fabric_proto::wire::Name::truncated(&s.name),
                set_offset: s.set_offset,
                // A set has at most 16 members (CXL); more do not fit the record.
                others: fabric_proto::wire::BoundedVec::new(others).unwrap_or_default(),
                dax: s.dax.as_deref().map(fabric_proto::wire::Name::truncated),
            },
        }
    }

    /// The registry as a snapshot record (at start, and when a failed journal is reopened;
    /// compaction writes the journal's own image instead). Linear in the registry's size.
    pub(super) fn snapshot(&self) -> Result<Vec<u8>, MemoryError> {
        // Adopted vendor objects live as long as their session only.
        let (mut regions, mut set_regions) = (Vec::new(), Vec::new());
        for (id, r) in self.ledger.regions.iter().filter(|(_, r)| r.object().is_none()) {
            match self.set_regions.get(id) {
                Some(s) => set_regions.push(self.set_region_record(*id, r, s)),
                None => regions.push(self.region_record(*id, r)),
            }
        }
        let exports = self
            .ledger
            .exports
            .iter()
            .filter(|e| self.ledger.regions.get(&e.handle.region).is_none_or(|r| r.object().is_none()))
            .map(Export::record)
            .collect();
        let lost =
            self.ledger.regions.iter().filter(|(_, r)| r.lost && r.object().is_none()).map(|(id, _)| *id).collect();
        encode(Snapshot { next_id: self.ledger.next_id, regions, exports, set_regions, lost })
            .map_err(MemoryError::Record)
    }

    /// Queues `change` in the journal, in state order: the caller waits for the ticket
    /// outside the registry lock ([`Memory::commit`]) and publishes or undoes its change
    /// then. `None`: nothing to wait for (no journal, or an adopted object's change).
    pub(super) fn journal(&mut self, change: &Change) -> Result<Option<Ticket>, MemoryError> {
        // Changes to adopted vendor objects are not journaled: they live as long as their
        // session only (docs/fabricd.md, "Adopted objects").
        let region = match change {
            Change::RegionAllocated(r) => Some(r.id),
            Change::RegionFreed { id } => Some(*id),
            Change::ExportCreated(e) => Some(e.region),
            Change::ExportRevoked { region, .. } => Some(*region),
            Change::RegionLost { id } => Some(*id),
            _ => None,
        };
        if region.and_then(|id| self.ledger.regions.get(&id)).is_some_and(|r| r.object().is_some()) {
            return Ok(None);
        }
        let Some(mut log) = self.log.take() else { return Ok(None) };
        let r = self.queue_with(&mut log, change);
        self.log = Some(log);
        r.map(Some)
    }

    fn queue_with(&self, log: &mut Log, change: &Change) -> Result<Ticket, MemoryError> {
        let (kind, payload) = change.encode().map_err(MemoryError::Record)?;
        if log.broken {
            if log.in_flight > 0 {
                return Err(MemoryError::JournalUnavailable);
            }
            // Nothing is in flight, so the registry is what was acknowledged: the journal is
            // brought back in line with it before anything new. Captured here (no I/O), the
            // snapshot is written by the journal's writer ahead of this change's record,
            // which fails with it if it cannot be (and the next change tries again).
            let snapshot = self.snapshot()?;
            drop(log.committer.enqueue_reopen(snapshot));
            log.broken = false;
            log.since_snapshot = 0;
        }
        log.in_flight += 1;
        log.since_snapshot = log.since_snapshot.saturating_add(1);
        Ok(log.committer.enqueue(kind, payload))
    }

    /// A queued record's outcome is known (its change is published or undone next, under
    /// this same lock).
    pub(super) fn settle(&mut self, waited: &Result<(), crate::journal::JournalError>) {
        let Some(log) = self.log.as_mut() else { return };
        log.in_flight = log.in_flight.saturating_sub(1);
        match waited {
            Ok(()) => {}
            // A snapshot that did not encode wrote nothing: the journal goes on as it was.
            Err(e) if e.wrote_nothing() => {}
            Err(e) => {
                tracing::error!(error = %crate::error_chain(e), "journal write failed; the change is refused");
                log.broken = true;
            }
        }
    }

    /// Queues a compaction when enough records have accumulated since the last one and
    /// none is in flight; [`Memory::finish`] hands it to the compaction thread, which
    /// settles it. Nothing is captured here: the journal's writer keeps the snapshot's
    /// state itself ([`super::durable::RegistryImage`]), as of every record queued before it.
    pub(super) fn maybe_compact(&mut self) -> Option<Ticket> {
        let log = self.log.as_mut()?;
        if log.since_snapshot < log.compact_records || log.broken || log.in_flight > 0 {
            return None;
        }
        tracing::debug!(records = log.since_snapshot, "journal compaction queued");
        log.since_snapshot = 0;
        log.in_flight += 1;
        Some(log.committer.enqueue_compaction())
    }

    /// The token and owner of `session`, which [`Memory::ensure_session`] made before the
    /// lock was taken. `NotFound` when the session ended meanwhile (its connection closed).
    pub(super) fn session(&self, session: u64) -> Result<Session, MemoryError> {
        self.sessions
            .get(&session)
            .copied()
            .ok_or_else(|| MemoryError::NotFound(format!("session {session} has ended")))
    }
}

/// A snapshot's record payload, its lists in id order.
fn encode(mut s: Snapshot) -> Result<Vec<u8>, super::durable::DurableError> {
    s.regions.sort_by_key(|r| r.id);
    s.set_regions.sort_by_key(|r| r.region.id);
    s.lost.sort_unstable();
    s.encode()
}

impl Session {
    /// A new session's token (from `/dev/urandom`) and owner (its process's start time
    /// from `/proc`): I/O, so made outside the registry lock.
    fn make(who: &Identity) -> Result<Self, MemoryError> {
        let token = random_token().map_err(io_err(Path::new("/dev/urandom")))?;
        Ok(Self { token, owner: owner_of(who) })
    }
}

impl Memory {
    /// The registry rebuilt from the journal and reconciled with the region files under
    /// `root`: a file with no acknowledged region is removed; a region whose resource,
    /// file or size is gone is dropped (a warning and a `status` problem); the regions of
    /// an owner whose process is gone are reclaimed; the rest wait, orphaned, for their
    /// owner to come back within `memory.resume_grace_s`. Then the journal is compacted to
    /// exactly this state.
    pub fn open_durable(
        root: &Path,
        inv: &Inventory,
        limits: LimitsConfig,
        durability: Durability,
    ) -> Result<Self, MemoryError> {
        let Durability { mut journal, replay, config, backings } = durability;
        let mut model = match &replay.snapshot {
            Some(s) => Replayed::from_snapshot(Snapshot::decode(&s.payload).map_err(MemoryError::Record)?),
            None => Replayed::default(),
        };
        model.next_id = model.next_id.max(1);
        let mut skipped = 0usize;
        for rec in &replay.records {
            let change = match Change::decode(rec.kind, &rec.payload) {
                Ok(c) => c,
                Err(super::durable::DurableError::UnknownKind(kind)) => {
                    tracing::warn!(seq = rec.seq, kind, "journal record of another subsystem; skipped");
                    continue;
                }
                Err(e) => return Err(MemoryError::Record(e)),
            };
            if let Err(e) = model.apply(change) {
                skipped += 1;
                tracing::warn!(seq = rec.seq, "journal record does not fit the registry; skipped: {e}");
            }
        }
        let resources = super::resources(root, inv)?;
        let mut st = State::new(resources, model.next_id);
        Self::apply_backings(&mut st, &backings);
        let mut orphans: BTreeMap<[u8; 16], u64> = BTreeMap::new();
        let mut gone_owners = 0usize;
        let offers_path = root.join(super::offers::FILE);
        let saved_offers = super::offers::read(&offers_path);
        // The resources of regions dropped for a changed memory.
        let mut moved: Vec<usize> = Vec::new();
        for r in model.regions.values() {
            // A set region names its DAX device, which `locate` checks.
            let changed = match (&saved_offers, model.sets.contains_key(&r.id)) {
                (Some(saved), false) => st.offer_changed(saved, &r.resource),
                _ => None,
            };
            if let Some(why) = changed {
                moved.extend(st.find_resource(&r.resource));
                st.lost(r.id, &why);
                continue;
            }
            let found = match st.locate(r, model.sets.get(&r.id)) {
                Ok(f) => f,
                Err(why) => {
                    st.lost(r.id, &why);
                    continue;
                }
            };
            if !owner_alive(&r.owner) {
                gone_owners += 1;
                tracing::info!(
                    region = r.id,
                    uid = r.owner.uid,
                    pid = r.owner.pid,
                    "owner process is gone; region reclaimed"
                );
                continue;
            }
            if !st.ledger.space.take(&found.members, r.offset, found.per) {
                // Its device shrank while the daemon was down: it keeps its range, as it
                // would have had the device shrunk under the running daemon (a rescan).
                if st.ledger.space.take_past_end(&found.members, r.offset, found.per) {
                    let why = format!(
                        "region {} ({:#x} bytes at offset {:#x}) lies past the new size of its device's memory; it stays in use until freed",
                        r.id, found.per, r.offset
                    );
                    tracing::warn!(
                        region = r.id,
                        offset = r.offset,
                        len = found.per,
                        "a restored region lies past its device's new size"
                    );
                    if st.problems.len() < 256 {
                        st.problems.push(why);
                    }
                } else {
                    st.lost(r.id, &format!("its range {:#x}+{:#x} overlaps another region", r.offset, found.per));
                    continue;
                }
            }
            let next = ORPHAN_SESSIONS + orphans.len() as u64;
            let session = *orphans.entry(r.token).or_insert_with(|| {
                st.orphans.push(Orphan::new(SessionToken(r.token), next, r.owner, true));
                next
            });
            st.ledger.charge(r.owner.uid, Usage::region(r.len, 0));
            st.ledger.publish_region(
                r.id,
                Region {
                    generation: r.generation,
                    owner: identity(&r.owner),
                    pid_start: r.owner.pid_start,
                    token: SessionToken(r.token),
                    session,
                    resource: found.members[0],
                    offset: r.offset,
                    len: r.len,
                    backing: found.backing,
                    // Lost with its device before the restart: lost still, even with the
                    // device back (what it held is not trusted once the device went).
                    lost: model.lost.contains(&r.id),
                },
            );
            if let Some(set) = found.set {
                st.set_regions.insert(r.id, set);
            }
        }
        st.reconcile_carved();
        for e in model.exports() {
            if !st.ledger.regions.contains_key(&e.region) {
                continue;
            }
            let policy = ExportPolicy {
                uids: e.uids.clone(),
                gids: e.gids.clone(),
                partition: e.partition.clone(),
                access: e.access,
            };
            let handle =
                ExportHandle { node: None, region: e.region, generation: e.generation, secret: Secret(e.secret) };
            // A region lost at start (`State::reconcile_carved`) has its exports revoked, as
            // one lost with its device before the restart has.
            let revoked = e.revoked || st.ledger.regions.get(&e.region).is_some_and(|r| r.lost);
            st.ledger.exports.push(Export { handle, owner_uid: e.owner_uid, policy, revoked });
            st.ledger.charge(e.owner_uid, Usage::OBJECT);
        }
        // What other nodes may map, before anything is allocated again.
        st.restored = super::holds::restore(&mut st, &root.join(super::holds::FILE));
        // What this node's clients may still map of other hosts' memory, likewise.
        st.foreign_restored = super::foreign::restore(&mut st, &root.join(super::foreign::FILE));
        let stray = remove_stray_files(&st);
        let snapshot = st.snapshot()?;
        let compacted = match journal.compact(&snapshot) {
            Ok(_) => true,
            // A registry larger than a snapshot holds (1 GiB): its records replay as they are.
            Err(e) if e.wrote_nothing() => {
                tracing::warn!(error = %crate::error_chain(&e), "registry snapshot not written at start; the journal keeps every record until the registry shrinks");
                false
            }
            Err(e) => return Err(MemoryError::Journal(e)),
        };
        // What backs each resource now, for the next start to check its regions against:
        // saved only once the regions dropped for a change are out of the journal, or the
        // next start would restore them onto the new memory.
        if moved.is_empty() || compacted {
            fabric_addrmap::durable::write_whole(&offers_path, &super::offers::encode(&st.offers()))
                .map_err(|e| MemoryError::Io { path: e.path, source: e.source })?;
        } else {
            // The record stays the last start's, against which a region placed on those
            // resources now would be dropped at the next start: none is placed there until
            // a start compacts the journal.
            let why = "regions dropped at start for this resource's changed memory are still in the journal (the registry is too large to compact); new regions here wait for a start that compacts it";
            tracing::warn!(regions = moved.len(), "{why}");
            for &i in &moved {
                st.resources[i].held_back = Some(why.to_owned());
            }
        }
        tracing::info!(
            regions = st.ledger.regions.len(),
            exports = st.ledger.exports.len(),
            sessions = st.orphans.len(),
            reclaimed_owner_gone = gone_owners,
            dropped = st.problems.len(),
            stray_files_removed = stray,
            records_skipped = skipped,
            replayed = replay.records.len(),
            grace_s = config.resume_grace_s,
            "memory registry restored from the journal"
        );
        st.log = Some(Log {
            committer: Committer::new(
                journal,
                JournalOptions::default(),
                Box::new(super::durable::RegistryImage::of(&snapshot)),
            ),
            in_flight: 0,
            broken: false,
            since_snapshot: 0,
            compact_records: config.compact_records,
        });
        Ok(Self::with_state(st, limits, root))
    }

    /// Makes `session`'s token and owner at its first use, without the registry lock (they
    /// are read from `/dev/urandom` and `/proc`); a concurrent first use keeps the one made
    /// first. Operations that need the session call this before they take the lock.
    pub(super) fn ensure_session(&self, session: u64, who: &Identity) -> Result<(), MemoryError> {
        if self.state().sessions.contains_key(&session) {
            return Ok(());
        }
        let made = Session::make(who)?;
        self.state().sessions.entry(session).or_insert(made);
        Ok(())
    }

    /// The session's resume token (made at first use), for its `Hello` response.
    pub fn session_token(&self, session: u64, who: &Identity) -> Result<SessionToken, MemoryError> {
        self.ensure_session(session, who)?;
        Ok(self.state().session(session)?.token)
    }

    /// Gives the regions and exports of the orphaned session `token` names to `session`,
    /// which must not hold regions yet; the caller's uid must be the owner's.
    pub fn resume(&self, session: u64, who: &Identity, token: &SessionToken) -> Result<Resumed, MemoryError> {
        // Read before the lock: the process's start time is in `/proc`.
        let owner = owner_of(who);
        let mut st = self.state();
        // Every orphan is compared, each in constant time.
        let mut found = None;
        for (i, o) in st.orphans.iter().enumerate() {
            if o.token == *token {
                found = Some(i);
            }
        }
        let Some(i) = found else {
            return Err(MemoryError::NotFound(
                "no session to resume with this token (its regions were reclaimed, or it never held any)".into(),
            ));
        };
        if st.orphans[i].owner.uid != who.uid {
            return Err(MemoryError::PermissionDenied(format!(
                "the session belongs to uid {}, not {}",
                st.orphans[i].owner.uid, who.uid
            )));
        }
        if st.orphans[i].resuming {
            return Err(MemoryError::BadRequest("another connection is resuming this session".into()));
        }
        if st.ledger.regions.values().any(|r| r.session == session) {
            return Err(MemoryError::BadRequest("resume a session before allocating on this connection".into()));
        }
        let ticket = st.journal(&Change::SessionResumed { token: *token.expose(), owner })?;
        // Marked while the record is written, so that no reclaim takes it meanwhile; a
        // grace period that ends meanwhile is noted, and acted on if the write fails.
        let orphaned = st.orphans[i].session;
        st.orphans[i].resuming = true;
        drop(st);
        let (mut st, done) = self.commit(ticket);
        // Still listed: no reclaim or other resume takes a resuming orphan.
        let at = st.orphans.iter().position(|o| o.session == orphaned && o.token == *token);
        if let Err(e) = done {
            let Some(i) = at else { return Err(e) };
            st.orphans[i].resuming = false;
            if st.orphans[i].expired {
                let o = st.orphans.remove(i);
                let uid = o.owner.uid;
                let r = self.reclaim(st, vec![o]);
                tracing::info!(uid, regions = r.regions, "a session's resume failed after its grace period; reclaimed");
            }
            return Err(e);
        }
        if let Some(i) = at {
            st.orphans.remove(i);
        }
        st.sessions.insert(session, Session { token: *token, owner });
        let mut out = Resumed::default();
        let mut ids = Vec::new();
        for (id, r) in st.ledger.regions.iter_mut().filter(|(_, r)| r.session == orphaned) {
            r.session = session;
            r.owner = *who;
            r.pid_start = owner.pid_start;
            out.regions += 1;
            ids.push(*id);
        }
        out.exports = st.ledger.exports.iter().filter(|e| ids.contains(&e.handle.region)).count() as u64;
        self.finish(st);
        tracing::info!(
            uid = who.uid,
            pid = who.pid,
            session,
            regions = out.regions,
            exports = out.exports,
            "session resumed"
        );
        Ok(out)
    }

    /// Reclaims every session found orphaned at start (the start's grace period is
    /// over): their regions are freed and their exports revoked, importers told. Sessions
    /// detached since are left to their own timers ([`Memory::reclaim_orphan`]).
    pub fn reclaim_orphans(&self) -> Reclaimed {
        let mut st = self.state();
        let (orphans, kept) =
            std::mem::take(&mut st.orphans).into_iter().partition(|o: &Orphan| o.at_start && !o.resuming);
        st.orphans = kept;
        for o in st.orphans.iter_mut().filter(|o| o.at_start) {
            o.expired = true;
        }
        self.reclaim(st, orphans)
    }

    /// Ends `orphans` (taken out of the orphan list): each end queued in the journal and,
    /// once durable, their regions dropped (importers told), their files removed after.
    fn reclaim(&self, mut st: MutexGuard<'_, State>, orphans: Vec<Orphan>) -> Reclaimed {
        let mut tickets = Vec::new();
        for o in &orphans {
            match st.journal(&Change::SessionEnded { token: *o.token.expose() }) {
                Ok(t) => tickets.extend(t),
                Err(e) => {
                    tracing::error!(error = %crate::error_chain(&e), "cannot journal the end of an orphaned session")
                }
            }
        }
        drop(st);
        // Every end waited for with the lock released, then settled under it once: a
        // guard kept across the next wait would hold the registry through a journal write
        // and deadlock on the next relock.
        let waited: Vec<_> = tickets.into_iter().map(Ticket::wait).collect();
        let mut st = self.state();
        for w in &waited {
            st.settle(w);
            if let Err(e) = w {
                tracing::error!(error = %crate::error_chain(e), "cannot journal the end of an orphaned session");
            }
        }
        let mut out = Reclaimed::default();
        for o in &orphans {
            for id in st.ledger.regions_of(o.session) {
                out.add(Self::drop_region(&mut st, id, RevocationReason::OwnerExited));
            }
            tracing::info!(
                uid = o.owner.uid,
                pid = o.owner.pid,
                "orphaned session not resumed within the grace period; reclaimed"
            );
        }
        self.finish(st);
        out
    }

    /// Keeps what `session` (whose connection closed) holds for a client to take back by
    /// its token, as if the daemon had restarted: the session becomes an orphan, its
    /// regions and exports stay (and stay journaled). Its imports are released and its
    /// registrations undone now (they are the connection's, not resumable). Returns the
    /// token; `None` when the session held no region, and then it is closed as
    /// [`Memory::close_session`] does.
    pub fn detach_session(&self, session: u64) -> (Option<SessionToken>, Reclaimed) {
        let mut st = self.state();
        let holds = st.ledger.regions.values().any(|r| r.session == session);
        let Some(s) = st.sessions.get(&session).copied().filter(|_| holds) else {
            drop(st);
            return (None, self.close_session(session));
        };
        let out = Self::drop_connection(&mut st, session);
        st.sessions.remove(&session);
        st.orphans.push(Orphan::new(s.token, session, s.owner, false));
        self.finish(st);
        (Some(s.token), out)
    }

    /// Reclaims the detached session `session` with `token`, if no client took it back
    /// (its grace period is over): as [`Memory::reclaim_orphans`] for that one session.
    /// A session resumed keeps its token, so the session id tells this detachment from a
    /// later one of the session that resumed it, whose grace runs from its own detach.
    pub fn reclaim_orphan(&self, token: &SessionToken, session: u64) -> Reclaimed {
        let mut st = self.state();
        let Some(i) = st.orphans.iter().position(|o| o.token == *token && o.session == session) else {
            return Reclaimed::default();
        };
        if st.orphans[i].resuming {
            st.orphans[i].expired = true;
            return Reclaimed::default();
        }
        let o = st.orphans.remove(i);
        self.reclaim(st, vec![o])
    }

    /// Sessions found in the journal that no client has taken back yet.
    pub fn orphans(&self) -> usize {
        self.state().orphans.len()
    }

    /// What start-up had to drop, one line each (shown by `status`).
    pub fn problems(&self) -> Vec<String> {
        self.state().problems.clone()
    }
}

/// Where a journaled region's bytes are now (see [`State::locate`]).
struct Found {
    /// The resources holding it: its own first (for a set region, the set's first member),
    /// then the set's other members.
    members: Vec<usize>,
    /// Bytes of the region each member holds, from the region's offset.
    per: u64,
    /// What holds its bytes (a carved region's device is found later).
    backing: Backing,
    /// The set part of a set region.
    set: Option<super::set::SetRegion>,
}

impl State {
    /// Finds what a journaled region needs in the fabric found at start: its resources,
    /// and its file with the size recorded (a sim file), or the device file that holds its
    /// range. `Err`: why it cannot come back.
    fn locate(&self, r: &RegionRecord, set: Option<&SetPlacement>) -> Result<Found, String> {
        let find = |key: &ResourceKey| {
            self.find_resource(key).ok_or_else(|| {
                format!("its resource {}#{:?}{} is not in the fabric", key.device.as_str(), key.kind, key.ordinal)
            })
        };
        let mut members = vec![find(&r.resource)?];
        let found = match set {
            None => {
                // A region of device memory is a range of the device file, which outlives
                // the daemon like a sim file does (and is never removed).
                let res = &self.resources[members[0]];
                let own = res.dir.join(format!("r{}", r.id));
                let backing = match &res.offer {
                    Offer::Device(b) => match b.file_offset(r.offset, r.len) {
                        Some(offset) => Backing::DeviceRange { path: b.path.clone(), offset },
                        None => return Err(format!("its range is not inside {}", b.path.display())),
                    },
                    Offer::Node(n) => Backing::NodeFile { path: own, node: n.node },
                    Offer::Files | Offer::Driver => Backing::SimFile(own),
                };
                Found { members, per: r.len, backing, set: None }
            }
            Some(p) => {
                for key in p.others.iter() {
                    members.push(find(key)?);
                }
                let ways = members.len() as u64;
                if !r.len.is_multiple_of(ways) {
                    return Err(format!("its length {:#x} does not stripe over {ways} members", r.len));
                }
                let mut carved = false;
                let backing = match &p.dax {
                    Some(dax) => {
                        let b = self.set_backings.get(p.set.as_str()).filter(|b| b.name == dax.as_str()).ok_or_else(
                            || {
                                format!(
                                    "its DAX device {} no longer backs set {} (memory.dax)",
                                    dax.as_str(),
                                    p.set.as_str()
                                )
                            },
                        )?;
                        // Its own device is found (or carved again) once every region is back
                        // (`State::reconcile_carved`).
                        carved = b.carve.is_some();
                        let at = b
                            .file_offset(p.set_offset, r.len)
                            .ok_or_else(|| format!("its range is not inside {} ({})", b.path.display(), b.name))?;
                        Backing::DeviceRange { path: b.path.clone(), offset: at }
                    }
                    None => Backing::SimFile(self.resources[members[0]].dir.join(format!("r{}", r.id))),
                };
                let part = super::set::SetRegion {
                    name: p.set.as_str().to_owned(),
                    set_offset: p.set_offset,
                    others: members[1..].to_vec(),
                    dax: p.dax.as_ref().map(|d| d.as_str().to_owned()),
                };
                let found = Found { members, per: r.len / ways, backing, set: Some(part) };
                if carved {
                    return Ok(found);
                }
                found
            }
        };
        let file = self
            .file_in(found.members[0], &found.backing)
            .ok_or_else(|| "it is a vendor object, which is never journaled".to_owned())?;
        let (path, device) = (file.path().to_owned(), found.backing.is_device());
        let meta = if device {
            std::fs::metadata(&path)
        } else {
            // A region file: by name in its directory held open, not through a symlink, the
            // daemon's own, 0600 (one an earlier daemon left readable under umask 022 is
            // tightened here, through its descriptor).
            file.open(false).and_then(|f| crate::sys::privdir::check_file(&f, &path).and_then(|()| f.metadata()))
        };
        match meta {
            Ok(_) if device => {}
            Ok(m) if m.is_file() && m.len() == r.len => {}
            Ok(m) => return Err(format!("its file {} is {} bytes, not {}", path.display(), m.len(), r.len)),
            Err(e) => return Err(format!("its file {} is missing or unusable ({e})", path.display())),
        }
        if let Backing::NodeFile { node, .. } = &found.backing {
            // A region file on a NUMA node: its pages must still be there (the file's shared
            // policy keeps them there; a file someone moved or replaced would not be).
            let checked = file.open(true).map_err(|e| e.to_string()).and_then(|f| {
                super::nodefd::check_file(&std::os::fd::OwnedFd::from(f), r.len, *node).map_err(|e| {
                    let why = std::error::Error::source(&e).map(|s| format!(": {s}")).unwrap_or_default();
                    format!("{e}{why}")
                })
            });
            if let Err(why) = checked {
                return Err(format!("its file {} on NUMA node {node}: {why}", path.display()));
            }
        }
        Ok(found)
    }

    pub(super) fn lost(&mut self, region: u64, why: &str) {
        tracing::warn!(region, "region dropped at start: {why}");
        if self.problems.len() < 256 {
            self.problems.push(format!("region {region} dropped at start: {why}"));
        }
    }
}

/// Removes region files with no live region: allocations never acknowledged, or freed
/// with the file still there when the daemon died.
fn remove_stray_files(st: &State) -> usize {
    let live: HashMap<&Path, ()> = st.ledger.regions.values().filter_map(|r| Some((r.backing.path()?, ()))).collect();
    let mut removed = 0;
    for res in &st.resources {
        let Ok(entries) = std::fs::read_dir(&res.dir) else { continue };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name();
            let is_region =
                name.to_str().is_some_and(|n| n.strip_prefix('r').is_some_and(|d| d.parse::<u64>().is_ok()));
            if !is_region || live.contains_key(path.as_path()) {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    removed += 1;
                    tracing::info!(path = %path.display(), "removed a region file with no acknowledged region");
                }
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove a stray region file"),
            }
        }
    }
    removed
}
