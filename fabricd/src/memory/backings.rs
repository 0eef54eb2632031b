//! What holds memory, one typed enum each: the kind of memory a resource offers its
//! regions ([`Offer`]) and what backs one region's bytes ([`Backing`]). What depends on the
//! kind — where the region's file is, its offset, what undoing or ending it leaves to do —
//! is here, so that a new kind is a compile error wherever it matters.

use std::path::{Path, PathBuf};

use fabric_topology::MemoryKind;

use super::adopt::Object;
use super::backing::DeviceBacking;
use super::carve::DaxRegion;
use super::numa::NodeBacking;

/// The memory a resource offers its regions.
#[derive(Debug, Clone)]
pub(super) enum Offer {
    /// A sparse file per region in the resource's directory: a sim device's memory, or
    /// host memory (DRAM, exported host memory), which is real either way.
    Files,
    /// Ranges of a device file the operator exports (a PCI BAR's `resourceN`).
    Device(DeviceBacking),
    /// A tmpfs file per region whose pages are bound to a NUMA node (the resource's
    /// directory is then under the node's tmpfs).
    Node(NodeBacking),
    /// Device memory of a real device that no configured file backs: only its driver
    /// allocates it (HBM, adopted with `Adopt`); `Alloc` refuses it.
    Driver,
}

impl Offer {
    /// What a resource of `kind` offers before any configured backing is applied: a file
    /// per region for a sim device and for host memory, else nothing but its driver.
    pub(super) fn of(kind: MemoryKind, simulated: bool) -> Self {
        let host = matches!(kind, MemoryKind::Dram | MemoryKind::HostExported);
        if simulated || host { Offer::Files } else { Offer::Driver }
    }

    /// The device file whose ranges the regions are, if that is what is offered.
    pub(super) fn device(&self) -> Option<&DeviceBacking> {
        match self {
            Offer::Device(b) => Some(b),
            Offer::Files | Offer::Node(_) | Offer::Driver => None,
        }
    }
}

/// What backs one region's bytes.
#[derive(Debug)]
pub(super) enum Backing {
    /// Its own file `r<id>`, sized with `set_len`, in its resource's directory (the first
    /// member's, for a set region).
    SimFile(PathBuf),
    /// Its own tmpfs file in a NUMA node's directory, its pages bound to `node`.
    NodeFile {
        /// The file.
        path: PathBuf,
        /// The node.
        node: u32,
    },
    /// The range at `offset` of a device file many regions share (a DAX device, a BAR's
    /// `resourceN`): never removed; its bytes stay when the region ends.
    DeviceRange {
        /// The device file.
        path: PathBuf,
        /// Offset of the region's first byte in it.
        offset: u64,
    },
    /// A DAX device carved for this region alone (`dax_per_region`): deleted when the
    /// region ends, and only then is its range free again.
    CarvedDax {
        /// Its device file (`/dev/daxN.M`).
        path: PathBuf,
        /// Its name, given by the kernel (`daxN.M`).
        name: String,
        /// The DAX region it was carved from.
        from: DaxRegion,
    },
    /// An adopted vendor object: no file, the object itself (not journaled).
    Object(Object),
}

impl Backing {
    /// The file clients map (none for a vendor object).
    pub(super) fn path(&self) -> Option<&Path> {
        match self {
            Backing::SimFile(path)
            | Backing::NodeFile { path, .. }
            | Backing::DeviceRange { path, .. }
            | Backing::CarvedDax { path, .. } => Some(path),
            Backing::Object(_) => None,
        }
    }

    /// Offset of the region's first byte in its file.
    pub(super) fn offset(&self) -> u64 {
        match self {
            Backing::DeviceRange { offset, .. } => *offset,
            Backing::SimFile(_) | Backing::NodeFile { .. } | Backing::CarvedDax { .. } | Backing::Object(_) => 0,
        }
    }

    /// The file is the region's own, by name in its resource's directory (removed when the
    /// region ends, sized by the registry), not a device file.
    pub(super) fn own_file(&self) -> Option<&Path> {
        match self {
            Backing::SimFile(path) | Backing::NodeFile { path, .. } => Some(path),
            Backing::DeviceRange { .. } | Backing::CarvedDax { .. } | Backing::Object(_) => None,
        }
    }

    /// The region is device memory, whose file serves only `mmap` (a DAX device, a BAR).
    pub(super) fn is_device(&self) -> bool {
        match self {
            Backing::DeviceRange { .. } | Backing::CarvedDax { .. } => true,
            Backing::SimFile(_) | Backing::NodeFile { .. } | Backing::Object(_) => false,
        }
    }

    /// The vendor object, for an adopted region.
    pub(super) fn object(&self) -> Option<&Object> {
        match self {
            Backing::Object(o) => Some(o),
            Backing::SimFile(_)
            | Backing::NodeFile { .. }
            | Backing::DeviceRange { .. }
            | Backing::CarvedDax { .. } => None,
        }
    }

    /// Undoes a backing nobody got (its allocation was refused after it was made): its
    /// own file removed, its carved DAX device deleted. `false` when the device could not
    /// be deleted (it still holds its range).
    pub(super) fn undo(&self) -> bool {
        match self {
            Backing::SimFile(path) | Backing::NodeFile { path, .. } => {
                let _ = std::fs::remove_file(path);
                true
            }
            Backing::CarvedDax { name, from, .. } => match from.destroy(name) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(device = %name, error = %e, "cannot delete the DAX device of a refused region; its range stays taken");
                    false
                }
            },
            Backing::DeviceRange { .. } | Backing::Object(_) => true,
        }
    }
}
