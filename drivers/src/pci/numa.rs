//! NUMA nodes as devices: one `Cpu` device per `sys/devices/system/node/nodeN` with CPUs
//! (its CPUs and DRAM), one `MemoryNode` device per node whose `cpulist` is empty (CXL,
//! soft-reserved, NVDIMM or device memory the kernel onlined as a node: fabric memory, not
//! the host's DRAM); CPU nodes linked pairwise by the SMP interconnect and to every memory
//! node; a single `package` device when the tree has no NUMA nodes.

use std::collections::BTreeMap;
use std::path::Path;

use fabric_topology::{
    BackendReport, Bandwidth, CpuSet, Device, DeviceId, DeviceIdx, DeviceKind, Inventory, Link, LinkKind, MemoryKind,
    MemoryOrigin, MemoryResource, NumaMemoryInfo,
};

use super::add;
use super::attrs::{self, AttrParseError};
use crate::SysfsRoot;
use crate::sysfs::{self, AttrError};

/// Why the NUMA layout could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    /// The node directory exists but cannot be listed.
    #[error("cannot list NUMA nodes")]
    List(#[source] AttrError),
}

/// The most NUMA nodes read (the kernel's MAX_NUMNODES is at most 1024).
pub const MAX_NODES: usize = 1024;

/// A NUMA node directory name `nodeN` as N.
pub fn parse_node_name(name: &str) -> Option<u32> {
    let n = name.strip_prefix("node")?;
    sysfs::parse_dec_u64(n).and_then(|v| u32::try_from(v).ok()).filter(|&v| v < 65_536)
}

/// What one NUMA node directory says.
#[derive(Debug, Clone, PartialEq)]
pub struct NumaNode {
    /// Node number.
    pub id: u32,
    /// `cpulist`.
    pub cpus: Option<CpuSet>,
    /// `meminfo` MemTotal in bytes.
    pub mem_bytes: Option<u64>,
    /// `distance` row.
    pub distance: Option<Vec<u32>>,
}

fn read_parsed<T>(path: &Path, parse: impl FnOnce(&str) -> Result<T, AttrParseError>) -> Result<T, AttrError> {
    let text = sysfs::read_attr(path)?;
    parse(&text).map_err(|e| AttrError::Invalid { path: path.to_owned(), value: e.to_string() })
}

fn noted<T>(report: &mut BackendReport, r: Result<T, AttrError>) -> Option<T> {
    r.map_err(|e| report.note_unknown(e.to_string())).ok()
}

/// Reads the NUMA nodes under the root, sorted by number.
pub fn read_nodes(root: &SysfsRoot, report: &mut BackendReport) -> Result<Vec<NumaNode>, NumaError> {
    let dir = root.path("sys/devices/system/node");
    let mut ids = Vec::new();
    for name in sysfs::list_dir(&dir).map_err(NumaError::List)? {
        match parse_node_name(&name) {
            Some(id) => ids.push(id),
            // `node` followed by anything but a plain number below 65,536 is not a node
            // the kernel makes: say so rather than drop it.
            None if name.len() > 4 && name.starts_with("node") && name[4..].bytes().all(|b| b.is_ascii_digit()) => {
                report.note_unknown(format!("{}: not a NUMA node number, skipped", dir.join(&name).display()));
            }
            None => {}
        }
    }
    ids.sort_unstable();
    if ids.len() > MAX_NODES {
        report.note_unknown(format!("{}: {} NUMA nodes, reading the first {MAX_NODES}", dir.display(), ids.len()));
        ids.truncate(MAX_NODES);
    }
    Ok(ids
        .into_iter()
        .map(|id| {
            let nd = dir.join(format!("node{id}"));
            NumaNode {
                id,
                cpus: noted(report, read_parsed(&nd.join("cpulist"), attrs::parse_cpulist)),
                mem_bytes: noted(report, read_parsed(&nd.join("meminfo"), attrs::parse_meminfo_total)),
                distance: noted(report, read_parsed(&nd.join("distance"), attrs::parse_distance)),
            }
        })
        .collect())
}

/// CPU devices added to the inventory, by NUMA node number.
#[derive(Debug, Default)]
pub struct Cpus {
    /// `numaN` devices by N.
    pub by_node: BTreeMap<u32, DeviceIdx>,
    /// The `package` device when there are no NUMA nodes.
    pub package: Option<DeviceIdx>,
    /// Memory-only `numaN` devices by N: never a host bridge's anchor.
    pub memory_nodes: BTreeMap<u32, DeviceIdx>,
    /// Devices this call added (not counting ones already present).
    pub added: usize,
}

impl Cpus {
    /// The CPU device for a NUMA node, or the only CPU device when there is just one.
    pub fn for_node(&self, node: Option<u32>) -> Option<DeviceIdx> {
        if let Some(i) = node.and_then(|n| self.by_node.get(&n)) {
            return Some(*i);
        }
        self.only()
    }

    /// The single CPU device, when there is exactly one.
    pub fn only(&self) -> Option<DeviceIdx> {
        match (self.by_node.len(), self.package) {
            (0, p) => p,
            (1, None) => self.by_node.values().next().copied(),
            _ => None,
        }
    }
}

/// Adds the CPU devices for `nodes` (or one `package` device) and the SMP links between
/// them.
pub fn add_cpus(inv: &mut Inventory, root: &SysfsRoot, nodes: &[NumaNode], report: &mut BackendReport) -> Cpus {
    let node = root.node();
    let mut cpus = Cpus::default();
    if nodes.is_empty() {
        let mut dev = Device::new(DeviceId::named(node, "package"), DeviceKind::Cpu, Some(node));
        dev.name = Some("package".to_owned());
        let online = root.path("sys/devices/system/cpu/online");
        dev.local_cpus = match read_parsed(&online, attrs::parse_cpulist) {
            Ok(c) => Some(c),
            Err(e) => {
                report.note_unknown(e.to_string());
                None
            }
        };
        cpus.package = add(inv, dev, &mut cpus.added);
        return cpus;
    }
    for n in nodes {
        // An empty cpulist is the kernel saying "no CPUs"; a missing one says nothing, so
        // such a node stays a CPU node (the conservative reading) and its gap is reported.
        let memory_only = n.cpus.as_ref().is_some_and(CpuSet::is_empty);
        let kind = if memory_only { DeviceKind::MemoryNode } else { DeviceKind::Cpu };
        let mut dev = Device::new(DeviceId::named(node, &format!("numa{}", n.id)), kind, Some(node));
        dev.name =
            Some(if memory_only { format!("NUMA node {} (memory only)", n.id) } else { format!("NUMA node {}", n.id) });
        dev.numa_node = Some(n.id);
        dev.local_cpus = n.cpus.clone().filter(|c| !c.is_empty());
        // A memory-only node's memory is fabric memory with a place in the address map
        // (host_exported); a CPU node's is the host's own DRAM.
        let mem_kind = if memory_only { MemoryKind::HostExported } else { MemoryKind::Dram };
        if let Some(size) = n.mem_bytes {
            dev.memory.push(MemoryResource { kind: mem_kind, size, hpa: None, numa_node: Some(n.id) });
        }
        if memory_only {
            dev.numa_memory = Some(NumaMemoryInfo {
                memory_only: true,
                origin: MemoryOrigin::Unknown,
                tier: None,
                access: Vec::new(),
                caches: Vec::new(),
            });
        }
        if let Some(d) = &n.distance {
            let row: Vec<String> = d.iter().map(u32::to_string).collect();
            dev.attrs.insert("numa.distance".to_owned(), row.join(" "));
        }
        if let Some(idx) = add(inv, dev, &mut cpus.added) {
            if memory_only {
                cpus.memory_nodes.insert(n.id, idx);
            } else {
                cpus.by_node.insert(n.id, idx);
            }
        }
    }
    let idxs: Vec<DeviceIdx> = cpus.by_node.values().copied().collect();
    for (i, &a) in idxs.iter().enumerate() {
        for &b in &idxs[i + 1..] {
            inv.add_link(Link::new(a, b, LinkKind::Smp, Bandwidth::default(), None));
        }
    }
    // Every CPU reaches every memory node through the SMP fabric; the HMAT figures, where
    // the firmware gives them, are put on these links by the hmem backend. Memory nodes are
    // not linked to each other: no traffic passes through one.
    for &m in cpus.memory_nodes.values() {
        for &c in &idxs {
            inv.add_link(Link::new(c, m, LinkKind::Smp, Bandwidth::default(), None));
        }
    }
    cpus
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_names() {
        assert_eq!(parse_node_name("node0"), Some(0));
        assert_eq!(parse_node_name("node17"), Some(17));
        for bad in ["node", "nodex", "node-1", "possible", "has_cpu", "node99999999999999999999"] {
            assert_eq!(parse_node_name(bad), None, "{bad}");
        }
    }
}
