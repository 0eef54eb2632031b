//! The CUDA C ABI (src/ffi/gpu.rs) called as C calls it: without a driver, every entry point
//! that returns an `int` answers `FMM_E_DEVICE` with "CUDA not present: …"; on the stand-in
//! driver (tests/fake_libcuda, where a device address is a host address, so what the ABI
//! says is there can be looked at directly) the argument checks, sizes, names, offsets of
//! reads, writes and copies, the device address, mappings keeping their memory and import
//! alive, and adopt/export/import/revocation through a real fabricd.
//!
//! The loader reads `LD_LIBRARY_PATH` once, at process start: the stand-in test runs in a
//! child of this test binary started with the stand-in on that path.
#![allow(clippy::unwrap_used)]

mod common;
#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::process::Command;
use std::ptr::{null, null_mut};
use std::time::{Duration, Instant};

use fabric_mm::ffi::*;

const MIB: u64 = 1 << 20;
/// Set in the child that runs on the stand-in: the daemon's socket.
const CHILD: &str = "FMM_GPU_FFI_SOCKET";

fn last() -> String {
    // SAFETY: fmm_last_error returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(fmm_last_error()) }.to_string_lossy().into_owned()
}

fn text(buf: &[c_char]) -> String {
    // SAFETY: the library NUL-terminated what it wrote into `buf`.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

#[test]
fn without_a_driver_every_entry_point_is_a_device_error_saying_cuda_is_not_present() {
    if fabric_mm::cuda::probe_library(&[fabric_mm::cuda::LIBCUDA]).is_ok() || std::env::var_os(CHILD).is_some() {
        return;
    }
    let mut buf = [0 as c_char; 8];
    let (mut n, mut fd, mut gfa) = (0, 0, 0u64);
    let mut props = FmmGpuProperties::default();
    // NULL everywhere: the missing driver is the answer, before the arguments are looked at.
    // SAFETY: every pointer is NULL or writable local storage of the right type.
    let codes = unsafe {
        [
            fmm_gpu_count(&mut n),
            fmm_gpu_open(0, &mut null_mut()),
            fmm_gpu_device(null(), buf.as_mut_ptr(), buf.len()),
            fmm_gpu_uuid(null(), buf.as_mut_ptr(), buf.len()),
            fmm_gpu_properties(null(), &mut props),
            fmm_gpu_alloc(null(), MIB, 0, &mut null_mut()),
            fmm_gpu_map(null(), null(), 0, &mut null_mut()),
            fmm_gpu_map_import(null(), null(), 0, &mut null_mut()),
            fmm_gpu_read(null(), 0, buf.as_mut_ptr().cast(), 1),
            fmm_gpu_write(null(), 0, buf.as_ptr().cast(), 1),
            fmm_gpu_copy(null(), 0, null(), 0, 1),
            fmm_gpu_dma_buf(null(), &mut fd),
            fmm_gpu_adopt(null(), null(), null(), 0, &mut null_mut()),
            fmm_gpu_export(null(), u32::MAX, 0, buf.as_mut_ptr(), buf.len()),
            fmm_gpu_region_gfa(null(), &mut gfa),
            fmm_gpu_import(null(), null(), null(), &mut null_mut()),
            fmm_gpu_import_check(null()),
        ]
    };
    for (i, code) in codes.into_iter().enumerate() {
        assert_eq!(code, FMM_E_DEVICE, "entry point {i}");
    }
    let msg = last();
    assert!(msg.starts_with("CUDA not present: libcuda.so.1: cannot open shared object file"), "{msg}");
    // The value getters and the releasers take NULL quietly.
    // SAFETY: NULL is allowed for each.
    unsafe {
        assert_eq!((fmm_gpu_memory_size(null()), fmm_gpu_mapping_ptr(null()), fmm_gpu_mapping_len(null())), (0, 0, 0));
        assert_eq!((fmm_gpu_region_size(null()), fmm_gpu_import_size(null())), (0, 0));
        fmm_gpu_close(null_mut());
        fmm_gpu_free(null_mut());
        fmm_gpu_unmap(null_mut());
        fmm_gpu_region_free(null_mut());
        fmm_gpu_import_release(null_mut());
    }
}

#[test]
fn on_the_stand_in_driver() {
    let Some(socket) = std::env::var_os(CHILD) else {
        // The parent: the stand-in, a daemon that knows its GPU, and this test again.
        let tmp = tempfile::tempdir().unwrap();
        let Some(lib) = fake_libcuda::build(tmp.path()) else { return };
        let d = common::daemon();
        let gpu = common::gpu(&common::session(&d.socket));
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "on_the_stand_in_driver", "--nocapture", "--test-threads=1"])
            .env(CHILD, &d.socket)
            .env("FAKE_CUDA_UUID", fake_libcuda::uuid_hex(&gpu))
            .env("FMM_GPU_FFI_DEVICE", &gpu)
            .env("LD_LIBRARY_PATH", &lib)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{}\n{stdout}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            d.log()
        );
        return;
    };
    let device = std::env::var("FMM_GPU_FFI_DEVICE").unwrap();
    // SAFETY: the test keeps every handle live while using it, frees each once, and passes
    // buffers of the lengths it says.
    unsafe { stand_in(&PathBuf::from(socket), &device) }
}

/// # Safety
/// Calls the C ABI; see the caller.
unsafe fn stand_in(socket: &std::path::Path, device: &str) {
    // SAFETY: every handle comes from the library and is used while live and freed once;
    // every buffer passed is as long as the length passed with it.
    unsafe {
        let mut n = 0;
        assert_eq!(fmm_gpu_count(&mut n), FMM_OK);
        assert_eq!(n, 1);
        let mut g = null_mut();
        assert_eq!(fmm_gpu_open(1, &mut g), FMM_E_DEVICE);
        assert!(last().contains("no CUDA device 1 (1 present)"), "{}", last());
        assert_eq!(fmm_gpu_open(0, null_mut()), FMM_E_ARG);
        assert_eq!(fmm_gpu_open(0, &mut g), FMM_OK);

        // Names: the UUID as nvidia-smi prints it (41 bytes with the NUL), the fabric device.
        let mut buf = [0 as c_char; 64];
        assert_eq!(fmm_gpu_uuid(g, buf.as_mut_ptr(), 41), FMM_OK);
        let uuid = text(&buf);
        assert_eq!(format!("uuid:{uuid}"), device);
        assert_eq!(fmm_gpu_uuid(g, buf.as_mut_ptr(), 40), FMM_E_BUFFER);
        assert_eq!(fmm_gpu_device(g, buf.as_mut_ptr(), buf.len()), FMM_OK);
        assert_eq!(text(&buf), device);
        assert_eq!(fmm_gpu_device(null(), buf.as_mut_ptr(), buf.len()), FMM_E_ARG);

        let mut p = FmmGpuProperties::default();
        assert_eq!(fmm_gpu_properties(g, null_mut()), FMM_E_ARG);
        assert_eq!(fmm_gpu_properties(g, &mut p), FMM_OK);
        assert_eq!((p.ordinal, p.compute_major, p.compute_minor), (0, 9, 0));
        assert_eq!((p.virtual_memory_management, p.posix_fd_handles, p.gpu_direct_rdma_with_vmm), (1, 1, 0));
        assert_eq!((p.granularity, p.recommended_granularity), (2 * MIB, 4 * MIB));

        // Allocation: rounded up to the granularity; zero and unknown flags refused.
        let (mut a, mut b) = (null_mut(), null_mut());
        assert_eq!(fmm_gpu_alloc(g, 0, 0, &mut a), FMM_E_ARG);
        assert_eq!(fmm_gpu_alloc(g, MIB, 4, &mut a), FMM_E_ARG);
        assert!(last().contains("unknown allocation flags 0x4"), "{}", last());
        assert_eq!(fmm_gpu_alloc(null(), MIB, 0, &mut a), FMM_E_ARG);
        assert_eq!(fmm_gpu_alloc(g, 3 * MIB, 0, &mut a), FMM_OK);
        assert_eq!(fmm_gpu_alloc(g, 1, 0, &mut b), FMM_OK);
        assert_eq!((fmm_gpu_memory_size(a), fmm_gpu_memory_size(b)), (4 * MIB, 2 * MIB));

        // Mapping, with the peers list checked.
        let (mut ma, mut mb) = (null_mut(), null_mut());
        assert_eq!(fmm_gpu_map(a, null(), 1, &mut ma), FMM_E_ARG);
        let nulls: [*const FmmGpu; 1] = [null()];
        assert_eq!(fmm_gpu_map(a, nulls.as_ptr(), 1, &mut ma), FMM_E_ARG);
        let peers: [*const FmmGpu; 1] = [g];
        assert_eq!(fmm_gpu_map(a, peers.as_ptr(), 1, &mut ma), FMM_OK);
        assert_eq!(fmm_gpu_map(b, null(), 0, &mut mb), FMM_OK);
        assert_eq!((fmm_gpu_mapping_len(ma), fmm_gpu_mapping_len(mb)), (4 * MIB, 2 * MIB));

        // A write at an offset lands there: on the stand-in the device address is the host's.
        let pat: Vec<u8> = (0..2 * MIB).map(|i| ((i * 7) ^ (i >> 9)) as u8).collect();
        assert_eq!(fmm_gpu_write(mb, 0, pat.as_ptr().cast(), pat.len()), FMM_OK);
        assert_eq!(fmm_gpu_write(ma, 100, b"fabric".as_ptr().cast(), 6), FMM_OK);
        let host = fmm_gpu_mapping_ptr(ma) as usize as *const u8;
        assert_eq!(std::slice::from_raw_parts(host.add(100), 6), b"fabric");
        let mut back = [0u8; 8];
        assert_eq!(fmm_gpu_read(ma, 99, back.as_mut_ptr().cast(), 8), FMM_OK);
        assert_eq!(&back, b"\0fabric\0");
        // Ranges outside the mapping, and NULL buffers, are argument errors.
        assert_eq!(fmm_gpu_read(ma, 4 * MIB - 4, back.as_mut_ptr().cast(), 4), FMM_OK);
        assert_eq!(fmm_gpu_read(ma, 4 * MIB - 3, back.as_mut_ptr().cast(), 4), FMM_E_ARG);
        assert!(last().contains("outside a 4194304-byte mapping"), "{}", last());
        assert_eq!(fmm_gpu_read(ma, u64::MAX, back.as_mut_ptr().cast(), 1), FMM_E_ARG);
        assert_eq!(fmm_gpu_read(ma, 0, null_mut(), 1), FMM_E_ARG);
        assert_eq!(fmm_gpu_write(ma, 0, null(), 1), FMM_E_ARG);

        // A copy between offsets moves exactly those bytes.
        assert_eq!(fmm_gpu_copy(ma, MIB, mb, 4096, 8192), FMM_OK);
        let mut got = vec![0u8; 8192 + 2];
        assert_eq!(fmm_gpu_read(ma, MIB - 1, got.as_mut_ptr().cast(), got.len()), FMM_OK);
        assert_eq!(got[0], 0);
        assert!(got[1..8193] == pat[4096..4096 + 8192], "the copy did not land where asked");
        assert_eq!(got[8193], 0);
        assert_eq!(fmm_gpu_copy(ma, 0, mb, MIB, 2 * MIB), FMM_E_ARG);
        assert_eq!(fmm_gpu_copy(ma, 0, null(), 0, 1), FMM_E_ARG);

        // No dma-buf on the stand-in: the driver's refusal, named.
        let mut fd: c_int = -1;
        assert_eq!(fmm_gpu_dma_buf(ma, null_mut()), FMM_E_ARG);
        assert_eq!(fmm_gpu_dma_buf(ma, &mut fd), FMM_E_DEVICE);
        assert!(last().contains("cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED"), "{}", last());

        // The mapping keeps its memory: freed first, it still reads and writes.
        fmm_gpu_free(a);
        assert_eq!(fmm_gpu_write(ma, 0, b"kept".as_ptr().cast(), 4), FMM_OK);
        assert_eq!(fmm_gpu_read(ma, 100, back.as_mut_ptr().cast(), 6), FMM_OK);
        assert_eq!(&back[..6], b"fabric");
        fmm_gpu_unmap(ma);

        through_fabricd(socket, g, b, mb, &pat);
        fmm_gpu_unmap(mb);
        fmm_gpu_free(b);
        fmm_gpu_close(g);
    }
}

/// Adopts `mem` (mapped as `map`, holding `pat`), exports it, imports it back into `g` in
/// the same process, and frees the region: the import hears of it.
///
/// # Safety
/// Live handles.
unsafe fn through_fabricd(
    socket: &std::path::Path,
    g: *mut FmmGpu,
    mem: *mut FmmGpuMemory,
    map: *mut FmmGpuMapping,
    pat: &[u8],
) {
    // SAFETY: as in `stand_in`.
    unsafe {
        let sock = CString::new(socket.to_str().unwrap()).unwrap();
        let mut s = null_mut();
        assert_eq!(fmm_session_open(sock.as_ptr(), 0, 0, &mut s), FMM_OK);
        let mut r = null_mut();
        assert_eq!(fmm_gpu_adopt(s, mem, null(), 2, &mut r), FMM_E_ARG);
        assert!(last().contains("unknown adopt flags 0x2"), "{}", last());
        assert!(r.is_null());
        // By fabric handle: this allocation has no fabric handle type, the driver says so.
        assert_eq!(fmm_gpu_adopt(s, mem, null(), FMM_GPU_ADOPT_FABRIC, &mut r), FMM_E_DEVICE);
        assert!(last().contains("fabric"), "{}", last());
        assert!(r.is_null());
        assert_eq!(fmm_gpu_adopt(s, mem, null(), 0, &mut r), FMM_OK);
        assert_eq!(fmm_gpu_region_size(r), 2 * MIB);
        let mut gfa = 0;
        assert_eq!(fmm_gpu_region_gfa(r, &mut gfa), FMM_OK);
        assert_ne!(gfa, 0);

        let mut handle = [0 as c_char; 128];
        assert_eq!(fmm_gpu_export(r, u32::MAX, 1, handle.as_mut_ptr(), handle.len()), FMM_E_BAD_REQUEST);
        assert_eq!(fmm_gpu_export(r, u32::MAX, 0, handle.as_mut_ptr(), 4), FMM_E_BUFFER);
        assert_eq!(fmm_gpu_export(r, u32::MAX, 0, handle.as_mut_ptr(), handle.len()), FMM_OK);

        let mut i = null_mut();
        let garbage = CString::new("not-a-handle").unwrap();
        assert_eq!(fmm_gpu_import(s, garbage.as_ptr(), g, &mut i), FMM_E_ARG);
        assert_eq!(fmm_gpu_import(s, handle.as_ptr(), null(), &mut i), FMM_E_ARG);
        assert_eq!(fmm_gpu_import(s, handle.as_ptr(), g, &mut i), FMM_OK);
        assert_eq!(fmm_gpu_import_size(i), 2 * MIB);
        let mut mi = null_mut();
        assert_eq!(fmm_gpu_map_import(i, null(), 0, &mut mi), FMM_OK);
        let mut got = vec![0u8; pat.len()];
        assert_eq!(fmm_gpu_read(mi, 0, got.as_mut_ptr().cast::<c_void>(), got.len()), FMM_OK);
        assert!(got == pat, "the import does not hold the exporter's bytes");
        // A store through the import is in the exporter's mapping.
        assert_eq!(fmm_gpu_write(mi, 8, b"import".as_ptr().cast(), 6), FMM_OK);
        assert_eq!(fmm_gpu_read(map, 8, got.as_mut_ptr().cast(), 6), FMM_OK);
        assert_eq!(&got[..6], b"import");

        assert_eq!(fmm_gpu_import_check(i), FMM_OK);
        fmm_gpu_region_free(r);
        let deadline = Instant::now() + Duration::from_secs(10);
        let code = loop {
            let c = fmm_gpu_import_check(i);
            if c != FMM_OK || Instant::now() > deadline {
                break c;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(code, FMM_E_REVOKED, "{}", last());
        assert!(last().contains("Freed"), "{}", last());
        // The mapping keeps the import: released first, it still reads.
        fmm_gpu_import_release(i);
        assert_eq!(fmm_gpu_read(mi, 8, got.as_mut_ptr().cast(), 6), FMM_OK);
        assert_eq!(&got[..6], b"import");
        fmm_gpu_unmap(mi);
        fmm_session_close(s);
    }
}
