//! PCI discovery from sysfs: NUMA nodes as CPU devices, host bridges, every PCI function
//! under `sys/bus/pci/devices` with its attributes, and the PCIe hierarchy as links.
//!
//! Works on any tree under an injected [`SysfsRoot`] and as non-root (of config space only the
//! first four bytes are read, of awake functions, as a liveness probe: [`health`]). Whatever a tree does not expose stays `None` and is summarised in the report, one
//! line per attribute. The text parsers are pure and public so they can be fuzzed.

mod assemble;
pub mod attrs;
pub mod health;
pub mod kind;
pub mod names;
pub mod numa;
pub mod tree;

use std::collections::BTreeMap;
use std::path::PathBuf;

use fabric_topology::{BackendReport, BackendState, Device, DeviceIdx, Inventory, PciAddress, error_chain};

pub use attrs::{
    AttrParseError, FunctionAttrs, parse_class, parse_cpulist, parse_cpumask, parse_distance, parse_id16,
    parse_iommu_group, parse_link_speed, parse_link_width, parse_meminfo_total, parse_resource,
};
pub use kind::classify;
pub use numa::{NumaError, parse_node_name};
pub use tree::{DevicePath, PathNode, TreeError, Upstream, parse_device_path, parse_host_bridge_name};

use crate::sysfs::{self, AttrError};
use crate::{Backend, SysfsRoot};

/// Why PCI discovery could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// `sys/bus/pci/devices` exists but cannot be listed.
    #[error("cannot list PCI functions")]
    ListFunctions(#[source] AttrError),
}

/// The most PCI functions read from one tree (far above any real host).
pub const MAX_FUNCTIONS: usize = 1 << 16;

/// Discovers PCI functions under `sys/bus/pci/devices`.
#[derive(Debug)]
pub struct PciBackend {
    root: SysfsRoot,
}

/// Report lines gathered during a scan, added to the report after the summary.
pub(crate) type Notes = Vec<String>;

/// One function found under `sys/bus/pci/devices`.
#[derive(Debug, Clone)]
pub(crate) struct Function {
    /// Its place in the hierarchy.
    pub path: DevicePath,
    /// Its directory relative to the root (`sys/devices/pci0000:00/...`, or
    /// `sys/bus/pci/devices/ADDR` for a function a dump holds as a plain directory).
    pub rel: String,
    /// Its attributes.
    pub attrs: FunctionAttrs,
}

impl PciBackend {
    /// A backend reading under `root`.
    pub fn new(root: SysfsRoot) -> Self {
        Self { root }
    }

    /// Finds every function, sorted by address, with the attribute tally.
    fn scan_functions(&self, notes: &mut Notes) -> Result<(Vec<Function>, attrs::Tally), PciError> {
        let dir = self.root.path("sys/bus/pci/devices");
        let mut names = sysfs::list_dir(&dir).map_err(PciError::ListFunctions)?;
        if names.len() > MAX_FUNCTIONS {
            notes.push(format!("{}: {} entries, reading the first {MAX_FUNCTIONS}", dir.display(), names.len()));
            names.truncate(MAX_FUNCTIONS);
        }
        let mut tally = attrs::Tally::default();
        let mut found: BTreeMap<PciAddress, Function> = BTreeMap::new();
        for name in names {
            let link = dir.join(&name);
            let (rel, real) = match tree::resolve_function_link(&self.root, &link) {
                Ok((rel, real)) => (format!("sys/devices/{rel}"), real),
                Err(e) => match plain_function(&link, &name) {
                    // Stripped dumps and some containers hold the function's directory
                    // itself, not a link into sys/devices: its attributes are all there,
                    // only its place in the hierarchy is not.
                    Some(address) => {
                        notes.push(format!(
                            "{}: not a link into sys/devices; shown without its place in the PCI hierarchy",
                            link.display()
                        ));
                        let attrs = attrs::read_function(&link, &mut tally);
                        let path = DevicePath { address, ancestors: Vec::new() };
                        if found.contains_key(&address) {
                            notes.push(format!("{}: a second entry for {address}, skipped", link.display()));
                            continue;
                        }
                        found.insert(address, Function { path, rel: format!("sys/bus/pci/devices/{name}"), attrs });
                        continue;
                    }
                    None => {
                        notes.push(format!("{}, skipped", error_chain(&e)));
                        continue;
                    }
                },
            };
            let path = match tree::parse_device_path(&rel["sys/devices/".len()..]) {
                Ok(p) => p,
                Err(e) => {
                    notes.push(format!("{}: {e}, skipped", link.display()));
                    continue;
                }
            };
            if path.address.to_string() != name {
                notes.push(format!("{}: entry name differs from its target {rel}", link.display()));
            }
            if found.contains_key(&path.address) {
                notes.push(format!("{}: a second entry for {}, skipped", link.display(), path.address));
                continue;
            }
            let attrs = attrs::read_function(&real, &mut tally);
            found.insert(path.address, Function { path, rel, attrs });
        }
        Ok((found.into_values().collect(), tally))
    }

    /// Host bridge directories at the top of `sys/devices` (some may have no functions).
    fn top_host_bridges(&self) -> Vec<(u32, u8)> {
        let dir: PathBuf = self.root.path("sys/devices");
        sysfs::list_dir(&dir).unwrap_or_default().iter().filter_map(|n| parse_host_bridge_name(n)).collect()
    }
}

/// The address of a function a dump holds as a plain directory (not a symlink) named by
/// its address; `None` for anything else.
fn plain_function(entry: &std::path::Path, name: &str) -> Option<PciAddress> {
    let meta = std::fs::symlink_metadata(entry).ok()?;
    if !meta.is_dir() {
        return None;
    }
    name.parse().ok()
}

/// Adds a device (or finds the one with its identity) and marks it as seen by this backend;
/// counts it in `added` when it is new.
pub(crate) fn add(inv: &mut Inventory, dev: Device, added: &mut usize) -> Option<DeviceIdx> {
    let before = inv.devices.len();
    let idx = inv.add_device(dev).ok()?;
    *added += inv.devices.len() - before;
    let d = inv.device_mut(idx);
    if !d.sources.iter().any(|s| s == "pci") {
        d.sources.push("pci".to_owned());
    }
    Some(idx)
}

impl Backend for PciBackend {
    fn name(&self) -> &'static str {
        "pci"
    }

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        let mut report = BackendReport::present("pci");
        let nodes = numa::read_nodes(&self.root, &mut report).unwrap_or_else(|e| {
            report.note_unknown(error_chain(&e));
            Vec::new()
        });
        let cpus = numa::add_cpus(inventory, &self.root, &nodes, &mut report);
        report.devices = cpus.added;
        crate::hmem::enrich_nodes(&self.root, inventory, &cpus, &mut report);
        if !self.root.path("sys/bus/pci/devices").is_dir() {
            report.state = BackendState::NotPresent(format!(
                "no PCI bus in sysfs ({} is not a directory)",
                self.root.path("sys/bus/pci/devices").display()
            ));
            return report;
        }
        let mut notes = Notes::new();
        let (functions, tally) = match self.scan_functions(&mut notes) {
            Ok(f) => f,
            Err(e) => {
                report.state = BackendState::Failed(error_chain(&e));
                return report;
            }
        };
        let top = self.top_host_bridges();
        report.devices += assemble::assemble(inventory, self.root.node(), &cpus, &top, &functions, &mut notes);
        // The per-attribute summary first: it is the most useful part when lines run out.
        for line in tally.lines().into_iter().chain(notes) {
            report.note_unknown(line);
        }
        tracing::debug!(functions = functions.len(), devices = report.devices, "pci discovery done");
        report
    }
}
