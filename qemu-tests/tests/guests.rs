//! Tier 3: one QEMU guest per test, booted from the cached Debian kernel and initramfs.
//! Each test fails with the guest's console when a guest check or a comparison fails.

use fabric_qemu_tests::{cxl, env, scripts, vm};

/// Bytes of the region the guest reads and writes through its DAX device (the probe's
/// `0x800000` in guest/cxl.sh).
const DAX_BYTES: u64 = 0x80_0000;

#[test]
fn cxl_region_discovery_and_load_store() {
    let Some(pre) = env::prereqs_or_skip("cxl_region_discovery_and_load_store") else { return };
    let mut spec = vm::VmSpec::new("cxl", scripts::CXL);
    let mem = pre.logs.join("cxl-mem");
    let _ = std::fs::remove_dir_all(&mem);
    cxl::add_topology(&mut spec, &mem).expect("backing files");
    // The first path: the host writes the pattern where the interleave puts it (each
    // target's region share starts at DPA 0: the first decoder allocates from the start).
    cxl::fill_backends(&mem, DAX_BYTES, 0x5eed_0001, [0, 0]).expect("prefill");
    let guest = vm::Guest::start(&pre, &spec).expect("boot");
    let out = guest.finish().expect("guest run");
    for (k, v) in &out.blobs {
        std::fs::write(out.dir.join(format!("{k}.json")), v).expect("keep blob");
    }

    out.expect_check("cxl-region");
    out.expect_check("cxl-list");
    out.expect_check("fabricd-start");
    out.expect_check("fabric-topology");
    out.expect_check("fabric-map");
    let region = out.blob("region-name").trim().to_owned();
    let list: serde_json::Value = serde_json::from_str(out.blob("cxl-list")).unwrap_or_else(|e| out.fail(&format!("cxl list JSON: {e}")));
    let topo: serde_json::Value =
        serde_json::from_str(out.blob("fabric-topology")).unwrap_or_else(|e| out.fail(&format!("topology JSON: {e}")));
    let map: serde_json::Value = serde_json::from_str(out.blob("fabric-map")).unwrap_or_else(|e| out.fail(&format!("map JSON: {e}")));

    let kernel = cxl::kernel_view(&list);
    // The kernel saw what QEMU built: four memdevs with the configured serials and sizes,
    // and the region 2-way at 256 B over serials 0x1000 and 0x1001.
    let serials: Vec<u64> = kernel.memdevs.values().map(|m| m.serial).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    if serials != [0x1000, 0x1001, 0x1002, 0x2000] {
        out.fail(&format!("kernel memdev serials {serials:x?}"));
    }
    let Some(kr) = kernel.regions.get(&region) else { out.fail(&format!("cxl list has no {region}")) };
    if (kr.ways, kr.granularity, kr.size) != (2, 256, 512 << 20) {
        out.fail(&format!("kernel region {kr:?}"));
    }
    let diffs = cxl::compare(&kernel, &topo);
    if !diffs.is_empty() {
        out.fail(&format!("fabricd's discovery differs from `cxl list -vvv`:\n  {}", diffs.join("\n  ")));
    }
    let diffs = cxl::check_map(&kernel, &region, &map);
    if !diffs.is_empty() {
        out.fail(&format!("the address map does not place {region}:\n  {}", diffs.join("\n  ")));
    }

    // Load/store through the region's DAX device, checked against the backing files.
    out.expect_check("dax-device");
    out.expect_check("dax-read");
    out.expect_check("dax-write");
    let base: Vec<u64> = kr.decoders.iter().map(|d| kernel.decoders.get(d).and_then(|x| x.dpa_resource).unwrap_or(u64::MAX)).collect();
    if let Err(e) = cxl::check_backends(&mem, DAX_BYTES, 0x5eed_0002, [base[0], base[1]]) {
        out.fail(&format!("the guest's stores through the DAX device are not in the devices' memory: {e}"));
    }
}
