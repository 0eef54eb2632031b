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
    /// Its DAX region cannot be carved into a device per region.
    #[error(transparent)]
    Carve(#[from] super::carve::CarveError),
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
    /// Per-region DAX (`[memory] dax_per_region`): the DAX region each region gets a device
    /// of its own in; `path` (its first device, shrunk to 0) is then never handed out.
    pub carve: Option<super::carve::DaxRegion>,
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
    /// The set's members in position order, from the inventory (empty where its geometry
    /// is unknown): where a range of the device lies on each.
    pub members: Vec<(DeviceId, MemoryKind, u16)>,
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
    /// NUMA nodes (`[memory] numa`, `numa_plain`), their devices set by the daemon.
    pub nodes: Vec<super::numa::NodeBacking>,
    /// This node's shares of memory other hosts reach too, as claimed in the domain.
    pub shares: Vec<ResourceShare>,
}

/// This node's share of a memory resource other hosts reach too (`[[memory.shares]]`,
/// claimed in the domain): new regions on it go only in `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceShare {
    /// The device.
    pub device: DeviceId,
    /// The resource's kind.
    pub kind: MemoryKind,
    /// Its ordinal among the device's resources of that kind.
    pub ordinal: u16,
    /// First byte of the share in the resource.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Whether the device keeps every host's caches coherent with it (`coherent` in
    /// `[[memory.shares]]`): `Software` unless declared.
    pub coherence: fabric_proto::wire::Coherence,
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

/// The address map's name of the interleave set of the CXL region holding DAX device
/// `name`, the region's HPA start, and the set's members.
type SetOf = (String, Option<u64>, Vec<(DeviceId, MemoryKind, u16)>);

fn set_of(inv: &Inventory, name: &str) -> Option<SetOf> {
    let r = inv.cxl.regions.iter().find(|r| r.dax.iter().any(|d| d.name == name))?;
    let set = fabric_addrmap::sync::set_name(r)?;
    let members = fabric_addrmap::sync::region_sets(inv)
        .into_iter()
        .find(|s| s.name == set)
        .map(|s| s.members.into_iter().map(|k| (k.device, k.kind, k.ordinal)).collect())
        .unwrap_or_default();
    Some((set, r.resource, members))
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
    let (set, region_start, members) =
        set_of(inv, name).ok_or_else(|| unusable("no CXL region in the fabric lists it".into()))?;
    let start = match (read_attr(&dir.join("resource")).ok().and_then(|s| parse_hex_u64(&s)), region_start) {
        (Some(d), Some(r)) => d.checked_sub(r).ok_or_else(|| unusable("it starts before its region".into()))?,
        _ => 0,
    };
    if !start.is_multiple_of(align) || size == 0 || !size.is_multiple_of(align) {
        return Err(unusable(format!("offset {start:#x} in its region and size {size:#x} are not {align}-aligned")));
    }
    let backing =
        DeviceBacking { kind: BackingKind::Dax, name: name.to_owned(), path, start, len: size, align, carve: None };
    Ok(SetBacking { set, backing, members })
}

/// Resolves `name` (`daxN.0`) for per-region DAX: its DAX region, taken over
/// ([`super::carve::DaxRegion::open`]: the device shrinks to 0), backs the interleave set of
/// the CXL region it belongs to, and each region on the set gets a device of its own at the
/// HPAs of its set range.
pub fn carved_dax(sysfs: &SysfsRoot, dev: &Path, inv: &Inventory, name: &str) -> Result<SetBacking, BackingError> {
    if !is_dax_name(name) {
        return Err(BackingError::BadName(name.to_owned(), "DAX device name (daxN.M)"));
    }
    let unusable = |why: String| BackingError::Unusable { what: name.to_owned(), why };
    // Before touching the device: it must be one of the fabric's CXL regions'.
    let (set, region_start, members) =
        set_of(inv, name).ok_or_else(|| unusable("no CXL region in the fabric lists it".into()))?;
    let region_start = region_start.ok_or_else(|| unusable("its CXL region's HPA start is unknown".into()))?;
    let region = super::carve::DaxRegion::open(sysfs, dev, name)?;
    let start = region
        .start
        .checked_sub(region_start)
        .ok_or_else(|| unusable(format!("its DAX region starts at {:#x}, before its CXL region", region.start)))?;
    let backing = DeviceBacking {
        kind: BackingKind::Dax,
        name: name.to_owned(),
        path: dev.join(name),
        start,
        len: region.size,
        align: region.align,
        carve: Some(region),
    };
    Ok(SetBacking { set, backing, members })
}

/// Why a line of a PCI function's sysfs `resource` table is not a memory BAR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BarLine {
    /// The table has no such line.
    Absent,
    /// The line is not three hex numbers.
    Malformed(String),
    /// An I/O BAR, an unset one, or an empty range (the flags).
    NotMemory(u64),
}

/// Line `index` of a sysfs `resource` table (`start end flags` in hex): the BAR's start and
/// inclusive end when it is a non-empty memory BAR.
pub fn memory_bar(table: &str, index: u8) -> Result<(u64, u64), BarLine> {
    let line = table.lines().nth(usize::from(index)).ok_or(BarLine::Absent)?;
    let f: Vec<u64> = line.split_whitespace().take(4).filter_map(parse_hex_u64).collect();
    let [begin, end, flags] = f[..] else {
        return Err(BarLine::Malformed(line.chars().take(120).collect()));
    };
    const IORESOURCE_IO: u64 = 0x100;
    const IORESOURCE_MEM: u64 = 0x200;
    if flags & IORESOURCE_IO != 0 || flags & IORESOURCE_MEM == 0 || end <= begin {
        return Err(BarLine::NotMemory(flags));
    }
    Ok((begin, end))
}

/// Resolves BAR `spec` (`DDDD:BB:DD.F/N`): `sys/bus/pci/devices/BDF/resourceN` under `sysfs`,
/// which must be a memory BAR of a whole number of pages.
pub fn bar(sysfs: &SysfsRoot, spec: &str) -> Result<BarBacking, BackingError> {
    let (address, index) = parse_bar(spec)?;
    let missing = |why: String| BackingError::Missing { what: spec.to_owned(), why };
    let unusable = |why: String| BackingError::Unusable { what: spec.to_owned(), why };
    let dir = sysfs.path(format!("sys/bus/pci/devices/{address}"));
    let table = read_attr(&dir.join("resource")).map_err(|e| missing(e.to_string()))?;
    match memory_bar(&table, index) {
        Ok(_) => {}
        Err(BarLine::Absent) => return Err(missing(format!("no BAR {index}"))),
        Err(BarLine::Malformed(line)) => return Err(unusable(format!("resource line {line:?}"))),
        Err(BarLine::NotMemory(flags)) => {
            return Err(unusable(format!("BAR {index} is not a memory BAR (flags {flags:#x})")));
        }
    }
    let path = dir.join(format!("resource{index}"));
    let len = std::fs::metadata(&path).map_err(|e| missing(format!("{}: {e}", path.display())))?.len();
    if len == 0 || !len.is_multiple_of(4096) {
        return Err(unusable(format!("{len} bytes is not a whole number of pages")));
    }
    let backing =
        DeviceBacking { kind: BackingKind::Bar, name: spec.to_owned(), path, start: 0, len, align: 4096, carve: None };
    Ok(BarBacking { address, index, resource: None, backing })
}

/// Resolves everything `[memory]` lists; with `per_region`, each DAX device names the DAX
/// region to carve a device per region from ([`carved_dax`]). Any entry that cannot be used
/// fails the start: an operator who exports a device wants to know at once that it is not
/// served.
pub fn resolve(
    sysfs: &SysfsRoot,
    dev: &Path,
    inv: &Inventory,
    dax_names: &[String],
    per_region: bool,
    bar_specs: &[String],
) -> Result<Backings, BackingError> {
    let mut out = Backings::default();
    for n in dax_names {
        let b = if per_region { carved_dax(sysfs, dev, inv, n)? } else { dax(sysfs, dev, inv, n)? };
        if out.sets.iter().any(|s| s.set == b.set) {
            return Err(BackingError::Unusable {
                what: n.clone(),
                why: format!("another DAX device already backs {}", b.set),
            });
        }
        out.sets.push(b);
    }
    for s in bar_specs {
        let b = bar(sysfs, s)?;
        // Two spellings of one BAR would be two resources over the same bytes, each with
        // an allocator of its own.
        if let Some(first) = out.bars.iter().find(|o| o.address == b.address && o.index == b.index) {
            return Err(BackingError::Unusable {
                what: s.clone(),
                why: format!("the BAR {} names already", first.backing.name),
            });
        }
        out.bars.push(b);
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use fabric_topology::cxl::{CxlDax, CxlRegion};

    /// A sysfs tree with DAX device `dax0.0` (`size`, `align`, bound to `driver`) and its
    /// device node stood in for by a regular file, over a CXL region at HPA `0x10_0000_0000`.
    fn tree(size: u64, align: Option<u64>, driver: Option<&str>) -> (tempfile::TempDir, Inventory) {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("sys/bus/dax/devices/dax0.0");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        if let Some(a) = align {
            std::fs::write(d.join("align"), format!("{a}\n")).unwrap();
        }
        if let Some(drv) = driver {
            let dd = t.path().join("sys/bus/dax/drivers").join(drv);
            std::fs::create_dir_all(&dd).unwrap();
            std::os::unix::fs::symlink(&dd, d.join("driver")).unwrap();
        }
        std::fs::create_dir_all(t.path().join("dev")).unwrap();
        std::fs::File::create(t.path().join("dev/dax0.0")).unwrap().set_len(size).unwrap();
        let mut inv = Inventory::default();
        inv.cxl.regions.push(CxlRegion {
            kernel_name: "region0".into(),
            uuid: None,
            mode: None,
            resource: Some(0x10_0000_0000),
            size: Some(size),
            ways: Some(2),
            granularity: Some(256),
            targets: Vec::new(),
            committed: Some(true),
            dax: vec![CxlDax { name: "dax0.0".into(), size: Some(size), numa_node: None }],
            root_decoder: None,
        });
        (t, inv)
    }

    fn resolve_dax(t: &tempfile::TempDir, inv: &Inventory, name: &str) -> Result<SetBacking, BackingError> {
        let root = SysfsRoot::new(t.path(), "");
        dax(&root, &t.path().join("dev"), inv, name)
    }

    #[test]
    fn a_device_dax_backs_its_regions_set_at_its_align() {
        let (t, inv) = tree(512 << 20, Some(1 << 30), Some("device_dax"));
        // 512 MiB is not a multiple of a 1 GiB align: refused.
        assert!(matches!(resolve_dax(&t, &inv, "dax0.0"), Err(BackingError::Unusable { .. })));
        let (t, inv) = tree(512 << 20, Some(2 << 20), Some("device_dax"));
        let b = resolve_dax(&t, &inv, "dax0.0").unwrap();
        assert_eq!(b.set, "cxl-region:hpa-0x1000000000");
        assert_eq!((b.backing.start, b.backing.len, b.backing.align), (0, 512 << 20, 2 << 20));
        assert_eq!(b.backing.path, t.path().join("dev/dax0.0"));
        assert_eq!(b.backing.kind, BackingKind::Dax);
        // Ranges map to file offsets only inside the device.
        assert_eq!(b.backing.file_offset(4 << 20, 2 << 20), Some(4 << 20));
        assert_eq!(b.backing.file_offset(510 << 20, 4 << 20), None);
        // Without an align attribute the 2 MiB default holds.
        let (t, inv) = tree(64 << 20, None, Some("device_dax"));
        assert_eq!(resolve_dax(&t, &inv, "dax0.0").unwrap().backing.align, 2 << 20);
    }

    #[test]
    fn a_dax_device_starting_inside_its_region_is_offset() {
        let (t, inv) = tree(64 << 20, Some(2 << 20), Some("device_dax"));
        std::fs::write(t.path().join("sys/bus/dax/devices/dax0.0/resource"), "0x1000400000\n").unwrap();
        let b = resolve_dax(&t, &inv, "dax0.0").unwrap().backing;
        assert_eq!(b.start, 4 << 20);
        assert_eq!(b.file_offset(4 << 20, 2 << 20), Some(0));
        assert_eq!(b.file_offset(2 << 20, 2 << 20), None, "before the device");
    }

    #[test]
    fn unusable_dax_devices_are_refused_by_name() {
        let (t, inv) = tree(64 << 20, Some(2 << 20), Some("kmem"));
        let e = resolve_dax(&t, &inv, "dax0.0").unwrap_err();
        assert!(e.to_string().contains("kmem"), "{e}");
        let (t, inv) = tree(64 << 20, Some(2 << 20), None);
        assert!(resolve_dax(&t, &inv, "dax0.0").unwrap_err().to_string().contains("no driver"));
        let (t, inv) = tree(64 << 20, Some(2 << 20), Some("device_dax"));
        assert!(matches!(resolve_dax(&t, &inv, "dax9.0"), Err(BackingError::Missing { .. })));
        assert!(matches!(resolve_dax(&t, &inv, "../etc"), Err(BackingError::BadName(..))));
        assert!(matches!(resolve_dax(&t, &inv, "dax0"), Err(BackingError::BadName(..))));
        // No device node.
        std::fs::remove_file(t.path().join("dev/dax0.0")).unwrap();
        assert!(resolve_dax(&t, &inv, "dax0.0").unwrap_err().to_string().contains("does not exist"));
        // A device no region of the fabric lists.
        let (t, _) = tree(64 << 20, Some(2 << 20), Some("device_dax"));
        let e = resolve_dax(&t, &Inventory::default(), "dax0.0").unwrap_err();
        assert!(e.to_string().contains("no CXL region"), "{e}");
        // Two DAX devices for one set.
        let (t, inv) = tree(64 << 20, Some(2 << 20), Some("device_dax"));
        let root = SysfsRoot::new(t.path(), "");
        let twice = ["dax0.0".to_owned(), "dax0.0".to_owned()];
        assert!(resolve(&root, &t.path().join("dev"), &inv, &twice, false, &[]).is_err());
    }

    fn bar_tree(flags: u64, len: u64) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("sys/bus/pci/devices/0000:00:05.0");
        std::fs::create_dir_all(&d).unwrap();
        let zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        let bar2 = format!("0x00000000fe000000 0x{:016x} 0x{flags:016x}\n", 0xfe00_0000 + len - 1);
        std::fs::write(d.join("resource"), format!("{zero}{zero}{bar2}{zero}{zero}{zero}")).unwrap();
        std::fs::File::create(d.join("resource2")).unwrap().set_len(len).unwrap();
        t
    }

    #[test]
    fn a_memory_bar_is_its_resource_file() {
        let t = bar_tree(0x40200, 4 << 20);
        let root = SysfsRoot::new(t.path(), "");
        let b = bar(&root, "0000:00:05.0/2").unwrap();
        assert_eq!(b.index, 2);
        assert_eq!(b.backing.len, 4 << 20);
        assert_eq!(b.backing.path, t.path().join("sys/bus/pci/devices/0000:00:05.0/resource2"));
        // An I/O BAR, an empty BAR, a missing function and bad specs are refused.
        let io = bar_tree(0x40101, 4096);
        assert!(bar(&SysfsRoot::new(io.path(), ""), "0000:00:05.0/2").unwrap_err().to_string().contains("memory BAR"));
        assert!(bar(&root, "0000:00:05.0/0").is_err());
        assert!(matches!(bar(&root, "0000:00:06.0/2"), Err(BackingError::Missing { .. })));
        for spec in ["0000:00:05.0", "0000:00:05.0/6", "nonsense/2", "0000:00:05.0/x"] {
            assert!(matches!(bar(&root, spec), Err(BackingError::BadName(..))), "{spec}");
        }
    }

    #[test]
    fn exported_bars_become_host_exported_resources_in_order() {
        use fabric_topology::{Device, DeviceKind, PciInfo};
        let t = bar_tree(0x40200, 4 << 20);
        let root = SysfsRoot::new(t.path(), "");
        let mut b = vec![bar(&root, "0000:00:05.0/2").unwrap()];
        let address: PciAddress = "0000:00:05.0".parse().unwrap();
        let mut inv = Inventory::default();
        let mut dev = Device::new(DeviceId::pci("n", address), DeviceKind::Nic, Some("n"));
        dev.pci = Some(PciInfo { address: Some(address), ..PciInfo::default() });
        inv.add_device(dev).unwrap();
        assert!(add_bar_resources(&mut inv, &b).is_empty());
        locate_bars(&inv, &mut b);
        assert_eq!(b[0].resource, Some((DeviceId::pci("n", address), 0)));
        assert_eq!(inv.devices[0].memory[0].kind, MemoryKind::HostExported);
        assert_eq!(inv.devices[0].memory[0].size, 4 << 20);
        assert_eq!(add_bar_resources(&mut Inventory::default(), &b), vec!["0000:00:05.0/2".to_owned()]);
    }

    /// One BAR listed twice, in two spellings: two resources over the same bytes, and two
    /// users' regions at offset 0 of it, unless refused.
    #[test]
    fn one_bar_listed_twice_is_refused() {
        let t = bar_tree(0x40200, 4 << 20);
        let root = SysfsRoot::new(t.path(), "");
        let dev = t.path().join("dev");
        let inv = Inventory::default();
        let specs = ["0000:00:05.0/2".to_owned(), "0:0:5.0/2".to_owned()];
        let e = resolve(&root, &dev, &inv, &[], false, &specs).unwrap_err().to_string();
        assert!(e.contains("0:0:5.0/2") && e.contains("0000:00:05.0/2"), "{e}");
        assert_eq!(resolve(&root, &dev, &inv, &[], false, &specs[..1]).unwrap().bars.len(), 1);
    }
}
