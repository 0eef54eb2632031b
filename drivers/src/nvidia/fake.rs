//! A fake [`NvmlSource`] for unit tests: a described system answers the same calls the
//! real library would, including errors for links a device does not have.

use std::cell::Cell;
use std::collections::HashMap;

use super::api::{FabricInfo, FabricState, NvmlCallError, NvmlPci, NvmlSource, P2pCap, P2pStatus, RemoteType};

/// NVML's version code for NVLink 4.0 (H100).
pub const NVLINK_4: u32 = 6;

#[derive(Debug, Clone)]
pub struct FakeLink {
    pub active: bool,
    pub version: u32,
    pub remote: Result<String, NvmlCallError>,
    pub remote_type: Result<RemoteType, NvmlCallError>,
}

impl FakeLink {
    pub fn to(remote: &str, remote_type: RemoteType) -> Self {
        Self { active: true, version: NVLINK_4, remote: Ok(remote.to_owned()), remote_type: Ok(remote_type) }
    }
}

#[derive(Debug, Clone)]
pub struct FakeGpu {
    pub uuid: String,
    pub name: String,
    pub serial: Result<String, NvmlCallError>,
    pub bus_id: String,
    pub memory: u64,
    pub numa_mask: Vec<u64>,
    pub cpu_mask: Vec<u64>,
    pub fabric: Result<FabricInfo, NvmlCallError>,
    pub links: Vec<FakeLink>,
    /// Fell off the bus: what the driver cached (uuid, name, serial, PCI) still answers,
    /// every query that reaches the GPU is `GpuLost`.
    pub lost: bool,
}

impl FakeGpu {
    pub fn h100(n: usize, bus_id: &str) -> Self {
        let node = u32::from(n >= 4);
        Self {
            uuid: format!("GPU-{n:08x}-0000-0000-0000-000000000000"),
            name: "NVIDIA H100 80GB HBM3".into(),
            serial: Ok(format!("165232000{n}")),
            bus_id: bus_id.into(),
            memory: 81_559_453_696,
            numa_mask: vec![1 << node],
            cpu_mask: vec![if node == 0 { 0xffff_ffff } else { 0xffff_ffff_0000_0000 }],
            fabric: Err(NvmlCallError::NotSupported),
            links: Vec::new(),
            lost: false,
        }
    }
}

#[derive(Debug, Default)]
pub struct FakeNvml {
    pub gpus: Vec<FakeGpu>,
    pub p2p: HashMap<(u32, u32, P2pCap), P2pStatus>,
    /// Panic on the n-th `uuid` call (to test the guard).
    pub panic_on_uuid: Option<u32>,
    pub calls: Cell<u32>,
}

/// GPU bus ids of a DGX H100 (domain printed with 8 digits, as NVML does).
pub const HGX_GPUS: [&str; 8] = [
    "00000000:18:00.0",
    "00000000:2A:00.0",
    "00000000:3A:00.0",
    "00000000:5D:00.0",
    "00000000:9A:00.0",
    "00000000:AB:00.0",
    "00000000:BA:00.0",
    "00000000:DB:00.0",
];

/// NVSwitch bus ids of the same board.
pub const HGX_SWITCHES: [&str; 4] = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"];

/// Links per switch on HGX H100: 18 links split 5/4/4/5.
pub const HGX_SPLIT: [usize; 4] = [5, 4, 4, 5];

impl FakeNvml {
    /// An 8-GPU HGX H100 board: every GPU has 18 NVLink4 links to 4 NVSwitches.
    pub fn hgx_h100() -> Self {
        let mut gpus = Vec::new();
        for (n, bus) in HGX_GPUS.iter().enumerate() {
            let mut g = FakeGpu::h100(n, bus);
            for (sw, count) in HGX_SWITCHES.iter().zip(HGX_SPLIT) {
                g.links.extend(std::iter::repeat_n(FakeLink::to(sw, RemoteType::Switch), count));
            }
            g.fabric = Ok(FabricInfo {
                state: FabricState::Completed,
                status: 0,
                cluster_uuid: [0xab; 16],
                clique_id: 7,
                health: None,
            });
            gpus.push(g);
        }
        let mut p2p = HashMap::new();
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    for cap in P2pCap::ALL {
                        p2p.insert((a, b, cap), P2pStatus::Ok);
                    }
                }
            }
        }
        Self { gpus, p2p, ..Self::default() }
    }

    /// Four GPUs wired as a full mesh without switches, `per_pair` links between each pair.
    pub fn direct_mesh(per_pair: usize) -> Self {
        let mut gpus: Vec<FakeGpu> = (0..4).map(|n| FakeGpu::h100(n, HGX_GPUS[n])).collect();
        for (a, gpu) in gpus.iter_mut().enumerate() {
            for (b, bus) in HGX_GPUS.iter().enumerate().take(4) {
                if a != b {
                    gpu.links.extend(std::iter::repeat_n(FakeLink::to(bus, RemoteType::Gpu), per_pair));
                }
            }
        }
        Self { gpus, ..Self::default() }
    }

    fn gpu(&self, dev: u32) -> Result<&FakeGpu, NvmlCallError> {
        self.gpus.get(dev as usize).ok_or(NvmlCallError::InvalidArgument)
    }

    /// The GPU, for a query that reaches it (not the driver's cache).
    fn live(&self, dev: u32) -> Result<&FakeGpu, NvmlCallError> {
        let g = self.gpu(dev)?;
        if g.lost {
            return Err(NvmlCallError::GpuLost);
        }
        Ok(g)
    }

    fn link(&self, dev: u32, link: u32) -> Result<&FakeLink, NvmlCallError> {
        let g = self.live(dev)?;
        if g.links.is_empty() {
            return Err(NvmlCallError::NotSupported);
        }
        g.links.get(link as usize).ok_or(NvmlCallError::InvalidArgument)
    }
}

impl NvmlSource for FakeNvml {
    fn device_count(&self) -> Result<u32, NvmlCallError> {
        Ok(self.gpus.len() as u32)
    }

    fn uuid(&self, dev: u32) -> Result<String, NvmlCallError> {
        let n = self.calls.get();
        self.calls.set(n + 1);
        if self.panic_on_uuid == Some(n) {
            panic!("fake NVML crashed");
        }
        Ok(self.gpu(dev)?.uuid.clone())
    }

    fn name(&self, dev: u32) -> Result<String, NvmlCallError> {
        Ok(self.gpu(dev)?.name.clone())
    }

    fn serial(&self, dev: u32) -> Result<String, NvmlCallError> {
        self.gpu(dev)?.serial.clone()
    }

    fn pci(&self, dev: u32) -> Result<NvmlPci, NvmlCallError> {
        Ok(NvmlPci { bus_id: self.gpu(dev)?.bus_id.clone(), pci_device_id: 0x2330_10de })
    }

    fn memory_total(&self, dev: u32) -> Result<u64, NvmlCallError> {
        Ok(self.live(dev)?.memory)
    }

    fn memory_numa_node(&self, _dev: u32) -> Result<u32, NvmlCallError> {
        Err(NvmlCallError::NotSupported)
    }

    fn numa_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        Ok(self.gpu(dev)?.numa_mask.clone())
    }

    fn cpu_affinity(&self, dev: u32) -> Result<Vec<u64>, NvmlCallError> {
        Ok(self.gpu(dev)?.cpu_mask.clone())
    }

    fn fabric_info(&self, dev: u32) -> Result<FabricInfo, NvmlCallError> {
        self.live(dev)?.fabric.clone()
    }

    fn nvlink_active(&self, dev: u32, link: u32) -> Result<bool, NvmlCallError> {
        Ok(self.link(dev, link)?.active)
    }

    fn nvlink_version(&self, dev: u32, link: u32) -> Result<u32, NvmlCallError> {
        Ok(self.link(dev, link)?.version)
    }

    fn nvlink_remote_bus_id(&self, dev: u32, link: u32) -> Result<String, NvmlCallError> {
        self.link(dev, link)?.remote.clone()
    }

    fn nvlink_remote_type(&self, dev: u32, link: u32) -> Result<RemoteType, NvmlCallError> {
        self.link(dev, link)?.remote_type.clone()
    }

    fn p2p_status(&self, a: u32, b: u32, cap: P2pCap) -> Result<P2pStatus, NvmlCallError> {
        self.p2p.get(&(a, b, cap)).copied().ok_or(NvmlCallError::NotSupported)
    }
}
