//! The requests this daemon serves, on the transport's side of the dispatch: a request
//! made an [`Operation`] and handed to [`dispatch::apply`] ([`request`], and
//! [`handle`] for in-process callers and tests), and the read-only answers the dispatch
//! builds (status, topology, devices, inventory, map, translation).

pub mod auth;
pub mod copyops;
pub mod dispatch;
pub mod dmaops;
pub mod domain;
pub mod domain_pages;
pub mod memops;
pub mod principal;
pub mod refusals;
pub mod regions;
pub mod scope;

use fabric_addrmap::{HoleOwner, Location, ResourceKey, Snapshot, TranslateError};
use fabric_proto::TopologyOptions;
use fabric_proto::wire::{
    BoundedVec, DeviceName, Document, ErrorBody, ErrorCode, ErrorText, Name, PROTOCOL_VERSION, Problem, ProblemKind,
    Request, ResourceName, Response, StatusResponse, TranslateQuery, TranslateResponse, Translation,
};
use fabric_topology::{BackendState, DeviceId, LinkState};

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::daemon::{Daemon, View};
use crate::transport::peer::Peer;
use dispatch::{Context, Operation, Outcome};
use principal::Client;
use scope::Caller;

pub use dispatch::errors::refusal;

/// Answers one request (not `Hello`) outside any session, dropping any descriptor the
/// answer carries: [`handle_session`] with session 0.
pub fn handle(d: &Daemon, peer: &Peer, req: Request) -> Result<Response, ErrorBody> {
    handle_session(d, peer, 0, req).map(|(r, _)| r)
}

/// Answers one request (not `Hello`) of `session`, with the descriptor the answer carries
/// (`Alloc` and `Import`), for an in-process caller with `peer`'s identity. Copies and
/// subscriptions need a connection.
pub fn handle_session(
    d: &Daemon,
    peer: &Peer,
    session: u64,
    req: Request,
) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
    if matches!(req, Request::Ping) {
        return Ok((Response::Ping, None));
    }
    let client = Arc::new(Client::accept(peer, d.admin_gid));
    let cx =
        Context { client: &client, session, request_id: 0, version: PROTOCOL_VERSION, abandon: &|| None, copies: None };
    request(d, &cx, req, Vec::new()).map(|o| (o.response, o.fd))
}

/// One request of `cx`'s client, with the descriptors that came with it (as many as
/// [`Request::fds_required`] says; the transport checked that): the node its handle or
/// region names checked
/// against this node, made an operation and applied by the one dispatch, and its answer
/// put in the form the connection's version reads (1.4 and older get node-less handles
/// and no grants: `fabric_proto::wire::Response::for_version`). Every refusal is logged
/// with the principal and the operation.
pub fn request(d: &Daemon, cx: &Context<'_>, req: Request, fds: Vec<OwnedFd>) -> Result<Outcome, ErrorBody> {
    let name = req.opcode().name();
    let version = cx.version;
    // A domain node with a node link asks another node's handles of their owner (the
    // dispatch routes them: `crate::peer::importer`).
    let asks_owners = d.domain.as_ref().is_some_and(|x| x.link().is_some());
    if let Err(e) = crate::nodeid::check_node(d.node, &req, version, asks_owners) {
        return Err(dispatch::refused_request(d, &cx.client.principal, name, e).for_version(version));
    }
    let op = Operation::from_request(req, fds, version)
        .map_err(|e| dispatch::refused_request(d, &cx.client.principal, name, e).for_version(version))?;
    dispatch::apply(d, cx, op)
        .map(|mut o| {
            o.response = o.response.for_version(version);
            o
        })
        .map_err(|e| e.for_version(version))
}

fn check_node(d: &View, node: Option<&str>) -> Result<(), ErrorBody> {
    match node {
        Some(n) if !d.nodes.iter().any(|x| x == n) => {
            Err(refusal(ErrorCode::NotFound, format!("no node {n:?} (nodes: {})", d.nodes.join(", "))))
        }
        _ => Ok(()),
    }
}

fn json_doc(schema: &str, write: impl FnOnce(&mut Vec<u8>) -> serde_json::Result<()>) -> Result<Document, ErrorBody> {
    let mut buf = Vec::new();
    write(&mut buf).map_err(|e| refusal(ErrorCode::Internal, format!("serialising {schema}: {e}")))?;
    let json = String::from_utf8(buf).map_err(|_| refusal(ErrorCode::Internal, "document is not UTF-8"))?;
    Ok(Document { schema: Name::truncated(schema), json })
}

/// The fabric `caller` asks about: on a domain node the domain's (every node's topology
/// record merged, the same on every node), otherwise the node's own; for a bound client,
/// its partitions' part of it.
pub fn fabric_view(d: &Daemon, caller: &Caller) -> Result<Arc<View>, ErrorBody> {
    let Some(domain) = &d.domain else { return caller.view(d) };
    let internal = |e: crate::daemon::StartError| refusal(ErrorCode::Internal, format!("domain fabric: {e}"));
    let merged = domain.fabric().map_err(internal)?;
    match caller.members()? {
        None => Ok(merged),
        // A bound client: its partitions' part of the domain's fabric.
        Some(m) => View::build(scope::scoped_inventory(&merged.fabric, &m)).map(Arc::new).map_err(internal),
    }
}

/// The `fabric.topology/v1` document, byte for byte what `fabricctl topology -o json`
/// writes (without the final newline).
pub fn topology(d: &Daemon, node: Option<&str>) -> Result<Document, ErrorBody> {
    topology_in(&d.view(), node)
}

/// The `fabric.topology/v1` document of a view (the whole fabric or a partition's).
pub fn topology_in(d: &View, node: Option<&str>) -> Result<Document, ErrorBody> {
    check_node(d, node)?;
    let opts = TopologyOptions { node: node.map(str::to_owned) };
    json_doc("fabric.topology/v1", |w| fabric_proto::topology::write_topology(w, &d.fabric, &d.order, &d.labels, &opts))
}

/// The `fabric.devices/v1` document.
pub fn devices(d: &Daemon, node: Option<&str>) -> Result<Document, ErrorBody> {
    devices_in(&d.view(), node)
}

/// The `fabric.devices/v1` document of a view.
pub fn devices_in(d: &View, node: Option<&str>) -> Result<Document, ErrorBody> {
    check_node(d, node)?;
    json_doc("fabric.devices/v1", |w| fabric_proto::topology::write_devices(w, &d.fabric, node))
}

/// The address map listing (`fabricctl map -o json`); the whole map (node filtering is
/// not offered for the map).
pub fn map_listing(d: &Daemon, node: Option<&str>) -> Result<Document, ErrorBody> {
    if node.is_some() {
        return Err(refusal(ErrorCode::BadRequest, "the map listing has no node filter"));
    }
    let listing = d.map_snapshot().listing();
    json_doc("fabric.map/v1", |w| serde_json::to_writer_pretty(w, &listing))
}

/// The address map listing as `caller` sees it: whole, or its partitions' ranges only.
pub fn map_listing_in(d: &Daemon, caller: &Caller, node: Option<&str>) -> Result<Document, ErrorBody> {
    if node.is_some() {
        return Err(refusal(ErrorCode::BadRequest, "the map listing has no node filter"));
    }
    let snap = caller.snapshot();
    let listing = match caller.members()? {
        // A domain node shows the domain's map, the same on every node.
        None => match &d.domain {
            Some(domain) => crate::tasks::domain::listing::listing(&domain.view()),
            None => snap.listing(),
        },
        // A bound client of a domain node: its partitions' part of the domain's map.
        Some(m) => match &d.domain {
            Some(domain) => scope::restrict_listing(crate::tasks::domain::listing::listing(&domain.view()), |r| {
                r.owner.split('#').next().and_then(|id| id.parse().ok()).is_some_and(|id| m.contains(&id))
            }),
            None => scope::scoped_listing(snap, &m),
        },
    };
    json_doc("fabric.map/v1", |w| serde_json::to_writer_pretty(w, &listing))
}

/// Translation as `caller` sees the map: whole (in a domain, the domain's: a GFA of
/// another node's slot names that node), or through its partitions' views. `version` is
/// the connection's, which decides how a GFA of another node is answered.
pub fn translate_in(
    d: &Daemon,
    caller: &Caller,
    queries: &[TranslateQuery],
    version: fabric_proto::wire::Version,
) -> Result<TranslateResponse, ErrorBody> {
    caller.require_scope()?;
    let snap = caller.snapshot();
    Ok(match &caller.scope {
        // A bound client of a domain node: the domain's answers, kept where they name a
        // device of its partitions.
        scope::Scope::Bound(_) if d.domain.is_some() => {
            let members: HashSet<String> =
                caller.members()?.unwrap_or_default().iter().map(ToString::to_string).collect();
            let mut r = translate(snap, queries);
            let mut results = r.results.into_vec();
            if let Some(domain) = &d.domain {
                domain::translate(domain, queries, &mut results, version);
            }
            for (q, t) in queries.iter().zip(results.iter_mut()) {
                if !scope::visible(q, t, &members) {
                    *t = Translation::NotInPartition;
                }
            }
            r.results = BoundedVec::new(results).unwrap_or_default();
            r
        }
        scope::Scope::Bound(names) => scope::translate_in(snap, names, queries),
        _ => {
            let mut r = translate(snap, queries);
            if let Some(domain) = &d.domain {
                let mut results = r.results.into_vec();
                domain::translate(domain, queries, &mut results, version);
                r.results = BoundedVec::new(results).unwrap_or_default();
            }
            r
        }
    })
}

/// The `fabric.inventory/v1` document: the inventory `caller` sees, which `fabricctl`
/// indexes and renders in any format exactly as it renders a local discovery.
pub fn inventory_in(d: &Daemon, caller: &Caller, node: Option<&str>) -> Result<Document, ErrorBody> {
    if node.is_some() {
        return Err(refusal(ErrorCode::BadRequest, "the inventory has no node filter (the client restricts it)"));
    }
    let v = fabric_view(d, caller)?;
    json_doc("fabric.inventory/v1", |w| serde_json::to_writer(w, v.fabric.inventory()))
}

/// The daemon's health: what is missing or degraded and why, and the counters.
pub fn status(d: &Daemon) -> StatusResponse {
    status_in(d, &d.view(), &d.vanished(), true)
}

/// The daemon's health with the devices and links of `view` and the `vanished` devices
/// (a partition's, for a bound client); the memory counters are the daemon's. The
/// daemon's own problems — functions refused for VFIO, the registry's (which name other
/// tenants' devices, regions and IOVA ranges) — only for a caller that sees `everything`.
pub fn status_in(d: &Daemon, view: &View, vanished: &[String], everything: bool) -> StatusResponse {
    let inv = view.fabric.inventory();
    let mut problems = Vec::new();
    for r in &inv.backends {
        let (kind, why) = match &r.state {
            BackendState::Present => continue,
            BackendState::NotPresent(why) => (ProblemKind::BackendMissing, why),
            BackendState::Failed(why) => (ProblemKind::BackendFailed, why),
        };
        problems.push(Problem {
            kind,
            subject: DeviceName::truncated(&r.backend),
            detail: ErrorText::truncated(why),
            bandwidth_permille: None,
        });
    }
    let refused_for_vfio: &[(String, String)] = if everything { d.vfio.refused() } else { &[] };
    for (bdf, why) in refused_for_vfio {
        problems.push(Problem {
            kind: ProblemKind::BackendFailed,
            subject: DeviceName::truncated(&format!("vfio:{bdf}")),
            detail: ErrorText::truncated(&format!("not taken for VFIO DMA (dma.vfio): {why}")),
            bandwidth_permille: None,
        });
    }
    for id in vanished {
        problems.push(Problem {
            kind: ProblemKind::DeviceMissing,
            subject: DeviceName::truncated(id),
            detail: ErrorText::truncated(
                "device vanished at a rescan (its memory is a hole in the map; its regions are lost, their exports revoked)",
            ),
            bandwidth_permille: None,
        });
    }
    for dev in &inv.devices {
        if let Some(why) = crate::tasks::monitor::failure(dev) {
            problems.push(Problem {
                kind: ProblemKind::DeviceFailed,
                subject: DeviceName::truncated(&dev.id.to_string()),
                detail: ErrorText::truncated(&format!("{why} (its regions are lost, their exports revoked)")),
                bandwidth_permille: None,
            });
        }
    }
    for l in &inv.links {
        let subject = || DeviceName::truncated(&format!("{}<->{}", inv.device(l.a).id, inv.device(l.b).id));
        match l.state {
            LinkState::Up => {}
            LinkState::Down => problems.push(Problem {
                kind: ProblemKind::LinkDown,
                subject: subject(),
                detail: ErrorText::truncated("link is down"),
                bandwidth_permille: Some(0),
            }),
            LinkState::Degraded => {
                let permille = match (l.bandwidth.current_mbps, l.bandwidth.max_mbps) {
                    (Some(c), Some(m)) if m > 0 => Some(u16::try_from(c.min(m) * 1000 / m).unwrap_or(1000)),
                    _ => None,
                };
                let detail = match (l.bandwidth.current_mbps, l.bandwidth.max_mbps) {
                    (Some(c), Some(m)) => format!("running at {c} of {m} MB/s per direction"),
                    _ => "running below its capability".to_owned(),
                };
                problems.push(Problem {
                    kind: ProblemKind::LinkDegraded,
                    subject: subject(),
                    detail: ErrorText::truncated(&detail),
                    bandwidth_permille: permille,
                });
            }
        }
    }
    let registry = if everything { d.memory.problems() } else { Vec::new() };
    for p in registry {
        problems.push(Problem {
            kind: ProblemKind::Other,
            subject: DeviceName::truncated("memory"),
            detail: ErrorText::truncated(&p),
            bandwidth_permille: None,
        });
    }
    problems.truncate(1024);
    let generation = d.map_snapshot().generation();
    let mem = d.memory.counts();
    StatusResponse {
        ready: true,
        uptime_s: d.uptime_s(),
        devices: u32::try_from(inv.devices.len()).unwrap_or(u32::MAX),
        links: u32::try_from(inv.links.len()).unwrap_or(u32::MAX),
        sessions: d.sessions(),
        regions: mem.regions,
        exports: mem.exports,
        imports: mem.imports,
        registrations: mem.registrations,
        allocated_bytes: mem.allocated_bytes,
        pinned_bytes: mem.pinned_bytes,
        map_generation: generation,
        problems: BoundedVec::new(problems).unwrap_or_default(),
    }
}

fn resource_name(key: &ResourceKey) -> ResourceName {
    ResourceName {
        device: DeviceName::truncated(&key.device.to_string()),
        memory: key.kind.into(),
        ordinal: key.ordinal,
    }
}

pub(crate) fn located(snap: &Snapshot, loc: &Location) -> Translation {
    Translation::Resource {
        resource: resource_name(snap.resource(loc.resource)),
        offset: loc.offset,
        set: loc.set.map(|s| Name::truncated(&snap.set(s).name)),
    }
}

pub(crate) fn failed(snap: &Snapshot, e: TranslateError) -> Translation {
    match e {
        TranslateError::Hole { owner, .. } => {
            let owner = match owner {
                HoleOwner::Resource(r) => {
                    let k = snap.resource(r);
                    format!(
                        "{}#{}{}",
                        k.device,
                        serde_json::to_value(k.kind)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_owned))
                            .unwrap_or_default(),
                        k.ordinal
                    )
                }
                HoleOwner::Set(s) => format!("set:{}", snap.set(s).name),
            };
            Translation::Hole { owner: DeviceName::truncated(&owner) }
        }
        TranslateError::NotInPartition { .. } => Translation::NotInPartition,
        TranslateError::Unmapped { .. } => Translation::Unmapped,
        _ => Translation::UnknownResource,
    }
}

/// Answers translation queries against one snapshot, in order.
pub fn translate(snap: &Snapshot, queries: &[TranslateQuery]) -> TranslateResponse {
    let results = queries
        .iter()
        .map(|q| match q {
            TranslateQuery::Gfa(g) => match snap.translate(*g) {
                Ok(loc) => located(snap, &loc),
                Err(e) => failed(snap, e),
            },
            TranslateQuery::Resource { resource, offset } => {
                let Ok(device) = resource.device.parse::<DeviceId>() else { return Translation::UnknownResource };
                match snap.reverse(&device, resource.memory.into(), resource.ordinal, *offset) {
                    Ok(g) => Translation::Gfa(g),
                    Err(e) => failed(snap, e),
                }
            }
        })
        .collect();
    // As many answers as queries, which the request bounds by the same limit.
    TranslateResponse { results: BoundedVec::new(results).unwrap_or_default() }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The daemon's own problems name devices and ranges of every tenant: a client that
    /// sees a partition (or nothing) does not get them. Before, `status` gave every
    /// caller the functions refused for VFIO and the registry's problems.
    #[test]
    fn a_status_of_part_of_the_fabric_leaves_out_the_daemons_own_problems() {
        let dir = tempfile::tempdir().unwrap();
        let sim = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
        let d = Daemon::on_sim_configured_for_tests(dir.path(), &sim, "[dma]\nvfio = [\"0000:99:00.0\"]\n");
        let vfio = |s: &StatusResponse| s.problems.iter().any(|p| p.subject.as_str().starts_with("vfio:"));
        assert!(vfio(&status_in(&d, &d.view(), &[], true)), "the function is refused (no such device)");
        assert!(!vfio(&status_in(&d, &d.view(), &[], false)));
    }
}
