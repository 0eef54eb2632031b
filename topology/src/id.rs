//! Stable device identity and PCI addresses.
//!
//! A [`DeviceId`] never contains an enumeration index: it is a UUID, a serial number, a PCI
//! address qualified by the node it lives on, or a name the operator (or a sim config) gave.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Errors from parsing identities and addresses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The text is not `DOMAIN:BUS:DEV.FN` in hexadecimal.
    #[error("invalid PCI address {0:?} (expected DOMAIN:BUS:DEVICE.FUNCTION in hex)")]
    PciAddress(String),
    /// The text is not `scheme:value` with a known scheme.
    #[error("invalid device id {0:?} (expected uuid:, serial:, pci: or name:)")]
    DeviceId(String),
}

/// A PCI function address. Domains may be wider than 16 bits (e.g. `10000:00:04.0` on
/// hosts with VMD or many segments), so the domain is 32 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI segment (domain).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0..32.
    pub device: u8,
    /// Function number, 0..8.
    pub function: u8,
}

impl PciAddress {
    /// Builds an address, checking the device and function ranges.
    pub fn new(domain: u32, bus: u8, device: u8, function: u8) -> Option<Self> {
        (device < 32 && function < 8).then_some(Self { domain, bus, device, function })
    }

    /// The bus id in the form NCCL and `nvidia-smi` print (`0000:17:00.0`).
    pub fn bus_id(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl FromStr for PciAddress {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || IdError::PciAddress(s.to_owned());
        let (dom, rest) = s.split_once(':').ok_or_else(bad)?;
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (dev, func) = rest.split_once('.').ok_or_else(bad)?;
        let hex = |t: &str, max_len: usize| -> Result<u32, IdError> {
            if t.is_empty() || t.len() > max_len || !t.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad());
            }
            u32::from_str_radix(t, 16).map_err(|_| bad())
        };
        let domain = hex(dom, 8)?;
        let bus = u8::try_from(hex(bus, 2)?).map_err(|_| bad())?;
        let device = u8::try_from(hex(dev, 2)?).map_err(|_| bad())?;
        let function = u8::try_from(hex(func, 1)?).map_err(|_| bad())?;
        Self::new(domain, bus, device, function).ok_or_else(bad)
    }
}

impl Serialize for PciAddress {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PciAddress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The stable identity of a device, as a canonical `scheme:value` string.
///
/// Schemes:
/// - `uuid:GPU-…` — a vendor UUID (GPUs, accelerators).
/// - `serial:KIND/VALUE` — a hardware serial number (CXL memdevs: `serial:cxl/0x1a2b`).
/// - `pci:NODE/DDDD:BB:DD.F` — a PCI function on a node.
/// - `name:NODE/NAME` — a topology object without hardware identity (a NUMA node, a host
///   bridge `pci0000:00`, a sim switch), named stably by its node and role.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(String);

impl DeviceId {
    /// A vendor UUID.
    pub fn uuid(uuid: &str) -> Self {
        Self(format!("uuid:{uuid}"))
    }

    /// A hardware serial of a kind of device (`cxl`, `nvswitch`, ...).
    pub fn serial(kind: &str, serial: &str) -> Self {
        Self(format!("serial:{kind}/{serial}"))
    }

    /// A CXL memory device by its serial (its PCIe DSN): `serial:cxl/0x…`, the same on every
    /// host that sees the device.
    pub fn cxl(serial: u64) -> Self {
        Self::serial("cxl", &format!("{serial:#x}"))
    }

    /// A PCI function on a node.
    pub fn pci(node: &str, addr: PciAddress) -> Self {
        Self(format!("pci:{node}/{addr}"))
    }

    /// A named topology object on a node (or on the fabric when `node` is `fabric`).
    pub fn named(node: &str, name: &str) -> Self {
        Self(format!("name:{node}/{name}"))
    }

    /// The canonical string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The scheme part (`uuid`, `serial`, `pci`, `name`).
    pub fn scheme(&self) -> &str {
        self.0.split_once(':').map_or("", |(s, _)| s)
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for DeviceId {
    type Err = IdError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || IdError::DeviceId(s.to_owned());
        let (scheme, value) = s.split_once(':').ok_or_else(bad)?;
        if value.is_empty() || s.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(bad());
        }
        match scheme {
            "uuid" => Ok(Self(s.to_owned())),
            "serial" | "name" => {
                let (a, b) = value.split_once('/').ok_or_else(bad)?;
                if a.is_empty() || b.is_empty() {
                    return Err(bad());
                }
                Ok(Self(s.to_owned()))
            }
            "pci" => {
                let (node, addr) = value.split_once('/').ok_or_else(bad)?;
                let addr: PciAddress = addr.parse().map_err(|_| bad())?;
                if node.is_empty() {
                    return Err(bad());
                }
                Ok(Self::pci(node, addr))
            }
            _ => Err(bad()),
        }
    }
}

impl Serialize for DeviceId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DeviceId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_address_round_trips_including_wide_domains() {
        for s in ["0000:00:04.1", "10000:00:04.0", "ffffffff:ff:1f.7"] {
            let a: PciAddress = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
        }
        let a: PciAddress = "10000:3a:00.0".parse().unwrap();
        assert_eq!(a.domain, 0x10000);
    }

    #[test]
    fn pci_address_rejects_garbage() {
        for s in ["", "0000:00:20.0", "0000:00:00.8", "0000:100:00.0", "g:00:00.0", "0:0:0", "123456789:00:00.0"] {
            assert!(s.parse::<PciAddress>().is_err(), "{s}");
        }
    }

    #[test]
    fn device_id_parses_canonical_forms() {
        let a: PciAddress = "0000:17:00.0".parse().unwrap();
        assert_eq!(DeviceId::pci("node0", a).to_string(), "pci:node0/0000:17:00.0");
        assert_eq!(DeviceId::cxl(0x5eed0000).to_string(), "serial:cxl/0x5eed0000");
        for s in ["uuid:GPU-1", "serial:cxl/0x10", "name:node0/numa0", "pci:n/0000:00:00.0"] {
            assert_eq!(s.parse::<DeviceId>().unwrap().as_str(), s);
        }
        for s in ["gpu0", "uuid:", "name:x", "pci:n/zz", "bogus:x/y", "name:a b/c"] {
            assert!(s.parse::<DeviceId>().is_err(), "{s}");
        }
    }
}
