//! Scenario tests of NVML discovery against the fake source: an HGX H100 board, a direct
//! mesh, degraded links, and merging into functions the PCI backend found first.

use fabric_topology::{
    BackendState, Device, DeviceId, DeviceIdx, DeviceKind, FAILED_ATTR, Fabric, HopClass, Inventory, Link, LinkKind,
    LinkState, MemoryKind, PciAddress, PciInfo,
};

use super::api::{FabricHealth, FabricInfo, FabricState, NvmlCallError, P2pCap, P2pStatus, RemoteType};
use super::discover_from;
use super::fake::{FakeNvml, HGX_GPUS, HGX_SPLIT, HGX_SWITCHES};
use super::snapshot::parse_bus_id;

const NODE: &str = "n0";

fn addr(bus: &str) -> PciAddress {
    parse_bus_id(bus).unwrap()
}

fn uuid_of(n: usize) -> DeviceId {
    DeviceId::uuid(&format!("GPU-{n:08x}-0000-0000-0000-000000000000"))
}

fn nvlinks(inv: &Inventory) -> Vec<&Link> {
    inv.links.iter().filter(|l| matches!(l.kind, LinkKind::NvLink { .. })).collect()
}

fn links_between(inv: &Inventory, a: DeviceIdx, b: DeviceIdx) -> Vec<&Link> {
    nvlinks(inv).into_iter().filter(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)).collect()
}

fn count(l: &Link) -> u16 {
    match l.kind {
        LinkKind::NvLink { count, .. } => count,
        _ => 0,
    }
}

#[test]
fn hgx_h100_yields_gpus_by_uuid_switches_and_nv18() {
    let fake = FakeNvml::hgx_h100();
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    assert_eq!(report.state, BackendState::Present);
    assert_eq!(report.devices, 12, "8 GPUs + 4 switches");
    assert_eq!(inv.count(DeviceKind::Gpu), 8);
    assert_eq!(inv.count(DeviceKind::NvSwitch), 4);
    for (n, bus) in HGX_GPUS.iter().enumerate() {
        let g = inv.find(&uuid_of(n)).expect("GPU by uuid");
        let d = inv.device(g);
        assert_eq!(d.pci_address(), Some(addr(bus)));
        let gpu = d.gpu.as_ref().unwrap();
        assert_eq!(gpu.nvlink_capable, Some(18));
        assert_eq!(gpu.nvlink_generation, Some(4));
        assert_eq!(gpu.fabric_state.as_deref(), Some("completed"));
        assert_eq!(gpu.fabric_cluster.as_deref(), Some("abababab-abab-abab-abab-abababababab"));
        assert_eq!(gpu.fabric_clique, Some(7));
        assert_eq!(d.numa_node, Some(u32::from(n >= 4)));
        assert_eq!(d.memory.len(), 1);
        assert_eq!(d.memory[0].kind, MemoryKind::Hbm);
        assert_eq!(d.sources, vec!["nvml".to_owned()]);
        for (sw, want) in HGX_SWITCHES.iter().zip(HGX_SPLIT) {
            let s = inv.find(&DeviceId::pci(NODE, addr(sw))).expect("switch by PCI address");
            let l = links_between(&inv, g, s);
            assert_eq!(l.len(), 1, "one bundle per GPU-switch pair");
            assert_eq!(count(l[0]), want as u16);
            assert_eq!(l[0].kind, LinkKind::NvLink { generation: 4, count: want as u16 });
            assert_eq!(l[0].bandwidth.current_mbps, Some(25_000 * want as u64));
            assert_eq!(l[0].state, LinkState::Up);
        }
    }
    assert_eq!(nvlinks(&inv).len(), 32);
    let peer = uuid_of(1).as_str().trim_start_matches("uuid:").to_owned();
    let g0 = inv.find(&uuid_of(0)).unwrap();
    assert_eq!(inv.device(g0).attrs.get(&format!("nvml.p2p.nvlink.{peer}")).map(String::as_str), Some("ok"));
    let fabric = Fabric::build(inv).unwrap();
    let inv = fabric.inventory();
    let (g0, g1, g7) = (inv.find(&uuid_of(0)).unwrap(), inv.find(&uuid_of(1)).unwrap(), inv.find(&uuid_of(7)).unwrap());
    assert_eq!(fabric.classify(g0, g1), HopClass::Nv(18));
    assert_eq!(fabric.classify(g0, g7), HopClass::Nv(18));
}

#[test]
fn direct_mesh_without_switches_dedupes_gpu_pairs() {
    let fake = FakeNvml::direct_mesh(6);
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    assert_eq!(report.state, BackendState::Present);
    assert_eq!(inv.count(DeviceKind::Gpu), 4);
    assert_eq!(inv.count(DeviceKind::NvSwitch), 0);
    let links = nvlinks(&inv);
    assert_eq!(links.len(), 6, "one bundle per unordered pair, not one per side");
    assert!(links.iter().all(|l| l.kind == LinkKind::NvLink { generation: 4, count: 6 }));
    assert!(links.iter().all(|l| l.bandwidth.max_mbps == Some(150_000)));
    let fabric = Fabric::build(inv).unwrap();
    let inv = fabric.inventory();
    for a in 0..4 {
        for b in 0..4 {
            let want = if a == b { HopClass::X } else { HopClass::Nv(6) };
            assert_eq!(fabric.classify(inv.find(&uuid_of(a)).unwrap(), inv.find(&uuid_of(b)).unwrap()), want);
        }
    }
}

#[test]
fn links_down_in_a_bundle_show_as_degraded() {
    let mut fake = FakeNvml::hgx_h100();
    // GPU 0 links 0 and 1 (both to switch 0) are down but still name their far end.
    fake.gpus[0].links[0].active = false;
    fake.gpus[0].links[1].active = false;
    let mut inv = Inventory::new();
    discover_from(&fake, NODE, &mut inv);
    let g0 = inv.find(&uuid_of(0)).unwrap();
    let s0 = inv.find(&DeviceId::pci(NODE, addr(HGX_SWITCHES[0]))).unwrap();
    let l = links_between(&inv, g0, s0);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].kind, LinkKind::NvLink { generation: 4, count: 3 });
    assert_eq!(l[0].bandwidth.current_mbps, Some(75_000));
    assert_eq!(l[0].bandwidth.max_mbps, Some(125_000));
    assert_eq!(l[0].state, LinkState::Degraded);
    assert!((l[0].bandwidth.fraction().unwrap() - 0.6).abs() < 1e-9);
    assert_eq!(inv.device(g0).attrs.get("nvml.nvlinks_active").map(String::as_str), Some("16/18"));
    let fabric = Fabric::build(inv).unwrap();
    let inv = fabric.inventory();
    let (g0, g1, g2) = (inv.find(&uuid_of(0)).unwrap(), inv.find(&uuid_of(1)).unwrap(), inv.find(&uuid_of(2)).unwrap());
    assert_eq!(fabric.classify(g0, g1), HopClass::Nv(16));
    assert_eq!(fabric.classify(g1, g2), HopClass::Nv(18), "other GPUs are unaffected");
}

#[test]
fn a_bundle_with_every_link_down_is_a_down_link() {
    let mut fake = FakeNvml::direct_mesh(6);
    // GPU 0 <-> GPU 1: every link down on both sides.
    for l in fake.gpus[0].links.iter_mut().take(6) {
        l.active = false;
    }
    for l in fake.gpus[1].links.iter_mut().take(6) {
        l.active = false;
    }
    let mut inv = Inventory::new();
    discover_from(&fake, NODE, &mut inv);
    let (g0, g1) = (inv.find(&uuid_of(0)).unwrap(), inv.find(&uuid_of(1)).unwrap());
    let l = links_between(&inv, g0, g1);
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].state, LinkState::Down);
    assert_eq!(count(l[0]), 0);
    assert_eq!(l[0].bandwidth.current_mbps, Some(0));
    let fabric = Fabric::build(inv).unwrap();
    let inv = fabric.inventory();
    let (g0, g1) = (inv.find(&uuid_of(0)).unwrap(), inv.find(&uuid_of(1)).unwrap());
    assert!(!matches!(fabric.classify(g0, g1), HopClass::Nv(_)), "a down bundle carries nothing");
}

#[test]
fn down_links_without_a_far_end_are_counted_not_attributed() {
    let mut fake = FakeNvml::hgx_h100();
    for l in fake.gpus[0].links.iter_mut().take(2) {
        l.active = false;
        l.remote = Err(NvmlCallError::NotSupported);
        l.remote_type = Err(NvmlCallError::NotSupported);
    }
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    let g0 = inv.find(&uuid_of(0)).unwrap();
    let s0 = inv.find(&DeviceId::pci(NODE, addr(HGX_SWITCHES[0]))).unwrap();
    let l = links_between(&inv, g0, s0);
    assert_eq!(count(l[0]), 3);
    assert_eq!(inv.device(g0).attrs.get("nvml.nvlinks_down_far_end_unknown").map(String::as_str), Some("2"));
    assert!(report.unknown.is_empty(), "down links without a far end are expected: {:?}", report.unknown);
}

#[test]
fn pci_functions_found_first_are_renamed_to_the_uuid_and_keep_their_pci_details() {
    let mut inv = Inventory::new();
    let bridge =
        inv.add_device(Device::new(DeviceId::pci(NODE, addr("0000:17:00.0")), DeviceKind::PciBridge, Some(NODE)));
    let bridge = bridge.unwrap();
    let gpu_addr = addr(HGX_GPUS[0]);
    let mut gpu = Device::new(DeviceId::pci(NODE, gpu_addr), DeviceKind::Other, Some(NODE));
    gpu.pci = Some(PciInfo {
        address: Some(gpu_addr),
        class: Some(0x030200),
        vendor_id: Some(0x10de),
        device_id: Some(0x2330),
        link_speed_gts: Some(32.0),
        link_width: Some(16),
        iommu_group: Some(42),
        ..PciInfo::default()
    });
    gpu.numa_node = Some(0);
    gpu.sources.push("pci".into());
    let gpu = inv.add_device(gpu).unwrap();
    inv.add_link(Link::pcie(bridge, gpu, (Some(5), Some(16)), (Some(5), Some(16))));
    let sw_addr = addr(HGX_SWITCHES[2]);
    let mut sw = Device::new(DeviceId::pci(NODE, sw_addr), DeviceKind::Other, Some(NODE));
    sw.pci =
        Some(PciInfo { address: Some(sw_addr), class: Some(0x068000), vendor_id: Some(0x10de), ..PciInfo::default() });
    sw.sources.push("pci".into());
    let sw = inv.add_device(sw).unwrap();

    let mut fake = FakeNvml::hgx_h100();
    // Without NVML's far-end type the switch is still recognised by its PCI class.
    for l in &mut fake.gpus[0].links {
        l.remote_type = Err(NvmlCallError::NotSupported);
    }
    discover_from(&fake, NODE, &mut inv);

    assert_eq!(inv.find(&uuid_of(0)), Some(gpu), "same device, new identity");
    assert_eq!(inv.find(&DeviceId::pci(NODE, gpu_addr)), None);
    let d = inv.device(gpu);
    assert_eq!(d.kind, DeviceKind::Gpu);
    let pci = d.pci.as_ref().unwrap();
    assert_eq!((pci.class, pci.link_width, pci.iommu_group), (Some(0x030200), Some(16), Some(42)));
    assert_eq!(d.sources, vec!["pci".to_owned(), "nvml".to_owned()]);
    assert_eq!(d.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(inv.count(DeviceKind::Gpu), 8, "no duplicate GPU");
    assert_eq!(inv.count(DeviceKind::NvSwitch), 4);
    assert_eq!(inv.device(sw).kind, DeviceKind::NvSwitch, "the PCI function became the switch");
    assert_eq!(inv.device(sw).sources, vec!["pci".to_owned(), "nvml".to_owned()]);
    assert_eq!(links_between(&inv, gpu, sw).len(), 1);
    assert!(inv.links.iter().any(|l| l.a == bridge && l.b == gpu), "PCIe link still points at the GPU");
}

#[test]
fn unanswered_queries_are_unknown_not_invented() {
    let mut fake = FakeNvml::hgx_h100();
    fake.gpus[3].serial = Err(NvmlCallError::Failed("GPU is lost".into()));
    fake.gpus[3].fabric = Err(NvmlCallError::NotSupported);
    fake.gpus[3].numa_mask = vec![0b11];
    fake.p2p.insert((0, 1, P2pCap::Read), P2pStatus::ChipsetNotSupported);
    fake.p2p.insert((0, 1, P2pCap::Atomics), P2pStatus::TopologyNotSupported);
    fake.p2p.remove(&(0, 2, P2pCap::Write));
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    let d = inv.device(inv.find(&uuid_of(3)).unwrap());
    let gpu = d.gpu.as_ref().unwrap();
    assert_eq!(gpu.serial, None);
    assert_eq!(gpu.fabric_state.as_deref(), Some("not_supported"));
    assert_eq!((gpu.fabric_cluster.as_ref(), gpu.fabric_clique), (None, None));
    assert_eq!(d.numa_node, None, "two NUMA nodes is not one");
    assert!(
        report.unknown.iter().any(|l| l.contains("device 3 serial") && l.contains("GPU is lost")),
        "{:?}",
        report.unknown
    );
    assert!(report.unknown.iter().any(|l| l.contains("device 3 memory_affinity")));
    let peer = uuid_of(1).as_str().trim_start_matches("uuid:").to_owned();
    let g0 = inv.device(inv.find(&uuid_of(0)).unwrap());
    assert_eq!(g0.attrs.get(&format!("nvml.p2p.read.{peer}")).map(String::as_str), Some("chipset_not_supported"));
    // Every capability of the matrix is recorded per ordered pair; an unanswered one is
    // absent (and noted), not guessed.
    assert_eq!(g0.attrs.get(&format!("nvml.p2p.atomics.{peer}")).map(String::as_str), Some("topology_not_supported"));
    for cap in ["write", "nvlink", "pci"] {
        assert_eq!(g0.attrs.get(&format!("nvml.p2p.{cap}.{peer}")).map(String::as_str), Some("ok"), "{cap}");
    }
    let peer2 = uuid_of(2).as_str().trim_start_matches("uuid:").to_owned();
    assert_eq!(g0.attrs.get(&format!("nvml.p2p.write.{peer2}")), None);
    assert!(report.unknown.iter().any(|l| l.contains("device 0 p2p write to 2")), "{:?}", report.unknown);
}

#[test]
fn a_lost_gpu_and_an_unhealthy_fabric_mark_the_gpu_failed_and_limited_capacity_does_not() {
    let mut fake = FakeNvml::hgx_h100();
    fake.gpus[1].lost = true;
    let health = |h| {
        Ok(FabricInfo {
            state: FabricState::Completed,
            status: 0,
            cluster_uuid: [0xab; 16],
            clique_id: 7,
            health: Some(h),
        })
    };
    fake.gpus[2].fabric = health(FabricHealth::Unhealthy);
    fake.gpus[3].fabric = health(FabricHealth::LimitedCapacity);
    fake.gpus[4].fabric = health(FabricHealth::Healthy);
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    let failed = |n: usize| inv.device(inv.find(&uuid_of(n)).unwrap()).attrs.get(FAILED_ATTR).cloned();
    let lost = failed(1).expect("a lost GPU is failed");
    assert!(lost.contains("GPU_IS_LOST"), "{lost}");
    assert!(report.unknown.iter().any(|l| l.contains("device 1 memory_info") && l.contains("lost")));
    assert!(failed(2).expect("an unhealthy fabric is a failure").contains("unhealthy"));
    assert_eq!(failed(3), None, "limited capacity is degraded, not failed");
    assert_eq!(inv.device(inv.find(&uuid_of(3)).unwrap()).attrs["nvml.fabric_health"], "limited_capacity");
    for n in [0, 4, 5, 6, 7] {
        assert_eq!(failed(n), None, "GPU {n}");
    }
}

#[test]
fn remote_gpu_type_is_inferred_from_the_gpu_list() {
    let mut fake = FakeNvml::direct_mesh(6);
    for g in &mut fake.gpus {
        for l in &mut g.links {
            l.remote_type = Ok(RemoteType::Unknown);
        }
    }
    let mut inv = Inventory::new();
    discover_from(&fake, NODE, &mut inv);
    assert_eq!(nvlinks(&inv).len(), 6);
}

#[test]
fn a_panicking_source_fails_the_backend_and_leaves_the_inventory_alone() {
    let fake = FakeNvml { panic_on_uuid: Some(2), ..FakeNvml::hgx_h100() };
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    match report.state {
        BackendState::Failed(m) => assert!(m.contains("fake NVML crashed"), "{m}"),
        s => panic!("unexpected {s:?}"),
    }
    assert!(inv.devices.is_empty());
}

#[test]
fn switches_without_a_host_address_become_one_fabric_device() {
    let mut fake = FakeNvml::hgx_h100();
    for g in &mut fake.gpus {
        for l in &mut g.links {
            // What NVML may report for switches in other trays: a type but no address.
            l.remote = Ok("00000000:00:00.0".into());
        }
    }
    let mut inv = Inventory::new();
    let report = discover_from(&fake, NODE, &mut inv);
    assert_eq!(inv.count(DeviceKind::NvSwitch), 1);
    let sw = inv.find(&DeviceId::named(NODE, "nvswitch-fabric")).unwrap();
    let g0 = inv.find(&uuid_of(0)).unwrap();
    assert_eq!(links_between(&inv, g0, sw)[0].kind, LinkKind::NvLink { generation: 4, count: 18 });
    assert!(report.unknown.is_empty(), "{:?}", report.unknown);
    let fabric = Fabric::build(inv).unwrap();
    let inv = fabric.inventory();
    assert_eq!(fabric.classify(inv.find(&uuid_of(0)).unwrap(), inv.find(&uuid_of(5)).unwrap()), HopClass::Nv(18));
}

#[test]
fn a_switch_address_taken_by_another_host_function_is_not_reused() {
    let mut inv = Inventory::new();
    let a = addr(HGX_SWITCHES[0]);
    let mut nic = Device::new(DeviceId::pci(NODE, a), DeviceKind::Nic, Some(NODE));
    nic.pci = Some(PciInfo { address: Some(a), vendor_id: Some(0x15b3), ..PciInfo::default() });
    let nic = inv.add_device(nic).unwrap();
    discover_from(&FakeNvml::hgx_h100(), NODE, &mut inv);
    assert_eq!(inv.device(nic).kind, DeviceKind::Nic, "the NIC stays a NIC");
    let sw = inv.find(&DeviceId::named(NODE, &format!("nvswitch@{a}"))).expect("switch named by its address");
    assert_eq!(inv.device(sw).kind, DeviceKind::NvSwitch);
    assert_eq!(inv.count(DeviceKind::NvSwitch), 4);
}
