//! The fabric model: devices with stable identity, typed links, memory resources, and the
//! fabric graph with path queries and `nvidia-smi topo`-style hop classes.
//!
//! Discovery backends (`fabric-drivers`) fill an [`Inventory`]; [`Fabric::build`] indexes it
//! into a graph that answers path queries. Nothing in this crate touches the host.

pub mod class;
pub mod cpuset;
pub mod cxl;
pub mod device;
pub mod graph;
pub mod hmem;
pub mod id;
pub mod inventory;
pub mod link;
pub mod path;
pub mod rdma;
pub mod report;

pub use class::HopClass;
pub use cpuset::CpuSet;
pub use device::{
    DOMAIN_NODE_ATTR, DOMAIN_NODE_DOWN, DOMAIN_NODE_LIVE, Device, DeviceKind, FAILED_ATTR, GpuInfo, GpuPartition,
    MemoryKind, MemoryResource, PciInfo, UalinkInfo,
};
pub use graph::Fabric;
pub use hmem::{
    AccessClass, DaxDevice, DaxMode, HmemInventory, MemoryOrigin, MemorySideCache, MemoryTier, NumaMemoryInfo,
};
pub use id::{DeviceId, IdError, PciAddress};
pub use inventory::{BackendReport, BackendState, DeviceIdx, Inventory};
pub use link::{Bandwidth, Link, LinkKind, LinkState};
pub use path::{PathError, Route};
pub use rdma::{GidType, LinkLayer, PhysState, PortState, RdmaDevice, RdmaGid, RdmaPort};
pub use report::error_chain;
