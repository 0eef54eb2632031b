//! NUMA nodes as region memory (`[memory] numa` and `numa_plain`): which node, whether it
//! is a memory-only node of CXL memory and of which CXL regions and memdevs, and its memory
//! as a `host_exported` resource of its `numaN` device.
//!
//! A CXL region onlined as System RAM (its DAX device bound to `kmem`) becomes a NUMA node
//! with no CPUs. The link from the node back to the CXL objects: the region's DAX device
//! names the node in `target_node` (discovery keeps it as [`CxlDax::numa_node`]), its
//! `driver` is `kmem`, and every memory block the node lists (`nodeN/memoryM`, block `M`
//! spans `[M * block_size, (M + 1) * block_size)` of host physical address space) lies inside
//! such a region's HPA range. Only then is the node "CXL memory", and the memdevs are the
//! region's targets.
//!
//! Why a `host_exported` resource of the node and not the CXL region's own resource: a
//! region's pages on a node are placed by the kernel's page allocator anywhere in the node,
//! so an offset in the CXL interleave set (and a GFA derived from it) would not say where
//! its bytes are; the address map translates GFAs of CXL resources to memdev offsets, which
//! would be false here. The node's memory is host-managed memory the daemon hands out, which
//! is what `host_exported` means; the GFA names the region, not its physical bytes.
//!
//! [`CxlDax::numa_node`]: fabric_topology::cxl::CxlDax

use fabric_drivers::sysfs::{SysfsRoot, list_dir, parse_dec_u64, parse_hex_u64, read_attr};
use fabric_topology::{DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};

/// Why a NUMA node cannot back regions.
#[derive(Debug, thiserror::Error)]
pub enum NumaError {
    /// `sys/devices/system/node/nodeN` does not exist.
    #[error("NUMA node {0} does not exist")]
    NoNode(u32),
    /// An attribute of the node is missing or malformed.
    #[error("NUMA node {node}: {what}")]
    Unreadable {
        /// The node.
        node: u32,
        /// What could not be read.
        what: String,
    },
    /// The node exists but is not what `[memory] numa` promises.
    #[error("NUMA node {node} is not served: {why}")]
    Refused {
        /// The node.
        node: u32,
        /// Why.
        why: String,
    },
    /// The fabric has no `numaN` device for it (discovery without the `pci` backend).
    #[error("NUMA node {0} has no numa{0} device in the fabric (the pci discovery backend adds NUMA nodes)")]
    NotInFabric(u32),
    /// The node has less free memory than the region asks for.
    #[error("NUMA node {node} has {free} bytes free, {len} asked")]
    NoMemory {
        /// The node.
        node: u32,
        /// `MemFree`.
        free: u64,
        /// Bytes asked.
        len: u64,
    },
    /// The region file could not be made or placed.
    #[error("region on NUMA node {node}")]
    Region {
        /// The node.
        node: u32,
        /// Why.
        #[source]
        source: super::nodefd::NodeFdError,
    },
}

/// A CXL region whose memory a node is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CxlOrigin {
    /// The address map's interleave set name (`cxl-region:hpa-…`).
    pub set: String,
    /// The kernel's region name at discovery (`region0`; display only).
    pub region: String,
    /// The DAX device `kmem` onlined (`dax0.0`).
    pub dax: String,
    /// The region's memdevs, in position order.
    pub memdevs: Vec<DeviceId>,
}

/// A NUMA node that backs regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeBacking {
    /// Node number.
    pub node: u32,
    /// `MemTotal` of the node.
    pub mem_bytes: u64,
    /// The node has no CPUs.
    pub memory_only: bool,
    /// The CXL regions its memory is (empty: not CXL memory).
    pub cxl: Vec<CxlOrigin>,
    /// Listed in `numa_plain` (served without the checks).
    pub plain: bool,
    /// The node's `meminfo` (read for `MemFree` before each region).
    pub meminfo: std::path::PathBuf,
    /// Its `numaN` device in the fabric (set by [`locate_nodes`]).
    pub device: Option<DeviceId>,
    /// The tmpfs directory its region files go under (`super::numadir`; set by the daemon
    /// before the registry opens).
    pub dir: std::path::PathBuf,
}

/// A memory block directory name `memoryM` as M.
pub fn parse_block_name(name: &str) -> Option<u64> {
    let m = name.strip_prefix("memory")?;
    if m.is_empty() || !m.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    parse_dec_u64(m)
}

/// `block_size_bytes` (hex, no `0x`): a non-zero power of two.
pub fn parse_block_size(text: &str) -> Option<u64> {
    parse_hex_u64(text).filter(|s| s.is_power_of_two())
}

/// A `meminfo` field (`Node 1 MemFree:  123 kB`) in bytes.
pub fn parse_meminfo_field(text: &str, field: &str) -> Option<u64> {
    let tag = format!("{field}:");
    for line in text.lines() {
        let Some((_, rest)) = line.split_once(tag.as_str()) else { continue };
        let mut it = rest.split_whitespace();
        let (Some(num), Some("kB"), None) = (it.next(), it.next(), it.next()) else { return None };
        return parse_dec_u64(num)?.checked_mul(1024);
    }
    None
}

/// The node's memory blocks' HPA ranges `[start, end)`, or why they cannot be read.
fn blocks(root: &SysfsRoot, node: u32) -> Result<Vec<(u64, u64)>, String> {
    let bs_path = root.path("sys/devices/system/memory/block_size_bytes");
    let bs = read_attr(&bs_path)
        .ok()
        .and_then(|t| parse_block_size(&t))
        .ok_or_else(|| format!("{} is missing or not a power of two", bs_path.display()))?;
    let dir = root.path(format!("sys/devices/system/node/node{node}"));
    let names = list_dir(&dir).map_err(|e| e.to_string())?;
    let mut out: Vec<(u64, u64)> = names
        .iter()
        .filter_map(|n| parse_block_name(n))
        .filter_map(|m| m.checked_mul(bs).and_then(|s| Some((s, s.checked_add(bs)?))))
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// The CXL regions node `node`'s memory is, or why it is not CXL memory.
fn cxl_origin(root: &SysfsRoot, inv: &Inventory, node: u32) -> Result<Vec<CxlOrigin>, String> {
    let mut origins = Vec::new();
    let mut ranges = Vec::new();
    for r in &inv.cxl.regions {
        for d in r.dax.iter().filter(|d| d.numa_node == Some(node)) {
            let driver = fabric_drivers::sysfs::link_name(&root.path(format!("sys/bus/dax/devices/{}/driver", d.name)));
            if driver.as_deref().ok() != Some("kmem") {
                continue;
            }
            let (Some(set), Some(start), Some(size)) = (fabric_addrmap::sync::set_name(r), r.resource, r.size) else {
                continue;
            };
            ranges.push((start, start.saturating_add(size)));
            origins.push(CxlOrigin {
                set,
                region: r.kernel_name.clone(),
                dax: d.name.clone(),
                memdevs: r.targets.clone(),
            });
        }
    }
    if origins.is_empty() {
        return Err("no CXL region's DAX device is onlined to it by kmem".to_owned());
    }
    let blocks = blocks(root, node)?;
    if blocks.is_empty() {
        return Err("it lists no memory blocks".to_owned());
    }
    if let Some((s, _)) = blocks.iter().find(|(s, e)| !ranges.iter().any(|(a, b)| a <= s && e <= b)) {
        return Err(format!("its memory block at {s:#x} is outside its CXL regions (the node holds other memory)"));
    }
    Ok(origins)
}

/// Resolves NUMA node `node` under `root` against the CXL objects of `inv`. Unless `plain`,
/// the node must have no CPUs and its memory must be CXL regions' (see the module docs).
pub fn resolve_node(root: &SysfsRoot, inv: &Inventory, node: u32, plain: bool) -> Result<NodeBacking, NumaError> {
    let dir = root.path(format!("sys/devices/system/node/node{node}"));
    if !dir.is_dir() {
        return Err(NumaError::NoNode(node));
    }
    let unreadable = |what: String| NumaError::Unreadable { node, what };
    let cpulist = read_attr(&dir.join("cpulist")).map_err(|e| unreadable(e.to_string()))?;
    let cpus =
        fabric_drivers::pci::attrs::parse_cpulist(cpulist.trim()).map_err(|e| unreadable(format!("cpulist: {e}")))?;
    let meminfo = dir.join("meminfo");
    let text = read_attr(&meminfo).map_err(|e| unreadable(e.to_string()))?;
    let mem_bytes = parse_meminfo_field(&text, "MemTotal").ok_or_else(|| unreadable("meminfo: no MemTotal".into()))?;
    let refused = |why: String| NumaError::Refused { node, why };
    if mem_bytes == 0 {
        return Err(refused("it has no memory online".into()));
    }
    let memory_only = cpus.is_empty();
    let hint = "list it in [memory] numa_plain to serve it anyway";
    let cxl = match cxl_origin(root, inv, node) {
        Ok(o) => o,
        Err(_) if plain => Vec::new(),
        Err(why) => return Err(refused(format!("it is not CXL memory: {why}; {hint}"))),
    };
    if !memory_only && !plain {
        return Err(refused(format!("it has CPUs ({cpulist}), so it is not a memory-only node; {hint}")));
    }
    Ok(NodeBacking { node, mem_bytes, memory_only, cxl, plain, meminfo, device: None, dir: std::path::PathBuf::new() })
}

/// Resolves every node `[memory] numa` and `numa_plain` list.
pub fn resolve(root: &SysfsRoot, inv: &Inventory, numa: &[u32], plain: &[u32]) -> Result<Vec<NodeBacking>, NumaError> {
    let listed = numa.iter().map(|&n| (n, false)).chain(plain.iter().map(|&n| (n, true)));
    listed.map(|(n, p)| resolve_node(root, inv, n, p)).collect()
}

/// The `numaN` device of node `node`.
pub fn node_device(inv: &Inventory, node: u32) -> Option<DeviceId> {
    inv.devices
        .iter()
        .find(|d| matches!(d.kind, DeviceKind::Cpu | DeviceKind::MemoryNode) && d.numa_node == Some(node))
        .map(|d| d.id.clone())
}

/// Finds each node's `numaN` device in `inv` (after [`add_node_resources`] ran on it).
pub fn locate_nodes(inv: &Inventory, nodes: &mut [NodeBacking]) -> Result<(), NumaError> {
    for n in nodes {
        n.device = Some(node_device(inv, n.node).ok_or(NumaError::NotInFabric(n.node))?);
    }
    Ok(())
}

/// Makes each served node's memory a `host_exported` resource of its `numaN` device (in
/// place of its `dram` resource), and records on the device what the node is
/// (`numa.memory_only`, `numa.served`, `cxl.regions`, `cxl.memdevs`). Returns the nodes with
/// no device in `inv`.
pub fn add_node_resources(inv: &mut Inventory, nodes: &[NodeBacking]) -> Vec<u32> {
    let mut absent = Vec::new();
    for n in nodes {
        let Some(dev) = inv
            .devices
            .iter_mut()
            .find(|d| matches!(d.kind, DeviceKind::Cpu | DeviceKind::MemoryNode) && d.numa_node == Some(n.node))
        else {
            absent.push(n.node);
            continue;
        };
        dev.memory.retain(|m| !matches!(m.kind, MemoryKind::Dram | MemoryKind::HostExported));
        dev.memory.push(MemoryResource {
            kind: MemoryKind::HostExported,
            size: n.mem_bytes,
            hpa: None,
            numa_node: Some(n.node),
        });
        dev.attrs.insert("numa.memory_only".into(), n.memory_only.to_string());
        dev.attrs.insert("numa.served".into(), if n.plain { "plain" } else { "cxl" }.into());
        if !n.cxl.is_empty() {
            let sets: Vec<&str> = n.cxl.iter().map(|o| o.set.as_str()).collect();
            let memdevs: Vec<String> = n.cxl.iter().flat_map(|o| o.memdevs.iter().map(|m| m.to_string())).collect();
            dev.attrs.insert("cxl.regions".into(), sets.join(" "));
            dev.attrs.insert("cxl.memdevs".into(), memdevs.join(" "));
        }
    }
    absent
}

impl NodeBacking {
    /// A new region of `len` bytes on the node: the tmpfs file `path` whose pages are all on
    /// the node. Refused when the node has less free memory than `len` (faulting bound pages
    /// in on a full node would wake the OOM killer).
    pub fn make_region(&self, path: &std::path::Path, len: u64) -> Result<std::os::fd::OwnedFd, NumaError> {
        let node = self.node;
        if let Some(free) = read_attr(&self.meminfo).ok().and_then(|t| parse_meminfo_field(&t, "MemFree"))
            && free < len
        {
            return Err(NumaError::NoMemory { node, free, len });
        }
        super::nodefd::node_file(path, len, node).map_err(|source| NumaError::Region { node, source })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use fabric_topology::cxl::{CxlDax, CxlRegion};

    /// Node `node` with `cpulist`, 1 GiB of memory and memory blocks `blocks` (128 MiB
    /// each), and a CXL region at HPA 16 GiB + 1 GiB whose DAX device dax0.0 targets node 1,
    /// bound to `driver`.
    fn tree(cpulist: &str, blocks: &[u64], driver: &str) -> (tempfile::TempDir, Inventory) {
        let t = tempfile::tempdir().unwrap();
        let nd = t.path().join("sys/devices/system/node/node1");
        std::fs::create_dir_all(&nd).unwrap();
        std::fs::write(nd.join("cpulist"), format!("{cpulist}\n")).unwrap();
        std::fs::write(nd.join("meminfo"), "Node 1 MemTotal:     1048576 kB\nNode 1 MemFree:      1000000 kB\n")
            .unwrap();
        let mem = t.path().join("sys/devices/system/memory");
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::write(mem.join("block_size_bytes"), "8000000\n").unwrap();
        for b in blocks {
            std::fs::create_dir_all(mem.join(format!("memory{b}"))).unwrap();
            std::os::unix::fs::symlink(mem.join(format!("memory{b}")), nd.join(format!("memory{b}"))).unwrap();
        }
        let dax = t.path().join("sys/bus/dax/devices/dax0.0");
        std::fs::create_dir_all(&dax).unwrap();
        let drv = t.path().join("sys/bus/dax/drivers").join(driver);
        std::fs::create_dir_all(&drv).unwrap();
        std::os::unix::fs::symlink(&drv, dax.join("driver")).unwrap();
        let mut inv = Inventory::default();
        inv.cxl.regions.push(CxlRegion {
            kernel_name: "region0".into(),
            uuid: None,
            mode: None,
            resource: Some(16 << 30),
            size: Some(1 << 30),
            ways: Some(2),
            granularity: Some(256),
            targets: vec![DeviceId::serial("cxl", "0x1000"), DeviceId::serial("cxl", "0x1001")],
            committed: Some(true),
            dax: vec![CxlDax { name: "dax0.0".into(), size: Some(1 << 30), numa_node: Some(1) }],
            root_decoder: None,
        });
        (t, inv)
    }

    /// Blocks 128..136 are exactly the region (16 GiB / 128 MiB = 128).
    const REGION_BLOCKS: [u64; 8] = [128, 129, 130, 131, 132, 133, 134, 135];

    fn resolve1(t: &tempfile::TempDir, inv: &Inventory, plain: bool) -> Result<NodeBacking, NumaError> {
        resolve_node(&SysfsRoot::new(t.path(), ""), inv, 1, plain)
    }

    #[test]
    fn a_memory_only_node_of_a_kmem_region_is_cxl_memory() {
        let (t, inv) = tree("", &REGION_BLOCKS, "kmem");
        let b = resolve1(&t, &inv, false).unwrap();
        assert_eq!((b.node, b.mem_bytes, b.memory_only, b.plain), (1, 1 << 30, true, false));
        assert_eq!(b.cxl.len(), 1);
        assert_eq!(b.cxl[0].set, "cxl-region:hpa-0x400000000");
        assert_eq!(b.cxl[0].dax, "dax0.0");
        assert_eq!(b.cxl[0].memdevs.len(), 2);
        // Part of the region onlined is still inside it.
        let (t, inv) = tree("", &REGION_BLOCKS[2..5], "kmem");
        assert!(resolve1(&t, &inv, false).is_ok());
    }

    #[test]
    fn nodes_that_are_not_cxl_memory_only_are_refused_unless_plain() {
        // CPUs on the node.
        let (t, inv) = tree("0-3", &REGION_BLOCKS, "kmem");
        let e = resolve1(&t, &inv, false).unwrap_err();
        assert!(e.to_string().contains("memory-only"), "{e}");
        let b = resolve1(&t, &inv, true).unwrap();
        assert!(!b.memory_only && b.plain && b.cxl.len() == 1);
        // The DAX device is not onlined (device_dax): not CXL memory of the node.
        let (t, inv) = tree("", &REGION_BLOCKS, "device_dax");
        assert!(resolve1(&t, &inv, false).unwrap_err().to_string().contains("kmem"));
        assert!(resolve1(&t, &inv, true).unwrap().cxl.is_empty());
        // A block outside the region: the node holds other memory too.
        let (t, inv) = tree("", &[127, 128, 129], "kmem");
        let e = resolve1(&t, &inv, false).unwrap_err();
        assert!(e.to_string().contains("0x3f8000000"), "{e}");
        // No CXL region names the node.
        let (t, _) = tree("", &REGION_BLOCKS, "kmem");
        assert!(matches!(resolve1(&t, &Inventory::default(), false), Err(NumaError::Refused { .. })));
        assert!(resolve1(&t, &Inventory::default(), true).is_ok());
    }

    #[test]
    fn missing_and_broken_nodes_are_typed_errors() {
        let (t, inv) = tree("", &REGION_BLOCKS, "kmem");
        let root = SysfsRoot::new(t.path(), "");
        assert!(matches!(resolve_node(&root, &inv, 7, true), Err(NumaError::NoNode(7))));
        let nd = t.path().join("sys/devices/system/node/node1");
        std::fs::write(nd.join("meminfo"), "Node 1 MemTotal:  0 kB\n").unwrap();
        assert!(resolve1(&t, &inv, true).unwrap_err().to_string().contains("no memory"));
        std::fs::write(nd.join("meminfo"), "garbage\n").unwrap();
        assert!(matches!(resolve1(&t, &inv, true), Err(NumaError::Unreadable { .. })));
        std::fs::write(nd.join("cpulist"), "x-y\n").unwrap();
        assert!(matches!(resolve1(&t, &inv, true), Err(NumaError::Unreadable { .. })));
        // Both lists resolve, and the first refusal fails the whole.
        std::fs::write(nd.join("cpulist"), "\n").unwrap();
        std::fs::write(nd.join("meminfo"), "Node 1 MemTotal:  1048576 kB\n").unwrap();
        assert_eq!(resolve(&root, &inv, &[1], &[]).unwrap().len(), 1);
        assert!(resolve(&root, &inv, &[1], &[3]).is_err());
    }

    #[test]
    fn a_served_node_becomes_a_host_exported_resource_of_its_device() {
        use fabric_topology::Device;
        let (t, inv0) = tree("", &REGION_BLOCKS, "kmem");
        let b = resolve1(&t, &inv0, false).unwrap();
        let mut inv = Inventory::default();
        let mut dev = Device::new(DeviceId::named("n", "numa1"), DeviceKind::Cpu, Some("n"));
        dev.numa_node = Some(1);
        dev.memory.push(MemoryResource { kind: MemoryKind::Dram, size: 1 << 30, hpa: None, numa_node: Some(1) });
        inv.add_device(dev).unwrap();
        assert!(add_node_resources(&mut inv, std::slice::from_ref(&b)).is_empty());
        let d = &inv.devices[0];
        assert_eq!(d.memory.len(), 1);
        assert_eq!((d.memory[0].kind, d.memory[0].size), (MemoryKind::HostExported, 1 << 30));
        assert_eq!(d.attrs.get("cxl.regions").map(String::as_str), Some("cxl-region:hpa-0x400000000"));
        assert_eq!(d.attrs.get("numa.served").map(String::as_str), Some("cxl"));
        assert!(d.attrs.get("cxl.memdevs").unwrap().contains("0x1001"));
        let mut nodes = vec![b];
        locate_nodes(&inv, &mut nodes).unwrap();
        assert_eq!(nodes[0].device, Some(DeviceId::named("n", "numa1")));
        assert!(matches!(locate_nodes(&Inventory::default(), &mut nodes), Err(NumaError::NotInFabric(1))));
        assert_eq!(add_node_resources(&mut Inventory::default(), &nodes), vec![1]);
    }

    #[test]
    fn parsers() {
        assert_eq!(parse_block_name("memory32"), Some(32));
        for bad in ["memory", "memoryx", "memory-1", "memory+1", "block_size_bytes", "memory99999999999999999999999"] {
            assert_eq!(parse_block_name(bad), None, "{bad}");
        }
        assert_eq!(parse_block_size("8000000\n"), Some(128 << 20));
        assert_eq!(parse_block_size("0"), None);
        assert_eq!(parse_block_size("3"), None);
        let mi = "Node 0 MemTotal:  2048 kB\nNode 0 MemFree:   1024 kB\n";
        assert_eq!(parse_meminfo_field(mi, "MemFree"), Some(1 << 20));
        assert_eq!(parse_meminfo_field(mi, "MemTotal"), Some(2 << 20));
        assert_eq!(parse_meminfo_field("Node 0 MemFree: 12 MB\n", "MemFree"), None);
        assert_eq!(parse_meminfo_field("Node 0 MemFree: 99999999999999999999 kB\n", "MemFree"), None);
        assert_eq!(parse_meminfo_field(mi, "Active"), None);
    }
}
