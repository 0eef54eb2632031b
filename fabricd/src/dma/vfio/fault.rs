//! DMA fault detection through the kernel log. A device whose DMA the IOMMU blocks may
//! still report the transfer done (edu does): the only witness is the IOMMU driver's
//! fault record, which the kernel logs — `DMAR: [DMA Write NO_PASID] Request device
//! [00:04.0] fault addr 0x200000 ...` (Intel) or `AMD-Vi: Event logged [IO_PAGE_FAULT
//! device=00:04.0 ...]` (AMD). The engine marks `/dev/kmsg` before a transfer and reads
//! the records logged since; a fault record naming the device's bus/device/function fails
//! the copy. Needs `CAP_SYSLOG` (root). The kernel rate-limits these records (10 per 5 s):
//! a fault while they are suppressed is missed, which is why the engine is for devices
//! fabricd alone maps for (a fault can only come from a mapping fabricd removed).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

/// Where the engine learns of IOMMU faults (the kernel log; a fake in tests).
pub trait FaultLog: Send {
    /// Skips everything logged so far.
    fn mark(&mut self) -> io::Result<()>;
    /// The first fault record of the device since the mark, waiting up to `settle`.
    fn fault(&mut self, settle: Duration) -> io::Result<Option<String>>;
}

/// The kernel log, read from a mark.
#[derive(Debug)]
pub struct Kmsg {
    file: File,
    /// `BB:DD.F`: how IOMMU drivers name the device.
    needle: String,
}

/// Whether kernel log record `text` is an IOMMU fault of the device printed as `needle`.
pub fn is_fault(text: &str, needle: &str) -> bool {
    let intel = text.contains("DMAR") && text.contains("fault addr") && text.contains(&format!("[{needle}]"));
    let amd = text.contains("IO_PAGE_FAULT") && text.contains(&format!("device={needle}"));
    intel || amd
}

impl Kmsg {
    /// Opens `/dev/kmsg` for the function `bdf` (`DDDD:BB:DD.F`).
    pub fn open(bdf: &str) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg")?;
        let needle = bdf.get(bdf.len().saturating_sub(7)..).unwrap_or(bdf).to_owned();
        let mut k = Self { file, needle };
        k.mark()?;
        Ok(k)
    }
}

impl FaultLog for Kmsg {
    fn mark(&mut self) -> io::Result<()> {
        self.file.seek(SeekFrom::End(0)).map(drop)
    }

    /// Waits for the record because the fault interrupt may be handled after the device
    /// reports the transfer done.
    fn fault(&mut self, settle: Duration) -> io::Result<Option<String>> {
        let deadline = Instant::now() + settle;
        let mut buf = vec![0u8; 8192];
        loop {
            match self.file.read(&mut buf) {
                Ok(0) => {}
                Ok(n) => {
                    let rec = String::from_utf8_lossy(&buf[..n]);
                    let text = rec.split_once(';').map_or(&*rec, |(_, t)| t).trim_end();
                    if is_fault(text, &self.needle) {
                        return Ok(Some(text.to_owned()));
                    }
                    continue;
                }
                // Overwritten before we read it: the next read goes on from the oldest kept.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_records_are_matched_by_device() {
        let intel = "DMAR: [DMA Write NO_PASID] Request device [00:04.0] fault addr 0x200000 [fault reason 0x05] PTE Write access is not set";
        assert!(is_fault(intel, "00:04.0"));
        assert!(!is_fault(intel, "00:05.0"));
        let amd = "AMD-Vi: Event logged [IO_PAGE_FAULT device=00:04.0 domain=0x0001 address=0x200000 flags=0x0020]";
        assert!(is_fault(amd, "00:04.0"));
        assert!(!is_fault("DMAR: IOMMU enabled", "00:04.0"));
        assert!(!is_fault("vfio-pci 0000:00:04.0: enabling device", "00:04.0"));
    }
}
