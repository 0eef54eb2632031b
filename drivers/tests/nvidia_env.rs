//! `FABRIC_NVML_LIBRARY` overrides the NVML library path. Alone in its test binary, because
//! it changes the process environment.

use fabric_drivers::Backend;
use fabric_drivers::nvidia::NvmlBackend;
use fabric_topology::{BackendState, Inventory};

#[test]
fn the_environment_overrides_the_library_path() {
    let bogus = "/nonexistent/override/libnvidia-ml.so.1";
    // SAFETY: this is the only test in this binary, so no other thread reads or writes the
    // environment while it changes.
    unsafe { std::env::set_var("FABRIC_NVML_LIBRARY", bogus) };
    let backend = NvmlBackend::new("n0");
    assert_eq!(backend.library(), std::path::Path::new(bogus));
    let r = backend.discover(&mut Inventory::new());
    assert!(matches!(&r.state, BackendState::NotPresent(m) if m.starts_with(bogus)), "{:?}", r.state);
    // SAFETY: as above.
    unsafe { std::env::remove_var("FABRIC_NVML_LIBRARY") };
    assert_eq!(NvmlBackend::new("n0").library(), std::path::Path::new("libnvidia-ml.so.1"));
}
