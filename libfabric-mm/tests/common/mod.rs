//! Starts the real fabricd (built next to this test binary by the workspace) on a temporary
//! socket and state dir serving the bundled HGX sim fabric, and opens sessions on it.
#![allow(dead_code, clippy::unwrap_used)]

pub mod domain;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_mm::{MemoryClass, Session, SessionConfig, WindowConfig};

/// A daemon on a temp dir; killed on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn fabricd_bin() -> PathBuf {
    // target/debug/deps/<test> → target/debug/fabricd
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().and_then(Path::parent).unwrap().join("fabricd");
    assert!(
        bin.exists(),
        "{} is not built: run `cargo build -p fabricd` (the workspace test run builds it)",
        bin.display()
    );
    bin
}

/// Starts fabricd and waits until its socket answers.
pub fn daemon() -> Daemon {
    daemon_with_config("")
}

/// [`daemon`] with `extra` appended to its configuration (whole TOML tables).
pub fn daemon_with_config(extra: &str) -> Daemon {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml").canonicalize().unwrap();
    daemon_with(&sim, extra, |_| {})
}

/// Starts fabricd on the sim fabric `sim` with `extra` appended to its config (e.g. a
/// `[limits]` table) and `prepare` applied to its command (e.g. a `pre_exec`).
pub fn daemon_with(sim: &Path, extra: &str, prepare: impl FnOnce(&mut Command)) -> Daemon {
    daemon_on(sim, "", extra, prepare)
}

/// [`daemon_with`], with `discovery` added to its `[discovery]` table (e.g. `sim_node`).
pub fn daemon_on(sim: &Path, discovery: &str, extra: &str, prepare: impl FnOnce(&mut Command)) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fabricd.sock");
    let config = dir.path().join("fabricd.toml");
    std::fs::write(
        &config,
        format!(
            "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\n{discovery}\n[metrics]\nlisten = \"\"\n{extra}",
            socket.display().to_string(),
            dir.path().join("state").display().to_string(),
            sim.display().to_string()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("fabricd.log")).unwrap();
    let mut cmd = Command::new(fabricd_bin());
    cmd.arg("--config").arg(&config).stdout(Stdio::null()).stderr(log);
    prepare(&mut cmd);
    let child = cmd.spawn().unwrap();
    let d = Daemon { child, dir, socket };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
        assert!(Instant::now() < deadline, "fabricd did not come up: {}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    d
}

impl Daemon {
    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("fabricd.log")).unwrap_or_default()
    }
}

/// A session on `socket` with a 16 TiB window at GFA 0 (covers the sim node).
pub fn session(socket: &Path) -> Session {
    Session::open_with(SessionConfig {
        socket: Some(socket.to_owned()),
        window: Some(WindowConfig::default()),
        client_name: Some("libfabric-mm-test".into()),
        ..SessionConfig::default()
    })
    .unwrap()
}

/// The first GPU with HBM.
pub fn gpu(s: &Session) -> String {
    s.first_device_with(MemoryClass::Hbm).unwrap().expect("the sim fabric has GPUs").id
}
