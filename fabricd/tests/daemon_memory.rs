//! Memory brokering on the real daemon with real clients: alloc, export, import, revoke,
//! release over the socket, regions shared by `mmap` of the passed descriptors, refusals
//! typed, per-uid limits, and reclaim when a client disconnects.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocResponse, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ErrorBody,
    ErrorCode, ErrorDetail, ExportHandle, ExportPolicy, ExportRequest, FreeRequest, ImportRequest, ImportResponse,
    MemoryClass, Name, ReleaseRequest, Request, Response, RevokeRequest, Secret, StatusRequest, StatusResponse,
};
use fabric_topology::{Fabric, MemoryKind};
use memmap2::{MmapMut, MmapOptions};

const MIB: u64 = 1 << 20;

/// The first GPU with HBM in the sim fabric, and its HBM size.
fn gpu() -> (String, u64) {
    let f = Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap();
    let d = f.inventory().devices.iter().find(|d| d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap();
    let size = d.memory.iter().find(|m| m.kind == MemoryKind::Hbm).unwrap().size;
    (d.id.to_string(), size)
}

fn alloc_req(device: &str, size: u64) -> Request {
    Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size,
        align: 0,
    })
}

fn alloc(c: &mut Connection, device: &str, size: u64) -> (AllocResponse, File) {
    let (r, mut fds) = c.call(alloc_req(device, size), &[]).unwrap();
    let Response::Alloc(a) = r else { panic!("{r:?}") };
    assert_eq!(fds.len(), 1);
    (a, File::from(fds.remove(0)))
}

fn refused(c: &mut Connection, req: Request) -> ErrorBody {
    match c.call(req, &[]) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn export(c: &mut Connection, region: u64, access: AccessMode) -> ExportHandle {
    let policy = ExportPolicy { uids: BoundedVec::default(), gids: BoundedVec::default(), partition: None, access };
    let Response::Export(e) = c.call(Request::Export(ExportRequest { region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    e.handle
}

fn import(c: &mut Connection, handle: ExportHandle, access: AccessMode) -> Result<(ImportResponse, File), ErrorBody> {
    match c.call(Request::Import(ImportRequest { handle, access }), &[]) {
        Ok((Response::Import(i), mut fds)) => {
            assert_eq!(fds.len(), 1);
            let fd: OwnedFd = fds.remove(0);
            Ok((i, File::from(fd)))
        }
        Err(CodecError::Refused { body, .. }) => Err(body),
        other => panic!("unexpected {other:?}"),
    }
}

fn map_rw(f: &File, offset: u64, len: u64) -> MmapMut {
    // SAFETY: the file is a region file only this test's clients map; the daemon never
    // truncates a live region's file.
    unsafe { MmapOptions::new().offset(offset).len(len as usize).map_mut(f) }.unwrap()
}

fn status(c: &mut Connection) -> StatusResponse {
    let Response::Status(s) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    s
}

#[test]
fn two_clients_share_a_region_through_passed_descriptors() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = gpu();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);

    let (region, fa) = alloc(&mut a, &gpu, 3 * MIB);
    assert_eq!(region.size, 4 * MIB, "rounded up to the 2 MiB granule");
    let mut ma = map_rw(&fa, region.offset, region.size);
    for (i, byte) in ma.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    let handle = export(&mut a, region.region, AccessMode::ReadWrite);
    assert_eq!((handle.region, handle.generation), (region.region, region.generation));

    let (imp, fb) = import(&mut b, handle, AccessMode::ReadWrite).unwrap();
    assert_eq!((imp.region, imp.size, imp.access), (region.region, region.size, AccessMode::ReadWrite));
    let mut mb = map_rw(&fb, imp.offset, imp.size);
    assert!(mb.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "B reads A's pattern");
    mb[12345] = 0xAB;
    mb[(4 * MIB - 1) as usize] = 0xCD;
    // A sees B's stores through its own mapping, with no daemon call in between.
    assert_eq!((ma[12345], ma[(4 * MIB - 1) as usize]), (0xAB, 0xCD));

    let s = status(&mut a);
    assert_eq!((s.regions, s.exports, s.imports, s.allocated_bytes), (1, 1, 1, 4 * MIB));

    // B cannot free or export A's region; A frees after B releases.
    assert_eq!(
        refused(&mut b, Request::Free(FreeRequest { region: region.region, node: None })).code,
        ErrorCode::PermissionDenied
    );
    let e = refused(
        &mut b,
        Request::Export(ExportRequest {
            region: region.region,
            policy: ExportPolicy {
                uids: BoundedVec::default(),
                gids: BoundedVec::default(),
                partition: None,
                access: AccessMode::ReadOnly,
            },
            node: None,
        }),
    );
    assert_eq!(e.code, ErrorCode::PermissionDenied);
    b.call(Request::Release(ReleaseRequest { import: imp.import }), &[]).unwrap();
    assert_eq!(refused(&mut b, Request::Release(ReleaseRequest { import: imp.import })).code, ErrorCode::NotFound);
    a.call(Request::Free(FreeRequest { region: region.region, node: None }), &[]).unwrap();
    let s = status(&mut a);
    assert_eq!((s.regions, s.exports, s.imports, s.allocated_bytes), (0, 0, 0, 0));
    // A freed region's handle names nothing.
    assert_eq!(import(&mut b, handle, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::InvalidHandle);
    drop(d);
}

#[test]
fn forged_read_only_and_revoked_handles_are_refused() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = gpu();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    let (region, fa) = alloc(&mut a, &gpu, 2 * MIB);
    map_rw(&fa, 0, region.size)[7] = 42;

    let ro = export(&mut a, region.region, AccessMode::ReadOnly);
    let mut wrong_secret = ro;
    wrong_secret.secret = Secret(ro.secret.0.map(|b| b ^ 1));
    assert_eq!(import(&mut b, wrong_secret, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::InvalidHandle);
    let mut wrong_gen = ro;
    wrong_gen.generation += 1;
    assert_eq!(import(&mut b, wrong_gen, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::InvalidHandle);
    let mut wrong_region = ro;
    wrong_region.region += 100;
    assert_eq!(import(&mut b, wrong_region, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::InvalidHandle);

    // A read-only export cannot be imported for writing, and its descriptor cannot be
    // mapped writable.
    assert_eq!(import(&mut b, ro, AccessMode::ReadWrite).unwrap_err().code, ErrorCode::PermissionDenied);
    let (imp, fb) = import(&mut b, ro, AccessMode::ReadOnly).unwrap();
    assert_eq!(imp.access, AccessMode::ReadOnly);
    // SAFETY: see map_rw.
    let err = unsafe { MmapOptions::new().len(imp.size as usize).map_mut(&fb) }.unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EACCES), "PROT_WRITE on the O_RDONLY descriptor fails");
    // SAFETY: see map_rw.
    let m = unsafe { MmapOptions::new().len(imp.size as usize).map(&fb) }.unwrap();
    assert_eq!(m[7], 42);

    // Only the owner revokes; after revocation imports are refused as revoked.
    assert_eq!(refused(&mut b, Request::Revoke(RevokeRequest { handle: ro })).code, ErrorCode::PermissionDenied);
    assert_eq!(refused(&mut a, Request::Revoke(RevokeRequest { handle: wrong_secret })).code, ErrorCode::InvalidHandle);
    a.call(Request::Revoke(RevokeRequest { handle: ro }), &[]).unwrap();
    assert_eq!(import(&mut b, ro, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::Revoked);
    // Another export of the same region still works: each has its own secret.
    let rw = export(&mut a, region.region, AccessMode::ReadWrite);
    assert_ne!(rw.secret, ro.secret);
    import(&mut b, rw, AccessMode::ReadWrite).unwrap();
    assert!(d.log().contains("refused"), "refusals are logged");
}

#[test]
fn a_closed_session_is_reclaimed_within_a_second() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let (gpu, hbm) = gpu();
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    // A takes the whole HBM (the backing file is sparse); nothing else fits.
    let (region, fa) = alloc(&mut a, &gpu, hbm);
    map_rw(&fa, 0, 4096)[0] = 0x5A;
    assert_eq!(refused(&mut b, alloc_req(&gpu, 2 * MIB)).code, ErrorCode::NoSpace);
    let handle = export(&mut a, region.region, AccessMode::ReadWrite);
    import(&mut b, handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(status(&mut b).imports, 1);

    drop(a);
    drop(fa);
    let start = Instant::now();
    let (again, fc) = loop {
        match b.call(alloc_req(&gpu, hbm), &[]) {
            Ok((Response::Alloc(r), mut fds)) => break (r, File::from(fds.remove(0))),
            Err(CodecError::Refused { body, .. }) if body.code == ErrorCode::NoSpace => {}
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(1), "A's region not reclaimed within a second");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_ne!(again.region, region.region);
    // The new region is fresh memory: A's data is not visible in it.
    assert_eq!(map_rw(&fc, 0, 4096)[0], 0);
    // A's export was revoked with its region, and B's import of it released.
    assert_eq!(import(&mut b, handle, AccessMode::ReadWrite).unwrap_err().code, ErrorCode::InvalidHandle);
    let s = status(&mut b);
    assert_eq!((s.regions, s.exports, s.imports), (1, 0, 0));
    assert!(d.log().contains("session closed; reclaimed"), "reclaim is logged:\n{}", d.log());
}

#[test]
fn per_uid_limits_are_typed_refusals() {
    let setup = common::Setup::new("[limits]\nallocated_bytes_per_uid = 8388608\nobjects_per_uid = 3\n");
    let _d = common::start(&setup.config, setup.dir.path());
    let (gpu, _) = gpu();
    let mut a = common::client(&setup.socket);
    let (region, _f) = alloc(&mut a, &gpu, 8 * MIB);
    let e = refused(&mut a, alloc_req(&gpu, MIB));
    assert_eq!(e.code, ErrorCode::LimitExceeded);
    assert_eq!(
        e.detail,
        Some(ErrorDetail::Limit {
            what: Name::truncated("allocated_bytes"),
            used: 8 * MIB,
            requested: 2 * MIB,
            max: 8 * MIB
        })
    );
    let h = export(&mut a, region.region, AccessMode::ReadOnly);
    import(&mut a, h, AccessMode::ReadOnly).unwrap();
    let e = import(&mut a, h, AccessMode::ReadOnly).unwrap_err();
    assert_eq!(e.code, ErrorCode::LimitExceeded);
    assert!(
        matches!(e.detail, Some(ErrorDetail::Limit { ref what, used: 3, max: 3, .. }) if what.as_str() == "objects")
    );
    // Freeing gives the objects back; unknown devices and zero sizes are typed too.
    a.call(Request::Free(FreeRequest { region: region.region, node: None }), &[]).unwrap();
    assert_eq!(refused(&mut a, alloc_req("name:nowhere/gpu9", MIB)).code, ErrorCode::NotFound);
    assert_eq!(refused(&mut a, alloc_req(&gpu, 0)).code, ErrorCode::BadRequest);
}

#[test]
fn at_start_region_files_without_an_acknowledged_region_are_removed() {
    let setup = common::Setup::new("");
    let (gpu, _) = gpu();
    let mut d = common::start(&setup.config, setup.dir.path());
    let mut a = common::client(&setup.socket);
    let (r, _) = alloc(&mut a, &gpu, 2 * MIB);
    let files = || {
        let mut v: Vec<String> = walk(&setup.state.join("memory"))
            .into_iter()
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .filter(|n| n.starts_with('r'))
            .collect();
        v.sort();
        v
    };
    let mine = format!("r{}", r.region);
    assert_eq!(files(), std::slice::from_ref(&mine));
    // A file no record names: what an allocation cut short by a crash leaves.
    let dir = walk(&setup.state.join("memory")).into_iter().find(|p| p.ends_with(&mine)).unwrap();
    std::fs::write(dir.with_file_name("r999999"), b"").unwrap();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    drop(d);
    let _d = common::start(&setup.config, setup.dir.path());
    assert_eq!(files(), [mine], "the acknowledged region's file stays, the stray one goes");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}
