//! The NUMA-node guest: one CXL type-3 device (256 MiB, serial 0x4000) on its own host
//! bridge, whose 1-way RAM region the guest onlines as System RAM (`kmem`), so that it
//! becomes a memory-only NUMA node; and the host-side check that a region's bytes are in
//! that device's memory.
//!
//! The guest's own DRAM is NUMA node 0 (`-numa node`): with an SRAT, Linux gives each CXL
//! window a node of its own (without one, everything is node 0).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::vm::VmSpec;

/// The device's bytes (two 128 MiB memory blocks).
pub const DEVICE_BYTES: u64 = 256 << 20;
/// Its serial number.
pub const SERIAL: u64 = 0x4000;

/// The device's backing file under `dir`.
pub fn backing_file(dir: &Path) -> PathBuf {
    dir.join("kmem0.raw")
}

/// Adds the topology to `spec`: guest DRAM as node 0 with every CPU (`smp` of them), the
/// host bridge, root port and device, and a 4 GiB CXL window.
pub fn add_topology(spec: &mut VmSpec, dir: &Path, smp: u32) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let file = backing_file(dir);
    let f = fs::OpenOptions::new().create(true).truncate(true).write(true).open(&file)?;
    f.set_len(DEVICE_BYTES)?;
    spec.machine = "q35,cxl=on".to_owned();
    spec.object(format!("memory-backend-ram,id=dram0,size={}M", spec.mem_mib))
        .arg("-numa")
        .arg(format!("node,nodeid=0,memdev=dram0,cpus=0-{}", smp.saturating_sub(1)));
    spec.device("pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1").device("cxl-rp,port=0,bus=cxl.1,id=rp0,chassis=0,slot=0");
    spec.object(format!("memory-backend-file,id=kmem0-be,share=on,mem-path={},size={DEVICE_BYTES}", file.display()));
    spec.device(format!("cxl-type3,bus=rp0,volatile-memdev=kmem0-be,id=kmem0,sn={SERIAL:#x}"));
    spec.arg("-M").arg("cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G");
    Ok(())
}

/// Finds each 4 KiB page of a `len`-byte region holding [`crate::pattern::word`]`(seed, ·)`
/// somewhere in `file` (the kernel placed the pages anywhere in the node): `Ok(offsets)`, the
/// file offset of each region page in order, or which page is missing.
pub fn find_pages(file: &Path, len: u64, seed: u64) -> Result<Vec<u64>, String> {
    const PAGE: usize = 4096;
    let pages = (len / PAGE as u64) as usize;
    let mut by_first = std::collections::HashMap::new();
    for k in 0..pages {
        by_first.insert(crate::pattern::word(seed, (k * PAGE) as u64), k);
    }
    let mut found = vec![None; pages];
    let mut f = fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut buf = vec![0u8; PAGE];
    let mut at = 0u64;
    loop {
        match f.read_exact(&mut buf) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(format!("{}: {e}", file.display())),
        }
        let word = |i: usize| u64::from_le_bytes(buf[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        if let Some(&k) = by_first.get(&word(0)) {
            let whole = (0..PAGE / 8).all(|i| word(i) == crate::pattern::word(seed, (k * PAGE + i * 8) as u64));
            if whole {
                found[k] = Some(at);
            }
        }
        at += PAGE as u64;
    }
    found
        .iter()
        .enumerate()
        .map(|(k, o)| {
            o.ok_or_else(|| format!("region page {k} (offset {:#x}) is not in the device's memory", k * PAGE))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pages_are_found_wherever_they_lie() {
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("mem.raw");
        let mut bytes = vec![0u8; 16 * 4096];
        // Region pages 0 and 1 at file pages 9 and 3.
        for (k, at) in [(0usize, 9usize), (1, 3)] {
            for i in 0..512 {
                let w = crate::pattern::word(5, (k * 4096 + i * 8) as u64);
                bytes[at * 4096 + i * 8..][..8].copy_from_slice(&w.to_le_bytes());
            }
        }
        fs::write(&f, &bytes).unwrap();
        assert_eq!(find_pages(&f, 8192, 5).unwrap(), vec![9 * 4096, 3 * 4096]);
        // Another seed, or a torn page, is not found.
        assert!(find_pages(&f, 8192, 6).is_err());
        bytes[3 * 4096 + 100] ^= 1;
        fs::write(&f, &bytes).unwrap();
        assert!(find_pages(&f, 8192, 5).unwrap_err().contains("page 1"));
    }
}
