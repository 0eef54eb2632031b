//! Fuzzes every parser of sysfs attribute text used by PCI/NUMA discovery and the NVML bus
//! id parser: arbitrary input must give a value or a typed error, never a panic.
#![no_main]

use fabric_drivers::pci::{self, attrs};
use fabric_drivers::{nvidia, sysfs};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };
    if let Ok(bars) = attrs::parse_resource(s) {
        for b in bars {
            assert!(b.size > 0, "empty BARs are skipped");
        }
    }
    let _ = attrs::parse_link_speed(s);
    let _ = attrs::parse_link_width(s);
    let _ = attrs::parse_id16(s);
    let _ = attrs::parse_class(s);
    let _ = attrs::parse_iommu_group(s);
    let _ = attrs::parse_cpulist(s);
    let _ = attrs::parse_cpumask(s);
    let _ = attrs::parse_meminfo_total(s);
    let _ = attrs::parse_distance(s);
    if let Ok(c) = pci::health::parse_aer_counters(s) {
        assert!(c.len() <= pci::health::MAX_AER_LINES);
        let _ = pci::health::aer_fatal(&c);
    }
    let _ = pci::health::config_dead(data);
    let _ = pci::parse_node_name(s);
    let _ = pci::parse_host_bridge_name(s);
    let _ = pci::parse_device_path(s);
    let _ = sysfs::parse_hex_u64(s);
    let _ = sysfs::parse_dec_u64(s);
    let _ = sysfs::parse_numa_node(s);
    if let Some(a) = nvidia::snapshot::parse_bus_id(s) {
        assert!(a.device < 32 && a.function < 8);
    }
});
