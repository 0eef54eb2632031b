//! Response bodies, [`Response`] (the typed form of any of them), and the error body every
//! refusal carries.

use serde::{Deserialize, Serialize};

use super::bounded::{BoundedVec, DeviceName, ErrorText, Name};
use super::event::Topics;
use super::handle::{ExportHandle, SessionToken};
use super::node::{Access, COHERENCE, Grant, NODE_IDENTITIES, NodeId};
use super::opcode::Opcode;
use super::request::{AccessMode, ExportPolicy, ObjectKind, PartitionSpec, ResourceName};
use super::version::{Version, VersionRange};

/// `Hello`: the agreed version and the server's limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloResponse {
    /// Version both sides use from now on.
    pub version: Version,
    /// Server name and version, for logs.
    pub server: Name,
    /// Session id (for logs and `fabricctl status`).
    pub session: u64,
    /// Largest request body the server accepts.
    pub max_request_body: u32,
    /// Most descriptors per frame the server accepts.
    pub max_fds: u8,
    /// The session's resume token (1.1; absent when 1.0 was agreed): present it in a
    /// later `Hello` after a daemon restart to take this session's regions back. Travels
    /// as a trailing extension of the frozen 1.0 body, present only when `Some`.
    #[serde(skip)]
    pub token: Option<SessionToken>,
}

/// `Topology`, `Devices`, `Map`: a JSON document of the named schema (for example
/// `fabric.topology/v1`, see `docs/topology-json.md`), carried as text so that the wire
/// format does not duplicate the documents' own versioning.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Document {
    /// Schema name and version.
    pub schema: Name,
    /// The document.
    pub json: String,
}

/// The answer to one [`super::TranslateQuery`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Translation {
    /// The GFA lands in this resource at this offset.
    Resource {
        /// The resource.
        resource: ResourceName,
        /// Byte offset in it.
        offset: u64,
        /// The interleave set it went through.
        set: Option<Name>,
    },
    /// The resource offset has this GFA.
    Gfa(u64),
    /// Nothing holds the address.
    Unmapped,
    /// A hole reserved for a vanished owner (`DEVICE#kindN` or `set:NAME`).
    Hole {
        /// The owner.
        owner: DeviceName,
    },
    /// Mapped, but not in the caller's partition.
    NotInPartition,
    /// The resource is not known or not mapped.
    UnknownResource,
    /// The GFA lies in the slot of another node of the domain (since 1.6; an older
    /// connection gets [`Translation::Resource`] or [`Translation::Hole`]): that node,
    /// whether it is live, and the resource or interleave set and the offset there;
    /// neither resource nor set for a hole of that node's slot.
    Remote {
        /// The node whose slot holds the GFA.
        node: Name,
        /// Whether the node is a live member (a gone node's slot is kept as a hole).
        live: bool,
        /// The resource, for a directly mapped range.
        resource: Option<ResourceName>,
        /// The interleave set, for a set's range.
        set: Option<Name>,
        /// Byte offset in the range.
        offset: u64,
    },
}

/// `Translate`: one answer per query, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TranslateResponse {
    /// The answers.
    pub results: BoundedVec<Translation, 1024>,
}

/// `Alloc`: the region; its memory object is the frame's one descriptor (since 1.5, when
/// the grant's access is [`Access::Fd`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocResponse {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes.
    pub size: u64,
    /// GFA of the first byte, when the memory is in the address map.
    pub gfa: Option<u64>,
    /// Offset of the region in the descriptor (for `mmap`).
    pub offset: u64,
    /// The owner node and how the memory is reached (1.5; absent when an older version
    /// was agreed). Travels as a trailing extension of the frozen body, present only when
    /// `Some`.
    #[serde(skip)]
    pub grant: Option<Grant>,
}

/// `Export`: the handle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportResponse {
    /// The handle (a capability: whoever holds it and passes the policy may import). Its
    /// node, since 1.5, trails the body.
    pub handle: ExportHandle,
}

/// `Import`: the import; its memory object is the frame's one descriptor (since 1.5, when
/// the grant's access is [`Access::Fd`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportResponse {
    /// Import id (for `Release`).
    pub import: u64,
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes.
    pub size: u64,
    /// GFA of the first byte, when mapped.
    pub gfa: Option<u64>,
    /// Offset of the region in the descriptor.
    pub offset: u64,
    /// Access granted.
    pub access: AccessMode,
    /// The owner node and how the memory is reached (1.5; absent when an older version
    /// was agreed). Travels as a trailing extension of the frozen body, present only when
    /// `Some`.
    #[serde(skip)]
    pub grant: Option<Grant>,
}

/// `ImportObject` (since 1.3): the import of an adopted region; its vendor object is the
/// frame's one descriptor (for `ObjectKind::CudaPosixFd`, the allocation to pass to
/// `cuMemImportFromShareableHandle`, `size` bytes) or, for a fabric handle (1.4), the bytes
/// in `object` and no descriptor. A connection that negotiated 1.3 is refused a fabric
/// handle (it could not decode it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportObjectResponse {
    /// Import id (for `Release`).
    pub import: u64,
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Bytes.
    pub size: u64,
    /// GFA of the first byte, when mapped.
    pub gfa: Option<u64>,
    /// Access granted (the vendor driver does not enforce read-only: see `docs/gpu.md`).
    pub access: AccessMode,
    /// What the object is (and, for a fabric handle, the object).
    pub object: ObjectKind,
    /// The device whose memory it is.
    pub device: DeviceName,
    /// The owner node and how the memory is reached (1.5; absent when an older version
    /// was agreed). Travels as a trailing extension of the frozen body, present only when
    /// `Some`.
    #[serde(skip)]
    pub grant: Option<Grant>,
}

/// `Register`: the registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// Registration id (for `Unregister`).
    pub registration: u64,
    /// Device address of the first byte.
    pub iova: u64,
    /// Bytes registered (the IOVA range covers them, in whole 4 KiB pages).
    pub len: u64,
}

/// `Copy` (since 1.2): the copy was queued; its [`super::Event::CopyDone`] names this id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyResponse {
    /// Copy id (unique within the daemon's run).
    pub copy: u64,
}

/// `Partitions`: the partitions the caller may see, after any change.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionsResponse {
    /// The partitions.
    pub partitions: BoundedVec<PartitionSpec, 1024>,
}

/// One region in a [`RegionsResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Owner's uid.
    pub owner_uid: u32,
    /// Owner's pid when it allocated.
    pub owner_pid: i32,
    /// The resource it lies in.
    pub resource: ResourceName,
    /// Byte offset in the resource.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// One export in a [`RegionsResponse`]: never its secret.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportInfo {
    /// Region id.
    pub region: u64,
    /// Generation the handle names.
    pub generation: u64,
    /// Exporter's uid.
    pub owner_uid: u32,
    /// Who may import.
    pub policy: ExportPolicy,
    /// Revoked (kept until its region is freed).
    pub revoked: bool,
}

/// One import in a [`RegionsResponse`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportInfo {
    /// Import id.
    pub import: u64,
    /// Region id.
    pub region: u64,
    /// Region generation.
    pub generation: u64,
    /// Importer's uid.
    pub uid: u32,
}

/// `Regions` (since 1.1): regions, exports and imports, each list by id and at most
/// 4,096 long (`truncated` says that more exist).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionsResponse {
    /// Regions.
    pub regions: BoundedVec<RegionInfo, 4096>,
    /// Exports.
    pub exports: BoundedVec<ExportInfo, 4096>,
    /// Imports.
    pub imports: BoundedVec<ImportInfo, 4096>,
    /// Some list was cut at its bound.
    pub truncated: bool,
}

/// Describes a partition (same fields as the spec that set it).
pub type PartitionInfo = PartitionSpec;

/// What is wrong with something.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ProblemKind {
    /// A backend's library or kernel interface is absent.
    BackendMissing,
    /// A backend failed.
    BackendFailed,
    /// A known device vanished.
    DeviceMissing,
    /// A device reports a failure.
    DeviceFailed,
    /// A link is down.
    LinkDown,
    /// A link runs below its maximum bandwidth.
    LinkDegraded,
    /// Anything else; see the detail.
    Other,
}

/// One thing missing or degraded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// What kind of problem.
    pub kind: ProblemKind,
    /// What it is about: a backend, device or link (`A<->B`).
    pub subject: DeviceName,
    /// Why, in words.
    pub detail: ErrorText,
    /// Bandwidth left, in thousandths, for a degraded link.
    pub bandwidth_permille: Option<u16>,
}

/// `Status`: the daemon's health and counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusResponse {
    /// Serving normally (false while starting or when something required is missing).
    pub ready: bool,
    /// Seconds since start.
    pub uptime_s: u64,
    /// Devices known.
    pub devices: u32,
    /// Links known.
    pub links: u32,
    /// Connected sessions.
    pub sessions: u32,
    /// Live regions.
    pub regions: u64,
    /// Live exports.
    pub exports: u64,
    /// Live imports.
    pub imports: u64,
    /// Live registrations.
    pub registrations: u64,
    /// Bytes allocated.
    pub allocated_bytes: u64,
    /// Bytes pinned by registrations.
    pub pinned_bytes: u64,
    /// Address map generation.
    pub map_generation: u64,
    /// What is missing or degraded and why.
    pub problems: BoundedVec<Problem, 1024>,
}

/// `Subscribe`: the topics now delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeResponse {
    /// Topics.
    pub topics: Topics,
}

/// Any successful response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// See [`HelloResponse`].
    Hello(HelloResponse),
    /// See [`StatusResponse`].
    Status(StatusResponse),
    /// The answer to `Ping` (empty body).
    Ping,
    /// A `fabric.topology/v1` document.
    Topology(Document),
    /// A `fabric.devices/v1` document.
    Devices(Document),
    /// An address map listing document.
    Map(Document),
    /// A `fabric.inventory/v1` document.
    Inventory(Document),
    /// See [`TranslateResponse`].
    Translate(TranslateResponse),
    /// See [`AllocResponse`].
    Alloc(AllocResponse),
    /// The region is freed (empty body).
    Free,
    /// See [`ExportResponse`].
    Export(ExportResponse),
    /// The export is revoked (empty body).
    Revoke,
    /// See [`ImportResponse`].
    Import(ImportResponse),
    /// The import is released (empty body).
    Release,
    /// See [`RegionsResponse`].
    Regions(RegionsResponse),
    /// `Adopt`: the region (its `offset` is 0; no descriptor travels back).
    Adopt(AllocResponse),
    /// See [`ImportObjectResponse`].
    ImportObject(ImportObjectResponse),
    /// See [`RegisterResponse`].
    Register(RegisterResponse),
    /// The registration is undone (empty body).
    Unregister,
    /// See [`CopyResponse`].
    Copy(CopyResponse),
    /// `CopyBatch`: the batch's id, which its one `CopyDone` names.
    CopyBatch(CopyResponse),
    /// See [`PartitionsResponse`].
    Partitions(PartitionsResponse),
    /// See [`SubscribeResponse`].
    Subscribe(SubscribeResponse),
    /// A `fabric.domain/v1` document (since 1.6).
    Domain(Document),
}

impl Response {
    /// The opcode the response travels under.
    pub fn opcode(&self) -> Opcode {
        match self {
            Response::Hello(_) => Opcode::Hello,
            Response::Status(_) => Opcode::Status,
            Response::Ping => Opcode::Ping,
            Response::Topology(_) => Opcode::Topology,
            Response::Devices(_) => Opcode::Devices,
            Response::Map(_) => Opcode::Map,
            Response::Inventory(_) => Opcode::Inventory,
            Response::Translate(_) => Opcode::Translate,
            Response::Alloc(_) => Opcode::Alloc,
            Response::Free => Opcode::Free,
            Response::Export(_) => Opcode::Export,
            Response::Revoke => Opcode::Revoke,
            Response::Import(_) => Opcode::Import,
            Response::Release => Opcode::Release,
            Response::Regions(_) => Opcode::Regions,
            Response::Adopt(_) => Opcode::Adopt,
            Response::ImportObject(_) => Opcode::ImportObject,
            Response::Register(_) => Opcode::Register,
            Response::Unregister => Opcode::Unregister,
            Response::Copy(_) => Opcode::Copy,
            Response::CopyBatch(_) => Opcode::CopyBatch,
            Response::Partitions(_) => Opcode::Partitions,
            Response::Subscribe(_) => Opcode::Subscribe,
            Response::Domain(_) => Opcode::Domain,
        }
    }

    /// Descriptors that must come with the response: one for a grant reached through a
    /// descriptor (every `Alloc` and `Import` before 1.5).
    pub fn fds_required(&self) -> u8 {
        let fd = |grant: &Option<Grant>| u8::from(grant.is_none_or(|g| g.access == Access::Fd));
        match self {
            Response::Alloc(a) => fd(&a.grant),
            Response::Import(i) => fd(&i.grant),
            Response::ImportObject(i) => u8::from(i.object.is_descriptor()),
            _ => 0,
        }
    }

    /// The response as a connection that negotiated `version` understands it: before 1.9,
    /// grants without their coherence; before 1.5, without the node of handles and
    /// without grants. A server answers an older
    /// connection only with grants it could express (a descriptor for `Alloc` and
    /// `Import`, a vendor object for `Adopt` and `ImportObject`).
    pub fn for_version(mut self, version: Version) -> Response {
        if version < COHERENCE {
            let grant = match &mut self {
                Response::Alloc(a) | Response::Adopt(a) => a.grant.as_mut(),
                Response::Import(i) => i.grant.as_mut(),
                Response::ImportObject(i) => i.grant.as_mut(),
                _ => None,
            };
            if let Some(g) = grant {
                g.coherence = None;
            }
        }
        if version < NODE_IDENTITIES {
            match &mut self {
                Response::Alloc(a) | Response::Adopt(a) => a.grant = None,
                Response::Import(i) => i.grant = None,
                Response::ImportObject(i) => i.grant = None,
                Response::Export(e) => e.handle.node = None,
                _ => {}
            }
        }
        self
    }
}

/// Why a request was refused. Variant order is the wire code and is frozen; new codes come
/// with a minor version, and a client that meets an unknown code treats it as `Internal`
/// only if it negotiated that minor (it cannot otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The frame was malformed (the server then closes the connection).
    BadFrame,
    /// The opcode is not known to the server.
    UnknownOpcode,
    /// No common protocol version.
    UnsupportedVersion,
    /// A request other than `Hello` came first.
    NotNegotiated,
    /// The body does not decode or a field is out of range.
    BadRequest,
    /// The caller may not do this (policy, owner, partition).
    PermissionDenied,
    /// Only root or the admin group may do this.
    AdminRequired,
    /// No such device, region, import, registration or partition.
    NotFound,
    /// The handle does not name a live export (wrong secret or generation).
    InvalidHandle,
    /// The export was revoked.
    Revoked,
    /// A per-user limit (bytes, pinned bytes, objects) would be exceeded.
    LimitExceeded,
    /// The resource has no free space.
    NoSpace,
    /// Descriptors missing, extra or of the wrong kind.
    BadFds,
    /// The server cannot serve this now (not ready, backend missing).
    Unavailable,
    /// A bug or an I/O failure in the server.
    Internal,
    /// The operation is valid but this daemon does not implement it yet (added in 1.0,
    /// appended so that every earlier code keeps its number).
    NotImplemented,
    /// (since 1.5) The handle names a region another node owns, which this daemon does
    /// not serve; the detail names the node.
    WrongNode,
}

/// Machine-readable detail of some errors.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorDetail {
    /// The version ranges that did not meet.
    Versions {
        /// Offered by the client.
        offered: VersionRange,
        /// Supported by the server.
        supported: VersionRange,
    },
    /// The limit that was hit.
    Limit {
        /// Which (`allocated_bytes`, `pinned_bytes`, `objects`...).
        what: Name,
        /// In use now.
        used: u64,
        /// Asked for.
        requested: u64,
        /// Allowed.
        max: u64,
    },
    /// (since 1.5) The node a handle named.
    Node {
        /// Its id.
        node: NodeId,
    },
}

/// The body of every error frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong.
    pub code: ErrorCode,
    /// Why, in words (also logged by the server).
    pub message: ErrorText,
    /// Details for some codes.
    pub detail: Option<ErrorDetail>,
}

impl ErrorBody {
    /// The refusal as a connection that negotiated `version` can decode it: before 1.5,
    /// `WrongNode` reads `InvalidHandle` (a handle that names no export here) and the node
    /// detail is left out.
    pub fn for_version(mut self, version: Version) -> ErrorBody {
        if version < NODE_IDENTITIES {
            if self.code == ErrorCode::WrongNode {
                self.code = ErrorCode::InvalidHandle;
            }
            if matches!(self.detail, Some(ErrorDetail::Node { .. })) {
                self.detail = None;
            }
        }
        self
    }
}

impl From<super::version::VersionError> for ErrorBody {
    /// The refusal a server sends when [`super::negotiate`] fails.
    fn from(e: super::version::VersionError) -> Self {
        let detail = match e {
            super::version::VersionError::EmptyRange { .. } => None,
            super::version::VersionError::UnsupportedVersion { offered, supported } => {
                Some(ErrorDetail::Versions { offered, supported })
            }
        };
        ErrorBody { code: ErrorCode::UnsupportedVersion, message: ErrorText::truncated(&e.to_string()), detail }
    }
}
