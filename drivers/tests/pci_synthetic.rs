//! PCI discovery on small synthetic sysfs trees: a PCIe switch with link speeds, a degraded
//! GPU link, an NVSwitch recognised from PCI alone, VMD-style nesting, the no-NUMA
//! fallback, functions that report a failure (fatal AER errors, config reads of all ones),
//! and hostile contents (garbage, huge files, FIFOs, dangling links, loops, links
//! leaving the root).
#![allow(clippy::unwrap_used)]

mod fixtures;

use std::os::unix::fs::symlink;
use std::process::Command;

use fabric_drivers::Backend;
use fabric_drivers::pci::PciBackend;
use fabric_topology::link::pcie_mbps;
use fabric_topology::{
    BackendReport, BackendState, DeviceId, DeviceIdx, DeviceKind, Fabric, Inventory, LinkKind, LinkState, PciAddress,
};
use fixtures::{Synth, ids};

fn discover(s: &Synth) -> (Fabric, BackendReport) {
    let mut inv = Inventory::new();
    let report = PciBackend::new(s.sysfs()).discover(&mut inv);
    inv.validate().unwrap();
    (Fabric::build(inv).unwrap(), report)
}

fn func(f: &Fabric, a: &str) -> DeviceIdx {
    let a: PciAddress = a.parse().unwrap();
    f.inventory().find(&DeviceId::pci("syn", a)).unwrap_or_else(|| panic!("{a} not found"))
}

fn named(f: &Fabric, n: &str) -> DeviceIdx {
    f.inventory().find(&DeviceId::named("syn", n)).unwrap_or_else(|| panic!("{n} not found"))
}

fn id_of(f: &Fabric, i: Option<DeviceIdx>) -> Option<String> {
    i.map(|i| f.device(i).id.to_string())
}

fn with<'a>(mut base: Vec<(&'a str, &'a str)>, more: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    base.extend_from_slice(more);
    base
}

fn link(
    speed: &'static str,
    width: &'static str,
    max_speed: &'static str,
    max_width: &'static str,
) -> [(&'static str, &'static str); 4] {
    [
        ("current_link_speed", speed),
        ("current_link_width", width),
        ("max_link_speed", max_speed),
        ("max_link_width", max_width),
    ]
}

const GEN4: &str = "16.0 GT/s PCIe";
const RP: &str = "pci0000:00/0000:00:01.0";
const USP: &str = "pci0000:00/0000:00:01.0/0000:01:00.0";
const DSP0: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0";
const DSP1: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0";
const GPU: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0";
const NVSW: &str = "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0";
const NIC: &str = "pci0000:80/0000:80:01.0/0000:81:00.0";

/// Two NUMA nodes; a root port, a PCIe switch with a degraded H100 below one downstream
/// port and an NVSwitch below the other; a ConnectX on node 1 whose speed is `Unknown`.
fn gpu_box() -> Synth {
    let s = Synth::new();
    s.numa(0, "0-15", 1 << 20);
    s.numa(1, "16-31", 1 << 20);
    s.write("sys/devices/system/node/node0/distance", "10 21\n");
    s.function("pci0000:00/0000:00:00.0", &ids("0x8086", "0x09a2", "0x060000", "0"));
    s.function(RP, &with(ids("0x8086", "0x347a", "0x060400", "0"), &link(GEN4, "16", GEN4, "16")));
    s.function(USP, &with(ids("0x10b5", "0xc040", "0x060400", "0"), &link(GEN4, "16", GEN4, "16")));
    s.function(DSP0, &with(ids("0x10b5", "0xc040", "0x060400", "0"), &link(GEN4, "8", GEN4, "16")));
    s.function(DSP1, &with(ids("0x10b5", "0xc040", "0x060400", "0"), &link(GEN4, "16", GEN4, "16")));
    let gpu_attrs = [
        ("local_cpulist", "0-15"),
        (
            "resource",
            "0x00000000fa000000 0x00000000faffffff 0x0000000000040200\n\
             0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
             0x000020be00000000 0x000020ffffffffff 0x000000000014220c",
        ),
    ];
    s.function(
        GPU,
        &with(ids("0x10de", "0x2330", "0x030200", "0"), &[&link(GEN4, "8", GEN4, "16")[..], &gpu_attrs].concat()),
    );
    let gpu_dir = s.path().join("sys/devices").join(GPU);
    symlink("../../../../../../../bus/pci/drivers/nvidia", gpu_dir.join("driver")).unwrap();
    symlink("../../../../../../../kernel/iommu_groups/17", gpu_dir.join("iommu_group")).unwrap();
    s.function(NVSW, &with(ids("0x10de", "0x22a3", "0x068000", "0"), &link(GEN4, "2", GEN4, "2")));
    s.function(
        "pci0000:80/0000:80:01.0",
        &with(ids("0x8086", "0x347a", "0x060400", "1"), &link("8.0 GT/s", "16", "8.0 GT/s", "16")),
    );
    s.function(NIC, &with(ids("0x15b3", "0x101b", "0x020700", "1"), &link("Unknown", "16", "16.0 GT/s", "16")));
    // The kernel lists the function's RDMA device and interface as class subdirectories.
    s.write(&format!("sys/devices/{NIC}/infiniband/mlx5_0/ports/1/state"), "4: ACTIVE\n");
    s.write(&format!("sys/devices/{NIC}/net/ibp129s0/mtu"), "4092\n");
    s
}

#[test]
fn nics_carry_their_rdma_device_and_interface_names() {
    let (f, _) = discover(&gpu_box());
    let nic = f.device(func(&f, "0000:81:00.0"));
    assert_eq!(nic.kind, fabric_topology::DeviceKind::Nic);
    assert_eq!(nic.attrs.get("ib_device").map(String::as_str), Some("mlx5_0"));
    assert_eq!(nic.attrs.get("netdev").map(String::as_str), Some("ibp129s0"));
    let gpu = f.device(func(&f, "0000:03:00.0"));
    assert!(!gpu.attrs.contains_key("ib_device"), "no infiniband/ directory, no RDMA name");
}

#[test]
fn switch_degraded_gpu_and_nvswitch_from_pci_alone() {
    let s = gpu_box();
    let (f, report) = discover(&s);
    assert_eq!(report.state, BackendState::Present);
    let inv = f.inventory();
    assert_eq!(inv.count(DeviceKind::Cpu), 2);
    assert_eq!(inv.count(DeviceKind::HostBridge), 2);
    assert_eq!(inv.count(DeviceKind::Gpu), 1);
    assert_eq!(inv.count(DeviceKind::NvSwitch), 1);
    assert_eq!(inv.count(DeviceKind::Nic), 1);
    assert_eq!(inv.count(DeviceKind::PciBridge), 5);
    assert_eq!(report.devices, 2 + 2 + 9);

    let gpu = func(&f, "0000:03:00.0");
    let d = f.device(gpu);
    assert_eq!(d.kind, DeviceKind::Gpu);
    let p = d.pci.as_ref().unwrap();
    assert!(p.vendor_name.as_deref().unwrap().contains("NVIDIA"));
    assert_eq!(
        (p.link_speed_gts, p.link_width, p.max_link_speed_gts, p.max_link_width),
        (Some(16.0), Some(8), Some(16.0), Some(16))
    );
    assert_eq!(p.driver.as_deref(), Some("nvidia"));
    assert_eq!(p.iommu_group, Some(17));
    assert_eq!(p.bars.len(), 2);
    assert_eq!((p.bars[1].index, p.bars[1].size), (2, 0x42_0000_0000));
    assert_eq!(d.local_cpus.as_ref().unwrap().to_string(), "0-15");
    assert_eq!(f.device(func(&f, "0000:04:00.0")).kind, DeviceKind::NvSwitch);

    // Hierarchy: GPU -> DSP -> USP -> root port -> host bridge -> numa0.
    let chain: Vec<String> = f.ancestors(gpu).map(|i| f.device(i).id.to_string()).collect();
    assert_eq!(
        chain,
        [
            "pci:syn/0000:03:00.0",
            "pci:syn/0000:02:00.0",
            "pci:syn/0000:01:00.0",
            "pci:syn/0000:00:01.0",
            "name:syn/pci0000:00",
            "name:syn/numa0"
        ]
    );
    assert_eq!(id_of(&f, f.cpu_of(func(&f, "0000:81:00.0"))).as_deref(), Some("name:syn/numa1"));

    // The GPU's link trained at gen4 x8 of x16: degraded, half the bandwidth.
    let l = f.link(f.parent_link(gpu).unwrap());
    assert_eq!(
        l.kind,
        LinkKind::Pcie { gen_current: Some(4), width_current: Some(8), gen_max: Some(4), width_max: Some(16) }
    );
    assert_eq!(l.state, LinkState::Degraded);
    assert_eq!(l.bandwidth.current_mbps, pcie_mbps(4, 8));
    assert_eq!(l.bandwidth.max_mbps, pcie_mbps(4, 16));
    assert_eq!(l.bandwidth.current_mbps, Some(15_753));
    // The switch's upstream link runs at full speed.
    let l = f.link(f.parent_link(func(&f, "0000:01:00.0")).unwrap());
    assert_eq!(l.state, LinkState::Up);
    assert_eq!(l.bandwidth.current_mbps, Some(31_507));
    // The NVSwitch's x2 link.
    let l = f.link(f.parent_link(func(&f, "0000:04:00.0")).unwrap());
    assert_eq!(l.bandwidth.current_mbps, Some(3_938));
    // `Unknown` current speed: current bandwidth unknown, not degraded, max still known.
    let l = f.link(f.parent_link(func(&f, "0000:81:00.0")).unwrap());
    assert_eq!(l.bandwidth.current_mbps, None);
    assert_eq!(l.bandwidth.max_mbps, pcie_mbps(4, 16));
    assert_eq!(l.state, LinkState::Up);
    // The old-style "8.0 GT/s" without the PCIe suffix.
    let l = f.link(f.parent_link(func(&f, "0000:80:01.0")).unwrap());
    assert_eq!(l.bandwidth.current_mbps, pcie_mbps(3, 16));

    // Only the host bridge function lacks link attributes, and the report says so once.
    assert!(
        report.unknown.contains(&"current_link_speed: missing on 1 of 9 PCI functions".to_owned()),
        "{:?}",
        report.unknown
    );
    assert_eq!(report.unknown.iter().filter(|l| l.starts_with("current_link_speed")).count(), 1);
    assert_eq!(f.device(named(&f, "numa0")).attrs.get("numa.distance").map(String::as_str), Some("10 21"));
}

#[test]
fn discovery_is_deterministic_and_ordered() {
    let s = gpu_box();
    let (a, _) = discover(&s);
    let (b, _) = discover(&s);
    assert_eq!(serde_json::to_string(a.inventory()).unwrap(), serde_json::to_string(b.inventory()).unwrap());
    let ids: Vec<&str> = a.inventory().devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(&ids[..4], ["name:syn/numa0", "name:syn/numa1", "name:syn/pci0000:00", "name:syn/pci0000:80"]);
    let addrs: Vec<PciAddress> = a.inventory().devices.iter().filter_map(|d| d.pci_address()).collect();
    let mut sorted = addrs.clone();
    sorted.sort();
    assert_eq!(addrs, sorted);
}

#[test]
fn vmd_domain_nests_under_its_endpoint() {
    let s = Synth::new();
    s.numa(0, "0-7", 1024);
    s.numa(1, "8-15", 1024);
    let vmd = "pci0000:5d/0000:5d:05.5";
    s.function(vmd, &ids("0x8086", "0x201d", "0x010400", "1"));
    s.function(&format!("{vmd}/pci10000:00/10000:00:02.0"), &ids("0x8086", "0x2032", "0x060400", "-1"));
    s.function(&format!("{vmd}/pci10000:00/10000:00:02.0/10000:01:00.0"), &ids("0x144d", "0xa824", "0x010802", "-1"));
    let (f, _) = discover(&s);
    assert_eq!(f.inventory().count(DeviceKind::HostBridge), 2);
    let nvme = func(&f, "10000:01:00.0");
    let chain: Vec<String> = f.ancestors(nvme).map(|i| f.device(i).id.to_string()).collect();
    assert_eq!(
        chain,
        [
            "pci:syn/10000:01:00.0",
            "pci:syn/10000:00:02.0",
            "name:syn/pci10000:00",
            "pci:syn/0000:5d:05.5",
            "name:syn/pci0000:5d",
            "name:syn/numa1"
        ]
    );
    let hb = f.device(named(&f, "pci10000:00"));
    assert_eq!(hb.attrs.get("pci.parent_function").map(String::as_str), Some("0000:5d:05.5"));
}

#[test]
fn without_numa_nodes_one_package_cpu() {
    let s = Synth::new();
    s.write("sys/devices/system/cpu/online", "0-3\n");
    s.function("pci0000:00/0000:00:02.0", &ids("0x1af4", "0x1042", "0x010000", "-1"));
    let (f, _) = discover(&s);
    assert_eq!(f.inventory().count(DeviceKind::Cpu), 1);
    let pkg = f.device(named(&f, "package"));
    assert_eq!(pkg.local_cpus.as_ref().unwrap().to_string(), "0-3");
    assert_eq!(id_of(&f, f.cpu_of(func(&f, "0000:00:02.0"))).as_deref(), Some("name:syn/package"));
}

#[test]
fn no_pci_bus_is_not_present_but_cpus_remain() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("sys/devices/system/node/node0")).unwrap();
    std::fs::write(dir.path().join("sys/devices/system/node/node0/cpulist"), "0-1\n").unwrap();
    let mut inv = Inventory::new();
    let r = PciBackend::new(fabric_drivers::SysfsRoot::new(dir.path(), "n")).discover(&mut inv);
    assert!(matches!(r.state, BackendState::NotPresent(_)), "{:?}", r.state);
    assert_eq!(inv.count(DeviceKind::Cpu), 1);
    assert!(r.unknown.iter().any(|l| l.contains("meminfo")), "missing meminfo is reported: {:?}", r.unknown);
}

#[test]
fn hostile_trees_are_survived_and_reported() {
    let s = Synth::new();
    s.numa(0, "0-3", 1024);
    // A sane function to show discovery carries on.
    s.function("pci0000:00/0000:00:01.0", &ids("0x8086", "0x1234", "0x020000", "0"));
    // Binary garbage and huge files in attributes.
    let g = "pci0000:00/0000:00:02.0";
    s.function(g, &[]);
    s.write(&format!("sys/devices/{g}/vendor"), [0xff, 0xfe, 0x00, 0x10]);
    s.write(&format!("sys/devices/{g}/device"), "\u{1b}[31m0x1234\u{0}");
    s.write(&format!("sys/devices/{g}/class"), "9".repeat(4 << 20));
    s.write(&format!("sys/devices/{g}/resource"), "0x1 0x2 0x3\n".repeat(1 << 20));
    s.write(&format!("sys/devices/{g}/current_link_speed"), "\u{0}\u{0}GT/s");
    s.write(&format!("sys/devices/{g}/numa_node"), "99999999999999999999999");
    s.write(&format!("sys/devices/{g}/local_cpulist"), "0-4294967295");
    // An attribute that is a FIFO (would block a naive open) and one that loops.
    let fifo = s.path().join("sys/devices").join(g).join("subsystem_vendor");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    symlink("max_link_width", s.path().join("sys/devices").join(g).join("max_link_width")).unwrap();
    symlink("driver", s.path().join("sys/devices").join(g).join("driver")).unwrap();
    // Dangling link, self loop, a plain file among the links, and a link leaving the root.
    s.bus_link("0000:00:09.0", "../../../devices/pci0000:00/0000:00:09.0");
    s.bus_link("0000:00:0a.0", "0000:00:0a.0");
    s.write("sys/bus/pci/devices/0000:00:0c.0", "not a link");
    let outside = tempfile::tempdir().unwrap();
    let evil = outside.path().join("pci0000:00/0000:00:0b.0");
    std::fs::create_dir_all(&evil).unwrap();
    std::fs::write(evil.join("vendor"), "0x10de\n").unwrap();
    s.bus_link("0000:00:0b.0", &format!("{}{}", "../".repeat(40), evil.display().to_string().trim_start_matches('/')));
    // An absolute link is re-rooted, never followed into the live /sys.
    s.bus_link("0000:00:0d.0", "/sys/devices/pci0000:00/0000:00:00.0");

    let (f, report) = discover(&s);
    assert_eq!(report.state, BackendState::Present);
    let addrs: Vec<String> =
        f.inventory().devices.iter().filter_map(|d| d.pci_address()).map(|a| a.to_string()).collect();
    assert_eq!(addrs, ["0000:00:01.0", "0000:00:02.0"]);
    let d = f.device(func(&f, "0000:00:02.0"));
    let p = d.pci.as_ref().unwrap();
    assert_eq!((p.vendor_id, p.device_id, p.subsystem_vendor_id, p.class), (None, None, None, None));
    assert_eq!((p.link_speed_gts, p.max_link_width), (None, None));
    assert!(p.bars.is_empty());
    assert_eq!(p.driver, None);
    assert_eq!((d.numa_node, d.local_cpus.as_ref()), (None, None));
    assert_eq!(d.kind, DeviceKind::Other);
    assert_eq!(f.device(func(&f, "0000:00:01.0")).kind, DeviceKind::Nic);

    let has = |needle: &str| report.unknown.iter().any(|l| l.contains(needle));
    for needle in [
        "vendor: unreadable or invalid on 1",
        "device: unreadable or invalid on 1",
        "class: unreadable or invalid on 1",
        "resource: unreadable or invalid on 1",
        "numa_node: unreadable or invalid on 1",
        "local_cpulist: unreadable or invalid on 1",
        "subsystem_vendor: unreadable or invalid on 1",
        "max_link_width: unreadable or invalid on 1",
        "current_link_speed: unreadable or invalid on 1",
        "driver: unreadable or invalid on 1",
        "0000:00:09.0: cannot follow link",
        "0000:00:0a.0: cannot follow link",
        "0000:00:0b.0: link target leaves sys/devices",
        "0000:00:0c.0: link target leaves sys/devices",
        "0000:00:0d.0: cannot follow link",
    ] {
        assert!(has(needle), "{needle:?} not in {:#?}", report.unknown);
    }
}

#[test]
fn functions_with_fatal_aer_errors_or_dead_config_space_are_failed_with_the_reason() {
    let s = gpu_box();
    let fatal = "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 1\nMalfTLP 0\nTOTAL_ERR_FATAL 1\n";
    let quiet = "Undefined 0\nDLP 0\nSDES 0\nTLP 0\nFCP 0\nCmpltTO 0\nMalfTLP 0\nTOTAL_ERR_FATAL 0\n";
    s.write(&format!("sys/devices/{GPU}/aer_dev_fatal"), fatal);
    s.write(&format!("sys/devices/{DSP1}/aer_dev_fatal"), quiet);
    s.write(&format!("sys/devices/{NVSW}/config"), [0xffu8; 64]);
    s.write(&format!("sys/devices/{NIC}/config"), [0xb3, 0x15, 0x1b, 0x10]);
    // A runtime-suspended function is not woken to read its config space.
    s.write(&format!("sys/devices/{USP}/config"), [0xffu8; 64]);
    s.write(&format!("sys/devices/{USP}/power/runtime_status"), "suspended\n");
    let (f, _) = discover(&s);
    let failed = |a: &str| f.device(func(&f, a)).attrs.get(fabric_topology::FAILED_ATTR).cloned();
    let gpu = failed("0000:03:00.0").expect("fatal AER errors fail the GPU");
    assert!(gpu.contains("1 fatal") && gpu.contains("CmpltTO 1"), "{gpu}");
    let nvsw = failed("0000:04:00.0").expect("config reads of all ones fail the NVSwitch");
    assert!(nvsw.contains("config reads"), "{nvsw}");
    for healthy in ["0000:02:01.0", "0000:81:00.0", "0000:01:00.0", "0000:00:01.0"] {
        assert_eq!(failed(healthy), None, "{healthy}");
    }
}

/// An attribute that is a symlink is not followed (sysfs attributes never are links): a
/// dump's `vendor -> /some/host/file` read the host's file, and its first bytes went into
/// the report. Before, the outside `device` value below was taken as the function's.
#[test]
fn attributes_that_are_symlinks_are_not_followed_out_of_the_tree() {
    let s = Synth::new();
    s.numa(0, "0-3", 1024);
    let g = "pci0000:00/0000:00:02.0";
    s.function(g, &ids("0x8086", "0x1234", "0x020000", "0"));
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("secret"), "SECRET-host-file\n").unwrap();
    std::fs::write(outside.path().join("device"), "0x5678\n").unwrap();
    let dir = s.path().join("sys/devices").join(g);
    for (attr, target) in [("subsystem_vendor", "secret"), ("device", "device")] {
        let _ = std::fs::remove_file(dir.join(attr));
        symlink(outside.path().join(target), dir.join(attr)).unwrap();
    }
    let (f, report) = discover(&s);
    let p = f.device(func(&f, "0000:00:02.0")).pci.clone().unwrap();
    assert_eq!((p.vendor_id, p.device_id, p.subsystem_vendor_id), (Some(0x8086), None, None));
    assert!(!report.unknown.iter().any(|l| l.contains("SECRET")), "{:#?}", report.unknown);
    assert!(report.unknown.iter().any(|l| l.contains("device: unreadable or invalid on 1")), "{:#?}", report.unknown);
}
