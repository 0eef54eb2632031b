//! Fuzzes the sim fabric parser: any text gives an inventory or an error with a location,
//! never a panic; a parsed inventory always builds into a fabric.
#![no_main]

use fabric_topology::Fabric;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    match fabric_drivers::sim::parse(s, "fuzz.toml") {
        Ok(inv) => {
            Fabric::build(inv).expect("a parsed sim inventory has no dangling links");
        }
        Err(e) => assert!(e.to_string().starts_with("fuzz.toml"), "error names the file: {e}"),
    }
});
