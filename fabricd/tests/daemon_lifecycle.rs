//! The daemon's life: `--check`, configuration errors, one daemon per socket and per state
//! dir, stale sockets, and a graceful SIGTERM (exit 0, STOPPING=1, socket removed).
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::Duration;

fn fabricd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fabricd"))
}

#[test]
fn check_validates_discovers_and_summarises_without_serving() {
    let s = common::Setup::new("");
    let out = fabricd().arg("--config").arg(&s.config).arg("--check").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for want in [
        format!("configuration {}: ok", s.config.display()),
        format!("socket {}", s.socket.display()),
        "backend sim: present (63 devices)".to_owned(),
        "discovered 63 devices, 94 links (1 down or degraded)".to_owned(),
        "check passed".to_owned(),
    ] {
        assert!(text.contains(&want), "missing {want:?} in:\n{text}");
    }
    assert!(!s.socket.exists(), "--check does not serve");
}

#[test]
fn a_bad_configuration_names_file_line_and_key_and_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[socket]\npath = \"/tmp/x.sock\"\ngroupp = \"fabric\"\n").unwrap();
    let out = fabricd().arg("--config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&path.display().to_string()) && err.contains("line 3") && err.contains("groupp"), "{err}");
    let out = fabricd().arg("--config").arg(dir.path().join("missing.toml")).output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing.toml"));
}

#[test]
fn a_second_daemon_on_the_same_socket_or_state_dir_refuses_to_start() {
    let s = common::Setup::new("");
    let mut d = common::start(&s.config, s.dir.path());

    // Same socket, other state dir: the live socket answers, so it refuses.
    let other = tempfile::tempdir().unwrap();
    let cfg = other.path().join("a.toml");
    common::Setup::write(&cfg, &s.socket, &other.path().join("state"), "");
    let out = fabricd().arg("--config").arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("already serving") && err.contains(&s.socket.display().to_string()), "{err}");

    // Same state dir, other socket: the journal's lock refuses it.
    let cfg = other.path().join("b.toml");
    common::Setup::write(&cfg, &other.path().join("b.sock"), &s.state, "");
    let out = fabricd().arg("--config").arg(&cfg).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("journal is in use"), "{err}");
    assert!(!other.path().join("b.sock").exists());

    // The first one is untouched.
    let mut c = common::client(&s.socket);
    c.call(fabric_proto::wire::Request::Status(Default::default()), &[]).unwrap();
    assert!(d.child.try_wait().unwrap().is_none());
}

#[test]
fn sigterm_stops_cleanly_and_a_stale_socket_is_replaced() {
    let s = common::Setup::new("");
    // A socket file nobody listens on (a daemon killed with -9) does not block a start.
    std::fs::create_dir_all(s.socket.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&s.socket).unwrap());
    assert!(s.socket.exists());
    let mut d = common::start(&s.config, s.dir.path());
    let _idle = common::client(&s.socket);
    let pid = i32::try_from(d.child.id()).unwrap();
    // SAFETY: kill(2) on our own child's pid; it touches no memory of ours.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let st = common::wait_exit(&mut d.child, 15);
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(!s.socket.exists(), "the socket file is removed");
    d.notify.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    let n = d.notify.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"STOPPING=1");
    let log = d.log();
    assert!(log.contains("SIGTERM") && log.contains("stopped"), "{log}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let s = common::Setup::new("");
    let mut text = std::fs::read_to_string(&s.config).unwrap();
    text.push_str("[log]\nformat = \"json\"\n");
    std::fs::write(&s.config, text).unwrap();
    let d = common::start(&s.config, s.dir.path());
    let log = d.log();
    let lines: Vec<serde_json::Value> =
        log.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}"))).collect();
    assert!(lines.iter().any(|v| v["fields"]["message"] == "ready"), "{log}");
}
