//! Real device memory behind regions: CXL memory through device-DAX (`/dev/daxX.Y`) and PCI
//! BARs through sysfs `resourceN`, as the operator lists them in `[memory] dax` and
//! `[memory] bars`. A region on such memory is a range of the device file: the client gets a
//! descriptor of the device (opened by the daemon) and the region's offset in it, and maps
//! that — the same `fd` + `offset` every region is handed (docs/fabricd.md, "Memory
//! backends").
//!
//! Nothing here is exported by default: handing out a DAX device or a BAR is an operator
//! decision, so each one is named in the configuration and checked at start (it must exist,
//! a DAX device must be bound to `device_dax`, a BAR must be a memory BAR).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use fabric_drivers::sysfs::{SysfsRoot, parse_attr, parse_dec_u64, parse_hex_u64, read_attr};
use fabric_topology::{DeviceId, Inventory, MemoryKind, PciAddress};

use super::alloc::GRANULE;

/// Why a configured DAX device or BAR cannot back regions.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// The name is not `daxN.M` / `DDDD:BB:DD.F/N`.
    #[error("{0:?} is not a {1}")]
    BadName(String, &'static str),
    /// The device or one of its attributes is missing or unreadable.
    #[error("{what}: {why}")]
    Missing {
        /// The DAX device or BAR.
        what: String,
        /// What was missing.
        why: String,
    },
    /// The device exists but cannot serve as region memory.
    #[error("{what}: {why}")]
    Unusable {
        /// The DAX device or BAR.
        what: String,
        /// Why not.
        why: String,
    },
}

/// What kind of device file a region's bytes are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackingKind {
    /// A device-DAX character device over a CXL region.
    Dax,
    /// A PCI BAR's sysfs `resourceN`.
    Bar,
}

/// A device file that holds regions: byte `o` of the file is byte `start + o` of the
/// resource (or interleave set) it backs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceBacking {
    /// Kind.
    pub kind: BackingKind,
    /// The configured name (`dax0.0`, `0000:00:05.0/2`).
    pub name: String,
    /// The file clients map.
    pub path: PathBuf,
    /// Offset in the resource (or set) of the file's first byte.
    pub start: u64,
    /// Bytes of the file.
    pub len: u64,
    /// Mapping offsets and lengths must be multiples of this (the DAX device's `align`).
    pub align: u64,
}

impl DeviceBacking {
    /// The offset in the file of the range `[offset, offset + len)` of the resource, when the
    /// file holds all of it.
    pub fn file_offset(&self, offset: u64, len: u64) -> Option<u64> {
        let o = offset.checked_sub(self.start)?;
        o.checked_add(len).filter(|&e| e <= self.len)?;
        Some(o)
    }

    /// Opens the file, read-write or read-only.
    pub fn open(&self, write: bool) -> std::io::Result<File> {
        OpenOptions::new().read(true).write(write).open(&self.path)
    }
}

/// A DAX device bound to an interleave set (the CXL region it is carved from).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetBacking {
    /// The address map's set name (`cxl-region:…`).
    pub set: String,
    /// The device file.
    pub backing: DeviceBacking,
}

/// A BAR bound to a device's memory resource (added to the inventory by
/// [`add_bar_resources`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarBacking {
    /// The PCI function.
    pub address: PciAddress,
    /// The memory resource it is: the function's device id and the ordinal among its
    /// `HostExported` resources (set by [`locate_bars`]).
    pub resource: Option<(DeviceId, u16)>,
    /// BAR index.
    pub index: u8,
    /// The device file.
    pub backing: DeviceBacking,
}

/// Everything the configuration exports, resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Backings {
    /// DAX devices, by set.
    pub sets: Vec<SetBacking>,
    /// BARs.
    pub bars: Vec<BarBacking>,
}

fn is_dax_name(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("dax") else { return false };
    let Some((a, b)) = rest.split_once('.') else { return false };
    !a.is_empty() && !b.is_empty() && a.bytes().chain(b.bytes()).all(|c| c.is_ascii_digit())
}

/// Parses `DDDD:BB:DD.F/N`.
pub fn parse_bar(spec: &str) -> Result<(PciAddress, u8), BackingError> {
    let bad = || BackingError::BadName(spec.to_owned(), "BAR (DDDD:BB:DD.F/N)");
    let (bdf, n) = spec.split_once('/').ok_or_else(bad)?;
    let address: PciAddress = bdf.parse().map_err(|_| bad())?;
    let index: u8 = n.parse().ok().filter(|&i| i < 6).ok_or_else(bad)?;
    Ok((address, index))
}

/// The address map's name of the interleave set of the CXL region holding DAX device `name`.
fn set_of(inv: &Inventory, name: &str) -> Option<(String, Option<u64>)> {
    let r = inv.cxl.regions.iter().find(|r| r.dax.iter().any(|d| d.name == name))?;
    Some((fabric_addrmap::sync::set_name(r)?, r.resource))
}

/// Resolves DAX device `name`: `sys/bus/dax/devices/NAME` under `sysfs`, its device node
/// under `dev`, and the CXL region (interleave set) of `inv` it is carved from.
pub fn dax(sysfs: &SysfsRoot, dev: &Path, inv: &Inventory, name: &str) -> Result<SetBacking, BackingError> {
    if !is_dax_name(name) {
        return Err(BackingError::BadName(name.to_owned(), "DAX device name (daxN.M)"));
    }
    let missing = |why: String| BackingError::Missing { what: name.to_owned(), why };
    let unusable = |why: String| BackingError::Unusable { what: name.to_owned(), why };
    let dir = sysfs.path(format!("sys/bus/dax/devices/{name}"));
    let size = parse_attr(&dir.join("size"), parse_dec_u64).map_err(|e| missing(e.to_string()))?;
    // Without an `align` attribute (older kernels) the DAX region's 2 MiB default holds.
    let align = match parse_attr(&dir.join("align"), parse_dec_u64) {
        Ok(a) if a.is_power_of_two() => a,
        Ok(a) => return Err(unusable(format!("align {a} is not a power of two"))),
        Err(e) if e.is_missing() => GRANULE,
        Err(e) => return Err(missing(e.to_string())),
    };
    match fabric_drivers::sysfs::link_name(&dir.join("driver")) {
        Ok(d) if d == "device_dax" => {}
        Ok(d) => {
            return Err(unusable(format!(
                "bound to {d}, not device_dax (a kmem device is a NUMA node: allocate there with numactl)"
            )));
        }
        Err(_) => return Err(unusable("bound to no driver (bind it to device_dax)".into())),
    }
    let path = dev.join(name);
    if !path.exists() {
        return Err(missing(format!("{} does not exist", path.display())));
    }
    let (set, region_start) =
        set_of(inv, name).ok_or_else(|| unusable("no CXL region in the fabric lists it".into()))?;
    let start = match (read_attr(&dir.join("resource")).ok().and_then(|s| parse_hex_u64(&s)), region_start) {
        (Some(d), Some(r)) => d.checked_sub(r).ok_or_else(|| unusable("it starts before its region".into()))?,
        _ => 0,
    };
    if !start.is_multiple_of(align) || size == 0 || !size.is_multiple_of(align) {
        return Err(unusable(format!("offset {start:#x} in its region and size {size:#x} are not {align}-aligned")));
    }
    let backing = DeviceBacking { kind: BackingKind::Dax, name: name.to_owned(), path, start, len: size, align };
    Ok(SetBacking { set, backing })
}

/// Resolves BAR `spec` (`DDDD:BB:DD.F/N`): `sys/bus/pci/devices/BDF/resourceN` under `sysfs`,
/// which must be a memory BAR of a whole number of pages.
pub fn bar(sysfs: &SysfsRoot, spec: &str) -> Result<BarBacking, BackingError> {
    let (address, index) = parse_bar(spec)?;
    let missing = |why: String| BackingError::Missing { what: spec.to_owned(), why };
    let unusable = |why: String| BackingError::Unusable { what: spec.to_owned(), why };
    let dir = sysfs.path(format!("sys/bus/pci/devices/{address}"));
    let table = read_attr(&dir.join("resource")).map_err(|e| missing(e.to_string()))?;
    let line = table.lines().nth(usize::from(index)).ok_or_else(|| missing(format!("no BAR {index}")))?;
    let f: Vec<u64> = line.split_whitespace().filter_map(parse_hex_u64).collect();
    let [begin, end, flags] = f[..] else { return Err(unusable(format!("resource line {line:?}"))) };
    const IORESOURCE_IO: u64 = 0x100;
    const IORESOURCE_MEM: u64 = 0x200;
    if flags & IORESOURCE_IO != 0 || flags & IORESOURCE_MEM == 0 || end <= begin {
        return Err(unusable(format!("BAR {index} is not a memory BAR (flags {flags:#x})")));
    }
    let path = dir.join(format!("resource{index}"));
    let len = std::fs::metadata(&path).map_err(|e| missing(format!("{}: {e}", path.display())))?.len();
    if len == 0 || !len.is_multiple_of(4096) {
        return Err(unusable(format!("{len} bytes is not a whole number of pages")));
    }
    let backing = DeviceBacking { kind: BackingKind::Bar, name: spec.to_owned(), path, start: 0, len, align: 4096 };
    Ok(BarBacking { address, index, resource: None, backing })
}

/// Resolves everything `[memory]` lists. Any entry that cannot be used fails the start: an
/// operator who exports a device wants to know at once that it is not served.
pub fn resolve(
    sysfs: &SysfsRoot,
    dev: &Path,
    inv: &Inventory,
    dax_names: &[String],
    bar_specs: &[String],
) -> Result<Backings, BackingError> {
    let mut out = Backings::default();
    for n in dax_names {
        let b = dax(sysfs, dev, inv, n)?;
        if out.sets.iter().any(|s| s.set == b.set) {
            return Err(BackingError::Unusable {
                what: n.clone(),
                why: format!("another DAX device already backs {}", b.set),
            });
        }
        out.sets.push(b);
    }
    for s in bar_specs {
        out.bars.push(bar(sysfs, s)?);
    }
    Ok(out)
}

/// Gives each PCI function with an exported BAR a `HostExported` memory resource of the
/// BAR's size (one per BAR, in configuration order), so that the address map places it and
/// regions can be allocated on it. Returns the BARs whose function is not in `inv`.
pub fn add_bar_resources(inv: &mut Inventory, bars: &[BarBacking]) -> Vec<String> {
    let mut absent = Vec::new();
    for b in bars {
        let Some(dev) = inv.devices.iter_mut().find(|d| d.pci.as_ref().is_some_and(|p| p.address == Some(b.address)))
        else {
            absent.push(b.backing.name.clone());
            continue;
        };
        dev.memory.push(fabric_topology::MemoryResource {
            kind: MemoryKind::HostExported,
            size: b.backing.len,
            hpa: None,
            numa_node: None,
        });
    }
    absent
}

/// Finds the resource each BAR became in `inv` (after [`add_bar_resources`] ran on it): the
/// BARs of one function are its last `HostExported` resources, in configuration order.
pub fn locate_bars(inv: &Inventory, bars: &mut [BarBacking]) {
    for i in 0..bars.len() {
        let address = bars[i].address;
        let Some(dev) = inv.devices.iter().find(|d| d.pci.as_ref().is_some_and(|p| p.address == Some(address))) else {
            continue;
        };
        let exported = dev.memory.iter().filter(|m| m.kind == MemoryKind::HostExported).count();
        let mine = bars.iter().filter(|b| b.address == address).count();
        let before = bars[..i].iter().filter(|b| b.address == address).count();
        let ordinal = (exported + before).checked_sub(mine).and_then(|o| u16::try_from(o).ok());
        bars[i].resource = ordinal.map(|o| (dev.id.clone(), o));
    }
}
