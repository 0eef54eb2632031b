//! The inventory: what discovery found — devices, links, CXL objects — and how each backend
//! fared. Backends add to one inventory; devices are deduplicated by identity.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::cxl::CxlInventory;
use crate::device::{Device, DeviceKind};
use crate::hmem::HmemInventory;
use crate::id::{DeviceId, PciAddress};
use crate::link::Link;

/// Position of a device in [`Inventory::devices`]. Internal to one inventory: never shown
/// to users as an identity and never persisted (use [`DeviceId`] for that).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeviceIdx(pub u32);

impl DeviceIdx {
    /// As a vector index.
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

/// How a backend fared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "reason", rename_all = "snake_case")]
pub enum BackendState {
    /// It ran and contributed what it found.
    Present,
    /// Its source does not exist here (no `/sys/bus/cxl`, no `libnvidia-ml.so`): the reason.
    NotPresent(String),
    /// It ran into an error; the reason. Other backends are unaffected.
    Failed(String),
}

/// One backend's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendReport {
    /// Backend name (`pci`, `cxl`, `nvml`, `cuda`, `ualink`, `sim`).
    pub backend: String,
    /// Outcome.
    pub state: BackendState,
    /// Devices it contributed.
    pub devices: usize,
    /// Attributes it could not read and objects it skipped, as `path: reason` lines
    /// (bounded).
    pub unknown: Vec<String>,
    /// Lines past [`MAX_UNKNOWN_LINES`] that were not kept: counted, so that nothing a
    /// backend skipped vanishes without a trace.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub unknown_omitted: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Most `unknown` lines a report keeps; the count of the rest is appended.
pub const MAX_UNKNOWN_LINES: usize = 64;

impl BackendReport {
    /// A report for a backend that ran.
    pub fn present(backend: &str) -> Self {
        Self {
            backend: backend.to_owned(),
            state: BackendState::Present,
            devices: 0,
            unknown: Vec::new(),
            unknown_omitted: 0,
        }
    }

    /// A report for a backend whose source is absent.
    pub fn not_present(backend: &str, reason: impl Into<String>) -> Self {
        Self {
            backend: backend.to_owned(),
            state: BackendState::NotPresent(reason.into()),
            devices: 0,
            unknown: Vec::new(),
            unknown_omitted: 0,
        }
    }

    /// A report for a backend that failed.
    pub fn failed(backend: &str, reason: impl Into<String>) -> Self {
        Self {
            backend: backend.to_owned(),
            state: BackendState::Failed(reason.into()),
            devices: 0,
            unknown: Vec::new(),
            unknown_omitted: 0,
        }
    }

    /// Records an attribute that could not be read, keeping the list bounded.
    pub fn note_unknown(&mut self, line: impl Into<String>) {
        if self.unknown.len() < MAX_UNKNOWN_LINES {
            self.unknown.push(line.into());
        } else {
            self.unknown_omitted += 1;
        }
    }
}

/// Errors from building an inventory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// A link names a device index that does not exist.
    #[error("link {link} refers to device index {index}, but there are {len} devices")]
    DanglingLink {
        /// Link position.
        link: usize,
        /// Offending index.
        index: u32,
        /// Number of devices.
        len: usize,
    },
    /// More devices than a `u32` index can name.
    #[error("too many devices")]
    TooManyDevices,
}

/// Devices, links and CXL objects found by discovery.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// Every device, in discovery order.
    pub devices: Vec<Device>,
    /// Every link; endpoints index `devices`.
    pub links: Vec<Link>,
    /// CXL decoders and regions.
    pub cxl: CxlInventory,
    /// DAX devices and memory tiers.
    #[serde(default, skip_serializing_if = "HmemInventory::is_empty")]
    pub hmem: HmemInventory,
    /// One report per backend that was asked.
    pub backends: Vec<BackendReport>,
    #[serde(skip)]
    index: HashMap<DeviceId, DeviceIdx>,
}

impl Inventory {
    /// An empty inventory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the identity index if it does not cover every device (after deserialising,
    /// or after devices were pushed directly); a no-op on an inventory built through
    /// [`Inventory::add_device`], which keeps the index current.
    pub fn ensure_indexed(&mut self) {
        if self.index.len() != self.devices.len() {
            self.reindex();
        }
    }

    /// Rebuilds the identity index from scratch.
    pub fn reindex(&mut self) {
        self.index = self.devices.iter().enumerate().map(|(i, d)| (d.id.clone(), DeviceIdx(i as u32))).collect();
    }

    /// Adds a device, or returns the existing one with the same identity.
    pub fn add_device(&mut self, device: Device) -> Result<DeviceIdx, InventoryError> {
        if let Some(&i) = self.index.get(&device.id) {
            return Ok(i);
        }
        let idx = DeviceIdx(u32::try_from(self.devices.len()).map_err(|_| InventoryError::TooManyDevices)?);
        self.index.insert(device.id.clone(), idx);
        self.devices.push(device);
        Ok(idx)
    }

    /// Adds a link.
    pub fn add_link(&mut self, link: Link) {
        self.links.push(link);
    }

    /// Looks a device up by identity.
    pub fn find(&self, id: &DeviceId) -> Option<DeviceIdx> {
        self.index.get(id).copied()
    }

    /// Looks a PCI function up by node and address.
    pub fn find_pci(&self, node: Option<&str>, addr: PciAddress) -> Option<DeviceIdx> {
        self.devices
            .iter()
            .position(|d| d.pci_address() == Some(addr) && d.node.as_deref() == node)
            .map(|i| DeviceIdx(i as u32))
    }

    /// The device at an index.
    pub fn device(&self, idx: DeviceIdx) -> &Device {
        &self.devices[idx.get()]
    }

    /// The device at an index, mutably.
    pub fn device_mut(&mut self, idx: DeviceIdx) -> &mut Device {
        &mut self.devices[idx.get()]
    }

    /// Changes a device's identity (e.g. a PCI function recognised as a GPU by its UUID).
    /// Returns false when another device already has `new`.
    pub fn rename(&mut self, idx: DeviceIdx, new: DeviceId) -> bool {
        if self.index.contains_key(&new) {
            return false;
        }
        let old = std::mem::replace(&mut self.devices[idx.get()].id, new.clone());
        self.index.remove(&old);
        self.index.insert(new, idx);
        true
    }

    /// Number of devices of a kind.
    pub fn count(&self, kind: DeviceKind) -> usize {
        self.devices.iter().filter(|d| d.kind == kind).count()
    }

    /// Checks that every link refers to an existing device.
    pub fn validate(&self) -> Result<(), InventoryError> {
        let len = self.devices.len();
        for (i, l) in self.links.iter().enumerate() {
            for end in [l.a, l.b] {
                if end.get() >= len {
                    return Err(InventoryError::DanglingLink { link: i, index: end.0, len });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_are_deduplicated_by_identity_and_renamable() {
        let mut inv = Inventory::new();
        let addr: PciAddress = "0000:17:00.0".parse().unwrap();
        let a = inv.add_device(Device::new(DeviceId::pci("n0", addr), DeviceKind::Gpu, Some("n0"))).unwrap();
        let b = inv.add_device(Device::new(DeviceId::pci("n0", addr), DeviceKind::Other, Some("n0"))).unwrap();
        assert_eq!(a, b);
        assert_eq!(inv.devices.len(), 1);
        assert!(inv.rename(a, DeviceId::uuid("GPU-x")));
        assert_eq!(inv.find(&DeviceId::uuid("GPU-x")), Some(a));
        assert_eq!(inv.find(&DeviceId::pci("n0", addr)), None);
    }
}
