//! Display names from the PCI id database (the `pci-ids` crate's bundled copy). Names are
//! for people only: nothing decides anything from them.

use pci_ids::FromId;

/// Vendor name for a vendor id.
pub fn vendor_name(vendor: u16) -> Option<String> {
    pci_ids::Vendor::from_id(vendor).map(|v| v.name().to_owned())
}

/// Device name for a vendor and device id.
pub fn device_name(vendor: u16, device: u16) -> Option<String> {
    pci_ids::Device::from_vid_pid(vendor, device).map(|d| d.name().to_owned())
}

/// Name of a 24-bit class code's class and subclass (`VGA compatible controller`).
pub fn class_name(class: u32) -> Option<String> {
    let [_, cid, sid, _] = class.to_be_bytes();
    pci_ids::Subclass::from_cid_sid(cid, sid)
        .map(|s| s.name().to_owned())
        .or_else(|| pci_ids::Class::from_id(cid).map(|c| c.name().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_known_ids_have_names() {
        assert!(vendor_name(0x10de).is_some_and(|n| n.contains("NVIDIA")));
        assert!(vendor_name(0x8086).is_some_and(|n| n.contains("Intel")));
        assert_eq!(vendor_name(0x0002), None);
        assert!(device_name(0x1af4, 0x1000).is_some());
        assert!(class_name(0x030000).is_some_and(|n| n.contains("VGA")));
    }
}
