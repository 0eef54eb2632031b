//! Memory of one domain node mapped by a client of another, through the library alone:
//! two real fabricd nodes (a private etcd, certificates from a test CA, the sim's shared
//! fabric); a session on tray1 imports a handle a session on tray0 exported — nothing
//! new to learn for a remote handle — maps it at its GFA in a window over tray0's slot,
//! reads tray0's stores and stores back, which tray0 reads; when tray0's region is freed
//! the importer's revocation callback runs with `Freed` and the import reports revoked,
//! and another importer process's next load through a stale mapping of its own (an `mmap`
//! of the import's descriptor the library does not know) dies of SIGBUS (the owner
//! truncated the region's file): it never reads memory that may be reused. When the owner
//! only revokes its export (the region lives on), the library fences an importer
//! process's mapping as its callback is told: its next load dies of SIGSEGV, while the
//! owner goes on using the region.
//!
//! That importer process is this same test binary re-run with `--ignored --exact
//! importer_process`.
//!
//! A node without the shared fabric (class NET): the same import call gives copy-only
//! memory (no mapping: `Error::CopyOnly`), and `Session::copy` between a registration
//! and its GFA moves the bytes over the node link, both ways.
//!
//! Without an `etcd` binary it says it is skipped (scripts/deps.sh installs it).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::domain::{self, SPAN};
use fabric_mm::{Error, Handle, Memory, MemoryClass, Policy, RevocationReason, Target, WindowConfig};

const LEN: u64 = 2 << 20;
const ENV: &str = "FABRIC_MM_CROSSNODE_IMPORTER";

/// The permissions `/proc/self/maps` gives the page at `p` (`rw-s`; `---p` once fenced).
fn perms(p: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (range, perms) = (f.next().unwrap(), f.next().unwrap());
        let (lo, hi) = range.split_once('-').unwrap();
        if (usize::from_str_radix(lo, 16).unwrap()..usize::from_str_radix(hi, 16).unwrap()).contains(&p) {
            return perms.to_owned();
        }
    }
    "unmapped".into()
}

/// The second importer: `socket slot handle through` in [`ENV`]; imports and maps (in
/// the library's window; `through` = `raw`: also an `mmap` of its own of the import's
/// descriptor, loaded through instead), says `MAPPED`, says `REVOKED <reason> <perms>`
/// when its revocation callback runs (with what its mapping's page is then), and at each
/// `LOAD` line loads the first byte and says `LOADED <byte>` (once the memory is taken
/// back it should not live to say it).
#[test]
#[ignore = "the importer process of the cross-node test, which runs it"]
fn importer_process() {
    let Ok(args) = std::env::var(ENV) else { return };
    let mut a = args.split(' ');
    let (socket, slot, handle) = (a.next().unwrap(), a.next().unwrap(), a.next().unwrap());
    let raw = a.next() == Some("raw");
    let s = domain::session(Path::new(socket), Some(slot.parse().unwrap()));
    let import = s.import(&handle.parse::<Handle>().unwrap(), false).unwrap();
    let m = s.map(&import).unwrap();
    let at = if raw {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&import.fd().unwrap());
        let off = libc::off_t::try_from(import.fd_offset()).unwrap();
        // SAFETY: a new shared read-only mapping of a descriptor this process holds.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), LEN as usize, libc::PROT_READ, libc::MAP_SHARED, fd, off) };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast::<u8>().cast_const()
    } else {
        m.as_ptr().cast_const()
    };
    let page = at as usize;
    s.on_revocation(move |r| {
        println!("REVOKED {:?} {}", r.reason, perms(page));
        std::io::stdout().flush().unwrap();
    });
    println!("\nMAPPED");
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lines() {
        if line.unwrap() == "LOAD" {
            // SAFETY: a load through a mapping this process holds; once the owner took
            // the memory back it faults, which is what this process exists to show.
            let seen = unsafe { std::ptr::read_volatile(at) };
            println!("LOADED {seen}");
            std::io::stdout().flush().unwrap();
        }
    }
}

/// Starts [`importer_process`] for `handle` on `socket` (`through`: see there) and waits
/// until it mapped the memory.
fn importer_child(
    socket: &Path,
    slot: u64,
    handle: &Handle,
    through: &str,
) -> (std::process::Child, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "importer_process", "--nocapture", "--test-threads=1"])
        .env(ENV, format!("{} {slot} {handle} {through}", socket.display()))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    until(&mut out, "MAPPED");
    (child, out)
}

/// Reads the child's lines until one is `want`; panics if it exits first.
fn until(out: &mut BufReader<std::process::ChildStdout>, want: &str) {
    let mut line = String::new();
    while line.trim() != want {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the importer process exited before saying {want}");
    }
}

/// Asks the child to load; returns its exit when it died of it, else what it said.
fn load(
    child: &mut std::process::Child,
    out: &mut BufReader<std::process::ChildStdout>,
) -> std::result::Result<String, std::process::ExitStatus> {
    writeln!(child.stdin.as_mut().unwrap(), "LOAD").unwrap();
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            return Err(child.wait().unwrap());
        }
        if line.starts_with("LOADED") {
            return Ok(line.trim().to_owned());
        }
    }
}

/// Two trays of the sim supernode sharing its fabric, both live: tray0, tray1 and tray0's
/// slot.
fn two_trays(lab: &domain::Lab) -> (common::Daemon, common::Daemon, u64) {
    let shared = lab.dir.path().join("sim");
    let supernode = domain::sim("supernode-64.toml");
    let n0 = lab.node(&supernode, Some(&shared), "tray0");
    let n1 = lab.node(&supernode, Some(&shared), "tray1");
    let slot0 = domain::wait_live(&[&n0, &n1]);
    (n0, n1, slot0)
}

/// A region of [`LEN`] bytes on the first HBM of `owner`'s node.
fn hbm_region(owner: &fabric_mm::Session) -> fabric_mm::Region {
    let gpu = owner.first_device_with(MemoryClass::Hbm).unwrap().unwrap().id;
    owner.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, LEN).unwrap()
}

#[test]
fn a_session_on_one_node_maps_and_stores_into_memory_exported_on_another() {
    let Some(lab) = domain::Lab::start() else { return };
    let (n0, n1, slot0) = two_trays(&lab);

    // tray0: allocate on its GPU, map, store, export — as for any local sharing.
    let owner = domain::session(&n0.socket, None);
    assert_eq!(owner.window().config(), WindowConfig { gfa: slot0 * SPAN, len: SPAN }, "tray0's own span");
    let region = hbm_region(&owner);
    let om = owner.map(&region).unwrap();
    // SAFETY: this test is the only writer of the region until it exports it.
    unsafe { om.as_mut_slice().unwrap()[..8].copy_from_slice(b"on tray0") };
    // This node's own memory is coherent: flush is a no-op, but the range is checked.
    assert!(om.coherent());
    om.flush(0, 8).unwrap();
    assert!(matches!(om.flush(LEN, 1), Err(Error::InvalidArgument(_))));
    let handle = owner.export(&region, &Policy::default()).unwrap();

    // tray1: the same import call; its window, which mirrors tray1's own span, gains
    // tray0's span and places the import at its GFA there.
    let importer = domain::session(&n1.socket, None);
    let slot1 = domain::status(&n1.socket)["self"]["slot"].as_u64().unwrap();
    assert_eq!(importer.window().apertures(), vec![(slot1 * SPAN, SPAN)]);
    let import = importer.import(&handle, true).unwrap();
    assert_eq!(import.gfa(), om.gfa().into(), "one GFA on both nodes");
    let im = importer.map(&import).unwrap();
    assert_eq!(importer.window().apertures(), vec![(slot1 * SPAN, SPAN), (slot0 * SPAN, SPAN)]);
    assert_eq!(importer.window().gfa_of(im.as_ptr()), Some(om.gfa()), "at its GFA in tray1's window");
    assert_eq!(im.as_ptr() as usize % (2 << 20), om.as_ptr() as usize % (2 << 20));
    // The sim's shared files are one host's memory: the grant says its caches are coherent
    // with them, so invalidate before loading what tray0 stored and flush after storing
    // are no-ops (CXL shared across hosts is not: crossnode_cxl.rs), the range checked.
    assert!(im.coherent());
    im.invalidate(0, LEN).unwrap();
    assert!(matches!(im.invalidate(LEN - 1, 2), Err(Error::InvalidArgument(_))));
    assert!(matches!(im.flush(0, 0), Err(Error::InvalidArgument(_))));
    // SAFETY: tray0 stored before exporting and stores nothing more; the test reads its
    // own store back through tray0's mapping only after it is made.
    unsafe {
        assert_eq!(&im.as_slice()[..8], b"on tray0", "tray0's stores are visible on tray1");
        std::ptr::write_volatile(im.as_ptr().add(LEN as usize - 1), 0x5a);
        im.flush(LEN - 1, 1).unwrap();
        assert_eq!(
            std::ptr::read_volatile(om.as_ptr().add(LEN as usize - 1)),
            0x5a,
            "tray1's store is visible on tray0"
        );
    }

    // A second importer, in a process of its own, maps it too (with an mmap of its own).
    let (mut child, mut out) = importer_child(&n1.socket, slot0, &handle, "raw");
    assert_eq!(load(&mut child, &mut out).unwrap(), format!("LOADED {}", b'o'));

    // tray0 frees the region: tray1's callback runs with Freed, the import is revoked.
    let rx = domain::revocations(&importer);
    drop(om);
    drop(region);
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("the revocation within a second of the free");
    assert_eq!((r.reason, r.import), (RevocationReason::Freed, import.import_id()));
    assert!(matches!(im.check(), Err(Error::Revoked { reason: RevocationReason::Freed, .. })));
    // The owner truncated the file before it told the importer node: the other process's
    // next load through a mapping the library does not know (so never fenced) faults.
    let status = load(&mut child, &mut out).unwrap_err();
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status}");
}

#[test]
fn an_export_revoked_on_one_node_fences_its_mappings_on_another() {
    let Some(lab) = domain::Lab::start() else { return };
    let (n0, n1, slot0) = two_trays(&lab);

    let owner = domain::session(&n0.socket, None);
    let region = hbm_region(&owner);
    let om = owner.map(&region).unwrap();
    // SAFETY: this test is the only writer of the region until it exports it.
    unsafe { om.as_mut_slice().unwrap()[0] = 42 };
    let handle = owner.export(&region, &Policy::default()).unwrap();

    // An importer on tray1 in this process, and one in a process of its own.
    let importer = domain::session(&n1.socket, None);
    let rx = domain::revocations(&importer);
    let import = importer.import(&handle, true).unwrap();
    let im = importer.map(&import).unwrap();
    // One that fences softly (as the Python binding does).
    let keeper = fabric_mm::Session::open_with(fabric_mm::SessionConfig {
        socket: Some(n1.socket.clone()),
        keep_revoked_mappings: true,
        ..fabric_mm::SessionConfig::default()
    })
    .unwrap();
    let kept_rx = domain::revocations(&keeper);
    let kept = keeper.import(&handle, false).unwrap();
    let km = keeper.map(&kept).unwrap();
    let (mut child, mut out) = importer_child(&n1.socket, slot0, &handle, "window");
    assert_eq!(load(&mut child, &mut out).unwrap(), "LOADED 42");

    // tray0 revokes the export; the region lives on.
    owner.revoke(&handle).unwrap();
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("the revocation within a second of the revoke");
    assert_eq!((r.reason, r.import), (RevocationReason::Revoked, import.import_id()));
    assert!(matches!(im.check(), Err(Error::Revoked { reason: RevocationReason::Revoked, .. })));
    // Fenced, still placed: nothing else lands there until the mapping is dropped, and the
    // import cannot be mapped again.
    assert_eq!(perms(im.as_ptr() as usize), "---p", "fenced: the region's file is no longer mapped there");
    assert_eq!(importer.window().placements(), vec![(im.gfa(), LEN)]);
    assert!(matches!(importer.map(&import), Err(Error::Revoked { .. })));
    drop(im);
    assert!(importer.window().placements().is_empty());
    // The keeper was told too: its mapping reads zeros from private pages of its own (no
    // fault), and no longer the live region.
    kept_rx.recv_timeout(Duration::from_secs(1)).expect("the keeper's revocation");
    assert!(matches!(km.check(), Err(Error::Revoked { .. })));
    // SAFETY: the keeper's mapping is blanked, readable as before.
    assert_eq!(unsafe { std::ptr::read_volatile(km.as_ptr()) }, 0);
    assert_eq!(perms(km.as_ptr() as usize), "r--p", "blanked: private pages, not the region's file");
    assert_eq!(keeper.window().placements(), vec![(km.gfa(), LEN)], "still placed until dropped");
    // The other process's callback ran after its mapping was fenced: its next load faults.
    until(&mut out, "REVOKED Revoked ---p");
    let status = load(&mut child, &mut out).unwrap_err();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status}");
    // The owner's own mapping is its region's, revoked export or not.
    // SAFETY: the only mapping left that stores to the region is this one.
    unsafe {
        om.as_mut_slice().unwrap()[1] = 7;
        assert_eq!(&om.as_slice()[..2], &[42, 7]);
    }
}

#[test]
fn a_session_on_a_node_without_the_shared_fabric_copies_to_and_from_memory_exported_on_another() {
    let Some(lab) = domain::Lab::start() else { return };
    let shared = lab.dir.path().join("sim");
    let supernode = domain::sim("supernode-64.toml");
    let n0 = lab.node(&supernode, Some(&shared), "tray0");
    let n1 = lab.node(&supernode, None, "tray1");
    let slot0 = domain::wait_live(&[&n0, &n1]);
    let owner = domain::session(&n0.socket, None);
    let gpu = owner.first_device_with(MemoryClass::Hbm).unwrap().unwrap().id;
    let region = owner.alloc(&Target::Device { device: gpu, memory: MemoryClass::Hbm }, 4 * LEN).unwrap();
    let om = owner.map(&region).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();

    // tray1: the same import call; copy-only, so no mapping.
    let importer = domain::session(&n1.socket, None);
    let import = importer.import(&handle, true).unwrap();
    assert!(import.copy_only());
    assert!(matches!(importer.map(&import), Err(Error::CopyOnly(_))));
    assert_eq!(importer.window().ptr_of(slot0 * SPAN), None, "nothing of tray0's reserved in tray1's window");
    let gfa = Memory::gfa(&import).unwrap();
    assert_eq!(gfa, om.gfa());

    // A host buffer of tray1's, registered, pushed into tray0's region and pulled back.
    let len = 3 * LEN + 5;
    let buf = importer.alloc_host(4 * LEN).unwrap();
    // SAFETY: the buffer is this test's and nothing else touches it meanwhile.
    let host = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len as usize) };
    for (i, b) in host.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    // The domain's devices are listed; one of tray1's own takes the registration.
    let reg = (importer.devices().unwrap().into_iter())
        .filter(|d| d.memory.iter().any(|(c, _)| *c == MemoryClass::Hbm))
        .find_map(|d| importer.register(&buf, &d.id, fabric_mm::Access::ReadWrite).ok())
        .expect("a device of tray1 takes the registration");
    let at = |offset| fabric_mm::CopyEndpoint::Registration { id: reg.id(), offset };
    let pushed = importer.copy(fabric_mm::CopyEndpoint::Gfa(gfa + 7), at(0), len).unwrap().wait();
    assert_eq!(pushed.unwrap(), len);
    // SAFETY: the copy completed; tray0's mapping is read after it.
    let seen = unsafe { &om.as_slice()[7..7 + len as usize] };
    assert!(seen == &host[..], "tray0 reads what tray1 pushed");
    host.fill(0);
    let pulled = importer.copy(at(0), fabric_mm::CopyEndpoint::Gfa(gfa + 7), len).unwrap().wait();
    assert_eq!(pulled.unwrap(), len);
    assert!(seen == &host[..], "tray1 pulled tray0's bytes back");
}
