//! Inventory-to-map synchronisation ([`fabric_addrmap::sync_inventory`]) on the sim CXL
//! pool: CXL region sets follow the regions (torn down, created, members vanished), and a
//! node's sync touches only that node's placements and sets.
#![allow(clippy::unwrap_used, reason = "tests panic on failure by design")]

use fabric_addrmap::{AddressMap, MapConfig, RangeKind, SyncScope, region_sets, sync_inventory, sync_sets};
use fabric_topology::Inventory;

fn sim(text: &str) -> Inventory {
    fabric_drivers::sim::parse(text, "test").unwrap()
}

fn pool() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/sim/cxl-pool.toml")).unwrap()
}

fn set_names(map: &AddressMap) -> Vec<String> {
    map.state().interleaves.iter().map(|s| s.name.clone()).collect()
}

const DOMAIN: SyncScope<'static> = SyncScope::Domain;

#[test]
fn regions_torn_down_and_created_follow_the_inventory() {
    let text = pool();
    let region0 = "[[templates.cxl-host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\nnuma = 1\n";
    assert!(text.contains(region0));
    let full = sim(&text);
    let torn = sim(&text.replace(region0, ""));
    assert_eq!(region_sets(&full).len(), region_sets(&torn).len() + 1);
    let gone = region_sets(&full).into_iter().find(|s| !region_sets(&torn).contains(s)).unwrap();

    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&full).unwrap();
    let s = sync_sets(&mut map, &full, DOMAIN).unwrap();
    assert_eq!(s.added.len(), region_sets(&full).len(), "{:?}", s.skipped);
    let g0 = map.generation();
    assert!(sync_sets(&mut map, &full, DOMAIN).unwrap().changes.is_empty(), "in line: nothing to do");
    assert_eq!(map.generation(), g0);

    // region0 torn down (its memdevs stay): the set goes and mem0/mem1 are direct again.
    let s = sync_inventory(&mut map, &torn, DOMAIN).unwrap().sets;
    assert_eq!(s.removed, vec![gone.name.clone()]);
    assert!(!set_names(&map).contains(&gone.name));
    let listing = map.snapshot().listing();
    for m in &gone.members {
        let direct =
            listing.ranges.iter().any(|r| r.kind == RangeKind::Direct && r.owner.contains(&m.device.to_string()));
        assert!(direct, "{} is not mapped directly: {listing:?}", m.device);
    }

    // Created again: a set again.
    let s = sync_inventory(&mut map, &full, DOMAIN).unwrap().sets;
    assert_eq!(s.added, vec![gone.name.clone()], "{:?}", s.skipped);
    assert!(set_names(&map).contains(&gone.name));
}

#[test]
fn a_set_whose_members_vanished_stays() {
    let text = pool();
    let full = sim(&text);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    sync_inventory(&mut map, &full, DOMAIN).unwrap();
    let before = set_names(&map);
    // Every member device gone (the regions with them): the sets stay, as holes.
    let members: Vec<String> =
        region_sets(&full).into_iter().flat_map(|s| s.members).map(|m| m.device.to_string()).collect();
    assert!(!members.is_empty());
    let mut without = full.clone();
    without.cxl.regions.clear();
    without.devices.retain(|d| !members.contains(&d.id.to_string()));
    without.links.clear();
    without.reindex();
    let s = sync_inventory(&mut map, &without, DOMAIN).unwrap().sets;
    assert!(s.removed.is_empty() && s.added.is_empty(), "{s:?}");
    assert_eq!(set_names(&map), before);
}

/// The part of a state that belongs to `node`, as bytes: its slots, placements and sets.
fn node_part(map: &AddressMap, node: &str) -> String {
    let st = map.state();
    let slots: Vec<_> = st.nodes.iter().filter(|n| n.node == node).collect();
    let placements: Vec<_> = st.placements.iter().filter(|p| p.node == node).collect();
    let sets: Vec<_> = st.interleaves.iter().filter(|s| s.node == node).collect();
    serde_json::to_string(&(slots, placements, sets)).unwrap()
}

/// Only `node`'s devices and CXL regions of `inv`.
fn node_only(inv: &Inventory, node: &str) -> Inventory {
    let mut out = inv.clone();
    out.devices.retain(|d| d.node.as_deref() == Some(node));
    let ids: Vec<_> = out.devices.iter().map(|d| d.id.clone()).collect();
    out.cxl.regions.retain(|r| r.targets.iter().all(|t| ids.contains(t)));
    out.links.clear();
    out.reindex();
    out
}

#[test]
fn a_nodes_sync_leaves_every_other_nodes_placement_byte_identical() {
    let text = format!("{}\n[[node]]\nname = \"host-b\"\ntemplate = \"cxl-host\"\n", pool());
    let full = sim(&text);
    let nodes: std::collections::BTreeSet<_> = full.devices.iter().filter_map(|d| d.node.clone()).collect();
    assert_eq!(nodes.iter().map(String::as_str).collect::<Vec<_>>(), ["cxl-host", "host-b"]);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let s = sync_inventory(&mut map, &full, DOMAIN).unwrap();
    // Both hosts have a RAM region at the same host address over their own memory: host
    // B's set is named for its node, since host A's has the region's name.
    assert!(s.sets.skipped.is_empty(), "{:?}", s.sets.skipped);
    let names = set_names(&map);
    assert!(names.iter().any(|n| n == "cxl-region:hpa-0x1000000000"), "{names:?}");
    assert!(names.iter().any(|n| n == "cxl-region:hpa-0x1000000000@host-b"), "{names:?}");
    let sets_a = map.state().interleaves.iter().filter(|s| s.node == "cxl-host").count();
    assert!(sets_a > 0, "node A has interleave sets: {:?}", set_names(&map));
    let a_before = node_part(&map, "cxl-host");

    // Node B rescans: one region torn down, one memdev gone, the rest as it was.
    let mut b = node_only(&full, "host-b");
    // A directly mapped device in no region goes, and the region named by its UUID is torn
    // down (regions named by HPA share names across hosts, so only one host's is mapped).
    let direct: Vec<_> = map.state().placements.iter().map(|p| p.key.device.clone()).collect();
    let in_region = |id: &fabric_topology::DeviceId| b.cxl.regions.iter().any(|r| r.targets.contains(id));
    let gone = b.devices.iter().position(|d| direct.contains(&d.id) && !in_region(&d.id)).unwrap();
    let gone = b.devices.remove(gone).id;
    let torn = b.cxl.regions.iter().position(|r| r.uuid.is_some()).unwrap();
    b.cxl.regions.remove(torn);
    b.reindex();
    let b_before = node_part(&map, "host-b");

    // The same inventory for the whole domain would have emptied node A: the scope is
    // what keeps it.
    let mut domain = AddressMap::from_state(map.state().clone()).unwrap();
    sync_inventory(&mut domain, &b, DOMAIN).unwrap();
    assert_ne!(node_part(&domain, "cxl-host"), a_before);

    let s = sync_inventory(&mut map, &b, SyncScope::Node("host-b")).unwrap();
    assert_eq!(s.sets.removed.len(), 1, "{s:?}");
    assert!(s.change.vanished.iter().any(|r| r.key.device == gone), "{:?}", s.change);
    assert_ne!(node_part(&map, "host-b"), b_before, "node B changed");
    assert_eq!(node_part(&map, "cxl-host"), a_before, "node A's placements, slots and sets are untouched");
    // And back: node B's sync again with its whole inventory restores its set.
    let s = sync_inventory(&mut map, &node_only(&full, "host-b"), SyncScope::Node("host-b")).unwrap();
    assert_eq!(s.sets.added.len(), 1, "{s:?}");
    assert_eq!(node_part(&map, "cxl-host"), a_before);
}

/// A CXL region named by its host address on two nodes: where it is the same memory (the
/// same members, geometry and size: a device both hosts share) the other node's set
/// stands for it, silently; where it is other memory, it is mapped under a name of its
/// node's, which it keeps (its range never moves) whoever holds the plain name later, and
/// a sync never touches the other node's set.
#[test]
fn a_region_named_like_another_nodes_set_is_mapped_under_its_nodes_name_unless_it_is_the_same_memory() {
    const PLAIN: &str = "cxl-region:hpa-0x1000000000";
    const QUALIFIED: &str = "cxl-region:hpa-0x1000000000@host-b";
    let text = format!("{}\n[[node]]\nname = \"host-b\"\ntemplate = \"cxl-host\"\n", pool());
    let full = sim(&text);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let a = node_only(&full, "cxl-host");
    let s = sync_inventory(&mut map, &a, SyncScope::Node("cxl-host")).unwrap();
    assert!(s.sets.skipped.is_empty(), "{:?}", s.sets.skipped);
    let a_before = node_part(&map, "cxl-host");
    let set = |m: &AddressMap, name: &str| m.state().interleaves.iter().find(|s| s.name == name).cloned();
    let hpa = |m: &AddressMap| m.state().interleaves.iter().filter(|s| s.name.contains(":hpa-")).count();
    assert_eq!(hpa(&map), 1);
    assert_eq!(set(&map, PLAIN).unwrap().node, "cxl-host");

    // Host B's own devices behind a region at the same address: mapped, named for host B,
    // in host B's part of the map.
    let b = node_only(&full, "host-b");
    let s = sync_inventory(&mut map, &b, SyncScope::Node("host-b")).unwrap();
    assert!(s.sets.skipped.is_empty(), "{:?}", s.sets.skipped);
    assert_eq!(s.sets.added.iter().filter(|n| n.as_str() == QUALIFIED).count(), 1, "{:?}", s.sets.added);
    let b_set = set(&map, QUALIFIED).unwrap();
    assert_eq!(b_set.node, "host-b");
    assert_ne!(b_set.members, set(&map, PLAIN).unwrap().members, "other memory");
    assert_eq!(hpa(&map), 2);
    assert_eq!(node_part(&map, "cxl-host"), a_before, "node A's set is untouched");
    // A translation of the set's first byte goes through host B's set to host B's device.
    let snap = map.snapshot();
    let t = snap.translate(b_set.start).unwrap();
    assert_eq!(snap.set(t.set.unwrap()).name, QUALIFIED);
    assert_eq!(snap.resource(t.resource), &b_set.members[0]);

    // A rescan of host B changes nothing.
    let b_part = node_part(&map, "host-b");
    let s = sync_inventory(&mut map, &b, SyncScope::Node("host-b")).unwrap();
    assert!(s.sets.added.is_empty() && s.sets.removed.is_empty() && s.sets.skipped.is_empty(), "{s:?}");
    assert_eq!(node_part(&map, "host-b"), b_part);

    // Host A's region is torn down, so the plain name is free: host B's set keeps its name
    // and range; host A's region, made again, takes the plain name again.
    let mut a_torn = a.clone();
    a_torn.cxl.regions.retain(|r| r.uuid.is_some());
    a_torn.reindex();
    let s = sync_inventory(&mut map, &a_torn, SyncScope::Node("cxl-host")).unwrap();
    assert_eq!(s.sets.removed, [PLAIN]);
    let s = sync_inventory(&mut map, &b, SyncScope::Node("host-b")).unwrap();
    assert!(s.sets.added.is_empty() && s.sets.removed.is_empty(), "{s:?}");
    assert_eq!(set(&map, QUALIFIED).unwrap().start, b_set.start, "host B's set never moves");
    let s = sync_inventory(&mut map, &a, SyncScope::Node("cxl-host")).unwrap();
    assert_eq!(s.sets.added, [PLAIN]);
    assert_eq!(set(&map, PLAIN).unwrap().node, "cxl-host");
    assert_eq!(set(&map, QUALIFIED).unwrap().start, b_set.start);

    // Host B sees host A's very devices (one shared pool): the same set, nothing to say,
    // nothing added.
    let mut shared = a.clone();
    for d in &mut shared.devices {
        d.node = Some("host-b".to_owned());
    }
    shared.reindex();
    let mut lone = AddressMap::new(MapConfig::default()).unwrap();
    sync_inventory(&mut lone, &a, SyncScope::Node("cxl-host")).unwrap();
    let lone_a = node_part(&lone, "cxl-host");
    let s = sync_inventory(&mut lone, &shared, SyncScope::Node("host-b")).unwrap();
    assert!(s.sets.skipped.is_empty(), "{:?}", s.sets.skipped);
    assert!(set(&lone, QUALIFIED).is_none());
    assert_eq!(hpa(&lone), 1);
    assert_eq!(node_part(&lone, "cxl-host"), lone_a);
}

/// A node-qualified name must fit what the wire and the journal carry of a set's name: a
/// node whose name makes it longer is reported, not mapped under a cut name.
#[test]
fn a_node_qualified_name_too_long_for_the_wire_is_reported() {
    let long = "h".repeat(40);
    let text = format!("{}\n[[node]]\nname = \"{long}\"\ntemplate = \"cxl-host\"\n", pool());
    let full = sim(&text);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    sync_inventory(&mut map, &node_only(&full, "cxl-host"), SyncScope::Node("cxl-host")).unwrap();
    let s = sync_inventory(&mut map, &node_only(&full, &long), SyncScope::Node(&long)).unwrap();
    let [why] = s.sets.skipped.as_slice() else { panic!("{:?}", s.sets.skipped) };
    assert!(why.contains("is longer than 64 bytes"), "{why}");
    assert!(
        set_names(&map).iter().all(|n| n.len() <= fabric_addrmap::sync::MAX_REGION_SET_NAME),
        "{:?}",
        set_names(&map)
    );
}

/// Two regions of one UUID over different memory (two hosts' sets cannot both have the
/// name, and a UUID names one region): the second is reported, never renamed.
#[test]
fn a_uuid_named_like_another_nodes_set_over_other_memory_is_reported() {
    let text = format!("{}\n[[node]]\nname = \"host-b\"\ntemplate = \"cxl-host\"\n", pool());
    let full = sim(&text);
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    let a = node_only(&full, "cxl-host");
    sync_inventory(&mut map, &a, SyncScope::Node("cxl-host")).unwrap();
    let a_before = node_part(&map, "cxl-host");
    let b = node_only(&full, "host-b");
    let uuid = |inv: &Inventory| inv.cxl.regions.iter().find_map(|r| r.uuid.clone()).unwrap();
    let mut clash = b.clone();
    let a_uuid = uuid(&a);
    for r in clash.cxl.regions.iter_mut().filter(|r| r.uuid.is_some()) {
        r.uuid = Some(a_uuid.clone());
    }
    clash.reindex();
    let s = sync_inventory(&mut map, &clash, SyncScope::Node("host-b")).unwrap();
    let [why] = s.sets.skipped.as_slice() else { panic!("{:?}", s.sets.skipped) };
    assert!(why.contains("node host-b's CXL region is not mapped: node cxl-host's set has that name"), "{why}");
    assert!(!set_names(&map).iter().any(|n| n.contains('@') && !n.contains(":hpa-")), "{:?}", set_names(&map));
    assert_eq!(node_part(&map, "cxl-host"), a_before);
}

/// A region whose part on each member starts past the member's first byte (a second
/// region of the devices) is not mapped as a set, with the reason in the sync's report: a
/// set covers its members from their first byte, so it would translate its GFAs to the
/// bytes of the region before it. The region at the start still is one.
#[test]
fn a_region_that_starts_past_its_members_first_byte_is_reported_not_mapped() {
    let region0 = "[[templates.cxl-host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\nnuma = 1\n";
    let halves = "[[templates.cxl-host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\nsize = \"256GiB\"\nnuma = 1\n\n[[templates.cxl-host.cxl_region]]\nname = \"region2\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\n";
    let text = pool();
    assert!(text.contains(region0));
    let inv = sim(&text.replace(region0, halves));
    let second = inv.cxl.regions.iter().find(|r| r.kernel_name == "region2").expect("region2");
    assert_eq!(second.size, Some(256 << 30));
    let names: Vec<String> = region_sets(&inv).into_iter().map(|s| s.name).collect();
    assert_eq!(names.len(), region_sets(&sim(&text)).len(), "region0 is a set, region2 is not: {names:?}");
    let mut map = AddressMap::new(MapConfig::default()).unwrap();
    map.update(&inv).unwrap();
    let s = sync_sets(&mut map, &inv, DOMAIN).unwrap();
    let hpa = second.resource.unwrap();
    let report = s.skipped.iter().find(|r| r.contains(&format!("hpa-{hpa:#x}"))).expect("region2 reported");
    assert!(report.contains("starts at device address 0x2000000000"), "{report}");
    assert!(!set_names(&map).iter().any(|n| n.contains(&format!("{hpa:#x}"))), "{:?}", set_names(&map));
}
