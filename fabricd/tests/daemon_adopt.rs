//! Vendor memory objects through the real daemon (`Adopt`, `ImportObject`): a descriptor
//! standing in for a CUDA POSIX export (a memfd, so the test can see which object travels)
//! becomes a region on a GPU's HBM with a GFA, counted in the owner's bytes, exported and
//! imported by handle with the same object coming back; the refusals are typed (wrong
//! import op either way, a socket as the object, non-HBM memory, a set, DMA registration of
//! it); the owner's session closing revokes it and tells the importer.
#![allow(clippy::unwrap_used)]

mod common;

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use fabric_proto::wire::{
    AccessMode, AdoptRequest, AllocRequest, AllocResponse, AllocTarget, BoundedVec, CodecError, Connection, DeviceName,
    ErrorBody, ErrorCode, Event, ExportHandle, ExportPolicy, ExportRequest, FabricHandleBytes, FreeRequest,
    ImportObjectResponse, ImportRequest, MemoryClass, Name, ObjectKind, RegionsRequest, RegisterRequest,
    RegisterSource, Request, Response, RevocationReason, StatusRequest, SubscribeRequest, Topics,
};
use fabric_topology::{DeviceKind, MemoryKind};

const MIB: u64 = 1 << 20;

/// The first GPU of the sim and a device of the sim without HBM.
fn devices() -> (String, String) {
    let inv = fabric_drivers::sim::load(&common::sim_file()).unwrap();
    let gpu = inv.devices.iter().find(|d| d.kind == DeviceKind::Gpu).unwrap();
    assert!(gpu.memory.iter().any(|m| m.kind == MemoryKind::Hbm));
    let other = inv.devices.iter().find(|d| !d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap();
    (gpu.id.to_string(), other.id.to_string())
}

/// A memfd of `len` bytes starting with `tag`: the stand-in for a CUDA export.
fn object(len: u64, tag: &[u8]) -> OwnedFd {
    let name = CString::new("cuda-export").unwrap();
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut f = File::from(fd.try_clone().unwrap());
    f.set_len(len).unwrap();
    f.write_all(tag).unwrap();
    fd
}

fn adopt_req(target: AllocTarget, size: u64) -> Request {
    Request::Adopt(AdoptRequest { target, size, object: ObjectKind::CudaPosixFd })
}

fn on_hbm(gpu: &str) -> AllocTarget {
    AllocTarget::Device { device: DeviceName::truncated(gpu), memory: MemoryClass::Hbm }
}

fn adopt(c: &mut Connection, gpu: &str, size: u64, fd: &OwnedFd) -> AllocResponse {
    let (r, fds) = c.call(adopt_req(on_hbm(gpu), size), &[fd.as_fd()]).unwrap();
    assert!(fds.is_empty(), "Adopt answers without a descriptor");
    let Response::Adopt(a) = r else { panic!("{r:?}") };
    a
}

fn refused(c: &mut Connection, req: Request, fds: &[std::os::fd::BorrowedFd<'_>]) -> ErrorBody {
    match c.call(req, fds) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn export(c: &mut Connection, region: u64) -> ExportHandle {
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let Response::Export(e) = c.call(Request::Export(ExportRequest { region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    e.handle
}

fn import_object(c: &mut Connection, handle: ExportHandle) -> (ImportObjectResponse, File) {
    let req = Request::ImportObject(ImportRequest { handle, access: AccessMode::ReadWrite });
    let (r, mut fds) = c.call(req, &[]).unwrap();
    let Response::ImportObject(i) = r else { panic!("{r:?}") };
    assert_eq!(fds.len(), 1);
    (i, File::from(fds.remove(0)))
}

fn allocated(c: &mut Connection) -> u64 {
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    s.allocated_bytes
}

#[test]
fn an_adopted_object_is_a_region_imported_by_handle() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = devices();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);

    let obj = object(6 * MIB, b"exporter's HBM");
    let before = allocated(&mut a);
    let r = adopt(&mut a, &gpu, 5 * MIB, &obj);
    assert_eq!((r.size, r.offset), (5 * MIB, 0));
    let gfa = r.gfa.expect("the GPU's HBM is in the map: the region has a GFA");
    // The resource range is the size rounded up to the 2 MiB granule.
    assert_eq!(allocated(&mut a) - before, 6 * MIB);
    let Response::Regions(list) = a.call(Request::Regions(RegionsRequest { all: false }), &[]).unwrap().0 else {
        panic!()
    };
    let info = list.regions.iter().find(|x| x.region == r.region).expect("listed");
    assert_eq!(info.resource.device.as_str(), gpu);
    assert_eq!(info.resource.memory, MemoryClass::Hbm);

    // Another session imports it by handle and gets the very object back.
    let handle = export(&mut a, r.region);
    let (i, mut f) = import_object(&mut b, handle);
    assert_eq!((i.region, i.generation, i.size, i.gfa), (r.region, r.generation, 5 * MIB, Some(gfa)));
    assert_eq!((i.object, i.device.as_str(), i.access), (ObjectKind::CudaPosixFd, gpu.as_str(), AccessMode::ReadWrite));
    let mut tag = [0u8; 14];
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_exact(&mut tag).unwrap();
    assert_eq!(&tag, b"exporter's HBM");
    assert!(d.log().contains("vendor object adopted"), "{}", d.log());

    // Free gives the range back.
    a.call(Request::Free(FreeRequest { region: r.region, node: None }), &[]).unwrap();
    assert_eq!(allocated(&mut a), before);
}

#[test]
fn wrong_ops_and_wrong_objects_are_typed_refusals() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let (gpu, other) = devices();
    let mut a = common::client(&setup.socket);
    let obj = object(2 * MIB, b"x");
    let r = adopt(&mut a, &gpu, 2 * MIB, &obj);
    let h = export(&mut a, r.region);

    // Its importers' drivers map it read-write: a read-only export would be a false promise.
    let ro = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let e = refused(&mut a, Request::Export(ExportRequest { region: r.region, policy: ro, node: None }), &[]);
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("read-only"), "{}", e.message);
    // A vendor object is not mmap-able memory: plain Import refuses it.
    let e = refused(&mut a, Request::Import(ImportRequest { handle: h, access: AccessMode::ReadWrite }), &[]);
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("ImportObject"), "{}", e.message);
    // And ImportObject refuses ordinary fabric memory.
    let req = Request::Alloc(AllocRequest { target: on_hbm(&gpu), size: 2 * MIB, align: 0 });
    let Response::Alloc(plain) = a.call(req, &[]).unwrap().0 else { panic!() };
    let ph = export(&mut a, plain.region);
    let e = refused(&mut a, Request::ImportObject(ImportRequest { handle: ph, access: AccessMode::ReadWrite }), &[]);
    assert_eq!(e.code, ErrorCode::BadRequest);
    // A forged handle is refused as for Import.
    let mut forged = h;
    forged.secret.0[0] ^= 1;
    let e =
        refused(&mut a, Request::ImportObject(ImportRequest { handle: forged, access: AccessMode::ReadWrite }), &[]);
    assert_eq!(e.code, ErrorCode::InvalidHandle);

    // A socket is no memory object.
    let (s1, _s2) = UnixStream::pair().unwrap();
    let e = refused(&mut a, adopt_req(on_hbm(&gpu), 2 * MIB), &[s1.as_fd()]);
    assert_eq!(e.code, ErrorCode::BadRequest);
    // A CUDA export is HBM: not on a device without it, not on another class, not on a set.
    let no_hbm = AllocTarget::Device { device: DeviceName::truncated(&other), memory: MemoryClass::Hbm };
    assert_eq!(refused(&mut a, adopt_req(no_hbm, 2 * MIB), &[obj.as_fd()]).code, ErrorCode::NotFound);
    let cxl = AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::CxlVolatile };
    assert_eq!(refused(&mut a, adopt_req(cxl, 2 * MIB), &[obj.as_fd()]).code, ErrorCode::BadRequest);
    let set = AllocTarget::Set(Name::truncated("any"));
    assert_eq!(refused(&mut a, adopt_req(set, 2 * MIB), &[obj.as_fd()]).code, ErrorCode::BadRequest);
    assert_eq!(refused(&mut a, adopt_req(on_hbm(&gpu), 0), &[obj.as_fd()]).code, ErrorCode::BadRequest);

    // The daemon never maps the object: it cannot pin it for DMA.
    let reg = Request::Register(RegisterRequest {
        device: DeviceName::truncated(&gpu),
        source: RegisterSource::Region(r.region),
        offset: 0,
        len: 4096,
        access: AccessMode::ReadWrite,
        node: None,
    });
    assert_eq!(refused(&mut a, reg, &[]).code, ErrorCode::NotImplemented);
}

#[test]
fn the_owner_going_away_revokes_the_object_and_tells_the_importer() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = devices();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    let Response::Subscribe(_) =
        b.call(Request::Subscribe(SubscribeRequest { topics: Topics::REVOCATION }), &[]).unwrap().0
    else {
        panic!()
    };
    let obj = object(2 * MIB, b"x");
    let r = adopt(&mut a, &gpu, 2 * MIB, &obj);
    let h = export(&mut a, r.region);
    let (i, _f) = import_object(&mut b, h);

    drop(a);
    b.stream().set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    match b.next_event().unwrap() {
        Event::Revocation(rv) => {
            assert_eq!((rv.region, rv.import), (r.region, i.import));
            assert_eq!(rv.reason, RevocationReason::OwnerExited);
        }
        other => panic!("{other:?}"),
    }
    // The export went with the region.
    let e = refused(&mut b, Request::ImportObject(ImportRequest { handle: h, access: AccessMode::ReadWrite }), &[]);
    assert_eq!(e.code, ErrorCode::InvalidHandle);
}

#[test]
fn adopted_objects_are_not_journaled_and_end_with_the_daemon() {
    let setup = common::Setup::new("[memory]\ncompact_records = 2\n");
    let mut d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = devices();
    let mut a = common::client(&setup.socket);
    let obj = object(2 * MIB, b"x");
    let r = adopt(&mut a, &gpu, 2 * MIB, &obj);
    let h = export(&mut a, r.region);
    // An ordinary region next to it, journaled; enough changes to compact with both live.
    let req = Request::Alloc(AllocRequest { target: on_hbm(&gpu), size: 2 * MIB, align: 0 });
    let Response::Alloc(plain) = a.call(req, &[]).unwrap().0 else { panic!() };
    let ph = export(&mut a, plain.region);
    drop(a);
    d.child.kill().unwrap();
    d.child.wait().unwrap();

    let d = common::start(&setup.config, setup.dir.path());
    let mut b = common::client(&setup.socket);
    // The object's export is gone with the object: nothing of it was journaled...
    let e = refused(&mut b, Request::ImportObject(ImportRequest { handle: h, access: AccessMode::ReadWrite }), &[]);
    assert_eq!(e.code, ErrorCode::InvalidHandle);
    // ...while the registry replayed the rest without a problem about the object.
    let Response::Status(s) = b.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    assert!(s.problems.iter().all(|p| !p.detail.as_str().contains(&format!("region {}", r.region))), "{s:?}");
    assert!(!d.log().contains("panicked"), "{}", d.log());
    // The ordinary region's export was journaled and still imports.
    let (resp, fds) =
        b.call(Request::Import(ImportRequest { handle: ph, access: AccessMode::ReadWrite }), &[]).unwrap();
    assert!(matches!(resp, Response::Import(ref i) if i.region == plain.region), "{resp:?}");
    assert_eq!(fds.len(), 1);
}

/// A CUDA fabric handle (protocol 1.4) is adopted as bytes: no descriptor travels either
/// way, the importer gets the very bytes back, and a connection that negotiated 1.3 (which
/// could not decode them) is refused both ways.
#[test]
fn a_fabric_handle_travels_as_bytes_and_only_to_connections_that_speak_1_4() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = devices();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    let mut bytes = [0u8; 64];
    bytes.iter_mut().enumerate().for_each(|(i, x)| *x = 0x40 + i as u8);
    let fabric = ObjectKind::CudaFabric(FabricHandleBytes(bytes));
    let req = Request::Adopt(AdoptRequest { target: on_hbm(&gpu), size: 4 * MIB, object: fabric });

    // With a descriptor as well: refused (the client side already refuses to send one).
    let e = match a.call(req.clone(), &[object(MIB, b"x").as_fd()]) {
        Err(e) => e.to_string(),
        Ok(r) => panic!("{r:?}"),
    };
    assert!(e.contains("descriptor"), "{e}");
    let (r, fds) = a.call(req.clone(), &[]).unwrap();
    assert!(fds.is_empty());
    let Response::Adopt(r) = r else { panic!("{r:?}") };
    assert_eq!(r.size, 4 * MIB);

    let handle = export(&mut a, r.region);
    let (i, fds) = b.call(Request::ImportObject(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]).unwrap();
    assert!(fds.is_empty(), "a fabric handle comes back as bytes only");
    let Response::ImportObject(i) = i else { panic!("{i:?}") };
    assert_eq!((i.object, i.region, i.size, i.device.as_str()), (fabric, r.region, 4 * MIB, gpu.as_str()));

    // A 1.3 connection: neither adopts nor is handed a fabric handle.
    let s = UnixStream::connect(&setup.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut old = Connection::new(s);
    let v13 = fabric_proto::wire::Version::new(1, 3);
    assert_eq!(old.hello("old", fabric_proto::wire::VersionRange::new(v13, v13)).unwrap().version, v13);
    let body = refused(&mut old, req, &[]);
    assert!(body.message.contains("1.4"), "{}", body.message);
    // The handle as a 1.3 client holds it: node-less (node ids came with 1.5).
    let handle = ExportHandle { node: None, ..handle };
    let body = refused(&mut old, Request::ImportObject(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]);
    assert!(body.message.contains("1.4"), "{}", body.message);
    // The refused import recorded nothing: the region still frees cleanly with one import.
    let Response::Regions(list) = a.call(Request::Regions(RegionsRequest { all: false }), &[]).unwrap().0 else {
        panic!()
    };
    assert!(list.regions.iter().any(|x| x.region == r.region));
}

fn register_fd(c: &mut Connection, gpu: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<Response, CodecError> {
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(gpu),
        source: RegisterSource::Fd,
        offset: 0,
        len: 4096,
        access: AccessMode::ReadOnly,
        node: None,
    });
    c.call(req, &[fd]).map(|(r, _)| r)
}

/// Only memory objects are adopted or registered: an eventfd, `/dev/zero`,
/// `/proc/self/mem` and a plain file on the test's filesystem are refused with what they
/// are (before this, Adopt took all four and handed them to importers as CUDA memory, and
/// Register mapped and locked the file); a memfd still passes both.
#[test]
fn only_memory_objects_are_adopted_or_registered() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = devices();
    let mut c = common::client(&setup.socket);
    // SAFETY: eventfd takes a count and flags; the result is checked.
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(efd >= 0);
    // SAFETY: just created, owned by nothing else.
    let efd = unsafe { OwnedFd::from_raw_fd(efd) };
    let zero = File::open("/dev/zero").unwrap();
    let mem = File::open("/proc/self/mem").unwrap();
    let plain_path = setup.dir.path().join("plain-file");
    let plain = File::options().read(true).write(true).create(true).truncate(true).open(&plain_path).unwrap();
    plain.set_len(4 * MIB).unwrap();
    let cases: [(std::os::fd::BorrowedFd<'_>, &str); 4] = [
        (efd.as_fd(), "anonymous inode"),
        (zero.as_fd(), "character device"),
        (mem.as_fd(), "/mem"),
        (plain.as_fd(), "plain-file"),
    ];
    let before = allocated(&mut c);
    for (fd, says) in cases {
        let body = refused(&mut c, adopt_req(on_hbm(&gpu), 2 * MIB), &[fd]);
        assert_eq!(body.code, ErrorCode::BadRequest, "{}", body.message);
        assert!(body.message.contains(says) && body.message.contains("not a CUDA export"), "{}", body.message);
    }
    assert_eq!(allocated(&mut c), before, "nothing placed by a refusal");
    match register_fd(&mut c, &gpu, plain.as_fd()) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, ErrorCode::BadRequest, "{}", body.message);
            assert!(body.message.contains("regular file outside tmpfs"), "{}", body.message);
        }
        other => panic!("a plain file was registered: {other:?}"),
    }
    let obj = object(4 * MIB, b"memfd");
    adopt(&mut c, &gpu, 2 * MIB, &obj);
    assert!(matches!(register_fd(&mut c, &gpu, obj.as_fd()), Ok(Response::Register(_))));
}

/// The socket group of the budget test's clients.
const BUDGET_GID: u32 = 62100;
const ENV_BUDGET_SOCKET: &str = "FABRICD_BUDGET_SOCKET";
const ENV_BUDGET_GPU: &str = "FABRICD_BUDGET_GPU";

/// Run by `a_uid_at_its_descriptor_share_is_refused_while_others_and_root_work` as another
/// uid: adopts memfds until refused, says how many and why, and keeps its session (and
/// so its objects) until its stdin closes.
#[test]
#[ignore = "a child of a_uid_at_its_descriptor_share_is_refused_while_others_and_root_work"]
fn budget_child() {
    let (Some(socket), Ok(gpu)) = (std::env::var_os(ENV_BUDGET_SOCKET), std::env::var(ENV_BUDGET_GPU)) else { return };
    let mut c = common::client(std::path::Path::new(&socket));
    let mut adopted = 0;
    let refused = loop {
        let obj = object(2 * MIB, b"budget");
        match c.call(adopt_req(on_hbm(&gpu), 2 * MIB), &[obj.as_fd()]) {
            Ok(_) if adopted < 1000 => adopted += 1,
            Ok(_) => break "nothing".to_owned(),
            Err(CodecError::Refused { body, .. }) => match body.detail {
                Some(fabric_proto::wire::ErrorDetail::Limit { what, .. }) => break what.as_str().to_owned(),
                _ => break format!("{:?}", body.code),
            },
            Err(e) => panic!("{e}"),
        }
    };
    println!("answer: adopted={adopted} refused={refused}");
    std::io::Write::flush(&mut std::io::stdout()).unwrap();
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}

/// Every adopted object keeps a descriptor. Under a 1,024-descriptor table, one uid may
/// keep 28 and other uids together 228 (docs/fabricd.md, "Descriptors"): eight uids fill
/// their shares, a ninth gets what is left of the others' share, and another connection
/// of root's still connects and adopts (before the budget, each uid kept up to
/// objects_per_uid, 4,096, and five uids filled a table root could not connect to).
#[test]
fn a_uid_at_its_descriptor_share_is_refused_while_others_and_root_work() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: needs root to run clients under other uids");
        return;
    }
    let setup = common::Setup::new(&format!("group = \"{BUDGET_GID}\""));
    let _d = common::start_with_open_files(&setup.config, setup.dir.path(), 1024);
    let (gpu, _) = devices();
    let mut children = Vec::new();
    let mut answers = Vec::new();
    for uid in 62001..=62009u32 {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", "budget_child", "--nocapture", "--test-threads", "1"])
            .env(ENV_BUDGET_SOCKET, &setup.socket)
            .env(ENV_BUDGET_GPU, &gpu)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        use std::os::unix::process::CommandExt;
        // SAFETY: runs in the forked child before exec and makes only async-signal-safe
        // system calls (setgroups, setgid, setuid) on values on its stack.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(BUDGET_GID) != 0 || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let answer = loop {
            let mut line = String::new();
            assert!(std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0, "uid {uid}'s client exited");
            if let Some((_, a)) = line.split_once("answer: ") {
                break a.trim().to_owned();
            }
        };
        answers.push(answer);
        children.push((child, out));
    }
    let full = "adopted=28 refused=descriptors_per_uid";
    assert!(answers[..8].iter().all(|a| a == full), "{answers:?}");
    assert_eq!(answers[8], "adopted=4 refused=descriptors_unprivileged");
    // Root connects and works in the share kept back.
    let mut root = common::client(&setup.socket);
    let obj = object(2 * MIB, b"root");
    adopt(&mut root, &gpu, 2 * MIB, &obj);
    allocated(&mut root);
    for (mut child, _) in children {
        drop(child.stdin.take());
        assert!(child.wait().unwrap().success());
    }
}
