//! Cross-check against hwloc on the live host: the PCI functions we discover under `/` must
//! be exactly the PCI devices and bridges `lstopo --whole-io` reports, with the same
//! vendor/device ids and the same parent bridge.
//!
//! Skips (with a message) when `lstopo-no-graphics` is not installed; installs it with apt
//! only when running as root with `FABRIC_INSTALL_DEPS=1`.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::collections::BTreeMap;
use std::process::Command;

use fabric_drivers::pci::PciBackend;
use fabric_drivers::{Backend, SysfsRoot};
use fabric_topology::{DeviceKind, Fabric, Inventory, PciAddress};
use quick_xml::Reader;
use quick_xml::events::{BytesStart, Event};

/// What hwloc says about one PCI function.
#[derive(Debug, PartialEq, Eq)]
struct HwlocPci {
    /// `[vendor:device]` from `pci_type`.
    ids: Option<(u16, u16)>,
    /// The nearest enclosing bridge with a bus id; `None` under a host bridge.
    parent: Option<PciAddress>,
}

fn have_lstopo() -> bool {
    Command::new("lstopo-no-graphics").arg("--version").output().is_ok_and(|o| o.status.success())
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn ensure_lstopo() -> bool {
    if have_lstopo() {
        return true;
    }
    if std::env::var("FABRIC_INSTALL_DEPS").as_deref() == Ok("1") && is_root() {
        let ok = Command::new("apt-get").args(["install", "-y", "hwloc"]).status().is_ok_and(|s| s.success());
        if ok && have_lstopo() {
            return true;
        }
    }
    false
}

fn attr(e: &BytesStart<'_>, name: &str) -> Option<String> {
    e.attributes().flatten().find(|a| a.key.as_ref() == name).map(|a| a.value.into_owned())
}

/// `pci_type="0200 [8086:1521] [8086:0001] 01"` -> (0x8086, 0x1521).
fn parse_ids(pci_type: &str) -> Option<(u16, u16)> {
    let inner = pci_type.split_whitespace().nth(1)?.strip_prefix('[')?.strip_suffix(']')?;
    let (v, d) = inner.split_once(':')?;
    Some((u16::from_str_radix(v, 16).ok()?, u16::from_str_radix(d, 16).ok()?))
}

/// PCIDev and Bridge objects with a `pci_busid`, from hwloc's XML.
fn parse_hwloc(xml: &str) -> BTreeMap<PciAddress, HwlocPci> {
    let mut out = BTreeMap::new();
    // One entry per open <object>: Some(busid) for a PCI bridge, None for anything else.
    let mut stack: Vec<Option<PciAddress>> = Vec::new();
    let mut reader = Reader::from_str(xml);
    loop {
        let ev = reader.read_event().unwrap();
        let (e, empty) = match &ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(e) if e.name().as_ref() == "object" => {
                stack.pop();
                continue;
            }
            Event::Eof => break,
            _ => continue,
        };
        if e.name().as_ref() != "object" {
            continue;
        }
        let ty = attr(e, "type").unwrap_or_default();
        let busid: Option<PciAddress> = attr(e, "pci_busid").map(|b| b.parse().unwrap());
        if let (Some(a), "PCIDev" | "Bridge") = (busid, ty.as_str()) {
            let parent = stack.iter().rev().flatten().next().copied();
            let ids = attr(e, "pci_type").as_deref().and_then(parse_ids);
            assert!(out.insert(a, HwlocPci { ids, parent }).is_none(), "{a} twice in hwloc's XML");
        }
        if !empty {
            stack.push(if ty == "Bridge" { busid } else { None });
        }
    }
    out
}

#[test]
fn hwloc_xml_scanner_reads_nesting() {
    let xml = r#"<topology><object type="Machine">
      <object type="Bridge" bridge_type="0-1" depth="0" bridge_pci="0000:[00-02]">
        <object type="PCIDev" pci_busid="0000:00:00.0" pci_type="0600 [8086:0d57] [0000:0000] 00"/>
        <object type="Bridge" pci_busid="0000:00:01.0" pci_type="0604 [8086:347a] [0000:0000] 00" bridge_type="1-1">
          <object type="PCIDev" pci_busid="0000:01:00.0" pci_type="0302 [10de:2330] [10de:16c1] a1">
            <object type="OSDev" name="card0"/>
          </object>
        </object>
        <object type="PCIDev" pci_busid="0000:00:02.0" pci_type="0100 [1af4:1042] [1af4:1042] 01"/>
      </object></object></topology>"#;
    let m = parse_hwloc(xml);
    let a = |s: &str| s.parse::<PciAddress>().unwrap();
    assert_eq!(m.len(), 4);
    assert_eq!(m[&a("0000:01:00.0")], HwlocPci { ids: Some((0x10de, 0x2330)), parent: Some(a("0000:00:01.0")) });
    assert_eq!(m[&a("0000:00:02.0")].parent, None);
    assert_eq!(m[&a("0000:00:01.0")].parent, None);
}

#[test]
fn live_host_pci_functions_match_hwloc() {
    if !std::path::Path::new("/sys/bus/pci/devices").is_dir() {
        eprintln!("skipping: no /sys/bus/pci/devices on this host");
        return;
    }
    if !ensure_lstopo() {
        eprintln!("skipping: lstopo-no-graphics not found (install hwloc, or run as root with FABRIC_INSTALL_DEPS=1)");
        return;
    }
    let out = Command::new("lstopo-no-graphics").args(["--whole-io", "--of", "xml"]).output().unwrap();
    assert!(out.status.success(), "lstopo failed: {}", String::from_utf8_lossy(&out.stderr));
    let hwloc = parse_hwloc(&String::from_utf8(out.stdout).unwrap());

    let mut inv = Inventory::new();
    let report = PciBackend::new(SysfsRoot::with_hostname("/")).discover(&mut inv);
    eprintln!("pci report: {report:?}");
    let f = Fabric::build(inv).unwrap();
    let mut ours: BTreeMap<PciAddress, HwlocPci> = BTreeMap::new();
    for (i, d) in f.inventory().devices.iter().enumerate() {
        let Some(a) = d.pci_address() else { continue };
        let p = d.pci.as_ref().unwrap();
        let parent = f.parent(fabric_topology::DeviceIdx(i as u32)).map(|pi| f.device(pi));
        let parent = parent.filter(|pd| pd.kind != DeviceKind::HostBridge).and_then(|pd| pd.pci_address());
        ours.insert(a, HwlocPci { ids: p.vendor_id.zip(p.device_id), parent });
    }
    let hw_ids: Vec<&PciAddress> = hwloc.keys().collect();
    let our_ids: Vec<&PciAddress> = ours.keys().collect();
    assert_eq!(our_ids, hw_ids, "PCI bus ids: ours vs hwloc's");
    assert!(!ours.is_empty() || hwloc.is_empty());
    for (a, h) in &hwloc {
        assert_eq!(&ours[a], h, "{a}: ours vs hwloc's");
    }
    eprintln!("{} PCI functions agree with hwloc", ours.len());
}
