//! Tier 3: one QEMU guest per test, booted from the cached Debian kernel and initramfs.
//! Each test fails with the guest's console when a guest check or a comparison fails.

use fabric_qemu_tests::{cxl, env, scripts, vm};

#[test]
fn cxl_region_discovery_and_load_store() {
    let Some(pre) = env::prereqs_or_skip("cxl_region_discovery_and_load_store") else { return };
    let mut spec = vm::VmSpec::new("cxl", scripts::CXL);
    let mem = pre.logs.join("cxl-mem");
    cxl::add_topology(&mut spec, &mem).expect("backing files");
    let guest = vm::Guest::start(&pre, &spec).expect("boot");
    let out = guest.finish().expect("guest run");
    for (k, v) in &out.blobs {
        std::fs::write(out.dir.join(format!("{k}.blob")), v).expect("write");
    }
    out.expect_check("cxl-region");
}
