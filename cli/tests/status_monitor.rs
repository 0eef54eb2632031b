//! `fabricctl status` against a daemon whose fabric changed at a rescan: a device that
//! vanished is listed with why (its regions lost, their exports revoked), a degraded link
//! with the share of its bandwidth left, in the table and in JSON; a link that goes down
//! (and comes back) while the daemon runs is an event, a status problem and a down link in
//! the GPU's topology.
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

/// A fabricd serving an editable copy of the HGX sim.
struct Served {
    _daemon: Daemon,
    /// Holds the files.
    _dir: tempfile::TempDir,
    /// The sim file it rescans every second.
    fabric: PathBuf,
    /// What the sim file held at start.
    base: String,
    /// Its socket.
    socket: PathBuf,
}

impl Served {
    fn sock(&self) -> &str {
        self.socket.to_str().unwrap()
    }
}

/// Starts fabricd (built next to fabricctl) on a copy of the HGX sim, rescanned every
/// second; `None` (with a message) when it is not built.
fn serve() -> Option<Served> {
    let bin = Path::new(env!("CARGO_BIN_EXE_fabricctl")).with_file_name("fabricd");
    if !bin.exists() {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let fabric = dir.path().join("fabric.toml");
    std::fs::write(&fabric, std::fs::read_to_string(sim()).unwrap()).unwrap();
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
    let d = Daemon(
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
    Some(Served { _daemon: d, _dir: dir, fabric, base: std::fs::read_to_string(sim()).unwrap(), socket })
}

/// Writes `text` to `path` atomically (the daemon may be reading it).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// `fabricctl ARGS --daemon SOCK` until its output is what `want` accepts (within 20 s).
fn until(args: &[&str], sock: &str, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut all = args.to_vec();
        all.extend(["--daemon", sock]);
        let o = fabricctl(&all);
        assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
        let t = String::from_utf8_lossy(&o.stdout).into_owned();
        if want(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "`fabricctl {}` never showed what was awaited:\n{t}", args.join(" "));
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn status_lists_a_vanished_device_with_why_and_a_degraded_link_with_its_share_left() {
    let Some(served) = serve() else { return };
    let (fabric, base, sock) = (served.fabric.as_path(), served.base.as_str(), served.sock());

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
    let before = gpus(fabric);
    replace(fabric, &changed);
    let after = gpus(fabric);
    let gone = before.iter().find(|g| !after.contains(g)).unwrap();

    let table = until(&["status"], sock, |t| t.contains(gone.as_str()));
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

#[test]
fn a_link_that_goes_down_while_the_daemon_runs_is_an_event_a_status_problem_and_marks_its_gpu() {
    use fabric_proto::wire::{Connection, Event, LinkChange, Request, SUPPORTED_VERSIONS, SubscribeRequest, Topics};
    let Some(served) = serve() else { return };
    let (fabric, base, sock) = (served.fabric.as_path(), served.base.as_str(), served.sock());
    let stream = std::os::unix::net::UnixStream::connect(&served.socket).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut sub = Connection::new(stream);
    sub.hello("link-down", SUPPORTED_VERSIONS).unwrap();
    sub.call(Request::Subscribe(SubscribeRequest { topics: Topics::LINK }), &[]).unwrap();
    let o = fabricctl(&["status", "--daemon", sock]);
    assert!(!String::from_utf8_lossy(&o.stdout).contains(" down"), "{}", String::from_utf8_lossy(&o.stdout));

    // gpu0's PCIe link goes down at the next rescan.
    let down = format!("{base}\n[[degraded]]\ndevice = \"node0/gpu0\"\nlink = \"pcie\"\nlink_down = true\n");
    replace(fabric, &down);
    let inv = fabric_drivers::sim::load(fabric).unwrap();
    let l = inv.links.iter().find(|l| l.state == fabric_topology::LinkState::Down).unwrap();
    let (up, gpu) = (inv.device(l.a).id.to_string(), inv.device(l.b).id.to_string());
    assert_eq!(inv.device(l.b).kind, fabric_topology::DeviceKind::Gpu);

    // The event: this link, down.
    let ev = loop {
        match sub.next_event().unwrap() {
            Event::Link { a, b, kind, change: LinkChange::Down } => break (a, b, kind),
            Event::Link { change, .. } => panic!("another link change first: {change:?}"),
            _ => {}
        }
    };
    assert_eq!((ev.0.as_str(), ev.1.as_str(), ev.2.as_str()), (up.as_str(), gpu.as_str(), "pcie"));

    // `status` names the link down, in the table and in JSON.
    let table = until(&["status"], sock, |t| t.contains(" down: "));
    assert!(table.contains(&format!("link {up}<->{gpu} down: link is down")), "{table}");
    let o = fabricctl(&["status", "--daemon", sock, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let problems = v["problems"].as_array().unwrap();
    let p = problems.iter().find(|p| p["kind"] == "link_down").unwrap_or_else(|| panic!("{v}"));
    assert_eq!(p["subject"], format!("{up}<->{gpu}"), "{p}");
    assert_eq!(p["bandwidth_fraction"], 0.0, "{p}");
    // The topology names the GPU behind it: its route to the host crosses a down link (the
    // sim's NIC1 link runs degraded from the start).
    let table = until(&["topology"], sock, |t| t.contains("Degraded links (2):"));
    let line = table.lines().find(|l| l.trim_end().ends_with(": down")).unwrap_or_else(|| panic!("{table}"));
    assert!(line.trim_start().starts_with("GPU0 pcie link "), "{line}\n{table}");
    let o = fabricctl(&["topology", "--daemon", sock, "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let down_links: Vec<_> = v["links"].as_array().unwrap().iter().filter(|l| l["state"] == "down").collect();
    assert_eq!(down_links.len(), 1, "{down_links:?}");

    // Back up: an Up event, and the problem is gone.
    replace(fabric, base);
    loop {
        if let Event::Link { b, change: LinkChange::Up, .. } = sub.next_event().unwrap() {
            assert_eq!(b.as_str(), gpu);
            break;
        }
    }
    let table = until(&["status"], sock, |t| !t.contains(" down: "));
    assert!(table.contains("degraded: 49.9% of its bandwidth left"), "the NIC link is still listed: {table}");
}
