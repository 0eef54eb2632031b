//! The CXL inventory does not depend on the kernel's enumeration numbers: renumbering ports,
//! endpoints, memdevs, decoders and regions (as a different boot would) yields the same
//! devices, links, decoders and regions, apart from the display-only kernel names.

mod cxl_fixture;

use cxl_fixture::{Names, qemu_cxl};
use fabric_drivers::Backend;
use fabric_drivers::cxl::CxlBackend;
use fabric_drivers::sysfs::SysfsRoot;
use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, Link, PciAddress, PciInfo};
use serde_json::Value;

/// The inventory as JSON with the kernel's display names removed.
fn stable_view(names: &Names, seed_pci: bool) -> Value {
    let t = qemu_cxl(names);
    let mut inv = Inventory::new();
    if seed_pci {
        seed(&mut inv);
    }
    let report = CxlBackend::new(SysfsRoot::new(t.root(), "n0")).discover(&mut inv);
    assert!(report.unknown.is_empty(), "{:#?}", report.unknown);
    assert_eq!(inv.cxl.regions.len(), 2);
    let mut v = serde_json::to_value(&inv).expect("inventory serialises");
    strip(&mut v);
    v
}

fn strip(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("kernel_name");
            if m.contains_key("numa_node") && m.contains_key("size") && m.len() == 3 {
                m.remove("name"); // a CxlDax: `daxR.M` follows the region number.
            }
            m.values_mut().for_each(strip);
        }
        Value::Array(a) => a.iter_mut().for_each(strip),
        _ => {}
    }
}

/// A few PCI backend devices and PCIe links, so that reuse and link conversion are covered.
fn seed(inv: &mut Inventory) {
    let hb = inv.add_device(Device::new(DeviceId::named("n0", "pci0000:0c"), DeviceKind::HostBridge, Some("n0")));
    let mut add = |addr: &str| {
        let a: PciAddress = addr.parse().expect("address");
        let mut d = Device::new(DeviceId::pci("n0", a), DeviceKind::PciBridge, Some("n0"));
        d.pci = Some(PciInfo { address: Some(a), ..PciInfo::default() });
        inv.add_device(d).expect("add")
    };
    let rp = add("0000:0c:00.0");
    let usp = add("0000:0d:00.0");
    let dsp = add("0000:0e:02.0");
    let ep = add("0000:11:00.0");
    let hb = hb.expect("add");
    for (a, b) in [(hb, rp), (rp, usp), (usp, dsp), (dsp, ep)] {
        inv.add_link(Link::pcie(a, b, (Some(5), Some(8)), (Some(5), Some(16))));
    }
}

#[test]
fn renumbering_ports_endpoints_decoders_and_regions_changes_nothing() {
    let renumbered = Names { hb: 2, sw: 1, ep: [9, 4, 3, 6, 10], mem: [2, 1, 0, 4, 3], region: [7, 3] };
    for seed_pci in [false, true] {
        let a = stable_view(&Names::default(), seed_pci);
        let b = stable_view(&renumbered, seed_pci);
        assert_eq!(a, b, "seed_pci={seed_pci}");
        // The comparison is not vacuous: it covers every decoder, region and link.
        assert_eq!(a["cxl"]["decoders"].as_array().map(Vec::len), Some(29));
        assert!(a["links"].as_array().is_some_and(|l| l.len() >= 6));
    }
}

#[test]
fn kernel_names_are_still_shown_for_display() {
    let renumbered = Names { hb: 2, sw: 1, ep: [9, 4, 3, 6, 10], mem: [2, 1, 0, 4, 3], region: [7, 3] };
    let t = qemu_cxl(&renumbered);
    let mut inv = Inventory::new();
    CxlBackend::new(SysfsRoot::new(t.root(), "n0")).discover(&mut inv);
    let m = inv.device(inv.find(&DeviceId::serial("cxl", "0x1")).expect("mem sn 1"));
    assert_eq!(m.cxl.as_ref().and_then(|c| c.kernel_name.as_deref()), Some("mem2"));
    assert_eq!(inv.cxl.regions[0].kernel_name, "region7");
    assert_eq!(inv.cxl.regions[0].dax[0].name, "dax7.0");
    assert!(inv.cxl.decoders.iter().any(|d| d.kernel_name == "decoder9.0"));
}
