//! Simulated fabrics described in TOML: node templates stamped out by generators, fabric
//! switches, cluster networks, CXL pools and UALink pods that run on any laptop.
//!
//! The format is documented in `docs/sim.md`; `configs/sim/` holds commented examples.
//! [`parse`] is pure (text in, inventory or located error out), which makes it the fuzz
//! entry point; [`load`] reads a file; [`SimBackend`] plugs a sim fabric into discovery.
//!
//! Identity is deterministic: GPUs get `uuid:GPU-…` derived from the fabric name, node and
//! GPU name; PCI functions `pci:NODE/ADDR` with bus numbers allocated in file order; CXL
//! memdevs `serial:cxl/0x…`; everything else `name:NODE/NAME` (`name:fabric/NAME` for
//! fabric-level switches). The same file always gives the same inventory.

mod build;
mod cxl;
mod degrade;
mod error;
mod r#gen;
mod kinds;
mod network;
mod plan;
mod schema;

use std::path::{Path, PathBuf};

use fabric_topology::{BackendReport, DeviceIdx, Inventory, Link};

use crate::Backend;

use error::Locator;
pub use error::SimError;

/// File name of the bundled default fabric (an 8-GPU HGX H100 board).
pub const DEFAULT_FABRIC_NAME: &str = "hgx-h100-8gpu.toml";

/// Text of the bundled default fabric, used when no sim file is given.
pub const DEFAULT_FABRIC: &str = include_str!("../../../configs/sim/hgx-h100-8gpu.toml");

/// Parses sim fabric text. `origin` names the text in error messages (a file name).
pub fn parse(text: &str, origin: &str) -> Result<Inventory, SimError> {
    let loc = Locator::new(text, origin);
    let file: schema::SimFile = toml::from_str(text).map_err(|e| loc.syntax(&e))?;
    build::build(&file).map_err(|e| loc.semantic(e))
}

/// Reads and parses a sim fabric file.
pub fn load(path: &Path) -> Result<Inventory, SimError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SimError::Read { origin: origin.clone(), source })?;
    parse(&text, &origin)
}

/// The bundled default fabric.
pub fn default_fabric() -> Result<Inventory, SimError> {
    parse(DEFAULT_FABRIC, DEFAULT_FABRIC_NAME)
}

/// Where a [`SimBackend`] gets its fabric.
#[derive(Debug, Clone)]
enum Source {
    File(PathBuf),
    Text { text: String, origin: String },
}

/// The `sim` discovery backend: adds a simulated fabric to the inventory.
#[derive(Debug, Clone)]
pub struct SimBackend {
    source: Source,
}

impl SimBackend {
    /// A backend reading `path` at discovery time.
    pub fn from_file(path: impl Into<PathBuf>) -> Self {
        Self { source: Source::File(path.into()) }
    }

    /// A backend over config text (`origin` names it in messages).
    pub fn from_text(text: impl Into<String>, origin: impl Into<String>) -> Self {
        Self { source: Source::Text { text: text.into(), origin: origin.into() } }
    }

    /// A backend over the bundled default fabric.
    pub fn bundled_default() -> Self {
        Self::from_text(DEFAULT_FABRIC, DEFAULT_FABRIC_NAME)
    }

    fn inventory(&self) -> Result<Inventory, SimError> {
        match &self.source {
            Source::File(p) => load(p),
            Source::Text { text, origin } => parse(text, origin),
        }
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        match self.inventory() {
            Ok(sim) => {
                let devices = sim.devices.len();
                merge(inventory, sim);
                let mut report = BackendReport::present("sim");
                report.devices = devices;
                report
            }
            Err(e) => {
                tracing::warn!(error = %e, "sim fabric not loaded");
                BackendReport::failed("sim", e.to_string())
            }
        }
    }
}

/// Adds a sim inventory's devices, links and CXL objects to `into`; devices already there
/// (same identity) are kept and gain the `sim` source.
fn merge(into: &mut Inventory, sim: Inventory) {
    if into.devices.is_empty() && into.links.is_empty() {
        let backends = std::mem::take(&mut into.backends);
        *into = sim;
        into.backends = backends;
        return;
    }
    let mut map = Vec::with_capacity(sim.devices.len());
    for d in sim.devices {
        let before = into.devices.len();
        match into.add_device(d) {
            Ok(idx) => {
                if idx.get() < before {
                    let existing = into.device_mut(idx);
                    if !existing.sources.iter().any(|s| s == "sim") {
                        existing.sources.push("sim".to_owned());
                    }
                }
                map.push(Some(idx));
            }
            Err(_) => map.push(None),
        }
    }
    let at = |i: DeviceIdx| map.get(i.get()).copied().flatten();
    for l in sim.links {
        if let (Some(a), Some(b)) = (at(l.a), at(l.b)) {
            into.add_link(Link { a, b, ..l });
        }
    }
    into.cxl.decoders.extend(sim.cxl.decoders);
    into.cxl.regions.extend(sim.cxl.regions);
}
