//! The copy engine's recovering CPU copy on the real daemon: a client that truncates its
//! own region file while the engine copies from or into it (by GFA and through a
//! registration of the region) gets a failed copy — `Internal`, the fault named — and the
//! daemon lives on: another session's copies running meanwhile all land byte for byte,
//! and the daemon serves new allocations and copies afterwards.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use fabric_proto::wire::{
    AccessMode, Connection, CopyDone, CopyEndpoint, CopyRequest, CopyResult, DeviceName, ErrorCode, Event, FreeRequest,
    RegisterRequest, RegisterSource, Request, Response,
};
use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;
/// Long copies (many 256 KiB chunks on one engine), so that a truncation lands mid-copy.
const LEN: u64 = 32 * MIB;
/// Whether the daemon has the recovering CPU copy (elsewhere the kernel copies; the
/// failures look the same but do not name a signal).
const RECOVERING: bool = cfg!(all(target_arch = "x86_64", target_os = "linux"));

struct Region {
    id: u64,
    gfa: u64,
    file: File,
}

fn alloc(c: &mut Connection, gpu: &str, size: u64) -> Region {
    let (a, file) = common::alloc_hbm(c, gpu, size);
    assert_eq!(a.offset, 0, "one file per region");
    Region { id: a.region, gfa: a.gfa.unwrap(), file }
}

fn free(c: &mut Connection, r: &Region) {
    assert_eq!(c.call(Request::Free(FreeRequest { region: r.id, node: None }), &[]).unwrap().0, Response::Free);
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(37).wrapping_add(seed) ^ (i >> 13) as u8).collect()
}

fn start_copy(c: &mut Connection, dst: CopyEndpoint, src: CopyEndpoint, len: u64) -> u64 {
    match c.call(Request::Copy(CopyRequest { dst, src, len }), &[]) {
        Ok((Response::Copy(r), _)) => r.copy,
        other => panic!("copy refused: {other:?}"),
    }
}

fn done(c: &mut Connection, copy: u64) -> CopyDone {
    loop {
        if let Event::CopyDone(d) = c.next_event().unwrap()
            && d.copy == copy
        {
            return d;
        }
    }
}

/// Checks how a copy whose memory a client may have truncated ended: whole, or failed
/// with `Internal` naming the fault, part of it moved. Returns whether it failed.
fn ended_well(d: &CopyDone, len: u64) -> bool {
    match &d.result {
        CopyResult::Ok => {
            assert_eq!(d.bytes, len);
            false
        }
        CopyResult::Failed { code, message } => {
            assert_eq!(*code, ErrorCode::Internal, "{message}");
            assert!(d.bytes < len, "failed after moving every byte: {d:?}");
            assert!(!RECOVERING || message.as_str().contains("SIGBUS after"), "{message}");
            true
        }
    }
}

/// Another session copying between its own regions until `stop`, checking every copy.
fn bystander(socket: &Path, gpu: String, stop: Arc<AtomicBool>) -> usize {
    let mut c = common::client(socket);
    let (a, b) = (alloc(&mut c, &gpu, 4 * MIB), alloc(&mut c, &gpu, 4 * MIB));
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) || n == 0 {
        let data = pattern(n as u8, 4 * MIB as usize);
        a.file.write_all_at(&data, 0).unwrap();
        let id = start_copy(&mut c, CopyEndpoint::Gfa(b.gfa), CopyEndpoint::Gfa(a.gfa), 4 * MIB);
        let d = done(&mut c, id);
        assert_eq!((d.result, d.bytes), (CopyResult::Ok, 4 * MIB), "a bystander's copy {n}");
        let mut got = vec![0; data.len()];
        b.file.read_exact_at(&mut got, 0).unwrap();
        assert!(got == data, "a bystander's copy {n} differs");
        n += 1;
    }
    n
}

#[test]
fn a_region_file_truncated_during_a_copy_fails_that_copy_and_the_daemon_serves_on() {
    let setup = common::Setup::with_sim(
        &common::sim_file(),
        "[copy]\nengines = 1\nchunk_bytes = 262144\n[memory]\nsize_check_s = 0\n",
    );
    let daemon = common::start(&setup.config, setup.dir.path());
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpus: Vec<String> =
        inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).map(|d| d.id.to_string()).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (socket, gpu, stop) = (setup.socket.clone(), gpus[1].clone(), stop.clone());
        std::thread::spawn(move || bystander(&socket, gpu, stop))
    };
    let mut c = common::client(&setup.socket);
    let gpu = &gpus[0];
    let data = pattern(1, LEN as usize);
    // Truncate the source, then the destination, of a copy by GFA right after it is
    // queued, until one is caught mid-copy (some chunks moved, then the fault). Each
    // round also copies after the truncation, which must fail whole.
    let (mut caught, mut failed) = ([false; 2], 0);
    for round in 0..40 {
        let side = round % 2;
        if caught[side] {
            continue;
        }
        let (src, dst) = (alloc(&mut c, gpu, LEN), alloc(&mut c, gpu, LEN));
        src.file.write_all_at(&data, 0).unwrap();
        let id = start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa), CopyEndpoint::Gfa(src.gfa), LEN);
        [&src, &dst][side].file.set_len(MIB).unwrap();
        let d = done(&mut c, id);
        failed += usize::from(ended_well(&d, LEN));
        caught[side] |= 0 < d.bytes && d.bytes < LEN;
        let after = start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa), CopyEndpoint::Gfa(src.gfa), LEN);
        let d = done(&mut c, after);
        assert!(ended_well(&d, LEN), "a copy through a truncated region succeeded");
        assert!(d.bytes <= MIB, "{} bytes moved past the truncation", d.bytes);
        // The first MiB is still there, and copies whole.
        let ok = start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa), CopyEndpoint::Gfa(src.gfa), MIB);
        assert_eq!(done(&mut c, ok).result, CopyResult::Ok);
        free(&mut c, &src);
        free(&mut c, &dst);
        if caught == [true; 2] {
            break;
        }
    }
    eprintln!("caught mid-copy: source {}, destination {}; {failed} copies failed", caught[0], caught[1]);
    assert!(caught[0] && caught[1], "no truncation landed mid-copy in 40 rounds (source, destination): {caught:?}");

    // Through a registration of the region (its pinned, locked mapping) the same.
    let src = alloc(&mut c, gpu, LEN);
    let dst = alloc(&mut c, gpu, LEN);
    src.file.write_all_at(&data, 0).unwrap();
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source: RegisterSource::Region(src.id),
        offset: 0,
        len: LEN,
        access: AccessMode::ReadOnly,
        node: None,
    });
    let Response::Register(r) = c.call(req, &[]).unwrap().0 else { panic!() };
    let from_reg = CopyEndpoint::Registration { id: r.registration, offset: 0 };
    let id = start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa), from_reg, LEN);
    assert_eq!(done(&mut c, id).result, CopyResult::Ok);
    src.file.set_len(0).unwrap();
    let id = start_copy(&mut c, CopyEndpoint::Gfa(dst.gfa), from_reg, LEN);
    assert!(ended_well(&done(&mut c, id), LEN), "a copy from a truncated registration succeeded");

    // The daemon serves on: the other session's copies all landed, new regions copy.
    stop.store(true, Ordering::Relaxed);
    let n = other.join().unwrap();
    let (a, b) = (alloc(&mut c, gpu, 2 * MIB), alloc(&mut c, &gpus[2], 2 * MIB));
    a.file.write_all_at(&data[..2 * MIB as usize], 0).unwrap();
    let id = start_copy(&mut c, CopyEndpoint::Gfa(b.gfa), CopyEndpoint::Gfa(a.gfa), 2 * MIB);
    assert_eq!(done(&mut c, id).result, CopyResult::Ok);
    let mut got = vec![0; 2 * MIB as usize];
    b.file.read_exact_at(&mut got, 0).unwrap();
    assert!(got[..] == data[..2 * MIB as usize]);
    let log = daemon.log();
    assert!(log.contains("copy chunk failed") && !log.contains("panicked"), "{log}");
    assert!(!RECOVERING || log.contains("recovering_cpu_copy=true"), "{log}");
    eprintln!("the other session's copies: {n}");
}
