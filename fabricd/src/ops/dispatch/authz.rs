//! The authorization table: whether a caller may run an operation, decided in one place
//! for every operation ([`authorize`]) from the caller (its principal, whether it is an
//! admin, its scope) and the facts of the policy state ([`Facts`]).
//!
//! | operation | rule (besides a client bound to nothing while partitions are required: `PermissionDenied`) |
//! |---|---|
//! | status, partitions list, subscribe | anyone (they answer through the caller's scope) |
//! | topology, devices, inventory, map, translate, copy | a scope |
//! | partitions set / remove, regions of all uids | an admin (`AdminRequired`) |
//! | alloc, adopt, register | the device (every member device of a set) in the caller's partitions |
//! | export | a policy partition exists (`NotFound`) and binds the caller |
//! | import, import-object | an export for a partition binds the caller; otherwise its region's device is in the caller's partitions; another node's export: a scope (its owner node checks the policy against the partitions the ask carries: `crate::peer::owner`) |
//! | free, revoke, release, unregister, regions of one's own | anyone; the registry checks that the session owns the object, in the critical section that acts on it |
//!
//! Another node of the domain (a [`Principal::Peer`]) has its own short table (`peer` below):
//! an import of this node's export by the partitions its client is bound to there, the
//! release of one, nothing else.
//!
//! Admins are bound to every partition. The export's own policy (uids, gids, access) is
//! the registry's to check, under the lock that creates the import.

use std::collections::HashSet;

use fabric_proto::wire::{ErrorBody, ErrorCode, ExportHandle};
use fabric_topology::DeviceId;

use super::errors::refusal;
use super::operation::{Operation, Target};
use crate::memory::ExportSubject;
use crate::ops::principal::{PeerNode, Principal};
use crate::ops::scope::{Caller, Scope};

/// What the table reads of the policy state: one view of the partitions, the map's sets
/// and the registry's exports.
pub trait Facts {
    /// Whether the map has a partition `name`.
    fn partition_exists(&self, name: &str) -> bool;
    /// The member devices of partitions `names`, together.
    fn members(&self, names: &[String]) -> HashSet<DeviceId>;
    /// The member devices of interleave set `name`; `None` when the map has no such set.
    fn set_devices(&self, name: &str) -> Option<Vec<DeviceId>>;
    /// What the export `handle` names is about; `None` when it names no export.
    fn export_subject(&self, handle: &ExportHandle) -> Option<ExportSubject>;
    /// The configured admin group, for messages.
    fn admin_group(&self) -> Option<&str>;
    /// Whether `node` is this one (a handle naming another node is that node's to judge).
    fn is_this_node(&self, node: fabric_proto::wire::NodeId) -> bool;
}

/// What an authorized operation may reach beyond what the table checked: the devices of a
/// copy's endpoints are known only once the registry resolves them.
#[derive(Debug, Default)]
pub struct Grant {
    /// The devices the caller's partitions hold; `None`: no restriction.
    pub members: Option<HashSet<DeviceId>>,
}

/// Decides whether `caller` may run `op`.
pub fn authorize(op: &Operation, caller: &Caller, facts: &dyn Facts) -> Result<Grant, ErrorBody> {
    use Operation as O;
    if let Principal::Peer(node) = caller.principal() {
        return peer(op, node, facts);
    }
    match op {
        O::Status | O::ListPartitions | O::Subscribe { .. } => Ok(Grant::default()),
        O::Free { .. } | O::Revoke { .. } | O::Release { .. } | O::Unregister { .. } => Ok(Grant::default()),
        O::Regions { all: false } => Ok(Grant::default()),
        O::Regions { all: true } => admin(caller, facts, "listing every uid's regions"),
        O::SetPartition(_) | O::RemovePartition { .. } => admin(caller, facts, "changing partitions"),
        O::Domain { action: fabric_proto::wire::DomainAction::Gc { .. } } => {
            admin(caller, facts, "freeing a node's domain slot")
        }
        O::Domain { .. } => caller.require_scope().map(|()| Grant::default()),
        O::Topology { .. } | O::Devices { .. } | O::Inventory { .. } | O::Map { .. } | O::Translate { .. } => {
            caller.require_scope().map(|()| Grant::default())
        }
        O::Copy { .. } => Ok(Grant { members: members(caller, facts)? }),
        O::Alloc { target: Target::Place(p), .. } | O::Adopt { place: p, .. } => device(caller, facts, &p.device),
        O::Register { device: d, .. } => device(caller, facts, d),
        O::Alloc { target: Target::Set(name), .. } => set(caller, facts, name),
        O::Export { policy, .. } => export(caller, facts, policy.partition.as_deref()),
        O::Import { handle, .. } | O::ImportObject { handle, .. } => import(caller, facts, handle),
    }
}

fn admin(caller: &Caller, facts: &dyn Facts, what: &str) -> Result<Grant, ErrorBody> {
    if caller.admin() {
        return Ok(Grant::default());
    }
    let group = facts.admin_group().unwrap_or("(none configured)");
    Err(refusal(
        ErrorCode::AdminRequired,
        format!("{what} needs root or membership of socket.admin_group {group}; uid {} is neither", caller.uid()),
    ))
}

/// The member devices of the caller's partitions (`None`: no restriction).
fn members(caller: &Caller, facts: &dyn Facts) -> Result<Option<HashSet<DeviceId>>, ErrorBody> {
    caller.require_scope()?;
    Ok(match &caller.scope {
        Scope::Bound(names) => Some(facts.members(names)),
        _ => None,
    })
}

fn outside(caller: &Caller, device: &DeviceId) -> ErrorBody {
    refusal(
        ErrorCode::PermissionDenied,
        format!("device {device} is not in the caller's partitions ({})", caller.partition_names()),
    )
}

/// `Alloc`, `Adopt`, `Register`: a bound client reaches only its partitions' devices (a
/// device's DMA domain, its IOVAs and, under VFIO, its IOMMU mappings are its tenant's).
fn device(caller: &Caller, facts: &dyn Facts, device: &DeviceId) -> Result<Grant, ErrorBody> {
    match members(caller, facts)? {
        Some(m) if !m.contains(device) => Err(outside(caller, device)),
        _ => Ok(Grant::default()),
    }
}

/// `Alloc` on an interleave set: every member device must be the caller's. A set the map
/// does not have passes here: the allocation says `NotFound`.
fn set(caller: &Caller, facts: &dyn Facts, name: &str) -> Result<Grant, ErrorBody> {
    let Some(m) = members(caller, facts)? else { return Ok(Grant::default()) };
    let devices = facts.set_devices(name).unwrap_or_default();
    match devices.iter().find(|d| !m.contains(d)) {
        Some(d) => Err(outside(caller, d)),
        None => Ok(Grant::default()),
    }
}

/// `Export`: a policy may name only an existing partition its exporter is bound to.
fn export(caller: &Caller, facts: &dyn Facts, partition: Option<&str>) -> Result<Grant, ErrorBody> {
    let Some(p) = partition else { return Ok(Grant::default()) };
    if !facts.partition_exists(p) {
        return Err(refusal(
            ErrorCode::NotFound,
            format!("the export policy names partition {p:?}, which does not exist"),
        ));
    }
    if !caller.in_partition(p) {
        return Err(refusal(
            ErrorCode::PermissionDenied,
            format!("uid {} may not export to partition {p:?}: it is not bound to it", caller.uid()),
        ));
    }
    Ok(Grant::default())
}

/// `Import`: an export whose policy names a partition admits only clients bound to it
/// (admins too); otherwise a bound client imports only regions on its partitions'
/// devices. Another node's export is its owner's to judge, against the partitions the
/// caller's ask carries. A handle that names no live export passes here and is refused by the
/// registry (`InvalidHandle`, `Revoked`), which checks it again under its lock.
fn import(caller: &Caller, facts: &dyn Facts, handle: &ExportHandle) -> Result<Grant, ErrorBody> {
    caller.require_scope()?;
    if handle.node.is_some_and(|n| !facts.is_this_node(n)) {
        return Ok(Grant::default());
    }
    let Some(subject) = facts.export_subject(handle) else { return Ok(Grant::default()) };
    if subject.revoked {
        return Ok(Grant::default());
    }
    if let Some(p) = &subject.policy.partition {
        if caller.in_partition(p) {
            return Ok(Grant::default());
        }
        return Err(refusal(
            ErrorCode::PermissionDenied,
            format!("the export is for partition {p:?}; uid {} is not bound to it", caller.uid()),
        ));
    }
    let Some(m) = members(caller, facts)? else { return Ok(Grant::default()) };
    // Every device the region lies on: a region of an interleave set is striped over all
    // of its members.
    match subject.devices.iter().find(|dev| !m.contains(*dev)) {
        Some(dev) => Err(refusal(
            ErrorCode::PermissionDenied,
            format!(
                "the region lies on {dev}, outside the caller's partitions ({}); its exporter may name a partition in the policy",
                caller.partition_names()
            ),
        )),
        None => Ok(Grant::default()),
    }
}

/// What another node may ask for its client (over the node link: `crate::peer::owner`):
/// an import of this node's export, judged by the export's policy against the domain's
/// partitions its client is bound to there (the node's claims) — an export for no
/// partition only where the domain shares identities (the registry then checks the
/// export's uids and gids) — and the release of one of its imports (the registry checks
/// that its session holds it). Nothing else. A revoked or unknown export passes here and
/// is refused by the registry, as for a local client.
fn peer(op: &Operation, node: &PeerNode, facts: &dyn Facts) -> Result<Grant, ErrorBody> {
    use Operation as O;
    match op {
        O::Release { .. } => Ok(Grant::default()),
        O::Import { handle, .. } | O::ImportObject { handle, .. } => {
            let Some(subject) = facts.export_subject(handle).filter(|s| !s.revoked) else {
                return Ok(Grant::default());
            };
            match &subject.policy.partition {
                Some(p) if node.claims(p) => Ok(Grant::default()),
                Some(p) => Err(refusal(
                    ErrorCode::PermissionDenied,
                    format!("the export is for partition {p:?}; the importer on node {} is not bound to it", node.node),
                )),
                None if node.shared_identities => Ok(Grant::default()),
                None => Err(refusal(
                    ErrorCode::PermissionDenied,
                    format!(
                        "the export names no partition and identities are not shared across this domain: the importer on node {} needs an export for its partition",
                        node.node
                    ),
                )),
            }
        }
        other => Err(refusal(
            ErrorCode::PermissionDenied,
            format!("node {} asked for {}, which no node asks of another", node.node, other.name()),
        )),
    }
}

#[cfg(test)]
mod tests;
