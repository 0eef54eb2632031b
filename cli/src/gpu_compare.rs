//! `fabricctl gpu-compare`: checks discovery against `nvidia-smi` on a GPU machine — every
//! GPU by UUID with its PCI bus id and memory size, and the GPU-to-GPU classes of the
//! connection matrix (`classify()` against `nvidia-smi topo -m`). scripts/gpu-check.sh runs
//! it; the tests run it on a sim fabric and hand-written nvidia-smi outputs.

use std::io::{self, Write};
use std::path::Path;

use fabric_topology::{DeviceIdx, DeviceKind, PciAddress};

use crate::nvsmi::{self, NvsmiError, SmiLog, SmiMatrix};
use crate::view::View;

/// Memory sizes differing by less than this fraction match: nvidia-smi prints the usable
/// framebuffer, discovery may record the raw size (80 GiB vs 81559 MiB on an H100).
pub const MEMORY_TOLERANCE: f64 = 0.02;

/// Why the comparison could not run.
#[derive(Debug, thiserror::Error)]
pub enum GpuCompareError {
    /// An input file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// An input could not be parsed.
    #[error(transparent)]
    Parse(#[from] NvsmiError),
    /// The comparison found differences (the report was written).
    #[error("{0} difference(s) between discovery and nvidia-smi")]
    Differences(usize),
}

impl GpuCompareError {
    /// How to fix it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            GpuCompareError::Read { .. } => {
                Some("pass the files written by `nvidia-smi -q -x` and `nvidia-smi topo -m`")
            }
            GpuCompareError::Parse(_) => {
                Some("the file is not nvidia-smi output of a supported driver; check it by eye")
            }
            GpuCompareError::Differences(_) => {
                Some("see the rows marked above; run `fabricctl status` or -vv to see which backend missed what")
            }
        }
    }
}

/// One GPU as nvidia-smi and discovery see it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuRow {
    /// nvidia-smi's index (`None` for a GPU only discovery found).
    pub smi_index: Option<usize>,
    /// UUID.
    pub uuid: Option<String>,
    /// Discovery's matrix label (`GPU0`), when discovery found the GPU.
    pub label: Option<String>,
    /// nvidia-smi's PCI bus id.
    pub smi_bus_id: Option<String>,
    /// Discovery's PCI address.
    pub bus_id: Option<String>,
    /// nvidia-smi's framebuffer total, MiB.
    pub smi_memory_mib: Option<u64>,
    /// Discovery's HBM size, MiB.
    pub memory_mib: Option<u64>,
    /// What differs (empty: the GPU matches).
    pub problems: Vec<String>,
}

/// One GPU-to-GPU cell of the matrix.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CellRow {
    /// Row (nvidia-smi label).
    pub a: String,
    /// Column.
    pub b: String,
    /// nvidia-smi's class.
    pub smi: String,
    /// `classify()`'s class, when both GPUs were discovered.
    pub fabric: Option<String>,
    /// Whether they agree.
    pub ok: bool,
}

/// The whole comparison (`fabric.gpu-compare/v1`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuCompare {
    /// Schema name.
    pub schema: &'static str,
    /// Driver version nvidia-smi reports.
    pub driver_version: Option<String>,
    /// CUDA version nvidia-smi reports.
    pub cuda_version: Option<String>,
    /// GPUs.
    pub gpus: Vec<GpuRow>,
    /// GPU-to-GPU matrix cells (NIC columns are not compared: nvidia-smi names NICs by
    /// its own legend, which discovery does not share).
    pub matrix: Vec<CellRow>,
    /// Number of differences.
    pub differences: usize,
}

fn norm_uuid(s: &str) -> String {
    s.trim().trim_start_matches("uuid:").to_ascii_lowercase()
}

fn gpu_uuid(view: &View, idx: DeviceIdx) -> Option<String> {
    let d = view.fabric.device(idx);
    d.gpu.as_ref().and_then(|g| g.uuid.clone()).or_else(|| (d.id.scheme() == "uuid").then(|| d.id.to_string()))
}

fn mib(bytes: u64) -> u64 {
    bytes / (1 << 20)
}

/// Compares a parsed `nvidia-smi -q -x` log and `topo -m` matrix with the view's GPUs.
pub fn compare(view: &View, log: &SmiLog, matrix: &SmiMatrix) -> GpuCompare {
    let gpus: Vec<DeviceIdx> =
        view.fabric.devices_of(DeviceKind::Gpu).filter(|&i| view.in_scope(i)).collect::<Vec<_>>();
    let mut matched: Vec<Option<DeviceIdx>> = Vec::new();
    let mut rows = Vec::new();
    for (i, g) in log.gpus.iter().enumerate() {
        let smi_addr: Option<PciAddress> =
            g.pci_bus_id.as_deref().or(g.id.as_deref()).and_then(|s| s.trim().to_ascii_lowercase().parse().ok());
        let by_uuid = g.uuid.as_deref().and_then(|u| {
            gpus.iter().copied().find(|&d| gpu_uuid(view, d).is_some_and(|x| norm_uuid(&x) == norm_uuid(u)))
        });
        let found = by_uuid.or_else(|| {
            let a = smi_addr?;
            gpus.iter().copied().find(|&d| view.fabric.device(d).pci.as_ref().and_then(|p| p.address) == Some(a))
        });
        matched.push(found);
        let mut row = GpuRow {
            smi_index: Some(i),
            uuid: g.uuid.clone(),
            label: None,
            smi_bus_id: g.pci_bus_id.clone().or_else(|| g.id.clone()),
            bus_id: None,
            smi_memory_mib: g.fb_total_mib,
            memory_mib: None,
            problems: Vec::new(),
        };
        let Some(d) = found else {
            row.problems.push("not discovered".into());
            rows.push(row);
            continue;
        };
        if by_uuid.is_none() {
            row.problems.push(format!("UUID differs: discovery has {:?}", gpu_uuid(view, d)));
        }
        let dev = view.fabric.device(d);
        row.label = view.labels.label(d).map(str::to_owned);
        let addr = dev.pci.as_ref().and_then(|p| p.address);
        row.bus_id = addr.map(|a| a.to_string());
        match (smi_addr, addr) {
            (Some(s), Some(f)) if s != f => row.problems.push(format!("PCI address differs: {s} vs {f}")),
            (Some(_), None) => row.problems.push("PCI address not discovered".into()),
            _ => {}
        }
        let hbm = dev
            .memory
            .iter()
            .filter(|m| m.kind == fabric_topology::MemoryKind::Hbm)
            .fold(0u64, |a, m| a.saturating_add(m.size));
        row.memory_mib = (hbm > 0).then(|| mib(hbm));
        match (g.fb_total_mib, row.memory_mib) {
            (Some(s), Some(f)) => {
                let diff = (s as f64 - f as f64).abs() / (s.max(1) as f64);
                if diff > MEMORY_TOLERANCE {
                    row.problems.push(format!("memory differs: {s} MiB vs {f} MiB"));
                }
            }
            (Some(_), None) => row.problems.push("memory size not discovered".into()),
            _ => {}
        }
        rows.push(row);
    }
    for &d in &gpus {
        if !matched.contains(&Some(d)) {
            rows.push(GpuRow {
                smi_index: None,
                uuid: gpu_uuid(view, d),
                label: view.labels.label(d).map(str::to_owned),
                smi_bus_id: None,
                bus_id: view.fabric.device(d).pci.as_ref().and_then(|p| p.address).map(|a| a.to_string()),
                smi_memory_mib: None,
                memory_mib: None,
                problems: vec!["not listed by nvidia-smi".into()],
            });
        }
    }
    let mut cells = Vec::new();
    let smi_gpus: Vec<&String> = matrix.labels.iter().filter(|l| l.starts_with("GPU")).collect();
    for a in &smi_gpus {
        for b in &smi_gpus {
            let Some(smi) = matrix.get(a, b) else { continue };
            let dev = |l: &str| l.strip_prefix("GPU")?.parse::<usize>().ok().and_then(|i| *matched.get(i)?);
            let fabric = match (dev(a), dev(b)) {
                (Some(x), Some(y)) => Some(view.fabric.classify(x, y).to_string()),
                _ => None,
            };
            let ok = fabric.as_deref() == Some(smi);
            cells.push(CellRow { a: (*a).clone(), b: (*b).clone(), smi: smi.to_owned(), fabric, ok });
        }
    }
    let differences = rows.iter().map(|r| r.problems.len()).sum::<usize>() + cells.iter().filter(|c| !c.ok).count();
    GpuCompare {
        schema: "fabric.gpu-compare/v1",
        driver_version: log.driver_version.clone(),
        cuda_version: log.cuda_version.clone(),
        gpus: rows,
        matrix: cells,
        differences,
    }
}

/// Reads both nvidia-smi outputs and compares them with `view`.
pub fn compare_files(view: &View, xml: &Path, topo: &Path) -> Result<GpuCompare, GpuCompareError> {
    let read = |p: &Path| {
        std::fs::read_to_string(p).map_err(|source| GpuCompareError::Read { path: p.display().to_string(), source })
    };
    let log = nvsmi::parse_query_xml(&read(xml)?)?;
    let matrix = nvsmi::parse_topo_matrix(&read(topo)?)?;
    Ok(compare(view, &log, &matrix))
}

/// Writes the comparison as a table.
pub fn render_table(c: &GpuCompare, out: &mut dyn Write) -> io::Result<()> {
    let opt = |s: &Option<String>| s.clone().unwrap_or_else(|| "-".into());
    let num = |n: Option<u64>| n.map_or_else(|| "-".into(), |n| n.to_string());
    writeln!(out, "nvidia-smi: driver {} CUDA {}", opt(&c.driver_version), opt(&c.cuda_version))?;
    writeln!(
        out,
        "{:<5} {:<6} {:<42} {:<18} {:<14} {:>10} {:>10}  RESULT",
        "SMI", "LABEL", "UUID", "SMI BUS ID", "BUS ID", "SMI MiB", "MiB"
    )?;
    for r in &c.gpus {
        let result = if r.problems.is_empty() { "ok".to_owned() } else { r.problems.join("; ") };
        writeln!(
            out,
            "{:<5} {:<6} {:<42} {:<18} {:<14} {:>10} {:>10}  {result}",
            r.smi_index.map_or_else(|| "-".into(), |i| i.to_string()),
            opt(&r.label),
            opt(&r.uuid),
            opt(&r.smi_bus_id),
            opt(&r.bus_id),
            num(r.smi_memory_mib),
            num(r.memory_mib),
        )?;
    }
    let bad: Vec<&CellRow> = c.matrix.iter().filter(|m| !m.ok).collect();
    writeln!(out, "matrix: {} GPU-to-GPU cells, {} differ", c.matrix.len(), bad.len())?;
    for m in bad {
        writeln!(out, "  {} -> {}: nvidia-smi {} discovery {}", m.a, m.b, m.smi, opt(&m.fabric))?;
    }
    writeln!(out, "{} difference(s)", c.differences)
}

/// Writes the comparison as JSON.
pub fn render_json(c: &GpuCompare, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, c).map_err(io::Error::other)?;
    writeln!(out)
}
