//! The placement algorithm: a pure, deterministic function from (previous state, inventory)
//! to (next state, change). Nodes are visited by name and resources by key, never in hash
//! order, so independent computations from the same inputs agree byte for byte.
//!
//! Rules: a placed range never moves while its resource fits in it; a resource that comes
//! back gets its old range; a vanished resource leaves a reserved hole until [`gc`]; new
//! resources take the lowest free aligned range in their node's slots, and a node that has
//! no room takes the lowest free slot of the space.

use std::collections::{BTreeMap, HashMap, HashSet};

use fabric_topology::{DeviceId, Inventory};
use serde::{Deserialize, Serialize};

use crate::alloc::Allocator;
use crate::config::align_up;
use crate::interleave::Geometry;
use crate::state::{FABRIC_NODE, InterleaveSet, NodeSlot, Partition, Placement, Presence, ResourceKey, State};

/// Errors from changing the layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No free slot or range is large enough.
    #[error("address space full: node {node} needs {need:#x} bytes")]
    AddressSpaceFull {
        /// Node being placed.
        node: String,
        /// Bytes it needed.
        need: u64,
    },
    /// A pinned node base is taken or out of space.
    #[error("node {node}: pinned base {base:#x} (+{span:#x}) is taken or out of space")]
    PinnedConflict {
        /// Node.
        node: String,
        /// Pinned base.
        base: u64,
        /// Slot span.
        span: u64,
    },
    /// A node's pinned base is not where its memory lies (a node slot never moves: its
    /// ranges' GFAs would, under the clients that map them).
    #[error(
        "node {node}: pinned base {base:#x}, but its memory lies at {at:#x} in this map (a node's ranges never move: lay the map out anew, without its saved record, to serve at the new base)"
    )]
    PinnedMoved {
        /// Node.
        node: String,
        /// Pinned base.
        base: u64,
        /// Where the node's first slot starts.
        at: u64,
    },
    /// A node pinned at `base` with a slot of `span` bytes whose memory lies past that
    /// slot in this map (a map laid out while the node had larger slots, or none pinned).
    #[error(
        "node {node}: pinned to [{base:#x}, +{span:#x}), but its memory reaches {end:#x} in this map (a node's ranges never move: lay the map out anew, without its saved record, to serve in that slot)"
    )]
    PinnedOutside {
        /// Node.
        node: String,
        /// Pinned base.
        base: u64,
        /// Pinned slot size.
        span: u64,
        /// Where the node's last slot in the map ends.
        end: u64,
    },
    /// A map that holds another node's slot, where only one node's belong (a domain
    /// node's own map: a record laid out while the daemon served under another name).
    #[error(
        "this map holds the slot of node {node} at {at:#x}, and serves node {this} only (a map laid out under another node name: lay the map out anew, without its saved record)"
    )]
    OtherNode {
        /// The node of the slot.
        node: String,
        /// The node the map serves.
        this: String,
        /// Where that slot starts.
        at: u64,
    },
    /// An interleave set of this name exists.
    #[error("interleave set {0:?} exists")]
    SetExists(String),
    /// No interleave set of this name.
    #[error("no interleave set {0:?}")]
    NoSuchSet(String),
    /// No partition of this name.
    #[error("no partition {0:?}")]
    NoSuchPartition(String),
    /// Member count differs from the ways.
    #[error("{ways}-way interleave set given {members} members")]
    MemberCount {
        /// Ways.
        ways: u32,
        /// Members given.
        members: usize,
    },
    /// A member is given twice.
    #[error("member {0} is given twice")]
    DuplicateMember(String),
    /// A member has no present direct range (unknown, vanished, or in another set).
    #[error("member {0} is not a present, directly mapped resource")]
    MemberUnavailable(String),
    /// The per-member size is zero, not a multiple of the granularity, or larger than a member.
    #[error(
        "member size {size:#x} is zero, not a multiple of {granularity}, or exceeds the smallest member ({smallest:#x})"
    )]
    MemberSize {
        /// Requested or computed size.
        size: u64,
        /// Granularity.
        granularity: u64,
        /// Smallest member.
        smallest: u64,
    },
}

/// One range in a change summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeChange {
    /// The resource.
    pub key: ResourceKey,
    /// Its (new) start.
    pub start: u64,
    /// Its size.
    pub size: u64,
    /// Its previous start, for moved ranges.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub previous: Option<u64>,
}

/// What one operation changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    /// Generation after the operation (unchanged when nothing changed).
    pub generation: u64,
    /// New resources and where they went.
    pub added: Vec<RangeChange>,
    /// Resources that came back to their old range.
    pub returned: Vec<RangeChange>,
    /// Resources that vanished (their ranges are now holes).
    pub vanished: Vec<RangeChange>,
    /// Resources whose size changed within their reservation.
    pub resized: Vec<RangeChange>,
    /// Resources that outgrew their reservation and moved.
    pub moved: Vec<RangeChange>,
    /// Holes collected.
    pub collected: Vec<RangeChange>,
    /// Direct ranges given up because their resource joined an interleave set.
    pub absorbed: Vec<RangeChange>,
    /// Node slots taken.
    pub nodes_added: Vec<NodeSlot>,
    /// Node slots released.
    pub nodes_removed: Vec<NodeSlot>,
    /// Interleave sets added, removed, or whose presence changed (by name).
    pub sets: Vec<String>,
    /// Partitions set or removed (by name).
    pub partitions: Vec<String>,
    /// Resources that fit nowhere (a pinned slot full, the address space full, a size past
    /// it): left out of the map, each with what it needed. Not a change of the map.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unplaced: Vec<Unplaced>,
}

/// A resource an inventory update could not place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unplaced {
    /// The resource.
    pub key: ResourceKey,
    /// The node it belongs to.
    pub node: String,
    /// Its size.
    pub size: u64,
}

impl Change {
    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty()
            && self.returned.is_empty()
            && self.vanished.is_empty()
            && self.resized.is_empty()
            && self.moved.is_empty()
            && self.collected.is_empty()
            && self.absorbed.is_empty()
            && self.nodes_added.is_empty()
            && self.nodes_removed.is_empty()
            && self.sets.is_empty()
            && self.partitions.is_empty()
    }
}

fn range(p: &Placement) -> RangeChange {
    RangeChange { key: p.key.clone(), start: p.start, size: p.size, previous: None }
}

/// Finishes an operation: bumps the generation when something changed.
fn finish(prev: &State, mut st: State, mut change: Change) -> (State, Change) {
    if change.is_empty() {
        change.generation = prev.generation;
        return (prev.clone(), change);
    }
    st.generation = prev.generation + 1;
    st.canonicalize();
    change.generation = st.generation;
    debug_assert_eq!(st.validate(), Ok(()));
    (st, change)
}

/// Places new ranges: holds the allocators and the per-node slot index for one operation.
struct Planner {
    slots: Allocator,
    ranges: Allocator,
    node_slots: BTreeMap<String, Vec<(u64, u64)>>,
}

impl Planner {
    fn new(st: &State) -> Self {
        let mut node_slots: BTreeMap<String, Vec<(u64, u64)>> = BTreeMap::new();
        for n in &st.nodes {
            node_slots.entry(n.node.clone()).or_default().push((n.start, n.start + n.span));
        }
        let direct = st.placements.iter().map(|p| (p.start, p.start + p.reserved));
        let sets = st.interleaves.iter().map(|s| (s.start, s.start + s.reserved));
        Self {
            slots: Allocator::new(st.nodes.iter().map(|n| (n.start, n.start + n.span))),
            ranges: Allocator::new(direct.chain(sets)),
            node_slots,
        }
    }

    /// Places `(reserved, align)` items in `node`, in order; returns their starts, `None`
    /// for an item that fits nowhere. A node whose base is pinned (a domain's slot) has that
    /// one slot, of its configured span: what does not fit in it stays unplaced, rather than
    /// take a slot (or a span) the domain gave another node. `PinnedConflict` when the
    /// pinned slot itself is taken or out of the address space.
    fn place(
        &mut self,
        st: &mut State,
        change: &mut Change,
        node: &str,
        items: &[(u64, u64)],
    ) -> Result<Vec<Option<u64>>, LayoutError> {
        let mut out: Vec<Option<u64>> = vec![None; items.len()];
        let slots = self.node_slots.get(node).cloned().unwrap_or_default();
        for (i, &(size, align)) in items.iter().enumerate() {
            out[i] = slots.iter().find_map(|&(lo, hi)| self.ranges.alloc(size, align, lo, hi));
        }
        let pin = st.config.nodes.get(node).and_then(|o| o.base);
        // Items no slot could be found for, alone: left out. Deferred: the largest of
        // several for which no slot held them all, tried again once the others are placed.
        let mut given_up = vec![false; items.len()];
        let mut deferred = vec![false; items.len()];
        loop {
            let open = |i: usize, deferred: &[bool]| out[i].is_none() && !given_up[i] && !deferred[i];
            let mut rest: Vec<usize> = (0..items.len()).filter(|&i| open(i, &deferred)).collect();
            if rest.is_empty() {
                deferred.fill(false);
                rest = (0..items.len()).filter(|&i| open(i, &deferred)).collect();
            }
            let first = !self.node_slots.contains_key(node);
            if rest.is_empty() || (pin.is_some() && !first) {
                break;
            }
            let need = rest.iter().map(|&i| items[i].0).fold(0u64, u64::saturating_add);
            let largest = rest.iter().copied().max_by_key(|&i| items[i].0).unwrap_or(0);
            let mut span = st.config.span_for(node, need);
            let start = match pin {
                Some(base) => {
                    let end = base.checked_add(span).filter(|&e| e <= st.config.limit());
                    match end {
                        Some(end) if self.slots.is_free(base, end) => {
                            self.slots.take(base, end);
                            base
                        }
                        // A slot sized by what it must hold, which the space above its base
                        // cannot hold: the largest item waits (alone, it fits nowhere), as
                        // unpinned, rather than fail the whole inventory (one bad size from
                        // sysfs would leave every other device unplaced).
                        None if span > st.config.span_for(node, 0) => {
                            if rest.len() > 1 {
                                deferred[largest] = true;
                            } else {
                                given_up[largest] = true;
                            }
                            continue;
                        }
                        _ => return Err(LayoutError::PinnedConflict { node: node.to_owned(), base, span }),
                    }
                }
                None => {
                    // At least the largest item's size.
                    let wide =
                        if span < items[largest].0 { items[largest].0.checked_next_power_of_two() } else { Some(span) };
                    let slot = wide.and_then(|w| Some((self.slots.alloc(w, w, st.config.base, st.config.limit())?, w)));
                    match slot {
                        Some((start, w)) => {
                            span = w;
                            start
                        }
                        // No slot for all of them: the largest waits until the others
                        // are placed, then is tried alone; alone, it fits nowhere. (Each
                        // round places, defers or gives up one: it ends.)
                        None if rest.len() > 1 => {
                            deferred[largest] = true;
                            continue;
                        }
                        None => {
                            given_up[largest] = true;
                            continue;
                        }
                    }
                }
            };
            let slot = NodeSlot { node: node.to_owned(), start, span };
            self.node_slots.entry(node.to_owned()).or_default().push((start, start + span));
            st.nodes.push(slot.clone());
            change.nodes_added.push(slot);
            let mut placed = false;
            for &i in &rest {
                out[i] = self.ranges.alloc(items[i].0, items[i].1, start, start + span);
                placed |= out[i].is_some();
            }
            if !placed {
                given_up[largest] = true;
            }
        }
        Ok(out)
    }
}

/// Index of kinds for per-kind ordinals.
fn kind_index(kind: fabric_topology::MemoryKind) -> usize {
    use fabric_topology::MemoryKind as K;
    match kind {
        K::Hbm => 0,
        K::Dram => 1,
        K::CxlVolatile => 2,
        K::CxlPersistent => 3,
        K::CxlDynamic => 4,
        K::HostExported => 5,
    }
}

/// The mapped resources of an inventory: key -> (node, size). Order of devices does not
/// matter; a key listed twice keeps its largest size.
pub fn wanted_resources(st: &State, inv: &Inventory) -> BTreeMap<ResourceKey, (String, u64)> {
    let mut wanted: BTreeMap<ResourceKey, (String, u64)> = BTreeMap::new();
    for d in &inv.devices {
        let mut ordinals = [0u16; 6];
        for m in &d.memory {
            let ord = &mut ordinals[kind_index(m.kind)];
            let key = ResourceKey::new(d.id.clone(), m.kind, *ord);
            *ord = ord.saturating_add(1);
            if !st.config.maps(m.kind) || m.size == 0 {
                continue;
            }
            let node = d.node.clone().unwrap_or_else(|| FABRIC_NODE.to_owned());
            let e = wanted.entry(key).or_insert((node, 0));
            e.1 = e.1.max(m.size);
        }
    }
    wanted
}

/// Brings the layout in line with an inventory of the whole domain.
pub fn apply_inventory(prev: &State, inv: &Inventory) -> Result<(State, Change), LayoutError> {
    apply_scoped(prev, inv, None)
}

/// Brings one node's part of the layout in line with that node's inventory: only the
/// placements and interleave sets in `node`'s slots (and resources the inventory puts on
/// `node`) change; every other node's stay byte for byte as they are, whatever `inv` says
/// of them. A set whose members span nodes (on [`crate::FABRIC_NODE`]) belongs to the
/// domain: `node` = `FABRIC_NODE`, or [`apply_inventory`], updates it.
pub fn apply_node_inventory(prev: &State, node: &str, inv: &Inventory) -> Result<(State, Change), LayoutError> {
    apply_scoped(prev, inv, Some(node))
}

fn apply_scoped(prev: &State, inv: &Inventory, scope: Option<&str>) -> Result<(State, Change), LayoutError> {
    let in_scope = |n: &str| scope.is_none_or(|s| s == n);
    let mut st = prev.clone();
    let mut change = Change::default();
    let next_gen = prev.generation + 1;
    let mut wanted = wanted_resources(prev, inv);
    wanted.retain(|_, (node, _)| in_scope(node));

    // Interleave members are not placed directly; a set is present when all its members are.
    let mut member_size: HashMap<ResourceKey, u64> = HashMap::new();
    for s in &st.interleaves {
        for m in &s.members {
            if let Some((_, size)) = wanted.remove(m) {
                member_size.insert(m.clone(), size);
            }
        }
    }
    for s in st.interleaves.iter_mut().filter(|s| in_scope(&s.node)) {
        let ok = s.members.iter().all(|m| member_size.get(m).is_some_and(|&sz| sz >= s.member_size));
        let presence = if ok { Presence::Present } else { Presence::Vanished { since: next_gen } };
        if (presence == Presence::Present) != (s.presence == Presence::Present) {
            s.presence = presence;
            change.sets.push(s.name.clone());
        }
    }

    // (key, node, size, its placement before, when it outgrew that).
    let mut pending: Vec<(ResourceKey, String, u64, Option<Placement>)> = Vec::new();
    let old = std::mem::take(&mut st.placements);
    for mut p in old {
        // Another node's range stays as it is, unless this node's inventory now has its
        // resource (a device that moved: its range is kept, as a domain update keeps it).
        if !in_scope(&p.node) && !wanted.contains_key(&p.key) {
            st.placements.push(p);
            continue;
        }
        match wanted.remove(&p.key) {
            Some((node, size)) => {
                // As it was: what it goes back to if it outgrew its range and fits nowhere.
                let before = p.clone();
                if p.presence != Presence::Present {
                    p.presence = Presence::Present;
                    if size <= p.reserved {
                        change.returned.push(RangeChange { size, ..range(&p) });
                    }
                }
                if size != p.size {
                    if size > p.reserved {
                        pending.push((p.key.clone(), node, size, Some(before)));
                        continue;
                    }
                    p.size = size;
                    change.resized.push(range(&p));
                }
                st.placements.push(p);
            }
            None => {
                if p.presence == Presence::Present {
                    p.presence = Presence::Vanished { since: next_gen };
                    change.vanished.push(range(&p));
                }
                st.placements.push(p);
            }
        }
    }
    pending.extend(wanted.into_iter().map(|(k, (node, size))| (k, node, size, None)));

    let mut by_node: BTreeMap<String, Vec<(ResourceKey, u64, Option<Placement>)>> = BTreeMap::new();
    for (key, node, size, previous) in pending {
        by_node.entry(node).or_default().push((key, size, previous));
    }
    let mut planner = Planner::new(&st);
    // An outgrown resource's range stays taken in this pass: nothing else is placed where
    // a stale GFA of it points, and it is there to go back to if it fits nowhere else.
    for old in by_node.values().flatten().filter_map(|(_, _, previous)| previous.as_ref()) {
        planner.ranges.take(old.start, old.start.saturating_add(old.reserved));
    }
    for (node, mut items) in by_node {
        items.sort_by(|a, b| a.0.cmp(&b.0));
        // A size no alignment can round up (untrusted, from sysfs) fits nowhere: an
        // unplaceable shape, so that it stays unplaced like one that does not fit.
        let shapes: Vec<(u64, u64)> = items
            .iter()
            .map(|(key, size, _)| {
                let align = st.config.align_of(&key.device);
                (align_up(*size, align).unwrap_or(u64::MAX), align)
            })
            .collect();
        let starts = planner.place(&mut st, &mut change, &node, &shapes)?;
        for (((key, size, previous), start), (reserved, _)) in items.into_iter().zip(starts).zip(shapes) {
            let Some(start) = start else {
                // One resource that fits nowhere costs only itself: the rest of the
                // inventory is still laid out, and one that outgrew its range keeps it.
                change.unplaced.push(Unplaced { key, node: node.clone(), size });
                st.placements.extend(previous);
                continue;
            };
            let p = Placement { key, node: node.clone(), start, reserved, size, presence: Presence::Present };
            match previous {
                Some(old) => change.moved.push(RangeChange { previous: Some(old.start), ..range(&p) }),
                None => change.added.push(range(&p)),
            }
            st.placements.push(p);
        }
    }
    Ok(finish(prev, st, change))
}

/// Which holes [`gc`] collects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GcFilter {
    /// Every hole.
    All,
    /// The holes of one device.
    Device(DeviceId),
    /// The holes in one node's slots.
    Node(String),
}

/// Releases holes; a node left with no ranges at all also gives its slots back.
pub fn gc(prev: &State, filter: &GcFilter) -> (State, Change) {
    let mut st = prev.clone();
    let mut change = Change::default();
    st.placements.retain(|p| {
        let hit = matches!(p.presence, Presence::Vanished { .. })
            && match filter {
                GcFilter::All => true,
                GcFilter::Device(d) => p.key.device == *d,
                GcFilter::Node(n) => p.node == *n,
            };
        if hit {
            change.collected.push(range(p));
        }
        !hit
    });
    let used: HashSet<&str> =
        st.placements.iter().map(|p| p.node.as_str()).chain(st.interleaves.iter().map(|s| s.node.as_str())).collect();
    let (keep, gone): (Vec<NodeSlot>, Vec<NodeSlot>) = st.nodes.drain(..).partition(|n| used.contains(n.node.as_str()));
    st.nodes = keep;
    change.nodes_removed = gone;
    finish(prev, st, change)
}

/// Creates an interleave set over present, directly mapped members (in position order).
/// Their direct ranges are given up and the set takes one range of `ways * member_size`.
/// `member_size` defaults to the smallest member rounded down to the granularity.
pub fn add_interleave(
    prev: &State,
    name: &str,
    geometry: Geometry,
    members: &[ResourceKey],
    member_size: Option<u64>,
) -> Result<(State, Change), LayoutError> {
    if prev.interleaves.iter().any(|s| s.name == name) {
        return Err(LayoutError::SetExists(name.to_owned()));
    }
    let ways = geometry.ways();
    if members.len() != ways as usize {
        return Err(LayoutError::MemberCount { ways, members: members.len() });
    }
    let mut st = prev.clone();
    let mut change = Change::default();
    let mut seen = HashSet::new();
    let mut taken = Vec::new();
    for m in members {
        if !seen.insert(m) {
            return Err(LayoutError::DuplicateMember(m.to_string()));
        }
        let i = st
            .placements
            .iter()
            .position(|p| p.key == *m && p.presence == Presence::Present)
            .ok_or_else(|| LayoutError::MemberUnavailable(m.to_string()))?;
        taken.push(st.placements.remove(i));
    }
    let g = geometry.granularity();
    let smallest = taken.iter().map(|p| p.size).min().unwrap_or(0);
    let size = member_size.unwrap_or(smallest / g * g);
    if size == 0 || !size.is_multiple_of(g) || size > smallest {
        return Err(LayoutError::MemberSize { size, granularity: g, smallest });
    }
    let node = match taken.first() {
        Some(p) if taken.iter().all(|q| q.node == p.node) => p.node.clone(),
        _ => FABRIC_NODE.to_owned(),
    };
    let align = members.iter().map(|m| st.config.align_of(&m.device)).max().unwrap_or(st.config.device_align);
    let total = size.saturating_mul(u64::from(ways));
    let full = || LayoutError::AddressSpaceFull { node: node.clone(), need: total };
    let reserved = align_up(total, align).ok_or_else(full)?;
    change.absorbed = taken.iter().map(range).collect();
    let mut planner = Planner::new(&st);
    let start = planner.place(&mut st, &mut change, &node, &[(reserved, align)])?.first().copied().flatten();
    let start = start.ok_or_else(full)?;
    st.interleaves.push(InterleaveSet {
        name: name.to_owned(),
        geometry,
        members: members.to_vec(),
        member_size: size,
        node,
        start,
        reserved,
        presence: Presence::Present,
    });
    change.sets.push(name.to_owned());
    Ok(finish(prev, st, change))
}

/// Removes an interleave set; its members are placed directly again by the next inventory
/// update.
pub fn remove_interleave(prev: &State, name: &str) -> Result<(State, Change), LayoutError> {
    let mut st = prev.clone();
    let i = st.interleaves.iter().position(|s| s.name == name).ok_or_else(|| LayoutError::NoSuchSet(name.into()))?;
    st.interleaves.remove(i);
    let change = Change { sets: vec![name.to_owned()], ..Change::default() };
    Ok(finish(prev, st, change))
}

/// Creates or replaces a partition.
pub fn set_partition(prev: &State, name: &str, devices: &[DeviceId]) -> (State, Change) {
    let mut st = prev.clone();
    let mut devices = devices.to_vec();
    devices.sort();
    devices.dedup();
    let part = Partition { name: name.to_owned(), devices };
    match st.partitions.iter_mut().find(|p| p.name == name) {
        Some(p) if *p == part => return finish(prev, st, Change::default()),
        Some(p) => *p = part,
        None => st.partitions.push(part),
    }
    finish(prev, st, Change { partitions: vec![name.to_owned()], ..Change::default() })
}

/// Removes a partition.
pub fn remove_partition(prev: &State, name: &str) -> Result<(State, Change), LayoutError> {
    let mut st = prev.clone();
    let i =
        st.partitions.iter().position(|p| p.name == name).ok_or_else(|| LayoutError::NoSuchPartition(name.into()))?;
    st.partitions.remove(i);
    Ok(finish(prev, st, Change { partitions: vec![name.to_owned()], ..Change::default() }))
}
