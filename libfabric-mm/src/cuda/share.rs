//! GPU memory as fabric regions, through fabricd: [`Session::adopt_gpu`] hands a CUDA
//! allocation's POSIX export to the daemon (`Adopt`), which places it in the GPU's HBM
//! resource (so it has a GFA), counts it against the owner's limits and exports, revokes and
//! reclaims it like any region; [`Session::adopt_gpu_fabric`] does the same with the
//! allocation's fabric handle (64 bytes, NVSwitch/IMEX systems; protocol 1.4).
//! [`Session::import_gpu`] imports either by handle (`ImportObject`): the daemon checks the
//! handle and policy and passes the descriptor or the fabric handle, which the importer gives
//! to `cuMemImportFromShareableHandle`. The bytes never pass through the daemon: kernels and
//! copy engines of the importer's GPU reach the exporter's HBM.

use std::os::fd::{AsFd, BorrowedFd};

use fabric_proto::wire::{
    AccessMode, AdoptRequest, AllocTarget, DeviceName, FabricHandleBytes, FreeRequest, ImportRequest, MemoryClass,
    NodeId, ObjectKind, Opcode, ReleaseRequest, Request, Response,
};

use super::{CudaContext, FabricHandle, GpuMemory};
use crate::error::{Error, Result};
use crate::memory::Handle;
use crate::session::{Policy, Session};

/// GPU memory this session handed to fabricd: a region on the GPU's HBM resource. Dropping
/// it frees the region (its exports are revoked and its importers told); the allocation
/// itself stays the caller's [`GpuMemory`].
#[derive(Debug)]
pub struct GpuRegion {
    session: Session,
    region: u64,
    generation: u64,
    size: u64,
    gfa: Option<u64>,
    device: String,
    /// The node that owns the region (protocol 1.5).
    owner: Option<NodeId>,
}

impl GpuRegion {
    /// Region id.
    pub fn id(&self) -> u64 {
        self.region
    }

    /// Region generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Its global fabric address, when the GPU's memory is in the address map.
    pub fn gfa(&self) -> Option<u64> {
        self.gfa
    }

    /// The GPU (`uuid:GPU-…`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Exports it: a handle another process imports with [`Session::import_gpu`].
    pub fn export(&self, policy: &Policy) -> Result<Handle> {
        self.session.export_region(self.region, self.owner, policy)
    }

    /// The session that adopted it (its exports are revoked there).
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }
}

impl Drop for GpuRegion {
    fn drop(&mut self) {
        let r = self
            .session
            .inner
            .client
            .undo(Request::Free(FreeRequest { region: self.region, node: self.session.inner.region_node(self.owner) }));
        if let Err(e) = r {
            tracing::debug!(region = self.region, error = %e, "freeing an adopted region");
        }
    }
}

/// Another process's GPU memory, imported through fabricd: the allocation (to map with
/// [`GpuMemory::map`]) and the import that admitted it. Dropping it releases the
/// allocation, then the import.
///
/// A revocation (owner exited, export revoked, region freed) is reported by
/// [`GpuImport::check`] and the session's revocation callback; the driver's reference keeps
/// the memory this process imported alive and mapped until it is dropped, so the daemon
/// cannot take it back — a revoked import must stop using it.
#[derive(Debug)]
pub struct GpuImport {
    // Fields drop in order: the allocation before the import.
    memory: GpuMemory,
    import: ImportGuard,
    region: u64,
    generation: u64,
    gfa: Option<u64>,
    device: String,
    fabric: bool,
}

/// The daemon's import: released on drop.
#[derive(Debug)]
struct ImportGuard {
    session: Session,
    id: u64,
}

impl Drop for ImportGuard {
    fn drop(&mut self) {
        let r = self.session.inner.client.undo(Request::Release(ReleaseRequest { import: self.id }));
        if let Err(e) = r {
            tracing::debug!(import = self.id, error = %e, "releasing a GPU import");
        }
        self.session.inner.revocations.forget(self.id);
    }
}

impl GpuImport {
    /// The imported allocation.
    pub fn memory(&self) -> &GpuMemory {
        &self.memory
    }

    /// The import's id.
    pub fn import_id(&self) -> u64 {
        self.import.id
    }

    /// The region's id and generation.
    pub fn region(&self) -> (u64, u64) {
        (self.region, self.generation)
    }

    /// Its global fabric address, when in the map.
    pub fn gfa(&self) -> Option<u64> {
        self.gfa
    }

    /// The exporter's GPU (`uuid:GPU-…`).
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Whether the memory came as a fabric handle (else as a POSIX descriptor).
    pub fn is_fabric(&self) -> bool {
        self.fabric
    }

    /// `Err(Revoked)` once the daemon told this session the import was revoked.
    pub fn check(&self) -> Result<()> {
        match self.import.session.inner.revocations.of_import(self.import.id) {
            Some(r) => Err(Error::Revoked { region: r.region, generation: r.generation, reason: r.reason }),
            None => Ok(()),
        }
    }
}

impl Session {
    /// Hands `memory` (a local CUDA allocation) to fabricd as a region of this session on
    /// its GPU's HBM: exported as a POSIX descriptor and sent with `Adopt`. `device` is the
    /// GPU's fabric identity; `None` asks CUDA (`uuid:GPU-…`, [`CudaContext::fabric_device`]).
    pub fn adopt_gpu(&self, memory: &GpuMemory, device: Option<&str>) -> Result<GpuRegion> {
        let device = adoptable(memory, device)?;
        let fd = memory.export_fd()?;
        self.adopt_object(memory, device, ObjectKind::CudaPosixFd, Some(fd.as_fd()))
    }

    /// [`Session::adopt_gpu`] with the allocation's fabric handle instead of a descriptor
    /// (protocol 1.4): for NVLink/NVSwitch systems, where an importer on another node of the
    /// NVLink domain can import it too. The allocation must have been made with
    /// [`super::AllocOptions::fabric`] (the driver needs an IMEX channel for that). The
    /// daemon keeps the handle's bytes only: the memory lives as long as this allocation.
    pub fn adopt_gpu_fabric(&self, memory: &GpuMemory, device: Option<&str>) -> Result<GpuRegion> {
        let v = self.protocol_version();
        if v < ObjectKind::CudaFabric(FabricHandleBytes([0; 64])).since() {
            return Err(Error::InvalidArgument(format!("fabric handles need protocol 1.4; fabricd speaks {v}")));
        }
        let device = adoptable(memory, device)?;
        let FabricHandle(bytes) = memory.export_fabric()?;
        self.adopt_object(memory, device, ObjectKind::CudaFabric(FabricHandleBytes(bytes)), None)
    }

    fn adopt_object(
        &self,
        memory: &GpuMemory,
        device: String,
        object: ObjectKind,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<GpuRegion> {
        let req = AdoptRequest {
            target: AllocTarget::Device { device: DeviceName::truncated(&device), memory: MemoryClass::Hbm },
            size: memory.size() as u64,
            object,
        };
        let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
        let (resp, _) = self.inner.client.call(Request::Adopt(req), &fds)?;
        let Response::Adopt(a) = resp else { return Err(Error::Unexpected(Opcode::Adopt)) };
        Ok(GpuRegion {
            session: self.clone(),
            region: a.region,
            generation: a.generation,
            size: a.size,
            gfa: a.gfa,
            device,
            owner: a.grant.map(|g| g.owner),
        })
    }

    /// Imports GPU memory another session adopted, by handle, into `gpu`'s context
    /// (`cuMemImportFromShareableHandle` on the descriptor or fabric handle fabricd passes,
    /// whichever the exporter adopted). Map it with
    /// `import.memory().map(..)`. Always read-write: the driver maps an imported allocation
    /// so, which is why fabricd refuses read-only exports of GPU memory.
    pub fn import_gpu(&self, handle: &Handle, gpu: &CudaContext) -> Result<GpuImport> {
        let access = AccessMode::ReadWrite;
        let (resp, mut fds) =
            self.inner.client.call(Request::ImportObject(ImportRequest { handle: handle.0, access }), &[])?;
        let Response::ImportObject(i) = resp else { return Err(Error::Unexpected(Opcode::ImportObject)) };
        // From here the import exists in the daemon: a failure below releases it.
        let guard = ImportGuard { session: self.clone(), id: i.import };
        let size = usize::try_from(i.size).map_err(|_| Error::InvalidArgument(format!("size {}", i.size)))?;
        let memory = match i.object {
            ObjectKind::CudaPosixFd => {
                let fd = fds.pop().ok_or(Error::Unexpected(Opcode::ImportObject))?;
                gpu.import_fd(fd.as_fd(), size)?
            }
            ObjectKind::CudaFabric(FabricHandleBytes(bytes)) => gpu.import_fabric(&FabricHandle(bytes), size)?,
        };
        let fabric = matches!(i.object, ObjectKind::CudaFabric(_));
        Ok(GpuImport {
            memory,
            import: guard,
            region: i.region,
            generation: i.generation,
            gfa: i.gfa,
            device: i.device.to_string(),
            fabric,
        })
    }
}

/// The device a local allocation is adopted on (`device`, else CUDA's UUID); an imported
/// allocation is refused.
fn adoptable(memory: &GpuMemory, device: Option<&str>) -> Result<String> {
    if memory.is_imported() {
        return Err(Error::InvalidArgument("an imported allocation is its exporter's to hand over".into()));
    }
    Ok(match device {
        Some(d) => d.to_owned(),
        None => memory.context().fabric_device()?,
    })
}
