//! `owner` and `importer`: device memory through fabricd and libfabric-mm's Session API, as a
//! runtime library would use it. The owner allocates on a CXL region's interleave set (its
//! DAX device) or a PCI BAR, maps the region at its GFA in the unified window, stores the
//! test pattern, has fabricd's copy engine copy it by GFA into another region of the same
//! device and loads that back, and exports it; the importer (another process) imports by handle, maps at
//! the same GFA and loads. The host then finds the owner's bytes in the device's memory.

use std::path::Path;
use std::time::{Duration, Instant};

use fabric_mm::{CopyEndpoint, Memory, MemoryClass, Policy, Session, Target};
use fabric_qemu_tests::pattern;

/// The allocation target: `set:NAME`, `numa:N` (the host_exported memory of NUMA node N's
/// device), or `bar:BDF` (the host_exported memory of the PCI function at BDF, found in the
/// daemon's device list).
fn target(s: &Session, spec: &str) -> Result<Target, String> {
    if let Some(name) = spec.strip_prefix("set:") {
        return Ok(Target::Set(name.to_owned()));
    }
    if let Some(node) = spec.strip_prefix("numa:") {
        // The host_exported memory fabricd made of a NUMA node it serves ([memory] numa).
        let devices = s.devices().map_err(|e| format!("devices: {e}"))?;
        let suffix = format!("/numa{node}");
        let dev = devices
            .into_iter()
            .find(|d| d.id.ends_with(&suffix) && d.memory.iter().any(|m| m.0 == MemoryClass::HostExported))
            .ok_or_else(|| format!("fabricd lists no numa{node} device with host_exported memory"))?;
        return Ok(Target::Device { device: dev.id, memory: MemoryClass::HostExported });
    }
    let Some(bdf) = spec.strip_prefix("bar:") else {
        return Err(format!("target {spec:?}: set:NAME, numa:N or bar:BDF"));
    };
    let devices = s.devices().map_err(|e| format!("devices: {e}"))?;
    let dev = devices
        .into_iter()
        .find(|d| d.id.ends_with(bdf) && d.memory.iter().any(|m| m.0 == MemoryClass::HostExported))
        .ok_or_else(|| format!("fabricd lists no device at {bdf} with host_exported memory"))?;
    Ok(Target::Device { device: dev.id, memory: MemoryClass::HostExported })
}

/// Allocates `len` bytes on `spec` (after a one-granule spacer), maps them at their GFA, stores the pattern for `seed`,
/// exports and writes `HANDLE GFA FD_OFFSET` to `out`; then waits (up to 60 s) for
/// `out.done`, which the importer makes, and frees the region by exiting.
pub fn owner(spec: &str, len: u64, seed: u64, out: &Path) -> Result<String, String> {
    let s = Session::open().map_err(|e| format!("session: {e}"))?;
    let target = target(&s, spec)?;
    // A first, smallest region takes the start of the device, so that the one under test
    // sits at a non-zero offset in the device file (the mmap offset path is exercised).
    let spacer = s.alloc(&target, 1).map_err(|e| format!("alloc on {target:?}: {e}"))?;
    let region = s.alloc(&target, len).map_err(|e| format!("alloc on {target:?}: {e}"))?;
    let m = s.map(&region).map_err(|e| format!("map at GFA {:?}: {e}", region.gfa()))?;
    if (m.len() as u64) < len {
        return Err(format!("the region is {} bytes, asked {len}", m.len()));
    }
    let p = m.as_ptr().cast::<u64>();
    for i in 0..len / 8 {
        // SAFETY: `p + i` lies in the live read-write mapping of the region; no Rust
        // reference to that memory exists.
        unsafe { p.add(i as usize).write_volatile(pattern::word(seed, i * 8)) };
    }
    let copied = engine_copy(&s, &spacer, &region, len, seed)?;
    let handle = s.export(&region, &Policy::default()).map_err(|e| format!("export: {e}"))?;
    let line = format!("{handle} {:#x} {:#x}\n", m.gfa(), region.fd_offset());
    std::fs::write(out, &line).map_err(|e| format!("{}: {e}", out.display()))?;
    let done = out.with_extension("done");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !done.exists() {
        if Instant::now() > deadline {
            return Err("the importer did not finish within 60 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(format!(
        "region {} at GFA {:#x} (fd offset {:#x}): {len:#x} bytes stored; {copied:#x} copied by the engine",
        region.id(),
        m.gfa(),
        region.fd_offset()
    ))
}

/// Has fabricd's copy engine copy the start of `region` into `into` by GFA — device memory
/// on both sides, whose file serves mmap only — and loads the copy back through a mapping
/// of `into`. Returns the bytes copied.
fn engine_copy(
    s: &Session,
    into: &fabric_mm::Region,
    region: &fabric_mm::Region,
    len: u64,
    seed: u64,
) -> Result<u64, String> {
    let (Some(dst), Some(src)) = (into.gfa(), region.gfa()) else {
        return Err("the regions have no GFA".into());
    };
    let n = len.min(Memory::len(into));
    let copy = s.copy(CopyEndpoint::Gfa(dst), CopyEndpoint::Gfa(src), n).map_err(|e| format!("copy: {e}"))?;
    let done = copy.wait().map_err(|e| format!("the copy into region {}: {e}", into.id()))?;
    let m = s.map(into).map_err(|e| format!("map region {}: {e}", into.id()))?;
    let p = m.as_ptr().cast::<u64>();
    for i in 0..n / 8 {
        // SAFETY: `p + i` lies in the live mapping of `into`; the copy completed.
        let got = unsafe { p.add(i as usize).read_volatile() };
        if got != pattern::word(seed, i * 8) {
            return Err(format!("the engine's copy differs at byte {:#x}: {got:#x}", i * 8));
        }
    }
    Ok(done)
}

/// Imports the handle in `file` (written by [`owner`]), maps it at its GFA and checks
/// `len` bytes of the pattern for `seed`; with `store`, imports read-write and then
/// stores the pattern for `store` there (flushed: another host may load it). Then makes
/// `file.done`.
pub fn importer(file: &Path, len: u64, seed: u64, store: Option<u64>) -> Result<String, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let mut it = text.split_whitespace();
    let handle: fabric_mm::Handle = it.next().ok_or("no handle")?.parse().map_err(|e| format!("handle: {e}"))?;
    let gfa = it.next().and_then(|g| u64::from_str_radix(g.trim_start_matches("0x"), 16).ok());
    let s = Session::open().map_err(|e| format!("session: {e}"))?;
    let result = (|| {
        let import = s.import(&handle, store.is_some()).map_err(|e| format!("import: {e}"))?;
        if import.gfa() != gfa {
            return Err(format!("the import is at GFA {:?}, the owner's region at {gfa:?}", import.gfa()));
        }
        let m = s.map(&import).map_err(|e| format!("map: {e}"))?;
        m.invalidate(0, len).map_err(|e| format!("invalidate: {e}"))?;
        let p = m.as_ptr().cast::<u64>();
        for i in 0..len / 8 {
            // SAFETY: `p + i` lies in the live mapping of the import.
            let got = unsafe { p.add(i as usize).read_volatile() };
            let want = pattern::word(seed, i * 8);
            if got != want {
                return Err(format!("offset {:#x}: {got:#018x}, expected {want:#018x}", i * 8));
            }
        }
        let owner = handle.node().map_or_else(|| "this node".to_owned(), |n| format!("node {n}"));
        let coherence = if m.coherent() { "coherent" } else { "not coherent: flush and invalidate do the cache work" };
        let mut said = format!(
            "import of region {} of {owner} at GFA {:#x}: {len:#x} bytes match; {coherence}",
            import.id(),
            m.gfa()
        );
        if let Some(store) = store {
            for i in 0..len / 8 {
                // SAFETY: `p + i` lies in the live read-write mapping of the import; no
                // Rust reference to that memory exists.
                unsafe { p.add(i as usize).write_volatile(pattern::word(store, i * 8)) };
            }
            m.flush(0, len).map_err(|e| format!("flush: {e}"))?;
            said.push_str(&format!("; stored {len:#x} bytes of seed {store:#x}"));
        }
        Ok(said)
    })();
    let _ = std::fs::write(file.with_extension("done"), "");
    result
}

/// Imports the handle in `file` (read-only), maps it, checks its first word, writes
/// `ready`, then loads the whole region every 10 ms: the owner's free (or revoke) must end
/// the access — fabricd deletes the import's DAX device, the kernel zaps the mapping and
/// the next load raises `SIGBUS`, which kills this process (the guest script checks the
/// signal). The session keeps revoked mappings (no library fence, which would fault with
/// `SIGSEGV` first), so the signal shows the device's deletion. Still loading after
/// `wait_s` is the error.
pub fn hold(file: &Path, len: u64, seed: u64, ready: &Path, wait_s: u64) -> Result<String, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let handle: fabric_mm::Handle =
        text.split_whitespace().next().ok_or("no handle")?.parse().map_err(|e| format!("handle: {e}"))?;
    let config = fabric_mm::SessionConfig { keep_revoked_mappings: true, ..fabric_mm::SessionConfig::default() };
    let s = Session::open_with(config).map_err(|e| format!("session: {e}"))?;
    let import = s.import(&handle, false).map_err(|e| format!("import: {e}"))?;
    let m = s.map(&import).map_err(|e| format!("map: {e}"))?;
    let p = m.as_ptr().cast::<u64>();
    // SAFETY: the first word lies in the live mapping of the import.
    let first = unsafe { p.read_volatile() };
    if first != pattern::word(seed, 0) {
        return Err(format!("offset 0: {first:#018x}, expected {:#018x}", pattern::word(seed, 0)));
    }
    std::fs::write(ready, "mapped\n").map_err(|e| format!("{}: {e}", ready.display()))?;
    let deadline = Instant::now() + Duration::from_secs(wait_s);
    let mut sum = 0u64;
    while Instant::now() < deadline {
        for i in 0..len / 8 {
            // SAFETY: `p + i` lies in the mapping, which stays in this process's address
            // space; a load of memory the kernel took away faults (the point of the test).
            sum = sum.wrapping_add(unsafe { p.add(i as usize).read_volatile() });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(format!(
        "import {} still loads {wait_s} s after it was mapped (sum {sum:#x}): the owner's free did not end it",
        import.id()
    ))
}
