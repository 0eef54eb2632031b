//! Helpers shared by the black-box tests: inventories and a naive reference translator.
#![allow(clippy::unwrap_used, reason = "test helpers panic on failure by design")]
#![allow(dead_code)]

use fabric_addrmap::{Presence, ResourceKey, State};
use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};

/// A device with one resource per (kind, size).
pub fn device(node: Option<&str>, id: &str, mem: &[(MemoryKind, u64)]) -> Device {
    let kind = if mem.iter().any(|m| m.0 == MemoryKind::Hbm) { DeviceKind::Gpu } else { DeviceKind::CxlMemdev };
    let mut d = Device::new(DeviceId::uuid(id), kind, node);
    for &(kind, size) in mem {
        d.memory.push(MemoryResource { kind, size, hpa: None, numa_node: None });
    }
    d
}

/// An inventory of devices, in the given order.
pub fn inventory(devices: impl IntoIterator<Item = Device>) -> Inventory {
    let mut inv = Inventory::new();
    for d in devices {
        inv.add_device(d).unwrap();
    }
    inv
}

/// What the reference says a GFA is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Naive {
    Direct(ResourceKey, u64),
    Member(ResourceKey, u64),
    Hole,
    Unmapped,
}

/// Linear scan over the state: the plain reference implementation.
pub fn naive_translate(st: &State, gfa: u64) -> Naive {
    for p in &st.placements {
        match p.presence {
            Presence::Present if gfa >= p.start && gfa < p.start + p.size => {
                return Naive::Direct(p.key.clone(), gfa - p.start);
            }
            Presence::Vanished { .. } if gfa >= p.start && gfa < p.start + p.reserved => return Naive::Hole,
            _ => {}
        }
    }
    for s in &st.interleaves {
        let end = if s.presence == Presence::Present { s.start + s.size() } else { s.start + s.reserved };
        if gfa >= s.start && gfa < end {
            if s.presence != Presence::Present {
                return Naive::Hole;
            }
            let off = gfa - s.start;
            let g = s.geometry.granularity();
            let w = u64::from(s.geometry.ways());
            let chunk = off / g;
            return Naive::Member(s.members[(chunk % w) as usize].clone(), (chunk / w) * g + off % g);
        }
    }
    Naive::Unmapped
}

/// The snapshot's answer in the reference's terms.
pub fn snap_translate(snap: &fabric_addrmap::Snapshot, gfa: u64) -> Naive {
    match snap.translate(gfa) {
        Ok(l) if l.set.is_some() => Naive::Member(snap.resource(l.resource).clone(), l.offset),
        Ok(l) => Naive::Direct(snap.resource(l.resource).clone(), l.offset),
        Err(fabric_addrmap::TranslateError::Hole { .. }) => Naive::Hole,
        Err(fabric_addrmap::TranslateError::Unmapped { .. }) => Naive::Unmapped,
        Err(e) => panic!("unexpected {e:?}"),
    }
}

/// Independent overlap check over every reserved range.
pub fn assert_no_overlaps(st: &State) {
    let mut r: Vec<(u64, u64)> = st.placements.iter().map(|p| (p.start, p.start + p.reserved)).collect();
    r.extend(st.interleaves.iter().map(|s| (s.start, s.start + s.reserved)));
    r.sort();
    for w in r.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap {w:x?}");
    }
    let mut n: Vec<(u64, u64)> = st.nodes.iter().map(|s| (s.start, s.start + s.span)).collect();
    n.sort();
    for w in n.windows(2) {
        assert!(w[0].1 <= w[1].0, "node slots overlap {w:x?}");
    }
    let limit = st.config.limit();
    assert!(n.last().is_none_or(|l| l.1 <= limit));
}

/// Addresses around every boundary of every range: one below and at each start, end of the
/// translating part, and end of the reservation.
pub fn boundary_probes(st: &State) -> Vec<u64> {
    let mut v = Vec::new();
    let mut edges: Vec<(u64, u64, u64)> = st.placements.iter().map(|p| (p.start, p.size, p.reserved)).collect();
    edges.extend(st.interleaves.iter().map(|s| (s.start, s.size(), s.reserved)));
    for (start, size, reserved) in edges {
        for g in [start.wrapping_sub(1), start, start + size - 1, start + size, start + reserved - 1, start + reserved]
        {
            v.push(g);
        }
    }
    for n in &st.nodes {
        v.extend([n.start, n.start + n.span - 1, n.start + n.span]);
    }
    v
}
