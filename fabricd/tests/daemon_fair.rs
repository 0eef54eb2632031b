//! Fairness on the real daemon: a client's large pin holds up no one else (another
//! client's `Ping` is answered while it runs), is given up when its client hangs up and
//! does not keep SIGTERM waiting; one session's backlog of copies does not hold up another
//! session's small copy; by default one uid cannot allocate all of the fabric's device
//! memory.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, CodecError, Connection, CopyEndpoint, CopyRequest, CopyResult, DeviceName, ErrorCode, ErrorDetail,
    Event, RegisterRequest, RegisterSource, Request, Response,
};
use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// A pin that takes a few times the yardstick's time.
const BIG: u64 = 3 * GIB;

fn gpus() -> Vec<(String, u64)> {
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    inv.devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
        .map(|d| (d.id.to_string(), d.memory.iter().map(|m| m.size).sum()))
        .collect()
}

fn start() -> (common::Setup, common::Daemon) {
    let setup = common::Setup::with_sim(&common::sim_file(), "[memory]\nsize_check_s = 0\n");
    let daemon = common::start(&setup.config, setup.dir.path());
    (setup, daemon)
}

fn memfd(len: u64) -> OwnedFd {
    let name = CString::new("fair-test").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
    fd
}

fn register_req(gpu: &str, len: u64) -> Request {
    Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source: RegisterSource::Fd,
        offset: 0,
        len,
        access: AccessMode::ReadWrite,
        node: None,
    })
}

/// Registers all of `fd` (`len` bytes) for `gpu`: the registration id.
fn register(c: &mut Connection, gpu: &str, fd: &OwnedFd, len: u64) -> u64 {
    let (r, _) = c.call(register_req(gpu, len), &[fd.as_fd()]).unwrap();
    let Response::Register(r) = r else { panic!("{r:?}") };
    r.registration
}

/// Registers `len` bytes of a new memfd on a thread of its own (the daemon pins them
/// while the caller goes on): the time the registration took, or its refusal.
fn register_in_background(
    mut c: Connection,
    gpu: String,
    len: u64,
) -> std::thread::JoinHandle<(Duration, Result<u64, CodecError>)> {
    std::thread::spawn(move || {
        let fd = memfd(len);
        let t = Instant::now();
        let r = c.call(register_req(&gpu, len), &[fd.as_fd()]).map(|(r, _)| match r {
            Response::Register(r) => r.registration,
            other => panic!("{other:?}"),
        });
        (t.elapsed(), r)
    })
}

/// Bytes the daemon has locked (`VmLck` of `/proc/PID/status`).
fn locked(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = status.lines().find_map(|l| l.strip_prefix("VmLck:")).map(|v| v.trim().trim_end_matches("kB").trim());
    kib.and_then(|k| k.parse::<u64>().ok()).map_or(0, |k| k << 10)
}

/// Waits until the daemon has at least `bytes` locked (a pin is under way).
fn wait_locked(pid: u32, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while locked(pid) < bytes {
        assert!(Instant::now() < deadline, "the daemon never locked {bytes} bytes");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// How long one uncontended registration of a new `len`-byte memfd takes here (then
/// undone): the yardstick the tests below compare with, so that they hold on a slow or
/// loaded machine as on a fast one.
fn pin_time(c: &mut Connection, gpu: &str, len: u64) -> Duration {
    let fd = memfd(len);
    let t = Instant::now();
    let id = register(c, gpu, &fd, len);
    let took = t.elapsed();
    let req = Request::Unregister(fabric_proto::wire::UnregisterRequest { registration: id });
    assert_eq!(c.call(req, &[]).unwrap().0, Response::Unregister);
    took
}

#[test]
fn a_large_pin_holds_up_no_other_client() {
    let (setup, _daemon) = start();
    let gpu = gpus()[0].0.clone();
    let mut other = common::client(&setup.socket);
    let pinning = register_in_background(common::client(&setup.socket), gpu, GIB);
    // Before the fix, the registry lock was held for the whole pin and every request
    // (Ping too: each request ends by taking it) waited for the pin to end.
    let mut slowest = Duration::ZERO;
    let mut pings = 0;
    while !pinning.is_finished() {
        let t = Instant::now();
        assert_eq!(other.call(Request::Ping, &[]).unwrap().0, Response::Ping);
        slowest = slowest.max(t.elapsed());
        pings += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    let (took, r) = pinning.join().unwrap();
    r.unwrap();
    assert!(pings >= 2, "the pin ended before a second ping ({took:?})");
    assert!(
        slowest * 4 < took,
        "a ping waited {slowest:?} while a pin of 1 GiB took {took:?}: the pin held everyone up"
    );
}

#[test]
fn sigterm_ends_the_daemon_during_a_pin_and_a_hang_up_abandons_it() {
    // The default pinned limit is a quarter of the machine's memory (fabricd/src/memory/limits.rs).
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    if (kib << 10) / 4 < BIG {
        println!("skipped: pins of {BIG} bytes need a machine of 4 times that");
        return;
    }
    let (setup, mut daemon) = start();
    let gpu = gpus()[0].0.clone();
    let pid = daemon.child.id();
    let yardstick = pin_time(&mut common::client(&setup.socket), &gpu, GIB);

    // A client that hangs up during its pin: the pin is given up, not finished.
    let c = common::client(&setup.socket);
    let hang_up = c.stream().try_clone().unwrap();
    let pinning = register_in_background(c, gpu.clone(), BIG);
    wait_locked(pid, 64 * MIB);
    let t = Instant::now();
    hang_up.shutdown(std::net::Shutdown::Both).unwrap();
    while locked(pid) > 0 {
        assert!(t.elapsed() < yardstick, "a pin of 3 GiB went on after its client hung up ({yardstick:?} per GiB)");
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = pinning.join().unwrap();
    // The refusal is logged once the pin is undone.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !daemon.log().contains("pinning abandoned") {
        assert!(Instant::now() < deadline, "{}", daemon.log());
        std::thread::sleep(Duration::from_millis(10));
    }

    // SIGTERM while a pin runs: the daemon stops without waiting for it.
    let pinning = register_in_background(common::client(&setup.socket), gpu, BIG);
    wait_locked(pid, 64 * MIB);
    let t = Instant::now();
    // SAFETY: kill sends a signal to the daemon this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGTERM) }, 0);
    let st = common::wait_exit(&mut daemon.child, 30);
    let stopped = t.elapsed();
    assert!(st.success(), "{st:?}");
    assert!(stopped < yardstick, "SIGTERM took {stopped:?} during a pin of 3 GiB (one GiB pins in {yardstick:?} here)");
    let (_, r) = pinning.join().unwrap();
    assert!(r.is_err(), "the abandoned registration is not acknowledged: {r:?}");
}

#[test]
fn a_backlog_of_copies_does_not_hold_up_another_sessions_copy() {
    const COPIES: usize = 32;
    let (setup, _daemon) = start();
    let gpu = gpus()[0].0.clone();

    // Session A queues 32 copies of 64 MiB (2 GiB) between two memory objects.
    let mut a = common::client(&setup.socket);
    let (src, dst) = (memfd(64 * MIB), memfd(64 * MIB));
    let (rs, rd) = (register(&mut a, &gpu, &src, 64 * MIB), register(&mut a, &gpu, &dst, 64 * MIB));
    // Session B's copy is small.
    let mut b = common::client(&setup.socket);
    let (bsrc, bdst) = (memfd(4096), memfd(4096));
    let (bs, bd) = (register(&mut b, &gpu, &bsrc, 4096), register(&mut b, &gpu, &bdst, 4096));

    let copy = |c: &mut Connection, dst: u64, src: u64, len: u64| {
        let req = Request::Copy(CopyRequest {
            dst: CopyEndpoint::Registration { id: dst, offset: 0 },
            src: CopyEndpoint::Registration { id: src, offset: 0 },
            len,
        });
        let Response::Copy(r) = c.call(req, &[]).unwrap().0 else { panic!() };
        r.copy
    };
    for _ in 0..COPIES {
        copy(&mut a, rd, rs, 64 * MIB);
    }
    // A's completions are counted as they come.
    let a_done = Arc::new(AtomicUsize::new(0));
    let counter = a_done.clone();
    let reader = std::thread::spawn(move || {
        while counter.load(Ordering::SeqCst) < COPIES {
            if let Event::CopyDone(d) = a.next_event().unwrap() {
                assert_eq!(d.result, CopyResult::Ok);
                counter.fetch_add(1, Ordering::SeqCst);
            }
        }
    });
    let id = copy(&mut b, bd, bs, 4096);
    let d = loop {
        if let Event::CopyDone(d) = b.next_event().unwrap() {
            break d;
        }
    };
    let before = a_done.load(Ordering::SeqCst);
    assert_eq!((d.copy, d.result, d.bytes), (id, CopyResult::Ok, 4096));
    // Before the fix the small copy queued behind all of A's 512 chunks.
    assert!(before <= COPIES / 2, "B's 4 KiB copy completed only after {before} of A's {COPIES} copies");
    reader.join().unwrap();
}

#[test]
fn by_default_one_uid_cannot_allocate_all_device_memory() {
    let (setup, _daemon) = start();
    let gpus = gpus();
    let total: u64 = gpus.iter().map(|g| g.1).sum();
    let mut c = common::client(&setup.socket);
    let mut allocated = 0;
    let mut refused = None;
    for (gpu, size) in &gpus {
        let req = Request::Alloc(fabric_proto::wire::AllocRequest {
            target: fabric_proto::wire::AllocTarget::Device {
                device: DeviceName::truncated(gpu),
                memory: fabric_proto::wire::MemoryClass::Hbm,
            },
            size: *size,
            align: 0,
        });
        match c.call(req, &[]) {
            Ok((Response::Alloc(a), _)) => allocated += a.size,
            Err(CodecError::Refused { body, .. }) => {
                refused = Some(body);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let body = refused.unwrap_or_else(|| panic!("one uid allocated all {total} bytes of HBM"));
    assert_eq!(body.code, ErrorCode::LimitExceeded, "{}", body.message);
    let Some(ErrorDetail::Limit { what, max, .. }) = body.detail else { panic!("{body:?}") };
    assert_eq!(what.as_str(), "allocated_bytes");
    // Half of the device memory (the HBM; host DRAM does not count).
    assert_eq!(max, total / 2);
    assert!(allocated <= total / 2 && allocated > 0);
}
