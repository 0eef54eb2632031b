//! Heterogeneous memory from sysfs: what each NUMA node's memory is (origin, memory tier,
//! HMAT access classes, memory-side caches), the DAX devices of every origin, and the
//! firmware's bandwidth and latency on the CPU → memory-node links.
//!
//! Two steps, so that no new backend report is needed: [`enrich_nodes`] runs inside the
//! PCI backend right after the NUMA nodes are added (it needs only the node tree, the
//! tiers and the DAX bus); [`resolve_cxl`] runs at the end of the CXL backend, which alone
//! knows the regions a DAX device or a node's memory blocks belong to.
//!
//! Sources (kernel `Documentation/ABI/testing/sysfs-devices-system-node`,
//! `sysfs-kernel-mm-memory-tiers`, `sysfs-bus-dax`, `admin-guide/mm/numaperf.rst`):
//! `nodeN/accessC/initiators/{read,write}_{bandwidth,latency}` (MB/s, ns) and its `nodeM`
//! links; `nodeN/memory_side_cache/indexK/{size,line_size,indexing,write_policy}`;
//! `nodeN/memoryX` with `memory/block_size_bytes`; `memory_tiering/memory_tierN/nodelist`;
//! `bus/dax/devices/daxX.Y/{size,resource,target_node,driver}`.

pub mod parse;
pub mod read;

use std::collections::BTreeMap;

use fabric_topology::{
    BackendReport, Bandwidth, DaxMode, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind, MemoryOrigin,
    NumaMemoryInfo,
};

use crate::SysfsRoot;
use crate::pci::numa::Cpus;

/// Reads the node-level facts, the tiers and the DAX devices into `inv` (after the NUMA
/// devices exist) and puts the HMAT figures on the CPU → memory-node links.
pub fn enrich_nodes(root: &SysfsRoot, inv: &mut Inventory, cpus: &Cpus, report: &mut BackendReport) {
    let mut notes = Vec::new();
    let tiers = read::read_tiers(root, &mut notes);
    let dax = read::read_dax(root, &mut notes);
    let tier_of: BTreeMap<u32, u32> = tiers.iter().flat_map(|t| t.nodes.iter().map(move |&n| (n, t.id))).collect();
    let nodes_dir = root.path("sys/devices/system/node");
    let all: Vec<(u32, DeviceIdx)> =
        cpus.by_node.iter().chain(cpus.memory_nodes.iter()).map(|(&n, &i)| (n, i)).collect();
    for &(n, idx) in &all {
        let dir = nodes_dir.join(format!("node{n}"));
        let access = read::read_access(&dir, &mut notes);
        let caches = read::read_caches(&dir, &mut notes);
        let tier = tier_of.get(&n).copied();
        let dev = inv.device_mut(idx);
        let memory_only = dev.kind == DeviceKind::MemoryNode;
        if !memory_only && access.is_empty() && caches.is_empty() && tier.is_none() {
            // A CPU node the firmware says nothing about keeps its plain DRAM entry.
            continue;
        }
        let origin = if memory_only { node_origin(n, &dax, &mut notes) } else { MemoryOrigin::System };
        dev.numa_memory = Some(NumaMemoryInfo { memory_only, origin, tier, access, caches });
    }
    for t in &tiers {
        for n in t.nodes.iter().filter(|n| !all.iter().any(|(m, _)| m == *n)) {
            notes.push(format!("memory_tier{}: node {n} is not among the NUMA nodes sysfs shows", t.id));
        }
    }
    for d in &dax {
        let shown = d.target_node.is_some_and(|n| all.iter().any(|(m, _)| *m == n));
        if d.mode == DaxMode::SystemRam && !shown {
            // kmem onlined it, yet the node is not in the tree (a stripped dump): the
            // memory is real, its node is what is missing.
            notes.push(format!(
                "{}: onlined as system memory of node {}, which sysfs does not show",
                d.name,
                d.target_node.map_or_else(|| "(unknown)".to_owned(), |n| n.to_string())
            ));
        }
    }
    hmat_links(inv, cpus, &mut notes);
    inv.hmem.dax.extend(dax);
    inv.hmem.tiers.extend(tiers);
    for n in notes {
        report.note_unknown(n);
    }
}

/// A memory-only node's origin from the DAX devices onlined (kmem) into it.
fn node_origin(node: u32, dax: &[fabric_topology::DaxDevice], notes: &mut Vec<String>) -> MemoryOrigin {
    let mut origins: Vec<&MemoryOrigin> =
        dax.iter().filter(|d| d.mode == DaxMode::SystemRam && d.target_node == Some(node)).map(|d| &d.origin).collect();
    origins.sort();
    origins.dedup();
    match origins.as_slice() {
        [] => MemoryOrigin::Unknown,
        [one] => (*one).clone(),
        many => {
            let names: Vec<&str> = many.iter().map(|o| o.name()).collect();
            notes.push(format!("node{node}: memory of several origins ({}), shown as unknown", names.join(", ")));
            MemoryOrigin::Unknown
        }
    }
}

/// Puts each memory-only node's HMAT figures (access class 1, CPU initiators, else class 0)
/// on the SMP links from its initiators' CPU devices.
fn hmat_links(inv: &mut Inventory, cpus: &Cpus, notes: &mut Vec<String>) {
    for (&n, &mem) in &cpus.memory_nodes {
        let Some(info) = inv.device(mem).numa_memory.as_ref() else { continue };
        let Some(class) = info.access.iter().find(|a| a.class == 1).or_else(|| info.access.first()).cloned() else {
            continue;
        };
        let bandwidth = class.bandwidth_mbps().map_or_else(Bandwidth::default, Bandwidth::full);
        let latency = class.latency_ns().map(|l| u32::try_from(l).unwrap_or(u32::MAX));
        for m in &class.initiators {
            let Some(&cpu) = cpus.by_node.get(m) else {
                notes.push(format!("node{n}: HMAT initiator node {m} is not a CPU node here"));
                continue;
            };
            let same = |l: &Link| l.kind == LinkKind::Smp && ((l.a == cpu && l.b == mem) || (l.a == mem && l.b == cpu));
            match inv.links.iter_mut().find(|l| same(l)) {
                Some(l) => {
                    l.bandwidth = bandwidth;
                    l.latency_ns = latency;
                }
                None => inv.add_link(Link::new(cpu, mem, LinkKind::Smp, bandwidth, latency)),
            }
        }
    }
}

/// A CXL region as this step needs it: kernel name, stable key, host physical `[start, end)`.
type RegionSpan = (String, String, Option<(u64, u64)>);

/// After the CXL backend built its regions: names the region of every CXL DAX device, and
/// finds the region of each memory-only node whose origin is still unknown from its
/// memory blocks (all inside one region's host physical range).
pub fn resolve_cxl(root: &SysfsRoot, inv: &mut Inventory, report: &mut BackendReport) {
    let regions: Vec<RegionSpan> = inv
        .cxl
        .regions
        .iter()
        .filter_map(|r| {
            let key = r.uuid.clone().or_else(|| r.resource.map(|s| format!("hpa:{s:#x}")))?;
            let range = r.resource.zip(r.size).and_then(|(s, z)| Some((s, s.checked_add(z)?)));
            Some((r.kernel_name.clone(), key, range))
        })
        .collect();
    let key_of = |kernel: &str| regions.iter().find(|(k, _, _)| k == kernel).map(|(_, key, _)| key.clone());
    for d in &mut inv.hmem.dax {
        if let MemoryOrigin::CxlRegion { region, kernel_name: Some(k) } = &mut d.origin {
            *region = key_of(k);
        }
    }
    let mut notes = Vec::new();
    let nodes_dir = root.path("sys/devices/system/node");
    for i in 0..inv.devices.len() {
        let idx = DeviceIdx(i as u32);
        let dev = inv.device(idx);
        let Some(n) = dev.numa_node.filter(|_| dev.kind == DeviceKind::MemoryNode) else { continue };
        if dev.id != DeviceId::named(root.node(), &format!("numa{n}")) {
            continue;
        }
        let origin = match dev.numa_memory.as_ref().map(|m| &m.origin) {
            Some(MemoryOrigin::CxlRegion { kernel_name: Some(k), .. }) => {
                Some(MemoryOrigin::CxlRegion { region: key_of(k), kernel_name: Some(k.clone()) })
            }
            Some(MemoryOrigin::Unknown) | None => {
                read::read_block_ranges(root, &nodes_dir.join(format!("node{n}")), &mut notes).and_then(|blocks| {
                    let inside = |(s, e): (u64, u64)| {
                        regions.iter().find(|(_, _, r)| r.is_some_and(|(rs, re)| rs <= s && e <= re))
                    };
                    let first = inside(*blocks.first()?)?;
                    blocks.iter().all(|&b| inside(b).is_some_and(|r| r.1 == first.1)).then(|| MemoryOrigin::CxlRegion {
                        region: Some(first.1.clone()),
                        kernel_name: Some(first.0.clone()),
                    })
                })
            }
            Some(_) => None,
        };
        if let (Some(o), Some(info)) = (origin, inv.device_mut(idx).numa_memory.as_mut()) {
            info.origin = o;
        }
    }
    for n in notes {
        report.note_unknown(n);
    }
}
