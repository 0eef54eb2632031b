//! The copy engine's CPU path on the real daemon: memfds sealed against shrinking are
//! registered as memory the engine may `memcpy` through (the registration says so), copies
//! between them land byte for byte (whole, partial, unaligned, and mixed with region
//! GFAs), the seal holds (the client cannot shrink them, so the daemon cannot fault); a
//! memfd without the shrink seal is copied by the CPU too where the daemon has its
//! recovering copy (x86_64 Linux; the kernel elsewhere), and shrinking it fails the copy
//! and never the daemon.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use fabric_proto::wire::{
    AccessMode, Connection, CopyEndpoint, CopyRequest, CopyResult, DeviceName, ErrorCode, Event, RegisterRequest,
    RegisterSource, Request, Response,
};
use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;

fn start() -> (common::Setup, common::Daemon, String) {
    let setup = common::Setup::with_sim(
        &common::sim_file(),
        "[copy]\nengines = 2\nchunk_bytes = 262144\n[memory]\nsize_check_s = 0\n",
    );
    let daemon = common::start(&setup.config, setup.dir.path());
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap().id.to_string();
    (setup, daemon, gpu)
}

/// A memfd of `len` bytes holding `data` (from byte 0), sealed with `seals`.
fn memfd(len: u64, data: &[u8], seals: i32) -> OwnedFd {
    // SAFETY: a NUL-terminated name and flags; returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(c"sealed-copy-test".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just made and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let f = File::from(fd.try_clone().unwrap());
    f.set_len(len).unwrap();
    f.write_all_at(data, 0).unwrap();
    // SAFETY: F_ADD_SEALS takes an int and touches no memory of ours.
    assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) }, 0);
    fd
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 11) as u8).collect()
}

fn read(fd: &OwnedFd, at: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    File::from(fd.try_clone().unwrap()).read_exact_at(&mut out, at).unwrap();
    out
}

fn register(c: &mut Connection, gpu: &str, fd: &OwnedFd, len: u64) -> u64 {
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source: RegisterSource::Fd,
        offset: 0,
        len,
        access: AccessMode::ReadWrite,
        node: None,
    });
    let Response::Register(r) = c.call(req, &[fd.as_fd()]).unwrap().0 else { panic!() };
    r.registration
}

/// Whether the daemon's log says registration `id` may be copied by the CPU.
fn cpu_copy(log: &str, id: u64) -> bool {
    let line = log
        .lines()
        .find(|l| l.contains("registered for DMA") && l.contains(&format!("registration={id} ")))
        .unwrap_or_else(|| panic!("no registration {id} in the log:\n{log}"));
    assert!(line.contains("cpu_copy="), "{line}");
    line.contains("cpu_copy=true")
}

fn reg(id: u64, offset: u64) -> CopyEndpoint {
    CopyEndpoint::Registration { id, offset }
}

/// Runs one copy to its end; returns its result.
fn copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> (CopyResult, u64) {
    let Response::Copy(r) = c.call(Request::Copy(CopyRequest { dst, src, len }), &[]).unwrap().0 else { panic!() };
    loop {
        if let Event::CopyDone(d) = c.next_event().unwrap()
            && d.copy == r.copy
        {
            return (d.result, d.bytes);
        }
    }
}

fn gfa_region(c: &mut Connection, gpu: &str, size: u64) -> (u64, File) {
    let (a, file) = common::alloc_hbm(c, gpu, size);
    (a.gfa.unwrap(), file)
}

#[test]
fn sealed_memfds_are_copied_by_the_cpu_byte_for_byte_and_cannot_shrink() {
    let (setup, daemon, gpu) = start();
    let mut c = common::client(&setup.socket);
    let len = 4 * MIB;
    let data = pattern(7, len as usize);
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    let (src, dst) = (memfd(len, &data, seals), memfd(len, &[], seals));
    let (rs, rd) = (register(&mut c, &gpu, &src, len), register(&mut c, &gpu, &dst, len));
    let log = daemon.log();
    assert!(cpu_copy(&log, rs) && cpu_copy(&log, rd), "sealed memfds not taken as CPU-copyable");
    // Whole, in several chunks over two engines.
    assert_eq!(copy(&mut c, reg(rd, 0), reg(rs, 0), len), (CopyResult::Ok, len));
    assert!(read(&dst, 0, len as usize) == data, "whole copy differs");
    // Partial and unaligned, into a zeroed destination.
    let dst2 = memfd(len, &[], seals);
    let rd2 = register(&mut c, &gpu, &dst2, len);
    let n = MIB + 5;
    assert_eq!(copy(&mut c, reg(rd2, 4096 + 7), reg(rs, 123), n), (CopyResult::Ok, n));
    let out = read(&dst2, 0, len as usize);
    assert!(out[..4096 + 7].iter().all(|&b| b == 0), "bytes before the range were written");
    assert!(out[4096 + 7..4096 + 7 + n as usize] == data[123..123 + n as usize], "partial copy differs");
    assert!(out[4096 + 7 + n as usize..].iter().all(|&b| b == 0), "bytes after the range were written");
    // The CPU moved those copies (the engine logs it per copy).
    assert!(daemon.log().lines().any(|l| l.contains("copy done") && l.contains("cpu=true")), "no copy by the CPU");
    // Mixed with a region by GFA (a regular file: the recovering CPU copy, or the kernel).
    let (gfa, region) = gfa_region(&mut c, &gpu, 2 * MIB);
    assert_eq!(copy(&mut c, CopyEndpoint::Gfa(gfa), reg(rs, MIB), 2 * MIB), (CopyResult::Ok, 2 * MIB));
    let mut got = vec![0; 2 * MIB as usize];
    region.read_exact_at(&mut got, 0).unwrap();
    assert!(got == data[MIB as usize..3 * MIB as usize], "memfd to GFA differs");
    assert_eq!(copy(&mut c, reg(rd2, 0), CopyEndpoint::Gfa(gfa), MIB), (CopyResult::Ok, MIB));
    assert!(read(&dst2, 0, MIB as usize) == data[MIB as usize..2 * MIB as usize], "GFA to memfd differs");
    // The seal holds: the client cannot shrink what the daemon copies with the CPU.
    let e = File::from(src.try_clone().unwrap()).set_len(0).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    assert_eq!(copy(&mut c, reg(rd, 0), reg(rs, 0), len), (CopyResult::Ok, len));
    assert!(daemon.log().lines().all(|l| !l.contains("panicked")));
}

/// Whether the daemon copies between its mappings with the CPU whatever the memory
/// (its recovering copy, `fabricd/src/copy/fault`), not only between sealed memfds.
const RECOVERING: bool = cfg!(all(target_arch = "x86_64", target_os = "linux"));

#[test]
fn a_memfd_without_the_shrink_seal_is_copied_by_the_cpu_and_shrinking_it_fails_the_copy() {
    let (setup, daemon, gpu) = start();
    let mut c = common::client(&setup.socket);
    let len = 2 * MIB;
    let data = pattern(3, len as usize);
    // Growing sealed, shrinking not (and a fully sealed peer): one side may shrink.
    let src = memfd(len, &data, libc::F_SEAL_GROW);
    let dst = memfd(len, &[], libc::F_SEAL_SHRINK | libc::F_SEAL_GROW);
    let (rs, rd) = (register(&mut c, &gpu, &src, len), register(&mut c, &gpu, &dst, len));
    let log = daemon.log();
    assert!(!cpu_copy(&log, rs), "a memfd that can shrink was taken as CPU-copyable");
    assert!(cpu_copy(&log, rd));
    assert_eq!(copy(&mut c, reg(rd, 0), reg(rs, 0), len), (CopyResult::Ok, len));
    assert!(read(&dst, 0, len as usize) == data, "copy differs");
    let want = if RECOVERING { "cpu=true" } else { "cpu=false" };
    assert!(
        daemon.log().lines().filter(|l| l.contains("copy done")).all(|l| l.contains(want)),
        "a copy with a shrinkable side did not say {want}"
    );
    // Shrinking it is allowed; the CPU copy's load now faults (SIGBUS), which the daemon
    // recovers from (or the kernel's copy reports): an error in the copy's completion.
    File::from(src.try_clone().unwrap()).set_len(0).unwrap();
    match copy(&mut c, reg(rd, 0), reg(rs, 0), len).0 {
        CopyResult::Failed { code, message } => {
            assert_eq!(code, ErrorCode::Internal, "{message}");
            assert!(!RECOVERING || message.as_str().contains("SIGBUS after"), "{message}");
        }
        CopyResult::Ok => panic!("a copy from shrunk memory succeeded"),
    }
    // Into it fails too: the store into the shrunk mapping faults the same way.
    match copy(&mut c, reg(rs, 0), reg(rd, 0), 4096).0 {
        CopyResult::Failed { code, message } => {
            assert_eq!(code, ErrorCode::Internal, "{message}");
            assert!(!RECOVERING || message.as_str().contains("SIGBUS after"), "{message}");
        }
        CopyResult::Ok => panic!("a copy into shrunk memory succeeded"),
    }
    // Alive and serving.
    assert_eq!(copy(&mut c, reg(rd, 0), reg(rd, MIB), 4096), (CopyResult::Ok, 4096));
    assert!(daemon.child.id() > 0 && daemon.log().lines().all(|l| !l.contains("panicked")));
}
