//! Starts the real `fabricd` binary on a temporary socket and state dir serving the bundled
//! HGX sim fabric, and waits for its readiness datagram (`NOTIFY_SOCKET`).
#![allow(dead_code, clippy::unwrap_used)]

pub mod domain;
pub mod peer;
pub mod scrape;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_proto::wire::{Connection, SUPPORTED_VERSIONS};

/// The sim fabric every test serves.
pub fn sim_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml").canonicalize().unwrap()
}

/// A daemon's files: configuration, socket, state dir.
#[derive(Debug)]
pub struct Setup {
    /// Holds the directory.
    pub dir: tempfile::TempDir,
    /// The configuration file.
    pub config: PathBuf,
    /// The socket.
    pub socket: PathBuf,
    /// The state dir.
    pub state: PathBuf,
}

impl Setup {
    /// A configuration with `extra` TOML appended (e.g. a `[socket]` group line goes in
    /// `socket_extra`).
    pub fn new(socket_extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        // Let an unprivileged test client reach the socket directory.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = dir.path().join("run/fabricd.sock");
        let state = dir.path().join("state");
        let config = dir.path().join("fabricd.toml");
        Self::write(&config, &socket, &state, socket_extra);
        Self { dir, config, socket, state }
    }

    /// Like [`Setup::new`], serving `sim` instead of the bundled HGX fabric, with `extra`
    /// TOML appended at the end (whole tables, e.g. `[limits]`).
    pub fn with_sim(sim: &Path, extra: &str) -> Self {
        let s = Self::new("");
        let text = std::fs::read_to_string(&s.config).unwrap();
        let text = text
            .replace(&format!("{:?}", sim_file().display().to_string()), &format!("{:?}", sim.display().to_string()));
        std::fs::write(&s.config, format!("{text}{extra}\n")).unwrap();
        s
    }

    /// Writes a configuration file.
    pub fn write(config: &Path, socket: &Path, state: &Path, socket_extra: &str) {
        let text = format!(
            "[socket]\npath = {:?}\n{socket_extra}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\n[metrics]\nlisten = \"\"\n",
            socket.display().to_string(),
            state.display().to_string(),
            sim_file().display().to_string()
        );
        std::fs::write(config, text).unwrap();
    }
}

/// A running daemon; killed on drop if still running.
#[derive(Debug)]
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// The readiness message it sent.
    pub ready: String,
    /// Its stderr (the log), in a file so that it never blocks on a full pipe.
    pub log: PathBuf,
    /// The socket it sends service-manager notifications to.
    pub notify: UnixDatagram,
}

impl Daemon {
    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    /// Kills the daemon; when a test fails, its log's last lines go to the test's output
    /// (what CI shows of a failure).
    #[allow(clippy::print_stderr)]
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().filter(|l| !l.contains(" DEBUG ") && !l.contains(" TRACE ")).collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            eprintln!(
                "--- the daemon's last {} lines above debug, {}:\n{}",
                tail.len(),
                self.log.display(),
                tail.join("\n")
            );
        }
    }
}

/// Starts `fabricd --config config` and waits for READY=1 (up to 30 s).
pub fn start(config: &Path, dir: &Path) -> Daemon {
    start_with(config, dir, |_| {})
}

/// [`start`], letting `prepare` adjust the command first (limits, `pre_exec`).
pub fn start_with(config: &Path, dir: &Path, prepare: impl FnOnce(&mut Command)) -> Daemon {
    let notify_path = dir.join(format!("notify-{}", rand_suffix()));
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let log = dir.join(format!("stderr-{}", rand_suffix()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fabricd"));
    cmd.arg("--config")
        .arg(config)
        .env("NOTIFY_SOCKET", &notify_path)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    prepare(&mut cmd);
    let child = cmd.spawn().unwrap();
    let mut buf = [0u8; 256];
    let n = match notify.recv(&mut buf) {
        Ok(n) => n,
        Err(e) => {
            let mut child = child;
            let _ = child.kill();
            let err = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("fabricd did not become ready ({e}); stderr:\n{err}");
        }
    };
    Daemon { child, ready: String::from_utf8_lossy(&buf[..n]).into_owned(), log, notify }
}

/// [`start`] with an open-file limit of `limit`, soft and hard.
pub fn start_with_open_files(config: &Path, dir: &Path, limit: u64) -> Daemon {
    start_with(config, dir, |cmd| {
        use std::os::unix::process::CommandExt;
        // SAFETY: runs in the forked child before exec and makes one async-signal-safe
        // system call on a value on its stack.
        unsafe {
            cmd.pre_exec(move || {
                let r = libc::rlimit { rlim_cur: limit, rlim_max: limit };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &r) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    })
}

/// This test binary re-run as its ignored test `child` (one command a line on stdin, one
/// answer on stdout) under `uid`, primary gid `gid` and the supplementary `groups`, with
/// `socket` in the environment variable `env`. Only numeric ids: nothing in /etc.
pub fn child_as(child: &str, env: &str, socket: &Path, uid: u32, gid: u32, groups: &[u32]) -> Command {
    let groups: Vec<libc::gid_t> = groups.to_vec();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", child, "--nocapture", "--test-threads", "1"])
        .env(env, socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and makes only
    // async-signal-safe system calls (setgroups, setgid, setuid) on data prepared before
    // the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Supplementary groups first, while still root; then gid, then uid.
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

fn rand_suffix() -> String {
    format!("{}-{:?}", std::process::id(), Instant::now()).chars().filter(char::is_ascii_alphanumeric).collect()
}

/// A negotiated client connection.
pub fn client(socket: &Path) -> Connection {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    c.hello("fabricd-test", SUPPORTED_VERSIONS).unwrap();
    c
}

/// Allocates `size` bytes of `gpu`'s HBM: the answer and the region's file.
pub fn alloc_hbm(c: &mut Connection, gpu: &str, size: u64) -> (fabric_proto::wire::AllocResponse, std::fs::File) {
    use fabric_proto::wire::{AllocRequest, AllocTarget, DeviceName, MemoryClass, Request, Response};
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(gpu), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    let (r, fds) = c.call(req, &[]).unwrap();
    let Response::Alloc(a) = r else { panic!("{r:?}") };
    (a, std::fs::File::from(fds.into_iter().next().unwrap()))
}

/// Exports `region` to the owner's uid with `access`: the handle.
pub fn export(
    c: &mut Connection,
    region: u64,
    access: fabric_proto::wire::AccessMode,
) -> fabric_proto::wire::ExportHandle {
    use fabric_proto::wire::{BoundedVec, ExportPolicy, ExportRequest, Request, Response};
    let policy = ExportPolicy { uids: BoundedVec::default(), gids: BoundedVec::default(), partition: None, access };
    let (r, _) = c.call(Request::Export(ExportRequest { region, policy, node: None }), &[]).unwrap();
    let Response::Export(e) = r else { panic!("{r:?}") };
    e.handle
}

/// Waits for the child to exit (up to `secs`).
pub fn wait_exit(child: &mut Child, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "fabricd did not exit within {secs} s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The CXL pool sim fabric (two memdevs in a 2-way interleave set).
pub fn cxl_pool() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap()
}

/// The CXL pool's 2-way set: its name and its members' device ids.
pub fn two_way_set() -> (String, String, String) {
    let inv = fabric_drivers::sim::load(&cxl_pool()).unwrap();
    let set = fabric_addrmap::region_sets(&inv).into_iter().find(|s| s.ways == 2).unwrap();
    (set.name.clone(), set.members[0].device.to_string(), set.members[1].device.to_string())
}

/// An allocation on interleave set `name`.
pub fn on_set(name: &str) -> fabric_proto::wire::AllocTarget {
    fabric_proto::wire::AllocTarget::Set(fabric_proto::wire::Name::truncated(name))
}

/// The size of the DAX device [`dax_fixture`] makes.
pub const DAX_BYTES: u64 = 512 << 30;

/// A fixture sysfs tree under `root` with `dax0.0` (the sim pool's region0 DAX device)
/// bound to device_dax, 2 MiB align, its device file a sparse regular file (a stand-in for
/// device memory: fabricd zeroes a range of it before handing it out).
pub fn dax_fixture(root: &Path) {
    let d = root.join("sys/bus/dax/devices/dax0.0");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("size"), format!("{DAX_BYTES}\n")).unwrap();
    std::fs::write(d.join("align"), format!("{}\n", 2 << 20)).unwrap();
    let drv = root.join("sys/bus/dax/drivers/device_dax");
    std::fs::create_dir_all(&drv).unwrap();
    std::os::unix::fs::symlink(&drv, d.join("driver")).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::File::create(root.join("dev/dax0.0")).unwrap().set_len(DAX_BYTES).unwrap();
}

/// A daemon's files serving the CXL pool (with `extra` TOML) whose 2-way set is backed by
/// the DAX stand-in of [`dax_fixture`] under the setup's `root`; and the set's name.
pub fn dax_backed_set(extra: &str) -> (Setup, String) {
    let (set, _, _) = two_way_set();
    let setup = Setup::with_sim(&cxl_pool(), extra);
    let root = setup.dir.path().join("root");
    dax_fixture(&root);
    configure_dax(&setup, &root, "\"dax0.0\"");
    (setup, set)
}

/// Points the configuration's `[discovery] sysfs_root` at `root` and sets `[memory] dax`.
pub fn configure_dax(setup: &Setup, root: &Path, dax: &str) {
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let mut text = match text.find("[memory]") {
        Some(at) => text[..at].to_owned(),
        None => text.replace("[discovery]\n", &format!("[discovery]\nsysfs_root = {:?}\n", root.display().to_string())),
    };
    text.push_str(&format!("[memory]\nresume_grace_s = 600\ndax = [{dax}]\n"));
    std::fs::write(&setup.config, text).unwrap();
}
