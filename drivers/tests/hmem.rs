//! Heterogeneous memory and "dumps as they come": the real `32em64t-2n8c+dax+nvme+mic+dimms`
//! dump's DAX devices (checked against the dump's files and against lstopo where hwloc is
//! installed), and synthetic trees built from the kernel's ABI documents for what no dump
//! shows (a CXL memory-only node with HMAT, tiers and a memory-side cache; a soft-reserved
//! node; a GPU-memory node sysfs says nothing about; PCI functions held as plain
//! directories). Expected values come from the files written here and the ABI rules.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod fixtures;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::symlink;
use std::process::Command;

use fabric_drivers::pci::PciBackend;
use fabric_drivers::{Backend, discover_host};
use fabric_topology::{
    DaxMode, DeviceId, DeviceKind, Fabric, Inventory, LinkKind, MemoryKind, MemoryOrigin, NumaMemoryInfo,
};
use fixtures::{Synth, extract, ids};

fn numa<'a>(inv: &'a Inventory, node: &str, n: u32) -> &'a fabric_topology::Device {
    let i = inv.find(&DeviceId::named(node, &format!("numa{n}"))).unwrap_or_else(|| panic!("numa{n} missing"));
    inv.device(i)
}

/// A DAX device as compared: name, origin, mode, size, target node.
type DaxRow<'a> = (&'a str, &'a MemoryOrigin, &'a DaxMode, Option<u64>, Option<u32>);

#[test]
fn real_dump_dax_devices_are_nvdimm_with_their_target_nodes() {
    let x = extract("32em64t").unwrap();
    let inv = discover_host(&x.sysfs());
    // From the dump: sys/bus/dax/devices/dax*/{size,target_node}, the driver links, and the
    // device paths under ACPI0012:00/ndbus0 (an NVDIMM bus).
    let got: Vec<DaxRow<'_>> =
        inv.hmem.dax.iter().map(|d| (d.name.as_str(), &d.origin, &d.mode, d.size, d.target_node)).collect();
    assert_eq!(
        got,
        [
            ("dax0.0", &MemoryOrigin::Nvdimm, &DaxMode::Device, Some(107_808_292_864), Some(4)),
            ("dax1.3", &MemoryOrigin::Nvdimm, &DaxMode::Device, Some(63_415_779_328), Some(5)),
            ("dax1.4", &MemoryOrigin::Nvdimm, &DaxMode::SystemRam, Some(545_391_640_576), Some(5)),
        ]
    );
    // kmem onlined dax1.4 into node 5, which the dump does not hold: said, not dropped.
    let pci = inv.backends.iter().find(|r| r.backend == "pci").unwrap();
    assert!(pci.unknown.iter().any(|l| l.contains("dax1.4") && l.contains("node 5")), "{:?}", pci.unknown);
    // Both nodes have CPUs: no memory-only node, and the CPU nodes keep their DRAM.
    for n in [0, 1] {
        let d = numa(&inv, "fx", n);
        assert_eq!(d.kind, DeviceKind::Cpu);
        assert_eq!(d.memory[0].kind, MemoryKind::Dram);
        assert_eq!(d.numa_memory, None);
    }
}

/// lstopo on the same dump: hwloc lists DAX devices bound to device_dax (those onlined by
/// kmem are NUMA memory, not OS devices) with `DAXType` NVM for an NVDIMM parent and SPM for
/// soft-reserved memory, and `Size` in KiB; and the NUMA nodes with their memory.
#[test]
fn real_dump_dax_and_nodes_match_lstopo() {
    let have = Command::new("lstopo-no-graphics").arg("--version").output().is_ok_and(|o| o.status.success());
    if !have {
        eprintln!("skipping: lstopo-no-graphics not found (install hwloc: scripts/deps.sh)");
        return;
    }
    let x = extract("32em64t").unwrap();
    let out = Command::new("lstopo-no-graphics")
        .args(["--whole-io", "--of", "xml"])
        .env("HWLOC_FSROOT", &x.root)
        .env("HWLOC_COMPONENTS", "linux,-x86")
        .output()
        .unwrap();
    assert!(out.status.success(), "lstopo: {}", String::from_utf8_lossy(&out.stderr));
    let xml = String::from_utf8(out.stdout).unwrap();
    let hw = hwloc_objects(&xml);
    let inv = discover_host(&x.sysfs());
    let ours: BTreeMap<String, (String, u64)> = inv
        .hmem
        .dax
        .iter()
        .filter(|d| d.mode != DaxMode::SystemRam)
        .map(|d| {
            let t = match d.origin {
                MemoryOrigin::Nvdimm => "NVM",
                MemoryOrigin::SoftReserved => "SPM",
                _ => "?",
            };
            (d.name.clone(), (t.to_owned(), d.size.unwrap() / 1024))
        })
        .collect();
    assert_eq!(ours, hw.dax, "DAX devices: ours vs lstopo's");
    let nodes: BTreeMap<u32, u64> = inv
        .devices
        .iter()
        .filter(|d| matches!(d.kind, DeviceKind::Cpu | DeviceKind::MemoryNode))
        .map(|d| (d.numa_node.unwrap(), d.memory_bytes()))
        .collect();
    assert_eq!(nodes, hw.numa, "NUMA nodes and their memory: ours vs lstopo's");
}

#[derive(Debug, Default)]
struct Hwloc {
    dax: BTreeMap<String, (String, u64)>,
    numa: BTreeMap<u32, u64>,
}

/// The DAX OS devices and NUMA nodes of hwloc's XML (a line scanner: each object's
/// attributes are on its own line, its infos on the following ones).
fn hwloc_objects(xml: &str) -> Hwloc {
    let attr = |line: &str, k: &str| {
        let pat = format!(" {k}=\"");
        let i = line.find(&pat)? + pat.len();
        Some(line[i..].split('"').next()?.to_owned())
    };
    let mut h = Hwloc::default();
    let mut current: Option<String> = None;
    for line in xml.lines() {
        if line.contains("<object type=\"NUMANode\"") {
            let n: u32 = attr(line, "os_index").unwrap().parse().unwrap();
            h.numa.insert(n, attr(line, "local_memory").map_or(0, |m| m.parse().unwrap()));
        } else if line.contains("<object type=\"OSDev\"") {
            current = attr(line, "name").filter(|n| n.starts_with("dax"));
        } else if let Some(name) = &current {
            let e = h.dax.entry(name.clone()).or_insert((String::new(), 0));
            match (attr(line, "name").as_deref(), attr(line, "value")) {
                (Some("DAXType"), Some(v)) => e.0 = v,
                (Some("Size"), Some(v)) => e.1 = v.parse().unwrap(),
                _ => {}
            }
        }
    }
    h
}

/// A host with a CPU node, a CXL memory-only node (HMAT, tier, memory-side cache), a
/// soft-reserved node and a GPU-memory node, per the kernel's ABI documents.
fn hetero_host() -> Synth {
    let s = Synth::new();
    s.numa(0, "0-3", 16 * 1024 * 1024);
    for n in [1, 2, 3] {
        s.numa(n, "", 8 * 1024 * 1024);
    }
    let node =
        |n: u32, rel: &str, v: &str| s.write(&format!("sys/devices/system/node/node{n}/{rel}"), format!("{v}\n"));
    // HMAT (numaperf.rst): node1's best initiator is node0, in both access classes.
    for (class, rb, wb, rl, wl) in [(0, "40000", "30000", "250", "300"), (1, "20000", "15000", "400", "450")] {
        let d = format!("access{class}/initiators");
        node(1, &format!("{d}/read_bandwidth"), rb);
        node(1, &format!("{d}/write_bandwidth"), wb);
        node(1, &format!("{d}/read_latency"), rl);
        node(1, &format!("{d}/write_latency"), wl);
        symlink("../../../node0", s.path().join(format!("sys/devices/system/node/node1/{d}/node0"))).unwrap();
    }
    node(1, "memory_side_cache/index1/size", "4294967296");
    node(1, "memory_side_cache/index1/line_size", "64");
    node(1, "memory_side_cache/index1/indexing", "0");
    node(1, "memory_side_cache/index1/write_policy", "0");
    // Memory tiers (sysfs-kernel-mm-memory-tiers): DRAM in tier 4, the slower nodes lower.
    s.write("sys/devices/virtual/memory_tiering/memory_tier4/nodelist", "0,3\n");
    s.write("sys/devices/virtual/memory_tiering/memory_tier22/nodelist", "1\n");
    s.write("sys/devices/virtual/memory_tiering/memory_tier8/nodelist", "2\n");
    // DAX devices (sysfs-bus-dax): node1's memory is a CXL region's, onlined by kmem;
    // node3's is dax_hmem's soft-reserved range; node2 (a GPU's memory onlined by its
    // driver) has none, and nothing else in sysfs names its owner.
    let dax = |path: &str, name: &str, driver: &str, target: &str, size: &str| {
        let dir = format!("sys/devices/{path}/{name}");
        s.write(&format!("{dir}/size"), format!("{size}\n"));
        s.write(&format!("{dir}/target_node"), format!("{target}\n"));
        s.write(&format!("{dir}/resource"), "0x1080000000\n");
        s.write(&format!("sys/bus/dax/drivers/{driver}/.keep"), "");
        // Only the driver link's last component is read.
        symlink(format!("../bus/dax/drivers/{driver}"), s.path().join(&dir).join("driver")).unwrap();
        fs::create_dir_all(s.path().join("sys/bus/dax/devices")).unwrap();
        symlink(format!("../../../devices/{path}/{name}"), s.path().join(format!("sys/bus/dax/devices/{name}")))
            .unwrap();
    };
    dax("platform/ACPI0017:00/root0/decoder0.0/region0/dax_region0", "dax0.0", "kmem", "1", "8589934592");
    dax("platform/hmem.0/dax1.0", "dax1.0", "kmem", "3", "8589934592");
    dax("platform/hmem.0/dax1.1", "dax1.1", "device_dax", "3", "1073741824");
    s
}

#[test]
fn memory_only_nodes_are_memory_with_origin_tier_hmat_and_caches() {
    let s = hetero_host();
    let mut inv = Inventory::new();
    let r = PciBackend::new(s.sysfs()).discover(&mut inv);
    eprintln!("{r:?}");
    let cpu = numa(&inv, "syn", 0);
    assert_eq!(cpu.kind, DeviceKind::Cpu);
    assert_eq!(cpu.memory[0].kind, MemoryKind::Dram);
    assert_eq!(cpu.numa_memory.as_ref().map(|m| (&m.origin, m.tier)), Some((&MemoryOrigin::System, Some(4))));

    let cxl = numa(&inv, "syn", 1);
    assert_eq!(cxl.kind, DeviceKind::MemoryNode);
    assert_eq!(cxl.local_cpus, None);
    assert_eq!(cxl.memory.len(), 1);
    assert_eq!((cxl.memory[0].kind, cxl.memory[0].size), (MemoryKind::HostExported, 8 << 30));
    let info: &NumaMemoryInfo = cxl.numa_memory.as_ref().unwrap();
    assert!(info.memory_only);
    // No CXL bus in this tree: the region is known by its kernel name only.
    assert_eq!(info.origin, MemoryOrigin::CxlRegion { region: None, kernel_name: Some("region0".into()) });
    assert_eq!(info.tier, Some(22));
    assert_eq!(info.access.len(), 2);
    assert_eq!(info.access[1].initiators, [0]);
    assert_eq!(info.access[1].read_bandwidth_mbps, Some(20_000));
    assert_eq!(info.access[1].write_latency_ns, Some(450));
    assert_eq!(info.caches.len(), 1);
    assert_eq!((info.caches[0].level, info.caches[0].size, info.caches[0].line_size), (1, Some(4 << 30), Some(64)));
    assert_eq!((info.caches[0].indexing, info.caches[0].write_policy), (Some(0), Some(0)));

    let gpu = numa(&inv, "syn", 2);
    assert_eq!(gpu.kind, DeviceKind::MemoryNode);
    assert_eq!(gpu.numa_memory.as_ref().map(|m| (&m.origin, m.tier)), Some((&MemoryOrigin::Unknown, Some(8))));
    let spm = numa(&inv, "syn", 3);
    assert_eq!(spm.numa_memory.as_ref().map(|m| &m.origin), Some(&MemoryOrigin::SoftReserved));

    // Tiers and DAX devices of every origin, in the inventory.
    let tiers: Vec<(u32, Vec<u32>)> = inv.hmem.tiers.iter().map(|t| (t.id, t.nodes.clone())).collect();
    assert_eq!(tiers, [(4, vec![0, 3]), (8, vec![2]), (22, vec![1])]);
    let dax: Vec<(&str, &str, Option<u32>)> =
        inv.hmem.dax.iter().map(|d| (d.name.as_str(), d.origin.name(), d.target_node)).collect();
    assert_eq!(
        dax,
        [("dax0.0", "cxl", Some(1)), ("dax1.0", "soft_reserved", Some(3)), ("dax1.1", "soft_reserved", Some(3))]
    );
    assert_eq!(inv.hmem.dax[0].resource, Some(0x10_8000_0000));
}

#[test]
fn cpu_to_memory_node_paths_carry_the_hmat_figures() {
    let s = hetero_host();
    let mut inv = Inventory::new();
    PciBackend::new(s.sysfs()).discover(&mut inv);
    let cpu = inv.find(&DeviceId::named("syn", "numa0")).unwrap();
    let mem = inv.find(&DeviceId::named("syn", "numa1")).unwrap();
    let gpu = inv.find(&DeviceId::named("syn", "numa2")).unwrap();
    // Memory nodes are not linked to each other, and hang off every CPU node.
    let smp = |a, b| {
        inv.links.iter().filter(|l| l.kind == LinkKind::Smp && ((l.a, l.b) == (a, b) || (l.b, l.a) == (a, b))).count()
    };
    assert_eq!(smp(cpu, mem), 1);
    assert_eq!(smp(mem, gpu), 0);
    let f = Fabric::build(inv).unwrap();
    let r = f.route(cpu, mem).unwrap();
    // Access class 1 (CPU initiators): the slower direction, write 15,000 MB/s, 450 ns.
    assert_eq!(r.hops, [cpu, mem]);
    assert_eq!((r.bandwidth_mbps, r.latency_ns), (Some(15_000), Some(450)));
    // The GPU-memory node has no HMAT data: reachable, figures unknown.
    let r = f.route(cpu, gpu).unwrap();
    assert_eq!((r.bandwidth_mbps, r.latency_ns), (None, None));
}

#[test]
fn plain_directory_functions_are_shown_and_bad_entries_named() {
    let s = Synth::new();
    s.numa(0, "0-3", 1024);
    s.function("pci0000:00/0000:00:01.0", &ids("0x8086", "0x1234", "0x060400", "0"));
    // A stripped dump: the function's directory itself under sys/bus/pci/devices.
    let plain = s.path().join("sys/bus/pci/devices/0000:03:00.0");
    fs::create_dir_all(&plain).unwrap();
    for (k, v) in ids("0x15b3", "0x1017", "0x020000", "0") {
        fs::write(plain.join(k), format!("{v}\n")).unwrap();
    }
    // A dangling link and a stray file: skipped, with the reason.
    s.bus_link("0000:04:00.0", "../../../devices/pci0000:00/0000:04:00.0");
    s.write("sys/bus/pci/devices/junk", "x");
    let mut inv = Inventory::new();
    let r = PciBackend::new(s.sysfs()).discover(&mut inv);
    let a: fabric_topology::PciAddress = "0000:03:00.0".parse().unwrap();
    let d = inv.device(inv.find(&DeviceId::pci("syn", a)).expect("the plain-directory function is shown"));
    assert_eq!(d.kind, DeviceKind::Nic);
    assert_eq!(d.pci.as_ref().unwrap().vendor_id, Some(0x15b3));
    assert_eq!(d.attrs["pci.sysfs_path"], "sys/bus/pci/devices/0000:03:00.0");
    let has = |what: &str, why: &str| r.unknown.iter().any(|l| l.contains(what) && l.contains(why));
    assert!(has("0000:03:00.0", "not a link into sys/devices"), "{:?}", r.unknown);
    assert!(has("0000:04:00.0", "skipped"), "{:?}", r.unknown);
    assert!(has("junk", "skipped"), "{:?}", r.unknown);
}
