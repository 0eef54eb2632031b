//! Fuzzes what a NUMA node's sysfs files are parsed with when fabricd serves the node
//! (fabricd/src/memory/numa.rs): memory block names, `block_size_bytes` and `meminfo`
//! fields give a value or `None`, never a panic, and what parses is consistent (a block size
//! is a power of two; a meminfo field is a whole number of KiB).
#![no_main]

use fabricd::memory::numa::{parse_block_name, parse_block_size, parse_meminfo_field};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Some(m) = parse_block_name(text) {
        assert_eq!(parse_block_name(&format!("memory{m}")), Some(m));
    }
    if let Some(s) = parse_block_size(text) {
        assert!(s.is_power_of_two());
    }
    for field in ["MemTotal", "MemFree"] {
        if let Some(b) = parse_meminfo_field(text, field) {
            assert_eq!(b % 1024, 0);
        }
    }
});
