//! The memory operations: alloc, adopt, free, export, revoke, import and release, from
//! checked arguments ([`crate::ops::dispatch::Operation`]) to [`crate::memory::Memory`] calls
//! and their answers, every refusal typed.

use std::os::fd::OwnedFd;

use crate::memory::Identity;
use fabric_proto::wire::{
    Access, AccessMode, AllocResponse, Coherence, DeviceName, ErrorBody, ExportHandle, ExportPolicy, ExportResponse,
    Grant, ImportObjectResponse, ImportResponse, ObjectKind, Response, Version,
};

use crate::daemon::Daemon;
use crate::memory::{Granted, Place};
use crate::ops::dispatch::errors::memory as refused;
use crate::ops::dispatch::operation::Target;
use crate::placement;

/// `Alloc`: a region and its backing file, read-write. An interleave set is the one of
/// `snap`, the map the request was authorized against.
pub fn alloc(
    d: &Daemon,
    snap: &fabric_addrmap::Snapshot,
    owner: &Identity,
    session: u64,
    target: &Target,
    size: u64,
    align: u64,
) -> Result<(Response, OwnedFd), ErrorBody> {
    let (g, gfa) = match target {
        Target::Set(name) => {
            let set = placement::set_spec(snap, name)?;
            let (g, offset) = d.memory.alloc_set(owner, session, &set, size, align).map_err(|e| refused(&e))?;
            (g, set.start.checked_add(offset))
        }
        Target::Place(place) => {
            let g = d.memory.alloc(owner, session, place, size, align).map_err(|e| refused(&e))?;
            let gfa = placement::region_gfa(d, g.region);
            (g, gfa)
        }
    };
    let resp = AllocResponse {
        region: g.region,
        generation: g.generation,
        size: g.len,
        gfa,
        offset: g.offset,
        grant: fd_grant(d, &g),
    };
    Ok((Response::Alloc(resp), g.fd))
}

/// The grant of memory this node hands over as a descriptor (every `Alloc` and `Import`),
/// with the coherence of the memory it is on.
fn fd_grant(d: &Daemon, g: &Granted) -> Option<Grant> {
    Some(Grant::new(d.node, Access::Fd).with_coherence(g.coherence))
}

/// The grant of a vendor object of this node (`Adopt`, `ImportObject`): its own driver
/// maps it, nothing for the library to flush.
fn vendor_grant(d: &Daemon) -> Option<Grant> {
    Some(Grant::new(d.node, Access::Vendor).with_coherence(Coherence::Hardware))
}

/// `Adopt`: the vendor object sent with the request (`fd`, when it is a descriptor)
/// becomes a region of this session.
pub fn adopt(
    d: &Daemon,
    owner: &Identity,
    session: u64,
    place: &Place,
    size: u64,
    object: ObjectKind,
    fd: Option<OwnedFd>,
) -> Result<Response, ErrorBody> {
    let a = d.memory.adopt(owner, session, place, size, object, fd).map_err(|e| refused(&e))?;
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
    owner: &Identity,
    session: u64,
    handle: &ExportHandle,
    access: AccessMode,
    version: Version,
) -> Result<(Response, Option<OwnedFd>), ErrorBody> {
    let o = d.memory.import_object(owner, session, handle, access, version).map_err(|e| refused(&e))?;
    let resp = ImportObjectResponse {
        import: o.import,
        region: o.region,
        generation: o.generation,
        size: o.size,
        gfa: placement::region_gfa(d, o.region),
        access,
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
pub fn export(
    d: &Daemon,
    owner: &Identity,
    session: u64,
    region: u64,
    policy: ExportPolicy,
) -> Result<Response, ErrorBody> {
    let handle = d.memory.export(owner, session, region, policy).map_err(|e| refused(&e))?;
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
    owner: &Identity,
    session: u64,
    handle: &ExportHandle,
    access: AccessMode,
) -> Result<(Response, OwnedFd), ErrorBody> {
    let g = d.memory.import(owner, session, handle, access).map_err(|e| refused(&e))?;
    let resp = ImportResponse {
        import: g.import,
        region: g.region,
        generation: g.generation,
        size: g.len,
        gfa: placement::region_gfa(d, g.region),
        offset: g.offset,
        access,
        grant: fd_grant(d, &g),
    };
    Ok((Response::Import(resp), g.fd))
}

/// `Release`: an import of this session.
pub fn release(d: &Daemon, session: u64, import: u64) -> Result<Response, ErrorBody> {
    d.memory.release(session, import).map_err(|e| refused(&e))?;
    Ok(Response::Release)
}
