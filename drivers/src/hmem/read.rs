//! Reads the heterogeneous-memory parts of sysfs under the injected root: a node's HMAT
//! access classes and memory-side caches, its memory blocks, the memory tiers and the DAX
//! devices. Every attribute is bounded and parsed strictly; what cannot be read is a note.

use std::path::Path;

use fabric_topology::{AccessClass, DaxDevice, DaxMode, MemorySideCache, MemoryTier};

use super::parse::{self, MAX_NODE};
use crate::SysfsRoot;
use crate::cxl::scan::Resolver;
use crate::sysfs::{self, AttrError};

/// The most memory tiers, caches per node and DAX devices read (far above real hosts:
/// tiers are abstract-distance chunks, HMAT caches a handful of levels).
pub const MAX_TIERS: usize = 64;
/// See [`MAX_TIERS`].
pub const MAX_CACHES: usize = 16;
/// See [`MAX_TIERS`].
pub const MAX_DAX: usize = 4096;
/// The most memory blocks of one node considered (a 16 TiB node of 128 MiB blocks).
pub const MAX_BLOCKS: usize = 1 << 17;

/// An optional attribute: missing is `None` silently, anything else wrong is a note.
fn optional<T>(path: &Path, parse: impl FnOnce(&str) -> Option<T>, notes: &mut Vec<String>) -> Option<T> {
    match sysfs::parse_attr(path, parse) {
        Ok(v) => Some(v),
        Err(e) if e.is_missing() => None,
        Err(e) => {
            notes.push(e.to_string());
            None
        }
    }
}

/// Node numbers of the `nodeM` entries of a directory (HMAT `initiators/`).
fn node_entries(dir: &Path, notes: &mut Vec<String>) -> Vec<u32> {
    let names = sysfs::list_dir(dir).unwrap_or_else(|e| {
        notes.push(e.to_string());
        Vec::new()
    });
    let mut v: Vec<u32> =
        names.iter().filter_map(|n| crate::pci::parse_node_name(n)).filter(|&n| n <= MAX_NODE).collect();
    v.sort_unstable();
    v
}

/// HMAT access classes of a node (`accessC/initiators/`), by class.
pub fn read_access(node_dir: &Path, notes: &mut Vec<String>) -> Vec<AccessClass> {
    let mut out = Vec::new();
    for class in 0..=1u8 {
        let dir = node_dir.join(format!("access{class}/initiators"));
        if !dir.is_dir() {
            continue;
        }
        let num = |name: &str, notes: &mut Vec<String>| optional(&dir.join(name), sysfs::parse_dec_u64, notes);
        out.push(AccessClass {
            class,
            initiators: node_entries(&dir, notes),
            read_bandwidth_mbps: num("read_bandwidth", notes),
            write_bandwidth_mbps: num("write_bandwidth", notes),
            read_latency_ns: num("read_latency", notes),
            write_latency_ns: num("write_latency", notes),
        });
    }
    out
}

/// Memory-side caches of a node (`memory_side_cache/indexK`), by level.
pub fn read_caches(node_dir: &Path, notes: &mut Vec<String>) -> Vec<MemorySideCache> {
    let dir = node_dir.join("memory_side_cache");
    let names = sysfs::list_dir(&dir).unwrap_or_else(|e| {
        notes.push(e.to_string());
        Vec::new()
    });
    let mut levels: Vec<u32> = names.iter().filter_map(|n| parse::parse_indexed_name(n, "index", 255)).collect();
    levels.sort_unstable();
    if levels.len() > MAX_CACHES {
        notes.push(format!("{}: {} caches, reading the first {MAX_CACHES}", dir.display(), levels.len()));
        levels.truncate(MAX_CACHES);
    }
    levels
        .into_iter()
        .map(|level| {
            let d = dir.join(format!("index{level}"));
            let small = |v: &str| sysfs::parse_dec_u64(v).and_then(|x| u32::try_from(x).ok());
            MemorySideCache {
                level,
                size: optional(&d.join("size"), sysfs::parse_dec_u64, notes),
                line_size: optional(&d.join("line_size"), sysfs::parse_dec_u64, notes),
                indexing: optional(&d.join("indexing"), small, notes),
                write_policy: optional(&d.join("write_policy"), small, notes),
            }
        })
        .collect()
}

/// The host physical ranges `[start, end)` of a node's memory blocks (`nodeN/memoryX`,
/// each `block_size_bytes` long), merged where adjacent. `None` when the tree does not
/// show them.
pub fn read_block_ranges(root: &SysfsRoot, node_dir: &Path, notes: &mut Vec<String>) -> Option<Vec<(u64, u64)>> {
    let bs_path = root.path("sys/devices/system/memory/block_size_bytes");
    // The kernel prints the block size in hex without a prefix.
    let bs = optional(&bs_path, sysfs::parse_hex_u64, notes).filter(|&b| b > 0)?;
    let names = sysfs::list_dir(node_dir).ok()?;
    let mut blocks: Vec<u64> = names
        .iter()
        .filter_map(|n| parse::parse_indexed_name(n, "memory", u64::from(u32::MAX)))
        .map(u64::from)
        .collect();
    if blocks.is_empty() {
        return None;
    }
    if blocks.len() > MAX_BLOCKS {
        notes.push(format!("{}: {} memory blocks, not matched to CXL regions", node_dir.display(), blocks.len()));
        return None;
    }
    blocks.sort_unstable();
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for b in blocks {
        let start = b.checked_mul(bs)?;
        let end = start.checked_add(bs)?;
        match ranges.last_mut() {
            Some(r) if r.1 == start => r.1 = end,
            _ => ranges.push((start, end)),
        }
    }
    Some(ranges)
}

/// The kernel's memory tiers (`sys/devices/virtual/memory_tiering/memory_tierN/nodelist`).
pub fn read_tiers(root: &SysfsRoot, notes: &mut Vec<String>) -> Vec<MemoryTier> {
    let dir = root.path("sys/devices/virtual/memory_tiering");
    let names = sysfs::list_dir(&dir).unwrap_or_else(|e| {
        notes.push(e.to_string());
        Vec::new()
    });
    let mut ids: Vec<u32> =
        names.iter().filter_map(|n| parse::parse_indexed_name(n, "memory_tier", u64::from(u32::MAX >> 7))).collect();
    ids.sort_unstable();
    if ids.len() > MAX_TIERS {
        notes.push(format!("{}: {} tiers, reading the first {MAX_TIERS}", dir.display(), ids.len()));
        ids.truncate(MAX_TIERS);
    }
    let mut out = Vec::new();
    for id in ids {
        let p = dir.join(format!("memory_tier{id}/nodelist"));
        match sysfs::read_attr(&p) {
            Ok(t) => match parse::parse_nodelist(&t) {
                Ok(nodes) => out.push(MemoryTier { id, nodes }),
                Err(e) => notes.push(format!("{}: {e}, tier skipped", p.display())),
            },
            Err(e) => notes.push(format!("{e}, tier skipped")),
        }
    }
    out
}

/// Every DAX device under `sys/bus/dax/devices`, by name; the CXL region of a CXL one is
/// filled in later by the CXL step.
pub fn read_dax(root: &SysfsRoot, notes: &mut Vec<String>) -> Vec<DaxDevice> {
    let dir = root.path("sys/bus/dax/devices");
    let names = match sysfs::list_dir(&dir) {
        Ok(n) => n,
        Err(e) => {
            notes.push(format!("{e}: DAX devices not read"));
            return Vec::new();
        }
    };
    let mut names: Vec<(u32, u32, String)> = names
        .into_iter()
        .filter_map(|n| match parse::parse_dax_name(&n) {
            Some((a, b)) => Some((a, b, n)),
            None => {
                notes.push(format!("{}: not a DAX device name, skipped", dir.join(&n).display()));
                None
            }
        })
        .collect();
    // Numeric order (dax2.0 before dax10.0): the kernel's own.
    names.sort();
    if names.len() > MAX_DAX {
        notes.push(format!("{}: {} DAX devices, reading the first {MAX_DAX}", dir.display(), names.len()));
        names.truncate(MAX_DAX);
    }
    let resolver = Resolver::new(root.root());
    let devices = root.path("sys/devices");
    names
        .into_iter()
        .map(|(_, _, name)| {
            let link = dir.join(&name);
            // Where it lives says where its memory comes from; a dump that holds a plain
            // directory (or a link leaving the root) shows no such place.
            let real = resolver.as_ref().and_then(|r| r.resolve(&link).map_err(|e| notes.push(e.to_string())).ok());
            let rel = real.as_ref().and_then(|p| {
                let d = std::fs::canonicalize(&devices).ok()?;
                p.strip_prefix(d).ok().map(|r| r.to_string_lossy().into_owned())
            });
            let origin = match &rel {
                Some(rel) => parse::dax_origin_from_path(rel).0,
                None => {
                    notes.push(format!("{}: not a link into sys/devices, origin unknown", link.display()));
                    fabric_topology::MemoryOrigin::Unknown
                }
            };
            let at = real.unwrap_or_else(|| link.clone());
            let mode = match sysfs::link_name(&at.join("driver")) {
                Ok(d) if d == "device_dax" => DaxMode::Device,
                Ok(d) if d == "kmem" => DaxMode::SystemRam,
                Ok(d) => DaxMode::Other(d.chars().take(64).collect()),
                Err(AttrError::Missing { .. }) => DaxMode::Unbound,
                Err(e) => {
                    notes.push(e.to_string());
                    DaxMode::Unbound
                }
            };
            DaxDevice {
                size: optional(&at.join("size"), sysfs::parse_dec_u64, notes),
                resource: optional(&at.join("resource"), sysfs::parse_hex_u64, notes),
                target_node: optional(&at.join("target_node"), sysfs::parse_numa_node, notes).flatten(),
                origin,
                mode,
                name,
            }
        })
        .collect()
}
