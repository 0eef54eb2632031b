//! The memory registry survives a daemon restart (SIGTERM and `kill -9`): a client that
//! presents its session token takes its regions back, their contents written through an
//! `mmap` are still there, and old export handles still import; owners that are gone are
//! reclaimed at start, owners that do not come back after the grace period; a region whose
//! file vanished is dropped with a `status` problem. Regions striped over an interleave set
//! (a sim file, or a range of the DAX device backing the set) come back the same way, at
//! the same GFA and with their DPA range taken in every member again; one whose file or
//! DAX device is gone is dropped with a problem. Real daemon processes throughout.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocResponse, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ErrorBody,
    ErrorCode, ExportHandle, ExportPolicy, ExportRequest, FreeRequest, ImportRequest, ImportResponse, MemoryClass,
    ProblemKind, RegionsRequest, Request, ResourceName, Response, SUPPORTED_VERSIONS, SessionToken, StatusRequest,
    StatusResponse,
};
use fabric_topology::{Fabric, MemoryKind};
use memmap2::{Mmap, MmapMut, MmapOptions};

const MIB: u64 = 1 << 20;

fn gpu() -> String {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    let d = f.inventory().devices.iter().find(|d| d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap();
    d.id.to_string()
}

fn connect(socket: &Path, resume: Option<SessionToken>) -> Result<(Connection, SessionToken), ErrorBody> {
    let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    match c.hello_with("durable-test", SUPPORTED_VERSIONS, resume) {
        Ok(h) => Ok((c, h.token.expect("a 1.1 hello carries a token"))),
        Err(CodecError::Refused { body, .. }) => Err(body),
        Err(e) => panic!("hello: {e}"),
    }
}

fn alloc(c: &mut Connection, device: &str, size: u64) -> (AllocResponse, File) {
    alloc_on(c, AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm }, size)
}

fn alloc_on(c: &mut Connection, target: AllocTarget, size: u64) -> (AllocResponse, File) {
    let req = Request::Alloc(AllocRequest { target, size, align: 0 });
    let (r, mut fds) = c.call(req, &[]).unwrap();
    let Response::Alloc(a) = r else { panic!("{r:?}") };
    (a, File::from(fds.remove(0)))
}

fn export(c: &mut Connection, region: u64) -> ExportHandle {
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let Response::Export(e) = c.call(Request::Export(ExportRequest { region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    e.handle
}

fn import(c: &mut Connection, handle: ExportHandle) -> Result<File, ErrorBody> {
    import_at(c, handle).map(|(_, f)| f)
}

fn import_at(c: &mut Connection, handle: ExportHandle) -> Result<(ImportResponse, File), ErrorBody> {
    match c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]) {
        Ok((Response::Import(i), mut fds)) => {
            let fd: OwnedFd = fds.remove(0);
            Ok((i, File::from(fd)))
        }
        Err(CodecError::Refused { body, .. }) => Err(body),
        other => panic!("unexpected {other:?}"),
    }
}

fn status(c: &mut Connection) -> StatusResponse {
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    s
}

fn map_rw(f: &File, len: u64) -> MmapMut {
    // SAFETY: a region file that only this test maps; the daemon never truncates a live
    // region's file.
    unsafe { MmapOptions::new().len(len as usize).map_mut(f) }.unwrap()
}

fn map_ro(f: &File, len: u64) -> Mmap {
    // SAFETY: as in `map_rw`.
    unsafe { MmapOptions::new().len(len as usize).map(f) }.unwrap()
}

fn pattern(seed: u64, i: usize) -> u8 {
    (seed as usize).wrapping_mul(131).wrapping_add(i.wrapping_mul(7)) as u8
}

fn region_files(state: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(dirs) = std::fs::read_dir(state.join("memory")) else { return out };
    // The resources' directories (the memory root also holds records: `offers.record`).
    for d in dirs.flatten().filter(|d| d.file_type().is_ok_and(|t| t.is_dir())) {
        for f in std::fs::read_dir(d.path()).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with('r') {
                out.push(f.path());
            }
        }
    }
    out
}

fn stop(mut d: common::Daemon, kill: bool) {
    if kill {
        d.child.kill().unwrap();
    } else {
        let pid = i32::try_from(d.child.id()).unwrap();
        // SAFETY: kill(2) on the daemon child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    }
    let st = common::wait_exit(&mut d.child, 20);
    if !kill {
        assert!(st.success(), "SIGTERM exits cleanly: {st:?}\n{}", d.log());
    }
}

fn restart_and_resume(kill: bool) {
    let setup = common::Setup::new("");
    let gpu = gpu();
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (r, f) = alloc(&mut a, &gpu, 4 * MIB);
    let mut m = map_rw(&f, r.size);
    for (i, b) in m.iter_mut().enumerate() {
        *b = pattern(r.region, i);
    }
    let handle = export(&mut a, r.region);
    let (r2, _) = alloc(&mut a, &gpu, 2 * MIB);
    a.call(Request::Free(FreeRequest { region: r2.region, node: None }), &[]).unwrap();

    stop(d, kill);
    let d = common::start(&setup.config, setup.dir.path());
    assert_eq!(region_files(&setup.state).len(), 1, "the live region's file is kept, the freed one is gone");

    // Before the owner is back, its export still imports, with the contents written.
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    assert_eq!(status(&mut b).regions, 1);
    let fi = import(&mut b, handle).unwrap();
    let mi = map_ro(&fi, r.size);
    assert!(mi.iter().enumerate().all(|(i, v)| *v == pattern(r.region, i)), "contents survive the restart");

    // Someone else's token, or a wrong one, takes nothing.
    let wrong = connect(&setup.socket, Some(SessionToken([0x5a; 16]))).unwrap_err();
    assert_eq!(wrong.code, ErrorCode::NotFound);

    // The owner takes its session back: same token; the region is its own again.
    let (mut a2, token2) = connect(&setup.socket, Some(token)).unwrap();
    assert_eq!(token2, token, "a resumed session keeps its token");
    let again = connect(&setup.socket, Some(token)).unwrap_err();
    assert_eq!(again.code, ErrorCode::NotFound, "a session is resumed once");
    // The owner's old mapping is still the region: a write through it after the restart
    // is seen through the import.
    m[12345] = !pattern(r.region, 12345);
    assert_eq!(mi[12345], !pattern(r.region, 12345));
    let h2 = export(&mut a2, r.region);
    import(&mut b, h2).unwrap();

    // A second restart: the resumed session is journaled under the same token.
    drop(a);
    stop(d, kill);
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut a3, _) = connect(&setup.socket, Some(token)).unwrap();
    let (mut c, _) = connect(&setup.socket, None).unwrap();
    import(&mut c, handle).unwrap();
    a3.call(Request::Free(FreeRequest { region: r.region, node: None }), &[]).unwrap();
    assert_eq!(import(&mut c, handle).unwrap_err().code, ErrorCode::InvalidHandle);
    assert!(region_files(&setup.state).is_empty());
    drop((a2, a3));
}

#[test]
fn regions_survive_sigterm_and_are_resumed_by_token() {
    restart_and_resume(false);
}

#[test]
fn regions_survive_kill_9_and_are_resumed_by_token() {
    restart_and_resume(true);
}

#[test]
fn a_client_that_disconnects_still_loses_its_regions() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    alloc(&mut a, &gpu(), 2 * MIB);
    drop(a);
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while status(&mut b).regions != 0 {
        assert!(Instant::now() < deadline, "the closed session's region is reclaimed");
        std::thread::sleep(Duration::from_millis(10));
    }
    stop(d, true);
    let _d = common::start(&setup.config, setup.dir.path());
    assert!(region_files(&setup.state).is_empty());
    assert_eq!(connect(&setup.socket, Some(token)).unwrap_err().code, ErrorCode::NotFound);
}

#[test]
fn an_owner_that_does_not_come_back_is_reclaimed_after_the_grace_period() {
    let setup = common::Setup::new("[memory]\nresume_grace_s = 1\n");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (r, _) = alloc(&mut a, &gpu(), 2 * MIB);
    let handle = export(&mut a, r.region);
    stop(d, true);
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    import(&mut b, handle).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // The region goes once its end is durable, its file right after (an effect run
    // without the registry lock).
    while status(&mut b).regions != 0 || !region_files(&setup.state).is_empty() {
        assert!(Instant::now() < deadline, "the orphaned region is reclaimed after the grace period");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(import(&mut b, handle).unwrap_err().code, ErrorCode::InvalidHandle);
    assert_eq!(connect(&setup.socket, Some(token)).unwrap_err().code, ErrorCode::NotFound);
}

#[test]
fn owners_that_do_not_come_back_are_reclaimed_together() {
    // Two orphaned sessions end in one reclaim, each end journaled: the registry waits
    // for both ends without its lock (it once kept it across the second wait and hung).
    let setup = common::Setup::new("[memory]\nresume_grace_s = 1\n");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, _) = connect(&setup.socket, None).unwrap();
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    alloc(&mut a, &gpu(), 2 * MIB);
    alloc(&mut b, &gpu(), 2 * MIB);
    stop(d, true);
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut c, _) = connect(&setup.socket, None).unwrap();
    assert_eq!(status(&mut c).regions, 2, "both sessions' regions are back, waiting for their owners");
    let deadline = Instant::now() + Duration::from_secs(10);
    while status(&mut c).regions != 0 || !region_files(&setup.state).is_empty() {
        assert!(Instant::now() < deadline, "both orphaned sessions are reclaimed after the grace period");
        std::thread::sleep(Duration::from_millis(50));
    }
    alloc(&mut c, &gpu(), 2 * MIB);
    assert_eq!(status(&mut c).regions, 1, "the registry serves after the reclaim");
}

const ENV_OWNER: &str = "FABRICD_DURABLE_OWNER_SOCKET";

/// The child of [`an_owner_that_is_gone_is_reclaimed_at_start`]: allocates, says so, and
/// waits to be killed.
#[test]
#[ignore = "the child process of an_owner_that_is_gone_is_reclaimed_at_start, which runs it"]
fn owner_child() {
    let Ok(socket) = std::env::var(ENV_OWNER) else { return };
    let (mut c, _) = connect(Path::new(&socket), None).unwrap();
    let (r, _) = alloc(&mut c, &gpu(), 2 * MIB);
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "\nREGION {}", r.region).unwrap();
    out.flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn an_owner_that_is_gone_is_reclaimed_at_start() {
    use std::io::BufRead;
    let setup = common::Setup::new("[memory]\nresume_grace_s = 600\n");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut mine, _) = connect(&setup.socket, None).unwrap();
    alloc(&mut mine, &gpu(), 2 * MIB);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "owner_child", "--nocapture", "--test-threads=1"])
        .env(ENV_OWNER, &setup.socket)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().starts_with("REGION ")), "the child allocated");
    assert_eq!(region_files(&setup.state).len(), 2);
    // The daemon dies first, then the owner: its connection never closed on a live daemon.
    stop(d, true);
    child.kill().unwrap();
    child.wait().unwrap();
    let d = common::start(&setup.config, setup.dir.path());
    assert_eq!(region_files(&setup.state).len(), 1, "the dead owner's region is reclaimed at start");
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    assert_eq!(status(&mut b).regions, 1, "this (live) process's region waits for it");
    assert!(d.log().contains("owner process is gone"), "{}", d.log());
}

#[test]
fn a_region_whose_file_vanished_is_dropped_with_a_problem() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (r1, _) = alloc(&mut a, &gpu(), 2 * MIB);
    let (r2, _) = alloc(&mut a, &gpu(), 2 * MIB);
    stop(d, true);
    let files = region_files(&setup.state);
    let one = files.iter().find(|p| p.ends_with(format!("r{}", r1.region))).unwrap();
    std::fs::remove_file(one).unwrap();
    let two = files.iter().find(|p| p.ends_with(format!("r{}", r2.region))).unwrap();
    File::options().write(true).open(two).unwrap().set_len(MIB).unwrap();
    let d = common::start(&setup.config, setup.dir.path());
    let none_left = connect(&setup.socket, Some(token)).unwrap_err();
    assert_eq!(none_left.code, ErrorCode::NotFound, "the session held nothing else");
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    let s = status(&mut b);
    assert_eq!(s.regions, 0);
    let lost: Vec<&str> =
        s.problems.iter().filter(|p| p.kind == ProblemKind::Other).map(|p| p.detail.as_str()).collect();
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost[0].contains(&format!("region {}", r1.region)) && lost[0].contains("missing"), "{lost:?}");
    assert!(lost[1].contains(&format!("region {}", r2.region)) && lost[1].contains("bytes"), "{lost:?}");
    assert!(region_files(&setup.state).is_empty(), "the file of the wrong size is removed");
    assert!(d.log().contains("region dropped at start"));
}

/// A region that lies past its device's memory after a restart (the device shrank while the
/// daemon was down) keeps its range and its owner can take it back; the status names it.
/// Before, it was dropped as overlapping another region and its file deleted.
#[test]
fn a_region_past_a_device_that_shrank_while_down_survives_with_a_problem() {
    let sims = tempfile::tempdir().unwrap();
    let sim = sims.path().join("sim.toml");
    let text = std::fs::read_to_string(common::sim_file()).unwrap();
    std::fs::write(&sim, &text).unwrap();
    let setup = common::Setup::with_sim(&sim, "");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (big, _) = alloc(&mut a, &gpu(), 50 << 30);
    stop(d, false);
    std::fs::write(&sim, text.replace("hbm = \"80GiB\"", "hbm = \"40GiB\"")).unwrap();
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut a2, _) = connect(&setup.socket, Some(token)).expect("the region is still there to resume");
    let s = status(&mut a2);
    assert_eq!(s.regions, 1);
    let past: Vec<&str> =
        s.problems.iter().map(|p| p.detail.as_str()).filter(|p| p.contains("past the new size")).collect();
    assert!(past.iter().any(|p| p.contains(&format!("region {}", big.region))), "{:?}", s.problems);
    assert_eq!(region_files(&setup.state).len(), 1, "its file is kept");
    // Nothing new lands on the bytes it holds (all of the new 40 GiB), nor past them.
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(&gpu()), memory: MemoryClass::Hbm },
        size: 2 * MIB,
        align: 0,
    });
    match a2.call(req, &[]) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::NoSpace, "{body:?}"),
        other => panic!("a region landed on a held or missing range: {other:?}"),
    }
    drop(a);
}

// ------------------------------------------------------------ regions striped over a set

use common::{cxl_pool, on_set, two_way_set};

fn on_member(device: &str) -> AllocTarget {
    AllocTarget::Resource(ResourceName {
        device: DeviceName::truncated(device),
        memory: MemoryClass::CxlVolatile,
        ordinal: 0,
    })
}

/// The offset in its resource of the caller's region `id` (the `Regions` list).
fn region_offset(c: &mut Connection, id: u64) -> u64 {
    let Response::Regions(r) = c.call(Request::Regions(RegionsRequest { all: false }), &[]).unwrap().0 else {
        panic!()
    };
    r.regions.iter().find(|x| x.region == id).unwrap().offset
}

/// The `status` problems about regions dropped at start.
fn dropped_at_start(s: &StatusResponse) -> Vec<&str> {
    s.problems.iter().filter(|p| p.subject.as_str() == "memory").map(|p| p.detail.as_str()).collect()
}

fn set_region_restart(kill: bool) {
    let (set, m0, m1) = two_way_set();
    let setup = common::Setup::with_sim(&cxl_pool(), "[memory]\nresume_grace_s = 600\n");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    // 8 MiB over 2 members: DPA 0..4 MiB of each, set offset 0.
    let (r, f) = alloc_on(&mut a, on_set(&set), 8 * MIB);
    let gfa = r.gfa.expect("a set region has a GFA");
    let mut m = map_rw(&f, r.size);
    for (i, b) in m.iter_mut().enumerate() {
        *b = pattern(r.region, i);
    }
    let handle = export(&mut a, r.region);
    // A region on member 0 takes its DPA 4..6 MiB.
    let (direct, _) = alloc_on(&mut a, on_member(&m0), 2 * MIB);
    assert_eq!(region_offset(&mut a, direct.region), 4 * MIB);
    // A freed set region leaves no record behind.
    let (gone, _) = alloc_on(&mut a, on_set(&set), 4 * MIB);
    a.call(Request::Free(FreeRequest { region: gone.region, node: None }), &[]).unwrap();
    assert_eq!(region_files(&setup.state).len(), 2);

    stop(d, kill);
    let d = common::start(&setup.config, setup.dir.path());
    assert_eq!(region_files(&setup.state).len(), 2, "the set region's file and the direct one are kept");
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    let s = status(&mut b);
    assert_eq!(s.regions, 2, "{:?}", s.problems);
    assert!(dropped_at_start(&s).is_empty(), "{:?}", s.problems);
    // Its export imports, at the same GFA, with the contents written before the restart.
    let (i, fi) = import_at(&mut b, handle).unwrap();
    assert_eq!((i.region, i.size, i.gfa), (r.region, r.size, Some(gfa)));
    let mi = map_ro(&fi, r.size);
    assert!(mi.iter().enumerate().all(|(i, v)| *v == pattern(r.region, i)), "contents survive the restart");

    // The owner takes its session back by token.
    let (mut a2, token2) = connect(&setup.socket, Some(token)).unwrap();
    assert_eq!(token2, token);
    m[777] = !pattern(r.region, 777);
    assert_eq!(mi[777], !pattern(r.region, 777), "the owner's old mapping is still the region");
    // The set region's DPA range is taken in both members again: the next set region
    // skips DPA 0..6 MiB (set offset 12 MiB), and member 1's next region lands at 4 MiB.
    let (next, _) = alloc_on(&mut a2, on_set(&set), 4 * MIB);
    assert_eq!(next.gfa, Some(gfa + 12 * MIB));
    let (on1, _) = alloc_on(&mut a2, on_member(&m1), 2 * MIB);
    assert_eq!(region_offset(&mut a2, on1.region), 4 * MIB);
    let h2 = export(&mut a2, r.region);

    // A second restart: the resumed set region and its new export are journaled too (and
    // the compaction at start wrote them into the snapshot).
    drop(a);
    stop(d, kill);
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut c, _) = connect(&setup.socket, None).unwrap();
    let (i2, _) = import_at(&mut c, h2).unwrap();
    assert_eq!(i2.gfa, Some(gfa));
    let (mut a3, _) = connect(&setup.socket, Some(token)).unwrap();
    a3.call(Request::Free(FreeRequest { region: r.region, node: None }), &[]).unwrap();
    assert_eq!(import(&mut c, handle).unwrap_err().code, ErrorCode::InvalidHandle);
    let (again, _) = alloc_on(&mut a3, on_set(&set), 8 * MIB);
    assert_eq!(again.gfa, Some(gfa), "the freed set range is free in both members");
    drop((a2, b));
}

#[test]
fn set_regions_survive_sigterm_at_the_same_gfa() {
    set_region_restart(false);
}

#[test]
fn set_regions_survive_kill_9_at_the_same_gfa() {
    set_region_restart(true);
}

#[test]
fn a_set_region_whose_file_vanished_is_dropped_with_a_problem() {
    let (set, _, _) = two_way_set();
    let setup = common::Setup::with_sim(&cxl_pool(), "");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (r, _) = alloc_on(&mut a, on_set(&set), 4 * MIB);
    stop(d, true);
    let files = region_files(&setup.state);
    assert_eq!(files.len(), 1);
    std::fs::remove_file(&files[0]).unwrap();
    let d = common::start(&setup.config, setup.dir.path());
    assert_eq!(connect(&setup.socket, Some(token)).unwrap_err().code, ErrorCode::NotFound);
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    let s = status(&mut b);
    assert_eq!(s.regions, 0);
    let lost = dropped_at_start(&s);
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert!(lost[0].contains(&format!("region {}", r.region)) && lost[0].contains("missing"), "{lost:?}");
    // Its range is free again in both members.
    let (again, _) = alloc_on(&mut b, on_set(&set), 4 * MIB);
    assert_eq!(again.gfa, r.gfa);
    assert!(d.log().contains("region dropped at start"));
}

use common::configure_dax;

#[test]
fn a_dax_backed_set_region_survives_kill_9_and_is_dropped_when_the_dax_device_is_gone() {
    use std::os::unix::fs::FileExt;
    let (setup, set) = common::dax_backed_set("");
    let root = setup.dir.path().join("root");
    let d = common::start(&setup.config, setup.dir.path());
    let (mut a, token) = connect(&setup.socket, None).unwrap();
    let (first, _) = alloc_on(&mut a, on_set(&set), 4 * MIB);
    let (r, f) = alloc_on(&mut a, on_set(&set), 4 * MIB);
    assert_eq!(r.offset, 4 * MIB, "the second region is the DAX device's next 4 MiB");
    let bytes: Vec<u8> = (0..4 * MIB as usize).map(|i| pattern(r.region, i)).collect();
    f.write_all_at(&bytes, r.offset).unwrap();
    a.call(Request::Free(FreeRequest { region: first.region, node: None }), &[]).unwrap();
    let handle = export(&mut a, r.region);
    stop(d, true);

    let d = common::start(&setup.config, setup.dir.path());
    assert!(region_files(&setup.state).is_empty(), "DAX regions have no files of their own");
    let (mut b, _) = connect(&setup.socket, None).unwrap();
    let (i, fi) = import_at(&mut b, handle).unwrap();
    assert_eq!((i.offset, i.gfa), (r.offset, r.gfa), "same range of the device, same GFA");
    let mut got = vec![0u8; bytes.len()];
    fi.read_exact_at(&mut got, i.offset).unwrap();
    assert!(got == bytes, "contents survive the restart");
    let (mut a2, _) = connect(&setup.socket, Some(token)).unwrap();
    // Its range is taken again: the next region is not at 4 MiB (the freed 0..4 MiB is).
    let (next, _) = alloc_on(&mut a2, on_set(&set), 8 * MIB);
    assert_eq!(next.offset, 8 * MIB);
    // Killed with the owner still connected: its session waits for it in the journal.
    stop(d, true);
    drop((a, a2, b));

    // The operator stops exporting the DAX device: its regions cannot come back.
    configure_dax(&setup, &root, "");
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut c, _) = connect(&setup.socket, None).unwrap();
    let s = status(&mut c);
    assert_eq!(s.regions, 0);
    let lost = dropped_at_start(&s);
    assert_eq!(lost.len(), 2, "{lost:?}");
    assert!(lost.iter().all(|l| l.contains("dax0.0") && l.contains("no longer backs")), "{lost:?}");
    assert_eq!(import(&mut c, handle).unwrap_err().code, ErrorCode::InvalidHandle);
}
