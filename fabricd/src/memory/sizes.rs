//! Region files keep their size. A client holds its region's file read-write (it maps it),
//! so it can also `ftruncate` it: shrinking it makes every other mapping of the region fault
//! (`SIGBUS`) past the new end, and growing it takes memory no limit counts (a NUMA region's
//! file grows past the range its node policy covers, and tmpfs fills). The registry puts
//! the size back: [`Memory::restore_sizes`], called periodically by the daemon
//! (`crate::tasks::sizewatch`). A shrunk region's lost tail comes back as zeros.

use super::{Memory, RegionFile};

impl Memory {
    /// Every region file whose size is not its region's length gets that length back — a
    /// sim interleave-set region's one file too (it holds the whole region). Device memory
    /// (a DAX device, a BAR: never resized by a client) and adopted vendor objects are left
    /// alone. Returns how many were restored.
    pub fn restore_sizes(&self) -> usize {
        // Where the files are is read under the lock and they are checked outside it: region
        // ids are never reused, so a region freed meanwhile only makes its open fail.
        let files: Vec<(u64, RegionFile, u64)> = {
            let st = self.state();
            st.ledger
                .regions
                .iter()
                .filter(|(_, r)| r.backing.own_file().is_some())
                .filter_map(|(id, r)| Some((*id, st.region_file(*id, r).ok()?, r.len)))
                .collect()
        };
        let mut restored = 0;
        for (id, file, len) in files {
            // One stat per region per check; the file is opened only to put its size back.
            let Ok(found) = file.size() else { continue };
            if found == len {
                continue;
            }
            let path = file.path().display();
            match file.open(true).and_then(|f| f.set_len(len)) {
                Ok(()) => {
                    restored += 1;
                    tracing::warn!(region = id, path = %path, found, len, "a client resized its region file; size restored");
                }
                Err(e) => {
                    tracing::warn!(region = id, path = %path, error = %e, "cannot restore a region file's size")
                }
            }
        }
        restored
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use crate::memory::Identity;
    use fabric_topology::{Device, DeviceId, DeviceKind, Inventory, MemoryKind, MemoryResource};

    use super::*;
    use crate::config::LimitsConfig;
    use crate::memory::Place;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_region_file_a_client_resized_gets_its_size_back() {
        let dir = tempfile::tempdir().unwrap();
        let id = DeviceId::uuid("GPU-74ea8f39-337d-2bff-f79c-f2f5ed86e4ee");
        let mut d = Device::new(id.clone(), DeviceKind::Gpu, Some("n0"));
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size: 1 << 30, hpa: None, numa_node: None });
        d.sources = vec!["sim".into()];
        let mut inv = Inventory::default();
        inv.add_device(d).unwrap();
        let m = Memory::open(dir.path(), &inv, LimitsConfig::default()).unwrap();
        let me = Identity { pid: 1, uid: 1000, gid: 1000 };
        let place = Place { device: id, kind: MemoryKind::Hbm, ordinal: None };
        let a = m.alloc(&me, 1, &place, 4 * MIB, 0).unwrap();
        let b = m.alloc(&me, 1, &place, 2 * MIB, 0).unwrap();
        assert_eq!(m.restore_sizes(), 0, "nothing resized yet");
        let (fa, fb) = (std::fs::File::from(a.fd), std::fs::File::from(b.fd));
        fa.set_len(MIB).unwrap(); // shrunk: other mappings would fault
        fb.set_len(64 * MIB).unwrap(); // grown: memory no limit counts
        assert_eq!(m.restore_sizes(), 2);
        assert_eq!((fa.metadata().unwrap().len(), fb.metadata().unwrap().len()), (4 * MIB, 2 * MIB));
        assert_eq!(m.restore_sizes(), 0);
    }
}
