//! A VFIO device's DMA engine as the copy path uses it: edu's transfers checked against
//! the kernel log for IOMMU faults, and against the set of live mappings, under one lock
//! per device. Unmapping takes the same lock ([`super::DmaMapping`]), so no transfer can
//! start on an IOVA once its mapping is gone — not even when a new registration gets the
//! same IOVA before the copy is stopped.

use std::collections::HashMap;
use std::time::Duration;

use super::VfioError;
use super::edu::{Bar, Edu};
use super::fault::FaultLog;

/// How long a copy waits after its transfers for the IOMMU's fault record.
pub const SETTLE: Duration = Duration::from_millis(30);
/// How long the unmap check waits for the fault record.
pub const VERIFY_SETTLE: Duration = Duration::from_secs(3);

/// One end of a device copy: a mapping (by id) and the IOVA of the copy's byte 0 in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct End {
    /// The mapping's id ([`super::DmaMapping::id`]).
    pub map: u64,
    /// IOVA.
    pub iova: u64,
}

/// The engine: edu, the fault log, and the mappings live now (id → IOVA range).
#[derive(Debug)]
pub struct Engine<B, L> {
    pub(super) edu: Edu<B>,
    pub(super) log: L,
    live: HashMap<u64, (u64, u64)>,
}

impl<B: Bar, L: FaultLog> Engine<B, L> {
    /// An engine with no mapping.
    pub fn new(edu: Edu<B>, log: L) -> Self {
        Self { edu, log, live: HashMap::new() }
    }

    /// Records mapping `id` of `[iova, iova + len)`.
    pub fn mapped(&mut self, id: u64, iova: u64, len: u64) {
        self.live.insert(id, (iova, len));
    }

    /// Forgets mapping `id` (before it is unmapped).
    pub fn unmapping(&mut self, id: u64) {
        self.live.remove(&id);
    }

    fn covers(&self, end: End, len: u64) -> bool {
        self.live
            .get(&end.map)
            .is_some_and(|&(start, n)| start <= end.iova && end.iova.checked_add(len).is_some_and(|e| e <= start + n))
    }

    /// Copies `len` bytes from `src` to `dst` on the device; refused when either mapping
    /// is gone, failed when the IOMMU logs a fault for the device meanwhile.
    pub fn copy(&mut self, src: End, dst: End, len: u64) -> Result<(), VfioError> {
        for e in [src, dst] {
            if !self.covers(e, len) {
                return Err(VfioError::Unmapped { iova: e.iova, len });
            }
        }
        self.log.mark().map_err(VfioError::Kmsg)?;
        self.edu.copy(src.iova, dst.iova, len)?;
        match self.log.fault(SETTLE).map_err(VfioError::Kmsg)? {
            Some(record) => Err(VfioError::Fault(record)),
            None => Ok(()),
        }
    }

    /// The unmap check: one transfer to `iova` (just unmapped); the fault record the IOMMU
    /// logged, or `None` when the write went through unreported.
    pub fn probe_unmapped(&mut self, iova: u64) -> Result<Option<String>, VfioError> {
        self.log.mark().map_err(VfioError::Kmsg)?;
        self.edu.write_to(iova)?;
        self.log.fault(VERIFY_SETTLE).map_err(VfioError::Kmsg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::sync::Mutex;

    /// A BAR whose transfers finish at once and are recorded; register 0 reads as edu.
    #[derive(Default)]
    struct Instant(Mutex<Vec<(u64, u64)>>);

    impl Bar for &Instant {
        fn read32(&self, _: u64) -> io::Result<u32> {
            Ok(0x0100_00ed)
        }
        fn read64(&self, _: u64) -> io::Result<u64> {
            Ok(0)
        }
        fn write64(&self, reg: u64, v: u64) -> io::Result<()> {
            self.0.lock().expect("lock").push((reg, v));
            Ok(())
        }
    }

    /// A log that reports `record` after the next mark, when set.
    struct Log {
        record: Option<String>,
        marks: u32,
    }

    impl FaultLog for Log {
        fn mark(&mut self) -> io::Result<()> {
            self.marks += 1;
            Ok(())
        }
        fn fault(&mut self, _: Duration) -> io::Result<Option<String>> {
            Ok(self.record.clone())
        }
    }

    const RECORD: &str = "DMAR: [DMA Write NO_PASID] Request device [00:04.0] fault addr 0x3000";

    #[test]
    fn a_transfer_the_iommu_blocked_fails_the_copy_even_when_the_device_says_done() {
        let bar = Instant::default();
        let mut e = Engine::new(Edu::new(&bar).expect("edu"), Log { record: None, marks: 0 });
        e.mapped(1, 0x1000, 0x2000);
        e.mapped(2, 0x3000, 0x2000);
        let (src, dst) = (End { map: 1, iova: 0x1000 }, End { map: 2, iova: 0x3000 });
        e.copy(src, dst, 0x2000).expect("clean copy");
        assert_eq!(e.log.marks, 1);
        e.log.record = Some(RECORD.into());
        assert!(matches!(e.copy(src, dst, 8), Err(VfioError::Fault(r)) if r == RECORD));
        assert_eq!(e.probe_unmapped(0x3000).expect("probe"), Some(RECORD.to_owned()));
    }

    #[test]
    fn no_transfer_starts_on_a_mapping_that_is_gone_or_too_short() {
        let bar = Instant::default();
        let mut e = Engine::new(Edu::new(&bar).expect("edu"), Log { record: None, marks: 0 });
        e.mapped(1, 0x1000, 0x1000);
        e.mapped(2, 0x3000, 0x1000);
        let (src, dst) = (End { map: 1, iova: 0x1000 }, End { map: 2, iova: 0x3000 });
        assert!(matches!(e.copy(src, dst, 0x1001), Err(VfioError::Unmapped { iova: 0x1000, .. })));
        e.unmapping(2);
        // A new mapping at the same IOVA is another mapping: the old copy does not reach it.
        e.mapped(3, 0x3000, 0x1000);
        assert!(matches!(e.copy(src, dst, 8), Err(VfioError::Unmapped { iova: 0x3000, .. })));
        assert!(bar.0.lock().expect("lock").is_empty(), "no register was written");
        e.copy(src, End { map: 3, iova: 0x3000 }, 8).expect("copy to the live mapping");
    }
}
