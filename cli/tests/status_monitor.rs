//! `fabricctl status` against a daemon whose fabric changed at a rescan: a device that
//! vanished is listed with why (its regions lost, their exports revoked), a degraded link
//! with the share of its bandwidth left, in the table and in JSON.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

fn fabricctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(args).env_remove("RUST_LOG").output().unwrap()
}

fn sim() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml").canonicalize().unwrap()
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn status_lists_a_vanished_device_with_why_and_a_degraded_link_with_its_share_left() {
    let bin = Path::new(env!("CARGO_BIN_EXE_fabricctl")).with_file_name("fabricd");
    if !bin.exists() {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let fabric = dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(sim()).unwrap();
    std::fs::write(&fabric, &base).unwrap();
    let socket = dir.path().join("fabricd.sock");
    let config = dir.path().join("fabricd.toml");
    let body = format!(
        "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\nrescan_interval_s = 1\n[metrics]\nlisten = \"\"\n",
        socket.display().to_string(),
        dir.path().join("state").display().to_string(),
        fabric.display().to_string()
    );
    std::fs::write(&config, body).unwrap();
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _d = Daemon(
        Command::new(&bin)
            .arg("--config")
            .arg(&config)
            .env("NOTIFY_SOCKET", &notify_path)
            .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut buf = [0u8; 128];
    notify.recv(&mut buf).unwrap();
    let sock = socket.to_str().unwrap();

    // gpu0's PCIe link at x4 of x16, and the last GPU gone.
    let changed = format!("{base}\n[[degraded]]\ndevice = \"node0/gpu0\"\nlink = \"pcie\"\nwidth = 4\n")
        .replacen(
            "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            1,
        )
        .replacen("i = 8\n", "i = 7\n", 1);
    let gpus = |p: &Path| -> Vec<String> {
        fabric_drivers::sim::load(p)
            .unwrap()
            .devices
            .iter()
            .filter(|d| d.kind == fabric_topology::DeviceKind::Gpu)
            .map(|d| d.id.to_string())
            .collect()
    };
    let before = gpus(&fabric);
    let tmp = fabric.with_extension("tmp");
    std::fs::write(&tmp, &changed).unwrap();
    std::fs::rename(&tmp, &fabric).unwrap();
    let after = gpus(&fabric);
    let gone = before.iter().find(|g| !after.contains(g)).unwrap();

    let deadline = Instant::now() + Duration::from_secs(20);
    let table = loop {
        let o = fabricctl(&["status", "--daemon", sock]);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        let t = String::from_utf8_lossy(&o.stdout).into_owned();
        if t.contains(gone.as_str()) {
            break t;
        }
        assert!(Instant::now() < deadline, "the vanished GPU never showed:\n{t}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let missing = format!("device {gone} missing: device vanished at a rescan");
    assert!(table.contains(&missing) && table.contains("exports revoked"), "{missing:?} in\n{table}");
    assert!(table.contains("degraded: 24.9% of its bandwidth left"), "{table}");

    let o = fabricctl(&["status", "--daemon", sock, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let problems = v["problems"].as_array().unwrap();
    let p = problems.iter().find(|p| p["kind"] == "device_missing" && p["subject"] == gone.as_str()).unwrap();
    assert!(p["detail"].as_str().unwrap().contains("regions are lost"), "{p}");
    assert!(problems.iter().any(|p| p["kind"] == "link_degraded" && p["bandwidth_fraction"] == 0.249), "{v}");
}
