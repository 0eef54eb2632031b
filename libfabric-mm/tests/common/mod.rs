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
    d.wait_up();
    d
}

impl Daemon {
    /// Waits until its socket answers.
    fn wait_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&self.socket).is_err() {
            assert!(Instant::now() < deadline, "fabricd did not come up: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops it (SIGTERM: a domain node gives its lease back, so its name is free at
    /// once) and starts it again on its configuration (`fabricd.toml`, which the test may
    /// have edited) and state; its log goes on in the same file.
    pub fn restart(&mut self) {
        // SAFETY: kill(2) on our own child's pid, which it keeps until we reap it.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "fabricd did not stop on SIGTERM: {}", self.log());
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = std::fs::OpenOptions::new().append(true).open(self.dir.path().join("fabricd.log")).unwrap();
        self.child = Command::new(fabricd_bin())
            .arg("--config")
            .arg(self.dir.path().join("fabricd.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.wait_up();
    }

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

/// A fixture sysfs tree under `root` with `dax0.0` (the sim CXL pool's region0 DAX device)
/// bound to device_dax with `align`; its device file `dev/dax0.0` is a regular file of
/// `bytes`, standing in for the device — or a hard link to `shared` when given (hosts that
/// share one device's memory).
pub fn dax_fixture(root: &Path, align: u64, bytes: u64, shared: Option<&Path>) {
    let d = root.join("sys/bus/dax/devices/dax0.0");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("size"), format!("{bytes}\n")).unwrap();
    std::fs::write(d.join("align"), format!("{align}\n")).unwrap();
    let drv = root.join("sys/bus/dax/drivers/device_dax");
    std::fs::create_dir_all(&drv).unwrap();
    std::os::unix::fs::symlink(&drv, d.join("driver")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    let dev = root.join("dev/dax0.0");
    match shared {
        Some(file) => std::fs::hard_link(file, &dev).unwrap(),
        None => std::fs::File::create(&dev).unwrap().set_len(bytes).unwrap(),
    }
}

/// The pattern's word at byte `off` for `seed`.
pub fn word(seed: u64, off: u64) -> u64 {
    (off ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Stores the pattern in the first `len` bytes of a mapping.
pub fn fill(m: &fabric_mm::Mapping, seed: u64, len: u64) {
    assert!(len as usize <= m.len());
    let p = m.as_ptr().cast::<u64>();
    for i in 0..len as usize / 8 {
        // SAFETY: `p + i` lies in the live read-write mapping; no reference to it exists.
        unsafe { p.add(i).write_volatile(word(seed, i as u64 * 8)) };
    }
}

/// Checks the pattern in the first `len` bytes of a mapping.
pub fn check(m: &fabric_mm::Mapping, seed: u64, len: u64) {
    assert!(len as usize <= m.len());
    let p = m.as_ptr().cast::<u64>();
    for i in 0..len as usize / 8 {
        // SAFETY: as in `fill`, read-only.
        let got = unsafe { p.add(i).read_volatile() };
        assert_eq!(got, word(seed, i as u64 * 8), "word {i} through the importer's mapping");
    }
}

/// Checks the pattern in a device file at `offset`.
pub fn check_file(path: &Path, offset: u64, len: u64, seed: u64) {
    let mut buf = vec![0u8; len as usize];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(path).unwrap(), &mut buf, offset).unwrap();
    for (i, w) in buf.chunks_exact(8).enumerate() {
        let got = u64::from_le_bytes(w.try_into().unwrap());
        assert_eq!(got, word(seed, i as u64 * 8), "{} at {:#x}", path.display(), offset + i as u64 * 8);
    }
}
