//! The fabricd wire protocol: length-delimited binary frames over a Unix stream socket, with
//! a fixed zerocopy header, bounded postcard bodies and file descriptors passed as
//! `SCM_RIGHTS`. The layout, versioning rules and security notes are in `docs/protocol.md`.
//!
//! The pieces are layered so that the daemon can reuse them over tokio:
//! - pure, allocation-bounded functions with no I/O: [`encode_frame`], [`decode_header`],
//!   [`encode_body`], [`decode_body`] and [`negotiate`];
//! - the one sans-IO [`FrameDecoder`] (bytes and descriptors in, whole frames out) that
//!   every receiver drives: the daemon over tokio, the blocking transport below, and a
//!   link that carries no descriptors;
//! - a blocking transport over [`std::os::unix::net::UnixStream`] ([`send_frame`],
//!   [`recv_frame`], [`Connection`]) and [`peer_cred`], with every syscall in `sys`.
//!
//! Decoding is total: any byte string yields a value or a typed error, never a panic, and
//! no allocation is larger than a small multiple of the announced body length, which is
//! checked against per-opcode limits before anything is allocated.

mod body;
mod bounded;
mod cmsg;
mod codec;
mod decoder;
mod event;
mod handle;
mod header;
mod node;
mod opcode;
mod request;
mod response;
mod sys;
mod version;

pub use body::{
    BodyError, Message, decode_body, decode_error, decode_event, decode_request, decode_response, encode_body,
    encode_message,
};
pub use bounded::{BoundedError, BoundedString, BoundedVec, DeviceName, ErrorText, Name};
pub use cmsg::{Rights, build_control, parse_rights, rights_len};
pub use codec::{
    CodecError, Connection, Frame, PeerCred, peer_cred, recv_frame, recv_message, send_frame, send_message,
};
pub use decoder::{DecodeError, DecoderConfig, ExtraFds, FrameDecoder, FramePart, FrameView, Progress};
pub use event::{
    CopyDone, CopyResult, DeviceChange, Event, LinkChange, MapChange, Revocation, RevocationReason, Topics,
};
pub use handle::{ExportHandle, HandleError, Secret, SessionToken, ct_eq};
pub use header::{FrameError, FrameKind, HEADER_LEN, Header, RawHeader, decode_header, encode_frame};
pub use node::{Access, COHERENCE, Coherence, Grant, NODE_IDENTITIES, NodeId, NodeIdError};
pub use opcode::{Opcode, PEER_DATA_BODY, PEER_DATA_CHUNK};
pub use request::{
    AccessMode, AdoptRequest, AllocRequest, AllocTarget, CopyBatchRequest, CopyEndpoint, CopyRequest, DomainAction,
    DomainRequest, ExportPolicy, ExportRequest, FabricHandleBytes, FreeRequest, HelloRequest, ImportRequest, MAX_BATCH,
    MemoryClass, ObjectKind, PageRequest, PartitionSpec, PartitionsRequest, RegionsRequest, RegisterRequest,
    RegisterSource, ReleaseRequest, Request, ResourceName, RevokeRequest, StatusRequest, SubscribeRequest,
    TopologyRequest, TranslateQuery, TranslateRequest, UnregisterRequest,
};
pub use response::{
    AllocResponse, CopyResponse, Document, ErrorBody, ErrorCode, ErrorDetail, ExportInfo, ExportResponse,
    HelloResponse, ImportInfo, ImportObjectResponse, ImportResponse, PartitionInfo, PartitionsResponse, Problem,
    ProblemKind, RegionInfo, RegionsResponse, RegisterResponse, Response, StatusResponse, SubscribeResponse,
    TranslateResponse, Translation,
};
pub use sys::{Received, SCM_MAX_FD, connect_unix, recv_with_fds, send_with_fds};
pub use version::{
    DOMAIN, PAGED, PROTOCOL_VERSION, QUALIFIED_REGIONS, SUPPORTED_VERSIONS, Version, VersionError, VersionRange,
    negotiate,
};

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"FBRC";

/// The largest body of any frame (a response carrying a large JSON document). Requests are
/// far smaller: see [`MAX_REQUEST_BODY`].
pub const MAX_BODY: u32 = 16 << 20;

/// The largest body of any request, so that a server holds at most this much (plus a
/// header) per connection while it reads.
pub const MAX_REQUEST_BODY: u32 = 64 << 10;

/// The most file descriptors any frame may carry.
pub const MAX_FDS: u8 = 8;

/// The most file descriptors any request carries (the largest [`Opcode::max_fds`] of a
/// request): a server makes room for this many in each `recvmsg`, so that a peer cannot
/// make it install more, and learns of any beyond from the truncation.
pub const MAX_REQUEST_FDS: u8 = 1;
