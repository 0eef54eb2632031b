//! The domain's map as every node shows it: a `fabric.map/v1` listing made from the
//! [`DomainView`] alone (this node's own placements included, as published), so every
//! node that saw the same records prints the same map. A gone node keeps its slot and its
//! ranges turn into holes; a slot without placements is listed empty.

use fabric_addrmap::{Listing, NodeUsage, RangeInfo, RangeKind};
use fabric_domain::{DomainView, NodeEntry, PlacedKind};
use fabric_topology::MemoryKind;

/// The listing of the domain; `generation` is the etcd revision the view reflects.
pub fn listing(view: &DomainView) -> Listing {
    let span = view.settings().map_or(0, |s| s.node_span);
    let mut nodes = Vec::new();
    let mut ranges = Vec::new();
    for n in view.nodes() {
        if let Some((usage, mut r)) = node_part(&n, span) {
            nodes.push(usage);
            ranges.append(&mut r);
        }
    }
    assemble(view, nodes, ranges)
}

/// One node's part of the listing: its slot's usage and its ranges (holes while it is
/// gone); `None` for a node that holds no slot.
pub fn node_part(n: &NodeEntry<'_>, span: u64) -> Option<(NodeUsage, Vec<RangeInfo>)> {
    let slot = n.slot?;
    let live = n.member.is_some();
    let mut reserved = 0;
    let mut mapped = 0;
    let mut ranges = Vec::new();
    for r in n.placements.map(|p| p.ranges.as_slice()).unwrap_or_default() {
        let kind = match (live, r.kind) {
            (false, _) | (_, PlacedKind::Hole) => RangeKind::Hole,
            (true, PlacedKind::Direct) => RangeKind::Direct,
            (true, PlacedKind::Interleave) => RangeKind::Interleave,
        };
        let size = if kind == RangeKind::Hole { 0 } else { r.size };
        reserved += r.reserved;
        mapped += size;
        ranges.push(RangeInfo {
            start: r.start,
            size,
            reserved: r.reserved,
            node: n.name.to_owned(),
            kind,
            owner: owner(r),
            memory: memory_kind(r.memory.as_deref()),
            vanished_since: None,
            interleave: None,
        });
    }
    let usage = NodeUsage {
        node: n.name.to_owned(),
        start: u64::from(slot).saturating_mul(span),
        span,
        reserved,
        mapped,
        utilisation: if span == 0 { 0.0 } else { reserved as f64 / span as f64 },
        state: Some(if live { "live" } else { "gone" }.to_owned()),
    };
    Some((usage, ranges))
}

/// The listing of these nodes' parts (all of the view's, or one page of them): sorted by
/// start, the totals theirs.
pub fn assemble(view: &DomainView, mut nodes: Vec<NodeUsage>, mut ranges: Vec<RangeInfo>) -> Listing {
    nodes.sort_by_key(|n| n.start);
    ranges.sort_by_key(|r| r.start);
    Listing {
        generation: u64::try_from(view.revision()).unwrap_or(0),
        address_bits: view.settings().map_or(0, |s| s.address_bits),
        mapped_bytes: ranges.iter().map(|r| r.size).sum(),
        hole_bytes: ranges.iter().filter(|r| r.kind == RangeKind::Hole).map(|r| r.reserved).sum(),
        high_water: ranges.iter().map(|r| r.start.saturating_add(r.reserved)).max().unwrap_or(0),
        nodes,
        ranges,
    }
}

/// `DEVICE#kindN` for a resource, as a node's own listing names it; `set:NAME` as is.
pub fn owner(r: &fabric_domain::PlacedRange) -> String {
    match &r.memory {
        Some(m) => format!("{}#{m}{}", r.owner, r.ordinal),
        None => r.owner.clone(),
    }
}

/// A published memory kind, when this build knows it.
pub fn memory_kind(name: Option<&str>) -> Option<MemoryKind> {
    serde_json::from_value(serde_json::Value::String(name?.to_owned())).ok()
}
