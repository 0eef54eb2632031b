//! Tests of the recovering copy: exact bytes at every small length and alignment and at
//! large lengths; a file shrunk under its mapping, an unreadable page and an unwritable
//! one give errors with the fault address while the process lives on (on several threads
//! at once); and a fault anywhere else still kills the process, checked in a child.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use super::*;

const PAGE: usize = 4096;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

#[test]
fn copies_exactly_every_length_to_4096_at_unaligned_offsets() {
    let src = pattern(2 * PAGE + 128, 1);
    for (so, d_o) in [(0, 0), (1, 0), (0, 1), (3, 7), (63, 17), (64, 64), (4095 % 128, 100)] {
        for len in 0..=PAGE {
            let mut dst = vec![0xa5u8; 2 * PAGE + 256];
            // SAFETY: both ranges lie inside these two vectors, which nothing else refers to.
            unsafe { copy_recovering(dst.as_mut_ptr().add(d_o), src.as_ptr().add(so), len) }.unwrap();
            assert_eq!(&dst[d_o..d_o + len], &src[so..so + len], "len {len} src+{so} dst+{d_o}");
            assert!(dst[..d_o].iter().all(|&b| b == 0xa5), "wrote before dst: len {len}");
            assert!(dst[d_o + len..].iter().all(|&b| b == 0xa5), "wrote past dst: len {len}");
        }
    }
}

#[test]
fn copies_large_lengths_exactly() {
    for len in [(1 << 20) + 3, (64 << 20) + 4097] {
        let src = pattern(len + 5, 9);
        let mut dst = vec![0u8; len + 8];
        // SAFETY: both ranges lie inside these two vectors.
        unsafe { copy_recovering(dst.as_mut_ptr().add(1), src.as_ptr().add(5), len) }.unwrap();
        assert!(dst[1..1 + len] == src[5..5 + len], "{len} bytes differ");
        assert_eq!((dst[0], dst[len + 1]), (0, 0));
    }
}

/// A shared mapping of `pages` pages of a new file, writable; unmapped on drop.
struct Mapped {
    file: File,
    ptr: *mut u8,
    len: usize,
}

impl Mapped {
    fn new(pages: usize, prot: i32) -> Self {
        let file = tempfile::tempfile().unwrap();
        file.set_len((pages * PAGE) as u64).unwrap();
        let len = pages * PAGE;
        // SAFETY: a new shared mapping of the file just made; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, std::os::fd::AsRawFd::as_raw_fd(&file), 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self { file, ptr: p.cast(), len }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[test]
fn a_file_shrunk_under_its_mapping_is_an_error_with_the_fault_address_both_ways() {
    let src = Mapped::new(4, libc::PROT_READ | libc::PROT_WRITE);
    let data = pattern(4 * PAGE, 3);
    // SAFETY: the mapping is 4 pages, `data` as long; nothing else refers to it.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), src.ptr, data.len()) };
    // A page and a half is left: the rest of page 1 reads as zeros, page 2 is gone.
    src.file.set_len((PAGE + PAGE / 2) as u64).unwrap();
    let mut dst = vec![0u8; 4 * PAGE];
    // SAFETY: `dst` is this vector; the source is the mapping, whose file shrank.
    let e = unsafe { copy_recovering(dst.as_mut_ptr(), src.ptr, 4 * PAGE) }.unwrap_err();
    let FaultError::Access { addr, done, len, signal } = e else { panic!("{e:?}") };
    let gone = src.ptr as usize + 2 * PAGE;
    assert_eq!((signal, len), (libc::SIGBUS, 4 * PAGE));
    assert_eq!(addr / PAGE, gone / PAGE, "fault at {addr:#x}, the missing page is {gone:#x}");
    assert!(done <= 2 * PAGE, "{done} bytes done past the fault");
    assert_eq!(&dst[..PAGE.min(done)], &data[..PAGE.min(done)]);
    assert!(e.to_string().starts_with("SIGBUS after"), "{e}");
    assert!(!e.to_string().contains("0x"), "no daemon address in the text: {e}");
    // Storing into the shrunk file faults the same way, at the destination.
    let more = pattern(4 * PAGE, 5);
    // SAFETY: the destination is the mapping (no Rust reference to it), the source a vector.
    let e = unsafe { copy_recovering(src.ptr, more.as_ptr(), 4 * PAGE) }.unwrap_err();
    let FaultError::Access { addr, signal, .. } = e else { panic!("{e:?}") };
    assert_eq!((signal, addr / PAGE), (libc::SIGBUS, gone / PAGE));
    // The process lives on and copies still work.
    let mut again = vec![0u8; PAGE];
    // SAFETY: page 0 of the mapping is still there; `again` is this vector.
    unsafe { copy_recovering(again.as_mut_ptr(), src.ptr, PAGE) }.unwrap();
    assert_eq!(&again[..], &more[..PAGE]);
}

#[test]
fn unreadable_and_unwritable_pages_are_errors_on_any_thread() {
    let none = Mapped::new(1, libc::PROT_NONE);
    let read_only = Mapped::new(1, libc::PROT_READ);
    let (n, r) = (none.ptr as usize, read_only.ptr as usize);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            std::thread::spawn(move || {
                for _ in 0..200 {
                    let mut buf = vec![0u8; PAGE];
                    // SAFETY: reads a PROT_NONE page into this vector.
                    let e = unsafe { copy_recovering(buf.as_mut_ptr(), n as *const u8, PAGE) }.unwrap_err();
                    assert!(matches!(e, FaultError::Access { addr, signal: libc::SIGSEGV, done: 0, .. } if addr == n));
                    // SAFETY: writes a read-only page, which nothing in Rust refers to.
                    let e = unsafe { copy_recovering((r + t) as *mut u8, buf.as_ptr(), 16) }.unwrap_err();
                    assert!(matches!(e, FaultError::Access { addr, signal: libc::SIGSEGV, .. } if addr == r + t));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Set in a child run of [`a_fault_outside_the_copy_still_kills_the_process`]: what to do.
const CHILD: &str = "FABRICD_FAULT_TEST_CHILD";

/// Reads a byte at `p` outside the recovering routine.
///
/// # Safety
/// May fault: for the child only.
unsafe fn touch(p: *const u8) -> u8 {
    let v: u8;
    // SAFETY: the caller's; the load may fault, which is the point.
    unsafe {
        std::arch::asm!("mov {v}, byte ptr [{p}]", p = in(reg) p, v = out(reg_byte) v, options(nostack, readonly))
    };
    v
}

extern "C" fn exit_42(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(42) };
}

fn child(mut what: &str) -> ! {
    let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: sets this process's core size limit from a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    if let Some(rest) = what.strip_prefix("dfl-") {
        // No handler before ours (Rust's is there otherwise): ours puts the default back.
        for sig in [libc::SIGSEGV, libc::SIGBUS] {
            // SAFETY: sets the default action; no memory is involved.
            unsafe { libc::signal(sig, libc::SIG_DFL) };
        }
        what = rest;
    }
    if what == "chain" {
        // A handler of the program's own, there before ours: it must still get the fault.
        // SAFETY: a zeroed sigaction is valid; it is filled in before use.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = exit_42 as *const () as usize;
        act.sa_flags = libc::SA_SIGINFO;
        // SAFETY: installs exit_42 for SIGSEGV.
        assert_eq!(unsafe { libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) }, 0);
    }
    // A recovered fault first: the handler is installed and working.
    let none = Mapped::new(1, libc::PROT_NONE);
    let mut buf = [0u8; 8];
    // SAFETY: reads a PROT_NONE page into `buf`.
    assert!(unsafe { copy_recovering(buf.as_mut_ptr(), none.ptr, 8) }.is_err());
    eprintln!("child: recovered");
    match what {
        "segv" | "chain" => {
            // SAFETY: the child exists to fault here (a PROT_NONE page).
            unsafe { touch(none.ptr) };
        }
        "bus" => {
            let m = Mapped::new(2, libc::PROT_READ);
            m.file.set_len(0).unwrap();
            // SAFETY: the child exists to fault here (a page past the file's end).
            unsafe { touch(m.ptr.add(PAGE)) };
        }
        "sent" => {
            // A SIGBUS sent by a process (no fault), its instruction pointer anywhere.
            // SAFETY: raise has no memory preconditions.
            unsafe { libc::raise(libc::SIGBUS) };
        }
        "sent-then-copy" => {
            // Sent under Rust's handler (which resets that signal's action and returns: the
            // process lives on), then a copy faults with the same signal (a PROT_NONE page:
            // SIGSEGV): it must still be recovered.
            // SAFETY: raise has no memory preconditions.
            unsafe { libc::raise(libc::SIGSEGV) };
            eprintln!("child: lived through a sent SIGSEGV");
            // SAFETY: reads a PROT_NONE page into `buf`.
            assert!(unsafe { copy_recovering(buf.as_mut_ptr(), none.ptr, 8) }.is_err());
            eprintln!("child: recovered again");
            std::process::exit(7);
        }
        "overflow" => {
            fn deep(n: u64) -> u64 {
                let a = std::hint::black_box([n; 64]);
                if n == u64::MAX { 0 } else { deep(std::hint::black_box(n + 1)).wrapping_add(a[3]) }
            }
            let t = std::thread::Builder::new().stack_size(256 << 10).spawn(|| deep(0)).unwrap();
            let _ = t.join();
        }
        _ => {}
    }
    eprintln!("child: still alive");
    std::process::exit(0)
}

/// Runs the child `what`, killed after 60 s (a handler that swallowed the fault would make
/// it fault forever).
fn run_child(me: &std::path::Path, name: &str, what: &str) -> std::process::Output {
    let child = Command::new(me)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, what)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
            // SAFETY: signals the child started above, which is not yet reaped (the
            // waiting thread has not sent).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = tx.send(());
    assert_ne!(out.status.signal(), Some(libc::SIGKILL), "{what}: the child hung (a fault looping?)");
    out
}

#[test]
fn a_fault_outside_the_copy_still_kills_the_process() {
    if let Ok(what) = std::env::var(CHILD) {
        child(&what);
    }
    let me = std::env::current_exe().unwrap();
    let name = "copy::fault::tests::a_fault_outside_the_copy_still_kills_the_process";
    for (what, signal, code) in [
        ("segv", Some(libc::SIGSEGV), None),
        ("bus", Some(libc::SIGBUS), None),
        ("dfl-segv", Some(libc::SIGSEGV), None),
        ("dfl-bus", Some(libc::SIGBUS), None),
        // Sent, not a fault: raised again under the default action.
        ("dfl-sent", Some(libc::SIGBUS), None),
        ("chain", None, Some(42)),
        // Sent under Rust's handler: the process lives, and the next copy fault is still
        // recovered (the handler put ours back).
        ("sent-then-copy", None, Some(7)),
        // Rust's stack overflow report still runs (it aborts).
        ("overflow", Some(libc::SIGABRT), None),
    ] {
        let out = run_child(&me, name, what);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("child: recovered"), "{what}: the child did not get as far as its fault:\n{err}");
        assert!(!err.contains("still alive"), "{what}: the child survived a fault outside the copy:\n{err}");
        assert_eq!((out.status.signal(), out.status.code()), (signal, code), "{what}: {:?}\n{err}", out.status);
        if what == "overflow" {
            assert!(err.contains("has overflowed its stack"), "{err}");
        }
    }
}
