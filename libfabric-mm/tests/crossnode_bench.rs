//! `fabricctl bench crossnode --net-importer` end to end, with tiny sizes, against three
//! fabricd nodes of one domain (a private etcd, node link certificates from a test CA):
//! tray0 owns, tray1 shares the sim's fabric with it, tray2 does not (class NET). Its JSON
//! carries every figure the cross-node issue names — `remote_import_p50_us`,
//! `local_import_p50_us`, `remote_loadstore_ratio`, `netcopy_ratio`, `revoke_p50_us`,
//! `revoke_max_us` — each finite and consistent with the others. Correctness only: timings
//! are recorded by hand in docs/BENCHMARKS.md. Without an `etcd` binary it says it is
//! skipped.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::domain;
use serde_json::Value;

/// `v[key]` as a positive, finite number.
fn figure(v: &Value, key: &str) -> f64 {
    let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
    assert!(x > 0.0 && x.is_finite(), "{key} = {x} in {v}");
    x
}

#[test]
fn the_crossnode_bench_reports_every_figure_against_a_shared_and_a_net_importer() {
    let Some(lab) = domain::Lab::start() else { return };
    let fabricctl = common::fabricd_bin().with_file_name("fabricctl");
    assert!(fabricctl.exists(), "fabricctl is not built next to fabricd: cargo build --workspace --bins");
    let shared = lab.dir.path().join("sim");
    let supernode = domain::sim("supernode-64.toml");
    let owner = lab.node(&supernode, Some(&shared), "tray0");
    let near = lab.node(&supernode, Some(&shared), "tray1");
    let far = lab.node(&supernode, None, "tray2");
    domain::wait_live(&[&owner, &near, &far]);

    let out = Command::new(&fabricctl)
        .args(["bench", "crossnode", "--owner"])
        .arg(&owner.socket)
        .arg("--importer")
        .arg(&near.socket)
        .arg("--net-importer")
        .arg(&far.socket)
        .args(["--iterations", "20", "--net-bytes", "4194304", "--json"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench crossnode failed: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["bench"].as_str(), v["iterations"].as_u64()), (Some("crossnode"), Some(20)), "{v}");
    let (remote, local) = (figure(&v, "remote_import_p50_us"), figure(&v, "local_import_p50_us"));
    let ratio = figure(&v, "import_ratio");
    assert!((ratio - remote / local).abs() <= 1e-9 * ratio, "import_ratio {ratio} is not {remote} / {local}");
    // The bare TLS round trip in the same run, and the ratio it alone would give.
    let (tls, floor) = (figure(&v, "tls_round_trip_p50_us"), figure(&v, "import_floor_ratio"));
    assert!(
        (floor - (local + tls) / local).abs() <= 1e-9 * floor,
        "import_floor_ratio {floor} is not ({local} + {tls}) / {local}"
    );
    figure(&v, "remote_loadstore_ratio");
    let (p50, max) = (figure(&v, "revoke_p50_us"), figure(&v, "revoke_max_us"));
    assert!(p50 <= max, "revoke p50 {p50} above its max {max}");
    // The network copy ran against tray2, off the shared fabric: a copy-only grant, and
    // its ratio is the nested document's.
    let net = &v["netcopy"];
    assert_eq!((net["grant"].as_str(), net["bytes"].as_u64()), (Some("CopyOnly"), Some(4 << 20)), "{v}");
    assert_eq!(figure(&v, "netcopy_ratio"), figure(net, "netcopy_ratio"));
    for key in ["push_gbps", "pull_gbps", "tcp_gbps", "tls_gbps"] {
        figure(net, key);
    }

    // Without a NET node the figures of the shared pair stand alone.
    let out = Command::new(&fabricctl)
        .args(["bench", "crossnode", "--owner"])
        .arg(&owner.socket)
        .arg("--importer")
        .arg(&near.socket)
        .args(["--iterations", "5", "--json"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v.get("netcopy").is_none() && v.get("netcopy_ratio").is_none(), "{v}");
    figure(&v, "remote_import_p50_us");
}
