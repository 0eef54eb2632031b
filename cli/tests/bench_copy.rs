//! `fabricctl bench copy` end to end with tiny sizes: it starts a private fabricd per
//! engine count, and its JSON carries each point's engine figure, the memcpy baseline and
//! their ratio, consistently. Correctness only: timings are recorded by hand in
//! docs/BENCHMARKS.md.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

#[test]
fn copy_bench_reports_engine_and_memcpy_figures_per_size_and_engine_count() {
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricctl"));
    assert!(
        fabricctl.with_file_name("fabricd").exists(),
        "fabricd is not built next to fabricctl: run `cargo build -p fabricd` (the workspace test run builds it)"
    );
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml");
    let out = Command::new(fabricctl)
        .args(["bench", "copy", "--sizes", "65536,1048576", "--engines", "1,2", "--iterations", "2", "--json", "--sim"])
        .arg(&sim)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench copy failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["bench"], "copy");
    assert!(v["endpoints"] == "registration" || v["endpoints"] == "gfa", "{v}");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.iter().map(|r| r["engines"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
    for r in runs {
        let points = r["points"].as_array().unwrap();
        assert_eq!(points.iter().map(|p| p["size"].as_u64().unwrap()).collect::<Vec<_>>(), [65536, 1 << 20]);
        for p in points {
            for key in ["engine_gbps", "gfa_gbps", "memcpy_gbps", "ratio"] {
                let x = p[key].as_f64().unwrap_or_else(|| panic!("{key} missing in {p}"));
                assert!(x > 0.0 && x.is_finite(), "{key} = {x}");
            }
            let ratio = p["engine_gbps"].as_f64().unwrap() / p["memcpy_gbps"].as_f64().unwrap();
            assert!((p["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9);
        }
        // Only the 1 MiB point counts toward the minimum.
        assert_eq!(r["ratio_min"], points[1]["ratio"]);
    }
    let best = v["ratio_min"].as_f64().unwrap();
    assert!(runs.iter().all(|r| r["ratio_min"].as_f64().unwrap() <= best));
    assert_eq!(v["target_met"], best >= 0.9);
    // Nonsense options are refused with a message.
    let out = Command::new(fabricctl).args(["bench", "copy", "--sizes", "0", "--sim"]).arg(&sim).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("out of range"), "{}", String::from_utf8_lossy(&out.stderr));
}
