//! The operations the daemon applies, one variant per request, with their arguments
//! checked: device ids parsed, targets resolved to places, descriptors matched to what
//! each operation takes. The transport builds one from a wire request
//! ([`Operation::from_request`]); nothing below [`super::apply`] sees a request frame.

use std::os::fd::OwnedFd;

use fabric_proto::wire::{
    AccessMode, AllocTarget, CopyRequest, ErrorBody, ErrorCode, ExportHandle, ExportPolicy, ObjectKind,
    PartitionsRequest, RegisterSource, Request, Topics, TranslateQuery, Version,
};
use fabric_topology::DeviceId;

use super::errors::refusal;
use crate::memory::Place;

/// Where an allocation goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One device's memory (one resource of it, or any of a kind).
    Place(Place),
    /// An interleave set of the map, by name.
    Set(String),
}

/// What a registration pins.
#[derive(Debug)]
pub enum RegisterFrom {
    /// A region of the session.
    Region(u64),
    /// An import of the session.
    Import(u64),
    /// The memory object sent with the request.
    Fd(OwnedFd),
    /// The connecting process's own memory at this address.
    Process {
        /// First byte.
        addr: u64,
    },
}

/// A partition's new devices and bindings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionChange {
    /// Name (not empty).
    pub name: String,
    /// Member devices.
    pub devices: Vec<DeviceId>,
    /// Uids bound.
    pub uids: Vec<u32>,
    /// Gids bound.
    pub gids: Vec<u32>,
}

/// One operation with its checked arguments.
#[derive(Debug)]
pub enum Operation {
    /// The daemon's health.
    Status,
    /// The topology document, of one node or all.
    Topology { node: Option<String> },
    /// The devices document.
    Devices { node: Option<String> },
    /// The inventory document.
    Inventory { node: Option<String> },
    /// The address map listing.
    Map { node: Option<String> },
    /// The domain's status or nodes, or the admin's slot gc.
    Domain { action: fabric_proto::wire::DomainAction },
    /// GFA and resource translations.
    Translate { queries: Vec<TranslateQuery> },
    /// The partitions the caller may see.
    ListPartitions,
    /// Create or replace a partition (admins).
    SetPartition(PartitionChange),
    /// Remove a partition (admins).
    RemovePartition { name: String },
    /// The caller's regions, exports and imports, or everyone's (`all`, admins).
    Regions { all: bool },
    /// A new region.
    Alloc { target: Target, size: u64, align: u64 },
    /// A vendor object made a region; `fd` is its descriptor when it travels as one.
    Adopt { place: Place, size: u64, object: ObjectKind, fd: Option<OwnedFd> },
    /// Free a region of the session.
    Free { region: u64 },
    /// Export a region of the session.
    Export { region: u64, policy: ExportPolicy },
    /// Revoke an export of a region of the session.
    Revoke { handle: ExportHandle },
    /// Import a region by handle, as a descriptor to map.
    Import { handle: ExportHandle, access: AccessMode },
    /// Import an adopted region by handle, as its vendor object.
    ImportObject { handle: ExportHandle, access: AccessMode },
    /// Release an import of the session.
    Release { import: u64 },
    /// Pin memory and map it for a device's DMA.
    Register { device: DeviceId, from: RegisterFrom, offset: u64, len: u64, access: AccessMode },
    /// End a registration of the session.
    Unregister { registration: u64 },
    /// Queue copies: one (`batch` false) or a batch with one completion.
    Copy { copies: Vec<CopyRequest>, batch: bool },
    /// Replace the connection's event subscription.
    Subscribe { topics: Topics },
}

fn device(s: &str) -> Result<DeviceId, ErrorBody> {
    s.parse::<DeviceId>().map_err(|e| refusal(ErrorCode::BadRequest, format!("device {s:?}: {e}")))
}

fn node(n: Option<fabric_proto::wire::Name>) -> Option<String> {
    n.map(|n| n.as_str().to_owned())
}

/// Where an `Alloc` or `Adopt` target lies.
fn target(target: &AllocTarget) -> Result<Target, ErrorBody> {
    Ok(match target {
        AllocTarget::Resource(r) => {
            Target::Place(Place { device: device(&r.device)?, kind: r.memory.into(), ordinal: Some(r.ordinal) })
        }
        AllocTarget::Device { device: d, memory } => {
            Target::Place(Place { device: device(d)?, kind: (*memory).into(), ordinal: None })
        }
        AllocTarget::Set(name) => Target::Set(name.as_str().to_owned()),
    })
}

impl Operation {
    /// The operation a request asks for, on a connection that negotiated `version`, with
    /// the descriptors that came with it (as many as [`Request::fds_required`] says: the
    /// transport checked that). `Hello` and `Ping` belong to the connection, not here.
    pub fn from_request(req: Request, fds: Vec<OwnedFd>, version: Version) -> Result<Self, ErrorBody> {
        let mut fds = fds.into_iter();
        Ok(match req {
            Request::Hello(_) | Request::Ping => {
                return Err(refusal(ErrorCode::BadRequest, "hello and ping are answered by the connection"));
            }
            Request::Status(_) => Self::Status,
            Request::Topology(t) => Self::Topology { node: node(t.node) },
            Request::Devices(t) => Self::Devices { node: node(t.node) },
            Request::Inventory(t) => Self::Inventory { node: node(t.node) },
            Request::Map(t) => Self::Map { node: node(t.node) },
            Request::Translate(t) => Self::Translate { queries: t.queries.into_vec() },
            Request::Partitions(PartitionsRequest::List) => Self::ListPartitions,
            Request::Partitions(PartitionsRequest::Set(spec)) => {
                if spec.name.is_empty() {
                    return Err(refusal(ErrorCode::BadRequest, "a partition needs a name"));
                }
                let devices = spec.devices.iter().map(|d| device(d)).collect::<Result<Vec<_>, _>>()?;
                Self::SetPartition(PartitionChange {
                    name: spec.name.as_str().to_owned(),
                    devices,
                    uids: spec.uids.into_vec(),
                    gids: spec.gids.into_vec(),
                })
            }
            Request::Partitions(PartitionsRequest::Remove { name }) => {
                Self::RemovePartition { name: name.as_str().to_owned() }
            }
            Request::Regions(r) => Self::Regions { all: r.all },
            Request::Alloc(a) => Self::Alloc { target: target(&a.target)?, size: a.size, align: a.align },
            Request::Adopt(a) => {
                if a.object.since() > version {
                    return Err(refusal(
                        ErrorCode::BadRequest,
                        format!(
                            "a {} needs protocol {}; this connection speaks {version}",
                            a.object.name(),
                            a.object.since()
                        ),
                    ));
                }
                let place = match target(&a.target)? {
                    Target::Place(p) => p,
                    Target::Set(name) => {
                        return Err(refusal(
                            ErrorCode::BadRequest,
                            format!("interleave set {name:?}: a vendor object lies on one device's memory"),
                        ));
                    }
                };
                let fd = fds.next();
                if a.object.is_descriptor() && fd.is_none() {
                    return Err(refusal(ErrorCode::BadFds, "Adopt needs the object's descriptor"));
                }
                if !a.object.is_descriptor() && fd.is_some() {
                    return Err(refusal(
                        ErrorCode::BadFds,
                        "a fabric handle travels in the body: Adopt it with no descriptor",
                    ));
                }
                Self::Adopt { place, size: a.size, object: a.object, fd }
            }
            Request::Free(f) => Self::Free { region: f.region },
            Request::Export(e) => Self::Export { region: e.region, policy: e.policy },
            Request::Revoke(r) => Self::Revoke { handle: r.handle },
            Request::Import(i) => Self::Import { handle: i.handle, access: i.access },
            Request::ImportObject(i) => Self::ImportObject { handle: i.handle, access: i.access },
            Request::Release(r) => Self::Release { import: r.import },
            Request::Register(r) => {
                let from = match r.source {
                    RegisterSource::Region(id) => RegisterFrom::Region(id),
                    RegisterSource::Import(id) => RegisterFrom::Import(id),
                    RegisterSource::Fd => RegisterFrom::Fd(fds.next().ok_or_else(|| {
                        refusal(ErrorCode::BadFds, "register from a descriptor needs one descriptor")
                    })?),
                    RegisterSource::Process { addr } => RegisterFrom::Process { addr },
                };
                Self::Register { device: device(&r.device)?, from, offset: r.offset, len: r.len, access: r.access }
            }
            Request::Unregister(u) => Self::Unregister { registration: u.registration },
            Request::Copy(c) => Self::Copy { copies: vec![c], batch: false },
            Request::CopyBatch(b) => {
                if b.copies.is_empty() {
                    return Err(refusal(ErrorCode::BadRequest, "a batch needs at least one copy"));
                }
                Self::Copy { copies: b.copies.into_vec(), batch: true }
            }
            Request::Subscribe(s) => Self::Subscribe { topics: s.topics },
            Request::Domain(r) => Self::Domain { action: r.action },
        })
    }

    /// The name refusals are logged and grouped under (the opcode's).
    pub fn name(&self) -> &'static str {
        use fabric_proto::wire::Opcode as O;
        let op = match self {
            Self::Status => O::Status,
            Self::Topology { .. } => O::Topology,
            Self::Devices { .. } => O::Devices,
            Self::Inventory { .. } => O::Inventory,
            Self::Map { .. } => O::Map,
            Self::Translate { .. } => O::Translate,
            Self::ListPartitions | Self::SetPartition(_) | Self::RemovePartition { .. } => O::Partitions,
            Self::Regions { .. } => O::Regions,
            Self::Alloc { .. } => O::Alloc,
            Self::Adopt { .. } => O::Adopt,
            Self::Free { .. } => O::Free,
            Self::Export { .. } => O::Export,
            Self::Revoke { .. } => O::Revoke,
            Self::Import { .. } => O::Import,
            Self::ImportObject { .. } => O::ImportObject,
            Self::Release { .. } => O::Release,
            Self::Register { .. } => O::Register,
            Self::Unregister { .. } => O::Unregister,
            Self::Copy { batch: false, .. } => O::Copy,
            Self::Copy { batch: true, .. } => O::CopyBatch,
            Self::Subscribe { .. } => O::Subscribe,
            Self::Domain { .. } => O::Domain,
        };
        op.name()
    }

    /// Whether what it creates depends on the partition state it was authorized against
    /// (so it runs under a [`super::gate::Pass`]: a partition change is acknowledged only
    /// after it has finished). An import of another node's handle (`here` is this node)
    /// does not: its owner judges it against the partitions the ask carries, and a pass
    /// held across a network round trip would let a stalled node hold up this node's
    /// partition changes.
    pub fn acts_under_policy(&self, here: fabric_proto::wire::NodeId) -> bool {
        match self {
            Self::Import { handle, .. } | Self::ImportObject { handle, .. } => handle.node.is_none_or(|n| n == here),
            Self::Alloc { .. }
            | Self::Adopt { .. }
            | Self::Export { .. }
            | Self::Register { .. }
            | Self::Copy { .. } => true,
            _ => false,
        }
    }
}
