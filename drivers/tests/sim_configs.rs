//! Every shipped sim fabric parses, and each has the structure and hop classes it claims.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use fabric_drivers::sim::{self, SimBackend};
use fabric_drivers::{Backend, discover};
use fabric_topology::cxl::{CxlDecoderLevel, CxlMode};
use fabric_topology::{DeviceIdx, DeviceKind, Fabric, HopClass, Inventory, LinkKind, LinkState, MemoryKind};

fn config_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim")
}

fn load(name: &str) -> Inventory {
    let path = config_dir().join(name);
    sim::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The `n`-th device of a kind on a node, in inventory order (which is template order).
fn nth(f: &Fabric, node: &str, kind: DeviceKind, n: usize) -> DeviceIdx {
    f.devices_of(kind)
        .filter(|&d| f.device(d).node.as_deref() == Some(node))
        .nth(n)
        .unwrap_or_else(|| panic!("no {kind:?} #{n} on {node}"))
}

fn kinds(inv: &Inventory) -> BTreeMap<DeviceKind, usize> {
    let mut m = BTreeMap::new();
    for d in &inv.devices {
        *m.entry(d.kind).or_insert(0) += 1;
    }
    m
}

fn links_of(inv: &Inventory, name: &str) -> usize {
    inv.links.iter().filter(|l| l.kind.name() == name).count()
}

#[test]
fn every_config_parses_and_builds_a_fabric() {
    let mut seen = 0;
    let mut entries: Vec<_> = std::fs::read_dir(config_dir()).expect("configs/sim exists").flatten().collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("toml") {
            continue;
        }
        let inv = sim::load(&path).unwrap_or_else(|err| panic!("{err}"));
        assert!(!inv.devices.is_empty(), "{}", path.display());
        inv.validate().expect("links refer to devices");
        for d in &inv.devices {
            assert_eq!(d.sources, ["sim"], "{}", d.id);
            // Identities round-trip through their canonical text.
            assert_eq!(d.id.as_str().parse::<fabric_topology::DeviceId>().as_ref(), Ok(&d.id));
        }
        let f = Fabric::build(inv).expect("fabric builds");
        if path.file_name().and_then(|n| n.to_str()) == Some("cluster-100k.toml") {
            // Checked here rather than in a test of its own so the big fabric is built once.
            check_cluster_100k(&f);
        }
        seen += 1;
    }
    assert!(seen >= 5, "expected the five shipped sim fabrics, found {seen}");
}

#[test]
fn hgx_board_has_the_dgx_h100_shape_and_classes() {
    let inv = load("hgx-h100-8gpu.toml");
    let k = kinds(&inv);
    assert_eq!(k[&DeviceKind::Gpu], 8);
    assert_eq!(k[&DeviceKind::Nic], 8);
    assert_eq!(k[&DeviceKind::NvSwitch], 4);
    assert_eq!(k[&DeviceKind::Storage], 4);
    assert_eq!(k[&DeviceKind::Cpu], 2);
    assert_eq!(k[&DeviceKind::HostBridge], 5);
    // 4 switches x (root port + upstream port + 5 downstream ports) + 4 NVSwitch root ports.
    assert_eq!(k[&DeviceKind::PciBridge], 4 * 7 + 4);
    assert_eq!(links_of(&inv, "nvlink"), 32);
    let nv_total: u32 = inv
        .links
        .iter()
        .filter_map(|l| if let LinkKind::NvLink { count, .. } = l.kind { Some(u32::from(count)) } else { None })
        .sum();
    assert_eq!(nv_total, 8 * 18);
    assert_eq!(links_of(&inv, "smp"), 1);
    assert_eq!(links_of(&inv, "host"), 5);
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).expect("a GPU");
    assert_eq!(gpu.memory[0].kind, MemoryKind::Hbm);
    assert_eq!(gpu.memory[0].size, 80 << 30);
    assert!(gpu.id.as_str().starts_with("uuid:GPU-"));
    assert_eq!(gpu.gpu.as_ref().and_then(|g| g.uuid.as_deref()), gpu.id.as_str().strip_prefix("uuid:"));
    assert_eq!(gpu.pci_address().map(|a| a.to_string()).as_deref(), Some("0000:18:00.0"));
    assert_eq!(gpu.local_cpus.as_ref().map(|c| c.to_string()).as_deref(), Some("0-55,112-167"));

    let f = Fabric::build(inv).expect("fabric");
    let g = |n| nth(&f, "node0", DeviceKind::Gpu, n);
    let nic = |n| nth(&f, "node0", DeviceKind::Nic, n);
    for a in 0..8 {
        for b in 0..8 {
            let want = if a == b { HopClass::X } else { HopClass::Nv(18) };
            assert_eq!(f.classify(g(a), g(b)), want, "gpu{a} gpu{b}");
        }
    }
    assert_eq!(f.classify(g(0), nic(0)), HopClass::Pix);
    assert_eq!(f.classify(g(0), nic(1)), HopClass::Pix);
    assert_eq!(f.classify(g(0), nic(2)), HopClass::Node, "other switch, same socket");
    assert_eq!(f.classify(g(0), nic(4)), HopClass::Sys, "other socket");
    assert_eq!(f.classify(g(7), nic(6)), HopClass::Pix);
    assert_eq!(f.classify(g(7), nic(4)), HopClass::Node);
    assert_eq!(f.device(f.cpu_of(g(5)).expect("cpu")).id.as_str(), "name:node0/numa1");

    // nic1 trained at x8: its upstream link is degraded to half, and a route to it says so.
    let l = f.parent_link(nic(1)).expect("nic1 has a parent link");
    let link = f.link(l);
    assert_eq!(link.state, LinkState::Degraded);
    assert!(matches!(link.kind, LinkKind::Pcie { width_current: Some(8), width_max: Some(16), .. }));
    let r = f.route(g(1), nic(1)).expect("route");
    assert!(r.degraded_links.contains(&l));
    assert!((r.fraction().expect("fraction") - 0.5).abs() < 0.01);
    let healthy = f.route(g(0), nic(0)).expect("route");
    assert!(healthy.degraded_links.is_empty());
    assert_eq!(f.inventory().links.iter().filter(|l| l.state != LinkState::Up).count(), 1);
}

#[test]
fn bundled_default_is_the_hgx_file_and_discovers_through_the_backend() {
    let text = std::fs::read_to_string(config_dir().join(sim::DEFAULT_FABRIC_NAME)).expect("file");
    assert_eq!(text, sim::DEFAULT_FABRIC);
    let backend = SimBackend::bundled_default();
    assert_eq!(backend.name(), "sim");
    let inv = discover(&[&backend]);
    assert_eq!(inv.count(DeviceKind::Gpu), 8);
    assert_eq!(inv.backends.len(), 1, "one report, from discover()");
    assert_eq!(inv.backends[0].devices, inv.devices.len());
    // A broken file is a failed report, not a panic, and leaves the inventory alone.
    let broken = SimBackend::from_text("[fabric]\nname = 1\n", "broken.toml");
    let inv = discover(&[&backend, &broken]);
    assert_eq!(inv.count(DeviceKind::Gpu), 8);
    assert!(matches!(&inv.backends[1].state, fabric_topology::BackendState::Failed(m) if m.contains("broken.toml:2")));
    // Merging the same fabric twice dedupes by identity.
    let inv = discover(&[&backend, &backend]);
    assert_eq!(inv.count(DeviceKind::Gpu), 8);
}

#[test]
fn supernode_spans_trays_with_one_nvlink_domain() {
    let inv = load("supernode-64.toml");
    let k = kinds(&inv);
    assert_eq!(k[&DeviceKind::Gpu], 64);
    assert_eq!(k[&DeviceKind::NvSwitch], 18);
    assert_eq!(k[&DeviceKind::Cpu], 32);
    assert_eq!(k[&DeviceKind::Nic], 64);
    assert_eq!(links_of(&inv, "nvlink"), 64 * 18);
    assert_eq!(links_of(&inv, "c2c"), 64);
    let fabric_switches = inv.devices.iter().filter(|d| d.node.is_none() && d.kind == DeviceKind::NvSwitch).count();
    assert_eq!(fabric_switches, 18, "NVLink switches live at fabric level, without a host");
    let f = Fabric::build(inv).expect("fabric");
    let g = |node: &str, n| nth(&f, node, DeviceKind::Gpu, n);
    assert_eq!(f.classify(g("tray0", 0), g("tray15", 3)), HopClass::Nv(18));
    assert_eq!(f.classify(g("tray0", 0), g("tray0", 1)), HopClass::Nv(18));
    // tray5/gpu2 lost two of its 18 links.
    assert_eq!(f.classify(g("tray0", 0), g("tray5", 2)), HopClass::Nv(16));
    let grace = nth(&f, "tray3", DeviceKind::Cpu, 1);
    assert_eq!(f.classify(g("tray3", 2), grace), HopClass::C2c);
    // A route is one path: through one switch chip, so one NVLink5 link's bandwidth.
    let r = f.route(g("tray0", 0), g("tray9", 1)).expect("route over NVLink");
    assert_eq!(r.class, HopClass::Nv(18));
    assert_eq!(r.bandwidth_mbps, Some(50_000));
    assert!(r.hops.iter().all(|&h| f.device(h).kind != DeviceKind::Nic), "stays on NVLink");
    assert_eq!(f.classify(g("tray0", 0), nth(&f, "tray1", DeviceKind::Nic, 0)), HopClass::Net);
}

#[test]
fn cxl_pool_has_consistent_regions_and_decoders() {
    let inv = load("cxl-pool.toml");
    let memdevs: Vec<_> = inv.devices.iter().filter(|d| d.kind == DeviceKind::CxlMemdev).collect();
    assert_eq!(memdevs.len(), 5);
    let with = |k: MemoryKind| memdevs.iter().filter(|d| d.memory.iter().any(|m| m.kind == k)).count();
    assert_eq!(with(MemoryKind::CxlVolatile), 3);
    assert_eq!(with(MemoryKind::CxlPersistent), 1);
    assert_eq!(with(MemoryKind::CxlDynamic), 1);
    let dcd = memdevs.iter().find(|d| d.cxl.as_ref().and_then(|c| c.dc_regions) == Some(2)).expect("a DCD");
    assert_eq!(dcd.memory.len(), 2);
    for d in &memdevs {
        let serial = d.cxl.as_ref().and_then(|c| c.serial).expect("serial");
        assert_eq!(d.id.as_str(), format!("serial:cxl/{serial:#x}"));
    }
    assert_eq!(inv.count(DeviceKind::CxlSwitch), 1);

    let cxl = &inv.cxl;
    assert_eq!(cxl.regions.len(), 2);
    let r0 = &cxl.regions[0];
    assert_eq!((r0.mode, r0.ways, r0.granularity), (Some(CxlMode::Ram), Some(2), Some(4096)));
    assert_eq!(r0.size, Some(2 * (256 << 30)));
    assert_eq!(r0.targets.len(), 2);
    let root = cxl.decoders.iter().find(|d| d.level == CxlDecoderLevel::Root).expect("root decoder");
    let (wstart, wsize) = (root.start.expect("start"), root.size.expect("size"));
    for r in &cxl.regions {
        let (s, n) = (r.resource.expect("resource"), r.size.expect("size"));
        assert!(s >= wstart && s + n <= wstart + wsize, "region inside the window");
        assert_eq!(r.root_decoder.as_deref(), Some(root.kernel_name.as_str()));
        // Every member has an endpoint decoder for the region with size / ways of DPA.
        for t in &r.targets {
            let d = cxl
                .decoders
                .iter()
                .find(|d| d.owner.as_ref() == Some(t) && d.region.as_deref() == Some(&r.kernel_name))
                .expect("endpoint decoder");
            assert_eq!(d.level, CxlDecoderLevel::Endpoint);
            assert_eq!(d.dpa_size, Some(n / u64::from(r.ways.expect("ways"))));
            assert_eq!(d.mode, r.mode);
        }
    }
    assert!(cxl.regions[1].resource >= Some(r0.resource.expect("r0") + r0.size.expect("r0")), "no overlap");
    let switch_dec =
        cxl.decoders.iter().filter(|d| d.level == CxlDecoderLevel::Switch && d.region.as_deref() == Some("region0"));
    assert_eq!(switch_dec.map(|d| d.targets.len()).collect::<Vec<_>>(), [1, 2], "host bridge 1 port, switch 2 ports");

    let f = Fabric::build(inv).expect("fabric");
    let nic = nth(&f, "cxl-host", DeviceKind::Nic, 0);
    let mem0 = nth(&f, "cxl-host", DeviceKind::CxlMemdev, 0);
    assert_eq!(f.classify(nic, mem0), HopClass::Cxl);
    let mem2 = nth(&f, "cxl-host", DeviceKind::CxlMemdev, 2);
    assert_eq!(f.link(f.parent_link(mem2).expect("link")).state, LinkState::Degraded);
}

#[test]
fn ualink_pod_numbers_1024_accelerators() {
    let inv = load("ualink-pod-1024.toml");
    let accs: Vec<_> = inv.devices.iter().filter(|d| d.kind == DeviceKind::Accelerator).collect();
    assert_eq!(accs.len(), 1024);
    let mut ids: Vec<u16> =
        accs.iter().map(|d| d.ualink.as_ref().and_then(|u| u.accelerator_id).expect("id")).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..1024).collect::<Vec<u16>>());
    assert!(accs.iter().all(|d| d.ualink.as_ref().and_then(|u| u.pod) == Some(0)));
    let vpod = |d: &fabric_topology::Device| d.ualink.as_ref().and_then(|u| u.vpod).expect("vpod");
    assert_eq!((vpod(accs[0]), vpod(accs[255]), vpod(accs[256]), vpod(accs[1023])), (0, 0, 1, 3));
    assert_eq!(inv.count(DeviceKind::UalinkSwitch), 4);
    assert_eq!(links_of(&inv, "ualink"), 1024 * 4);
    let f = Fabric::build(inv).expect("fabric");
    let a = |node: &str, n| nth(&f, node, DeviceKind::Accelerator, n);
    assert_eq!(f.classify(a("host0", 0), a("host255", 3)), HopClass::Ual(4));
    let r = f.route(a("host0", 0), a("host200", 1)).expect("route");
    assert_eq!(r.bandwidth_mbps, Some(4 * 200 * 125));
}

#[test]
fn loading_twice_gives_identical_serializations() {
    for name in ["hgx-h100-8gpu.toml", "supernode-64.toml", "cxl-pool.toml", "ualink-pod-1024.toml"] {
        let a = serde_json::to_string(&load(name)).expect("json");
        let b = serde_json::to_string(&load(name)).expect("json");
        assert_eq!(a, b, "{name}");
    }
}

fn check_cluster_100k(f: &Fabric) {
    let inv = f.inventory();
    let k = kinds(inv);
    assert_eq!(k[&DeviceKind::Gpu], 100_000);
    assert_eq!(k[&DeviceKind::Nic], 100_000);
    assert_eq!(f.nodes().len(), 12_500);
    // 8 rails x ceil(12500 / 32) leaves, 32 spines.
    assert_eq!(k[&DeviceKind::NetworkSwitch], 8 * 391 + 32);
    assert_eq!(links_of(inv, "network"), 100_000 + 8 * 391 * 32);
    assert_eq!(links_of(inv, "nvlink"), 12_500 * 32);
    let g = |node: &str, n| nth(f, node, DeviceKind::Gpu, n);
    assert_eq!(f.classify(g("node0", 0), g("node0", 5)), HopClass::Nv(18));
    assert_eq!(f.classify(g("node0", 0), g("node12499", 7)), HopClass::Net);
    let r = f.route(g("node17", 3), g("node9000", 3)).expect("route across nodes");
    let kinds_on_path: Vec<DeviceKind> = r.hops.iter().map(|&h| f.device(h).kind).collect();
    assert!(kinds_on_path.contains(&DeviceKind::NetworkSwitch));
    assert_eq!(kinds_on_path.iter().filter(|&&k| k == DeviceKind::Nic).count(), 2);
    assert_eq!(r.bandwidth_mbps, Some(400 * 125));
    // node4711/nic3 negotiated 200G.
    let nic = nth(f, "node4711", DeviceKind::Nic, 3);
    let degraded: Vec<_> = f.neighbors(nic).filter(|&(_, l)| f.link(l).state == LinkState::Degraded).collect();
    assert_eq!(degraded.len(), 1);
    assert_eq!(f.link(degraded[0].1).bandwidth.current_mbps, Some(200 * 125));
}
