//! `fabricctl bench register` and `fabricctl bench loadstore` end to end with tiny counts:
//! each starts a private fabricd, measures its figure and its baseline in the same run,
//! and reports them with the ratio between them. Correctness only: timings are recorded
//! by hand in docs/BENCHMARKS.md.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

fn bench(args: &[&str]) -> serde_json::Value {
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricctl"));
    assert!(
        fabricctl.with_file_name("fabricd").exists(),
        "fabricd is not built next to fabricctl: run `cargo build -p fabricd` (the workspace test run builds it)"
    );
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let out = Command::new(fabricctl).arg("bench").args(args).arg("--json").arg("--sim").arg(&sim).output().unwrap();
    assert!(out.status.success(), "bench {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn positive(v: &serde_json::Value, key: &str) -> f64 {
    let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {v}"));
    assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
    x
}

#[test]
fn register_bench_reports_hit_miss_and_mlock_from_one_run() {
    let v = bench(&["register", "--bytes", "1048576", "--iterations", "3", "--hits", "2000"]);
    assert_eq!(v["bench"], "register");
    assert_eq!(v["bytes"], 1 << 20);
    let hit = positive(&v, "hit_ns");
    positive(&v, "hit_wall_ns");
    let base = positive(&v, "hit_baseline_ns");
    assert!((positive(&v, "hit_ratio") - hit / base).abs() < 1e-9);
    let miss = positive(&v, "miss_us_per_mib");
    let mlock = positive(&v, "mlock_us_per_mib");
    assert!((positive(&v, "ratio") - miss / mlock).abs() < 1e-9);
    assert_eq!(v["miss_target_met"], v["ratio"].as_f64().unwrap() <= 1.5);
    assert_eq!(v["hit_target_met"], v["hit_ns"].as_f64().unwrap() <= 100.0);
}

#[test]
fn loadstore_bench_reports_import_and_local_copies_from_one_run() {
    let v = bench(&["loadstore", "--bytes", "1048576", "--iterations", "3"]);
    assert_eq!(v["bench"], "loadstore");
    assert_eq!(v["bytes"], 1 << 20);
    let import = positive(&v, "import_gbps");
    let local = positive(&v, "local_gbps");
    assert!((positive(&v, "ratio") - import / local).abs() < 1e-9);
    assert_eq!(v["target_met"], v["ratio"].as_f64().unwrap() >= 0.95);
}
