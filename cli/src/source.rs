//! Where the inventory comes from: the live host (or a sysfs tree under another root)
//! through the host backends, or a simulated fabric file.

use std::path::{Path, PathBuf};

use fabric_drivers::SysfsRoot;
use fabric_drivers::sim::SimError;
use fabric_topology::Fabric;
use fabric_topology::inventory::InventoryError;

use crate::args::SourceArgs;

/// Errors obtaining the fabric.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The sim file does not exist.
    #[error("sim fabric file {0} does not exist")]
    SimNotFound(PathBuf),
    /// The sim file could not be loaded.
    #[error("loading sim fabric {path}")]
    SimLoad {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: SimError,
    },
    /// The sysfs root has no `sys/` directory.
    #[error("{0} has no sys/ directory to discover from")]
    NoSysfs(PathBuf),
    /// Discovery produced an inconsistent inventory.
    #[error("indexing the discovered inventory")]
    Index(#[source] InventoryError),
}

impl SourceError {
    /// How to fix it.
    pub fn hint(&self) -> &'static str {
        match self {
            SourceError::SimNotFound(_) => "pass an existing file to --sim, e.g. --sim configs/sim/hgx-h100-8gpu.toml",
            SourceError::SimLoad { .. } => {
                "fix the file and key named above; sim fabrics are described in configs/sim/"
            }
            SourceError::NoSysfs(_) => "pass --sysfs-root a directory that contains sys/ (an extracted sysfs dump)",
            SourceError::Index(_) => "a discovery backend produced a dangling link; rerun with -vv and report it",
        }
    }
}

/// An inventory source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// Host discovery under a root directory (`/` for the live host).
    Sysfs(PathBuf),
    /// A sim fabric file.
    Sim(PathBuf),
}

impl Source {
    /// The source the flags select: `--sim`, else `--sysfs-root`, else the live host.
    pub fn from_args(args: &SourceArgs) -> Self {
        match (&args.sim, &args.sysfs_root) {
            (Some(f), _) => Source::Sim(f.clone()),
            (None, Some(d)) => Source::Sysfs(d.clone()),
            (None, None) => Source::Sysfs(PathBuf::from("/")),
        }
    }

    /// Discovers or loads the inventory and indexes it.
    pub fn load(&self) -> Result<Fabric, SourceError> {
        let inv = match self {
            Source::Sim(path) => load_sim(path)?,
            Source::Sysfs(root) => {
                if !root.join("sys").is_dir() {
                    return Err(SourceError::NoSysfs(root.clone()));
                }
                let root = SysfsRoot::with_hostname(root);
                tracing::info!(root = %root.root().display(), node = root.node(), "discovering host");
                fabric_drivers::discover_host(&root)
            }
        };
        tracing::info!(devices = inv.devices.len(), links = inv.links.len(), "inventory loaded");
        Fabric::build(inv).map_err(SourceError::Index)
    }
}

fn load_sim(path: &Path) -> Result<fabric_topology::Inventory, SourceError> {
    if !path.is_file() {
        return Err(SourceError::SimNotFound(path.to_owned()));
    }
    tracing::info!(file = %path.display(), "loading sim fabric");
    fabric_drivers::sim::load(path).map_err(|source| SourceError::SimLoad { path: path.to_owned(), source })
}
