//! Hop classes: the `nvidia-smi topo -m` vocabulary (X, NV#, PIX, PXB, PHB, NODE, SYS)
//! extended with classes for xGMI, UALink, chip-to-chip, CXL and the network.

use std::fmt;

use serde::{Serialize, Serializer};

/// How two devices reach each other, from closest to farthest. The order of variants is
/// the order of preference (`Ord`: smaller is closer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HopClass {
    /// The device itself.
    X,
    /// NVLink: the number of links between the two (directly, or through NVSwitches the
    /// lesser of the two devices' switch-facing link counts).
    Nv(u16),
    /// AMD xGMI: the number of direct links; 0 when the kernel does not say how many
    /// (partitioned modes report xGMI peers without bandwidth), shown as `XGMI`.
    Xgmi(u16),
    /// UALink through UALink switches (or directly): the lesser port count.
    Ual(u16),
    /// Chip-to-chip coherent link (NVLink-C2C).
    C2c,
    /// Connection traversing at most a single PCIe switch (or bridge).
    Pix,
    /// Connection traversing multiple PCIe switches/bridges, but not a host bridge.
    Pxb,
    /// Connection traversing a PCIe host bridge (typically the CPU).
    Phb,
    /// Connection traversing PCIe and the interconnect between host bridges in one NUMA node.
    Node,
    /// Connection traversing PCIe and the SMP interconnect between NUMA nodes.
    Sys,
    /// Connection that reaches memory over CXL.mem links.
    Cxl,
    /// Connection that crosses the network between nodes.
    Net,
    /// No usable path (links down or nothing connects them).
    None,
}

impl HopClass {
    /// The legend lines, in the order they are printed under a matrix.
    pub const LEGEND: &'static [(&'static str, &'static str)] = &[
        ("X", "Self"),
        ("NV#", "Connection traversing a bonded set of # NVLinks (directly or through NVSwitches)"),
        ("XGMI#", "Connection traversing a bonded set of # xGMI links"),
        ("UAL#", "Connection traversing # UALink ports (through UALink switches)"),
        ("C2C", "Connection traversing a chip-to-chip coherent link"),
        ("PIX", "Connection traversing at most a single PCIe bridge"),
        ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
        ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
        ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
        ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"),
        ("CXL", "Connection reaching memory over CXL.mem links (host bridge, CXL switch, type-3 device)"),
        ("NET", "Connection traversing the network between nodes"),
        ("-", "No usable path (links down or not connected)"),
    ];

    /// Whether the class is a scale-up (direct load/store capable) connection.
    pub fn is_scale_up(&self) -> bool {
        matches!(self, HopClass::Nv(_) | HopClass::Xgmi(_) | HopClass::Ual(_) | HopClass::C2c)
    }
}

impl fmt::Display for HopClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HopClass::X => f.write_str("X"),
            HopClass::Nv(n) => write!(f, "NV{n}"),
            HopClass::Xgmi(0) => f.write_str("XGMI"),
            HopClass::Xgmi(n) => write!(f, "XGMI{n}"),
            HopClass::Ual(n) => write!(f, "UAL{n}"),
            HopClass::C2c => f.write_str("C2C"),
            HopClass::Pix => f.write_str("PIX"),
            HopClass::Pxb => f.write_str("PXB"),
            HopClass::Phb => f.write_str("PHB"),
            HopClass::Node => f.write_str("NODE"),
            HopClass::Sys => f.write_str("SYS"),
            HopClass::Cxl => f.write_str("CXL"),
            HopClass::Net => f.write_str("NET"),
            HopClass::None => f.write_str("-"),
        }
    }
}

impl Serialize for HopClass {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}
