//! `power-workload` and `power-observe`: the guest's half of the power-loss test
//! (`qemu-tests/tests/power.rs`, the model in `fabric_qemu_tests::power`).
//!
//! The workload changes the memory registry on one connection (alloc, write the region's
//! pages and `msync` them, export, revoke, free) and prints each change to the data port as
//! soon as the daemon ACKNOWLEDGED it, after a `T` line that says what it is about to try.
//! The host cuts the power (SIGKILL of QEMU) at a random moment, so the last `T` may have
//! no answer. The observer runs in the next boot, after fabricd replayed its journal, and
//! writes what the registry and the disk hold now as JSON for the host to compare.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ExportHandle, ExportPolicy,
    ExportRequest, FreeRequest, ImportRequest, MemoryClass, RegionsRequest, ReleaseRequest, Request, Response,
    RevokeRequest, SUPPORTED_VERSIONS, SessionToken, StatusRequest,
};
use fabric_qemu_tests::power::{PAGE, page_class, region_seed, written_pages};

/// The workload stops by itself after this long (the host cuts the power well before).
const WORKLOAD_LIMIT: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// xorshift64*: reproducible from the seed the host gives.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

fn socket() -> String {
    std::env::var("FABRIC_SOCKET").unwrap_or_else(|_| "/run/fabric/fabricd.sock".into())
}

fn connect(resume: Option<SessionToken>) -> Result<(Connection, SessionToken, bool), String> {
    let open = || -> Result<Connection, String> {
        let s = std::os::unix::net::UnixStream::connect(socket()).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| format!("timeout: {e}"))?;
        Ok(Connection::new(s))
    };
    let mut c = open()?;
    match c.hello_with("power-workload", SUPPORTED_VERSIONS, resume) {
        Ok(h) => Ok((c, h.token.ok_or("no session token")?, resume.is_some())),
        // No orphaned session with this token: everything it held was freed.
        Err(CodecError::Refused { body, .. })
            if resume.is_some() && body.code == fabric_proto::wire::ErrorCode::NotFound =>
        {
            let mut c = open()?;
            let h = c.hello("power-workload", SUPPORTED_VERSIONS).map_err(|e| format!("hello: {e}"))?;
            Ok((c, h.token.ok_or("no session token")?, false))
        }
        Err(e) => Err(format!("hello: {e}")),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A token as [`hex`] wrote it.
pub fn parse_token(s: &str) -> Option<SessionToken> {
    let s = s.trim();
    if s.len() != 32 {
        return None;
    }
    let mut b = [0u8; 16];
    for (i, out) in b.iter_mut().enumerate() {
        *out = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(SessionToken(b))
}

fn call(c: &mut Connection, req: Request) -> Result<(Response, Vec<OwnedFd>), String> {
    c.call(req, &[]).map_err(|e| format!("{e}"))
}

/// Stores the region's pattern in its written pages through a shared mapping of `fd` and
/// `msync`s them: from then on they are on the disk.
fn write_pages(fd: &OwnedFd, region: u64, generation: u64, len: u64) -> Result<(), String> {
    // SAFETY: a fresh shared mapping of the region's file, which only this process maps;
    // the daemon never truncates a live region's file. Unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    let seed = region_seed(region, generation);
    for page in written_pages(len) {
        for w in 0..PAGE / 8 {
            let off = page * PAGE + w * 8;
            // SAFETY: `off` is inside the mapping (written_pages stays below len); no Rust
            // reference to the mapped memory exists.
            unsafe {
                p.cast::<u8>()
                    .add(off as usize)
                    .cast::<u64>()
                    .write_volatile(fabric_qemu_tests::pattern::word(seed, off))
            };
        }
    }
    // SAFETY: `p` is the mapping made above, `len` its length.
    let synced = unsafe { libc::msync(p, len as usize, libc::MS_SYNC) };
    let err = std::io::Error::last_os_error();
    // SAFETY: as above; nothing refers to the mapping after this.
    unsafe { libc::munmap(p, len as usize) };
    if synced != 0 {
        return Err(format!("msync: {err}"));
    }
    Ok(())
}

/// Runs until the power goes (or [`WORKLOAD_LIMIT`]), writing one line per step to `out`
/// (the data port): `H TOKEN [resumed]`, then `T A|E id|V handle|F id` before each change
/// and `A id gen len`, `S id`, `E id gen handle`, `V handle`, `F id` once acknowledged.
pub fn workload(out: &Path, resume: Option<SessionToken>, seed: u64) -> Result<String, String> {
    let mut tty = File::options().write(true).open(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut say = |line: String| -> Result<(), String> {
        tty.write_all(format!("{line}\n").as_bytes()).and_then(|()| tty.flush()).map_err(|e| format!("data port: {e}"))
    };
    let device = {
        let s = fabric_mm::Session::open().map_err(|e| format!("session: {e}"))?;
        s.first_device_with(fabric_mm::MemoryClass::CxlVolatile)
            .map_err(|e| format!("devices: {e}"))?
            .ok_or("no device with CXL volatile memory")?
            .id
    };
    let (mut c, token, resumed) = connect(resume)?;
    say(format!("H {}{}", hex(token.expose()), if resumed { " resumed" } else { "" }))?;
    // (id, len) of the live regions this session owns; handles it exported.
    let mut live: Vec<(u64, u64)> = Vec::new();
    let mut handles: Vec<ExportHandle> = Vec::new();
    if resumed {
        match call(&mut c, Request::Regions(RegionsRequest { all: false }))? {
            (Response::Regions(r), _) => live.extend(r.regions.iter().map(|r| (r.region, r.size))),
            (other, _) => return Err(format!("regions answered {other:?}")),
        }
    }
    let mut rng = Rng(seed | 1);
    let start = Instant::now();
    let mut steps = 0u64;
    while start.elapsed() < WORKLOAD_LIMIT {
        steps += 1;
        let roll = rng.below(100);
        if live.is_empty() || (roll < 40 && live.len() < 10) {
            let size = (1 + rng.below(2)) * 2 * MIB;
            say("T A".into())?;
            let target =
                AllocTarget::Device { device: DeviceName::truncated(&device), memory: MemoryClass::CxlVolatile };
            match call(&mut c, Request::Alloc(AllocRequest { target, size, align: 0 }))? {
                (Response::Alloc(a), fds) => {
                    say(format!("A {} {} {}", a.region, a.generation, a.size))?;
                    let fd = fds.into_iter().next().ok_or("alloc: no descriptor")?;
                    // A third of the regions stay untouched: nothing but the daemon's own
                    // fsyncs makes their files durable.
                    if rng.below(3) > 0 {
                        write_pages(&fd, a.region, a.generation, a.size)?;
                        say(format!("S {}", a.region))?;
                    }
                    live.push((a.region, a.size));
                }
                (other, _) => return Err(format!("alloc answered {other:?}")),
            }
        } else if roll < 60 {
            let (id, _) = live[rng.below(live.len() as u64) as usize];
            say(format!("T E {id}"))?;
            let policy = ExportPolicy {
                uids: BoundedVec::default(),
                gids: BoundedVec::default(),
                partition: None,
                access: AccessMode::ReadOnly,
            };
            match call(&mut c, Request::Export(ExportRequest { region: id, policy, node: None }))? {
                (Response::Export(e), _) => {
                    say(format!("E {id} {} {}", e.handle.generation, e.handle))?;
                    handles.push(e.handle);
                }
                (other, _) => return Err(format!("export answered {other:?}")),
            }
        } else if roll < 70 && !handles.is_empty() {
            let h = handles.swap_remove(rng.below(handles.len() as u64) as usize);
            if !live.iter().any(|(id, _)| *id == h.region) {
                continue;
            }
            say(format!("T V {h}"))?;
            call(&mut c, Request::Revoke(RevokeRequest { handle: h }))?;
            say(format!("V {h}"))?;
        } else {
            let (id, _) = live.swap_remove(rng.below(live.len() as u64) as usize);
            say(format!("T F {id}"))?;
            call(&mut c, Request::Free(FreeRequest { region: id, node: None }))?;
            say(format!("F {id}"))?;
            handles.retain(|h| h.region != id);
        }
    }
    Ok(format!("power workload: {steps} steps, no power loss within {WORKLOAD_LIMIT:?}"))
}

/// Counts of a region's pages: written pages with its pattern, written pages still zero,
/// and pages that are neither what was written nor zero (never allowed).
fn classify(
    read: impl Fn(&mut [u8], u64) -> std::io::Result<()>,
    region: u64,
    generation: u64,
    len: u64,
) -> Result<[u64; 3], String> {
    let mut counts = [0u64; 3];
    let written: Vec<u64> = written_pages(len).collect();
    let mut buf = vec![0u8; PAGE as usize];
    let seed = region_seed(region, generation);
    for page in 0..len / PAGE {
        read(&mut buf, page * PAGE).map_err(|e| format!("reading page {page}: {e}"))?;
        match page_class(&buf, seed, page * PAGE, written.contains(&page)) {
            Some(true) => counts[0] += 1,
            Some(false) if written.contains(&page) => counts[1] += 1,
            Some(false) => {}
            None => counts[2] += 1,
        }
    }
    Ok(counts)
}

/// Region files (`r<id>`) under the sim memory directory `memory`, by id.
fn region_files(memory: &Path) -> BTreeMap<u64, std::path::PathBuf> {
    let mut out = BTreeMap::new();
    for res in std::fs::read_dir(memory).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(res.path()).into_iter().flatten().flatten() {
            let name = f.file_name();
            if let Some(id) = name.to_str().and_then(|n| n.strip_prefix('r')).and_then(|d| d.parse().ok()) {
                out.insert(id, f.path());
            }
        }
    }
    out
}

/// What the registry and the disk hold after a restart, as JSON in `out`: every region
/// (`Regions` with `all`) with its file's size and page counts, every export, region files
/// no region names, the import of each handle in `handles` (one per line), and `status`.
pub fn observe(memory: &Path, handles: &Path, out: &Path) -> Result<String, String> {
    let (mut c, _, _) = connect(None)?;
    let (regions, exports) = match call(&mut c, Request::Regions(RegionsRequest { all: true }))? {
        (Response::Regions(r), _) => (r.regions.into_vec(), r.exports.into_vec()),
        (other, _) => return Err(format!("regions answered {other:?}")),
    };
    let mut files = region_files(memory);
    let mut jregions = Vec::new();
    for r in &regions {
        let file = files.remove(&r.region);
        let (size, pages) = match &file {
            Some(p) => {
                let f = File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
                let size = f.metadata().map_err(|e| format!("{}: {e}", p.display()))?.len();
                let pages = if size == r.size {
                    Some(classify(|b, at| f.read_exact_at(b, at), r.region, r.generation, size)?)
                } else {
                    None
                };
                (Some(size), pages)
            }
            None => (None, None),
        };
        jregions.push(serde_json::json!({
            "id": r.region, "generation": r.generation, "size": r.size, "file_size": size, "pages": pages,
        }));
    }
    let jexports: Vec<_> = exports
        .iter()
        .map(|e| serde_json::json!({ "region": e.region, "generation": e.generation, "revoked": e.revoked }))
        .collect();
    let mut imports = serde_json::Map::new();
    let text = std::fs::read_to_string(handles).unwrap_or_default();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let handle: ExportHandle = line.parse().map_err(|e| format!("handle {line}: {e}"))?;
        let got = match c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]) {
            Ok((Response::Import(imp), fds)) => {
                let f = File::from(fds.into_iter().next().ok_or("import: no descriptor")?);
                let pages =
                    classify(|b, at| f.read_exact_at(b, imp.offset + at), imp.region, imp.generation, imp.size)?;
                call(&mut c, Request::Release(ReleaseRequest { import: imp.import }))?;
                serde_json::json!({ "ok": pages })
            }
            Ok((other, _)) => return Err(format!("import answered {other:?}")),
            Err(CodecError::Refused { body, .. }) => serde_json::json!({ "refused": format!("{:?}", body.code) }),
            Err(e) => return Err(format!("import: {e}")),
        };
        imports.insert(line.to_owned(), got);
    }
    let problems = match call(&mut c, Request::Status(StatusRequest {}))? {
        (Response::Status(s), _) => s
            .problems
            .iter()
            .map(|p| format!("{:?} {}: {}", p.kind, p.subject.as_str(), p.detail.as_str()))
            .collect::<Vec<_>>(),
        (other, _) => return Err(format!("status answered {other:?}")),
    };
    let doc = serde_json::json!({
        "regions": jregions,
        "exports": jexports,
        "stray_files": files.keys().collect::<Vec<_>>(),
        "imports": imports,
        "problems": problems,
    });
    std::fs::write(out, doc.to_string()).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(format!("{} regions, {} exports, {} handles imported", regions.len(), exports.len(), imports.len()))
}
