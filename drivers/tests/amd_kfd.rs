//! AMD discovery from KFD trees: the three real captures in `fixtures/kfd-real` (MI210 in
//! two xGMI hives, MI308X in CPX mode, a Vega10 with a hand-made twin) and synthetic trees
//! built from the kernel's rules where no capture exists (an MI250X-class hive with 4/2/1
//! link bundles, a hidden partition, a device cgroup's EPERM).
//!
//! Expected values are read off the capture files (`properties` lines quoted in comments)
//! and the kernel's rules in the fixtures' README, not from discovery's output.

#![allow(clippy::unwrap_used)] // Helpers outside #[test] fns: a panic there is a failed test.

mod fixtures;

use std::collections::BTreeSet;
use std::io;
use std::path::Path;

use fabric_drivers::amd::{self, AmdBackend};
use fabric_drivers::sysfs::{AttrError, read_attr};
use fabric_drivers::{Backend, discover};
use fabric_topology::{BackendState, DeviceKind, Fabric, HopClass, Inventory, LinkKind, MemoryKind};

use fixtures::{Synth, extract_kfd};

fn gpus(inv: &Inventory) -> Vec<&fabric_topology::Device> {
    inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).collect()
}

fn xgmi_links(inv: &Inventory) -> Vec<(String, String, u16, Option<u64>)> {
    inv.links
        .iter()
        .filter_map(|l| match l.kind {
            LinkKind::Xgmi { count } => {
                Some((inv.device(l.a).id.to_string(), inv.device(l.b).id.to_string(), count, l.bandwidth.max_mbps))
            }
            _ => None,
        })
        .collect()
}

fn serial(uid: u64) -> String {
    format!("serial:amdgpu/0x{uid:016x}")
}

#[test]
fn mi210_two_hives_of_four_with_one_link_per_pair() {
    let x = extract_kfd("mi210-2hive-xgmi");
    let mut inv = Inventory::new();
    let report = AmdBackend::new(x.sysfs()).discover(&mut inv);
    assert_eq!(report.state, BackendState::Present);
    assert!(report.unknown.is_empty(), "{:?}", report.unknown);
    // Nodes 2..=9 have simd_count 416; nodes 0 and 1 are CPUs (simd_count 0).
    let g = gpus(&inv);
    assert_eq!(g.len(), 8);
    assert_eq!(report.devices, 8);
    // Node 2: unique_id 1801979520617338022, location_id 25344 = 0x6300, domain 0.
    let n2 = inv.devices.iter().find(|d| d.id.to_string() == serial(1_801_979_520_617_338_022)).unwrap();
    assert_eq!(n2.pci_address().unwrap().to_string(), "0000:63:00.0");
    let gi = n2.gpu.as_ref().unwrap();
    assert_eq!(gi.gfx_target.as_deref(), Some("gfx90a"), "gfx_target_version 90010");
    assert_eq!(gi.compute_units, Some(104), "simd_count 416 / simd_per_cu 4");
    assert!(gi.partitions.is_empty());
    assert!(n2.memory.is_empty(), "no mem_banks and no amdgpu attributes: size unknown, not invented");
    assert_eq!(n2.pci.as_ref().unwrap().device_id, Some(0x740f), "device_id 29711");
    // Hives: 12609507387757274807 (nodes 2-5) and 18091350218769748594 (nodes 6-9).
    let hives: BTreeSet<String> = g.iter().filter_map(|d| d.gpu.as_ref()?.xgmi_hive.clone()).collect();
    assert_eq!(
        hives,
        [format!("0x{:016x}", 12_609_507_387_757_274_807u64), format!("0x{:016x}", 18_091_350_218_769_748_594u64)]
            .into_iter()
            .collect()
    );
    // Each GPU has 3 type-11 io_links, weight 15, min = max = 50000: one link per pair,
    // 4 choose 2 = 6 pairs per hive.
    let links = xgmi_links(&inv);
    assert_eq!(links.len(), 12);
    assert!(links.iter().all(|l| l.2 == 1 && l.3 == Some(50_000)), "{links:?}");
    // Across hives: p2p_links of type 2 with weight 72 (flags 3): indirect PCIe routes.
    let n6 = serial(12_585_367_064_092_601_175);
    assert_eq!(n2.attrs.get(&format!("kfd.route.{n6}")).map(String::as_str), Some("pcie weight 72"));
    let f = Fabric::build(inv).unwrap();
    let idx = |id: &str| f.inventory().devices.iter().position(|d| d.id.to_string() == id).unwrap();
    let (a, b, c) = (idx(&serial(1_801_979_520_617_338_022)), idx(&serial(5_847_760_019_078_012_339)), idx(&n6));
    let di = |i: usize| fabric_topology::DeviceIdx(i as u32);
    assert_eq!(f.classify(di(a), di(b)), HopClass::Xgmi(1));
    assert!(!f.classify(di(a), di(c)).is_scale_up(), "other hive: no xGMI");
}

#[test]
fn mi308x_cpx_partitions_group_under_eight_gpus_in_one_hive() {
    let x = extract_kfd("mi308x-cpx-intel");
    let mut inv = Inventory::new();
    let report = AmdBackend::new(x.sysfs()).discover(&mut inv);
    assert!(report.unknown.is_empty(), "{:?}", report.unknown);
    // 32 GPU nodes (2..=33) with 8 distinct unique_ids, location_ids base|0..3.
    let g = gpus(&inv);
    assert_eq!(g.len(), 8);
    let hives: BTreeSet<_> = g.iter().map(|d| d.gpu.as_ref().unwrap().xgmi_hive.clone()).collect();
    assert_eq!(hives.len(), 1, "hive_id 2095653680343411291 on every node");
    let domains: BTreeSet<u32> = g.iter().map(|d| d.pci_address().unwrap().domain).collect();
    assert_eq!(domains, [0, 1].into_iter().collect());
    // Node 2: unique_id 598046273873802902, location_id 2560 = 0x0a00, nodes 2..=5 its
    // partitions; each simd_count 80 / simd_per_cu 4 = 20 CUs, one FB bank (heap_type 1)
    // of 51539607552 bytes, but node 5's (partition 3) is 51522830336.
    let d = inv.devices.iter().find(|d| d.id.to_string() == serial(598_046_273_873_802_902)).unwrap();
    assert_eq!(d.pci_address().unwrap().to_string(), "0000:0a:00.0");
    let gi = d.gpu.as_ref().unwrap();
    assert_eq!(gi.partitions.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1, 2, 3]);
    assert!(gi.partitions.iter().all(|p| p.compute_units == Some(20)));
    let mem: Vec<_> = gi.partitions.iter().map(|p| p.memory_bytes.unwrap()).collect();
    assert_eq!(mem, [51_539_607_552, 51_539_607_552, 51_539_607_552, 51_522_830_336]);
    assert_eq!(gi.compute_units, Some(80));
    assert_eq!(gi.gfx_target.as_deref(), Some("gfx942"), "gfx_target_version 90402");
    assert_eq!(
        d.memory.iter().find(|m| m.kind == MemoryKind::Hbm).map(|m| m.size),
        Some(3 * 51_539_607_552 + 51_522_830_336)
    );
    // Cross-device io_links: type 11, weight 41 = 2 x 13 + 15 (one xGMI hop between
    // partitions), bandwidth 0: every pair of the 8 is an xGMI peer, count not reported.
    let links = xgmi_links(&inv);
    assert_eq!(links.len(), 28, "8 choose 2");
    assert!(links.iter().all(|l| l.2 == 0 && l.3.is_none()));
    let f = Fabric::build(inv).unwrap();
    let gs: Vec<_> = f.devices_of(DeviceKind::Gpu).collect();
    assert_eq!(f.classify(gs[0], gs[7]).to_string(), "XGMI");
}

/// A device plugin that hands a pod partition 0 of two GPUs: every other GPU node of the
/// MI308X capture refused (EPERM). The two are still partitioned GPUs with a direct xGMI
/// link (weight 41 is only ever a partition's), and the one partition's memory and compute
/// units are not given as the GPU's.
#[test]
fn partition_0_alone_of_two_gpus_is_still_a_partitioned_gpu_on_xgmi() {
    let x = extract_kfd("mi308x-cpx-intel");
    let nodes = x.root.join("sys/class/kfd/kfd/topology/nodes");
    let hidden: Vec<_> = (3..=33).filter(|n| *n != 6).map(|n| nodes.join(format!("{n}/properties"))).collect();
    let read = |p: &Path| -> Result<String, AttrError> {
        if hidden.iter().any(|h| h == p) {
            return Err(AttrError::Unreadable { path: p.to_owned(), source: io::Error::from_raw_os_error(1) });
        }
        read_attr(p)
    };
    let mut inv = Inventory::new();
    let report = amd::discover_with(&x.sysfs(), &mut inv, &read);
    let g = gpus(&inv);
    assert_eq!(g.len(), 2, "{:?}", report.unknown);
    let links = xgmi_links(&inv);
    assert_eq!(links.len(), 1, "a direct xGMI link, not a route: {links:?}");
    for d in &g {
        let gi = d.gpu.as_ref().unwrap();
        assert_eq!(gi.partitions.iter().map(|p| p.index).collect::<Vec<_>>(), [0]);
        assert_eq!(gi.compute_units, None, "20 CUs are partition 0's, not the GPU's");
        assert!(d.memory.is_empty(), "48 GiB is partition 0's, not the GPU's HBM");
    }
    assert_eq!(report.unknown.iter().filter(|l| l.contains("not shown by KFD")).count(), 2, "{:?}", report.unknown);
}

#[test]
fn vega10_and_its_hand_made_twin_are_two_gpus_by_unique_id() {
    let x = extract_kfd("vega10-single");
    let mut inv = Inventory::new();
    let report = AmdBackend::new(x.sysfs()).discover(&mut inv);
    // Nodes 1 and 2 share location_id 6400 but unique_ids ...556 and ...557 differ.
    let g = gpus(&inv);
    assert_eq!(g.len(), 2, "{:?}", report.unknown);
    let ids: BTreeSet<String> = g.iter().map(|d| d.id.to_string()).collect();
    assert_eq!(ids, [serial(14_073_402_507_705_256_556), serial(14_073_402_507_705_256_557)].into_iter().collect());
    for d in &g {
        assert_eq!(d.pci_address().unwrap().to_string(), "0000:19:00.0");
        assert_eq!(d.memory[0].size, 17_163_091_968, "mem_banks/0 size_in_bytes");
        let gi = d.gpu.as_ref().unwrap();
        assert_eq!(gi.compute_units, Some(64), "simd_count 256 / simd_per_cu 4");
        assert_eq!((gi.gfx_target.as_ref(), gi.xgmi_hive.as_ref()), (None, None), "old kernel: no such keys");
    }
    assert!(xgmi_links(&inv).is_empty());
}

/// A KFD GPU node following `kfd_topology.c`'s layout.
fn gpu_node(s: &Synth, n: u32, loc: u32, uid: u64, hive: u64, links: &[(u32, u32, u64, u64)]) {
    let d = format!("sys/class/kfd/kfd/topology/nodes/{n}");
    s.write(
        &format!("{d}/properties"),
        format!(
            "cpu_cores_count 0\nsimd_count 440\nsimd_per_cu 4\nio_links_count {}\nvendor_id 4098\n\
             device_id 29704\nlocation_id {loc}\ndomain 0\nhive_id {hive}\ngfx_target_version 90010\n\
             unique_id {uid}\ndrm_render_minor {}\n",
            links.len(),
            128 + n
        ),
    );
    s.write(&format!("{d}/mem_banks/0/properties"), "heap_type 1\nsize_in_bytes 68702699520\nflags 0\n");
    for (i, (to, weight, min, max)) in links.iter().enumerate() {
        s.write(
            &format!("{d}/io_links/{i}/properties"),
            format!(
                "type 11\nnode_from {n}\nnode_to {to}\nweight {weight}\nmin_bandwidth {min}\nmax_bandwidth {max}\n"
            ),
        );
    }
}

/// RCCL's `topo_8p1h.xml` (8 MI250X-class GCDs in one hive): its xGMI bundles, by bus.
const HIVE_8P1H: [(u8, u8, u64); 12] = [
    (0x29, 0x2c, 4),
    (0x29, 0xad, 2),
    (0x29, 0xb3, 1),
    (0x2c, 0x32, 1),
    (0x2c, 0xb6, 1),
    (0x2f, 0x32, 4),
    (0x2f, 0xad, 1),
    (0x2f, 0xb3, 2),
    (0x32, 0xb0, 1),
    (0xad, 0xb0, 4),
    (0xb0, 0xb6, 1),
    (0xb3, 0xb6, 4),
];
const BUSES: [u8; 8] = [0x29, 0x2c, 0x2f, 0x32, 0xad, 0xb0, 0xb3, 0xb6];

/// The MI250X-class hive as the kernel would show it unpartitioned: a direct peer's
/// io_link has weight 15, min one link (50000), max count x 50000; an indirect peer weight
/// 30 (two hops) and bandwidth 0.
fn mi250x_hive() -> Synth {
    let s = Synth::new();
    for (i, &bus) in BUSES.iter().enumerate() {
        let mut links = Vec::new();
        for (j, &peer) in BUSES.iter().enumerate() {
            if i == j {
                continue;
            }
            let bundle = HIVE_8P1H.iter().find(|&&(a, b, _)| (a, b) == (bus, peer) || (b, a) == (bus, peer));
            links.push(match bundle {
                Some(&(_, _, count)) => (j as u32 + 1, 15, 50_000, count * 50_000),
                None => (j as u32 + 1, 30, 0, 0),
            });
        }
        gpu_node(&s, i as u32 + 1, u32::from(bus) << 8, 0x1000 + i as u64, 77, &links);
    }
    s.write("sys/class/kfd/kfd/topology/nodes/0/properties", "cpu_cores_count 64\nsimd_count 0\n");
    s
}

#[test]
fn synthetic_mi250x_hive_has_rccls_bundles_and_indirect_routes() {
    let s = mi250x_hive();
    let mut inv = Inventory::new();
    let report = AmdBackend::new(s.sysfs()).discover(&mut inv);
    assert!(report.unknown.is_empty(), "{:?}", report.unknown);
    let bus_of = |id: &str| inv.devices.iter().find(|d| d.id.to_string() == id).unwrap().pci_address().unwrap().bus;
    let mut got: Vec<(u8, u8, u64)> = xgmi_links(&inv)
        .iter()
        .map(|(a, b, c, bw)| {
            assert_eq!(*bw, Some(u64::from(*c) * 50_000));
            let (x, y) = (bus_of(a), bus_of(b));
            (x.min(y), x.max(y), u64::from(*c))
        })
        .collect();
    got.sort_unstable();
    assert_eq!(got, HIVE_8P1H.to_vec());
    // 0x29 and 0x2f share no bundle: a two-hop xGMI route.
    let first = inv.devices.iter().find(|d| d.pci_address().is_some_and(|a| a.bus == 0x29)).unwrap();
    let third = inv.devices.iter().find(|d| d.pci_address().is_some_and(|a| a.bus == 0x2f)).unwrap();
    assert_eq!(first.attrs.get(&format!("kfd.route.{}", third.id)).map(String::as_str), Some("xgmi weight 30"));
    assert_eq!(first.memory[0].size, 68_702_699_520);
    assert_eq!(first.name.as_deref().map(|n| n.is_empty()), Some(false), "named from the PCI id database");
}

/// A dump whose symlinks are absolute (copied with their `/sys/...` targets, as some
/// capture tools leave them): `sys/class/kfd/kfd` and a GPU's `sys/bus/pci/devices/ADDR`
/// are followed inside the dump, never into the live host's `/sys` (where this host has
/// no KFD, so the backend said "not present" before).
#[test]
fn absolute_symlinks_of_a_dump_resolve_inside_it() {
    use std::os::unix::fs::symlink;
    let s = mi250x_hive();
    let virt = s.path().join("sys/devices/virtual/kfd");
    std::fs::create_dir_all(&virt).unwrap();
    std::fs::rename(s.path().join("sys/class/kfd/kfd"), virt.join("kfd")).unwrap();
    symlink("/sys/devices/virtual/kfd/kfd", s.path().join("sys/class/kfd/kfd")).unwrap();
    s.write("sys/devices/pci0000:00/0000:00:01.0/0000:29:00.0/xgmi_physical_id", "5\n");
    symlink("/sys/devices/pci0000:00/0000:00:01.0/0000:29:00.0", s.path().join("sys/bus/pci/devices/0000:29:00.0"))
        .unwrap();
    let mut inv = Inventory::new();
    let report = AmdBackend::new(s.sysfs()).discover(&mut inv);
    assert_eq!(report.state, BackendState::Present, "{report:?}");
    assert_eq!(gpus(&inv).len(), 8, "{:?}", report.unknown);
    let first = inv.devices.iter().find(|d| d.pci_address().is_some_and(|a| a.bus == 0x29)).unwrap();
    assert_eq!(first.attrs.get("amdgpu.xgmi_physical_id").map(String::as_str), Some("5"), "{:?}", first.attrs);
}

/// A symlink loop where `sys/class/kfd/kfd` should be is a failed backend saying so, not
/// "KFD not loaded".
#[test]
fn a_symlink_loop_in_a_dump_is_a_failure_not_an_absent_kfd() {
    let s = Synth::new();
    std::fs::create_dir_all(s.path().join("sys/class/kfd")).unwrap();
    std::os::unix::fs::symlink("/sys/class/kfd/kfd", s.path().join("sys/class/kfd/kfd")).unwrap();
    let mut inv = Inventory::new();
    let report = AmdBackend::new(s.sysfs()).discover(&mut inv);
    assert!(matches!(&report.state, BackendState::Failed(why) if why.contains("symlink loop")), "{report:?}");
}

#[test]
fn eperm_nodes_are_hidden_and_their_partition_reported_missing() {
    let s = Synth::new();
    // One GPU in QPX mode: partitions 0-3 at location base | partition; node 3 is refused.
    for p in 0..4u32 {
        gpu_node(&s, p + 1, 0x4000 | p, 42, 0, &[]);
    }
    s.write("sys/class/kfd/kfd/topology/nodes/0/properties", "cpu_cores_count 64\nsimd_count 0\n");
    let hidden = s.path().join("sys/class/kfd/kfd/topology/nodes/3/properties");
    let read = |p: &Path| -> Result<String, AttrError> {
        if p == hidden {
            // What KFD's node_show answers outside the device cgroup.
            return Err(AttrError::Unreadable { path: p.to_owned(), source: io::Error::from_raw_os_error(1) });
        }
        read_attr(p)
    };
    let mut inv = Inventory::new();
    let report = amd::discover_with(&s.sysfs(), &mut inv, &read);
    assert_eq!(report.state, BackendState::Present, "hidden is not a failure");
    assert!(report.unknown.iter().any(|l| l.contains("hidden") && l.contains("nodes 3")), "{:?}", report.unknown);
    assert!(
        report.unknown.iter().any(|l| l.contains("compute partition(s) 2 not shown")),
        "the hole in 0, 1, _, 3: {:?}",
        report.unknown
    );
    let g = gpus(&inv);
    assert_eq!(g.len(), 1);
    let gi = g[0].gpu.as_ref().unwrap();
    assert_eq!(gi.partitions.iter().map(|p| p.index).collect::<Vec<_>>(), [0, 1, 3], "not invented");
    assert!(g[0].memory.is_empty(), "a sum without partition 2 would be wrong");
    assert_eq!(gi.compute_units, None, "nor is a count of compute units without it");
    assert!(gi.partitions.iter().all(|p| p.compute_units.is_some()), "each partition keeps its own");
}

#[test]
fn no_kfd_tree_is_not_present_and_other_backends_still_run() {
    let s = Synth::new();
    let inv = discover(&[&AmdBackend::new(s.sysfs())]);
    assert!(matches!(inv.backends[0].state, BackendState::NotPresent(_)));
    assert!(inv.devices.is_empty());
}
