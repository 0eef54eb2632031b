//! fabricctl against a running fabricd: `status` (table and JSON); `topology` in every
//! format, `devices`, `path` and the `map` listing through the socket equal the local
//! output for the same fabric; `partitions` and `regions` from the daemon; `status` with no
//! daemon exits 1 with the socket tried and a hint.
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

    // translate through the daemon: a mapped GFA answers, an unmapped one exits 1.
    let listing = fabricctl(&["map", "-o", "json", "--daemon", sock]);
    assert_eq!(listing.status.code(), Some(0), "{}", text(&listing.stderr));
    let v: serde_json::Value = serde_json::from_slice(&listing.stdout).unwrap();
    let start = v["ranges"][0]["start"].as_u64().unwrap();
    let o = fabricctl(&["map", "translate", &format!("{start:#x}"), "--daemon", sock, "-o", "json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let t: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((t["schema"].as_str(), t["offset"].as_str()), (Some("fabric.map.translate.daemon/v1"), Some("0x0")));
    let o = fabricctl(&["map", "translate", "0x7fffffffffffff", "--daemon", sock]);
    assert_eq!(o.status.code(), Some(1), "{}{}", text(&o.stdout), text(&o.stderr));
    assert!(text(&o.stderr).contains("not mapped"), "{}", text(&o.stderr));
}

/// A daemon that answers Hello and then goes away: the next request's broken pipe is the
/// daemon's, not a closed output, so fabricctl says so and exits 1 (it exited 0 in silence).
#[test]
fn a_daemon_that_hangs_up_is_an_error_not_a_closed_output() {
    use fabric_proto::wire::{
        FrameKind, Header, HelloResponse, Message, Name, Opcode, Response, recv_frame, send_message,
    };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("hangup.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        for _ in 0..2 {
            let (stream, _) = listener.accept().unwrap();
            let Ok(frame) = recv_frame(&stream) else { continue };
            assert_eq!(frame.header.opcode, Opcode::Hello);
            let reply = Header::new(Opcode::Hello, FrameKind::Response, frame.header.request_id);
            let hello = Message::Response(Response::Hello(HelloResponse {
                version: fabric_proto::wire::PROTOCOL_VERSION,
                server: Name::truncated("hangs up"),
                session: 1,
                max_request_body: fabric_proto::wire::MAX_REQUEST_BODY,
                max_fds: fabric_proto::wire::MAX_FDS,
                token: None,
            }));
            send_message(&stream, &reply, &hello, &[]).unwrap();
            drop(stream);
        }
    });
    for args in [["status", "--daemon"], ["devices", "--daemon"]] {
        let o = fabricctl(&[args[0], args[1], sock.to_str().unwrap()]);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}{}", text(&o.stdout), text(&o.stderr));
        assert!(text(&o.stderr).starts_with("error:"), "{}", text(&o.stderr));
    }
    server.join().unwrap();
}

/// Runs fabricctl with `args`, killing it after `limit` (a hang fails the test, not CI).
fn fabricctl_within(args: &[&str], limit: Duration) -> (Output, Duration) {
    use std::process::Stdio;
    let start = std::time::Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
        .args(args)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!("fabricctl {args:?} still waiting after {limit:?}: {}", text(&o.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = start.elapsed();
    (child.wait_with_output().unwrap(), elapsed)
}

/// A wedged daemon whose accept queue is full: fabricctl gives up after `--timeout` with
/// a typed error and a hint (a blocking `connect` used to wait for ever).
#[test]
fn a_daemon_that_takes_no_connection_times_out() {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, connect, listen, socket};
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("wedged.sock");
    let listener = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    let addr = UnixAddr::new(&sock).unwrap();
    bind(listener.as_raw_fd(), &addr).unwrap();
    listen(&listener, Backlog::new(0).unwrap()).unwrap();
    // Fill the queue: connects that are never accepted, until the kernel says it is full.
    let mut queued = Vec::new();
    loop {
        let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
            .unwrap();
        match connect(fd.as_raw_fd(), &addr) {
            Ok(()) => queued.push(fd),
            Err(nix::errno::Errno::EAGAIN) => break,
            Err(e) => panic!("filling the accept queue: {e}"),
        }
        assert!(queued.len() < 64, "the accept queue never filled");
    }
    let (o, elapsed) =
        fabricctl_within(&["--timeout", "1", "status", "--daemon", sock.to_str().unwrap()], Duration::from_secs(30));
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("took no connection within 1s"), "{err}");
    assert!(err.contains("hint: fabricd is wedged or overloaded"), "{err}");
    assert!(elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(20), "{elapsed:?}");
    drop(queued);
}

/// A daemon that answers hello, then trickles its answer a byte every 100 ms: each read
/// gets a byte well within any read timeout, so only a bound on the whole call ends it.
#[test]
fn a_daemon_that_trickles_its_answer_times_out() {
    use fabric_proto::wire::{
        FrameKind, Header, HelloResponse, Message, Name, Opcode, Response, recv_frame, send_message,
    };
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("trickle.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let frame = recv_frame(&stream).unwrap();
        let reply = Header::new(Opcode::Hello, FrameKind::Response, frame.header.request_id);
        let hello = Message::Response(Response::Hello(HelloResponse {
            version: fabric_proto::wire::PROTOCOL_VERSION,
            server: Name::truncated("trickles"),
            session: 1,
            max_request_body: fabric_proto::wire::MAX_REQUEST_BODY,
            max_fds: fabric_proto::wire::MAX_FDS,
            token: None,
        }));
        send_message(&stream, &reply, &hello, &[]).unwrap();
        let request = recv_frame(&stream).unwrap();
        assert_eq!(request.header.opcode, Opcode::Status);
        // A header that announces a 1,000-byte body, then the body a byte at a time.
        let mut frame = Vec::new();
        let status = Header::new(Opcode::Status, FrameKind::Response, request.header.request_id);
        fabric_proto::wire::encode_frame(&status, &[0; 1000], &mut frame).unwrap();
        if stream.write_all(&frame[..fabric_proto::wire::HEADER_LEN]).is_err() {
            return;
        }
        for _ in 0..600 {
            std::thread::sleep(Duration::from_millis(100));
            if stream.write_all(&[0]).is_err() {
                return;
            }
        }
        panic!("fabricctl still reading after a minute");
    });
    let (o, elapsed) =
        fabricctl_within(&["--timeout", "2", "status", "--daemon", sock.to_str().unwrap()], Duration::from_secs(30));
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no answer within 2s"), "{err}");
    assert!(err.contains("hint: fabricd is wedged or overloaded"), "{err}");
    assert!(elapsed >= Duration::from_secs(2) && elapsed < Duration::from_secs(20), "{elapsed:?}");
    server.join().unwrap();
}

/// Runs `args` through the daemon and locally on the sim; both must succeed with the
/// same output.
fn same_output(sock: &str, args: &[&str]) -> String {
    let simf = sim();
    let remote = fabricctl(&[args, &["--daemon", sock]].concat());
    assert_eq!(remote.status.code(), Some(0), "{args:?}: {}", text(&remote.stderr));
    let local = fabricctl(&[args, &["--sim", simf.to_str().unwrap()]].concat());
    assert_eq!(local.status.code(), Some(0), "{args:?}: {}", text(&local.stderr));
    assert_eq!(text(&remote.stdout), text(&local.stdout), "{args:?}");
    assert!(!remote.stdout.is_empty());
    text(&remote.stdout)
}

#[test]
fn every_format_through_the_daemon_equals_the_local_output() {
    let Some(bin) = fabricd_bin() else {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_d, socket) = start(&bin, dir.path());
    let sock = socket.to_str().unwrap();
    for format in ["table", "tree", "json", "dot", "nccl-xml"] {
        same_output(sock, &["topology", "-o", format]);
    }
    let golden =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hgx-h100-8gpu.table"))
            .unwrap();
    assert_eq!(same_output(sock, &["topology", "-o", "table"]), golden, "and both equal the golden matrix");
    same_output(sock, &["topology", "-o", "tree", "--node", "node0"]);
    for format in ["table", "json"] {
        same_output(sock, &["devices", "-o", format]);
        same_output(sock, &["path", "GPU0", "GPU5", "-o", format]);
    }

    // The map listing: the daemon's against a local run over a copy of its map state (the
    // map half of its map record, written as a state file).
    let copy = dir.path().join("map-copy.state");
    let record = std::fs::read(dir.path().join("state/map.record")).unwrap();
    let (_, payload) = fabric_addrmap::durable::decode_frame(b"FBRCMAPR", 1, 1, u64::MAX, &record).unwrap();
    let mut body: serde_json::Value = serde_json::from_slice(payload).unwrap();
    let state: fabric_addrmap::State = serde_json::from_value(body["map"].take()).unwrap();
    std::fs::write(&copy, fabric_addrmap::encode_state(&state)).unwrap();
    let simf = sim();
    for format in ["json", "table"] {
        let remote = fabricctl(&["map", "-o", format, "--daemon", sock]);
        assert_eq!(remote.status.code(), Some(0), "{}", text(&remote.stderr));
        let local =
            fabricctl(&["map", "-o", format, "--sim", simf.to_str().unwrap(), "--state", copy.to_str().unwrap()]);
        assert_eq!(local.status.code(), Some(0), "{}", text(&local.stderr));
        let (r, l) = (text(&remote.stdout), text(&local.stdout));
        if format == "json" {
            assert_eq!(r, l);
        } else {
            // The first line says where the listing came from.
            let (r1, rest_r) = r.split_once('\n').unwrap();
            let (l1, rest_l) = l.split_once('\n').unwrap();
            assert!(r1.ends_with(&format!("fabricd {sock}")), "{r1}");
            assert!(l1.ends_with(&format!("state {}", copy.display())), "{l1}");
            assert_eq!(rest_r, rest_l);
        }
    }
    // Commands that change a local state file do not take --daemon.
    let o = fabricctl(&["map", "gc", "--daemon", sock]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("does not use the daemon"), "{}", text(&o.stderr));

    // With FABRIC_SOCKET set and no source flag, the daemon answers.
    let o = Command::new(env!("CARGO_BIN_EXE_fabricctl"))
        .args(["devices", "-o", "json"])
        .env("FABRIC_SOCKET", sock)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert_eq!(text(&o.stdout), same_output(sock, &["devices", "-o", "json"]));
    // A listing of a named state file is that file's, though a daemon answers (before,
    // the daemon's map was printed and --state ignored); with --daemon it is a usage error.
    let mine = dir.path().join("mine.state");
    let with_socket = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_fabricctl")).args(args).env("FABRIC_SOCKET", sock).output().unwrap();
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        let out = text(&o.stdout);
        assert!(out.lines().next().unwrap().ends_with(&format!("state {}", mine.display())), "{out}");
    };
    with_socket(&["map", "--sim", simf.to_str().unwrap(), "--state", mine.to_str().unwrap()]);
    with_socket(&["map", "--state", mine.to_str().unwrap()]);
    let o = fabricctl(&["map", "--state", mine.to_str().unwrap(), "--daemon", sock]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .is_some_and(|v| v.split_whitespace().nth(1) == Some("0"))
}

#[test]
fn partitions_and_regions_come_from_the_daemon() {
    let Some(bin) = fabricd_bin() else {
        eprintln!("skipped: fabricd is not built next to fabricctl (run the workspace's tests)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_d, socket) = start(&bin, dir.path());
    let sock = socket.to_str().unwrap();

    let o = fabricctl(&["partitions", "--daemon", sock]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("no partitions"), "{}", text(&o.stdout));
    let set = fabricctl(&[
        "partitions",
        "set",
        "tenant-a",
        "GPU0",
        "GPU1",
        "--uid",
        "61001",
        "--gid",
        "61300",
        "--daemon",
        sock,
    ]);
    if !is_root() {
        // Only root or the admin group change partitions.
        assert_eq!(set.status.code(), Some(1));
        assert!(
            text(&set.stderr).contains("AdminRequired") || text(&set.stderr).contains("admin"),
            "{}",
            text(&set.stderr)
        );
    } else {
        assert_eq!(set.status.code(), Some(0), "{}", text(&set.stderr));
        let fabric = fabric_topology::Fabric::build(fabric_drivers::sim::load(&sim()).unwrap()).unwrap();
        let order = fabric_proto::order::device_order(&fabric);
        let labels = fabric_proto::MatrixLabels::from_order(&fabric, &order);
        let gpu0 = fabric.device(labels.find("GPU0").unwrap()).id.to_string();
        let o = fabricctl(&["partitions", "-o", "json", "--daemon", sock]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["schema"], "fabric.partitions/v1");
        let p = &v["partitions"][0];
        assert_eq!(p["name"], "tenant-a");
        assert_eq!(p["devices"].as_array().unwrap().len(), 2);
        assert!(p["devices"].as_array().unwrap().iter().any(|d| d == gpu0.as_str()), "{p}");
        assert_eq!(p["uids"], serde_json::json!([61001]));
        assert_eq!(p["gids"], serde_json::json!([61300]));
        let t = text(&fabricctl(&["partitions", "--daemon", sock]).stdout);
        assert!(t.contains("tenant-a") && t.contains("61001") && t.contains(&gpu0), "{t}");
        let o = fabricctl(&["partitions", "remove", "tenant-a", "--daemon", sock]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
        assert!(text(&o.stdout).contains("no partitions"));
        let o = fabricctl(&["partitions", "remove", "tenant-a", "--daemon", sock]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            text(&o.stderr).contains("NotFound") || text(&o.stderr).contains("no partition"),
            "{}",
            text(&o.stderr)
        );
    }

    // A region and an export of this uid, held by this test's own connection.
    use fabric_proto::wire::*;
    let mut c = Connection::new(std::os::unix::net::UnixStream::connect(&socket).unwrap());
    c.hello("cli-test", SUPPORTED_VERSIONS).unwrap();
    let fabric = fabric_topology::Fabric::build(fabric_drivers::sim::load(&sim()).unwrap()).unwrap();
    let gpu = fabric.inventory().devices.iter().find(|d| d.gpu.is_some()).unwrap().id.to_string();
    let target = AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm };
    let (Response::Alloc(a), _fd) =
        c.call(Request::Alloc(AllocRequest { target, size: 4 << 20, align: 0 }), &[]).unwrap()
    else {
        panic!()
    };
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    c.call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[]).unwrap();

    let o = fabricctl(&["regions", "-o", "json", "--daemon", sock]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["schema"], "fabric.regions/v1");
    assert_eq!(v["regions"][0]["region"], a.region);
    assert_eq!(v["regions"][0]["device"], gpu.as_str());
    assert_eq!(v["regions"][0]["size"], a.size);
    assert_eq!(v["exports"][0]["access"], "read_only");
    assert!(!text(&o.stdout).contains("secret"));
    let t = text(&fabricctl(&["regions", "--daemon", sock]).stdout);
    assert!(t.contains("regions (1)") && t.contains("exports (1)") && t.contains(&gpu), "{t}");
    let all = fabricctl(&["regions", "--all", "--daemon", sock]);
    assert_eq!(all.status.code(), Some(if is_root() { 0 } else { 1 }), "{}", text(&all.stderr));
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
