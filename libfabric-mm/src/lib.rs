//! `libfabric-mm`, the userspace library through which runtimes allocate, export, import
//! and map fabric memory and register memory for DMA (Rust API and C ABI).
//!
//! This crate is reserved by the workspace layout and is filled by the libfabric-mm issue,
//! after the daemon it talks to exists. It holds no code yet.
