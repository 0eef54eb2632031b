//! Display names from the PCI id database (the `pci-ids` crate's bundled copy), through the
//! relocation-free tables `build.rs` derives from it. Names are for people only: nothing
//! decides anything from them.

/// Every name, concatenated.
static NAMES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pci-names.txt"));
/// Vendor id → name.
static VENDORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pci-vendors.bin"));
/// `vendor << 16 | device` → name.
static DEVICES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pci-devices.bin"));
/// Class id → name.
static CLASSES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pci-classes.bin"));
/// `class << 8 | subclass` → name.
static SUBCLASSES: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pci-subclasses.bin"));

/// Bytes per record: key, name offset, name length (little-endian u32 each), sorted by key.
const RECORD: usize = 12;

/// The `i`th u32 of record `r`.
fn field(table: &[u8], r: usize, i: usize) -> Option<u32> {
    let at = r.checked_mul(RECORD)?.checked_add(i * 4)?;
    let bytes = table.get(at..at + 4)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

/// The name recorded for `key` in `table`, by binary search.
fn lookup(table: &[u8], key: u32) -> Option<String> {
    let (mut lo, mut hi) = (0, table.len() / RECORD);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let k = field(table, mid, 0)?;
        if k < key {
            lo = mid + 1;
        } else if k > key {
            hi = mid;
        } else {
            let off = field(table, mid, 1)? as usize;
            let len = field(table, mid, 2)? as usize;
            let name = NAMES.get(off..off.checked_add(len)?)?;
            return std::str::from_utf8(name).ok().map(str::to_owned);
        }
    }
    None
}

/// Vendor name for a vendor id.
pub fn vendor_name(vendor: u16) -> Option<String> {
    lookup(VENDORS, u32::from(vendor))
}

/// Device name for a vendor and device id.
pub fn device_name(vendor: u16, device: u16) -> Option<String> {
    lookup(DEVICES, u32::from(vendor) << 16 | u32::from(device))
}

/// Name of a 24-bit class code's class and subclass (`VGA compatible controller`).
pub fn class_name(class: u32) -> Option<String> {
    let [_, cid, sid, _] = class.to_be_bytes();
    lookup(SUBCLASSES, u32::from(cid) << 8 | u32::from(sid)).or_else(|| lookup(CLASSES, u32::from(cid)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pci_ids::FromId;

    #[test]
    fn well_known_ids_have_names() {
        assert!(vendor_name(0x10de).is_some_and(|n| n.contains("NVIDIA")));
        assert!(vendor_name(0x8086).is_some_and(|n| n.contains("Intel")));
        assert_eq!(vendor_name(0x0002), None);
        assert!(device_name(0x1af4, 0x1000).is_some());
        assert_eq!(device_name(0x1af4, 0xfffe), None);
        assert!(class_name(0x030000).is_some_and(|n| n.contains("VGA")));
        // A class with no such subclass falls back to the class name.
        assert_eq!(class_name(0x03_7f_00), pci_ids::Class::from_id(0x03).map(|c| c.name().to_owned()));
        assert_eq!(class_name(0xfe_00_00), None);
    }

    /// Every entry of the crate's database answers the same through the derived tables, and
    /// ids the database lacks answer nothing in both.
    #[test]
    fn tables_agree_with_the_pci_ids_crate() {
        let mut devices = 0;
        for v in pci_ids::Vendors::iter() {
            assert_eq!(vendor_name(v.id()).as_deref(), Some(v.name()), "vendor {:04x}", v.id());
            for d in v.devices() {
                let first = pci_ids::Device::from_vid_pid(v.id(), d.id()).map(|d| d.name());
                assert_eq!(device_name(v.id(), d.id()).as_deref(), first, "device {:04x}:{:04x}", v.id(), d.id());
                devices += 1;
            }
        }
        assert!(devices > 10_000, "only {devices} devices in the database");
        for cid in 0..=u8::MAX {
            for sid in [0u8, 1, 2, 4, 0x80, 0xff] {
                let want = pci_ids::Subclass::from_cid_sid(cid, sid)
                    .map(|s| s.name())
                    .or_else(|| pci_ids::Class::from_id(cid).map(|c| c.name()));
                let code = u32::from(cid) << 16 | u32::from(sid) << 8;
                assert_eq!(class_name(code).as_deref(), want, "class {code:06x}");
            }
        }
        for vendor in [0u16, 0x0002, 0xfffe, 0xffff] {
            assert_eq!(vendor_name(vendor).as_deref(), pci_ids::Vendor::from_id(vendor).map(|v| v.name()));
        }
    }
}
