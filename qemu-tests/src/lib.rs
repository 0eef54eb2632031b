//! End-to-end tests on real Linux kernels booted under QEMU, with emulated CXL memory, an
//! IOMMU with a DMA-capable device, and shared-memory BARs.
//!
//! This crate is reserved by the workspace layout and is filled by the qemu-tests issue.
//! It holds no code yet; `docs/testing.md` lists the tiers that run today.
