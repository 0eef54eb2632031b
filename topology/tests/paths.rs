//! Hop classification and path queries on hand-built fabrics whose answers are known.
#![allow(clippy::unwrap_used)]

use fabric_topology::link::{LinkKind, nvlink_mbps_per_link};
use fabric_topology::{
    Bandwidth, DOMAIN_NODE_ATTR, DOMAIN_NODE_DOWN, DOMAIN_NODE_LIVE, Device, DeviceId, DeviceIdx, DeviceKind, Fabric,
    HopClass, Inventory, Link, LinkState, PciAddress,
};

struct B {
    inv: Inventory,
}

impl B {
    fn new() -> Self {
        Self { inv: Inventory::new() }
    }
    fn dev(&mut self, node: &str, name: &str, kind: DeviceKind) -> DeviceIdx {
        let id = DeviceId::named(node, name);
        let n = if node == "fabric" { None } else { Some(node) };
        self.inv.add_device(Device::new(id, kind, n)).unwrap()
    }
    fn pci(&mut self, node: &str, addr: &str, kind: DeviceKind, parent: DeviceIdx, gen_w: (u8, u8)) -> DeviceIdx {
        let a: PciAddress = addr.parse().unwrap();
        let i = self.inv.add_device(Device::new(DeviceId::pci(node, a), kind, Some(node))).unwrap();
        self.inv.add_link(Link::pcie(parent, i, (Some(gen_w.0), Some(gen_w.1)), (Some(5), Some(16))));
        i
    }
    fn link(&mut self, a: DeviceIdx, b: DeviceIdx, kind: LinkKind, mbps: u64) {
        self.inv.add_link(Link::new(a, b, kind, Bandwidth::full(mbps), Some(100)));
    }
    fn build(self) -> Fabric {
        Fabric::build(self.inv).unwrap()
    }
}

/// Two sockets; socket 0 has two host bridges, the first with a PCIe switch holding GPU0,
/// GPU1 and NIC0 and a nested switch with GPU2; the second host bridge has GPU3. Socket 1
/// has GPU4 on a root port.
fn two_socket_node(b: &mut B, node: &str) -> Vec<DeviceIdx> {
    let c0 = b.dev(node, "numa0", DeviceKind::Cpu);
    let c1 = b.dev(node, "numa1", DeviceKind::Cpu);
    b.link(c0, c1, LinkKind::Smp, 60_000);
    let hb0 = b.dev(node, "pci0000:00", DeviceKind::HostBridge);
    let hb1 = b.dev(node, "pci0000:40", DeviceKind::HostBridge);
    let hb2 = b.dev(node, "pci0000:80", DeviceKind::HostBridge);
    b.inv.add_link(Link::new(c0, hb0, LinkKind::HostAttach, Bandwidth::default(), None));
    b.inv.add_link(Link::new(c0, hb1, LinkKind::HostAttach, Bandwidth::default(), None));
    b.inv.add_link(Link::new(c1, hb2, LinkKind::HostAttach, Bandwidth::default(), None));
    let rp = b.pci(node, "0000:00:01.0", DeviceKind::PciBridge, hb0, (5, 16));
    let up = b.pci(node, "0000:01:00.0", DeviceKind::PciBridge, rp, (5, 16));
    let d0 = b.pci(node, "0000:02:00.0", DeviceKind::PciBridge, up, (5, 16));
    let d1 = b.pci(node, "0000:02:01.0", DeviceKind::PciBridge, up, (5, 16));
    let d2 = b.pci(node, "0000:02:02.0", DeviceKind::PciBridge, up, (5, 16));
    let d3 = b.pci(node, "0000:02:03.0", DeviceKind::PciBridge, up, (5, 16));
    let g0 = b.pci(node, "0000:03:00.0", DeviceKind::Gpu, d0, (5, 16));
    let g1 = b.pci(node, "0000:04:00.0", DeviceKind::Gpu, d1, (5, 16));
    let nic = b.pci(node, "0000:05:00.0", DeviceKind::Nic, d2, (5, 8)); // degraded: x8 of x16
    let up2 = b.pci(node, "0000:06:00.0", DeviceKind::PciBridge, d3, (5, 16));
    let dn2 = b.pci(node, "0000:07:00.0", DeviceKind::PciBridge, up2, (5, 16));
    let g2 = b.pci(node, "0000:08:00.0", DeviceKind::Gpu, dn2, (5, 16));
    let rp1 = b.pci(node, "0000:40:01.0", DeviceKind::PciBridge, hb1, (4, 16));
    let g3 = b.pci(node, "0000:41:00.0", DeviceKind::Gpu, rp1, (4, 16));
    let rp2 = b.pci(node, "0000:80:01.0", DeviceKind::PciBridge, hb2, (5, 16));
    let g4 = b.pci(node, "0000:81:00.0", DeviceKind::Gpu, rp2, (5, 16));
    let rp0b = b.pci(node, "0000:00:02.0", DeviceKind::PciBridge, hb0, (5, 16));
    let g5 = b.pci(node, "0000:09:00.0", DeviceKind::Gpu, rp0b, (5, 16));
    vec![g0, g1, nic, g2, g3, g4, g5]
}

#[test]
fn pci_classes_follow_nvidia_smi_semantics() {
    let mut b = B::new();
    let d = two_socket_node(&mut b, "n0");
    let f = b.build();
    let (g0, g1, nic, g2, g3, g4, g5) = (d[0], d[1], d[2], d[3], d[4], d[5], d[6]);
    assert_eq!(f.classify(g0, g0), HopClass::X);
    assert_eq!(f.classify(g0, g1), HopClass::Pix, "one switch");
    assert_eq!(f.classify(g0, nic), HopClass::Pix);
    assert_eq!(f.classify(g0, g2), HopClass::Pxb, "nested switch");
    assert_eq!(f.classify(g0, g5), HopClass::Phb, "two root ports of one host bridge");
    assert_eq!(f.classify(g0, g3), HopClass::Node, "two host bridges, one socket");
    assert_eq!(f.classify(g0, g4), HopClass::Sys, "across sockets");
    assert_eq!(f.classify(g4, g0), HopClass::Sys, "symmetric");
}

#[test]
fn pci_classes_are_the_same_both_ways_round_between_any_two_devices() {
    let mut b = B::new();
    two_socket_node(&mut b, "n0");
    let f = b.build();
    let all: Vec<DeviceIdx> = (0..f.len()).map(|i| DeviceIdx(u32::try_from(i).unwrap())).collect();
    for &x in &all {
        for &y in &all {
            let (xy, yx) = (f.classify(x, y), f.classify(y, x));
            assert_eq!(xy, yx, "{} / {}", f.device(x).id, f.device(y).id);
        }
    }
    let id = |name: &str| all.iter().copied().find(|&i| f.device(i).id.to_string().ends_with(name)).unwrap();
    // A device and one of its ancestors: the socket, the host bridge, its own switch.
    let g0 = id("0000:03:00.0");
    assert_eq!(f.classify(id("numa0"), g0), HopClass::Node);
    assert_eq!(f.classify(id("pci0000:00"), g0), HopClass::Phb);
    assert_eq!(f.classify(id("0000:02:00.0"), g0), HopClass::Pix, "its own downstream port");
}

#[test]
fn routes_report_bottleneck_and_degradation() {
    let mut b = B::new();
    let d = two_socket_node(&mut b, "n0");
    let f = b.build();
    let r = f.route(d[0], d[2]).unwrap();
    assert_eq!(r.hops.len(), 5, "gpu, dsp, usp, dsp, nic: {:?}", r.hops);
    assert_eq!(r.bandwidth_mbps, Some(31_507), "NIC at gen5 x8");
    assert_eq!(r.max_bandwidth_mbps, Some(63_015));
    assert_eq!(r.degraded_links.len(), 1);
    assert!((r.fraction().unwrap() - 0.5).abs() < 0.001);
    let r = f.route(d[0], d[4]).unwrap();
    assert_eq!(r.bandwidth_mbps, Some(31_507), "gen4 x16 is the bottleneck");
    assert_eq!(r.class, HopClass::Node);
    let r = f.route(d[0], d[5]).unwrap();
    assert!(r.hops.iter().any(|&h| f.device(h).kind == DeviceKind::Cpu));
    assert_eq!(r.class, HopClass::Sys);
}

#[test]
fn nvswitch_fabric_classifies_as_nv_count() {
    let mut b = B::new();
    let gpus: Vec<_> = (0..8).map(|i| b.dev("n0", &format!("gpu{i}"), DeviceKind::Gpu)).collect();
    let sws: Vec<_> = (0..4).map(|i| b.dev("n0", &format!("sw{i}"), DeviceKind::NvSwitch)).collect();
    let per = nvlink_mbps_per_link(4).unwrap();
    for &g in &gpus {
        for (s, n) in sws.iter().zip([5u16, 4, 4, 5]) {
            b.link(g, *s, LinkKind::NvLink { generation: 4, count: n }, per * u64::from(n));
        }
    }
    // GPU 7 lost 2 links to switch 0.
    let l = b.inv.links.iter_mut().find(|l| l.a == gpus[7] && l.b == sws[0]).unwrap();
    l.kind = LinkKind::NvLink { generation: 4, count: 3 };
    l.bandwidth = Bandwidth { current_mbps: Some(per * 3), max_mbps: Some(per * 5) };
    l.state = LinkState::Degraded;
    let f = b.build();
    assert_eq!(f.classify(gpus[0], gpus[1]), HopClass::Nv(18));
    assert_eq!(f.classify(gpus[0], gpus[7]), HopClass::Nv(16));
    let r = f.route(gpus[0], gpus[7]).unwrap();
    assert_eq!(r.hops.len(), 3);
    assert_eq!(r.bandwidth_mbps, Some(125_000), "widest: through a 5-link switch");
    assert!(r.degraded_links.is_empty(), "the route avoids the degraded bundle");
}

#[test]
fn direct_xgmi_and_c2c_and_down_links() {
    let mut b = B::new();
    let a = b.dev("n0", "gpuA", DeviceKind::Gpu);
    let c = b.dev("n0", "gpuB", DeviceKind::Gpu);
    let cpu = b.dev("n0", "grace", DeviceKind::Cpu);
    let h = b.dev("n0", "hopper", DeviceKind::Gpu);
    b.link(a, c, LinkKind::Xgmi { count: 2 }, 100_000);
    b.link(cpu, h, LinkKind::C2c, 450_000);
    let x = b.dev("n0", "gpuX", DeviceKind::Gpu);
    let y = b.dev("n0", "gpuY", DeviceKind::Gpu);
    b.inv.add_link(Link {
        state: LinkState::Down,
        ..Link::new(x, y, LinkKind::NvLink { generation: 4, count: 4 }, Bandwidth::full(1), None)
    });
    let f = b.build();
    assert_eq!(f.classify(a, c), HopClass::Xgmi(2));
    assert_eq!(f.classify(cpu, h), HopClass::C2c);
    assert_eq!(HopClass::Xgmi(2).to_string(), "XGMI2");
    assert_eq!(f.classify(x, y), HopClass::Sys, "down links don't count; no PCI path is known");
    assert!(f.route(x, y).is_err());
}

#[test]
fn scale_up_domains_join_c2c_memory_to_the_gpus_across_switches_and_leave_out_down_links() {
    // Two trays on one fabric-level NVSwitch: each a Grace with one GPU on C2C. A third
    // tray's GPU has its NVLink down, a fourth tray's Grace has no GPU.
    let mut b = B::new();
    let sw = b.dev("fabric", "nvsw0", DeviceKind::NvSwitch);
    let nv = LinkKind::NvLink { generation: 5, count: 18 };
    let mut trays = Vec::new();
    for t in 0..3 {
        let node = format!("tray{t}");
        let cpu = b.dev(&node, "grace", DeviceKind::Cpu);
        let gpu = b.dev(&node, "gpu0", DeviceKind::Gpu);
        b.link(cpu, gpu, LinkKind::C2c, 450_000);
        trays.push((cpu, gpu));
    }
    b.link(trays[0].1, sw, nv, 900_000);
    b.link(trays[1].1, sw, nv, 900_000);
    b.inv.add_link(Link { state: LinkState::Down, ..Link::new(trays[2].1, sw, nv, Bandwidth::full(1), None) });
    let lone = b.dev("tray3", "grace", DeviceKind::Cpu);
    let f = b.build();
    let [(cpu0, gpu0), (cpu1, gpu1), (cpu2, gpu2)] = trays[..] else { unreachable!() };
    assert!(f.same_scale_up_domain(cpu0, gpu1), "tray0's memory, tray1's GPU: C2C, NVLink, the switch");
    assert!(f.same_scale_up_domain(cpu1, cpu0));
    assert!(f.same_scale_up_domain(gpu0, gpu1));
    assert!(!f.same_scale_up_domain(gpu0, gpu2), "its only NVLink is down");
    assert!(f.same_scale_up_domain(cpu2, gpu2), "C2C alone is a scale-up domain of its own");
    assert!(!f.same_scale_up_domain(lone, lone), "no scale-up link at all: no domain");
    assert!(!f.same_scale_up_domain(cpu0, lone));
}

#[test]
fn xgmi_peers_without_a_link_count_are_still_xgmi() {
    // Partitioned AMD GPUs: the kernel lists the xGMI peer but not how many links.
    let mut b = B::new();
    let a = b.dev("n0", "gpuA", DeviceKind::Gpu);
    let c = b.dev("n0", "gpuB", DeviceKind::Gpu);
    b.inv.add_link(Link::new(a, c, LinkKind::Xgmi { count: 0 }, Bandwidth::default(), None));
    let f = b.build();
    assert_eq!(f.classify(a, c), HopClass::Xgmi(0));
    assert_eq!(f.classify(a, c).to_string(), "XGMI");
}

#[test]
fn cross_node_routes_go_through_nics_and_network_switches() {
    let mut b = B::new();
    let n0 = two_socket_node(&mut b, "n0");
    let n1 = two_socket_node(&mut b, "n1");
    let leaf0 = b.dev("fabric", "leaf0", DeviceKind::NetworkSwitch);
    let leaf1 = b.dev("fabric", "leaf1", DeviceKind::NetworkSwitch);
    let spine = b.dev("fabric", "spine0", DeviceKind::NetworkSwitch);
    b.link(n0[2], leaf0, LinkKind::Network { gbps: 400 }, 50_000);
    b.link(n1[2], leaf1, LinkKind::Network { gbps: 400 }, 50_000);
    b.link(leaf0, spine, LinkKind::Network { gbps: 800 }, 100_000);
    b.link(leaf1, spine, LinkKind::Network { gbps: 800 }, 100_000);
    let f = b.build();
    assert_eq!(f.classify(n0[0], n1[0]), HopClass::Net);
    let r = f.route(n0[0], n1[4]).unwrap();
    let kinds: Vec<_> = r.hops.iter().map(|&h| f.device(h).kind).collect();
    assert_eq!(kinds.first(), Some(&DeviceKind::Gpu));
    assert_eq!(kinds.iter().filter(|k| **k == DeviceKind::NetworkSwitch).count(), 3);
    assert_eq!(kinds.iter().filter(|k| **k == DeviceKind::Nic).count(), 2);
    assert_eq!(r.bandwidth_mbps, Some(31_507), "the degraded NIC PCIe link");
    // The route is connected: consecutive hops share a link.
    assert_eq!(r.links.len(), r.hops.len() - 1);
    // A NIC on the network is its own way out: NIC to NIC, and GPU to a remote NIC, with
    // one NIC per node.
    let r = f.route(n0[2], n1[2]).unwrap();
    assert_eq!(r.hops.len(), 5, "nic, leaf, spine, leaf, nic: {:?}", r.hops);
    assert_eq!(f.classify(n0[2], n1[2]), HopClass::Net);
    let r = f.route(n0[0], n1[2]).unwrap();
    assert_eq!(r.hops.last(), Some(&n1[2]));
}

#[test]
fn live_members_of_a_domain_are_net_apart_without_a_described_network() {
    let mut b = B::new();
    let n0 = two_socket_node(&mut b, "n0");
    let n1 = two_socket_node(&mut b, "n1");
    let n2 = two_socket_node(&mut b, "n2");
    let mark = |b: &mut B, devs: &[DeviceIdx], state: &str| {
        for &d in devs {
            b.inv.device_mut(d).attrs.insert(DOMAIN_NODE_ATTR.into(), state.into());
        }
    };
    // Every device of n0 and n1 is a live member's, n2's are a node that is down.
    let all = |b: &B, node: &str| -> Vec<DeviceIdx> {
        (0..b.inv.devices.len() as u32)
            .map(DeviceIdx)
            .filter(|&i| b.inv.device(i).node.as_deref() == Some(node))
            .collect()
    };
    let (d0, d1, d2) = (all(&b, "n0"), all(&b, "n1"), all(&b, "n2"));
    mark(&mut b, &d0, DOMAIN_NODE_LIVE);
    mark(&mut b, &d1, DOMAIN_NODE_LIVE);
    mark(&mut b, &d2, DOMAIN_NODE_DOWN);
    let f = b.build();
    assert_eq!(f.classify(n0[0], n1[0]), HopClass::Net, "members talk over the network");
    assert_eq!(f.classify(n0[0], n2[0]), HopClass::None, "a node that is down is not reached");
    assert_eq!(f.classify(n0[0], n0[1]), HopClass::Pix, "within a node nothing changes");
    // Without the attribute, nodes with nothing between them have no path.
    let mut b = B::new();
    let n0 = two_socket_node(&mut b, "n0");
    let n1 = two_socket_node(&mut b, "n1");
    assert_eq!(b.build().classify(n0[0], n1[0]), HopClass::None);
}

#[test]
fn endpoints_are_not_transit() {
    // Two GPUs joined only through a third GPU: no path (GPUs do not forward).
    let mut b = B::new();
    let g: Vec<_> = (0..3).map(|i| b.dev("n0", &format!("g{i}"), DeviceKind::Gpu)).collect();
    b.link(g[0], g[1], LinkKind::NvLink { generation: 4, count: 2 }, 50_000);
    b.link(g[1], g[2], LinkKind::NvLink { generation: 4, count: 2 }, 50_000);
    let f = b.build();
    assert!(f.route(g[0], g[2]).is_err());
    assert!(f.route(g[0], g[1]).is_ok());
}

#[test]
fn a_route_over_links_of_known_bandwidth_beats_one_over_unknown_links() {
    // Two GPUs under one PCIe switch whose links report no speed, and a direct NVLink.
    let mut b = B::new();
    let sw = b.dev("n0", "sw", DeviceKind::PciBridge);
    let g0 = b.dev("n0", "gpu0", DeviceKind::Gpu);
    let g1 = b.dev("n0", "gpu1", DeviceKind::Gpu);
    for g in [g0, g1] {
        b.inv.add_link(Link::pcie(sw, g, (None, None), (None, None)));
    }
    let nv = nvlink_mbps_per_link(4).unwrap() * 18;
    b.link(g0, g1, LinkKind::NvLink { count: 18, generation: 4 }, nv);
    let f = b.build();
    let r = f.route(g0, g1).unwrap();
    assert_eq!(r.hops, vec![g0, g1], "took the links of unknown speed");
    assert_eq!(r.bandwidth_mbps, Some(nv));
}

#[test]
fn of_two_routes_as_wide_the_one_of_fewer_hops_is_taken() {
    // gpu0 - a - b - x (wide), gpu0 - x (narrower), x - gpu1 (narrowest): both routes are
    // as wide as x - gpu1, and the direct one has two hops fewer.
    let mut b = B::new();
    let s = b.dev("n0", "gpu0", DeviceKind::Gpu);
    let [a, m, x] = ["a", "b", "x"].map(|n| b.dev("n0", n, DeviceKind::PciBridge));
    let t = b.dev("n0", "gpu1", DeviceKind::Gpu);
    for (p, q) in [(s, a), (a, m), (m, x)] {
        b.link(p, q, LinkKind::Smp, 100);
    }
    b.link(s, x, LinkKind::Smp, 50);
    b.link(x, t, LinkKind::Smp, 10);
    let f = b.build();
    let r = f.route(s, t).unwrap();
    assert_eq!(r.hops, vec![s, x, t]);
    assert_eq!(r.bandwidth_mbps, Some(10));
}
