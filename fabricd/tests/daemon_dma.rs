//! DMA registration on the real daemon with real clients: regions, imports, memory
//! objects and the client's own locked memory registered for a device whose DMA mask is
//! 24 bits; IOVAs below the mask, distinct and reused after unregister; exhaustion,
//! pinned-bytes and `RLIMIT_MEMLOCK` refusals typed; registrations reclaimed when their
//! session closes and when the region or import under them goes.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, CodecError, Connection, DeviceName, ErrorBody, ErrorCode, ErrorDetail,
    FreeRequest, ImportRequest, MemoryClass, RegisterRequest, RegisterResponse, RegisterSource, ReleaseRequest,
    Request, Response, RevokeRequest, StatusRequest, StatusResponse, UnregisterRequest,
};
use fabric_topology::DeviceKind;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;
const MASK_BITS: u32 = 24;

/// The CXL pool sim with a GPU whose DMA mask is 24 bits (16 MiB of IOVA space).
pub fn sim(dir: &Path) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml");
    let mut text = std::fs::read_to_string(base).unwrap();
    text.push_str(
        "\n[[templates.cxl-host.gpu]]\nname = \"gpu0\"\nparent = \"pci0000:00\"\nmodel = \"test GPU\"\nhbm = \"1GiB\"\ndma_mask_bits = 24\n",
    );
    let path = dir.join("dma-sim.toml");
    std::fs::write(&path, text).unwrap();
    path
}

fn gpu(sim: &Path) -> String {
    let inv = fabric_drivers::sim::load(sim).unwrap();
    let d = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap();
    assert_eq!(d.dma_mask_bits, Some(24));
    d.id.to_string()
}

struct Env {
    setup: common::Setup,
    _daemon: common::Daemon,
    gpu: String,
}

fn start(limits: &str, prepare: impl FnOnce(&mut std::process::Command)) -> Env {
    let scratch = tempfile::tempdir().unwrap();
    let sim = sim(scratch.path());
    let setup = common::Setup::with_sim(&sim, limits);
    // The sim file must outlive the daemon's start; keep it next to the config.
    let kept = setup.dir.path().join("dma-sim.toml");
    std::fs::copy(&sim, &kept).unwrap();
    let text = std::fs::read_to_string(&setup.config).unwrap();
    std::fs::write(&setup.config, text.replace(&sim.display().to_string(), &kept.display().to_string())).unwrap();
    let daemon = common::start_with(&setup.config, setup.dir.path(), prepare);
    Env { gpu: gpu(&kept), setup, _daemon: daemon }
}

fn refused(c: &mut Connection, req: Request, fds: &[std::os::fd::BorrowedFd<'_>]) -> ErrorBody {
    match c.call(req, fds) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn alloc(c: &mut Connection, device: &str, size: u64) -> u64 {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    let Response::Alloc(a) = c.call(req, &[]).unwrap().0 else { panic!() };
    a.region
}

fn reg_req(device: &str, source: RegisterSource, offset: u64, len: u64, access: AccessMode) -> Request {
    Request::Register(RegisterRequest {
        device: DeviceName::truncated(device),
        source,
        offset,
        len,
        access,
        node: None,
    })
}

fn register(
    c: &mut Connection,
    device: &str,
    source: RegisterSource,
    offset: u64,
    len: u64,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> RegisterResponse {
    let (r, _) = c.call(reg_req(device, source, offset, len, AccessMode::ReadWrite), fds).unwrap();
    let Response::Register(r) = r else { panic!("{r:?}") };
    assert_eq!(r.len, len);
    r
}

fn unregister(c: &mut Connection, registration: u64) {
    let (r, _) = c.call(Request::Unregister(UnregisterRequest { registration }), &[]).unwrap();
    assert_eq!(r, Response::Unregister);
}

fn status(c: &mut Connection) -> StatusResponse {
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    s
}

fn memfd(len: u64) -> OwnedFd {
    let name = CString::new("dma-test").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    File::from(fd.try_clone().unwrap()).set_len(len).unwrap();
    fd
}

/// Anonymous memory of this process, locked when `lock`.
fn own_memory(len: usize, lock: bool) -> memmap2::MmapMut {
    let mut m = memmap2::MmapMut::map_anon(len).unwrap();
    m.fill(0x5a);
    if lock {
        // SAFETY: locks the mapping just made, `len` bytes; it stays mapped while used.
        assert_eq!(unsafe { libc::mlock(m.as_ptr().cast(), len) }, 0);
    }
    m
}

fn ranges_disjoint(rs: &[(u64, u64)]) {
    let mut v: Vec<(u64, u64)> =
        rs.iter().map(|&(iova, len)| (iova / PAGE * PAGE, (iova % PAGE + len).next_multiple_of(PAGE))).collect();
    v.sort_unstable();
    for w in v.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "IOVA ranges overlap: {w:?}");
    }
}

#[test]
fn every_source_registers_below_the_mask_at_distinct_iovas_and_unregister_frees() {
    let env = start("", |_| {});
    let mut c = common::client(&env.setup.socket);
    let mut other = common::client(&env.setup.socket);
    let gpu = env.gpu.clone();

    // A region the caller owns.
    let region = alloc(&mut c, &gpu, 2 * MIB);
    let r1 = register(&mut c, &gpu, RegisterSource::Region(region), 0, 2 * MIB, &[]);
    // An import the caller holds, read-only: the device may read it only.
    let shared = alloc(&mut other, &gpu, 2 * MIB);
    let handle = common::export(&mut other, shared, AccessMode::ReadOnly);
    let Response::Import(imp) =
        c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]).unwrap().0
    else {
        panic!()
    };
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Import(imp.import), 0, MIB, AccessMode::ReadWrite), &[]);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{}", body.message);
    let (r, _) =
        c.call(reg_req(&gpu, RegisterSource::Import(imp.import), 100, MIB, AccessMode::ReadOnly), &[]).unwrap();
    let Response::Register(r2) = r else { panic!() };
    assert_eq!(r2.iova % PAGE, 100, "the IOVA keeps the offset within its page");
    // A memory object passed with the request, at an unaligned offset.
    let fd = memfd(3 * MIB);
    let r3 = register(&mut c, &gpu, RegisterSource::Fd, 5000, MIB, &[fd.as_fd()]);
    assert_eq!(r3.iova % PAGE, 5000 % PAGE);
    // The caller's own locked memory; unlocked memory is refused.
    let mine = own_memory(256 << 10, true);
    let addr = mine.as_ptr() as u64;
    let r4 = register(&mut c, &gpu, RegisterSource::Process { addr }, 0, 256 << 10, &[]);
    let loose = own_memory(64 << 10, false);
    let body = refused(
        &mut c,
        reg_req(&gpu, RegisterSource::Process { addr: loose.as_ptr() as u64 }, 0, 4096, AccessMode::ReadWrite),
        &[],
    );
    assert_eq!(body.code, ErrorCode::BadRequest);
    assert!(body.message.contains("not locked"), "{}", body.message);

    let all = [(r1.iova, r1.len), (r2.iova, r2.len), (r3.iova, r3.len), (r4.iova, r4.len)];
    for (iova, len) in all {
        assert!(iova >= PAGE, "IOVA 0 is never handed out");
        assert!(iova + len <= 1 << MASK_BITS, "{iova:#x}+{len:#x} is past the 24-bit mask");
    }
    ranges_disjoint(&all);
    let s = status(&mut c);
    assert_eq!(s.registrations, 4);
    assert_eq!(s.pinned_bytes, 2 * MIB + (MIB + PAGE) + (MIB + PAGE) + (256 << 10));

    // The space left below the mask (16 MiB - page 0 - 4.25 MiB) cannot hold 12 MiB.
    let big = memfd(12 * MIB);
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Fd, 0, 12 * MIB, AccessMode::ReadWrite), &[big.as_fd()]);
    assert_eq!(body.code, ErrorCode::NoSpace, "{}", body.message);
    // Unregister frees the range: the lowest one is handed out again.
    unregister(&mut c, r1.registration);
    let again = register(&mut c, &gpu, RegisterSource::Region(region), 0, 2 * MIB, &[]);
    assert_eq!(again.iova, r1.iova);
    unregister(&mut c, again.registration);
    let body = refused(&mut c, Request::Unregister(UnregisterRequest { registration: again.registration }), &[]);
    assert_eq!(body.code, ErrorCode::NotFound);
    // Another session may not undo this one's registrations.
    let body = refused(&mut other, Request::Unregister(UnregisterRequest { registration: r3.registration }), &[]);
    assert_eq!(body.code, ErrorCode::PermissionDenied);
    // Bad inputs: no such device, a CPU, a range past the region, the Fd source without one.
    let body =
        refused(&mut c, reg_req("name:nowhere/x", RegisterSource::Region(region), 0, 1, AccessMode::ReadOnly), &[]);
    assert_eq!(body.code, ErrorCode::NotFound);
    let body = refused(
        &mut c,
        reg_req("name:cxl-host/numa0", RegisterSource::Region(region), 0, 1, AccessMode::ReadOnly),
        &[],
    );
    assert_eq!(body.code, ErrorCode::BadRequest, "{}", body.message);
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Region(region), MIB, 2 * MIB, AccessMode::ReadOnly), &[]);
    assert_eq!(body.code, ErrorCode::BadRequest);
    // Descriptors must match the source: Fd needs one, the others none.
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Fd, 0, PAGE, AccessMode::ReadOnly), &[]);
    assert_eq!(body.code, ErrorCode::BadFds, "{}", body.message);
    let body =
        refused(&mut c, reg_req(&gpu, RegisterSource::Region(region), 0, PAGE, AccessMode::ReadOnly), &[fd.as_fd()]);
    assert_eq!(body.code, ErrorCode::BadFds, "{}", body.message);
    let s = status(&mut c);
    assert_eq!(s.registrations, 3);
    drop(mine);
}

#[test]
fn registrations_end_with_their_region_import_and_session() {
    let env = start("", |_| {});
    let mut owner = common::client(&env.setup.socket);
    let mut c = common::client(&env.setup.socket);
    let gpu = env.gpu.clone();

    // Freeing a region drops the registrations over it, the owner's and an importer's.
    let region = alloc(&mut owner, &gpu, 2 * MIB);
    let own = register(&mut owner, &gpu, RegisterSource::Region(region), 0, MIB, &[]);
    let handle = common::export(&mut owner, region, AccessMode::ReadWrite);
    let Response::Import(imp) =
        c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]).unwrap().0
    else {
        panic!()
    };
    let via_import = register(&mut c, &gpu, RegisterSource::Import(imp.import), 0, MIB, &[]);
    assert_eq!(status(&mut c).registrations, 2);
    owner.call(Request::Free(FreeRequest { region, node: None }), &[]).unwrap();
    let s = status(&mut c);
    assert_eq!((s.registrations, s.pinned_bytes), (0, 0));
    for (conn, id) in [(&mut owner, own.registration), (&mut c, via_import.registration)] {
        let body = refused(conn, Request::Unregister(UnregisterRequest { registration: id }), &[]);
        assert_eq!(body.code, ErrorCode::NotFound);
    }

    // Releasing an import and revoking its export drop registrations over it.
    let region = alloc(&mut owner, &gpu, 2 * MIB);
    let handle = common::export(&mut owner, region, AccessMode::ReadWrite);
    let mut imports = Vec::new();
    for _ in 0..2 {
        let Response::Import(imp) =
            c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]).unwrap().0
        else {
            panic!()
        };
        register(&mut c, &gpu, RegisterSource::Import(imp.import), 0, MIB, &[]);
        imports.push(imp.import);
    }
    assert_eq!(status(&mut c).registrations, 2);
    c.call(Request::Release(ReleaseRequest { import: imports[0] }), &[]).unwrap();
    assert_eq!(status(&mut c).registrations, 1);
    owner.call(Request::Revoke(RevokeRequest { handle }), &[]).unwrap();
    assert_eq!(status(&mut c).registrations, 0);

    // A session that closes loses its registrations within a second.
    let mut gone = common::client(&env.setup.socket);
    let region = alloc(&mut gone, &gpu, 2 * MIB);
    register(&mut gone, &gpu, RegisterSource::Region(region), 0, 2 * MIB, &[]);
    let fd = memfd(MIB);
    register(&mut gone, &gpu, RegisterSource::Fd, 0, MIB, &[fd.as_fd()]);
    let s = status(&mut c);
    assert_eq!((s.registrations, s.pinned_bytes), (2, 3 * MIB));
    drop(gone);
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let s = status(&mut c);
        if s.registrations == 0 && s.pinned_bytes == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "registrations still live a second after their session closed: {s:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A region's file sent as a memory object registers as the region (or the import) it is:
/// freeing the region or revoking the export ends the registration, as it ends one made by
/// id; a session that neither owns nor imports the region is refused its file.
#[test]
fn a_region_file_registers_as_its_region_or_import() {
    let env = start("", |_| {});
    let mut owner = common::client(&env.setup.socket);
    let mut c = common::client(&env.setup.socket);
    let mut stranger = common::client(&env.setup.socket);
    let gpu = env.gpu.clone();
    let alloc_file = |c: &mut Connection| {
        let req = Request::Alloc(AllocRequest {
            target: AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm },
            size: 2 * MIB,
            align: 0,
        });
        let (Response::Alloc(a), fds) = c.call(req, &[]).unwrap() else { panic!() };
        (a.region, fds.into_iter().next().unwrap())
    };

    // The owner's own file: freeing the region ends the registration.
    let (region, file) = alloc_file(&mut owner);
    let r = register(&mut owner, &gpu, RegisterSource::Fd, PAGE, MIB, &[file.as_fd()]);
    assert_eq!(status(&mut owner).registrations, 1);
    owner.call(Request::Free(FreeRequest { region, node: None }), &[]).unwrap();
    let s = status(&mut owner);
    assert_eq!((s.registrations, s.pinned_bytes), (0, 0), "a registration of a freed region's file lives on");
    let body = refused(&mut owner, Request::Unregister(UnregisterRequest { registration: r.registration }), &[]);
    assert_eq!(body.code, ErrorCode::NotFound);

    // An importer's file: bounded by the import's access, ended by the revocation.
    let (region, owners_file) = alloc_file(&mut owner);
    let handle = common::export(&mut owner, region, AccessMode::ReadWrite);
    let (Response::Import(_), fds) =
        c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadOnly }), &[]).unwrap()
    else {
        panic!()
    };
    let imported = fds.into_iter().next().unwrap();
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Fd, 0, MIB, AccessMode::ReadWrite), &[imported.as_fd()]);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{body:?}");
    let (r, _) = c.call(reg_req(&gpu, RegisterSource::Fd, 0, MIB, AccessMode::ReadOnly), &[imported.as_fd()]).unwrap();
    assert!(matches!(r, Response::Register(_)), "{r:?}");

    // Someone handed the owner's file holds no right to the region: refused.
    let body =
        refused(&mut stranger, reg_req(&gpu, RegisterSource::Fd, 0, MIB, AccessMode::ReadOnly), &[owners_file.as_fd()]);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{body:?}");
    assert!(body.message.contains(&format!("region {region}'s file")), "{}", body.message);

    assert_eq!(status(&mut c).registrations, 1);
    owner.call(Request::Revoke(RevokeRequest { handle }), &[]).unwrap();
    let s = status(&mut c);
    assert_eq!((s.registrations, s.pinned_bytes), (0, 0), "a registration of a revoked import's file lives on");
}

/// A region's file under another name (a hard link a same-uid client made) is not taken
/// for plain memory: registered so, the region's free could not end the registration, and
/// the device would go on reaching the bytes. Before, only the `r<id>` name was known.
#[test]
fn a_hard_link_of_a_region_file_is_refused_not_registered_as_plain_memory() {
    // On tmpfs, where a file of any name is a memory object the daemon takes (elsewhere
    // the link is refused anyway, as no tmpfs file nor one fabricd handed out).
    let shm = match tempfile::tempdir_in("/dev/shm") {
        Ok(d) => d,
        Err(e) => return eprintln!("skipped: no /dev/shm ({e})"),
    };
    let scratch = tempfile::tempdir().unwrap();
    let sim = sim(scratch.path());
    let setup = common::Setup::with_sim(&sim, "");
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let state = shm.path().join("state");
    let text = text
        .replace(&format!("{:?}", setup.state.display().to_string()), &format!("{:?}", state.display().to_string()));
    std::fs::write(&setup.config, text).unwrap();
    let _daemon = common::start_with(&setup.config, setup.dir.path(), |_| {});
    let mut owner = common::client(&setup.socket);
    let gpu = gpu(&sim);
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm },
        size: 2 * MIB,
        align: 0,
    });
    let (Response::Alloc(_), fds) = owner.call(req, &[]).unwrap() else { panic!() };
    let file = fds.into_iter().next().unwrap();
    let path = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())).unwrap();
    let link = shm.path().join("not-a-region-name");
    std::fs::hard_link(&path, &link).unwrap();
    let linked = std::fs::File::open(&link).unwrap();
    let body = refused(&mut owner, reg_req(&gpu, RegisterSource::Fd, 0, MIB, AccessMode::ReadOnly), &[linked.as_fd()]);
    assert_eq!(body.code, ErrorCode::PermissionDenied, "{body:?}");
    assert!(body.message.contains("another link"), "{}", body.message);
    assert_eq!(status(&mut owner).registrations, 0);
    // A plain file of the client's own registers as ever.
    let own = shm.path().join("plain");
    std::fs::write(&own, vec![0u8; 2 * MIB as usize]).unwrap();
    let plain = std::fs::OpenOptions::new().read(true).write(true).open(&own).unwrap();
    register(&mut owner, &gpu, RegisterSource::Fd, 0, MIB, &[plain.as_fd()]);
}

#[test]
fn pinned_bytes_and_object_limits_are_typed_refusals() {
    let env = start("[limits]\npinned_bytes_per_uid = 4194304\nobjects_per_uid = 3\n", |_| {});
    let mut c = common::client(&env.setup.socket);
    let gpu = env.gpu.clone();
    let region = alloc(&mut c, &gpu, 4 * MIB);
    register(&mut c, &gpu, RegisterSource::Region(region), 0, 3 * MIB, &[]);
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Region(region), 0, 2 * MIB, AccessMode::ReadOnly), &[]);
    assert_eq!(body.code, ErrorCode::LimitExceeded);
    assert_eq!(
        body.detail,
        Some(ErrorDetail::Limit {
            what: fabric_proto::wire::Name::truncated("pinned_bytes"),
            used: 3 * MIB,
            requested: 2 * MIB,
            max: 4 * MIB
        })
    );
    // Registrations count as objects: region + 1 registration + 1 more = 3, then refused.
    register(&mut c, &gpu, RegisterSource::Region(region), 0, PAGE, &[]);
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Region(region), 0, PAGE, AccessMode::ReadOnly), &[]);
    assert_eq!(body.code, ErrorCode::LimitExceeded);
    assert!(matches!(&body.detail, Some(ErrorDetail::Limit { what, .. }) if what.as_str() == "objects"));
}

/// Linux's `CAP_IPC_LOCK`, which lets a process lock memory past `RLIMIT_MEMLOCK`.
const CAP_IPC_LOCK: u32 = 14;

fn has_cap(pid: u32, cap: u32) -> bool {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let eff = s.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(eff, 16).unwrap() & (1 << cap) != 0
}

#[test]
fn rlimit_memlock_refusal_names_the_limit() {
    // The daemon runs with RLIMIT_MEMLOCK = 64 KiB and without CAP_IPC_LOCK (dropped from
    // its bounding set, so not even root's exec gets it back): mlock of a 2 MiB region
    // fails and the refusal says which limit and what it is.
    let env = start("", |cmd| {
        // SAFETY: between fork and exec only prctl and setrlimit run: async-signal-safe
        // syscalls that allocate nothing.
        unsafe {
            cmd.pre_exec(|| {
                // Fails without CAP_SETPCAP; a non-root daemon lacks CAP_IPC_LOCK anyway.
                libc::prctl(libc::PR_CAPBSET_DROP, CAP_IPC_LOCK as libc::c_ulong, 0, 0, 0);
                let r = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
                if libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    });
    assert!(!has_cap(env._daemon.child.id(), CAP_IPC_LOCK), "the daemon kept CAP_IPC_LOCK; the test proves nothing");
    let mut c = common::client(&env.setup.socket);
    let gpu = env.gpu.clone();
    let region = alloc(&mut c, &gpu, 2 * MIB);
    let body = refused(&mut c, reg_req(&gpu, RegisterSource::Region(region), 0, 2 * MIB, AccessMode::ReadWrite), &[]);
    assert_eq!(body.code, ErrorCode::LimitExceeded, "{}", body.message);
    let Some(ErrorDetail::Limit { what, requested, max, .. }) = &body.detail else { panic!("{body:?}") };
    assert_eq!((what.as_str(), *requested, *max), ("RLIMIT_MEMLOCK", 2 * MIB, 64 << 10));
    assert!(body.message.contains("RLIMIT_MEMLOCK") && body.message.contains("65536"), "{}", body.message);
    // Nothing was left pinned or accounted by the refusal.
    let s = status(&mut c);
    assert_eq!((s.registrations, s.pinned_bytes), (0, 0));
    // The client's own memory is pinned by the client: the daemon's limit does not apply.
    let mine = own_memory(1 << 20, true);
    register(&mut c, &gpu, RegisterSource::Process { addr: mine.as_ptr() as u64 }, 0, 1 << 20, &[]);
    drop(mine);
}
