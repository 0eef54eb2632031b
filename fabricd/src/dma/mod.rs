//! DMA registrations: memory pinned and given an IOVA in the DMA domain of the device that
//! will move it, and the lookup from `(domain, iova, len)` back to that memory that a copy
//! engine uses.
//!
//! A domain is what shares one IOMMU translation: the device's IOMMU group when sysfs
//! names one, else the device alone (sim devices). Each domain has its own
//! [`iova::IovaAllocator`]; every range handed to a device lies below its DMA mask.
//!
//! Two kinds of backing:
//! - memory the daemon maps — a region, an import, a memory object passed with the
//!   request — is mapped shared and `mlock`ed here ([`sys::Pinned`]); copies use the
//!   descriptor (`pread`/`pwrite`), never the mapping, so a client that shrinks the file
//!   cannot fault the daemon;
//! - the client's own virtual memory, which the client locks (`mlock`) and the daemon
//!   checks (`VmFlags: lo` in `/proc/<pid>/smaps`) and reaches with `process_vm_readv`/
//!   `process_vm_writev`, following the process by the pidfd its connection was accepted
//!   with ([`crate::transport::peer::Process::with`]), so that a reused pid is never read or written.
//!
//! The registry has no lock of its own: it lives in the memory registry's state
//! ([`crate::memory`]), so that freeing a region or releasing an import detaches the
//! registrations over it in the same critical section — a registration never outlives
//! its memory. Mapping and unmapping run outside that lock; an IOVA range is taken
//! before its mapping is made and freed only after its unmap has returned
//! ([`Registry::detach`]), so no two mappings of a domain ever share an IOVA.
//!
//! # Safety of DMA
//! While memory is registered a device (or the copy engine acting for it) may write it at
//! any time; the owner must not hold Rust references to registered bytes across a copy.
//! The daemon itself never forms references to registered memory.

mod client;
pub mod iova;
pub mod sys;
pub mod vfio;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;

use fabric_proto::wire::AccessMode;
use fabric_topology::{Device, DeviceId, DeviceKind};

pub use client::{ClientAccess, ClientGate, Unreached};
use iova::{IovaAllocator, IovaError, PAGE};
use sys::Pinned;

/// The mask a device gets when it names none: it addresses 64 bits.
pub const DEFAULT_DMA_MASK_BITS: u8 = 64;

/// Why a copy to or from registered memory failed.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// No registration of the domain covers the whole range.
    #[error("no registration in domain {domain} covers IOVA {iova:#x}+{len}")]
    NotRegistered {
        /// The domain.
        domain: String,
        /// First IOVA.
        iova: u64,
        /// Bytes.
        len: u64,
    },
    /// The registration lets the device read only.
    #[error("registration {0} is read-only for the device")]
    ReadOnly(u64),
    /// The process whose memory is registered has exited.
    #[error("the process of registration {0} has exited")]
    ProcessGone(u64),
    /// The registration of a client's memory was undone while the copy was under way.
    #[error("registration {0} was unregistered")]
    Unregistered(u64),
    /// The copy itself failed.
    #[error("copy through registration {registration}")]
    Io {
        /// The registration.
        registration: u64,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where a device's DMA goes: its domain and mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The device.
    pub device: DeviceId,
    /// The DMA domain (`NODE/iommu_group:N`, or the device id).
    pub domain: String,
    /// The device's DMA mask in bits.
    pub mask_bits: u8,
    /// The device when the daemon holds it through VFIO: registrations are mapped in its
    /// container ([`vfio`]).
    pub vfio: Option<std::sync::Arc<vfio::VfioDevice>>,
}

/// Whether `dev` can be a DMA target at all (CPUs, bridges and switches move no data).
pub fn can_dma(dev: &Device) -> bool {
    !matches!(
        dev.kind,
        DeviceKind::Cpu
            | DeviceKind::HostBridge
            | DeviceKind::PciBridge
            | DeviceKind::CxlSwitch
            | DeviceKind::UalinkSwitch
            | DeviceKind::NetworkSwitch
    )
}

/// The DMA target of `dev`: its IOMMU group's domain when known, its mask from
/// `dma_mask_bits` (sysfs or the sim file; a `dma_mask_bits` attribute is honoured too),
/// else [`DEFAULT_DMA_MASK_BITS`].
pub fn target_of(dev: &Device) -> Target {
    let domain = match (dev.pci.as_ref().and_then(|p| p.iommu_group), &dev.node) {
        (Some(g), Some(node)) => format!("{node}/iommu_group:{g}"),
        (Some(g), None) => format!("iommu_group:{g}"),
        (None, _) => dev.id.to_string(),
    };
    let mask_bits = dev
        .dma_mask_bits
        .or_else(|| dev.attrs.get("dma_mask_bits").and_then(|v| v.trim().parse().ok()))
        .unwrap_or(DEFAULT_DMA_MASK_BITS);
    Target { device: dev.id.clone(), domain, mask_bits, vfio: None }
}

/// What a registration's memory is.
#[derive(Debug, Clone)]
pub enum Backing {
    /// Mapped and locked by the daemon; shared with copies in flight
    /// ([`crate::copy`]), so that the mapping outlives a copy's chunk in flight even
    /// when the registration goes.
    Mapped(std::sync::Arc<Pinned>),
    /// The client's own memory, locked by the client.
    Process {
        /// The process that connected, followed by the pidfd taken at accept: copies
        /// stop once it exits, and never reach a process that got its pid since.
        process: crate::transport::peer::Process,
        /// First byte of the first page.
        addr: u64,
        /// Held around every access to that memory; closed when the registration is
        /// undone ([`ClientGate`]).
        gate: std::sync::Arc<ClientGate>,
    },
}

/// Which object's life bounds a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Covers {
    /// A region.
    Region(u64),
    /// An import.
    Import(u64),
    /// A memory object passed with the request (lives as long as the registration).
    Fd,
    /// The client's own memory (lives as long as the session).
    Process,
}

/// One registration.
#[derive(Debug)]
pub struct Registration {
    /// The device it was made for.
    pub device: DeviceId,
    /// Its DMA domain.
    pub domain: String,
    /// First IOVA of the page-aligned range.
    pub iova: u64,
    /// Bytes of that range (whole pages): what is pinned and accounted.
    pub span: u64,
    /// Offset of the first registered byte in the range.
    pub lead: u64,
    /// Bytes registered.
    pub len: u64,
    /// What the device may do.
    pub access: AccessMode,
    /// Who holds it.
    pub uid: u32,
    /// The session that made it.
    pub session: u64,
    /// What bounds its life.
    pub covers: Covers,
    /// The fabric region whose memory it maps (the session's own, or an import's), if any.
    pub region: Option<u64>,
    /// Its IOMMU mapping, for a VFIO device. Declared before `backing`: dropped first, so
    /// the range is unmapped before the memory is unpinned.
    pub vfio: Option<vfio::DmaMapping>,
    /// The memory.
    pub backing: Backing,
}

impl Registration {
    /// Undoes it: a client's memory's gate shut ([`ClientGate::shut`]; the operation
    /// drains it last), unmapped from the IOMMU (a VFIO device's), then unpinned. Runs off
    /// the registry lock. Whether its IOVA range may be handed out again: false when the unmap failed, and the device
    /// may still reach the pages there.
    pub fn undo(mut self) -> bool {
        // A client's memory: no access begins after (those in flight are drained by the
        // operation, last: `Memory::deliver`).
        if let Backing::Process { gate, .. } = &self.backing {
            gate.shut();
        }
        let unmapped = self.vfio.take().is_none_or(vfio::DmaMapping::unmap);
        drop(self);
        unmapped
    }

    /// The fabric region an IOMMU mapping of it reaches, if it has one: what must wait
    /// for its unmap before the region's range is handed out again.
    pub fn iommu_region(&self) -> Option<u64> {
        self.region.filter(|_| self.vfio.is_some())
    }

    /// The gate of a client's memory it registers ([`ClientGate`]), if it does.
    pub fn client_gate(&self) -> Option<std::sync::Arc<ClientGate>> {
        match &self.backing {
            Backing::Process { gate, .. } => Some(gate.clone()),
            Backing::Mapped(_) => None,
        }
    }

    /// What a copy through it needs, taken under the registry lock and used without it:
    /// its memory stays reachable (mapped, or its process followed) as long as the result.
    pub fn reach(&self) -> Reach {
        Reach { backing: self.backing.clone(), access: self.access }
    }
}

/// A registration's memory and access, for reading and writing it outside the registry
/// lock ([`Registration::reach`]).
#[derive(Debug, Clone)]
pub struct Reach {
    backing: Backing,
    access: AccessMode,
}

impl Reach {
    /// Reads `buf.len()` bytes at byte `at` of the page-aligned range.
    pub fn read(&self, id: u64, at: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let io = |source| DmaError::Io { registration: id, source };
        match &self.backing {
            Backing::Mapped(p) => p.file().read_exact_at(buf, p.offset() + at).map_err(io),
            Backing::Process { process, addr, gate } => gate
                .reach(process, |pid| sys::read_process(pid, addr + at, buf))
                .map_err(|u| unreached(u, id))?
                .map_err(io),
        }
    }

    /// Writes `buf` at byte `at` of the page-aligned range (read-write registrations).
    pub fn write(&self, id: u64, at: u64, buf: &[u8]) -> Result<(), DmaError> {
        if self.access != AccessMode::ReadWrite {
            return Err(DmaError::ReadOnly(id));
        }
        let io = |source| DmaError::Io { registration: id, source };
        match &self.backing {
            Backing::Mapped(p) => p.file().write_all_at(buf, p.offset() + at).map_err(io),
            Backing::Process { process, addr, gate } => gate
                .reach(process, |pid| sys::write_process(pid, addr + at, buf))
                .map_err(|u| unreached(u, id))?
                .map_err(io),
        }
    }
}

/// The error of a copy through registration `id` whose client memory was not reached.
fn unreached(u: Unreached, id: u64) -> DmaError {
    match u {
        Unreached::Unregistered => DmaError::Unregistered(id),
        Unreached::ProcessGone => DmaError::ProcessGone(id),
    }
}

/// Every registration and the IOVA space of every domain.
#[derive(Debug, Default)]
pub struct Registry {
    domains: HashMap<String, IovaAllocator>,
    regs: HashMap<u64, Registration>,
}

/// The page-aligned range around `len` bytes at `at`: `(first page, lead, span)`.
pub fn span_of(at: u64, len: u64) -> Option<(u64, u64, u64)> {
    if len == 0 {
        return None;
    }
    let lead = at % PAGE;
    let span = iova::page_len(lead.checked_add(len)?)?;
    at.checked_add(len)?;
    Some((at - lead, lead, span))
}

impl Registry {
    /// Takes `span` bytes of IOVA space in `t`'s domain below its mask.
    pub fn alloc_iova(&mut self, t: &Target, span: u64) -> Result<u64, IovaError> {
        self.domains.entry(t.domain.clone()).or_default().alloc(span, t.mask_bits)
    }

    /// Gives back an IOVA range of `domain` that no registration holds: one whose
    /// registration failed, or one whose detached registration is unmapped.
    pub fn free_iova(&mut self, domain: &str, iova: u64) {
        if let Some(d) = self.domains.get_mut(domain) {
            d.free(iova);
        }
    }

    /// Records a registration whose IOVA came from [`Registry::alloc_iova`].
    pub fn insert(&mut self, id: u64, r: Registration) {
        self.regs.insert(id, r);
    }

    /// The registration `id`.
    pub fn get(&self, id: u64) -> Option<&Registration> {
        self.regs.get(&id)
    }

    /// Removes a registration: no copy resolves it any more, but its IOVA range stays
    /// taken. Dropping the result unmaps and unpins it (slow: done without the lock);
    /// only then may the range be freed ([`Registry::free_iova`]).
    pub fn detach(&mut self, id: u64) -> Option<Registration> {
        self.regs.remove(&id)
    }

    /// Ids of the registrations that match.
    pub fn ids_where(&self, pred: impl Fn(&Registration) -> bool) -> Vec<u64> {
        self.regs.iter().filter(|(_, r)| pred(r)).map(|(k, _)| *k).collect()
    }

    /// Live registrations.
    pub fn count(&self) -> u64 {
        self.regs.len() as u64
    }

    /// Bytes pinned by all registrations.
    pub fn pinned_bytes(&self) -> u64 {
        self.regs.values().map(|r| r.span).sum()
    }

    /// The registration of `domain` holding `[iova, iova + len)` whole, with the offset of
    /// `iova` in its page-aligned range.
    pub fn resolve(&self, domain: &str, iova: u64, len: u64) -> Result<(u64, &Registration, u64), DmaError> {
        let missing = || DmaError::NotRegistered { domain: domain.to_owned(), iova, len };
        let end = iova.checked_add(len).ok_or_else(missing)?;
        self.regs
            .iter()
            .find(|(_, r)| r.domain == domain && r.iova <= iova && end <= r.iova + r.span)
            .map(|(id, r)| (*id, r, iova - r.iova))
            .ok_or_else(missing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_whole_pages() {
        assert_eq!(span_of(0, 1), Some((0, 0, PAGE)));
        assert_eq!(span_of(PAGE - 1, 2), Some((0, PAGE - 1, 2 * PAGE)));
        assert_eq!(span_of(3 * PAGE, 2 * PAGE), Some((3 * PAGE, 0, 2 * PAGE)));
        assert_eq!(span_of(5, 0), None);
        assert_eq!(span_of(u64::MAX - 2, 8), None);
    }

    #[test]
    fn domains_follow_iommu_groups_and_masks_default_to_64() {
        let mut d = Device::new(DeviceId::named("n0", "gpu0"), DeviceKind::Gpu, Some("n0"));
        assert_eq!(target_of(&d).domain, d.id.to_string());
        assert_eq!(target_of(&d).mask_bits, 64);
        d.attrs.insert("dma_mask_bits".into(), "40".into());
        assert_eq!(target_of(&d).mask_bits, 40);
        d.dma_mask_bits = Some(32);
        d.pci = Some(fabric_topology::PciInfo { iommu_group: Some(7), ..Default::default() });
        assert_eq!(
            target_of(&d),
            Target { device: d.id.clone(), domain: "n0/iommu_group:7".into(), mask_bits: 32, vfio: None }
        );
        assert!(can_dma(&d));
        assert!(!can_dma(&Device::new(DeviceId::named("n0", "numa0"), DeviceKind::Cpu, Some("n0"))));
    }
}
