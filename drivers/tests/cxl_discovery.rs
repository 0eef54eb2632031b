//! CXL discovery on the QEMU / Linux 6.12 fixture tree: memdevs, ports, decoders, regions,
//! DAX, dynamic capacity, reuse of PCI backend devices, and hostile input.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

mod cxl_fixture;

use cxl_fixture::{MEM, Names, PMEM_UUID, WINDOW, qemu_cxl};
use fabric_drivers::Backend;
use fabric_drivers::cxl::CxlBackend;
use fabric_drivers::sysfs::SysfsRoot;
use fabric_topology::cxl::{CxlDecoder, CxlDecoderLevel, CxlMode};
use fabric_topology::{
    BackendState, Bandwidth, Device, DeviceId, DeviceKind, Inventory, Link, LinkKind, MemoryKind, PciAddress, PciInfo,
};

const NODE: &str = "n0";

fn discover(root: &std::path::Path, inv: &mut Inventory) -> fabric_topology::BackendReport {
    CxlBackend::new(SysfsRoot::new(root, NODE)).discover(inv)
}

fn serial(s: u64) -> DeviceId {
    DeviceId::serial("cxl", &format!("{s:#x}"))
}

fn pci(s: &str) -> DeviceId {
    DeviceId::pci(NODE, s.parse().unwrap())
}

fn hb() -> DeviceId {
    DeviceId::named(NODE, "pci0000:0c")
}

fn decoder<'a>(inv: &'a Inventory, owner: &DeviceId, level: CxlDecoderLevel, start: u64) -> &'a CxlDecoder {
    inv.cxl
        .decoders
        .iter()
        .find(|d| d.owner.as_ref() == Some(owner) && d.level == level && d.start == Some(start) && d.size != Some(0))
        .unwrap_or_else(|| panic!("no {level:?} decoder of {owner} at {start:#x}"))
}

fn has_cxl_link(inv: &Inventory, a: &DeviceId, b: &DeviceId) -> bool {
    let (a, b) = (inv.find(a).unwrap(), inv.find(b).unwrap());
    inv.links.iter().any(|l| l.a == a && l.b == b && matches!(l.kind, LinkKind::Cxl { .. }))
}

#[test]
fn no_cxl_bus_is_not_present() {
    let dir = tempfile::tempdir().unwrap();
    let mut inv = Inventory::new();
    let r = discover(dir.path(), &mut inv);
    assert_eq!(
        r.state,
        BackendState::NotPresent("no /sys/bus/cxl: kernel without CXL support or no CXL devices".into())
    );
    assert!(inv.devices.is_empty());
}

#[test]
fn memdevs_are_keyed_by_serial_with_sizes_and_firmware() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    let r = discover(t.root(), &mut inv);
    assert_eq!(r.state, BackendState::Present);
    assert!(r.unknown.is_empty(), "{:#?}", r.unknown);
    assert_eq!(inv.count(DeviceKind::CxlMemdev), 5);
    for (s, addr, ram, pmem) in [
        (1, "0000:0f:00.0", MEM, 0),
        (2, "0000:10:00.0", MEM, 0),
        (3, "0000:11:00.0", MEM, 0),
        (4, "0000:12:00.0", 0, MEM),
        (5, "0000:13:00.0", 0, 0),
    ] {
        let d = inv.device(inv.find(&serial(s)).unwrap());
        let c = d.cxl.as_ref().unwrap();
        assert_eq!(c.serial, Some(s));
        assert_eq!(c.pci_address, Some(addr.parse().unwrap()));
        assert_eq!(d.pci_address(), Some(addr.parse().unwrap()));
        assert_eq!((c.ram_size, c.pmem_size), (Some(ram), Some(pmem)));
        assert_eq!(c.firmware_version.as_deref(), Some("BWFW VERSION 00"));
        assert_eq!(d.numa_node, Some(0));
        let vol: u64 = d.memory.iter().filter(|m| m.kind == MemoryKind::CxlVolatile).map(|m| m.size).sum();
        let per: u64 = d.memory.iter().filter(|m| m.kind == MemoryKind::CxlPersistent).map(|m| m.size).sum();
        assert_eq!((vol, per), (ram, pmem));
        assert_eq!(d.sources, vec!["cxl".to_owned()]);
    }
    // mem0/mem1 capacity is onlined to node 1 through region0's dax0.0; mem2's is not in a region.
    let m0 = inv.device(inv.find(&serial(1)).unwrap());
    assert_eq!(m0.memory[0].numa_node, Some(1));
    assert_eq!(inv.device(inv.find(&serial(3)).unwrap()).memory[0].numa_node, None);
}

#[test]
fn dynamic_capacity_is_reported_as_the_kernel_shows_it() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    discover(t.root(), &mut inv);
    let d = inv.device(inv.find(&serial(5)).unwrap());
    assert_eq!(d.cxl.as_ref().unwrap().dc_regions, Some(2));
    let dc: Vec<u64> = d.memory.iter().filter(|m| m.kind == MemoryKind::CxlDynamic).map(|m| m.size).collect();
    assert_eq!(dc, vec![MEM, MEM]);
    // A memdev without DC attributes says nothing about DC.
    assert_eq!(inv.device(inv.find(&serial(1)).unwrap()).cxl.as_ref().unwrap().dc_regions, None);

    // The 2025 layout (`dynamic_ram_a/size`) is read too.
    let mem4 = t.p("sys/devices/pci0000:0c/0000:0c:01.0/0000:13:00.0/mem4");
    t.remove("sys/devices/pci0000:0c/0000:0c:01.0/0000:13:00.0/mem4/dc0");
    t.remove("sys/devices/pci0000:0c/0000:0c:01.0/0000:13:00.0/mem4/dc1");
    std::fs::create_dir(mem4.join("dynamic_ram_a")).unwrap();
    std::fs::write(mem4.join("dynamic_ram_a/size"), "0x20000000\n").unwrap();
    let mut inv = Inventory::new();
    discover(t.root(), &mut inv);
    let d = inv.device(inv.find(&serial(5)).unwrap());
    assert_eq!(d.cxl.as_ref().unwrap().dc_regions, Some(1));
    assert_eq!(d.memory.iter().find(|m| m.kind == MemoryKind::CxlDynamic).map(|m| m.size), Some(0x2000_0000));
}

#[test]
fn host_bridge_switch_and_links_follow_the_port_hierarchy() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    discover(t.root(), &mut inv);
    let hbi = inv.find(&hb()).expect("host bridge added");
    assert_eq!(inv.device(hbi).kind, DeviceKind::HostBridge);
    let sw = inv.find(&pci("0000:0d:00.0")).expect("switch keyed by its upstream port");
    assert_eq!(inv.device(sw).kind, DeviceKind::CxlSwitch);
    assert_eq!(inv.device(sw).attrs.get("cxl_decoders_committed").map(String::as_str), Some("2"));
    assert_eq!(inv.count(DeviceKind::CxlSwitch), 1);
    assert_eq!(inv.count(DeviceKind::HostBridge), 1);
    // Without the PCI backend's ports, links go host bridge -> switch -> memdev (and the DCD,
    // on a root port, hangs off the host bridge).
    assert!(has_cxl_link(&inv, &hb(), &pci("0000:0d:00.0")));
    for s in 1..=4 {
        assert!(has_cxl_link(&inv, &pci("0000:0d:00.0"), &serial(s)), "switch -> mem sn {s}");
    }
    assert!(has_cxl_link(&inv, &hb(), &serial(5)));
    assert_eq!(inv.links.len(), 6);
    inv.validate().unwrap();
}

#[test]
fn decoders_carry_ways_granularity_and_stable_targets() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    discover(t.root(), &mut inv);
    let root_id = DeviceId::named(NODE, "ACPI0017:00");
    let w = decoder(&inv, &root_id, CxlDecoderLevel::Root, WINDOW.0);
    assert_eq!((w.size, w.ways, w.granularity), (Some(WINDOW.1), Some(1), Some(4096)));
    assert_eq!(w.targets, vec![hb().to_string()]);
    assert_eq!(w.capabilities, vec!["ram", "pmem", "accelmem", "expander"]);
    assert_eq!(w.qos_class, Some(0));
    assert_eq!(w.locked, Some(false));

    let h = decoder(&inv, &hb(), CxlDecoderLevel::Switch, WINDOW.0);
    assert_eq!((h.ways, h.granularity), (Some(1), Some(256)));
    assert_eq!(h.targets, vec![pci("0000:0c:00.0").to_string()]);

    let s = decoder(&inv, &pci("0000:0d:00.0"), CxlDecoderLevel::Switch, WINDOW.0);
    assert_eq!((s.size, s.ways, s.granularity), (Some(2 * MEM), Some(2), Some(256)));
    assert_eq!(s.targets, vec![pci("0000:0e:00.0").to_string(), pci("0000:0e:01.0").to_string()]);
    let s1 = decoder(&inv, &pci("0000:0d:00.0"), CxlDecoderLevel::Switch, WINDOW.0 + 2 * MEM);
    assert_eq!(s1.targets, vec![pci("0000:0e:03.0").to_string()]);

    let e = decoder(&inv, &serial(2), CxlDecoderLevel::Endpoint, WINDOW.0);
    assert_eq!(e.mode, Some(CxlMode::Ram));
    assert_eq!((e.dpa_start, e.dpa_size), (Some(0), Some(MEM)));
    assert_eq!((e.ways, e.granularity), (Some(2), Some(256)));
    assert!(e.targets.is_empty());
    assert_eq!(e.region.as_deref(), Some("hpa:0x290000000"));
    let p = decoder(&inv, &serial(4), CxlDecoderLevel::Endpoint, WINDOW.0 + 2 * MEM);
    assert_eq!((p.mode, p.region.as_deref()), (Some(CxlMode::Pmem), Some(PMEM_UUID)));

    // Unallocated endpoint decoders: mode none, no DPA (the kernel prints RESOURCE_SIZE_MAX).
    let idle = inv.cxl.decoders.iter().find(|d| d.owner == Some(serial(5)) && d.kernel_name == "decoder7.0").unwrap();
    assert_eq!((idle.mode, idle.dpa_start, idle.dpa_size), (Some(CxlMode::None), None, Some(0)));
    // 1 root + 4 host bridge + 4 switch + 5 x 4 endpoint decoders.
    assert_eq!(inv.cxl.decoders.len(), 29);
    for d in &inv.cxl.decoders {
        assert!(d.owner.is_some(), "{d:?}");
        assert!(d.targets.iter().all(|t| !t.contains("port") && !t.starts_with("unresolved")), "{d:?}");
    }
}

#[test]
fn regions_have_resource_size_targets_and_dax() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    discover(t.root(), &mut inv);
    assert_eq!(inv.cxl.regions.len(), 2);
    let r = &inv.cxl.regions[0];
    assert_eq!((r.kernel_name.as_str(), r.mode, r.uuid.as_deref()), ("region0", Some(CxlMode::Ram), None));
    assert_eq!((r.resource, r.size), (Some(WINDOW.0), Some(2 * MEM)));
    assert_eq!((r.ways, r.granularity, r.committed), (Some(2), Some(256), Some(true)));
    assert_eq!(r.targets, vec![serial(1), serial(2)]);
    assert_eq!(r.root_decoder.as_deref(), Some("hpa:0x290000000"));
    assert_eq!(r.dax.len(), 1);
    assert_eq!((r.dax[0].name.as_str(), r.dax[0].size, r.dax[0].numa_node), ("dax0.0", Some(2 * MEM), Some(1)));

    let p = &inv.cxl.regions[1];
    assert_eq!((p.mode, p.uuid.as_deref()), (Some(CxlMode::Pmem), Some(PMEM_UUID)));
    assert_eq!((p.resource, p.size, p.ways, p.granularity), (Some(WINDOW.0 + 2 * MEM), Some(MEM), Some(1), Some(4096)));
    assert_eq!(p.targets, vec![serial(4)]);
    assert!(p.dax.is_empty());
}

/// Seeds what the PCI backend adds for the same machine: host bridge, ports, functions and
/// PCIe links (gen 5 x8 from QEMU's defaults are not needed; x16 gen 4 here).
fn seed_pci(inv: &mut Inventory) {
    let hb_idx = inv.add_device(Device::new(hb(), DeviceKind::HostBridge, Some(NODE))).unwrap();
    let mut add = |addr: &str, kind| {
        let a: PciAddress = addr.parse().unwrap();
        let mut d = Device::new(DeviceId::pci(NODE, a), kind, Some(NODE));
        d.pci = Some(PciInfo { address: Some(a), ..PciInfo::default() });
        d.sources.push("pci".into());
        inv.add_device(d).unwrap()
    };
    let rp0 = add("0000:0c:00.0", DeviceKind::PciBridge);
    let rp1 = add("0000:0c:01.0", DeviceKind::PciBridge);
    let usp = add("0000:0d:00.0", DeviceKind::PciBridge);
    let dsp: Vec<_> = (0..4).map(|i| add(&format!("0000:0e:0{i}.0"), DeviceKind::PciBridge)).collect();
    let eps: Vec<_> =
        ["0f", "10", "11", "12", "13"].iter().map(|b| add(&format!("0000:{b}:00.0"), DeviceKind::Other)).collect();
    let pcie = |a, b| Link::pcie(a, b, (Some(4), Some(16)), (Some(4), Some(16)));
    let mut links = vec![pcie(hb_idx, rp0), pcie(hb_idx, rp1), pcie(rp0, usp), pcie(rp1, eps[4])];
    for i in 0..4 {
        links.push(pcie(usp, dsp[i]));
        links.push(pcie(dsp[i], eps[i]));
    }
    for l in links {
        inv.add_link(l);
    }
}

#[test]
fn pci_backend_devices_are_reused_renamed_and_their_links_become_cxl() {
    let t = qemu_cxl(&Names::default());
    let mut inv = Inventory::new();
    seed_pci(&mut inv);
    let before = (inv.devices.len(), inv.links.len());
    let mem_idx = inv.find(&pci("0000:10:00.0")).unwrap();
    let r = discover(t.root(), &mut inv);
    assert!(r.unknown.is_empty(), "{:#?}", r.unknown);
    assert_eq!((inv.devices.len(), inv.links.len()), before, "nothing duplicated");
    // The memdev's PCI function is now keyed by its serial, at the same index.
    assert_eq!(inv.find(&serial(2)), Some(mem_idx));
    assert_eq!(inv.find(&pci("0000:10:00.0")), None);
    let d = inv.device(mem_idx);
    assert_eq!(d.kind, DeviceKind::CxlMemdev);
    assert_eq!(d.sources, vec!["pci".to_owned(), "cxl".to_owned()]);
    assert_eq!(inv.device(inv.find(&pci("0000:0d:00.0")).unwrap()).kind, DeviceKind::CxlSwitch);
    // Every link along the CXL hierarchy is now CXL, with the PCIe width and bandwidth kept.
    for (a, b) in [
        (hb(), pci("0000:0c:00.0")),
        (hb(), pci("0000:0c:01.0")),
        (pci("0000:0c:00.0"), pci("0000:0d:00.0")),
        (pci("0000:0d:00.0"), pci("0000:0e:01.0")),
        (pci("0000:0e:01.0"), serial(2)),
        (pci("0000:0c:01.0"), serial(5)),
    ] {
        assert!(has_cxl_link(&inv, &a, &b), "{a} -> {b}");
    }
    assert!(inv.links.iter().all(|l| l.kind == LinkKind::Cxl { width: Some(16) }));
    assert_eq!(inv.links[0].bandwidth, Bandwidth::full(31_507));
    assert_eq!(r.devices, 1 + 1 + 5);
}

#[test]
fn hostile_values_become_unknown_with_notes() {
    let t = qemu_cxl(&Names::default());
    let mem0 = "sys/devices/pci0000:0c/0000:0c:00.0/0000:0d:00.0/0000:0e:00.0/0000:0f:00.0/mem0";
    t.file(&format!("{mem0}/serial"), "0xzz");
    t.remove(&format!("{mem0}/ram/size"));
    t.file(&format!("{mem0}/firmware_version"), "bad\u{7}fw");
    let sw = "sys/devices/platform/ACPI0017:00/root0/port1/port2";
    t.file(&format!("{sw}/decoder2.0/interleave_ways"), "7");
    t.file(&format!("{sw}/decoder2.0/target_list"), "0,banana");
    t.file(&format!("{sw}/decoder2.1/target_list"), "9");
    t.file("sys/devices/platform/ACPI0017:00/root0/decoder0.0/region0/size", &"f".repeat(100_000));
    let mut inv = Inventory::new();
    let r = discover(t.root(), &mut inv);
    assert_eq!(r.state, BackendState::Present);
    let has = |s: &str| r.unknown.iter().any(|l| l.contains(s));
    // mem0: unusable serial -> keyed by its PCI function; missing ram/size -> None.
    let d = inv.device(inv.find(&pci("0000:0f:00.0")).expect("fallback identity"));
    let c = d.cxl.as_ref().unwrap();
    assert_eq!((c.serial, c.ram_size, c.firmware_version.as_deref()), (None, None, None));
    assert!(d.memory.is_empty());
    assert!(has("mem0/serial: invalid") && has("mem0/ram/size: missing") && has("serial unknown; keyed by PCI"));
    assert!(has("mem0/firmware_version: invalid"));
    let s = decoder(&inv, &pci("0000:0d:00.0"), CxlDecoderLevel::Switch, WINDOW.0);
    assert_eq!((s.ways, s.targets.len()), (None, 0));
    assert!(has("decoder2.0/interleave_ways: invalid") && has("decoder2.0/target_list: invalid"));
    let s1 = decoder(&inv, &pci("0000:0d:00.0"), CxlDecoderLevel::Switch, WINDOW.0 + 2 * MEM);
    assert_eq!(s1.targets, vec!["unresolved:dport9".to_owned()]);
    assert_eq!(inv.cxl.regions[0].size, None);
    // The region still resolves its members, mem0 by its fallback identity.
    assert_eq!(inv.cxl.regions[0].targets, vec![pci("0000:0f:00.0"), serial(2)]);
}

#[test]
fn duplicate_and_zero_serials_fall_back_to_pci_identity() {
    let t = qemu_cxl(&Names::default());
    let base = "sys/devices/pci0000:0c/0000:0c:00.0/0000:0d:00.0";
    t.file(&format!("{base}/0000:0e:01.0/0000:10:00.0/mem1/serial"), "0x3");
    t.file(&format!("{base}/0000:0e:03.0/0000:12:00.0/mem3/serial"), "0x0");
    let mut inv = Inventory::new();
    let r = discover(t.root(), &mut inv);
    assert_eq!(inv.count(DeviceKind::CxlMemdev), 5, "two memdevs with one serial are not merged");
    for a in ["0000:10:00.0", "0000:11:00.0", "0000:12:00.0"] {
        assert!(inv.find(&pci(a)).is_some(), "{a}");
    }
    assert_eq!(inv.find(&serial(3)), None);
    assert!(r.unknown.iter().any(|l| l.contains("serial shared")));
    assert!(r.unknown.iter().any(|l| l.contains("serial is 0")));
}

#[test]
fn symlinks_that_leave_the_root_are_not_followed() {
    let t = qemu_cxl(&Names::default());
    let outside = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(outside.path().join("mem9")).unwrap();
    std::fs::write(outside.path().join("mem9/serial"), "0x99\n").unwrap();
    std::os::unix::fs::symlink(outside.path().join("mem9"), t.p("sys/bus/cxl/devices/mem9")).unwrap();
    std::os::unix::fs::symlink("../../../../../../../..", t.p("sys/bus/cxl/devices/mem8")).unwrap();
    // The switch's uport pointing out of the tree: the port is dropped, not followed.
    let sw = "sys/devices/platform/ACPI0017:00/root0/port1/port2";
    std::fs::remove_file(t.p(&format!("{sw}/uport"))).unwrap();
    std::os::unix::fs::symlink(outside.path(), t.p(&format!("{sw}/uport"))).unwrap();
    let mut inv = Inventory::new();
    let r = discover(t.root(), &mut inv);
    assert_eq!(inv.find(&serial(0x99)), None);
    assert_eq!(inv.count(DeviceKind::CxlMemdev), 5);
    assert_eq!(inv.count(DeviceKind::CxlSwitch), 0);
    assert!(r.unknown.iter().any(|l| l.contains("mem9: link leaves the sysfs root")));
    assert!(r.unknown.iter().any(|l| l.contains("mem8: link leaves the sysfs root")));
    assert!(r.unknown.iter().any(|l| l.contains("port2/uport")));
    // Memdevs below the dropped switch attach to the host bridge's dport... which is not a
    // device here, so to nothing: no link invents a path through the unknown switch.
    assert!(!has_cxl_link(&inv, &hb(), &serial(1)));
    inv.validate().unwrap();
}

#[test]
fn acpi_companion_dports_resolve_through_physical_node() {
    // Kernels that register the ACPI0016 device as the root's dport: its `physical_node`
    // names the PCI host bridge.
    let t = qemu_cxl(&Names::default());
    let acpi = "sys/devices/LNXSYSTM:00/LNXSYBUS:00/ACPI0016:00";
    t.file(&format!("{acpi}/path"), "\\_SB_.PC0C");
    t.link(&format!("{acpi}/physical_node"), "sys/devices/pci0000:0c");
    t.link("sys/devices/platform/ACPI0017:00/root0/dport12", acpi);
    let mut inv = Inventory::new();
    let r = discover(t.root(), &mut inv);
    assert!(r.unknown.is_empty(), "{:#?}", r.unknown);
    let w = decoder(&inv, &DeviceId::named(NODE, "ACPI0017:00"), CxlDecoderLevel::Root, WINDOW.0);
    assert_eq!(w.targets, vec![hb().to_string()]);
}
