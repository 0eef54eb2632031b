//! scripts/gpu-check.sh on a machine without a GPU: it must finish quickly, write every
//! step's result and a summary, and exit 3 with the reasons ("CUDA not present: …",
//! "NVML not present: …"); with nvidia-smi answering (a stand-in printing the hand-written
//! fixtures) the comparison runs and its differences fail the check with exit 1.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_owned()
}

/// target/debug, where the workspace build puts fabricctl and the gpu_check example.
fn bins(dir: &Path) -> PathBuf {
    let debug = std::env::current_exe().expect("exe").parent().and_then(Path::parent).expect("target dir").to_owned();
    let out = dir.join("bin");
    std::fs::create_dir_all(&out).expect("bin dir");
    let gpu_check = PathBuf::from(env!("CARGO_BIN_EXE_gpu_check"));
    for (from, name) in [(debug.join("fabricctl"), "fabricctl"), (gpu_check, "gpu_check")] {
        assert!(
            from.exists(),
            "{} is not built: run `cargo build -p fabric-cli` (the workspace test run builds it)",
            from.display()
        );
        std::os::unix::fs::symlink(&from, out.join(name)).expect("link");
    }
    out
}

/// This test is about the machine without a GPU; on one with a driver the script's real
/// run is the check.
fn gpu_here() -> bool {
    fabric_mm::cuda::probe_library(&[fabric_mm::cuda::LIBCUDA]).is_ok()
}

fn run_script(dir: &Path, path: &str) -> (Output, serde_json::Value) {
    run_script_with(dir, path, &[])
}

fn run_script_with(dir: &Path, path: &str, env: &[(&str, &str)]) -> (Output, serde_json::Value) {
    let out = dir.join("out");
    let o = Command::new(repo().join("scripts/gpu-check.sh"))
        .arg(&out)
        .envs(env.iter().copied())
        .env("FABRIC_BIN_DIR", bins(dir))
        .env("PATH", path)
        .env_remove("RUST_LOG")
        .output()
        .expect("runs");
    let summary = std::fs::read(out.join("summary.json")).expect("summary.json written");
    (o, serde_json::from_slice(&summary).expect("summary is JSON"))
}

#[test]
fn without_a_gpu_the_check_reports_not_present_and_exits_3() {
    if gpu_here() || Path::new("/usr/bin/nvidia-smi").exists() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let t = std::time::Instant::now();
    let (o, s) = run_script(dir.path(), "/usr/bin:/bin");
    assert_eq!(o.status.code(), Some(3), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t.elapsed().as_secs() < 60);
    assert_eq!(s["schema"], "fabric.gpu-check/v1");
    assert_eq!(s["status"], "not_present");
    assert_eq!(s["failed_steps"], serde_json::json!([]));
    let absent: Vec<String> =
        s["not_present"].as_array().expect("list").iter().map(|v| v.as_str().expect("text").to_owned()).collect();
    assert!(absent.iter().any(|a| a.starts_with("CUDA not present: ") && a.contains("libcuda.so.1")), "{absent:?}");
    assert!(absent.iter().any(|a| a.starts_with("NVML not present: ")), "{absent:?}");
    assert!(absent.iter().any(|a| a.contains("nvidia-smi")), "{absent:?}");
    let out = dir.path().join("out");
    for f in ["steps.tsv", "environment.txt", "topology.json", "devices.json", "probe.json"] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    let steps = s["steps"].as_array().expect("steps");
    let status = |name: &str| steps.iter().find(|x| x["step"] == name).map(|x| x["status"].clone());
    assert_eq!(status("topology-json"), Some("passed".into()), "discovery runs without a GPU");
    assert_eq!(status("cuda-probe"), Some("not_present".into()));
    assert_eq!(status("cuda-memory"), Some("skipped".into()));
}

#[test]
fn nvidia_smi_output_is_compared_and_differences_fail_the_check() {
    if gpu_here() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = dir.path().join("fake-bin");
    std::fs::create_dir_all(&fake).expect("dir");
    let data = repo().join("cli/tests/data/nvidia-smi");
    let script = format!(
        "#!/bin/sh\ncase \"$*\" in\n  '-q -x') cat '{xml}' ;;\n  'topo -m') cat '{topo}' ;;\n  *) echo \"fake nvidia-smi $*\" ;;\nesac\n",
        xml = data.join("hgx-h100-8gpu.query.xml").display(),
        topo = data.join("hgx-h100-8gpu.topo.txt").display(),
    );
    let smi = fake.join("nvidia-smi");
    std::fs::write(&smi, script).expect("write");
    std::fs::set_permissions(&smi, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let (o, s) = run_script(dir.path(), &format!("{}:/usr/bin:/bin", fake.display()));
    // This host has none of the fixture's eight GPUs: every one is a difference.
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(s["status"], "failed");
    assert_eq!(s["failed_steps"], serde_json::json!(["gpu-compare"]));
    assert!(s["gpu_compare_differences"].as_u64().expect("count") >= 8);
    let compare: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("out/gpu-compare.json")).expect("written"))
            .expect("JSON");
    assert_eq!(compare["gpus"][0]["problems"][0], "not discovered");
}

#[test]
fn steps_past_the_time_budget_are_timed_out_and_fail_the_check() {
    if gpu_here() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // 12 s leaves less than the 10 s kill margin + 5 s: no step may start.
    let (o, s) = run_script_with(dir.path(), "/usr/bin:/bin", &[("GPU_CHECK_BUDGET", "12")]);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(s["status"], "failed");
    let steps = s["steps"].as_array().expect("steps");
    let ran: Vec<_> = steps.iter().filter(|x| x["status"] != "skipped").collect();
    assert!(ran.len() >= 8 && ran.iter().all(|x| x["status"] == "timeout"), "{steps:?}");
    assert!(s["failed_steps"].as_array().expect("list").iter().any(|x| x == "cuda-probe"));
}
