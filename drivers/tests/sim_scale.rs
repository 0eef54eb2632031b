//! Scale check for the 100,000-GPU cluster: load + `Fabric::build` time and peak memory.
//! Run in release: `cargo test -p fabric-drivers --release --test sim_scale -- --ignored --nocapture`.

use std::path::Path;
use std::time::Instant;

use fabric_drivers::sim;
use fabric_topology::{DeviceKind, Fabric};

/// Peak resident set size of this process in KiB, from /proc (Linux only).
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[test]
#[ignore = "slow in debug builds; run in release to measure"]
#[allow(clippy::print_stderr)]
fn cluster_100k_loads_and_builds_within_budget() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cluster-100k.toml");
    let t0 = Instant::now();
    let inv = sim::load(&path).expect("load");
    let t_load = t0.elapsed();
    let (devices, links) = (inv.devices.len(), inv.links.len());
    let t1 = Instant::now();
    let f = Fabric::build(inv).expect("build");
    let t_build = t1.elapsed();
    let total = t0.elapsed();
    let rss = peak_rss_kib();
    eprintln!(
        "cluster-100k: {devices} devices, {links} links; load {:.0} ms, Fabric::build {:.0} ms, total {:.0} ms; peak RSS {} MiB",
        t_load.as_secs_f64() * 1e3,
        t_build.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3,
        rss.map_or("?".to_owned(), |k| (k / 1024).to_string()),
    );
    assert_eq!(f.devices_of(DeviceKind::Gpu).count(), 100_000);
    if cfg!(debug_assertions) {
        return;
    }
    assert!(total.as_secs_f64() < 2.0, "load + build took {total:?}");
    if let Some(k) = rss {
        assert!(k < 2 * 1024 * 1024, "peak RSS {k} KiB");
    }
}
