//! Hand-built fabrics for renderer tests: an 8-GPU HGX-like node, two such nodes behind a
//! network switch, a CXL memory-expander host and a many-node cluster.
//!
//! Shared by the crate's unit tests (included with `#[path]`) and the integration tests.
#![allow(dead_code)]

use fabric_topology::cxl::{CxlDecoder, CxlDecoderLevel, CxlMemdevInfo, CxlMode, CxlRegion};
use fabric_topology::{
    BackendReport, Bandwidth, CpuSet, Device, DeviceId, DeviceIdx, DeviceKind, Fabric, GpuInfo, Inventory, Link,
    LinkKind, MemoryKind, MemoryResource, PciAddress, PciInfo,
};

pub const GIB: u64 = 1 << 30;

fn addr(bus: u8, dev: u8) -> PciAddress {
    PciAddress::new(0, bus, dev, 0).expect("valid address")
}

fn pci_info(a: PciAddress, class: u32, vendor: u16, device: u16, gen_: u8, width: u8) -> PciInfo {
    let gts = [0.0, 2.5, 5.0, 8.0, 16.0, 32.0, 64.0][gen_ as usize];
    PciInfo {
        address: Some(a),
        class: Some(class),
        vendor_id: Some(vendor),
        device_id: Some(device),
        subsystem_vendor_id: Some(vendor),
        subsystem_device_id: Some(0x16c1),
        link_speed_gts: Some(gts),
        link_width: Some(width),
        max_link_speed_gts: Some(gts),
        max_link_width: Some(16),
        ..PciInfo::default()
    }
}

fn add(inv: &mut Inventory, mut d: Device) -> DeviceIdx {
    d.sources.push("test".into());
    inv.add_device(d).expect("device fits")
}

fn bridge(inv: &mut Inventory, node: &str, a: PciAddress, numa: u32) -> DeviceIdx {
    let mut d = Device::new(DeviceId::pci(node, a), DeviceKind::PciBridge, Some(node));
    d.pci = Some(pci_info(a, 0x060400, 0x1000, 0xc030, 5, 16));
    d.numa_node = Some(numa);
    add(inv, d)
}

fn gen5(inv: &mut Inventory, up: DeviceIdx, down: DeviceIdx) {
    inv.add_link(Link::pcie(up, down, (Some(5), Some(16)), (Some(5), Some(16))));
}

/// What [`hgx_node`] built.
#[derive(Debug, Clone, Default)]
pub struct NodeParts {
    pub cpus: Vec<DeviceIdx>,
    pub gpus: Vec<DeviceIdx>,
    /// The four GPU-facing NICs, then the management NIC.
    pub nics: Vec<DeviceIdx>,
    pub nvswitches: Vec<DeviceIdx>,
}

/// Adds an HGX-like node: two NUMA nodes (Smp-linked), four host bridges (two per NUMA
/// node), each with a root port, a PCIe switch with two GPUs and one NIC (quadrants 0 and 1
/// put the NIC behind a second, nested switch), a management NIC on its own root port of the
/// first host bridge, and four NVSwitches with NVLink 4 bundles of 5+4+4+5 links per GPU.
/// With `degraded`, the NIC of quadrant 3 trains at x8 instead of x16.
pub fn hgx_node(inv: &mut Inventory, node: &str, degraded: bool) -> NodeParts {
    let mut parts = NodeParts::default();
    let cpu_lists = ["0-55,112-167", "56-111,168-223"];
    for n in 0..2u32 {
        let mut d = Device::new(DeviceId::named(node, &format!("numa{n}")), DeviceKind::Cpu, Some(node));
        d.name = Some("Intel(R) Xeon(R) Platinum 8480+".into());
        d.numa_node = Some(n);
        d.local_cpus = Some(cpu_lists[n as usize].parse().expect("cpulist"));
        d.memory.push(MemoryResource { kind: MemoryKind::Dram, size: 1024 * GIB, hpa: None, numa_node: Some(n) });
        d.attrs.insert("arch".into(), "x86_64".into());
        d.attrs.insert("vendor".into(), "GenuineIntel".into());
        d.attrs.insert("family".into(), "6".into());
        d.attrs.insert("model".into(), "143".into());
        parts.cpus.push(add(inv, d));
    }
    inv.add_link(Link::new(parts.cpus[0], parts.cpus[1], LinkKind::Smp, Bandwidth::default(), None));
    for s in 0..4u32 {
        let mut d = Device::new(DeviceId::named(node, &format!("nvswitch{s}")), DeviceKind::NvSwitch, Some(node));
        d.name = Some("NVIDIA NVSwitch".into());
        parts.nvswitches.push(add(inv, d));
    }
    let mut mgmt = None;
    for q in 0..4u8 {
        let numa = u32::from(q / 2);
        let cpu = parts.cpus[numa as usize];
        let base = 0x10 + q * 0x20;
        let hb = add(inv, {
            let mut d =
                Device::new(DeviceId::named(node, &format!("pci0000:{base:02x}")), DeviceKind::HostBridge, Some(node));
            d.numa_node = Some(numa);
            d
        });
        inv.add_link(Link::new(cpu, hb, LinkKind::HostAttach, Bandwidth::default(), None));
        let rp = bridge(inv, node, addr(base, 1), numa);
        gen5(inv, hb, rp);
        let usp = bridge(inv, node, addr(base + 1, 0), numa);
        gen5(inv, rp, usp);
        let dsps: Vec<DeviceIdx> = (0..3).map(|k| bridge(inv, node, addr(base + 2, k), numa)).collect();
        for &dsp in &dsps {
            gen5(inv, usp, dsp);
        }
        for k in 0..2u8 {
            let a = addr(base + 3 + k, 0);
            let gi = parts.gpus.len();
            let mut d = Device::new(DeviceId::uuid(&format!("GPU-{node}-{gi:02}")), DeviceKind::Gpu, Some(node));
            d.name = Some("NVIDIA H100 80GB HBM3".into());
            d.numa_node = Some(numa);
            d.local_cpus = Some(cpu_lists[numa as usize].parse().expect("cpulist"));
            d.pci = Some(pci_info(a, 0x030200, 0x10de, 0x2330, 5, 16));
            d.gpu = Some(GpuInfo {
                uuid: Some(format!("GPU-{node}-{gi:02}")),
                model: Some("NVIDIA H100 80GB HBM3".into()),
                nvlink_capable: Some(18),
                nvlink_generation: Some(4),
                compute_capability: Some("9.0".into()),
                ..GpuInfo::default()
            });
            d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 80 * GIB, hpa: None, numa_node: None });
            let g = add(inv, d);
            gen5(inv, dsps[k as usize], g);
            for (s, &count) in [5u16, 4, 4, 5].iter().enumerate() {
                let bw = Bandwidth::full(u64::from(count) * 25_000);
                inv.add_link(Link::new(g, parts.nvswitches[s], LinkKind::NvLink { generation: 4, count }, bw, None));
            }
            parts.gpus.push(g);
        }
        // The NIC: on the switch (quadrants 2, 3) or behind a nested switch (0, 1).
        let nic_parent = if q < 2 {
            let usp2 = bridge(inv, node, addr(base + 5, 0), numa);
            gen5(inv, dsps[2], usp2);
            let dsp2 = bridge(inv, node, addr(base + 6, 0), numa);
            gen5(inv, usp2, dsp2);
            dsp2
        } else {
            dsps[2]
        };
        let a = addr(base + 7, 0);
        let nic = add(inv, nic_device(node, a, numa, &format!("mlx5_{q}"), cpu_lists[numa as usize]));
        if degraded && q == 3 {
            inv.add_link(Link::pcie(nic_parent, nic, (Some(5), Some(8)), (Some(5), Some(16))));
        } else {
            gen5(inv, nic_parent, nic);
        }
        parts.nics.push(nic);
        if q == 0 {
            let rp2 = bridge(inv, node, addr(base, 2), numa);
            gen5(inv, hb, rp2);
            let a = addr(base + 0x10, 0);
            let m = add(inv, nic_device(node, a, numa, "mlx5_4", cpu_lists[0]));
            inv.add_link(Link::pcie(rp2, m, (Some(4), Some(8)), (Some(4), Some(8))));
            mgmt = Some(m);
        }
    }
    parts.nics.extend(mgmt);
    inv.backends.push(BackendReport { devices: inv.devices.len(), ..BackendReport::present("test") });
    parts
}

fn nic_device(node: &str, a: PciAddress, numa: u32, ib: &str, cpus: &str) -> Device {
    let mut d = Device::new(DeviceId::pci(node, a), DeviceKind::Nic, Some(node));
    d.name = Some("MT2910 Family [ConnectX-7]".into());
    d.numa_node = Some(numa);
    d.local_cpus = Some(cpus.parse::<CpuSet>().expect("cpulist"));
    d.pci = Some(pci_info(a, 0x020700, 0x15b3, 0x1021, 5, 16));
    d.attrs.insert("ib_device".into(), ib.into());
    d
}

/// One HGX node, `node0`, with a degraded NIC link.
pub fn hgx() -> Inventory {
    let mut inv = Inventory::new();
    hgx_node(&mut inv, "node0", true);
    inv
}

/// Two HGX nodes whose GPU-facing NICs connect at 400 Gb/s to one leaf switch.
pub fn two_nodes() -> Inventory {
    let mut inv = Inventory::new();
    let a = hgx_node(&mut inv, "node0", false);
    let b = hgx_node(&mut inv, "node1", false);
    let mut leaf = Device::new(DeviceId::named("fabric", "leaf0"), DeviceKind::NetworkSwitch, None);
    leaf.name = Some("Quantum-2 QM9700".into());
    let leaf = add(&mut inv, leaf);
    for nic in a.nics[..4].iter().chain(&b.nics[..4]) {
        inv.add_link(Link::new(*nic, leaf, LinkKind::Network { gbps: 400 }, Bandwidth::full(50_000), Some(600)));
    }
    inv
}

/// `nodes` HGX nodes; NICs connect to leaves (32 nodes per leaf), leaves to 4 spines.
pub fn cluster(nodes: usize) -> Inventory {
    let mut inv = Inventory::new();
    let spines: Vec<DeviceIdx> = (0..4)
        .map(|s| {
            add(&mut inv, Device::new(DeviceId::named("fabric", &format!("spine{s}")), DeviceKind::NetworkSwitch, None))
        })
        .collect();
    let mut leaf = None;
    for n in 0..nodes {
        if n % 32 == 0 {
            let l = add(
                &mut inv,
                Device::new(DeviceId::named("fabric", &format!("leaf{}", n / 32)), DeviceKind::NetworkSwitch, None),
            );
            for &s in &spines {
                inv.add_link(Link::new(l, s, LinkKind::Network { gbps: 800 }, Bandwidth::full(100_000), None));
            }
            leaf = Some(l);
        }
        let parts = hgx_node(&mut inv, &format!("node{n}"), false);
        let l = leaf.expect("leaf made");
        for nic in &parts.nics[..4] {
            inv.add_link(Link::new(*nic, l, LinkKind::Network { gbps: 400 }, Bandwidth::full(50_000), None));
        }
    }
    inv
}

/// A host with one NUMA node, a GPU on a root port and a CXL memory expander behind a CXL
/// switch on a CXL host bridge, with a committed one-way region.
pub fn cxl_host() -> Inventory {
    let node = "cxl0";
    let mut inv = Inventory::new();
    let mut cpu = Device::new(DeviceId::named(node, "numa0"), DeviceKind::Cpu, Some(node));
    cpu.numa_node = Some(0);
    cpu.local_cpus = Some("0-31".parse().expect("cpulist"));
    let cpu = add(&mut inv, cpu);
    let hb0 = add(&mut inv, Device::new(DeviceId::named(node, "pci0000:00"), DeviceKind::HostBridge, Some(node)));
    inv.add_link(Link::new(cpu, hb0, LinkKind::HostAttach, Bandwidth::default(), None));
    let rp = bridge(&mut inv, node, addr(0, 1), 0);
    gen5(&mut inv, hb0, rp);
    let mut g = Device::new(DeviceId::uuid("GPU-cxl0-00"), DeviceKind::Gpu, Some(node));
    g.pci = Some(pci_info(addr(1, 0), 0x030200, 0x10de, 0x2330, 5, 16));
    g.numa_node = Some(0);
    let g = add(&mut inv, g);
    gen5(&mut inv, rp, g);
    let hb1 = add(&mut inv, Device::new(DeviceId::named(node, "pci0000:0c"), DeviceKind::HostBridge, Some(node)));
    inv.add_link(Link::new(cpu, hb1, LinkKind::HostAttach, Bandwidth::default(), None));
    let crp = bridge(&mut inv, node, addr(0x0c, 0), 0);
    inv.add_link(Link::new(hb1, crp, LinkKind::Cxl { width: Some(16) }, Bandwidth::full(63_015), None));
    let mut sw = Device::new(DeviceId::pci(node, addr(0x0d, 0)), DeviceKind::CxlSwitch, Some(node));
    sw.name = Some("CXL switch".into());
    let sw = add(&mut inv, sw);
    inv.add_link(Link::new(crp, sw, LinkKind::Cxl { width: Some(16) }, Bandwidth::full(63_015), None));
    let mut m = Device::new(DeviceId::serial("cxl", "0x1a2b"), DeviceKind::CxlMemdev, Some(node));
    m.name = Some("CXL type-3 memory expander".into());
    m.numa_node = Some(0);
    m.cxl = Some(CxlMemdevInfo {
        serial: Some(0x1a2b),
        kernel_name: Some("mem0".into()),
        pci_address: Some(addr(0x0e, 0)),
        ram_size: Some(256 * GIB),
        ..CxlMemdevInfo::default()
    });
    m.memory.push(MemoryResource { kind: MemoryKind::CxlVolatile, size: 256 * GIB, hpa: None, numa_node: Some(1) });
    let mid = m.id.clone();
    let m = add(&mut inv, m);
    inv.add_link(Link::new(sw, m, LinkKind::Cxl { width: Some(8) }, Bandwidth::full(31_507), None));
    inv.cxl.decoders.push(CxlDecoder {
        kernel_name: "decoder0.0".into(),
        level: CxlDecoderLevel::Root,
        owner: None,
        start: Some(0x10_0000_0000),
        size: Some(256 * GIB),
        ways: Some(1),
        granularity: Some(256),
        mode: None,
        dpa_start: None,
        dpa_size: None,
        targets: vec!["name:cxl0/pci0000:0c".into()],
        capabilities: vec!["ram".into()],
        qos_class: None,
        region: None,
        locked: Some(false),
    });
    inv.cxl.regions.push(CxlRegion {
        kernel_name: "region0".into(),
        uuid: None,
        mode: Some(CxlMode::Ram),
        resource: Some(0x10_0000_0000),
        size: Some(256 * GIB),
        ways: Some(1),
        granularity: Some(256),
        targets: vec![mid],
        committed: Some(true),
        dax: Vec::new(),
        root_decoder: Some("decoder0.0".into()),
    });
    inv.backends.push(BackendReport::present("test"));
    inv.backends.push(BackendReport::not_present("nvml", "libnvidia-ml.so.1 not found"));
    inv
}

/// Indexes an inventory.
pub fn fabric(inv: Inventory) -> Fabric {
    Fabric::build(inv).expect("valid inventory")
}
