//! A NUMA node as region memory: fabricd discovers this host (the `pci` backend adds a
//! `numaN` device per node) and serves node 0 through `[memory] numa_plain`. A session
//! allocates on the node's `host_exported` memory, maps it at its GFA and stores; a second
//! session imports and loads; and the kernel's own account (`/proc/self/numa_maps`) shows the
//! mapping bound to node 0 with every page there. The region is a tmpfs file under
//! `numa_dir`: it outlives a `kill -9` of the daemon, and the restarted daemon checks its
//! pages and serves it again. `[memory] numa = [0]` is refused: node 0 has CPUs and is not
//! CXL memory.
//!
//! The QEMU tier (`qemu-tests/guest/numa.sh`) does the same on a memory-only node of CXL
//! memory onlined by `kmem`.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fabric_mm::{Memory, MemoryClass, Policy, Target};

struct Daemon {
    child: std::process::Child,
    socket: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts fabricd on this host's sysfs (pci backend only) with `memory` as its `[memory]`
/// table; `Err(log)` when it exits instead.
fn start(dir: &Path, memory: &str) -> Result<Daemon, String> {
    let socket = dir.join("fabricd.sock");
    let config = dir.join("fabricd.toml");
    std::fs::write(
        &config,
        format!(
            "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsysfs_root = \"/\"\nbackends = [\"pci\"]\n\
             rescan_interval_s = 0\nuevents = \"off\"\n[metrics]\nlisten = \"\"\n[memory]\n{memory}\n",
            socket.display().to_string(),
            dir.join("state").display().to_string(),
        ),
    )
    .unwrap();
    let log = dir.join("fabricd.log");
    let child = Command::new(common::fabricd_bin())
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut d = Daemon { child, socket };
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
        if d.child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            return Err(std::fs::read_to_string(&log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(d)
}

/// A private tmpfs directory for the daemon's NUMA region files (removed when the first
/// value drops), and the `[memory]` lines that serve node 0 with it (`None`: no /dev/shm).
fn numa_plain_0() -> Option<(tempfile::TempDir, PathBuf, String)> {
    let shm = tempfile::tempdir_in("/dev/shm").ok()?;
    let numa_dir = shm.path().join("numa");
    let memory = format!("numa_plain = [0]\nnuma_dir = {:?}", numa_dir.display().to_string());
    Some((shm, numa_dir, memory))
}

fn word(seed: u64, off: u64) -> u64 {
    (off ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The `/proc/self/numa_maps` line of the mapping starting at `addr`.
fn numa_maps_line(addr: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/numa_maps").unwrap();
    let want = format!("{addr:x} ");
    maps.lines().find(|l| l.starts_with(&want)).unwrap_or_else(|| panic!("no numa_maps line at {addr:#x}")).to_owned()
}

/// Pages the kernel counts on each node in a numa_maps line (`N0=1024`).
fn pages_per_node(line: &str) -> Vec<(u32, u64)> {
    line.split_whitespace()
        .filter_map(|f| f.strip_prefix('N')?.split_once('='))
        .filter_map(|(n, c)| Some((n.parse().ok()?, c.parse().ok()?)))
        .collect()
}

#[test]
fn a_region_on_a_numa_node_is_a_bound_file_shared_by_import() {
    let dir = tempfile::tempdir().unwrap();
    if !Path::new("/sys/devices/system/node/node0").exists() {
        eprintln!("skipped: this kernel shows no NUMA node 0");
        return;
    }
    let Some((_shm, numa_dir, memory)) = numa_plain_0() else { return };
    let d = start(dir.path(), &memory).unwrap_or_else(|log| panic!("fabricd did not start: {log}"));
    let s = common::session(&d.socket);
    let dev = s
        .devices()
        .unwrap()
        .into_iter()
        .find(|d| d.id.ends_with("/numa0") && d.memory.iter().any(|m| m.0 == MemoryClass::HostExported))
        .expect("numa0 with host_exported memory");
    let target = Target::Device { device: dev.id.clone(), memory: MemoryClass::HostExported };
    let len = 4u64 << 20;
    let region = s.alloc(&target, len).unwrap();
    assert_eq!(region.fd_offset(), 0, "a file per region");
    assert!(region.gfa().is_some(), "host_exported memory is in the address map");
    let m = s.map(&region).unwrap();
    let p = m.as_ptr().cast::<u64>();
    for i in 0..len as usize / 8 {
        // SAFETY: `p + i` lies in the live read-write mapping; no reference to it exists.
        unsafe { p.add(i).write_volatile(word(7, i as u64 * 8)) };
    }
    // The kernel's account: the mapping follows the file's shared policy (bound to node 0,
    // set by fabricd's mbind) and all its pages are on node 0.
    let line = numa_maps_line(m.as_ptr() as usize);
    assert!(line.contains("bind:0"), "{line}");
    assert!(line.contains(&format!("file={}", numa_dir.display())), "the daemon's region file: {line}");
    let pages = pages_per_node(&line);
    assert_eq!(pages, vec![(0, len / 4096)], "{line}");

    let handle = s.export(&region, &Policy::default()).unwrap();
    let other = common::session(&d.socket);
    let import = other.import(&handle, false).unwrap();
    assert_eq!(import.gfa(), region.gfa());
    let mi = other.map(&import).unwrap();
    let q = mi.as_ptr().cast::<u64>();
    for i in 0..len as usize / 8 {
        // SAFETY: `q + i` lies in the live read-only mapping of the import.
        let got = unsafe { q.add(i).read_volatile() };
        assert_eq!(got, word(7, i as u64 * 8), "offset {:#x}", i * 8);
    }
    // Read-only import: the library mapped it without write access.
    assert!(numa_maps_line(mi.as_ptr() as usize).contains("bind:0"));
}

#[test]
fn a_node_with_cpus_is_refused_as_cxl_memory() {
    if !Path::new("/sys/devices/system/node/node0/cpulist").exists() {
        eprintln!("skipped: this kernel shows no NUMA node 0");
        return;
    }
    let cpus = std::fs::read_to_string("/sys/devices/system/node/node0/cpulist").unwrap();
    if cpus.trim().is_empty() {
        eprintln!("skipped: node 0 has no CPUs here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = start(dir.path(), "numa = [0]").err().expect("fabricd refuses node 0 as CXL memory");
    assert!(log.contains("numa_plain"), "the refusal names the way out: {log}");
    // A node that does not exist.
    let dir = tempfile::tempdir().unwrap();
    let log = start(dir.path(), "numa_plain = [999]").err().expect("fabricd refuses a missing node");
    assert!(log.contains("NUMA node 999 does not exist"), "{log}");
}

#[test]
fn a_node_region_outlives_a_daemon_restart() {
    if !Path::new("/sys/devices/system/node/node0").exists() {
        eprintln!("skipped: this kernel shows no NUMA node 0");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some((_shm, numa_dir, memory)) = numa_plain_0() else { return };
    let d = start(dir.path(), &memory).unwrap_or_else(|log| panic!("fabricd did not start: {log}"));
    let s = common::session(&d.socket);
    let token = s.token().expect("fabricd speaks 1.1");
    let dev = s.devices().unwrap().into_iter().find(|d| d.id.ends_with("/numa0")).expect("numa0");
    let region = s.alloc(&Target::Device { device: dev.id, memory: MemoryClass::HostExported }, 2 << 20).unwrap();
    let gfa = region.gfa();
    let handle = s.export(&region, &Policy::default()).unwrap();
    let m = s.map(&region).unwrap();
    // SAFETY: the first word of the live read-write mapping; no reference to it exists.
    unsafe { m.as_ptr().cast::<u64>().write_volatile(0xfeed) };
    drop(d); // SIGKILL
    // SAFETY: as above, a read: the mapping holds the file.
    assert_eq!(unsafe { m.as_ptr().cast::<u64>().read_volatile() }, 0xfeed);
    std::mem::forget(m); // its session is gone: nothing to unmap through
    std::mem::forget(region);
    std::mem::forget(s);

    // The journaled region comes back: its file is still on node 0, and this process (its
    // owner) is alive, so it waits for the owner's session to be resumed.
    let d = start(dir.path(), &memory).unwrap_or_else(|log| panic!("fabricd did not restart: {log}"));
    let log = std::fs::read_to_string(dir.path().join("fabricd.log")).unwrap();
    assert!(!log.contains("dropped at start"), "{log}");
    let config = fabric_mm::SessionConfig {
        socket: Some(d.socket.clone()),
        resume: Some(token),
        ..fabric_mm::SessionConfig::default()
    };
    let back = fabric_mm::Session::open_with(config).unwrap();
    let other = common::session(&d.socket);
    let import = other.import(&handle, false).unwrap();
    assert_eq!(import.gfa(), gfa, "the same place in the address map");
    let mi = other.map(&import).unwrap();
    // SAFETY: the first word of the live read-only mapping of the import.
    assert_eq!(unsafe { mi.as_ptr().cast::<u64>().read_volatile() }, 0xfeed);
    let line = numa_maps_line(mi.as_ptr() as usize);
    assert!(line.contains("bind:0") && line.contains(&format!("file={}", numa_dir.display())), "{line}");
    drop((mi, import, other));

    // A file that is not where the journal says (here: removed while no daemon ran) drops
    // its region at the next start, with the reason (the resumed owner still holds it).
    drop(d);
    std::mem::forget(back);
    for e in std::fs::read_dir(&numa_dir).unwrap().flatten() {
        for f in std::fs::read_dir(e.path()).unwrap().flatten() {
            std::fs::remove_file(f.path()).unwrap();
        }
    }
    let _d = start(dir.path(), &memory).unwrap_or_else(|log| panic!("fabricd did not restart: {log}"));
    let log = std::fs::read_to_string(dir.path().join("fabricd.log")).unwrap();
    assert!(log.contains("dropped at start") && log.contains("is missing"), "{log}");
}
