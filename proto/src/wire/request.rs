//! Request bodies: one struct per operation, and [`Request`], the typed form of any of
//! them. Field order is the wire order (postcard); it is frozen within a major version.

use std::fmt;

use fabric_topology::MemoryKind;
use serde::{Deserialize, Serialize};

use super::bounded::{BoundedVec, DeviceName, Name};
use super::event::Topics;
use super::handle::{ExportHandle, SessionToken};
use super::node::NodeId;
use super::opcode::Opcode;
use super::version::{Version, VersionRange};

/// Kind of memory, as it travels. Variant order is the wire code and is frozen; it maps
/// one to one onto [`MemoryKind`] (a new kind there fails to compile here until it gets a
/// code).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum MemoryClass {
    /// HBM.
    Hbm,
    /// Host DRAM.
    Dram,
    /// CXL volatile.
    CxlVolatile,
    /// CXL persistent.
    CxlPersistent,
    /// CXL dynamic capacity.
    CxlDynamic,
    /// Host memory exported to the fabric.
    HostExported,
}

impl From<MemoryKind> for MemoryClass {
    fn from(k: MemoryKind) -> Self {
        match k {
            MemoryKind::Hbm => MemoryClass::Hbm,
            MemoryKind::Dram => MemoryClass::Dram,
            MemoryKind::CxlVolatile => MemoryClass::CxlVolatile,
            MemoryKind::CxlPersistent => MemoryClass::CxlPersistent,
            MemoryKind::CxlDynamic => MemoryClass::CxlDynamic,
            MemoryKind::HostExported => MemoryClass::HostExported,
        }
    }
}

impl From<MemoryClass> for MemoryKind {
    fn from(k: MemoryClass) -> Self {
        match k {
            MemoryClass::Hbm => MemoryKind::Hbm,
            MemoryClass::Dram => MemoryKind::Dram,
            MemoryClass::CxlVolatile => MemoryKind::CxlVolatile,
            MemoryClass::CxlPersistent => MemoryKind::CxlPersistent,
            MemoryClass::CxlDynamic => MemoryKind::CxlDynamic,
            MemoryClass::HostExported => MemoryKind::HostExported,
        }
    }
}

/// One memory resource of a device: the `ordinal`-th resource of kind `memory`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ResourceName {
    /// Device identity in text form.
    pub device: DeviceName,
    /// Kind of memory.
    pub memory: MemoryClass,
    /// Which resource of that kind, from 0.
    pub ordinal: u16,
}

/// `Hello`: the versions the client can speak, and a name for logs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HelloRequest {
    /// Offered versions, inclusive.
    pub versions: VersionRange,
    /// Client name (program), for logs only; identity comes from `SO_PEERCRED`.
    pub client: Name,
    /// The token of a session to take back after a daemon restart (1.1): its regions and
    /// exports become this connection's. Travels as a trailing extension of the frozen
    /// 1.0 body, present only when `Some` (see `docs/protocol.md`, "Negotiation").
    #[serde(skip)]
    pub resume: Option<SessionToken>,
}

/// `Status`: no fields.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusRequest {}

/// `Topology`, `Devices` and `Map`: which part of the fabric.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyRequest {
    /// Only this node (all nodes when absent).
    pub node: Option<Name>,
}

/// One translation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum TranslateQuery {
    /// GFA to resource + offset.
    Gfa(u64),
    /// Resource + offset to GFA.
    Resource {
        /// The resource.
        resource: ResourceName,
        /// Byte offset in it.
        offset: u64,
    },
}

/// `Translate`: up to 1,024 queries, answered in order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TranslateRequest {
    /// The queries.
    pub queries: BoundedVec<TranslateQuery, 1024>,
}

/// Where to allocate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum AllocTarget {
    /// One resource.
    Resource(ResourceName),
    /// Any resource of this kind on the device.
    Device {
        /// Device identity.
        device: DeviceName,
        /// Kind of memory.
        memory: MemoryClass,
    },
    /// An interleave set, by name.
    Set(Name),
}

/// `Alloc`: a region of `size` bytes. The response carries one descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocRequest {
    /// Where.
    pub target: AllocTarget,
    /// Bytes (the server may round up to its page size).
    pub size: u64,
    /// Alignment of the region's GFA in bytes (a power of two; 0 for the default).
    pub align: u64,
}

/// `Free`: a region the caller owns. Its exports are revoked and importers told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreeRequest {
    /// Region id.
    pub region: u64,
    /// The node that owns the region (1.8): a trailing extension of the frozen body,
    /// present only when `Some` (`docs/protocol.md`, "Node identities").
    #[serde(skip)]
    pub node: Option<NodeId>,
}

/// Read-only or read-write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AccessMode {
    /// Loads only.
    ReadOnly,
    /// Loads and stores.
    ReadWrite,
}

/// Who may import an export. Empty `uids` and `gids` mean the owner's uid only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportPolicy {
    /// Allowed user ids.
    pub uids: BoundedVec<u32, 64>,
    /// Allowed group ids (primary group of the importer).
    pub gids: BoundedVec<u32, 64>,
    /// Importers must be bound to this partition.
    pub partition: Option<Name>,
    /// The most an importer gets.
    pub access: AccessMode,
}

/// `Export`: make a region importable.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportRequest {
    /// Region id.
    pub region: u64,
    /// Who may import.
    pub policy: ExportPolicy,
    /// The node that owns the region (1.8; trailing, as for [`FreeRequest::node`]).
    #[serde(skip)]
    pub node: Option<NodeId>,
}

/// `Revoke`: end an export; its importers are told.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeRequest {
    /// The export's handle (its node, since 1.5, trails the body).
    pub handle: ExportHandle,
}

/// `Import`: a region by handle. The response carries one descriptor (before 1.5; since,
/// what its grant says).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportRequest {
    /// The handle (its node, since 1.5, trails the body, after `access`).
    pub handle: ExportHandle,
    /// Access wanted (at most the policy's).
    pub access: AccessMode,
}

/// `Release`: drop an import.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseRequest {
    /// Import id.
    pub import: u64,
}

/// What memory a registration covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RegisterSource {
    /// A region the caller owns.
    Region(u64),
    /// An import the caller holds.
    Import(u64),
    /// The memory object sent as the frame's one descriptor (memfd or regular file).
    Fd,
    /// The caller's own virtual memory from `addr` (plus the request's `offset`), which
    /// the caller has locked (`mlock`); the server checks that and reaches it through the
    /// process (added in 1.0 after `Fd`).
    Process {
        /// First byte, in the caller's address space.
        addr: u64,
    },
}

/// `Register`: pin memory and map it for DMA by a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The device that will DMA.
    pub device: DeviceName,
    /// The memory.
    pub source: RegisterSource,
    /// Byte offset in the source.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Direction the device may access.
    pub access: AccessMode,
    /// The node that owns the region a [`RegisterSource::Region`] names (1.8; trailing, as
    /// for [`FreeRequest::node`]; never with another source).
    #[serde(skip)]
    pub node: Option<NodeId>,
}

/// What kind of vendor memory object an `Adopt` hands over (since 1.3), and for a kind
/// that is bytes rather than a descriptor, the object itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ObjectKind {
    /// A CUDA virtual-memory allocation exported with `cuMemExportToShareableHandle` as a
    /// POSIX file descriptor; an importer passes it to `cuMemImportFromShareableHandle`.
    /// The descriptor travels as the frame's one descriptor.
    CudaPosixFd,
    /// (since 1.4) A CUDA allocation exported as a fabric handle (`CUmemFabricHandle`,
    /// NVLink/NVSwitch systems with IMEX channels): 64 opaque bytes, carried in the body —
    /// no descriptor travels. The bytes are a capability: whoever holds them (and may open
    /// an IMEX channel) can import the memory.
    CudaFabric(FabricHandleBytes),
}

impl ObjectKind {
    /// The protocol version that introduced this kind: a peer that negotiated an older
    /// one can neither send nor decode it.
    pub const fn since(&self) -> Version {
        match self {
            ObjectKind::CudaPosixFd => Version::new(1, 3),
            ObjectKind::CudaFabric(_) => Version::new(1, 4),
        }
    }

    /// Whether the object travels as a file descriptor (as opposed to bytes in the body).
    pub const fn is_descriptor(&self) -> bool {
        matches!(self, ObjectKind::CudaPosixFd)
    }

    /// The kind's name, without any bytes it carries (for logs and errors).
    pub const fn name(&self) -> &'static str {
        match self {
            ObjectKind::CudaPosixFd => "CUDA POSIX descriptor",
            ObjectKind::CudaFabric(_) => "CUDA fabric handle",
        }
    }
}

/// The 64 bytes of a CUDA fabric handle. Encoded as 64 raw bytes; `Debug` never shows them
/// (they are a capability).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandleBytes(pub [u8; 64]);

impl fmt::Debug for FabricHandleBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FabricHandleBytes(..)")
    }
}

impl Serialize for FabricHandleBytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let mut t = s.serialize_tuple(self.0.len())?;
        for b in &self.0 {
            t.serialize_element(b)?;
        }
        t.end()
    }
}

impl<'de> Deserialize<'de> for FabricHandleBytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Bytes64;
        impl<'de> serde::de::Visitor<'de> for Bytes64 {
            type Value = FabricHandleBytes;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("64 bytes")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = [0u8; 64];
                for (i, b) in out.iter_mut().enumerate() {
                    *b = seq.next_element()?.ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                Ok(FabricHandleBytes(out))
            }
        }
        d.deserialize_tuple(64, Bytes64)
    }
}

/// `Adopt` (since 1.3): the memory object — sent as the frame's one descriptor, or, for a
/// kind that is bytes (a CUDA fabric handle, 1.4), in `object` with no descriptor — which a
/// vendor API allocated on the target's memory, becomes a region of the caller's session:
/// placed in the resource's range (so it has a GFA), counted against the caller's limits,
/// exportable and importable (with `ImportObject`), freed with `Free` or with the session.
/// The daemon never maps it; `size` is the exporter's word (the importer's driver checks it
/// when it maps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdoptRequest {
    /// The memory it lies in: a resource, or a device and class (not a set).
    pub target: AllocTarget,
    /// Bytes of the object.
    pub size: u64,
    /// What the object is (and, for a fabric handle, the object).
    pub object: ObjectKind,
}

/// `Unregister`: undo a registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnregisterRequest {
    /// Registration id.
    pub registration: u64,
}

/// One side of a copy (since 1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CopyEndpoint {
    /// A DMA registration of the caller's session, from byte `offset` of what it registered.
    Registration {
        /// Registration id.
        id: u64,
        /// Byte offset in the registered bytes.
        offset: u64,
    },
    /// A global fabric address inside a region the caller owns or has imported (with
    /// write access when it is the destination) and may reach under its partitions.
    Gfa(u64),
}

/// `Copy` (since 1.2): move `len` bytes from `src` to `dst` with the daemon's copy engine.
/// The answer comes at once with the copy's id; the completion follows as a
/// [`super::Event::CopyDone`] sent to this connection whether or not it subscribed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyRequest {
    /// Where the bytes go.
    pub dst: CopyEndpoint,
    /// Where they come from.
    pub src: CopyEndpoint,
    /// Bytes (at least one).
    pub len: u64,
}

/// The most copies one `CopyBatch` carries.
pub const MAX_BATCH: usize = 64;

/// `CopyBatch` (since 1.3): several copies queued as one, like a DMA engine's descriptor
/// list. Every copy is checked before any is queued (one refusal refuses the batch); the
/// engines run them in any order and in parallel, and one [`super::Event::CopyDone`] under
/// the batch's id reports the bytes of all of them (or the first failure).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyBatchRequest {
    /// The copies, 1 to [`MAX_BATCH`].
    pub copies: BoundedVec<CopyRequest, MAX_BATCH>,
}

/// A partition: devices and the users bound to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionSpec {
    /// Name.
    pub name: Name,
    /// Devices (identities in text form).
    pub devices: BoundedVec<DeviceName, 1024>,
    /// Users bound to it.
    pub uids: BoundedVec<u32, 64>,
    /// Groups bound to it.
    pub gids: BoundedVec<u32, 64>,
}

/// `Partitions`: list them (anyone) or change them (admin only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PartitionsRequest {
    /// The partitions the caller may see.
    List,
    /// Create or replace one.
    Set(PartitionSpec),
    /// Remove one.
    Remove {
        /// Name.
        name: Name,
    },
}

/// `Regions` (since 1.1): the caller's regions, exports and imports; with `all`, every
/// one the daemon holds (admin only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionsRequest {
    /// Everyone's, not only the caller's (root or the admin group only).
    pub all: bool,
}

/// `Subscribe`: the event topics this connection wants from now on (empty: none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubscribeRequest {
    /// Topics.
    pub topics: Topics,
}

/// What a `Domain` request asks (since 1.6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DomainAction {
    /// This node's standing in its domain and etcd's reachability, with the members.
    Status,
    /// The domain's nodes: name, incarnation, slot, live or gone, peer address.
    Nodes,
    /// Admin: free the slot of a node that is gone (its GFAs may then go to another node).
    Gc {
        /// The node.
        node: Name,
    },
    /// A page of the domain's nodes, by name (1.7): what `Nodes` answers whole.
    NodesPage(PageRequest),
    /// A page of the domain's map, by node name (1.7): what `Map` answers whole.
    MapPage(PageRequest),
}

/// Which page of a domain listing (1.7). Pages follow the nodes in name order; the
/// answer's `page` says the view revision it was made from and the node to ask `after`
/// next. A page is answered from the view of `revision` while the daemon still holds it,
/// else from its current view (another revision: the client starts again).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRequest {
    /// The view revision of the pages before; 0 for the first page.
    pub revision: u64,
    /// The last node of the page before; none for the first page.
    pub after: Option<Name>,
}

/// `Domain` (since 1.6): answered with a `fabric.domain/v1` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainRequest {
    /// What is asked.
    pub action: DomainAction,
}

/// Any request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// See [`HelloRequest`].
    Hello(HelloRequest),
    /// See [`StatusRequest`].
    Status(StatusRequest),
    /// Nothing to do: the daemon answers at once (empty body).
    Ping,
    /// The topology document.
    Topology(TopologyRequest),
    /// The devices document.
    Devices(TopologyRequest),
    /// The address map document.
    Map(TopologyRequest),
    /// See [`TranslateRequest`].
    Translate(TranslateRequest),
    /// The inventory document (since 1.1; `node` must be absent).
    Inventory(TopologyRequest),
    /// See [`AllocRequest`].
    Alloc(AllocRequest),
    /// See [`FreeRequest`].
    Free(FreeRequest),
    /// See [`ExportRequest`].
    Export(ExportRequest),
    /// See [`RevokeRequest`].
    Revoke(RevokeRequest),
    /// See [`ImportRequest`].
    Import(ImportRequest),
    /// See [`ReleaseRequest`].
    Release(ReleaseRequest),
    /// See [`RegionsRequest`].
    Regions(RegionsRequest),
    /// See [`AdoptRequest`].
    Adopt(AdoptRequest),
    /// `ImportObject` (since 1.3): an adopted region by handle; the response carries its
    /// vendor descriptor.
    ImportObject(ImportRequest),
    /// See [`RegisterRequest`].
    Register(RegisterRequest),
    /// See [`UnregisterRequest`].
    Unregister(UnregisterRequest),
    /// See [`CopyRequest`].
    Copy(CopyRequest),
    /// See [`CopyBatchRequest`].
    CopyBatch(CopyBatchRequest),
    /// See [`PartitionsRequest`].
    Partitions(PartitionsRequest),
    /// See [`SubscribeRequest`].
    Subscribe(SubscribeRequest),
    /// See [`DomainRequest`].
    Domain(DomainRequest),
}

impl Request {
    /// The opcode the request travels under.
    pub fn opcode(&self) -> Opcode {
        match self {
            Request::Hello(_) => Opcode::Hello,
            Request::Status(_) => Opcode::Status,
            Request::Ping => Opcode::Ping,
            Request::Topology(_) => Opcode::Topology,
            Request::Devices(_) => Opcode::Devices,
            Request::Map(_) => Opcode::Map,
            Request::Translate(_) => Opcode::Translate,
            Request::Inventory(_) => Opcode::Inventory,
            Request::Alloc(_) => Opcode::Alloc,
            Request::Free(_) => Opcode::Free,
            Request::Export(_) => Opcode::Export,
            Request::Revoke(_) => Opcode::Revoke,
            Request::Import(_) => Opcode::Import,
            Request::Release(_) => Opcode::Release,
            Request::Regions(_) => Opcode::Regions,
            Request::Adopt(_) => Opcode::Adopt,
            Request::ImportObject(_) => Opcode::ImportObject,
            Request::Register(_) => Opcode::Register,
            Request::Unregister(_) => Opcode::Unregister,
            Request::Copy(_) => Opcode::Copy,
            Request::CopyBatch(_) => Opcode::CopyBatch,
            Request::Partitions(_) => Opcode::Partitions,
            Request::Subscribe(_) => Opcode::Subscribe,
            Request::Domain(_) => Opcode::Domain,
        }
    }

    /// Descriptors that must come with the request.
    pub fn fds_required(&self) -> u8 {
        match self {
            Request::Register(RegisterRequest { source: RegisterSource::Fd, .. }) => 1,
            Request::Adopt(a) => u8::from(a.object.is_descriptor()),
            _ => 0,
        }
    }
}
