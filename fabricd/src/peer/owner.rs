//! The owner's side of an import across nodes: the handle checked by the registry (its
//! secret in constant time) and the policy by domain-wide tenants (the dispatch's
//! authorization table, for the asking node as a `Principal::Peer`), the import recorded
//! against the importer node's incarnation (one registry session per importer node and
//! incarnation), and a grant that names the region's file on the shared sim fabric, or its
//! place in a set of shared CXL devices (or, for a CUDA fabric handle, the handle, to a
//! node of the same NVLink domain).
//! Revocations of those imports go back to the importer node over the link ([`revokes`]);
//! a region freed under a remote import has its file truncated, so the importer's next
//! load faults instead of reading memory that may be reused, and its range is quarantined
//! until the importer acknowledged the end (or, for a node that left, until it returns as
//! another incarnation or an admin collects it: `memory/quarantine.rs`).

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::sync::{Arc, Mutex};

use crate::memory::Identity;
use fabric_domain::DataPathKind;
use fabric_domain::records::SHARED_FILE;
use fabric_nodelink::{Peer, PeerError};
use fabric_proto::wire::{ErrorCode, ExportHandle, ObjectKind, RevocationReason, Secret, Topics};

use super::clique::NoReach;
use super::members::listed;
use super::revokes::{self, Outbox};
use super::wire::{self, ImportAsk, ImportGrant, ObjectGrant, ReleaseAsk, Shared, SharedFile};
use crate::daemon::Daemon;
use crate::events::Reach;
use crate::memory::ExportSubject;
use crate::ops::dispatch::Operation;
use crate::ops::principal::{Client, NOBODY_UID, PeerNode, Principal};
use crate::ops::scope::Caller;

/// One importer node's incarnation: its registry session.
#[derive(Debug)]
struct Remote {
    incarnation: u64,
    session: u64,
    /// Its revocations not yet told.
    outbox: Arc<Outbox>,
}

/// What the owner keeps for imports granted to other nodes.
#[derive(Debug, Default)]
pub struct Owner {
    /// By importer node.
    remotes: Mutex<HashMap<String, Remote>>,
    /// Importer nodes that left while holding imports, with the incarnation they held
    /// them at: what they imported is quarantined until they return as another one.
    departed: Mutex<HashMap<String, u64>>,
    /// Importer nodes whose holds an earlier incarnation of this daemon saved
    /// (`memory/holds.rs`): quarantined until they reach this incarnation (having voided
    /// what the last one granted: `Importer::void_owner`), return as another one, or are
    /// collected. Taken from the registry when the daemon is attached.
    restored: Mutex<HashSet<String>>,
    /// The file of each remote import, open: truncated if its region is freed (the
    /// registry removes the file, which would leave the importer's mapping reading the
    /// old pages).
    files: Mutex<HashMap<u64, (String, File)>>,
    /// By importer node, held while that node's incarnation's session is set up, which is
    /// published in `remotes` only once complete.
    setup: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// This node's incarnations ended so far ([`Owner::end_all`]; changed under the
    /// `remotes` lock): a session set up across an end is not published.
    ended: std::sync::atomic::AtomicU64,
}

/// The principal of `peer`'s client as its ask states it: the node, its incarnation, the
/// partitions it vouches for, and the uid and gid that count where identities are shared.
/// Without an ask (a release): the node alone.
pub(super) fn principal(d: &Daemon, peer: &Peer, ask: Option<&ImportAsk>) -> Principal {
    let node = peer.identity.node.clone();
    let incarnation = peer.incarnation;
    Principal::Peer(match ask {
        Some(ask) => PeerNode {
            node,
            incarnation,
            claims: ask.partitions.clone(),
            uid: ask.uid,
            gid: ask.gid,
            shared_identities: d.config.peer.shared_identities,
        },
        None => PeerNode {
            node,
            incarnation,
            claims: Vec::new(),
            uid: NOBODY_UID,
            gid: NOBODY_UID,
            shared_identities: false,
        },
    })
}

/// `who`'s caller for the authorization table.
fn caller(d: &Daemon, who: Principal) -> Caller {
    Caller::of_node(d, Arc::new(Client { principal: who, admin: false }))
}

/// Authorizes `op` for `caller` (a refusal as the node link carries it).
fn authorize(d: &Daemon, caller: &Caller, op: &Operation) -> Result<(), PeerError> {
    crate::ops::dispatch::authorize(d, caller, op)
        .map(|_| ())
        .map_err(|e| PeerError::Denied { code: e.code, message: e.message.to_string() })
}

fn denied(e: &crate::memory::MemoryError) -> PeerError {
    let body = crate::ops::dispatch::errors::memory(e);
    PeerError::Denied { code: body.code, message: body.message.to_string() }
}

/// Where an answer runs, for the steps in it that block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    /// On a worker of the domain's runtime (the link's own task): a step that blocks (an
    /// `fsync`) leaves the worker first (`block_in_place`), so that the runtime's other
    /// tasks (links' TLS, etcd's lease) go on meanwhile.
    Worker,
    /// On a thread that may block (the blocking pool).
    Blocking,
}

impl On {
    /// Runs `f`, which may block, off the worker when on one.
    pub(super) fn blocking<T>(self, f: impl FnOnce() -> T) -> T {
        match self {
            On::Worker => tokio::task::block_in_place(f),
            On::Blocking => f(),
        }
    }
}

/// Saves the holds with `import` of `session` in them before it is granted; undoes it
/// when they could not be saved (a restart would forget that the node may map it). Only
/// a record that changed is written (a node importing a region it holds already changes
/// nothing): the write, off the worker when `on` one.
fn saved(d: &Daemon, session: u64, import: u64, on: On) -> Result<(), PeerError> {
    if d.memory.holds_are_saved() {
        return Ok(());
    }
    // The undo too: a release runs the registry's queued effects (a backing's removal).
    on.blocking(|| d.memory.save_holds().map_err(|e| {
        let _ = d.memory.release(session, import);
        tracing::error!(error = %crate::error_chain(&e), import, "an import across nodes was undone: the quarantine record could not be saved");
        PeerError::Denied {
            code: ErrorCode::Unavailable,
            message: format!("this node could not save who may map its memory: {}", crate::error_chain(&e)),
        }
    }))
}

impl Owner {
    /// The registry session of `peer`'s incarnation, made (with its revocations forwarded)
    /// on first use; an older incarnation's session is closed first (what it held is void,
    /// and the lift of its quarantine never reaches what this one imports). Refused for an
    /// incarnation the domain view does not list as live: an earlier one's link that is
    /// still up gets nothing new.
    ///
    /// The first ask of an incarnation may block (ending the last one's session saves the
    /// quarantine record): that, off the worker when `on` one.
    fn session(&self, d: &Arc<Daemon>, peer: &Peer, on: On) -> Result<u64, PeerError> {
        let current = || {
            let remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            remotes.get(&peer.identity.node).filter(|r| r.incarnation == peer.incarnation).map(|r| r.session)
        };
        match current() {
            Some(session) => Ok(session),
            None => on.blocking(|| self.new_session(d, peer, current)),
        }
    }

    /// [`Owner::session`] when `current` has none yet: made, once.
    fn new_session(&self, d: &Arc<Daemon>, peer: &Peer, current: impl Fn() -> Option<u64>) -> Result<u64, PeerError> {
        let node = &peer.identity.node;
        // One node's session is made once; other nodes' are not held up by it.
        let gate = self.setup.lock().unwrap_or_else(|p| p.into_inner()).entry(node.clone()).or_default().clone();
        let _setup = gate.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(session) = current() {
            return Ok(session);
        }
        // Checked under the gate, which `end_all` takes to end this node's session: one
        // set up across the end of this node's incarnation is refused at the latest when
        // published (below), and lifts no quarantine that end saved.
        let epoch = self.ended.load(std::sync::atomic::Ordering::Acquire);
        super::service::granting(d)?;
        let live = d.domain.as_ref().and_then(|x| x.view().members().find(|m| &m.name == node).map(|m| m.incarnation));
        if live != Some(peer.incarnation) {
            return Err(PeerError::Denied {
                code: ErrorCode::Unavailable,
                message: format!(
                    "node {node} is not a live member of the domain at incarnation {} (the view says {live:?})",
                    peer.incarnation
                ),
            });
        }
        let old = self.remotes.lock().unwrap_or_else(|p| p.into_inner()).remove(node);
        if let Some(old) = old {
            self.end(d, node, old, false);
        }
        let session = d.reserve_session();
        let outbox = Arc::new(Outbox::default());
        d.memory.remote_session(session, node, peer.incarnation, d.config.peer.shared_identities);
        self.returned(d, node, peer.incarnation);
        self.reached(d, node);
        d.events.sink(session, Topics::REVOCATION, Reach::All, revokes::sink(outbox.clone()));
        if let Some(domain) = &d.domain {
            domain.runtime().spawn(revokes::forward(Arc::downgrade(d), node.clone(), outbox.clone()));
        }
        let remote = Remote { incarnation: peer.incarnation, session, outbox };
        let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
        if self.ended.load(std::sync::atomic::Ordering::Acquire) != epoch {
            // This node's incarnation ended meanwhile: the session is nobody's.
            drop(remotes);
            self.end(d, node, remote, true);
            return Err(PeerError::Denied {
                code: ErrorCode::Unavailable,
                message: "this node's incarnation ended while the import was asked: ask again once it rejoined".into(),
            });
        }
        remotes.insert(node.clone(), remote);
        Ok(session)
    }

    /// This node's incarnation is over (its lease is lost): every importer node's session
    /// ends, as at a restart. The importers void what this incarnation granted when they
    /// see it gone; until each has (it reaches the next incarnation, returns as another
    /// one of its own, or an admin collects it), what it imported stays quarantined when
    /// freed. Before, the sessions lived on across the rejoin and their imports were held
    /// until the importer node itself restarted.
    /// Blocking (the quarantine record is saved): never on the domain runtime's workers.
    pub fn end_all(&self, d: &Daemon) {
        let all: Vec<(String, Remote)> = {
            let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            self.ended.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            remotes.drain().collect()
        };
        for (node, r) in all {
            let gate = self.setup.lock().unwrap_or_else(|p| p.into_inner()).entry(node.clone()).or_default().clone();
            let _setup = gate.lock().unwrap_or_else(|p| p.into_inner());
            self.departed.lock().unwrap_or_else(|p| p.into_inner()).entry(node.clone()).or_insert(r.incarnation);
            self.restored.lock().unwrap_or_else(|p| p.into_inner()).insert(node.clone());
            self.end(d, &node, r, true);
        }
    }

    /// Whether `session` is still `node`'s current one: an import recorded in a session
    /// that ended meanwhile (the node left or restarted) would be nobody's.
    fn still(&self, node: &str, session: u64) -> bool {
        self.remotes.lock().unwrap_or_else(|p| p.into_inner()).get(node).is_some_and(|r| r.session == session)
    }

    /// Undoes import `import` of `session`, recorded after the session ended.
    fn too_late(d: &Daemon, node: &str, session: u64, import: u64) -> PeerError {
        let _ = d.memory.release(session, import);
        PeerError::Denied {
            code: ErrorCode::Unavailable,
            message: format!("node {node}'s incarnation ended while its import was recorded: ask again"),
        }
    }

    /// Takes the importer nodes whose holds came back at start (once, when the daemon is
    /// attached, before any peer is served): they count as nodes that left at the
    /// incarnation they held them at.
    pub(super) fn adopt_restored(&self, d: &Daemon) {
        let nodes = d.memory.take_restored_holders();
        let mut departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
        for (node, incarnation) in &nodes {
            departed.entry(node.clone()).or_insert(*incarnation);
        }
        self.restored.lock().unwrap_or_else(|p| p.into_inner()).extend(nodes.into_iter().map(|(n, _)| n));
    }

    /// `node` reached this incarnation of the daemon: it voided what the last one granted
    /// before asking anything (`Importer::void_owner`), so what it held then is no longer
    /// mapped and the quarantine saved for it lifts.
    fn reached(&self, d: &Daemon, node: &str) {
        let was = self.restored.lock().unwrap_or_else(|p| p.into_inner()).remove(node);
        if was {
            self.departed.lock().unwrap_or_else(|p| p.into_inner()).remove(node);
            let bytes = d.memory.lift_quarantine(node, None);
            tracing::info!(peer = %node, bytes, "node link: an importer node reached this incarnation; the quarantine saved for it by the last one is lifted");
        }
    }

    /// `node` is live at `incarnation`: if it left at another, it holds nothing of this
    /// node's any more and its quarantine lifts.
    fn returned(&self, d: &Daemon, node: &str, incarnation: u64) {
        let back = {
            let mut departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
            match departed.get(node) {
                Some(&left) if left != incarnation => departed.remove(node).is_some(),
                _ => false,
            }
        };
        if back {
            let bytes = d.memory.lift_quarantine(node, None);
            tracing::info!(peer = %node, incarnation, bytes, "node link: an importer node that left is back as a new incarnation; its quarantine is lifted");
        }
    }

    /// The handle an [`ImportAsk`] names, checked by the registry (the secret in constant
    /// time), its export's subject, and the identity the import is recorded under, once the
    /// authorization table admits the asking node's client: a [`Principal::Peer`] with the
    /// partitions it claims (`object`: an `ImportObject`). Its refusals, like every refusal
    /// of this side, are logged and counted by `super::service` as the dispatch's are.
    fn admit(
        &self,
        d: &Daemon,
        peer: &Peer,
        ask: &ImportAsk,
        object: bool,
    ) -> Result<(ExportHandle, ExportSubject, Identity), PeerError> {
        ask.check()?;
        let handle =
            ExportHandle { node: None, region: ask.region, generation: ask.generation, secret: Secret(ask.secret) };
        let subject = d.memory.export_subject(&handle).map_err(|e| denied(&e))?;
        if subject.revoked {
            return Err(PeerError::Denied { code: ErrorCode::Revoked, message: "the export was revoked".into() });
        }
        let caller = caller(d, principal(d, peer, Some(ask)));
        let op = if object {
            Operation::ImportObject { handle, access: ask.access }
        } else {
            Operation::Import { handle, access: ask.access }
        };
        authorize(d, &caller, &op)?;
        Ok((handle, subject, caller.principal().owner()))
    }

    /// Serves an importer node's [`ImportAsk`].
    /// Nothing in it blocks but what [`On`] takes off a worker: the registry's import opens
    /// the region's file (as the file kept for truncation below is opened), a metadata
    /// lookup, never a wait for a device; an import undone (a release, which runs the
    /// registry's queued effects) goes through `on` too.
    pub fn import(&self, d: &Arc<Daemon>, peer: &Peer, ask: ImportAsk, on: On) -> Result<ImportGrant, PeerError> {
        let (handle, subject, cred) = self.admit(d, peer, &ask, false)?;
        let node = &peer.identity.node;
        // A region on the shared sim fabric is granted by its file to a node in the
        // scale-up domain of its device (`super::clique::scale_up`), one on a DAX device
        // over CXL devices with serials by its place in their set (`super::cxl`); any
        // other, and any the importer does not reach, copy-only (its bytes reached by
        // `Copy` chunks over the link: `super::copy`).
        // A data path the domain's settings leave out is not granted: the copy stays.
        let own = d.memory.own_file(ask.region);
        let allows = |kind| d.domain.as_ref().is_none_or(|domain| domain.allows(kind));
        let shared = match &own {
            Some(path) if allows(DataPathKind::SharedFile) => shared_file_for(d, path, &subject, node, ask.region, on)?,
            None if allows(DataPathKind::Cxl) => super::cxl::grant(d, ask.region).map(Shared::Cxl),
            _ => None,
        };
        let session = self.session(d, peer, on)?;
        let g = d.memory.import(&cred, session, &handle, ask.access).map_err(|e| denied(&e))?;
        saved(d, session, g.import, on)?;
        // The file is kept to truncate when the region goes: opened for writing here (the
        // grant's descriptor is read-only for a read-only import).
        let kept = match (&shared, &own) {
            (Some(Shared::File(_)), Some(path)) => Some(
                std::fs::OpenOptions::new().write(true).open(path).unwrap_or_else(|e| {
                    tracing::warn!(path = %path.display(), error = %e, "cannot open a region file for writing; kept as granted");
                    File::from(g.fd)
                }),
            ),
            _ => None,
        };
        {
            // Checked and kept under one lock: an end of the session either came before
            // (the import is undone) or comes after and closes the file with the others.
            let remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            if remotes.get(node).is_none_or(|r| r.session != session) {
                drop(remotes);
                return Err(on.blocking(|| Self::too_late(d, node, session, g.import)));
            }
            if let Some(file) = kept {
                self.files.lock().unwrap_or_else(|p| p.into_inner()).insert(g.import, (node.clone(), file));
            }
        }
        // A free that came between the import's record and the file's keeping above found
        // no file to truncate (the revocation's `ended` ran first): truncated here, so that
        // the importer's next load faults as after any free. Checked after the file is
        // kept: one of the two always sees the other.
        if matches!(shared, Some(Shared::File(_))) && !d.memory.region_live(g.region, g.generation) {
            on.blocking(|| self.ended(g.import, RevocationReason::Freed));
        }
        let reach = match &shared {
            Some(Shared::File(_)) => "shared file",
            Some(Shared::Cxl(_)) => "shared CXL",
            None => "copy-only",
        };
        tracing::info!(peer = %peer.identity.node, region = g.region, import = g.import, ?ask.access, reach, "node link: import granted");
        Ok(ImportGrant {
            import: g.import,
            region: g.region,
            generation: g.generation,
            len: g.len,
            offset: g.offset,
            gfa: crate::placement::region_gfa(d, g.region),
            shared,
        })
    }

    /// Serves an importer node's [`ImportAsk`] for a vendor object: a CUDA fabric handle
    /// goes to a node of the same NVLink domain (the importer's driver, with its IMEX
    /// channel, imports it); a POSIX descriptor is this host's only and is refused.
    pub fn import_object(&self, d: &Arc<Daemon>, peer: &Peer, ask: ImportAsk) -> Result<ObjectGrant, PeerError> {
        let (handle, subject, cred) = self.admit(d, peer, &ask, true)?;
        match subject.object {
            Some(ObjectKind::CudaFabric(_)) => {}
            Some(kind) => {
                return Err(PeerError::Denied {
                    code: ErrorCode::NotImplemented,
                    message: format!(
                        "region {} is a {}, a descriptor of this host that cannot cross nodes: export the allocation as a CUDA fabric handle",
                        ask.region,
                        kind.name()
                    ),
                });
            }
            None => {
                return Err(PeerError::Denied {
                    code: ErrorCode::BadRequest,
                    message: format!(
                        "region {} is fabric memory, not a vendor object: import it with Import",
                        ask.region
                    ),
                });
            }
        }
        for device in &subject.devices {
            super::clique::check(d, device, &peer.identity.node)?;
        }
        let node = &peer.identity.node;
        let session = self.session(d, peer, On::Blocking)?;
        let o = d
            .memory
            .import_object(&cred, session, &handle, ask.access, fabric_proto::wire::PROTOCOL_VERSION)
            .map_err(|e| denied(&e))?;
        saved(d, session, o.import, On::Blocking)?;
        if !self.still(node, session) {
            return Err(Self::too_late(d, node, session, o.import));
        }
        tracing::info!(peer = %peer.identity.node, region = o.region, import = o.import, "node link: vendor object granted");
        Ok(ObjectGrant {
            import: o.import,
            region: o.region,
            generation: o.generation,
            size: o.size,
            gfa: crate::placement::region_gfa(d, o.region),
            object: o.kind,
            device: o.device.to_string(),
        })
    }

    /// The registry session of `peer`'s current incarnation, if it imported anything.
    pub fn session_of(&self, peer: &Peer) -> Option<u64> {
        let remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
        remotes.get(&peer.identity.node).filter(|r| r.incarnation == peer.incarnation).map(|r| r.session)
    }

    /// Serves an importer node's [`ReleaseAsk`].
    pub fn release(&self, d: &Daemon, peer: &Peer, ask: ReleaseAsk) -> Result<(), PeerError> {
        authorize(d, &caller(d, principal(d, peer, None)), &Operation::Release { import: ask.import })?;
        let session =
            self.session_of(peer).ok_or_else(|| PeerError::Refused("no import of this incarnation".into()))?;
        d.memory.release(session, ask.import).map_err(|e| denied(&e))?;
        // Closed after the lock.
        let file = self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(&ask.import);
        drop(file);
        Ok(())
    }

    /// Releases what importer nodes that are no longer `live` at the incarnation they
    /// imported with held: a node that left has what it imported quarantined, one that
    /// restarted does not; a node that left and is back as another incarnation has its
    /// quarantine lifted, and so has one no longer `known` to the domain (an admin
    /// collected it).
    pub fn void_departed(&self, d: &Daemon, live: &HashMap<&str, u64>, known: &HashSet<&str>) {
        let departed: Vec<(String, Remote)> = {
            let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            // `live` may be older than a session set up since (`session` checks the
            // current view): a session the current view lists as live stays.
            let now = d.domain.as_ref().map(|x| x.view());
            let listed_now = |node: &str, incarnation: u64| now.as_ref().is_some_and(|v| listed(v, node, incarnation));
            let gone: Vec<String> = remotes
                .iter()
                .filter(|(node, r)| live.get(node.as_str()) != Some(&r.incarnation) && !listed_now(node, r.incarnation))
                .map(|(node, _)| node.clone())
                .collect();
            gone.into_iter().filter_map(|n| remotes.remove(&n).map(|r| (n, r))).collect()
        };
        for (node, r) in departed {
            let left = !live.contains_key(node.as_str());
            if left {
                self.departed.lock().unwrap_or_else(|p| p.into_inner()).insert(node.clone(), r.incarnation);
            }
            self.end(d, &node, r, left);
        }
        let back: Vec<(String, u64)> = {
            let departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
            departed.keys().filter_map(|n| live.get(n.as_str()).map(|i| (n.clone(), *i))).collect()
        };
        for (node, incarnation) in back {
            self.returned(d, &node, incarnation);
        }
        let collected: Vec<String> = {
            let mut departed = self.departed.lock().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<String> = departed.keys().filter(|n| !known.contains(n.as_str())).cloned().collect();
            gone.into_iter().filter(|n| departed.remove(n).is_some()).collect()
        };
        for node in collected {
            let bytes = d.memory.lift_quarantine(&node, None);
            tracing::info!(peer = %node, bytes, "node link: an importer node that left was collected; its quarantine is lifted");
        }
        // A node that is not live sets nothing up (its ask is refused), unless one that
        // began before this view still holds its gate.
        self.setup
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|node, gate| live.contains_key(node.as_str()) || Arc::strong_count(gate) > 1);
    }

    /// Ends an importer node incarnation's session: its imports released, its
    /// revocations no longer forwarded, the files kept for them closed. A node that
    /// `left` keeps what it imported quarantined; one that restarted holds nothing.
    fn end(&self, d: &Daemon, node: &str, r: Remote, left: bool) {
        r.outbox.close();
        d.events.unsubscribe(r.session);
        let untold = r.outbox.len();
        let reclaimed = d.memory.end_remote_session(r.session, left);
        if !left {
            d.memory.lift_quarantine(node, None);
        }
        // The files are closed after the lock.
        let closed: Vec<_> =
            self.files.lock().unwrap_or_else(|p| p.into_inner()).extract_if(|_, (n, _)| n == node).collect();
        drop(closed);
        tracing::info!(peer = %node, incarnation = r.incarnation, imports = reclaimed.imports, untold, left, "node link: an importer node left or restarted; its imports are released");
    }

    /// An import of a remote session ended: a region that is gone has its file truncated.
    pub(super) fn ended(&self, import: u64, reason: RevocationReason) {
        let gone = !matches!(reason, RevocationReason::Revoked);
        if !gone {
            return;
        }
        // Taken out first: the truncation is I/O, never under the lock.
        let file = self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(&import);
        if let Some((_, f)) = file
            && let Err(e) = f.set_len(0)
        {
            tracing::warn!(import, error = %e, "cannot truncate a freed region's file under a remote import");
        }
    }
}

/// The grant of region `region`'s file at `path` on the shared sim fabric to node `node`:
/// the file when `node` is in the scale-up domain of the region's device, `None`
/// (copy-only) when it is outside, refused `Unavailable` while that is not known. `None` at
/// once, without asking the domain's topology, when this node shares no files or `node`
/// maps none (its member record does not offer [`SHARED_FILE`]: no `peer.shared_dir`).
fn shared_file_for(
    d: &Daemon,
    path: &std::path::Path,
    subject: &ExportSubject,
    node: &str,
    region: u64,
    on: On,
) -> Result<Option<Shared>, PeerError> {
    let Ok(file) = shared_file(d, path) else { return Ok(None) };
    let maps_files = d
        .domain
        .as_ref()
        .is_some_and(|domain| domain.view().members().find(|m| m.name == node).is_some_and(|m| m.offers(SHARED_FILE)));
    if !maps_files {
        tracing::debug!(peer = %node, region, "node link: the importer maps no shared files; copy-only");
        return Ok(None);
    }
    // Every device the region lies on (each member of an interleave set).
    match subject.devices.iter().try_for_each(|device| super::clique::scale_up(d, device, node, on)) {
        Ok(()) => Ok(Some(Shared::File(file))),
        Err(NoReach::Outside(why)) => {
            tracing::info!(peer = %node, region, why, "node link: the importer is not in the region's scale-up domain; copy-only");
            Ok(None)
        }
        Err(NoReach::Unknown(why)) => {
            tracing::warn!(peer = %node, region, why, "node link: an import refused for now: whether the importer reaches the region is not known");
            Err(PeerError::Denied {
                code: ErrorCode::Unavailable,
                message: format!("whether node {node} reaches region {region} is not known yet ({why}): ask again"),
            })
        }
    }
}

/// The region file's place under `peer.shared_dir/<this node>/`: its resource directory
/// and name.
fn shared_file(d: &Daemon, path: &std::path::Path) -> Result<SharedFile, PeerError> {
    let not_shared = || PeerError::Denied {
        code: ErrorCode::NotImplemented,
        message: "this node's memory is not on a shared sim fabric (peer.shared_dir): copy the bytes instead".into(),
    };
    if d.domain.is_none() || d.config.peer.shared_dir.is_none() {
        return Err(not_shared());
    }
    let root = d.config.memory_root(&d.state_dir);
    let rel = path.strip_prefix(&root).map_err(|_| not_shared())?;
    let parts: Vec<&str> = rel.iter().filter_map(|c| c.to_str()).collect();
    let [resource, file] = parts.as_slice() else { return Err(not_shared()) };
    let f = SharedFile { resource: (*resource).to_owned(), file: (*file).to_owned() };
    wire::check_name("resource", &f.resource)?;
    wire::check_name("file", &f.file)?;
    Ok(f)
}
