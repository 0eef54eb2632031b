//! Fuzzes the CXL and UALink attribute parsers: the input is split into `name=value` lines
//! and fed to the per-object parsers as a sysfs directory's attributes would be.
#![no_main]

use fabric_drivers::cxl::parse;
use fabric_drivers::ualink;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    let _ = parse::parse_target_list(s);
    let _ = parse::parse_mode(s);
    let _ = parse::parse_granularity(s);
    let _ = parse::parse_ways(s);
    let _ = parse::parse_hex_addr(s);
    let _ = parse::parse_size(s);
    let _ = parse::parse_uuid(s);
    let _ = parse::parse_decoder_name(s);
    let _ = ualink::parse_rate_gts(s);
    let _ = ualink::parse_port_state(s);
    let attrs: parse::RawAttrs =
        s.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
    let _ = parse::parse_decoder(&attrs);
    let _ = parse::parse_region(&attrs);
    let _ = parse::parse_dc_partitions(&attrs);
    let _ = ualink::parse_ualink_port(0, &attrs);
    let _ = ualink::parse_ualink_device(&attrs);
});
