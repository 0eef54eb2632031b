//! `fabricctl bench control` end to end: it starts a private fabricd and the echo server,
//! runs every measurement, and reports positive latencies, both request rates and zero
//! errors. Correctness only: timings are recorded by hand in docs/BENCHMARKS.md.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

#[test]
fn control_bench_runs_against_a_private_daemon_with_zero_errors() {
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricctl"));
    assert!(
        fabricctl.with_file_name("fabricd").exists(),
        "fabricd is not built next to fabricctl: run `cargo build -p fabricd` (the workspace test run builds it)"
    );
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let out = Command::new(fabricctl)
        .args(["bench", "control", "--iterations", "300", "--clients", "8", "--seconds", "0.3", "--json", "--sim"])
        .arg(&sim)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench control failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "control");
    assert_eq!(v["errors"], 0, "{v}");
    for key in [
        "echo_p50_us",
        "echo_p99_us",
        "noop_p50_us",
        "noop_p99_us",
        "alloc_p50_us",
        "export_p50_us",
        "import_p50_us",
        "import_p99_us",
        "import_after_change_p50_us",
        "rps",
        "echo_rps",
    ] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0, "{key} = {x}");
    }
    assert!(v["noop_p99_us"].as_f64() >= v["noop_p50_us"].as_f64());
    let ratio = v["noop_p50_us"].as_f64().unwrap() / v["echo_p50_us"].as_f64().unwrap();
    assert!((v["noop_ratio"].as_f64().unwrap() - ratio).abs() < 1e-9);
}

/// The isolation mode: every figure present, the loading clients made progress without an
/// error, and the ratio is what its two rates give.
#[test]
fn control_isolation_mode_reports_idle_and_loaded_latency_and_both_allocation_rates() {
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricctl"));
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let out = Command::new(fabricctl)
        .args(["bench", "control", "--mode", "isolation", "--iterations", "100", "--seconds", "0.3", "--json", "--sim"])
        .arg(&sim)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench control --mode isolation failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "control-isolation");
    assert_eq!(v["errors"], 0, "{v}");
    for key in [
        "idle_p50_us",
        "idle_p99_us",
        "idle_max_us",
        "loaded_p50_us",
        "loaded_p99_us",
        "loaded_max_us",
        "partitions_p99_us",
        "status_idle_p99_us",
        "status_loaded_p99_us",
        "allocs_per_s_1",
        "allocs_per_s_16",
    ] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0, "{key} = {x}");
    }
    assert!(v["loaded_allocs"].as_u64().unwrap() > 0 && v["partition_changes"].as_u64().unwrap() > 0, "{v}");
    assert!(v["idle_max_us"].as_f64() >= v["idle_p99_us"].as_f64());
    let ratio = v["allocs_per_s_16"].as_f64().unwrap() / v["allocs_per_s_1"].as_f64().unwrap();
    assert!((v["group_commit_ratio"].as_f64().unwrap() - ratio).abs() < 1e-9);
}

#[test]
fn libcontrol_bench_reports_the_library_figure_its_baseline_and_the_ratio() {
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricctl"));
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let out = Command::new(fabricctl)
        .args(["bench", "libcontrol", "--iterations", "50", "--json", "--sim"])
        .arg(&sim)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench libcontrol failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "libcontrol");
    assert_eq!(v["iterations"], 50);
    for key in ["echo_p50_us", "echo_p99_us", "lib_noop_p50_us", "import_map_p50_us", "import_map_p99_us", "ratio"] {
        let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
        assert!(x > 0.0, "{key} = {x}");
    }
    assert!(v["import_map_p99_us"].as_f64() >= v["import_map_p50_us"].as_f64());
    let ratio = v["import_map_p50_us"].as_f64().unwrap() / v["echo_p50_us"].as_f64().unwrap();
    assert!((v["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9, "{v}");
}
