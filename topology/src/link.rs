//! Typed links between devices, with bandwidth, latency and state.
//!
//! Bandwidth is per direction in MB/s (10^6 bytes per second), integer so that outputs are
//! deterministic. `max` is what the link is built for; `current` is what it runs at now, so a
//! PCIe link trained at a lower speed or width, or an NVLink bundle with lanes down, shows
//! the fraction of bandwidth left.

use serde::{Deserialize, Serialize};

use crate::inventory::DeviceIdx;

/// Per-direction bandwidth of a link in MB/s. `None` means unknown (an attribute that the
/// source did not expose); it is never invented.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bandwidth {
    /// What the link runs at now.
    pub current_mbps: Option<u64>,
    /// What the link is capable of.
    pub max_mbps: Option<u64>,
}

impl Bandwidth {
    /// A link running at its full capability.
    pub fn full(mbps: u64) -> Self {
        Self { current_mbps: Some(mbps), max_mbps: Some(mbps) }
    }

    /// The fraction of capability left, when both figures are known.
    pub fn fraction(&self) -> Option<f64> {
        match (self.current_mbps, self.max_mbps) {
            (Some(c), Some(m)) if m > 0 => Some(c as f64 / m as f64),
            _ => None,
        }
    }

    /// True when the link runs below its capability.
    pub fn is_degraded(&self) -> bool {
        matches!((self.current_mbps, self.max_mbps), (Some(c), Some(m)) if c < m)
    }
}

/// Operational state of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkState {
    /// Up at full capability (or capability unknown).
    Up,
    /// Up, but below its capability.
    Degraded,
    /// Down: carries no traffic, never used by path queries.
    Down,
}

/// The kind of a link, with its kind-specific shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum LinkKind {
    /// PCI Express from an upstream port (`a`) to a downstream device (`b`).
    Pcie {
        /// Current generation (1..=6), when known.
        gen_current: Option<u8>,
        /// Current width in lanes, when known.
        width_current: Option<u8>,
        /// Maximum generation, when known.
        gen_max: Option<u8>,
        /// Maximum width, when known.
        width_max: Option<u8>,
    },
    /// A host bridge attached to the CPU package / NUMA node it hangs off (`a` = CPU).
    HostAttach,
    /// The SMP interconnect between CPU packages / NUMA nodes (QPI/UPI/Infinity Fabric).
    Smp,
    /// NVLink between a GPU and a GPU or NVSwitch: `count` links bundled.
    NvLink {
        /// NVLink generation (3 = A100, 4 = H100/H200, 5 = B200).
        generation: u8,
        /// Number of links in the bundle that are up.
        count: u16,
    },
    /// AMD xGMI / Infinity Fabric links between GPUs.
    Xgmi {
        /// Number of links bundled.
        count: u16,
    },
    /// CXL (`a` upstream: host bridge, root port or switch; `b` downstream).
    Cxl {
        /// Lanes, when known.
        width: Option<u8>,
    },
    /// UALink between an accelerator and a UALink switch (or two accelerators).
    Ualink {
        /// Number of ports (stations) bundled.
        ports: u16,
        /// Lanes per port.
        lanes: u8,
        /// Signalling rate per lane in GT/s.
        gts: u16,
    },
    /// Chip-to-chip coherent link (NVLink-C2C between Grace and Hopper).
    C2c,
    /// A network link (InfiniBand/Ethernet) between a NIC and a switch, or switch to switch.
    Network {
        /// Port speed in Gb/s.
        gbps: u32,
    },
}

impl LinkKind {
    /// Short lower-case name for tables and DOT labels.
    pub fn name(&self) -> &'static str {
        match self {
            LinkKind::Pcie { .. } => "pcie",
            LinkKind::HostAttach => "host",
            LinkKind::Smp => "smp",
            LinkKind::NvLink { .. } => "nvlink",
            LinkKind::Xgmi { .. } => "xgmi",
            LinkKind::Cxl { .. } => "cxl",
            LinkKind::Ualink { .. } => "ualink",
            LinkKind::C2c => "c2c",
            LinkKind::Network { .. } => "network",
        }
    }

    /// Whether this is a scale-up (memory-semantic, GPU-to-GPU) link.
    pub fn is_scale_up(&self) -> bool {
        matches!(self, LinkKind::NvLink { .. } | LinkKind::Xgmi { .. } | LinkKind::Ualink { .. } | LinkKind::C2c)
    }

    /// Whether `a` is the upstream end (PCIe/CXL trees and host attachment).
    pub fn is_hierarchical(&self) -> bool {
        matches!(self, LinkKind::Pcie { .. } | LinkKind::Cxl { .. } | LinkKind::HostAttach)
    }
}

/// Per-direction PCIe bandwidth in MB/s for a generation and lane count, after line coding
/// (8b/10b for gen 1-2, 128b/130b for gen 3-5, FLIT 242/256 for gen 6).
pub fn pcie_mbps(generation: u8, width: u8) -> Option<u64> {
    // Per-lane raw rate in MT/s, coded payload numerator/denominator.
    let (mts, num, den): (u64, u64, u64) = match generation {
        1 => (2_500, 8, 10),
        2 => (5_000, 8, 10),
        3 => (8_000, 128, 130),
        4 => (16_000, 128, 130),
        5 => (32_000, 128, 130),
        6 => (64_000, 242, 256),
        _ => return None,
    };
    if width == 0 || width > 32 {
        return None;
    }
    Some(mts * num * u64::from(width) / (den * 8))
}

/// Maps a sysfs `current_link_speed` in GT/s to a PCIe generation.
pub fn pcie_gen_from_gts(gts: f64) -> Option<u8> {
    const TABLE: [(f64, u8); 6] = [(2.5, 1), (5.0, 2), (8.0, 3), (16.0, 4), (32.0, 5), (64.0, 6)];
    TABLE.iter().find(|(g, _)| (gts - g).abs() < 0.01).map(|&(_, n)| n)
}

/// Per-direction bandwidth of one NVLink of a generation, in MB/s.
pub fn nvlink_mbps_per_link(generation: u8) -> Option<u64> {
    match generation {
        1 => Some(20_000),
        2..=4 => Some(25_000),
        5 => Some(50_000),
        _ => None,
    }
}

/// A typed edge of the fabric graph. For hierarchical kinds `a` is the upstream end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// One end (upstream for hierarchical kinds).
    pub a: DeviceIdx,
    /// The other end.
    pub b: DeviceIdx,
    /// Kind and kind-specific shape.
    pub kind: LinkKind,
    /// Per-direction bandwidth.
    pub bandwidth: Bandwidth,
    /// One-way latency in nanoseconds, when known.
    pub latency_ns: Option<u32>,
    /// Up, degraded or down.
    pub state: LinkState,
}

impl Link {
    /// A link that is up, with its state derived from the bandwidth figures.
    pub fn new(a: DeviceIdx, b: DeviceIdx, kind: LinkKind, bandwidth: Bandwidth, latency_ns: Option<u32>) -> Self {
        let state = if bandwidth.is_degraded() { LinkState::Degraded } else { LinkState::Up };
        Self { a, b, kind, bandwidth, latency_ns, state }
    }

    /// A PCIe link from its current and maximum speed and width.
    pub fn pcie(a: DeviceIdx, b: DeviceIdx, cur: (Option<u8>, Option<u8>), max: (Option<u8>, Option<u8>)) -> Self {
        let bw = |(g, w): (Option<u8>, Option<u8>)| g.zip(w).and_then(|(g, w)| pcie_mbps(g, w));
        let kind = LinkKind::Pcie { gen_current: cur.0, width_current: cur.1, gen_max: max.0, width_max: max.1 };
        Self::new(a, b, kind, Bandwidth { current_mbps: bw(cur), max_mbps: bw(max) }, None)
    }

    /// The end that is not `x` (or `a` if `x` is neither).
    pub fn other(&self, x: DeviceIdx) -> DeviceIdx {
        if self.a == x { self.b } else { self.a }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pcie_bandwidth_matches_the_spec_tables() {
        // Gen5 x16: 32 GT/s * 16 * 128/130 / 8 = 63.015 GB/s per direction.
        assert_eq!(pcie_mbps(5, 16), Some(63_015));
        assert_eq!(pcie_mbps(3, 16), Some(15_753));
        assert_eq!(pcie_mbps(1, 1), Some(250));
        assert_eq!(pcie_mbps(7, 16), None);
        assert_eq!(pcie_mbps(4, 0), None);
        assert_eq!(pcie_gen_from_gts(16.0), Some(4));
        assert_eq!(pcie_gen_from_gts(3.3), None);
    }

    #[test]
    fn degraded_links_report_their_fraction() {
        let a = DeviceIdx(0);
        let b = DeviceIdx(1);
        let l = Link::pcie(a, b, (Some(4), Some(8)), (Some(4), Some(16)));
        assert_eq!(l.state, LinkState::Degraded);
        assert!((l.bandwidth.fraction().unwrap() - 0.5).abs() < 1e-3);
        let l = Link::pcie(a, b, (Some(4), None), (Some(4), Some(16)));
        assert_eq!(l.state, LinkState::Up, "unknown current width is not degradation");
        assert_eq!(l.bandwidth.current_mbps, None);
    }
}
