//! The DMA engine of QEMU's `edu` device (QEMU `docs/specs/edu.rst`): it moves bytes
//! between RAM (an IOVA) and its own 4 KiB buffer at device address `0x40000`, one
//! transfer at a time, addressing 28 bits. A copy RAM → RAM is therefore pieces of at
//! most 4 KiB, each two transfers (RAM → edu, edu → RAM), with the CPU never touching a
//! byte. The registers are reached through [`Bar`], so the sequence is tested on a fake.

use std::io;
use std::time::{Duration, Instant};

/// PCI ids of edu.
pub const IDS: (&str, &str) = ("0x1234", "0x11e8");
/// edu's DMA mask.
pub const MASK_BITS: u8 = 28;
/// Bytes of edu's buffer: the largest transfer.
pub const PIECE: u64 = 4096;
/// Device address of edu's buffer.
pub const BUFFER: u64 = 0x40000;
/// Bytes of BAR 0 the driver touches (through the DMA command register).
pub const REGISTERS: u64 = 0x100;

const ID: u64 = 0x00;
const DMA_SRC: u64 = 0x80;
const DMA_DST: u64 = 0x88;
const DMA_COUNT: u64 = 0x90;
const DMA_CMD: u64 = 0x98;
const CMD_START: u64 = 1;
const CMD_TO_RAM: u64 = 2;
/// What register 0 reads as: major 1, minor 0, `0xed`.
const ID_VALUE: u32 = 0x0100_00ed;

/// A device's BAR 0 registers.
pub trait Bar: Send {
    /// Reads the 32-bit register at `reg`.
    fn read32(&self, reg: u64) -> io::Result<u32>;
    /// Reads the 64-bit register at `reg`.
    fn read64(&self, reg: u64) -> io::Result<u64>;
    /// Writes the 64-bit register at `reg`.
    fn write64(&self, reg: u64, v: u64) -> io::Result<()>;
}

/// Why an edu transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum EduError {
    /// A register access failed.
    #[error("edu register {reg:#x}")]
    Register {
        /// The register.
        reg: u64,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Register 0 does not read as edu's.
    #[error("register 0 reads {0:#x}, not edu's {ID_VALUE:#x}")]
    NotEdu(u32),
    /// The device did not clear its busy bit in time.
    #[error("edu DMA {src:#x} -> {dst:#x} did not finish in {timeout:?}")]
    Timeout {
        /// Source address.
        src: u64,
        /// Destination address.
        dst: u64,
        /// How long it was given.
        timeout: Duration,
    },
    /// An address beyond edu's 28 bits.
    #[error("IOVA {0:#x} is beyond edu's {MASK_BITS}-bit DMA mask")]
    Mask(u64),
}

/// edu's engine over its registers.
#[derive(Debug)]
pub struct Edu<B> {
    bar: B,
    /// How long one transfer may take (edu waits 100 ms of virtual time per transfer).
    pub timeout: Duration,
    /// Pause between two reads of the busy bit.
    pub poll: Duration,
}

impl<B: Bar> Edu<B> {
    /// Checks register 0 and takes the device.
    pub fn new(bar: B) -> Result<Self, EduError> {
        let id = bar.read32(ID).map_err(|source| EduError::Register { reg: ID, source })?;
        if id != ID_VALUE {
            return Err(EduError::NotEdu(id));
        }
        Ok(Self { bar, timeout: Duration::from_secs(10), poll: Duration::from_millis(1) })
    }

    fn write(&self, reg: u64, v: u64) -> Result<(), EduError> {
        self.bar.write64(reg, v).map_err(|source| EduError::Register { reg, source })
    }

    /// One transfer of `len` (≤ [`PIECE`]) bytes; waits for the busy bit to clear.
    fn transfer(&self, src: u64, dst: u64, len: u64, to_ram: bool) -> Result<(), EduError> {
        debug_assert!(len <= PIECE);
        self.write(DMA_SRC, src)?;
        self.write(DMA_DST, dst)?;
        self.write(DMA_COUNT, len)?;
        self.write(DMA_CMD, CMD_START | if to_ram { CMD_TO_RAM } else { 0 })?;
        let deadline = Instant::now() + self.timeout;
        loop {
            let cmd = self.bar.read64(DMA_CMD).map_err(|source| EduError::Register { reg: DMA_CMD, source })?;
            if cmd & CMD_START == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(EduError::Timeout { src, dst, timeout: self.timeout });
            }
            std::thread::sleep(self.poll);
        }
    }

    /// Copies `len` bytes from IOVA `src` to IOVA `dst` through the buffer, piece by piece.
    pub fn copy(&self, src: u64, dst: u64, len: u64) -> Result<(), EduError> {
        let limit = 1u64 << MASK_BITS;
        for a in [src, dst] {
            if a.checked_add(len).is_none_or(|e| e > limit) {
                return Err(EduError::Mask(a));
            }
        }
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PIECE);
            self.transfer(src + done, BUFFER, n, false)?;
            self.transfer(BUFFER, dst + done, n, true)?;
            done += n;
        }
        Ok(())
    }

    /// Writes one piece of edu's buffer to IOVA `dst` (the unmap check's probe).
    pub fn write_to(&self, dst: u64) -> Result<(), EduError> {
        self.transfer(BUFFER, dst, PIECE, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// A fake edu: registers, a buffer, RAM as pages by IOVA; a transfer completes on the
    /// `busy_reads`-th read of the command register (or never).
    struct Fake {
        regs: Mutex<HashMap<u64, u64>>,
        buffer: Mutex<Vec<u8>>,
        ram: Mutex<HashMap<u64, u8>>,
        log: Mutex<Vec<(u64, u64)>>,
        busy_reads: Option<u32>,
        reads: Mutex<u32>,
    }

    impl Fake {
        fn new(busy_reads: Option<u32>) -> Self {
            Self {
                regs: Mutex::default(),
                buffer: Mutex::new(vec![0; PIECE as usize]),
                ram: Mutex::default(),
                log: Mutex::default(),
                busy_reads,
                reads: Mutex::new(0),
            }
        }

        fn run(&self) {
            let r = self.regs.lock().expect("lock");
            let (src, dst, n, cmd) = (r[&DMA_SRC], r[&DMA_DST], r[&DMA_COUNT], r[&DMA_CMD]);
            let (mut buf, mut ram) = (self.buffer.lock().expect("lock"), self.ram.lock().expect("lock"));
            for i in 0..n {
                if cmd & CMD_TO_RAM != 0 {
                    ram.insert(dst + i, buf[(src - BUFFER + i) as usize]);
                } else {
                    buf[(dst - BUFFER + i) as usize] = ram.get(&(src + i)).copied().unwrap_or(0);
                }
            }
        }
    }

    impl Bar for &Fake {
        fn read32(&self, reg: u64) -> io::Result<u32> {
            Ok(if reg == ID { ID_VALUE } else { 0 })
        }
        fn read64(&self, reg: u64) -> io::Result<u64> {
            let mut reads = self.reads.lock().expect("lock");
            *reads += 1;
            let v = self.regs.lock().expect("lock").get(&reg).copied().unwrap_or(0);
            if reg == DMA_CMD && self.busy_reads.is_some_and(|b| *reads >= b) && v & CMD_START != 0 {
                self.run();
                self.regs.lock().expect("lock").insert(DMA_CMD, v & !CMD_START);
                *reads = 0;
                return Ok(v & !CMD_START);
            }
            Ok(v)
        }
        fn write64(&self, reg: u64, v: u64) -> io::Result<()> {
            self.log.lock().expect("lock").push((reg, v));
            self.regs.lock().expect("lock").insert(reg, v);
            Ok(())
        }
    }

    #[test]
    fn a_copy_goes_ram_to_edu_to_ram_in_pieces_of_at_most_4k() {
        let fake = Fake::new(Some(3));
        let len = 2 * PIECE + 100;
        for i in 0..len {
            fake.ram.lock().expect("lock").insert(0x10_0000 + i, (i * 7 + 3) as u8);
        }
        let edu = Edu::new(&fake).expect("edu");
        edu.copy(0x10_0000, 0x20_0000, len).expect("copy");
        let ram = fake.ram.lock().expect("lock");
        assert!((0..len).all(|i| ram[&(0x20_0000 + i)] == (i * 7 + 3) as u8));
        // The register sequence: src, dst, count, cmd per transfer; two transfers per piece.
        let log = fake.log.lock().expect("lock");
        assert_eq!(log.len(), 6 * 4);
        assert_eq!(&log[..4], &[(DMA_SRC, 0x10_0000), (DMA_DST, BUFFER), (DMA_COUNT, PIECE), (DMA_CMD, CMD_START)]);
        assert_eq!(&log[4..8], &[(DMA_SRC, BUFFER), (DMA_DST, 0x20_0000), (DMA_COUNT, PIECE), (DMA_CMD, 3)]);
        assert_eq!(log[20..24], [(DMA_SRC, BUFFER), (DMA_DST, 0x20_2000), (DMA_COUNT, 100), (DMA_CMD, 3)]);
    }

    #[test]
    fn a_device_that_stays_busy_times_out_and_iovas_past_the_mask_are_refused() {
        let fake = Fake::new(None);
        let mut edu = Edu::new(&fake).expect("edu");
        edu.timeout = Duration::from_millis(20);
        assert!(matches!(edu.copy(0x1000, 0x2000, 8), Err(EduError::Timeout { src: 0x1000, dst: BUFFER, .. })));
        assert!(matches!(edu.copy(1 << 28, 0x2000, 8), Err(EduError::Mask(a)) if a == 1 << 28));
        assert!(matches!(edu.copy(0x1000, (1 << 28) - 4, 8), Err(EduError::Mask(_))));
    }

    #[test]
    fn another_device_is_not_taken_for_edu() {
        struct Other;
        impl Bar for Other {
            fn read32(&self, _: u64) -> io::Result<u32> {
                Ok(0xffff_ffff)
            }
            fn read64(&self, _: u64) -> io::Result<u64> {
                Ok(0)
            }
            fn write64(&self, _: u64, _: u64) -> io::Result<()> {
                Ok(())
            }
        }
        assert!(matches!(Edu::new(Other), Err(EduError::NotEdu(0xffff_ffff))));
    }
}
