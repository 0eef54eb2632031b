//! The one dispatch: every operation a connection asks is applied by [`apply`], which
//! authorizes it at one point ([`authz::authorize`]), runs it, and logs its refusal.
//! What another node asks over the node link (an import of this node's export, the
//! release of one) is authorized by the same table ([`authorize`], for a
//! [`Principal::Peer`]) before `crate::peer::owner` grants it. Wire frames and Unix
//! credentials stay in the transport ([`crate::transport::server`], [`crate::ops`]); below this
//! module code sees a [`Principal`] and an [`Operation`].
//!
//! - [`operation`]: the operations and their checked arguments;
//! - [`authz`]: the authorization table;
//! - [`gate`]: the policy gate, which keeps an operation's check and its act on the same
//!   partition state;
//! - [`errors`]: the one mapping from internal errors to typed refusals.

pub mod authz;
pub mod errors;
pub mod gate;
pub mod operation;

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use fabric_addrmap::Snapshot;
use fabric_proto::wire::{ErrorBody, ErrorCode, Event, ExportHandle, Response, SubscribeResponse, Version};
use fabric_topology::DeviceId;
use tokio::sync::mpsc;

pub use operation::Operation;

use crate::daemon::Daemon;
use crate::memory::{Abandon, ExportSubject};
use crate::ops::principal::{Client, Principal};
use crate::ops::scope::Caller;
use crate::ops::{self, copyops, dmaops, memops, regions};
use errors::refusal;

/// Where an operation comes from: the client, its session, and what its connection
/// offers.
pub struct Context<'a> {
    /// Who, fixed at connect.
    pub client: &'a Arc<Client>,
    /// The session its objects belong to.
    pub session: u64,
    /// The request's id (a copy's completion travels under it).
    pub request_id: u64,
    /// The protocol version the connection negotiated (what it may be sent).
    pub version: Version,
    /// Asked between the pieces of long work a client controls (a pin): no one waits any
    /// more when it says why.
    pub abandon: Abandon<'a>,
    /// Where copy completions go; `None` outside a connection (copies and subscriptions
    /// need one).
    pub copies: Option<&'a crate::copy::Sink>,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("uid", &self.client.principal.uid())
            .field("session", &self.session)
            .field("request_id", &self.request_id)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

/// What an applied operation gives back.
#[derive(Debug)]
pub struct Outcome {
    /// The answer.
    pub response: Response,
    /// The descriptor that travels with it (`Alloc`, `Import`, ...).
    pub fd: Option<OwnedFd>,
    /// A new subscription's queue (`Subscribe`).
    pub events: Option<mpsc::Receiver<Event>>,
}

impl Outcome {
    fn answer(response: Response) -> Self {
        Self { response, fd: None, events: None }
    }

    fn with_fd(response: Response, fd: Option<OwnedFd>) -> Self {
        Self { response, fd, events: None }
    }
}

/// Applies one operation of `cx`'s client: authorized, run, its refusal (if any) logged.
pub fn apply(d: &Daemon, cx: &Context<'_>, op: Operation) -> Result<Outcome, ErrorBody> {
    let name = op.name();
    let r = authorized(d, cx, op);
    if let Err(e) = &r {
        d.refused(&cx.client.principal, name, e);
    }
    r
}

/// Logs the refusal of a request that did not become an operation (its arguments did
/// not check out), as [`apply`] logs those of operations.
pub fn refused_request(d: &Daemon, who: &Principal, op: &'static str, e: ErrorBody) -> ErrorBody {
    d.refused(who, op, &e);
    e
}

fn authorized(d: &Daemon, cx: &Context<'_>, op: Operation) -> Result<Outcome, ErrorBody> {
    // Taken before the scope is read, held until the effects are in place.
    let _pass = op.acts_under_policy(d.node).then(|| d.policy.enter());
    let caller = Caller::resolve(d, cx.client.clone());
    let grant = authorize(d, &caller, &op)?;
    run(d, cx, &caller, grant, op)
}

/// Whether `caller` may run `op`, against the daemon's policy state now: the one check
/// every operation passes, whether a connection asks ([`apply`]) or another node
/// (`crate::peer::owner`, for a [`Principal::Peer`]).
pub fn authorize(d: &Daemon, caller: &Caller, op: &Operation) -> Result<authz::Grant, ErrorBody> {
    authz::authorize(op, caller, &DaemonFacts::new(d, caller))
}

/// The policy state as the daemon holds it: the map the caller's scope was resolved
/// against (one view), the registry's exports.
struct DaemonFacts<'a> {
    d: &'a Daemon,
    snap: Arc<Snapshot>,
    /// The domain's partitions that bind the caller, as its scope was resolved.
    domain_partitions: &'a [fabric_domain::PartitionRecord],
}

impl<'a> DaemonFacts<'a> {
    fn new(d: &'a Daemon, caller: &'a Caller) -> Self {
        Self { d, snap: caller.snapshot().clone(), domain_partitions: &caller.domain_partitions }
    }
}

impl authz::Facts for DaemonFacts<'_> {
    /// A partition of this node's map, or of the domain (one that binds the caller, or any
    /// the node's view holds: an admin, bound to none, exports to a domain's tenant too).
    fn partition_exists(&self, name: &str) -> bool {
        self.snap.state().partitions.iter().any(|p| p.name == name)
            || self.domain_partitions.iter().any(|p| p.name == name)
            || self.d.domain.as_ref().is_some_and(|dom| dom.view().partitions().any(|p| p.name == name))
    }

    fn members(&self, names: &[String]) -> HashSet<DeviceId> {
        let domain = self.domain_partitions.iter().filter(|p| names.contains(&p.name)).flat_map(|p| p.devices.iter());
        self.snap
            .state()
            .partitions
            .iter()
            .filter(|p| names.contains(&p.name))
            .flat_map(|p| p.devices.iter())
            .chain(domain)
            .cloned()
            .collect()
    }

    fn set_devices(&self, name: &str) -> Option<Vec<DeviceId>> {
        let s = self.snap.state().interleaves.iter().find(|s| s.name == name)?;
        Some(s.members.iter().map(|m| m.device.clone()).collect())
    }

    fn export_subject(&self, handle: &ExportHandle) -> Option<ExportSubject> {
        self.d.memory.export_subject(handle).ok()
    }

    fn admin_group(&self) -> Option<&str> {
        self.d.config.socket.admin_group.as_deref()
    }

    fn is_this_node(&self, node: fabric_proto::wire::NodeId) -> bool {
        node == self.d.node
    }
}

fn needs_connection(what: &str) -> ErrorBody {
    refusal(ErrorCode::BadRequest, format!("{what} is answered on a connection, which gets what follows"))
}

/// Runs an authorized operation.
fn run(
    d: &Daemon,
    cx: &Context<'_>,
    caller: &Caller,
    grant: authz::Grant,
    op: Operation,
) -> Result<Outcome, ErrorBody> {
    use crate::peer::importer::{Imported, route_import};
    use Operation as O;
    let owner = caller.principal().owner();
    let session = cx.session;
    let answer = |r: Result<Response, ErrorBody>| r.map(Outcome::answer);
    match op {
        O::Status => answer(caller.status_view(d).and_then(|v| {
            let vanished = caller.vanished(d)?;
            let everything = caller.scope == crate::ops::scope::Scope::All;
            Ok(Response::Status(ops::status_in(d, &v, &vanished, everything)))
        })),
        O::Topology { node } => answer(
            ops::fabric_view(d, caller).and_then(|v| ops::topology_in(&v, node.as_deref())).map(Response::Topology),
        ),
        O::Devices { node } => answer(
            ops::fabric_view(d, caller).and_then(|v| ops::devices_in(&v, node.as_deref())).map(Response::Devices),
        ),
        O::Inventory { node } => answer(ops::inventory_in(d, caller, node.as_deref()).map(Response::Inventory)),
        O::Map { node } => answer(ops::map_listing_in(d, caller, node.as_deref()).map(Response::Map)),
        O::Translate { queries } => answer(ops::translate_in(d, caller, &queries, cx.version).map(Response::Translate)),
        O::Domain { action } => answer(ops::domain::request(d, caller, &action).map(Response::Domain)),
        O::ListPartitions => Ok(Outcome::answer(Response::Partitions(regions::partition_list(d, caller)))),
        O::SetPartition(change) => {
            regions::set_partition(d, caller, &change)?;
            // Acknowledged only once what was authorized against the old state is done.
            d.policy.changed();
            Ok(Outcome::answer(Response::Partitions(regions::partition_list(d, caller))))
        }
        O::RemovePartition { name } => {
            regions::remove_partition(d, caller, &name)?;
            d.policy.changed();
            Ok(Outcome::answer(Response::Partitions(regions::partition_list(d, caller))))
        }
        O::Regions { all } => {
            Ok(Outcome::answer(Response::Regions(d.memory.list(if all { None } else { Some(caller.uid()) }))))
        }
        O::Alloc { target, size, align } => memops::alloc(d, caller.snapshot(), &owner, session, &target, size, align)
            .map(|(r, fd)| Outcome::with_fd(r, Some(fd))),
        O::Adopt { place, size, object, fd } => answer(memops::adopt(d, &owner, session, &place, size, object, fd)),
        O::Free { region } => answer(memops::free(d, session, region)),
        O::Export { region, policy } => answer(memops::export(d, &owner, session, region, policy)),
        O::Revoke { handle } => answer(memops::revoke(d, session, &handle)),
        // Another node's handle, or an import of one: asked of its owner over the node link.
        O::Import { handle, access } => match route_import(d, cx, caller, (&handle, access), Imported::Region) {
            Some(across) => across,
            None => memops::import(d, &owner, session, &handle, access).map(|(r, fd)| Outcome::with_fd(r, Some(fd))),
        },
        O::ImportObject { handle, access } => match route_import(d, cx, caller, (&handle, access), Imported::Object) {
            Some(across) => across,
            None => memops::import_object(d, &owner, session, &handle, access, cx.version)
                .map(|(r, fd)| Outcome::with_fd(r, fd)),
        },
        O::Release { import } => match crate::peer::importer::route_release(d, session, import) {
            Some(across) => across.map(|()| Outcome::answer(Response::Release)),
            None => answer(memops::release(d, session, import)),
        },
        O::Register { device, from, offset, len, access } => {
            let req = dmaops::Registration { device, from, offset, len, access };
            answer(dmaops::register(d, caller.principal(), session, req, cx.abandon))
        }
        O::Unregister { registration } => answer(dmaops::unregister(d, session, registration)),
        O::Copy { copies, batch } => {
            let sink = cx.copies.ok_or_else(|| needs_connection("copy"))?;
            let r = copyops::Copies { caller, members: grant.members, session, request_id: cx.request_id };
            // One end in another node's memory this session imported: over the node link.
            if let Some(across) = crate::peer::copy::route(d, cx, &r, &copies, batch) {
                return across;
            }
            answer(copyops::submit(d, &r, &copies, batch, sink.clone()))
        }
        O::Subscribe { topics } => {
            if cx.copies.is_none() {
                return Err(needs_connection("subscribe"));
            }
            // Its reach follows its bindings: looked up for each event, not fixed now.
            let viewer = crate::events::Viewer::Client(caller.client.clone());
            let events = d.events.subscribe(session, topics, viewer);
            tracing::debug!(?topics, "subscribed");
            Ok(Outcome { response: Response::Subscribe(SubscribeResponse { topics }), fd: None, events })
        }
    }
}
