//! Property tests for the PCI attribute parsers: arbitrary text never panics, and values the
//! kernel would print parse back to what was printed.
#![allow(clippy::unwrap_used)]

use fabric_drivers::pci;
use proptest::prelude::*;

proptest! {
    #[test]
    fn arbitrary_text_never_panics(s in "\\PC{0,200}") {
        let _ = pci::parse_resource(&s);
        let _ = pci::parse_link_speed(&s);
        let _ = pci::parse_link_width(&s);
        let _ = pci::parse_class(&s);
        let _ = pci::parse_id16(&s);
        let _ = pci::parse_cpulist(&s);
        let _ = pci::parse_cpumask(&s);
        let _ = pci::parse_meminfo_total(&s);
        let _ = pci::parse_distance(&s);
        let _ = pci::parse_device_path(&s);
        let _ = pci::parse_host_bridge_name(&s);
        let _ = pci::parse_node_name(&s);
    }

    #[test]
    fn resource_lines_round_trip(entries in proptest::collection::vec((any::<u32>(), 0u64..1 << 40, any::<u32>()), 0..17)) {
        let text: String = entries
            .iter()
            .map(|&(start, len, flags)| {
                let start = u64::from(start) << 12;
                format!("0x{start:016x} 0x{:016x} 0x{flags:016x}\n", start + len)
            })
            .collect();
        let bars = pci::parse_resource(&text).unwrap();
        let want: Vec<(u8, u64, u64)> = entries
            .iter()
            .enumerate()
            // Unassigned (all zero) and unset or disabled (IORESOURCE_UNSET/_DISABLED) skipped.
            .filter(|&(_, &(start, len, flags))| !(start == 0 && len == 0) && flags & 0x3000_0000 == 0)
            .map(|(i, &(start, len, _))| (i as u8, u64::from(start) << 12, len + 1))
            .collect();
        let got: Vec<(u8, u64, u64)> = bars.iter().map(|b| (b.index, b.start, b.size)).collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn kernel_link_speeds_parse(tenths in 1u32..1000, suffix in prop_oneof![Just(""), Just(" PCIe")]) {
        let v = f64::from(tenths) / 10.0;
        let s = format!("{v:.1} GT/s{suffix}");
        prop_assert_eq!(pci::parse_link_speed(&s).unwrap(), Some(v));
    }
}
