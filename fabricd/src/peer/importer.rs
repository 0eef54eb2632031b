//! The importer's side of an import across nodes: a client's `Import` of a handle that
//! names another node of the domain, once the dispatch authorized it
//! ([`route_import`]), is asked of that node over the link; its grant names
//! the region's file on the shared sim fabric, which is opened here under this node's own
//! `peer.shared_dir` (the owner's name is the member this node dialled, the file's names
//! are single path components) and handed to the client as a local import's descriptor.
//! Where the two nodes share no memory fabric (class NET: no `peer.shared_dir` here, or a
//! region the owner does not keep on it) the client gets a copy-only grant instead: no
//! descriptor, the region's GFA, reached with `Copy` over the link ([`super::copy`]).
//! An `ImportObject` is asked the same way; its grant is a CUDA fabric handle the client's
//! driver imports.
//! The client's `Release` of such an import goes back to the owner; the owner's
//! revocations reach the client as the same `Revocation` events as local ones.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fabric_nodelink::{Peer, PeerError, PeerOp};
use fabric_proto::wire::{
    Access, AccessMode, Coherence, DeviceName, ErrorBody, ErrorCode, Event, ExportHandle, Grant, ImportObjectResponse,
    ImportResponse, NODE_IDENTITIES, NodeId, Response, Revocation, RevocationReason,
};

use super::DialError;
use super::members::listed;
use super::wire::{self, ImportAsk, ImportGrant, ObjectGrant, ReleaseAsk, RevokeNotice, Shared};
use crate::daemon::Daemon;
use crate::events::Reach;
use crate::ops::dispatch::errors::refusal;
use crate::ops::dispatch::{Context, Outcome};
use crate::ops::scope::Caller;

/// The bit that marks an import id as one of another node's regions (the registry's own
/// ids count up from 1 and never reach it).
pub const REMOTE_IMPORT: u64 = 1 << 62;

/// How long a client's import waits for the owner node.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);

/// One import of another node's region, held by a local session.
#[derive(Debug)]
struct Held {
    session: u64,
    owner: String,
    /// The owner's incarnation when it granted the import.
    incarnation: u64,
    owner_import: u64,
    region: u64,
    generation: u64,
    /// The region's GFA and bytes, and the access granted (what a copy may do).
    gfa: Option<u64>,
    len: u64,
    access: fabric_proto::wire::AccessMode,
    /// The owner said its export was revoked (held until released, but no copy uses it).
    revoked: bool,
    /// What an import of shared CXL memory holds here (its DPAs, a carved device), given
    /// back when the import ends (the device already when it is revoked).
    cxl: Option<super::cxl::Hold>,
}

/// A held import a copy reaches: where to send its chunks.
#[derive(Debug, Clone)]
pub(super) struct RemoteReach {
    /// The owner node's name.
    pub owner: String,
    /// The owner's import id.
    pub owner_import: u64,
    /// The owner's incarnation that granted it: a chunk goes to that one only (another
    /// incarnation's ids name other imports).
    pub owner_incarnation: u64,
    /// The region's first GFA and bytes.
    pub gfa: u64,
    /// Its bytes.
    pub len: u64,
    /// Whether the import may be written.
    pub writable: bool,
}

/// The imports this node's clients hold of other nodes' regions.
#[derive(Debug, Default)]
pub struct Importer {
    next: AtomicU64,
    held: Mutex<HashMap<u64, Held>>,
    /// Shared CXL imports the owner ended (freed, left) that the client has not released,
    /// by import id. Its whole-DAX mapping outlives the import, so the DPAs stay held until
    /// the client's `Release` or the end of its session. Locked after `held` when both are.
    ended: Mutex<HashMap<u64, Ended>>,
    devices: super::cxl::ImportDevices,
    /// Imports being asked and not in `held` yet, by (owner, region, generation): a
    /// revocation of that region that finds nothing held may be about one of them, and is
    /// refused so that the owner tells it again (an acknowledged end lifts the owner's
    /// quarantine of the memory). Locked after `held`.
    asking: Mutex<HashMap<AskKey, usize>>,
    /// The incarnation of each owner last dialled (its earlier incarnations' imports are
    /// void): an import an earlier one granted is not recorded after that. Locked after
    /// `held`.
    current: Mutex<HashMap<String, u64>>,
}

/// A shared CXL import its owner ended that the client has not released.
#[derive(Debug)]
struct Ended {
    session: u64,
    hold: super::cxl::Hold,
    /// `(owner, region, generation)` while the client may still reach the region's DPAs:
    /// a whole DAX device's mapping outlives the import (a carved device's mappings went
    /// with the device). No end of that region is acknowledged to the owner meanwhile
    /// (whichever import or incarnation of the owner's it names: the owner lifts this
    /// node's quarantine by region), so that it keeps the DPAs out of reuse
    /// ([`Importer::revoked`]).
    mapped: Option<(String, u64, u64)>,
}

/// Which region an import being asked is of: (owner, region, generation).
type AskKey = (String, u64, u64);

/// An import being asked ([`Importer::asking`]); counted until dropped, after the import
/// is recorded or refused.
struct Asking<'a> {
    importer: &'a Importer,
    key: AskKey,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let mut asking = self.importer.asking.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = asking.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                asking.remove(&self.key);
            }
        }
    }
}

/// What the client gets when the owner node cannot be asked.
fn unavailable(owner: &str, e: &DialError) -> ErrorBody {
    refusal(ErrorCode::Unavailable, format!("node {owner} cannot be asked: {}", crate::error_chain(e)))
}

/// The node link and the owner node a client's handle names, when it names another node
/// of a domain this node has a link in; `None`: the handle is this node's.
fn other_node<'a>(d: &'a Daemon, cx: &Context<'_>, handle: &ExportHandle) -> Option<(&'a super::NodeLink, NodeId)> {
    let link = d.domain.as_ref()?.link()?;
    match handle.node {
        Some(node) if node != d.node && cx.version >= NODE_IDENTITIES => Some((link, node)),
        _ => None,
    }
}

/// What a client imports: a region to map (`Import`) or a vendor object (`ImportObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Imported {
    /// A region, as a descriptor to map (or copy-only).
    Region,
    /// A vendor object (a CUDA fabric handle).
    Object,
}

/// The dispatch's `Import` or `ImportObject` of another node's handle, authorized (a
/// scope): asked of its owner. `None`: the handle is this node's.
pub fn route_import(
    d: &Daemon,
    cx: &Context<'_>,
    caller: &Caller,
    (handle, access): (&ExportHandle, AccessMode),
    what: Imported,
) -> Option<Result<Outcome, ErrorBody>> {
    let (link, node) = other_node(d, cx, handle)?;
    let domain = d.domain.as_ref()?;
    let to =
        owner_of(d, node).map(|(owner, incarnation)| Asked { link, domain, handle, access, node, owner, incarnation });
    Some(to.and_then(|to| match what {
        Imported::Region => import(d, cx, caller, to),
        Imported::Object => import_object(d, cx, caller, to),
    }))
}

/// A client's import of another node's handle, on its way to the owner.
struct Asked<'a> {
    link: &'a super::NodeLink,
    domain: &'a std::sync::Arc<crate::tasks::domain::Domain>,
    handle: &'a ExportHandle,
    access: AccessMode,
    /// The owner's node id, its name and its incarnation as the domain's view lists it.
    node: NodeId,
    owner: String,
    incarnation: u64,
}

/// The dispatch's `Release` of `import`, when it is one of another node's regions (its
/// id carries [`REMOTE_IMPORT`]): given back to the owner. `None`: a local import.
pub fn route_release(d: &Daemon, session: u64, import: u64) -> Option<Result<(), ErrorBody>> {
    if import & REMOTE_IMPORT == 0 {
        return None;
    }
    let link = d.domain.as_ref()?.link()?;
    Some(link.service().importer().release(d, session, import))
}

/// This node's incarnation now (0 outside a domain).
fn own_incarnation(d: &Daemon) -> u64 {
    d.domain.as_ref().map_or(0, |x| x.status().incarnation)
}

/// The owner of a remote handle: its name and incarnation, when this node may ask it.
fn owner_of(d: &Daemon, node: NodeId) -> Result<(String, u64), ErrorBody> {
    let Some(domain) = d.domain.as_ref() else {
        return Err(refusal(ErrorCode::WrongNode, "this node has no node link"));
    };
    let standing = domain.status().standing.clone();
    if standing != crate::tasks::domain::Standing::Joined {
        return Err(refusal(
            ErrorCode::Unavailable,
            format!(
                "this node is {standing} from its domain's etcd: new imports from other nodes are refused until it rejoins (established mappings keep working until its lease is lost)"
            ),
        ));
    }
    let id = node.to_string();
    owner_named(&domain.view(), &id)
}

/// The live member whose record carries node id `id`, and its incarnation. A member
/// writes its own record, node id included, so two may claim one id: then neither is
/// asked (the handle's secret would go to whichever sorts first), and the import is
/// refused until one of them leaves.
fn owner_named(view: &fabric_domain::DomainView, id: &str) -> Result<(String, u64), ErrorBody> {
    let claiming = view.members_with_node_id(id);
    let mut claiming = claiming.iter();
    let Some(first) = claiming.next() else {
        return Err(refusal(ErrorCode::WrongNode, format!("node {id} is no live member of the domain")));
    };
    if let Some(second) = claiming.next() {
        tracing::warn!(node_id = id, first = %first.name, second = %second.name, "two members of the domain claim one node id; imports of its handles refused");
        return Err(refusal(
            ErrorCode::Unavailable,
            format!(
                "members {} and {} both claim node id {id}: the owner of the handle is not known, and its secret goes to neither",
                first.name, second.name
            ),
        ));
    }
    Ok((first.name.clone(), first.incarnation))
}

/// Asks `owner` (incarnation `incarnation`, and no other: its grant's id is that one's)
/// for the import `i` of this client (`op`: `Import` or `ImportObject`) and decodes its
/// grant.
fn ask<T: serde::de::DeserializeOwned>(
    d: &Daemon,
    caller: &Caller,
    (handle, access): (&ExportHandle, AccessMode),
    (owner, incarnation): (&str, u64),
    op: PeerOp,
) -> Result<T, ErrorBody> {
    let Some(domain) = d.domain.as_ref() else {
        return Err(refusal(ErrorCode::WrongNode, "this node has no node link"));
    };
    let partitions = match caller.event_reach() {
        Reach::All => Vec::new(),
        Reach::Partitions(names) => names.into_iter().take(wire::MAX_CLAIMS).collect(),
    };
    let crate::ops::principal::Principal::Local(process) = caller.principal() else {
        return Err(refusal(ErrorCode::BadRequest, "a node imports for its own clients only"));
    };
    let cred = process.id;
    let ask = ImportAsk {
        region: handle.region,
        generation: handle.generation,
        secret: *handle.secret.expose(),
        access,
        uid: cred.uid,
        gid: cred.gid,
        partitions,
    };
    let Some(link) = domain.link() else {
        return Err(refusal(ErrorCode::WrongNode, "this node has no node link"));
    };
    // An answer that comes after this call gave up is a grant the owner recorded and
    // no client got: given back, or the owner would keep it (and count it against this
    // node's imports) until this node restarts.
    let late: super::direct::Late = {
        let (domain, owner) = (domain.clone(), owner.to_owned());
        Box::new(move |answer| {
            let Some(import) = wire::granted_import(&answer.body) else { return };
            tracing::info!(%owner, import, "a grant came after its import gave up; given back");
            if let Some(link) = domain.link() {
                link.service().importer().give_back(&domain, (&owner, incarnation), import);
            }
        })
    };
    // Asked here, on the request's thread, over a blocking link: no runtime worker
    // between the owner's answer and this thread.
    match link.call_here(domain, (owner, Some(incarnation)), wire::request(op, &ask), ASK_TIMEOUT, Some(late)) {
        Ok(r) => decoded(owner, &r.body, |import| {
            link.service().importer().give_back(domain, (owner, incarnation), import);
        }),
        Err(DialError::Peer { source: PeerError::Denied { code, message }, .. }) => {
            Err(refusal(code, format!("node {owner}: {message}")))
        }
        Err(e) => Err(unavailable(owner, &e)),
    }
}

/// The first wait before a release is told again, and the longest.
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(200);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(10);
/// How long a release is told again before it is given up (a link that can never be
/// made: an address that does not resolve, another CA's certificate).
const RELEASE_GIVE_UP: Duration = Duration::from_secs(600);

/// Whether a release that failed with `e` may still be held by the owner (told again):
/// not when the owner answered (but `Unavailable`: for now), is another incarnation, or
/// is no member any more.
fn release_untold(e: &DialError) -> bool {
    match e {
        DialError::Peer { source: PeerError::Denied { code, .. }, .. } => *code == ErrorCode::Unavailable,
        DialError::Peer { .. } | DialError::Restarted { .. } | DialError::NotMember(_) | DialError::NoLink => false,
        _ => true,
    }
}

/// `owner`'s grant in `body`; one with bytes after it (another version's, with a field
/// added) is still recorded at the owner: its import id goes to `back` to be given back
/// (no client gets it). A body whose head is no grant is given back to no one: its first
/// number may not be an import id at all, and releasing another live import would free
/// memory a client maps.
fn decoded<T: serde::de::DeserializeOwned>(owner: &str, body: &[u8], back: impl FnOnce(u64)) -> Result<T, ErrorBody> {
    wire::decode(body).map_err(|e| {
        let grant_first = postcard::take_from_bytes::<T>(body).is_ok();
        if grant_first && let Some(import) = wire::granted_import(body) {
            tracing::warn!(%owner, import, error = %e, "a grant that does not decode; given back");
            back(import);
        }
        refusal(ErrorCode::Internal, format!("node {owner}'s grant: {e}"))
    })
}

fn import(d: &Daemon, cx: &Context<'_>, caller: &Caller, to: Asked<'_>) -> Result<Outcome, ErrorBody> {
    let Asked { link, domain, handle, access, node, owner, incarnation } = to;
    let shared = d.config.peer.shared_dir.clone();
    let mine = own_incarnation(d);
    let _asking = link.service().importer().asking(&owner, handle.region, handle.generation);
    let grant: ImportGrant = ask(d, caller, (handle, access), (&owner, incarnation), PeerOp::Import)?;
    let write = access == AccessMode::ReadWrite;
    // The owner recorded an import this node cannot use: give it back.
    let give_back = || link.service().importer().give_back(domain, (&owner, incarnation), grant.import);
    grant
        .check()
        .map_err(|e| refusal(ErrorCode::Internal, format!("node {owner}'s grant: {e}")))
        .inspect_err(|_| give_back())?;
    // What the client maps (a descriptor and the offset in it), and what that holds here.
    // The sim's shared files are one host's memory, kept coherent by its caches.
    let (reach, cxl, coherence) = match (&shared, &grant.shared) {
        (Some(shared), Some(Shared::File(file))) => {
            let fd = open_shared(shared, &owner, &grant, file, write).inspect_err(|_| give_back())?;
            (Some((fd, grant.offset)), None, Coherence::Hardware)
        }
        (_, Some(Shared::Cxl(c))) => {
            let devices = &link.service().importer().devices;
            let region = (grant.region, grant.generation);
            match super::cxl::open(d, devices, &owner, region, c, grant.len, write).inspect_err(|_| give_back())? {
                Some(r) => (Some((r.fd, r.offset)), Some(r.hold), r.coherence),
                None => (None, None, Coherence::Hardware),
            }
        }
        _ => (None, None, Coherence::Hardware),
    };
    // Class NET: copy-only, which needs the region's GFA.
    if reach.is_none() && grant.gfa.is_none() {
        give_back();
        return Err(refusal(
            ErrorCode::NotImplemented,
            format!(
                "node {owner} shares no memory fabric with this node (class NET) and its region {} has no GFA: it can be neither mapped nor copied",
                grant.region
            ),
        ));
    }
    let local = held(
        d,
        link,
        cx,
        &owner,
        (incarnation, mine),
        (grant.import, grant.region, grant.generation),
        (grant.gfa, grant.len),
        (access, cxl),
    )?;
    let given = if reach.is_some() { Access::Fd } else { Access::CopyOnly };
    tracing::info!(owner = %owner, region = grant.region, import = local, access = ?given, "imported another node's region");
    let response = Response::Import(ImportResponse {
        import: local,
        region: grant.region,
        generation: grant.generation,
        size: grant.len,
        gfa: grant.gfa,
        offset: reach.as_ref().map_or(0, |(_, offset)| *offset),
        access,
        grant: Some(Grant::new(node, given).with_coherence(coherence)),
    });
    Ok(Outcome { response: response.for_version(cx.version), fd: reach.map(|(fd, _)| fd), events: None })
}

/// Records the owner's import `(owner import, region, generation)` of `(gfa, len)` for the
/// client's session, with the access it asked and what it holds here; the client's own
/// import id. Refused, with what it held here given back, when the owner restarted or
/// left since it granted the import (that incarnation's imports are void).
#[allow(clippy::too_many_arguments)]
fn held(
    d: &Daemon,
    link: &super::NodeLink,
    cx: &Context<'_>,
    owner: &str,
    (incarnation, mine): (u64, u64),
    (owner_import, region, generation): (u64, u64, u64),
    (gfa, len): (Option<u64>, u64),
    (access, cxl): (fabric_proto::wire::AccessMode, Option<super::cxl::Hold>),
) -> Result<u64, ErrorBody> {
    let importer = link.service().importer();
    let view = d.domain.as_ref().map(|domain| domain.view());
    if let Err(why) = gfa_of(view.as_deref(), owner, gfa, len) {
        if let Some(hold) = cxl {
            hold.end(d, &importer.devices);
        }
        if let Some(domain) = d.domain.as_ref() {
            importer.give_back(domain, (owner, incarnation), owner_import);
        }
        return Err(refusal(ErrorCode::Internal, format!("node {owner}'s grant: {why}")));
    }
    importer
        .hold(
            d,
            mine,
            Held {
                session: cx.session,
                owner: owner.to_owned(),
                incarnation,
                owner_import,
                region,
                generation,
                gfa,
                len,
                access,
                revoked: false,
                cxl,
            },
        )
        .map_err(|stale| {
            if let Some(hold) = stale.cxl {
                hold.end(d, &importer.devices);
            }
            // Whichever incarnation granted it holds nothing for this one (or ends this
            // node's old session soon): telling it costs nothing when it is gone.
            if let Some(domain) = d.domain.as_ref() {
                importer.give_back(domain, (owner, incarnation), owner_import);
            }
            refusal(
                ErrorCode::Unavailable,
                format!(
                    "node {owner} (incarnation {incarnation}) or this node (incarnation {mine}) restarted, rejoined or left while the import was granted; ask again"
                ),
            )
        })
}

/// Checks the GFA range `(gfa, len)` an owner's grant states: inside the domain's
/// address space of that owner (the slot the view gives it), both ends. A copy finds the
/// import by GFA (`Importer::reach`), so a range the owner does not hold would route a
/// client's copies of its own or a third node's memory to that owner.
fn gfa_of(view: Option<&fabric_domain::DomainView>, owner: &str, gfa: Option<u64>, len: u64) -> Result<(), String> {
    let Some(start) = gfa else { return Ok(()) };
    let last = len
        .checked_sub(1)
        .and_then(|l| start.checked_add(l))
        .ok_or_else(|| format!("a region of {len} bytes at GFA {start:#x} is empty or runs past the address space"))?;
    let view = view.ok_or("this node is in no domain")?;
    for at in [start, last] {
        match view.locate(at) {
            Some(l) if l.node == owner => {}
            Some(l) => return Err(format!("GFA {at:#x} lies in node {}'s slot, not {owner}'s", l.node)),
            None => return Err(format!("GFA {at:#x} lies in no node's slot of the domain")),
        }
    }
    Ok(())
}

/// `ImportObject` of another node's vendor object: the owner hands over a CUDA fabric
/// handle to a node of the same NVLink domain; the client's driver imports it (no
/// descriptor travels, nothing to open here).
fn import_object(d: &Daemon, cx: &Context<'_>, caller: &Caller, to: Asked<'_>) -> Result<Outcome, ErrorBody> {
    let Asked { link, domain, handle, access, node, owner, incarnation } = to;
    let mine = own_incarnation(d);
    let _asking = link.service().importer().asking(&owner, handle.region, handle.generation);
    let grant: ObjectGrant = ask(d, caller, (handle, access), (&owner, incarnation), PeerOp::ImportObject)?;
    let usable = grant.check().map_err(|e| refusal(ErrorCode::Internal, format!("node {owner}'s grant: {e}")));
    let usable = usable.and_then(|()| {
        if grant.object.since() > cx.version {
            Err(refusal(
                ErrorCode::NotImplemented,
                format!("the region is a {}, which needs protocol {}", grant.object.name(), grant.object.since()),
            ))
        } else {
            Ok(())
        }
    });
    if let Err(e) = usable {
        link.service().importer().give_back(domain, (&owner, incarnation), grant.import);
        return Err(e);
    }
    let local = held(
        d,
        link,
        cx,
        &owner,
        (incarnation, mine),
        (grant.import, grant.region, grant.generation),
        (grant.gfa, grant.size),
        (access, None),
    )?;
    tracing::info!(owner = %owner, region = grant.region, import = local, "imported another node's vendor object");
    let response = Response::ImportObject(ImportObjectResponse {
        import: local,
        region: grant.region,
        generation: grant.generation,
        size: grant.size,
        gfa: grant.gfa,
        access,
        object: grant.object,
        device: DeviceName::truncated(&grant.device),
        grant: Some(Grant::new(node, Access::Vendor).with_coherence(Coherence::Hardware)),
    });
    Ok(Outcome { response: response.for_version(cx.version), fd: None, events: None })
}

/// Opens `<shared>/<owner>/<resource>/<file>`: the resource directory checked as a
/// private directory (no symlink, the daemon's euid, not writable by others), the file by
/// name in it, and long enough for the grant.
fn open_shared(
    shared: &std::path::Path,
    owner: &str,
    g: &ImportGrant,
    f: &super::wire::SharedFile,
    write: bool,
) -> Result<OwnedFd, ErrorBody> {
    let dir_path = shared.join(owner).join(&f.resource);
    let bad = |what: String| refusal(ErrorCode::Unavailable, what);
    let dir = crate::sys::privdir::PrivateDir::open(&dir_path)
        .map_err(|e| bad(format!("{}: {}", dir_path.display(), crate::error_chain(&e))))?;
    let file =
        crate::sys::privdir::open_in(std::os::fd::AsFd::as_fd(&dir.into_fd()), std::ffi::OsStr::new(&f.file), write)
            .map_err(|e| bad(format!("{}/{}: {e}", dir_path.display(), f.file)))?;
    let size = file.metadata().map(|m| m.size()).unwrap_or(0);
    if size < g.offset.saturating_add(g.len) {
        return Err(refusal(
            ErrorCode::Revoked,
            format!("node {owner}'s region {} is gone (its file is short)", g.region),
        ));
    }
    Ok(OwnedFd::from(file))
}

/// Takes `import` out of `map` when `session` holds it; `Ok(None)` when it is not there,
/// refused when another session holds it.
fn take_own<T>(
    map: &mut HashMap<u64, T>,
    import: u64,
    session: u64,
    session_of: impl Fn(&T) -> u64,
) -> Result<Option<T>, ErrorBody> {
    match map.get(&import) {
        Some(t) if session_of(t) != session => {
            Err(refusal(ErrorCode::PermissionDenied, format!("import {import} belongs to another session")))
        }
        _ => Ok(map.remove(&import)),
    }
}

impl Importer {
    /// Counts an import of `owner`'s `(region, generation)` being asked until the guard
    /// drops.
    fn asking(&self, owner: &str, region: u64, generation: u64) -> Asking<'_> {
        let key = (owner.to_owned(), region, generation);
        *self.asking.lock().unwrap_or_else(|p| p.into_inner()).entry(key.clone()).or_default() += 1;
        Asking { importer: self, key }
    }

    /// Records `h`, asked while this node was incarnation `mine`, unless its owner's
    /// incarnation that granted it was voided meanwhile (this node dialled a newer one, or
    /// the owner is no live member at it any more), or this node's own incarnation `mine`
    /// ended (its lease lost: every import is voided, and a rejoin is another one): then `h`
    /// comes back, to give up. Checked under the `held` lock, which voiding takes too, so
    /// that an import is either voided or never recorded.
    fn hold(&self, d: &Daemon, mine: u64, h: Held) -> Result<u64, Box<Held>> {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let dialled = self.current.lock().unwrap_or_else(|p| p.into_inner()).get(&h.owner).copied();
        let live = d.domain.as_ref().is_some_and(|domain| {
            let me = domain.status();
            me.standing == crate::tasks::domain::Standing::Joined
                && me.incarnation == mine
                && listed(&domain.view(), &h.owner, h.incarnation)
        });
        if dialled.is_some_and(|c| c != h.incarnation) || !live {
            return Err(Box::new(h));
        }
        let id = REMOTE_IMPORT | (self.next.fetch_add(1, Ordering::Relaxed) + 1);
        held.insert(id, h);
        Ok(id)
    }

    /// The held import of `session` whose region holds `gfa`, if any: when the session
    /// holds several of one region, one not revoked first, then a writable one, then the
    /// newest.
    pub(super) fn reach(&self, session: u64, gfa: u64) -> Option<(u64, RemoteReach)> {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.iter()
            .filter_map(|(id, h)| {
                let start = h.gfa?;
                (h.session == session && start <= gfa && gfa - start < h.len).then(|| {
                    let writable = h.access == fabric_proto::wire::AccessMode::ReadWrite;
                    let (owner, owner_import, len) = (h.owner.clone(), h.owner_import, h.len);
                    let owner_incarnation = h.incarnation;
                    (*id, RemoteReach { owner, owner_import, owner_incarnation, gfa: start, len, writable }, h.revoked)
                })
            })
            .max_by_key(|(id, r, revoked)| (!revoked, r.writable, *id))
            .map(|(id, r, _)| (id, r))
    }

    /// Whether `import` is still held (not released, its owner not gone).
    pub(super) fn holds(&self, import: u64) -> bool {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&import)
    }

    /// Releases `import` of `session`: told to the owner node without waiting for it (its
    /// import ends with this node's incarnation anyway).
    fn release(&self, d: &Daemon, session: u64, import: u64) -> Result<(), ErrorBody> {
        let taken = take_own(&mut self.held.lock().unwrap_or_else(|p| p.into_inner()), import, session, |h| h.session);
        let Some(mut h) = taken? else { return self.release_ended(d, session, import) };
        if let Some(hold) = h.cxl.take() {
            hold.end(d, &self.devices);
        }
        if let Some(domain) = d.domain.as_ref() {
            self.give_back(domain, (&h.owner, h.incarnation), h.owner_import);
        }
        Ok(())
    }

    /// Releases `import` of `session` that its owner already ended: gives back what it
    /// held here (the owner knows it ended).
    fn release_ended(&self, d: &Daemon, session: u64, import: u64) -> Result<(), ErrorBody> {
        let taken = take_own(&mut self.ended.lock().unwrap_or_else(|p| p.into_inner()), import, session, |e| e.session);
        let Some(ended) = taken? else {
            return Err(refusal(ErrorCode::NotFound, format!("no import {import}")));
        };
        ended.hold.end(d, &self.devices);
        Ok(())
    }

    /// Keeps the hold of an import its owner ended until the client releases it; its
    /// carved device, if any, is returned to delete now (outside the locks).
    fn linger(&self, d: &Daemon, import: u64, h: Held) -> Option<super::cxl::Deleting> {
        let mut hold = h.cxl?;
        let device = hold.take_device(d);
        let mapped = hold.whole().then_some((h.owner, h.region, h.generation));
        self.ended.lock().unwrap_or_else(|p| p.into_inner()).insert(import, Ended { session: h.session, hold, mapped });
        device
    }

    /// The local import whose client still maps the DPAs of `owner`'s region `region`
    /// (at `generation`) after the owner ended it. Not by the owner's import id nor its
    /// incarnation: an owner that rejoined in the same process names the same region by
    /// another import, and another import's end lifts the same quarantine.
    fn still_mapped(&self, owner: &str, region: u64, generation: u64) -> Option<u64> {
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        ended.iter().find_map(|(k, e)| {
            let (o, r, g) = e.mapped.as_ref()?;
            (o == owner && *r == region && *g == generation).then_some(*k)
        })
    }

    /// Tells `owner` that its import `import` is released (in the background), until it
    /// answered. The owner's incarnation that granted it comes along: another incarnation
    /// is not told (its ids name other imports, and it holds none of the earlier one's).
    /// A release that gets no answer (the owner stopped or cut off, this node fenced for
    /// a moment) is told again with backoff, for as long as the owner is a member at that
    /// incarnation and this node is the incarnation that asked (another one's imports
    /// the owner ends when it sees it), for up to [`RELEASE_GIVE_UP`]; before, it was
    /// told once, and the owner held the import, counted against this node, until this
    /// node restarted.
    fn give_back(
        &self,
        domain: &std::sync::Arc<crate::tasks::domain::Domain>,
        (owner, granted): (&str, u64),
        import: u64,
    ) {
        let (domain, owner) = (domain.clone(), owner.to_owned());
        let ours = domain.status().incarnation;
        domain.clone().runtime().spawn(async move {
            let since = std::time::Instant::now();
            let mut wait = RELEASE_RETRY_FIRST;
            let mut told = 0u32;
            loop {
                let Some(link) = domain.link() else { return };
                let release = wire::request(PeerOp::Release, &ReleaseAsk { import });
                let e = match link.call_granted(&domain, &owner, granted, release).await {
                    Ok(_) => return,
                    Err(e) => e,
                };
                told += 1;
                let why = crate::error_chain(&e);
                if !release_untold(&e) {
                    // It answered (an import it no longer holds), or holds nothing of this
                    // incarnation's any more.
                    tracing::info!(%owner, import, error = %why, "an import's release ends without the owner's answer: it holds none");
                    return;
                }
                if domain.status().incarnation != ours {
                    tracing::info!(%owner, import, "an import's release ends: this node is another incarnation now");
                    return;
                }
                if since.elapsed() >= RELEASE_GIVE_UP {
                    tracing::error!(%owner, import, told, error = %why, "an import's release never reached its owner; given up (the owner holds it until this node restarts)");
                    return;
                }
                if told == 1 {
                    tracing::warn!(%owner, import, error = %why, "cannot release an import at its owner; told again");
                } else {
                    tracing::debug!(%owner, import, told, error = %why, "cannot release an import at its owner");
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(RELEASE_RETRY_MAX);
            }
        });
    }

    /// Releases every import `session` held (its client left).
    pub fn close_session(&self, d: &Daemon, session: u64) {
        let ids: Vec<u64> = {
            let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            held.iter().filter(|(_, h)| h.session == session).map(|(k, _)| *k).collect()
        };
        for id in ids {
            let _ = self.release(d, session, id);
        }
        let ended: Vec<super::cxl::Hold> = {
            let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
            let ids: Vec<u64> = ended.iter().filter(|(_, e)| e.session == session).map(|(k, _)| *k).collect();
            ids.into_iter().filter_map(|k| ended.remove(&k)).map(|e| e.hold).collect()
        };
        for hold in ended {
            hold.end(d, &self.devices);
        }
    }

    /// Ends the imports of owners that are no longer `live` at the incarnation that
    /// granted them: their holders get `OwnerExited`, as when a local owner's process
    /// exits.
    pub fn void_departed(&self, d: &Daemon, live: &HashMap<&str, u64>) {
        self.void_departed_as_of(d, live, || d.domain.as_ref().map(|x| x.view()));
    }

    /// [`Self::void_departed`] with the current view read by `now`, under the `held` lock:
    /// `live` may be older than an import recorded since ([`Self::hold`] checks the
    /// current view), and an import of an owner incarnation the current view lists stays.
    fn void_departed_as_of(
        &self,
        d: &Daemon,
        live: &HashMap<&str, u64>,
        now: impl FnOnce() -> Option<Arc<fabric_domain::DomainView>>,
    ) {
        let current: std::cell::OnceCell<Option<Arc<fabric_domain::DomainView>>> = std::cell::OnceCell::new();
        self.void(
            d,
            |h| {
                live.get(h.owner.as_str()) != Some(&h.incarnation)
                    && !current.get().and_then(Option::as_ref).is_some_and(|v| listed(v, &h.owner, h.incarnation))
            },
            || {
                let _ = current.set(now());
            },
        );
    }

    /// Ends every import this node holds: its own incarnation is over (a lost lease), and
    /// owners release what it imported.
    pub fn void_all(&self, d: &Daemon) {
        let n = self.held.lock().unwrap_or_else(|p| p.into_inner()).len();
        if n > 0 {
            tracing::warn!(
                imports = n,
                "this node's incarnation is over: its clients' imports of other nodes' memory end"
            );
        }
        self.void(d, |_| true, || {});
    }

    /// Ends the imports of `owner` granted by another incarnation than `incarnation`, which
    /// this node is about to ask: an owner told anything by this node knows it holds
    /// nothing of an earlier incarnation (its quarantine of what was imported then lifts,
    /// `memory/holds.rs`).
    pub fn void_owner(&self, d: &Daemon, owner: &str, incarnation: u64) {
        self.void(
            d,
            |h| h.owner == owner && h.incarnation != incarnation,
            || {
                self.current.lock().unwrap_or_else(|p| p.into_inner()).insert(owner.to_owned(), incarnation);
            },
        );
    }

    /// Ends the held imports `gone` picks; `under_lock` runs first under the `held` lock
    /// (so that no import it makes void is recorded after). Blocking (a carved device is
    /// deleted): never on the domain runtime's workers.
    fn void(&self, d: &Daemon, gone: impl Fn(&Held) -> bool, under_lock: impl FnOnce()) {
        let mut devices = Vec::new();
        let ended: Vec<(u64, u64, u64, u64, String)> = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            under_lock();
            let ids: Vec<u64> = held.iter().filter(|(_, h)| gone(h)).map(|(k, _)| *k).collect();
            let mut out = Vec::new();
            for k in ids {
                let Some(h) = held.remove(&k) else { continue };
                out.push((k, h.session, h.region, h.generation, h.owner.clone()));
                devices.extend(self.linger(d, k, h));
            }
            out
        };
        for deleting in devices {
            deleting.finish(d, &self.devices);
        }
        for (local, session, region, generation, owner) in ended {
            tracing::info!(owner = %owner, region, import = local, "the owner node left or restarted; its import is revoked");
            let ev = Revocation { region, generation, import: local, reason: RevocationReason::OwnerExited };
            d.events.send_to(session, Event::Revocation(ev));
        }
    }

    /// Serves an owner node's [`RevokeNotice`]: the session holding the import gets the
    /// same `Revocation` event a local import's holder gets; a region that is gone ends
    /// the import here too.
    pub fn revoked(&self, d: &Daemon, peer: &Peer, notice: RevokeNotice) -> Result<(), PeerError> {
        let r = notice.revocation;
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        // (local import, session, region, generation) of each import the notice is about.
        let found: Vec<(u64, u64, u64, u64)> = held
            .iter()
            // Its ids are the granting incarnation's: another one's notice names other imports.
            .filter(|(_, h)| {
                h.owner == peer.identity.node && h.incarnation == peer.incarnation && h.owner_import == r.import
            })
            .map(|(k, h)| (*k, h.session, h.region, h.generation))
            .collect();
        // Revoked or gone, the import's device goes (its mappings with it): only what the
        // owner still grants stays reachable. Its DPAs stay held until the client
        // releases it (a whole DAX device's mapping outlives the import).
        let key = (peer.identity.node.clone(), r.region, r.generation);
        if found.is_empty() && self.asking.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key) {
            // Perhaps about an import of this owner not recorded yet: acknowledged now,
            // the owner would reuse memory the client is about to map. Told again later,
            // it finds the import.
            return Err(PeerError::Refused(format!(
                "an import from node {} is being recorded here: tell import {} again",
                peer.identity.node, r.import
            )));
        }
        let mut devices = Vec::new();
        for (k, ..) in &found {
            if matches!(r.reason, RevocationReason::Revoked) {
                if let Some(h) = held.get_mut(k) {
                    h.revoked = true;
                    devices.extend(h.cxl.as_mut().and_then(|c| c.take_device(d)));
                }
            } else if let Some(h) = held.remove(k) {
                devices.extend(self.linger(d, *k, h));
            }
        }
        drop(held);
        for deleting in devices {
            deleting.finish(d, &self.devices);
        }
        for (local, session, region, generation) in found {
            let ev = Revocation { region, generation, import: local, reason: r.reason };
            d.events.send_to(session, Event::Revocation(ev));
        }
        // The region ended, and a client here still maps a whole DAX device over its DPAs:
        // acknowledged now, the owner would hand them to another region under that
        // mapping. Refused until the client releases the import (or its session ends);
        // the owner keeps the range quarantined and tells it again.
        if !matches!(r.reason, RevocationReason::Revoked)
            && let Some(local) = self.still_mapped(&peer.identity.node, r.region, r.generation)
        {
            return Err(PeerError::Refused(format!(
                "import {local} of node {}'s region {} is still mapped by its client here (a whole DAX device): tell import {} again once it is released",
                peer.identity.node, r.region, r.import
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::Path;

    use fabric_nodelink::NodeIdentity;

    use super::*;

    /// A view of live members, each `(name, node id)`.
    fn members(of: &[(&str, &str)]) -> fabric_domain::DomainView {
        use fabric_domain::records::{Keys, MemberRecord, RECORD_VERSION, RecordLimits, encode};
        let keys = Keys::new("d");
        let entries: Vec<(String, Vec<u8>)> = of
            .iter()
            .map(|(name, id)| {
                let record = MemberRecord {
                    version: RECORD_VERSION,
                    name: (*name).to_owned(),
                    incarnation: 7,
                    peer_address: "127.0.0.1:7471".into(),
                    capabilities: Vec::new(),
                    groups: Vec::new(),
                    software: "test".into(),
                    node_id: Some((*id).to_owned()),
                };
                (keys.member(name), encode(&record))
            })
            .collect();
        let entries = entries.iter().map(|(k, v)| (k.as_bytes(), v.as_slice()));
        fabric_domain::DomainView::load(keys.clone(), RecordLimits::default(), entries, 1)
    }

    /// A grant's GFA range must lie in its owner's slot, both ends: a copy finds its
    /// import by GFA, so a range elsewhere would route copies of other memory to it.
    #[test]
    fn a_grant_whose_gfas_lie_outside_its_owners_slot_is_refused() {
        use fabric_domain::records::{Keys, RecordLimits, SlotClaim, encode};
        use fabric_domain::{DataPathKind, DomainSettings};
        const SPAN: u64 = 1 << 40;
        let keys = Keys::new("d");
        let entries = [
            (keys.settings(), encode(&DomainSettings::new(57, SPAN, vec![DataPathKind::SharedFile]))),
            (keys.slot(1), encode(&SlotClaim::new(1, "tray0"))),
            (keys.slot(2), encode(&SlotClaim::new(2, "tray1"))),
        ];
        let view = fabric_domain::DomainView::load(
            keys.clone(),
            RecordLimits::default(),
            entries.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())),
            1,
        );
        let view = Some(&view);
        assert_eq!(gfa_of(view, "tray0", None, 1 << 21), Ok(()), "copy-only grants of no GFA have nothing to check");
        assert_eq!(gfa_of(view, "tray0", Some(SPAN + (1 << 21)), 1 << 21), Ok(()));
        assert_eq!(gfa_of(view, "tray0", Some(2 * SPAN - (1 << 21)), 1 << 21), Ok(()), "up to the slot's last byte");
        let cases = [
            (Some(2 * SPAN), 1 << 21, "in node tray1's slot"),
            (Some(2 * SPAN - (1 << 21)), 1 << 22, "in node tray1's slot"),
            (Some(5 * SPAN), 1 << 21, "in no node's slot"),
            (Some(u64::MAX - 7), 1 << 21, "runs past the address space"),
            (Some(SPAN), 0, "is empty"),
        ];
        for (gfa, len, why) in cases {
            let e = gfa_of(view, "tray0", gfa, len).unwrap_err();
            assert!(e.contains(why), "{gfa:?}+{len}: {e}");
        }
        assert!(gfa_of(None, "tray0", Some(SPAN), 1 << 21).is_err(), "no domain, no owner's slot");
    }

    /// A handle's owner is the one member that carries its node id: another member
    /// writing the same id into its own record makes the owner unknown, and neither is
    /// asked (the handle's secret would go to whichever sorts first).
    #[test]
    fn a_node_id_two_members_claim_names_no_owner() {
        let (a, b) = ("00000000000000aa", "00000000000000bb");
        assert_eq!(owner_named(&members(&[("tray0", a), ("tray1", b)]), a).unwrap(), ("tray0".to_owned(), 7));
        let twice = owner_named(&members(&[("a-evil", a), ("tray0", a), ("tray1", b)]), a).unwrap_err();
        assert_eq!(twice.code, ErrorCode::Unavailable);
        assert!(twice.message.contains("a-evil") && twice.message.contains("tray0"), "{}", twice.message);
        let none = owner_named(&members(&[("tray1", b)]), a).unwrap_err();
        assert_eq!(none.code, ErrorCode::WrongNode);
    }

    fn daemon(dir: &Path) -> Daemon {
        Daemon::on_sim_for_tests(dir)
    }

    /// Session 1's read-only import of node a's region 1, a's import 7 at incarnation 1.
    fn held_of_a() -> Held {
        Held {
            session: 1,
            owner: "a".to_owned(),
            incarnation: 1,
            owner_import: 7,
            region: 1,
            generation: 1,
            gfa: None,
            len: 4096,
            access: fabric_proto::wire::AccessMode::ReadOnly,
            revoked: false,
            cxl: None,
        }
    }

    fn freed(import: u64) -> RevokeNotice {
        RevokeNotice { revocation: Revocation { region: 1, generation: 1, import, reason: RevocationReason::Freed } }
    }

    /// A grant that does not decode whole is given back (the owner recorded it); before,
    /// it was refused here and held at the owner until this node restarted.
    #[test]
    fn a_grant_that_does_not_decode_is_given_back() {
        let grant = ObjectGrant {
            import: 300,
            region: 1,
            generation: 1,
            size: 4096,
            gfa: None,
            object: fabric_proto::wire::ObjectKind::CudaPosixFd,
            device: "gpu0".into(),
        };
        let mut body = wire::response(PeerOp::ImportObject, &grant).body;
        let mut back = None;
        assert!(decoded::<ObjectGrant>("a", &body, |i| back = Some(i)).is_ok());
        assert_eq!(back, None, "a grant that decodes is kept");
        body.push(0);
        let refused = decoded::<ObjectGrant>("a", &body, |i| back = Some(i)).unwrap_err();
        assert_eq!(refused.code, ErrorCode::Internal);
        assert_eq!(back, Some(300), "given back");
        // Nothing readable, or a head that is no grant: nothing to give back.
        let mut nothing = None;
        assert!(decoded::<ObjectGrant>("a", &[], |i| nothing = Some(i)).is_err());
        assert!(decoded::<ObjectGrant>("a", &[42], |i| nothing = Some(i)).is_err());
        assert_eq!(nothing, None);
    }

    #[test]
    fn an_end_that_finds_nothing_while_an_import_of_its_owner_is_asked_is_told_again() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let importer = Importer::default();
        let peer = Peer {
            identity: NodeIdentity::new("dom", "a").unwrap(),
            incarnation: 1,
            addr: "127.0.0.1:9".parse().unwrap(),
            version: fabric_nodelink::PEER_PROTOCOL,
        };
        assert!(importer.revoked(&d, &peer, freed(7)).is_ok(), "nothing asked, nothing held: acknowledged");
        let asked = importer.asking("a", 1, 1);
        let other = importer.asking("b", 1, 1);
        let elsewhere = importer.asking("a", 2, 1);
        // The import of a's region may be the one a ended: acknowledged now, a would
        // reuse memory this node's client is about to be handed.
        assert!(matches!(importer.revoked(&d, &peer, freed(7)), Err(PeerError::Refused(_))));
        drop(asked);
        assert!(
            importer.revoked(&d, &peer, freed(7)).is_ok(),
            "another owner's import, or one of another region of a, says nothing of this one"
        );
        drop((other, elsewhere));
        assert!(importer.asking.lock().unwrap().is_empty(), "every guard counted down");
    }

    /// An owner's import ids are its incarnation's: after it restarted, the new
    /// incarnation's notice about its import 7 ends another import than the one the old
    /// incarnation granted as 7. Before, it ended this one.
    #[test]
    fn a_notice_of_another_incarnation_of_the_owner_ends_none_of_the_earlier_ones_imports() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let importer = Importer::default();
        let held = held_of_a();
        importer.held.lock().unwrap().insert(70, held);
        let peer = |incarnation| Peer {
            identity: NodeIdentity::new("dom", "a").unwrap(),
            incarnation,
            addr: "127.0.0.1:9".parse().unwrap(),
            version: fabric_nodelink::PEER_PROTOCOL,
        };
        assert!(importer.revoked(&d, &peer(2), freed(7)).is_ok());
        assert!(importer.holds(70), "incarnation 2's import 7 is not incarnation 1's");
        assert!(importer.revoked(&d, &peer(1), freed(7)).is_ok());
        assert!(!importer.holds(70), "the granting incarnation's notice ends it");
    }

    /// A freed region's import that a client here maps through a whole DAX device: the
    /// client is told at once, but the owner's end is acknowledged only once the client
    /// released it, so that the owner keeps its DPAs out of reuse meanwhile. Before, it was
    /// acknowledged at once.
    #[test]
    fn the_end_of_an_import_mapped_through_a_whole_dax_device_waits_for_its_release() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let importer = Importer::default();
        let range = crate::memory::ForeignRange::for_tests();
        let held = Held { cxl: Some(super::super::cxl::Hold::whole_device_for_tests(range)), ..held_of_a() };
        importer.held.lock().unwrap().insert(70, held);
        let viewer = crate::events::Viewer::Fixed(crate::events::Reach::All);
        let mut events = d.events.subscribe(1, fabric_proto::wire::Topics::REVOCATION, viewer).unwrap();
        let peer = Peer {
            identity: NodeIdentity::new("dom", "a").unwrap(),
            incarnation: 1,
            addr: "127.0.0.1:9".parse().unwrap(),
            version: fabric_nodelink::PEER_PROTOCOL,
        };
        let first = importer.revoked(&d, &peer, freed(7));
        assert!(matches!(&first, Err(PeerError::Refused(m)) if m.contains("still mapped")), "{first:?}");
        assert!(!importer.holds(70), "ended here at once");
        assert!(events.try_recv().is_ok(), "the client is told at once");
        let again = importer.revoked(&d, &peer, freed(7));
        assert!(matches!(again, Err(PeerError::Refused(_))), "{again:?}");
        assert!(events.try_recv().is_err(), "told once");
        // Any end of that region is refused: another import of it, or import 7 told by
        // the owner at another incarnation (it rejoined in the same process, its registry
        // kept). Before, both were acknowledged and the owner reused the DPAs.
        assert!(importer.revoked(&d, &peer, freed(8)).is_err(), "another import of the region");
        let rejoined = Peer { incarnation: 2, ..peer.clone() };
        assert!(importer.revoked(&d, &rejoined, freed(7)).is_err(), "the owner at another incarnation");
        // Another region's end is acknowledged.
        let other = RevokeNotice { revocation: Revocation { region: 2, ..freed(8).revocation } };
        assert!(importer.revoked(&d, &peer, other).is_ok());
        importer.release(&d, 1, 70).unwrap();
        assert!(importer.revoked(&d, &peer, freed(7)).is_ok(), "released: acknowledged");

        // A carved device's import, revoked first (its device deleted then), then freed:
        // nothing maps the DPAs any more, so the end is acknowledged at once.
        let range = crate::memory::ForeignRange::for_tests();
        let held = Held { cxl: Some(super::super::cxl::Hold::device_taken_for_tests(range)), ..held_of_a() };
        importer.held.lock().unwrap().insert(71, held);
        assert!(importer.revoked(&d, &peer, freed(7)).is_ok(), "a carved device's end waits for nothing");
    }

    /// The view a departure is judged on may be older than an import recorded since: a
    /// returning owner's import granted at an incarnation the current view lists stays.
    /// Before, it was voided (`OwnerExited`) on the older view, which had no such member.
    #[test]
    fn an_import_the_current_view_lists_its_owner_for_survives_an_older_view() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let importer = Importer::default();
        // `members` lists its nodes at incarnation 7.
        importer.held.lock().unwrap().insert(70, Held { incarnation: 7, ..held_of_a() });
        let older: HashMap<&str, u64> = HashMap::new();
        let now = Arc::new(members(&[("a", "00000000000000aa")]));
        importer.void_departed_as_of(&d, &older, || Some(now.clone()));
        assert!(importer.holds(70), "the current view lists a at 7");
        let restarted = Arc::new(members(&[("b", "00000000000000bb")]));
        importer.void_departed_as_of(&d, &older, || Some(restarted));
        assert!(!importer.holds(70), "neither view lists a at 7: voided");
        importer.held.lock().unwrap().insert(71, Held { incarnation: 7, ..held_of_a() });
        let live: HashMap<&str, u64> = [("a", 7)].into();
        importer.void_departed_as_of(&d, &live, || None);
        assert!(importer.holds(71), "the view handed lists a at 7");
    }

    #[test]
    fn an_import_whose_owner_is_not_live_at_its_incarnation_is_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let d = daemon(dir.path());
        let importer = Importer::default();
        let h = held_of_a();
        let back = importer.hold(&d, 0, h).unwrap_err();
        assert_eq!((back.owner.as_str(), back.owner_import), ("a", 7));
        assert!(importer.held.lock().unwrap().is_empty());
    }
}
