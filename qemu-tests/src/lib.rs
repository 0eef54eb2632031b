//! End-to-end tests on real Linux kernels booted under QEMU (tier 3), with emulated CXL
//! memory, an IOMMU with a DMA-capable device, and shared-memory BARs.
//!
//! The scripts in `scripts/` build everything from Debian packages (`qemu-deps.sh`,
//! `qemu-image.sh`); this crate boots one guest per test ([`vm`]), talks QMP to it
//! ([`qmp`]), and compares what the guest reports with what the kernel says ([`cxl`],
//! [`kmem`], [`daxsplit`]).
//! `docs/testing.md` ("Tier 3") describes the result channel, the cache and the logs.

pub mod cpio;
pub mod cxl;
pub mod daxsplit;
pub mod disk;
pub mod env;
pub mod kmem;
pub mod pattern;
pub mod power;
pub mod qmp;
pub mod scripts;
pub mod twohost;
pub mod vm;
