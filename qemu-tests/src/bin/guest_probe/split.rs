//! `split SET DIR`: the client's half of the per-region DAX test (guest/daxsplit.sh), one
//! process through libfabric-mm's Session API, in steps the script paces with files in DIR:
//!
//! 1. allocates A (4 MiB) and B (8 MiB) on SET, maps both at their GFAs, stores a pattern
//!    in B and then another in A, and checks both; names the device behind each descriptor
//!    (`/proc/self/fd` link); in forked children, maps each descriptor past its region's end
//!    and loads the region's last word (must work) and the first word past it (must not:
//!    `SIGBUS`, or a refused `mmap`); writes `regions` (`A|B NAME GFA LEN FD_OFFSET` lines);
//! 2. on `go-free`: frees A, writes `freed`;
//! 3. on `go-realloc`: allocates C (4 MiB), stores a pattern, writes `c` (`C NAME GFA LEN`);
//! 4. on `go-check` (after the script restarted fabricd): loads B and C again through the
//!    mappings made before the restart — a device fabricd had deleted or carved again would
//!    have taken the mappings with it — and exits.
//!
//! Failures go to stderr and exit 1; progress lines to stdout.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use fabric_mm::{Mapping, Memory, Session, Target};
use fabric_qemu_tests::daxsplit::SEEDS;
use fabric_qemu_tests::pattern;

const MIB: u64 = 1 << 20;
const SEED_A: u64 = SEEDS[0];
const SEED_B: u64 = SEEDS[1];
const SEED_C: u64 = SEEDS[2];

fn store(m: &Mapping, seed: u64) {
    let p = m.as_ptr().cast::<u64>();
    for i in 0..m.len() as u64 / 8 {
        // SAFETY: `p + i` lies in the live read-write mapping; no Rust reference to it exists.
        unsafe { p.add(i as usize).write_volatile(pattern::word(seed, i * 8)) };
    }
}

fn verify(m: &Mapping, seed: u64, what: &str) -> Result<(), String> {
    let p = m.as_ptr().cast::<u64>();
    for i in 0..m.len() as u64 / 8 {
        // SAFETY: as in `store`, a load.
        let got = unsafe { p.add(i as usize).read_volatile() };
        let want = pattern::word(seed, i * 8);
        if got != want {
            return Err(format!("{what}: offset {:#x}: {got:#018x}, expected {want:#018x}", i * 8));
        }
    }
    Ok(())
}

/// Every word of the mapping is zero: a new region on device memory never shows what its
/// range held before (fabricd zeroes it).
fn verify_zero(m: &Mapping, what: &str) -> Result<(), String> {
    let p = m.as_ptr().cast::<u64>();
    for i in 0..m.len() as u64 / 8 {
        // SAFETY: as in `store`, a load.
        let got = unsafe { p.add(i as usize).read_volatile() };
        if got != 0 {
            return Err(format!("{what}: offset {:#x}: {got:#018x}, expected zero", i * 8));
        }
    }
    Ok(())
}

/// The device node a descriptor is open on.
fn device_of(fd: BorrowedFd<'_>) -> Result<String, String> {
    let link = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::read_link(&link).map(|p| p.display().to_string()).map_err(|e| format!("{link}: {e}"))
}

/// How a forked child that mapped `fd` for `map_len` bytes and loaded the byte at `at` ended.
#[derive(Debug, PartialEq, Eq)]
enum Touch {
    /// The load worked.
    Loaded,
    /// `mmap` refused the length.
    MapRefused,
    /// The child died of this signal.
    Signal(i32),
    /// Anything else (exit status).
    Other(i32),
}

fn touch(fd: BorrowedFd<'_>, map_len: usize, at: usize) -> Touch {
    let raw = fd.as_raw_fd();
    // SAFETY: the child calls only mmap, one volatile load and _exit before it ends, none of
    // which takes a lock another thread of this process could hold at the fork.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: a new shared read-only mapping chosen by the kernel over an open descriptor.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ, libc::MAP_SHARED, raw, 0) };
        if p == libc::MAP_FAILED {
            // SAFETY: ends the child without running the parent's destructors.
            unsafe { libc::_exit(3) };
        }
        // SAFETY: `at < map_len`: inside the mapping; a page past the device's end faults
        // (SIGBUS), which is what is being tested.
        let _ = unsafe { p.cast::<u8>().add(at).read_volatile() };
        // SAFETY: as above.
        unsafe { libc::_exit(0) };
    }
    if pid < 0 {
        return Touch::Other(-1);
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out pointer.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFSIGNALED(status) {
        return Touch::Signal(libc::WTERMSIG(status));
    }
    match libc::WEXITSTATUS(status) {
        0 => Touch::Loaded,
        3 => Touch::MapRefused,
        n => Touch::Other(n),
    }
}

/// The descriptor reaches the region's last word and nothing past it.
fn bounded(fd: BorrowedFd<'_>, len: u64, what: &str) -> Result<String, String> {
    let map_len = (len + 2 * MIB) as usize;
    let inside = touch(fd, map_len, len as usize - 8);
    if inside != Touch::Loaded {
        return Err(format!("{what}: loading its last word through its descriptor: {inside:?}"));
    }
    match touch(fd, map_len, len as usize) {
        Touch::Signal(libc::SIGBUS) => Ok(format!("{what}: past its {len:#x} bytes: SIGBUS")),
        Touch::MapRefused => Ok(format!("{what}: past its {len:#x} bytes: mmap refused")),
        other => Err(format!("{what}: the byte past its {len:#x} bytes: {other:?}, expected SIGBUS")),
    }
}

fn wait_for(file: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !file.exists() {
        if Instant::now() > deadline {
            return Err(format!("{} did not appear within 120 s", file.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn put(file: &Path, text: &str) -> Result<(), String> {
    std::fs::write(file, text).map_err(|e| format!("{}: {e}", file.display()))
}

#[allow(clippy::print_stdout)] // A command-line tool run by guest scripts.
pub fn split(set: &str, dir: &Path) -> Result<String, String> {
    let s = Session::open().map_err(|e| format!("session: {e}"))?;
    let target = Target::Set(set.to_owned());
    let a = s.alloc(&target, 4 * MIB).map_err(|e| format!("alloc A: {e}"))?;
    let b = s.alloc(&target, 8 * MIB).map_err(|e| format!("alloc B: {e}"))?;
    let ma = s.map(&a).map_err(|e| format!("map A: {e}"))?;
    let mb = s.map(&b).map_err(|e| format!("map B: {e}"))?;
    verify_zero(&ma, "A, new")?;
    verify_zero(&mb, "B, new")?;
    // B first, then A: stores through A must leave B as it was.
    store(&mb, SEED_B);
    store(&ma, SEED_A);
    verify(&mb, SEED_B, "B after stores through A")?;
    verify(&ma, SEED_A, "A")?;
    let (fd_a, fd_b) = (a.fd().map_err(|e| e.to_string())?, b.fd().map_err(|e| e.to_string())?);
    let (dev_a, dev_b) = (device_of(fd_a)?, device_of(fd_b)?);
    println!("A on {dev_a}, B on {dev_b}: patterns stored and checked");
    println!("{}", bounded(fd_a, a.len(), "A")?);
    println!("{}", bounded(fd_b, b.len(), "B")?);
    let line = |n: &str, dev: &str, m: &Mapping, r: &fabric_mm::Region| {
        format!("{n} {dev} {:#x} {:#x} {:#x}\n", m.gfa(), r.len(), r.fd_offset())
    };
    put(&dir.join("regions"), &(line("A", &dev_a, &ma, &a) + &line("B", &dev_b, &mb, &b)))?;

    wait_for(&dir.join("go-free"))?;
    let gfa_a = ma.gfa();
    drop(ma);
    drop(a);
    put(&dir.join("freed"), &format!("{dev_a}\n"))?;

    wait_for(&dir.join("go-realloc"))?;
    let c = s.alloc(&target, 4 * MIB).map_err(|e| format!("alloc C after A was freed: {e}"))?;
    let mc = s.map(&c).map_err(|e| format!("map C: {e}"))?;
    verify_zero(&mc, "C, in the range A's pattern was in")?;
    store(&mc, SEED_C);
    verify(&mb, SEED_B, "B after stores through C")?;
    let dev_c = device_of(c.fd().map_err(|e| e.to_string())?)?;
    println!("C on {dev_c} at GFA {:#x} (A was at {gfa_a:#x})", mc.gfa());
    put(&dir.join("c"), &format!("C {dev_c} {:#x} {:#x}\n", mc.gfa(), c.len()))?;

    wait_for(&dir.join("go-check"))?;
    verify(&mb, SEED_B, "B through its mapping from before the restart")?;
    verify(&mc, SEED_C, "C through its mapping from before the restart")?;
    Ok(format!("B ({dev_b}) and C ({dev_c}) still hold their patterns through the mappings made before the restart"))
}
