//! The commands only fabricd can answer: `fabricctl partitions` (list, set, remove) and
//! `fabricctl regions`, each as a table or a JSON document (`fabric.partitions/v1`,
//! `fabric.regions/v1`).

use std::io::{self, Write};

use fabric_proto::wire::{
    AccessMode, BoundedVec, DeviceName, Name, PartitionSpec, PartitionsRequest, PartitionsResponse, RegionsResponse,
};
use serde::Serialize;

use crate::args::{ListFormat, PartitionsArgs, PartitionsCommand, RegionsArgs};
use crate::daemon::Client;
use crate::view::View;

/// Errors of the partition arguments.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A list is longer than the protocol carries.
    #[error("{what}: {len} given, at most {max}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Given.
        len: usize,
        /// Allowed.
        max: usize,
    },
    /// A name is longer than the protocol carries.
    #[error("partition name {0:?} is longer than 64 bytes")]
    LongName(String),
}

/// `fabric.partitions/v1`.
#[derive(Debug, Serialize)]
pub struct PartitionsDoc {
    /// Schema.
    pub schema: &'static str,
    /// The partitions the caller may see.
    pub partitions: Vec<PartitionDoc>,
}

/// One partition.
#[derive(Debug, Serialize)]
pub struct PartitionDoc {
    /// Name.
    pub name: String,
    /// Member devices.
    pub devices: Vec<String>,
    /// Bound uids.
    pub uids: Vec<u32>,
    /// Bound gids.
    pub gids: Vec<u32>,
}

/// The document for a partitions answer.
pub fn partitions_doc(p: &PartitionsResponse) -> PartitionsDoc {
    PartitionsDoc {
        schema: "fabric.partitions/v1",
        partitions: p
            .partitions
            .iter()
            .map(|s| PartitionDoc {
                name: s.name.to_string(),
                devices: s.devices.iter().map(ToString::to_string).collect(),
                uids: s.uids.to_vec(),
                gids: s.gids.to_vec(),
            })
            .collect(),
    }
}

fn ids(v: &[u32]) -> String {
    if v.is_empty() { "-".to_owned() } else { v.iter().map(ToString::to_string).collect::<Vec<_>>().join(",") }
}

fn write_json<T: Serialize>(v: &T, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v).map_err(io::Error::other)?;
    writeln!(out)
}

/// Writes partitions as a table (one line per partition, then its devices) or JSON.
pub fn render_partitions(doc: &PartitionsDoc, format: ListFormat, out: &mut dyn Write) -> io::Result<()> {
    if format == ListFormat::Json {
        return write_json(doc, out);
    }
    if doc.partitions.is_empty() {
        return writeln!(out, "no partitions (that you may see)");
    }
    writeln!(out, "{:<24} {:>7} {:<24} GIDS", "PARTITION", "DEVICES", "UIDS")?;
    for p in &doc.partitions {
        writeln!(out, "{:<24} {:>7} {:<24} {}", p.name, p.devices.len(), ids(&p.uids), ids(&p.gids))?;
        for d in &p.devices {
            writeln!(out, "  {d}")?;
        }
    }
    Ok(())
}

fn bounded<T, const N: usize>(what: &'static str, v: Vec<T>) -> Result<BoundedVec<T, N>, RemoteError> {
    let len = v.len();
    BoundedVec::new(v).map_err(|_| RemoteError::TooMany { what, len, max: N })
}

/// Runs `fabricctl partitions`.
pub fn partitions(args: &PartitionsArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut client = Client::connect(args.daemon.clone().flatten().as_deref())?;
    let req = match &args.command {
        None | Some(PartitionsCommand::List) => PartitionsRequest::List,
        Some(PartitionsCommand::Set { name, devices, uids, gids }) => {
            // Labels (GPU0) resolve in the fabric the daemon shows this caller.
            let view = View::new(client.fabric()?, None)?;
            let mut names = Vec::new();
            for d in devices {
                let idx = view.resolve(d)?;
                names.push(DeviceName::truncated(&view.fabric.device(idx).id.to_string()));
            }
            PartitionsRequest::Set(PartitionSpec {
                name: Name::new(name.as_str()).map_err(|_| RemoteError::LongName(name.clone()))?,
                devices: bounded("devices", names)?,
                uids: bounded("--uid", uids.clone())?,
                gids: bounded("--gid", gids.clone())?,
            })
        }
        Some(PartitionsCommand::Remove { name }) => PartitionsRequest::Remove {
            name: Name::new(name.as_str()).map_err(|_| RemoteError::LongName(name.clone()))?,
        },
    };
    let answer = client.partitions(req)?;
    render_partitions(&partitions_doc(&answer), args.output, out)?;
    Ok(())
}

/// `fabric.regions/v1`: what `fabricctl regions -o json` prints.
#[derive(Debug, Serialize)]
pub struct RegionsDoc {
    /// Schema.
    pub schema: &'static str,
    /// Everyone's (`--all`) or the caller's.
    pub all: bool,
    /// Regions.
    pub regions: Vec<RegionDoc>,
    /// Exports (never their secrets).
    pub exports: Vec<ExportDoc>,
    /// Imports.
    pub imports: Vec<ImportDoc>,
    /// The daemon cut a list at 4,096 entries.
    pub truncated: bool,
}

/// One region.
#[derive(Debug, Serialize)]
pub struct RegionDoc {
    /// Region id.
    pub region: u64,
    /// Generation.
    pub generation: u64,
    /// Owner uid.
    pub owner_uid: u32,
    /// Owner pid.
    pub owner_pid: i32,
    /// Device.
    pub device: String,
    /// Kind of memory (`hbm`, `cxl_volatile`...).
    pub memory: String,
    /// Which resource of that kind.
    pub ordinal: u16,
    /// Offset in the resource.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// One export.
#[derive(Debug, Serialize)]
pub struct ExportDoc {
    /// Region id.
    pub region: u64,
    /// Generation its handle names.
    pub generation: u64,
    /// Exporter uid.
    pub owner_uid: u32,
    /// Admitted uids (none and no gids: the owner only, or the partition's clients).
    pub uids: Vec<u32>,
    /// Admitted gids.
    pub gids: Vec<u32>,
    /// Partition whose clients may import.
    pub partition: Option<String>,
    /// `read_only` or `read_write`.
    pub access: &'static str,
    /// Revoked.
    pub revoked: bool,
}

/// One import.
#[derive(Debug, Serialize)]
pub struct ImportDoc {
    /// Import id.
    pub import: u64,
    /// Region id.
    pub region: u64,
    /// Generation.
    pub generation: u64,
    /// Importer uid.
    pub uid: u32,
}

fn memory_name(m: fabric_proto::wire::MemoryClass) -> String {
    let k: fabric_topology::MemoryKind = m.into();
    serde_json::to_value(k).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

/// The document for a regions answer.
pub fn regions_doc(r: &RegionsResponse, all: bool) -> RegionsDoc {
    RegionsDoc {
        schema: "fabric.regions/v1",
        all,
        regions: r
            .regions
            .iter()
            .map(|x| RegionDoc {
                region: x.region,
                generation: x.generation,
                owner_uid: x.owner_uid,
                owner_pid: x.owner_pid,
                device: x.resource.device.to_string(),
                memory: memory_name(x.resource.memory),
                ordinal: x.resource.ordinal,
                offset: x.offset,
                size: x.size,
            })
            .collect(),
        exports: r
            .exports
            .iter()
            .map(|e| ExportDoc {
                region: e.region,
                generation: e.generation,
                owner_uid: e.owner_uid,
                uids: e.policy.uids.to_vec(),
                gids: e.policy.gids.to_vec(),
                partition: e.policy.partition.as_ref().map(ToString::to_string),
                access: match e.policy.access {
                    AccessMode::ReadOnly => "read_only",
                    AccessMode::ReadWrite => "read_write",
                },
                revoked: e.revoked,
            })
            .collect(),
        imports: r
            .imports
            .iter()
            .map(|i| ImportDoc { import: i.import, region: i.region, generation: i.generation, uid: i.uid })
            .collect(),
        truncated: r.truncated,
    }
}

/// Writes regions, exports and imports as three tables or JSON.
pub fn render_regions(doc: &RegionsDoc, format: ListFormat, out: &mut dyn Write) -> io::Result<()> {
    if format == ListFormat::Json {
        return write_json(doc, out);
    }
    writeln!(out, "regions ({}):", doc.regions.len())?;
    if !doc.regions.is_empty() {
        writeln!(
            out,
            "  {:>8} {:>6} {:>7} {:>8} {:>14} {:>14}  RESOURCE",
            "REGION", "GEN", "UID", "PID", "OFFSET", "SIZE"
        )?;
    }
    for r in &doc.regions {
        writeln!(
            out,
            "  {:>8} {:>6} {:>7} {:>8} {:>#14x} {:>14}  {}#{}{}",
            r.region, r.generation, r.owner_uid, r.owner_pid, r.offset, r.size, r.device, r.memory, r.ordinal
        )?;
    }
    writeln!(out, "exports ({}):", doc.exports.len())?;
    if !doc.exports.is_empty() {
        writeln!(
            out,
            "  {:>8} {:>6} {:>7} {:<10} {:<16} {:<16} {:<16} STATE",
            "REGION", "GEN", "UID", "ACCESS", "UIDS", "GIDS", "PARTITION"
        )?;
    }
    for e in &doc.exports {
        let state = if e.revoked { "revoked" } else { "live" };
        let part = e.partition.as_deref().unwrap_or("-");
        writeln!(
            out,
            "  {:>8} {:>6} {:>7} {:<10} {:<16} {:<16} {:<16} {state}",
            e.region,
            e.generation,
            e.owner_uid,
            e.access,
            ids(&e.uids),
            ids(&e.gids),
            part
        )?;
    }
    writeln!(out, "imports ({}):", doc.imports.len())?;
    if !doc.imports.is_empty() {
        writeln!(out, "  {:>8} {:>8} {:>6} {:>7}", "IMPORT", "REGION", "GEN", "UID")?;
    }
    for i in &doc.imports {
        writeln!(out, "  {:>8} {:>8} {:>6} {:>7}", i.import, i.region, i.generation, i.uid)?;
    }
    if doc.truncated {
        writeln!(out, "(the daemon listed the first 4096 of each)")?;
    }
    Ok(())
}

/// Runs `fabricctl regions`.
pub fn regions(args: &RegionsArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut client = Client::connect(args.daemon.clone().flatten().as_deref())?;
    let answer = client.regions(args.all)?;
    render_regions(&regions_doc(&answer, args.all), args.output, out)?;
    Ok(())
}
