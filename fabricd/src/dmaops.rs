//! The DMA operations on the wire: register and unregister, from requests to
//! [`crate::memory::Memory::register`] calls and back, every refusal typed.

use std::os::fd::OwnedFd;

use fabric_proto::wire::{ErrorBody, ErrorCode, RegisterRequest, RegisterResponse, RegisterSource, Response};
use fabric_topology::DeviceId;

use crate::daemon::Daemon;
use crate::dma::{Target, can_dma, target_of};
use crate::memops::refused;
use crate::memory::{Abandon, Source};
use crate::ops::refusal;
use crate::peer::Peer;

/// The DMA target of device `name`: its domain and mask.
pub fn target(d: &Daemon, name: &str) -> Result<Target, ErrorBody> {
    let id: DeviceId = name.parse().map_err(|e| refusal(ErrorCode::BadRequest, format!("device {name:?}: {e}")))?;
    let view = d.view();
    let inv = view.fabric.inventory();
    let idx = inv.find(&id).ok_or_else(|| refusal(ErrorCode::NotFound, format!("no device {id}")))?;
    let dev = inv.device(idx);
    if !can_dma(dev) {
        return Err(refusal(ErrorCode::BadRequest, format!("device {id} ({:?}) does not do DMA", dev.kind)));
    }
    let mut t = target_of(dev);
    if let Some(v) = dev.pci.as_ref().and_then(|p| p.address).and_then(|a| d.vfio.get(&a.to_string())) {
        t.mask_bits = t.mask_bits.min(v.mask_bits.unwrap_or(crate::dma::DEFAULT_DMA_MASK_BITS));
        t.vfio = Some(v.clone());
    }
    Ok(t)
}

/// `Register`: pins the source and maps it at an IOVA in the device's DMA domain; the pin
/// is given up when `abandon` says so (the connection's end, the daemon's).
pub fn register(
    d: &Daemon,
    peer: &Peer,
    session: u64,
    req: RegisterRequest,
    fds: Vec<OwnedFd>,
    abandon: Abandon<'_>,
) -> Result<Response, ErrorBody> {
    let target = target(d, &req.device)?;
    let source = match req.source {
        RegisterSource::Region(id) => Source::Region(id),
        RegisterSource::Import(id) => Source::Import(id),
        RegisterSource::Fd => Source::Fd(
            fds.into_iter()
                .next()
                .ok_or_else(|| refusal(ErrorCode::BadFds, "register from a descriptor needs one descriptor"))?,
        ),
        // The process that connected, followed by its pidfd: never the pid looked up anew.
        RegisterSource::Process { addr } => Source::Process {
            addr,
            process: peer.process().map_err(|e| refusal(ErrorCode::PermissionDenied, e.to_string()))?.clone(),
        },
    };
    let r = d
        .memory
        .register(&peer.cred, session, &target, source, req.offset, req.len, req.access, abandon)
        .map_err(|e| refused(&e))?;
    Ok(Response::Register(RegisterResponse { registration: r.registration, iova: r.iova, len: r.len }))
}

/// `Unregister`: a registration of this session.
pub fn unregister(d: &Daemon, session: u64, registration: u64) -> Result<Response, ErrorBody> {
    d.memory.unregister(session, registration).map_err(|e| refused(&e))?;
    Ok(Response::Unregister)
}
