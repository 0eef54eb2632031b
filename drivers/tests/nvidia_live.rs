//! On a host with the NVIDIA driver loaded: NVML and CUDA agree on the GPUs. Elsewhere the
//! test has nothing to check and passes (the no-driver behaviour is `nvidia_absent.rs`).

use std::path::Path;

use fabric_drivers::Backend;
use fabric_drivers::nvidia::{CudaBackend, NvmlBackend};
use fabric_topology::{BackendState, DeviceKind, Fabric, HopClass, Inventory};

#[test]
fn nvml_and_cuda_describe_the_same_gpus() {
    if !Path::new("/proc/driver/nvidia").exists() {
        return;
    }
    let mut inv = Inventory::new();
    let nvml = NvmlBackend::new("live").discover(&mut inv);
    assert_eq!(nvml.state, BackendState::Present, "{nvml:?}");
    let gpus = inv.count(DeviceKind::Gpu);
    assert!(gpus > 0);
    for d in inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu) {
        assert_eq!(d.id.scheme(), "uuid", "{d:?}");
        assert!(d.pci_address().is_some(), "{d:?}");
        assert!(d.memory_bytes() > 0, "{d:?}");
        assert!(d.gpu.as_ref().and_then(|g| g.fabric_state.as_ref()).is_some(), "{d:?}");
    }
    let cuda = CudaBackend::new("live").discover(&mut inv);
    assert_eq!(cuda.state, BackendState::Present, "{cuda:?}");
    assert_eq!(inv.count(DeviceKind::Gpu), gpus, "CUDA matched NVML's GPUs instead of adding new ones");
    for d in inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu) {
        assert!(d.sources.iter().any(|s| s == "cuda"), "{d:?}");
        assert!(d.gpu.as_ref().and_then(|g| g.compute_capability.as_ref()).is_some(), "{d:?}");
    }
    let fabric = Fabric::build(inv).unwrap();
    let g: Vec<_> = fabric.devices_of(DeviceKind::Gpu).collect();
    assert_eq!(fabric.classify(g[0], g[0]), HopClass::X);
}
