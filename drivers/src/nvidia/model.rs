//! Maps an NVML snapshot into the inventory: GPUs by UUID (merged into the PCI function the
//! PCI backend found), NVSwitches by PCI address, NVLink bundles and the P2P matrix.

use std::collections::{BTreeMap, HashMap, HashSet};

use fabric_topology::link::nvlink_mbps_per_link;
use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, FAILED_ATTR, GpuInfo, Inventory, Link, LinkKind,
    LinkState, MemoryKind, MemoryResource, PciAddress, PciInfo,
};

use super::api::{FabricHealth, FabricState, RemoteType};
use super::snapshot::{GpuRecord, NvmlSnapshot};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR_ID: u16 = 0x10de;

/// PCI class/subclass of NVSwitch functions ("bridge, other").
pub const NVSWITCH_CLASS: u32 = 0x0680;

/// Whether a PCI function looks like an NVSwitch (NVIDIA vendor id, class 0x0680).
pub fn looks_like_nvswitch(pci: &PciInfo) -> bool {
    pci.vendor_id == Some(NVIDIA_VENDOR_ID) && pci.class.map(|c| c >> 8) == Some(NVSWITCH_CLASS)
}

/// Formats a 16-byte UUID as `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

/// Adds `source` to a device's sources once.
pub(crate) fn add_source(d: &mut Device, source: &str) {
    if !d.sources.iter().any(|s| s == source) {
        d.sources.push(source.to_owned());
    }
}

/// Links from one GPU to one far end.
#[derive(Debug, Default)]
struct Bundle {
    active: u16,
    down: u16,
    generation: Option<u8>,
    remote_type: Option<RemoteType>,
}

/// Puts what `snap` found into `inv` for `node`, noting what could not be placed in `report`.
pub fn apply(snap: &NvmlSnapshot, node: &str, inv: &mut Inventory, report: &mut BackendReport) {
    for line in &snap.unknown {
        report.note_unknown(line.clone());
    }
    let placed: Vec<Option<DeviceIdx>> = snap.gpus.iter().map(|g| place_gpu(g, node, inv, report)).collect();
    report.devices += placed.iter().flatten().count();
    let gpu_at: HashMap<PciAddress, DeviceIdx> =
        snap.gpus.iter().zip(&placed).filter_map(|(g, i)| Some((g.address?, (*i)?))).collect();
    let mut switches = HashSet::new();
    let mut gpu_pairs = HashSet::new();
    for (rec, idx) in snap.gpus.iter().zip(&placed) {
        if let Some(idx) = *idx {
            add_nvlinks(rec, idx, node, inv, report, &gpu_at, &mut switches, &mut gpu_pairs);
        }
    }
    report.devices += switches.len();
    for e in &snap.p2p {
        let (Some(a), Some(peer)) = (placed.get(e.from).copied().flatten(), snap.gpus.get(e.to)) else { continue };
        let peer_name = peer.uuid.clone().or_else(|| peer.bus_id.clone()).unwrap_or_else(|| peer.index.to_string());
        inv.device_mut(a).attrs.insert(format!("nvml.p2p.{}.{peer_name}", e.cap.as_str()), e.status.to_string());
    }
}

/// Finds (or adds) the device for a GPU record, gives it its UUID identity and fills it.
fn place_gpu(rec: &GpuRecord, node: &str, inv: &mut Inventory, report: &mut BackendReport) -> Option<DeviceIdx> {
    let uuid_id = rec.uuid.as_deref().filter(|u| !u.is_empty()).map(DeviceId::uuid);
    let existing =
        uuid_id.as_ref().and_then(|id| inv.find(id)).or_else(|| rec.address.and_then(|a| inv.find_pci(Some(node), a)));
    let idx = match existing {
        Some(idx) => {
            if let Some(id) = &uuid_id
                && inv.device(idx).id != *id
                && !inv.rename(idx, id.clone())
            {
                report.note_unknown(format!("nvml device {}: identity {id} already taken", rec.index));
            }
            idx
        }
        None => {
            let Some(id) = uuid_id.or_else(|| rec.address.map(|a| DeviceId::pci(node, a))) else {
                report.note_unknown(format!("nvml device {}: neither UUID nor PCI address; skipped", rec.index));
                return None;
            };
            let mut d = Device::new(id, DeviceKind::Gpu, Some(node));
            d.pci = rec.address.map(|a| PciInfo { address: Some(a), ..PciInfo::default() });
            match inv.add_device(d) {
                Ok(i) => i,
                Err(e) => {
                    report.note_unknown(format!("nvml device {}: {e}", rec.index));
                    return None;
                }
            }
        }
    };
    fill_gpu(inv.device_mut(idx), rec);
    Some(idx)
}

/// Why NVML says the GPU failed: it is lost (`NVML_ERROR_GPU_IS_LOST`), or its GPU fabric
/// health summary is unhealthy (its memory cannot be reached over the NVLink fabric).
/// `LimitedCapacity` is degraded, not failed.
pub fn failure(rec: &GpuRecord) -> Option<String> {
    if rec.lost {
        return Some(
            "NVML reports the GPU lost (NVML_ERROR_GPU_IS_LOST: fell off the bus or stopped responding)".into(),
        );
    }
    match rec.fabric.as_ref().and_then(|f| f.health) {
        Some(FabricHealth::Unhealthy) => Some("NVML reports its GPU fabric health unhealthy".into()),
        _ => None,
    }
}

fn fill_gpu(d: &mut Device, rec: &GpuRecord) {
    d.kind = DeviceKind::Gpu;
    if rec.name.is_some() {
        d.name.clone_from(&rec.name);
    }
    let pci = d.pci.get_or_insert_with(PciInfo::default);
    pci.address = pci.address.or(rec.address);
    pci.vendor_id = pci.vendor_id.or(rec.vendor_id);
    pci.device_id = pci.device_id.or(rec.device_id);
    // The PCI backend reads locality from sysfs; NVML's answer only fills a gap.
    d.numa_node = d.numa_node.or(rec.numa_node);
    if d.local_cpus.is_none() {
        d.local_cpus.clone_from(&rec.local_cpus);
    }
    let gpu = d.gpu.get_or_insert_with(GpuInfo::default);
    let set = |dst: &mut Option<String>, src: &Option<String>| {
        if src.is_some() {
            dst.clone_from(src);
        }
    };
    set(&mut gpu.uuid, &rec.uuid);
    set(&mut gpu.model, &rec.name);
    set(&mut gpu.serial, &rec.serial);
    if rec.no_nvlink {
        gpu.nvlink_capable = Some(0);
    } else if !rec.links.is_empty() {
        gpu.nvlink_capable = u16::try_from(rec.links.len()).ok();
    }
    if let Some(g) = rec.links.iter().filter_map(|l| l.generation).max() {
        gpu.nvlink_generation = Some(g);
    }
    if let Some(f) = &rec.fabric {
        gpu.fabric_state = Some(f.state.name());
        let registered = f.state == FabricState::Completed && f.status == 0 && f.cluster_uuid != [0; 16];
        if registered {
            gpu.fabric_cluster = Some(format_uuid(&f.cluster_uuid));
            gpu.fabric_clique = Some(f.clique_id);
        }
        if f.state == FabricState::Completed && f.status != 0 {
            d.attrs.insert("nvml.fabric_status".into(), f.status.to_string());
        }
        if let Some(h) = f.health {
            d.attrs.insert("nvml.fabric_health".into(), h.to_string());
        }
    }
    if let Some(why) = failure(rec) {
        d.attrs.insert(FAILED_ATTR.to_owned(), why);
    }
    if let Some(size) = rec.memory_total
        && !d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)
    {
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size, hpa: None, numa_node: rec.memory_numa_node });
    }
    if let Some(b) = &rec.bus_id {
        d.attrs.insert("nvml.bus_id".into(), b.clone());
    }
    if !rec.links.is_empty() {
        let up = rec.links.iter().filter(|l| l.active).count();
        d.attrs.insert("nvml.nvlinks_active".into(), format!("{up}/{}", rec.links.len()));
    }
    add_source(d, "nvml");
}

/// Aggregates a GPU's NVLinks per far end into bundles and adds one link per bundle.
#[allow(clippy::too_many_arguments)]
fn add_nvlinks(
    rec: &GpuRecord,
    gpu: DeviceIdx,
    node: &str,
    inv: &mut Inventory,
    report: &mut BackendReport,
    gpu_at: &HashMap<PciAddress, DeviceIdx>,
    switches: &mut HashSet<DeviceIdx>,
    gpu_pairs: &mut HashSet<(DeviceIdx, DeviceIdx)>,
) {
    let mut bundles: BTreeMap<FarEnd, Bundle> = BTreeMap::new();
    let mut down_unattributed = 0u32;
    for l in &rec.links {
        let far = match l.remote.filter(|a| *a != NO_ADDRESS) {
            Some(a) => FarEnd::Pci(a),
            // An NVSwitch outside this host's PCI tree (switch trays) has no usable address,
            // but still carries the GPU's traffic to every other GPU on the fabric.
            None if l.active && l.remote_type == Some(RemoteType::Switch) => FarEnd::SwitchFabric,
            None if l.active => {
                report.note_unknown(format!("nvml device {} nvlink {}: active, far end unknown", rec.index, l.link));
                continue;
            }
            None => {
                down_unattributed += 1;
                continue;
            }
        };
        let b = bundles.entry(far).or_default();
        if l.active {
            b.active += 1;
        } else {
            b.down += 1;
        }
        b.generation = b.generation.max(l.generation);
        if let Some(t) = l.remote_type.filter(|t| *t != RemoteType::Unknown) {
            b.remote_type = Some(t);
        }
    }
    if down_unattributed > 0 {
        inv.device_mut(gpu).attrs.insert("nvml.nvlinks_down_far_end_unknown".into(), down_unattributed.to_string());
    }
    let gpu_generation = inv.device(gpu).gpu.as_ref().and_then(|g| g.nvlink_generation);
    for (far, b) in bundles {
        let (kind, other) = match far {
            FarEnd::SwitchFabric => match switch_fabric(inv, node) {
                Some(s) => (RemoteType::Switch, s),
                None => continue,
            },
            FarEnd::Pci(addr) => {
                let kind = b.remote_type.unwrap_or_else(|| infer_remote_type(inv, node, addr, gpu_at));
                let other = match kind {
                    RemoteType::Gpu => gpu_at.get(&addr).copied().or_else(|| inv.find_pci(Some(node), addr)),
                    RemoteType::Switch => nvswitch_at(inv, node, addr),
                    RemoteType::IbmNpu => npu_at(inv, node, addr),
                    RemoteType::Unknown => None,
                };
                let Some(other) = other else {
                    report.note_unknown(format!(
                        "nvml device {} nvlink far end {addr} ({kind:?}): not placed",
                        rec.index
                    ));
                    continue;
                };
                (kind, other)
            }
        };
        if kind == RemoteType::Switch {
            switches.insert(other);
        }
        if other == gpu {
            continue;
        }
        // Both GPUs of a direct bundle report it; keep one.
        if kind == RemoteType::Gpu && !gpu_pairs.insert((gpu.min(other), gpu.max(other))) {
            continue;
        }
        let generation = b.generation.or(gpu_generation);
        if generation.is_none() {
            report.note_unknown(format!("nvml device {} nvlink to {far}: generation unknown", rec.index));
        }
        let per_link = generation.and_then(nvlink_mbps_per_link);
        let bandwidth = Bandwidth {
            current_mbps: per_link.map(|p| p * u64::from(b.active)),
            max_mbps: per_link.map(|p| p * u64::from(b.active + b.down)),
        };
        let mut link = Link::new(
            gpu,
            other,
            LinkKind::NvLink { generation: generation.unwrap_or(0), count: b.active },
            bandwidth,
            None,
        );
        if b.active == 0 {
            link.state = LinkState::Down;
        } else if b.down > 0 {
            link.state = LinkState::Degraded;
        }
        inv.add_link(link);
    }
}

/// Guesses the far end's type from what the inventory knows, when NVML did not say.
fn infer_remote_type(
    inv: &Inventory,
    node: &str,
    addr: PciAddress,
    gpu_at: &HashMap<PciAddress, DeviceIdx>,
) -> RemoteType {
    if gpu_at.contains_key(&addr) {
        return RemoteType::Gpu;
    }
    match inv.find_pci(Some(node), addr).map(|i| inv.device(i)) {
        Some(d) if d.kind == DeviceKind::NvSwitch || d.pci.as_ref().is_some_and(looks_like_nvswitch) => {
            RemoteType::Switch
        }
        Some(d) if d.kind == DeviceKind::Gpu => RemoteType::Gpu,
        _ => RemoteType::Unknown,
    }
}

/// Where a bundle of NVLinks goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum FarEnd {
    /// A device with a PCI address.
    Pci(PciAddress),
    /// NVSwitches NVML names by type only.
    SwitchFabric,
}

impl std::fmt::Display for FarEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FarEnd::Pci(a) => write!(f, "{a}"),
            FarEnd::SwitchFabric => f.write_str("the NVSwitch fabric"),
        }
    }
}

/// The all-zero address NVML reports when it does not know the far end.
const NO_ADDRESS: PciAddress = PciAddress { domain: 0, bus: 0, device: 0, function: 0 };

/// The NVSwitch at a PCI address: the function the PCI backend found there (an NVSwitch on
/// an HGX board is a host PCI function of class 0x0680), or a new device keyed by node and
/// address. If the host function at that address is plainly something else, the address is
/// not a host address (a switch in another tray), and the switch gets a name of its own.
fn nvswitch_at(inv: &mut Inventory, node: &str, addr: PciAddress) -> Option<DeviceIdx> {
    let host = inv.find_pci(Some(node), addr).filter(|&i| {
        let d = inv.device(i);
        let vendor = d.pci.as_ref().and_then(|p| p.vendor_id);
        matches!(d.kind, DeviceKind::NvSwitch | DeviceKind::Other) && vendor.is_none_or(|v| v == NVIDIA_VENDOR_ID)
    });
    let idx = match host {
        Some(i) => i,
        None => {
            let id = if inv.find_pci(Some(node), addr).is_some() {
                DeviceId::named(node, &format!("nvswitch@{addr}"))
            } else {
                DeviceId::pci(node, addr)
            };
            let host_pci = id.scheme() == "pci";
            let mut d = Device::new(id, DeviceKind::NvSwitch, Some(node));
            if host_pci {
                d.pci = Some(PciInfo { address: Some(addr), vendor_id: Some(NVIDIA_VENDOR_ID), ..PciInfo::default() });
            } else {
                d.attrs.insert("nvml.remote_bus_id".into(), addr.to_string());
            }
            inv.add_device(d).ok()?
        }
    };
    let d = inv.device_mut(idx);
    d.kind = DeviceKind::NvSwitch;
    add_source(d, "nvml");
    Some(idx)
}

/// One device standing for the NVSwitches a node's GPUs reach without a usable address.
fn switch_fabric(inv: &mut Inventory, node: &str) -> Option<DeviceIdx> {
    let id = DeviceId::named(node, "nvswitch-fabric");
    if let Some(i) = inv.find(&id) {
        return Some(i);
    }
    let mut d = Device::new(id, DeviceKind::NvSwitch, Some(node));
    d.attrs.insert("nvml.note".into(), "NVSwitches reached by NVLink without a PCI address on this host".into());
    add_source(&mut d, "nvml");
    inv.add_device(d).ok()
}

/// The IBM NPU (POWER9 CPU end of an NVLink) at a PCI address.
fn npu_at(inv: &mut Inventory, node: &str, addr: PciAddress) -> Option<DeviceIdx> {
    let idx = match inv.find_pci(Some(node), addr) {
        Some(i) => i,
        None => {
            let mut d = Device::new(DeviceId::pci(node, addr), DeviceKind::Other, Some(node));
            d.pci = Some(PciInfo { address: Some(addr), ..PciInfo::default() });
            inv.add_device(d).ok()?
        }
    };
    let d = inv.device_mut(idx);
    d.attrs.insert("nvml.nvlink_endpoint".into(), "ibm_npu".into());
    add_source(d, "nvml");
    Some(idx)
}
