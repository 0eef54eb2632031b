//! Device memory behind the same API: fabricd configured with a DAX device (`[memory] dax`)
//! and a PCI BAR (`[memory] bars`) on the CXL-pool sim fabric, with a fixture sysfs tree
//! whose device files (`dev/dax0.0`, `resource2`) are regular files standing in for the
//! devices. A session allocates on the CXL region's interleave set and on the NIC's BAR,
//! maps at the GFA, stores; a second session imports and loads; and the bytes are read back
//! from the device files at the offsets the daemon carved. The copy engine moves bytes
//! between regions on the two devices by GFA.
//!
//! What this cannot prove is that the kernel's device-DAX and sysfs BAR mappings behave the
//! same (alignment rules, MAP_SHARED only, no read()/write()): the QEMU tier
//! (`qemu-tests/guest/cxl.sh`, `ivshmem.sh`) does that on real devices.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{check, check_file, fill};
use fabric_mm::{CopyEndpoint, Error, Memory, MemoryClass, Policy, Target};

/// The sim CXL pool's region0 (2 x 256 GiB at HPA 0x10_0000_0000) and its DAX device.
const SET: &str = "cxl-region:hpa-0x1000000000";
const DAX_BYTES: u64 = 512 << 30;
const BAR_BYTES: u64 = 4 << 20;

fn sim() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml").canonicalize().unwrap()
}

/// The fixture tree: `dax0.0` bound to device_dax with `align`, and BAR 2 of `bdf`.
fn fixture(root: &Path, align: u64, bdf: &str) {
    common::dax_fixture(root, align, DAX_BYTES, None);
    let dax = std::fs::OpenOptions::new().write(true).open(root.join("dev/dax0.0")).unwrap();
    // What a previous holder left at the start of each device: a new region must not show it.
    dax.write_all_at(&vec![STALE; 8 << 20], 0).unwrap();
    let p = root.join("sys/bus/pci/devices").join(bdf);
    std::fs::create_dir_all(&p).unwrap();
    let zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
    let bar2 = format!("0x00000000fe000000 0x{:016x} 0x0000000000040200\n", 0xfe00_0000 + BAR_BYTES - 1);
    std::fs::write(p.join("resource"), format!("{zero}{zero}{bar2}{zero}{zero}{zero}")).unwrap();
    std::fs::write(p.join("resource2"), vec![STALE; BAR_BYTES as usize]).unwrap();
}

/// The byte a previous holder of the device memory left behind.
const STALE: u8 = 0xee;

/// Checks that the first `len` bytes of a new region's mapping are zeros.
fn check_zero(m: &fabric_mm::Mapping, len: u64) {
    assert!(len as usize <= m.len());
    let p = m.as_ptr().cast::<u64>();
    for i in 0..len as usize / 8 {
        // SAFETY: `p + i` lies in the live mapping; no reference to it exists.
        let got = unsafe { p.add(i).read_volatile() };
        assert_eq!(got, 0, "word {i} of a new region on device memory is not zero");
    }
}

struct Daemon {
    child: std::process::Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts fabricd on the CXL pool with `memory` as its `[memory]` table; `None` when it
/// exits instead (with its log).
fn start(dir: &Path, root: &Path, memory: &str) -> Result<Daemon, String> {
    let socket = dir.join("fabricd.sock");
    let _ = std::fs::remove_file(&socket);
    let config = dir.join("fabricd.toml");
    std::fs::write(
        &config,
        format!(
            "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\nsysfs_root = {:?}\n\
             [metrics]\nlisten = \"\"\n[memory]\n{memory}\n",
            socket.display().to_string(),
            dir.join("state").display().to_string(),
            sim().display().to_string(),
            root.display().to_string(),
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
    let mut d = Daemon { child, socket, log };
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
        if d.child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            return Err(std::fs::read_to_string(&d.log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(d)
}

/// The NIC of the CXL pool, and its PCI address (its id is `pci:NODE/ADDR`).
fn nic(dir: &Path, root: &Path) -> (String, String) {
    let d = start(dir, root, "").unwrap();
    let s = common::session(&d.socket);
    let nic = s.devices().unwrap().into_iter().find(|x| x.kind == "nic").expect("the CXL pool has a NIC");
    let bdf = nic.id.rsplit('/').next().unwrap().to_owned();
    (nic.id, bdf)
}

#[test]
fn regions_on_a_dax_device_and_a_bar_are_ranges_of_the_device_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let (nic, bdf) = nic(dir.path(), &root);
    // A 1 GiB align: the second region starts at the next 1 GiB of the device.
    fixture(&root, 1 << 30, &bdf);
    let memory = format!("dax = [\"dax0.0\"]\nbars = [\"{bdf}/2\"]");
    let d = start(dir.path(), &root, &memory).unwrap_or_else(|log| panic!("fabricd refused: {log}"));
    let owner = common::session(&d.socket);
    let importer = common::session(&d.socket);

    // CXL: two regions on the set, each a range of the DAX device at its align.
    let dax = root.join("dev/dax0.0");
    let a = owner.alloc(&Target::Set(SET.into()), 8 << 20).unwrap();
    let b = owner.alloc(&Target::Set(SET.into()), 8 << 20).unwrap();
    let (ga, gb) = (a.gfa().unwrap(), b.gfa().unwrap());
    assert_eq!(gb - ga, 1 << 30, "the second region starts at the device's next 1 GiB");
    assert_eq!((a.len(), b.len()), (1 << 30, 1 << 30), "DAX regions are whole multiples of its align");
    for (r, seed) in [(&a, 0xa), (&b, 0xb)] {
        let m = owner.map(r).unwrap();
        // `a` is where the previous holder's bytes were: fabricd zeroed them.
        check_zero(&m, 8 << 20);
        fill(&m, seed, 8 << 20);
        let h = owner.export(r, &Policy::default()).unwrap();
        let i = importer.import(&h, false).unwrap();
        assert_eq!(i.gfa(), r.gfa());
        check(&importer.map(&i).unwrap(), seed, 8 << 20);
    }
    // The second path: the device file, at the region's offset in the set.
    check_file(&dax, 0, 8 << 20, 0xa);
    check_file(&dax, 1 << 30, 8 << 20, 0xb);

    // The BAR: a host_exported resource of the NIC, regions are ranges of resource2.
    let bar = root.join("sys/bus/pci/devices").join(&bdf).join("resource2");
    let target = Target::Device { device: nic.clone(), memory: MemoryClass::HostExported };
    let c = owner.alloc(&target, 2 << 20).unwrap();
    let e = owner.alloc(&target, 2 << 20).unwrap();
    check_zero(&owner.map(&c).unwrap(), 2 << 20);
    check_zero(&owner.map(&e).unwrap(), 2 << 20);
    fill(&owner.map(&c).unwrap(), 0xc, 2 << 20);
    fill(&owner.map(&e).unwrap(), 0xe, 2 << 20);
    let h = owner.export(&e, &Policy::default()).unwrap();
    check(&importer.map(&importer.import(&h, false).unwrap()).unwrap(), 0xe, 2 << 20);
    assert_eq!(e.gfa().unwrap() - c.gfa().unwrap(), 2 << 20);
    check_file(&bar, 0, 2 << 20, 0xc);
    check_file(&bar, 2 << 20, 2 << 20, 0xe);
    // The BAR holds two 2 MiB regions and no more.
    assert!(matches!(owner.alloc(&target, 2 << 20), Err(Error::Refused { .. })));

    // The copy engine reaches device memory by GFA through its mappings (the devices'
    // files serve no read()/write()): the BAR's region into the DAX region `a`, and
    // region `b` into `a` — two ranges of one device file — at unaligned offsets.
    let (ge, mib) = (e.gfa().unwrap(), 1u64 << 20);
    let copied = owner.copy(CopyEndpoint::Gfa(ga + 2 * mib), CopyEndpoint::Gfa(ge), 2 * mib).unwrap().wait();
    assert_eq!(copied.unwrap(), 2 * mib);
    let copied = owner.copy(CopyEndpoint::Gfa(ga + 4 * mib + 8), CopyEndpoint::Gfa(gb), mib).unwrap().wait();
    assert_eq!(copied.unwrap(), mib);
    check_file(&dax, 2 * mib, 2 * mib, 0xe);
    check_file(&dax, 4 * mib + 8, mib, 0xb);
    check_file(&dax, 1 << 30, 8 * mib, 0xb);

    // Freeing leaves the device file and its bytes; the range is handed out again, zeroed:
    // the next holder (here the same uid, as well it could be another) never sees them.
    drop(c);
    check_file(&bar, 0, 2 << 20, 0xc);
    let again = owner.alloc(&target, 2 << 20).unwrap();
    assert_eq!(again.gfa(), Some(e.gfa().unwrap() - (2 << 20)));
    assert!(bar.exists() && dax.exists());
    check_zero(&owner.map(&again).unwrap(), 2 << 20);
    let mut back = vec![1u8; 2 << 20];
    std::fs::File::open(&bar).unwrap().read_exact_at(&mut back, 0).unwrap();
    assert!(back.iter().all(|&b| b == 0), "the freed region's bytes are still in the BAR");
    check_file(&bar, 2 << 20, 2 << 20, 0xe);
}

#[test]
fn a_region_on_a_bar_survives_a_daemon_kill_and_its_range_stays_taken() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    let (nic, bdf) = nic(dir.path(), &root);
    fixture(&root, 2 << 20, &bdf);
    let memory = format!("bars = [\"{bdf}/2\"]\nresume_grace_s = 600");
    let mut d = start(dir.path(), &root, &memory).unwrap_or_else(|log| panic!("fabricd refused: {log}"));
    let target = Target::Device { device: nic, memory: MemoryClass::HostExported };
    let s = common::session(&d.socket);
    let r = s.alloc(&target, 2 << 20).unwrap();
    let gfa = r.gfa().unwrap();
    fill(&s.map(&r).unwrap(), 0x51, 2 << 20);
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let bar = root.join("sys/bus/pci/devices").join(&bdf).join("resource2");
    check_file(&bar, 0, 2 << 20, 0x51);
    // Restarted on the same state: the region is back (its owner, this process, lives and
    // has the grace period to resume), so its range is not handed out again.
    let d = start(dir.path(), &root, &memory).unwrap_or_else(|log| panic!("fabricd refused: {log}"));
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert!(!log.contains("is missing") && !log.contains("not inside"), "the region was dropped at restart: {log}");
    let t = common::session(&d.socket);
    let next = t.alloc(&target, 2 << 20).unwrap();
    assert_eq!(next.gfa(), Some(gfa + (2 << 20)), "the restored region keeps its range");
    assert!(t.alloc(&target, 2 << 20).is_err(), "the 4 MiB BAR is full");
    assert!(bar.exists());
    check_file(&bar, 0, 2 << 20, 0x51);
}

#[test]
fn device_memory_the_fabric_cannot_serve_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir_all(&root).unwrap();
    fixture(&root, 2 << 20, "0000:00:05.0");
    for (memory, why) in [
        ("dax = [\"dax7.0\"]", "dax7.0"),
        ("dax = [\"/dev/dax0.0\"]", "not a DAX device name"),
        ("bars = [\"0000:00:05.0/3\"]", "0000:00:05.0/3"),
        ("bars = [\"0000:00:05.0\"]", "not a BAR"),
        ("bars = [\"0000:00:05.0/2\"]", "no resource in the fabric"),
    ] {
        match start(dir.path(), &root, memory) {
            Ok(mut d) => {
                if why.contains("no resource") {
                    // The function is not in the sim fabric: served without it, and said so.
                    let s = common::session(&d.socket);
                    assert!(
                        s.devices().unwrap().iter().all(|x| x.memory.iter().all(|m| m.0 != MemoryClass::HostExported))
                    );
                    let _ = d.child.kill();
                    let _ = d.child.wait();
                    let log = std::fs::read_to_string(&d.log).unwrap();
                    assert!(log.contains("not in the fabric"), "{log}");
                    continue;
                }
                panic!("fabricd started with {memory}");
            }
            Err(log) => assert!(log.contains(why), "{memory}: {log}"),
        }
    }
}
