//! RDMA discovery (`/sys/class/infiniband`) on the real dump that has an InfiniBand HCA
//! (32em64t: a ConnectX-3 `mlx4_0`) and on synthetic trees written from the kernel's ABI
//! (`Documentation/ABI/stable/sysfs-class-infiniband`, `drivers/infiniband/core/sysfs.c`):
//! an NDR InfiniBand HCA with a peer-memory module, a RoCE v2 NIC with its GID table, a port
//! down, a port a subnet manager has not activated, Soft-RoCE without a PCI function, and
//! hostile contents. Expected values come from those files and rules, not from our output.
#![allow(clippy::unwrap_used)]

mod fixtures;

use std::os::unix::fs::symlink;

use fabric_drivers::Backend;
use fabric_drivers::pci::PciBackend;
use fabric_drivers::rdma::RdmaBackend;
use fabric_topology::{
    BackendReport, BackendState, DeviceId, DeviceIdx, DeviceKind, GidType, Inventory, LinkKind, LinkLayer, LinkState,
    PhysState, PortState, RdmaDevice,
};
use fixtures::{Synth, ids};

fn discover(root: &fabric_drivers::SysfsRoot) -> (Inventory, BackendReport) {
    let mut inv = Inventory::new();
    PciBackend::new(root.clone()).discover(&mut inv);
    let report = RdmaBackend::new(root.clone()).discover(&mut inv);
    inv.validate().unwrap();
    (inv, report)
}

fn rdma<'a>(inv: &'a Inventory, id: &DeviceId) -> (DeviceIdx, &'a RdmaDevice) {
    let i = inv.find(id).unwrap_or_else(|| panic!("{id} not found"));
    (i, inv.device(i).rdma.first().unwrap_or_else(|| panic!("{id} has no RDMA device")))
}

/// The network links of a device: (state, gbps, current MB/s, max MB/s).
fn net_links(inv: &Inventory, i: DeviceIdx) -> Vec<(LinkState, u32, Option<u64>, Option<u64>)> {
    inv.links
        .iter()
        .filter(|l| l.a == i)
        .filter_map(|l| match l.kind {
            LinkKind::Network { gbps } => Some((l.state, gbps, l.bandwidth.current_mbps, l.bandwidth.max_mbps)),
            _ => None,
        })
        .collect()
}

#[test]
fn real_dump_connectx3_fdr_port() {
    let Some(x) = fixtures::extract("32em64t") else { return };
    let (inv, report) = discover(&x.sysfs());
    assert_eq!(report.state, BackendState::Present);
    // The dump's class directory also lists scif0 (a Xeon Phi's SCIF RDMA device) whose
    // target, sys/devices/scif_dma_0, was not captured: skipped with its reason.
    assert!(report.unknown.iter().any(|l| l.starts_with("infiniband/scif0: skipped")), "{:?}", report.unknown);
    let id = DeviceId::pci("fx", "0000:82:00.0".parse().unwrap());
    let (i, d) = rdma(&inv, &id);
    assert_eq!(inv.device(i).kind, DeviceKind::Nic);
    assert_eq!(d.name, "mlx4_0");
    assert_eq!(d.node_type.as_deref(), Some("CA"));
    assert_eq!(d.node_guid.as_deref(), Some("0002:c903:00f9:bfa0"));
    assert_eq!(d.sys_image_guid.as_deref(), Some("0002:c903:00f9:bfa3"));
    assert_eq!(d.firmware.as_deref(), Some("2.11.500"));
    assert_eq!(d.peer_memory, None, "the dump has no peer-memory module");
    assert_eq!(d.ports.len(), 1);
    let p = &d.ports[0];
    assert_eq!((p.number, p.state, p.phys_state), (1, Some(PortState::Active), Some(PhysState::LinkUp)));
    // "56 Gb/sec (4X FDR)": 4 lanes × 14 Gb/s.
    assert_eq!(p.rate_mbps, Some(56_000));
    assert_eq!(p.rate.as_deref(), Some("56 Gb/sec (4X FDR)"));
    assert_eq!(p.link_layer, Some(LinkLayer::Infiniband));
    assert_eq!((p.lid, p.sm_lid), (Some(0x3a4), Some(0x1)));
    // GID 0 of an IB port is the subnet prefix + the port GUID; the table's other 127
    // entries are all zero (unused).
    assert_eq!(p.port_guid.as_deref(), Some("0002:c903:00f9:bfa1"));
    assert_eq!(p.gids.len(), 1);
    assert_eq!(p.gids[0].gid, "fe80:0000:0000:0000:0002:c903:00f9:bfa1");
    assert_eq!(net_links(&inv, i), [(LinkState::Up, 56, Some(7_000), Some(7_000))]);
}

const NDR_HCA: &str = "pci0000:00/0000:00:01.0/0000:01:00.0";
const ROCE_P0: &str = "pci0000:00/0000:00:02.0/0000:02:00.0";
const ROCE_P1: &str = "pci0000:00/0000:00:02.0/0000:02:00.1";
const NO_SM: &str = "pci0000:00/0000:00:03.0/0000:03:00.0";

/// Writes an RDMA device `name` below the device path `under` (relative to `sys/devices`)
/// with its class link, and `files` relative to the device directory.
fn rdma_device(s: &Synth, under: &str, name: &str, files: &[(&str, &str)]) {
    let dir = format!("sys/devices/{under}/infiniband/{name}");
    for (f, v) in files {
        s.write(&format!("{dir}/{f}"), format!("{v}\n"));
    }
    std::fs::create_dir_all(s.path().join("sys/class/infiniband")).unwrap();
    symlink(format!("../../devices/{under}/infiniband/{name}"), s.path().join("sys/class/infiniband").join(name))
        .unwrap();
}

fn port_files(
    state: &'static str,
    phys: &'static str,
    rate: &'static str,
    layer: &'static str,
) -> Vec<(&'static str, &'static str)> {
    vec![("ports/1/state", state), ("ports/1/phys_state", phys), ("ports/1/rate", rate), ("ports/1/link_layer", layer)]
}

fn host() -> Synth {
    let s = Synth::new();
    s.numa(0, "0-7", 1 << 20);
    for bridge in ["pci0000:00/0000:00:01.0", "pci0000:00/0000:00:02.0", "pci0000:00/0000:00:03.0"] {
        s.function(bridge, &ids("0x8086", "0x1234", "0x060400", "0"));
    }
    // ConnectX-7 (InfiniBand controller class 0x0207), NDR.
    s.function(NDR_HCA, &ids("0x15b3", "0x1021", "0x020700", "0"));
    s.write(&format!("sys/devices/{NDR_HCA}/net/ib0/ifindex"), "5\n");
    let mut f = vec![
        ("node_type", "1: CA"),
        ("node_guid", "a088:c203:0045:1e2c"),
        ("sys_image_guid", "a088:c203:0045:1e2c"),
        ("fw_ver", "28.39.1002"),
        ("ports/1/lid", "0x12"),
        ("ports/1/sm_lid", "0x1"),
        ("ports/1/gids/0", "fe80:0000:0000:0000:a088:c203:0045:1e2c"),
        ("ports/1/gids/1", "0000:0000:0000:0000:0000:0000:0000:0000"),
        ("ports/1/gid_attrs/types/0", "IB/RoCE v1"),
    ];
    f.extend(port_files("4: ACTIVE", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"));
    rdma_device(&s, NDR_HCA, "mlx5_0", &f);
    // ConnectX-6 Dx, two Ethernet functions: port 0 up with RoCE v1 and v2 GIDs for its
    // link-local and IPv4 addresses; port 1 administratively down.
    s.function(ROCE_P0, &ids("0x15b3", "0x101d", "0x020000", "0"));
    s.function(ROCE_P1, &ids("0x15b3", "0x101d", "0x020000", "0"));
    s.write(&format!("sys/devices/{ROCE_P0}/net/eth2/ifindex"), "6\n");
    s.write(&format!("sys/devices/{ROCE_P1}/net/eth3/ifindex"), "7\n");
    let mut f = vec![
        ("node_type", "1: CA"),
        ("node_guid", "b83f:d203:00aa:bb10"),
        ("sys_image_guid", "b83f:d203:00aa:bb10"),
        ("ports/1/lid", "0x0"),
        ("ports/1/sm_lid", "0x0"),
        ("ports/1/gids/0", "fe80:0000:0000:0000:ba3f:d2ff:feaa:bb10"),
        ("ports/1/gids/1", "fe80:0000:0000:0000:ba3f:d2ff:feaa:bb10"),
        ("ports/1/gids/2", "0000:0000:0000:0000:0000:ffff:c0a8:010a"),
        ("ports/1/gids/3", "0000:0000:0000:0000:0000:ffff:c0a8:010a"),
        ("ports/1/gids/4", "0000:0000:0000:0000:0000:0000:0000:0000"),
        ("ports/1/gid_attrs/types/0", "IB/RoCE v1"),
        ("ports/1/gid_attrs/types/1", "RoCE v2"),
        ("ports/1/gid_attrs/types/2", "IB/RoCE v1"),
        ("ports/1/gid_attrs/types/3", "RoCE v2"),
        ("ports/1/gid_attrs/ndevs/0", "eth2"),
        ("ports/1/gid_attrs/ndevs/1", "eth2"),
        ("ports/1/gid_attrs/ndevs/2", "eth2"),
        ("ports/1/gid_attrs/ndevs/3", "eth2"),
    ];
    f.extend(port_files("4: ACTIVE", "5: LinkUp", "100 Gb/sec (2X HDR)", "Ethernet"));
    rdma_device(&s, ROCE_P0, "mlx5_1", &f);
    let mut f = vec![("node_guid", "b83f:d203:00aa:bb11"), ("sys_image_guid", "b83f:d203:00aa:bb10")];
    f.extend(port_files("1: DOWN", "3: Disabled", "40 Gb/sec (4X QDR)", "Ethernet"));
    rdma_device(&s, ROCE_P1, "mlx5_2", &f);
    // An InfiniBand port cabled but with no subnet manager: physically up, logically INIT.
    s.function(NO_SM, &ids("0x15b3", "0x1021", "0x020700", "0"));
    let mut f = vec![("node_guid", "a088:c203:0045:1e40"), ("ports/1/lid", "0x0")];
    f.extend(port_files("2: INIT", "5: LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand"));
    rdma_device(&s, NO_SM, "mlx5_3", &f);
    s
}

#[test]
fn infiniband_hca_with_peer_memory() {
    let s = host();
    s.write("sys/module/nvidia_peermem/version", "550.54.15\n");
    let (inv, report) = discover(&s.sysfs());
    let id = DeviceId::pci("syn", "0000:01:00.0".parse().unwrap());
    let (i, d) = rdma(&inv, &id);
    assert_eq!(d.name, "mlx5_0");
    assert_eq!(d.peer_memory.as_deref(), Some("sys/module/nvidia_peermem/version"));
    assert_eq!(inv.device(i).attrs.get("gdr").map(String::as_str), Some("1"));
    let p = &d.ports[0];
    assert_eq!(p.rate_mbps, Some(400_000));
    assert_eq!(p.lid, Some(0x12));
    assert_eq!(p.port_guid.as_deref(), Some("a088:c203:0045:1e2c"));
    assert_eq!(p.gids.len(), 1, "the zero GID is an unused slot");
    assert_eq!(p.gids[0].kind, Some(GidType::IbRoceV1));
    // One port, no GID naming a netdev: the function's only netdev is the port's (IPoIB).
    assert_eq!(p.netdev.as_deref(), Some("ib0"));
    // 400 Gb/s = 50,000 MB/s per direction.
    assert_eq!(net_links(&inv, i), [(LinkState::Up, 400, Some(50_000), Some(50_000))]);
    assert!(!report.unknown.iter().any(|l| l.contains("mlx5_0")), "{:?}", report.unknown);
}

#[test]
fn roce_v2_gids_netdev_and_a_port_down() {
    let s = host();
    let (inv, report) = discover(&s.sysfs());
    let (i, d) = rdma(&inv, &DeviceId::pci("syn", "0000:02:00.0".parse().unwrap()));
    assert_eq!(d.peer_memory, None);
    assert!(!inv.device(i).attrs.contains_key("gdr"), "no peer-memory module: gdr unknown, not 0");
    let p = &d.ports[0];
    assert!(p.is_roce());
    assert_eq!(p.lid, None, "RoCE ports have no LID");
    assert_eq!(p.port_guid, None);
    let kinds: Vec<(u32, Option<GidType>)> = p.gids.iter().map(|g| (g.index, g.kind)).collect();
    assert_eq!(
        kinds,
        [
            (0, Some(GidType::IbRoceV1)),
            (1, Some(GidType::RoceV2)),
            (2, Some(GidType::IbRoceV1)),
            (3, Some(GidType::RoceV2))
        ]
    );
    assert_eq!(p.gids[3].gid, "0000:0000:0000:0000:0000:ffff:c0a8:010a");
    assert!(p.gids.iter().all(|g| g.netdev.as_deref() == Some("eth2")));
    assert_eq!(p.netdev.as_deref(), Some("eth2"));
    assert_eq!(net_links(&inv, i), [(LinkState::Up, 100, Some(12_500), Some(12_500))]);

    let (j, d) = rdma(&inv, &DeviceId::pci("syn", "0000:02:00.1".parse().unwrap()));
    assert_eq!(d.ports[0].state, Some(PortState::Down));
    assert_eq!(net_links(&inv, j), [(LinkState::Down, 40, None, Some(5_000))]);
    assert!(
        report.unknown.iter().any(|l| l == "mlx5_2 port 1: down (state Down, phys_state Disabled)"),
        "{:?}",
        report.unknown
    );
}

#[test]
fn a_port_without_a_subnet_manager_is_degraded() {
    let (inv, report) = discover(&host().sysfs());
    let (i, _) = rdma(&inv, &DeviceId::pci("syn", "0000:03:00.0".parse().unwrap()));
    assert_eq!(net_links(&inv, i), [(LinkState::Degraded, 400, Some(0), Some(50_000))]);
    assert!(report.unknown.iter().any(|l| l.starts_with("mlx5_3 port 1: degraded")));
    // The peer stands for the far end sysfs does not name.
    let peer = inv.find(&DeviceId::named("syn", "mlx5_3/port1/peer")).unwrap();
    assert_eq!(inv.device(peer).kind, DeviceKind::Other);
}

#[test]
fn soft_roce_without_pci_function_is_its_own_nic() {
    let s = host();
    let mut f = vec![("node_type", "1: CA"), ("ports/1/gids/0", "fe80:0000:0000:0000:0011:22ff:fe33:4455")];
    f.push(("ports/1/gid_attrs/ndevs/0", "veth0"));
    f.push(("ports/1/gid_attrs/types/0", "RoCE v2"));
    f.extend(port_files("4: ACTIVE", "5: LinkUp", "10 Gb/sec (1X QDR)", "Ethernet"));
    rdma_device(&s, "virtual", "rxe0", &f);
    let (inv, _) = discover(&s.sysfs());
    let (i, d) = rdma(&inv, &DeviceId::named("syn", "rxe0"));
    assert_eq!(inv.device(i).kind, DeviceKind::Nic);
    assert_eq!(inv.device(i).pci_address(), None);
    assert_eq!(d.ports[0].netdev.as_deref(), Some("veth0"));
    assert_eq!(net_links(&inv, i), [(LinkState::Up, 10, Some(1_250), Some(1_250))]);
}

#[test]
fn a_soft_roce_device_named_like_another_device_does_not_take_it_over() {
    // `rdma link add numa0 type rxe netdev veth0`: the user names the RDMA device.
    let s = host();
    let mut f = vec![("node_type", "1: CA")];
    f.extend(port_files("4: ACTIVE", "5: LinkUp", "10 Gb/sec (1X QDR)", "Ethernet"));
    rdma_device(&s, "virtual", "numa0", &f);
    let (inv, _) = discover(&s.sysfs());
    let numa = inv.find(&DeviceId::named("syn", "numa0")).expect("the NUMA node");
    assert_eq!(inv.device(numa).kind, DeviceKind::Cpu);
    assert!(inv.device(numa).rdma.is_empty() && !inv.device(numa).attrs.contains_key("ib_device"));
    assert!(net_links(&inv, numa).is_empty());
    let (i, d) = rdma(&inv, &DeviceId::named("syn", "rdma/numa0"));
    assert_eq!((inv.device(i).kind, d.name.as_str()), (DeviceKind::Nic, "numa0"));
    assert_eq!(net_links(&inv, i).len(), 1);
}

#[test]
fn hostile_contents_are_reported_not_trusted() {
    let s = host();
    // A class link that leaves the root, a dangling one, garbage in every port attribute.
    std::fs::create_dir_all(s.path().join("sys/class/infiniband")).unwrap();
    symlink("../../../../../../../../etc", s.path().join("sys/class/infiniband/evil")).unwrap();
    symlink("../../devices/gone/infiniband/ghost", s.path().join("sys/class/infiniband/ghost")).unwrap();
    let f = vec![
        ("node_guid", "zzzz"),
        ("ports/1/state", "ACTIVE"),
        ("ports/1/phys_state", "99: Warp"),
        ("ports/1/rate", "fast"),
        ("ports/1/link_layer", "Omni-Path"),
        ("ports/1/lid", "0x123456"),
        ("ports/1/gids/0", "fe80::1"),
        ("ports/99999999/state", "4: ACTIVE"),
    ];
    rdma_device(&s, "virtual", "bad0", &f);
    let (inv, report) = discover(&s.sysfs());
    assert_eq!(report.state, BackendState::Present);
    assert!(report.unknown.iter().any(|l| l.starts_with("infiniband/evil: skipped")), "{:?}", report.unknown);
    assert!(report.unknown.iter().any(|l| l.starts_with("infiniband/ghost: skipped")));
    let (i, d) = rdma(&inv, &DeviceId::named("syn", "bad0"));
    assert_eq!(d.node_guid, None);
    assert_eq!(d.ports.len(), 1, "a port number too long to be one is not a port");
    let p = &d.ports[0];
    assert_eq!((p.state, p.phys_state, p.rate_mbps, p.link_layer, p.lid), (None, None, None, None, None));
    assert!(p.gids.is_empty());
    assert_eq!(net_links(&inv, i), [(LinkState::Down, 0, None, None)]);
    assert!(
        report.unknown.iter().any(|l| l.contains("bad0 port 1: rate: invalid value \"fast\"")),
        "{:?}",
        report.unknown
    );
}

#[test]
fn no_class_directory_is_not_present() {
    let s = Synth::new();
    let (_, report) = discover(&s.sysfs());
    assert!(matches!(report.state, BackendState::NotPresent(_)), "{:?}", report.state);
}
