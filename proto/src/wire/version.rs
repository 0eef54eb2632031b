//! Protocol versions and the negotiation of one at connect: the client offers a range, the
//! server picks the highest version both understand or refuses with a typed error.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A protocol version. The major names the frame layout and the body encodings; a minor
/// adds opcodes, variants or fields that a peer uses only once both sides negotiated it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Version {
    /// Incompatible changes.
    pub major: u8,
    /// Compatible additions.
    pub minor: u8,
}

impl Version {
    /// A version.
    pub const fn new(major: u8, minor: u8) -> Self {
        Self { major, minor }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// An inclusive range of versions, ordered by (major, minor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct VersionRange {
    /// Oldest version.
    pub min: Version,
    /// Newest version.
    pub max: Version,
}

impl VersionRange {
    /// A range; see [`VersionRange::is_valid`].
    pub const fn new(min: Version, max: Version) -> Self {
        Self { min, max }
    }

    /// Whether `min <= max`.
    pub fn is_valid(&self) -> bool {
        self.min <= self.max
    }

    /// Whether `v` lies in the range.
    pub fn contains(&self, v: Version) -> bool {
        self.min <= v && v <= self.max
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..={}", self.min, self.max)
    }
}

/// The version this crate speaks best. 1.1 added the session token and resume to `Hello`
/// (docs/protocol.md, "Negotiation"), and the `Ping`, `Inventory` and `Regions` opcodes;
/// 1.2 added `Copy` and the `CopyDone` event; 1.3 `Adopt` and `ImportObject` (vendor
/// memory objects such as CUDA exports as regions) and `CopyBatch`; 1.4 the
/// `ObjectKind::CudaFabric` object (a CUDA fabric handle, bytes instead of a descriptor);
/// 1.5 node identities: handles name their node and responses that hand memory over carry
/// a typed grant (`docs/protocol.md`, "Node identities"); 1.6 the `Domain` opcode and the
/// `Translation::Remote` answer (a GFA in another node's slot of the domain); 1.7 paged
/// domain listings (`DomainAction::NodesPage`, `DomainAction::MapPage`); 1.8 the node of
/// the region a `Free`, `Export` or `Register` request names; 1.9 the coherence of a grant
/// (`Coherence`: whether flush and invalidate of a mapping are needed).
pub const PROTOCOL_VERSION: Version = Version::new(1, 9);

/// The first version with the domain: the `Domain` opcode and `Translation::Remote`.
pub const DOMAIN: Version = Version::new(1, 6);

/// The first version with paged domain listings: `DomainAction::NodesPage` and
/// `DomainAction::MapPage`.
pub const PAGED: Version = Version::new(1, 7);

/// The first version whose requests about a region (`Free`, `Export`, `Register` of a
/// `Region`) may name the node that owns it, as handles have since 1.5.
pub const QUALIFIED_REGIONS: Version = Version::new(1, 8);

/// Every version this crate understands.
pub const SUPPORTED_VERSIONS: VersionRange = VersionRange::new(Version::new(1, 0), PROTOCOL_VERSION);

/// Why no version could be agreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    /// The offered range is empty (`min > max`).
    #[error("offered version range {offered} is empty")]
    EmptyRange {
        /// What the peer offered.
        offered: VersionRange,
    },
    /// The ranges do not overlap.
    #[error("no common version: offered {offered}, supported {supported}")]
    UnsupportedVersion {
        /// What the peer offered.
        offered: VersionRange,
        /// What this side understands.
        supported: VersionRange,
    },
}

/// Picks the highest version in both `offered` and `supported`.
pub fn negotiate(offered: VersionRange, supported: VersionRange) -> Result<Version, VersionError> {
    if !offered.is_valid() {
        return Err(VersionError::EmptyRange { offered });
    }
    let best = offered.max.min(supported.max);
    if supported.is_valid() && offered.contains(best) && supported.contains(best) {
        Ok(best)
    } else {
        Err(VersionError::UnsupportedVersion { offered, supported })
    }
}
