//! Fuzzes the `/sys/class/infiniband` attribute parsers: every line of the input goes
//! through each of them; what parses must print back to the same value.
#![no_main]

use fabric_drivers::rdma::attrs;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    for line in s.lines().take(256) {
        let _ = attrs::port_state(line);
        let _ = attrs::phys_state(line);
        let _ = attrs::node_type(line);
        let _ = attrs::link_layer(line);
        let _ = attrs::gid_type(line);
        if let Some(m) = attrs::rate_mbps(line) {
            // At most seven integer digits of Gb/s.
            assert!(m < 10_000_000_000);
        }
        if let Some(l) = attrs::lid(line) {
            assert!(l <= 0xffff);
        }
        if let Some((v, text)) = attrs::guid(line) {
            assert_eq!(attrs::guid(&text), Some((v, text.clone())));
            let n = attrs::nccl_guid(v);
            assert_eq!(u64::from_str_radix(&n[2..], 16).map(u64::swap_bytes), Ok(v));
        }
        if let Some((v, text)) = attrs::gid(line) {
            assert_eq!(attrs::gid(&text), Some((v, text.clone())));
            assert_eq!(attrs::guid(&attrs::gid_interface_id(v)).map(|g| g.0), Some(v as u64));
        }
        if let Some(n) = attrs::name(line) {
            assert!(!n.contains('/') && n != "." && n != "..");
        }
    }
});
