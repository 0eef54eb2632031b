//! Device properties from the CUDA driver API (cudarc, loaded at run time): compute
//! capability and the memory features runtime libraries care about (unified addressing,
//! host-memory mapping, VMM, POSIX-fd and fabric handles), merged into the GPUs NVML or the
//! PCI backend found.

use cudarc::driver::sys as cu;
use cudarc::driver::sys::CUdevice_attribute as A;
use fabric_topology::{
    BackendReport, Device, DeviceId, DeviceIdx, DeviceKind, GpuInfo, Inventory, MemoryKind, MemoryResource, PciAddress,
    PciInfo,
};

use super::model::{add_source, format_uuid};
use super::snapshot::parse_bus_id;
use super::{guarded, sys};
use crate::Backend;

/// Why the CUDA driver could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    /// No loadable `libcuda`.
    #[error("libcuda.so.1 not found")]
    LibraryMissing,
    /// `cuInit` said there is no usable driver or device (`CUDA_ERROR_NO_DEVICE`, the toolkit's
    /// stub library, ...).
    #[error("cuInit: {0:?}")]
    NoDevice(cu::CUresult),
    /// `cuInit` failed otherwise.
    #[error("cuInit: {0:?}")]
    Init(cu::CUresult),
    /// `cuDeviceGetCount` failed.
    #[error("cuDeviceGetCount: {0:?}")]
    DeviceCount(cu::CUresult),
}

/// Boolean device attributes recorded as `cuda.<name>` = `true`/`false`.
const BOOL_ATTRS: &[(&str, A)] = &[
    ("unified_addressing", A::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING),
    ("can_map_host_memory", A::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY),
    ("virtual_memory_management", A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
    ("posix_fd_handles", A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED),
    ("fabric_handles", A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED),
    ("gpu_direct_rdma", A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
    ("multicast", A::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED),
];

/// What the CUDA driver said about one device. `None` = no answer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CudaDeviceRecord {
    /// CUDA ordinal (a handle for this pass only; depends on `CUDA_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// Product name.
    pub name: Option<String>,
    /// `GPU-…` UUID, formatted as NVML does.
    pub uuid: Option<String>,
    /// PCI address.
    pub address: Option<PciAddress>,
    /// Total memory in bytes.
    pub total_mem: Option<u64>,
    /// Compute capability (major, minor).
    pub compute_capability: Option<(i32, i32)>,
    /// Host NUMA node nearest the device.
    pub host_numa_id: Option<u32>,
    /// Boolean features by name (see `BOOL_ATTRS`).
    pub features: Vec<(&'static str, bool)>,
}

/// What one pass over the driver found: devices, and queries that got no answer.
pub type CudaCollected = (Vec<CudaDeviceRecord>, Vec<String>);

/// Device properties from the CUDA driver API.
#[derive(Debug)]
pub struct CudaBackend {
    node: String,
}

impl CudaBackend {
    /// A backend qualifying identities with `node`.
    pub fn new(node: &str) -> Self {
        Self { node: node.to_owned() }
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn discover(&self, inventory: &mut Inventory) -> BackendReport {
        discover_guarded(&self.node, inventory, sys::cuda_library_present, collect)
    }
}

/// The backend's control flow with the presence probe and the collection injectable, so that
/// the guard order (probe first, cudarc after, panics caught) is testable without a driver.
pub(super) fn discover_guarded(
    node: &str,
    inv: &mut Inventory,
    present: fn() -> bool,
    collect: fn() -> Result<CudaCollected, CudaError>,
) -> BackendReport {
    // cudarc panics on first use without libcuda: this check must come before any call.
    if !present() {
        return BackendReport::not_present("cuda", CudaError::LibraryMissing.to_string());
    }
    match guarded(collect) {
        Err(msg) => BackendReport::failed("cuda", format!("CUDA driver API panicked: {msg}")),
        Ok(Err(e @ (CudaError::NoDevice(_) | CudaError::LibraryMissing))) => {
            BackendReport::not_present("cuda", e.to_string())
        }
        Ok(Err(e)) => BackendReport::failed("cuda", e.to_string()),
        Ok(Ok((records, unknown))) => {
            let mut report = BackendReport::present("cuda");
            for line in unknown {
                report.note_unknown(line);
            }
            enrich(&records, node, inv, &mut report);
            report
        }
    }
}

/// Initialises the driver and reads every device. Call only after the library probe.
fn collect() -> Result<CudaCollected, CudaError> {
    use cudarc::driver::result;
    if let Err(e) = result::init() {
        return Err(match e.0 {
            cu::CUresult::CUDA_ERROR_NO_DEVICE | cu::CUresult::CUDA_ERROR_STUB_LIBRARY => CudaError::NoDevice(e.0),
            other => CudaError::Init(other),
        });
    }
    let count = result::device::get_count().map_err(|e| CudaError::DeviceCount(e.0))?;
    let mut unknown = Vec::new();
    let mut records = Vec::new();
    for ordinal in 0..count {
        let mut note = |what: &str, rc: cu::CUresult| unknown.push(format!("cuda device {ordinal} {what}: {rc:?}"));
        let dev = match result::device::get(ordinal) {
            Ok(d) => d,
            Err(e) => {
                note("cuDeviceGet", e.0);
                continue;
            }
        };
        let mut rec = CudaDeviceRecord { ordinal, ..CudaDeviceRecord::default() };
        rec.name = result::device::get_name(dev).map_err(|e| note("name", e.0)).ok();
        rec.uuid = result::device::get_uuid(dev)
            .map(|u| format!("GPU-{}", format_uuid(&u.bytes.map(|b| b as u8))))
            .map_err(|e| note("uuid", e.0))
            .ok();
        rec.address = match sys::cuda_pci_bus_id(dev) {
            Ok(s) => parse_bus_id(&s),
            Err(rc) => {
                note("pci bus id", rc);
                None
            }
        };
        rec.total_mem = sys::cuda_total_mem(dev).map(|m| m as u64).map_err(|rc| note("total mem", rc)).ok();
        let major = sys::cuda_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
        let minor = sys::cuda_attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
        match (major, minor) {
            (Ok(a), Ok(b)) => rec.compute_capability = Some((a, b)),
            (Err(rc), _) | (_, Err(rc)) => note("compute capability", rc),
        }
        rec.host_numa_id =
            sys::cuda_attribute(dev, A::CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID).ok().and_then(|v| u32::try_from(v).ok());
        for &(name, attr) in BOOL_ATTRS {
            match sys::cuda_attribute(dev, attr) {
                Ok(v) => rec.features.push((name, v != 0)),
                Err(rc) => note(name, rc),
            }
        }
        records.push(rec);
    }
    Ok((records, unknown))
}

/// Merges CUDA's view into the inventory: matched by UUID, then by PCI address; a device
/// neither NVML nor the PCI backend found is added.
pub fn enrich(records: &[CudaDeviceRecord], node: &str, inv: &mut Inventory, report: &mut BackendReport) {
    for rec in records {
        let uuid_id = rec.uuid.as_deref().map(DeviceId::uuid);
        let found = uuid_id
            .as_ref()
            .and_then(|id| inv.find(id))
            .or_else(|| rec.address.and_then(|a| inv.find_pci(Some(node), a)));
        let idx: DeviceIdx = match found {
            Some(i) => {
                if let Some(id) = &uuid_id
                    && inv.device(i).id != *id
                    && !inv.rename(i, id.clone())
                {
                    report.note_unknown(format!("cuda device {}: identity {id} already taken", rec.ordinal));
                }
                i
            }
            None => {
                let Some(id) = uuid_id.or_else(|| rec.address.map(|a| DeviceId::pci(node, a))) else {
                    report.note_unknown(format!("cuda device {}: neither UUID nor PCI address; skipped", rec.ordinal));
                    continue;
                };
                let mut d = Device::new(id, DeviceKind::Gpu, Some(node));
                d.pci = rec.address.map(|a| PciInfo { address: Some(a), ..PciInfo::default() });
                match inv.add_device(d) {
                    Ok(i) => i,
                    Err(e) => {
                        report.note_unknown(format!("cuda device {}: {e}", rec.ordinal));
                        continue;
                    }
                }
            }
        };
        fill(inv.device_mut(idx), rec);
        report.devices += 1;
    }
}

fn fill(d: &mut Device, rec: &CudaDeviceRecord) {
    d.kind = DeviceKind::Gpu;
    if d.name.is_none() {
        d.name.clone_from(&rec.name);
    }
    d.numa_node = d.numa_node.or(rec.host_numa_id);
    let gpu = d.gpu.get_or_insert_with(GpuInfo::default);
    if gpu.uuid.is_none() {
        gpu.uuid.clone_from(&rec.uuid);
    }
    if gpu.model.is_none() {
        gpu.model.clone_from(&rec.name);
    }
    if let Some((a, b)) = rec.compute_capability {
        gpu.compute_capability = Some(format!("{a}.{b}"));
    }
    if let Some(size) = rec.total_mem
        && !d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)
    {
        d.memory.push(MemoryResource { kind: MemoryKind::Hbm, size, hpa: None, numa_node: None });
    }
    for &(name, on) in &rec.features {
        d.attrs.insert(format!("cuda.{name}"), on.to_string());
    }
    add_source(d, "cuda");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(uuid: &str, bus: &str) -> CudaDeviceRecord {
        CudaDeviceRecord {
            ordinal: 0,
            name: Some("NVIDIA H100 80GB HBM3".into()),
            uuid: Some(uuid.into()),
            address: parse_bus_id(bus),
            total_mem: Some(80 << 30),
            compute_capability: Some((9, 0)),
            host_numa_id: Some(1),
            features: vec![("virtual_memory_management", true), ("fabric_handles", false)],
        }
    }

    #[test]
    fn missing_library_is_reported_before_any_cudarc_call() {
        let mut inv = Inventory::new();
        let r = discover_guarded("n0", &mut inv, || false, || panic!("cudarc must not be reached"));
        assert_eq!(r.state, fabric_topology::BackendState::NotPresent("libcuda.so.1 not found".into()));
        assert!(inv.devices.is_empty());
    }

    #[test]
    fn a_panicking_driver_call_is_a_failed_report() {
        let mut inv = Inventory::new();
        let r = discover_guarded("n0", &mut inv, || true, || panic!("symbol cuInit missing"));
        match r.state {
            fabric_topology::BackendState::Failed(m) => assert!(m.contains("cuInit missing"), "{m}"),
            s => panic!("unexpected {s:?}"),
        }
        let r =
            discover_guarded("n0", &mut inv, || true, || Err(CudaError::NoDevice(cu::CUresult::CUDA_ERROR_NO_DEVICE)));
        assert!(matches!(r.state, fabric_topology::BackendState::NotPresent(_)));
    }

    #[test]
    fn cuda_enriches_the_gpu_matched_by_pci_address() {
        let mut inv = Inventory::new();
        let addr = parse_bus_id("0000:18:00.0").unwrap();
        let mut pci = Device::new(DeviceId::pci("n0", addr), DeviceKind::Other, Some("n0"));
        pci.pci = Some(PciInfo { address: Some(addr), class: Some(0x030200), ..PciInfo::default() });
        pci.sources.push("pci".into());
        let idx = inv.add_device(pci).unwrap();
        let mut report = BackendReport::present("cuda");
        enrich(&[rec("GPU-1", "0000:18:00.0")], "n0", &mut inv, &mut report);
        assert_eq!(inv.find(&DeviceId::uuid("GPU-1")), Some(idx));
        let d = inv.device(idx);
        assert_eq!(d.kind, DeviceKind::Gpu);
        assert_eq!(d.gpu.as_ref().unwrap().compute_capability.as_deref(), Some("9.0"));
        assert_eq!(d.attrs.get("cuda.virtual_memory_management").map(String::as_str), Some("true"));
        assert_eq!(d.attrs.get("cuda.fabric_handles").map(String::as_str), Some("false"));
        assert_eq!(d.pci.as_ref().unwrap().class, Some(0x030200), "PCI details kept");
        assert_eq!(d.numa_node, Some(1));
        assert_eq!(d.sources, vec!["pci".to_owned(), "cuda".to_owned()]);
        assert_eq!(report.devices, 1);
        // An unknown device is added, not dropped.
        enrich(&[rec("GPU-2", "0000:2a:00.0")], "n0", &mut inv, &mut report);
        assert_eq!(inv.devices.len(), 2);
    }
}
