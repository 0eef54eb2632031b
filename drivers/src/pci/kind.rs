//! What a PCI function is, from its vendor id and class code alone.

use fabric_topology::DeviceKind;

/// NVIDIA's PCI vendor id.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// AMD/ATI's PCI vendor id (graphics).
pub const VENDOR_AMD_ATI: u16 = 0x1002;

/// Classifies a function. Display controllers (class 0x03) count as GPUs only from NVIDIA
/// and AMD: an Intel display function is usually the integrated graphics, which the
/// fabric has no use for. NVSwitches show up as NVIDIA "other bridge" (0x0680) functions.
/// AMD processing accelerators (class 0x12: MI300X/MI300A/MI308X) are GPUs. CXL memory
/// devices (0x0502) stay `Other`: the CXL backend owns their memdevs.
pub fn classify(vendor: Option<u16>, class: Option<u32>) -> DeviceKind {
    let Some(class) = class else { return DeviceKind::Other };
    let base = class >> 16;
    let sub = class >> 8;
    match (base, sub) {
        (0x03, _) if matches!(vendor, Some(VENDOR_NVIDIA | VENDOR_AMD_ATI)) => DeviceKind::Gpu,
        // AMD's MI300 family shows as a processing accelerator (0x1200), not a display
        // controller, but is a GPU (RCCL's topology files list it as one).
        (0x12, _) if vendor == Some(VENDOR_AMD_ATI) => DeviceKind::Gpu,
        (_, 0x0680) if vendor == Some(VENDOR_NVIDIA) => DeviceKind::NvSwitch,
        (_, 0x0604 | 0x0609) => DeviceKind::PciBridge,
        (0x12, _) | (_, 0x0b40) => DeviceKind::Accelerator,
        (0x02, _) => DeviceKind::Nic,
        (0x01, _) => DeviceKind::Storage,
        _ => DeviceKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_map_to_kinds() {
        assert_eq!(classify(Some(0x10de), Some(0x030200)), DeviceKind::Gpu);
        assert_eq!(classify(Some(0x1002), Some(0x038000)), DeviceKind::Gpu);
        assert_eq!(classify(Some(0x8086), Some(0x030000)), DeviceKind::Other);
        assert_eq!(classify(Some(0x10de), Some(0x068000)), DeviceKind::NvSwitch);
        assert_eq!(classify(Some(0x8086), Some(0x068000)), DeviceKind::Other);
        assert_eq!(classify(Some(0x8086), Some(0x060400)), DeviceKind::PciBridge);
        assert_eq!(classify(Some(0x8086), Some(0x060401)), DeviceKind::PciBridge);
        assert_eq!(classify(Some(0x1000), Some(0x060900)), DeviceKind::PciBridge);
        assert_eq!(classify(Some(0x8086), Some(0x060000)), DeviceKind::Other);
        assert_eq!(classify(Some(0x1d0f), Some(0x120000)), DeviceKind::Accelerator);
        assert_eq!(classify(Some(0x1002), Some(0x120000)), DeviceKind::Gpu, "MI300X");
        assert_eq!(classify(Some(0x8086), Some(0x0b4000)), DeviceKind::Accelerator);
        assert_eq!(classify(Some(0x15b3), Some(0x020700)), DeviceKind::Nic);
        assert_eq!(classify(Some(0x15b3), Some(0x028000)), DeviceKind::Nic);
        assert_eq!(classify(Some(0x144d), Some(0x010802)), DeviceKind::Storage);
        assert_eq!(classify(Some(0x8086), Some(0x050210)), DeviceKind::Other);
        assert_eq!(classify(None, None), DeviceKind::Other);
    }
}
