//! `libfabric-mm`: the library runtimes link to use fabric memory. A [`Session`] talks to
//! fabricd; memory is allocated on a device ([`Session::alloc`]), exported as a
//! [`Handle`], imported by another process ([`Session::import`]) and mapped at its global
//! fabric address inside the session's unified [`Window`] ([`Session::map`]), where
//! loads and stores reach it directly, with no daemon on the path.
//!
//! Memory is registered for DMA by a device ([`Session::register`], [`Session::register_ptr`]):
//! pinned and given an IOVA in the device's DMA domain, through a cache keyed by allocation
//! and generation ([`regcache`]).
//!
//! Every resource is an owned value whose `Drop` undoes it. Revocation (owner exited,
//! export revoked, device lost) marks imports revoked: the next use fails with
//! [`Error::Revoked`], and [`Session::on_revocation`] runs a callback.
//!
//! [`Session::copy`] moves bytes between registrations and GFAs with the daemon's copy
//! engine, asynchronously: a [`Copy`](struct@Copy) to poll, wait on, or get a callback from.
//!
//! Topology queries ([`Session::path`], [`Session::nearest_memory`],
//! [`Session::alloc_nearest`]) rank where memory should go; a session's [`Token`] takes
//! it back after a daemon restart or a dropped connection ([`SessionConfig::resume`]).
//!
//! See docs/libfabric-mm.md for the guide, the guarantees and the limits.
#![warn(missing_docs)]

mod client;
mod coherence;
pub mod copy;
pub mod cuda;
pub mod device;
pub mod error;
pub mod ffi;
pub mod ffi_path;
pub mod hostmem;
pub mod memory;
mod origin;
pub mod path;
pub mod regcache;
pub mod register;
pub mod resume;
pub mod session;
pub mod topology;
pub mod window;

pub use copy::{Copy, CopyEndpoint, CopyOutcome, CopyPart};
pub use error::{Error, Result};
pub use fabric_proto::wire::{MemoryClass, NodeId, Revocation, RevocationReason};
pub use hostmem::HostBuffer;
pub use memory::{Handle, Import, Mapping, Memory, Region};
pub use path::{FabricView, NearMemory, PathInfo};
pub use regcache::{CacheLimits, CacheStats};
pub use register::{Access, Registrable, Registration, RegistrationStats};
pub use resume::Token;
pub use session::{Location, Policy, RemotePlace, ResourceOffset, Session, SessionConfig, Target, default_socket};
pub use topology::DeviceInfo;
pub use window::{Protection, Window, WindowConfig};
