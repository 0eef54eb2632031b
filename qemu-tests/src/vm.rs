//! Boots one QEMU guest for one test: builds its initramfs (the cached base image plus an
//! overlay with the project's static binaries and the test's script), starts QEMU with the
//! console on a log file, waits for the guest to power off within the test's timeout, and
//! collects what came back: `FABRIC-TEST-RESULT` markers from the console and the blobs the
//! guest wrote to its second serial port.
//!
//! Accelerator: KVM when `/dev/kvm` opens, else TCG; `FABRIC_QEMU_ACCEL=tcg|kvm` forces one.
//! A KVM that fails inside the guest (nested setups do: "KVM internal error") is noted in
//! `target/qemu-tests/kvm-unusable` and the test reruns under TCG, as do later tests.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::cpio::{Entry, write_archive};
use crate::env::Prereqs;
use crate::qmp::{Qmp, QmpError};

/// Why a guest could not be run to the end.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A file of the run could not be written or read.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// QEMU could not be started.
    #[error("starting {0}")]
    Spawn(String, #[source] std::io::Error),
    /// QEMU exited with an error before the guest finished.
    #[error("QEMU exited with {status} before the guest finished; qemu.log: {log}\n--- guest console ---\n{console}")]
    QemuFailed {
        /// Exit status.
        status: String,
        /// QEMU's stderr.
        log: String,
        /// The guest console up to then.
        console: String,
    },
    /// The guest did not power off in time.
    #[error("the guest did not finish within {0:?}\n--- guest console ---\n{1}")]
    Timeout(Duration, String),
    /// QMP failed.
    #[error(transparent)]
    Qmp(#[from] QmpError),
}

impl VmError {
    /// Whether the guest's kernel oopsed or panicked before the image's init said it booted:
    /// a failure of the guest kernel or the hypervisor, before any of the test ran.
    pub fn kernel_died_booting(&self) -> bool {
        let console = match self {
            VmError::QemuFailed { console, .. } | VmError::Timeout(_, console) => console,
            _ => return false,
        };
        !console.contains(BOOTED)
            && ["Kernel panic - not syncing", "Oops: ", "BUG: "].iter().any(|m| console.contains(m))
    }
}

/// What the image's init prints on the console once the guest booted (`scripts/qemu-image.sh`).
const BOOTED: &str = "FABRIC-GUEST-BOOTED";

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |e| VmError::Io(what, e)
}

/// What one test's guest looks like.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Test name: the log directory's name.
    pub name: String,
    /// QEMU arguments after the common ones (devices, objects, `-M` options).
    pub args: Vec<String>,
    /// The guest's `/fabric/test.sh`.
    pub script: String,
    /// Guest memory in MiB.
    pub mem_mib: u32,
    /// Everything (boot, test, power-off) must fit in this.
    pub timeout: Duration,
    /// `q35` machine options beyond the defaults (e.g. `cxl=on`).
    pub machine: String,
    /// Extra kernel command line (e.g. `intel_iommu=on`).
    pub append: String,
    /// Extra files for the overlay archive: path (relative to `/`) and contents.
    pub files: Vec<(String, Vec<u8>)>,
}

impl VmSpec {
    /// A spec with the defaults: 1 GiB, q35, 240 s.
    pub fn new(name: &str, script: &str) -> Self {
        VmSpec {
            name: name.to_owned(),
            args: Vec::new(),
            script: script.to_owned(),
            mem_mib: 1024,
            timeout: Duration::from_secs(240),
            machine: "q35".to_owned(),
            append: String::new(),
            files: Vec::new(),
        }
    }

    /// Appends QEMU arguments.
    pub fn arg(&mut self, a: impl Into<String>) -> &mut Self {
        self.args.push(a.into());
        self
    }

    /// Appends `-device SPEC`.
    pub fn device(&mut self, spec: impl Into<String>) -> &mut Self {
        self.arg("-device").arg(spec)
    }

    /// Appends `-object SPEC`.
    pub fn object(&mut self, spec: impl Into<String>) -> &mut Self {
        self.arg("-object").arg(spec)
    }
}

/// The accelerator a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// QEMU's translator: slow, always there.
    Tcg,
}

fn pick_accel(logs: &Path) -> Accel {
    match std::env::var("FABRIC_QEMU_ACCEL").as_deref() {
        Ok("tcg") => return Accel::Tcg,
        Ok("kvm") => return Accel::Kvm,
        _ => {}
    }
    if logs.join("kvm-unusable").exists() {
        return Accel::Tcg;
    }
    match fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        Ok(_) => Accel::Kvm,
        Err(_) => Accel::Tcg,
    }
}

/// A booted guest: QEMU running, its logs in [`Guest::dir`].
#[derive(Debug)]
pub struct Guest {
    /// The run's directory (`target/qemu-tests/NAME/`): console.log, data.log, qemu.log.
    pub dir: PathBuf,
    /// The accelerator in use.
    pub accel: Accel,
    child: Child,
    started: Instant,
    timeout: Duration,
}

impl Guest {
    /// Builds the initramfs and starts QEMU.
    pub fn start(pre: &Prereqs, spec: &VmSpec) -> Result<Guest, VmError> {
        let root = pre.logs.clone();
        let dir = root.join(&spec.name);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let initrd = dir.join("initrd.img");
        build_initrd(pre, spec, &initrd)?;
        let accel = pick_accel(&root);
        match Self::boot(pre, spec, &dir, &initrd, accel) {
            Err(e) if e.kernel_died_booting() => {
                // The guest kernel died before the image's init ran: nothing of the test had
                // happened yet. Seen once under nested KVM (an int3 oops in the kernel's own
                // boot-time code patching). Its console is kept; the guest boots once more.
                let _ = fs::rename(dir.join("console.log"), dir.join("console-failed-boot.log"));
                #[allow(clippy::print_stderr)] // The harness's note in the test's output.
                {
                    eprintln!("{}: the guest kernel died while booting; booting it once more", spec.name);
                }
                Self::boot(pre, spec, &dir, &initrd, pick_accel(&root))
            }
            r => r,
        }
    }

    /// Starts QEMU and waits for the image's init to say it booted; a KVM guest that does
    /// not boot is started again under TCG.
    fn boot(pre: &Prereqs, spec: &VmSpec, dir: &Path, initrd: &Path, accel: Accel) -> Result<Guest, VmError> {
        let root = pre.logs.clone();
        let mut guest = Self::spawn(pre, spec, dir, initrd, accel)?;
        if accel == Accel::Kvm {
            // A KVM guest boots in seconds; one that has not within a minute is stuck.
            guest.timeout = guest.timeout.min(Duration::from_secs(60));
        }
        match guest.wait_console(BOOTED) {
            Ok(()) => {
                guest.timeout = spec.timeout;
                Ok(guest)
            }
            Err(e) if e.kernel_died_booting() => Err(e),
            Err(_) if accel == Accel::Kvm && !std::env::var("FABRIC_QEMU_ACCEL").is_ok_and(|a| a == "kvm") => {
                // Remembered for later tests: each would otherwise lose time finding out.
                let _ = fs::write(root.join("kvm-unusable"), read_lossy(&dir.join("qemu.log")));
                drop(guest);
                let _ = fs::rename(dir.join("qemu.log"), dir.join("qemu-kvm-failed.log"));
                let mut guest = Self::spawn(pre, spec, dir, initrd, Accel::Tcg)?;
                guest.wait_console(BOOTED)?;
                Ok(guest)
            }
            Err(e) => Err(e),
        }
    }

    fn spawn(pre: &Prereqs, spec: &VmSpec, dir: &Path, initrd: &Path, accel: Accel) -> Result<Guest, VmError> {
        let cpu = match accel {
            // -arch-capabilities: nested KVM refuses that MSR.
            Accel::Kvm => "max,hypervisor=off,-arch-capabilities",
            // hypervisor=off: 6.12 commits CXL regions only on "bare metal".
            Accel::Tcg => "max,hypervisor=off",
        };
        let d = |f: &str| dir.join(f).display().to_string();
        let mut cmd = Command::new(&pre.qemu);
        cmd.args(["-accel", if accel == Accel::Kvm { "kvm" } else { "tcg" }])
            .args(["-cpu", cpu, "-smp", &std::env::var("FABRIC_QEMU_SMP").unwrap_or_else(|_| "2".into())])
            .args(["-nodefaults", "-display", "none", "-no-reboot"])
            .arg("-M")
            .arg(&spec.machine)
            .arg("-m")
            .arg(format!("{}M", spec.mem_mib))
            .arg("-kernel")
            .arg(&pre.kernel)
            .arg("-initrd")
            .arg(initrd)
            .arg("-append")
            .arg(format!("console=ttyS0 loglevel=4 panic=-1 oops=panic {}", spec.append))
            .arg("-serial")
            .arg(format!("file:{}", d("console.log")))
            .arg("-serial")
            .arg(format!("file:{}", d("data.log")))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", d("qmp.sock")))
            .args(&spec.args)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let qlog = fs::File::create(dir.join("qemu.log")).map_err(io("creating qemu.log"))?;
        cmd.stderr(qlog);
        let mut cmdline = fs::File::create(dir.join("qemu.cmdline")).map_err(io("creating qemu.cmdline"))?;
        let _ = writeln!(cmdline, "{:?}", cmd);
        let child = cmd.spawn().map_err(|e| VmError::Spawn(pre.qemu.display().to_string(), e))?;
        Ok(Guest { dir: dir.to_path_buf(), accel, child, started: Instant::now(), timeout: spec.timeout })
    }

    /// Connects to the guest's QMP socket.
    pub fn qmp(&self) -> Result<Qmp, VmError> {
        Ok(Qmp::connect(&self.dir.join("qmp.sock"), Duration::from_secs(20))?)
    }

    /// The console so far.
    pub fn console(&self) -> String {
        read_lossy(&self.dir.join("console.log"))
    }

    /// Waits (within the test's timeout) until the console has a line containing `needle`.
    pub fn wait_console(&mut self, needle: &str) -> Result<(), VmError> {
        loop {
            if self.console().contains(needle) {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait().map_err(io("waiting for QEMU"))? {
                return Err(self.qemu_failed(st));
            }
            if self.kvm_failed() || self.started.elapsed() > self.timeout {
                return Err(VmError::Timeout(self.timeout, self.console()));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn qemu_failed(&self, status: std::process::ExitStatus) -> VmError {
        VmError::QemuFailed {
            status: status.to_string(),
            log: read_lossy(&self.dir.join("qemu.log")),
            console: self.console(),
        }
    }

    fn kvm_failed(&self) -> bool {
        self.accel == Accel::Kvm && {
            let log = read_lossy(&self.dir.join("qemu.log"));
            log.contains("KVM internal error") || log.contains("failed to set MSR")
        }
    }

    /// What the guest wrote to its data port (ttyS1) so far.
    pub fn data(&self) -> String {
        read_lossy(&self.dir.join("data.log"))
    }

    /// Waits (within the test's timeout) until `done` holds for the data port's contents.
    pub fn wait_data(&mut self, done: impl Fn(&str) -> bool) -> Result<(), VmError> {
        loop {
            if done(&self.data()) {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait().map_err(io("waiting for QEMU"))? {
                return Err(self.qemu_failed(st));
            }
            if self.kvm_failed() || self.started.elapsed() > self.timeout {
                return Err(VmError::Timeout(self.timeout, self.console()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Cuts the guest's power: SIGKILL of QEMU, so the guest gets no chance to write back
    /// anything it still holds (its page cache, requests QEMU has not completed). What
    /// QEMU already wrote to its disk images stays (the host is up). Collects the results.
    pub fn cut_power(mut self) -> Result<Outcome, VmError> {
        if let Some(st) = self.child.try_wait().map_err(io("waiting for QEMU"))? {
            return Err(self.qemu_failed(st));
        }
        self.child.kill().map_err(io("killing QEMU"))?;
        self.child.wait().map_err(io("waiting for QEMU"))?;
        Ok(Outcome::parse(&self.dir, self.accel, self.started.elapsed()))
    }

    /// Waits for QEMU to exit (the guest powers off) and collects the results.
    pub fn finish(mut self) -> Result<Outcome, VmError> {
        let status = loop {
            if let Some(st) = self.child.try_wait().map_err(io("waiting for QEMU"))? {
                break st;
            }
            if self.kvm_failed() || self.started.elapsed() > self.timeout {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Err(VmError::Timeout(self.timeout, self.console()));
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let elapsed = self.started.elapsed();
        if !status.success() {
            return Err(self.qemu_failed(status));
        }
        Ok(Outcome::parse(&self.dir, self.accel, elapsed))
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn read_lossy(p: &Path) -> String {
    fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

fn build_initrd(pre: &Prereqs, spec: &VmSpec, out: &Path) -> Result<(), VmError> {
    let script = &spec.script;
    let mut entries = vec![Entry::Dir("fabric".into()), Entry::Dir("fabric/bin".into())];
    for b in &pre.binaries {
        let data = fs::read(b).map_err(io(format!("reading {}", b.display())))?;
        let name = b.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        entries.push(Entry::File(format!("fabric/bin/{name}"), data, 0o755));
    }
    entries.push(Entry::File("fabric/common.sh".into(), crate::scripts::COMMON.as_bytes().to_vec(), 0o644));
    entries.push(Entry::File("fabric/test.sh".into(), script.as_bytes().to_vec(), 0o755));
    for (path, data) in &spec.files {
        entries.push(Entry::File(path.trim_start_matches('/').to_owned(), data.clone(), 0o644));
    }
    let mut img = fs::read(&pre.base_initrd).map_err(io(format!("reading {}", pre.base_initrd.display())))?;
    // The kernel looks for the next archive's header only at 4-byte offsets, skipping zeros.
    img.resize(img.len().next_multiple_of(4), 0);
    write_archive(&entries, &mut img).map_err(io("writing the overlay archive"))?;
    fs::write(out, img).map_err(io(format!("writing {}", out.display())))
}

/// One `FABRIC-TEST-RESULT NAME ok|fail DETAIL` line from the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Whether it passed.
    pub ok: bool,
    /// The rest of the line.
    pub detail: String,
}

/// What a finished guest reported.
#[derive(Debug)]
pub struct Outcome {
    /// The run's directory.
    pub dir: PathBuf,
    /// The accelerator used.
    pub accel: Accel,
    /// Boot to power-off.
    pub elapsed: Duration,
    /// The console.
    pub console: String,
    /// Guest checks by name (a name reported twice keeps the last).
    pub checks: BTreeMap<String, Check>,
    /// Blobs from the data port by name.
    pub blobs: BTreeMap<String, String>,
    /// The init's `FABRIC-GUEST-EXIT` status, if it got that far.
    pub exit: Option<i32>,
}

impl Outcome {
    /// Parses the logs in `dir`.
    pub fn parse(dir: &Path, accel: Accel, elapsed: Duration) -> Outcome {
        let console = read_lossy(&dir.join("console.log")).replace('\r', "");
        let mut checks = BTreeMap::new();
        let mut exit = None;
        for line in console.lines() {
            if let Some(rest) = line.split("FABRIC-TEST-RESULT ").nth(1) {
                let mut it = rest.splitn(3, ' ');
                let (Some(name), Some(verdict)) = (it.next(), it.next()) else { continue };
                let detail = it.next().unwrap_or("").to_owned();
                checks.insert(name.to_owned(), Check { ok: verdict == "ok", detail });
            }
            if let Some(rest) = line.split("FABRIC-GUEST-EXIT ").nth(1) {
                exit = rest.split_whitespace().next().and_then(|s| s.parse().ok());
            }
        }
        let data = read_lossy(&dir.join("data.log")).replace('\r', "");
        let mut blobs = BTreeMap::new();
        let mut current: Option<(String, String)> = None;
        for line in data.lines() {
            if let Some(name) = line.strip_prefix("FABRIC-BLOB-BEGIN ") {
                current = Some((name.trim().to_owned(), String::new()));
            } else if line.starts_with("FABRIC-BLOB-END") {
                if let Some((n, b)) = current.take() {
                    blobs.insert(n, b);
                }
            } else if let Some((_, b)) = current.as_mut() {
                b.push_str(line);
                b.push('\n');
            }
        }
        // Kept beside the console for whoever reads a failure (NAME.json, NAME.txt).
        for (name, body) in &blobs {
            let ext = if body.trim_start().starts_with(['{', '[']) { "json" } else { "txt" };
            let _ = fs::write(dir.join(format!("{name}.{ext}")), body);
        }
        Outcome { dir: dir.to_path_buf(), accel, elapsed, console, checks, blobs, exit }
    }

    /// The blob named `name`, or a panic that shows the console.
    pub fn blob(&self, name: &str) -> &str {
        match self.blobs.get(name) {
            Some(b) => b,
            None => self.fail(&format!("the guest sent no blob {name:?}")),
        }
    }

    /// Asserts the guest check `name` passed.
    pub fn expect_check(&self, name: &str) -> &Check {
        match self.checks.get(name) {
            Some(c) if c.ok => c,
            Some(c) => self.fail(&format!("guest check {name} failed: {}", c.detail)),
            None => self.fail(&format!("guest check {name} was never reported")),
        }
    }

    /// Panics with `msg` and the guest's console (the log stays in [`Outcome::dir`]).
    pub fn fail(&self, msg: &str) -> ! {
        panic!(
            "{msg}\n--- guest console ({}) ---\n{}\n--- end of console ---",
            self.dir.join("console.log").display(),
            self.console
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_kernel_death_before_init_is_a_boot_failure() {
        let died =
            |console: &str| VmError::QemuFailed { status: "0".into(), log: String::new(), console: console.into() };
        assert!(
            died("[ 1.9] Oops: int3: 0000 [#1]\n[ 1.9] Kernel panic - not syncing: Fatal exception")
                .kernel_died_booting()
        );
        assert!(
            VmError::Timeout(Duration::from_secs(1), "[ 0.5] BUG: kernel NULL pointer".into()).kernel_died_booting()
        );
        // After init said it booted, a panic is the test's own finding.
        assert!(!died("FABRIC-GUEST-BOOTED 6.12\nKernel panic - not syncing").kernel_died_booting());
        assert!(!died("[ 1.0] booting quietly").kernel_died_booting());
        assert!(!VmError::Spawn("qemu".into(), std::io::Error::other("x")).kernel_died_booting());
    }
}
