//! Fuzzes the nvidia-smi parsers of `fabricctl gpu-compare` (`nvidia-smi -q -x` XML and
//! `topo -m` text): any input gives a result or a typed error, never a panic; a parsed
//! matrix has a full row or none for each device column.
#![no_main]

use fabric_cli::nvsmi::{parse_query_xml, parse_topo_matrix};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(log) = parse_query_xml(s) {
        for g in &log.gpus {
            assert!(g.fb_total_mib.is_none_or(|m| m < u64::MAX / 1024 + 1));
        }
    }
    if let Ok(m) = parse_topo_matrix(s) {
        assert_eq!(m.cells.len(), m.labels.len());
        for row in &m.cells {
            assert!(row.is_empty() || row.len() == m.labels.len());
        }
        if let Some(first) = m.labels.first() {
            let _ = m.get(first, first);
        }
    }
});
