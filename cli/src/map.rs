//! `fabricctl map`: the global fabric address map of the selected inventory — listing,
//! translation both ways, hole collection, partitions and rebuild.
//!
//! Until the daemon owns the map, `fabricctl` does: every `map` command loads the state
//! file, brings it in line with the inventory (stable placement: returning devices get
//! their old ranges, vanished ones leave holes), creates interleave sets for CXL regions it
//! has not seen, saves the state if anything changed, and then answers.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use fabric_addrmap::{
    AddressMap, Change, GcFilter, Listing, Location, MapConfig, MapError, RebuildFrom, Snapshot, TranslateError,
};
use fabric_topology::{DeviceId, Inventory, MemoryKind};
use serde::Serialize;

use crate::args::{ListFormat, MapArgs, MapCommand, PartitionCommand, RebuildSource};
use crate::source::Source;
use crate::view::View;

/// Errors of the map commands.
#[derive(Debug, thiserror::Error)]
pub enum MapCmdError {
    /// The state file could not be opened, updated or saved.
    #[error("address map state {path}")]
    State {
        /// The state file.
        path: PathBuf,
        /// Why.
        #[source]
        source: MapError,
    },
    /// No state directory could be chosen.
    #[error("no state directory: set --state, FABRIC_STATE_DIR, XDG_STATE_HOME or HOME")]
    NoStateDir,
    /// A GFA or offset argument is not a number.
    #[error("{0:?} is not an address (use 0x-prefixed hex or decimal)")]
    BadNumber(String),
    /// A translation failed.
    #[error("translating {what}")]
    Translate {
        /// What was asked.
        what: String,
        /// Why.
        #[source]
        source: TranslateError,
    },
    /// The partition named does not exist.
    #[error("no partition named {0:?}")]
    NoPartition(String),
    /// The map configuration file could not be read.
    #[error("reading map configuration {path}")]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The map configuration file is not valid (the message names line and key).
    #[error("{path}: {message}")]
    ConfigParse {
        /// The file.
        path: PathBuf,
        /// The TOML error, with line, column and key.
        message: String,
    },
    /// The map configuration is inconsistent.
    #[error("{path}: invalid map configuration")]
    ConfigInvalid {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: fabric_addrmap::config::ConfigError,
    },
}

/// Reads a map configuration (`configs/addrmap.toml` documents every key).
pub fn load_config(path: &Path) -> Result<MapConfig, MapCmdError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| MapCmdError::ConfigRead { path: path.to_owned(), source })?;
    let config: MapConfig = toml::from_str(&text).map_err(|e| MapCmdError::ConfigParse {
        path: path.to_owned(),
        message: e.to_string().trim_end().to_owned(),
    })?;
    config.validate().map_err(|source| MapCmdError::ConfigInvalid { path: path.to_owned(), source })?;
    Ok(config)
}

impl MapCmdError {
    /// How to fix it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            MapCmdError::State { source: MapError::Persist(_), .. } => Some(
                "the state file is damaged and was left untouched; `fabricctl map rebuild` moves it aside \
                 and starts again (`--from previous` restores the last good copy)",
            ),
            MapCmdError::NoStateDir => Some("pass --state FILE"),
            MapCmdError::Translate { source: TranslateError::Hole { .. }, .. } => {
                Some("the owner vanished; `fabricctl map gc` releases its hole once you are sure it is gone")
            }
            MapCmdError::Translate { source: TranslateError::UnknownResource, .. } => {
                Some("list the mapped resources with `fabricctl map`; --kind and --ordinal pick one of a device's")
            }
            _ => None,
        }
    }
}

/// The state file: `--state`, else `$FABRIC_STATE_DIR`, `/var/lib/fabric` for root, or
/// `$XDG_STATE_HOME/fabric` / `~/.local/state/fabric`; one file per inventory source
/// ([`state_name`]) so a sim fabric or a sysfs dump never shares placements with the host.
pub fn state_path(explicit: Option<&Path>, source: &Source) -> Result<PathBuf, MapCmdError> {
    if let Some(p) = explicit {
        return Ok(p.to_owned());
    }
    let dir = if let Some(d) = std::env::var_os("FABRIC_STATE_DIR") {
        PathBuf::from(d)
    } else if is_root() {
        PathBuf::from("/var/lib/fabric")
    } else if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        PathBuf::from(d).join("fabric")
    } else {
        PathBuf::from(std::env::var_os("HOME").ok_or(MapCmdError::NoStateDir)?).join(".local/state/fabric")
    };
    Ok(dir.join(state_name(source)))
}

/// The state file's name for `source`: `map.state` for the live host, `map-sim-STEM.state`
/// for a sim file, and for another sysfs root (a dump) a name of its own, from a hash of
/// its canonical path: listing a dump must not place its devices in the host's state (and
/// mark the host's as vanished, for a later gc to free).
pub fn state_name(source: &Source) -> String {
    match source {
        Source::Sim(f) => format!("map-sim-{}.state", f.file_stem().and_then(|s| s.to_str()).unwrap_or("fabric")),
        Source::Sysfs(root) => {
            let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.clone());
            if root == Path::new("/") {
                return "map.state".to_owned();
            }
            // FNV-1a: stable across builds, unlike std's hasher.
            let hash = root
                .as_os_str()
                .as_encoded_bytes()
                .iter()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3));
            format!("map-sysfs-{hash:016x}.state")
        }
    }
}

pub(crate) fn is_root() -> bool {
    // The effective uid without libc: /proc/self/status "Uid: real effective ...".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:")).map(|v| v.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// Opens the map for an inventory, brings it up to date and saves it if it changed.
/// Returns the map, what changed, and the CXL regions that could not become sets.
///
/// `config`, when given, steers new placements from now on (placed ranges never move).
pub fn open(
    inv: &Inventory,
    path: &Path,
    config: Option<&MapConfig>,
) -> Result<(AddressMap, Change, Vec<String>), MapCmdError> {
    let s = fabric_addrmap::open_synced(inv, path, config)
        .map_err(|source| MapCmdError::State { path: path.to_owned(), source })?;
    Ok((s.map, s.change, s.skipped))
}

/// Parses `0x…` hex or decimal (digits and `_` only: no sign).
pub fn parse_number(s: &str) -> Result<u64, MapCmdError> {
    let t = s.trim().replace('_', "");
    let (digits, radix) = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => (h, 16),
        None => (t.as_str(), 10),
    };
    let r = if digits.chars().all(|c| c.is_digit(radix)) { u64::from_str_radix(digits, radix).ok() } else { None };
    r.ok_or_else(|| MapCmdError::BadNumber(s.to_owned()))
}

/// A memory kind by its JSON name (`hbm`, `cxl_volatile`, …).
pub(crate) fn memory_kind(s: &str) -> Result<MemoryKind, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned()))
        .map_err(|_| format!("{s:?} is no memory kind (hbm, cxl_volatile, cxl_persistent, cxl_dynamic, host_exported)"))
}

/// A translation, for output.
#[derive(Debug, Serialize)]
pub struct TranslateDoc {
    /// Schema name.
    pub schema: &'static str,
    /// The GFA asked.
    pub gfa: String,
    /// The device holding it.
    pub device: String,
    /// Kind of memory.
    pub kind: MemoryKind,
    /// Ordinal among the device's resources of that kind.
    pub ordinal: u16,
    /// Byte offset in the resource.
    pub offset: String,
    /// The interleave set it went through.
    pub interleave_set: Option<String>,
    /// The map generation answered from.
    pub generation: u64,
}

fn translate_doc(snap: &Snapshot, gfa: u64, loc: &Location) -> TranslateDoc {
    let key = snap.resource(loc.resource);
    TranslateDoc {
        schema: "fabric.map.translate/v1",
        gfa: format!("{gfa:#x}"),
        device: key.device.to_string(),
        kind: key.kind,
        ordinal: key.ordinal,
        offset: format!("{:#x}", loc.offset),
        interleave_set: loc.set.map(|s| snap.set(s).name.clone()),
        generation: snap.generation(),
    }
}

fn write_json<T: Serialize>(v: &T, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v).map_err(io::Error::other)?;
    writeln!(out)
}

fn bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 5] =
        [("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, v) in UNITS {
        if n >= v {
            return format!("{:.1} {u}", n as f64 / v as f64);
        }
    }
    format!("{n} B")
}

/// Most ranges the table lists before it summarises (JSON always has all).
const TABLE_RANGES: usize = 48;

/// Writes a listing as the `map` table; `from` says where it came from (`state FILE` or
/// `fabricd SOCKET`) on the first line.
pub fn render_listing(l: &Listing, from: &str, skipped: &[String], out: &mut dyn Write) -> io::Result<()> {
    writeln!(out, "Address map generation {} ({} address bits)  {from}", l.generation, l.address_bits)?;
    writeln!(
        out,
        "mapped {}  holes {}  high water {:#x}  ranges {}\n",
        bytes(l.mapped_bytes),
        bytes(l.hole_bytes),
        l.high_water,
        l.ranges.len()
    )?;
    writeln!(out, "{:<16} {:>20} {:>10} {:>10} {:>6}", "NODE", "START", "SPAN", "MAPPED", "USED")?;
    for n in l.nodes.iter().take(TABLE_RANGES) {
        let util = format!("{:.1}%", n.utilisation * 100.0);
        let node = match n.state.as_deref() {
            Some("gone") => format!("{} (gone)", n.node),
            _ => n.node.clone(),
        };
        writeln!(out, "{node:<16} {:>#20x} {:>10} {:>10} {:>6}", n.start, bytes(n.span), bytes(n.mapped), util)?;
    }
    if l.nodes.len() > TABLE_RANGES {
        writeln!(out, "... {} more nodes (-o json lists all)", l.nodes.len() - TABLE_RANGES)?;
    }
    writeln!(out)?;
    writeln!(out, "{:>20} {:>20} {:>10} {:<10} {:<14} OWNER", "START", "END", "SIZE", "KIND", "MEMORY")?;
    for r in l.ranges.iter().take(TABLE_RANGES) {
        let kind = serde_json::to_value(r.kind).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        let mem = r.memory.and_then(|m| serde_json::to_value(m).ok()).and_then(|v| v.as_str().map(str::to_owned));
        let mut owner = r.owner.clone();
        if let Some(i) = &r.interleave {
            owner = format!("{owner} ({}-way, {} B granularity: {})", i.ways, i.granularity, i.members.join(", "));
        }
        if let Some(g) = r.vanished_since {
            owner = format!("{owner} [vanished at generation {g}]");
        }
        let end = r.start.saturating_add(r.size.saturating_sub(1));
        writeln!(
            out,
            "{:>#20x} {:>#20x} {:>10} {:<10} {:<14} {owner}",
            r.start,
            end,
            bytes(r.size),
            kind,
            mem.unwrap_or_else(|| "-".into())
        )?;
    }
    if l.ranges.len() > TABLE_RANGES {
        writeln!(out, "... {} more ranges (-o json lists all)", l.ranges.len() - TABLE_RANGES)?;
    }
    for s in skipped {
        writeln!(out, "\nnot mapped: {s}")?;
    }
    Ok(())
}

fn render_change(change: &Change, format: ListFormat, out: &mut dyn Write) -> io::Result<()> {
    if format == ListFormat::Json {
        return write_json(change, out);
    }
    writeln!(out, "generation {}", change.generation)?;
    for (what, list) in [
        ("added", &change.added),
        ("returned", &change.returned),
        ("vanished", &change.vanished),
        ("collected", &change.collected),
        ("moved", &change.moved),
        ("resized", &change.resized),
        ("absorbed", &change.absorbed),
    ] {
        if !list.is_empty() {
            writeln!(out, "{what}: {}", list.len())?;
        }
    }
    Ok(())
}

/// Runs a `map` command.
pub fn run(args: &MapArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    // The listing comes from fabricd when one is selected; the other commands work on a
    // local state file and need --daemon left out.
    // A state file or a map configuration named is a local map (clap refuses them with
    // --daemon): no daemon is asked, even one at the default socket.
    let local = args.state.is_some() || args.config.is_some();
    match &args.command {
        None if local => {}
        None => {
            if let Some(mut client) = crate::daemon::select(&args.source)? {
                let l = client.listing()?;
                if args.output == ListFormat::Json {
                    write_json(&l, out)?;
                } else {
                    render_listing(&l, &format!("fabricd {}", client.path().display()), &[], out)?;
                }
                return Ok(());
            }
        }
        Some(MapCommand::Translate { gfa, partition: None }) if args.source.daemon.is_some() => {
            if let Some(mut client) = crate::daemon::select(&args.source)? {
                return crate::domain::translate(&mut client, *gfa, args.output, out);
            }
        }
        Some(c) if args.source.daemon.is_some() => {
            let name = match c {
                MapCommand::Translate { .. } => "map translate --partition (a bound client sees its partitions)",
                MapCommand::Reverse { .. } => "map reverse",
                MapCommand::Gc { .. } => "map gc",
                MapCommand::Partition(_) => "map partition (use `fabricctl partitions`)",
                MapCommand::Rebuild { .. } => "map rebuild",
            };
            return Err(crate::daemon::DaemonError::CommandUnavailable(name).into());
        }
        Some(_) => {}
    }
    let source = Source::from_args(&args.source);
    let path = state_path(args.state.as_deref(), &source)?;
    let config = args.config.as_deref().map(load_config).transpose()?;
    let config = config.as_ref();
    // `map gc --node NAME` names the node whose holes go (clap gives the global --node
    // the same value): the fabric is read whole, since that node may be gone from it.
    let narrow = match &args.command {
        Some(MapCommand::Gc { .. }) => None,
        _ => args.source.node.clone(),
    };
    let view = View::new(source.load()?, narrow)?;
    let inv = view.fabric.inventory();
    let format = args.output;
    match &args.command {
        None => {
            let (map, _, skipped) = open(inv, &path, config)?;
            if format == ListFormat::Json {
                write_json(&map.snapshot().listing(), out)?;
            } else {
                render_listing(&map.snapshot().listing(), &format!("state {}", path.display()), &skipped, out)?;
            }
        }
        Some(MapCommand::Translate { gfa, partition }) => {
            let (map, _, _) = open(inv, &path, config)?;
            let snap = map.snapshot();
            let g = *gfa;
            let what = format!("GFA {g:#x}");
            let loc = match partition {
                Some(p) => snap.partition(p).ok_or_else(|| MapCmdError::NoPartition(p.clone()))?.translate(g),
                None => snap.translate(g),
            }
            .map_err(|source| MapCmdError::Translate { what, source })?;
            let doc = translate_doc(&snap, g, &loc);
            if format == ListFormat::Json {
                write_json(&doc, out)?;
            } else {
                let kind = serde_json::to_value(doc.kind)?.as_str().unwrap_or_default().to_owned();
                write!(out, "{} -> {} {kind}[{}] + {}", doc.gfa, doc.device, doc.ordinal, doc.offset)?;
                match &doc.interleave_set {
                    Some(s) => writeln!(out, " (through interleave set {s})")?,
                    None => writeln!(out)?,
                }
            }
        }
        Some(MapCommand::Reverse { device, offset, kind, ordinal }) => {
            let (map, _, _) = open(inv, &path, config)?;
            let snap = map.snapshot();
            let idx = view.resolve(device)?;
            let id: &DeviceId = &view.fabric.device(idx).id;
            let off = *offset;
            let kind = kind.or_else(|| first_mapped_kind(&snap, id)).unwrap_or(MemoryKind::Hbm);
            let what = format!("{id} offset {off:#x}");
            let gfa =
                snap.reverse(id, kind, *ordinal, off).map_err(|source| MapCmdError::Translate { what, source })?;
            if format == ListFormat::Json {
                #[derive(Serialize)]
                struct ReverseDoc<'a> {
                    schema: &'static str,
                    device: &'a DeviceId,
                    kind: MemoryKind,
                    ordinal: u16,
                    offset: String,
                    gfa: String,
                    generation: u64,
                }
                let doc = ReverseDoc {
                    schema: "fabric.map.reverse/v1",
                    device: id,
                    kind,
                    ordinal: *ordinal,
                    offset: format!("{off:#x}"),
                    gfa: format!("{gfa:#x}"),
                    generation: snap.generation(),
                };
                write_json(&doc, out)?;
            } else {
                writeln!(out, "{id} offset {off:#x} -> GFA {gfa:#x}")?;
            }
        }
        Some(MapCommand::Gc { device, node }) => {
            let (mut map, _, _) = open(inv, &path, config)?;
            let filter = match (device, node) {
                (Some(d), _) => GcFilter::Device(d.parse::<DeviceId>()?),
                (None, Some(n)) => GcFilter::Node(n.clone()),
                (None, None) => GcFilter::All,
            };
            let change = map.gc(&filter);
            map.save(&path).map_err(|source| MapCmdError::State { path: path.clone(), source })?;
            render_change(&change, format, out)?;
        }
        Some(MapCommand::Rebuild { from }) => {
            let from = match from {
                RebuildSource::Inventory => RebuildFrom::Inventory,
                RebuildSource::Previous => RebuildFrom::Previous,
            };
            let rebuilt = AddressMap::rebuild(&path, config.cloned().unwrap_or_default(), inv, from)
                .map_err(|source| MapCmdError::State { path: path.clone(), source })?;
            if let Some(p) = &rebuilt.moved_aside {
                writeln!(out, "moved the damaged state aside to {}", p.display())?;
            }
            render_change(&rebuilt.change, format, out)?;
        }
        Some(MapCommand::Partition(p)) => {
            let (mut map, _, _) = open(inv, &path, config)?;
            let change = match p {
                PartitionCommand::Set { name, devices } => {
                    let ids = devices
                        .iter()
                        .map(|d| view.resolve(d).map(|i| view.fabric.device(i).id.clone()))
                        .collect::<Result<Vec<_>, _>>()?;
                    map.partition(name, &ids)
                }
                PartitionCommand::Remove { name } => {
                    map.remove_partition(name).map_err(|source| MapCmdError::State { path: path.clone(), source })?
                }
            };
            map.save(&path).map_err(|source| MapCmdError::State { path: path.clone(), source })?;
            render_change(&change, format, out)?;
        }
    }
    Ok(())
}

fn first_mapped_kind(snap: &Snapshot, id: &DeviceId) -> Option<MemoryKind> {
    [
        MemoryKind::Hbm,
        MemoryKind::CxlVolatile,
        MemoryKind::CxlPersistent,
        MemoryKind::CxlDynamic,
        MemoryKind::HostExported,
    ]
    .into_iter()
    .find(|&k| snap.lookup(id, k, 0).is_some())
}

#[cfg(test)]
mod state_tests {
    use super::*;

    /// A dump's listing wrote the host's `map.state` before: its devices were placed there
    /// and the host's marked vanished, for a later gc to free.
    #[test]
    fn each_sysfs_root_has_a_state_file_of_its_own() {
        let dump = tempfile::tempdir().unwrap();
        let other = tempfile::tempdir().unwrap();
        let host = state_name(&Source::Sysfs(PathBuf::from("/")));
        assert_eq!(host, "map.state");
        let a = state_name(&Source::Sysfs(dump.path().to_owned()));
        assert!(a.starts_with("map-sysfs-") && a.ends_with(".state"), "{a}");
        assert_ne!(a, state_name(&Source::Sysfs(other.path().to_owned())));
        assert_eq!(a, state_name(&Source::Sysfs(dump.path().join("."))), "the canonical path names it");
        assert_eq!(state_name(&Source::Sim(PathBuf::from("configs/sim/a.toml"))), "map-sim-a.state");
    }
}
