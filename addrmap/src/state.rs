//! The persisted map state: node slots, placements, interleave sets, partitions and the
//! generation. Everything else (the lookup index) is derived from it.
//!
//! Every list is kept in one canonical order (slots and placements by start, sets and
//! partitions by name) so that the same state always encodes to the same bytes.

use std::collections::HashSet;

use fabric_topology::{Device, DeviceId, MemoryKind};
use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, MIN_ALIGN, MapConfig};
use crate::interleave::Geometry;

/// Node name used for memory of devices that belong to no node, and for interleave sets whose
/// members span nodes.
pub const FABRIC_NODE: &str = "~fabric";

/// Stable identity of one memory resource: the device, the kind of memory, and its ordinal
/// among the device's resources of that kind. Enumeration order of devices never enters it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceKey {
    /// The device.
    pub device: DeviceId,
    /// Kind of memory.
    pub kind: MemoryKind,
    /// Ordinal among the device's resources of this kind (0 for the first HBM, ...).
    pub ordinal: u16,
}

impl ResourceKey {
    /// A key.
    pub fn new(device: DeviceId, kind: MemoryKind, ordinal: u16) -> Self {
        Self { device, kind, ordinal }
    }

    /// The key of `device.memory[index]`, or `None` when there is no such resource.
    pub fn of(device: &Device, index: usize) -> Option<Self> {
        let kind = device.memory.get(index)?.kind;
        let ordinal = device.memory[..index].iter().filter(|m| m.kind == kind).count();
        Some(Self::new(device.id.clone(), kind, u16::try_from(ordinal).ok()?))
    }
}

impl std::fmt::Display for ResourceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}#{}{}", self.device, kind_name(self.kind), self.ordinal)
    }
}

/// The short name of a memory kind (as in JSON).
pub fn kind_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Hbm => "hbm",
        MemoryKind::Dram => "dram",
        MemoryKind::CxlVolatile => "cxl_volatile",
        MemoryKind::CxlPersistent => "cxl_persistent",
        MemoryKind::CxlDynamic => "cxl_dynamic",
        MemoryKind::HostExported => "host_exported",
    }
}

/// Whether a placed range's owner is in the inventory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum Presence {
    /// The owner is present; the range translates.
    Present,
    /// The owner vanished at generation `since`; the range is a reserved hole.
    Vanished {
        /// Generation at which it vanished.
        since: u64,
    },
}

/// A node's slot: a span of GFA space whose ranges belong to that node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeSlot {
    /// Node name.
    pub node: String,
    /// First GFA.
    pub start: u64,
    /// Size in bytes.
    pub span: u64,
}

/// One resource's range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// Owner.
    pub key: ResourceKey,
    /// Node whose slot holds the range.
    pub node: String,
    /// First GFA.
    pub start: u64,
    /// Bytes reserved (the size rounded up to the device alignment).
    pub reserved: u64,
    /// Bytes that translate (the resource size).
    pub size: u64,
    /// Present or a hole.
    pub presence: Presence,
}

/// An interleave set: `ways` members striped over one range of `ways * member_size` bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InterleaveSet {
    /// Operator-given name.
    pub name: String,
    /// Ways and granularity.
    pub geometry: Geometry,
    /// Members in position order.
    pub members: Vec<ResourceKey>,
    /// Bytes of each member that the set uses (from DPA offset 0).
    pub member_size: u64,
    /// Node whose slot holds the range.
    pub node: String,
    /// First GFA.
    pub start: u64,
    /// Bytes reserved.
    pub reserved: u64,
    /// Present when every member is.
    pub presence: Presence,
}

impl InterleaveSet {
    /// Bytes that translate.
    pub fn size(&self) -> u64 {
        self.member_size * u64::from(self.geometry.ways())
    }
}

/// A named subset of devices: a tenant's view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partition {
    /// Name.
    pub name: String,
    /// Member devices, sorted.
    pub devices: Vec<DeviceId>,
}

/// The whole persisted state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    /// Bumped by every change.
    pub generation: u64,
    /// The configuration new placements follow.
    pub config: MapConfig,
    /// Node slots, by start.
    pub nodes: Vec<NodeSlot>,
    /// Direct ranges, by start.
    pub placements: Vec<Placement>,
    /// Interleave sets, by name.
    pub interleaves: Vec<InterleaveSet>,
    /// Partitions, by name.
    pub partitions: Vec<Partition>,
}

/// Why a state is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    /// The configuration is invalid.
    #[error("configuration")]
    Config(#[from] ConfigError),
    /// Some invariant does not hold; the text names it.
    #[error("{0}")]
    Invariant(String),
}

/// The highest generation a valid state has (see [`State::validate`]).
pub const MAX_GENERATION: u64 = 1 << 63;

impl State {
    /// An empty state at generation 0.
    pub fn new(config: MapConfig) -> Self {
        Self {
            generation: 0,
            config,
            nodes: Vec::new(),
            placements: Vec::new(),
            interleaves: Vec::new(),
            partitions: Vec::new(),
        }
    }

    /// Puts every list in canonical order.
    pub fn canonicalize(&mut self) {
        self.nodes.sort_by_key(|n| n.start);
        self.placements.sort_by_key(|p| p.start);
        self.interleaves.sort_by(|a, b| a.name.cmp(&b.name));
        self.partitions.sort_by(|a, b| a.name.cmp(&b.name));
    }

    /// Checks every invariant the rest of the crate relies on.
    pub fn validate(&self) -> Result<(), StateError> {
        self.config.validate()?;
        let bad = |s: String| Err(StateError::Invariant(s));
        // Generations only grow, one per change: one past 2^63 no map reached by changes (a
        // corrupt or hostile record), and near 2^64 it would wrap, a newer map reading as
        // older than every other.
        if self.generation > MAX_GENERATION {
            return bad(format!("generation {} is past {MAX_GENERATION}", self.generation));
        }
        let limit = self.config.limit();
        let mut prev_end = 0u64;
        for (i, n) in self.nodes.iter().enumerate() {
            let end = n.start.checked_add(n.span);
            if n.span < MIN_ALIGN || n.start % MIN_ALIGN != 0 || end.is_none_or(|e| e > limit) {
                return bad(format!(
                    "node slot {i} ({}) at {:#x}+{:#x} is misaligned or out of space",
                    n.node, n.start, n.span
                ));
            }
            if i > 0 && n.start < prev_end {
                return bad(format!("node slot {i} ({}) overlaps or is out of order", n.node));
            }
            prev_end = n.start + n.span;
        }
        // Every placed range: (start, end of reservation, node, label).
        let mut ranges: Vec<(u64, u64, &str, String)> = Vec::new();
        let mut keys = HashSet::new();
        for (i, p) in self.placements.iter().enumerate() {
            if p.size == 0
                || p.reserved < p.size
                || p.start % MIN_ALIGN != 0
                || p.start.checked_add(p.reserved).is_none()
            {
                return bad(format!("placement {i} ({}) has bad start, size or reservation", p.key));
            }
            if i > 0 && p.start < self.placements[i - 1].start {
                return bad(format!("placement {i} ({}) is out of order", p.key));
            }
            if !keys.insert(&p.key) {
                return bad(format!("resource {} is placed twice", p.key));
            }
            self.check_presence(p.presence, &p.key.to_string())?;
            ranges.push((p.start, p.start + p.reserved, &p.node, p.key.to_string()));
        }
        for (i, s) in self.interleaves.iter().enumerate() {
            if i > 0 && s.name <= self.interleaves[i - 1].name {
                return bad(format!("interleave set {} is duplicated or out of order", s.name));
            }
            let ways = s.geometry.ways() as usize;
            let total = s.member_size.checked_mul(ways as u64);
            if s.members.len() != ways
                || s.member_size == 0
                || s.member_size % s.geometry.granularity() != 0
                || total.is_none_or(|t| t > s.reserved)
                || s.start % MIN_ALIGN != 0
                || s.start.checked_add(s.reserved).is_none()
            {
                return bad(format!("interleave set {} has bad members, sizes or reservation", s.name));
            }
            for m in &s.members {
                if !keys.insert(m) {
                    return bad(format!("resource {m} is placed twice (interleave set {})", s.name));
                }
            }
            self.check_presence(s.presence, &s.name)?;
            ranges.push((s.start, s.start + s.reserved, &s.node, format!("interleave set {}", s.name)));
        }
        ranges.sort_by_key(|r| r.0);
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return bad(format!("{} overlaps {}", w[0].3, w[1].3));
            }
        }
        for (start, end, node, label) in &ranges {
            let slot = self.nodes.partition_point(|n| n.start <= *start).checked_sub(1).map(|i| &self.nodes[i]);
            match slot {
                Some(n) if n.node == *node && *end <= n.start + n.span => {}
                _ => return bad(format!("{label} at {start:#x} is not inside a slot of node {node}")),
            }
        }
        for (i, p) in self.partitions.iter().enumerate() {
            if i > 0 && p.name <= self.partitions[i - 1].name {
                return bad(format!("partition {} is duplicated or out of order", p.name));
            }
            if p.devices.windows(2).any(|w| w[0] >= w[1]) {
                return bad(format!("partition {} devices are not sorted and unique", p.name));
            }
        }
        Ok(())
    }

    fn check_presence(&self, p: Presence, label: &str) -> Result<(), StateError> {
        match p {
            Presence::Vanished { since } if since > self.generation => Err(StateError::Invariant(format!(
                "{label} vanished at generation {since}, after the state's generation {}",
                self.generation
            ))),
            _ => Ok(()),
        }
    }

    /// Bytes that translate (present direct ranges and present interleave sets).
    pub fn mapped_bytes(&self) -> u64 {
        let direct = self.placements.iter().filter(|p| p.presence == Presence::Present).map(|p| p.size);
        let sets = self.interleaves.iter().filter(|s| s.presence == Presence::Present).map(|s| s.size());
        direct.chain(sets).fold(0, u64::saturating_add)
    }
}
