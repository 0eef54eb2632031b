//! Per-function sysfs attributes: pure parsers for their text (fuzzable) and the reader that
//! turns one function directory into [`FunctionAttrs`], tallying what was unknown.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use fabric_topology::CpuSet;
use fabric_topology::device::Bar;

use crate::sysfs::{self, AttrError};

/// Why attribute text did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttrParseError {
    /// A hexadecimal or decimal number was expected.
    #[error("not a number: {0:?}")]
    Number(String),
    /// The number does not fit the attribute's range.
    #[error("out of range: {0:?}")]
    Range(String),
    /// A `resource` line is not three hexadecimal numbers, or its end precedes its start.
    #[error("bad resource line {line}: {text:?}")]
    ResourceLine {
        /// Zero-based line number (the BAR index).
        line: usize,
        /// The offending line (truncated).
        text: String,
    },
    /// The `resource` file has more lines than any kernel writes.
    #[error("resource has {0} lines")]
    ResourceTooLong(usize),
    /// A link speed is not `N GT/s` (optionally followed by `PCIe`) nor `Unknown`.
    #[error("bad link speed {0:?}")]
    LinkSpeed(String),
    /// A `meminfo` file has no `MemTotal` line in kB.
    #[error("no MemTotal in meminfo")]
    MemTotal,
}

fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

/// `IORESOURCE_UNSET` (include/linux/ioport.h): no address assigned.
const IORESOURCE_UNSET: u64 = 0x2000_0000;
/// `IORESOURCE_DISABLED`.
const IORESOURCE_DISABLED: u64 = 0x1000_0000;

/// The most lines a `resource` file may have (the kernel writes 13 to 17).
pub const MAX_RESOURCE_LINES: usize = 64;

/// Parses a `resource` file: one line per resource, `start end flags` in hexadecimal. The
/// line number is the index (0-5 BARs, 6 the expansion ROM, 7 and up SR-IOV BARs or bridge
/// windows). Unassigned entries (all zero, or start and end zero) are skipped, and so are
/// BARs the kernel left unassigned or disabled: it prints one as `0x0 <size - 1>` with
/// `IORESOURCE_UNSET` (or `IORESOURCE_DISABLED`) in the flags — no address to use.
pub fn parse_resource(text: &str) -> Result<Vec<Bar>, AttrParseError> {
    let lines: Vec<&str> = text.lines().collect();
    if lines.len() > MAX_RESOURCE_LINES {
        return Err(AttrParseError::ResourceTooLong(lines.len()));
    }
    let mut bars = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let bad = || AttrParseError::ResourceLine { line: i, text: clip(line) };
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.is_empty() && i + 1 == lines.len() {
            continue;
        }
        let [start, end, flags] = fields[..] else { return Err(bad()) };
        let start = sysfs::parse_hex_u64(start).ok_or_else(bad)?;
        let end = sysfs::parse_hex_u64(end).ok_or_else(bad)?;
        let flags = sysfs::parse_hex_u64(flags).ok_or_else(bad)?;
        if (start == 0 && end == 0) || flags & (IORESOURCE_UNSET | IORESOURCE_DISABLED) != 0 {
            continue;
        }
        if end < start {
            return Err(bad());
        }
        let size = (end - start).checked_add(1).ok_or_else(bad)?;
        let index = u8::try_from(i).map_err(|_| bad())?;
        bars.push(Bar { index, start, size, flags });
    }
    Ok(bars)
}

/// Parses `current_link_speed` / `max_link_speed`: `16.0 GT/s PCIe`, `8.0 GT/s`, `5 GT/s`,
/// `2.5 GT/s`. The kernel's `Unknown` (or `Unknown speed` on old kernels) is `Ok(None)`.
pub fn parse_link_speed(text: &str) -> Result<Option<f64>, AttrParseError> {
    let t = text.trim();
    if t == "Unknown" || t == "Unknown speed" {
        return Ok(None);
    }
    let bad = || AttrParseError::LinkSpeed(clip(t));
    let t = t.strip_suffix("PCIe").map_or(t, str::trim_end);
    let num = t.strip_suffix("GT/s").ok_or_else(bad)?.trim_end();
    if num.is_empty() || num.len() > 8 || !num.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(bad());
    }
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !(v > 0.0 && v <= 1024.0) {
        return Err(bad());
    }
    Ok(Some(v))
}

/// Parses `current_link_width` / `max_link_width` (a lane count in decimal; `0` is what a
/// port whose link is down reports).
pub fn parse_link_width(text: &str) -> Result<u8, AttrParseError> {
    let v = sysfs::parse_dec_u64(text).ok_or_else(|| AttrParseError::Number(clip(text)))?;
    u8::try_from(v).map_err(|_| AttrParseError::Range(clip(text)))
}

/// Parses a 16-bit hexadecimal id (`vendor`, `device`, `subsystem_*`).
pub fn parse_id16(text: &str) -> Result<u16, AttrParseError> {
    let v = sysfs::parse_hex_u64(text).ok_or_else(|| AttrParseError::Number(clip(text)))?;
    u16::try_from(v).map_err(|_| AttrParseError::Range(clip(text)))
}

/// Parses the 24-bit `class` code (`0x030200`).
pub fn parse_class(text: &str) -> Result<u32, AttrParseError> {
    let v = sysfs::parse_hex_u64(text).ok_or_else(|| AttrParseError::Number(clip(text)))?;
    u32::try_from(v).ok().filter(|&v| v <= 0xff_ffff).ok_or_else(|| AttrParseError::Range(clip(text)))
}

/// Parses a decimal IOMMU group number (the name of the `iommu_group` link's target).
pub fn parse_iommu_group(text: &str) -> Result<u32, AttrParseError> {
    let v = sysfs::parse_dec_u64(text).ok_or_else(|| AttrParseError::Number(clip(text)))?;
    u32::try_from(v).map_err(|_| AttrParseError::Range(clip(text)))
}

/// Parses a cpulist (`0-7,16-23`); an empty list is an empty set.
pub fn parse_cpulist(text: &str) -> Result<CpuSet, AttrParseError> {
    text.parse::<CpuSet>().map_err(|_| AttrParseError::Number(clip(text)))
}

/// Parses a `local_cpus` hexadecimal mask (`00000000,0000ff00`).
pub fn parse_cpumask(text: &str) -> Result<CpuSet, AttrParseError> {
    CpuSet::from_mask(text).map_err(|_| AttrParseError::Number(clip(text)))
}

/// Parses a node's `meminfo` (`Node 0 MemTotal:  16747124 kB`) into bytes.
pub fn parse_meminfo_total(text: &str) -> Result<u64, AttrParseError> {
    for line in text.lines() {
        let Some((_, rest)) = line.split_once("MemTotal:") else { continue };
        let mut it = rest.split_whitespace();
        let (Some(num), Some("kB"), None) = (it.next(), it.next(), it.next()) else {
            return Err(AttrParseError::MemTotal);
        };
        let kb = sysfs::parse_dec_u64(num).ok_or(AttrParseError::MemTotal)?;
        return kb.checked_mul(1024).ok_or(AttrParseError::MemTotal);
    }
    Err(AttrParseError::MemTotal)
}

/// Parses a node's `distance` row (`10 21`): decimal SLIT distances, one per node.
pub fn parse_distance(text: &str) -> Result<Vec<u32>, AttrParseError> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    if fields.is_empty() || fields.len() > 4096 {
        return Err(AttrParseError::Number(clip(text)));
    }
    fields
        .iter()
        .map(|f| {
            let v = sysfs::parse_dec_u64(f).ok_or_else(|| AttrParseError::Number(clip(f)))?;
            u32::try_from(v).map_err(|_| AttrParseError::Range(clip(f)))
        })
        .collect()
}

/// What one function's directory told us; `None` where unknown.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FunctionAttrs {
    /// `vendor`.
    pub vendor: Option<u16>,
    /// `device`.
    pub device: Option<u16>,
    /// `subsystem_vendor`.
    pub subsystem_vendor: Option<u16>,
    /// `subsystem_device`.
    pub subsystem_device: Option<u16>,
    /// `class`.
    pub class: Option<u32>,
    /// `numa_node`; `Some(None)` when the kernel says `-1` (no affinity).
    pub numa_node: Option<Option<u32>>,
    /// `local_cpulist`, else `local_cpus`.
    pub local_cpus: Option<CpuSet>,
    /// `current_link_speed` in GT/s.
    pub link_speed_gts: Option<f64>,
    /// `current_link_width`.
    pub link_width: Option<u8>,
    /// `max_link_speed` in GT/s.
    pub max_link_speed_gts: Option<f64>,
    /// `max_link_width`.
    pub max_link_width: Option<u8>,
    /// BARs 0-5 and the ROM (6) from `resource`.
    pub bars: Vec<Bar>,
    /// `resource` was read and parsed.
    pub bars_known: bool,
    /// The `iommu_group` link's target number.
    pub iommu_group: Option<u32>,
    /// The `driver` link's target name.
    pub driver: Option<String>,
    /// RDMA devices of the function (`infiniband/mlx5_0`): what NCCL calls a NIC.
    pub rdma_devices: Vec<String>,
    /// Network interfaces of the function (`net/eth0`).
    pub netdevs: Vec<String>,
    /// `dma_mask_bits`: bits of address the function can DMA to (set by its driver).
    pub dma_mask_bits: Option<u8>,
    /// Why the function is failed, when it is ([`super::health`]).
    pub failure: Option<String>,
}

/// Entries of a class subdirectory of a function (`infiniband/`, `net/`): names only, with
/// the characters an interface or device name may have, at most 16.
fn class_entries(dir: &Path, sub: &str) -> Vec<String> {
    sysfs::list_dir(&dir.join(sub))
        .unwrap_or_default()
        .into_iter()
        .filter(|n| n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:@".contains(&b)))
        .take(16)
        .collect()
}

/// How often each attribute was missing or bad across functions, so the report carries
/// one line per attribute instead of one per function.
#[derive(Debug, Default)]
pub struct Tally {
    entries: BTreeMap<&'static str, TallyEntry>,
    /// Functions read.
    pub functions: usize,
}

#[derive(Debug, Default)]
struct TallyEntry {
    missing: usize,
    bad: usize,
    first_bad: Option<String>,
}

impl Tally {
    fn missing(&mut self, name: &'static str) {
        self.entries.entry(name).or_default().missing += 1;
    }

    fn bad(&mut self, name: &'static str, why: String) {
        let e = self.entries.entry(name).or_default();
        e.bad += 1;
        e.first_bad.get_or_insert(why);
    }

    fn record<T>(&mut self, name: &'static str, r: Result<T, AttrError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) if e.is_missing() => {
                self.missing(name);
                None
            }
            Err(e) => {
                self.bad(name, e.to_string());
                None
            }
        }
    }

    /// One summary line per attribute that was missing or bad somewhere.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, e) in &self.entries {
            if e.missing > 0 {
                out.push(format!("{name}: missing on {} of {} PCI functions", e.missing, self.functions));
            }
            if e.bad > 0 {
                let first = e.first_bad.as_deref().unwrap_or("");
                out.push(format!("{name}: unreadable or invalid on {} PCI functions (first: {first})", e.bad));
            }
        }
        out
    }

    /// How many functions lacked `name` (missing, not bad).
    pub fn missing_count(&self, name: &str) -> usize {
        self.entries.get(name).map_or(0, |e| e.missing)
    }
}

/// Reads an attribute only if it is a regular file: a FIFO or device node planted in a
/// tree would block or misbehave on open.
fn read_regular(path: &Path) -> Result<String, AttrError> {
    match fs::metadata(path) {
        Ok(m) if m.is_file() => sysfs::read_attr(path),
        Ok(_) => Err(AttrError::Invalid { path: path.to_owned(), value: "not a regular file".to_owned() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(AttrError::Missing { path: path.to_owned() }),
        Err(e) => Err(AttrError::Unreadable { path: path.to_owned(), source: e }),
    }
}

/// The name a link like `driver` points to, checked to sit in a directory named `parent`
/// (`.../drivers/nvidia`, `.../iommu_groups/17`). The target need not exist: dumps keep
/// links whose targets were not copied.
fn link_in(dir: &Path, name: &str, parent: &str) -> Result<String, AttrError> {
    let path = dir.join(name);
    let target = fs::read_link(&path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => AttrError::Missing { path: path.clone() },
        _ => AttrError::Unreadable { path: path.clone(), source: e },
    })?;
    let in_parent = target.parent().and_then(Path::file_name).is_some_and(|p| p == parent);
    let leaf = target.file_name().and_then(|n| n.to_str()).filter(|n| in_parent && !n.is_empty());
    leaf.map(str::to_owned).ok_or_else(|| AttrError::Invalid { path, value: clip(&target.to_string_lossy()) })
}

fn parsed<T>(dir: &Path, name: &str, parse: impl FnOnce(&str) -> Result<T, AttrParseError>) -> Result<T, AttrError> {
    let path = dir.join(name);
    let text = read_regular(&path)?;
    parse(text.trim()).map_err(|_| AttrError::Invalid { path, value: clip(text.trim()) })
}

/// Reads a function's attributes from its sysfs directory, tallying what was unknown.
pub fn read_function(dir: &Path, tally: &mut Tally) -> FunctionAttrs {
    tally.functions += 1;
    let mut a = FunctionAttrs {
        vendor: tally.record("vendor", parsed(dir, "vendor", parse_id16)),
        device: tally.record("device", parsed(dir, "device", parse_id16)),
        subsystem_vendor: tally.record("subsystem_vendor", parsed(dir, "subsystem_vendor", parse_id16)),
        subsystem_device: tally.record("subsystem_device", parsed(dir, "subsystem_device", parse_id16)),
        class: tally.record("class", parsed(dir, "class", parse_class)),
        ..FunctionAttrs::default()
    };
    a.numa_node = tally.record(
        "numa_node",
        parsed(dir, "numa_node", |t| sysfs::parse_numa_node(t).ok_or_else(|| AttrParseError::Number(clip(t)))),
    );
    a.local_cpus = match parsed(dir, "local_cpulist", parse_cpulist) {
        Ok(c) => Some(c),
        Err(list_err) => match parsed(dir, "local_cpus", parse_cpumask) {
            Ok(c) => Some(c),
            Err(mask_err) if list_err.is_missing() => tally.record("local_cpulist", Err(mask_err)),
            Err(_) => tally.record("local_cpulist", Err(list_err)),
        },
    };
    let link_speed = parsed(dir, "current_link_speed", parse_link_speed);
    a.failure = super::health::failure(dir, &link_speed);
    a.link_speed_gts = tally.record("current_link_speed", link_speed).flatten();
    a.max_link_speed_gts = tally.record("max_link_speed", parsed(dir, "max_link_speed", parse_link_speed)).flatten();
    a.link_width = tally.record("current_link_width", parsed(dir, "current_link_width", parse_link_width));
    a.max_link_width = tally.record("max_link_width", parsed(dir, "max_link_width", parse_link_width));
    if let Some(bars) = tally.record("resource", parsed(dir, "resource", parse_resource)) {
        a.bars = bars.into_iter().filter(|b| b.index <= 6).collect();
        a.bars_known = true;
    }
    let group = link_in(dir, "iommu_group", "iommu_groups").and_then(|name| {
        parse_iommu_group(&name).map_err(|_| AttrError::Invalid { path: dir.join("iommu_group"), value: clip(&name) })
    });
    a.iommu_group = tally.record("iommu_group", group);
    // No `driver` link means no driver is bound: a fact, not an unknown.
    a.driver = match link_in(dir, "driver", "drivers") {
        Ok(d) => Some(d),
        Err(e) if e.is_missing() => None,
        Err(e) => tally.record("driver", Err(e)),
    };
    // Absent directories mean the function has no RDMA device / interface: not unknowns.
    a.rdma_devices = class_entries(dir, "infiniband");
    a.netdevs = class_entries(dir, "net");
    // Older kernels lack the file: absent is not tallied; a bad value is.
    a.dma_mask_bits = match parsed(dir, "dma_mask_bits", |t| {
        t.parse::<u8>().ok().filter(|b| (1..=64).contains(b)).ok_or_else(|| AttrParseError::Number(clip(t)))
    }) {
        Ok(b) => Some(b),
        Err(e) if e.is_missing() => None,
        Err(e) => tally.record("dma_mask_bits", Err(e)),
    };
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_lines_become_bars() {
        let t = "0x000000000000c000 0x000000000000c03f 0x0000000000040101\n\
                 0x00000000febd2000 0x00000000febd2fff 0x0000000000040200\n\
                 0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        let bars = parse_resource(t).unwrap();
        assert_eq!(bars.len(), 2);
        assert_eq!(bars[1], Bar { index: 1, start: 0xfebd_2000, size: 0x1000, flags: 0x40200 });
        assert!(parse_resource("0x1 0x0 0x0").is_err(), "end before start");
        assert!(parse_resource("0x1 0x2").is_err());
        assert!(parse_resource("zz 0x2 0x3").is_err());
        assert!(parse_resource("0x0 0xffffffffffffffff 0x200").is_err(), "size overflows");
        assert_eq!(parse_resource("").unwrap(), vec![]);
        // A 256 GiB BAR the kernel could not assign: `0x0 <size - 1>` with IORESOURCE_UNSET.
        assert_eq!(parse_resource("0x0 0x3fffffffff 0x2014220c\n").unwrap(), vec![]);
        assert_eq!(parse_resource("0x0 0xfff 0x10000200\n").unwrap(), vec![], "disabled");
    }

    #[test]
    fn link_speeds_in_every_kernel_format() {
        assert_eq!(parse_link_speed("16.0 GT/s PCIe").unwrap(), Some(16.0));
        assert_eq!(parse_link_speed("8.0 GT/s").unwrap(), Some(8.0));
        assert_eq!(parse_link_speed("5 GT/s").unwrap(), Some(5.0));
        assert_eq!(parse_link_speed("2.5 GT/s").unwrap(), Some(2.5));
        assert_eq!(parse_link_speed("Unknown").unwrap(), None);
        assert_eq!(parse_link_speed("Unknown speed").unwrap(), None);
        for bad in ["", "GT/s", "fast", "-8 GT/s", "NaN GT/s", "inf GT/s", "1e3 GT/s", "0 GT/s"] {
            assert!(parse_link_speed(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_link_width("16").unwrap(), 16);
        assert!(parse_link_width("256").is_err());
    }

    #[test]
    fn ids_classes_and_node_files() {
        assert_eq!(parse_id16("0x10de").unwrap(), 0x10de);
        assert!(parse_id16("0x10000").is_err());
        assert_eq!(parse_class("0x030200").unwrap(), 0x030200);
        assert!(parse_class("0x1000000").is_err());
        assert_eq!(
            parse_meminfo_total("Node 0 MemTotal:       16747124 kB\nNode 0 MemFree: 1 kB").unwrap(),
            16747124 * 1024
        );
        assert!(parse_meminfo_total("Node 0 MemFree: 1 kB").is_err());
        assert!(parse_meminfo_total("Node 0 MemTotal: 1 MB").is_err());
        assert_eq!(parse_distance("10 21").unwrap(), vec![10, 21]);
        assert!(parse_distance("").is_err());
    }

    #[test]
    fn dma_mask_bits_is_read_absent_is_quiet_and_bad_is_tallied() {
        let dir = tempfile::tempdir().unwrap();
        let mut tally = Tally::default();
        assert_eq!(read_function(dir.path(), &mut tally).dma_mask_bits, None);
        assert_eq!(tally.missing_count("dma_mask_bits"), 0);
        fs::write(dir.path().join("dma_mask_bits"), "40\n").unwrap();
        assert_eq!(read_function(dir.path(), &mut tally).dma_mask_bits, Some(40));
        fs::write(dir.path().join("dma_mask_bits"), "65\n").unwrap();
        assert_eq!(read_function(dir.path(), &mut tally).dma_mask_bits, None);
        assert!(
            tally.lines().iter().any(|l| l.starts_with("dma_mask_bits: unreadable or invalid")),
            "{:?}",
            tally.lines()
        );
    }
}
