//! One pass over an [`NvmlSource`]: every GPU's identity, memory, affinity, fabric state,
//! NVLinks and the P2P matrix, as plain data.
//!
//! Collecting first and mapping into the inventory afterwards ([`super::model`]) keeps the
//! inventory untouched if the library misbehaves half-way, and lets the mapping be tested on
//! hand-written snapshots as well as on a fake source.

use fabric_topology::{CpuSet, PciAddress};

use super::api::nvlink_generation;
use super::api::{FabricInfo, FabricState, NVLINK_MAX_LINKS, NvmlCallError, NvmlSource, P2pCap, P2pStatus, RemoteType};

/// What NVML said about one GPU. `None` = NVML did not answer (see `NvmlSnapshot::unknown`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuRecord {
    /// NVML enumeration index (a handle for this pass only).
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: Option<String>,
    /// Product name.
    pub name: Option<String>,
    /// Board serial.
    pub serial: Option<String>,
    /// The bus id as NVML printed it.
    pub bus_id: Option<String>,
    /// The bus id parsed.
    pub address: Option<PciAddress>,
    /// PCI vendor id.
    pub vendor_id: Option<u16>,
    /// PCI device id.
    pub device_id: Option<u16>,
    /// Framebuffer bytes.
    pub memory_total: Option<u64>,
    /// NUMA node that onlines the GPU's own memory (C2C systems).
    pub memory_numa_node: Option<u32>,
    /// The one NUMA node near the GPU.
    pub numa_node: Option<u32>,
    /// CPUs near the GPU.
    pub local_cpus: Option<CpuSet>,
    /// Fabric registration state.
    pub fabric: Option<FabricInfo>,
    /// NVLinks the device has (active or not), in link order.
    pub links: Vec<NvLinkRecord>,
    /// True when every link query said the device has no NVLink.
    pub no_nvlink: bool,
    /// Some query answered `GpuLost`: the GPU fell off the bus or stopped responding.
    pub lost: bool,
}

/// One NVLink of a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvLinkRecord {
    /// Link number on the GPU.
    pub link: u32,
    /// Whether it is up.
    pub active: bool,
    /// Generation, when NVML reported a known version code.
    pub generation: Option<u8>,
    /// PCI address of the far end, when known.
    pub remote: Option<PciAddress>,
    /// Type of the far end, when known.
    pub remote_type: Option<RemoteType>,
}

/// The P2P status between two GPUs for one capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2pEntry {
    /// Position of the first GPU in [`NvmlSnapshot::gpus`].
    pub from: usize,
    /// Position of the second GPU.
    pub to: usize,
    /// Capability asked about.
    pub cap: P2pCap,
    /// NVML's answer.
    pub status: P2pStatus,
}

/// Everything one pass over NVML found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NvmlSnapshot {
    /// GPUs in NVML order.
    pub gpus: Vec<GpuRecord>,
    /// P2P statuses for every ordered pair of GPUs and capability that NVML answered.
    pub p2p: Vec<P2pEntry>,
    /// Queries that got no answer, as `what: why` lines.
    pub unknown: Vec<String>,
}

/// Parses NVML's bus id (`00000000:17:00.0`; older drivers print `0000:17:00.0`).
pub fn parse_bus_id(s: &str) -> Option<PciAddress> {
    s.trim().trim_end_matches('\0').to_ascii_lowercase().parse().ok()
}

/// Turns a little-endian bitmask of 64-bit words into the set bits' positions as ranges.
fn mask_ranges(words: &[u64]) -> Vec<(u32, u32)> {
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for (w, &bits) in words.iter().enumerate() {
        for b in 0..64u32 {
            if bits & (1u64 << b) == 0 {
                continue;
            }
            let Some(n) = u32::try_from(w).ok().and_then(|w| w.checked_mul(64)).map(|base| base + b) else {
                return ranges;
            };
            match ranges.last_mut() {
                Some(last) if last.1 + 1 == n => last.1 = n,
                _ => ranges.push((n, n)),
            }
        }
    }
    ranges
}

/// Collects everything the backend needs from `src`. Fails only when NVML cannot count its
/// devices; any other query without an answer leaves its field `None` and adds a line to
/// `unknown`.
pub fn collect(src: &dyn NvmlSource) -> Result<NvmlSnapshot, NvmlCallError> {
    let count = src.device_count()?;
    let mut snap = NvmlSnapshot::default();
    for dev in 0..count {
        let rec = collect_gpu(src, dev, &mut snap.unknown);
        snap.gpus.push(rec);
    }
    for (i, a) in snap.gpus.iter().enumerate() {
        for (j, b) in snap.gpus.iter().enumerate() {
            if i == j {
                continue;
            }
            for cap in P2pCap::ALL {
                match src.p2p_status(a.index, b.index, cap) {
                    Ok(status) => snap.p2p.push(P2pEntry { from: i, to: j, cap, status }),
                    Err(e) => {
                        snap.unknown.push(format!("nvml device {} p2p {} to {}: {e}", a.index, cap.as_str(), b.index))
                    }
                }
            }
        }
    }
    Ok(snap)
}

/// Records failed queries of one device.
struct Notes<'a> {
    dev: u32,
    unknown: &'a mut Vec<String>,
    /// A query answered `GpuLost`.
    lost: bool,
}

impl Notes<'_> {
    fn note(&mut self, what: &str, e: &dyn std::fmt::Display) {
        self.unknown.push(format!("nvml device {} {what}: {e}", self.dev));
    }

    fn ok<T>(&mut self, what: &str, r: Result<T, NvmlCallError>) -> Option<T> {
        self.lost |= matches!(r, Err(NvmlCallError::GpuLost));
        r.map_err(|e| self.note(what, &e)).ok()
    }
}

fn collect_gpu(src: &dyn NvmlSource, dev: u32, unknown: &mut Vec<String>) -> GpuRecord {
    let mut n = Notes { dev, unknown, lost: false };
    let mut rec = GpuRecord { index: dev, ..GpuRecord::default() };
    rec.uuid = n.ok("uuid", src.uuid(dev)).map(|s| s.trim().to_owned());
    rec.name = n.ok("name", src.name(dev));
    rec.serial = n.ok("serial", src.serial(dev));
    if let Some(pci) = n.ok("pci_info", src.pci(dev)) {
        rec.address = parse_bus_id(&pci.bus_id);
        if rec.address.is_none() {
            n.note("pci bus id", &format!("unparsable {:?}", pci.bus_id));
        }
        rec.bus_id = Some(pci.bus_id);
        rec.vendor_id = Some((pci.pci_device_id & 0xffff) as u16);
        rec.device_id = Some((pci.pci_device_id >> 16) as u16);
    }
    rec.memory_total = n.ok("memory_info", src.memory_total(dev));
    rec.memory_numa_node = match src.memory_numa_node(dev) {
        Ok(node) => Some(node),
        // Only systems whose GPU memory is a NUMA node (NVLink-C2C) answer this.
        Err(NvmlCallError::NotSupported) => None,
        Err(e) => n.ok("numa_node_id", Err(e)),
    };
    if let Some(words) = n.ok("memory_affinity", src.numa_affinity(dev)) {
        match mask_ranges(&words).as_slice() {
            [(a, b)] if a == b => rec.numa_node = Some(*a),
            [] => n.note("memory_affinity", &"empty node set"),
            _ => n.note("memory_affinity", &"more than one NUMA node"),
        }
    }
    if let Some(words) = n.ok("cpu_affinity", src.cpu_affinity(dev)) {
        let ranges = mask_ranges(&words);
        if ranges.is_empty() {
            n.note("cpu_affinity", &"empty CPU set");
        } else {
            rec.local_cpus = Some(CpuSet::from_ranges(ranges));
        }
    }
    rec.fabric = match src.fabric_info(dev) {
        Ok(f) => Some(f),
        // The call exists but the GPU takes part in no fabric (PCIe cards, pre-Hopper).
        Err(NvmlCallError::NotSupported) => Some(FabricInfo {
            state: FabricState::NotSupported,
            status: 0,
            cluster_uuid: [0; 16],
            clique_id: 0,
            health: None,
        }),
        Err(e) => n.ok("gpu_fabric_info", Err(e)),
    };
    let mut absent = 0;
    for link in 0..NVLINK_MAX_LINKS {
        let active = match src.nvlink_active(dev, link) {
            Ok(a) => a,
            Err(NvmlCallError::NotSupported | NvmlCallError::InvalidArgument) => {
                absent += 1;
                continue;
            }
            Err(e) => {
                n.note(&format!("nvlink {link} state"), &e);
                // A lost GPU answers no link either: one line, not one per link.
                if e == NvmlCallError::GpuLost {
                    n.lost = true;
                    break;
                }
                continue;
            }
        };
        let what = |w: &str| format!("nvlink {link} {w}");
        let generation = match n.ok(&what("version"), src.nvlink_version(dev, link)) {
            Some(code) => {
                let g = nvlink_generation(code);
                if g.is_none() {
                    n.note(&what("version"), &format!("unknown version code {code}"));
                }
                g
            }
            None => None,
        };
        // Links that are down may not report their far end: expected, not worth a line.
        let remote = match src.nvlink_remote_bus_id(dev, link) {
            Ok(s) => {
                let a = parse_bus_id(&s);
                if a.is_none() {
                    n.note(&what("remote pci bus id"), &format!("unparsable {s:?}"));
                }
                a
            }
            Err(e) if active => n.ok(&what("remote_pci_info"), Err(e)),
            Err(_) => None,
        };
        let remote_type = match src.nvlink_remote_type(dev, link) {
            Ok(t) => Some(t),
            Err(e) if active => n.ok(&what("remote_device_type"), Err(e)),
            Err(_) => None,
        };
        rec.links.push(NvLinkRecord { link, active, generation, remote, remote_type });
    }
    rec.no_nvlink = absent == NVLINK_MAX_LINKS;
    rec.lost = n.lost;
    rec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_with_eight_digit_domains_parse() {
        let a = parse_bus_id("00000000:17:00.0").unwrap();
        assert_eq!((a.domain, a.bus, a.device, a.function), (0, 0x17, 0, 0));
        assert_eq!(parse_bus_id("00010000:C1:00.0").unwrap().domain, 0x10000);
        assert_eq!(parse_bus_id("0000:3b:00.0").unwrap().bus, 0x3b);
        assert_eq!(parse_bus_id("garbage"), None);
    }

    #[test]
    fn masks_become_ranges() {
        assert_eq!(mask_ranges(&[0b1111_0000]), vec![(4, 7)]);
        assert_eq!(mask_ranges(&[u64::MAX, 1]), vec![(0, 64)]);
        assert_eq!(mask_ranges(&[1 << 63, 0, 1]), vec![(63, 63), (128, 128)]);
        assert!(mask_ranges(&[0, 0]).is_empty());
    }
}
