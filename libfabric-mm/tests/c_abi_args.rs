//! The C ABI's interleave-set allocation, translation and copy callback called as C calls
//! them, against a real fabricd on the sim CXL pool: bad strings and NULLs refused with
//! `FMM_E_ARG` and nothing written, translations that agree with `Session::translate`,
//! reverse translations that lead back to the same GFAs in C and in Rust, and a completion
//! callback that runs once on another thread. On the sim HGX: a copy's pending wait leaves
//! the last error alone, and a copy takes one callback.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fabric_mm::ffi::copy::*;
use fabric_mm::ffi::*;

const SET: &str = "cxl-region:hpa-0x1000000000";

fn last() -> String {
    // SAFETY: fmm_last_error returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(fmm_last_error()) }.to_string_lossy().into_owned()
}

fn open(socket: &Path) -> *mut FmmSession {
    let sock = CString::new(socket.to_str().unwrap()).unwrap();
    let mut s = null_mut();
    // SAFETY: a NUL-terminated socket path and a writable out pointer.
    assert_eq!(unsafe { fmm_session_open(sock.as_ptr(), 0, 1 << 44, &mut s) }, FMM_OK, "{}", last());
    s
}

fn location() -> FmmLocation {
    FmmLocation {
        kind: 99,
        device: [0; 257],
        memory_class: 0,
        ordinal: 0,
        offset: 0,
        set: [0; 65],
        node: [0; 65],
        live: 0,
    }
}

fn text(field: &[c_char]) -> String {
    // SAFETY: the library NUL-terminates the fields it fills.
    unsafe { CStr::from_ptr(field.as_ptr()) }.to_str().unwrap().to_owned()
}

#[test]
fn alloc_set_translate_and_copy_callback_check_their_arguments_and_agree_with_rust() {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap();
    let d = common::daemon_with(&sim, "", |_| {});
    let s = open(&d.socket);
    let set = CString::new(SET).unwrap();
    let mut r = null_mut();

    // SAFETY: s is live; strings are NUL-terminated; out pointers writable or NULL.
    unsafe {
        assert_eq!(fmm_alloc_set(s, c"\xff\xfe".as_ptr(), 1 << 20, &mut r), FMM_E_ARG);
        assert_eq!(last(), "set is not UTF-8");
        assert_eq!(fmm_alloc_set(s, null(), 1 << 20, &mut r), FMM_E_ARG);
        assert_eq!(last(), "set is NULL");
        assert!(r.is_null());
        assert_eq!(fmm_alloc_set(s, c"no-such-set".as_ptr(), 1 << 20, &mut r), FMM_E_NOT_FOUND);
        assert!(last().contains(SET), "the refusal names the sets there are: {}", last());
        assert_eq!(fmm_alloc_set(s, set.as_ptr(), 1 << 20, null_mut()), FMM_E_ARG, "NULL out");
        assert_eq!(fmm_alloc_set(s, set.as_ptr(), 4 << 20, &mut r), FMM_OK, "{}", last());
    }
    let mut m = null_mut();
    // SAFETY: s and r are live; m writable.
    assert_eq!(unsafe { fmm_map_region(s, r, &mut m) }, FMM_OK, "{}", last());
    // SAFETY: m is live.
    let (gfa, len) = unsafe { (fmm_mapping_gfa(m), fmm_mapping_len(m)) };

    // Translation: the C answers are the Rust ones, field for field.
    let gfas = [gfa, gfa + 4096, gfa + len - 1, u64::MAX - 7];
    let mut out = [location(); 4];
    // SAFETY: 4 GFAs in, room for 4 out.
    assert_eq!(unsafe { fmm_translate(s, gfas.as_ptr(), 4, out.as_mut_ptr()) }, FMM_OK, "{}", last());
    let rust = common::session(&d.socket).translate(&gfas).unwrap();
    for (c, r) in out.iter().zip(&rust) {
        match r {
            fabric_mm::Location::Resource { device, ordinal, offset, set, .. } => {
                assert_eq!(c.kind, FMM_LOCATION_RESOURCE);
                assert_eq!((text(&c.device), c.ordinal, c.offset), (device.clone(), *ordinal, *offset));
                assert_eq!(text(&c.set), set.clone().unwrap_or_default());
                assert_eq!(c.memory_class, FMM_MEM_CXL_VOLATILE);
            }
            fabric_mm::Location::Unmapped => assert_eq!(c.kind, FMM_LOCATION_UNMAPPED),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_ne!(text(&out[0].device), text(&out[1].device), "granules alternate: {rust:?}");
    let many = vec![gfa; FMM_TRANSLATE_MAX + 1];
    let mut room = vec![location(); many.len()];
    // SAFETY: the arrays have the counts given; NULLs are refused.
    unsafe {
        assert_eq!(fmm_translate(s, many.as_ptr(), many.len(), room.as_mut_ptr()), FMM_E_ARG);
        assert!(room.iter().all(|l| l.kind == 99), "nothing written on a refusal");
        // A count no array has (a -1 by mistake) is refused before a slice is made of it
        // (before: undefined behaviour, an abort in a debug build).
        assert_eq!(fmm_translate(s, many.as_ptr(), usize::MAX, room.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(fmm_translate(s, null(), 1, room.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(fmm_translate(s, many.as_ptr(), 1, null_mut()), FMM_E_ARG);
        assert_eq!(fmm_translate(s, null(), 0, null_mut()), FMM_OK);
        assert_eq!(fmm_translate(s, many.as_ptr(), FMM_TRANSLATE_MAX, room.as_mut_ptr()), FMM_OK, "{}", last());
        assert!(room[..FMM_TRANSLATE_MAX].iter().all(|l| l.kind == FMM_LOCATION_RESOURCE));
        assert_eq!(room[FMM_TRANSLATE_MAX].kind, 99, "nothing past count");
    }

    // Reverse translation: every located byte leads back to its GFA, in C and in Rust; a
    // device the map does not know, and an offset past a member's mapped bytes, have none.
    let devices: Vec<CString> = out.iter().map(|l| CString::new(text(&l.device)).unwrap()).collect();
    let mut items: Vec<FmmResourceOffset> = out[..3]
        .iter()
        .zip(&devices)
        .map(|(l, dev)| FmmResourceOffset {
            device: dev.as_ptr(),
            memory_class: l.memory_class,
            ordinal: l.ordinal,
            offset: l.offset,
        })
        .collect();
    let unknown = c"uuid:no-such-device";
    items.push(FmmResourceOffset { device: unknown.as_ptr(), ..items[0] });
    items.push(FmmResourceOffset { offset: u64::MAX / 2, ..items[0] });
    let mut back = [7u64; 5];
    // SAFETY: 5 items with NUL-terminated devices in, room for 5 out.
    assert_eq!(unsafe { fmm_reverse(s, items.as_ptr(), 5, back.as_mut_ptr()) }, FMM_OK, "{}", last());
    assert_eq!(back, [gfas[0], gfas[1], gfas[2], FMM_NO_GFA, FMM_NO_GFA]);
    let rust_items: Vec<fabric_mm::ResourceOffset> = rust[..3]
        .iter()
        .map(|l| match l {
            fabric_mm::Location::Resource { device, memory, ordinal, offset, .. } => fabric_mm::ResourceOffset {
                device: device.clone(),
                memory: *memory,
                ordinal: *ordinal,
                offset: *offset,
            },
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    let rust_back = common::session(&d.socket).reverse(&rust_items).unwrap();
    assert_eq!(rust_back, [Some(gfas[0]), Some(gfas[1]), Some(gfas[2])]);
    let mut untouched = [7u64; 2];
    // SAFETY: the arrays have the counts given; NULLs and bad fields are refused.
    unsafe {
        let bad_class = [FmmResourceOffset { memory_class: 77, ..items[0] }, items[1]];
        assert_eq!(fmm_reverse(s, bad_class.as_ptr(), 2, untouched.as_mut_ptr()), FMM_E_ARG);
        assert!(last().contains("memory class"), "{}", last());
        let null_device = [items[0], FmmResourceOffset { device: null(), ..items[1] }];
        assert_eq!(fmm_reverse(s, null_device.as_ptr(), 2, untouched.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(last(), "device is NULL");
        assert_eq!(untouched, [7, 7], "nothing written on a refusal");
        assert_eq!(fmm_reverse(s, null(), 1, untouched.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(fmm_reverse(s, items.as_ptr(), 1, null_mut()), FMM_E_ARG);
        assert_eq!(fmm_reverse(s, null(), 0, null_mut()), FMM_OK);
        let many = vec![items[0]; FMM_TRANSLATE_MAX + 1];
        let mut room = vec![0u64; many.len()];
        assert_eq!(fmm_reverse(s, many.as_ptr(), many.len(), room.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(fmm_reverse(s, many.as_ptr(), usize::MAX, room.as_mut_ptr()), FMM_E_ARG);
        assert_eq!(fmm_reverse(s, many.as_ptr(), FMM_TRANSLATE_MAX, room.as_mut_ptr()), FMM_OK, "{}", last());
        assert!(room[..FMM_TRANSLATE_MAX].iter().all(|&g| g == gfas[0]));
    }

    // A copy called back: once, on another thread, with the bytes.
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static RESULT: AtomicI64 = AtomicI64::new(1);
    static BYTES: AtomicU64 = AtomicU64::new(0);
    static THREAD: std::sync::Mutex<Option<std::thread::ThreadId>> = std::sync::Mutex::new(None);
    unsafe extern "C" fn done(user: *mut c_void, rc: c_int, bytes: u64, message: *const c_char) {
        assert_eq!(user as usize, 0x5eed);
        assert!(message.is_null());
        RESULT.store(rc.into(), Ordering::SeqCst);
        BYTES.store(bytes, Ordering::SeqCst);
        *THREAD.lock().unwrap() = Some(std::thread::current().id());
        CALLS.fetch_add(1, Ordering::SeqCst);
    }
    let half = len / 2;
    let dst = FmmCopyEndpoint { kind: FMM_COPY_GFA, id: 0, offset: gfa + half };
    let src = FmmCopyEndpoint { kind: FMM_COPY_GFA, id: 0, offset: gfa };
    // SAFETY: m is live and maps `len` bytes; no copy runs on them yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(fmm_mapping_ptr(m).cast::<u8>(), len as usize) };
    bytes[..half as usize].fill(0x5a);
    bytes[half as usize..].fill(0);
    // No place for the copy: refused before it starts (before, it started, was dropped,
    // and went on writing what the caller was told nothing touched).
    // SAFETY: s is live and the endpoints valid; the NULL out is refused.
    assert_eq!(unsafe { fmm_copy_start(s, &dst, &src, half, null_mut()) }, FMM_E_ARG);
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: as above; nothing writes the mapping.
    assert!(unsafe { std::ptr::read_volatile(&bytes[half as usize]) } == 0, "the refused copy wrote");
    // An export whose handle does not fit is revoked, not left behind without a handle.
    let exports = || {
        let mut c = fabric_proto::wire::Connection::new(std::os::unix::net::UnixStream::connect(&d.socket).unwrap());
        c.hello("c-abi-test", fabric_proto::wire::SUPPORTED_VERSIONS).unwrap();
        match c.call(fabric_proto::wire::Request::Status(fabric_proto::wire::StatusRequest {}), &[]).unwrap().0 {
            fabric_proto::wire::Response::Status(st) => st.exports,
            other => panic!("{other:?}"),
        }
    };
    let mut small = [0 as c_char; 4];
    // SAFETY: s and r are live; the buffers have the lengths given.
    unsafe {
        assert_eq!(fmm_export(s, r, u32::MAX, 0, null_mut(), 96), FMM_E_ARG);
        assert_eq!(fmm_export(s, r, u32::MAX, 0, small.as_mut_ptr(), small.len()), FMM_E_BUFFER);
    }
    assert!(last().contains("too small"), "{}", last());
    assert_eq!(exports(), 0, "no export left without a handle");
    let mut c = null_mut();
    // SAFETY: s is live, endpoints and out valid; done is safe to call from any thread.
    unsafe {
        assert_eq!(fmm_copy_start(s, &dst, &src, half, &mut c), FMM_OK, "{}", last());
        assert_eq!(fmm_copy_on_complete(c, None, null_mut()), FMM_E_ARG);
        assert_eq!(last(), "callback is NULL");
        assert_eq!(fmm_copy_on_complete(c, Some(done), 0x5eed as *mut c_void), FMM_OK, "{}", last());
    }
    // A copy that finished before its callback was set calls back at once, on this thread
    // (on a loaded machine it can): then it already has.
    let at_once = CALLS.load(Ordering::SeqCst) == 1;
    // SAFETY: c is live and not used afterwards.
    unsafe { fmm_copy_free(c) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while CALLS.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the callback never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(CALLS.load(Ordering::SeqCst), 1);
    assert_eq!((RESULT.load(Ordering::SeqCst), BYTES.load(Ordering::SeqCst)), (0, half));
    let here = *THREAD.lock().unwrap() == Some(std::thread::current().id());
    assert_eq!(here, at_once, "on this thread exactly when the copy was done before the callback was set");

    // SAFETY: live handles, not used afterwards.
    unsafe {
        fmm_unmap(m);
        fmm_region_free(r);
        fmm_session_close(s);
    }
}

static CALLED: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn count(user: *mut c_void, rc: c_int, _: u64, _: *const c_char) {
    assert_eq!((user as usize, rc), (0xf1, FMM_OK), "only the first callback runs, and succeeds");
    CALLED.fetch_add(1, Ordering::SeqCst);
}

/// `FMM_COPY_PENDING` is not a failure: a wait that timed out leaves the last error's text,
/// and a pointer the caller kept to it, as they were (before, it replaced the text and the
/// kept pointer dangled). A second `fmm_copy_on_complete` is `FMM_E_ARG`, and its callback
/// never runs.
#[test]
fn a_pending_wait_keeps_the_last_error_and_a_copy_takes_one_callback() {
    let d = common::daemon();
    let s = open(&d.socket);
    const LEN: u64 = 64 << 20;
    let mut gpu = [0 as c_char; 257];
    let (mut a, mut b, mut ma, mut mb) = (null_mut(), null_mut(), null_mut(), null_mut());
    // SAFETY: s is live; the buffer has its length; out pointers are writable.
    unsafe {
        assert_eq!(fmm_first_device(s, FMM_MEM_HBM, gpu.as_mut_ptr(), gpu.len()), FMM_OK, "{}", last());
        assert_eq!(fmm_alloc(s, gpu.as_ptr(), FMM_MEM_HBM, LEN, &mut a), FMM_OK, "{}", last());
        assert_eq!(fmm_alloc(s, gpu.as_ptr(), FMM_MEM_HBM, LEN, &mut b), FMM_OK, "{}", last());
        assert_eq!(fmm_map_region(s, a, &mut ma), FMM_OK, "{}", last());
        assert_eq!(fmm_map_region(s, b, &mut mb), FMM_OK, "{}", last());
    }
    // SAFETY: live mappings.
    let (ga, gb) = unsafe { (fmm_mapping_gfa(ma), fmm_mapping_gfa(mb)) };
    let dst = FmmCopyEndpoint { kind: FMM_COPY_GFA, id: 0, offset: gb };
    let src = FmmCopyEndpoint { kind: FMM_COPY_GFA, id: 0, offset: ga };

    // A failing call, and a pointer to its text kept.
    // SAFETY: a NULL copy is refused, not dereferenced.
    assert_eq!(unsafe { fmm_copy_poll(null(), null_mut()) }, FMM_E_ARG);
    let kept = fmm_last_error();
    assert_eq!(last(), "copy is NULL");
    // A 64 MiB copy nearly always still runs at a 0 ms wait right after its start; rounds
    // repeat until one did.
    let mut pending = 0;
    for _ in 0..20 {
        let mut c = null_mut();
        let mut bytes = 7;
        // SAFETY: s is live, endpoints and out valid; c is live until freed.
        unsafe {
            assert_eq!(fmm_copy_start(s, &dst, &src, LEN, &mut c), FMM_OK, "{}", last());
            let rc = fmm_copy_wait(c, 0, &mut bytes);
            if rc == FMM_COPY_PENDING {
                pending += 1;
                assert_eq!(bytes, 7, "nothing written while pending");
                assert_eq!(fmm_last_error(), kept, "the last error was replaced by a pending wait");
                assert_eq!(CStr::from_ptr(kept).to_str().unwrap(), "copy is NULL");
            } else {
                assert_eq!(rc, FMM_OK, "{}", last());
            }
            assert_eq!(fmm_copy_wait(c, -1, &mut bytes), FMM_OK, "{}", last());
            assert_eq!(bytes, LEN);
            assert_eq!(fmm_last_error(), kept, "a successful wait leaves the last error alone too");
            fmm_copy_free(c);
        }
        if pending >= 3 {
            break;
        }
    }
    assert!(pending >= 1, "no 64 MiB copy was still running right after its start in 20 rounds");

    // One callback per copy.
    let mut c = null_mut();
    // SAFETY: as above; `count` is safe to call from any thread.
    unsafe {
        assert_eq!(fmm_copy_start(s, &dst, &src, LEN, &mut c), FMM_OK, "{}", last());
        assert_eq!(fmm_copy_on_complete(c, Some(count), 0xf1 as *mut c_void), FMM_OK, "{}", last());
        assert_eq!(fmm_copy_on_complete(c, Some(count), 0xf2 as *mut c_void), FMM_E_ARG);
        assert!(last().contains("one per copy"), "{}", last());
        fmm_copy_free(c);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while CALLED.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the callback never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(CALLED.load(Ordering::SeqCst), 1);

    // SAFETY: live handles, not used afterwards.
    unsafe {
        fmm_unmap(ma);
        fmm_unmap(mb);
        fmm_region_free(a);
        fmm_region_free(b);
        fmm_session_close(s);
    }
}
