//! Fuzzes the heterogeneous-memory parsers: node lists (memory tiers, HMAT), directory
//! names (`memory_tierN`, `accessC`, `indexK`, `daxX.Y`) and a DAX device's origin from its
//! device path. Each must be total; a parsed node list is sorted, distinct and bounded, and
//! prints back to a list that parses to itself.
#![no_main]

use fabric_drivers::hmem::parse::{self, MAX_NODE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(nodes) = parse::parse_nodelist(s) {
        assert!(nodes.windows(2).all(|w| w[0] < w[1]));
        assert!(nodes.iter().all(|&n| n <= MAX_NODE));
        let text: Vec<String> = nodes.iter().map(u32::to_string).collect();
        assert_eq!(parse::parse_nodelist(&text.join(",")).as_ref(), Ok(&nodes));
    }
    for prefix in ["memory_tier", "access", "index", "memory", "ndbus"] {
        if let Some(v) = parse::parse_indexed_name(s, prefix, 1 << 20) {
            assert!(v <= 1 << 20);
            assert_eq!(parse::parse_indexed_name(&format!("{prefix}{v}"), prefix, 1 << 20), Some(v));
        }
    }
    let _ = parse::parse_dax_name(s);
    let (origin, region) = parse::dax_origin_from_path(s);
    assert_eq!(region.is_some(), origin.name() == "cxl");
});
