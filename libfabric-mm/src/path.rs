//! Topology queries between devices: the path (hop class, bottleneck bandwidth, route,
//! latency), memory ranked by nearness to a device, and allocation on the nearest memory.
//!
//! The daemon's `Inventory` (the devices and links this session may see: its partitions'
//! for a bound client) is built into a [`fabric_topology::Fabric`] here, and the queries are
//! the same widest-path search `fabricctl topology` uses. A [`FabricView`] is one
//! snapshot: query it many times without round trips; the `Session` shortcuts fetch a
//! fresh one per call.

use fabric_proto::wire::{MemoryClass, Opcode, Request, Response, TopologyRequest};
use fabric_topology::{DeviceId, DeviceIdx, Fabric, Inventory};

use crate::error::{Error, Result};
use crate::memory::Region;
use crate::session::{Session, Target};

/// The path between two devices.
#[derive(Debug, Clone, PartialEq)]
pub struct PathInfo {
    /// The hop class, as `nvidia-smi topo -m` writes it: `X` (the device itself), `NV#`
    /// (NVLink, # links), `PIX`, `PXB`, `PHB`, `NODE`, `SYS`, `CXL`, `UAL#`, `NET`, …
    pub class: String,
    /// Bottleneck bandwidth now, per direction, MB/s (over links whose bandwidth is known).
    pub bandwidth_mbps: Option<u64>,
    /// Bottleneck bandwidth the route is built for (below `bandwidth_mbps` when degraded).
    pub max_bandwidth_mbps: Option<u64>,
    /// Sum of the known link latencies, ns.
    pub latency_ns: Option<u64>,
    /// The devices on the route, from source to destination inclusive.
    pub route: Vec<String>,
    /// Links on the route running below their capability.
    pub degraded_links: usize,
}

/// A memory resource and how far it is from the device asked about.
#[derive(Debug, Clone, PartialEq)]
pub struct NearMemory {
    /// The device that holds it.
    pub device: String,
    /// Its class.
    pub memory: MemoryClass,
    /// Its size, bytes.
    pub size: u64,
    /// The path from the device asked about to it.
    pub path: PathInfo,
}

/// One snapshot of the fabric this session sees.
#[derive(Debug)]
pub struct FabricView {
    fabric: Fabric,
}

fn unknown(device: &str) -> Error {
    Error::InvalidArgument(format!("no device {device:?} in the fabric this session sees"))
}

impl FabricView {
    /// Builds a view from a `fabric.inventory/v1` document.
    pub fn from_inventory_json(json: &str) -> Result<Self> {
        let inv: Inventory = serde_json::from_str(json)
            .map_err(|e| Error::InvalidArgument(format!("inventory document does not parse: {e}")))?;
        let fabric = Fabric::build(inv)
            .map_err(|e| Error::InvalidArgument(format!("inventory document is inconsistent: {e}")))?;
        Ok(Self { fabric })
    }

    /// The underlying graph (every query `fabric-topology` offers).
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    fn index(&self, device: &str) -> Result<DeviceIdx> {
        let id: DeviceId = device.parse().map_err(|_| unknown(device))?;
        self.fabric.inventory().find(&id).ok_or_else(|| unknown(device))
    }

    fn name(&self, idx: DeviceIdx) -> String {
        self.fabric.device(idx).id.to_string()
    }

    /// The widest path from `a` to `b` (device identities in text form).
    pub fn path(&self, a: &str, b: &str) -> Result<PathInfo> {
        let (ia, ib) = (self.index(a)?, self.index(b)?);
        let r = self.fabric.route(ia, ib).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(PathInfo {
            class: r.class.to_string(),
            bandwidth_mbps: r.bandwidth_mbps,
            max_bandwidth_mbps: r.max_bandwidth_mbps,
            latency_ns: r.latency_ns,
            route: r.hops.iter().map(|h| self.name(*h)).collect(),
            degraded_links: r.degraded_links.len(),
        })
    }

    /// Every memory resource reachable from `device` (of class `only`, when given), nearest
    /// first: the device's own memory, then by bottleneck bandwidth (highest first), then
    /// latency and hops (fewest first). Unreachable memory is left out.
    pub fn nearest_memory(&self, device: &str, only: Option<MemoryClass>) -> Result<Vec<NearMemory>> {
        let from = self.index(device)?;
        let mut out = Vec::new();
        for (i, d) in self.fabric.inventory().devices.iter().enumerate() {
            let held: Vec<_> = d
                .memory
                .iter()
                .map(|m| (MemoryClass::from(m.kind), m.size))
                .filter(|(c, _)| only.is_none_or(|o| o == *c))
                .collect();
            if held.is_empty() {
                continue;
            }
            let Ok(idx) = u32::try_from(i).map(DeviceIdx) else { continue };
            let Ok(path) = self.path(device, &d.id.to_string()) else { continue };
            for (memory, size) in held {
                out.push((idx == from, NearMemory { device: d.id.to_string(), memory, size, path: path.clone() }));
            }
        }
        out.sort_by(|(own_a, a), (own_b, b)| {
            own_b
                .cmp(own_a)
                .then(b.path.bandwidth_mbps.unwrap_or(0).cmp(&a.path.bandwidth_mbps.unwrap_or(0)))
                .then(a.path.latency_ns.unwrap_or(u64::MAX).cmp(&b.path.latency_ns.unwrap_or(u64::MAX)))
                .then(a.path.route.len().cmp(&b.path.route.len()))
        });
        Ok(out.into_iter().map(|(_, m)| m).collect())
    }
}

impl Session {
    /// A snapshot of the fabric this session sees (one round trip).
    pub fn fabric_view(&self) -> Result<FabricView> {
        match self.call(Request::Inventory(TopologyRequest { node: None }))? {
            Response::Inventory(doc) => FabricView::from_inventory_json(&doc.json),
            _ => Err(Error::Unexpected(Opcode::Inventory)),
        }
    }

    /// The path between two devices: [`FabricView::path`] on a fresh snapshot.
    pub fn path(&self, a: &str, b: &str) -> Result<PathInfo> {
        self.fabric_view()?.path(a, b)
    }

    /// Memory ranked by nearness to `device`: [`FabricView::nearest_memory`] on a fresh
    /// snapshot.
    pub fn nearest_memory(&self, device: &str, only: Option<MemoryClass>) -> Result<Vec<NearMemory>> {
        self.fabric_view()?.nearest_memory(device, only)
    }

    /// Allocates `size` bytes on the memory nearest to `device` that has room: each
    /// candidate of [`Session::nearest_memory`] in turn, until the daemon grants one. The
    /// error is the last refusal (or `InvalidArgument` when no memory is reachable).
    pub fn alloc_nearest(&self, device: &str, size: u64) -> Result<Region> {
        let mut last = None;
        for m in self.nearest_memory(device, None)? {
            match self.alloc(&Target::Device { device: m.device, memory: m.memory }, size) {
                Ok(r) => return Ok(r),
                Err(e @ (Error::Disconnected | Error::Connect { .. })) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::InvalidArgument(format!("no memory is reachable from {device:?}"))))
    }
}
