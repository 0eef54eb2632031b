//! Maps an NVML snapshot into the inventory: GPUs by UUID (merged into the PCI function the
//! PCI backend found), NVSwitches by PCI address, NVLink bundles and the P2P matrix.

use std::collections::{BTreeMap, HashMap, HashSet};

use fabric_topology::link::nvlink_mbps_per_link;
use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, GpuInfo, Inventory, Link, LinkKind, LinkState,
    MemoryKind, MemoryResource, PciAddress, PciInfo,
};

use super::api::{FabricState, RemoteType};
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
        let (Some(a), Some(peer)) = (placed[e.from], snap.gpus.get(e.to)) else { continue };
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
        gpu.fabric_state = Some(f.state.as_str());
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
    let mut bundles: BTreeMap<PciAddress, Bundle> = BTreeMap::new();
    let mut down_unattributed = 0u32;
    for l in &rec.links {
        let Some(addr) = l.remote else {
            if l.active {
                report.note_unknown(format!("nvml device {} nvlink {}: active, far end unknown", rec.index, l.link));
            } else {
                down_unattributed += 1;
            }
            continue;
        };
        let b = bundles.entry(addr).or_default();
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
    for (addr, b) in bundles {
        let kind = b.remote_type.unwrap_or_else(|| infer_remote_type(inv, node, addr, gpu_at));
        let other = match kind {
            RemoteType::Gpu => match gpu_at.get(&addr).copied().or_else(|| inv.find_pci(Some(node), addr)) {
                Some(o) => o,
                None => {
                    report.note_unknown(format!("nvml device {} nvlink peer GPU {addr}: not found", rec.index));
                    continue;
                }
            },
            RemoteType::Switch => match endpoint_at(inv, node, addr, DeviceKind::NvSwitch) {
                Some(s) => {
                    switches.insert(s);
                    s
                }
                None => continue,
            },
            RemoteType::IbmNpu => match endpoint_at(inv, node, addr, DeviceKind::Other) {
                Some(n) => {
                    inv.device_mut(n).attrs.insert("nvml.nvlink_endpoint".into(), "ibm_npu".into());
                    n
                }
                None => continue,
            },
            RemoteType::Unknown => {
                report.note_unknown(format!("nvml device {} nvlink far end {addr}: type unknown", rec.index));
                continue;
            }
        };
        if other == gpu {
            continue;
        }
        // Both GPUs of a direct bundle report it; keep one.
        if kind == RemoteType::Gpu && !gpu_pairs.insert((gpu.min(other), gpu.max(other))) {
            continue;
        }
        let generation = b.generation.or(gpu_generation);
        if generation.is_none() {
            report.note_unknown(format!("nvml device {} nvlink to {addr}: generation unknown", rec.index));
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

/// The far end of an NVLink that is not a GPU, by PCI address: the function the PCI backend
/// found (an NVSwitch is a PCI function of class 0x0680 on the host), or a new device keyed
/// by node and address. `kind` is applied to it unless it is `Other`. `None` only when the
/// inventory is full.
fn endpoint_at(inv: &mut Inventory, node: &str, addr: PciAddress, kind: DeviceKind) -> Option<DeviceIdx> {
    let idx = match inv.find_pci(Some(node), addr) {
        Some(i) => i,
        None => {
            let mut d = Device::new(DeviceId::pci(node, addr), kind, Some(node));
            let vendor_id = (kind == DeviceKind::NvSwitch).then_some(NVIDIA_VENDOR_ID);
            d.pci = Some(PciInfo { address: Some(addr), vendor_id, ..PciInfo::default() });
            inv.add_device(d).ok()?
        }
    };
    let d = inv.device_mut(idx);
    if kind != DeviceKind::Other {
        d.kind = kind;
    }
    add_source(d, "nvml");
    Some(idx)
}
