//! A client that stalls a copy in its own memory holds up only itself.
//!
//! The client registers memory whose pages are missing and watched by a userfaultfd
//! that never serves a fault. The daemon's `process_vm_readv` of it then blocks for as long
//! as the client likes. The copy engine has one thread here, so the engine itself is taken.
//!
//! While the copy is stalled:
//! - another session's copy still completes: the watchdog replaces the engine thread;
//! - the stalling client's own `Unregister` waits for the access in flight;
//! - another session's `Free` and `Unregister` are answered at once, though their sweeps
//!   stop the stalled copy.
//!
//! Once the client lets the fault go (it closes its userfaultfd), its `Unregister` is
//! answered and its copy completes. A stalling client that disconnects instead still has
//! its regions reclaimed and their importers told at once; only the end of its session's
//! teardown waits for the stall. It needs a userfaultfd that catches the kernel's own
//! accesses: root, or `vm.unprivileged_userfaultfd = 1`. Otherwise it prints why it
//! skipped.
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "a test")]

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, Connection, CopyEndpoint, CopyRequest, CopyResult, DeviceName, ErrorCode, Event, FreeRequest,
    ImportRequest, RegisterRequest, RegisterSource, Request, Response, RevocationReason, SubscribeRequest, Topics,
    UnregisterRequest,
};
use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;

// The userfaultfd ABI (linux/userfaultfd.h), which the libc crate does not carry.
const UFFD_API: u64 = 0xaa;
/// `_IOWR(0xaa, 0x3f, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
/// `_IOWR(0xaa, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRegister {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// `len` bytes of this process's memory, locked on fault (so that the daemon takes it as
/// locked memory, its pages still missing), every missing-page fault caught by a
/// userfaultfd nobody reads: an access blocks until the descriptor is closed (then the
/// pages fault in as zeros). `None`, with the reason, where no such userfaultfd is allowed.
fn stalling_memory(len: usize) -> Result<(usize, OwnedFd), String> {
    // SAFETY: a new private anonymous mapping; no address of ours is passed.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED);
    // SAFETY: locks the mapping just made, on fault: nothing is populated.
    let locked = unsafe { libc::syscall(libc::SYS_mlock2, addr, len, libc::MLOCK_ONFAULT) };
    assert_eq!(locked, 0, "mlock2: {}", std::io::Error::last_os_error());
    // SAFETY: userfaultfd takes flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return Err(format!("no userfaultfd: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the descriptor was just made and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut api = UffdioApi { api: UFFD_API, features: 0, ioctls: 0 };
    // SAFETY: the ioctl reads and writes the struct, which lives across the call.
    assert_eq!(unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api) }, 0);
    let mut reg = UffdioRegister { start: addr as u64, len: len as u64, mode: UFFDIO_REGISTER_MODE_MISSING, ioctls: 0 };
    // SAFETY: as above; the range is the mapping made here.
    assert_eq!(unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_REGISTER, &mut reg) }, 0);
    Ok((addr as usize, fd))
}

fn register(c: &mut Connection, gpu: &str, source: RegisterSource, len: u64) -> u64 {
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source,
        offset: 0,
        len,
        access: AccessMode::ReadWrite,
        node: None,
    });
    let Response::Register(r) = c.call(req, &[]).unwrap().0 else { panic!() };
    r.registration
}

fn start_copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> u64 {
    let Response::Copy(r) = c.call(Request::Copy(CopyRequest { dst, src, len }), &[]).unwrap().0 else { panic!() };
    r.copy
}

fn done(c: &mut Connection, copy: u64) -> fabric_proto::wire::CopyDone {
    loop {
        if let Event::CopyDone(d) = c.next_event().unwrap()
            && d.copy == copy
        {
            return d;
        }
    }
}

/// A one-engine daemon on the sim, and 2 MiB of stalling memory here.
struct Stage {
    addr: usize,
    uffd: OwnedFd,
    setup: common::Setup,
    daemon: common::Daemon,
    gpu: String,
}

/// The stage, or `None` (having said why) where no stalling userfaultfd is allowed.
fn stage() -> Option<Stage> {
    let (addr, uffd) = match stalling_memory(2 * MIB as usize) {
        Ok(m) => m,
        Err(why) => {
            eprintln!("skipped: {why} (needs root or vm.unprivileged_userfaultfd = 1)");
            return None;
        }
    };
    let setup = common::Setup::with_sim(
        &common::sim_file(),
        "[copy]\nengines = 1\nchunk_bytes = 262144\n[memory]\nsize_check_s = 0\n",
    );
    let daemon = common::start(&setup.config, setup.dir.path());
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap().id.to_string();
    Some(Stage { addr, uffd, setup, daemon, gpu })
}

/// Runs `f` and says how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    (f(), t.elapsed())
}

#[test]
fn a_client_stalling_a_copy_in_its_own_memory_holds_up_only_itself() {
    let Some(Stage { addr, uffd, setup, daemon, gpu }) = stage() else { return };

    // The stalling client: a copy from its memory into its region, which blocks in the
    // engine's read of the first page.
    let mut a = common::client(&setup.socket);
    let stalled = register(&mut a, &gpu, RegisterSource::Process { addr: addr as u64 }, 2 * MIB);
    let (ra, _) = common::alloc_hbm(&mut a, &gpu, 2 * MIB);
    let a_copy = start_copy(
        &mut a,
        CopyEndpoint::Gfa(ra.gfa.unwrap()),
        CopyEndpoint::Registration { id: stalled, offset: 0 },
        2 * MIB,
    );

    // Another session's copy completes: the stalled engine is replaced.
    let mut b = common::client(&setup.socket);
    let (rb1, _) = common::alloc_hbm(&mut b, &gpu, 2 * MIB);
    let (rb2, _) = common::alloc_hbm(&mut b, &gpu, 2 * MIB);
    let (gb1, gb2) = (rb1.gfa.unwrap(), rb2.gfa.unwrap());
    let (d, took) = timed(|| {
        let id = start_copy(&mut b, CopyEndpoint::Gfa(gb2), CopyEndpoint::Gfa(gb1), 2 * MIB);
        done(&mut b, id)
    });
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, 2 * MIB), "another session's copy");
    assert!(took < Duration::from_secs(10), "another session's copy took {took:?}");
    assert!(daemon.log().contains("stalled in the client's own memory"), "{}", daemon.log());

    // The stalling client's own unregister waits for the access in flight.
    let unregister = std::thread::spawn(move || {
        let (r, _) = a.call(Request::Unregister(UnregisterRequest { registration: stalled }), &[]).unwrap();
        assert_eq!(r, Response::Unregister);
        a
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(!unregister.is_finished(), "the unregister was answered with an access to its memory in flight");

    // Another session's free and unregister stop the stalled copy (what it depends on is
    // gone) without waiting for it.
    let rb = register(&mut b, &gpu, RegisterSource::Region(rb2.region), 2 * MIB);
    let (r, took) = timed(|| b.call(Request::Unregister(UnregisterRequest { registration: rb }), &[]).unwrap().0);
    assert_eq!(r, Response::Unregister);
    assert!(took < Duration::from_secs(2), "another session's unregister took {took:?}");
    let (r, took) = timed(|| b.call(Request::Free(FreeRequest { region: rb1.region, node: None }), &[]).unwrap().0);
    assert_eq!(r, Response::Free);
    assert!(took < Duration::from_secs(2), "another session's free took {took:?}");
    let (id, took) = timed(|| start_copy(&mut b, CopyEndpoint::Gfa(gb2), CopyEndpoint::Gfa(gb2 + MIB), MIB));
    assert_eq!(done(&mut b, id).result, CopyResult::Ok);
    assert!(took < Duration::from_secs(2), "another session's copy request took {took:?}");

    // The client lets the fault go: its unregister is answered, and its copy ends
    // (stopped by the unregister).
    drop(uffd);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !unregister.is_finished() {
        assert!(Instant::now() < deadline, "the unregister was not answered once the memory was served");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut a = unregister.join().unwrap();
    let d = done(&mut a, a_copy);
    match d.result {
        CopyResult::Failed { code, message } => {
            assert_eq!(code, ErrorCode::NotFound, "{message}");
            assert!(message.contains("unregistered"), "{message}");
        }
        CopyResult::Ok => panic!("the stalled copy completed after its unregister: {d:?}"),
    }
    // The daemon serves the client on.
    let (ra2, _) = common::alloc_hbm(&mut a, &gpu, 2 * MIB);
    let id = start_copy(&mut a, CopyEndpoint::Gfa(ra2.gfa.unwrap()), CopyEndpoint::Gfa(ra.gfa.unwrap()), 2 * MIB);
    assert_eq!(done(&mut a, id).result, CopyResult::Ok);
    let log = daemon.log();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn a_stalling_client_that_disconnects_has_its_regions_reclaimed_and_importers_told_at_once() {
    let Some(Stage { addr, uffd, setup, daemon, gpu }) = stage() else { return };

    // The stalling client exports a region another session imports, then stalls a copy
    // from its memory into it.
    let mut a = common::client(&setup.socket);
    let stalled = register(&mut a, &gpu, RegisterSource::Process { addr: addr as u64 }, 2 * MIB);
    let (ra, _) = common::alloc_hbm(&mut a, &gpu, 2 * MIB);
    let handle = common::export(&mut a, ra.region, AccessMode::ReadWrite);
    let mut b = common::client(&setup.socket);
    let Response::Subscribe(_) =
        b.call(Request::Subscribe(SubscribeRequest { topics: Topics::REVOCATION }), &[]).unwrap().0
    else {
        panic!()
    };
    let Response::Import(i) =
        b.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]).unwrap().0
    else {
        panic!()
    };
    start_copy(
        &mut a,
        CopyEndpoint::Gfa(ra.gfa.unwrap()),
        CopyEndpoint::Registration { id: stalled, offset: 0 },
        2 * MIB,
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.log().contains("stalled in the client's own memory") {
        assert!(Instant::now() < deadline, "the stall was not seen: {}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }

    // It disconnects with the copy stalled: its region goes, and the importer is told.
    drop(a);
    let (event, took) = timed(|| b.next_event().unwrap());
    let Event::Revocation(r) = event else { panic!("{event:?}") };
    assert_eq!((r.import, r.reason), (i.import, RevocationReason::OwnerExited));
    assert!(took < Duration::from_secs(5), "the importer was told after {took:?}");
    let Response::Status(st) = b.call(Request::Status(Default::default()), &[]).unwrap().0 else { panic!() };
    assert_eq!(st.regions, 0, "the disconnected client's region is still there");

    // The client lets the fault go: its session's teardown ends.
    drop(uffd);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.log().contains("session closed") {
        assert!(Instant::now() < deadline, "the teardown did not end: {}", daemon.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!daemon.log().contains("panicked"));
}
