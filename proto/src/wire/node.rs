//! Node identities on the wire (protocol 1.5): the [`NodeId`] that export handles and
//! grants name as the owner of a region, and the [`Grant`] that says how the memory a
//! response hands over is reached ([`Access`]). Both travel as fixed-length trailing
//! extensions of the frozen 1.0 bodies (`docs/protocol.md`, "Node identities"); since 1.9
//! a grant also says whether the memory is [`Coherence`]-kept by the hardware.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::version::Version;

/// The first protocol version whose handles and grants name their node.
pub const NODE_IDENTITIES: Version = Version::new(1, 5);

/// The identity of one fabricd node: 8 opaque bytes, fixed on the wire (not a varint) so
/// that a trailing extension has one length. A standalone daemon draws its own at random
/// on first start and keeps it in its state directory, so that it (and every handle it
/// made) survives restarts; no two daemons share one by accident, even on one host.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub [u8; 8]);

impl NodeId {
    /// Bytes on the wire.
    pub const LEN: usize = 8;
}

impl fmt::Display for NodeId {
    /// 16 lowercase hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeId({self})")
    }
}

/// A node id's text form that does not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a node id is 16 hex digits")]
pub struct NodeIdError;

impl FromStr for NodeId {
    type Err = NodeIdError;
    fn from_str(s: &str) -> Result<Self, NodeIdError> {
        if s.len() != 2 * Self::LEN || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(NodeIdError);
        }
        let mut out = [0u8; Self::LEN];
        for (i, byte) in out.iter_mut().enumerate() {
            let pair = s.get(2 * i..2 * i + 2).ok_or(NodeIdError)?;
            *byte = u8::from_str_radix(pair, 16).map_err(|_| NodeIdError)?;
        }
        Ok(NodeId(out))
    }
}

/// How the memory a grant hands over is reached. Variant order is the wire code and is
/// frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Access {
    /// A file descriptor travels with the response (`SCM_RIGHTS`); the region starts at the
    /// response's `offset` in it: `mmap` it, or register it for DMA.
    Fd,
    /// A vendor memory object (the `object` and `device` of an `ImportObject` response, or
    /// the object the caller adopted): its own driver maps it, never the daemon.
    Vendor,
    /// Nothing to map: the memory is reached only through the copy API (`Copy` with a
    /// GFA endpoint). No descriptor travels and the response's `offset` is 0.
    CopyOnly,
}

/// The first protocol version whose grants say the memory's [`Coherence`].
pub const COHERENCE: Version = Version::new(1, 9);

/// Whether the hardware keeps the caches of the host that maps the memory coherent with
/// what other hosts store to it (since 1.9, in a [`Grant`]). Variant order is the wire code
/// and is frozen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Coherence {
    /// Kept coherent by the hardware: memory only this host reaches (its own DRAM, HBM or
    /// CXL device), the sim's shared files (the nodes are processes of one host), NVLink,
    /// a CXL device whose hosts are kept coherent (back-invalidate). Flush and invalidate
    /// are no-ops; a grant that maps nothing (vendor, copy-only) says this too.
    Hardware,
    /// Not kept coherent across hosts (CXL.mem shared by several hosts without
    /// back-invalidate): a store must be written back before another host loads it, and
    /// cached lines dropped before loading what another host stored.
    Software,
}

/// What a response that hands memory over (`Alloc`, `Adopt`, `Import`, `ImportObject`)
/// says about it since 1.5: the node that owns the region, and how it is reached. Sent
/// only to a connection that negotiated 1.5 or later; an older one gets the 1.4 body, whose
/// region is this daemon's and whose access is implied by the opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Grant {
    /// The node that owns the region (the region id is that node's).
    pub owner: NodeId,
    /// How to reach it.
    pub access: Access,
    /// Since 1.9: whether this host's caches are kept coherent with the memory; `None`
    /// from a daemon older than 1.9. Not part of the 1.5 trailer's serde form: it travels
    /// as one more byte after it ([`Grant::LEN_COHERENCE`]).
    #[serde(skip)]
    pub coherence: Option<Coherence>,
}

impl Grant {
    /// Bytes on the wire of the 1.5 trailer: the node id and one byte of [`Access`].
    pub const LEN: usize = NodeId::LEN + 1;
    /// Bytes on the wire from 1.9 when [`Grant::coherence`] is set: one more, its code.
    pub const LEN_COHERENCE: usize = Self::LEN + 1;

    /// A grant of memory without a coherence (as a daemon older than 1.9 sends it).
    pub fn new(owner: NodeId, access: Access) -> Self {
        Self { owner, access, coherence: None }
    }

    /// The grant with its coherence.
    pub fn with_coherence(self, coherence: Coherence) -> Self {
        Self { coherence: Some(coherence), ..self }
    }
}
