//! From KFD nodes to physical GPUs: partitions grouped under their GPU, xGMI links between
//! GPUs with their count and bandwidth, and indirect routes.
//!
//! The kernel's rules followed here (`kfd_crat.c`, `kfd_topology.c`, `amdgpu_xgmi.c`):
//! - a GPU node has `simd_count > 0`;
//! - in a partitioned mode each compute partition is its own KFD node, with the physical
//!   GPU's `unique_id` and `location_id = bus << 8 | devfn | partition` (the partition
//!   number is OR-ed into the function bits);
//! - an unpartitioned GPU's xGMI io_link has `weight` 15 per hop, `min_bandwidth` one link's
//!   bandwidth and `max_bandwidth` all direct links' (0 for an indirect hive peer), so the
//!   link count is `max / min`;
//! - a partitioned GPU's io_links to another device's partitions have weight
//!   `2 × 13 + 15 = 41` (one xGMI hop) and bandwidth 0: the peer is direct, the count is not
//!   reported.

use std::collections::{BTreeMap, HashMap};

use fabric_topology::PciAddress;

use super::kfd::{HEAP_FB, IOLINK_PCIE, IOLINK_XGMI, KfdLink, KfdNode};

/// The weight KFD gives a one-hop xGMI link between partitions of different devices.
const PARTITIONED_XGMI_WEIGHT: u32 = 2 * 13 + 15;

/// One physical GPU: its KFD nodes (one per visible partition).
#[derive(Debug, Clone)]
pub struct PhysicalGpu {
    /// The chip's unique id, when the kernel gives a non-zero one.
    pub unique_id: Option<u64>,
    /// Its PCI function.
    pub address: PciAddress,
    /// Whether KFD shows it partitioned (more than one node, or a partition number in the
    /// address).
    pub partitioned: bool,
    /// `(partition index, node)`, by index.
    pub nodes: Vec<(u32, KfdNode)>,
}

impl PhysicalGpu {
    fn first(&self) -> &KfdNode {
        &self.nodes[0].1
    }

    /// A property of the first visible partition (all partitions share device facts).
    pub fn prop(&self, key: &str) -> Option<u64> {
        self.first().props.get(key)
    }

    /// Compute units of one node.
    pub fn node_compute_units(n: &KfdNode) -> Option<u32> {
        let simds = n.props.get("simd_count")?;
        let per_cu = n.props.get("simd_per_cu").filter(|&v| v > 0)?;
        u32::try_from(simds / per_cu).ok()
    }

    /// Frame-buffer bytes of one node, when every bank was read and the node has any.
    pub fn node_memory(n: &KfdNode) -> Option<u64> {
        if n.mem_banks_incomplete {
            return None;
        }
        let fb: Vec<u64> = n.mem_banks.iter().filter(|(h, _)| HEAP_FB.contains(h)).map(|&(_, s)| s).collect();
        (!fb.is_empty()).then(|| fb.iter().fold(0u64, |a, &b| a.saturating_add(b)))
    }
}

/// The PCI address a node's `domain` and `location_id` give, with the partition bits kept.
fn node_address(n: &KfdNode) -> Option<PciAddress> {
    let loc = n.props.get("location_id").filter(|&l| l <= 0xffff)?;
    let domain = u32::try_from(n.props.get("domain").unwrap_or(0)).ok()?;
    PciAddress::new(domain, (loc >> 8) as u8, ((loc >> 3) & 0x1f) as u8, (loc & 7) as u8)
}

/// A physical GPU's key: PCI domain, bus, device (slot) and unique id.
type SlotKey = (u32, u8, u8, u64);

/// Groups GPU nodes into physical GPUs. Nodes are grouped by unique id and PCI slot
/// (bus, device): partitions differ only in the function bits. Returns the GPUs sorted by
/// address, and notes for nodes that could not be placed.
pub fn group(nodes: Vec<KfdNode>, notes: &mut Vec<String>) -> Vec<PhysicalGpu> {
    let mut groups: BTreeMap<SlotKey, Vec<(PciAddress, KfdNode)>> = BTreeMap::new();
    for n in nodes.into_iter().filter(KfdNode::is_gpu) {
        let Some(addr) = node_address(&n) else {
            notes.push(format!("kfd node {}: location_id or domain missing or out of range", n.id));
            continue;
        };
        let uid = n.props.get("unique_id").unwrap_or(0);
        groups.entry((addr.domain, addr.bus, addr.device, uid)).or_default().push((addr, n));
    }
    let mut gpus = Vec::new();
    for ((domain, bus, device, uid), mut members) in groups {
        members.sort_by_key(|(a, n)| (a.function, n.id));
        // Partitioned: several partitions shown, one other than 0, or only partition 0
        // shown (the others hidden, e.g. by a device cgroup) but with the xGMI weight only
        // partitions' links have.
        let partitioned = members.len() > 1
            || members.iter().any(|(a, n)| {
                a.function != 0
                    || n.io_links.iter().any(|l| l.link_type == IOLINK_XGMI && l.weight == PARTITIONED_XGMI_WEIGHT)
            });
        // Two nodes with one address and id are two copies of one partition: keep the
        // first, say so.
        let mut nodes: Vec<(u32, KfdNode)> = Vec::new();
        for (a, n) in members {
            let index = if partitioned { u32::from(a.function) } else { 0 };
            if nodes.iter().any(|(i, _)| *i == index) {
                notes.push(format!("kfd node {}: same GPU and partition as another node; ignored", n.id));
                continue;
            }
            nodes.push((index, n));
        }
        let function = if partitioned { 0 } else { nodes[0].1.props.get("location_id").unwrap_or(0) as u8 & 7 };
        let Some(address) = PciAddress::new(domain, bus, device, function) else { continue };
        gpus.push(PhysicalGpu { unique_id: (uid != 0).then_some(uid), address, partitioned, nodes });
    }
    gpus
}

/// A link between two physical GPUs, as far as KFD shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XgmiPeer {
    /// Direct xGMI links; 0 when the kernel does not say how many.
    pub count: u16,
    /// Per-direction bandwidth of all of them in MB/s, when reported.
    pub mbps: Option<u64>,
}

/// An indirect route to another GPU: the link type of its first hop and the kernel's
/// weight (its relative distance).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// `io_links`/`p2p_links` type.
    pub link_type: u32,
    /// Weight.
    pub weight: u32,
}

impl Route {
    /// The route in words for an attribute value.
    pub fn describe(&self) -> String {
        let t = match self.link_type {
            IOLINK_XGMI => "xgmi".to_owned(),
            IOLINK_PCIE => "pcie".to_owned(),
            t => format!("type {t}"),
        };
        format!("{t} weight {}", self.weight)
    }
}

/// What the links of every node say between physical GPUs (indexes into the GPU list).
#[derive(Debug, Default)]
pub struct Connections {
    /// Direct xGMI between `(a, b)`, `a < b`.
    pub xgmi: BTreeMap<(usize, usize), XgmiPeer>,
    /// Indirect routes from `a` to `b` (ordered pair), the lightest seen.
    pub routes: BTreeMap<(usize, usize), Route>,
    /// Links whose far end is not a visible GPU node (hidden, or not a GPU): count.
    pub to_unknown: usize,
}

/// Classifies one xGMI io_link: a direct peer (with its count and bandwidth) or `None`
/// for an indirect one.
fn direct_xgmi(l: &KfdLink, partitioned: bool) -> Option<XgmiPeer> {
    if l.link_type != IOLINK_XGMI {
        return None;
    }
    if l.max_bandwidth > 0 {
        // min is one link's bandwidth; a max that is not a whole number of links leaves
        // the count unknown rather than rounded.
        let count = (l.min_bandwidth > 0 && l.max_bandwidth.is_multiple_of(l.min_bandwidth))
            .then(|| u16::try_from(l.max_bandwidth / l.min_bandwidth).ok())
            .flatten()
            .unwrap_or(0);
        return Some(XgmiPeer { count, mbps: Some(l.max_bandwidth) });
    }
    (partitioned && l.weight == PARTITIONED_XGMI_WEIGHT).then_some(XgmiPeer { count: 0, mbps: None })
}

/// Joins every GPU node's links to the physical GPUs at their ends.
pub fn connect(gpus: &[PhysicalGpu]) -> Connections {
    let owner: HashMap<u32, usize> =
        gpus.iter().enumerate().flat_map(|(g, p)| p.nodes.iter().map(move |(_, n)| (n.id, g))).collect();
    let mut c = Connections::default();
    for (g, gpu) in gpus.iter().enumerate() {
        for (_, n) in &gpu.nodes {
            for (l, indirect) in n.io_links.iter().map(|l| (l, false)).chain(n.p2p_links.iter().map(|l| (l, true))) {
                let Some(&peer) = owner.get(&l.node_to) else {
                    // CPU nodes are expected at the far end of PCIe links; anything else
                    // points at a node we could not read.
                    if l.link_type == IOLINK_XGMI {
                        c.to_unknown += 1;
                    }
                    continue;
                };
                if peer == g {
                    continue; // between partitions of one GPU: inside the device
                }
                match (indirect, direct_xgmi(l, gpu.partitioned)) {
                    (false, Some(x)) => {
                        let key = (g.min(peer), g.max(peer));
                        let e = c.xgmi.entry(key).or_insert(x);
                        // Both directions and every partition pair describe the same links.
                        e.count = e.count.max(x.count);
                        e.mbps = e.mbps.max(x.mbps);
                    }
                    _ => {
                        let r = Route { link_type: l.link_type, weight: l.weight };
                        let e = c.routes.entry((g, peer)).or_insert(r);
                        if r.weight < e.weight {
                            *e = r;
                        }
                    }
                }
            }
        }
    }
    // A pair with direct links is not also an indirect route.
    let xgmi = &c.xgmi;
    c.routes.retain(|&(a, b), _| !xgmi.contains_key(&(a.min(b), a.max(b))));
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amd::kfd::parse_properties;

    fn node(id: u32, props: &str, io: Vec<KfdLink>) -> KfdNode {
        KfdNode { id, props: parse_properties(props).unwrap(), io_links: io, ..KfdNode::default() }
    }

    fn xgmi(to: u32, weight: u32, min: u64, max: u64) -> KfdLink {
        KfdLink { link_type: IOLINK_XGMI, node_to: to, weight, min_bandwidth: min, max_bandwidth: max }
    }

    #[test]
    fn counts_come_from_max_over_min_and_unknown_stays_unknown() {
        assert_eq!(direct_xgmi(&xgmi(1, 15, 50_000, 200_000), false), Some(XgmiPeer { count: 4, mbps: Some(200_000) }));
        assert_eq!(direct_xgmi(&xgmi(1, 15, 0, 50_000), false), Some(XgmiPeer { count: 0, mbps: Some(50_000) }));
        assert_eq!(direct_xgmi(&xgmi(1, 15, 30_000, 50_000), false).map(|x| x.count), Some(0));
        assert_eq!(direct_xgmi(&xgmi(1, 30, 0, 0), false), None, "indirect hive peer");
        assert_eq!(direct_xgmi(&xgmi(1, 41, 0, 0), true), Some(XgmiPeer { count: 0, mbps: None }));
        assert_eq!(direct_xgmi(&xgmi(1, 41, 0, 0), false), None);
    }

    #[test]
    fn partitions_group_under_one_gpu_by_unique_id_and_slot() {
        let p = |loc: u32| format!("simd_count 80\nsimd_per_cu 4\nlocation_id {loc}\nunique_id 7\n");
        let nodes = vec![
            node(2, &p(0x0a00), vec![xgmi(4, 41, 0, 0)]),
            node(3, &p(0x0a01), vec![]),
            node(4, &p(0x8000).replace("unique_id 7", "unique_id 8"), vec![]),
            node(0, "cpu_cores_count 4\nsimd_count 0\n", vec![]),
        ];
        let mut notes = Vec::new();
        let gpus = group(nodes, &mut notes);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].address.to_string(), "0000:0a:00.0");
        assert_eq!(gpus[0].nodes.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [0, 1]);
        assert!(gpus[0].partitioned && !gpus[1].partitioned);
        let c = connect(&gpus);
        assert_eq!(c.xgmi.get(&(0, 1)), Some(&XgmiPeer { count: 0, mbps: None }));
    }
}
