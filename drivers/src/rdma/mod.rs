//! RDMA NICs from `/sys/class/infiniband`: ports, state, rate, link layer (InfiniBand or
//! RoCE), GIDs, GUIDs, the netdev behind each port, and GPUDirect RDMA availability.
//!
//! Each RDMA device is attached to its PCI function (found by following the class link
//! into `sys/devices`), which becomes a NIC; one without a PCI function (Soft-RoCE `rxe0`
//! on a netdev, `siw`) is added as `name:NODE/<device>`. Each port becomes a network link
//! to the port's link partner, which sysfs does not name: the partner is a device of its
//! own (`name:NODE/<device>/port<N>/peer`, kind `other`) so the link can carry the port's
//! rate and state — down or degraded ports show as such wherever links do.

pub mod attrs;
pub mod read;

use std::path::Path;

use fabric_topology::{
    BackendReport, Bandwidth, Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind, LinkState,
    PciAddress, RdmaDevice,
};

use crate::Backend;
use crate::pci::tree::resolve_function_link;
use crate::sysfs::{SysfsRoot, list_dir};

/// The backend's name in reports and device sources.
pub const NAME: &str = "rdma";
/// Where the kernel lists RDMA devices.
pub const CLASS_DIR: &str = "sys/class/infiniband";
/// RDMA devices read (a host with every SR-IOV VF bound has a few hundred).
pub const MAX_DEVICES: usize = 1024;

/// The files whose presence says a GPU peer-memory client is loaded, as NCCL checks them
/// (`ncclIbGdrSupport`): MLNX_OFED's `nv_peer_mem` (and its non-coherent variant) register
/// under `memory_peers`; the driver's own `nvidia_peermem` module shows its version.
pub const PEER_MEMORY_FILES: [&str; 3] = [
    "sys/kernel/mm/memory_peers/nv_mem/version",
    "sys/kernel/mm/memory_peers/nv_mem_nc/version",
    "sys/module/nvidia_peermem/version",
];

/// RDMA devices under a sysfs root.
#[derive(Debug, Clone)]
pub struct RdmaBackend {
    root: SysfsRoot,
}

impl RdmaBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }
}

impl Backend for RdmaBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn discover(&self, inv: &mut Inventory) -> BackendReport {
        discover(&self.root, inv)
    }
}

/// The first peer-memory file present under the root.
pub fn peer_memory(root: &SysfsRoot) -> Option<String> {
    PEER_MEMORY_FILES.iter().find(|p| root.path(p).exists()).map(|p| (*p).to_owned())
}

/// The PCI function an RDMA device's path (relative to `sys/devices`) sits under: the
/// component before `infiniband/<name>`.
fn function_of(rel: &str) -> Option<PciAddress> {
    let parts: Vec<&str> = rel.split('/').collect();
    let at = parts.iter().rposition(|p| *p == "infiniband")?;
    parts.get(at.checked_sub(1)?)?.parse().ok()
}

fn discover(root: &SysfsRoot, inv: &mut Inventory) -> BackendReport {
    let class = root.path(CLASS_DIR);
    if !class.is_dir() {
        return BackendReport::not_present(NAME, format!("no {CLASS_DIR} (no RDMA driver loaded)"));
    }
    let mut report = BackendReport::present(NAME);
    let mut notes = Vec::new();
    let names = match list_dir(&class) {
        Ok(n) => n,
        Err(e) => return BackendReport::failed(NAME, e.to_string()),
    };
    if names.len() > MAX_DEVICES {
        notes.push(format!("{} RDMA devices beyond the first {MAX_DEVICES} not read", names.len() - MAX_DEVICES));
    }
    let peer = peer_memory(root);
    let node = root.node().to_owned();
    for entry in names.into_iter().take(MAX_DEVICES) {
        let Some(name) = attrs::name(&entry) else {
            notes.push(format!("infiniband/{}: not a device name; skipped", entry.escape_debug()));
            continue;
        };
        let (rel, real) = match resolve_function_link(root, &class.join(&name)) {
            Ok(x) => x,
            Err(e) => {
                notes.push(format!("infiniband/{name}: skipped ({e})"));
                continue;
            }
        };
        let function = function_of(&rel);
        let netdevs: Vec<String> = match function {
            Some(_) => real
                .parent()
                .and_then(Path::parent)
                .map(|f| list_dir(&f.join("net")).unwrap_or_default())
                .unwrap_or_default()
                .iter()
                .filter_map(|n| attrs::name(n))
                .take(16)
                .collect(),
            None => Vec::new(),
        };
        let mut dev = read::device(&real, &name, &netdevs, &mut notes);
        dev.peer_memory.clone_from(&peer);
        let Some(nic) = place(inv, &node, &name, function, &mut report.devices) else {
            notes.push(format!("{name}: could not be added"));
            continue;
        };
        connect(inv, &node, nic, &dev, &mut report.devices, &mut notes);
        let d = inv.device_mut(nic);
        if !d.sources.iter().any(|s| s == NAME) {
            d.sources.push(NAME.to_owned());
        }
        if peer.is_some() {
            // What NCCL writes as `gdr` for its nets when a peer-memory client is loaded.
            d.attrs.insert("gdr".to_owned(), "1".to_owned());
        }
        d.rdma.push(dev);
    }
    finish(report, notes)
}

/// The NIC for an RDMA device: its PCI function, else a device of its own.
fn place(
    inv: &mut Inventory,
    node: &str,
    name: &str,
    function: Option<PciAddress>,
    added: &mut usize,
) -> Option<DeviceIdx> {
    if let Some(i) = function.and_then(|a| inv.find_pci(Some(node), a)) {
        let d = inv.device_mut(i);
        // A function that carries an RDMA device is a NIC whatever its class says (an
        // InfiniBand controller of class 0x0c06 or a function without a class file).
        if d.kind == DeviceKind::Other {
            d.kind = DeviceKind::Nic;
        }
        d.attrs.entry("ib_device".to_owned()).or_insert_with(|| name.to_owned());
        return Some(i);
    }
    // Named after the RDMA device, which the user names (`rdma link add numa0 type rxe
    // ...`): a device of that name that is not this RDMA device's NIC (a NUMA node, a host
    // bridge) is not taken over; the NIC is named in a namespace of its own instead.
    let mut id = DeviceId::named(node, name);
    if let Some(i) = inv.find(&id) {
        let d = inv.device(i);
        if d.kind == DeviceKind::Nic && d.attrs.get("ib_device").is_some_and(|n| n == name) {
            return Some(i);
        }
        id = DeviceId::named(node, &format!("rdma/{name}"));
        if let Some(i) = inv.find(&id) {
            return Some(i);
        }
    }
    let mut d = Device::new(id, DeviceKind::Nic, Some(node));
    d.name = Some(match function {
        Some(a) => format!("RDMA device {name} (PCI function {a} not found)"),
        None => format!("RDMA device {name} (no PCI function)"),
    });
    d.attrs.insert("ib_device".to_owned(), name.to_owned());
    let i = inv.add_device(d).ok()?;
    *added += 1;
    Some(i)
}

/// One network link per port, to the port's link partner.
fn connect(
    inv: &mut Inventory,
    node: &str,
    nic: DeviceIdx,
    dev: &RdmaDevice,
    added: &mut usize,
    notes: &mut Vec<String>,
) {
    for p in &dev.ports {
        let id = DeviceId::named(node, &format!("{}/port{}/peer", dev.name, p.number));
        let peer = match inv.find(&id) {
            Some(i) => i,
            None => {
                let mut d = Device::new(id, DeviceKind::Other, Some(node));
                d.name = Some(format!("link partner of {} port {} (not visible in sysfs)", dev.name, p.number));
                d.sources.push(NAME.to_owned());
                let Ok(i) = inv.add_device(d) else { continue };
                *added += 1;
                i
            }
        };
        let state = p.link_state();
        let gbps = p.rate_mbps.map_or(0, |m| u32::try_from(m / 1000).unwrap_or(u32::MAX));
        // MB/s per direction from Mb/s; a port that carries no data has none of its rate.
        let max = p.rate_mbps.map(|m| m / 8);
        let bandwidth = match state {
            LinkState::Up => Bandwidth { current_mbps: max, max_mbps: max },
            LinkState::Degraded => Bandwidth { current_mbps: Some(0), max_mbps: max },
            LinkState::Down => Bandwidth { current_mbps: None, max_mbps: max },
        };
        let mut link = Link::new(nic, peer, LinkKind::Network { gbps }, bandwidth, None);
        link.state = state;
        inv.add_link(link);
        if state != LinkState::Up {
            let say = |v: Option<String>| v.unwrap_or_else(|| "unknown".to_owned());
            notes.push(format!(
                "{} port {}: {} (state {}, phys_state {})",
                dev.name,
                p.number,
                if state == LinkState::Down { "down" } else { "degraded" },
                say(p.state.map(|s| format!("{s:?}"))),
                say(p.phys_state.map(|s| format!("{s:?}"))),
            ));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_devices_hang_off_the_function_before_infiniband() {
        let a: PciAddress = "0000:82:00.0".parse().unwrap();
        assert_eq!(function_of("pci0000:80/0000:80:02.2/0000:82:00.0/infiniband/mlx4_0"), Some(a));
        assert_eq!(function_of("virtual/infiniband/rxe0"), None);
        assert_eq!(function_of("infiniband/x"), None);
    }
}
