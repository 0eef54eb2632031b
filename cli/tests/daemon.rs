//! fabricctl against a running fabricd: `status` (table and JSON), `topology -o json` and
//! `devices -o json` through the socket equal the local documents, formats that need the
//! model say so, and `status` with no daemon exits 1 with the socket tried and a hint.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

fn fabricctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(args).env_remove("RUST_LOG").output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn sim() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml").canonicalize().unwrap()
}

/// The fabricd binary built next to fabricctl (the workspace builds both).
fn fabricd_bin() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_BIN_EXE_fabricctl")).with_file_name("fabricd");
    p.exists().then_some(p)
}

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts fabricd on the HGX sim in `dir` and waits for READY=1.
fn start(bin: &Path, dir: &Path) -> (Daemon, PathBuf) {
    let socket = dir.join("fabricd.sock");
    let config = dir.join("fabricd.toml");
    let body = format!(
        "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\n[metrics]\nlisten = \"\"\n",
        socket.display().to_string(),
        dir.join("state").display().to_string(),
        sim().display().to_string()
    );
    std::fs::write(&config, body).unwrap();
    let notify_path = dir.join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let child = Command::new(bin)
        .arg("--config")
        .arg(&config)
        .env("NOTIFY_SOCKET", &notify_path)
        .stderr(std::fs::File::create(dir.join("log")).unwrap())
        .spawn()
        .unwrap();
    let d = Daemon(child);
    let mut buf = [0u8; 128];
    let n = notify.recv(&mut buf).unwrap_or_else(|e| {
        panic!("fabricd not ready: {e}: {}", std::fs::read_to_string(dir.join("log")).unwrap_or_default())
    });
    assert!(buf[..n].starts_with(b"READY=1"));
    (d, socket)
}

#[test]
fn status_topology_and_devices_come_from_the_running_daemon() {
    let Some(bin) = fabricd_bin() else {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_d, socket) = start(&bin, dir.path());
    let sock = socket.to_str().unwrap();

    // The degraded link of the sim, computed here.
    let fabric = fabric_topology::Fabric::build(fabric_drivers::sim::load(&sim()).unwrap()).unwrap();
    let inv = fabric.inventory();
    let l = inv.links.iter().find(|l| l.state == fabric_topology::LinkState::Degraded).unwrap();
    let subject = format!("{}<->{}", inv.device(l.a).id, inv.device(l.b).id);
    let permille = l.bandwidth.current_mbps.unwrap() * 1000 / l.bandwidth.max_mbps.unwrap();

    let o = fabricctl(&["status", "--daemon", sock]);
    let t = text(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{t}{}", text(&o.stderr));
    assert!(t.contains(&format!("fabricd at {sock}: serving")), "{t}");
    assert!(t.contains(&format!("devices {}, links {}", inv.devices.len(), inv.links.len())), "{t}");
    let pct = format!("link {subject} degraded: {:.1}% of its bandwidth left", permille as f64 / 10.0);
    assert!(t.contains(&pct), "{pct:?} in {t}");

    let o = fabricctl(&["status", "--daemon", sock, "-o", "json"]);
    assert_eq!(o.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["schema"], "fabric.status/v1");
    assert_eq!(v["devices"], inv.devices.len());
    let p = v["problems"].as_array().unwrap().iter().find(|p| p["kind"] == "link_degraded").unwrap();
    assert_eq!(p["subject"], subject.as_str());
    assert_eq!(p["bandwidth_fraction"].as_f64().unwrap(), permille as f64 / 1000.0);

    // Through the daemon, byte for byte what the same fabric gives locally.
    let simf = sim();
    let simf = simf.to_str().unwrap();
    for cmd in ["topology", "devices"] {
        let remote = fabricctl(&[cmd, "-o", "json", "--daemon", sock]);
        assert_eq!(remote.status.code(), Some(0), "{}", text(&remote.stderr));
        let local = fabricctl(&[cmd, "-o", "json", "--sim", simf]);
        assert_eq!(text(&remote.stdout), text(&local.stdout), "{cmd}");
    }
    // FABRIC_SOCKET picks the socket when --daemon has no value.
    let o = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
        .args(["devices", "-o", "json", "--daemon"])
        .env("FABRIC_SOCKET", sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));

    // Formats that need the fabric model say so instead of guessing.
    let o = fabricctl(&["topology", "--daemon", sock]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("use -o json"), "{}", text(&o.stderr));
}

#[test]
fn status_without_a_daemon_names_the_socket_and_hints_to_start_one() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nobody.sock");
    let o = fabricctl(&["status", "--daemon", sock.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let e = text(&o.stderr);
    assert!(e.contains(&format!("no fabricd is listening on {}", sock.display())), "{e}");
    assert!(e.contains("hint: start fabricd"), "{e}");
    assert!(o.stdout.is_empty());
    // The default socket comes from FABRIC_SOCKET.
    let o = Command::new(env!("CARGO_BIN_EXE_fabricctl")).arg("status").env("FABRIC_SOCKET", &sock).output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains(&sock.display().to_string()));
    // --daemon and --sim exclude each other.
    let o = fabricctl(&["topology", "--daemon", "x.sock", "--sim", "a.toml"]);
    assert_eq!(o.status.code(), Some(2));
}
