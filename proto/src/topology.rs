//! `fabric.topology/v1` and `fabric.devices/v1`: the fabric as a JSON document, built from a
//! [`Fabric`] with stable identities and a stable order.

use std::collections::{BTreeMap, HashMap};

use fabric_topology::cxl::{CxlInventory, CxlMemdevInfo};
use fabric_topology::hmem::{HmemInventory, NumaMemoryInfo};
use fabric_topology::{
    BackendState, Bandwidth, CpuSet, DeviceId, DeviceIdx, DeviceKind, Fabric, GpuInfo, LinkKind, LinkState,
    MemoryResource, PciInfo, RdmaDevice, UalinkInfo,
};
use serde::{Deserialize, Serialize};

use crate::order::{MatrixLabels, device_order, sorted_nodes};
use crate::{DEVICES_SCHEMA, HasSchema, TOPOLOGY_SCHEMA};

/// The largest number of matrix devices for which a document carries the class matrix.
pub const MATRIX_LIMIT: usize = 64;

/// What to put in a topology document.
#[derive(Debug, Clone, Default)]
pub struct TopologyOptions {
    /// Only this node's devices (and the links among them).
    pub node: Option<String>,
}

/// The whole fabric (or one node of it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopologyDoc {
    /// Always `fabric.topology/v1`.
    pub schema: String,
    /// Node names in natural order.
    pub nodes: Vec<String>,
    /// Counts over the document's devices and links.
    pub summary: SummaryDoc,
    /// Matrix labels (`GPU0`, `NIC0`, ...) of the document's matrix devices, in matrix order.
    pub labels: Vec<LabelDoc>,
    /// Devices in the stable order.
    pub devices: Vec<DeviceDoc>,
    /// Links between the document's devices.
    pub links: Vec<LinkDoc>,
    /// CXL decoders and regions.
    pub cxl: CxlInventory,
    /// DAX devices of every origin and the kernel's memory tiers; absent when there are none.
    #[serde(default, skip_serializing_if = "HmemInventory::is_empty")]
    pub hmem: HmemInventory,
    /// How each discovery backend fared.
    pub backends: Vec<BackendDoc>,
    /// Hop classes between matrix devices; absent when there are more than 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix: Option<MatrixDoc>,
}

/// Every device with its identity and details.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DevicesDoc {
    /// Always `fabric.devices/v1`.
    pub schema: String,
    /// Devices in the stable order.
    pub devices: Vec<DeviceDoc>,
}

/// A label in the matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelDoc {
    /// `GPU0`, `ACC3`, `NIC1`, `CXL0`.
    pub label: String,
    /// The device it names.
    pub id: DeviceId,
}

/// One device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceDoc {
    /// Stable identity.
    pub id: DeviceId,
    /// Kind.
    pub kind: DeviceKind,
    /// Matrix label, for GPUs, accelerators, NICs and CXL memdevs.
    pub label: Option<String>,
    /// Node; null for fabric-level devices.
    pub node: Option<String>,
    /// Display name.
    pub name: Option<String>,
    /// NUMA node, null when unknown.
    pub numa_node: Option<u32>,
    /// Local CPUs as a cpulist, null when unknown.
    pub local_cpus: Option<CpuSet>,
    /// Upstream device in the PCI/CXL hierarchy.
    pub parent: Option<DeviceId>,
    /// PCI details.
    pub pci: Option<PciInfo>,
    /// GPU details.
    pub gpu: Option<GpuInfo>,
    /// CXL memdev details.
    pub cxl: Option<CxlMemdevInfo>,
    /// UALink details.
    pub ualink: Option<UalinkInfo>,
    /// RDMA devices of a NIC and their ports (absent when it has none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma: Vec<RdmaDevice>,
    /// For NUMA nodes: the node's memory origin, tier, HMAT access classes and caches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_memory: Option<NumaMemoryInfo>,
    /// Memory resources.
    pub memory: Vec<MemoryResource>,
    /// Sum of `memory` sizes in bytes.
    pub memory_bytes: u64,
    /// Links of the device by kind (`pcie`, `nvlink`, ...).
    pub link_kinds: BTreeMap<String, usize>,
    /// Backends that contributed.
    pub sources: Vec<String>,
    /// Backend-specific facts.
    pub attrs: BTreeMap<String, String>,
}

/// One link. For hierarchical kinds (`pcie`, `cxl`, `host_attach`) `a` is the upstream end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkDoc {
    /// One end.
    pub a: DeviceId,
    /// The other end.
    pub b: DeviceId,
    /// Kind and shape, tagged by `type`.
    pub kind: LinkKind,
    /// Per-direction bandwidth in MB/s.
    pub bandwidth: Bandwidth,
    /// One-way latency.
    pub latency_ns: Option<u32>,
    /// `up`, `degraded` or `down`.
    pub state: LinkState,
    /// `current / max` bandwidth, rounded to 4 decimals; null when either is unknown.
    pub fraction: Option<f64>,
}

/// A backend's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendDoc {
    /// Backend name.
    pub backend: String,
    /// `present`, `not_present` or `failed`.
    pub state: String,
    /// Why it was not present or failed.
    pub reason: Option<String>,
    /// Devices contributed.
    pub devices: usize,
    /// Attributes it could not read and objects it skipped, with the reason.
    pub unknown: Vec<String>,
    /// Lines past the report's bound that were counted but not kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unknown_omitted: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Hop classes between matrix devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixDoc {
    /// Row and column labels.
    pub labels: Vec<String>,
    /// `classes[i][j]`: how `labels[i]` reaches `labels[j]` (`X`, `NV18`, `PIX`, ...).
    pub classes: Vec<Vec<String>>,
}

/// Counts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SummaryDoc {
    /// Nodes.
    pub nodes: usize,
    /// Devices.
    pub devices: usize,
    /// Devices by kind.
    pub devices_by_kind: BTreeMap<String, usize>,
    /// Links.
    pub links: usize,
    /// Links by kind.
    pub links_by_kind: BTreeMap<String, usize>,
    /// Links by state.
    pub links_by_state: BTreeMap<String, usize>,
    /// Scale-up domains (NVLink/xGMI/UALink/C2C components) by number of compute devices.
    pub scale_up_domains: Vec<DomainSizeDoc>,
}

/// `count` scale-up domains have `size` compute devices each.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DomainSizeDoc {
    /// Compute devices per domain.
    pub size: usize,
    /// Number of such domains.
    pub count: usize,
}

impl HasSchema for TopologyDoc {
    const SCHEMA: &'static str = TOPOLOGY_SCHEMA;
    fn schema(&self) -> &str {
        &self.schema
    }
}

impl HasSchema for DevicesDoc {
    const SCHEMA: &'static str = DEVICES_SCHEMA;
    fn schema(&self) -> &str {
        &self.schema
    }
}

/// Name of a device kind as it appears in documents (`gpu`, `nv_switch`, ...).
pub fn kind_name(kind: DeviceKind) -> String {
    serde_json::to_value(kind).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// Name of a link state as it appears in documents.
pub fn state_name(state: LinkState) -> &'static str {
    match state {
        LinkState::Up => "up",
        LinkState::Degraded => "degraded",
        LinkState::Down => "down",
    }
}

fn round4(x: f64) -> f64 {
    (x * 10_000.0).round() / 10_000.0
}

/// Which devices a document covers.
fn scope(fabric: &Fabric, order: &[DeviceIdx], node: Option<&str>) -> Vec<DeviceIdx> {
    match node {
        None => order.to_vec(),
        Some(n) => order.iter().copied().filter(|&i| fabric.device(i).node.as_deref() == Some(n)).collect(),
    }
}

/// A device as a document entry.
pub fn device_doc(fabric: &Fabric, labels: &MatrixLabels, idx: DeviceIdx) -> DeviceDoc {
    let d = fabric.device(idx);
    let mut link_kinds = BTreeMap::new();
    for (_, li) in fabric.neighbors(idx) {
        *link_kinds.entry(fabric.link(li).kind.name().to_owned()).or_insert(0) += 1;
    }
    DeviceDoc {
        id: d.id.clone(),
        kind: d.kind,
        label: labels.label(idx).map(str::to_owned),
        node: d.node.clone(),
        name: d.name.clone(),
        numa_node: d.numa_node,
        local_cpus: d.local_cpus.clone(),
        parent: fabric.parent(idx).map(|p| fabric.device(p).id.clone()),
        pci: d.pci.clone(),
        gpu: d.gpu.clone(),
        cxl: d.cxl.clone(),
        ualink: d.ualink.clone(),
        rdma: d.rdma.clone(),
        numa_memory: d.numa_memory.clone(),
        memory: d.memory.clone(),
        memory_bytes: d.memory_bytes(),
        link_kinds,
        sources: d.sources.clone(),
        attrs: d.attrs.clone(),
    }
}

/// Sizes of the scale-up domains (compute devices per component of non-down scale-up links).
pub fn scale_up_domain_sizes(fabric: &Fabric, devices: &[DeviceIdx]) -> Vec<DomainSizeDoc> {
    let mut parent: Vec<u32> = (0..fabric.len() as u32).collect();
    fn find(p: &mut [u32], mut x: u32) -> u32 {
        while p[x as usize] != x {
            let g = p[p[x as usize] as usize];
            p[x as usize] = g;
            x = g;
        }
        x
    }
    let inv = fabric.inventory();
    let mut touched = vec![false; fabric.len()];
    for l in inv.links.iter().filter(|l| l.kind.is_scale_up() && l.state != LinkState::Down) {
        let (ra, rb) = (find(&mut parent, l.a.0), find(&mut parent, l.b.0));
        if ra != rb {
            parent[ra.max(rb) as usize] = ra.min(rb);
        }
        touched[l.a.get()] = true;
        touched[l.b.get()] = true;
    }
    let mut size: HashMap<u32, usize> = HashMap::new();
    for &i in devices {
        if touched[i.get()] && fabric.device(i).kind.is_compute() {
            *size.entry(find(&mut parent, i.0)).or_insert(0) += 1;
        }
    }
    let mut hist: BTreeMap<usize, usize> = BTreeMap::new();
    for s in size.into_values() {
        *hist.entry(s).or_insert(0) += 1;
    }
    hist.into_iter().map(|(size, count)| DomainSizeDoc { size, count }).collect()
}

/// Counts over a set of devices and the links among them.
pub fn summary(fabric: &Fabric, devices: &[DeviceIdx], links: &[usize]) -> SummaryDoc {
    let mut devices_by_kind = BTreeMap::new();
    let mut nodes = std::collections::HashSet::new();
    for &i in devices {
        let d = fabric.device(i);
        *devices_by_kind.entry(kind_name(d.kind)).or_insert(0) += 1;
        if let Some(n) = d.node.as_deref() {
            nodes.insert(n);
        }
    }
    let (mut links_by_kind, mut links_by_state) = (BTreeMap::new(), BTreeMap::new());
    for &li in links {
        let l = fabric.link(li);
        *links_by_kind.entry(l.kind.name().to_owned()).or_insert(0) += 1;
        *links_by_state.entry(state_name(l.state).to_owned()).or_insert(0) += 1;
    }
    SummaryDoc {
        nodes: nodes.len(),
        devices: devices.len(),
        devices_by_kind,
        links: links.len(),
        links_by_kind,
        links_by_state,
        scale_up_domains: scale_up_domain_sizes(fabric, devices),
    }
}

/// The links with both ends in `devices`, ordered by the position of their ends.
pub fn links_among(fabric: &Fabric, devices: &[DeviceIdx]) -> Vec<usize> {
    let mut pos = vec![u32::MAX; fabric.len()];
    for (p, &i) in devices.iter().enumerate() {
        pos[i.get()] = p as u32;
    }
    let mut out: Vec<(u32, u32, usize)> = fabric
        .inventory()
        .links
        .iter()
        .enumerate()
        .filter(|(_, l)| pos[l.a.get()] != u32::MAX && pos[l.b.get()] != u32::MAX)
        .map(|(li, l)| (pos[l.a.get()], pos[l.b.get()], li))
        .collect();
    // Parallel links between the same ends keep their relative inventory order.
    out.sort_by_key(|&(a, b, li)| (a, b, li));
    out.into_iter().map(|(_, _, li)| li).collect()
}

/// A link as a document entry.
pub fn link_doc(fabric: &Fabric, li: usize) -> LinkDoc {
    let l = fabric.link(li);
    LinkDoc {
        a: fabric.device(l.a).id.clone(),
        b: fabric.device(l.b).id.clone(),
        kind: l.kind,
        bandwidth: l.bandwidth,
        latency_ns: l.latency_ns,
        state: l.state,
        fraction: l.bandwidth.fraction().map(round4),
    }
}

fn backend_doc(r: &fabric_topology::BackendReport) -> BackendDoc {
    let (state, reason) = match &r.state {
        BackendState::Present => ("present", None),
        BackendState::NotPresent(why) => ("not_present", Some(why.clone())),
        BackendState::Failed(why) => ("failed", Some(why.clone())),
    };
    BackendDoc {
        backend: r.backend.clone(),
        state: state.to_owned(),
        reason,
        devices: r.devices,
        unknown: r.unknown.clone(),
        unknown_omitted: r.unknown_omitted,
    }
}

impl TopologyDoc {
    /// Builds the document for a fabric.
    pub fn from_fabric(fabric: &Fabric, opts: &TopologyOptions) -> Self {
        let order = device_order(fabric);
        let labels = MatrixLabels::from_order(fabric, &order);
        Self::build(fabric, &order, &labels, opts)
    }

    /// Builds the document from a precomputed order and labels.
    pub fn build(fabric: &Fabric, order: &[DeviceIdx], labels: &MatrixLabels, opts: &TopologyOptions) -> Self {
        let (mut head, devices, links) = Self::parts(fabric, order, labels, opts);
        head.devices = devices.iter().map(|&i| device_doc(fabric, labels, i)).collect();
        head.links = links.iter().map(|&li| link_doc(fabric, li)).collect();
        head
    }

    /// The document without devices and links, plus the devices and links in scope.
    fn parts(
        fabric: &Fabric,
        order: &[DeviceIdx],
        labels: &MatrixLabels,
        opts: &TopologyOptions,
    ) -> (Self, Vec<DeviceIdx>, Vec<usize>) {
        let devices = scope(fabric, order, opts.node.as_deref());
        let links = links_among(fabric, &devices);
        let in_scope = |i: DeviceIdx| opts.node.is_none() || fabric.device(i).node == opts.node;
        let matrix_devs: Vec<(String, DeviceIdx)> =
            labels.entries().iter().filter(|(_, i)| in_scope(*i)).cloned().collect();
        let matrix = (matrix_devs.len() <= MATRIX_LIMIT && !matrix_devs.is_empty()).then(|| MatrixDoc {
            labels: matrix_devs.iter().map(|(l, _)| l.clone()).collect(),
            classes: matrix_devs
                .iter()
                .map(|&(_, a)| matrix_devs.iter().map(|&(_, b)| fabric.classify(a, b).to_string()).collect())
                .collect(),
        });
        let nodes = match &opts.node {
            Some(n) => vec![n.clone()],
            None => sorted_nodes(fabric),
        };
        let head = Self {
            schema: TOPOLOGY_SCHEMA.to_owned(),
            nodes,
            summary: summary(fabric, &devices, &links),
            labels: matrix_devs
                .iter()
                .map(|(l, i)| LabelDoc { label: l.clone(), id: fabric.device(*i).id.clone() })
                .collect(),
            devices: Vec::new(),
            links: Vec::new(),
            cxl: fabric.inventory().cxl.clone(),
            hmem: fabric.inventory().hmem.clone(),
            backends: fabric.inventory().backends.iter().map(backend_doc).collect(),
            matrix,
        };
        (head, devices, links)
    }
}

/// Serializes a sequence lazily, one element at a time.
struct Lazy<F>(F);

impl<F, I, T> Serialize for Lazy<F>
where
    F: Fn() -> I,
    I: Iterator<Item = T>,
    T: Serialize,
{
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq((self.0)())
    }
}

/// The same fields as [`TopologyDoc`], with devices and links produced while writing.
#[derive(Serialize)]
struct TopologyStream<'a, D: Serialize, L: Serialize> {
    schema: &'a str,
    nodes: Vec<String>,
    summary: SummaryDoc,
    labels: Vec<LabelDoc>,
    devices: D,
    links: L,
    cxl: &'a CxlInventory,
    #[serde(skip_serializing_if = "HmemInventory::is_empty")]
    hmem: &'a HmemInventory,
    backends: Vec<BackendDoc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    matrix: Option<MatrixDoc>,
}

/// Writes the topology document (pretty JSON) without materialising every device and
/// link entry first, so that a 100,000-GPU fabric streams in bounded extra memory. The
/// bytes are identical to serialising [`TopologyDoc::build`].
pub fn write_topology<W: std::io::Write>(
    w: W,
    fabric: &Fabric,
    order: &[DeviceIdx],
    labels: &MatrixLabels,
    opts: &TopologyOptions,
) -> serde_json::Result<()> {
    let (head, devices, links) = TopologyDoc::parts(fabric, order, labels, opts);
    let doc = TopologyStream {
        schema: TOPOLOGY_SCHEMA,
        nodes: head.nodes,
        summary: head.summary,
        labels: head.labels,
        devices: Lazy(|| devices.iter().map(|&i| device_doc(fabric, labels, i))),
        links: Lazy(|| links.iter().map(|&li| link_doc(fabric, li))),
        cxl: &fabric.inventory().cxl,
        hmem: &fabric.inventory().hmem,
        backends: head.backends,
        matrix: head.matrix,
    };
    serde_json::to_writer_pretty(w, &doc)
}

/// Writes the devices document (pretty JSON), producing entries while writing; the bytes
/// are identical to serialising [`DevicesDoc::from_fabric`].
pub fn write_devices<W: std::io::Write>(w: W, fabric: &Fabric, node: Option<&str>) -> serde_json::Result<()> {
    #[derive(Serialize)]
    struct DevicesStream<'a, D: Serialize> {
        schema: &'a str,
        devices: D,
    }
    let order = device_order(fabric);
    let labels = MatrixLabels::from_order(fabric, &order);
    let devices = scope(fabric, &order, node);
    let doc = DevicesStream {
        schema: DEVICES_SCHEMA,
        devices: Lazy(|| devices.iter().map(|&i| device_doc(fabric, &labels, i))),
    };
    serde_json::to_writer_pretty(w, &doc)
}

impl DevicesDoc {
    /// Every device of the fabric (or of one node).
    pub fn from_fabric(fabric: &Fabric, node: Option<&str>) -> Self {
        let order = device_order(fabric);
        let labels = MatrixLabels::from_order(fabric, &order);
        let devices = scope(fabric, &order, node);
        Self {
            schema: DEVICES_SCHEMA.to_owned(),
            devices: devices.iter().map(|&i| device_doc(fabric, &labels, i)).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use fabric_topology::{Device, Inventory, Link};
    use serde_json::Value;

    use super::*;
    use crate::parse_doc;

    fn tiny() -> Fabric {
        let mut inv = Inventory::new();
        let mut cpu = Device::new(DeviceId::named("n1", "numa0"), DeviceKind::Cpu, Some("n1"));
        cpu.numa_node = Some(0);
        let cpu = inv.add_device(cpu).expect("cpu");
        let addr = "0000:17:00.0".parse().expect("addr");
        let mut g = Device::new(DeviceId::uuid("GPU-b"), DeviceKind::Gpu, Some("n1"));
        g.pci = Some(PciInfo { address: Some(addr), ..PciInfo::default() });
        let g = inv.add_device(g).expect("gpu");
        let addr2 = "0000:03:00.0".parse().expect("addr");
        let mut g2 = Device::new(DeviceId::uuid("GPU-a"), DeviceKind::Gpu, Some("n1"));
        g2.pci = Some(PciInfo { address: Some(addr2), ..PciInfo::default() });
        let g2 = inv.add_device(g2).expect("gpu");
        inv.add_link(Link::pcie(cpu, g, (Some(4), Some(8)), (Some(4), Some(16))));
        inv.add_link(Link::pcie(cpu, g2, (Some(4), Some(16)), (Some(4), Some(16))));
        Fabric::build(inv).expect("fabric")
    }

    fn keys(v: &Value) -> Vec<&str> {
        v.as_object().expect("object").keys().map(String::as_str).collect()
    }

    /// Pins the field names of v1: renaming or removing one is a breaking change that
    /// needs a new schema version (docs/topology-json.md, "Compatibility").
    #[test]
    fn v1_field_names_are_stable() {
        let doc = TopologyDoc::from_fabric(&tiny(), &TopologyOptions::default());
        let v = serde_json::to_value(&doc).expect("json");
        let mut top = keys(&v);
        top.sort_unstable();
        assert_eq!(top, ["backends", "cxl", "devices", "labels", "links", "matrix", "nodes", "schema", "summary"]);
        let mut dev = keys(&v["devices"][0]);
        dev.sort_unstable();
        assert_eq!(
            dev,
            [
                "attrs",
                "cxl",
                "gpu",
                "id",
                "kind",
                "label",
                "link_kinds",
                "local_cpus",
                "memory",
                "memory_bytes",
                "name",
                "node",
                "numa_node",
                "parent",
                "pci",
                "sources",
                "ualink"
            ]
        );
        let mut link = keys(&v["links"][0]);
        link.sort_unstable();
        assert_eq!(link, ["a", "b", "bandwidth", "fraction", "kind", "latency_ns", "state"]);
        assert_eq!(v["links"][0]["kind"]["type"], "pcie");
        let mut s = keys(&v["summary"]);
        s.sort_unstable();
        assert_eq!(
            s,
            ["devices", "devices_by_kind", "links", "links_by_kind", "links_by_state", "nodes", "scale_up_domains"]
        );
    }

    #[test]
    fn devices_and_labels_follow_pci_order_not_discovery_order() {
        let doc = TopologyDoc::from_fabric(&tiny(), &TopologyOptions::default());
        let ids: Vec<&str> = doc.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["uuid:GPU-a", "uuid:GPU-b", "name:n1/numa0"]);
        assert_eq!(doc.labels[0], LabelDoc { label: "GPU0".into(), id: DeviceId::uuid("GPU-a") });
        let m = doc.matrix.as_ref().expect("matrix");
        assert_eq!(m.classes, [["X", "NODE"], ["NODE", "X"]].map(|r| r.map(String::from).to_vec()).to_vec());
        let degraded = doc.links.iter().find(|l| l.state == LinkState::Degraded).expect("degraded");
        assert_eq!(degraded.fraction, Some(0.5));
        let text = serde_json::to_string(&doc).expect("json");
        assert_eq!(parse_doc::<TopologyDoc>(&text).expect("parse"), doc);
        let devices = DevicesDoc::from_fabric(&tiny(), Some("n1"));
        assert_eq!(devices.devices.len(), 3);
        assert!(parse_doc::<DevicesDoc>(&text).is_err(), "a topology document is not a devices document");
    }
}
