//! The NVIDIA backends on hosts without the NVIDIA stack (CI, laptops) and with broken
//! libraries: they report "not present" or "failed" with a reason, and never panic.

use std::io::Write;
use std::path::Path;

use fabric_drivers::Backend;
use fabric_drivers::nvidia::{CudaBackend, NvmlBackend};
use fabric_topology::{BackendState, Inventory};

/// Whether the NVIDIA kernel driver is loaded here (then the libraries may legitimately work).
fn nvidia_driver_loaded() -> bool {
    Path::new("/proc/driver/nvidia").exists()
}

fn reason(state: &BackendState) -> &str {
    match state {
        BackendState::NotPresent(r) | BackendState::Failed(r) => r,
        BackendState::Present => "",
    }
}

#[test]
fn without_a_driver_both_backends_are_absent_with_a_reason() {
    if nvidia_driver_loaded() {
        eprintln!("NVIDIA driver loaded: skipping the no-driver expectations");
        return;
    }
    let mut inv = Inventory::new();
    let nvml = NvmlBackend::with_library("n0", "libnvidia-ml.so.1").discover(&mut inv);
    assert_eq!(nvml.backend, "nvml");
    assert!(matches!(nvml.state, BackendState::NotPresent(_)), "{:?}", nvml.state);
    assert!(reason(&nvml.state).contains("libnvidia-ml.so.1") || reason(&nvml.state).contains("driver not loaded"));

    let cuda = CudaBackend::new("n0").discover(&mut inv);
    assert_eq!(cuda.backend, "cuda");
    assert_ne!(cuda.state, BackendState::Present);
    assert!(!reason(&cuda.state).is_empty());
    assert!(inv.devices.is_empty() && inv.links.is_empty());
}

#[test]
fn a_missing_library_path_is_not_present_and_names_the_path() {
    let mut inv = Inventory::new();
    let r = NvmlBackend::with_library("n0", "/nonexistent/dir/libnvidia-ml.so.1").discover(&mut inv);
    match &r.state {
        BackendState::NotPresent(m) => {
            assert!(m.starts_with("/nonexistent/dir/libnvidia-ml.so.1 not found: "), "{m}");
        }
        s => panic!("unexpected {s:?}"),
    }
    assert_eq!(r.devices, 0);
}

#[test]
fn a_file_that_is_not_a_shared_object_is_rejected_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("libnvidia-ml.so.1");
    std::fs::File::create(&path).unwrap().write_all(b"this is not an ELF file\n").unwrap();
    let mut inv = Inventory::new();
    let r = NvmlBackend::with_library("n0", &path).discover(&mut inv);
    assert!(matches!(r.state, BackendState::NotPresent(_) | BackendState::Failed(_)), "{:?}", r.state);
    assert!(reason(&r.state).contains(path.to_str().unwrap()), "{:?}", r.state);
    assert!(inv.devices.is_empty());
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_shared_object_without_nvml_symbols_is_not_nvml() {
    let mut inv = Inventory::new();
    let r = NvmlBackend::with_library("n0", "libc.so.6").discover(&mut inv);
    match &r.state {
        BackendState::NotPresent(m) => assert!(m.contains("is not an NVML library"), "{m}"),
        s => panic!("unexpected {s:?}"),
    }
}

#[test]
fn host_discovery_includes_both_reports() {
    let dir = tempfile::tempdir().unwrap();
    let inv = fabric_drivers::discover_host(&fabric_drivers::SysfsRoot::new(dir.path(), "n0"));
    for name in ["nvml", "cuda"] {
        let r = inv.backends.iter().find(|r| r.backend == name).expect("report");
        if r.state != BackendState::Present {
            assert!(!reason(&r.state).is_empty());
        }
    }
}
