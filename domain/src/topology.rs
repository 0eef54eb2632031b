//! `topology/<node>`: what a node publishes of its inventory for the domain's one
//! topology — its devices (identity, kind, memory), the links among them and to the
//! fabric-level switches it reaches — with its strict checks. [`crate::domain_fabric`]
//! merges every node's record into one inventory, classified by the topology crate.
//!
//! Like the other records only their node writes, a topology record is read
//! **tolerantly** ([`crate::tolerant`]): fields this build does not know (added by a newer
//! node: more details of a device, its PCI function, a link) are ignored rather than
//! refused, a device of a kind it does not know is shown as `other`, and a link or memory
//! resource of a kind it does not know is left out, so nodes of different versions still
//! show each other's topology, each with the details it knows. Every field it does know is
//! checked as strictly as ever, and the record's size bound holds.

use std::collections::HashSet;

use fabric_topology::{DeviceId, DeviceIdx, DeviceKind, Fabric, LinkKind, LinkState, MemoryKind, PciAddress};
use serde::{Deserialize, Serialize};

use crate::records::{RECORD_VERSION, Record, RecordError, check_node_name, invalid};

/// Most devices one node's topology record lists.
pub const MAX_TOPOLOGY_DEVICES: usize = 1024;
/// Most links one node's topology record lists.
pub const MAX_TOPOLOGY_LINKS: usize = 4096;
/// Most memory resources one device lists.
pub const MAX_DEVICE_MEMORY: usize = 16;
/// Longest device identity.
pub const MAX_DEVICE_ID_LEN: usize = 256;
/// Longest device name.
pub const MAX_DEVICE_NAME_LEN: usize = 128;

/// NUMA node numbers a record may state: below this (the kernel's largest
/// `MAX_NUMNODES` is 1,024).
pub const MAX_NUMA_NODE: u32 = 1 << 16;

/// Longest cpulist a record may state.
pub const MAX_CPULIST_LEN: usize = 256;

/// `topology/<node>`: the node's part of the domain's topology, written after discovery
/// and after each rescan that changes it (a fenced write, no lease: like the placements, it
/// outlives the daemon, so a node that is down is still shown, marked so).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyRecord {
    /// Format version.
    pub version: u32,
    /// The node.
    pub node: String,
    /// Its incarnation when it wrote this record.
    pub incarnation: u64,
    /// Its devices, then the fabric-level switches they link to; identities unique.
    pub devices: Vec<TopologyDevice>,
    /// Links among them; ends index `devices`.
    #[serde(deserialize_with = "crate::tolerant::known")]
    pub links: Vec<TopologyLink>,
}

/// One device of a node's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyDevice {
    /// Stable identity.
    pub id: DeviceId,
    /// What it is.
    #[serde(deserialize_with = "crate::tolerant::device_kind")]
    pub kind: DeviceKind,
    /// Display name (model), when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A fabric-level switch, of no node: several nodes publish it, the domain holds one.
    #[serde(default, skip_serializing_if = "is_false")]
    pub fabric: bool,
    /// The memory it exposes.
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "crate::tolerant::known")]
    pub memory: Vec<TopologyMemory>,
    /// The NUMA node it is local to, when known (below [`MAX_NUMA_NODE`]). Optional, so a
    /// record written before it existed still decodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// The CPUs local to it, as a kernel cpulist (`0-3,8-11`, at most
    /// [`MAX_CPULIST_LEN`] bytes), when known. Optional like `numa_node`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_cpus: Option<String>,
    /// Its PCI function, when it is one. Optional like `numa_node`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci: Option<TopologyPci>,
}

/// What the domain shows of a device's PCI function: where it is, what it is, and its
/// driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyPci {
    /// Its address on its node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<PciAddress>,
    /// 24-bit class code.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<u32>,
    /// Vendor id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor_id: Option<u16>,
    /// Device id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_id: Option<u16>,
    /// The bound kernel driver (at most [`MAX_DRIVER_LEN`] bytes, no control characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver: Option<String>,
    /// Subsystem vendor id (the board's maker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subsystem_vendor_id: Option<u16>,
    /// Subsystem device id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subsystem_device_id: Option<u16>,
    /// Vendor and device names from the node's PCI id database (display only; each at
    /// most [`MAX_PCI_NAME_LEN`] bytes, no control characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor_name: Option<String>,
    /// See `vendor_name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_name: Option<String>,
    /// The link as trained now and as built: speed in MT/s (2.5 GT/s is 2500; at most
    /// [`MAX_LINK_SPEED_MTS`]) and width in lanes (1, 2, 4, 8, 12, 16 or 32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_speed_mts: Option<u32>,
    /// See `link_speed_mts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_width: Option<u8>,
    /// See `link_speed_mts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_link_speed_mts: Option<u32>,
    /// See `link_speed_mts`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_link_width: Option<u8>,
    /// Its assigned BARs (at most 7, by index: 0–5 and 6, the expansion ROM; each once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bars: Vec<TopologyBar>,
}

/// A BAR as the domain shows it: its size and kind, not where the node put it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyBar {
    /// BAR index (6: the expansion ROM).
    pub index: u8,
    /// Bytes (not zero).
    pub size: u64,
    /// Memory (rather than I/O ports).
    #[serde(default, skip_serializing_if = "is_false")]
    pub memory: bool,
    /// Prefetchable memory.
    #[serde(default, skip_serializing_if = "is_false")]
    pub prefetchable: bool,
    /// A 64-bit memory BAR.
    #[serde(default, skip_serializing_if = "is_false")]
    pub mem64: bool,
}

/// Longest vendor or device name a record may state.
pub const MAX_PCI_NAME_LEN: usize = 128;
/// Fastest link speed a record may state, MT/s (PCIe 7 is 128,000).
pub const MAX_LINK_SPEED_MTS: u32 = 1_000_000;
/// Most BARs of one function (six and the expansion ROM).
pub const MAX_BARS: usize = 7;

/// A link width a PCIe link may have.
fn valid_width(width: u8) -> bool {
    matches!(width, 1 | 2 | 4 | 8 | 12 | 16 | 32)
}

/// GT/s as the kernel reports it, in MT/s; `None` outside `(0, MAX_LINK_SPEED_MTS]`.
fn speed_mts(gts: f64) -> Option<u32> {
    let mts = (gts * 1000.0).round();
    (mts.is_finite() && mts >= 1.0 && mts <= f64::from(MAX_LINK_SPEED_MTS)).then_some(mts as u32)
}

/// A display name a record may state.
fn valid_pci_name(name: &str) -> bool {
    name.len() <= MAX_PCI_NAME_LEN && !name.chars().any(char::is_control)
}

/// Longest driver name a record may state.
pub const MAX_DRIVER_LEN: usize = 64;

/// A PCI class code: 24 bits.
fn valid_class(class: u32) -> bool {
    class <= 0xff_ffff
}

/// A driver name a record may state: at most [`MAX_DRIVER_LEN`] bytes, no control
/// characters.
fn valid_driver(driver: &str) -> bool {
    driver.len() <= MAX_DRIVER_LEN && !driver.chars().any(char::is_control)
}

impl TopologyPci {
    /// The part of `pci` a record carries (a driver name past [`MAX_DRIVER_LEN`] or with
    /// control characters left out).
    fn of(pci: &fabric_topology::PciInfo) -> Self {
        use fabric_topology::device::Bar;
        let name = |n: &Option<String>| n.clone().filter(|n| valid_pci_name(n));
        let mut bars: Vec<TopologyBar> = Vec::new();
        for b in &pci.bars {
            if b.size > 0 && usize::from(b.index) < MAX_BARS && !bars.iter().any(|o| o.index == b.index) {
                bars.push(TopologyBar {
                    index: b.index,
                    size: b.size,
                    memory: b.flags & Bar::FLAG_MEM != 0,
                    prefetchable: b.flags & Bar::FLAG_PREFETCH != 0,
                    mem64: b.flags & Bar::FLAG_MEM64 != 0,
                });
            }
        }
        bars.sort_by_key(|b| b.index);
        Self {
            address: pci.address,
            class: pci.class.filter(|c| valid_class(*c)),
            vendor_id: pci.vendor_id,
            device_id: pci.device_id,
            driver: pci.driver.clone().filter(|d| valid_driver(d)),
            subsystem_vendor_id: pci.subsystem_vendor_id,
            subsystem_device_id: pci.subsystem_device_id,
            vendor_name: name(&pci.vendor_name),
            device_name: name(&pci.device_name),
            link_speed_mts: pci.link_speed_gts.and_then(speed_mts),
            link_width: pci.link_width.filter(|w| valid_width(*w)),
            max_link_speed_mts: pci.max_link_speed_gts.and_then(speed_mts),
            max_link_width: pci.max_link_width.filter(|w| valid_width(*w)),
            bars,
        }
    }

    /// As the topology crate holds it (a BAR's start, which stays on its node, is 0).
    pub fn info(&self) -> fabric_topology::PciInfo {
        use fabric_topology::device::Bar;
        let gts = |mts: Option<u32>| mts.map(|m| f64::from(m) / 1000.0);
        let flag = |on: bool, f: u64| if on { f } else { 0 };
        fabric_topology::PciInfo {
            address: self.address,
            class: self.class,
            vendor_id: self.vendor_id,
            device_id: self.device_id,
            driver: self.driver.clone(),
            subsystem_vendor_id: self.subsystem_vendor_id,
            subsystem_device_id: self.subsystem_device_id,
            vendor_name: self.vendor_name.clone(),
            device_name: self.device_name.clone(),
            link_speed_gts: gts(self.link_speed_mts),
            link_width: self.link_width,
            max_link_speed_gts: gts(self.max_link_speed_mts),
            max_link_width: self.max_link_width,
            bars: self
                .bars
                .iter()
                .map(|b| Bar {
                    index: b.index,
                    start: 0,
                    size: b.size,
                    flags: flag(b.memory, Bar::FLAG_MEM)
                        | flag(b.prefetchable, Bar::FLAG_PREFETCH)
                        | flag(b.mem64, Bar::FLAG_MEM64),
                })
                .collect(),
            ..Default::default()
        }
    }

    /// Why the record cannot carry this, if it cannot.
    fn refusal(&self) -> Option<String> {
        if self.class.is_some_and(|c| !valid_class(c)) {
            return Some("a class past 24 bits".into());
        }
        if self.driver.as_deref().is_some_and(|n| !valid_driver(n)) {
            return Some(format!("a driver of more than {MAX_DRIVER_LEN} bytes or with control characters"));
        }
        if [&self.vendor_name, &self.device_name].into_iter().flatten().any(|n| !valid_pci_name(n)) {
            return Some(format!("a name of more than {MAX_PCI_NAME_LEN} bytes or with control characters"));
        }
        let speed_ok = |s: Option<u32>| s.is_none_or(|s| s > 0 && s <= MAX_LINK_SPEED_MTS);
        if !speed_ok(self.link_speed_mts) || !speed_ok(self.max_link_speed_mts) {
            return Some(format!("a link speed of 0 or past {MAX_LINK_SPEED_MTS} MT/s"));
        }
        if [self.link_width, self.max_link_width].into_iter().flatten().any(|w| !valid_width(w)) {
            return Some("a link width that is no PCIe width".into());
        }
        let sorted = self.bars.windows(2).all(|w| w[0].index < w[1].index);
        if self.bars.len() > MAX_BARS
            || !sorted
            || self.bars.iter().any(|b| usize::from(b.index) >= MAX_BARS || b.size == 0)
        {
            return Some(format!("BARs not sorted by index, an index past {}, or a BAR of no size", MAX_BARS - 1));
        }
        None
    }
}

/// A memory resource of a device: its kind and size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyMemory {
    /// Kind of memory.
    pub kind: MemoryKind,
    /// Bytes.
    pub size: u64,
}

/// A link between two devices of the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyLink {
    /// One end (upstream for hierarchical kinds): an index into the record's devices.
    pub a: u32,
    /// The other end.
    pub b: u32,
    /// Kind and kind-specific shape (NVLink generation and count, ...).
    pub kind: LinkKind,
    /// Per-direction bandwidth now, MB/s, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_mbps: Option<u64>,
    /// Per-direction bandwidth the link is built for, MB/s, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_mbps: Option<u64>,
    /// One-way latency, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u32>,
    /// Up, degraded or down.
    pub state: LinkState,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The kinds a fabric-level device may be: switches shared by nodes.
pub fn is_fabric_switch(kind: DeviceKind) -> bool {
    matches!(kind, DeviceKind::NvSwitch | DeviceKind::UalinkSwitch | DeviceKind::CxlSwitch | DeviceKind::NetworkSwitch)
}

/// Whether `d` is a fabric-level switch: of no node, of a switch kind (what the rings of a
/// node's record are made of).
pub fn is_shared_switch(d: &fabric_topology::Device) -> bool {
    d.node.is_none() && is_fabric_switch(d.kind)
}

/// Whether a record lists `d` among its node's devices: all but storage controllers and
/// other functions without memory, which no path passes through and no matrix shows.
pub fn is_published(d: &fabric_topology::Device) -> bool {
    !matches!(d.kind, DeviceKind::Storage | DeviceKind::Other) || !d.memory.is_empty()
}

impl TopologyRecord {
    /// The record of `node` in `fabric`: the node's devices (all but storage controllers and
    /// other functions without memory, which no path passes through and no matrix shows),
    /// then the fabric-level switches (devices of no node) around them, ring by ring of
    /// hops, as many whole rings as keep the record within [`MAX_TOPOLOGY_DEVICES`],
    /// [`MAX_TOPOLOGY_LINKS`] and `max_bytes` encoded (`nearby.rs`: every switch of a
    /// small fabric, the leaves and spines above the node in a large network), and the links
    /// among them.
    ///
    /// The NVSwitches of an NVL rack sit in switch trays that a compute node does not see:
    /// NVML names them by type only, and the node's inventory has one node-level stand-in
    /// for them (no PCI address). When every GPU on NVLink to such a stand-in is in one
    /// NVLink clique (NVML's cluster UUID and clique id), the record publishes it as the
    /// clique's fabric-level switch, [`clique_switch`]: every node of the clique names the
    /// same one, so the domain's topology joins their GPUs through it (NV18 across trays,
    /// as through the sim's fabric switches).
    pub fn from_fabric(fabric: &Fabric, node: &str, incarnation: u64, max_bytes: usize) -> Self {
        let own = devices(fabric).filter(|&i| fabric.device(i).node.as_deref() == Some(node));
        Self::around(fabric, node, own.collect(), incarnation, max_bytes)
    }

    /// The records of every node of `fabric`, as [`TopologyRecord::from_fabric`] makes each,
    /// in one pass over its devices (a sim of a whole cluster: 12,500 nodes).
    pub fn of_every_node(fabric: &Fabric, incarnation: u64, max_bytes: usize) -> Vec<Self> {
        let at: std::collections::HashMap<&str, usize> =
            fabric.nodes().iter().enumerate().map(|(k, n)| (n.as_str(), k)).collect();
        let mut by_node: Vec<Vec<DeviceIdx>> = vec![Vec::new(); fabric.nodes().len()];
        for i in devices(fabric) {
            if let Some(k) = fabric.device(i).node.as_deref().and_then(|n| at.get(n)) {
                by_node[*k].push(i);
            }
        }
        fabric
            .nodes()
            .iter()
            .zip(by_node)
            .map(|(n, own)| Self::around(fabric, n, own, incarnation, max_bytes))
            .collect()
    }

    /// The record of `node` whose own devices are `own` (module docs of `nearby.rs`).
    fn around(fabric: &Fabric, node: &str, own: Vec<DeviceIdx>, incarnation: u64, max_bytes: usize) -> Self {
        let own: Vec<DeviceIdx> =
            own.into_iter().filter(|&i| is_published(fabric.device(i))).take(MAX_TOPOLOGY_DEVICES).collect();
        let rings = crate::nearby::Rings::around(fabric, own, MAX_TOPOLOGY_DEVICES);
        // The widest whole rings that fit; at least the node's own devices and the switches
        // they link to (without those the node would look cut off from every fabric), and
        // the publisher refuses that if it is over the bound: the domain then shows no
        // topology of the node rather than a wrong one.
        let least = rings.ends[..rings.ends.len().min(2)].last().copied().unwrap_or_default();
        let mut record = None;
        for &count in rings.ends.iter().rev() {
            let mut r = Self::of_devices(fabric, node, incarnation, &rings.devices[..count]);
            // The incarnation is written again when the record is published: leave room
            // for its longest form.
            let fits = r.links.len() <= MAX_TOPOLOGY_LINKS
                && crate::records::encode(&r).len() + u64::MAX.to_string().len() <= max_bytes;
            if fits || count <= least {
                r.links.truncate(MAX_TOPOLOGY_LINKS);
                record = Some(r);
                break;
            }
        }
        record.unwrap_or_else(|| Self::of_devices(fabric, node, incarnation, &[]))
    }

    /// The record listing `devices` (the node's own, then fabric-level switches) and the
    /// links among them.
    fn of_devices(fabric: &Fabric, node: &str, incarnation: u64, chosen: &[DeviceIdx]) -> Self {
        let index: std::collections::HashMap<DeviceIdx, u32> =
            chosen.iter().zip(0u32..).map(|(&i, k)| (i, k)).collect();
        let devices = chosen
            .iter()
            .map(|&i| {
                let d = fabric.device(i);
                let own = d.node.as_deref() == Some(node);
                let clique =
                    (own && d.kind == DeviceKind::NvSwitch && d.pci_address().is_none()).then(|| clique_of(fabric, i));
                let clique = clique.flatten();
                let (id, name) = match &clique {
                    Some((cluster, id)) => {
                        (clique_switch(cluster, *id), Some(format!("NVLink clique {id} of cluster {cluster}")))
                    }
                    None => (d.id.clone(), d.name.clone()),
                };
                TopologyDevice {
                    id,
                    kind: d.kind,
                    name: name.map(|n| n.chars().filter(|c| !c.is_control()).take(MAX_DEVICE_NAME_LEN).collect()),
                    fabric: !own || clique.is_some(),
                    memory: d
                        .memory
                        .iter()
                        .take(MAX_DEVICE_MEMORY)
                        .map(|m| TopologyMemory { kind: m.kind, size: m.size })
                        .collect(),
                    numa_node: d.numa_node.filter(|n| *n < MAX_NUMA_NODE),
                    local_cpus: d
                        .local_cpus
                        .as_ref()
                        .filter(|c| !c.is_empty())
                        .map(ToString::to_string)
                        .filter(|c| c.len() <= MAX_CPULIST_LEN),
                    pci: d.pci.as_ref().map(TopologyPci::of),
                }
            })
            .collect();
        // Membership as a bit per device of the fabric: the spines of a large network have
        // thousands of neighbours each, every one of them asked about.
        let mut among = vec![0u64; fabric.len().div_ceil(64)];
        for &i in chosen {
            among[i.get() / 64] |= 1 << (i.get() % 64);
        }
        let links =
            crate::nearby::Rings::links_among(fabric, chosen, |d| among[d.get() / 64] & (1 << (d.get() % 64)) != 0)
                .into_iter()
                .filter_map(|li| {
                    let l = fabric.link(li);
                    Some(TopologyLink {
                        a: *index.get(&l.a)?,
                        b: *index.get(&l.b)?,
                        kind: l.kind,
                        current_mbps: l.bandwidth.current_mbps,
                        max_mbps: l.bandwidth.max_mbps,
                        latency_ns: l.latency_ns,
                        state: l.state,
                    })
                })
                .collect();
        Self { version: RECORD_VERSION, node: node.to_owned(), incarnation, devices, links }
    }

    /// The device a link end names.
    pub fn device(&self, end: u32) -> Option<&TopologyDevice> {
        self.devices.get(usize::try_from(end).ok()?)
    }

    fn check(&self) -> Result<(), RecordError> {
        check_node_name("node", &self.node)?;
        if self.incarnation == 0 {
            return Err(invalid("incarnation", "0 is not an incarnation".into()));
        }
        if self.devices.len() > MAX_TOPOLOGY_DEVICES {
            return Err(invalid("devices", format!("more than {MAX_TOPOLOGY_DEVICES}")));
        }
        if self.links.len() > MAX_TOPOLOGY_LINKS {
            return Err(invalid("links", format!("more than {MAX_TOPOLOGY_LINKS}")));
        }
        let mut ids = HashSet::with_capacity(self.devices.len());
        for d in &self.devices {
            if d.id.as_str().len() > MAX_DEVICE_ID_LEN {
                return Err(invalid("devices.id", format!("longer than {MAX_DEVICE_ID_LEN} bytes")));
            }
            if d.name.as_ref().is_some_and(|n| n.len() > MAX_DEVICE_NAME_LEN || n.chars().any(char::is_control)) {
                return Err(invalid(
                    "devices.name",
                    format!("{}: more than {MAX_DEVICE_NAME_LEN} bytes, or control characters", d.id),
                ));
            }
            if !ids.insert(&d.id) {
                return Err(invalid("devices.id", format!("{} is listed twice", d.id)));
            }
            if d.fabric && !is_fabric_switch(d.kind) {
                return Err(invalid("devices.fabric", format!("{} is no switch; only switches are shared", d.id)));
            }
            if !d.fabric && d.id.as_str().starts_with("name:fabric/") {
                return Err(invalid("devices.fabric", format!("{} names the fabric, not a node", d.id)));
            }
            if d.memory.len() > MAX_DEVICE_MEMORY {
                return Err(invalid("devices.memory", format!("{} lists more than {MAX_DEVICE_MEMORY}", d.id)));
            }
            if d.numa_node.is_some_and(|n| n >= MAX_NUMA_NODE) {
                return Err(invalid("devices.numa_node", format!("{}: not below {MAX_NUMA_NODE}", d.id)));
            }
            if let Some(cpus) = &d.local_cpus
                && (cpus.len() > MAX_CPULIST_LEN || cpus.parse::<fabric_topology::CpuSet>().is_err())
            {
                return Err(invalid(
                    "devices.local_cpus",
                    format!("{}: not a cpulist of at most {MAX_CPULIST_LEN} bytes", d.id),
                ));
            }
            if let Some(why) = d.pci.as_ref().and_then(TopologyPci::refusal) {
                return Err(invalid("devices.pci", format!("{}: {why}", d.id)));
            }
            if d.memory.iter().try_fold(0u64, |sum, m| sum.checked_add(m.size)).is_none() {
                return Err(invalid("devices.memory", format!("{}: sizes add up beyond 2^64", d.id)));
            }
        }
        for l in &self.links {
            let len = self.devices.len();
            if self.device(l.a).is_none() || self.device(l.b).is_none() || l.a == l.b {
                return Err(invalid("links", format!("{} - {} does not join two of the {len} devices", l.a, l.b)));
            }
        }
        Ok(())
    }
}

/// Every device of `fabric`.
fn devices(fabric: &Fabric) -> impl Iterator<Item = DeviceIdx> {
    (0..u32::try_from(fabric.len()).unwrap_or(u32::MAX)).map(DeviceIdx)
}

/// The fabric-level switch standing for NVLink clique `clique` of cluster `cluster`: the
/// NVSwitches its GPUs reach, which no compute node sees (see
/// [`TopologyRecord::from_fabric`]).
pub fn clique_switch(cluster: &str, clique: u32) -> DeviceId {
    DeviceId::serial("nvlink-clique", &format!("{cluster}.{clique}"))
}

/// The one NVLink clique of the GPUs on NVLink to `switch`, when they all have the same
/// (and there is at least one).
fn clique_of(fabric: &Fabric, switch: DeviceIdx) -> Option<(String, u32)> {
    let mut found: Option<(String, u32)> = None;
    for (other, li) in fabric.neighbors(switch) {
        if !matches!(fabric.link(li).kind, LinkKind::NvLink { .. }) {
            continue;
        }
        let gpu = fabric.device(other);
        if gpu.kind != DeviceKind::Gpu {
            continue;
        }
        let info = gpu.gpu.as_ref();
        let this = (info?.fabric_cluster.clone().filter(|c| valid_cluster(c))?, info?.fabric_clique?);
        match &found {
            Some(f) if *f != this => return None,
            _ => found = Some(this),
        }
    }
    found
}

/// A cluster UUID as NVML formats it: hex digits and dashes, at most 64 bytes.
fn valid_cluster(c: &str) -> bool {
    !c.is_empty() && c.len() <= 64 && c.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
}

impl Record for TopologyRecord {
    fn validate(&self) -> Result<(), RecordError> {
        self.check()
    }
}

/// A link end as an index of the merged inventory (`end` was checked in range).
pub(crate) fn end(indexes: &[DeviceIdx], end: u32) -> Option<DeviceIdx> {
    indexes.get(usize::try_from(end).ok()?).copied()
}

#[cfg(test)]
mod tests {
    use fabric_topology::{Bandwidth, Device, Inventory, Link, MemoryResource};
    use proptest::prelude::*;

    use super::*;
    use crate::records::{DEFAULT_MAX_RECORD_BYTES, RecordLimits, decode, encode};

    /// A tray: a CPU, a GPU with HBM on NVLink to a fabric switch, an NVMe drive.
    pub(crate) fn tray(node: &str) -> Fabric {
        let mut inv = Inventory::new();
        let mut numa = Device::new(DeviceId::named(node, "numa0"), DeviceKind::Cpu, Some(node));
        numa.numa_node = Some(0);
        numa.local_cpus = Some("0-15,32-47".parse().unwrap());
        let cpu = inv.add_device(numa).unwrap();
        let mut gpu = Device::new(DeviceId::uuid(&format!("GPU-{node}")), DeviceKind::Gpu, Some(node));
        gpu.numa_node = Some(1);
        gpu.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 1 << 30, hpa: None, numa_node: None });
        gpu.pci = Some(fabric_topology::PciInfo {
            address: Some("0000:17:00.0".parse().unwrap()),
            class: Some(0x03_0200),
            vendor_id: Some(0x10de),
            device_id: Some(0x2335),
            driver: Some("nvidia".into()),
            subsystem_vendor_id: Some(0x10de),
            subsystem_device_id: Some(0x18be),
            vendor_name: Some("NVIDIA Corporation".into()),
            device_name: Some("GH100 [H200 SXM 141GB]".into()),
            link_speed_gts: Some(32.0),
            link_width: Some(16),
            max_link_speed_gts: Some(32.0),
            max_link_width: Some(16),
            bars: vec![
                fabric_topology::device::Bar { index: 0, start: 0xa000_0000, size: 16 << 20, flags: 0x0004_0200 },
                fabric_topology::device::Bar { index: 2, start: 0x38_0000_0000, size: 256 << 30, flags: 0x0014_220c },
                fabric_topology::device::Bar { index: 4, start: 0x3a_0000_0000, size: 32 << 20, flags: 0x0014_220c },
            ],
            ..Default::default()
        });
        let gpu = inv.add_device(gpu).unwrap();
        let nvme =
            inv.add_device(Device::new(DeviceId::named(node, "nvme0"), DeviceKind::Storage, Some(node))).unwrap();
        let sw = inv.add_device(Device::new(DeviceId::named("fabric", "nvsw0"), DeviceKind::NvSwitch, None)).unwrap();
        inv.add_link(Link::new(cpu, gpu, LinkKind::C2c, Bandwidth::full(450_000), None));
        inv.add_link(Link::new(cpu, nvme, LinkKind::HostAttach, Bandwidth::default(), None));
        inv.add_link(Link::new(gpu, sw, LinkKind::NvLink { generation: 5, count: 18 }, Bandwidth::full(900_000), None));
        Fabric::build(inv).unwrap()
    }

    #[test]
    fn fields_of_a_newer_node_are_ignored_and_known_ones_still_checked() {
        let record = TopologyRecord::from_fabric(&tray("tray0"), "tray0", 3, DEFAULT_MAX_RECORD_BYTES);
        let mut value: serde_json::Value = serde_json::from_slice(&encode(&record)).unwrap();
        value["cables"] = serde_json::json!([{ "a": 0, "b": 1 }]);
        value["devices"][1]["firmware"] = serde_json::json!("96.00.5e.00.01");
        value["devices"][1]["pci"]["aer_errors"] = serde_json::json!(0);
        value["devices"][1]["pci"]["bars"][0]["resizable"] = serde_json::json!(true);
        value["devices"][1]["memory"][0]["ecc"] = serde_json::json!("on");
        value["links"][0]["cable"] = serde_json::json!({ "length_m": 2 });
        let newer = serde_json::to_vec(&value).unwrap();
        assert_eq!(decode::<TopologyRecord>(&newer, RecordLimits::default()), Ok(record));
        // What this build knows is still checked, and the size bound still holds.
        value["devices"][1]["pci"]["link_width"] = serde_json::json!(3);
        let bad = serde_json::to_vec(&value).unwrap();
        assert!(matches!(
            decode::<TopologyRecord>(&bad, RecordLimits::default()),
            Err(RecordError::Invalid { field: "devices.pci", .. })
        ));
        value["devices"][1]["pci"]["link_width"] = serde_json::json!(16);
        value["padding"] = serde_json::json!("x".repeat(70_000));
        let big = serde_json::to_vec(&value).unwrap();
        assert!(matches!(decode::<TopologyRecord>(&big, RecordLimits::default()), Err(RecordError::Oversized { .. })));
    }

    /// A NIC under a leaf with 100 spines above it, each cabled to each of 100 cores (the
    /// NIC's cable added last, so it is the last link of the inventory).
    fn tall(cores: usize) -> Fabric {
        let mut inv = Inventory::new();
        let nic = inv.add_device(Device::new(DeviceId::named("n0", "nic0"), DeviceKind::Nic, Some("n0"))).unwrap();
        let switch = |inv: &mut Inventory, name: String| {
            inv.add_device(Device::new(DeviceId::named("fabric", &name), DeviceKind::NetworkSwitch, None)).unwrap()
        };
        let leaf = switch(&mut inv, "leaf".into());
        let spines: Vec<DeviceIdx> = (0..100).map(|k| switch(&mut inv, format!("spine{k}"))).collect();
        let cores: Vec<DeviceIdx> = (0..cores).map(|k| switch(&mut inv, format!("core{k}"))).collect();
        let cable = |a, b| Link::new(a, b, LinkKind::Network { gbps: 400 }, Bandwidth::full(400_000), None);
        for &s in &spines {
            inv.add_link(cable(leaf, s));
            for &c in &cores {
                inv.add_link(cable(s, c));
            }
        }
        inv.add_link(cable(nic, leaf));
        Fabric::build(inv).unwrap()
    }

    #[test]
    fn a_record_keeps_the_widest_rings_whose_links_fit_and_never_fewer_than_the_first() {
        use crate::records::MAX_RECORD_BYTES;
        // The cores' 10,000 links are over the bound: the rings stop at the spines, and
        // every link among what is listed is there, the NIC's cable included.
        let r = TopologyRecord::from_fabric(&tall(100), "n0", 1, MAX_RECORD_BYTES);
        assert_eq!((r.devices.len(), r.links.len()), (102, 101), "the NIC, the leaf, 100 spines");
        assert!(r.links.iter().any(|l| (l.a, l.b) == (0, 1)), "the NIC's own cable");
        assert_eq!(decode::<TopologyRecord>(&encode(&r), RecordLimits::new(MAX_RECORD_BYTES)), Ok(r.clone()));
        // With 30 cores (3,101 links) the cores fit too.
        assert_eq!(TopologyRecord::from_fabric(&tall(30), "n0", 1, MAX_RECORD_BYTES).devices.len(), 132);
        // A bound nothing fits: still the NIC and its leaf (the publisher refuses it, the
        // domain shows no topology of the node), never the NIC cut off from its network.
        let r = TopologyRecord::from_fabric(&tall(1), "n0", 1, 64);
        assert_eq!((r.devices.len(), r.links.len()), (2, 1));
        assert!(encode(&r).len() > 64);
    }

    #[test]
    fn a_node_publishes_its_devices_and_the_fabric_switches() {
        let record = TopologyRecord::from_fabric(&tray("tray0"), "tray0", 3, DEFAULT_MAX_RECORD_BYTES);
        let ids: Vec<&str> = record.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["name:tray0/numa0", "uuid:GPU-tray0", "name:fabric/nvsw0"]);
        assert!(record.devices[2].fabric && !record.devices[1].fabric);
        assert_eq!(record.devices[1].memory, [TopologyMemory { kind: MemoryKind::Hbm, size: 1 << 30 }]);
        assert_eq!(record.links.len(), 2, "the drive's link goes with the drive");
        assert_eq!(
            (record.devices[0].numa_node, record.devices[0].local_cpus.as_deref()),
            (Some(0), Some("0-15,32-47"))
        );
        assert_eq!((record.devices[1].numa_node, record.devices[1].local_cpus.as_deref()), (Some(1), None));
        let pci = record.devices[1].pci.as_ref().unwrap();
        assert_eq!((pci.address.map(|a| a.to_string()), pci.class), (Some("0000:17:00.0".into()), Some(0x03_0200)));
        assert_eq!((pci.vendor_id, pci.device_id, pci.driver.as_deref()), (Some(0x10de), Some(0x2335), Some("nvidia")));
        assert_eq!(pci.info().address, pci.address, "back as the topology crate holds it");
        assert_eq!((pci.subsystem_vendor_id, pci.subsystem_device_id), (Some(0x10de), Some(0x18be)));
        assert_eq!(pci.device_name.as_deref(), Some("GH100 [H200 SXM 141GB]"));
        assert_eq!(
            (pci.link_speed_mts, pci.link_width, pci.max_link_speed_mts),
            (Some(32_000), Some(16), Some(32_000))
        );
        let bars: Vec<(u8, u64, bool, bool)> =
            pci.bars.iter().map(|b| (b.index, b.size, b.prefetchable, b.mem64)).collect();
        assert_eq!(bars, [(0, 16 << 20, false, false), (2, 256 << 30, true, true), (4, 32 << 20, true, true)]);
        let back = pci.info();
        assert_eq!((back.link_speed_gts, back.max_link_width), (Some(32.0), Some(16)));
        assert_eq!(back.bars[1].size, 256 << 30);
        assert!(back.bars.iter().all(|b| b.start == 0), "where the node put a BAR stays on the node");
        assert_eq!(TopologyPci::of(&back), *pci, "a record's PCI details survive a merge and a republish");
        let limits = RecordLimits::default();
        assert_eq!(decode::<TopologyRecord>(&encode(&record), limits), Ok(record.clone()));
        assert!(
            TopologyRecord::from_fabric(&tray("tray0"), "tray1", 3, DEFAULT_MAX_RECORD_BYTES).devices.is_empty(),
            "no devices of its own, no switches around them"
        );
    }

    #[test]
    fn hostile_records_are_refused_with_the_field() {
        let limits = RecordLimits::default();
        let good = TopologyRecord::from_fabric(&tray("tray0"), "tray0", 3, DEFAULT_MAX_RECORD_BYTES);
        let field = |r: &TopologyRecord| match decode::<TopologyRecord>(&encode(r), limits) {
            Err(RecordError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let mut r = good.clone();
        r.devices[1].name = Some("GPU\n0".into());
        assert_eq!(field(&r), "devices.name");
        let mut r = good.clone();
        r.incarnation = 0;
        assert_eq!(field(&r), "incarnation");
        let mut r = good.clone();
        r.devices.push(r.devices[0].clone());
        assert_eq!(field(&r), "devices.id");
        let mut r = good.clone();
        r.devices[1].fabric = true;
        assert_eq!(field(&r), "devices.fabric");
        let mut r = good.clone();
        r.devices[2].fabric = false;
        assert_eq!(field(&r), "devices.fabric", "a node's device under the fabric's name");
        let mut r = good.clone();
        r.devices[1].memory = vec![TopologyMemory { kind: MemoryKind::Hbm, size: u64::MAX }; 2];
        assert_eq!(field(&r), "devices.memory");
        let mut r = good.clone();
        r.devices[1].memory = vec![TopologyMemory { kind: MemoryKind::Hbm, size: 1 }; 17];
        assert_eq!(field(&r), "devices.memory");
        let mut r = good.clone();
        r.devices[1].numa_node = Some(MAX_NUMA_NODE);
        assert_eq!(field(&r), "devices.numa_node");
        let pci = |class, driver: &str| TopologyPci {
            class: Some(class),
            driver: Some(driver.to_owned()),
            ..TopologyPci::of(&fabric_topology::PciInfo::default())
        };
        let bar = |index, size| TopologyBar { index, size, memory: true, prefetchable: false, mem64: false };
        for bad in [
            pci(1 << 24, "nvidia"),
            pci(0x030200, "nv\nidia"),
            pci(0x030200, &"d".repeat(65)),
            TopologyPci { vendor_name: Some("N".repeat(129)), ..pci(0x030200, "nvidia") },
            TopologyPci { device_name: Some("H\u{7}200".into()), ..pci(0x030200, "nvidia") },
            TopologyPci { link_speed_mts: Some(0), ..pci(0x030200, "nvidia") },
            TopologyPci { max_link_speed_mts: Some(MAX_LINK_SPEED_MTS + 1), ..pci(0x030200, "nvidia") },
            TopologyPci { link_width: Some(3), ..pci(0x030200, "nvidia") },
            TopologyPci { bars: vec![bar(2, 1), bar(0, 1)], ..pci(0x030200, "nvidia") },
            TopologyPci { bars: vec![bar(0, 1), bar(0, 2)], ..pci(0x030200, "nvidia") },
            TopologyPci { bars: vec![bar(7, 1)], ..pci(0x030200, "nvidia") },
            TopologyPci { bars: vec![bar(1, 0)], ..pci(0x030200, "nvidia") },
        ] {
            let mut r = good.clone();
            r.devices[1].pci = Some(bad.clone());
            assert_eq!(field(&r), "devices.pci", "{bad:?}");
        }
        for bad in ["0-", "x", "3-1", &"0,".repeat(200)] {
            let mut r = good.clone();
            r.devices[1].local_cpus = Some(bad.to_owned());
            assert_eq!(field(&r), "devices.local_cpus", "{bad:?}");
        }
        let mut r = good.clone();
        r.links[0].b = 3;
        assert_eq!(field(&r), "links");
        let mut r = good.clone();
        r.links[0].b = r.links[0].a;
        assert_eq!(field(&r), "links");
        let mut r = good.clone();
        r.node = "../x".into();
        assert_eq!(field(&r), "node");
        // Identities are checked by their own decoder.
        let text = String::from_utf8(encode(&good)).unwrap();
        let bad = text.replacen("uuid:GPU-tray0", "GPU-tray0", 1);
        assert!(matches!(decode::<TopologyRecord>(bad.as_bytes(), limits), Err(RecordError::Malformed(_))));
        // A device kind this build does not know is a newer node's: shown as other. A link
        // or memory of a kind it does not know is left out; the rest stays.
        let newer = text.replacen("\"gpu\"", "\"warp_drive\"", 1);
        let r = decode::<TopologyRecord>(newer.as_bytes(), limits).unwrap();
        assert_eq!(r.devices[1].kind, DeviceKind::Other);
        assert_eq!(r.devices[1].memory, good.devices[1].memory);
        let newer = text.replacen("\"c2c\"", "\"telepathy\"", 1);
        let r = decode::<TopologyRecord>(newer.as_bytes(), limits).unwrap();
        assert_eq!(r.links.len(), good.links.len() - 1);
        assert!(r.links.iter().all(|l| l.kind != LinkKind::C2c));
        let newer = text.replacen("\"hbm\"", "\"holographic\"", 1);
        let r = decode::<TopologyRecord>(newer.as_bytes(), limits).unwrap();
        assert!(r.devices[1].memory.is_empty() && r.devices.len() == good.devices.len());
        // A field this build does not know is a newer node's, ignored (see the test above);
        // a known field of the wrong type is not.
        let extra = text.replacen("\"links\"", "\"extra\":1,\"links\"", 1);
        assert_eq!(decode::<TopologyRecord>(extra.as_bytes(), limits), Ok(good.clone()));
        let mistyped = text.replacen("\"incarnation\":", "\"incarnation\":\"x\",\"was\":", 1);
        assert!(matches!(decode::<TopologyRecord>(mistyped.as_bytes(), limits), Err(RecordError::Malformed(_))));
        let v2 = text.replacen("\"version\":1", "\"version\":2", 1);
        assert_eq!(decode::<TopologyRecord>(v2.as_bytes(), limits), Err(RecordError::WrongVersion { found: 2 }));
        let cut = &text.as_bytes()[..text.len() / 2];
        assert!(matches!(decode::<TopologyRecord>(cut, limits), Err(RecordError::Truncated { .. })));
        let huge = TopologyRecord {
            devices: (0..2000)
                .map(|i| TopologyDevice {
                    id: DeviceId::named("tray0", &format!("d{i}")),
                    kind: DeviceKind::Gpu,
                    name: None,
                    fabric: false,
                    memory: vec![],
                    numa_node: None,
                    local_cpus: None,
                    pci: None,
                })
                .collect(),
            ..good
        };
        assert!(matches!(decode::<TopologyRecord>(&encode(&huge), limits), Err(RecordError::Oversized { .. })));
        // The count bound holds under the largest size bound too.
        let wide = RecordLimits::new(crate::records::MAX_RECORD_BYTES);
        assert!(matches!(
            decode::<TopologyRecord>(&encode(&huge), wide),
            Err(RecordError::Invalid { field: "devices", .. })
        ));
    }

    /// A record written before devices carried NUMA and CPU affinity decodes, without them.
    #[test]
    fn a_record_without_affinity_still_decodes() {
        let good = TopologyRecord::from_fabric(&tray("tray0"), "tray0", 3, DEFAULT_MAX_RECORD_BYTES);
        let text = String::from_utf8(encode(&good)).unwrap();
        let old = text
            .replace(",\"numa_node\":0", "")
            .replace(",\"numa_node\":1", "")
            .replace(",\"local_cpus\":\"0-15,32-47\"", "");
        assert!(!old.contains("numa_node") && !old.contains("local_cpus"), "{old}");
        let record = decode::<TopologyRecord>(old.as_bytes(), RecordLimits::default()).unwrap();
        assert!(record.devices.iter().all(|d| d.numa_node.is_none() && d.local_cpus.is_none()));
    }

    /// The fuzz target's seeds of the new records decode (the first byte picks the type).
    #[test]
    fn fuzz_seeds_decode() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/domain_records");
        let seed = |name: &str| std::fs::read(dir.join(name)).unwrap();
        let topology = seed("topology");
        assert_eq!(topology[0] % 6, 4);
        let record = decode::<TopologyRecord>(&topology[1..], RecordLimits::default()).unwrap();
        assert_eq!(record.devices.len(), 3);
        let partition = seed("partition");
        assert_eq!(partition[0] % 6, 5);
        let record = decode::<crate::partition::PartitionRecord>(&partition[1..], RecordLimits::default()).unwrap();
        assert_eq!(record.name, "tenant-a");
    }

    proptest! {
        #[test]
        fn any_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<TopologyRecord>(&bytes, RecordLimits::new(256));
        }
    }
}
