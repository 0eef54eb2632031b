//! PCI discovery on real sysfs dumps (hwloc's test trees): function and host bridge counts
//! checked against the trees themselves, hierarchy and NUMA locality of functions checked by
//! hand in the dumps, and attributes the dumps lack reported as unknown.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod fixtures;

use std::fs;
use std::path::Path;

use fabric_drivers::Backend;
use fabric_drivers::pci::PciBackend;
use fabric_topology::{
    BackendReport, BackendState, CpuSet, DeviceId, DeviceIdx, DeviceKind, Fabric, Inventory, LinkKind, MemoryKind,
    PciAddress,
};

fn discover(x: &fixtures::Extracted) -> (Fabric, BackendReport) {
    let mut inv = Inventory::new();
    let report = PciBackend::new(x.sysfs()).discover(&mut inv);
    inv.backends.push(report.clone());
    inv.validate().unwrap();
    (Fabric::build(inv).unwrap(), report)
}

fn addr(s: &str) -> PciAddress {
    s.parse().unwrap()
}

fn func(f: &Fabric, a: &str) -> DeviceIdx {
    f.inventory().find(&DeviceId::pci("fx", addr(a))).unwrap_or_else(|| panic!("{a} not found"))
}

fn named(f: &Fabric, name: &str) -> DeviceIdx {
    f.inventory().find(&DeviceId::named("fx", name)).unwrap_or_else(|| panic!("{name} not found"))
}

fn id_of(f: &Fabric, i: Option<DeviceIdx>) -> Option<String> {
    i.map(|i| f.device(i).id.to_string())
}

fn parent_id(f: &Fabric, a: &str) -> Option<String> {
    id_of(f, f.parent(func(f, a)))
}

fn cpu_id(f: &Fabric, a: &str) -> Option<String> {
    id_of(f, f.cpu_of(func(f, a)))
}

fn functions(f: &Fabric) -> usize {
    f.inventory().devices.iter().filter(|d| d.pci.is_some()).count()
}

fn links(f: &Fabric, pred: impl Fn(&LinkKind) -> bool) -> usize {
    f.inventory().links.iter().filter(|l| pred(&l.kind)).count()
}

/// Entries of `sys/bus/pci/devices`, counted independently of the backend.
fn bus_entries(root: &Path) -> usize {
    fs::read_dir(root.join("sys/bus/pci/devices")).unwrap().count()
}

/// `pciDDDD:BB` directories at the top of `sys/devices`.
fn host_bridge_dirs(root: &Path) -> usize {
    fs::read_dir(root.join("sys/devices"))
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name().into_string().unwrap();
            n.starts_with("pci") && n.contains(':')
        })
        .count()
}

fn has_line(r: &BackendReport, needle: &str) -> bool {
    r.unknown.iter().any(|l| l.contains(needle))
}

#[test]
fn every_dump_gives_every_function_and_host_bridge_and_invents_no_link_speed() {
    let archives = fixtures::archives();
    assert_eq!(archives.len(), 3, "the fixture set this test was written against");
    for a in archives {
        let x = fixtures::extract_path(&a);
        let (f, report) = discover(&x);
        assert_eq!(report.state, BackendState::Present, "{}", x.archive);
        assert_eq!(functions(&f), bus_entries(&x.root), "{}", x.archive);
        assert_eq!(f.inventory().count(DeviceKind::HostBridge), host_bridge_dirs(&x.root), "{}", x.archive);
        assert_eq!(report.devices, f.len(), "{}", x.archive);
        // Every function hangs off a bridge or host bridge, over a PCIe link.
        for (i, d) in f.inventory().devices.iter().enumerate() {
            if d.pci.is_some() {
                let pl = f
                    .parent_link(DeviceIdx(i as u32))
                    .unwrap_or_else(|| panic!("{}: {} has no parent", x.archive, d.id));
                assert!(matches!(f.link(pl).kind, LinkKind::Pcie { .. }));
                assert_eq!(d.sources, vec!["pci".to_owned()]);
            }
        }
        // None of these dumps has link speed attributes: bandwidth stays unknown, and the
        // report says so in one line per attribute.
        let n = functions(&f);
        for l in &f.inventory().links {
            assert_eq!(l.bandwidth.current_mbps, None, "{}", x.archive);
            assert_eq!(l.bandwidth.max_mbps, None, "{}", x.archive);
        }
        for d in &f.inventory().devices {
            if let Some(p) = &d.pci {
                assert_eq!(
                    (p.link_speed_gts, p.link_width, p.max_link_speed_gts, p.max_link_width),
                    (None, None, None, None)
                );
            }
        }
        for attr in ["current_link_speed", "current_link_width", "max_link_speed", "max_link_width"] {
            let line = format!("{attr}: missing on {n} of {n} PCI functions");
            assert_eq!(report.unknown.iter().filter(|l| **l == line).count(), 1, "{}: {line}", x.archive);
        }
        // Real, healthy machines: the failure probes (AER counters, config space, link
        // status) find nothing failed.
        let failed: Vec<&str> = f
            .inventory()
            .devices
            .iter()
            .filter(|d| d.attrs.contains_key(fabric_topology::FAILED_ATTR))
            .map(|d| d.id.as_str())
            .collect();
        assert!(failed.is_empty(), "{}: {failed:?}", x.archive);
        // Same tree, same inventory, same order.
        let (again, _) = discover(&x);
        assert_eq!(
            serde_json::to_string(f.inventory()).unwrap(),
            serde_json::to_string(again.inventory()).unwrap(),
            "{}",
            x.archive
        );
    }
}

#[test]
fn dump_32em64t_two_nodes_four_root_complexes_137_functions() {
    let Some(x) = fixtures::extract("32em64t") else { return };
    assert_eq!(x.root.file_name().unwrap(), "32em64t-2n8c+1mic", "directory name inside the archive");
    let (f, report) = discover(&x);
    let inv = f.inventory();
    assert_eq!(bus_entries(&x.root), 137);
    assert_eq!(functions(&f), 137);
    assert_eq!(inv.count(DeviceKind::HostBridge), 4);
    assert_eq!(inv.count(DeviceKind::Cpu), 2);
    assert_eq!(inv.count(DeviceKind::PciBridge), 9, "8 of class 0x0604 00 and one subtractive 0x0604 01");
    assert_eq!(inv.count(DeviceKind::Nic), 3, "two igb, one mlx4");
    assert_eq!(inv.count(DeviceKind::Storage), 2, "NVMe and AHCI");
    assert_eq!(inv.count(DeviceKind::Accelerator), 1, "the Xeon Phi");
    assert_eq!(inv.count(DeviceKind::Gpu), 0, "the ASPEED VGA is not a GPU");
    assert_eq!(inv.devices.len(), 2 + 4 + 137);

    // NUMA nodes: cpulist and MemTotal from the dump.
    let n0 = f.device(named(&f, "numa0"));
    let n1 = f.device(named(&f, "numa1"));
    assert_eq!(n0.local_cpus.as_ref().unwrap().to_string(), "0-7");
    assert_eq!(n1.local_cpus.as_ref().unwrap().to_string(), "8-15");
    assert_eq!(n0.memory[0].kind, MemoryKind::Dram);
    assert_eq!(n0.memory[0].size, 16_747_124 * 1024);
    assert_eq!(n1.memory[0].size, 16_777_216 * 1024);
    assert_eq!(n1.memory[0].numa_node, Some(1));
    assert_eq!(n0.attrs.get("numa.distance").map(String::as_str), Some("10 21"));
    assert_eq!(links(&f, |k| *k == LinkKind::Smp), 1);
    assert_eq!(links(&f, |k| matches!(k, LinkKind::Pcie { .. })), 137);

    // Hierarchy, as the dump's device paths nest.
    assert_eq!(parent_id(&f, "0000:05:00.0").as_deref(), Some("pci:fx/0000:04:00.0"));
    assert_eq!(parent_id(&f, "0000:04:00.0").as_deref(), Some("pci:fx/0000:00:1c.0"));
    assert_eq!(parent_id(&f, "0000:00:1c.0").as_deref(), Some("name:fx/pci0000:00"));
    assert_eq!(parent_id(&f, "0000:02:00.3").as_deref(), Some("pci:fx/0000:00:01.1"));
    assert_eq!(parent_id(&f, "0000:83:00.0").as_deref(), Some("pci:fx/0000:80:03.0"));
    assert_eq!(parent_id(&f, "0000:82:00.0").as_deref(), Some("pci:fx/0000:80:02.2"));
    assert_eq!(parent_id(&f, "0000:7f:08.0").as_deref(), Some("name:fx/pci0000:7f"));
    assert_eq!(id_of(&f, f.parent(named(&f, "pci0000:00"))).as_deref(), Some("name:fx/numa0"));
    assert_eq!(id_of(&f, f.parent(named(&f, "pci0000:80"))).as_deref(), Some("name:fx/numa1"));

    // NUMA locality: the Xeon Phi and the ConnectX on node 1, the VGA on node 0.
    assert_eq!(cpu_id(&f, "0000:83:00.0").as_deref(), Some("name:fx/numa1"));
    assert_eq!(cpu_id(&f, "0000:82:00.0").as_deref(), Some("name:fx/numa1"));
    assert_eq!(cpu_id(&f, "0000:05:00.0").as_deref(), Some("name:fx/numa0"));
    let phi = f.device(func(&f, "0000:83:00.0"));
    assert_eq!(phi.kind, DeviceKind::Accelerator);
    assert_eq!(phi.numa_node, Some(1));
    assert_eq!(phi.local_cpus.as_ref().unwrap().to_string(), "8-15");
    let p = phi.pci.as_ref().unwrap();
    assert_eq!((p.vendor_id, p.device_id, p.class), (Some(0x8086), Some(0x225c), Some(0x0b4000)));
    assert_eq!(p.driver.as_deref(), Some("mic"));
    assert_eq!(p.iommu_group, None, "no iommu_group links in this dump");
    assert_eq!(p.bars.len(), 2, "resource lines 0 and 4 are assigned");
    assert_eq!((p.bars[0].index, p.bars[0].start, p.bars[0].size), (0, 0x3bc_0000_0000, 0x2_0000_0000));
    assert_eq!((p.bars[1].index, p.bars[1].start, p.bars[1].size), (4, 0xec00_0000, 0x2_0000));
    let mlx = f.device(func(&f, "0000:82:00.0"));
    assert_eq!(mlx.kind, DeviceKind::Nic);
    assert!(mlx.pci.as_ref().unwrap().vendor_name.as_deref().unwrap().contains("Mellanox"));
    assert_eq!(mlx.pci.as_ref().unwrap().driver.as_deref(), Some("mlx4_core"));
    // The NVMe says numa_node -1 but lists CPUs 0-3: no node is invented.
    let nvme = f.device(func(&f, "0000:00:02.0"));
    assert_eq!(nvme.kind, DeviceKind::Storage);
    assert_eq!(nvme.numa_node, None);
    assert_eq!(nvme.local_cpus.as_ref().unwrap().to_string(), "0-3");

    // The uncore root complexes report no NUMA node for any function: not attached.
    for hb in ["pci0000:7f", "pci0000:ff"] {
        assert_eq!(f.parent(named(&f, hb)), None, "{hb}");
        assert_eq!(f.device(named(&f, hb)).numa_node, None);
        assert!(has_line(&report, &format!("{hb}: NUMA node unknown")), "{hb}: {:?}", report.unknown);
    }
    assert_eq!(links(&f, |k| *k == LinkKind::HostAttach), 2);
    assert_eq!(cpu_id(&f, "0000:7f:08.0"), None);
    assert!(has_line(&report, "iommu_group: missing on 137 of 137 PCI functions"));
}

#[test]
fn dump_40intel64_four_nodes_with_conflicting_locality() {
    let Some(x) = fixtures::extract("40intel64") else { return };
    let (f, report) = discover(&x);
    let inv = f.inventory();
    assert_eq!(functions(&f), 3);
    assert_eq!(inv.count(DeviceKind::HostBridge), 1);
    assert_eq!(inv.count(DeviceKind::Cpu), 4);
    assert_eq!(links(&f, |k| *k == LinkKind::Smp), 6, "every pair of 4 nodes");
    for (n, first) in [(0u32, 0u32), (1, 1), (2, 2), (3, 3)] {
        let d = f.device(named(&f, &format!("numa{n}")));
        let want = CpuSet::from_ranges((0..10).map(|i| (first + 4 * i, first + 4 * i)).collect());
        assert_eq!(d.local_cpus.as_ref(), Some(&want), "numa{n} cpus interleave");
        assert_eq!(d.numa_node, Some(n));
        assert_eq!(d.attrs.get("numa.distance").map(|s| s.split(' ').count()), Some(4));
    }
    assert_eq!(f.device(named(&f, "numa0")).memory[0].size, 134_204_252 * 1024);
    // Functions say numa_node -1 and local CPUs 0-39 (all nodes): no node is picked.
    assert_eq!(parent_id(&f, "0000:01:00.0").as_deref(), Some("pci:fx/0000:00:03.0"));
    assert_eq!(parent_id(&f, "0000:00:03.0").as_deref(), Some("name:fx/pci0000:00"));
    for a in ["0000:00:00.0", "0000:00:03.0", "0000:01:00.0"] {
        let d = f.device(func(&f, a));
        assert_eq!(d.numa_node, None, "{a}");
        assert_eq!(d.local_cpus.as_ref().unwrap().to_string(), "0-39", "{a}");
        assert_eq!(cpu_id(&f, a), None, "{a}");
    }
    assert_eq!(f.device(func(&f, "0000:01:00.0")).kind, DeviceKind::Storage);
    assert_eq!(f.parent(named(&f, "pci0000:00")), None);
    assert!(has_line(&report, "pci0000:00: NUMA node unknown"));
}

#[test]
fn dump_2pa_wide_pci_domain() {
    let Some(x) = fixtures::extract("2pa-pcidomain32bits") else { return };
    let (f, _report) = discover(&x);
    let inv = f.inventory();
    assert_eq!(functions(&f), 9);
    assert_eq!(inv.count(DeviceKind::HostBridge), 2);
    let wide = func(&f, "10000:00:04.0");
    let d = f.device(wide);
    assert_eq!(d.id.as_str(), "pci:fx/10000:00:04.0");
    assert_eq!(d.pci_address().unwrap().domain, 0x10000);
    assert_eq!(d.kind, DeviceKind::Storage, "virtio block, class 0x010000");
    let p = d.pci.as_ref().unwrap();
    assert_eq!(p.driver.as_deref(), Some("virtio-pci"));
    assert_eq!(p.bars.len(), 2);
    assert_eq!((p.bars[0].start, p.bars[0].size), (0xc000, 0x40));
    assert_eq!((p.bars[1].start, p.bars[1].size), (0xfebd_2000, 0x1000));
    assert_eq!(parent_id(&f, "10000:00:04.0").as_deref(), Some("name:fx/pci10000:00"));
    assert_eq!(parent_id(&f, "10000:00:00.0").as_deref(), Some("name:fx/pci10000:00"));
    assert_eq!(parent_id(&f, "0000:00:03.0").as_deref(), Some("name:fx/pci0000:00"));
    // One NUMA node and every numa_node -1: both host bridges go to the only CPU.
    assert_eq!(inv.count(DeviceKind::Cpu), 1);
    assert_eq!(d.numa_node, None);
    assert_eq!(cpu_id(&f, "10000:00:04.0").as_deref(), Some("name:fx/numa0"));
    assert_eq!(cpu_id(&f, "0000:00:03.0").as_deref(), Some("name:fx/numa0"));
    assert_eq!(f.device(named(&f, "numa0")).memory[0].size, 2_052_540 * 1024);
}
