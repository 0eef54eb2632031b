//! The domain's one topology: every node's `topology/<node>` record merged into one
//! [`Inventory`], which the topology crate indexes and classifies exactly as it does one
//! host's (NV18 between trays through the fabric switches, `NET` between live members
//! with no memory fabric between them). A pure function of the [`DomainView`].

use std::collections::HashSet;

use fabric_topology::{
    BackendReport, Bandwidth, DOMAIN_NODE_ATTR, DOMAIN_NODE_DOWN, DOMAIN_NODE_LIVE, Device, DeviceIdx, DeviceKind,
    FAILED_ATTR, Inventory, Link, LinkState, MemoryResource,
};

use crate::topology::{self, TopologyDevice, TopologyRecord};
use crate::view::DomainView;

/// The backend name the merged inventory reports itself under.
pub const DOMAIN_BACKEND: &str = "domain";

/// Merges the topology records of `view` into one inventory, node by node in name order.
///
/// - A node's devices carry [`DOMAIN_NODE_ATTR`]: `live` while its member key lives,
///   `down` once it is gone; a node that is down also has [`FAILED_ATTR`] on its devices
///   and its links marked down (its memory cannot be reached), but stays listed.
/// - Fabric-level switches published by several nodes are one device; a link between two
///   of them is kept once.
/// - A CXL memory device named by its serial ([`pooled`]) that several nodes publish is
///   one device of a pool those hosts share: merged once, as a device of no node (the
///   name and memory of the first live host's record; no NUMA node, CPUs or PCI function,
///   which are each host's own; failed only while every host publishing it is down), with
///   each host's links to it.
/// - A record that names a device another node already published (or a node's device
///   under a fabric switch's identity, or a shared switch of another kind) is refused
///   whole, with the reason in the `domain` backend report's notes: the first publisher
///   keeps it, the map of the others is never changed by it.
pub fn merge(view: &DomainView) -> Inventory {
    merge_with(view, None)
}

/// [`merge`], with `own` — this node's name and the record it made of its own fabric —
/// in place of what the view holds for it: a node shows its own devices, live, from its
/// start and after each rescan, before its record has gone round through etcd.
pub fn merge_with(view: &DomainView, own: Option<(&str, &TopologyRecord)>) -> Inventory {
    let records: Vec<(&str, &TopologyRecord, bool)> = view
        .nodes()
        .into_iter()
        .filter(|n| own.is_none_or(|(name, _)| name != n.name))
        .filter_map(|n| view.topology(n.name).map(|r| (n.name, r, n.member.is_some())))
        .collect();
    merge_records(records, own)
}

/// [`merge_with`] of the records of `nodes` alone: what a question about a few nodes
/// needs — whether one reaches a device of another by a scale-up fabric, through their
/// devices and the fabric-level switches their records carry — without merging a
/// 12,500-node domain. A node with no record is left out; conflicts are settled among
/// these records only, and this node's own record (`own`, when `nodes` names it) is merged
/// first, so another node's record cannot claim its devices here whatever the names' order.
pub fn merge_nodes(view: &DomainView, own: Option<(&str, &TopologyRecord)>, nodes: &[&str]) -> Inventory {
    let mut names: Vec<&str> = nodes.to_vec();
    names.sort_unstable();
    names.dedup();
    let own = own.filter(|(name, _)| nodes.contains(name));
    let mut records: Vec<(&str, &TopologyRecord, bool)> = own.map(|(n, r)| (n, r, true)).into_iter().collect();
    records.extend(
        names
            .into_iter()
            .filter(|n| own.is_none_or(|(name, _)| name != *n))
            .filter_map(|n| view.topology(n).map(|r| (n, r, view.live_member(n).is_some()))),
    );
    merge_ordered(records)
}

/// Merges `own` (live) first, then `records` (node, record, live) node by node in name
/// order: a stale record of a node that sorts first (a down node whose GPU moved here)
/// cannot take this node's own devices from it.
fn merge_records<'a>(
    mut records: Vec<(&'a str, &'a TopologyRecord, bool)>,
    own: Option<(&'a str, &'a TopologyRecord)>,
) -> Inventory {
    records.sort_by(|a, b| a.0.cmp(b.0));
    if let Some((name, record)) = own {
        records.insert(0, (name, record, true));
    }
    merge_ordered(records)
}

/// Merges `records` (node, record, live) in the order given: a record that names a device
/// an earlier one published is refused whole.
fn merge_ordered(records: Vec<(&str, &TopologyRecord, bool)>) -> Inventory {
    let mut inv = Inventory::new();
    let mut report = BackendReport::present(DOMAIN_BACKEND);
    let mut fabric_links: HashSet<(DeviceIdx, DeviceIdx, &'static str)> = HashSet::new();
    for (name, record, live) in records {
        if let Err(why) = conflict(&inv, record) {
            tracing::warn!(node = name, %why, "topology record not merged");
            report.note_unknown(format!("topology/{name}: {why}"));
            continue;
        }
        let (indexes, added) = add_devices(&mut inv, record, live);
        for l in &record.links {
            let (Some(a), Some(b)) = (topology::end(&indexes, l.a), topology::end(&indexes, l.b)) else { continue };
            // A link between devices that are no one node's (fabric switches, pooled
            // devices) is published alike by every node that reaches it: kept once.
            let common = |end| record.device(end).is_some_and(|d| d.fabric || pooled(d));
            let shared = common(l.a) && common(l.b);
            if shared && !fabric_links.insert((a.min(b), a.max(b), l.kind.name())) {
                continue;
            }
            let bandwidth = Bandwidth { current_mbps: l.current_mbps, max_mbps: l.max_mbps };
            let mut link = Link::new(a, b, l.kind, bandwidth, l.latency_ns);
            link.state = if live || shared { l.state } else { LinkState::Down };
            inv.add_link(link);
        }
        report.devices += added;
    }
    inv.backends.push(report);
    inv
}

/// Whether `d` is a CXL memory device named by its serial (`serial:cxl/…`, the PCIe
/// DSN): every host attached to a pool — a multi-headed device, or one behind a switch
/// several hosts reach — sees it under that same identity.
pub fn pooled(d: &TopologyDevice) -> bool {
    d.kind == DeviceKind::CxlMemdev && d.id.as_str().starts_with("serial:cxl/")
}

/// A record device's memory, as the inventory holds it.
fn memory(d: &TopologyDevice) -> Vec<MemoryResource> {
    d.memory.iter().map(|m| MemoryResource { kind: m.kind, size: m.size, hpa: None, numa_node: None }).collect()
}

/// Why `record` cannot join `inv`, if it cannot.
fn conflict(inv: &Inventory, record: &TopologyRecord) -> Result<(), String> {
    for d in &record.devices {
        let Some(i) = inv.find(&d.id) else { continue };
        let held = inv.device(i);
        let same_switch = d.fabric && held.node.is_none() && held.kind == d.kind;
        let same_pool = pooled(d) && held.kind == d.kind;
        if !(same_switch || same_pool) {
            let by = held.node.as_deref().map_or_else(|| "the fabric".to_owned(), |n| format!("node {n}"));
            return Err(format!("device {} is already published by {by}", d.id));
        }
    }
    Ok(())
}

/// Adds `record`'s devices: their indexes, and how many of the node's own were new.
fn add_devices(inv: &mut Inventory, record: &TopologyRecord, live: bool) -> (Vec<DeviceIdx>, usize) {
    let mut indexes = Vec::with_capacity(record.devices.len());
    let mut added = 0;
    for d in &record.devices {
        if let Some(i) = inv.find(&d.id) {
            // `conflict` let through only shared switches and pooled devices: the switch
            // already there; a pooled device another host published is the pool's, not
            // that host's.
            if pooled(d) {
                // What was the first host's alone goes: its node, NUMA node, CPUs and PCI
                // function (each host reaches the device at an address of its own). A live
                // host's record describes it in place of those of hosts that are down, and
                // it has failed only while every host that publishes it is down.
                let held = inv.device_mut(i);
                if live && held.attrs.remove(FAILED_ATTR).is_some() {
                    held.name = d.name.clone();
                    held.memory = memory(d);
                }
                held.node = None;
                held.numa_node = None;
                held.local_cpus = None;
                held.pci = None;
                held.attrs.remove(DOMAIN_NODE_ATTR);
            }
            indexes.push(i);
            continue;
        }
        let mut device = Device::new(d.id.clone(), d.kind, (!d.fabric).then_some(record.node.as_str()));
        device.name = d.name.clone();
        device.numa_node = d.numa_node;
        device.local_cpus = d.local_cpus.as_deref().and_then(|c| c.parse().ok());
        device.pci = d.pci.as_ref().map(topology::TopologyPci::info);
        device.sources.push(DOMAIN_BACKEND.to_owned());
        device.memory = memory(d);
        if !d.fabric {
            let state = if live { DOMAIN_NODE_LIVE } else { DOMAIN_NODE_DOWN };
            device.attrs.insert(DOMAIN_NODE_ATTR.to_owned(), state.to_owned());
            if !live {
                device.attrs.insert(FAILED_ATTR.to_owned(), format!("node {} is down", record.node));
            }
        }
        match inv.add_device(device) {
            Ok(i) => indexes.push(i),
            Err(_) => break,
        }
        added += usize::from(!d.fabric);
    }
    (indexes, added)
}

#[cfg(test)]
mod tests {
    use fabric_topology::{DeviceId, DeviceKind, Fabric, HopClass, LinkKind, LinkState, MemoryKind, PciAddress};

    use super::*;
    use crate::records::{
        DataPathKind, DomainSettings, Keys, MemberRecord, RECORD_VERSION, RecordLimits, SlotClaim, encode,
    };
    use crate::topology::{TopologyDevice, TopologyLink};

    /// A device of a record: nothing known but its identity and kind.
    fn dev(id: DeviceId, kind: DeviceKind, fabric: bool) -> TopologyDevice {
        TopologyDevice { id, kind, name: None, fabric, memory: vec![], numa_node: None, local_cpus: None, pci: None }
    }

    /// A tray of the supernode: two GPUs, each 18 NVLinks to the same two fabric switches
    /// (9 to each), a NIC on the rail network (fabric-level leaf).
    fn tray(node: &str) -> TopologyRecord {
        let mut devices = vec![
            dev(DeviceId::named(node, "numa0"), DeviceKind::Cpu, false),
            dev(DeviceId::uuid(&format!("GPU-{node}-0")), DeviceKind::Gpu, false),
            dev(DeviceId::uuid(&format!("GPU-{node}-1")), DeviceKind::Gpu, false),
            dev(DeviceId::named("fabric", "nvsw0"), DeviceKind::NvSwitch, true),
            dev(DeviceId::named("fabric", "nvsw1"), DeviceKind::NvSwitch, true),
        ];
        devices[1].memory.push(topology::TopologyMemory { kind: MemoryKind::Hbm, size: 1 << 30 });
        let link = |a, b, kind| TopologyLink {
            a,
            b,
            kind,
            current_mbps: Some(450_000),
            max_mbps: Some(450_000),
            latency_ns: None,
            state: LinkState::Up,
        };
        let nv = LinkKind::NvLink { generation: 5, count: 9 };
        let links = vec![
            link(0, 1, LinkKind::C2c),
            link(0, 2, LinkKind::C2c),
            link(1, 3, nv),
            link(1, 4, nv),
            link(2, 3, nv),
            link(2, 4, nv),
            link(3, 4, LinkKind::NvLink { generation: 5, count: 1 }),
        ];
        TopologyRecord { version: RECORD_VERSION, node: node.into(), incarnation: 1, devices, links }
    }

    /// A host with no memory fabric shared with anyone: a GPU under a host bridge.
    fn island(node: &str) -> TopologyRecord {
        let addr: PciAddress = "0000:17:00.0".parse().unwrap();
        let devices = vec![
            dev(DeviceId::named(node, "pci0000:00"), DeviceKind::HostBridge, false),
            dev(DeviceId::pci(node, addr), DeviceKind::Gpu, false),
        ];
        let pcie =
            LinkKind::Pcie { gen_current: Some(5), width_current: Some(16), gen_max: Some(5), width_max: Some(16) };
        let links = vec![TopologyLink {
            a: 0,
            b: 1,
            kind: pcie,
            current_mbps: None,
            max_mbps: None,
            latency_ns: None,
            state: LinkState::Up,
        }];
        TopologyRecord { version: RECORD_VERSION, node: node.into(), incarnation: 1, devices, links }
    }

    fn member(name: &str) -> Vec<u8> {
        encode(&MemberRecord {
            version: RECORD_VERSION,
            name: name.into(),
            incarnation: 1,
            peer_address: "127.0.0.1:7400".into(),
            capabilities: vec![],
            groups: vec![],
            software: "0.1.0".into(),
            node_id: None,
        })
    }

    /// A view of `records`; the nodes named in `down` have no member key.
    fn view(records: &[TopologyRecord], down: &[&str]) -> DomainView {
        let k = Keys::new("d");
        let mut entries =
            vec![(k.settings(), encode(&DomainSettings::new(57, 1 << 40, vec![DataPathKind::SharedFile])))];
        for (slot, r) in records.iter().enumerate() {
            entries.push((k.slot(slot as u32), encode(&SlotClaim::new(slot as u32, &r.node))));
            entries.push((k.topology(&r.node), encode(r)));
            if !down.contains(&r.node.as_str()) {
                entries.push((k.member(&r.node), member(&r.node)));
            }
        }
        DomainView::load(k, RecordLimits::default(), entries.iter().map(|(a, b)| (a.as_bytes(), b.as_slice())), 3)
    }

    fn class(f: &Fabric, a: &DeviceId, b: &DeviceId) -> HopClass {
        f.classify(f.inventory().find(a).unwrap(), f.inventory().find(b).unwrap())
    }

    /// A compute tray of an NVL rack as NVML shows it: two GPUs of clique `clique` of one
    /// cluster, each 18 NVLinks to the switch trays, which the node sees only as its
    /// node-level stand-in (no PCI address).
    fn nvl_tray(node: &str, clique: u32) -> TopologyRecord {
        let mut inv = Inventory::new();
        let sw = inv
            .add_device(Device::new(DeviceId::named(node, "nvswitch-fabric"), DeviceKind::NvSwitch, Some(node)))
            .unwrap();
        for i in 0..2 {
            let mut gpu = Device::new(DeviceId::uuid(&format!("GPU-{node}-{i}")), DeviceKind::Gpu, Some(node));
            gpu.gpu = Some(fabric_topology::GpuInfo {
                fabric_cluster: Some("c0ffee00-0000-4000-8000-000000000001".into()),
                fabric_clique: Some(clique),
                ..Default::default()
            });
            let gpu = inv.add_device(gpu).unwrap();
            let nv = LinkKind::NvLink { generation: 5, count: 18 };
            inv.add_link(Link::new(gpu, sw, nv, Bandwidth::full(900_000), None));
        }
        TopologyRecord::from_fabric(&Fabric::build(inv).unwrap(), node, 1, crate::records::DEFAULT_MAX_RECORD_BYTES)
    }

    #[test]
    fn gpus_of_one_nvlink_clique_on_different_nodes_are_nvlink_peers() {
        let (a, b, other) = (nvl_tray("tray0", 7), nvl_tray("tray1", 7), nvl_tray("tray2", 8));
        let switch = crate::topology::clique_switch("c0ffee00-0000-4000-8000-000000000001", 7);
        assert!(a.devices.iter().any(|d| d.fabric && d.id == switch), "{:?}", a.devices);
        assert!(!a.devices.iter().any(|d| d.id.as_str().contains("nvswitch-fabric")));
        let v = view(&[a, b, other], &[]);
        assert!(v.refused().is_empty(), "{:?}", v.refused());
        let f = Fabric::build(merge(&v)).unwrap();
        assert_eq!(f.inventory().count(DeviceKind::NvSwitch), 2, "one switch per clique");
        let g = |n: &str, i: u8| DeviceId::uuid(&format!("GPU-{n}-{i}"));
        assert_eq!(class(&f, &g("tray0", 0), &g("tray1", 1)), HopClass::Nv(18), "one clique: NVLink");
        assert_eq!(class(&f, &g("tray0", 0), &g("tray0", 1)), HopClass::Nv(18));
        assert_eq!(class(&f, &g("tray0", 0), &g("tray2", 0)), HopClass::Net, "another clique: the network");
    }

    #[test]
    fn a_stand_in_whose_gpus_name_no_single_clique_stays_the_nodes_own() {
        let mut inv = Inventory::new();
        let sw = inv
            .add_device(Device::new(DeviceId::named("t", "nvswitch-fabric"), DeviceKind::NvSwitch, Some("t")))
            .unwrap();
        for (i, clique) in [Some(1), Some(2), None].into_iter().enumerate() {
            let mut gpu = Device::new(DeviceId::uuid(&format!("GPU-{i}")), DeviceKind::Gpu, Some("t"));
            gpu.gpu = Some(fabric_topology::GpuInfo {
                fabric_cluster: Some("c0ffee".into()),
                fabric_clique: clique,
                ..Default::default()
            });
            let gpu = inv.add_device(gpu).unwrap();
            let nv = LinkKind::NvLink { generation: 5, count: 18 };
            inv.add_link(Link::new(gpu, sw, nv, Bandwidth::full(900_000), None));
            let r = TopologyRecord::from_fabric(
                &Fabric::build(inv.clone()).unwrap(),
                "t",
                1,
                crate::records::DEFAULT_MAX_RECORD_BYTES,
            );
            let published = r.devices.iter().find(|d| d.kind == DeviceKind::NvSwitch).unwrap();
            // One GPU in clique 1: the clique's switch; a second clique, or a GPU of none:
            // the node's own stand-in.
            assert_eq!(published.fabric, i == 0, "{i}: {published:?}");
        }
    }

    /// A host attached to a shared CXL pool: its CXL host bridge and, below it, the pool's
    /// memory device under its serial, as every host attached sees it.
    fn cxl_host(node: &str, gib: u64) -> TopologyRecord {
        let mut devices = vec![
            dev(DeviceId::named(node, "pci0000:0c"), DeviceKind::HostBridge, false),
            dev(DeviceId::cxl(0x5eed_0000), DeviceKind::CxlMemdev, false),
        ];
        devices[1].memory.push(topology::TopologyMemory { kind: MemoryKind::CxlVolatile, size: gib << 30 });
        devices[1].numa_node = Some(0);
        let links = vec![TopologyLink {
            a: 0,
            b: 1,
            kind: LinkKind::Cxl { width: Some(8) },
            current_mbps: None,
            max_mbps: None,
            latency_ns: None,
            state: LinkState::Up,
        }];
        TopologyRecord { version: RECORD_VERSION, node: node.into(), incarnation: 1, devices, links }
    }

    #[test]
    fn a_cxl_device_several_hosts_publish_is_one_device_of_their_pool_reached_from_each() {
        let v = view(&[cxl_host("host-a", 64), cxl_host("host-b", 32), cxl_host("host-c", 64)], &["host-c"]);
        assert!(v.refused().is_empty(), "{:?}", v.refused());
        let inv = merge(&v);
        let report = inv.backends.iter().find(|b| b.backend == DOMAIN_BACKEND).unwrap();
        assert!(report.unknown.is_empty(), "no record refused: {:?}", report.unknown);
        assert_eq!(report.devices, 4, "three host bridges, the pooled device once");
        assert_eq!(inv.count(DeviceKind::CxlMemdev), 1);
        let pool = inv.find(&DeviceId::cxl(0x5eed_0000)).unwrap();
        let d = inv.device(pool);
        assert_eq!(d.node, None, "the pool's, not a host's");
        assert!(!d.attrs.contains_key(FAILED_ATTR) && !d.attrs.contains_key(DOMAIN_NODE_ATTR), "{:?}", d.attrs);
        assert_eq!(d.memory[0].size, 64 << 30, "the first record's description");
        assert_eq!((d.numa_node, d.pci.is_none()), (None, true), "no one host's NUMA node or PCI function");
        let links: Vec<_> =
            inv.links.iter().filter(|l| l.b == pool).map(|l| (inv.device(l.a).node.clone(), l.state)).collect();
        assert_eq!(
            links,
            [
                (Some("host-a".to_owned()), LinkState::Up),
                (Some("host-b".to_owned()), LinkState::Up),
                (Some("host-c".to_owned()), LinkState::Down),
            ],
            "each host's link to it; a host that is down, its link down"
        );
        let f = Fabric::build(inv).unwrap();
        assert_eq!(f.nodes(), ["host-a", "host-b", "host-c"]);
        let bridge = |n: &str| DeviceId::named(n, "pci0000:0c");
        assert_eq!(class(&f, &bridge("host-b"), &DeviceId::cxl(0x5eed_0000)), HopClass::Cxl);
        assert_eq!(class(&f, &bridge("host-a"), &bridge("host-b")), HopClass::Net, "a memory device joins no hosts");
        // The first host down: the first live one describes the pool, which has not failed;
        // every publisher down: it has.
        let v = view(&[cxl_host("host-a", 16), cxl_host("host-b", 32)], &["host-a"]);
        let inv = merge(&v);
        let d = inv.device(inv.find(&DeviceId::cxl(0x5eed_0000)).unwrap());
        assert_eq!((d.memory[0].size, d.attrs.contains_key(FAILED_ATTR)), (32 << 30, false), "{:?}", d.attrs);
        let inv = merge(&view(&[cxl_host("host-a", 16), cxl_host("host-b", 32)], &["host-a", "host-b"]));
        let d = inv.device(inv.find(&DeviceId::cxl(0x5eed_0000)).unwrap());
        assert_eq!((d.node.as_deref(), d.attrs.contains_key(FAILED_ATTR)), (None, true), "{:?}", d.attrs);
        // Behind a fabric-level CXL switch every host reaches, the switch's link to the
        // pooled device is one link, however many hosts publish it.
        let behind_switch = |node: &str| {
            let mut r = cxl_host(node, 64);
            r.devices.push(dev(DeviceId::named("fabric", "cxlsw0"), DeviceKind::CxlSwitch, true));
            r.links[0].b = 2;
            let mut down = r.links[0].clone();
            (down.a, down.b) = (2, 1);
            r.links.push(down);
            r
        };
        let inv = merge(&view(&[behind_switch("host-a"), behind_switch("host-b")], &[]));
        let sw = inv.find(&DeviceId::named("fabric", "cxlsw0")).unwrap();
        let pool = inv.find(&DeviceId::cxl(0x5eed_0000)).unwrap();
        assert_eq!(inv.links.iter().filter(|l| (l.a, l.b) == (sw, pool)).count(), 1);
        assert_eq!(inv.links.iter().filter(|l| l.b == sw).count(), 2, "each host's link to the switch");
        // A device of one host only stays that host's.
        let one = merge(&view(&[cxl_host("host-a", 64), island("host9")], &[]));
        assert_eq!(one.device(one.find(&DeviceId::cxl(0x5eed_0000)).unwrap()).node.as_deref(), Some("host-a"));
        // Another kind under a pooled device's identity is still refused.
        let mut liar = island("host-z");
        liar.devices[1].id = DeviceId::cxl(0x5eed_0000);
        let inv = merge(&view(&[cxl_host("host-a", 64), liar], &[]));
        assert_eq!(inv.backends[0].unknown.len(), 1, "{:?}", inv.backends[0].unknown);
    }

    #[test]
    fn trays_share_the_fabric_switches_and_an_island_is_net() {
        let v = view(&[tray("tray0"), tray("tray1"), island("host9")], &[]);
        assert!(v.refused().is_empty(), "{:?}", v.refused());
        let inv = merge(&v);
        assert_eq!(inv.count(DeviceKind::NvSwitch), 2, "one switch however many publish it");
        let shared = |k: &str| inv.links.iter().filter(|l| l.kind.name() == k).count();
        assert_eq!(shared("nvlink"), 4 + 4 + 1, "the switch-to-switch link once");
        let f = Fabric::build(inv).unwrap();
        let g = |n: &str, i: u8| DeviceId::uuid(&format!("GPU-{n}-{i}"));
        assert_eq!(class(&f, &g("tray0", 0), &g("tray1", 1)), HopClass::Nv(18), "through the fabric switches");
        assert_eq!(class(&f, &g("tray0", 0), &g("tray0", 1)), HopClass::Nv(18));
        let island_gpu = DeviceId::pci("host9", "0000:17:00.0".parse().unwrap());
        assert_eq!(class(&f, &g("tray0", 0), &island_gpu), HopClass::Net, "no memory fabric: the network");
        // A path query says the same: NET, the two ends, nothing known of the network.
        let (a, b) = (f.inventory().find(&g("tray0", 0)).unwrap(), f.inventory().find(&island_gpu).unwrap());
        let r = f.route(a, b).unwrap();
        assert_eq!((r.class, r.hops, r.links.len(), r.bandwidth_mbps), (HopClass::Net, vec![a, b], 0, None));
        let gpu = f.inventory().find(&g("tray1", 0)).unwrap();
        assert_eq!(f.device(gpu).memory[0].size, 1 << 30);
        assert_eq!(f.device(gpu).node.as_deref(), Some("tray1"));
        assert_eq!(f.device(gpu).attrs.get(DOMAIN_NODE_ATTR).map(String::as_str), Some(DOMAIN_NODE_LIVE));
    }

    #[test]
    fn numa_cpu_affinity_and_pci_details_of_a_record_reach_the_merged_devices() {
        let mut t = tray("tray0");
        t.devices[0].numa_node = Some(0);
        t.devices[0].local_cpus = Some("0-71".into());
        t.devices[1].numa_node = Some(1);
        let addr: PciAddress = "0000:17:00.0".parse().unwrap();
        t.devices[1].pci = Some(topology::TopologyPci {
            address: Some(addr),
            class: Some(0x03_0200),
            vendor_id: Some(0x10de),
            device_id: None,
            driver: Some("nvidia".into()),
            subsystem_vendor_id: None,
            subsystem_device_id: None,
            vendor_name: None,
            device_name: None,
            link_speed_mts: Some(16_000),
            link_width: Some(8),
            max_link_speed_mts: None,
            max_link_width: None,
            bars: Vec::new(),
        });
        let inv = merge(&view(&[t, tray("tray1")], &[]));
        let cpu = inv.device(inv.find(&DeviceId::named("tray0", "numa0")).unwrap());
        assert_eq!((cpu.numa_node, cpu.local_cpus.as_ref().map(ToString::to_string)), (Some(0), Some("0-71".into())));
        let gpu = inv.device(inv.find(&DeviceId::uuid("GPU-tray0-0")).unwrap());
        assert_eq!(gpu.numa_node, Some(1));
        let pci = gpu.pci.as_ref().unwrap();
        assert_eq!((pci.address, pci.vendor_id, pci.driver.as_deref()), (Some(addr), Some(0x10de), Some("nvidia")));
        assert_eq!((pci.link_speed_gts, pci.link_width), (Some(16.0), Some(8)), "the link as the node trained it");
        let other = inv.device(inv.find(&DeviceId::uuid("GPU-tray1-0")).unwrap());
        assert_eq!((other.numa_node, other.local_cpus.as_ref()), (None, None), "a record without them: unknown");
    }

    #[test]
    fn a_node_that_is_down_is_listed_and_marked_but_not_reached() {
        let v = view(&[tray("tray0"), tray("tray1"), island("host9")], &["tray1"]);
        let f = Fabric::build(merge(&v)).unwrap();
        let g = |n: &str, i: u8| DeviceId::uuid(&format!("GPU-{n}-{i}"));
        let gone = f.inventory().find(&g("tray1", 0)).unwrap();
        assert_eq!(f.device(gone).attrs.get(DOMAIN_NODE_ATTR).map(String::as_str), Some(DOMAIN_NODE_DOWN));
        assert!(f.device(gone).attrs.contains_key(FAILED_ATTR));
        assert_eq!(class(&f, &g("tray0", 0), &g("tray1", 0)), HopClass::None);
        assert_eq!(class(&f, &g("tray0", 0), &g("tray0", 1)), HopClass::Nv(18), "the live trays keep their switches");
        let island_gpu = DeviceId::pci("host9", "0000:17:00.0".parse().unwrap());
        assert_eq!(class(&f, &island_gpu, &g("tray1", 1)), HopClass::None);
        let (a, b) = (f.inventory().find(&island_gpu).unwrap(), gone);
        assert!(matches!(f.route(a, b), Err(fabric_topology::PathError::Unreachable(..))), "a node that is down");
    }

    #[test]
    fn a_node_shows_its_own_fabric_before_its_record_went_round() {
        let v = view(&[tray("tray0")], &[]);
        let g = |n: &str, i: u8| DeviceId::uuid(&format!("GPU-{n}-{i}"));
        // tray1 has just started: its record is not in its view yet, its own devices are.
        let own = tray("tray1");
        let inv = merge_with(&v, Some(("tray1", &own)));
        let gpu = inv.find(&g("tray1", 0)).expect("its own GPU");
        assert_eq!(inv.device(gpu).attrs.get(DOMAIN_NODE_ATTR).map(String::as_str), Some(DOMAIN_NODE_LIVE));
        assert!(inv.find(&g("tray0", 0)).is_some(), "and the others' from the view");
        assert!(merge(&v).find(&g("tray1", 0)).is_none(), "the view alone has none of tray1's");
        // Its own record stands in for the view's, which may be older.
        let v = view(&[tray("tray0"), island("tray1")], &[]);
        let inv = merge_with(&v, Some(("tray1", &own)));
        assert!(inv.find(&g("tray1", 0)).is_some());
        assert!(inv.find(&DeviceId::pci("tray1", "0000:17:00.0".parse().unwrap())).is_none(), "{:?}", inv.devices);
        // A node that sorts first and still publishes a GPU that is tray1's now (moved, or
        // a record claiming it): on tray1, tray1's own record is merged first and keeps it.
        let mut stale = tray("old-tray");
        stale.devices[1].id = g("tray1", 0);
        let v = view(&[stale, tray("tray1")], &["old-tray"]);
        let inv = merge_with(&v, Some(("tray1", &own)));
        let gpu = inv.find(&g("tray1", 0)).expect("its own GPU");
        assert_eq!(inv.device(gpu).node.as_deref(), Some("tray1"));
        assert!(inv.find(&g("tray1", 1)).is_some(), "all of its record");
        assert!(inv.find(&g("old-tray", 0)).is_none(), "the claiming record is refused whole");
    }

    /// Two nodes' records merged alone answer what the whole domain answers about the two
    /// (the path between their GPUs through the fabric switches, a node that is down), and
    /// hold nothing of a third node; this node's own record stands in for the view's.
    #[test]
    fn the_records_of_two_nodes_merge_alone_as_the_domain_shows_them() {
        let g = |n: &str, i: u8| DeviceId::uuid(&format!("GPU-{n}-{i}"));
        let v = view(&[tray("tray0"), tray("tray1"), tray("tray2"), island("host9")], &["tray2"]);
        let whole = Fabric::build(merge(&v)).unwrap();
        for (other, want) in [("tray1", HopClass::Nv(18)), ("tray2", HopClass::None), ("host9", HopClass::Net)] {
            let pair = Fabric::build(merge_nodes(&v, None, &["tray0", other, "tray0"])).unwrap();
            let other_gpu =
                if other == "host9" { DeviceId::pci("host9", "0000:17:00.0".parse().unwrap()) } else { g(other, 1) };
            assert_eq!(class(&pair, &g("tray0", 0), &other_gpu), want, "{other}");
            assert_eq!(class(&whole, &g("tray0", 0), &other_gpu), want, "{other}");
            let nodes: std::collections::BTreeSet<_> =
                pair.inventory().devices.iter().filter_map(|d| d.node.clone()).collect();
            assert_eq!(nodes, ["tray0", other].map(String::from).into(), "nothing of the others");
            assert_eq!(pair.inventory().count(DeviceKind::NvSwitch), 2, "tray0's switches");
        }
        // A node with no record is left out; this node's own record is used when named.
        let own = island("tray0");
        let pair = merge_nodes(&v, Some(("tray0", &own)), &["tray0", "tray7"]);
        assert!(pair.find(&g("tray0", 0)).is_none(), "its own record, not the view's");
        assert!(pair.find(&DeviceId::pci("tray0", "0000:17:00.0".parse().unwrap())).is_some());
        let without = merge_nodes(&v, Some(("tray0", &own)), &["tray1"]);
        assert!(without.find(&DeviceId::pci("tray0", "0000:17:00.0".parse().unwrap())).is_none(), "not named");
        assert!(without.find(&g("tray1", 0)).is_some());
        // An importer whose name sorts first and whose record claims this node's GPU is
        // refused whole: this node's own record is merged first.
        let mut hostile = tray("tray0");
        hostile.devices[1].id = g("tray1", 0);
        let v = view(&[hostile, tray("tray1")], &[]);
        let own = tray("tray1");
        let pair = Fabric::build(merge_nodes(&v, Some(("tray1", &own)), &["tray0", "tray1"])).unwrap();
        let gpu = pair.inventory().find(&g("tray1", 0)).unwrap();
        assert_eq!(pair.device(gpu).node.as_deref(), Some("tray1"));
        assert!(pair.inventory().find(&g("tray0", 1)).is_none(), "the claiming record is not merged");
    }

    #[test]
    fn a_record_that_claims_another_nodes_device_is_refused_whole() {
        let mut thief = tray("tray2");
        thief.devices[1].id = DeviceId::uuid("GPU-tray0-0");
        let mut imposter = tray("tray9");
        // A shared switch of another kind under a switch's identity.
        imposter.devices[3].kind = DeviceKind::NetworkSwitch;
        let v = view(&[tray("tray0"), thief, imposter], &[]);
        let inv = merge(&v);
        let report = inv.backends.iter().find(|b| b.backend == DOMAIN_BACKEND).unwrap();
        assert_eq!(report.unknown.len(), 2, "{:?}", report.unknown);
        assert!(
            report.unknown[0].contains("tray2") && report.unknown[0].contains("node tray0"),
            "{:?}",
            report.unknown
        );
        assert!(
            report.unknown[1].contains("tray9") && report.unknown[1].contains("the fabric"),
            "{:?}",
            report.unknown
        );
        assert_eq!(report.devices, 3, "tray0's devices only");
        let f = Fabric::build(inv).unwrap();
        assert_eq!(f.nodes(), ["tray0"]);
        let gpu = f.inventory().find(&DeviceId::uuid("GPU-tray0-0")).unwrap();
        assert_eq!(f.device(gpu).node.as_deref(), Some("tray0"));
    }

    proptest::proptest! {
        /// Any bytes under a topology or partition key are applied or refused, never
        /// panic, and a refusal leaves the merged fabric as it was.
        #[test]
        fn hostile_values_never_poison_the_merge(
            which in 0usize..3,
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..400),
        ) {
            let mut v = view(&[tray("tray0"), tray("tray1")], &[]);
            let before = merge(&v);
            let k = Keys::new("d");
            let key = [k.topology("tray0"), k.topology("tray9"), k.partition("p")][which].clone();
            if v.apply(key.as_bytes(), Some(&bytes), 9).is_err() {
                let after = merge(&v);
                proptest::prop_assert_eq!(after.devices, before.devices);
                proptest::prop_assert_eq!(after.links, before.links);
                proptest::prop_assert!(v.refused().contains_key(key.as_str()));
            }
        }
    }

    proptest::proptest! {
        /// What a cache of the merge keys on: writes that leave `fabric_revision` where it
        /// was — placements, partitions, a live member's rewrite, a refused record — leave
        /// the merged fabric as it was too, and a member's going moves it.
        #[test]
        fn the_merge_moves_only_with_the_fabric_revision(
            writes in proptest::collection::vec((0usize..4, 0usize..2, 0u64..4), 1..12),
        ) {
            let mut v = view(&[tray("tray0"), tray("tray1")], &[]);
            let (before, at) = (serde_json::to_string(&merge(&v)).unwrap(), v.fabric_revision());
            let k = Keys::new("d");
            for (rev, (what, n, generation)) in (10..).zip(writes) {
                let node = ["tray0", "tray1"][n];
                let (key, value) = match what {
                    0 => (k.placements(node), encode(&crate::records::PlacementsRecord {
                        version: RECORD_VERSION,
                        node: node.into(),
                        incarnation: 1,
                        generation,
                        slot: n as u32,
                        span: 1 << 40,
                        ranges: vec![],
                    })),
                    1 => (k.partition("p"), encode(&crate::partition::PartitionRecord::new("p", vec![DeviceId::uuid(&format!("GPU-{node}-0"))], &[generation as u32], &[]))),
                    2 => (k.member(node), member(node)),
                    _ => (k.topology(node), b"{\"version\":1".to_vec()),
                };
                let applied = v.apply(key.as_bytes(), Some(&value), rev);
                proptest::prop_assert_eq!(applied.is_ok(), what < 3, "{:?}", applied);
            }
            proptest::prop_assert_eq!(v.fabric_revision(), at);
            proptest::prop_assert_eq!(serde_json::to_string(&merge(&v)).unwrap(), before.clone());
            let gone = v.revision() + 1;
            v.apply(k.member("tray1").as_bytes(), None, gone).unwrap();
            proptest::prop_assert_eq!(v.fabric_revision(), gone);
            proptest::prop_assert_ne!(serde_json::to_string(&merge(&v)).unwrap(), before);
        }
    }

    #[test]
    fn records_enter_the_view_only_for_slot_holders_under_their_own_key() {
        let mut v = view(&[tray("tray0")], &[]);
        let k = Keys::new("d");
        let err = v.apply(k.topology("tray1").as_bytes(), Some(&encode(&tray("tray0"))), 4).unwrap_err();
        assert!(err.contains("under the key"), "{err}");
        let err = v.apply(k.topology("tray1").as_bytes(), Some(&encode(&tray("tray1"))), 4).unwrap_err();
        assert!(err.contains("holds no slot"), "{err}");
        let err = v.apply(k.topology("tray0").as_bytes(), Some(b"{\"version\":1"), 4).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        assert!(v.topology("tray0").is_some(), "a refused value leaves the record as it was");
        v.apply(k.slot(0).as_bytes(), None, 5).unwrap();
        assert!(v.topology("tray0").is_none(), "a freed slot takes the topology with it");
        assert!(merge(&v).devices.is_empty());
    }
}
