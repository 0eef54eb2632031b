//! A listing of a snapshot for operators: every range with its owner, every interleave set,
//! every hole, and the utilisation of each node slot. Plain serialisable data that the CLI
//! renders as a table or JSON.

use serde::{Deserialize, Serialize};

use fabric_topology::MemoryKind;

use crate::snapshot::Snapshot;
use crate::state::Presence;

/// What a listed range is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RangeKind {
    /// One resource, mapped directly.
    Direct,
    /// An interleave set.
    Interleave,
    /// A hole left by a vanished resource or a set with a vanished member.
    Hole,
}

/// One listed range.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeInfo {
    /// First GFA.
    pub start: u64,
    /// Bytes that translate (0 for a hole).
    pub size: u64,
    /// Bytes reserved.
    pub reserved: u64,
    /// Node whose slot holds it.
    pub node: String,
    /// What it is.
    pub kind: RangeKind,
    /// Owner: the resource (`DEVICE#kindN`) or `set:NAME`.
    pub owner: String,
    /// Memory kind of a direct range or hole of a resource.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryKind>,
    /// Generation at which a hole's owner vanished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vanished_since: Option<u64>,
    /// Interleave ways, granularity and members (position order), for sets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub interleave: Option<InterleaveInfo>,
}

/// Interleave details of a listed set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterleaveInfo {
    /// Ways.
    pub ways: u32,
    /// Granularity in bytes.
    pub granularity: u64,
    /// Bytes of each member.
    pub member_size: u64,
    /// Members, in position order.
    pub members: Vec<String>,
}

/// One node slot and how full it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeUsage {
    /// Node.
    pub node: String,
    /// First GFA of the slot.
    pub start: u64,
    /// Slot size.
    pub span: u64,
    /// Bytes reserved by ranges and holes in the slot.
    pub reserved: u64,
    /// Bytes that translate.
    pub mapped: u64,
    /// `reserved / span`.
    pub utilisation: f64,
    /// In a domain's map: `live`, or `gone` for a node whose lease ended (its slot kept, a
    /// hole that keeps its GFAs). Absent in a node's own map.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

/// The whole listing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Listing {
    /// Generation.
    pub generation: u64,
    /// Address width.
    pub address_bits: u8,
    /// Node slots.
    pub nodes: Vec<NodeUsage>,
    /// Ranges, by start.
    pub ranges: Vec<RangeInfo>,
    /// Bytes that translate.
    pub mapped_bytes: u64,
    /// Bytes held by holes.
    pub hole_bytes: u64,
    /// One past the highest reserved GFA (0 when empty).
    pub high_water: u64,
}

impl Snapshot {
    /// Lists ranges, sets, holes and node utilisation.
    pub fn listing(&self) -> Listing {
        let st = self.state();
        let mut ranges = Vec::with_capacity(st.placements.len() + st.interleaves.len());
        for p in &st.placements {
            let (kind, size, since) = match p.presence {
                Presence::Present => (RangeKind::Direct, p.size, None),
                Presence::Vanished { since } => (RangeKind::Hole, 0, Some(since)),
            };
            ranges.push(RangeInfo {
                start: p.start,
                size,
                reserved: p.reserved,
                node: p.node.clone(),
                kind,
                owner: p.key.to_string(),
                memory: Some(p.key.kind),
                vanished_since: since,
                interleave: None,
            });
        }
        for s in &st.interleaves {
            let (kind, size, since) = match s.presence {
                Presence::Present => (RangeKind::Interleave, s.size(), None),
                Presence::Vanished { since } => (RangeKind::Hole, 0, Some(since)),
            };
            ranges.push(RangeInfo {
                start: s.start,
                size,
                reserved: s.reserved,
                node: s.node.clone(),
                kind,
                owner: format!("set:{}", s.name),
                memory: None,
                vanished_since: since,
                interleave: Some(InterleaveInfo {
                    ways: s.geometry.ways(),
                    granularity: s.geometry.granularity(),
                    member_size: s.member_size,
                    members: s.members.iter().map(ToString::to_string).collect(),
                }),
            });
        }
        ranges.sort_by_key(|r| r.start);
        let mut nodes: Vec<NodeUsage> = st
            .nodes
            .iter()
            .map(|n| NodeUsage {
                node: n.node.clone(),
                start: n.start,
                span: n.span,
                reserved: 0,
                mapped: 0,
                utilisation: 0.0,
                state: None,
            })
            .collect();
        for r in &ranges {
            let i = nodes.partition_point(|n| n.start <= r.start);
            if let Some(n) = i.checked_sub(1).and_then(|i| nodes.get_mut(i)) {
                n.reserved += r.reserved;
                n.mapped += r.size;
            }
        }
        for n in &mut nodes {
            n.utilisation = n.reserved as f64 / n.span as f64;
        }
        let hole_bytes = ranges.iter().filter(|r| r.kind == RangeKind::Hole).map(|r| r.reserved).sum();
        let high_water = ranges.iter().map(|r| r.start + r.reserved).max().unwrap_or(0);
        Listing {
            generation: st.generation,
            address_bits: st.config.address_bits,
            nodes,
            mapped_bytes: st.mapped_bytes(),
            hole_bytes,
            high_water,
            ranges,
        }
    }
}
