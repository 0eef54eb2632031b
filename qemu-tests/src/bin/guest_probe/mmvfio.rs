//! `fabric-guest-probe mm-edu BDF`: the VFIO path as an application sees it — through
//! libfabric-mm and fabricd, which holds edu through VFIO (`dma.vfio`). Two host buffers
//! registered for edu (IOVAs inside its 28-bit mask), a copy between them through the
//! copy API (fabricd runs it on edu's DMA engine: RAM → edu → RAM), the bytes checked;
//! the client's own memory refused for a VFIO device; after the destination is
//! unregistered, a copy to it is refused (`NotFound`). Prints one FABRIC-TEST-RESULT line
//! per step, `registered-iovas SRC DST` and `unregistered-iova 0x…` for the guest script, which checks that fabricd's
//! unmap check saw the IOMMU block a DMA to that IOVA.

use std::time::Duration;

use fabric_mm::{Access, Error, Session};
use fabric_proto::wire::ErrorCode;

const LEN: u64 = 8192;

fn byte(i: u64) -> u8 {
    (i as u8).wrapping_mul(13).wrapping_add(5)
}

/// The whole sequence.
#[allow(clippy::print_stdout)] // The probe's report, read by the guest script.
pub fn mm_edu(bdf: &str) -> Result<(), String> {
    let s = Session::open().map_err(|e| format!("Session::open: {e}"))?;
    let devices = s.devices().map_err(|e| format!("devices: {e}"))?;
    let dev = devices
        .iter()
        .find(|d| d.id.starts_with("pci:") && d.id.ends_with(bdf))
        .ok_or_else(|| format!("fabricd names no device at {bdf}"))?
        .id
        .clone();
    let src = s.alloc_host(LEN).map_err(|e| format!("alloc_host: {e}"))?;
    let dst = s.alloc_host(LEN).map_err(|e| format!("alloc_host: {e}"))?;
    for i in 0..LEN {
        // SAFETY: inside the buffer (LEN bytes); nothing is registered yet.
        unsafe {
            src.as_ptr().add(i as usize).write_volatile(byte(i));
            dst.as_ptr().add(i as usize).write_volatile(0);
        }
    }
    let rs = s.register_uncached(&src, &dev, Access::ReadOnly).map_err(|e| format!("register src: {e}"))?;
    let rd = s.register_uncached(&dst, &dev, Access::ReadWrite).map_err(|e| format!("register dst: {e}"))?;
    for r in [&rs, &rd] {
        if r.iova() + r.len() > 1 << 28 {
            return Err(format!("IOVA {:#x}+{} is past edu's 28-bit mask", r.iova(), r.len()));
        }
    }
    println!(
        "FABRIC-TEST-RESULT mm-register ok {dev}: src IOVA {:#x}, dst IOVA {:#x}, inside the 28-bit mask",
        rs.iova(),
        rd.iova()
    );
    println!("registered-iovas {:#x} {:#x}", rs.iova(), rd.iova());
    let c = s.copy(rd.at(0), rs.at(0), LEN).map_err(|e| format!("copy: {e}"))?;
    let n = c.wait_timeout(Duration::from_secs(60)).ok_or("the copy did not finish in 60 s")?;
    let n = n.map_err(|e| format!("copy failed: {e}"))?;
    for i in 0..LEN {
        // SAFETY: inside the buffer; the copy is done, so no device writes it now.
        let got = unsafe { dst.as_ptr().add(i as usize).read_volatile() };
        if got != byte(i) {
            return Err(format!("round trip: byte {i} is {got:#x}, sent {:#x}", byte(i)));
        }
    }
    println!("FABRIC-TEST-RESULT mm-copy-round-trip ok {n} bytes RAM -> edu -> RAM through the copy API");

    // The caller's own memory cannot be mapped in the daemon's container.
    let mut own = vec![0u8; 4096];
    // SAFETY: `own` outlives the attempt; the registration is refused (or dropped at once).
    let r = unsafe { s.register_ptr(own.as_mut_ptr(), own.len(), &dev, Access::ReadWrite) };
    match r {
        Err(Error::Refused { code: ErrorCode::BadRequest, message, .. }) if message.contains("VFIO") => {
            println!("FABRIC-TEST-RESULT mm-process-memory-refused ok {message}");
        }
        other => return Err(format!("register_ptr for a VFIO device: {other:?}")),
    }

    let (old, iova) = (rd.id(), rd.iova());
    drop(rd);
    match s.copy(fabric_mm::CopyEndpoint::Registration { id: old, offset: 0 }, rs.at(0), 4096) {
        Err(Error::Refused { code: ErrorCode::NotFound, message, .. }) => {
            println!("FABRIC-TEST-RESULT mm-unregistered-refused ok {message}");
        }
        other => return Err(format!("copy to unregistered {old}: {other:?}")),
    }
    println!("unregistered-iova {iova:#x}");
    Ok(())
}
