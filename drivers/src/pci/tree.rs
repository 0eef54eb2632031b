//! The PCI hierarchy as sysfs encodes it in device paths: `pciDDDD:BB` host bridge
//! directories containing function directories (`DDDD:BB:DD.F`) nested under their bridges.
//!
//! [`parse_device_path`] is pure (fuzzable); [`resolve_function_link`] follows one
//! `sys/bus/pci/devices/*` link without ever leaving the injected root.

use std::fs;
use std::path::{Component, Path, PathBuf};

use fabric_topology::PciAddress;

use crate::SysfsRoot;

/// Why a function's device path could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The link could not be read or followed (dangling, a loop, permissions).
    #[error("{path}: cannot follow link")]
    Follow {
        /// The link.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The link leads outside `sys/devices` under the root.
    #[error("{path}: link target leaves sys/devices under the root")]
    Escapes {
        /// The link.
        path: PathBuf,
    },
    /// The path does not end in a PCI function address.
    #[error("device path {0:?} does not end in a PCI address")]
    NotAFunction(String),
}

/// A host bridge name `pciDDDD:BB` as (domain, bus); domains may exceed 16 bits.
pub fn parse_host_bridge_name(name: &str) -> Option<(u32, u8)> {
    let rest = name.strip_prefix("pci")?;
    let (dom, bus) = rest.split_once(':')?;
    let hex = |t: &str, max: usize| {
        (!t.is_empty() && t.len() <= max && t.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(t, 16).ok())
            .flatten()
    };
    Some((hex(dom, 8)?, u8::try_from(hex(bus, 2)?).ok()?))
}

/// The canonical host bridge name for a domain and bus (`pci0000:00`, `pci10000:00`).
pub fn host_bridge_name(domain: u32, bus: u8) -> String {
    format!("pci{domain:04x}:{bus:02x}")
}

/// What a function hangs off, directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Upstream {
    /// A host bridge (`pciDDDD:BB`), as (domain, bus).
    HostBridge(u32, u8),
    /// A bridge function (root port, switch port).
    Function(PciAddress),
}

/// One component of a device path that matters to the PCI hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathNode {
    /// A host bridge directory.
    HostBridge(u32, u8),
    /// A function directory.
    Function(PciAddress),
}

/// A function's place in the hierarchy, from its path below `sys/devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePath {
    /// The function itself (the last component).
    pub address: PciAddress,
    /// The hierarchy components above it, outermost first (host bridges and bridges; other
    /// directories such as `platform` or `VMBUS:00` are left out).
    pub ancestors: Vec<PathNode>,
}

impl DevicePath {
    /// The nearest hierarchy component above the function.
    pub fn upstream(&self) -> Option<Upstream> {
        self.ancestors.last().map(|n| match *n {
            PathNode::HostBridge(d, b) => Upstream::HostBridge(d, b),
            PathNode::Function(a) => Upstream::Function(a),
        })
    }

    /// The innermost host bridge above the function (a VMD domain's, when nested).
    pub fn host_bridge(&self) -> Option<(u32, u8)> {
        self.ancestors.iter().rev().find_map(|n| match *n {
            PathNode::HostBridge(d, b) => Some((d, b)),
            PathNode::Function(_) => None,
        })
    }
}

/// The most components a device path may have (real trees nest a handful of switches).
pub const MAX_PATH_COMPONENTS: usize = 64;

/// Parses a device path relative to `sys/devices` (`pci0000:00/0000:00:03.0/0000:01:00.0`).
pub fn parse_device_path(rel: &str) -> Result<DevicePath, TreeError> {
    let bad = || TreeError::NotAFunction(rel.chars().take(200).collect());
    let parts: Vec<&str> = rel.split('/').filter(|p| !p.is_empty()).collect();
    if parts.len() > MAX_PATH_COMPONENTS {
        return Err(bad());
    }
    let (last, above) = parts.split_last().ok_or_else(bad)?;
    let address: PciAddress = last.parse().map_err(|_| bad())?;
    let ancestors = above
        .iter()
        .filter_map(|p| {
            if let Some((d, b)) = parse_host_bridge_name(p) {
                Some(PathNode::HostBridge(d, b))
            } else {
                p.parse().ok().map(PathNode::Function)
            }
        })
        .collect();
    Ok(DevicePath { address, ancestors })
}

/// Follows `link` (an entry of `sys/bus/pci/devices`) and returns the target's path
/// relative to `sys/devices` under the root, plus the target's real directory. Relative
/// targets are followed from the link's directory; absolute ones are re-rooted. The final
/// directory must lie under the root's `sys/devices` after every symlink is resolved.
pub fn resolve_function_link(root: &SysfsRoot, link: &Path) -> Result<(String, PathBuf), TreeError> {
    let follow = |source| TreeError::Follow { path: link.to_owned(), source };
    let devices = fs::canonicalize(root.path("sys/devices")).map_err(follow)?;
    let target = match fs::read_link(link) {
        Ok(t) if t.is_absolute() => root.path(t),
        Ok(t) => link.parent().unwrap_or(Path::new("")).join(t),
        // Not a link: a dump may hold the function directory itself.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => link.to_owned(),
        Err(e) => return Err(follow(e)),
    };
    let real = fs::canonicalize(&target).map_err(follow)?;
    let rel = real.strip_prefix(&devices).map_err(|_| TreeError::Escapes { path: link.to_owned() })?;
    let mut out = String::new();
    for c in rel.components() {
        let Component::Normal(s) = c else { return Err(TreeError::Escapes { path: link.to_owned() }) };
        let s = s.to_str().ok_or_else(|| TreeError::NotAFunction(rel.display().to_string()))?;
        if !out.is_empty() {
            out.push('/');
        }
        out.push_str(s);
    }
    if !real.is_dir() {
        return Err(TreeError::NotAFunction(out));
    }
    Ok((out, real))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn host_bridge_names_allow_wide_domains() {
        assert_eq!(parse_host_bridge_name("pci0000:00"), Some((0, 0)));
        assert_eq!(parse_host_bridge_name("pci10000:00"), Some((0x10000, 0)));
        assert_eq!(host_bridge_name(0x10000, 0), "pci10000:00");
        for bad in ["pci", "pci0000", "pci0000:100", "pcixx:00", "0000:00", "pci123456789:00", "pci_bus"] {
            assert_eq!(parse_host_bridge_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn paths_give_parents_including_vmd_nesting() {
        let p = parse_device_path("pci0000:00/0000:00:1c.0/0000:04:00.0/0000:05:00.0").unwrap();
        assert_eq!(p.address, addr("0000:05:00.0"));
        assert_eq!(p.upstream(), Some(Upstream::Function(addr("0000:04:00.0"))));
        assert_eq!(p.host_bridge(), Some((0, 0)));
        let p = parse_device_path("pci0000:00/0000:00:03.0").unwrap();
        assert_eq!(p.upstream(), Some(Upstream::HostBridge(0, 0)));
        let p = parse_device_path("pci0000:5d/0000:5d:05.5/pci10000:00/10000:00:02.0/10000:01:00.0").unwrap();
        assert_eq!(p.host_bridge(), Some((0x10000, 0)));
        assert_eq!(p.ancestors[1], PathNode::Function(addr("0000:5d:05.5")));
        let p = parse_device_path("platform/soc/pci0001:00/0001:00:00.0").unwrap();
        assert_eq!(p.upstream(), Some(Upstream::HostBridge(1, 0)));
        assert!(parse_device_path("pci0000:00").is_err());
        assert!(parse_device_path("").is_err());
        assert_eq!(parse_device_path("0000:00:01.0").unwrap().upstream(), None);
    }
}
