//! scripts/gpu-check.sh on a machine without a GPU: it must finish quickly, write every
//! step's result and a summary, and exit 3 with the reasons ("CUDA not present: …",
//! "NVML not present: …"); with nvidia-smi answering (a stand-in printing the hand-written
//! fixtures) the comparison runs and its differences fail the check with exit 1; with the
//! stand-in CUDA driver every CUDA step runs, fabricd's included, and the fabric-handle step
//! runs only where an IMEX channel is.

#[path = "fake_libcuda/mod.rs"]
mod fake_libcuda;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repo root").to_owned()
}

/// target/debug, where the workspace build puts fabricctl, fabricd and gpu_check: a bin dir
/// with fabricctl and gpu_check (and fabricd with `daemon`).
fn bins(dir: &Path) -> PathBuf {
    bins_with(dir, false)
}

fn bins_with(dir: &Path, daemon: bool) -> PathBuf {
    let debug = std::env::current_exe().expect("exe").parent().and_then(Path::parent).expect("target dir").to_owned();
    let out = dir.join("bin");
    std::fs::create_dir_all(&out).expect("bin dir");
    let gpu_check = PathBuf::from(env!("CARGO_BIN_EXE_gpu_check"));
    let mut links = vec![(debug.join("fabricctl"), "fabricctl"), (gpu_check, "gpu_check")];
    if daemon {
        links.push((debug.join("fabricd"), "fabricd"));
        // The C example as the bundle links it (scripts/gpu-bundle-c.sh, static library).
        let script = repo().join("scripts/gpu-bundle-c.sh");
        let profile = debug.file_name().and_then(|n| n.to_str()).expect("profile").to_owned();
        let made = Command::new(script)
            .arg(dir.join("c"))
            .arg(profile)
            .env("FABRIC_BUNDLE_NO_BUILD", "1")
            .output()
            .expect("gpu-bundle-c.sh runs");
        assert!(made.status.success(), "gpu-bundle-c.sh: {}", String::from_utf8_lossy(&made.stderr));
        links.push((dir.join("c/bin/gpu_share"), "gpu_share"));
    }
    for (from, name) in links {
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
    run_script_in(dir, bins(dir), path, env)
}

fn run_script_in(dir: &Path, bin: PathBuf, path: &str, env: &[(&str, &str)]) -> (Output, serde_json::Value) {
    let out = dir.join("out");
    let o = Command::new(repo().join("scripts/gpu-check.sh"))
        .arg(&out)
        .envs(env.iter().copied())
        .env("FABRIC_BIN_DIR", bin)
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

/// The whole script on the stand-in CUDA driver: fabricd discovers the stand-in GPU through
/// its CUDA backend, the memory check passes its allocation through fabricd as a descriptor,
/// directly, and — with an IMEX channel present — as a fabric handle; without a channel the
/// fabric step is skipped and says why. (No NVML or nvidia-smi here: the status is
/// `not_present` with exactly those two reasons, and nothing failed.)
#[test]
fn on_the_stand_in_driver_every_cuda_step_runs_and_fabric_handles_need_an_imex_channel() {
    if gpu_here() || Path::new("/usr/bin/nvidia-smi").exists() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(lib) = fake_libcuda::build(dir.path()) else { return };
    let imex = dir.path().join("imex");
    std::fs::create_dir(&imex).expect("imex dir");
    let devices = dir.path().join("devices");
    std::fs::write(&devices, "Character devices:\n195 nvidia\n").expect("devices");
    let lib = lib.display().to_string();
    let (imex_s, devices_s) = (imex.display().to_string(), devices.display().to_string());
    let env = [
        ("LD_LIBRARY_PATH", lib.as_str()),
        ("FAKE_CUDA_FABRIC", "1"),
        ("FAKE_CUDA_UUID", "0123456789abcdef0123456789abcdef"),
        ("GPU_CHECK_IMEX_DIR", imex_s.as_str()),
        ("GPU_CHECK_PROC_DEVICES", devices_s.as_str()),
        ("GPU_CHECK_SIZE_MIB", "4"),
        ("GPU_CHECK_ITERS", "2"),
    ];
    let run = |sub: &str, extra: &[(&str, &str)]| {
        let d = dir.path().join(sub);
        std::fs::create_dir(&d).expect("dir");
        let env: Vec<(&str, &str)> = env.iter().chain(extra).copied().collect();
        let (o, s) = run_script_in(&d, bins_with(&d, true), "/usr/bin:/bin", &env);
        let steps = s["steps"].as_array().expect("steps").clone();
        let status = move |name: &str| steps.iter().find(|x| x["step"] == name).map(|x| x["status"].clone());
        (o, s, status)
    };
    // No channel, and the driver registers no channel device: skipped, with the reason.
    let (o, s, status) = run("none", &[]);
    assert_eq!(o.status.code(), Some(3), "{}\n{s:#}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(s["failed_steps"], serde_json::json!([]), "{s:#}");
    for step in ["cuda-probe", "cuda-memory", "cuda-memory-direct", "daemon-status", "cuda-c-share"] {
        assert_eq!(status(step), Some("passed".into()), "{step}: {s:#}");
    }
    assert_eq!(status("cuda-memory-fabric"), Some("skipped".into()), "{s:#}");
    let steps = s["steps"].as_array().expect("steps");
    let fabric = steps.iter().find(|x| x["step"] == "cuda-memory-fabric").expect("listed");
    assert!(fabric.to_string().contains("no nvidia-caps-imex-channels device"), "{fabric}");
    // With a channel: the fabric handle goes through fabricd and both sides verify.
    std::fs::write(imex.join("channel0"), b"").expect("channel");
    let (o, s, status) = run("channel", &[]);
    assert_eq!(o.status.code(), Some(3), "{}\n{s:#}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(s["failed_steps"], serde_json::json!([]), "{s:#}");
    assert_eq!(status("imex-channel"), Some("passed".into()), "{s:#}");
    assert_eq!(status("cuda-memory-fabric"), Some("passed".into()), "{s:#}");
    assert_eq!(status("cuda-c-share-fabric"), Some("passed".into()), "{s:#}");
    let c = std::fs::read_to_string(dir.path().join("channel/out/c-share-fabric.txt")).expect("C output");
    assert!(c.contains("handed over as a fabric handle") && c.contains("gpu_share: passed"), "{c}");
    assert!(s["figures_fabric"]["cuMemcpyDtoD imported->local GB/s"].as_f64().expect("figure") > 0.0, "{s:#}");
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("channel/out/memory-fabric.json")).expect("report"))
            .expect("JSON");
    let import = doc["importer"]["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|x| x["step"] == "ImportObject + cuMemImportFromShareableHandle")
        .expect("import step")
        .clone();
    assert_eq!(import["detail"]["object"], "fabric handle", "{import}");
    let absent = s["not_present"].as_array().expect("list");
    assert_eq!(absent.len(), 2, "only NVML and nvidia-smi are missing: {absent:?}");
    // No channel, but the driver registered the device class: GPU_CHECK_IMEX=create makes
    // channel 0 with its major number (as root; otherwise the step says root is needed).
    let fresh = dir.path().join("imex-new");
    std::fs::write(&devices, "Character devices:\n195 nvidia\n242 nvidia-caps-imex-channels\n").expect("devices");
    let fresh_s = fresh.display().to_string();
    let (_, s, status) = run("create", &[("GPU_CHECK_IMEX", "create"), ("GPU_CHECK_IMEX_DIR", fresh_s.as_str())]);
    let note = std::fs::read_to_string(dir.path().join("create/out/imex-channel.txt")).expect("note");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert!(note.contains("created") && note.contains("major 242") && note.contains("0600"), "{note}");
        assert_eq!(status("cuda-memory-fabric"), Some("passed".into()), "{s:#}");
        // Made for the check only: gone afterwards.
        assert!(fresh.is_dir() && !fresh.join("channel0").exists(), "channel0 left behind");
    } else {
        assert!(note.contains("needs root"), "{note}");
        assert_eq!(status("cuda-memory-fabric"), Some("skipped".into()), "{s:#}");
    }
}
