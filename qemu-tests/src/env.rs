//! Where the tier's inputs are, and whether they are all there: QEMU 10.x, the cached
//! kernel and base initramfs (`scripts/qemu-image.sh`), and the statically linked project
//! binaries (`scripts/qemu-tests.sh` builds them).
//!
//! `FABRIC_QEMU_TESTS=1` (set by `scripts/test.sh`) makes the tier required: a missing input
//! fails the test. Without it a test with missing inputs says what is missing and passes
//! without running, so a plain `cargo nextest run --workspace` works on any laptop.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The project binaries every guest gets in `/fabric/bin`.
pub const BINARIES: [&str; 3] = ["fabricd", "fabricctl", "fabric-guest-probe"];

/// Everything a guest needs, found.
#[derive(Debug, Clone)]
pub struct Prereqs {
    /// `qemu-system-x86_64`.
    pub qemu: PathBuf,
    /// The 6.12 kernel.
    pub kernel: PathBuf,
    /// The base initramfs.
    pub base_initrd: PathBuf,
    /// Static binaries copied into each guest.
    pub binaries: Vec<PathBuf>,
    /// Where runs keep their logs (`target/qemu-tests`).
    pub logs: PathBuf,
}

/// The workspace's target directory.
pub fn target_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("target")
}

/// The cache the scripts fill: `$FABRIC_QEMU_CACHE`, else `/var/cache/fabric-qemu` as root,
/// else `${XDG_CACHE_HOME:-~/.cache}/fabric-qemu`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FABRIC_QEMU_CACHE") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/cache/fabric-qemu");
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
    base.join("fabric-qemu")
}

/// Whether an ELF file asks for a program interpreter (is dynamically linked).
fn has_interp(data: &[u8]) -> Option<bool> {
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 {
        return None;
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(data[32..40].try_into().ok()?) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    for i in 0..phnum {
        let o = phoff.checked_add(i.checked_mul(phentsize)?)?;
        let kind = u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?);
        if kind == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// Finds every input; `Err` lists what is missing and how to get it.
pub fn locate() -> Result<Prereqs, String> {
    let mut missing = Vec::new();
    let qemu = PathBuf::from(std::env::var_os("FABRIC_QEMU").unwrap_or_else(|| "qemu-system-x86_64".into()));
    match Command::new(&qemu).arg("--version").output() {
        Ok(o) => {
            let v = String::from_utf8_lossy(&o.stdout).into_owned();
            let major =
                v.split("version ").nth(1).and_then(|r| r.split('.').next()).and_then(|m| m.parse::<u32>().ok());
            if major.is_none_or(|m| m < 10) {
                missing.push(format!("{} is not QEMU 10.x ({})", qemu.display(), v.lines().next().unwrap_or("")));
            }
        }
        Err(e) => missing.push(format!("{}: {e}", qemu.display())),
    }
    let image = cache_dir().join("image");
    let kernel = image.join("vmlinuz");
    let base_initrd = image.join("base.cpio.gz");
    for f in [&kernel, &base_initrd] {
        if !f.is_file() {
            missing.push(format!("{} (scripts/qemu-image.sh builds it)", f.display()));
        }
    }
    let bins = std::env::var_os("FABRIC_QEMU_BINS")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("x86_64-unknown-linux-gnu").join("debug"));
    let mut binaries = Vec::new();
    for b in BINARIES {
        let p = bins.join(b);
        match fs::read(&p) {
            Ok(data) => match has_interp(&data) {
                Some(false) => binaries.push(p),
                Some(true) => missing.push(format!("{} is dynamically linked (build it with crt-static)", p.display())),
                None => missing.push(format!("{} is not an x86-64 ELF file", p.display())),
            },
            Err(_) => missing.push(format!("{} (scripts/qemu-tests.sh builds it statically)", p.display())),
        }
    }
    if !missing.is_empty() {
        return Err(missing.join("; "));
    }
    let logs = target_dir().join("qemu-tests");
    fs::create_dir_all(&logs).map_err(|e| format!("creating {}: {e}", logs.display()))?;
    Ok(Prereqs { qemu, kernel, base_initrd, binaries, logs })
}

/// The inputs, or `None` after saying why the test does not run. With
/// `FABRIC_QEMU_TESTS=1` a missing input is a failure instead.
#[allow(clippy::print_stderr)] // The test's own output: why it did not run.
pub fn prereqs_or_skip(test: &str) -> Option<Prereqs> {
    match locate() {
        Ok(p) => Some(p),
        Err(why) if std::env::var("FABRIC_QEMU_TESTS").as_deref() == Ok("1") => {
            panic!("{test}: the QEMU tier is required (FABRIC_QEMU_TESTS=1) but inputs are missing: {why}")
        }
        Err(why) => {
            eprintln!("{test}: not run: {why}. Run scripts/qemu-tests.sh (as root on Debian) to set the tier up.");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dynamic_elf_are_told_apart() {
        // This test binary is dynamically linked unless built with crt-static.
        let me = fs::read(std::env::current_exe().expect("exe")).expect("read");
        let dynamic = !cfg!(target_feature = "crt-static");
        assert_eq!(has_interp(&me), Some(dynamic));
        assert_eq!(has_interp(b"not an elf"), None);
    }
}
