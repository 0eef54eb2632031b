//! Copies by the daemon's copy engine through the library: poll, wait, wait with a
//! timeout and callbacks; typed refusals; and two processes — one exports a region, the
//! other imports it and has the engine copy from it into its own region and into its own
//! locked memory registered for DMA (made with a raw request: the library's registration
//! API is not part of this crate yet).
//!
//! The exporter is this same test binary re-run with `--ignored --exact exporter_process`.
#![allow(clippy::unwrap_used, clippy::print_stdout, reason = "the exporter child reports on stdout")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fabric_mm::{Access, CopyEndpoint, Error, Handle, Memory, MemoryClass, Policy, Target};
use fabric_proto::wire::ErrorCode;

const ENV_SOCKET: &str = "FABRIC_MM_COPY_TEST_SOCKET";
const LEN: u64 = 4 << 20;
const MIB: u64 = 1 << 20;

fn pattern(seed: u8, i: usize) -> u8 {
    (i.wrapping_mul(29) ^ (i >> 10)) as u8 ^ seed
}

/// The exporter: allocate, store the pattern, export, print the handle and GFA; exit at
/// the end of stdin.
#[test]
#[ignore = "the exporter process of the copy tests, which run it"]
fn exporter_process() {
    let Ok(socket) = std::env::var(ENV_SOCKET) else { return };
    let s = common::session(std::path::Path::new(&socket));
    let region = s.alloc(&Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm }, LEN).unwrap();
    let m = s.map(&region).unwrap();
    // SAFETY: this process is the only writer, before it exports.
    let bytes = unsafe { m.as_mut_slice().unwrap() };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(5, i);
    }
    let handle = s.export(&region, &Policy { read_only: true, ..Policy::default() }).unwrap();
    println!("\nHANDLE {handle} {:#x}", m.gfa());
    std::io::stdout().flush().unwrap();
    for _ in std::io::stdin().lock().lines() {}
}

fn session_and_regions(socket: &std::path::Path) -> (fabric_mm::Session, fabric_mm::Mapping, fabric_mm::Mapping) {
    let s = common::session(socket);
    let t = Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm };
    let a = s.map(&s.alloc(&t, LEN).unwrap()).unwrap();
    let b = s.map(&s.alloc(&t, LEN).unwrap()).unwrap();
    // SAFETY: nothing else writes these regions yet.
    unsafe { a.as_mut_slice().unwrap() }.iter_mut().enumerate().for_each(|(i, x)| *x = pattern(1, i));
    (s, a, b)
}

#[test]
fn a_copy_is_polled_waited_for_and_called_back() {
    let d = common::daemon();
    let (s, a, b) = session_and_regions(&d.socket);
    assert_eq!(s.protocol_version(), fabric_proto::wire::PROTOCOL_VERSION);
    let (ga, gb) = (a.gfa(), b.gfa());

    // Poll until done, then wait gives the same answer.
    let c = s.copy(CopyEndpoint::Gfa(gb), CopyEndpoint::Gfa(ga), 3 * MIB).unwrap();
    let polled = loop {
        if let Some(r) = c.poll() {
            break r.unwrap();
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(polled, 3 * MIB);
    assert_eq!(c.wait().unwrap(), 3 * MIB);
    assert_eq!(c.wait_timeout(Duration::ZERO).unwrap().unwrap(), 3 * MIB);
    // SAFETY: the copy is done; nothing writes b now.
    let got = unsafe { b.as_slice() };
    assert!((0..3 * MIB as usize).all(|i| got[i] == pattern(1, i)), "the engine's bytes landed");
    assert!(got[3 * MIB as usize..].iter().all(|&x| x == 0));

    // A callback on the reader thread.
    let (tx, rx) = mpsc::channel();
    let c2 = s
        .copy_with(CopyEndpoint::Gfa(gb + MIB), CopyEndpoint::Gfa(ga + 7), MIB, move |r| tx.send(r.unwrap()).unwrap())
        .unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), MIB);
    assert!(matches!(c2.poll(), Some(Err(Error::InvalidArgument(_)))), "the result went to the callback");
    drop(c2);
    // A callback set after the copy finished runs at once, here.
    let c3 = s.copy(CopyEndpoint::Gfa(gb), CopyEndpoint::Gfa(ga + 1), 4096).unwrap();
    c3.wait().unwrap();
    let (tx, rx) = mpsc::channel();
    c3.on_complete(move |r| tx.send(r.unwrap()).unwrap()).unwrap();
    assert_eq!(rx.try_recv().unwrap(), 4096);
    // SAFETY: all copies are done.
    let got = unsafe { b.as_slice() };
    assert!((0..4096).all(|i| got[i] == pattern(1, i + 1)));
    assert!((0..MIB as usize).all(|i| got[MIB as usize + i] == pattern(1, i + 7)));

    // Many at once, each resolved.
    let copies: Vec<_> = (0..16u64)
        .map(|i| s.copy(CopyEndpoint::Gfa(gb + i * 65536), CopyEndpoint::Gfa(ga + i * 65536), 65536).unwrap())
        .collect();
    for c in &copies {
        assert_eq!(c.wait_timeout(Duration::from_secs(10)).unwrap().unwrap(), 65536);
    }

    // Refusals come back from copy() typed, with their C code.
    let e = s.copy(CopyEndpoint::Gfa(gb), CopyEndpoint::Gfa(ga), 0).unwrap_err();
    assert!(matches!(e, Error::Refused { code: ErrorCode::BadRequest, .. }), "{e}");
    assert_eq!(e.code(), fabric_mm::ffi::FMM_E_BAD_REQUEST);
    let e = s.copy(CopyEndpoint::Gfa(gb), CopyEndpoint::Registration { id: 4242, offset: 0 }, 1).unwrap_err();
    assert!(matches!(e, Error::Refused { code: ErrorCode::NotFound, .. }), "{e}");
}

#[test]
fn another_process_exports_and_this_one_imports_and_copies() {
    let d = common::daemon();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "exporter_process", "--nocapture", "--test-threads=1"])
        .env(ENV_SOCKET, &d.socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let (handle, gfa) = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the exporter exited before exporting");
        if let Some(rest) = line.trim().strip_prefix("HANDLE ") {
            let mut f = rest.split(' ');
            let h: Handle = f.next().unwrap().parse().unwrap();
            break (h, u64::from_str_radix(f.next().unwrap().trim_start_matches("0x"), 16).unwrap());
        }
    };
    let s = common::session(&d.socket);
    let import = s.import(&handle, false).unwrap();
    assert_eq!(import.gfa(), Some(gfa));
    let t = Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm };
    let mine = s.map(&s.alloc(&t, LEN).unwrap()).unwrap();

    // Import (by GFA) to this process's region (by GFA).
    let c = s.copy(CopyEndpoint::Gfa(mine.gfa() + 10), CopyEndpoint::Gfa(gfa + 3), 2 * MIB).unwrap();
    assert_eq!(c.wait().unwrap(), 2 * MIB);
    // SAFETY: the copy is done.
    let got = unsafe { mine.as_slice() };
    assert!((0..2 * MIB as usize).all(|i| got[10 + i] == pattern(5, i + 3)), "the exporter's bytes landed");
    // The import is read-only: no copy into it.
    let e = s.copy(CopyEndpoint::Gfa(gfa), CopyEndpoint::Gfa(mine.gfa()), 16).unwrap_err();
    assert!(matches!(e, Error::Refused { code: ErrorCode::PermissionDenied, .. }), "{e}");

    // Import to this process's own locked memory, registered for DMA.
    let mut buf = vec![0u8; MIB as usize];
    // SAFETY: the buffer lives (and is not touched through a reference) until the copy is
    // done and the registration dropped.
    let reg = unsafe { s.register_ptr(buf.as_mut_ptr(), buf.len(), &common::gpu(&s), Access::ReadWrite) }.unwrap();
    let c = s.copy(reg.at(0), CopyEndpoint::Gfa(gfa + MIB), MIB).unwrap();
    assert_eq!(c.wait().unwrap(), MIB);
    // SAFETY: the copy is done: nothing writes the buffer now (read through its pointer,
    // which the daemon was given).
    let seen = unsafe { std::slice::from_raw_parts(std::ptr::addr_of!(buf[0]), buf.len()) };
    assert!(
        seen.iter().enumerate().all(|(i, &x)| x == pattern(5, MIB as usize + i)),
        "the engine wrote this process's memory"
    );

    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn host_buffers_are_sealed_so_the_engine_copies_them_with_the_cpu() {
    let d = common::daemon();
    let s = common::session(&d.socket);
    let dev = common::gpu(&s);
    let (a, b) = (s.alloc_host(2 * MIB).unwrap(), s.alloc_host(2 * MIB).unwrap());
    let n = 2 * MIB as usize;
    // SAFETY: the buffer is `n` bytes, and nothing else touches it yet.
    unsafe { std::slice::from_raw_parts_mut(a.as_ptr(), n) }.iter_mut().enumerate().for_each(|(i, x)| {
        *x = pattern(3, i);
    });
    let (ra, rb) = (s.register(&a, &dev, Access::ReadWrite).unwrap(), s.register(&b, &dev, Access::ReadWrite).unwrap());
    let log = d.log();
    for id in [ra.id(), rb.id()] {
        let line = log
            .lines()
            .find(|l| l.contains("registered for DMA") && l.contains(&format!("registration={id} ")))
            .unwrap_or_else(|| panic!("registration {id} not in the log:\n{log}"));
        assert!(line.contains("cpu_copy=true"), "a host buffer is not sealed against shrinking: {line}");
    }
    let reg = |r: &fabric_mm::Registration, offset| CopyEndpoint::Registration { id: r.id(), offset };
    let c = s.copy(reg(&rb, 4096), reg(&ra, 5), MIB).unwrap();
    assert_eq!(c.wait().unwrap(), MIB);
    // SAFETY: the copy is done; nothing writes `b` now.
    let got = unsafe { std::slice::from_raw_parts(b.as_ptr(), n) };
    assert!(got[..4096].iter().all(|&x| x == 0));
    assert!((0..MIB as usize).all(|i| got[4096 + i] == pattern(3, i + 5)), "the CPU copy's bytes differ");
    assert!(got[4096 + MIB as usize..].iter().all(|&x| x == 0));
}

#[test]
fn a_batch_is_one_copy_with_the_bytes_of_all_its_parts() {
    let d = common::daemon();
    let (s, a, b) = session_and_regions(&d.socket);
    let (ga, gb) = (a.gfa(), b.gfa());
    let part = |dst: u64, src: u64, len: u64| fabric_mm::CopyPart {
        dst: CopyEndpoint::Gfa(gb + dst),
        src: CopyEndpoint::Gfa(ga + src),
        len,
    };
    let parts = [part(0, MIB, MIB), part(2 * MIB, 0, MIB + 7), part(MIB, 3 * MIB, 4096)];
    let c = s.copy_batch(&parts).unwrap();
    assert_eq!(c.wait().unwrap(), 2 * MIB + 7 + 4096);
    // SAFETY: the batch completed; nothing writes `b` now.
    let got = unsafe { b.as_slice() };
    for p in &parts {
        let (CopyEndpoint::Gfa(dst), CopyEndpoint::Gfa(src)) = (p.dst, p.src) else { unreachable!() };
        let (dst, src) = ((dst - gb) as usize, (src - ga) as usize);
        for i in (0..p.len as usize).step_by(997) {
            assert_eq!(got[dst + i], pattern(1, src + i), "part at {dst:#x}, byte {i}");
        }
    }
    // One bad part refuses the batch; more than 64 parts are refused before sending.
    let e = s.copy_batch(&[parts[0], part(0, LEN, 1)]).unwrap_err();
    assert!(matches!(&e, Error::Refused { message, .. } if message.contains("copy 1 of the batch")), "{e}");
    assert!(matches!(s.copy_batch(&[parts[2]; 65]), Err(Error::InvalidArgument(_))));
}

/// A copy whose connection ends before its completion comes has its callback called once,
/// with `Disconnected`, and a callback set after the end (on a copy that had none) is
/// called at once with it; without that a caller waiting on its callback would wait
/// forever. The copies are large so that the disconnect usually comes first; rounds repeat
/// until it has (a copy that finished first calls back with its bytes, also exactly once).
#[test]
fn a_copy_cut_off_by_the_end_of_its_connection_calls_back_with_disconnected() {
    let d = common::daemon();
    let (mut cut_off, mut late_cut_off) = (0, 0);
    for _ in 0..20 {
        let s = common::session(&d.socket);
        let t = Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm };
        let big = 256 * MIB;
        let a = s.map(&s.alloc(&t, big).unwrap()).unwrap();
        let b = s.map(&s.alloc(&t, big).unwrap()).unwrap();
        let (tx, rx) = mpsc::channel();
        let c = s.copy(CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), big).unwrap();
        c.on_complete(move |r| tx.send(r).unwrap()).unwrap();
        // Its callback is set after the end.
        let later = s.copy(CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), big).unwrap();
        s.disconnect();
        let first = rx.recv_timeout(Duration::from_secs(10)).expect("the callback ran");
        assert!(rx.recv_timeout(Duration::from_millis(200)).is_err(), "the callback ran twice");
        match first {
            Ok(n) => assert_eq!(n, big),
            Err(Error::Disconnected) => cut_off += 1,
            Err(e) => panic!("unexpected copy outcome {e}"),
        }
        // One callback per copy, before the end or after.
        assert!(matches!(c.on_complete(|_| {}), Err(Error::InvalidArgument(_))));
        // The connection is over: a callback set now runs at once, here.
        let (tx, rx) = mpsc::channel();
        later.on_complete(move |r| tx.send(r).unwrap()).unwrap();
        match rx.try_recv().expect("a callback set after the end ran at once") {
            Ok(n) => assert_eq!(n, big),
            Err(Error::Disconnected) => late_cut_off += 1,
            Err(e) => panic!("unexpected copy outcome {e}"),
        }
        if cut_off >= 3 && late_cut_off >= 1 {
            break;
        }
    }
    assert!(cut_off >= 1, "the disconnect never came before a 256 MiB copy's completion in 20 rounds");
    assert!(late_cut_off >= 1, "the disconnect never came before the second copy's completion in 20 rounds");
}

/// One callback per copy: a second `on_complete`, while the first is still to run or after
/// it ran, is refused and never runs (before: it was kept and never called, so a waiter on
/// it — the Python binding's second `await` — hung).
#[test]
fn a_copy_takes_one_callback_and_refuses_a_second() {
    let d = common::daemon();
    let (s, a, b) = session_and_regions(&d.socket);
    let (ga, gb) = (a.gfa(), b.gfa());
    let (tx, rx) = mpsc::channel();
    let first = tx.clone();
    let c = s
        .copy_with(CopyEndpoint::Gfa(gb), CopyEndpoint::Gfa(ga), LEN, move |r| {
            first.send(("first", r.unwrap())).unwrap()
        })
        .unwrap();
    let second = tx.clone();
    let e = c.on_complete(move |r| second.send(("second", r.unwrap())).unwrap()).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("one per copy")), "{e}");
    assert_eq!(e.code(), fabric_mm::ffi::FMM_E_ARG);
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), ("first", LEN));
    // After it ran, the same; and a callback set on a copy already done runs at once, once.
    let third = tx.clone();
    assert!(matches!(
        c.on_complete(move |r| third.send(("third", r.unwrap())).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    let c = s.copy(CopyEndpoint::Gfa(gb), CopyEndpoint::Gfa(ga), MIB).unwrap();
    assert_eq!(c.wait().unwrap(), MIB);
    let fourth = tx.clone();
    c.on_complete(move |r| fourth.send(("fourth", r.unwrap())).unwrap()).unwrap();
    assert_eq!(rx.try_recv().unwrap(), ("fourth", MIB));
    let fifth = tx.clone();
    assert!(matches!(
        c.on_complete(move |r| fifth.send(("fifth", r.unwrap())).unwrap()),
        Err(Error::InvalidArgument(_))
    ));
    std::thread::sleep(Duration::from_millis(100));
    assert!(rx.try_recv().is_err(), "a refused callback ran");
}

/// A wait for a copy made in one of its session's callbacks is refused, as any call that
/// waits for the daemon is there: the callback's thread is the one that reads the
/// completion (before, the wait blocked it — for good while the copy still ran). `poll`
/// works there, and the wait after the callback.
#[test]
fn waiting_for_a_copy_in_a_callback_of_its_session_is_refused() {
    let d = common::daemon();
    let (s, a, b) = session_and_regions(&d.socket);
    let c = std::sync::Arc::new(s.copy(CopyEndpoint::Gfa(b.gfa()), CopyEndpoint::Gfa(a.gfa()), MIB).unwrap());
    // Done first, so that the refusal is the only way for the waits below to fail.
    assert_eq!(c.wait().unwrap(), MIB);
    // A revocation callback: an import of another session's region, revoked.
    let owner = common::session(&d.socket);
    let region = owner.alloc(&Target::Device { device: common::gpu(&owner), memory: MemoryClass::Hbm }, LEN).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let _import = s.import(&handle, false).unwrap();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let inside = c.clone();
    s.on_revocation(move |_| {
        let got = (inside.wait(), inside.wait_timeout(Duration::from_secs(1)), inside.poll());
        let _ = tx.lock().unwrap().send(got);
    });
    owner.revoke(&handle).unwrap();
    let (wait, timed, polled) = rx.recv_timeout(Duration::from_secs(10)).expect("the callback returned");
    assert!(matches!(&wait, Err(Error::InvalidArgument(m)) if m.contains("callbacks")), "{wait:?}");
    assert!(matches!(&timed, Some(Err(Error::InvalidArgument(m))) if m.contains("callbacks")), "{timed:?}");
    assert_eq!(polled.unwrap().unwrap(), MIB, "poll answers there");
    assert_eq!(c.wait().unwrap(), MIB, "and the wait after the callback");
}

/// A bare pointer's registration dropped in another copy's callback while a copy into its
/// bytes runs: the drop returns only once the daemon stopped writing them. Before, in a
/// callback the unregister was only sent, the drop returned at once, and memory the
/// caller then freed and reused (here: mapped afresh at the same address) went on being
/// written by the engine. (Here the old drop's own bookkeeping of the 65,536 locked pages
/// took about as long as the daemon's stop, so this test did not catch it: it holds the
/// promise, not the race.)
#[test]
fn a_pointer_registration_dropped_in_a_callback_is_let_go_once_no_copy_writes_it() {
    const BIG: u64 = 256 * MIB;
    let d = common::daemon_with_config("[copy]\nengines = 3\nchunk_bytes = 134217728\n");
    let s = common::session(&d.socket);
    let t = Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm };
    let src = s.map(&s.alloc(&t, BIG).unwrap()).unwrap();
    // SAFETY: nothing else touches the mapping yet.
    unsafe { src.as_mut_slice().unwrap() }.fill(0x77);
    let small = s.map(&s.alloc(&t, MIB).unwrap()).unwrap();
    for attempt in 0..5 {
        // SAFETY: a fresh anonymous mapping of BIG bytes.
        let buf = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                BIG as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(buf, libc::MAP_FAILED);
        let at = buf as usize;
        // SAFETY: the mapping stays until the end of this attempt (replaced in place, as
        // a free and a new allocation may do, only once the registration is dropped).
        let reg =
            unsafe { s.register_ptr(buf.cast::<u8>(), BIG as usize, &common::gpu(&s), Access::ReadWrite) }.unwrap();
        let big = s.copy(reg.at(0), CopyEndpoint::Gfa(src.gfa()), BIG).unwrap();
        let held = std::sync::Arc::new(std::sync::Mutex::new(Some(reg)));
        let (tx, rx) = mpsc::channel();
        let in_callback = held.clone();
        let main = std::thread::current().id();
        let _b = s
            .copy_with(CopyEndpoint::Gfa(small.gfa()), CopyEndpoint::Gfa(src.gfa()), 4096, move |_| {
                // On the thread that read the completion (a callback proper), not at once
                // in `on_complete` because the copy was already done.
                let reader = std::thread::current().id() != main;
                let t0 = std::time::Instant::now();
                drop(in_callback.lock().unwrap().take());
                let waited = t0.elapsed();
                // The caller frees the buffer and reuses the address: fresh zero pages.
                // SAFETY: the registration is gone; the pages are this test's.
                let again = unsafe {
                    libc::mmap(
                        at as *mut libc::c_void,
                        BIG as usize,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                tx.send((again as usize == at, waited, reader)).unwrap();
            })
            .unwrap();
        let (remapped, waited, reader) = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        assert!(remapped, "the address was mapped again");
        let outcome = big.wait();
        // SAFETY: the fresh mapping of BIG bytes at `at`, which nothing may write now.
        let fresh = unsafe { std::slice::from_raw_parts(at as *const u8, BIG as usize) };
        let written = fresh.iter().filter(|&&b| b != 0).count();
        // SAFETY: unmaps the test's own mapping.
        unsafe { libc::munmap(at as *mut libc::c_void, BIG as usize) };
        eprintln!("attempt {attempt}: the drop waited {waited:?} (on the reader: {reader}); the big copy: {outcome:?}");
        assert_eq!(written, 0, "attempt {attempt}: {written} bytes written after the drop returned");
        // Dropped in a callback proper, while the big copy still ran (cut short): shown.
        if reader && outcome.is_err() {
            return;
        }
    }
    panic!("the drop never waited for a running copy: nothing shown");
}
