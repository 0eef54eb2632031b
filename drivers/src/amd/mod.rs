//! AMD GPUs and xGMI from sysfs alone (no ROCm): the KFD topology tree and the amdgpu
//! attributes of each GPU's PCI function.
//!
//! Each physical GPU becomes one device keyed `serial:amdgpu/0x<unique_id>` (its PCI
//! address when the kernel gives no unique id, or two GPUs share one), never by a KFD node
//! number. A GPU the PCI backend already found is enriched and renamed, keeping its PCI
//! facts and links; one KFD shows without a PCI function in the tree (KFD-only dumps) is
//! added with what KFD says of its PCI identity. Compute partitions (one KFD node each)
//! are grouped under their GPU. Direct xGMI peers become xGMI links with their count and
//! bandwidth; indirect routes (`p2p_links`, indirect hive peers) become
//! `kfd.route.<peer id>` attributes. Nodes the kernel hides (EPERM from a device cgroup)
//! and partitions that are missing are named in the report, not counted as failures.

pub mod amdgpu;
pub mod assemble;
pub mod kfd;

use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, GpuInfo, GpuPartition, Inventory, Link,
    LinkKind, MemoryKind, MemoryResource, PciInfo,
};

use crate::Backend;
use crate::pci::names;
use crate::sysfs::{SysfsRoot, read_attr};

use amdgpu::AmdgpuAttrs;
use assemble::PhysicalGpu;

/// The backend's name in reports and device sources.
pub const NAME: &str = "amd";

/// AMD GPUs from KFD and amdgpu sysfs attributes under a sysfs root.
#[derive(Debug, Clone)]
pub struct AmdBackend {
    root: SysfsRoot,
}

impl AmdBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

impl Backend for AmdBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn discover(&self, inv: &mut Inventory) -> BackendReport {
        discover_with(&self.root, inv, &|p| read_attr(p))
    }
}

/// The backend with an injectable attribute reader (tests use it to make the kernel's
/// EPERM, which a root-run test cannot get from file modes).
pub fn discover_with(root: &SysfsRoot, inv: &mut Inventory, read: kfd::ReadFn<'_>) -> BackendReport {
    // `sys/class/kfd/kfd` and each `sys/bus/pci/devices/ADDR` are symlinks: resolved
    // inside the root, so that a dump's absolute links never lead to the live `/sys`.
    let nodes_dir = match root.resolve(kfd::KFD_NODES) {
        Some(dir) if dir.is_dir() => dir,
        Some(_) => {
            return BackendReport::not_present(NAME, format!("no {} (amdgpu's KFD not loaded)", kfd::KFD_NODES));
        }
        None => {
            let why = format!("{}: a symlink loop or an unreadable link on the way", kfd::KFD_NODES);
            return BackendReport::failed(NAME, why);
        }
    };
    let mut report = BackendReport::present(NAME);
    let tree = kfd::read_tree(&nodes_dir, read);
    let mut notes = Vec::new();
    if !tree.hidden.is_empty() {
        notes.push(format!(
            "kfd: {} node(s) hidden (permission denied, as a device cgroup without the GPU gives): nodes {}",
            tree.hidden.len(),
            tree.hidden.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ));
    }
    notes.extend(tree.notes);
    let gpus = assemble::group(tree.nodes, &mut notes);
    let conns = assemble::connect(&gpus);
    if conns.to_unknown > 0 {
        notes.push(format!("kfd: {} xGMI link(s) lead to nodes not shown (hidden or unreadable)", conns.to_unknown));
    }
    let attrs: Vec<AmdgpuAttrs> = gpus
        .iter()
        .map(|g| {
            let function = format!("sys/bus/pci/devices/{}", g.address);
            match root.resolve(&function) {
                Some(dir) => amdgpu::read(&dir, read, &mut notes),
                None => {
                    notes.push(format!("{function}: a symlink loop or an unreadable link; its attributes not read"));
                    AmdgpuAttrs::default()
                }
            }
        })
        .collect();
    let ids = identities(root.node(), &gpus, &attrs, &mut notes);
    let mut idx: Vec<DeviceIdx> = Vec::with_capacity(gpus.len());
    for (i, g) in gpus.iter().enumerate() {
        match place(inv, root.node(), g, &ids[i], &mut report.devices) {
            Some(d) => idx.push(d),
            None => {
                notes.push(format!("{}: could not be added", ids[i]));
                return finish(report, notes);
            }
        }
        fill(inv.device_mut(idx[i]), g, &attrs[i], &mut notes);
    }
    for (&(a, b), x) in &conns.xgmi {
        let bw = x.mbps.map(Bandwidth::full).unwrap_or_default();
        inv.add_link(Link::new(idx[a], idx[b], LinkKind::Xgmi { count: x.count }, bw, None));
    }
    for (&(a, b), r) in &conns.routes {
        let key = format!("kfd.route.{}", inv.device(idx[b]).id);
        inv.device_mut(idx[a]).attrs.insert(key, r.describe());
    }
    finish(report, notes)
}

fn finish(mut report: BackendReport, notes: Vec<String>) -> BackendReport {
    let total = notes.len();
    for n in notes.into_iter().take(fabric_topology::inventory::MAX_UNKNOWN_LINES) {
        report.note_unknown(n);
    }
    if total > report.unknown.len() {
        let more = total - report.unknown.len();
        report.unknown.pop();
        report.unknown.push(format!("… and {} more", more + 1));
    }
    report
}

/// Stable identities: the unique id (KFD's decimal, or amdgpu's hex attribute), else the
/// PCI address; a unique id two GPUs share is no identity, and both fall back.
fn identities(node: &str, gpus: &[PhysicalGpu], attrs: &[AmdgpuAttrs], notes: &mut Vec<String>) -> Vec<DeviceId> {
    let uid: Vec<Option<u64>> = gpus.iter().zip(attrs).map(|(g, a)| g.unique_id.or(a.unique_id)).collect();
    for (g, a) in gpus.iter().zip(attrs) {
        if let (Some(k), Some(p)) = (g.unique_id, a.unique_id)
            && k != p
        {
            notes.push(format!("{}: KFD unique_id {k:#x} differs from amdgpu's {p:#x}; KFD's used", g.address));
        }
    }
    gpus.iter()
        .enumerate()
        .map(|(i, g)| match uid[i] {
            Some(u) if uid.iter().filter(|&&x| x == Some(u)).count() == 1 => {
                DeviceId::serial("amdgpu", &format!("0x{u:016x}"))
            }
            other => {
                if other.is_some() {
                    notes.push(format!("{}: unique_id shared with another GPU; keyed by PCI address", g.address));
                }
                DeviceId::pci(node, g.address)
            }
        })
        .collect()
}

/// Finds the GPU's PCI function (renaming it to `id`), or adds a device for it.
fn place(inv: &mut Inventory, node: &str, g: &PhysicalGpu, id: &DeviceId, added: &mut usize) -> Option<DeviceIdx> {
    if let Some(i) = inv.find(id) {
        return Some(i);
    }
    // A function another GPU of this backend already took (two GPUs showing one address,
    // as a hand-edited dump does) is not this GPU's.
    let free = inv.find_pci(Some(node), g.address).filter(|&i| !inv.device(i).sources.iter().any(|s| s == NAME));
    if let Some(i) = free
        && inv.rename(i, id.clone())
    {
        // The PCI backend may have called it something else (an older kernel's class, a
        // function without a class file); KFD says it is a GPU.
        inv.device_mut(i).kind = DeviceKind::Gpu;
        return Some(i);
    }
    let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some(node));
    let vendor = g.prop("vendor_id").and_then(|v| u16::try_from(v).ok());
    let device = g.prop("device_id").and_then(|v| u16::try_from(v).ok());
    d.name = vendor.zip(device).and_then(|(v, dv)| names::device_name(v, dv));
    d.pci = Some(PciInfo {
        address: Some(g.address),
        vendor_id: vendor,
        device_id: device,
        vendor_name: vendor.and_then(names::vendor_name),
        device_name: d.name.clone(),
        ..PciInfo::default()
    });
    let before = inv.devices.len();
    let i = inv.add_device(d).ok()?;
    *added += inv.devices.len() - before;
    Some(i)
}

/// Adds what KFD and amdgpu say to the GPU's device.
fn fill(d: &mut Device, g: &PhysicalGpu, a: &AmdgpuAttrs, notes: &mut Vec<String>) {
    if !d.sources.iter().any(|s| s == NAME) {
        d.sources.push(NAME.to_owned());
    }
    let gpu = d.gpu.get_or_insert_with(GpuInfo::default);
    gpu.gfx_target = g.prop("gfx_target_version").and_then(kfd::gfx_target);
    let cus: Vec<Option<u32>> = g.nodes.iter().map(|(_, n)| PhysicalGpu::node_compute_units(n)).collect();
    gpu.compute_units = cus.iter().try_fold(0u32, |acc, c| c.map(|c| acc.saturating_add(c)));
    let hive = g.prop("hive_id").filter(|&h| h != 0).or(a.hive_id.filter(|&h| h != 0));
    gpu.xgmi_hive = hive.map(|h| format!("0x{h:016x}"));
    gpu.compute_partition_mode.clone_from(&a.compute_partition);
    gpu.memory_partition_mode.clone_from(&a.memory_partition);
    if g.partitioned {
        gpu.partitions = g
            .nodes
            .iter()
            .map(|(i, n)| GpuPartition {
                index: *i,
                compute_units: PhysicalGpu::node_compute_units(n),
                memory_bytes: PhysicalGpu::node_memory(n),
                render_minor: n.props.get_u32("drm_render_minor"),
            })
            .collect();
    }
    // Partitions the mode (or the numbering) implies but KFD does not show.
    let shown: Vec<u32> = g.nodes.iter().map(|(i, _)| *i).collect();
    let expected = a
        .compute_partition
        .as_deref()
        .and_then(amdgpu::partitions_of_mode)
        // Without the mode, the numbering: a partitioned GPU has at least two partitions.
        .unwrap_or_else(|| if g.partitioned { shown.iter().max().map_or(0, |m| m + 1).max(2) } else { 1 });
    let missing: Vec<String> = (0..expected).filter(|i| !shown.contains(i)).map(|i| i.to_string()).collect();
    if !missing.is_empty() {
        notes.push(format!(
            "{}: compute partition(s) {} not shown by KFD (hidden or missing)",
            d.id,
            missing.join(", ")
        ));
        // The shown partitions' sum is not the GPU's (as for VRAM below); each partition
        // keeps its own count.
        if let Some(gpu) = d.gpu.as_mut() {
            gpu.compute_units = None;
        }
    }
    if let Some(u) = g.unique_id.or(a.unique_id) {
        d.attrs.insert("amdgpu.unique_id".into(), format!("0x{u:016x}"));
    }
    for (k, v) in [("amdgpu.xgmi_device_id", a.xgmi_device_id), ("amdgpu.xgmi_physical_id", a.xgmi_physical_id)] {
        if let Some(v) = v {
            d.attrs.insert(k.into(), v.to_string());
        }
    }
    // VRAM: amdgpu's total, else the sum of every partition's frame buffer, but only when
    // every partition is shown and read (a partial sum would be a wrong size).
    let kfd_sum = if missing.is_empty() {
        g.nodes
            .iter()
            .map(|(_, n)| PhysicalGpu::node_memory(n))
            .try_fold(0u64, |acc, m| m.map(|m| acc.saturating_add(m)))
    } else {
        None
    };
    if let Some(size) = a.vram_total.or(kfd_sum).filter(|&s| s > 0)
        && !d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)
    {
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size, hpa: None, numa_node: None });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_topology::inventory::MAX_UNKNOWN_LINES;

    #[test]
    fn report_lines_stay_bounded_and_count_the_rest() {
        let notes: Vec<String> = (0..MAX_UNKNOWN_LINES + 10).map(|i| format!("note {i}")).collect();
        let r = finish(BackendReport::present(NAME), notes);
        assert_eq!(r.unknown.len(), MAX_UNKNOWN_LINES);
        assert_eq!(r.unknown.last().map(String::as_str), Some("… and 11 more"));
        let r = finish(BackendReport::present(NAME), vec!["one".into()]);
        assert_eq!(r.unknown, ["one"]);
    }
}
