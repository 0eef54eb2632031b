//! The CXL guest: its QEMU topology (two host bridges, a switch, three volatile type-3
//! devices and a persistent one), and the comparison of fabricd's discovery with the
//! kernel's own account (`cxl list -vvv` from Debian's ndctl, run in the same guest).

use std::fs;
use std::path::{Path, PathBuf};

use crate::vm::VmSpec;

/// Bytes of each type-3 device's memory.
pub const DEVICE_BYTES: u64 = 256 << 20;

/// One emulated type-3 device.
#[derive(Debug, Clone)]
pub struct Type3 {
    /// QEMU id.
    pub id: &'static str,
    /// Serial number the device reports.
    pub serial: u64,
    /// Persistent (with a label storage area) rather than volatile.
    pub persistent: bool,
    /// The port it sits under.
    pub bus: &'static str,
}

/// The devices of the CXL guest. The first two are the region's targets, in order.
pub const DEVICES: [Type3; 4] = [
    Type3 { id: "mem0", serial: 0x1000, persistent: false, bus: "swp0" },
    Type3 { id: "mem1", serial: 0x1001, persistent: false, bus: "swp1" },
    Type3 { id: "mem2", serial: 0x1002, persistent: false, bus: "swp2" },
    Type3 { id: "mem3", serial: 0x2000, persistent: true, bus: "rp2" },
];

/// The backing file of device `id` under `dir`.
pub fn backing_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.raw"))
}

/// Adds the CXL topology to `spec`, its memory backed by sparse files in `dir` (created
/// here): host bridge cxl.1 with root ports rp0 (a switch with downstream ports swp0..2, one
/// volatile device each) and rp1 (empty), host bridge cxl.2 with rp2 (the persistent
/// device); window 0 (4 GiB) over cxl.1, window 1 (4 GiB) over cxl.2.
pub fn add_topology(spec: &mut VmSpec, dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    spec.machine = "q35,cxl=on".to_owned();
    spec.device("pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1")
        .device("cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=0")
        .device("cxl-rp,port=1,bus=cxl.1,id=rp1,chassis=0,slot=1")
        .device("cxl-upstream,bus=rp0,id=us0");
    for p in 0..3 {
        spec.device(format!("cxl-downstream,port={p},bus=us0,id=swp{p},chassis=0,slot={}", 4 + p));
    }
    spec.device("pxb-cxl,bus_nr=32,bus=pcie.0,id=cxl.2").device("cxl-rp,port=0,bus=cxl.2,id=rp2,chassis=0,slot=2");
    for d in &DEVICES {
        let file = backing_file(dir, d.id);
        fs::OpenOptions::new().create(true).truncate(false).write(true).open(&file)?.set_len(DEVICE_BYTES)?;
        spec.object(format!(
            "memory-backend-file,id={}-be,share=on,mem-path={},size={DEVICE_BYTES}",
            d.id,
            file.display()
        ));
        if d.persistent {
            let lsa = dir.join(format!("{}-lsa.raw", d.id));
            fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lsa)?.set_len(1 << 20)?;
            spec.object(format!("memory-backend-file,id={}-lsa,share=on,mem-path={},size=1M", d.id, lsa.display()));
            spec.device(format!(
                "cxl-type3,bus={},persistent-memdev={id}-be,lsa={id}-lsa,id={id},sn={:#x}",
                d.bus,
                d.serial,
                id = d.id
            ));
        } else {
            spec.device(format!("cxl-type3,bus={},volatile-memdev={id}-be,id={id},sn={:#x}", d.bus, d.serial, id = d.id));
        }
    }
    spec.arg("-M").arg("cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G,cxl-fmw.1.targets.0=cxl.2,cxl-fmw.1.size=4G");
    Ok(())
}
