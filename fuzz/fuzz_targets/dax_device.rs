//! Fuzzes what a DAX device's sysfs is parsed with for per-region DAX
//! (fabricd/src/memory/carve.rs): the device name, its `size` and its `mappingN/start`, `end`
//! as lines of text give a device or a refusal, never a panic; a device's ranges are non-empty
//! and add up to its size, and a name that parses prints back to itself.
#![no_main]

use fabricd::memory::carve::{dax_ids, parse_device};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut lines = text.lines();
    let name = lines.next().unwrap_or("");
    if let Some((n, m)) = dax_ids(name) {
        assert_eq!(dax_ids(&format!("dax{n}.{m}")), Some((n, m)));
    }
    let size = lines.next().unwrap_or("");
    let rest: Vec<&str> = lines.collect();
    let pairs: Vec<(&str, &str)> = rest.chunks(2).map(|c| (c[0], c.get(1).copied().unwrap_or(""))).collect();
    if let Ok(d) = parse_device(name, size, &pairs, None) {
        assert_eq!(d.ranges.len(), pairs.len());
        assert!(d.ranges.iter().all(|&(_, len)| len > 0));
        assert_eq!(d.ranges.iter().map(|r| r.1).sum::<u64>(), d.size);
    }
});
