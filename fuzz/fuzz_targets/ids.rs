//! Fuzzes the parsers of identities and CPU lists: PCI addresses, device ids, cpulists and
//! cpumasks. Whatever parses must print back to something that parses to the same value.
#![no_main]

use fabric_topology::{CpuSet, DeviceId, PciAddress};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(a) = s.parse::<PciAddress>() {
        assert_eq!(a.to_string().parse::<PciAddress>().ok(), Some(a));
    }
    if let Ok(id) = s.parse::<DeviceId>() {
        assert_eq!(id.to_string().parse::<DeviceId>().ok(), Some(id));
    }
    if let Ok(c) = s.parse::<CpuSet>() {
        assert_eq!(c.to_string().parse::<CpuSet>().ok(), Some(c));
    }
    let _ = CpuSet::from_mask(s);
});
