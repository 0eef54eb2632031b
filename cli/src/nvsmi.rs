//! Parsers for `nvidia-smi` output, the reference discovery is checked against on a GPU
//! machine: `nvidia-smi -q -x` (the XML log, `nvsmi_device_v12.dtd`) and
//! `nvidia-smi topo -m` (the connection matrix). Both inputs are untrusted text: anything
//! unexpected is an error or an unknown field, never a panic.

use quick_xml::Reader;
use quick_xml::events::Event;

/// Why an `nvidia-smi` output could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NvsmiError {
    /// The XML is malformed.
    #[error("nvidia-smi -q -x: malformed XML at byte {position}: {message}")]
    Xml {
        /// Byte offset.
        position: u64,
        /// The parser's message.
        message: String,
    },
    /// The XML is not an `nvidia_smi_log`.
    #[error("nvidia-smi -q -x: no <nvidia_smi_log> element")]
    NotALog,
    /// `topo -m` has no header row of device columns.
    #[error("nvidia-smi topo -m: no header row with GPU columns")]
    NoMatrixHeader,
    /// A matrix row has fewer cells than device columns.
    #[error("nvidia-smi topo -m: row {row:?} has {got} cells, expected {expected}")]
    ShortRow {
        /// Row label.
        row: String,
        /// Cells found.
        got: usize,
        /// Device columns.
        expected: usize,
    },
}

/// One `<gpu>` of `nvidia-smi -q -x`, in nvidia-smi's order (its GPU index).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SmiGpu {
    /// The `id` attribute (the PCI bus id, `00000000:18:00.0`).
    pub id: Option<String>,
    /// `<product_name>`.
    pub product_name: Option<String>,
    /// `<uuid>`.
    pub uuid: Option<String>,
    /// `<pci><pci_bus_id>`.
    pub pci_bus_id: Option<String>,
    /// `<fb_memory_usage><total>` in MiB.
    pub fb_total_mib: Option<u64>,
    /// `<fabric><state>` (drivers that report the GPU fabric).
    pub fabric_state: Option<String>,
}

/// What `nvidia-smi -q -x` says about the machine.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SmiLog {
    /// `<driver_version>`.
    pub driver_version: Option<String>,
    /// `<cuda_version>`.
    pub cuda_version: Option<String>,
    /// GPUs in nvidia-smi index order.
    pub gpus: Vec<SmiGpu>,
}

/// Parses "81559 MiB" (also "N/A", which is unknown).
fn parse_mib(s: &str) -> Option<u64> {
    let mut it = s.split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("MiB") | None => Some(n),
        Some("GiB") => n.checked_mul(1024),
        Some("KiB") => Some(n / 1024),
        _ => None,
    }
}

/// Parses the XML log of `nvidia-smi -q -x`.
pub fn parse_query_xml(xml: &str) -> Result<SmiLog, NvsmiError> {
    let mut reader = Reader::from_str(xml);
    let mut path: Vec<String> = Vec::new();
    let mut log = SmiLog::default();
    let mut seen_root = false;
    loop {
        let ev = reader
            .read_event()
            .map_err(|e| NvsmiError::Xml { position: reader.error_position(), message: e.to_string() })?;
        match ev {
            Event::Start(e) => {
                let name = e.name().as_ref().to_owned();
                if path.is_empty() && name == "nvidia_smi_log" {
                    seen_root = true;
                }
                if path.len() == 1 && seen_root && name == "gpu" {
                    let id = e.attributes().flatten().find(|a| a.key.as_ref() == "id").map(|a| a.value.to_string());
                    log.gpus.push(SmiGpu { id, ..SmiGpu::default() });
                }
                path.push(name);
                if path.len() > 64 {
                    return Err(NvsmiError::Xml {
                        position: reader.buffer_position(),
                        message: "nesting too deep".into(),
                    });
                }
            }
            Event::End(_) => {
                path.pop();
            }
            Event::Text(t) => {
                // Entities (`&amp;`) arrive as separate events and are dropped: the fields
                // compared (UUIDs, bus ids, sizes) never contain them.
                let text = t.xml10_content().trim().to_owned();
                if text.is_empty() || !seen_root {
                    continue;
                }
                let p: Vec<&str> = path.iter().map(String::as_str).collect();
                match p.as_slice() {
                    ["nvidia_smi_log", "driver_version"] => log.driver_version = Some(text),
                    ["nvidia_smi_log", "cuda_version"] => log.cuda_version = Some(text),
                    ["nvidia_smi_log", "gpu", rest @ ..] => {
                        let Some(g) = log.gpus.last_mut() else { continue };
                        match rest {
                            ["product_name"] => g.product_name = Some(text),
                            ["uuid"] => g.uuid = Some(text),
                            ["pci", "pci_bus_id"] => g.pci_bus_id = Some(text),
                            ["fb_memory_usage", "total"] => g.fb_total_mib = parse_mib(&text),
                            ["fabric", "state"] => g.fabric_state = Some(text),
                            _ => {}
                        }
                    }
                    _ => {}
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    if !seen_root {
        return Err(NvsmiError::NotALog);
    }
    Ok(log)
}

/// The device-to-device part of `nvidia-smi topo -m`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SmiMatrix {
    /// Device column labels in order (`GPU0`, …, `NIC0`, …).
    pub labels: Vec<String>,
    /// `cells[i][j]`: the class from row `labels[i]` to column `labels[j]` (`X`, `NV18`, `PIX`…).
    pub cells: Vec<Vec<String>>,
}

impl SmiMatrix {
    /// The class between two labelled devices.
    pub fn get(&self, a: &str, b: &str) -> Option<&str> {
        let i = self.labels.iter().position(|l| l == a)?;
        let j = self.labels.iter().position(|l| l == b)?;
        self.cells.get(i)?.get(j).map(String::as_str)
    }
}

/// Removes ANSI escape sequences (nvidia-smi underlines the header row).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// Whether a header word names a device column (`GPU0`, `NIC3`, `mlx5_0` in old drivers).
fn is_device_column(w: &str) -> bool {
    let digits = |p: &str| w.strip_prefix(p).is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    digits("GPU") || digits("NIC") || w.starts_with("mlx")
}

/// Parses `nvidia-smi topo -m`: the header row of device columns and one row per device.
/// Columns after the devices (CPU/NUMA affinity, GPU NUMA ID) and the legend are ignored.
pub fn parse_topo_matrix(text: &str) -> Result<SmiMatrix, NvsmiError> {
    let mut lines = text.lines().map(strip_ansi);
    let labels: Vec<String> = loop {
        let Some(line) = lines.next() else { return Err(NvsmiError::NoMatrixHeader) };
        let words: Vec<&str> = line.split_whitespace().collect();
        let devices: Vec<String> = words.iter().take_while(|w| is_device_column(w)).map(|w| (*w).to_owned()).collect();
        if !devices.is_empty() && devices.iter().any(|d| d.starts_with("GPU")) {
            break devices;
        }
    };
    let mut m = SmiMatrix { labels: labels.clone(), cells: vec![Vec::new(); labels.len()] };
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&first, rest)) = words.split_first() else {
            // The blank line before the legend ends the matrix.
            if m.cells.iter().any(|r| !r.is_empty()) {
                break;
            }
            continue;
        };
        let Some(i) = labels.iter().position(|l| l == first) else {
            if first.starts_with("Legend") {
                break;
            }
            continue;
        };
        if rest.len() < labels.len() {
            return Err(NvsmiError::ShortRow { row: first.to_owned(), got: rest.len(), expected: labels.len() });
        }
        m.cells[i] = rest[..labels.len()].iter().map(|c| (*c).to_owned()).collect();
    }
    // Devices without a row (a truncated output) keep an empty row; `get` answers None.
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Outputs captured on an H200 machine by `scripts/gpu-check.sh` (2026-11-29).
    #[test]
    fn captured_h200_outputs_parse() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nvidia-smi");
        let xml = std::fs::read_to_string(format!("{dir}/h200-1gpu.query.xml")).unwrap();
        let log = parse_query_xml(&xml).unwrap();
        assert_eq!(log.driver_version.as_deref(), Some("580.159.04"));
        assert_eq!(log.cuda_version.as_deref(), Some("13.0"));
        assert_eq!(log.gpus.len(), 1);
        let g = &log.gpus[0];
        assert_eq!(g.product_name.as_deref(), Some("NVIDIA H200"));
        assert_eq!(g.uuid.as_deref(), Some("GPU-74ea8f39-337d-2bff-f79c-f2f5ed86e4ee"));
        assert_eq!(g.pci_bus_id.as_deref(), Some("00000000:00:06.0"));
        assert_eq!(g.fb_total_mib, Some(143_771));
        let topo = std::fs::read_to_string(format!("{dir}/h200-1gpu.topo.txt")).unwrap();
        let m = parse_topo_matrix(&topo).unwrap();
        // One GPU: "X" to itself; the affinity and "GPU NUMA ID" columns are not devices.
        assert_eq!(m.labels, ["GPU0"]);
        assert_eq!(m.get("GPU0", "GPU0"), Some("X"));
    }

    #[test]
    fn memory_sizes_parse() {
        assert_eq!(parse_mib("81559 MiB"), Some(81559));
        assert_eq!(parse_mib("N/A"), None);
        assert_eq!(parse_mib("2 GiB"), Some(2048));
        assert_eq!(parse_mib("12 parsecs"), None);
    }

    #[test]
    fn the_header_underline_is_stripped() {
        assert_eq!(strip_ansi("\x1b[4mGPU0\tGPU1\x1b[0m"), "GPU0\tGPU1");
        assert_eq!(strip_ansi("plain"), "plain");
        assert_eq!(strip_ansi("\x1b"), "");
    }

    #[test]
    fn device_columns_are_recognised() {
        assert!(is_device_column("GPU0") && is_device_column("NIC12") && is_device_column("mlx5_0"));
        assert!(!is_device_column("GPU") && !is_device_column("CPU") && !is_device_column("GPUx"));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(parse_query_xml("<other/>"), Err(NvsmiError::NotALog));
        assert!(matches!(parse_query_xml("<nvidia_smi_log><gpu></nvidia_smi_log>"), Err(NvsmiError::Xml { .. })));
        assert_eq!(parse_topo_matrix("no matrix here\n"), Err(NvsmiError::NoMatrixHeader));
        assert!(matches!(parse_topo_matrix("\tGPU0\tGPU1\nGPU0\t X \n"), Err(NvsmiError::ShortRow { .. })));
    }
}
