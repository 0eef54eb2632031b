//! Two processes share fabric memory through the library: the owner allocates, maps and
//! stores, exports; another process imports, maps at the same GFA, loads what the owner
//! stored and stores back, which the owner sees with no daemon call per access. When the
//! owner is killed, the importer learns of the revocation by callback and by error.
//!
//! The owner is this same test binary re-run with `--ignored --exact owner_process`.
#![allow(clippy::unwrap_used, clippy::print_stdout, reason = "the owner child reports on stdout")]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use fabric_mm::{Error, Handle, Memory, MemoryClass, Policy, RevocationReason, Target};

const ENV_SOCKET: &str = "FABRIC_MM_TEST_SOCKET";
const LEN: u64 = 4 << 20;

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(7) ^ (i >> 12)) as u8
}

/// The owner: allocate, map, store the pattern, export, print the handle and GFA; on
/// "CHECK" verify the importer's stores and answer "SEEN"; exit at end of stdin.
#[test]
#[ignore = "the owner process of the sharing tests, which run it"]
fn owner_process() {
    let Ok(socket) = std::env::var(ENV_SOCKET) else { return };
    let s = common::session(std::path::Path::new(&socket));
    let region = s.alloc(&Target::Device { device: common::gpu(&s), memory: MemoryClass::Hbm }, LEN).unwrap();
    let m = s.map(&region).unwrap();
    // SAFETY: this process is the only writer until it prints the handle.
    let bytes = unsafe { m.as_mut_slice().unwrap() };
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = pattern(i);
    }
    let handle = s.export(&region, &Policy::default()).unwrap();
    println!("\nHANDLE {handle} {:#x} {:#x}", m.gfa(), m.as_ptr() as usize - s.window().base() as usize);
    std::io::stdout().flush().unwrap();
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        if line.unwrap() == "CHECK" {
            // SAFETY: the importer finished its stores before sending CHECK.
            let seen = unsafe { std::ptr::read_volatile(m.as_ptr().add(LEN as usize / 2)) };
            println!("SEEN {seen}");
            std::io::stdout().flush().unwrap();
        }
    }
}

#[allow(clippy::zombie_processes, reason = "the child is handed to the caller, which waits for it")]
fn spawn_owner(socket: &std::path::Path) -> (Child, BufReader<ChildStdout>, Handle, u64, usize) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "owner_process", "--nocapture", "--test-threads=1"])
        .env(ENV_SOCKET, socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            let status = child.wait().unwrap();
            panic!("the owner exited before exporting: {status}");
        }
        if let Some(rest) = line.trim().strip_prefix("HANDLE ") {
            let mut f = rest.split(' ');
            let handle: Handle = f.next().unwrap().parse().unwrap();
            let gfa = u64::from_str_radix(f.next().unwrap().trim_start_matches("0x"), 16).unwrap();
            let off = usize::from_str_radix(f.next().unwrap().trim_start_matches("0x"), 16).unwrap();
            return (child, out, handle, gfa, off);
        }
    }
}

#[test]
fn two_processes_share_a_region_through_the_window() {
    let d = common::daemon();
    let (mut owner, mut out, handle, owner_gfa, owner_off) = spawn_owner(&d.socket);
    let s = common::session(&d.socket);
    let import = s.import(&handle, true).unwrap();
    assert_eq!(import.gfa(), Some(owner_gfa), "both sides see one GFA");
    let m = s.map(&import).unwrap();
    // Pointer arithmetic is GFA arithmetic, in both processes alike.
    assert_eq!(m.as_ptr() as usize - s.window().base() as usize, owner_off);
    assert_eq!(s.window().gfa_of(m.as_ptr()), Some(owner_gfa));
    // SAFETY: the owner stored the pattern before exporting and stores nothing more.
    let bytes = unsafe { m.as_slice() };
    assert_eq!(bytes.len() as u64, LEN);
    assert!(bytes.iter().enumerate().all(|(i, b)| *b == pattern(i)), "the owner's stores are visible");
    // SAFETY: the owner only reads, after CHECK.
    unsafe { std::ptr::write_volatile(m.as_ptr().add(LEN as usize / 2), 0xAB) };
    let stdin = owner.stdin.as_mut().unwrap();
    writeln!(stdin, "CHECK").unwrap();
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "SEEN 171", "the owner sees the importer's store");
    drop(owner.stdin.take());
    assert!(owner.wait().unwrap().success());
}

#[test]
fn killing_the_owner_revokes_the_import_by_callback_and_by_error() {
    let d = common::daemon();
    let (mut owner, _out, handle, _, _) = spawn_owner(&d.socket);
    let s = common::session(&d.socket);
    let import = s.import(&handle, false).unwrap();
    let m = s.map(&import).unwrap();
    assert!(!m.writable());
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    s.on_revocation(move |r| {
        let _ = tx.lock().unwrap().send(*r);
    });
    owner.kill().unwrap();
    owner.wait().unwrap();
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("revocation within a second of the owner's death");
    assert_eq!(r.reason, RevocationReason::OwnerExited);
    assert_eq!(r.import, import.import_id());
    assert!(matches!(import.check(), Err(Error::Revoked { reason: RevocationReason::OwnerExited, .. })));
    assert!(matches!(m.check(), Err(Error::Revoked { .. })));
    drop(m);
    assert!(matches!(s.map(&import), Err(Error::Revoked { .. })), "a revoked import cannot be mapped again");
    // Importing the dead owner's handle again fails too.
    assert!(s.import(&handle, false).is_err());
}

#[test]
fn mapping_respects_the_window_and_dropping_undoes() {
    let d = common::daemon();
    let s = common::session(&d.socket);
    let gpu = common::gpu(&s);
    let region = s.alloc(&Target::Device { device: gpu.clone(), memory: MemoryClass::Hbm }, LEN).unwrap();
    let gfa = region.gfa().expect("regions have GFAs");
    let m = s.map(&region).unwrap();
    assert!(matches!(s.map(&region), Err(Error::AlreadyMapped { .. })), "one placement per GFA range");
    drop(m);
    let _again = s.map(&region).unwrap();
    // A window that does not cover the region refuses with the numbers.
    let narrow = fabric_mm::Session::open_with(fabric_mm::SessionConfig {
        socket: Some(d.socket.clone()),
        window: Some(fabric_mm::WindowConfig { gfa: gfa + LEN, len: 1 << 30 }),
        client_name: None,
        ..fabric_mm::SessionConfig::default()
    })
    .unwrap();
    // Another session's memory is mapped by that session only (its window, its
    // revocations).
    let e = narrow.map(&region).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("another session")), "{e}");
    let imported = narrow.import(&s.export(&region, &Policy::default()).unwrap(), true).unwrap();
    let e = narrow.map(&imported).unwrap_err();
    assert!(matches!(e, Error::OutsideWindow { .. }), "{e}");
    // Translating the region's GFA names its device.
    let loc = s.translate(&[gfa]).unwrap();
    assert!(
        matches!(&loc[0], fabric_mm::Location::Resource { device, offset, .. } if *device == gpu && *offset % 4096 == 0),
        "{loc:?}"
    );
}

/// A revocation callback may drop the import and its mapping (the undo is sent, not
/// waited for: the callback's thread is the one that would read the answer); a call that
/// waits for the daemon, made there, is refused rather than hang; the session goes on.
#[test]
fn a_revocation_callback_that_drops_the_import_does_not_hang_the_session() {
    let d = common::daemon();
    let owner = common::session(&d.socket);
    let region = owner.alloc(&Target::Device { device: common::gpu(&owner), memory: MemoryClass::Hbm }, LEN).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let s = common::session(&d.socket);
    let import = s.import(&handle, false).unwrap();
    let held = std::sync::Mutex::new(Some((s.map(&import).unwrap(), import)));
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let again = s.clone();
    s.on_revocation(move |_| {
        drop(held.lock().unwrap().take());
        let call = again.translate(&[0]).map(drop);
        let _ = tx.lock().unwrap().send(call);
    });
    owner.revoke(&handle).unwrap();
    let call = rx.recv_timeout(Duration::from_secs(5)).expect("the callback returned");
    assert!(matches!(&call, Err(Error::InvalidArgument(m)) if m.contains("callbacks")), "{call:?}");
    // The session answers after the callback, its own calls and others'.
    let gpu = common::gpu(&s);
    drop(s.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, LEN).unwrap());
    assert!(s.import(&handle, false).is_err(), "the revoked handle imports no more");
}

/// A revocation callback that panics does not stop the session: whichever thread ran it
/// (the reader thread, or a caller's that was reading for its answer) catches and logs the
/// panic and gives the read side back; later calls are answered and later revocations
/// still reach the callback. Before, every later call waited for good.
#[test]
fn a_revocation_callback_that_panics_does_not_stop_the_session() {
    let d = common::daemon();
    let owner = common::session(&d.socket);
    let region = owner.alloc(&Target::Device { device: common::gpu(&owner), memory: MemoryClass::Hbm }, LEN).unwrap();
    let handles = [(); 2].map(|()| owner.export(&region, &Policy::default()).unwrap());
    let s = common::session(&d.socket);
    let imports = handles.map(|h| s.import(&h, false).unwrap());
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let first = std::sync::atomic::AtomicBool::new(true);
    s.on_revocation(move |r| {
        assert!(!first.swap(false, std::sync::atomic::Ordering::SeqCst), "the first revocation's callback panics");
        let _ = tx.lock().unwrap().send(r.import);
    });
    owner.revoke(&handles[0]).unwrap();
    // Calls go on meanwhile; one may run the panicking callback, and is answered all the
    // same.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while imports[0].check().is_ok() {
        assert!(std::time::Instant::now() < deadline, "the first revocation was not read");
        s.translate(&[0]).unwrap();
    }
    owner.revoke(&handles[1]).unwrap();
    let told = rx.recv_timeout(Duration::from_secs(5)).expect("the next revocation reached the callback");
    assert_eq!(told, imports[1].import_id());
    let gpu = common::gpu(&s);
    drop(s.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, LEN).unwrap());
}

/// A revocation callback may remove itself (a one-shot): the call returns at once, the
/// callback is not called again, and the session goes on. Replaced from another thread
/// while it runs, the replacement returns only once it has returned.
#[test]
fn a_revocation_callback_may_remove_itself_and_a_replacement_waits_for_it() {
    let d = common::daemon();
    let owner = common::session(&d.socket);
    let gpu = common::gpu(&owner);
    let target = Target::Device { device: gpu, memory: MemoryClass::Hbm };
    let regions: Vec<_> = (0..2).map(|_| owner.alloc(&target, LEN).unwrap()).collect();
    let handles: Vec<_> = regions.iter().map(|r| owner.export(r, &Policy::default()).unwrap()).collect();
    let s = common::session(&d.socket);
    let imports: Vec<_> = handles.iter().map(|h| s.import(h, false).unwrap()).collect();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let (me, counted) = (s.clone(), calls.clone());
    s.on_revocation(move |_| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        me.on_revocation(|_| {});
        let _ = tx.lock().unwrap().send(());
    });
    owner.revoke(&handles[0]).unwrap();
    rx.recv_timeout(Duration::from_secs(5)).expect("the callback returned after removing itself");
    owner.revoke(&handles[1]).unwrap();
    // The second revocation reaches the session (its import fails) but no callback.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while imports[1].check().is_ok() {
        assert!(std::time::Instant::now() < deadline, "the second revocation never came");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    s.ping().unwrap();

    // A callback that runs for a while, replaced from this thread meanwhile.
    let region = owner.alloc(&target, LEN).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let _import = s.import(&handle, false).unwrap();
    let (started, wait) = mpsc::channel();
    let started = std::sync::Mutex::new(started);
    let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let end = ended.clone();
    s.on_revocation(move |_| {
        let _ = started.lock().unwrap().send(());
        std::thread::sleep(Duration::from_millis(300));
        end.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    owner.revoke(&handle).unwrap();
    wait.recv_timeout(Duration::from_secs(5)).expect("the callback ran");
    s.on_revocation(|_| {});
    assert!(ended.load(std::sync::atomic::Ordering::SeqCst), "the replacement returned while the callback ran");
}
