//! The DMA operations: register and unregister, from checked arguments to
//! [`crate::memory::Memory::register`] calls and back, every refusal typed.

use fabric_proto::wire::{AccessMode, ErrorBody, ErrorCode, RegisterResponse, Response};
use fabric_topology::DeviceId;

use crate::daemon::Daemon;
use crate::dma::{Target, can_dma, target_of};
use crate::memory::{Abandon, Source, fdkind};
use crate::ops::dispatch::errors::{memory as refused, refusal};
use crate::ops::dispatch::operation::RegisterFrom;
use crate::ops::principal::Principal;

/// The DMA target of device `name`: its domain and mask.
pub fn target(d: &Daemon, id: &DeviceId) -> Result<Target, ErrorBody> {
    let view = d.view();
    let inv = view.fabric.inventory();
    let idx = inv.find(id).ok_or_else(|| refusal(ErrorCode::NotFound, format!("no device {id}")))?;
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

/// A `Register`'s checked arguments.
#[derive(Debug)]
pub struct Registration {
    /// The device whose DMA domain maps it.
    pub device: DeviceId,
    /// What is pinned.
    pub from: RegisterFrom,
    /// Offset into the source.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// The device's access.
    pub access: AccessMode,
}

/// `Register`: pins the source and maps it at an IOVA in the device's DMA domain; the pin
/// is given up when `abandon` says so (the connection's end, the daemon's).
pub fn register(
    d: &Daemon,
    who: &Principal,
    session: u64,
    req: Registration,
    abandon: Abandon<'_>,
) -> Result<Response, ErrorBody> {
    let target = target(d, &req.device)?;
    let source = match req.from {
        RegisterFrom::Region(id) => Source::Region(id),
        RegisterFrom::Import(id) => Source::Import(id),
        RegisterFrom::Fd(fd) => {
            refuse_other_nodes_file(d, std::os::fd::AsFd::as_fd(&fd))?;
            Source::Fd(fd)
        }
        // The process that connected, followed by its pidfd: never the pid looked up anew.
        RegisterFrom::Process { addr } => Source::Process {
            addr,
            process: who.process().map_err(|e| refusal(ErrorCode::PermissionDenied, e.to_string()))?.clone(),
        },
    };
    let r = d
        .memory
        .register(&who.owner(), session, &target, source, req.offset, req.len, req.access, abandon)
        .map_err(|e| refused(&e))?;
    Ok(Response::Register(RegisterResponse { registration: r.registration, iova: r.iova, len: r.len }))
}

/// Refuses a descriptor of another node's region file on the sim's shared fabric (what a
/// cross-node import hands its client): registered as a plain memory object, the owner's
/// free or revocation could not end the registration, and the device would go on
/// reaching that node's memory. This node's own region files (in its resource
/// directories, a NUMA directory under `shared_dir` included) are the registry's to
/// resolve ([`crate::memory::Memory::register`]).
fn refuse_other_nodes_file(d: &Daemon, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), ErrorBody> {
    let Some(shared) = &d.config.peer.shared_dir else { return Ok(()) };
    let own = d.config.memory_root(&d.state_dir);
    if fdkind::opened_under(fd, shared) && !fdkind::opened_under(fd, &own) && !d.memory.opened_in_own_dir(fd) {
        return Err(refusal(
            ErrorCode::NotImplemented,
            "the descriptor is another node's region file (a cross-node import): its registration could not be ended by the owner's revocation, so it cannot be registered for DMA; move its bytes with Copy (by the import's GFA) instead",
        ));
    }
    Ok(())
}

/// `Unregister`: a registration of this session.
pub fn unregister(d: &Daemon, session: u64, registration: u64) -> Result<Response, ErrorBody> {
    d.memory.unregister(session, registration).map_err(|e| refused(&e))?;
    Ok(Response::Unregister)
}
