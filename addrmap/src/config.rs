//! Map configuration: address width, base, node spans and alignments, per-node and
//! per-device overrides, and which memory kinds are mapped.
//!
//! The configuration only steers *new* placements: a range that is already placed never
//! moves because the configuration changed (stability beats tidiness).

use std::collections::BTreeMap;

use fabric_topology::{DeviceId, MemoryKind};
use serde::{Deserialize, Serialize};

/// 1 GiB.
pub const GIB: u64 = 1 << 30;
/// 1 TiB.
pub const TIB: u64 = 1 << 40;

/// Errors from validating a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The address width is outside 40..=64 bits.
    #[error("address_bits {0} is outside 40..=64")]
    AddressBits(u8),
    /// A size or alignment is not a power of two, or too small.
    #[error("{what} {value:#x} must be a power of two of at least {min:#x}")]
    NotPowerOfTwo {
        /// Which setting.
        what: String,
        /// Its value.
        value: u64,
        /// The smallest accepted value.
        min: u64,
    },
    /// A base address is not aligned or lies outside the address space.
    #[error("{what} {value:#x} is not {align:#x}-aligned or lies outside the {bits}-bit space")]
    BadBase {
        /// Which setting.
        what: String,
        /// Its value.
        value: u64,
        /// Required alignment.
        align: u64,
        /// Address width.
        bits: u8,
    },
}

/// How large a node's slot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum NodeSpan {
    /// The node's mapped memory (each resource rounded up to its alignment) rounded up to a
    /// power of two, and at least `min`.
    Auto {
        /// Smallest slot.
        min: u64,
    },
    /// Every node slot has this size (a power of two).
    Fixed(u64),
}

/// Overrides for one node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeOverride {
    /// Pinned start of the node's first slot (aligned to its span).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<u64>,
    /// Slot size for this node (a power of two).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span: Option<u64>,
}

/// Overrides for one device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceOverride {
    /// Alignment of the device's ranges (a power of two, at least 4 KiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub align: Option<u64>,
}

/// The map's configuration. Every field has a default, so a configuration file names only
/// what it changes (`configs/addrmap.toml` lists them all).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MapConfig {
    /// Significant bits of a GFA: every mapped byte lies below `2^address_bits`.
    pub address_bits: u8,
    /// First GFA handed out (aligned to the default node span).
    pub base: u64,
    /// Node slot size.
    pub node_span: NodeSpan,
    /// Default alignment of a device range.
    pub device_align: u64,
    /// Memory kinds that are mapped; others are ignored.
    pub kinds: Vec<MemoryKind>,
    /// Per-node overrides, by node name.
    #[serde(default)]
    pub nodes: BTreeMap<String, NodeOverride>,
    /// Per-device overrides.
    #[serde(default)]
    pub devices: BTreeMap<DeviceId, DeviceOverride>,
}

impl Default for MapConfig {
    /// 57 bits (UALink's physical address width, 128 PiB); base 0; node slots sized to
    /// the node's memory rounded up to a power of two, at least 1 TiB; devices 1 GiB-aligned
    /// (1 GiB pages and the CUDA VMM granularity both divide it); host DRAM not mapped.
    fn default() -> Self {
        Self {
            address_bits: 57,
            base: 0,
            node_span: NodeSpan::Auto { min: TIB },
            device_align: GIB,
            kinds: vec![
                MemoryKind::Hbm,
                MemoryKind::CxlVolatile,
                MemoryKind::CxlPersistent,
                MemoryKind::CxlDynamic,
                MemoryKind::HostExported,
            ],
            nodes: BTreeMap::new(),
            devices: BTreeMap::new(),
        }
    }
}

/// Smallest accepted device alignment.
pub const MIN_ALIGN: u64 = 4096;

impl MapConfig {
    /// One past the highest GFA.
    pub fn limit(&self) -> u64 {
        if self.address_bits >= 64 { u64::MAX } else { 1u64 << self.address_bits }
    }

    /// Whether resources of this kind are mapped.
    pub fn maps(&self, kind: MemoryKind) -> bool {
        self.kinds.contains(&kind)
    }

    /// Alignment of a device's ranges.
    pub fn align_of(&self, device: &DeviceId) -> u64 {
        self.devices.get(device).and_then(|o| o.align).unwrap_or(self.device_align)
    }

    /// The slot span for a node whose new memory needs `need` bytes.
    pub fn span_for(&self, node: &str, need: u64) -> u64 {
        if let Some(span) = self.nodes.get(node).and_then(|o| o.span) {
            return span;
        }
        match self.node_span {
            NodeSpan::Fixed(span) => span,
            NodeSpan::Auto { min } => need.checked_next_power_of_two().unwrap_or(1 << 63).max(min),
        }
    }

    /// Checks every setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(40..=64).contains(&self.address_bits) {
            return Err(ConfigError::AddressBits(self.address_bits));
        }
        let pow2 = |what: String, value: u64, min: u64| {
            if value.is_power_of_two() && value >= min {
                Ok(())
            } else {
                Err(ConfigError::NotPowerOfTwo { what, value, min })
            }
        };
        pow2("device_align".into(), self.device_align, MIN_ALIGN)?;
        let default_span = match self.node_span {
            NodeSpan::Auto { min } => min,
            NodeSpan::Fixed(span) => span,
        };
        pow2("node_span".into(), default_span, self.device_align)?;
        let bits = self.address_bits;
        let base_ok = |v: u64, align: u64| v.is_multiple_of(align) && v < self.limit();
        if !base_ok(self.base, default_span) {
            return Err(ConfigError::BadBase { what: "base".into(), value: self.base, align: default_span, bits });
        }
        for (name, o) in &self.nodes {
            if let Some(span) = o.span {
                pow2(format!("nodes.{name}.span"), span, MIN_ALIGN)?;
            }
            if let Some(base) = o.base {
                let align = o.span.unwrap_or(MIN_ALIGN);
                if !base_ok(base, align) {
                    return Err(ConfigError::BadBase { what: format!("nodes.{name}.base"), value: base, align, bits });
                }
            }
        }
        for (id, o) in &self.devices {
            if let Some(align) = o.align {
                pow2(format!("devices.{id}.align"), align, MIN_ALIGN)?;
            }
        }
        Ok(())
    }
}

/// Rounds `v` up to a multiple of the power of two `align`; `None` on overflow.
pub fn align_up(v: u64, align: u64) -> Option<u64> {
    v.checked_add(align - 1).map(|x| x & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_reach_128_pib() {
        let c = MapConfig::default();
        c.validate().unwrap();
        assert_eq!(c.limit(), 128 << 50);
        assert!(!c.maps(MemoryKind::Dram));
        assert_eq!(c.span_for("n", 8 * 141_000_000_000), 2 * TIB);
        assert_eq!(c.span_for("n", 1), TIB);
    }

    #[test]
    fn bad_settings_are_rejected() {
        let c = MapConfig { device_align: 3 << 20, ..MapConfig::default() };
        assert!(matches!(c.validate(), Err(ConfigError::NotPowerOfTwo { .. })));
        let c = MapConfig { base: GIB, ..MapConfig::default() };
        assert!(matches!(c.validate(), Err(ConfigError::BadBase { .. })));
        let c = MapConfig { address_bits: 70, ..MapConfig::default() };
        assert!(matches!(c.validate(), Err(ConfigError::AddressBits(70))));
    }
}
