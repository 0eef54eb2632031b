//! gpu_check's whole CUDA path against a stand-in driver (tests/fake_libcuda/fake_cuda.c,
//! built here with `cc`): presence probe, allocation with the fabric-handle fallback,
//! granularity rounding, POSIX-fd export passed to a second process over SCM_RIGHTS,
//! import, map/set access/unmap, the pattern kernels' parameter layout, copies and event
//! timing, and the importer's stores seen in the exporter's mapping. What this cannot show
//! — that a real driver and GPU behave so — is the GPU check's job (docs/gpu.md).

mod common;
#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

use std::path::{Path, PathBuf};
use std::process::Command;

fn gpu_check() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpu_check"))
}

/// Builds the stand-in as libcuda.so.1 in `dir` (`None`: no C compiler here).
fn fake_driver(dir: &Path) -> Option<PathBuf> {
    fake_libcuda::build(dir)
}

fn run(lib: &Path, args: &[&str], out: &Path) -> (Option<i32>, serde_json::Value) {
    run_env(lib, args, out, &[])
}

fn run_env(lib: &Path, args: &[&str], out: &Path, env: &[(&str, &str)]) -> (Option<i32>, serde_json::Value) {
    let o = Command::new(gpu_check())
        .args(args)
        .arg("--out")
        .arg(out)
        .envs(env.iter().copied())
        .env("LD_LIBRARY_PATH", lib)
        .env_remove("RUST_LOG")
        .output()
        .expect("runs");
    let doc = std::fs::read(out).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    assert!(o.status.code().is_some(), "killed by a signal: {}", String::from_utf8_lossy(&o.stderr));
    (o.status.code(), doc)
}

fn step<'a>(doc: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    doc["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["step"] == name)
        .unwrap_or_else(|| panic!("{name}: {doc}"))
}

#[test]
fn the_memory_check_runs_end_to_end_on_the_stand_in_driver() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let (code, probe) = run(&lib, &["probe"], &dir.path().join("probe.json"));
    assert_eq!(code, Some(0), "{probe}");
    assert_eq!(probe["driver_version"], 12080);
    assert_eq!(probe["devices"][0]["compute_capability"], serde_json::json!([9, 0]));

    let out = dir.path().join("memory.json");
    let (code, doc) = run(&lib, &["memory", "--size-mib", "3", "--iters", "3"], &out);
    assert_eq!(code, Some(0), "{doc:#}");
    assert_eq!(doc["status"], "passed");
    // 3 MiB rounds up to the stand-in's 2 MiB granularity.
    assert_eq!(doc["size"], 4 << 20);
    // The device claims fabric handles; cuMemCreate refuses them; the fallback allocates.
    assert!(
        step(&doc, "cuMemCreate with fabric handles")["unsupported"].as_str().expect("why").contains("NOT_SUPPORTED")
    );
    assert_eq!(step(&doc, "cuMemCreate")["ok"], true);
    assert_eq!(step(&doc, "fill exporter pattern")["detail"], "kernel fill_u32");
    assert_eq!(step(&doc, "verify locally")["detail"]["gpu_mismatched_words"], 0);
    assert!(step(&doc, "dma-buf export (cuMemGetHandleForAddressRange)")["unsupported"].is_string());
    assert_eq!(step(&doc, "peer access")["skipped"], "1 GPU(s): peer access needs two");
    // The importer saw the exporter's pattern, and the exporter sees the importer's.
    let imp = &doc["importer"];
    assert_eq!(imp["status"], "passed", "{imp:#}");
    assert_eq!(step(imp, "verify exporter's pattern through the import")["detail"]["gpu_mismatched_words"], 0);
    assert_eq!(step(&doc, "verify importer's stores in exporter's mapping")["ok"], true);
    let fig = &imp["figures"];
    for k in [
        "baseline cuMemcpyDtoD local->local GB/s",
        "cuMemcpyDtoD imported->local GB/s",
        "stream copy imported->local GB/s (events)",
    ] {
        assert!(fig[k].as_f64().expect(k) > 0.0, "{k}: {fig}");
    }
    assert!(fig["map us (imported)"]["samples"].as_u64().expect("samples") >= 50);
}

#[test]
fn a_content_mismatch_is_caught() {
    // The stand-in with a kernel that writes the wrong pattern: verification must fail.
    let dir = tempfile::tempdir().expect("tempdir");
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_libcuda/fake_cuda.c"))
        .expect("source")
        .replace("buf[i] = pattern(i, seed);", "buf[i] = pattern(i, seed) ^ (i == 7);");
    let bad = dir.path().join("bad.c");
    std::fs::write(&bad, src).expect("write");
    let lib = dir.path().join("libcuda.so.1");
    match Command::new("cc").args(["-shared", "-fPIC", "-o"]).arg(&lib).arg(&bad).status() {
        Ok(s) => assert!(s.success()),
        Err(_) => return,
    }
    std::fs::copy(&lib, dir.path().join("libcuda.so")).expect("copy");
    let (code, doc) = run(dir.path(), &["memory", "--size-mib", "2", "--iters", "1"], &dir.path().join("m.json"));
    assert_eq!(code, Some(1));
    assert_eq!(doc["status"], "failed");
    let v = step(&doc, "verify locally");
    assert_eq!(v["ok"], false);
    assert!(v["error"].as_str().expect("error").contains("\"gpu_mismatched_words\":1"), "{v}");
}

#[test]
fn the_memory_check_goes_through_fabricd() {
    through_fabricd(&[], "Adopt (the allocation becomes a region on the GPU's HBM)", "POSIX descriptor");
}

/// The same with the allocation handed over as a fabric handle (protocol 1.4): the stand-in
/// driver makes fabric handles when told to, and the daemon passes the bytes.
#[test]
fn the_memory_check_shares_a_fabric_handle_through_fabricd() {
    through_fabricd(
        &["--share", "fabric"],
        "Adopt as a fabric handle (the allocation becomes a region on the GPU's HBM)",
        "fabric handle",
    );
}

/// Asked to share by fabric handle where the driver makes none (no IMEX channel): a failed
/// step that says why, not a silent fall back to descriptors.
#[test]
fn a_fabric_share_without_fabric_handles_fails_and_says_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let d = common::daemon();
    let out = dir.path().join("memory.json");
    let socket = d.socket.display().to_string();
    let args = ["memory", "--size-mib", "2", "--iters", "1", "--daemon", &socket, "--share", "fabric"];
    let (code, doc) = run(&lib, &args, &out);
    assert_eq!(code, Some(1), "{doc:#}");
    let s = step(&doc, "fabric handle for fabricd");
    assert_eq!(s["ok"], false, "{s}");
    assert!(s["error"].as_str().expect("error").contains("cuMemCreate"), "{s}");
    assert!(!d.log().contains("vendor object adopted"), "{}", d.log());
}

fn through_fabricd(extra: &[&str], adopt_step: &str, object: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_driver(dir.path()) else { return };
    let d = common::daemon();
    let gpu = common::gpu(&common::session(&d.socket));
    // The stand-in reports the sim GPU's UUID, so the exporter finds its fabric identity
    // through CUDA (`uuid:` + cuDeviceGetUuid), as on a real host.
    let hex = fake_libcuda::uuid_hex(&gpu);
    let out = dir.path().join("memory.json");
    let socket = d.socket.display().to_string();
    let mut args = vec!["memory", "--size-mib", "2", "--iters", "2", "--daemon", &socket];
    args.extend_from_slice(extra);
    let (code, doc) = run_env(&lib, &args, &out, &[("FAKE_CUDA_UUID", &hex), ("FAKE_CUDA_FABRIC", "1")]);
    assert_eq!(code, Some(0), "{doc:#}\n{}", d.log());
    let adopted = &step(&doc, adopt_step)["detail"];
    assert_eq!(adopted["device"], gpu.as_str());
    assert!(adopted["gfa"].is_u64(), "{adopted}");
    let imp = &doc["importer"];
    assert_eq!(imp["status"], "passed", "{imp:#}");
    let got = &step(imp, "ImportObject + cuMemImportFromShareableHandle")["detail"];
    assert_eq!(got["gfa"], adopted["gfa"]);
    assert_eq!(got["device"], gpu.as_str());
    assert_eq!(got["object"], object);
    assert_eq!(step(imp, "verify exporter's pattern through the import")["detail"]["gpu_mismatched_words"], 0);
    assert_eq!(step(&doc, "verify importer's stores in exporter's mapping")["ok"], true);
    // The exporter freed the region once the importer's stores were done: the importer
    // heard of it, and its mapping still read what it had written.
    let seen = step(imp, "revocation seen after the owner freed the region");
    assert_eq!(seen["ok"], true, "{seen}");
    assert!(seen["detail"]["why"].as_str().expect("why").contains("Freed"), "{seen}");
    assert_eq!(step(imp, "the revoked mapping still reads the data (the driver's reference)")["ok"], true);
    let host = &step(&doc, "host<->device copies: registered vs pageable")["detail"];
    for k in ["HtoD registered GB/s", "HtoD pageable GB/s", "DtoH registered GB/s", "DtoH pageable GB/s"] {
        assert!(host[k].as_f64().expect(k) > 0.0, "{k}: {host}");
    }
    let log = d.log();
    assert!(log.contains("vendor object adopted") && log.contains("imported"), "{log}");
}
