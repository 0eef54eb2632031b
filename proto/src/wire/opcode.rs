//! Operation codes and their per-opcode limits: the largest body and the most file
//! descriptors a frame of each kind may carry.

use std::fmt;

use super::header::FrameKind;
use super::version::Version;
use super::{MAX_BODY, MAX_REQUEST_BODY};

/// What a frame is about. Codes are frozen within a major version; new codes come with a
/// minor version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum Opcode {
    /// Version negotiation; the first frame on every connection.
    Hello = 0x0001,
    /// Daemon health: what is missing or degraded and why.
    Status = 0x0002,
    /// Does nothing and answers at once: liveness and round-trip latency (since 1.1).
    Ping = 0x0003,
    /// The fabric as a `fabric.topology/v1` document.
    Topology = 0x0010,
    /// The devices as a `fabric.devices/v1` document.
    Devices = 0x0011,
    /// The address map listing as a JSON document.
    Map = 0x0012,
    /// GFA to resource+offset and back.
    Translate = 0x0013,
    /// The discovered inventory as a `fabric.inventory/v1` document (since 1.1).
    Inventory = 0x0014,
    /// Allocate a region; the response carries its memory object.
    Alloc = 0x0020,
    /// Free a region (revoking its exports).
    Free = 0x0021,
    /// Export a region: get a handle.
    Export = 0x0022,
    /// Revoke an export.
    Revoke = 0x0023,
    /// Import a region by handle; the response carries its memory object.
    Import = 0x0024,
    /// Release an import.
    Release = 0x0025,
    /// List regions, exports and imports (since 1.1).
    Regions = 0x0026,
    /// Hand the daemon memory a vendor API allocated (a CUDA POSIX export) so that it
    /// becomes a region (since 1.3).
    Adopt = 0x0027,
    /// Import an adopted region: its vendor descriptor (since 1.3).
    ImportObject = 0x0028,
    /// Register memory for DMA by a device.
    Register = 0x0030,
    /// Undo a registration.
    Unregister = 0x0031,
    /// Start an asynchronous copy by the daemon's copy engine (since 1.2).
    Copy = 0x0032,
    /// Start several copies as one, with one completion (since 1.3).
    CopyBatch = 0x0033,
    /// List or change partitions (changes are admin only).
    Partitions = 0x0040,
    /// Choose the event topics this connection receives.
    Subscribe = 0x0050,
    /// The domain this daemon's node belongs to: status, nodes, and the admin's slot gc
    /// (since 1.6).
    Domain = 0x0060,
    /// A chunk of a copy between two nodes: node link only, never valid on the Unix
    /// socket (a client's frame is refused whatever its version). Its bodies may carry up
    /// to [`PEER_DATA_BODY`] bytes, apart from the 256 bytes of the control operations.
    PeerData = 0x0070,
}

/// The largest body of a [`Opcode::PeerData`] frame: one copy chunk of up to
/// [`PEER_DATA_CHUNK`] bytes and its small header.
pub const PEER_DATA_BODY: u32 = PEER_DATA_CHUNK + 64;

/// The most bytes one node-link copy chunk moves.
pub const PEER_DATA_CHUNK: u32 = 1 << 20;

impl Opcode {
    /// Every opcode, in code order.
    pub const ALL: [Opcode; 25] = [
        Opcode::Hello,
        Opcode::Status,
        Opcode::Ping,
        Opcode::Topology,
        Opcode::Devices,
        Opcode::Map,
        Opcode::Translate,
        Opcode::Inventory,
        Opcode::Alloc,
        Opcode::Free,
        Opcode::Export,
        Opcode::Revoke,
        Opcode::Import,
        Opcode::Release,
        Opcode::Regions,
        Opcode::Adopt,
        Opcode::ImportObject,
        Opcode::Register,
        Opcode::Unregister,
        Opcode::Copy,
        Opcode::CopyBatch,
        Opcode::Partitions,
        Opcode::Subscribe,
        Opcode::Domain,
        Opcode::PeerData,
    ];

    /// The opcode with this code, if any.
    pub fn from_code(code: u16) -> Option<Self> {
        Self::ALL.iter().copied().find(|op| op.code() == code)
    }

    /// The wire code.
    pub const fn code(self) -> u16 {
        self as u16
    }

    /// A short lower-case name, for logs and metrics.
    pub const fn name(self) -> &'static str {
        match self {
            Opcode::Hello => "hello",
            Opcode::Status => "status",
            Opcode::Ping => "ping",
            Opcode::Topology => "topology",
            Opcode::Devices => "devices",
            Opcode::Map => "map",
            Opcode::Translate => "translate",
            Opcode::Inventory => "inventory",
            Opcode::Alloc => "alloc",
            Opcode::Free => "free",
            Opcode::Export => "export",
            Opcode::Revoke => "revoke",
            Opcode::Import => "import",
            Opcode::Release => "release",
            Opcode::Regions => "regions",
            Opcode::Adopt => "adopt",
            Opcode::ImportObject => "import_object",
            Opcode::Register => "register",
            Opcode::Unregister => "unregister",
            Opcode::Copy => "copy",
            Opcode::CopyBatch => "copy_batch",
            Opcode::Partitions => "partitions",
            Opcode::Subscribe => "subscribe",
            Opcode::Domain => "domain",
            Opcode::PeerData => "peer_data",
        }
    }

    /// The first protocol version that has this opcode: a peer uses it only when the
    /// negotiated version is at least this, and a server answers it with `UnknownOpcode`
    /// on a connection that negotiated less.
    pub const fn since(self) -> Version {
        match self {
            Opcode::Ping | Opcode::Inventory | Opcode::Regions => Version::new(1, 1),
            Opcode::Copy => Version::new(1, 2),
            Opcode::Adopt | Opcode::ImportObject | Opcode::CopyBatch => Version::new(1, 3),
            Opcode::Domain => Version::new(1, 6),
            _ => Version::new(1, 0),
        }
    }

    /// Whether the operation changes state only an administrator may change (the server
    /// still decides per request: listing partitions is open to all).
    pub const fn may_need_admin(self) -> bool {
        matches!(self, Opcode::Partitions | Opcode::Domain)
    }

    /// The largest body a frame of this opcode and kind may carry. Always at most
    /// [`MAX_BODY`]; a client's requests at most [`MAX_REQUEST_BODY`] (a node link's
    /// [`Opcode::PeerData`] frames, up to [`PEER_DATA_BODY`], are no client's); events only
    /// for `Subscribe`.
    pub const fn max_body(self, kind: FrameKind) -> u32 {
        const SMALL: u32 = 256;
        match kind {
            FrameKind::Error => 4 << 10,
            FrameKind::Event => match self {
                Opcode::Subscribe => 4 << 10,
                _ => 0,
            },
            FrameKind::Request => match self {
                Opcode::Hello => SMALL,
                Opcode::Status | Opcode::Topology | Opcode::Devices | Opcode::Map | Opcode::Inventory => 1 << 10,
                Opcode::Translate | Opcode::Partitions => MAX_REQUEST_BODY,
                Opcode::Export | Opcode::CopyBatch => 4 << 10,
                Opcode::Alloc | Opcode::Register | Opcode::Adopt => 1 << 10,
                Opcode::Free
                | Opcode::Revoke
                | Opcode::Import
                | Opcode::ImportObject
                | Opcode::Release
                | Opcode::Unregister
                | Opcode::Copy
                | Opcode::Regions => SMALL,
                Opcode::Subscribe | Opcode::Ping | Opcode::Domain => SMALL,
                Opcode::PeerData => PEER_DATA_BODY,
            },
            FrameKind::Response => match self {
                Opcode::Topology | Opcode::Devices | Opcode::Map | Opcode::Inventory | Opcode::Regions => MAX_BODY,
                Opcode::Status | Opcode::Translate | Opcode::Partitions | Opcode::Domain => 1 << 20,
                // The device name is up to 256 bytes; between nodes, an import's grant
                // names up to 16 members of a shared CXL set.
                Opcode::Import | Opcode::ImportObject => 1 << 10,
                Opcode::Hello
                | Opcode::Alloc
                | Opcode::Free
                | Opcode::Export
                | Opcode::Revoke
                | Opcode::Adopt
                | Opcode::Release
                | Opcode::Register
                | Opcode::Unregister
                | Opcode::Copy
                | Opcode::CopyBatch
                | Opcode::Subscribe
                | Opcode::Ping => SMALL,
                Opcode::PeerData => PEER_DATA_BODY,
            },
        }
    }

    /// The most file descriptors a frame of this opcode and kind may carry (at most
    /// [`super::MAX_FDS`]): the memory object of an alloc or import response, the memory
    /// a register request hands over, the vendor object an adopt request hands over and an
    /// object import returns.
    pub const fn max_fds(self, kind: FrameKind) -> u8 {
        match (self, kind) {
            (Opcode::Alloc | Opcode::Import | Opcode::ImportObject, FrameKind::Response) => 1,
            (Opcode::Register | Opcode::Adopt, FrameKind::Request) => 1,
            _ => 0,
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_request_fds_is_what_the_largest_request_carries() {
        let largest = Opcode::ALL.iter().map(|op| op.max_fds(FrameKind::Request)).max();
        assert_eq!(largest, Some(super::super::MAX_REQUEST_FDS));
    }
}
