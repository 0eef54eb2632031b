//! The domain's keys in etcd and the records stored under them, with their strict encoding.
//!
//! Every key lives under `/fabric/<domain>/`:
//!
//! | key                    | record             | lease | written by                       |
//! |------------------------|--------------------|-------|----------------------------------|
//! | `settings`             | [`DomainSettings`] | no    | the first node, once             |
//! | `members/<node>`       | [`MemberRecord`]   | yes   | the node, at join                |
//! | `slots/<n>`            | [`SlotClaim`]      | no    | the node, at its first claim     |
//! | `slot-of/<node>`       | [`SlotClaim`]      | no    | the same transaction             |
//! | `placements/<node>`    | [`PlacementsRecord`] | no  | the node, when its memory moves  |
//! | `partitions/<name>`    | [`PartitionRecord`](crate::partition::PartitionRecord) | no | an admin, through any node |
//! | `topology/<node>`      | [`TopologyRecord`](crate::topology::TopologyRecord) | no | the node, after discovery and each rescan |
//!
//! A record is JSON with a `version` field, at most [`RecordLimits::max_bytes`] long; the
//! decoder refuses oversized, truncated, wrong-version, malformed and out-of-range input
//! with a typed [`RecordError`] and never panics: etcd is shared, so any of its values may
//! have been written by a broken or hostile hand. The records only their own node writes
//! (members, placements, topology) are read tolerantly of what a newer node may add —
//! fields and kinds this build does not know ([`crate::tolerant`]); the others (settings,
//! slots, shares, partitions) refuse unknown fields too.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::config::is_valid_name;

/// The one record format version this build reads and writes.
pub const RECORD_VERSION: u32 = 1;
/// Default bound on one record's encoded size.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 64 * 1024;
/// Highest bound a caller may set: well under etcd's 1.5 MiB request limit.
pub const MAX_RECORD_BYTES: usize = 1024 * 1024;
/// Most slots a domain may have (the 100,000-GPU cluster has 12,500 nodes).
pub const MAX_SLOTS: u32 = 1 << 16;
/// Smallest node span: 1 GiB, the map's default device alignment.
pub const MIN_NODE_SPAN: u64 = 1 << 30;
/// Longest peer address (`host:port`).
pub const MAX_PEER_ADDRESS_LEN: usize = 260;
/// Most capabilities or fabric groups one member lists.
pub const MAX_LIST_LEN: usize = 32;
/// Longest software version string.
pub const MAX_VERSION_LEN: usize = 64;

/// Errors from decoding a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The value is larger than the configured bound.
    #[error("{len} bytes, more than the {max}-byte bound")]
    Oversized {
        /// Its length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// The value ends before the record does (an empty value included).
    #[error("truncated after {len} bytes")]
    Truncated {
        /// Its length.
        len: usize,
    },
    /// The record's format version is not [`RECORD_VERSION`].
    #[error("format version {found}, this build reads {RECORD_VERSION}")]
    WrongVersion {
        /// The version found.
        found: u32,
    },
    /// The value is not a well-formed record (syntax, unknown or missing field, wrong type).
    #[error("malformed: {0}")]
    Malformed(String),
    /// The record is well formed but a field is out of range.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Bounds on what the decoder accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordLimits {
    max_bytes: usize,
}

impl RecordLimits {
    /// Limits with this bound on a record's size, capped at [`MAX_RECORD_BYTES`].
    pub fn new(max_bytes: usize) -> Self {
        Self { max_bytes: max_bytes.min(MAX_RECORD_BYTES) }
    }

    /// The bound on a record's size.
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }
}

impl Default for RecordLimits {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_RECORD_BYTES)
    }
}

/// The etcd keys of one domain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    /// The keys of the domain `domain` (a name [`DomainConfig::validate`] accepted).
    ///
    /// [`DomainConfig::validate`]: crate::config::DomainConfig::validate
    pub fn new(domain: &str) -> Self {
        Self { prefix: format!("/fabric/{domain}/") }
    }

    /// `/fabric/<domain>/`: every key of the domain.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The domain-wide settings.
    pub fn settings(&self) -> String {
        format!("{}settings", self.prefix)
    }

    /// The prefix of every member key.
    pub fn members(&self) -> String {
        format!("{}members/", self.prefix)
    }

    /// A live node's member record (on its lease).
    pub fn member(&self, node: &str) -> String {
        format!("{}members/{node}", self.prefix)
    }

    /// The prefix of every slot key.
    pub fn slots(&self) -> String {
        format!("{}slots/", self.prefix)
    }

    /// The claim of slot `slot`.
    pub fn slot(&self, slot: u32) -> String {
        format!("{}slots/{slot}", self.prefix)
    }

    /// The slot a node holds (the reverse of [`Keys::slot`]).
    pub fn slot_of(&self, node: &str) -> String {
        format!("{}slot-of/{node}", self.prefix)
    }

    /// A node's placements.
    pub fn placements(&self, node: &str) -> String {
        format!("{}placements/{node}", self.prefix)
    }

    /// A partition of the domain (an admin's definition).
    pub fn partition(&self, name: &str) -> String {
        format!("{}partitions/{name}", self.prefix)
    }

    /// The prefix of every partition key.
    pub fn partitions(&self) -> String {
        format!("{}partitions/", self.prefix)
    }

    /// An admin's gc of `node`, queued for the leader (`duties.rs`).
    pub fn gc_request(&self, node: &str) -> String {
        format!("{}gc/{node}", self.prefix)
    }

    /// The prefix of the gc queue.
    pub fn gc_requests(&self) -> String {
        format!("{}gc/", self.prefix)
    }

    /// The shares of a resource several hosts reach (`shares.rs`).
    pub fn share(&self, resource: &str) -> String {
        format!("{}shares/{resource}", self.prefix)
    }

    /// The prefix of every share table.
    pub fn shares(&self) -> String {
        format!("{}shares/", self.prefix)
    }

    /// What a node publishes of its inventory (devices, links, fabric-level switches).
    pub fn topology(&self, node: &str) -> String {
        format!("{}topology/{node}", self.prefix)
    }

    /// The prefix of every node's topology record.
    pub fn topologies(&self) -> String {
        format!("{}topology/", self.prefix)
    }

    /// The slot number a slot key names, if it is one (`slots/<n>` with `n` in decimal,
    /// no leading zero, below [`MAX_SLOTS`]).
    pub fn parse_slot_key(&self, key: &[u8]) -> Option<u32> {
        let rest = key.strip_prefix(self.slots().as_bytes())?;
        let text = std::str::from_utf8(rest).ok()?;
        if text.is_empty() || (text.len() > 1 && text.starts_with('0')) || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        text.parse::<u32>().ok().filter(|n| *n < MAX_SLOTS)
    }
}

/// How nodes of the domain reach each other's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataPathKind {
    /// A file every node can map (nodes on one machine: the stand-in for a memory fabric).
    SharedFile,
    /// NVLink load/store between GPUs of one clique.
    Nvlink,
    /// A CXL memory pool shared by hosts.
    Cxl,
    /// RDMA reads and writes (scale-out).
    Rdma,
}

/// Domain-wide settings, written once by the first node; every other node must agree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DomainSettings {
    /// Format version ([`RECORD_VERSION`]).
    pub version: u32,
    /// Significant bits of a GFA (40..=64).
    pub address_bits: u8,
    /// Every node's slot size: a power of two, at least [`MIN_NODE_SPAN`]; slot `n` starts
    /// at `n * node_span`.
    pub node_span: u64,
    /// The data paths the domain uses, sorted, no duplicates.
    pub data_paths: Vec<DataPathKind>,
}

impl DomainSettings {
    /// Settings of the current version.
    pub fn new(address_bits: u8, node_span: u64, mut data_paths: Vec<DataPathKind>) -> Self {
        data_paths.sort_unstable();
        data_paths.dedup();
        Self { version: RECORD_VERSION, address_bits, node_span, data_paths }
    }

    /// How many slots the address space holds (at most [`MAX_SLOTS`]).
    pub fn slot_count(&self) -> u32 {
        let space = if self.address_bits >= 64 { u128::from(u64::MAX) + 1 } else { 1u128 << self.address_bits };
        let slots = space / u128::from(self.node_span.max(1));
        u32::try_from(slots.min(u128::from(MAX_SLOTS))).unwrap_or(MAX_SLOTS)
    }

    /// The first field where `self` and `other` differ, with both values as text.
    pub fn difference(&self, other: &Self) -> Option<(&'static str, String, String)> {
        if self.address_bits != other.address_bits {
            return Some(("address_bits", self.address_bits.to_string(), other.address_bits.to_string()));
        }
        if self.node_span != other.node_span {
            return Some(("node_span", format!("{:#x}", self.node_span), format!("{:#x}", other.node_span)));
        }
        if self.data_paths != other.data_paths {
            return Some(("data_paths", format!("{:?}", self.data_paths), format!("{:?}", other.data_paths)));
        }
        None
    }

    fn check(&self) -> Result<(), RecordError> {
        if !(40..=64).contains(&self.address_bits) {
            return Err(invalid("address_bits", format!("{} is outside 40..=64", self.address_bits)));
        }
        if !self.node_span.is_power_of_two() || self.node_span < MIN_NODE_SPAN {
            return Err(invalid("node_span", format!("{:#x} is not a power of two of at least 1 GiB", self.node_span)));
        }
        if self.address_bits < 64 && self.node_span > 1u64 << self.address_bits {
            return Err(invalid("node_span", format!("{:#x} is larger than the address space", self.node_span)));
        }
        if self.data_paths.is_empty() || !self.data_paths.windows(2).all(|w| matches!(w, [a, b] if a < b)) {
            return Err(invalid("data_paths", "must be non-empty, sorted, without duplicates".into()));
        }
        Ok(())
    }
}

/// A group of nodes that can load and store each other's memory (read tolerantly, like
/// the member record that lists it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FabricGroup {
    /// An NVLink domain: NVML's `clusterUuid` and `cliqueId`.
    NvlinkClique {
        /// The cluster UUID (as NVML prints it).
        cluster_uuid: String,
        /// The clique within the cluster.
        clique_id: u32,
    },
    /// A CXL memory pool shared by several hosts.
    CxlPool {
        /// The pool's name.
        pool: String,
    },
}

impl std::fmt::Display for FabricGroup {
    /// `nvlink-clique:<cluster uuid>.<clique id>` or `cxl-pool:<name>`, as `domain nodes`
    /// lists a member's groups.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NvlinkClique { cluster_uuid, clique_id } => write!(f, "nvlink-clique:{cluster_uuid}.{clique_id}"),
            Self::CxlPool { pool } => write!(f, "cxl-pool:{pool}"),
        }
    }
}

/// Whether `name` can name a fabric group (a CXL pool, an NVLink cluster): 1 to
/// [`MAX_VERSION_LEN`] of `[A-Za-z0-9._:-]`, what a member record accepts.
pub fn is_group_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_VERSION_LEN && name.bytes().all(is_token_byte)
}

/// A live node's record, on its lease: gone one TTL after the node stops renewing. Read
/// tolerantly ([`crate::tolerant`]): fields and fabric-group kinds a newer node added are
/// left out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    /// Format version ([`RECORD_VERSION`]).
    pub version: u32,
    /// The node's name (the key's last part).
    pub name: String,
    /// Fresh for every start of the daemon: state tied to another incarnation is void.
    pub incarnation: u64,
    /// Where other nodes reach this one (`host:port`).
    pub peer_address: String,
    /// What the node offers (short names, each like a node name).
    pub capabilities: Vec<String>,
    /// The NVLink cliques and CXL pools the node belongs to.
    #[serde(deserialize_with = "crate::tolerant::known")]
    pub groups: Vec<FabricGroup>,
    /// The daemon's software version.
    pub software: String,
    /// The node id its handles and grants name (16 lowercase hex digits; fabricd's
    /// `STATE/node-id`): how another node finds the owner of a handle. Absent in records
    /// of daemons that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// The capability of a node that maps the sim's shared files (`peer.shared_dir`): an owner
/// grants such files only to a node that lists it.
pub const SHARED_FILE: &str = "shared-file";

impl MemberRecord {
    /// Whether the node lists `capability`.
    pub fn offers(&self, capability: &str) -> bool {
        self.capabilities.iter().any(|c| c == capability)
    }

    fn check(&self) -> Result<(), RecordError> {
        check_node_name("name", &self.name)?;
        if let Some(id) = &self.node_id
            && (id.len() != 16 || !id.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        {
            return Err(invalid("node_id", "must be 16 lowercase hex digits".into()));
        }
        if self.incarnation == 0 {
            return Err(invalid("incarnation", "0 is not an incarnation".into()));
        }
        check_peer_address(&self.peer_address)?;
        if self.capabilities.len() > MAX_LIST_LEN {
            return Err(invalid("capabilities", format!("more than {MAX_LIST_LEN}")));
        }
        for capability in &self.capabilities {
            check_node_name("capabilities", capability)?;
        }
        if self.groups.len() > MAX_LIST_LEN {
            return Err(invalid("groups", format!("more than {MAX_LIST_LEN}")));
        }
        for group in &self.groups {
            let (field, text) = match group {
                FabricGroup::NvlinkClique { cluster_uuid, .. } => ("groups.cluster_uuid", cluster_uuid),
                FabricGroup::CxlPool { pool } => ("groups.pool", pool),
            };
            if !is_group_name(text) {
                return Err(invalid(field, "must be 1 to 64 of [A-Za-z0-9._:-]".into()));
            }
        }
        if self.software.is_empty()
            || self.software.len() > MAX_VERSION_LEN
            || !self.software.bytes().all(is_token_byte)
        {
            return Err(invalid("software", "must be 1 to 64 of [A-Za-z0-9._:-]".into()));
        }
        Ok(())
    }
}

/// A slot's claim, stored both at `slots/<n>` and at `slot-of/<node>`, without a lease: a
/// node keeps its slot (and its GFAs) across restarts and deaths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotClaim {
    /// Format version ([`RECORD_VERSION`]).
    pub version: u32,
    /// The slot.
    pub slot: u32,
    /// The node that holds it.
    pub node: String,
}

impl SlotClaim {
    /// A claim of the current version.
    pub fn new(slot: u32, node: &str) -> Self {
        Self { version: RECORD_VERSION, slot, node: node.to_owned() }
    }

    fn check(&self) -> Result<(), RecordError> {
        if self.slot >= MAX_SLOTS {
            return Err(invalid("slot", format!("{} is not below {MAX_SLOTS}", self.slot)));
        }
        check_node_name("node", &self.node)
    }
}

/// Most ranges one node's placements record lists.
pub const MAX_PLACED_RANGES: usize = 4096;
/// Longest owner (a device id, or `set:NAME`) a placed range names.
pub const MAX_OWNER_LEN: usize = 256;

/// What a placed range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacedKind {
    /// One memory resource, mapped directly.
    Direct,
    /// A CXL interleave set.
    Interleave,
    /// Reserved for an owner that vanished: nothing translates there.
    Hole,
}

/// One range of a node's slot (read tolerantly, like its record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedRange {
    /// First GFA.
    pub start: u64,
    /// Bytes reserved in the slot.
    pub reserved: u64,
    /// Bytes that translate (0 for a hole; at most `reserved`).
    pub size: u64,
    /// What the range is.
    pub kind: PlacedKind,
    /// The device id of a resource, or `set:NAME` of an interleave set.
    pub owner: String,
    /// The memory kind of a resource (`hbm`, `cxl_volatile`, ...), absent for a set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
    /// The resource's ordinal among its device's resources of that kind.
    #[serde(default)]
    pub ordinal: u16,
}

/// `placements/<node>`: where one node placed its memory, all inside its slot. Written by
/// the node after each committed change of its map; read by every other node to hold the
/// domain's map. Read tolerantly ([`crate::tolerant`]): fields a newer node added are
/// ignored, and ranges of a kind this build does not know are left out (nothing of this
/// node translates there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementsRecord {
    /// Format version.
    pub version: u32,
    /// The node.
    pub node: String,
    /// Its incarnation when it wrote this record.
    pub incarnation: u64,
    /// The node's map generation the ranges come from.
    pub generation: u64,
    /// Its slot.
    pub slot: u32,
    /// The domain's node span (the slot's size).
    pub span: u64,
    /// The ranges, by start, without overlaps.
    #[serde(deserialize_with = "crate::tolerant::known")]
    pub ranges: Vec<PlacedRange>,
}

impl PlacementsRecord {
    /// The slot's first GFA and one past its last (`None` when it lies beyond 2^64).
    pub fn slot_range(&self) -> Option<(u64, u64)> {
        let start = u64::from(self.slot).checked_mul(self.span)?;
        Some((start, start.checked_add(self.span)?))
    }

    /// The range holding `gfa`, if any.
    pub fn range_at(&self, gfa: u64) -> Option<&PlacedRange> {
        let i = self.ranges.partition_point(|r| r.start <= gfa).checked_sub(1)?;
        self.ranges.get(i).filter(|r| gfa - r.start < r.reserved)
    }

    fn check(&self) -> Result<(), RecordError> {
        check_node_name("node", &self.node)?;
        if self.slot >= MAX_SLOTS {
            return Err(invalid("slot", format!("{} is not below {MAX_SLOTS}", self.slot)));
        }
        if !self.span.is_power_of_two() || self.span < MIN_NODE_SPAN {
            return Err(invalid("span", format!("{:#x} is not a power of two of at least 1 GiB", self.span)));
        }
        let (low, high) =
            self.slot_range().ok_or_else(|| invalid("slot", format!("slot {} lies beyond 2^64", self.slot)))?;
        if self.ranges.len() > MAX_PLACED_RANGES {
            return Err(invalid("ranges", format!("more than {MAX_PLACED_RANGES}")));
        }
        let mut next = low;
        for r in &self.ranges {
            let end = r.start.checked_add(r.reserved).filter(|&e| r.reserved > 0 && r.start >= low && e <= high);
            let Some(end) = end else {
                let reason =
                    format!("{:#x}+{:#x} is not inside slot {} [{low:#x}, {high:#x})", r.start, r.reserved, self.slot);
                return Err(invalid("ranges.start", reason));
            };
            if r.start < next {
                return Err(invalid(
                    "ranges.start",
                    format!("{:#x} overlaps the range before it (unsorted or overlapping)", r.start),
                ));
            }
            next = end;
            if r.size > r.reserved || (r.kind == PlacedKind::Hole && r.size != 0) {
                return Err(invalid(
                    "ranges.size",
                    format!("{:#x} at {:#x} does not fit its reservation", r.size, r.start),
                ));
            }
            if r.owner.is_empty() || r.owner.len() > MAX_OWNER_LEN || !r.owner.bytes().all(is_owner_byte) {
                return Err(invalid("ranges.owner", format!("must be 1 to {MAX_OWNER_LEN} of [A-Za-z0-9._:/#@+-]")));
            }
            match (&r.memory, r.kind) {
                (None, PlacedKind::Direct) => {
                    return Err(invalid("ranges.memory", "a resource names its memory kind".into()));
                }
                (Some(m), _) if m.is_empty() || m.len() > MAX_VERSION_LEN || !m.bytes().all(is_token_byte) => {
                    return Err(invalid("ranges.memory", "must be 1 to 64 of [A-Za-z0-9._:-]".into()));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// A record type stored in etcd.
pub trait Record: Serialize + DeserializeOwned {
    /// Checks the ranges serde cannot express.
    fn validate(&self) -> Result<(), RecordError>;
}

impl Record for DomainSettings {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

impl Record for MemberRecord {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

impl Record for SlotClaim {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

impl Record for PlacementsRecord {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

/// Just the version field, read before the record itself so that a record of another
/// version is named as such rather than as malformed.
#[derive(Deserialize)]
struct VersionProbe {
    version: u32,
}

/// Encodes a record (for records this build made: their fields are in range).
pub fn encode<R: Record>(record: &R) -> Vec<u8> {
    // Serializing these plain structs (strings, integers, vectors, unit-like enums) into a
    // vector cannot fail; an empty value would be refused by every decoder, never misread.
    serde_json::to_vec(record).unwrap_or_default()
}

/// Decodes and checks a record read from etcd.
pub fn decode<R: Record>(bytes: &[u8], limits: RecordLimits) -> Result<R, RecordError> {
    if bytes.len() > limits.max_bytes() {
        return Err(RecordError::Oversized { len: bytes.len(), max: limits.max_bytes() });
    }
    let probe: VersionProbe = serde_json::from_slice(bytes).map_err(|e| json_error(bytes, &e))?;
    if probe.version != RECORD_VERSION {
        return Err(RecordError::WrongVersion { found: probe.version });
    }
    let record: R = serde_json::from_slice(bytes).map_err(|e| json_error(bytes, &e))?;
    record.validate()?;
    Ok(record)
}

fn json_error(bytes: &[u8], error: &serde_json::Error) -> RecordError {
    if error.is_eof() { RecordError::Truncated { len: bytes.len() } } else { RecordError::Malformed(error.to_string()) }
}

pub(crate) fn invalid(field: &'static str, reason: String) -> RecordError {
    RecordError::Invalid { field, reason }
}

pub(crate) fn check_node_name(field: &'static str, name: &str) -> Result<(), RecordError> {
    if is_valid_name(name) {
        Ok(())
    } else {
        Err(invalid(field, format!("{:?} is not a name", name.chars().take(80).collect::<String>())))
    }
}

fn is_owner_byte(b: u8) -> bool {
    is_token_byte(b) || matches!(b, b'/' | b'#' | b'@' | b'+')
}

pub(crate) fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

/// `host:port` with a non-zero port; the host a name or an IP address (`[v6]` bracketed).
pub fn check_peer_address(address: &str) -> Result<(), RecordError> {
    let fail =
        || invalid("peer_address", format!("{:?} is not host:port", address.chars().take(80).collect::<String>()));
    if address.len() > MAX_PEER_ADDRESS_LEN {
        return Err(fail());
    }
    if address.parse::<std::net::SocketAddr>().is_ok_and(|a| a.port() != 0) {
        return Ok(());
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(fail)?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0) && !port.starts_with('+');
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if port_ok && host_ok { Ok(()) } else { Err(fail()) }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn member() -> MemberRecord {
        MemberRecord {
            version: RECORD_VERSION,
            name: "tray-3".into(),
            incarnation: 42,
            peer_address: "10.0.0.3:7400".into(),
            capabilities: vec!["shared-file".into()],
            groups: vec![
                FabricGroup::NvlinkClique { cluster_uuid: "c0ffee00-0000-4000-8000-000000000001".into(), clique_id: 7 },
                FabricGroup::CxlPool { pool: "pool-a".into() },
            ],
            software: "0.1.0".into(),
            node_id: Some("0123456789abcdef".into()),
        }
    }

    fn settings() -> DomainSettings {
        DomainSettings::new(57, 1 << 40, vec![DataPathKind::SharedFile, DataPathKind::Nvlink])
    }

    #[test]
    fn key_layout() {
        let keys = Keys::new("supernode");
        assert_eq!(keys.settings(), "/fabric/supernode/settings");
        assert_eq!(keys.member("tray-1"), "/fabric/supernode/members/tray-1");
        assert_eq!(keys.slot(12), "/fabric/supernode/slots/12");
        assert_eq!(keys.slot_of("tray-1"), "/fabric/supernode/slot-of/tray-1");
        assert_eq!(keys.placements("tray-1"), "/fabric/supernode/placements/tray-1");
        assert_eq!(keys.topology("tray-1"), "/fabric/supernode/topology/tray-1");
        assert_eq!(keys.parse_slot_key(b"/fabric/supernode/slots/12"), Some(12));
        for bad in ["slots/", "slots/012", "slots/-1", "slots/65536", "slots/1x", "slot-of/a"] {
            assert_eq!(keys.parse_slot_key(format!("/fabric/supernode/{bad}").as_bytes()), None, "{bad}");
        }
        assert_eq!(keys.parse_slot_key(b"/fabric/other/slots/1"), None);
    }

    #[test]
    fn records_round_trip() {
        let limits = RecordLimits::default();
        assert_eq!(decode::<MemberRecord>(&encode(&member()), limits), Ok(member()));
        assert_eq!(decode::<DomainSettings>(&encode(&settings()), limits), Ok(settings()));
        let claim = SlotClaim::new(9, "tray-9");
        assert_eq!(decode::<SlotClaim>(&encode(&claim), limits), Ok(claim));
    }

    #[test]
    fn refusals_are_typed() {
        let limits = RecordLimits::new(256);
        let bytes = encode(&SlotClaim::new(1, "a"));
        assert_eq!(decode::<SlotClaim>(&[], limits), Err(RecordError::Truncated { len: 0 }));
        assert_eq!(
            decode::<SlotClaim>(&bytes[..bytes.len() - 1], limits),
            Err(RecordError::Truncated { len: bytes.len() - 1 })
        );
        let v2 = br#"{"version":2,"slot":1,"node":"a","future":true}"#;
        assert_eq!(decode::<SlotClaim>(v2, limits), Err(RecordError::WrongVersion { found: 2 }));
        assert_eq!(decode::<SlotClaim>(&[b' '; 257], limits), Err(RecordError::Oversized { len: 257, max: 256 }));
        let extra = br#"{"version":1,"slot":1,"node":"a","extra":0}"#;
        assert!(matches!(decode::<SlotClaim>(extra, limits), Err(RecordError::Malformed(_))));
        let bad_node = br#"{"version":1,"slot":1,"node":"../x"}"#;
        assert!(matches!(decode::<SlotClaim>(bad_node, limits), Err(RecordError::Invalid { field: "node", .. })));
        let big_slot = br#"{"version":1,"slot":65536,"node":"a"}"#;
        assert!(matches!(decode::<SlotClaim>(big_slot, limits), Err(RecordError::Invalid { field: "slot", .. })));
        assert_eq!(RecordLimits::new(usize::MAX).max_bytes(), MAX_RECORD_BYTES);
    }

    #[test]
    fn settings_are_checked_and_compared() {
        let limits = RecordLimits::default();
        for (bits, span) in [(39u8, 1u64 << 30), (65, 1 << 30), (57, 3 << 30), (57, 1 << 20), (40, 1 << 41)] {
            let s = DomainSettings { address_bits: bits, node_span: span, ..settings() };
            assert!(matches!(decode::<DomainSettings>(&encode(&s), limits), Err(RecordError::Invalid { .. })));
        }
        let unsorted =
            DomainSettings { data_paths: vec![DataPathKind::Nvlink, DataPathKind::SharedFile], ..settings() };
        assert!(decode::<DomainSettings>(&encode(&unsorted), limits).is_err());
        assert_eq!(settings().slot_count(), 1 << 16);
        assert_eq!(DomainSettings::new(44, 1 << 40, vec![DataPathKind::Cxl]).slot_count(), 16);
        assert_eq!(DomainSettings::new(64, 1 << 63, vec![DataPathKind::Cxl]).slot_count(), 2);
        let other = DomainSettings::new(52, 1 << 40, vec![DataPathKind::SharedFile]);
        assert_eq!(settings().difference(&other), Some(("address_bits", "57".into(), "52".into())));
        assert_eq!(settings().difference(&settings()), None);
    }

    #[test]
    fn member_fields_are_checked() {
        let limits = RecordLimits::default();
        let cases: Vec<(&str, MemberRecord)> = vec![
            ("incarnation", MemberRecord { incarnation: 0, ..member() }),
            ("peer_address", MemberRecord { peer_address: "10.0.0.3".into(), ..member() }),
            ("peer_address", MemberRecord { peer_address: "h:0".into(), ..member() }),
            ("peer_address", MemberRecord { peer_address: "a b:1".into(), ..member() }),
            ("capabilities", MemberRecord { capabilities: vec!["x".into(); 33], ..member() }),
            ("software", MemberRecord { software: String::new(), ..member() }),
            ("node_id", MemberRecord { node_id: Some("0123".into()), ..member() }),
            ("node_id", MemberRecord { node_id: Some("0123456789ABCDEF".into()), ..member() }),
            ("groups.pool", MemberRecord { groups: vec![FabricGroup::CxlPool { pool: "a/b".into() }], ..member() }),
        ];
        for (field, record) in cases {
            match decode::<MemberRecord>(&encode(&record), limits) {
                Err(RecordError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        for good in ["node-1.example:7400", "[::1]:7400", "127.0.0.1:1"] {
            let record = MemberRecord { peer_address: good.into(), ..member() };
            assert!(decode::<MemberRecord>(&encode(&record), limits).is_ok(), "{good}");
        }
    }

    #[test]
    fn groups_print_as_domain_nodes_lists_them() {
        let clique = FabricGroup::NvlinkClique { cluster_uuid: "c0ffee".into(), clique_id: 7 };
        assert_eq!(clique.to_string(), "nvlink-clique:c0ffee.7");
        assert_eq!(FabricGroup::CxlPool { pool: "serial:cxl_0x5eed".into() }.to_string(), "cxl-pool:serial:cxl_0x5eed");
        for good in ["p", "serial:cxl_0x5eed0000", &"x".repeat(MAX_VERSION_LEN)] {
            assert!(is_group_name(good), "{good}");
        }
        for bad in ["", "a/b", "a b", "pool\n", &"x".repeat(MAX_VERSION_LEN + 1)] {
            assert!(!is_group_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_newer_nodes_member_and_placements_are_read_with_what_this_build_knows() {
        let limits = RecordLimits::default();
        // A member record with a field and a fabric group of a kind this build does not
        // know: read without them; the node stays a member.
        let text = String::from_utf8(encode(&member())).unwrap();
        let newer = text.replacen("\"groups\":[", "\"groups\":[{\"ualink_pod\":{\"pod\":3}},", 1).replacen(
            "\"software\"",
            "\"rack\":\"r12\",\"software\"",
            1,
        );
        assert_eq!(decode::<MemberRecord>(newer.as_bytes(), limits), Ok(member()));
        // A known group of the wrong shape, a known field of the wrong type: refused.
        let bad = text.replacen("\"clique_id\":7", "\"clique_id\":\"seven\"", 1);
        assert!(matches!(decode::<MemberRecord>(bad.as_bytes(), limits), Err(RecordError::Malformed(_))));
        let bad = text.replacen("\"incarnation\":42", "\"incarnation\":\"42\"", 1);
        assert!(matches!(decode::<MemberRecord>(bad.as_bytes(), limits), Err(RecordError::Malformed(_))));

        // Placements with a range of a kind this build does not know, and a new field: the
        // range is left out (nothing of it translates here), the others stay.
        let base = 3 * 64 * GIB;
        let mut good = placements(3);
        good.ranges = vec![range(base, GIB), range(base + GIB, GIB), range(base + 2 * GIB, GIB)];
        let text = String::from_utf8(encode(&good)).unwrap();
        let second = format!("\"start\":{}", base + GIB);
        let at = text.find(&second).unwrap();
        let (head, tail) = text.split_at(at);
        let tail = tail.replacen("\"kind\":\"direct\"", "\"kind\":\"remote_window\",\"window\":9", 1);
        let newer = format!("{head}{tail}").replacen("\"ranges\"", "\"epoch\":5,\"ranges\"", 1);
        let read = decode::<PlacementsRecord>(newer.as_bytes(), limits).unwrap();
        assert_eq!(read.ranges, [range(base, GIB), range(base + 2 * GIB, GIB)]);
        // The settings, slots and shares stay strict: what nodes write back is never dropped.
        let extra = br#"{"version":1,"slot":1,"node":"a","extra":0}"#;
        assert!(matches!(decode::<SlotClaim>(extra, limits), Err(RecordError::Malformed(_))));
    }

    fn name() -> impl Strategy<Value = String> {
        "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
    }

    const GIB: u64 = 1 << 30;

    fn range(start: u64, reserved: u64) -> PlacedRange {
        PlacedRange {
            start,
            reserved,
            size: reserved,
            kind: PlacedKind::Direct,
            owner: "name:tray3/gpu0".into(),
            memory: Some("hbm".into()),
            ordinal: 0,
        }
    }

    fn placements(slot: u32) -> PlacementsRecord {
        PlacementsRecord {
            version: RECORD_VERSION,
            node: "tray3".into(),
            incarnation: 7,
            generation: 2,
            slot,
            span: 64 * GIB,
            ranges: vec![],
        }
    }

    #[test]
    fn placements_stay_inside_their_slot() {
        let limits = RecordLimits::default();
        let base = 3 * 64 * GIB;
        let mut good = placements(3);
        good.ranges = vec![range(base, GIB), range(base + GIB, 63 * GIB)];
        assert_eq!(decode::<PlacementsRecord>(&encode(&good), limits), Ok(good.clone()));
        assert_eq!(good.range_at(base + GIB + 5).map(|r| r.start), Some(base + GIB));
        assert_eq!(good.range_at(base - 1), None);
        let field = |r: &PlacementsRecord| match decode::<PlacementsRecord>(&encode(r), limits) {
            Err(RecordError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let mut outside = good.clone();
        outside.ranges = vec![range(base - GIB, GIB)];
        assert_eq!(field(&outside), "ranges.start");
        let mut past_end = good.clone();
        past_end.ranges = vec![range(base + 63 * GIB, 2 * GIB)];
        assert_eq!(field(&past_end), "ranges.start");
        let mut wraps = good.clone();
        wraps.ranges = vec![range(u64::MAX - 1, 4)];
        assert_eq!(field(&wraps), "ranges.start");
        let mut overlap = good.clone();
        overlap.ranges = vec![range(base, 2 * GIB), range(base + GIB, GIB)];
        assert_eq!(field(&overlap), "ranges.start");
        let mut unsorted = good.clone();
        unsorted.ranges.reverse();
        assert_eq!(field(&unsorted), "ranges.start");
        let mut big = good.clone();
        big.ranges[0].size = 2 * GIB;
        assert_eq!(field(&big), "ranges.size");
        let mut owner = good.clone();
        owner.ranges[0].owner = "a b".into();
        assert_eq!(field(&owner), "ranges.owner");
        let mut kindless = good.clone();
        kindless.ranges[0].memory = None;
        assert_eq!(field(&kindless), "ranges.memory");
        let mut span = good.clone();
        span.span = 3 * GIB;
        assert_eq!(field(&span), "span");
        let mut beyond = good;
        beyond.slot = MAX_SLOTS - 1;
        beyond.span = 1 << 62;
        assert_eq!(field(&beyond), "slot");
    }

    proptest! {
        #[test]
        fn any_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let limits = RecordLimits::new(256);
            let _ = decode::<SlotClaim>(&bytes, limits);
            let _ = decode::<MemberRecord>(&bytes, limits);
            let _ = decode::<DomainSettings>(&bytes, limits);
            let _ = decode::<PlacementsRecord>(&bytes, limits);
        }

        #[test]
        fn placements_round_trip(slot in 0u32..1024, count in 0usize..8, step in 1u64..4) {
            let mut record = placements(slot);
            record.ranges = (0..count as u64)
                .map(|i| range(record.slot_range().unwrap().0 + i * step * GIB, GIB))
                .collect();
            prop_assert_eq!(decode::<PlacementsRecord>(&encode(&record), RecordLimits::default()), Ok(record));
        }

        #[test]
        fn claims_round_trip(slot in 0..MAX_SLOTS, node in name()) {
            let claim = SlotClaim::new(slot, &node);
            prop_assert_eq!(decode::<SlotClaim>(&encode(&claim), RecordLimits::default()), Ok(claim));
        }

        #[test]
        fn members_round_trip(
            node in name(),
            incarnation in 1..u64::MAX,
            port in 1..u16::MAX,
            capabilities in proptest::collection::vec(name(), 0..4),
            clique in any::<u32>(),
        ) {
            let record = MemberRecord {
                name: node,
                incarnation,
                peer_address: format!("10.1.2.3:{port}"),
                capabilities,
                groups: vec![FabricGroup::NvlinkClique { cluster_uuid: "u-1".into(), clique_id: clique }],
                ..member()
            };
            prop_assert_eq!(decode::<MemberRecord>(&encode(&record), RecordLimits::default()), Ok(record));
        }

        #[test]
        fn every_truncation_is_refused(cut in 0usize..200) {
            let bytes = encode(&member());
            let cut = cut.min(bytes.len() - 1);
            prop_assert!(decode::<MemberRecord>(&bytes[..cut], RecordLimits::default()).is_err());
        }
    }
}
