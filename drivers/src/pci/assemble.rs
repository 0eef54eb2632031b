//! Turns scanned functions into inventory devices and links: host bridges attached to their
//! CPU, functions under their bridges, PCIe links carrying the downstream end's speed.

use std::collections::{BTreeMap, HashMap};

use fabric_topology::link::pcie_gen_from_gts;
use fabric_topology::{
    Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, FAILED_ATTR, Inventory, Link, LinkKind, PciAddress, PciInfo,
};

use super::numa::Cpus;
use super::tree::{PathNode, host_bridge_name};
use super::{Function, Notes, add, kind, names};

/// What we learn about a host bridge from the functions below it.
#[derive(Debug, Default)]
struct HostBridge {
    /// The function it sits under (a VMD endpoint), when nested.
    parent: Option<PciAddress>,
    /// First known NUMA node of its functions.
    numa: Option<u32>,
}

fn host_bridges(top: &[(u32, u8)], functions: &[Function]) -> BTreeMap<(u32, u8), HostBridge> {
    let mut hbs: BTreeMap<(u32, u8), HostBridge> = top.iter().map(|&k| (k, HostBridge::default())).collect();
    for f in functions {
        for (i, n) in f.path.ancestors.iter().enumerate() {
            let PathNode::HostBridge(d, b) = *n else { continue };
            let above = f.path.ancestors[..i].iter().rev().find_map(|n| match *n {
                PathNode::Function(a) => Some(a),
                PathNode::HostBridge(..) => None,
            });
            let hb = hbs.entry((d, b)).or_default();
            hb.parent = hb.parent.or(above);
        }
        if let Some(k) = f.path.host_bridge() {
            let hb = hbs.entry(k).or_default();
            hb.numa = hb.numa.or(f.attrs.numa_node.flatten());
        }
    }
    hbs
}

fn function_device(node: &str, f: &Function) -> Device {
    let a = &f.attrs;
    let mut dev = Device::new(DeviceId::pci(node, f.path.address), kind::classify(a.vendor, a.class), Some(node));
    let vendor_name = a.vendor.and_then(names::vendor_name);
    let device_name = a.vendor.zip(a.device).and_then(|(v, d)| names::device_name(v, d));
    let class_name = a.class.and_then(names::class_name);
    dev.name = device_name.clone().or_else(|| class_name.clone());
    if let Some(c) = class_name {
        dev.attrs.insert("pci.class_name".to_owned(), c);
    }
    dev.attrs.insert("pci.sysfs_path".to_owned(), f.rel.clone());
    if let Some(ib) = a.rdma_devices.first() {
        dev.attrs.insert("ib_device".to_owned(), ib.clone());
    }
    if !a.netdevs.is_empty() {
        dev.attrs.insert("netdev".to_owned(), a.netdevs.join(","));
    }
    dev.numa_node = a.numa_node.flatten();
    dev.dma_mask_bits = a.dma_mask_bits;
    dev.local_cpus = a.local_cpus.clone();
    dev.pci = Some(PciInfo {
        address: Some(f.path.address),
        class: a.class,
        vendor_id: a.vendor,
        device_id: a.device,
        subsystem_vendor_id: a.subsystem_vendor,
        subsystem_device_id: a.subsystem_device,
        vendor_name,
        device_name,
        link_speed_gts: a.link_speed_gts,
        link_width: a.link_width,
        max_link_speed_gts: a.max_link_speed_gts,
        max_link_width: a.max_link_width,
        bars: a.bars.clone(),
        iommu_group: a.iommu_group,
        driver: a.driver.clone(),
    });
    dev
}

/// A PCIe generation from a speed, noting speeds that match no generation.
fn generation(speed: Option<f64>, addr: PciAddress, notes: &mut Notes) -> Option<u8> {
    let s = speed?;
    let g = pcie_gen_from_gts(s);
    if g.is_none() {
        notes.push(format!("{addr}: link speed {s} GT/s is not a PCIe generation"));
    }
    g
}

/// Adds host bridges, functions and links; returns how many devices were new.
pub(crate) fn assemble(
    inv: &mut Inventory,
    node: &str,
    cpus: &Cpus,
    top: &[(u32, u8)],
    functions: &[Function],
    notes: &mut Notes,
) -> usize {
    let mut added = 0;
    let hbs = host_bridges(top, functions);
    let mut hb_idx: HashMap<(u32, u8), DeviceIdx> = HashMap::new();
    for (&(d, b), hb) in &hbs {
        let name = host_bridge_name(d, b);
        let mut dev = Device::new(DeviceId::named(node, &name), DeviceKind::HostBridge, Some(node));
        dev.name = Some(name.clone());
        dev.numa_node = hb.numa;
        if let Some(p) = hb.parent {
            dev.attrs.insert("pci.parent_function".to_owned(), p.to_string());
        }
        if let Some(i) = add(inv, dev, &mut added) {
            hb_idx.insert((d, b), i);
        }
    }
    let mut fn_idx: HashMap<PciAddress, DeviceIdx> = HashMap::new();
    for f in functions {
        if let Some(i) = add(inv, function_device(node, f), &mut added) {
            // Also on a device another backend added first (a CXL memdev's function).
            if let Some(why) = &f.attrs.failure {
                inv.device_mut(i).attrs.insert(FAILED_ATTR.to_owned(), why.clone());
            }
            fn_idx.insert(f.path.address, i);
        }
    }

    for (&(d, b), hb) in &hbs {
        let Some(&idx) = hb_idx.get(&(d, b)) else { continue };
        let name = host_bridge_name(d, b);
        // A host bridge nested under a function (a VMD domain) hangs off that function; the
        // hop is internal to the device, so its bandwidth is unknown.
        if let Some(&up) = hb.parent.and_then(|p| fn_idx.get(&p)) {
            inv.add_link(Link::pcie(up, idx, (None, None), (None, None)));
            continue;
        }
        match cpus.for_node(hb.numa) {
            Some(cpu) => inv.add_link(Link::new(cpu, idx, LinkKind::HostAttach, Bandwidth::default(), None)),
            None => notes.push(format!("{name}: NUMA node unknown, not attached to a CPU")),
        }
    }

    for f in functions {
        let Some(&child) = fn_idx.get(&f.path.address) else { continue };
        let up = f.path.ancestors.iter().rev().find_map(|n| match *n {
            PathNode::Function(a) => fn_idx.get(&a).copied(),
            PathNode::HostBridge(d, b) => hb_idx.get(&(d, b)).copied(),
        });
        let Some(up) = up else {
            // A function found as a plain directory has already been reported as shown
            // without its place in the hierarchy.
            if !f.path.ancestors.is_empty() || f.rel.starts_with("sys/devices/") {
                notes.push(format!("{}: no host bridge or bridge above it", f.path.address));
            }
            continue;
        };
        // The downstream device's link attributes describe its upstream link.
        let a = &f.attrs;
        let addr = f.path.address;
        let cur = (generation(a.link_speed_gts, addr, notes), a.link_width);
        let max = (generation(a.max_link_speed_gts, addr, notes), a.max_link_width);
        inv.add_link(Link::pcie(up, child, cur, max));
    }
    added
}
