//! Crash recovery of the memory registry under load: a workload process (this test binary
//! re-run as `crash_workload`) runs threads that allocate (on a CXL memory device of the
//! sim CXL pool, or striped over its 2-way interleave set, whose first member is that
//! device), write a pattern through the mapping, export, import, revoke, release and free
//! concurrently, each on its own connection, and prints every change the daemon
//! ACKNOWLEDGED. The test `kill -9`s the
//! daemon after a random delay, waits until every workload thread saw the crash, restarts
//! the daemon and checks, against the acknowledged changes:
//!
//! - every acknowledged live region exists: its file, its size, the pattern written;
//! - every acknowledged free is gone;
//! - acknowledged, unrevoked exports still import (and show the pattern); acknowledged
//!   revocations are still revoked;
//! - the registry counts exactly the region files there are, and a file the workload was
//!   never told about belongs to an allocation that a crash left unacknowledged.
//!
//! Then the workload threads take their sessions back by token and go on. Many crash
//! points, bounded time; it prints how many it survived.
#![allow(clippy::unwrap_used, clippy::print_stdout, clippy::print_stderr, reason = "the workload's acknowledgements")]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ErrorCode, ExportHandle,
    ExportPolicy, ExportRequest, FreeRequest, ImportRequest, MemoryClass, Name, ReleaseRequest, Request, Response,
    RevokeRequest, SUPPORTED_VERSIONS, SessionToken, StatusRequest,
};
use fabric_topology::MemoryKind;
use memmap2::{Mmap, MmapMut, MmapOptions};

const ENV_SOCKET: &str = "FABRICD_CRASH_SOCKET";
const ENV_SEED: &str = "FABRICD_CRASH_SEED";
const THREADS: usize = 3;
const MIN_ROUNDS: usize = 30;
const MAX_ROUNDS: usize = 80;
const BUDGET: Duration = Duration::from_secs(45);
const MIB: u64 = 1 << 20;

/// xorshift64*: reproducible from a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pattern(region: u64, i: u64) -> u8 {
    region.wrapping_mul(131).wrapping_add(i.wrapping_mul(7)) as u8
}

fn cxl_pool() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap()
}

/// The CXL pool's 2-way interleave set and its first member (a CXL memory device).
fn set_and_member() -> (String, String) {
    let inv = fabric_drivers::sim::load(&cxl_pool()).unwrap();
    let set = fabric_addrmap::region_sets(&inv).into_iter().find(|s| s.ways == 2).unwrap();
    assert_eq!(set.members[0].kind, MemoryKind::CxlVolatile);
    (set.name.clone(), set.members[0].device.to_string())
}

// ---------------------------------------------------------------- the workload process

/// What a workload call came to: done, refused by the daemon, or the daemon went away.
enum Outcome<T> {
    Ok(T),
    Refused(ErrorCode),
    Down,
}

fn call(c: &mut Connection, req: Request) -> Outcome<(Response, Vec<std::os::fd::OwnedFd>)> {
    match c.call(req, &[]) {
        Ok(r) => Outcome::Ok(r),
        Err(CodecError::Refused { body, .. }) => Outcome::Refused(body.code),
        Err(_) => Outcome::Down,
    }
}

struct Out(Mutex<std::io::Stdout>);

impl Out {
    fn line(&self, s: &str) {
        let mut o = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // The parent is gone if this fails; the stdin thread ends the process.
        let _ = writeln!(o, "{s}");
        let _ = o.flush();
    }
}

struct Shared {
    out: Out,
    /// Bumped by every "go" from the parent.
    epoch: Mutex<u64>,
    wake: Condvar,
    /// Handles any thread exported, for others to import.
    handles: Mutex<Vec<ExportHandle>>,
    socket: String,
    /// The CXL memory device regions go on, or the interleave set they are striped over.
    device: String,
    set: String,
}

struct Owned {
    id: u64,
    map: MmapMut,
    exports: Vec<ExportHandle>,
}

struct Imported {
    id: u64,
    region: u64,
    map: Mmap,
}

struct Worker {
    t: usize,
    rng: Rng,
    shared: Arc<Shared>,
    token: Option<SessionToken>,
    regions: Vec<Owned>,
    imports: Vec<Imported>,
    pending_free: Vec<u64>,
    pending_revoke: Vec<ExportHandle>,
}

fn check_mapping(region: u64, map: &[u8]) {
    let len = map.len() as u64;
    for i in [0, 1, 4095, len / 2, len - 1] {
        assert_eq!(map[i as usize], pattern(region, i), "region {region}: byte {i} through a mapping");
    }
}

impl Worker {
    /// Connects and takes the session back; `None` when the daemon is down (again).
    fn connect(&mut self) -> Option<Connection> {
        let s = std::os::unix::net::UnixStream::connect(&self.shared.socket).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut c = Connection::new(s);
        let hello = match c.hello_with("crash-workload", SUPPORTED_VERSIONS, self.token) {
            Ok(h) => h,
            Err(CodecError::Refused { body, .. }) if body.code == ErrorCode::NotFound => {
                assert!(
                    self.regions.is_empty(),
                    "thread {}: resume refused but {} acknowledged regions were live",
                    self.t,
                    self.regions.len()
                );
                c.hello("crash-workload", SUPPORTED_VERSIONS).ok()?
            }
            Err(CodecError::Refused { body, .. }) => panic!("thread {}: hello refused: {body:?}", self.t),
            Err(_) => return None,
        };
        let token = hello.token.unwrap();
        if self.token == Some(token) {
            self.shared.out.line(&format!("R {}", self.t));
        }
        self.token = Some(token);
        Some(c)
    }

    /// Settles what a crash left uncertain and checks the mappings kept across it.
    fn after_restart(&mut self, c: &mut Connection) -> bool {
        // Imports end with the daemon; the mappings stay valid (they hold the file).
        for i in self.imports.drain(..) {
            check_mapping(i.region, &i.map);
        }
        for r in &self.regions {
            check_mapping(r.id, &r.map);
        }
        for id in std::mem::take(&mut self.pending_free) {
            match call(c, Request::Free(FreeRequest { region: id, node: None })) {
                Outcome::Ok(_) | Outcome::Refused(ErrorCode::NotFound) => self.shared.out.line(&format!("F {id}")),
                Outcome::Refused(code) => panic!("thread {}: free {id} after restart: {code:?}", self.t),
                Outcome::Down => {
                    self.pending_free.push(id);
                    return false;
                }
            }
        }
        for h in std::mem::take(&mut self.pending_revoke) {
            match call(c, Request::Revoke(RevokeRequest { handle: h })) {
                Outcome::Ok(_) => self.shared.out.line(&format!("V {h}")),
                Outcome::Refused(code) => panic!("thread {}: revoke after restart: {code:?}", self.t),
                Outcome::Down => {
                    self.pending_revoke.push(h);
                    return false;
                }
            }
        }
        true
    }

    /// Works until the daemon goes away, reports it ("D"), waits for the parent's "go"
    /// (the daemon restarted and checked), takes the session back, and goes on.
    fn run(mut self) {
        let mut seen = *self.shared.epoch.lock().unwrap();
        let mut c = self.connect().expect("the daemon is up at start");
        self.shared.out.line(&format!("S {}", self.t));
        loop {
            if self.step(&mut c) {
                continue;
            }
            self.shared.out.line(&format!("D {}", self.t));
            loop {
                let mut e = self.shared.epoch.lock().unwrap();
                while *e <= seen {
                    e = self.shared.wake.wait(e).unwrap();
                }
                seen = *e;
                drop(e);
                if let Some(mut again) = self.connect()
                    && self.after_restart(&mut again)
                {
                    c = again;
                    break;
                }
                // Killed again before this thread got back: that crash's report.
                self.shared.out.line(&format!("D {}", self.t));
            }
        }
    }

    /// One random operation; false when the daemon went away.
    fn step(&mut self, c: &mut Connection) -> bool {
        let roll = self.rng.below(100);
        let t = self.t;
        if roll < 30 && self.regions.len() < 6 || self.regions.is_empty() {
            let len = (1 + self.rng.below(2)) * 2 * MIB;
            // Half the regions are striped over the set (a set region is a multiple of
            // 4 MiB: 2 ways x 2 MiB), sharing the member's DPA space with the others.
            let target = if self.rng.below(2) == 0 {
                AllocTarget::Set(Name::truncated(&self.shared.set))
            } else {
                AllocTarget::Device {
                    device: DeviceName::truncated(&self.shared.device),
                    memory: MemoryClass::CxlVolatile,
                }
            };
            let req = Request::Alloc(AllocRequest { target, size: len, align: 0 });
            match call(c, req) {
                Outcome::Ok((Response::Alloc(a), mut fds)) => {
                    self.shared.out.line(&format!("A {t} {} {}", a.region, a.size));
                    let f = File::from(fds.remove(0));
                    // SAFETY: a region file only this workload maps; the daemon never
                    // truncates a live region's file.
                    let mut map = unsafe { MmapOptions::new().len(a.size as usize).map_mut(&f) }.unwrap();
                    for (i, b) in map.iter_mut().enumerate() {
                        *b = pattern(a.region, i as u64);
                    }
                    self.shared.out.line(&format!("W {}", a.region));
                    self.regions.push(Owned { id: a.region, map, exports: Vec::new() });
                }
                Outcome::Ok(other) => panic!("alloc answered {other:?}"),
                Outcome::Refused(code) => panic!("thread {t}: alloc refused: {code:?}"),
                Outcome::Down => {
                    self.shared.out.line(&format!("U {t}"));
                    return false;
                }
            }
        } else if roll < 45 {
            let i = self.rng.below(self.regions.len() as u64) as usize;
            if self.regions[i].exports.len() >= 3 {
                return true;
            }
            let region = self.regions[i].id;
            let policy = ExportPolicy {
                uids: BoundedVec::default(),
                gids: BoundedVec::default(),
                partition: None,
                access: AccessMode::ReadOnly,
            };
            match call(c, Request::Export(ExportRequest { region, policy, node: None })) {
                Outcome::Ok((Response::Export(e), _)) => {
                    self.shared.out.line(&format!("E {t} {region} {}", e.handle));
                    self.regions[i].exports.push(e.handle);
                    self.shared.handles.lock().unwrap().push(e.handle);
                }
                Outcome::Ok(other) => panic!("export answered {other:?}"),
                Outcome::Refused(code) => panic!("thread {t}: export refused: {code:?}"),
                Outcome::Down => return false,
            }
        } else if roll < 65 {
            if self.imports.len() >= 8 {
                return true;
            }
            let handle = {
                let hs = self.shared.handles.lock().unwrap();
                if hs.is_empty() {
                    return true;
                }
                hs[self.rng.below(hs.len() as u64) as usize]
            };
            match call(c, Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly })) {
                Outcome::Ok((Response::Import(imp), mut fds)) => {
                    let f = File::from(fds.remove(0));
                    // SAFETY: as for the owner's mapping; read-only.
                    let map = unsafe { MmapOptions::new().len(imp.size as usize).map(&f) }.unwrap();
                    check_mapping(imp.region, &map);
                    self.imports.push(Imported { id: imp.import, region: imp.region, map });
                }
                Outcome::Ok(other) => panic!("import answered {other:?}"),
                // Revoked, or its region freed: both fine here.
                Outcome::Refused(ErrorCode::Revoked | ErrorCode::InvalidHandle) => {}
                Outcome::Refused(code) => panic!("thread {t}: import refused: {code:?}"),
                Outcome::Down => return false,
            }
        } else if roll < 75 {
            let Some(i) = self.imports.len().checked_sub(1) else { return true };
            let id = self.imports[i].id;
            match call(c, Request::Release(ReleaseRequest { import: id })) {
                Outcome::Ok(_) | Outcome::Refused(ErrorCode::NotFound) => {
                    self.imports.pop();
                }
                Outcome::Refused(code) => panic!("thread {t}: release refused: {code:?}"),
                Outcome::Down => return false,
            }
        } else if roll < 83 {
            let i = self.rng.below(self.regions.len() as u64) as usize;
            let Some(h) = self.regions[i].exports.pop() else { return true };
            match call(c, Request::Revoke(RevokeRequest { handle: h })) {
                Outcome::Ok(_) => self.shared.out.line(&format!("V {h}")),
                Outcome::Refused(code) => panic!("thread {t}: revoke refused: {code:?}"),
                Outcome::Down => {
                    self.shared.out.line(&format!("PV {h}"));
                    self.pending_revoke.push(h);
                    return false;
                }
            }
        } else {
            let i = self.rng.below(self.regions.len() as u64) as usize;
            let r = self.regions.swap_remove(i);
            match call(c, Request::Free(FreeRequest { region: r.id, node: None })) {
                Outcome::Ok(_) => self.shared.out.line(&format!("F {}", r.id)),
                Outcome::Refused(code) => panic!("thread {t}: free refused: {code:?}"),
                Outcome::Down => {
                    self.shared.out.line(&format!("PF {}", r.id));
                    self.pending_free.push(r.id);
                    return false;
                }
            }
        }
        true
    }
}

fn workload(socket: String, seed: u64) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        std::process::exit(101);
    }));
    let (set, device) = set_and_member();
    let shared = Arc::new(Shared {
        out: Out(Mutex::new(std::io::stdout())),
        epoch: Mutex::new(0),
        wake: Condvar::new(),
        handles: Mutex::new(Vec::new()),
        socket,
        device,
        set,
    });
    // End the harness's "test crash_workload ... " line so each acknowledgement has its own.
    shared.out.line("");
    let s = shared.clone();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() {
                break;
            }
            *s.epoch.lock().unwrap() += 1;
            s.wake.notify_all();
        }
        // The parent closed stdin or went away.
        std::process::exit(0);
    });
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let w = Worker {
                t,
                rng: Rng((seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1),
                shared: shared.clone(),
                token: None,
                regions: Vec::new(),
                imports: Vec::new(),
                pending_free: Vec::new(),
                pending_revoke: Vec::new(),
            };
            std::thread::spawn(move || w.run())
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
}

/// The workload half of [`acknowledged_registry_changes_survive_kill_9`], run by it in a
/// process of its own; it does nothing when run directly.
#[test]
#[ignore = "the workload process of acknowledged_registry_changes_survive_kill_9, which runs it"]
fn crash_workload() {
    if let Ok(socket) = std::env::var(ENV_SOCKET) {
        let seed = std::env::var(ENV_SEED).ok().and_then(|s| s.parse().ok()).unwrap_or(1);
        workload(socket, seed);
    }
}

// ---------------------------------------------------------------- the test

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExportState {
    Live,
    Revoked,
    PendingRevoke,
}

#[derive(Debug, Default)]
struct Model {
    /// Acknowledged live regions: id -> (len, pattern written).
    live: BTreeMap<u64, (u64, bool)>,
    freed: BTreeSet<u64>,
    pending_free: BTreeSet<u64>,
    exports: Vec<(ExportHandle, u64, ExportState)>,
    /// Allocations whose answer a crash cut off.
    uncertain_allocs: usize,
    /// Region files of such allocations found so far.
    leaked: BTreeSet<u64>,
    down: usize,
    /// Worker threads connected at start.
    started: usize,
    resumed: usize,
    acks: usize,
}

impl Model {
    fn record(&mut self, line: &str) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let n = |i: usize| f[i].parse::<u64>().unwrap();
        match f.first().copied() {
            Some("A") => {
                assert!(self.live.insert(n(2), (n(3), false)).is_none(), "region {} acknowledged twice", n(2));
                self.acks += 1;
            }
            Some("W") => self.live.get_mut(&n(1)).unwrap().1 = true,
            Some("E") => {
                self.exports.push((f[3].parse().unwrap(), n(2), ExportState::Live));
                self.acks += 1;
            }
            Some("V" | "PV") => {
                let h: ExportHandle = f[1].parse().unwrap();
                let e = self.exports.iter_mut().find(|e| e.0 == h).unwrap();
                e.2 = if f[0] == "V" { ExportState::Revoked } else { ExportState::PendingRevoke };
                self.acks += usize::from(f[0] == "V");
            }
            Some("F") => {
                self.live.remove(&n(1));
                self.pending_free.remove(&n(1));
                self.freed.insert(n(1));
                self.exports.retain(|e| e.1 != n(1));
                self.acks += 1;
            }
            Some("PF") => {
                self.pending_free.insert(n(1));
            }
            Some("U") => self.uncertain_allocs += 1,
            Some("D") => self.down += 1,
            Some("S") => self.started += 1,
            Some("R") => self.resumed += 1,
            // The test harness's own lines.
            _ => {}
        }
    }
}

fn region_files(state: &Path) -> BTreeMap<u64, (std::path::PathBuf, u64)> {
    let mut out = BTreeMap::new();
    let Ok(dirs) = std::fs::read_dir(state.join("memory")) else { return out };
    // The resources' directories (the memory root also holds records: `offers.record`).
    for d in dirs.flatten().filter(|d| d.file_type().is_ok_and(|t| t.is_dir())) {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_prefix('r').and_then(|s| s.parse().ok()) {
                out.insert(id, (f.path(), f.metadata().unwrap().len()));
            }
        }
    }
    out
}

fn check_bytes(round: usize, id: u64, f: &File, len: u64) {
    for at in [0, len - 4096] {
        let mut buf = vec![0u8; 4096];
        f.read_exact_at(&mut buf, at).unwrap();
        for (i, b) in buf.iter().enumerate() {
            let off = at + i as u64;
            assert_eq!(*b, pattern(id, off), "round {round}: region {id}: byte {off} after the restart");
        }
    }
}

fn check(round: usize, m: &mut Model, state: &Path, c: &mut Connection) -> (usize, usize) {
    let files = region_files(state);
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    assert_eq!(s.regions as usize, files.len(), "round {round}: the registry counts exactly the region files");
    // After kill -9 the journal and the files agree: nothing is dropped at start.
    let dropped: Vec<_> = s.problems.iter().filter(|p| p.subject.as_str() == "memory").collect();
    assert!(dropped.is_empty(), "round {round}: start-up dropped regions: {dropped:?}");
    for (id, (len, written)) in &m.live {
        if m.pending_free.contains(id) {
            continue;
        }
        let (path, size) = files.get(id).unwrap_or_else(|| panic!("round {round}: acknowledged region {id} lost"));
        assert_eq!(size, len, "round {round}: region {id} size");
        if *written {
            check_bytes(round, *id, &File::open(path).unwrap(), *len);
        }
    }
    for id in &m.freed {
        assert!(!files.contains_key(id), "round {round}: acknowledged free of region {id} undone");
    }
    for id in files.keys() {
        if !m.live.contains_key(id) && !m.pending_free.contains(id) {
            m.leaked.insert(*id);
        }
    }
    assert!(
        m.leaked.len() <= m.uncertain_allocs,
        "round {round}: {} region files no acknowledged region names, only {} allocations unacknowledged",
        m.leaked.len(),
        m.uncertain_allocs
    );
    let (mut imported, mut refused) = (0, 0);
    for (h, region, st) in &m.exports {
        if m.pending_free.contains(region) || !m.live.get(region).is_some_and(|r| r.1) {
            continue;
        }
        match c.call(Request::Import(ImportRequest { handle: *h, access: AccessMode::ReadOnly }), &[]) {
            Ok((Response::Import(i), mut fds)) => {
                assert_ne!(*st, ExportState::Revoked, "round {round}: acknowledged revocation of {h} undone");
                check_bytes(round, *region, &File::from(fds.remove(0)), i.size);
                c.call(Request::Release(ReleaseRequest { import: i.import }), &[]).unwrap();
                imported += 1;
            }
            Err(CodecError::Refused { body, .. }) if body.code == ErrorCode::Revoked => {
                assert_ne!(*st, ExportState::Live, "round {round}: acknowledged export {h} no longer imports");
                refused += 1;
            }
            other => panic!("round {round}: import of an acknowledged export: {other:?}"),
        }
    }
    (imported, refused)
}

#[test]
fn acknowledged_registry_changes_survive_kill_9() {
    let seed = std::env::var(ENV_SEED)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64));
    eprintln!("daemon_crash: seed {seed} (set {ENV_SEED} to repeat)");
    let mut rng = Rng(seed | 1);
    // Small compaction threshold: crashes land around compactions too. A long grace: the
    // workload's sessions must wait for it across every crash.
    let setup = common::Setup::with_sim(&cxl_pool(), "[memory]\nresume_grace_s = 600\ncompact_records = 16\n");
    let started = Instant::now();
    let mut daemon = common::start(&setup.config, setup.dir.path());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "crash_workload", "--nocapture", "--test-threads=1"])
        .env(ENV_SOCKET, &setup.socket)
        .env(ENV_SEED, rng.next().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut go = child.stdin.take().unwrap();
    let (tx, rx) = mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut m = Model::default();
    let drain = |m: &mut Model, until: Option<usize>, child: &mut std::process::Child| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if until.is_some_and(|n| m.down >= n) {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(5)) {
                Ok(line) => m.record(&line),
                Err(mpsc::RecvTimeoutError::Timeout) if until.is_none() => return,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the workload died: {:?}", child.try_wait()),
            }
            assert!(Instant::now() < deadline, "workload threads did not all see the crash");
            if let Ok(Some(st)) = child.try_wait() {
                panic!("the workload exited: {st}");
            }
        }
    };
    // Every worker thread is connected before the first crash: under load the workload's
    // process can take longer to start than the first delay, and a thread that finds no
    // daemon at start fails.
    let connected_by = Instant::now() + Duration::from_secs(60);
    while m.started < THREADS {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(line) => m.record(&line),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the workload died: {:?}", child.try_wait()),
        }
        assert!(Instant::now() < connected_by, "the workload's threads did not all connect");
    }
    let (mut rounds, mut imported, mut refused, mut max_live) = (0, 0, 0, 0);
    while rounds < MAX_ROUNDS && (rounds < MIN_ROUNDS || started.elapsed() < BUDGET) {
        let delay = Duration::from_millis(30 + rng.below(400));
        let until = Instant::now() + delay;
        while Instant::now() < until {
            drain(&mut m, None, &mut child);
        }
        daemon.child.kill().unwrap();
        daemon.child.wait().unwrap();
        drop(daemon);
        // Every thread reports the crash after the acknowledgements it got before it.
        let want = m.down + THREADS;
        drain(&mut m, Some(want), &mut child);
        daemon = common::start(&setup.config, setup.dir.path());
        let mut c = common::client(&setup.socket);
        let (i, r) = check(rounds, &mut m, &setup.state, &mut c);
        (imported, refused) = (imported + i, refused + r);
        max_live = max_live.max(m.live.len());
        drop(c);
        rounds += 1;
        writeln!(go, "go").unwrap();
    }
    // Let the threads resume and work a little, then end the workload: its sessions close
    // and everything they held is reclaimed (and journaled so).
    let until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < until {
        drain(&mut m, None, &mut child);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let mut c = common::client(&setup.socket);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
        if s.regions == 0 && s.exports == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the ended workload's regions are reclaimed: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    daemon.child.kill().unwrap();
    daemon.child.wait().unwrap();
    drop(daemon);
    let _daemon = common::start(&setup.config, setup.dir.path());
    assert!(region_files(&setup.state).is_empty(), "nothing comes back after the reclaim was journaled");
    assert!(m.resumed >= rounds, "workload threads resumed their sessions ({} resumes)", m.resumed);
    println!(
        "daemon_crash: survived {rounds} kill -9 crash points in {:.1} s; {} acknowledged changes, \
         {} acknowledged frees checked gone, up to {max_live} live regions checked with contents, \
         {imported} imports of live exports and {refused} refusals of revoked ones, {} allocations left \
         unacknowledged by a crash ({} of them found), {} session resumes",
        started.elapsed().as_secs_f64(),
        m.acks,
        m.freed.len(),
        m.uncertain_allocs,
        m.leaked.len(),
        m.resumed
    );
}
