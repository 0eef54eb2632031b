//! Reads `sys/bus/cxl/devices` into raw records: ports, memdevs, decoders, regions and DAX
//! devices, with every symlink resolved and checked to stay inside the sysfs root.
//!
//! The walk is flat (one pass over the bus directory, never a recursive descent), so a
//! symlink loop or a deep hostile tree cannot make it run away; parent/child relations come
//! from the resolved paths: the CXL core nests `portN`, `endpointN` and `decoderX.Y` inside
//! their parent port's directory and `regionN` inside its root decoder's directory.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use fabric_topology::cxl::CxlMode;

use super::parse::{
    DcPartition, DecoderAttrs, RawAttrs, RegionAttrs, parse_dc_partitions, parse_decoder, parse_decoder_name,
    parse_indexed, parse_region, parse_size,
};
use crate::sysfs::{AttrError, list_dir, parse_dec_u64, parse_numa_node, read_attr};

/// Most entries read from the bus directory (a large host has a few hundred).
pub const MAX_BUS_ENTRIES: usize = 4096;

/// Why one object or link could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// A symlink resolves outside the sysfs root (or cannot be resolved at all).
    #[error("{path}: link leaves the sysfs root or does not resolve")]
    Escapes {
        /// The link.
        path: PathBuf,
    },
    /// A directory could not be listed.
    #[error("{path}: cannot list")]
    List {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: AttrError,
    },
}

/// Which kind of CXL port object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortKind {
    /// `rootN`: the platform CXL root (ACPI0017).
    Root,
    /// `portN`: a host bridge (ACPI0016) or a switch upstream port.
    Port,
    /// `endpointN`: the port of a memdev.
    Endpoint,
}

/// A downstream port of a CXL port (`dportN`).
#[derive(Debug, Clone)]
pub struct DportRaw {
    /// The hardware port id (the number in `dportN`, used by `target_list`).
    pub id: u32,
    /// Resolved device path.
    pub path: PathBuf,
    /// Resolved `physical_node` of an ACPI companion, when the dport is an ACPI device.
    pub physical: Option<PathBuf>,
}

/// A `rootN` / `portN` / `endpointN` object.
#[derive(Debug, Clone)]
pub struct PortRaw {
    /// Kernel name (display only).
    pub name: String,
    /// Kind.
    pub kind: PortKind,
    /// Resolved directory.
    pub path: PathBuf,
    /// Resolved `uport` (with an ACPI companion's `physical_node` followed).
    pub uport: Option<PathBuf>,
    /// Resolved `parent_dport` (6.3+).
    pub parent_dport: Option<PathBuf>,
    /// Downstream ports by hardware id.
    pub dports: BTreeMap<u32, DportRaw>,
    /// `decoders_committed` (6.7+).
    pub decoders_committed: Option<u32>,
}

/// A `memN` object.
#[derive(Debug, Clone)]
pub struct MemdevRaw {
    /// Kernel name (display only).
    pub name: String,
    /// Resolved directory.
    pub path: PathBuf,
    /// The parent device directory (the PCI function), as libcxl's `host`.
    pub host: Option<PathBuf>,
    /// `serial`.
    pub serial: Option<u64>,
    /// `ram/size`.
    pub ram_size: Option<u64>,
    /// `pmem/size`.
    pub pmem_size: Option<u64>,
    /// `numa_node` (`Some(None)`: -1, no affinity).
    pub numa_node: Option<Option<u32>>,
    /// `firmware_version`.
    pub firmware_version: Option<String>,
    /// Dynamic-capacity partitions the kernel shows.
    pub dc: Vec<DcPartition>,
}

/// A `decoderX.Y` object.
#[derive(Debug, Clone)]
pub struct DecoderRaw {
    /// Kernel name (display only).
    pub name: String,
    /// The instance `Y`: the HDM decoder index within its port (a hardware index, stable).
    pub instance: u32,
    /// Resolved directory.
    pub path: PathBuf,
    /// Attributes.
    pub attrs: DecoderAttrs,
}

/// A device-DAX instance under a region.
#[derive(Debug, Clone)]
pub struct DaxRaw {
    /// Kernel name (`dax0.0`).
    pub name: String,
    /// `size` (decimal).
    pub size: Option<u64>,
    /// `target_node`: the node the memory is onlined to.
    pub target_node: Option<u32>,
    /// `numa_node`.
    pub numa_node: Option<u32>,
}

/// A `regionN` object.
#[derive(Debug, Clone)]
pub struct RegionRaw {
    /// Kernel name (display only).
    pub name: String,
    /// Resolved directory.
    pub path: PathBuf,
    /// Attributes.
    pub attrs: RegionAttrs,
    /// DAX devices.
    pub dax: Vec<DaxRaw>,
}

/// Everything read from the bus, plus `path: reason` notes for the report.
#[derive(Debug, Default)]
pub struct Scan {
    /// Ports of all kinds.
    pub ports: Vec<PortRaw>,
    /// Memdevs.
    pub memdevs: Vec<MemdevRaw>,
    /// Decoders.
    pub decoders: Vec<DecoderRaw>,
    /// Regions.
    pub regions: Vec<RegionRaw>,
    /// Unreadable, missing or invalid attributes and refused links.
    pub notes: Vec<String>,
}

/// Resolves links strictly inside one canonical root.
#[derive(Debug)]
pub struct Resolver {
    root: PathBuf,
}

impl Resolver {
    /// A resolver for `root`, which must exist.
    pub fn new(root: &Path) -> Option<Self> {
        fs::canonicalize(root).ok().map(|root| Self { root })
    }

    /// The canonical path of `p` when it resolves and stays inside the root.
    pub fn resolve(&self, p: &Path) -> Result<PathBuf, ScanError> {
        match fs::canonicalize(p) {
            Ok(c) if c.starts_with(&self.root) => Ok(c),
            _ => Err(ScanError::Escapes { path: p.to_owned() }),
        }
    }

    /// Like [`Resolver::resolve`] for an optional link: a link that does not exist is `None`
    /// without a note; one that escapes is `None` with a note.
    fn link(&self, p: &Path, notes: &mut Vec<String>) -> Option<PathBuf> {
        if fs::symlink_metadata(p).is_err() {
            return None;
        }
        self.resolve(p).map_err(|e| notes.push(e.to_string())).ok()
    }

    /// A link to a device, following an ACPI companion's `physical_node` once.
    fn device_link(&self, p: &Path, notes: &mut Vec<String>) -> (Option<PathBuf>, Option<PathBuf>) {
        let dev = self.link(p, notes);
        let phys = dev.as_ref().and_then(|d| self.link(&d.join("physical_node"), notes));
        (dev, phys)
    }
}

/// Reads attribute `rel` of `dir` into `out` when present; notes unreadable ones, and
/// missing ones when `expected`.
fn collect(dir: &Path, rel: &str, expected: bool, out: &mut RawAttrs, notes: &mut Vec<String>) {
    match read_attr(&dir.join(rel)) {
        Ok(v) => {
            out.insert(rel.to_owned(), v);
        }
        Err(e) if e.is_missing() && !expected => {}
        Err(e) => notes.push(e.to_string()),
    }
}

fn note_invalid(dir: &Path, invalid: &[String], notes: &mut Vec<String>) {
    for name in invalid {
        notes.push(format!("{}: invalid value", dir.join(name).display()));
    }
}

/// Scans `bus` (`…/sys/bus/cxl/devices`) with links resolved by `res`.
pub fn scan(bus: &Path, res: &Resolver) -> Result<Scan, ScanError> {
    let names = list_dir(bus).map_err(|source| ScanError::List { path: bus.to_owned(), source })?;
    let mut s = Scan::default();
    if names.len() > MAX_BUS_ENTRIES {
        s.notes.push(format!("{}: {} entries, only {MAX_BUS_ENTRIES} read", bus.display(), names.len()));
    }
    let mut decoder_dirs = Vec::new();
    let mut region_dirs = Vec::new();
    for name in names.into_iter().take(MAX_BUS_ENTRIES) {
        let Ok(path) = res.resolve(&bus.join(&name)).map_err(|e| s.notes.push(e.to_string())) else { continue };
        if let Some(kind) = port_kind(&name) {
            let port = scan_port(name, kind, path, res, &mut s.notes);
            s.ports.push(port);
        } else if parse_indexed(&name, "mem").is_some() {
            let m = scan_memdev(name, path, &mut s.notes);
            s.memdevs.push(m);
        } else if let Some((_, instance)) = parse_decoder_name(&name) {
            decoder_dirs.push((name, instance, path));
        } else if parse_indexed(&name, "region").is_some() {
            region_dirs.push((name, path));
        }
    }
    for (name, instance, path) in decoder_dirs {
        let kind = path.parent().and_then(|pp| s.ports.iter().find(|p| p.path == pp)).map(|p| p.kind);
        let attrs = scan_decoder(&path, kind, &mut s.notes);
        s.decoders.push(DecoderRaw { name, instance, path, attrs });
    }
    for (name, path) in region_dirs {
        let r = scan_region(name, path, res, &mut s.notes);
        s.regions.push(r);
    }
    Ok(s)
}

fn port_kind(name: &str) -> Option<PortKind> {
    if parse_indexed(name, "root").is_some() {
        Some(PortKind::Root)
    } else if parse_indexed(name, "port").is_some() {
        Some(PortKind::Port)
    } else if parse_indexed(name, "endpoint").is_some() {
        Some(PortKind::Endpoint)
    } else {
        None
    }
}

fn scan_port(name: String, kind: PortKind, path: PathBuf, res: &Resolver, notes: &mut Vec<String>) -> PortRaw {
    let (uport_dev, uport_phys) = res.device_link(&path.join("uport"), notes);
    if uport_dev.is_none() {
        notes.push(format!("{}: missing or unresolvable", path.join("uport").display()));
    }
    let parent_dport = res.link(&path.join("parent_dport"), notes);
    let mut dports = BTreeMap::new();
    for entry in list_dir(&path).unwrap_or_default() {
        let Some(id) = parse_indexed(&entry, "dport") else { continue };
        if let (Some(dev), physical) = res.device_link(&path.join(&entry), notes) {
            dports.insert(id, DportRaw { id, path: dev, physical });
        }
    }
    let mut attrs = RawAttrs::new();
    collect(&path, "decoders_committed", false, &mut attrs, notes);
    let decoders_committed = attrs.get("decoders_committed").and_then(|v| {
        let n = parse_dec_u64(v).and_then(|n| u32::try_from(n).ok());
        if n.is_none() {
            notes.push(format!("{}: invalid value", path.join("decoders_committed").display()));
        }
        n
    });
    PortRaw { name, kind, path, uport: uport_phys.or(uport_dev), parent_dport, dports, decoders_committed }
}

fn scan_memdev(name: String, path: PathBuf, notes: &mut Vec<String>) -> MemdevRaw {
    let mut a = RawAttrs::new();
    for rel in ["serial", "ram/size", "pmem/size", "numa_node", "firmware_version"] {
        collect(&path, rel, true, &mut a, notes);
    }
    let entries = list_dir(&path).unwrap_or_default();
    for dir in entries.iter().filter(|e| e.starts_with("dc") || e.starts_with("dynamic_ram")) {
        if dir == "dc" {
            for f in list_dir(&path.join("dc")).unwrap_or_default().iter().take(16) {
                collect(&path, &format!("dc/{f}"), false, &mut a, notes);
            }
        } else {
            collect(&path, &format!("{dir}/size"), false, &mut a, notes);
        }
    }
    let mut parsed = |rel: &str, f: &dyn Fn(&str) -> bool| {
        if let Some(v) = a.get(rel).filter(|v| !f(v)) {
            notes.push(format!("{}: invalid value {:?}", path.join(rel).display(), trunc(v)));
        }
    };
    parsed("serial", &|v| parse_size(v).is_some());
    parsed("ram/size", &|v| parse_size(v).is_some());
    parsed("pmem/size", &|v| parse_size(v).is_some());
    parsed("numa_node", &|v| parse_numa_node(v).is_some());
    parsed("firmware_version", &|v| printable(v).is_some());
    let get = |rel: &str| a.get(rel).map(String::as_str);
    MemdevRaw {
        host: path.parent().map(Path::to_owned),
        serial: get("serial").and_then(parse_size),
        ram_size: get("ram/size").and_then(parse_size),
        pmem_size: get("pmem/size").and_then(parse_size),
        numa_node: get("numa_node").and_then(parse_numa_node),
        firmware_version: get("firmware_version").and_then(printable),
        dc: parse_dc_partitions(&a),
        name,
        path,
    }
}

fn printable(v: &str) -> Option<String> {
    let t = v.trim();
    (!t.is_empty() && t.len() <= 64 && t.chars().all(|c| !c.is_control())).then(|| t.to_owned())
}

fn trunc(v: &str) -> String {
    v.chars().take(64).collect()
}

fn scan_decoder(path: &Path, kind: Option<PortKind>, notes: &mut Vec<String>) -> DecoderAttrs {
    let mut a = RawAttrs::new();
    let common = ["devtype", "start", "size", "interleave_ways", "interleave_granularity", "locked"];
    let (expected, optional): (&[&str], &[&str]) = match kind {
        Some(PortKind::Root) => (&["target_list", "cap_ram", "cap_pmem", "cap_type2", "cap_type3"], &["qos_class"]),
        Some(PortKind::Port) => (&["target_list"], &["target_type"]),
        Some(PortKind::Endpoint) => (&["mode", "dpa_resource", "dpa_size"], &[]),
        None => (&[], &[]),
    };
    for rel in common.iter().chain(expected) {
        collect(path, rel, *rel != "devtype" && *rel != "locked", &mut a, notes);
    }
    for rel in optional {
        collect(path, rel, false, &mut a, notes);
    }
    let d = parse_decoder(&a);
    note_invalid(path, &d.invalid, notes);
    d
}

fn scan_region(name: String, path: PathBuf, res: &Resolver, notes: &mut Vec<String>) -> RegionRaw {
    let mut a = RawAttrs::new();
    for rel in ["size", "resource", "interleave_ways", "interleave_granularity", "commit"] {
        collect(&path, rel, true, &mut a, notes);
    }
    collect(&path, "uuid", false, &mut a, notes);
    collect(&path, "mode", false, &mut a, notes);
    let entries = list_dir(&path).unwrap_or_default();
    for t in entries.iter().filter(|e| parse_indexed(e, "target").is_some()) {
        collect(&path, t, false, &mut a, notes);
    }
    let attrs = parse_region(&a);
    note_invalid(&path, &attrs.invalid, notes);
    let mut dax = Vec::new();
    for dr in entries.iter().filter(|e| e.starts_with("dax_region")) {
        let Ok(dr_path) = res.resolve(&path.join(dr)).map_err(|e| notes.push(e.to_string())) else { continue };
        let names: Vec<String> =
            list_dir(&dr_path).unwrap_or_default().into_iter().filter(|e| is_dax_name(e)).collect();
        if names.len() > 64 {
            notes.push(format!("{}: {} DAX devices, only 64 read", dr_path.display(), names.len()));
        }
        for d in names.into_iter().take(64) {
            let dp = dr_path.join(&d);
            let mut da = RawAttrs::new();
            collect(&dp, "size", true, &mut da, notes);
            collect(&dp, "target_node", false, &mut da, notes);
            collect(&dp, "numa_node", false, &mut da, notes);
            let node = |k: &str| da.get(k).and_then(|v| parse_numa_node(v)).flatten();
            dax.push(DaxRaw {
                size: da.get("size").and_then(|v| parse_size(v)),
                target_node: node("target_node"),
                numa_node: node("numa_node"),
                name: d,
            });
        }
    }
    let mut attrs = attrs;
    if !a.contains_key("mode") && attrs.uuid.is_some() {
        // Before 6.3 regions had no `mode`: only PMEM regions existed, and they carry a UUID.
        attrs.mode = Some(CxlMode::Pmem);
    }
    RegionRaw { name, path, attrs, dax }
}

fn is_dax_name(e: &str) -> bool {
    e.strip_prefix("dax")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(a, b)| parse_dec_u64(a).is_some() && parse_dec_u64(b).is_some())
}
