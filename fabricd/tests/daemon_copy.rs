//! The copy engine on the real daemon with real clients: region to region by GFA and by
//! registration, partial ranges, process-backed registrations both ways, contents checked
//! byte for byte; typed refusals; unregister, free and session end during a copy stop it
//! with a report and never take the daemon down; many concurrent copies all land.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocResponse, BoundedVec, CodecError, Connection, CopyBatchRequest, CopyDone, CopyEndpoint,
    CopyRequest, CopyResult, DeviceName, ErrorBody, ErrorCode, Event, ExportPolicy, ExportRequest, FreeRequest,
    ImportRequest, RegisterRequest, RegisterSource, Request, Response, RevokeRequest, UnregisterRequest, Version,
    VersionRange,
};
use fabric_topology::DeviceKind;
use memmap2::{MmapMut, MmapOptions};

const MIB: u64 = 1 << 20;

struct Env {
    setup: common::Setup,
    daemon: common::Daemon,
    gpus: Vec<String>,
}

fn start(copy: &str) -> Env {
    let setup = common::Setup::with_sim(&common::sim_file(), &format!("[copy]\n{copy}\n[memory]\nsize_check_s = 0\n"));
    let daemon = common::start(&setup.config, setup.dir.path());
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpus = inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).map(|d| d.id.to_string()).collect();
    Env { setup, daemon, gpus }
}

/// A region with its memory mapped here.
struct Region {
    info: AllocResponse,
    map: MmapMut,
}

impl Region {
    fn gfa(&self) -> u64 {
        self.info.gfa.expect("HBM regions have GFAs")
    }
}

fn alloc(c: &mut Connection, device: &str, size: u64) -> Region {
    let (info, file) = common::alloc_hbm(c, device, size);
    // SAFETY: a shared mapping of the region's file; the test is its only user here.
    let map = unsafe { MmapOptions::new().offset(info.offset).len(info.size as usize).map_mut(&file).unwrap() };
    Region { info, map }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8).collect()
}

fn register(c: &mut Connection, gpu: &str, source: RegisterSource, offset: u64, len: u64, access: AccessMode) -> u64 {
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source,
        offset,
        len,
        access,
        node: None,
    });
    let Response::Register(r) = c.call(req, &[]).unwrap().0 else { panic!() };
    r.registration
}

fn reg(id: u64, offset: u64) -> CopyEndpoint {
    CopyEndpoint::Registration { id, offset }
}

fn start_copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> u64 {
    match c.call(Request::Copy(CopyRequest { dst, src, len }), &[]) {
        Ok((Response::Copy(r), _)) => r.copy,
        other => panic!("copy refused: {other:?}"),
    }
}

fn refused(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> ErrorBody {
    match c.call(Request::Copy(CopyRequest { dst, src, len }), &[]) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Waits for the completion of `copy` (other completions are kept in `seen`).
fn done(c: &mut Connection, copy: u64, seen: &mut Vec<CopyDone>) -> CopyDone {
    if let Some(i) = seen.iter().position(|d| d.copy == copy) {
        return seen.remove(i);
    }
    loop {
        match c.next_event().unwrap() {
            Event::CopyDone(d) if d.copy == copy => return d,
            Event::CopyDone(d) => seen.push(d),
            _ => {}
        }
    }
}

fn copy_ok(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) {
    let id = start_copy(c, dst, src, len);
    let d = done(c, id, &mut Vec::new());
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, len));
}

fn own_memory(len: usize, seed: u8) -> MmapMut {
    let mut m = MmapMut::map_anon(len).unwrap();
    m.copy_from_slice(&pattern(seed, len));
    // SAFETY: locks the mapping just made, `len` bytes; it stays mapped while used.
    assert_eq!(unsafe { libc::mlock(m.as_ptr().cast(), len) }, 0);
    m
}

#[test]
fn regions_copy_by_gfa_and_by_registration_over_partial_ranges() {
    let env = start("");
    let mut c = common::client(&env.setup.socket);
    assert_eq!(c.version(), fabric_proto::wire::PROTOCOL_VERSION);
    let gpu = &env.gpus[0];
    let mut a = alloc(&mut c, gpu, 4 * MIB);
    let mut b = alloc(&mut c, &env.gpus[1], 4 * MIB);
    let data = pattern(7, 4 * MIB as usize);
    a.map.copy_from_slice(&data);
    b.map.fill(0xee);

    // GFA to GFA, unaligned on both sides, past a chunk boundary.
    let len = 3 * MIB + 123;
    copy_ok(&mut c, CopyEndpoint::Gfa(b.gfa() + 100), CopyEndpoint::Gfa(a.gfa() + 4096 + 7), len);
    let l = len as usize;
    assert!(b.map[..100].iter().all(|&x| x == 0xee), "bytes before the range untouched");
    assert_eq!(&b.map[100..100 + l], &data[4103..4103 + l]);
    assert!(b.map[100 + l..].iter().all(|&x| x == 0xee), "bytes after the range untouched");

    // Registration to registration, at offsets inside them.
    b.map.fill(0);
    let ra = register(&mut c, gpu, RegisterSource::Region(a.info.region), MIB, 2 * MIB, AccessMode::ReadOnly);
    let rb = register(&mut c, gpu, RegisterSource::Region(b.info.region), 4096, 3 * MIB, AccessMode::ReadWrite);
    copy_ok(&mut c, reg(rb, 10), reg(ra, 5), MIB + 1);
    let at = 4096 + 10;
    assert_eq!(&b.map[at..at + MIB as usize + 1], &data[MIB as usize + 5..2 * MIB as usize + 6]);

    // Mixed: a registration to a GFA and back.
    copy_ok(&mut c, CopyEndpoint::Gfa(b.gfa()), reg(ra, 0), 4096);
    assert_eq!(&b.map[..4096], &data[MIB as usize..MIB as usize + 4096]);
    a.map[..4096].fill(1);
    copy_ok(&mut c, reg(rb, 0), CopyEndpoint::Gfa(a.gfa()), 4096);
    assert!(b.map[4096..8192].iter().all(|&x| x == 1));

    // An importer copies from the exporter's region by GFA.
    let mut other = common::client(&env.setup.socket);
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let Response::Export(e) =
        c.call(Request::Export(ExportRequest { region: a.info.region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    let Response::Import(_) =
        other.call(Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadOnly }), &[]).unwrap().0
    else {
        panic!()
    };
    let mut mine = alloc(&mut other, gpu, 2 * MIB);
    copy_ok(&mut other, CopyEndpoint::Gfa(mine.gfa()), CopyEndpoint::Gfa(a.gfa() + 8192), MIB);
    assert_eq!(&mine.map[..MIB as usize], &data[8192..8192 + MIB as usize]);
    // ... but may not write it through a read-only import.
    let body = refused(&mut other, CopyEndpoint::Gfa(a.gfa()), CopyEndpoint::Gfa(mine.gfa()), 4096);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{}", body.message);
    mine.map[0] = 0;
}

#[test]
fn process_backed_registrations_copy_both_ways() {
    let env = start("");
    let mut c = common::client(&env.setup.socket);
    let gpu = &env.gpus[0];
    let mut r = alloc(&mut c, gpu, 2 * MIB);
    let rdata = pattern(3, 2 * MIB as usize);
    r.map.copy_from_slice(&rdata);
    let len = MIB as usize;
    let p1 = own_memory(len, 11);
    let p2 = own_memory(len, 0);
    let g1 = register(
        &mut c,
        gpu,
        RegisterSource::Process { addr: p1.as_ptr() as u64 },
        0,
        len as u64,
        AccessMode::ReadWrite,
    );
    let g2 = register(
        &mut c,
        gpu,
        RegisterSource::Process { addr: p2.as_ptr() as u64 },
        0,
        len as u64,
        AccessMode::ReadWrite,
    );
    let p1_data = pattern(11, len);

    // Process memory to a region, by GFA.
    copy_ok(&mut c, CopyEndpoint::Gfa(r.gfa() + 1), reg(g1, 0), len as u64 - 1);
    assert_eq!(&r.map[1..len], &p1_data[..len - 1]);
    // A region to process memory.
    let rr = register(&mut c, gpu, RegisterSource::Region(r.info.region), 0, 2 * MIB, AccessMode::ReadOnly);
    copy_ok(&mut c, reg(g2, 0), reg(rr, MIB), len as u64);
    // SAFETY: the daemon's copy completed before this read; nothing writes p2 now.
    assert_eq!(&p2[..], &rdata[len..2 * len]);
    // Process to process.
    copy_ok(&mut c, reg(g2, 4096), reg(g1, 0), 8192);
    assert_eq!(&p2[4096..4096 + 8192], &p1_data[..8192]);
}

#[test]
fn refusals_are_typed() {
    let env = start("max_in_flight_per_session = 1\nengines = 1\nchunk_bytes = 262144\n");
    let mut c = common::client(&env.setup.socket);
    let mut other = common::client(&env.setup.socket);
    let gpu = &env.gpus[0];
    let a = alloc(&mut c, gpu, 4 * MIB);
    let b = alloc(&mut c, gpu, 4 * MIB);
    let (ga, gb) = (CopyEndpoint::Gfa(a.gfa()), CopyEndpoint::Gfa(b.gfa()));

    let body = refused(&mut c, gb, ga, 0);
    assert_eq!(body.code, ErrorCode::BadRequest);
    let body = refused(&mut c, gb, reg(999, 0), 10);
    assert_eq!(body.code, ErrorCode::NotFound, "{}", body.message);
    let body = refused(&mut c, CopyEndpoint::Gfa(1 << 62), ga, 10);
    assert_eq!(body.code, ErrorCode::NotFound, "{}", body.message);
    let body = refused(&mut c, gb, CopyEndpoint::Gfa(a.gfa() + 3 * MIB), 2 * MIB);
    assert_eq!(body.code, ErrorCode::BadRequest, "past the region: {}", body.message);
    let body = refused(&mut c, CopyEndpoint::Gfa(a.gfa() + 100), ga, 200);
    assert_eq!(body.code, ErrorCode::BadRequest, "overlap: {}", body.message);
    assert!(body.message.contains("overlap"), "{}", body.message);
    // Another session's region and registration are not reachable.
    let theirs = CopyEndpoint::Gfa(other_region(&mut other, gpu));
    let body = refused(&mut other, theirs, ga, 10);
    assert_eq!(body.code, ErrorCode::NotFound, "{}", body.message);
    let ra = register(&mut c, gpu, RegisterSource::Region(a.info.region), 0, MIB, AccessMode::ReadOnly);
    let body = refused(&mut other, theirs, reg(ra, 0), 10);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{}", body.message);
    // A read-only registration is no destination; a range past a registration is refused.
    let body = refused(&mut c, reg(ra, 0), gb, 10);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{}", body.message);
    let body = refused(&mut c, gb, reg(ra, MIB - 5), 10);
    assert_eq!(body.code, ErrorCode::BadRequest, "{}", body.message);

    // One copy in flight per session: the next ones are refused until it is done (a
    // 64 MiB copy on one engine in 256 KiB chunks outlasts many round trips).
    let big_a = alloc(&mut c, gpu, 64 * MIB);
    let big_b = alloc(&mut c, gpu, 64 * MIB);
    let first = start_copy(&mut c, CopyEndpoint::Gfa(big_b.gfa()), CopyEndpoint::Gfa(big_a.gfa()), 64 * MIB);
    let mut limited = 0;
    let mut seen = Vec::new();
    let mut extra = Vec::new();
    for _ in 0..20 {
        match c.call(Request::Copy(CopyRequest { dst: gb, src: ga, len: 4096 }), &[]) {
            Err(CodecError::Refused { body, .. }) => {
                assert_eq!(body.code, ErrorCode::LimitExceeded, "{}", body.message);
                limited += 1;
            }
            Ok((Response::Copy(r), _)) => {
                extra.push(r.copy);
                let d = done(&mut c, r.copy, &mut seen);
                assert_eq!(d.result, CopyResult::Ok);
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(limited > 0, "no copy was refused while one was in flight");
    assert_eq!(done(&mut c, first, &mut seen).result, CopyResult::Ok);

    // A 1.1 connection does not have the opcode.
    let mut old = Connection::new(UnixStream::connect(&env.setup.socket).unwrap());
    old.hello("old", VersionRange::new(Version::new(1, 0), Version::new(1, 1))).unwrap();
    match old.call(Request::Copy(CopyRequest { dst: gb, src: ga, len: 1 }), &[]) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::UnknownOpcode),
        other => panic!("{other:?}"),
    }
}

fn other_region(c: &mut Connection, gpu: &str) -> u64 {
    alloc(c, gpu, 2 * MIB).gfa()
}

/// Starts big copies and ends one of their dependencies at once, until one is seen
/// stopped mid-way (the engine is slowed by one engine and small chunks).
fn stops_mid_copy(
    end: impl Fn(&mut Connection, &Env) -> (CopyEndpoint, CopyEndpoint, Box<dyn FnOnce(&mut Connection)>),
    want: &str,
) {
    let env = start("engines = 1\nchunk_bytes = 262144\n");
    let mut c = common::client(&env.setup.socket);
    let mut stopped = false;
    for _ in 0..5 {
        let (dst, src, then) = end(&mut c, &env);
        let id = start_copy(&mut c, dst, src, 64 * MIB);
        then(&mut c);
        let d = done(&mut c, id, &mut Vec::new());
        match d.result {
            CopyResult::Ok => assert_eq!(d.bytes, 64 * MIB),
            CopyResult::Failed { code, message } => {
                assert_eq!(code, ErrorCode::NotFound, "{message}");
                assert!(message.contains(want), "{message}");
                assert!(d.bytes < 64 * MIB, "{}", d.bytes);
                stopped = true;
                break;
            }
        }
    }
    assert!(stopped, "no copy was ever seen stopped mid-way");
    // The daemon still serves, and says what happened.
    let mut c2 = common::client(&env.setup.socket);
    let r = alloc(&mut c2, &env.gpus[0], 2 * MIB);
    copy_ok(&mut c2, CopyEndpoint::Gfa(r.gfa()), CopyEndpoint::Gfa(r.gfa() + MIB), 4096);
    assert!(env.daemon.log().contains("copy stopped"), "{}", env.daemon.log());
}

#[test]
fn unregister_during_a_copy_stops_it_and_the_daemon_serves_on() {
    stops_mid_copy(
        |c, env| {
            let a = alloc(c, &env.gpus[0], 64 * MIB);
            let b = alloc(c, &env.gpus[1], 64 * MIB);
            let rb =
                register(c, &env.gpus[0], RegisterSource::Region(b.info.region), 0, 64 * MIB, AccessMode::ReadWrite);
            let then = move |c: &mut Connection| {
                let (r, _) = c.call(Request::Unregister(UnregisterRequest { registration: rb }), &[]).unwrap();
                assert_eq!(r, Response::Unregister);
            };
            (reg(rb, 0), CopyEndpoint::Gfa(a.gfa()), Box::new(then))
        },
        "unregistered",
    );
}

#[test]
fn freeing_the_source_during_a_copy_stops_it() {
    stops_mid_copy(
        |c, env| {
            let a = alloc(c, &env.gpus[0], 64 * MIB);
            let b = alloc(c, &env.gpus[1], 64 * MIB);
            let region = a.info.region;
            let then = move |c: &mut Connection| {
                let (r, _) = c.call(Request::Free(FreeRequest { region, node: None }), &[]).unwrap();
                assert_eq!(r, Response::Free);
            };
            (CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), Box::new(then))
        },
        "freed",
    );
}

#[test]
fn revoking_the_export_stops_an_importer_copy() {
    let env = start("engines = 1\nchunk_bytes = 262144\n");
    let mut owner = common::client(&env.setup.socket);
    let mut c = common::client(&env.setup.socket);
    let mut stopped = false;
    for _ in 0..5 {
        let a = alloc(&mut owner, &env.gpus[0], 64 * MIB);
        let policy = ExportPolicy {
            uids: BoundedVec::default(),
            gids: BoundedVec::default(),
            partition: None,
            access: AccessMode::ReadOnly,
        };
        let Response::Export(e) =
            owner.call(Request::Export(ExportRequest { region: a.info.region, policy, node: None }), &[]).unwrap().0
        else {
            panic!()
        };
        let req = Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadOnly });
        let Response::Import(_) = c.call(req, &[]).unwrap().0 else { panic!() };
        let b = alloc(&mut c, &env.gpus[1], 64 * MIB);
        let id = start_copy(&mut c, CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), 64 * MIB);
        let (r, _) = owner.call(Request::Revoke(RevokeRequest { handle: e.handle }), &[]).unwrap();
        assert_eq!(r, Response::Revoke);
        let d = done(&mut c, id, &mut Vec::new());
        if let CopyResult::Failed { code, message } = d.result {
            assert_eq!(code, ErrorCode::NotFound, "{message}");
            assert!(message.contains("revoked"), "{message}");
            stopped = true;
            break;
        }
    }
    assert!(stopped, "no copy was ever seen stopped by the revocation");
}

#[test]
fn a_session_that_dies_mid_copy_is_reclaimed_and_others_are_served() {
    let env = start("engines = 1\nchunk_bytes = 262144\n");
    for _ in 0..3 {
        let mut c = common::client(&env.setup.socket);
        let a = alloc(&mut c, &env.gpus[0], 64 * MIB);
        let b = alloc(&mut c, &env.gpus[1], 64 * MIB);
        start_copy(&mut c, CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), 64 * MIB);
        drop(c);
    }
    let mut c = common::client(&env.setup.socket);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let Response::Status(s) = c.call(Request::Status(Default::default()), &[]).unwrap().0 else { panic!() };
        if s.regions == 0 && s.sessions == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the dead sessions' regions were not reclaimed: {s:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let r = alloc(&mut c, &env.gpus[0], 2 * MIB);
    copy_ok(&mut c, CopyEndpoint::Gfa(r.gfa()), CopyEndpoint::Gfa(r.gfa() + MIB), MIB);
    assert!(env.daemon.child.id() > 0);
    let log = env.daemon.log();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn many_concurrent_copies_from_many_sessions_all_land() {
    let env = start("engines = 4\nchunk_bytes = 262144\n");
    let socket = env.setup.socket.clone();
    let gpus = env.gpus.clone();
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let socket = socket.clone();
            let gpu = gpus[t as usize].clone();
            std::thread::spawn(move || many(&socket, &gpu, t))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

fn many(socket: &Path, gpu: &str, t: u8) {
    let mut c = common::client(socket);
    let piece = 512 << 10;
    let n = 16usize;
    let mut src = alloc(&mut c, gpu, 8 * MIB);
    let dst = alloc(&mut c, gpu, 8 * MIB);
    let data = pattern(t.wrapping_mul(17), 8 * MIB as usize);
    src.map.copy_from_slice(&data);
    // Pieces land in reverse order in the destination.
    let ids: Vec<u64> = (0..n)
        .map(|i| {
            let d = (n - 1 - i) as u64 * piece;
            start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa() + d), CopyEndpoint::Gfa(src.gfa() + i as u64 * piece), piece)
        })
        .collect();
    let mut seen = Vec::new();
    for id in ids {
        let d = done(&mut c, id, &mut seen);
        assert_eq!((d.result, d.bytes), (CopyResult::Ok, piece));
    }
    let p = piece as usize;
    for i in 0..n {
        let d = (n - 1 - i) * p;
        assert_eq!(&dst.map[d..d + p], &data[i * p..(i + 1) * p], "piece {i} of session {t}");
    }
}

fn memfd(len: u64) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    let name = std::ffi::CString::new("copy-test").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
    fd
}

#[test]
fn memory_shrunk_under_a_registration_fails_the_copy_and_never_the_daemon() {
    use std::os::fd::AsFd;
    let env = start("");
    let mut c = common::client(&env.setup.socket);
    let gpu = &env.gpus[0];
    let r = alloc(&mut c, gpu, 2 * MIB);
    let (src_fd, dst_fd) = (memfd(2 * MIB), memfd(2 * MIB));
    let reg_fd = |c: &mut Connection, fd: &std::os::fd::OwnedFd| {
        let req = Request::Register(RegisterRequest {
            device: DeviceName::truncated(gpu),
            source: RegisterSource::Fd,
            offset: 0,
            len: 2 * MIB,
            access: AccessMode::ReadWrite,
            node: None,
        });
        let Response::Register(r) = c.call(req, &[fd.as_fd()]).unwrap().0 else { panic!() };
        r.registration
    };
    let (rs, rd) = (reg_fd(&mut c, &src_fd), reg_fd(&mut c, &dst_fd));
    copy_ok(&mut c, reg(rd, 0), reg(rs, 0), 2 * MIB);
    // The client shrinks both memory objects it registered.
    File::from(src_fd.try_clone().unwrap()).set_len(0).unwrap();
    File::from(dst_fd.try_clone().unwrap()).set_len(0).unwrap();
    for (dst, src) in [(CopyEndpoint::Gfa(r.gfa()), reg(rs, 0)), (reg(rd, 0), CopyEndpoint::Gfa(r.gfa()))] {
        let id = start_copy(&mut c, dst, src, MIB);
        let d = done(&mut c, id, &mut Vec::new());
        match d.result {
            CopyResult::Failed { code, message } => {
                assert_eq!(code, ErrorCode::Internal, "{message}");
                // The CPU copied (its fault recovered), where the daemon has that copy.
                let recovering = cfg!(all(target_arch = "x86_64", target_os = "linux"));
                assert!(!recovering || message.as_str().contains("SIGBUS after"), "{message}");
            }
            CopyResult::Ok => panic!("a copy through shrunk memory succeeded"),
        }
    }
    // The daemon is alive and serves.
    copy_ok(&mut c, CopyEndpoint::Gfa(r.gfa()), CopyEndpoint::Gfa(r.gfa() + MIB), 4096);
    assert!(env.daemon.log().contains("copy chunk failed"));
}

fn batch(copies: &[(CopyEndpoint, CopyEndpoint, u64)]) -> Request {
    let copies = copies.iter().map(|&(dst, src, len)| CopyRequest { dst, src, len }).collect();
    Request::CopyBatch(CopyBatchRequest { copies: BoundedVec::new(copies).unwrap() })
}

#[test]
fn a_batch_moves_all_its_copies_with_one_completion_or_is_refused_whole() {
    let env = start("engines = 2\nmax_in_flight_per_session = 2\n");
    let mut c = common::client(&env.setup.socket);
    let gpu = &env.gpus[0];
    let mut a = alloc(&mut c, gpu, 4 * MIB);
    let mut b = alloc(&mut c, &env.gpus[1], 4 * MIB);
    let data = pattern(9, 4 * MIB as usize);
    a.map.copy_from_slice(&data);
    b.map.fill(0xee);
    let ra = register(&mut c, gpu, RegisterSource::Region(a.info.region), 0, 4 * MIB, AccessMode::ReadOnly);
    let rb = register(&mut c, gpu, RegisterSource::Region(b.info.region), 0, 4 * MIB, AccessMode::ReadWrite);

    // Three copies of different kinds and sizes, one of them over several chunks.
    let parts = [
        (reg(rb, 0), reg(ra, 3 * MIB), MIB),
        (CopyEndpoint::Gfa(b.gfa() + MIB + 5), CopyEndpoint::Gfa(a.gfa() + 17), 2 * MIB),
        (reg(rb, 3 * MIB + 4096), CopyEndpoint::Gfa(a.gfa()), 4096),
    ];
    let Response::CopyBatch(r) = c.call(batch(&parts), &[]).unwrap().0 else { panic!() };
    let d = done(&mut c, r.copy, &mut Vec::new());
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, 3 * MIB + 4096));
    let (m, u) = (MIB as usize, 4096usize);
    assert_eq!(&b.map[..m], &data[3 * m..4 * m]);
    assert_eq!(&b.map[m + 5..3 * m + 5], &data[17..2 * m + 17]);
    assert_eq!(&b.map[3 * m + u..3 * m + 2 * u], &data[..u]);
    assert!(b.map[m..m + 5].iter().all(|&x| x == 0xee), "between the copies nothing moved");

    // One bad copy refuses the whole batch, naming it; nothing of the others moves.
    b.map.fill(0);
    let bad = [(reg(rb, 0), reg(ra, 0), 4096), (CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), 0)];
    let Err(CodecError::Refused { body, .. }) = c.call(batch(&bad), &[]) else { panic!() };
    assert_eq!(body.code, ErrorCode::BadRequest);
    assert!(body.message.contains("copy 1 of the batch"), "{}", body.message);
    let outside = [(reg(rb, 0), reg(ra, 0), 4096), (reg(rb, 0), reg(ra + 1000, 0), 4096)];
    let Err(CodecError::Refused { body, .. }) = c.call(batch(&outside), &[]) else { panic!() };
    assert_eq!(body.code, ErrorCode::NotFound, "{}", body.message);
    std::thread::sleep(Duration::from_millis(50));
    assert!(b.map[..4096].iter().all(|&x| x == 0), "a refused batch moves nothing");
    let Err(CodecError::Refused { body, .. }) = c.call(batch(&[]), &[]) else { panic!() };
    assert_eq!(body.code, ErrorCode::BadRequest);

    // A batch is one copy in flight for the session's limit (2 here).
    let big = [(reg(rb, 0), reg(ra, 0), 4 * MIB); 3];
    let mut ids = Vec::new();
    for _ in 0..2 {
        let Response::CopyBatch(r) = c.call(batch(&big), &[]).unwrap().0 else { panic!() };
        ids.push(r.copy);
    }
    let mut seen = Vec::new();
    for id in ids {
        let d = done(&mut c, id, &mut seen);
        assert_eq!((d.result, d.bytes), (CopyResult::Ok, 12 * MIB));
    }
}

/// A client that pipelines its copies (the next requests already buffered whenever one is
/// answered) gets each completion as it comes, between the answers: what the daemon holds
/// for it stays within the session's in-flight limit. Before, every answer came first and
/// the completions queued behind the requests, without bound, in the daemon.
#[test]
fn pipelined_copies_get_their_completions_between_the_answers() {
    use std::io::Write;

    use fabric_proto::wire::{FrameKind, Header, Message, Opcode, encode_message, recv_message};
    const LIMIT: u64 = 4;
    const COPIES: u64 = 3000;
    let env = start(&format!("max_in_flight_per_session = {LIMIT}"));
    let mut c = common::client(&env.setup.socket);
    let a = alloc(&mut c, &env.gpus[0], MIB);
    let copy =
        Request::Copy(CopyRequest { dst: CopyEndpoint::Gfa(a.gfa() + 4096), src: CopyEndpoint::Gfa(a.gfa()), len: 1 });
    let mut bytes = Vec::new();
    for id in 0..COPIES {
        let h = Header::new(Opcode::Copy, FrameKind::Request, 1000 + id);
        encode_message(&h, &Message::Request(copy.clone()), &mut bytes).unwrap();
    }
    let mut writer = c.stream().try_clone().unwrap();
    let sent = std::thread::spawn(move || writer.write_all(&bytes).unwrap());
    let (mut answered, mut accepted, mut done, mut widest) = (0, 0u64, 0u64, 0u64);
    while answered < COPIES || done < accepted {
        let (h, msg, _) = recv_message(c.stream()).unwrap();
        match msg {
            Message::Response(Response::Copy(_)) => {
                answered += 1;
                accepted += 1;
            }
            Message::Error(_) => answered += 1,
            Message::Event(Event::CopyDone(_)) => done += 1,
            other => panic!("{h:?}: {other:?}"),
        }
        widest = widest.max(accepted.saturating_sub(done));
    }
    sent.join().unwrap();
    assert!(accepted >= LIMIT, "copies ran: {accepted}");
    // A completion is queued just after its place is given back: a few may be in between.
    assert!(widest <= 2 * LIMIT, "{widest} copies answered and not yet reported (limit {LIMIT}); {accepted} accepted");
}

/// A session holding two imports of one region, one read-only and one read-write, copies
/// into it through the writable one, every time. Before, the import used was whichever
/// the registry's map gave first: the same copy was refused or run by chance.
#[test]
fn a_copy_into_a_region_imported_twice_goes_through_the_writable_import() {
    let env = start("");
    let mut owner = common::client(&env.setup.socket);
    let mut c = common::client(&env.setup.socket);
    let a = alloc(&mut owner, &env.gpus[0], 2 * MIB);
    let export = |owner: &mut Connection, access| {
        let policy = ExportPolicy { uids: BoundedVec::default(), gids: BoundedVec::default(), partition: None, access };
        let req = Request::Export(ExportRequest { region: a.info.region, policy, node: None });
        let Response::Export(e) = owner.call(req, &[]).unwrap().0 else { panic!() };
        e.handle
    };
    let import = |c: &mut Connection, handle, access| {
        let Response::Import(i) = c.call(Request::Import(ImportRequest { handle, access }), &[]).unwrap().0 else {
            panic!()
        };
        i.import
    };
    let (ro, rw) = (export(&mut owner, AccessMode::ReadOnly), export(&mut owner, AccessMode::ReadWrite));
    for round in 0..16 {
        let first = import(&mut c, ro, AccessMode::ReadOnly);
        let second = import(&mut c, rw, AccessMode::ReadWrite);
        let r = c.call(
            Request::Copy(CopyRequest {
                dst: CopyEndpoint::Gfa(a.gfa() + 4096),
                src: CopyEndpoint::Gfa(a.gfa()),
                len: 64,
            }),
            &[],
        );
        let Ok((Response::Copy(started), _)) = r else { panic!("round {round}: {r:?}") };
        assert_eq!(done(&mut c, started.copy, &mut Vec::new()).result, CopyResult::Ok, "round {round}");
        for import in [first, second] {
            let req = Request::Release(fabric_proto::wire::ReleaseRequest { import });
            c.call(req, &[]).unwrap();
        }
    }
}
