//! The owner's side of an import across nodes: the handle checked by the registry (its
//! secret in constant time) and the policy by domain-wide tenants, the import recorded
//! against the importer node's incarnation (one registry session per importer node and
//! incarnation), and a grant that names the region's file on the shared sim fabric.
//! Revocations of those imports go back to the importer node over the link; a region
//! freed under a remote import has its file truncated, so the importer's next load
//! faults instead of reading memory that may be reused.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex, Weak};

use fabric_nodelink::{Peer, PeerError, PeerOp};
use fabric_proto::wire::{ErrorCode, Event, ExportHandle, PeerCred, RevocationReason, Secret, Topics};

use super::wire::{self, ImportAsk, ImportGrant, ReleaseAsk, RevokeNotice, SharedFile};
use crate::daemon::Daemon;
use crate::events::Reach;

/// The uid a remote importer is recorded under where identities are not shared: no local
/// user's (the limits per uid count it apart).
const REMOTE_UID: u32 = 65534;

/// One importer node's incarnation: its registry session.
#[derive(Debug)]
struct Remote {
    incarnation: u64,
    session: u64,
}

/// What the owner keeps for imports granted to other nodes.
#[derive(Debug, Default)]
pub struct Owner {
    /// By importer node.
    remotes: Mutex<HashMap<String, Remote>>,
    /// The file of each remote import, open: truncated if its region is freed (the
    /// registry removes the file, which would leave the importer's mapping reading the
    /// old pages).
    files: Mutex<HashMap<u64, (String, File)>>,
}

fn denied(e: &crate::memory::MemoryError) -> PeerError {
    let body = crate::ops::dispatch::errors::memory(e);
    PeerError::Denied { code: body.code, message: body.message.to_string() }
}

impl Owner {
    /// The registry session of `peer`'s incarnation, made (with its revocations forwarded)
    /// on first use; an older incarnation's session is closed (what it held is void).
    fn session(&self, d: &Arc<Daemon>, peer: &Peer) -> u64 {
        let node = &peer.identity.node;
        let (session, old) = {
            let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            match remotes.get(node) {
                Some(r) if r.incarnation == peer.incarnation => return r.session,
                _ => {}
            }
            let session = d.reserve_session();
            let old = remotes.insert(node.clone(), Remote { incarnation: peer.incarnation, session });
            (session, old)
        };
        if let Some(old) = old {
            self.end(d, node, old);
        }
        if let Some(rx) = d.events.subscribe(session, Topics::REVOCATION, Reach::All) {
            let (weak, node) = (Arc::downgrade(d), node.clone());
            if let Some(domain) = &d.domain {
                domain.runtime().spawn(forward(weak, node, rx));
            }
        }
        session
    }

    /// Serves an importer node's [`ImportAsk`].
    pub fn import(&self, d: &Arc<Daemon>, peer: &Peer, ask: ImportAsk) -> Result<ImportGrant, PeerError> {
        ask.check()?;
        let handle =
            ExportHandle { node: None, region: ask.region, generation: ask.generation, secret: Secret(ask.secret) };
        let subject = d.memory.export_subject(&handle).map_err(|e| denied(&e))?;
        if subject.revoked {
            return Err(PeerError::Denied { code: ErrorCode::Revoked, message: "the export was revoked".into() });
        }
        let policy = &subject.policy;
        let shared_ids = d.config.peer.shared_identities;
        if let Some(p) = &policy.partition
            && !ask.partitions.iter().any(|c| c.as_str() == p.as_str())
        {
            return Err(PeerError::Denied {
                code: ErrorCode::PermissionDenied,
                message: format!(
                    "the export is for partition {p:?}; the importer on node {} is not bound to it",
                    peer.identity.node
                ),
            });
        }
        if policy.partition.is_none() && !shared_ids {
            return Err(PeerError::Denied {
                code: ErrorCode::PermissionDenied,
                message: "the export names no partition and identities are not shared across this domain: an importer on another node needs an export for its partition".into(),
            });
        }
        let cred = if shared_ids {
            PeerCred { pid: 0, uid: ask.uid, gid: ask.gid }
        } else {
            PeerCred { pid: 0, uid: REMOTE_UID, gid: REMOTE_UID }
        };
        // A region on the shared sim fabric is granted by its file; any other is granted
        // copy-only (its bytes reached by `Copy` chunks over the link: `super::copy`).
        let file = d.memory.own_file(ask.region).and_then(|path| shared_file(d, &path).ok());
        let session = self.session(d, peer);
        let g = d.memory.import(&cred, session, &handle, ask.access).map_err(|e| denied(&e))?;
        if file.is_some() {
            let held = (peer.identity.node.clone(), File::from(g.fd));
            self.files.lock().unwrap_or_else(|p| p.into_inner()).insert(g.import, held);
        }
        tracing::info!(peer = %peer.identity.node, region = g.region, import = g.import, ?ask.access, copy_only = file.is_none(), "node link: import granted");
        Ok(ImportGrant {
            import: g.import,
            region: g.region,
            generation: g.generation,
            len: g.len,
            offset: g.offset,
            gfa: crate::placement::region_gfa(d, g.region),
            file,
        })
    }

    /// The registry session of `peer`'s current incarnation, if it imported anything.
    pub fn session_of(&self, peer: &Peer) -> Option<u64> {
        let remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
        remotes.get(&peer.identity.node).filter(|r| r.incarnation == peer.incarnation).map(|r| r.session)
    }

    /// Serves an importer node's [`ReleaseAsk`].
    pub fn release(&self, d: &Daemon, peer: &Peer, ask: ReleaseAsk) -> Result<(), PeerError> {
        let session = {
            let remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            match remotes.get(&peer.identity.node) {
                Some(r) if r.incarnation == peer.incarnation => r.session,
                _ => return Err(PeerError::Refused("no import of this incarnation".into())),
            }
        };
        d.memory.release(session, ask.import).map_err(|e| denied(&e))?;
        self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(&ask.import);
        Ok(())
    }

    /// Releases what importer nodes that are no longer `live` at the incarnation they
    /// imported with held.
    pub fn void_departed(&self, d: &Daemon, live: &HashMap<&str, u64>) {
        let departed: Vec<(String, Remote)> = {
            let mut remotes = self.remotes.lock().unwrap_or_else(|p| p.into_inner());
            let gone: Vec<String> = remotes
                .iter()
                .filter(|(node, r)| live.get(node.as_str()) != Some(&r.incarnation))
                .map(|(node, _)| node.clone())
                .collect();
            gone.into_iter().filter_map(|n| remotes.remove(&n).map(|r| (n, r))).collect()
        };
        for (node, r) in departed {
            self.end(d, &node, r);
        }
    }

    /// Ends an importer node incarnation's session: its imports released, its
    /// revocations no longer forwarded, the files kept for them closed.
    fn end(&self, d: &Daemon, node: &str, r: Remote) {
        d.events.subscribe(r.session, Topics::NONE, Reach::All);
        let reclaimed = d.memory.close_session(r.session);
        self.files.lock().unwrap_or_else(|p| p.into_inner()).retain(|_, (n, _)| n != node);
        tracing::info!(peer = %node, incarnation = r.incarnation, imports = reclaimed.imports, "node link: an importer node left or restarted; its imports are released");
    }

    /// An import of a remote session ended: a region that is gone has its file truncated.
    fn ended(&self, import: u64, reason: RevocationReason) {
        let gone = !matches!(reason, RevocationReason::Revoked);
        if !gone {
            return;
        }
        if let Some((_, f)) = self.files.lock().unwrap_or_else(|p| p.into_inner()).remove(&import)
            && let Err(e) = f.set_len(0)
        {
            tracing::warn!(import, error = %e, "cannot truncate a freed region's file under a remote import");
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

/// Forwards the revocations of `node`'s session to that node.
async fn forward(d: Weak<Daemon>, node: String, mut rx: tokio::sync::mpsc::Receiver<Event>) {
    while let Some(ev) = rx.recv().await {
        let Event::Revocation(r) = ev else { continue };
        let Some(d) = d.upgrade() else { return };
        let (Some(domain), Some(link)) = (d.domain.as_ref(), d.domain.as_ref().and_then(|x| x.link())) else { return };
        link.service().owner().ended(r.import, r.reason);
        let notice = RevokeNotice { revocation: r };
        match link.call(domain, &node, wire::request(PeerOp::Revoke, &notice)).await {
            Ok(_) => {
                tracing::info!(peer = %node, import = r.import, reason = ?r.reason, "node link: importer told of a revocation")
            }
            Err(e) => {
                tracing::warn!(peer = %node, import = r.import, error = %crate::error_chain(&e), "node link: cannot tell the importer of a revocation")
            }
        }
    }
}
