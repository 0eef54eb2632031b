//! Property tests: on random PCI forests, hop classes are symmetric and agree with the
//! devices the route actually crosses, and routes are connected with the right bottleneck.
#![allow(clippy::unwrap_used)]

use fabric_topology::link::LinkKind;
use fabric_topology::{Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, Fabric, HopClass, Inventory, Link};
use proptest::prelude::*;

/// A random forest: `cpus` NUMA nodes, host bridges on them, and a random tree of bridges
/// and endpoints below each host bridge. Each entry of `shape` is (parent choice, is
/// bridge, gen, width).
fn build(cpus: usize, hbs: usize, shape: &[(usize, bool, u8, u8)]) -> (Fabric, Vec<DeviceIdx>) {
    let mut inv = Inventory::new();
    let node = "n0";
    let cpu: Vec<_> = (0..cpus)
        .map(|i| inv.add_device(Device::new(DeviceId::named(node, &format!("numa{i}")), DeviceKind::Cpu, Some(node))))
        .collect::<Result<_, _>>()
        .unwrap();
    for w in cpu.windows(2) {
        inv.add_link(Link::new(w[0], w[1], LinkKind::Smp, Bandwidth::full(40_000), None));
    }
    let mut bridges = Vec::new();
    for h in 0..hbs {
        let hb = inv
            .add_device(Device::new(
                DeviceId::named(node, &format!("pci0000:{h:02x}")),
                DeviceKind::HostBridge,
                Some(node),
            ))
            .unwrap();
        inv.add_link(Link::new(cpu[h % cpus], hb, LinkKind::HostAttach, Bandwidth::default(), None));
        bridges.push(hb);
    }
    let mut endpoints = Vec::new();
    for (i, &(p, is_bridge, g, w)) in shape.iter().enumerate() {
        let parent = bridges[p % bridges.len()];
        let kind = if is_bridge { DeviceKind::PciBridge } else { DeviceKind::Gpu };
        let id = DeviceId::named(node, &format!("dev{i}"));
        let d = inv.add_device(Device::new(id, kind, Some(node))).unwrap();
        inv.add_link(Link::pcie(parent, d, (Some(g), Some(w)), (Some(5), Some(16))));
        if is_bridge { bridges.push(d) } else { endpoints.push(d) }
    }
    (Fabric::build(inv).unwrap(), endpoints)
}

/// (parent choice, is bridge, PCIe generation, width) per device.
type Shape = Vec<(usize, bool, u8, u8)>;

fn shape() -> impl Strategy<Value = (usize, usize, Shape)> {
    (
        1usize..4,
        1usize..5,
        prop::collection::vec((0usize..64, any::<bool>(), 3u8..6, prop::sample::select(vec![4u8, 8, 16])), 2..40),
    )
}

proptest! {
    #[test]
    fn classes_are_symmetric_and_match_routes((cpus, hbs, s) in shape()) {
        let (f, eps) = build(cpus, hbs, &s);
        for &a in &eps {
            for &b in &eps {
                let c = f.classify(a, b);
                prop_assert_eq!(c, f.classify(b, a));
                let r = f.route(a, b).unwrap();
                prop_assert_eq!(r.class, c);
                let count = |k| r.hops.iter().filter(|&&h| f.device(h).kind == k).count();
                match c {
                    HopClass::X => prop_assert_eq!(a, b),
                    HopClass::Pix | HopClass::Pxb => prop_assert_eq!(count(DeviceKind::HostBridge), 0),
                    HopClass::Phb => {
                        prop_assert_eq!(count(DeviceKind::HostBridge), 1);
                        prop_assert_eq!(count(DeviceKind::Cpu), 0);
                    }
                    HopClass::Node => {
                        prop_assert_eq!(count(DeviceKind::HostBridge), 2);
                        prop_assert_eq!(count(DeviceKind::Cpu), 1);
                    }
                    HopClass::Sys => prop_assert!(count(DeviceKind::Cpu) >= 2),
                    other => prop_assert!(false, "unexpected class {other}"),
                }
                // PIX means at most one switch-worth of bridges; PXB more than one bridge.
                if c == HopClass::Pxb {
                    prop_assert!(count(DeviceKind::PciBridge) >= 2);
                }
                // Connected, and the bottleneck is the slowest link crossed.
                prop_assert_eq!(r.links.len(), r.hops.len() - 1);
                for (w, &l) in r.hops.windows(2).zip(&r.links) {
                    let link = f.link(l);
                    prop_assert!((link.a == w[0] && link.b == w[1]) || (link.a == w[1] && link.b == w[0]));
                }
                let min = r.links.iter().filter_map(|&l| f.link(l).bandwidth.current_mbps).min();
                prop_assert_eq!(r.bandwidth_mbps, min);
            }
        }
    }
}
