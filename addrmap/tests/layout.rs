//! Property tests of the layout: no overlaps, exact translation both ways against a linear
//! reference, stability under add/remove/restart/re-enumeration (with interleave sets made
//! and dropped and partitions redrawn in the same sequences), lowest-fit placement,
//! partition views against a reference, and byte-identical results from independent
//! computations.
#![allow(clippy::unwrap_used, reason = "test helpers panic on failure by design")]

mod common;

use std::collections::{BTreeSet, HashMap};

use common::{Naive, assert_no_overlaps, device, inventory, naive_translate, snap_translate};
use fabric_addrmap::interleave::{GRANULARITIES, WAYS};
use fabric_addrmap::{
    AddressMap, GIB, GcFilter, MapConfig, NodeSpan, Presence, ResourceKey, State, TranslateError, encode_state,
};
use fabric_topology::{Device, DeviceId, MemoryKind};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add(usize),
    Remove(usize),
    Restart,
    Reenumerate(u64),
    Gc(Option<usize>),
    /// An interleave set of `WAYS[ways]` present CXL resources (chosen from `pick`) with
    /// granularity `GRANULARITIES[gran]`.
    Interleave {
        ways: usize,
        gran: usize,
        pick: u64,
    },
    /// Drops one of the sets, if any.
    Uninterleave(u64),
    /// Redraws partition `p` as the devices whose bits are set.
    Partition(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..12usize).prop_map(Op::Add),
        2 => (0..12usize).prop_map(Op::Remove),
        1 => Just(Op::Restart),
        1 => any::<u64>().prop_map(Op::Reenumerate),
        1 => proptest::option::of(0..12usize).prop_map(Op::Gc),
        2 => (0..WAYS.len(), 0..GRANULARITIES.len(), any::<u64>())
            .prop_map(|(ways, gran, pick)| Op::Interleave { ways, gran, pick }),
        1 => any::<u64>().prop_map(Op::Uninterleave),
        1 => any::<u16>().prop_map(Op::Partition),
    ]
}

/// Twelve devices over three nodes and the fabric, every third a CXL device with two
/// resources (eight CXL resources for interleave sets); sizes from the seed.
fn universe(sizes: &[u64]) -> Vec<Device> {
    (0..12)
        .map(|i| {
            let node = match i % 4 {
                3 => None,
                n => Some(["n-a", "n-b", "n-c"][n]),
            };
            let s = sizes[i];
            if i % 3 == 2 {
                device(
                    node,
                    &format!("CXL-{i}"),
                    &[(MemoryKind::CxlVolatile, s), (MemoryKind::CxlPersistent, s / 2 + 1)],
                )
            } else {
                device(node, &format!("GPU-{i}"), &[(MemoryKind::Hbm, s)])
            }
        })
        .collect()
}

fn config(small: bool) -> MapConfig {
    if small {
        // Small fixed node slots so nodes overflow into extension slots, and one device
        // with a coarser alignment.
        let mut c = MapConfig { node_span: NodeSpan::Fixed(256 * GIB), address_bits: 48, ..MapConfig::default() };
        c.devices.insert(DeviceId::uuid("GPU-1"), fabric_addrmap::DeviceOverride { align: Some(64 * GIB) });
        c
    } else {
        MapConfig::default()
    }
}

fn shuffled(devs: &[Device], present: &BTreeSet<usize>, seed: u64) -> fabric_topology::Inventory {
    let mut list: Vec<Device> = present.iter().map(|&i| devs[i].clone()).collect();
    let mut x = seed | 1;
    for i in (1..list.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        list.swap(i, (x % (i as u64 + 1)) as usize);
    }
    inventory(list)
}

fn keys_of(d: &Device) -> Vec<(ResourceKey, u64)> {
    (0..d.memory.len()).map(|i| (ResourceKey::of(d, i).unwrap(), d.memory[i].size)).collect()
}

/// The lowest `align`-aligned window of `size` bytes in `node`'s slots of `st`, by brute force.
fn naive_lowest_fit(st: &State, node: &str, size: u64, align: u64) -> Option<u64> {
    let taken: Vec<(u64, u64)> = st
        .placements
        .iter()
        .map(|p| (p.start, p.start + p.reserved))
        .chain(st.interleaves.iter().map(|s| (s.start, s.start + s.reserved)))
        .collect();
    for slot in st.nodes.iter().filter(|n| n.node == node) {
        let mut c = slot.start.next_multiple_of(align);
        while c + size <= slot.start + slot.span {
            if taken.iter().all(|&(s, e)| c + size <= s || c >= e) {
                return Some(c);
            }
            c += align;
        }
    }
    None
}

fn check_translation(map: &AddressMap, devs: &[Device], present: &BTreeSet<usize>, rng: &mut u64) {
    let snap = map.snapshot();
    let st = snap.state();
    for &i in present {
        for (key, size) in keys_of(&devs[i]) {
            // A member of a present set translates through the set, for its first
            // `member_size` bytes; a member of a set that is a hole has no GFA.
            let set = st.interleaves.iter().find(|s| s.members.contains(&key));
            let (mapped, want): (u64, fn(ResourceKey, u64) -> Naive) = match set {
                Some(s) if s.presence == Presence::Present => (s.member_size, Naive::Member),
                Some(_) => {
                    assert!(snap.reverse_key(&key, 0).is_err(), "{key} is in a vanished set");
                    continue;
                }
                // A member of a dropped set is placed again by the next inventory update.
                None if !st.placements.iter().any(|p| p.key == key) => {
                    assert_eq!(snap.reverse_key(&key, 0), Err(TranslateError::UnknownResource), "{key}");
                    continue;
                }
                None => (size, Naive::Direct),
            };
            for off in [0, mapped - 1, mapped / 2, *rng % mapped] {
                let gfa = snap.reverse_key(&key, off).unwrap();
                assert_eq!(snap_translate(&snap, gfa), want(key.clone(), off));
            }
            assert!(snap.reverse_key(&key, mapped).is_err());
            *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
    }
    let mut probes = common::boundary_probes(st);
    // Random addresses (most near mapped space) agree with the linear reference.
    let high = snap.listing().high_water.max(1);
    for _ in 0..200 {
        *rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        probes.push((*rng >> 7) % (high + GIB));
    }
    for &gfa in &probes {
        assert_eq!(snap_translate(&snap, gfa), naive_translate(st, gfa), "gfa {gfa:#x}");
    }
    // Every partition's view answers what the reference answers for ranges whose devices
    // are all its own, `NotInPartition` for any other range, and `Unmapped` outside ranges.
    for part in &st.partitions {
        let view = snap.partition(&part.name).unwrap();
        for &gfa in &probes {
            let want = match owners(st, gfa) {
                None => Err("unmapped"),
                Some(devices) if devices.iter().all(|d| part.devices.contains(d)) => Ok(naive_translate(st, gfa)),
                Some(_) => Err("not in partition"),
            };
            let got = match view.translate(gfa) {
                Ok(l) if l.set.is_some() => Ok(Naive::Member(snap.resource(l.resource).clone(), l.offset)),
                Ok(l) => Ok(Naive::Direct(snap.resource(l.resource).clone(), l.offset)),
                Err(TranslateError::Hole { .. }) => Ok(Naive::Hole),
                Err(TranslateError::Unmapped { .. }) => Err("unmapped"),
                Err(TranslateError::NotInPartition { .. }) => Err("not in partition"),
                Err(e) => panic!("unexpected {e:?}"),
            };
            assert_eq!(got, want, "partition {} gfa {gfa:#x}", part.name);
        }
    }
}

/// The devices behind the range holding `gfa` (its translating part or its hole), by a
/// linear scan; `None` outside every range.
fn owners(st: &State, gfa: u64) -> Option<Vec<DeviceId>> {
    for p in &st.placements {
        let end = if p.presence == Presence::Present { p.start + p.size } else { p.start + p.reserved };
        if gfa >= p.start && gfa < end {
            return Some(vec![p.key.device.clone()]);
        }
    }
    for s in &st.interleaves {
        let end = if s.presence == Presence::Present { s.start + s.size() } else { s.start + s.reserved };
        if gfa >= s.start && gfa < end {
            return Some(s.members.iter().map(|m| m.device.clone()).collect());
        }
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn layout_is_stable_exact_and_deterministic(
        small in any::<bool>(),
        sizes in proptest::collection::vec(1u64..(300 * GIB), 12),
        ops in proptest::collection::vec(op(), 1..24),
    ) {
        let devs = universe(&sizes);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("map.state");
        let mut map = AddressMap::new(config(small)).unwrap();
        let mut twin = AddressMap::new(config(small)).unwrap();
        let mut present = BTreeSet::new();
        let mut home: HashMap<ResourceKey, u64> = HashMap::new();
        let mut set_home: HashMap<String, u64> = HashMap::new();
        // A dropped set's members wait for the next inventory update to be placed.
        let mut unplaced = false;
        let mut rng = 0x1234_5678u64;
        for (step, op) in ops.into_iter().enumerate() {
            let before = map.state().clone();
            let gen_before = map.generation();
            let mut added = None;
            let change = match &op {
                Op::Add(i) => { if present.insert(*i) { added = Some(*i); } None }
                Op::Remove(i) => { present.remove(i); None }
                Op::Restart => {
                    map.save(&path).unwrap();
                    map = AddressMap::load(&path).unwrap();
                    prop_assert_eq!(map.state(), &before);
                    continue;
                }
                Op::Reenumerate(_) => None,
                Op::Gc(which) => {
                    let filter = match which { Some(i) => GcFilter::Device(devs[*i].id.clone()), None => GcFilter::All };
                    let c = map.gc(&filter);
                    twin.gc(&filter);
                    for r in &c.collected { home.remove(&r.key); }
                    Some(c)
                }
                Op::Interleave { ways, gran, pick } => {
                    let ways = usize::from(WAYS[*ways]);
                    let gran = u64::from(GRANULARITIES[*gran]);
                    let free: Vec<ResourceKey> = map.state().placements.iter()
                        .filter(|p| p.presence == Presence::Present && p.key.device.to_string().contains("CXL-"))
                        .map(|p| p.key.clone())
                        .collect();
                    if free.len() < ways {
                        continue;
                    }
                    let first = (*pick % free.len() as u64) as usize;
                    let members: Vec<ResourceKey> = (0..ways).map(|k| free[(first + k) % free.len()].clone()).collect();
                    let name = format!("set{step}");
                    let r = map.add_interleave(&name, ways as u32, gran, &members, None);
                    let r2 = twin.add_interleave(&name, ways as u32, gran, &members, None);
                    prop_assert_eq!(r.is_ok(), r2.is_ok());
                    match r {
                        Ok(c) => {
                            // The members' direct ranges are released; they get new ones
                            // only after the set is dropped.
                            for m in &members { home.remove(m); }
                            Some(c)
                        }
                        // Members smaller than the granularity: refused, nothing changed.
                        Err(_) => { prop_assert_eq!(map.state(), &before); continue; }
                    }
                }
                Op::Uninterleave(pick) => {
                    let names: Vec<String> = map.state().interleaves.iter().map(|s| s.name.clone()).collect();
                    if names.is_empty() {
                        continue;
                    }
                    let name = &names[(*pick % names.len() as u64) as usize];
                    let c = map.remove_interleave(name).unwrap();
                    twin.remove_interleave(name).unwrap();
                    set_home.remove(name);
                    unplaced = true;
                    Some(c)
                }
                Op::Partition(mask) => {
                    let ids: Vec<DeviceId> = (0..devs.len()).filter(|i| mask & (1 << i) != 0).map(|i| devs[i].id.clone()).collect();
                    let c = map.partition("p", &ids);
                    twin.partition("p", &ids);
                    Some(c)
                }
            };
            let change = match change {
                Some(c) => c,
                None => {
                    let seed = if let Op::Reenumerate(s) = op { s } else { step as u64 };
                    let c = map.update(&shuffled(&devs, &present, seed)).unwrap();
                    // The twin sees the same inventory in another order.
                    let c2 = twin.update(&shuffled(&devs, &present, seed ^ 0xdead_beef)).unwrap();
                    prop_assert_eq!(&c, &c2);
                    if matches!(op, Op::Reenumerate(_)) && !unplaced {
                        prop_assert!(c.is_empty(), "re-enumeration changed the map: {:?}", c);
                    }
                    unplaced = false;
                    c
                }
            };
            prop_assert_eq!(encode_state(map.state()), encode_state(twin.state()));
            prop_assert_eq!(map.generation(), if change.is_empty() { gen_before } else { gen_before + 1 });
            let st = map.state();
            st.validate().unwrap();
            assert_no_overlaps(st);
            // Stability: every set keeps its start until dropped or collected, and is
            // present exactly when all its members' devices are.
            set_home.retain(|name, _| st.interleaves.iter().any(|s| &s.name == name));
            for s in &st.interleaves {
                let start = *set_home.entry(s.name.clone()).or_insert(s.start);
                prop_assert_eq!(start, s.start, "set {} moved", s.name);
                let all = s.members.iter().all(|m| present.iter().any(|&i| devs[i].id == m.device));
                prop_assert_eq!(s.presence == Presence::Present, all, "set {}", s.name);
            }
            // Stability: every key keeps the start it first got, until collected (or absorbed
            // into a set).
            for p in &st.placements {
                let start = *home.entry(p.key.clone()).or_insert(p.start);
                prop_assert_eq!(start, p.start, "{} moved", p.key);
                let want_present = present.iter().any(|&i| devs[i].id == p.key.device);
                prop_assert_eq!(p.presence == Presence::Present, want_present);
            }
            // Lowest fit for a single new single-resource device.
            if let Some(i) = added
                && devs[i].memory.len() == 1
                && change.added.len() == 1
            {
                let d = &devs[i];
                let node = d.node.clone().unwrap_or_else(|| fabric_addrmap::FABRIC_NODE.to_owned());
                let align = st.config.align_of(&d.id);
                let reserved = d.memory[0].size.next_multiple_of(align);
                let got = change.added[0].start;
                match naive_lowest_fit(&before, &node, reserved, align) {
                    Some(want) => prop_assert_eq!(got, want),
                    None => {
                        // A new slot: the lowest free span-aligned slot of the space.
                        prop_assert_eq!(change.nodes_added.len(), 1);
                        let slot = &change.nodes_added[0];
                        prop_assert_eq!(got, slot.start);
                        let mut c = st.config.base;
                        while before.nodes.iter().any(|n| c < n.start + n.span && n.start < c + slot.span) {
                            c += slot.span;
                        }
                        prop_assert_eq!(slot.start, c);
                    }
                }
            }
            check_translation(&map, &devs, &present, &mut rng);
        }
    }
}

#[test]
fn returning_device_gets_its_old_range_and_vanished_leaves_a_hole() {
    let devs: Vec<Device> =
        (0..4).map(|i| device(Some("n0"), &format!("GPU-{i}"), &[(MemoryKind::Hbm, 80 * GIB)])).collect();
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let c = map.update(&inventory(devs.clone())).unwrap();
    assert_eq!(c.added.len(), 4);
    assert_eq!(c.generation, 1);
    let starts: Vec<u64> = c.added.iter().map(|r| r.start).collect();
    assert_eq!(starts, [0, 80 * GIB, 160 * GIB, 240 * GIB]);

    let c = map.update(&inventory([devs[0].clone(), devs[2].clone(), devs[3].clone()])).unwrap();
    assert_eq!(c.vanished.len(), 1);
    assert_eq!(c.generation, 2);
    let snap = map.snapshot();
    assert!(matches!(snap.translate(80 * GIB + 5), Err(fabric_addrmap::TranslateError::Hole { .. })));

    // A new device does not take the hole.
    let newcomer = device(Some("n0"), "GPU-new", &[(MemoryKind::Hbm, 80 * GIB)]);
    let mut list = vec![devs[0].clone(), devs[2].clone(), devs[3].clone(), newcomer.clone()];
    let c = map.update(&inventory(list.clone())).unwrap();
    assert_eq!(c.added[0].start, 320 * GIB);

    list.push(devs[1].clone());
    let c = map.update(&inventory(list.clone())).unwrap();
    assert_eq!(c.returned.len(), 1);
    assert_eq!(c.returned[0].start, 80 * GIB);

    // Same inventory again: nothing changes, the generation stays.
    let g = map.generation();
    assert!(map.update(&inventory(list.into_iter().rev())).unwrap().is_empty());
    assert_eq!(map.generation(), g);
}

#[test]
fn gc_frees_holes_for_the_lowest_fit_and_releases_empty_nodes() {
    let a = device(Some("n0"), "GPU-a", &[(MemoryKind::Hbm, 10 * GIB)]);
    let b = device(Some("n0"), "GPU-b", &[(MemoryKind::Hbm, 10 * GIB)]);
    let c = device(Some("n1"), "GPU-c", &[(MemoryKind::Hbm, 10 * GIB)]);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inventory([a.clone(), b.clone(), c.clone()])).unwrap();
    map.update(&inventory([b.clone()])).unwrap();
    let ch = map.gc(&GcFilter::Device(a.id.clone()));
    assert_eq!(ch.collected.len(), 1);
    assert!(ch.nodes_removed.is_empty());
    let ch = map.gc(&GcFilter::All);
    assert_eq!(ch.collected.len(), 1);
    assert_eq!(ch.nodes_removed.len(), 1);
    assert_eq!(ch.nodes_removed[0].node, "n1");
    let d = device(Some("n0"), "GPU-d", &[(MemoryKind::Hbm, 10 * GIB)]);
    let ch = map.update(&inventory([b, d])).unwrap();
    assert_eq!(ch.added[0].start, 0, "the collected hole is the lowest fit");
    assert!(map.gc(&GcFilter::All).is_empty());
}

#[test]
fn grown_resource_moves_and_shrunk_one_stays() {
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let a = |s| device(Some("n0"), "GPU-a", &[(MemoryKind::Hbm, s)]);
    let b = device(Some("n0"), "GPU-b", &[(MemoryKind::Hbm, GIB)]);
    map.update(&inventory([a(3 * GIB / 2), b.clone()])).unwrap();
    let c = map.update(&inventory([a(GIB), b.clone()])).unwrap();
    assert_eq!(c.resized.len(), 1);
    assert_eq!(c.resized[0].start, 0);
    // Still within the 2 GiB reservation.
    let c = map.update(&inventory([a(2 * GIB), b.clone()])).unwrap();
    assert_eq!(c.resized.len(), 1);
    assert_eq!(c.resized[0].start, 0);
    let c = map.update(&inventory([a(3 * GIB), b])).unwrap();
    assert_eq!(c.moved.len(), 1);
    assert_eq!(c.moved[0].previous, Some(0));
    assert_eq!(c.moved[0].start, 3 * GIB);
}

#[test]
fn pinned_node_base_and_dram_not_mapped() {
    let mut cfg = MapConfig::default();
    cfg.nodes.insert("n9".into(), fabric_addrmap::NodeOverride { base: Some(64 * fabric_addrmap::TIB), span: None });
    let mut map = AddressMap::new(cfg).unwrap();
    let g = device(Some("n9"), "GPU-9", &[(MemoryKind::Hbm, GIB), (MemoryKind::Dram, GIB)]);
    let c = map.update(&inventory([g])).unwrap();
    assert_eq!(c.added.len(), 1);
    assert_eq!(c.added[0].start, 64 * fabric_addrmap::TIB);
}

/// A pinned node whose slot is sized by its memory, with one size no slot above its base
/// could hold (untrusted, from sysfs): that one resource stays unplaced and the rest are
/// laid out. Before, the whole update failed (`PinnedConflict`) and nothing was placed.
#[test]
fn one_impossible_size_on_a_pinned_node_leaves_only_itself_unplaced() {
    let tib = fabric_addrmap::TIB;
    let mut cfg = MapConfig::default();
    cfg.nodes.insert("n1".into(), fabric_addrmap::NodeOverride { base: Some(64 * tib), span: None });
    let mut map = AddressMap::new(cfg).unwrap();
    let good = device(Some("n1"), "GPU-1", &[(MemoryKind::Hbm, 80 * GIB)]);
    let bad = device(Some("n1"), "GPU-2", &[(MemoryKind::Hbm, u64::MAX - 5)]);
    let c = map.update(&inventory([good, bad])).unwrap();
    assert_eq!(c.added.len(), 1, "{c:?}");
    assert_eq!(c.added[0].start, 64 * tib);
    assert_eq!(c.unplaced.len(), 1);
    assert_eq!(c.unplaced[0].size, u64::MAX - 5);
}

/// A node's memory never moves: a configuration pinning its base elsewhere (a domain
/// node that restarted into another slot) is refused, the map left as it was; the pin
/// where it lies, and pins of nodes without memory, are taken.
#[test]
fn a_pin_that_would_move_a_placed_node_is_refused() {
    let tib = fabric_addrmap::TIB;
    let pin = |base| fabric_addrmap::NodeOverride { base: Some(base), span: None };
    let mut cfg = MapConfig::default();
    cfg.nodes.insert("n9".into(), pin(64 * tib));
    let mut map = AddressMap::new(cfg.clone()).unwrap();
    let g = device(Some("n9"), "GPU-9", &[(MemoryKind::Hbm, GIB)]);
    map.update(&inventory([g])).unwrap();
    let mut moved = cfg.clone();
    moved.nodes.insert("n9".into(), pin(128 * tib));
    let e = map.set_config(moved).unwrap_err();
    assert!(
        matches!(&e, fabric_addrmap::MapError::Layout(fabric_addrmap::LayoutError::PinnedMoved { at, .. }) if *at == 64 * tib),
        "{e:?}"
    );
    let snap = map.snapshot();
    assert_eq!(snap.state().nodes[0].start, 64 * tib, "the node stays");
    let mut other = cfg;
    other.nodes.insert("n7".into(), pin(256 * tib));
    map.set_config(other).unwrap();
}

/// A map laid out with larger slots than a domain later pins (a standalone daemon's 2 TiB
/// slot, a domain of 1 TiB ones): a pin at the node's base is refused while its memory
/// reaches past the pinned slot, into the next node's GFAs.
#[test]
fn a_pin_whose_slot_does_not_hold_the_nodes_memory_is_refused() {
    let tib = fabric_addrmap::TIB;
    let mut map = AddressMap::new(MapConfig { node_span: NodeSpan::Fixed(2 * tib), ..MapConfig::default() }).unwrap();
    let gpus = (0..3).map(|i| device(Some("n1"), &format!("GPU-{i}"), &[(MemoryKind::Hbm, 600 * GIB)]));
    map.update(&inventory(gpus)).unwrap();
    let last = map.snapshot().state().placements.iter().map(|p| p.start + p.reserved).max().unwrap();
    assert!(last > tib, "the map reaches past 1 TiB: {last:#x}");
    let pinned = |span| {
        let mut cfg = MapConfig { node_span: NodeSpan::Fixed(tib), ..MapConfig::default() };
        cfg.nodes.insert("n1".into(), fabric_addrmap::NodeOverride { base: Some(0), span: Some(span) });
        cfg
    };
    let e = map.set_config(pinned(tib)).unwrap_err();
    assert!(
        matches!(&e, fabric_addrmap::MapError::Layout(fabric_addrmap::LayoutError::PinnedOutside { end, .. }) if *end == 2 * tib),
        "{e:?}"
    );
    assert_eq!(map.snapshot().state().config.node_span, NodeSpan::Fixed(2 * tib), "the map stays as it was");
    map.set_config(pinned(2 * tib)).unwrap();
}

/// A domain node's map holds its own node's slots only: one laid out under the host's
/// name is refused for the domain's node name, naming the other node and its slot.
#[test]
fn a_map_of_another_node_name_is_refused_for_a_domain_node() {
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inventory([device(Some("host-a"), "GPU-0", &[(MemoryKind::Hbm, GIB)])])).unwrap();
    map.only_node("host-a").unwrap();
    let e = map.only_node("tray0").unwrap_err();
    assert!(
        matches!(&e, fabric_addrmap::MapError::Layout(fabric_addrmap::LayoutError::OtherNode { node, this, at: 0 }) if node == "host-a" && this == "tray0"),
        "{e:?}"
    );
    AddressMap::new(MapConfig::default()).unwrap().only_node("tray0").expect("an empty map is anyone's");
}

/// A map of 1 TiB node slots with node n1 pinned at 4 TiB, as a domain pins its slot.
fn pinned_n1() -> AddressMap {
    let tib = fabric_addrmap::TIB;
    let mut cfg = MapConfig { node_span: NodeSpan::Fixed(tib), ..MapConfig::default() };
    cfg.nodes.insert("n1".into(), fabric_addrmap::NodeOverride { base: Some(4 * tib), span: Some(tib) });
    AddressMap::new(cfg).unwrap()
}

/// A domain node's memory stays in the slot the domain pinned it to: what does not fit is
/// left unplaced (and said), never placed in another node's slot or past its own span.
#[test]
fn a_pinned_node_that_outgrows_its_slot_leaves_the_rest_unplaced() {
    let tib = fabric_addrmap::TIB;
    let mut map = pinned_n1();
    // Nine GPUs of 128 GiB: eight fill the 1 TiB slot, the ninth does not fit; and one
    // larger than the whole slot.
    let mut gpus: Vec<Device> =
        (0..9).map(|i| device(Some("n1"), &format!("GPU-{i}"), &[(MemoryKind::Hbm, 128 * GIB)])).collect();
    gpus.push(device(Some("n1"), "GPU-huge", &[(MemoryKind::Hbm, 2 * tib)]));
    let c = map.update(&inventory(gpus)).unwrap();
    assert_eq!(c.added.len(), 8);
    assert!(c.added.iter().all(|r| r.start >= 4 * tib && r.start + r.size <= 5 * tib), "{:?}", c.added);
    let unplaced: BTreeSet<String> = c.unplaced.iter().map(|u| u.key.device.to_string()).collect();
    assert_eq!(unplaced.len(), 2, "{unplaced:?}");
    assert!(unplaced.iter().any(|d| d.ends_with("GPU-huge")) && unplaced.iter().any(|d| d.ends_with("GPU-8")));
    let snap = map.snapshot();
    assert_eq!(snap.state().nodes.len(), 1, "one slot: {:?}", snap.state().nodes);
    assert_eq!((snap.state().nodes[0].start, snap.state().nodes[0].span), (4 * tib, tib));
}

/// A resource whose size no slot can hold (a broken sysfs value) costs only itself: the
/// rest of the inventory is laid out, and a placed resource that grows past what fits
/// keeps its range.
#[test]
fn a_resource_that_fits_nowhere_leaves_the_others_placed() {
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let ok = device(Some("n0"), "GPU-0", &[(MemoryKind::Hbm, GIB)]);
    let bad = device(Some("n0"), "CXL-bad", &[(MemoryKind::CxlVolatile, u64::MAX)]);
    let c = map.update(&inventory([ok.clone(), bad.clone()])).unwrap();
    assert_eq!(c.added.len(), 1);
    assert_eq!(c.unplaced.len(), 1);
    assert_eq!(c.unplaced[0].size, u64::MAX);
    let before = map.generation();
    // The placed GPU "grows" past anything the map holds: it keeps its range.
    let grown = device(Some("n0"), "GPU-0", &[(MemoryKind::Hbm, u64::MAX - 1)]);
    let c = map.update(&inventory([grown, bad])).unwrap();
    assert_eq!(c.unplaced.len(), 2, "{c:?}");
    assert!(c.moved.is_empty() && c.added.is_empty());
    assert_eq!(map.generation(), before, "nothing changed");
    let snap = map.snapshot();
    let p = &snap.state().placements[0];
    assert_eq!((p.size, p.presence), (GIB, Presence::Present));
}

#[test]
fn a_state_whose_generation_could_wrap_is_refused() {
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inventory([device(Some("n0"), "GPU-0", &[(MemoryKind::Hbm, GIB)])])).unwrap();
    let mut st = map.snapshot().state().clone();
    st.generation = u64::MAX;
    assert!(fabric_addrmap::decode_state(&encode_state(&st)).is_err());
    st.generation = fabric_addrmap::MAX_GENERATION;
    assert!(fabric_addrmap::decode_state(&encode_state(&st)).is_ok());
}

/// An outgrown resource's old range stays taken in the pass that moves it: nothing new
/// lands where it was, and when it fits nowhere it keeps that range, overlapping nothing.
/// A vanished one that comes back too large to place stays a hole.
#[test]
fn an_outgrown_resource_that_fits_nowhere_keeps_its_range_and_nothing_lands_in_it() {
    let mut map = pinned_n1();
    let gpu = |i: usize, size: u64| device(Some("n1"), &format!("GPU-{i}"), &[(MemoryKind::Hbm, size)]);
    map.update(&inventory((0..8).map(|i| gpu(i, 128 * GIB)))).unwrap();
    let before = map.snapshot().state().placements.clone();
    // GPU-0 grows past its range, GPU-7 is gone, and a new 64 GiB expander comes.
    let cxl = device(Some("n1"), "CXL-0", &[(MemoryKind::CxlVolatile, 64 * GIB)]);
    let c = map
        .update(&inventory((0..7).map(|i| gpu(i, if i == 0 { 256 * GIB } else { 128 * GIB })).chain([cxl.clone()])))
        .unwrap();
    let st = map.snapshot().state().clone();
    st.validate().unwrap();
    assert_no_overlaps(&st);
    let unplaced: BTreeSet<String> = c.unplaced.iter().map(|u| u.key.device.to_string()).collect();
    assert!(unplaced.iter().any(|d| d.ends_with("GPU-0")), "{unplaced:?}");
    assert_eq!(at(&st.placements, "GPU-0"), at(&before, "GPU-0"), "GPU-0 keeps its range and size");
    // Nor does the expander: GPU-0's old range is taken and GPU-7's is a hole, not free.
    assert!(at(&st.placements, "CXL-0").is_none() && unplaced.iter().any(|d| d.ends_with("CXL-0")), "{unplaced:?}");
    // GPU-7 comes back at twice its size, beside a change elsewhere: it stays a hole.
    let c = map.update(&inventory((0..7).map(|i| gpu(i, 128 * GIB)).chain([gpu(7, 256 * GIB)]))).unwrap();
    assert!(c.unplaced.iter().any(|u| u.key.device.to_string().ends_with("GPU-7")), "{c:?}");
    let st = map.snapshot().state().clone();
    st.validate().unwrap();
    let g7 = at(&st.placements, "GPU-7").unwrap();
    assert!(matches!(g7.presence, Presence::Vanished { .. }), "{g7:?}");
    assert!(c.returned.is_empty(), "{c:?}");
}

/// The placement of the device whose id ends with `name`.
fn at(placements: &[fabric_addrmap::Placement], name: &str) -> Option<fabric_addrmap::Placement> {
    placements.iter().find(|p| p.key.device.to_string().ends_with(name)).cloned()
}

/// When no slot holds all of a node's new resources, the largest waits and is tried alone
/// once the others are placed, rather than being left out.
#[test]
fn the_largest_of_resources_no_slot_holds_together_is_tried_alone() {
    let cfg = MapConfig { address_bits: 40, node_span: NodeSpan::Auto { min: 64 * GIB }, ..MapConfig::default() };
    let mut map = AddressMap::new(cfg).unwrap();
    let mem = |node: &str, id: &str| device(Some(node), id, &[(MemoryKind::Hbm, 256 * GIB)]);
    // Node a takes [0, 256 GiB); node b's three need 1 TiB together, which is not free.
    let c = map.update(&inventory([mem("a", "A-0"), mem("b", "B-0"), mem("b", "B-1"), mem("b", "B-2")])).unwrap();
    assert!(c.unplaced.is_empty(), "{:?}", c.unplaced);
    assert_eq!(c.added.len(), 4);
    let st = map.snapshot().state().clone();
    st.validate().unwrap();
    assert_no_overlaps(&st);
}
