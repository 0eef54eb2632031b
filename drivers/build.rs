//! Re-indexes the `pci-ids` crate's database into relocation-free tables.
//!
//! `pci-ids` keeps its names in statics full of `&'static str` and slice pointers: about
//! 50,000 pointers that the dynamic loader must relocate, page by page, every time a
//! position-independent `fabricctl` starts (about 1.5 ms of copy-on-write page faults on a
//! 2-core VM, half the command's run time). This script walks that same database once at
//! build time and writes it as one string blob plus sorted fixed-size records of plain
//! integers (`key`, `offset`, `length`, little-endian u32 each), which need no relocation
//! and cost nothing until a lookup touches them. `src/pci/names.rs` reads them.

use std::io::Write;
use std::path::Path;

/// One record: key, offset of the name in the blob, length of the name.
type Record = (u32, u32, u32);

/// Appends `name` to the blob and returns its record for `key`.
fn record(blob: &mut String, key: u32, name: &str) -> Record {
    let off = u32::try_from(blob.len()).expect("PCI name blob exceeds 4 GiB");
    let len = u32::try_from(name.len()).expect("PCI name exceeds 4 GiB");
    blob.push_str(name);
    (key, off, len)
}

/// Sorts by key, keeping the first of duplicate keys (what `pci-ids`' lookups return).
fn index(mut records: Vec<Record>) -> Vec<u8> {
    records.sort_by_key(|r| r.0);
    records.dedup_by_key(|r| r.0);
    let mut bytes = Vec::with_capacity(records.len() * 12);
    for (key, off, len) in records {
        bytes.extend_from_slice(&key.to_le_bytes());
        bytes.extend_from_slice(&off.to_le_bytes());
        bytes.extend_from_slice(&len.to_le_bytes());
    }
    bytes
}

fn write(dir: &Path, file: &str, bytes: &[u8]) {
    let path = dir.join(file);
    let mut f = std::fs::File::create(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.write_all(bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

fn main() {
    let out = std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR");
    let dir = Path::new(&out);
    let mut blob = String::new();
    let mut vendors = Vec::new();
    let mut devices = Vec::new();
    for v in pci_ids::Vendors::iter() {
        vendors.push(record(&mut blob, u32::from(v.id()), v.name()));
        for d in v.devices() {
            devices.push(record(&mut blob, u32::from(v.id()) << 16 | u32::from(d.id()), d.name()));
        }
    }
    let mut classes = Vec::new();
    let mut subclasses = Vec::new();
    for c in pci_ids::Classes::iter() {
        classes.push(record(&mut blob, u32::from(c.id()), c.name()));
        for s in c.subclasses() {
            subclasses.push(record(&mut blob, u32::from(c.id()) << 8 | u32::from(s.id()), s.name()));
        }
    }
    write(dir, "pci-names.txt", blob.as_bytes());
    write(dir, "pci-vendors.bin", &index(vendors));
    write(dir, "pci-devices.bin", &index(devices));
    write(dir, "pci-classes.bin", &index(classes));
    write(dir, "pci-subclasses.bin", &index(subclasses));
    println!("cargo::rerun-if-changed=build.rs");
}
