//! The memory operations on the wire: alloc, free, export, revoke, import and release,
//! from requests to [`crate::memory::Memory`] calls and back, every refusal typed.

use std::os::fd::OwnedFd;

use fabric_proto::wire::{
    Access, AdoptRequest, AllocRequest, AllocResponse, AllocTarget, DeviceName, ErrorBody, ErrorCode, ErrorDetail,
    ExportHandle, ExportRequest, ExportResponse, Grant, ImportObjectResponse, ImportRequest, ImportResponse, Name,
    PeerCred, Response, Version,
};
use fabric_topology::DeviceId;

use crate::daemon::Daemon;
use crate::dma::sys::PinError;
use crate::memory::{MemoryError, Place};
use crate::ops::refusal;
use crate::placement;

/// The typed refusal for a memory error.
pub fn refused(e: &MemoryError) -> ErrorBody {
    let code = match e {
        MemoryError::NotFound(_) => ErrorCode::NotFound,
        MemoryError::PermissionDenied(_) => ErrorCode::PermissionDenied,
        MemoryError::InvalidHandle => ErrorCode::InvalidHandle,
        MemoryError::Revoked => ErrorCode::Revoked,
        MemoryError::Limit { .. } => ErrorCode::LimitExceeded,
        MemoryError::NoSpace(_) => ErrorCode::NoSpace,
        MemoryError::BadRequest(_) => ErrorCode::BadRequest,
        MemoryError::NotImplemented(_) => ErrorCode::NotImplemented,
        MemoryError::DeviceLost(_) => ErrorCode::Unavailable,
        MemoryError::Node(crate::memory::numa::NumaError::NoMemory { .. }) => ErrorCode::NoSpace,
        MemoryError::Node(_) => ErrorCode::Internal,
        MemoryError::Carve(_) | MemoryError::Zero(_) => ErrorCode::Internal,
        MemoryError::Io { .. }
        | MemoryError::Private(_)
        | MemoryError::Journal(_)
        | MemoryError::Record(_)
        | MemoryError::JournalUnavailable => ErrorCode::Internal,
        MemoryError::Iova(_) => ErrorCode::NoSpace,
        MemoryError::Pin(PinError::MemlockLimit { .. }) => ErrorCode::LimitExceeded,
        MemoryError::Pin(PinError::Map { source, .. }) if source.raw_os_error() == Some(libc::EACCES) => {
            ErrorCode::PermissionDenied
        }
        MemoryError::Pin(PinError::Map { .. }) => ErrorCode::BadRequest,
        MemoryError::Pin(PinError::Lock { .. }) => ErrorCode::Internal,
        // No one waits for the answer (the client hung up, the daemon is stopping).
        MemoryError::Pin(PinError::Abandoned { .. }) => ErrorCode::Unavailable,
        MemoryError::Vfio(_) => ErrorCode::Internal,
    };
    let message = crate::error_chain(e);
    let mut body = refusal(code, message);
    if let MemoryError::Limit { what, used, requested, max, .. } = e {
        body.detail =
            Some(ErrorDetail::Limit { what: Name::truncated(what), used: *used, requested: *requested, max: *max });
    }
    if let MemoryError::Pin(PinError::MemlockLimit { requested, locked, limit }) = e {
        body.detail = Some(ErrorDetail::Limit {
            what: Name::truncated("RLIMIT_MEMLOCK"),
            used: *locked,
            requested: *requested,
            max: *limit,
        });
    }
    body
}

fn parse_device(s: &str) -> Result<DeviceId, ErrorBody> {
    s.parse::<DeviceId>().map_err(|e| refusal(ErrorCode::BadRequest, format!("device {s:?}: {e}")))
}

/// `Alloc`: a region and its backing file, read-write.
pub fn alloc(
    d: &Daemon,
    peer: &PeerCred,
    session: u64,
    req: AllocRequest,
) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
    let (g, gfa) = if let AllocTarget::Set(name) = &req.target {
        let set = placement::set_spec(d, name)?;
        let (g, offset) = d.memory.alloc_set(peer, session, &set, req.size, req.align).map_err(|e| refused(&e))?;
        (g, set.start.checked_add(offset))
    } else {
        let place = place_of(&req.target)?;
        let g = d.memory.alloc(peer, session, &place, req.size, req.align).map_err(|e| refused(&e))?;
        let gfa = placement::region_gfa(d, g.region);
        (g, gfa)
    };
    let resp = AllocResponse {
        region: g.region,
        generation: g.generation,
        size: g.len,
        gfa,
        offset: g.offset,
        grant: fd_grant(d),
    };
    Ok((Response::Alloc(resp), Some(g.fd)))
}

/// The grant of memory this node hands over as a descriptor (every `Alloc` and `Import`).
fn fd_grant(d: &Daemon) -> Option<Grant> {
    Some(Grant { owner: d.node, access: Access::Fd })
}

/// The grant of a vendor object of this node (`Adopt`, `ImportObject`).
fn vendor_grant(d: &Daemon) -> Option<Grant> {
    Some(Grant { owner: d.node, access: Access::Vendor })
}

/// Where an `Alloc` or `Adopt` on a resource or a device goes; an interleave set is not
/// one place (`Alloc` handles it first; `Adopt` refuses it).
fn place_of(target: &AllocTarget) -> Result<Place, ErrorBody> {
    match target {
        AllocTarget::Resource(r) => {
            Ok(Place { device: parse_device(&r.device)?, kind: r.memory.into(), ordinal: Some(r.ordinal) })
        }
        AllocTarget::Device { device, memory } => {
            Ok(Place { device: parse_device(device)?, kind: (*memory).into(), ordinal: None })
        }
        AllocTarget::Set(name) => Err(refusal(
            ErrorCode::BadRequest,
            format!("interleave set {name:?}: a vendor object lies on one device's memory"),
        )),
    }
}

/// `Adopt`: the vendor object sent with the request becomes a region of this session.
pub fn adopt(
    d: &Daemon,
    peer: &PeerCred,
    session: u64,
    req: AdoptRequest,
    fds: Vec<OwnedFd>,
) -> Result<Response, ErrorBody> {
    let place = place_of(&req.target)?;
    let fd = fds.into_iter().next();
    if req.object.is_descriptor() && fd.is_none() {
        return Err(refusal(ErrorCode::BadFds, "Adopt needs the object's descriptor"));
    }
    if !req.object.is_descriptor() && fd.is_some() {
        return Err(refusal(ErrorCode::BadFds, "a fabric handle travels in the body: Adopt it with no descriptor"));
    }
    let a = d.memory.adopt(peer, session, &place, req.size, req.object, fd).map_err(|e| refused(&e))?;
    let gfa = placement::region_gfa(d, a.region);
    let grant = vendor_grant(d);
    Ok(Response::Adopt(AllocResponse {
        region: a.region,
        generation: a.generation,
        size: a.size,
        gfa,
        offset: 0,
        grant,
    }))
}

/// `ImportObject`: an adopted region by handle, with a duplicate of its vendor descriptor.
pub fn import_object(
    d: &Daemon,
    peer: &PeerCred,
    session: u64,
    req: ImportRequest,
    version: Version,
) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
    let o = d.memory.import_object(peer, session, &req.handle, req.access, version).map_err(|e| refused(&e))?;
    let resp = ImportObjectResponse {
        import: o.import,
        region: o.region,
        generation: o.generation,
        size: o.size,
        gfa: placement::region_gfa(d, o.region),
        access: req.access,
        object: o.kind,
        device: DeviceName::truncated(&o.device.to_string()),
        grant: vendor_grant(d),
    };
    Ok((Response::ImportObject(resp), o.fd))
}

/// `Free`: a region of this session.
pub fn free(d: &Daemon, session: u64, region: u64) -> Result<Response, ErrorBody> {
    d.memory.free(session, region).map_err(|e| refused(&e))?;
    Ok(Response::Free)
}

/// `Export`: a handle for a region of this session.
pub fn export(d: &Daemon, peer: &PeerCred, session: u64, req: ExportRequest) -> Result<Response, ErrorBody> {
    let handle = d.memory.export(peer, session, req.region, req.policy).map_err(|e| refused(&e))?;
    // The registry keeps handles node-less (all of them are this node's); the one handed
    // out names this node.
    Ok(Response::Export(ExportResponse { handle: ExportHandle { node: Some(d.node), ..handle } }))
}

/// `Revoke`: an export of a region of this session.
pub fn revoke(d: &Daemon, session: u64, handle: &ExportHandle) -> Result<Response, ErrorBody> {
    d.memory.revoke(session, handle).map_err(|e| refused(&e))?;
    Ok(Response::Revoke)
}

/// `Import`: the region a handle names, opened read-only or read-write as granted.
pub fn import(
    d: &Daemon,
    peer: &PeerCred,
    session: u64,
    req: ImportRequest,
) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
    let g = d.memory.import(peer, session, &req.handle, req.access).map_err(|e| refused(&e))?;
    let resp = ImportResponse {
        import: g.import,
        region: g.region,
        generation: g.generation,
        size: g.len,
        gfa: placement::region_gfa(d, g.region),
        offset: g.offset,
        access: req.access,
        grant: fd_grant(d),
    };
    Ok((Response::Import(resp), Some(g.fd)))
}

/// `Release`: an import of this session.
pub fn release(d: &Daemon, session: u64, import: u64) -> Result<Response, ErrorBody> {
    d.memory.release(session, import).map_err(|e| refused(&e))?;
    Ok(Response::Release)
}
