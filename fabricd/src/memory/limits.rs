//! The per-uid limits that the configuration leaves unset, derived from what the daemon
//! serves: a uid may allocate half of the fabric's device memory and pin a quarter of the
//! machine's memory, so that by default no single uid can leave `NoSpace` to everyone else
//! or lock most of the host's memory. Explicit `[limits]` values always win. Also whose
//! allowance a limit counts ([`Holder`]): a local uid's, or an importer node's.

use super::alloc::GRANULE;
use crate::dma::iova::PAGE;

/// One uid may allocate 1/`FABRIC_SHARE` of the fabric memory.
pub const FABRIC_SHARE: u64 = 2;
/// One uid may pin 1/`MACHINE_SHARE` of the machine's memory.
pub const MACHINE_SHARE: u64 = 4;

/// The default `allocated_bytes_per_uid` for a fabric whose memory resources hold
/// `device_bytes` of device memory (HBM, CXL, exported host memory: what is scarce and
/// brokered only here) and `dram_bytes` of host DRAM: half of the device memory, or of the
/// DRAM when there is no device memory, in whole 2 MiB granules and at least one granule.
/// Host DRAM does not count next to device memory: a node's DRAM (terabytes) would let one
/// uid take every GPU's HBM.
pub fn default_allocated(device_bytes: u64, dram_bytes: u64) -> u64 {
    let base = if device_bytes > 0 { device_bytes } else { dram_bytes };
    (base / FABRIC_SHARE / GRANULE * GRANULE).max(GRANULE)
}

/// The default `pinned_bytes_per_uid` on a machine of `mem_total` bytes of memory: a
/// quarter of it in whole pages. Not capped by the daemon's `RLIMIT_MEMLOCK`: a client
/// locks its own memory for `Register { Process }` under its own limit, and the daemon's
/// limit bounds what it pins for all uids together (a pin past it is refused by `mlock`).
pub fn default_pinned(mem_total: u64) -> u64 {
    (mem_total / MACHINE_SHARE / PAGE * PAGE).max(PAGE)
}

/// Whose allowance a limit counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// A uid of this host (a local client, or a client of another node where the domain
    /// shares identities).
    Uid(u32),
    /// An importer node of the domain, for what it imports over the node link
    /// (`limits.imports_per_node`, and the descriptors its imports keep here).
    Node(String),
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Uid(uid) => write!(f, "uid {uid}"),
            Self::Node(node) => write!(f, "node {node}"),
        }
    }
}

/// The machine's memory (`sysinfo`'s total RAM), or `None` when unknown.
pub fn machine_memory() -> Option<u64> {
    // SAFETY: an all-zero sysinfo is a valid value of the plain C struct.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: sysinfo writes one struct into `si`, which lives across the call.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    u64::from(si.mem_unit).checked_mul(si.totalram as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uid_may_allocate_half_the_device_memory_in_granules() {
        // The HGX sim: 8 GPUs of 80 GiB and two sockets of 1 TiB DRAM.
        assert_eq!(default_allocated(640 << 30, 2 << 40), 320 << 30);
        assert_eq!(default_allocated((640 << 30) + 3 * GRANULE, 0), (320 << 30) + GRANULE);
        // Only DRAM: half of it.
        assert_eq!(default_allocated(0, 256 << 30), 128 << 30);
        assert_eq!(default_allocated(0, 0), GRANULE);
        assert_eq!(default_allocated(GRANULE, 0), GRANULE);
    }

    #[test]
    fn a_uid_may_pin_a_quarter_of_the_machine_in_pages() {
        assert_eq!(default_pinned(24 << 30), 6 << 30);
        assert_eq!(default_pinned((1 << 30) + 7), 256 << 20);
        assert_eq!(default_pinned(0), PAGE);
        assert_eq!(default_pinned(u64::MAX) % PAGE, 0);
    }

    #[test]
    fn the_machine_has_memory() {
        assert!(machine_memory().is_some_and(|m| m > 0));
    }
}
