//! DMA registration through the library against a real fabricd serving a fabric whose GPU
//! has a 24-bit DMA mask: every kind of memory registers below the mask; the cache hits,
//! misses, evicts and is invalidated when memory is freed or revoked, and never answers a
//! reallocation at the same address with a stale registration; a sub-range is answered
//! from a cached larger registration and a copy to it lands at its offset; the per-user pinned limit,
//! the daemon's `RLIMIT_MEMLOCK` and the caller's `RLIMIT_MEMLOCK` are clear typed errors;
//! a forked child does not get registered pages and the parent's registrations survive.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fabric_mm::{
    Access, CacheLimits, CopyEndpoint, Error, HostBuffer, Memory, MemoryClass, Policy, Registration, Session, Target,
};
use fabric_proto::wire::{Connection, Request, Response, SUPPORTED_VERSIONS, StatusRequest};

const MIB: u64 = 1 << 20;
const MASK: u64 = 1 << 24;
const ENV_SOCKET: &str = "FMM_REGISTER_TEST_SOCKET";
/// Linux's `CAP_IPC_LOCK`, which lets a process lock memory past `RLIMIT_MEMLOCK`.
const CAP_IPC_LOCK: u32 = 14;

/// The CXL pool sim with a GPU whose DMA mask is 24 bits (16 MiB of IOVA space), written
/// into `dir`.
fn sim(dir: &Path) -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml");
    let mut text = std::fs::read_to_string(base).unwrap();
    text.push_str(
        "\n[[templates.cxl-host.gpu]]\nname = \"gpu0\"\nparent = \"pci0000:00\"\nmodel = \"test GPU\"\nhbm = \"1GiB\"\ndma_mask_bits = 24\n",
    );
    let path = dir.join("dma-sim.toml");
    std::fs::write(&path, text).unwrap();
    path
}

struct Env {
    daemon: common::Daemon,
    _scratch: tempfile::TempDir,
}

fn start(extra: &str, prepare: impl FnOnce(&mut Command)) -> Env {
    let scratch = tempfile::tempdir().unwrap();
    let daemon = common::daemon_with(&sim(scratch.path()), extra, prepare);
    Env { daemon, _scratch: scratch }
}

fn gpu(s: &Session) -> String {
    s.devices().unwrap().into_iter().find(|d| d.kind == "gpu").expect("the test sim has a GPU").id
}

fn hbm(s: &Session, device: &str, size: u64) -> fabric_mm::Region {
    s.alloc(&Target::Device { device: device.to_owned(), memory: MemoryClass::Hbm }, size).unwrap()
}

/// (registrations, pinned bytes) in the whole daemon.
fn daemon_registrations(socket: &Path) -> (u64, u64) {
    let mut c = Connection::new(std::os::unix::net::UnixStream::connect(socket).unwrap());
    c.hello("register-test", SUPPORTED_VERSIONS).unwrap();
    let Response::Status(st) = c.call(Request::Status(StatusRequest {}), &[]).unwrap().0 else { panic!() };
    (st.registrations, st.pinned_bytes)
}

fn below_mask(r: &Registration) {
    assert!(r.iova() + r.len() <= MASK, "{r:?} reaches past the 24-bit mask");
}

/// Anonymous memory of this process (not locked), filled with `byte`.
fn anon(len: usize, byte: u8) -> *mut u8 {
    // SAFETY: a new private anonymous mapping; it aliases nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping above has len writable bytes.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), byte, len) };
    p.cast()
}

/// Whether the page at `p` is locked, from `VmFlags` of its mapping in /proc/self/smaps.
fn locked(p: *const u8) -> bool {
    let a = p as u64;
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((s, e)) = range.split_once('-')
            && let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16))
        {
            inside = s <= a && a < e;
        } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
            return flags.split_whitespace().any(|f| f == "lo");
        }
    }
    panic!("{p:?} is not mapped")
}

#[test]
fn registrations_and_host_buffers_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Registration>();
    send_sync::<HostBuffer>();
}

#[test]
fn every_kind_of_memory_registers_below_the_mask_and_drops_clean() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let region = hbm(&s, &dev, 2 * MIB);
    let handle = s.export(&region, &Policy::default()).unwrap();
    let other = common::session(&env.daemon.socket);
    let import = other.import(&handle, true).unwrap();
    let mapping = s.map(&region).unwrap();
    let host = s.alloc_host(MIB + 1).unwrap();
    assert_eq!(host.len(), MIB + 4096, "host buffers are whole pages");
    let own = anon(MIB as usize, 0x5a);

    let regs = vec![
        s.register(&region, &dev, Access::ReadWrite).unwrap(),
        other.register(&import, &dev, Access::ReadOnly).unwrap(),
        s.register_range(&mapping, 4096, 8192, &dev, Access::ReadOnly).unwrap(),
        s.register(&host, &dev, Access::ReadWrite).unwrap(),
        // SAFETY: `own` stays mapped until after the registration is dropped below.
        unsafe { s.register_ptr(own.add(100), 5000, &dev, Access::ReadWrite) }.unwrap(),
    ];
    let mut ranges: Vec<(u64, u64)> = regs.iter().map(|r| (r.iova(), r.iova() + r.len())).collect();
    ranges.sort_unstable();
    for r in &regs {
        below_mask(r);
        assert_eq!(r.device(), dev);
    }
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "IOVA ranges overlap: {ranges:?}");
    assert_eq!(regs[4].iova() % 4096, 100, "the IOVA keeps the pointer's offset in its page");
    assert_eq!((regs[2].len(), regs[4].len(), regs[4].access()), (8192, 5000, Access::ReadWrite));
    assert!(locked(own), "register_ptr locks the caller's pages");
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 5);
    assert_eq!(s.registration_stats().live, 4);

    // Memory that is not mapped: an OS error, not a made-up limit.
    let hole = anon(4096, 0);
    // SAFETY: unmapping the page just mapped; nothing refers to it.
    unsafe { libc::munmap(hole.cast(), 4096) };
    // SAFETY: deliberately unmapped; the library must refuse it before any registration.
    let e = unsafe { s.register_ptr(hole, 4096, &dev, Access::ReadOnly) }.unwrap_err();
    assert!(matches!(e, Error::Os { .. }), "{e:?}");
    // Beyond the memory: refused by the library, nothing registered.
    let e = s.register_range(&region, MIB, 2 * MIB, &dev, Access::ReadOnly).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    // A device that does not DMA: the daemon's refusal comes through.
    let cpu = s.devices().unwrap().into_iter().find(|d| d.kind == "cpu").unwrap().id;
    assert!(matches!(s.register(&host, &cpu, Access::ReadOnly), Err(Error::Refused { .. })));

    drop(regs);
    assert!(!locked(own), "dropping the registration unlocks what the library locked");
    // Cached registrations outlive their handles until the cache lets go.
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 4);
    s.clear_registration_cache();
    other.clear_registration_cache();
    assert_eq!(daemon_registrations(&env.daemon.socket), (0, 0));
    assert_eq!(s.registration_stats().live, 0);
    // SAFETY: the mapping made by anon, no longer registered.
    unsafe { libc::munmap(own.cast(), MIB as usize) };
}

#[test]
fn the_cache_hits_evicts_and_never_serves_freed_or_revoked_memory() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);

    // Hit: the same registration, no new daemon registration.
    let region = hbm(&s, &dev, 2 * MIB);
    let (id, old_gen) = (region.id(), region.generation());
    let a = s.register(&region, &dev, Access::ReadWrite).unwrap();
    let b = s.register(&region, &dev, Access::ReadWrite).unwrap();
    assert_eq!((a.id(), a.iova()), (b.id(), b.iova()));
    assert!(b.cached());
    // Another access or range is another registration.
    let c = s.register(&region, &dev, Access::ReadOnly).unwrap();
    assert_ne!(c.id(), a.id());
    let st = s.registration_stats();
    assert_eq!((st.cache.hits, st.cache.misses, st.cache.entries, st.live), (1, 2, 2, 2));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 2);

    // Free the region (mappings first: a mapping holds it): the cache drops its entries.
    let gfa = region.gfa();
    let mapped_at = s.map(&region).unwrap().as_ptr() as u64;
    drop((a, b, c, region));
    let st = s.registration_stats();
    assert_eq!((st.cache.invalidations, st.cache.entries, st.live), (2, 0, 0));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);

    // Reallocate: the same size, likely the same GFA and so the same address in the
    // window; whatever the placement, the new allocation misses.
    let again = hbm(&s, &dev, 2 * MIB);
    assert!((again.id(), again.generation()) != (id, old_gen));
    let mapped = s.map(&again).unwrap();
    if again.gfa() == gfa {
        assert_eq!(mapped.as_ptr() as u64, mapped_at, "same GFA, same window address");
    }
    let fresh = s.register(&mapped, &dev, Access::ReadWrite).unwrap();
    assert_eq!(s.registration_stats().cache.misses, 3, "a reallocation never hits the freed region's entry");
    // The mapping and the region are one allocation: a hit.
    let hit = s.register(&again, &dev, Access::ReadWrite).unwrap();
    assert_eq!(hit.id(), fresh.id());
    drop((hit, fresh, mapped, again));

    // Host buffers: freed and reallocated (often at the same address) miss too.
    let h1 = s.alloc_host(MIB).unwrap();
    let (p1, id1) = (h1.as_ptr(), h1.id());
    let r1 = s.register(&h1, &dev, Access::ReadWrite).unwrap().id();
    drop(h1);
    let h2 = s.alloc_host(MIB).unwrap();
    assert_ne!(h2.id(), id1);
    let misses = s.registration_stats().cache.misses;
    let r2 = s.register(&h2, &dev, Access::ReadWrite).unwrap();
    assert_eq!(s.registration_stats().cache.misses, misses + 1, "buffer at {:?} (was {p1:?})", h2.as_ptr());
    assert_ne!(r2.id(), r1);
    drop((r2, h2));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);

    // Bounded: two entries at most; the least recently used goes (and is unregistered).
    s.set_registration_cache(CacheLimits { entries: 2, bytes: 1 << 30 });
    let h = s.alloc_host(4 * 4096).unwrap();
    for i in 0..3 {
        s.register_range(&h, i * 4096, 4096, &dev, Access::ReadOnly).unwrap();
    }
    let st = s.registration_stats();
    assert_eq!((st.cache.evictions, st.cache.entries, st.live), (1, 2, 2));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 2);
    // Too big for the byte bound: registered, not cached, unregistered on drop.
    s.set_registration_cache(CacheLimits { entries: 2, bytes: 4096 });
    let big = s.register(&h, &dev, Access::ReadOnly).unwrap();
    assert!(!big.cached());
    drop(big);
    assert_eq!(s.registration_stats().live, s.registration_stats().cache.entries);
    drop(h);
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);

    // Revoked import: the cached registration is invalidated, new ones fail.
    s.set_registration_cache(CacheLimits::default());
    let owner = common::session(&env.daemon.socket);
    let region = hbm(&owner, &dev, MIB);
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let import = s.import(&handle, true).unwrap();
    s.register(&import, &dev, Access::ReadWrite).unwrap();
    owner.revoke(&handle).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while import.check().is_ok() {
        assert!(Instant::now() < deadline, "no revocation arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = s.registration_stats().cache.invalidations;
    assert!(matches!(s.register(&import, &dev, Access::ReadWrite), Err(Error::Revoked { .. })));
    assert_eq!(s.registration_stats().cache.invalidations, before + 1);
    assert_eq!(s.registration_stats().cache.entries, 0);
}

/// Each import has registrations of its own: the daemon ends them with that import. So
/// one import's registration never answers for another import of the same region (nor for
/// the region its owner registered): after the owner revokes one export and exports the
/// region again, the new import's registration is a new one, live in the daemon; and
/// another session's memory is refused. Before, the new import was answered with the
/// revoked one's registration, which the daemon had already dropped.
#[test]
fn an_imports_registration_never_answers_for_another_import_of_the_region() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let owner = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let region = hbm(&owner, &dev, MIB);
    let own = owner.register(&region, &dev, Access::ReadWrite).unwrap();

    let first = owner.export(&region, &Policy::default()).unwrap();
    let a = s.import(&first, true).unwrap();
    let through_a = s.register(&a, &dev, Access::ReadWrite).unwrap();
    assert_ne!(through_a.id(), own.id(), "the owner's registration is the owner's");
    owner.revoke(&first).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.check().is_ok() {
        assert!(Instant::now() < deadline, "no revocation arrived");
        std::thread::sleep(Duration::from_millis(10));
    }
    let second = owner.export(&region, &Policy::default()).unwrap();
    let b = s.import(&second, true).unwrap();
    let hits = s.registration_stats().cache.hits;
    let through_b = s.register(&b, &dev, Access::ReadWrite).unwrap();
    assert_eq!(s.registration_stats().cache.hits, hits, "answered from the revoked import's registration");
    assert_ne!(through_b.id(), through_a.id());
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 2, "the owner's and b's");
    // A second import of the same export: its own registration, and dropping the first
    // import leaves it registered.
    let c = s.import(&second, true).unwrap();
    let through_c = s.register(&c, &dev, Access::ReadWrite).unwrap();
    assert_eq!(s.registration_stats().cache.hits, hits, "answered from b's registration");
    drop((through_b, b));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 2, "the owner's and c's");
    drop(through_a);
    // Another session's memory: refused here, not sent with this session's ids.
    let e = s.register(&region, &dev, Access::ReadWrite).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("another session")), "{e:?}");
    drop((through_c, c, own));
}

#[test]
fn a_sub_range_is_answered_from_a_cached_larger_registration_and_copies_land_there() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let region = hbm(&s, &dev, 2 * MIB);
    let m = s.map(&region).unwrap();
    // SAFETY: nothing is registered yet; the mapping is this process's.
    unsafe { std::ptr::write_bytes(m.as_ptr(), 0, (2 * MIB) as usize) };

    let whole = s.register(&region, &dev, Access::ReadWrite).unwrap();
    let (off, len) = (MIB + 4096 + 100, 64 * 1024);
    let sub = s.register_range(&region, off, len, &dev, Access::ReadWrite).unwrap();
    // The same daemon registration, at the sub-range's offset in it.
    assert_eq!((sub.id(), sub.id_offset(), sub.iova(), sub.len()), (whole.id(), off, whole.iova() + off, len));
    assert!(sub.cached());
    below_mask(&sub);
    let st = s.registration_stats();
    assert_eq!((st.cache.hits, st.cache.range_hits, st.cache.misses, st.live), (1, 1, 1, 1));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 1, "no second registration in the daemon");
    // Another access is not answered by a read-write registration.
    let ro = s.register_range(&region, off, len, &dev, Access::ReadOnly).unwrap();
    assert_ne!(ro.id(), whole.id());
    drop(ro);

    // A copy to the sub-range's first byte lands at that offset of the region.
    let host = s.alloc_host(len).unwrap();
    // SAFETY: the buffer is not registered while it is filled.
    unsafe { host.as_mut_slice() }.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8 + 1);
    let src = s.register(&host, &dev, Access::ReadOnly).unwrap();
    s.copy(sub.at(0), CopyEndpoint::from(&src), len).unwrap().wait().unwrap();
    // SAFETY: the copy is done; nothing writes the region now.
    let bytes = unsafe { m.as_slice() };
    let at = off as usize;
    assert_eq!(bytes[at - 1], 0, "the byte before the sub-range is untouched");
    assert!((0..len as usize).all(|i| bytes[at + i] == (i % 251) as u8 + 1), "the copied bytes land at the offset");
    assert_eq!(bytes[at + len as usize], 0, "the byte after the sub-range is untouched");

    // Freed and reallocated: a sub-range of the new region never hits the old registration.
    let hits = s.registration_stats().cache.hits;
    drop((sub, whole, m, region));
    let again = hbm(&s, &dev, 2 * MIB);
    let fresh = s.register_range(&again, off, len, &dev, Access::ReadWrite).unwrap();
    let st = s.registration_stats();
    assert_eq!((st.cache.hits, st.cache.range_hits), (hits, 1), "a reallocation misses");
    assert_eq!(fresh.id_offset(), 0, "a registration of its own");
    drop((fresh, again, src, host));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);
}

#[test]
fn overlapping_pointer_registrations_unlock_only_when_the_last_goes() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let p = anon(4 * 4096, 1);
    // SAFETY: `p` stays mapped until the end of the test, after both registrations.
    let a = unsafe { s.register_ptr(p, 3 * 4096, &dev, Access::ReadOnly) }.unwrap();
    // SAFETY: as above.
    let b = unsafe { s.register_ptr(p.add(2 * 4096), 2 * 4096, &dev, Access::ReadOnly) }.unwrap();
    assert_ne!(a.id(), b.id());
    drop(a);
    // SAFETY: in the mapping of `p`.
    let (first, third) = unsafe { (p, p.add(2 * 4096)) };
    assert!(!locked(first) && locked(third), "the shared page stays locked for the registration left");
    drop(b);
    assert!(!locked(third));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);
}

#[test]
fn the_per_user_pinned_limit_is_a_clear_error() {
    let env = start("[limits]\npinned_bytes_per_uid = 65536\n", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let host = s.alloc_host(MIB).unwrap();
    let e = s.register(&host, &dev, Access::ReadWrite).unwrap_err();
    let Error::PinnedLimit { used, requested, max } = e else { panic!("{e:?}") };
    assert_eq!((used, requested, max), (0, MIB, 65536));
    assert!(e.to_string().contains("limits.pinned_bytes_per_uid"), "{e}");
    assert_eq!(e.code(), fabric_mm::ffi::FMM_E_LIMIT);
    // Within the limit it works.
    let held = s.register_range(&host, 0, 32768, &dev, Access::ReadWrite).unwrap();
    // A cached registration no one holds is given back to make room (and the refusal
    // stands when the room is taken by registrations in use).
    drop(s.register_range(&host, 32768, 32768, &dev, Access::ReadWrite).unwrap());
    let again = s.register_range(&host, 65536, 32768, &dev, Access::ReadWrite).unwrap();
    assert_eq!(s.registration_stats().cache.evictions, 1);
    let e = s.register_range(&host, 98304, 4096, &dev, Access::ReadWrite).unwrap_err();
    assert!(matches!(e, Error::PinnedLimit { used: 65536, requested: 4096, max: 65536 }), "{e:?}");
    drop((held, again));
}

fn has_cap(pid: u32, cap: u32) -> bool {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let eff = s.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(eff, 16).unwrap() & (1 << cap) != 0
}

/// Drops `CAP_IPC_LOCK` from the bounding set (so that even root's exec does not get it)
/// and sets `RLIMIT_MEMLOCK` to 64 KiB in the child about to exec.
fn without_ipc_lock(cmd: &mut Command) {
    // SAFETY: between fork and exec only prctl and setrlimit run: async-signal-safe
    // system calls that allocate nothing.
    unsafe {
        cmd.pre_exec(|| {
            // Fails without CAP_SETPCAP; a process without it lacks CAP_IPC_LOCK anyway.
            libc::prctl(libc::PR_CAPBSET_DROP, CAP_IPC_LOCK as libc::c_ulong, 0, 0, 0);
            let r = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &r) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

#[test]
fn the_daemons_rlimit_memlock_is_a_clear_error() {
    let env = start("", without_ipc_lock);
    assert!(!has_cap(env.daemon.child.id(), CAP_IPC_LOCK), "the daemon kept CAP_IPC_LOCK; the test proves nothing");
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let region = hbm(&s, &dev, 2 * MIB);
    let e = s.register(&region, &dev, Access::ReadWrite).unwrap_err();
    let Error::DaemonMemlockLimit { requested, limit, .. } = e else { panic!("{e:?}") };
    assert_eq!((requested, limit), (2 * MIB, 64 << 10));
    assert!(e.to_string().contains("RLIMIT_MEMLOCK") && e.to_string().contains("LimitMEMLOCK"), "{e}");
    assert_eq!(e.code(), fabric_mm::ffi::FMM_E_MEMLOCK);
    assert_eq!(s.registration_stats().live, 0);
}

#[test]
fn the_callers_rlimit_memlock_is_a_clear_error() {
    let env = start("", |_| {});
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "memlock_child", "--ignored", "--nocapture", "--test-threads=1"])
        .env(ENV_SOCKET, &env.daemon.socket);
    without_ipc_lock(&mut cmd);
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("memlock child: ok"),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child of the test above, under a 64 KiB `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`;
/// does nothing when run directly.
#[test]
#[ignore = "run by the_callers_rlimit_memlock_is_a_clear_error"]
fn memlock_child() {
    let Some(socket) = std::env::var_os(ENV_SOCKET) else { return };
    assert!(!has_cap(std::process::id(), CAP_IPC_LOCK), "the child kept CAP_IPC_LOCK; the test proves nothing");
    let s = common::session(Path::new(&socket));
    let dev = gpu(&s);
    let p = anon(MIB as usize, 7);
    // SAFETY: `p` stays mapped for the rest of the process.
    let e = unsafe { s.register_ptr(p, MIB as usize, &dev, Access::ReadWrite) }.unwrap_err();
    let Error::MemlockLimit { requested, limit } = e else { panic!("{e:?}") };
    assert_eq!((requested, limit), (MIB, 64 << 10));
    assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
    assert!(!locked(p), "a refused registration leaves nothing locked");
    // Within the limit it works; a host buffer is pinned by the daemon, not by us.
    // SAFETY: as above.
    let small = unsafe { s.register_ptr(p, 8192, &dev, Access::ReadWrite) }.unwrap();
    let host: HostBuffer = s.alloc_host(MIB).unwrap();
    let r = s.register(&host, &dev, Access::ReadWrite).unwrap();
    below_mask(&r);
    drop(small);
    println!("memlock child: ok");
}

/// In a forked child: 1 when the byte at `p` can be read, 0 when it cannot (a hole, or
/// the library's `PROT_NONE` reservation over what the parent kept out of children):
/// read through `process_vm_readv` of this very process, which fails rather than faults.
fn mapped_in_child(p: *const u8) -> i32 {
    let mut byte = 0u8;
    let local = libc::iovec { iov_base: std::ptr::from_mut(&mut byte).cast(), iov_len: 1 };
    let remote = libc::iovec { iov_base: p.cast_mut().cast(), iov_len: 1 };
    // SAFETY: reads one byte of this process into `byte`; the kernel checks `p`.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    i32::from(n == 1)
}

/// Runs `child` in a forked child, which leaves with `_exit` and the code it returns, and
/// answers that code. A child that has not ended within 10 s is killed, and the test fails
/// saying `hung`.
fn in_child(hung: &str, child: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child runs `child` (system calls, or drops of library objects no other
    // thread of the test holds the locks of) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let code = child();
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut status = 0;
    // SAFETY: polls the child forked above.
    while unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == 0 {
        if Instant::now() > deadline {
            // SAFETY: the child forked above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("{hung}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(libc::WIFEXITED(status), "child status {status:#x}");
    libc::WEXITSTATUS(status)
}

#[test]
fn a_cached_registration_is_not_answered_after_the_connection_ended_nor_in_a_forked_child() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let host = s.alloc_host(MIB).unwrap();
    let first = s.register(&host, &dev, Access::ReadWrite).unwrap();
    drop(first);
    assert!(s.register(&host, &dev, Access::ReadWrite).unwrap().cached(), "kept in the cache");
    // The child has the parent's cache, not its session: no hit there (before, the
    // parent's registration was answered).
    let code = in_child("the registering child hung", || match s.register(&host, &dev, Access::ReadWrite) {
        Err(fabric_mm::Error::Disconnected) => 0,
        Ok(_) => 1,
        Err(_) => 2,
    });
    assert_eq!(code, 0, "a forked child's register (1: a cache hit)");
    // The daemon ends a disconnected session's registrations: no hit either.
    s.disconnect();
    assert!(matches!(s.register(&host, &dev, Access::ReadWrite), Err(fabric_mm::Error::Disconnected)));
}

#[test]
fn another_sessions_host_buffer_is_registered_uncached_and_let_go_with_it() {
    let env = start("", |_| {});
    let (s1, s2) = (common::session(&env.daemon.socket), common::session(&env.daemon.socket));
    let dev = gpu(&s1);
    let buf = s1.alloc_host(MIB).unwrap();
    let r = s2.register(&buf, &dev, Access::ReadWrite).unwrap();
    assert!(!r.cached(), "another session's buffer is not kept in this session's cache");
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 1);
    drop(r);
    // Before, s2's cache kept it (and its pinned bytes) after the buffer was freed.
    drop(buf);
    assert_eq!(daemon_registrations(&env.daemon.socket), (0, 0));
}

/// A region whose device vanished (the daemon ends its registrations and tells its owner,
/// a revocation with import 0) is no longer answered from the cache: before, `register`
/// kept answering the dead registration, whose IOVA the daemon may hand to another.
#[test]
fn a_lost_regions_cached_registrations_are_not_answered() {
    let dir = tempfile::tempdir().unwrap();
    let sim = dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/hgx-h100-8gpu.toml"))
        .unwrap();
    std::fs::write(&sim, &base).unwrap();
    let d = common::daemon_on(&sim, "rescan_interval_s = 1", "", |_| {});
    let s = common::session(&d.socket);
    let gpus: Vec<String> = s.devices().unwrap().into_iter().filter(|d| d.kind == "gpu").map(|d| d.id).collect();
    assert_eq!(gpus.len(), 8);
    let dev = gpus[0].clone();
    let regions: Vec<fabric_mm::Region> = gpus.iter().map(|g| hbm(&s, g, MIB)).collect();
    for r in &regions {
        drop(s.register(r, &dev, Access::ReadWrite).unwrap());
        assert!(s.register(r, &dev, Access::ReadWrite).unwrap().cached());
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    s.on_revocation(move |r| {
        let _ = tx.lock().unwrap().send(*r);
    });
    // The last GPU goes from the sim; the next rescan loses its memory.
    let seven = base
        .replacen(
            "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            1,
        )
        .replacen("i = 8\n", "i = 7\n", 1);
    assert_ne!(seven, base);
    std::fs::write(dir.path().join("fabric.tmp"), &seven).unwrap();
    std::fs::rename(dir.path().join("fabric.tmp"), &sim).unwrap();
    let lost = rx.recv_timeout(Duration::from_secs(20)).expect("the owner is told its region was lost");
    assert_eq!(lost.import, 0);
    let region = regions.iter().find(|r| r.id() == lost.region).expect("one of this session's regions");
    match s.register(region, &dev, Access::ReadWrite) {
        Err(fabric_mm::Error::Revoked { region: r, .. }) => assert_eq!(r, lost.region),
        other => panic!("a lost region's registration: {other:?}"),
    }
    // The others are still answered from the cache.
    let other = regions.iter().find(|r| r.id() != lost.region).unwrap();
    assert!(s.register(other, &dev, Access::ReadWrite).unwrap().cached());
}

fn fork_and_probe(probes: &[*const u8]) -> Vec<i32> {
    probes.iter().map(|&p| in_child("the probing child hung", || mapped_in_child(p))).collect()
}

#[test]
fn a_forked_child_does_not_get_registered_pages_and_the_parent_keeps_its_registrations() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let host = s.alloc_host(MIB).unwrap();
    // SAFETY: no device is writing the buffer yet (nothing is registered).
    unsafe { host.as_mut_slice() }.fill(0xa5);
    let own = anon(3 * 4096, 0x3c);
    let rh = s.register(&host, &dev, Access::ReadWrite).unwrap();
    // SAFETY: `own` stays mapped until the end of the test.
    let rp = unsafe { s.register_ptr(own.add(4096), 4096, &dev, Access::ReadWrite) }.unwrap();
    let before = daemon_registrations(&env.daemon.socket);
    // SAFETY: pointers into the mappings above.
    let (own_registered, own_plain) = unsafe { (own.add(4096).cast_const(), own.cast_const()) };
    // The child has neither registered range (no COW sharing, nothing to corrupt), but has
    // the unregistered page next to it: the probe can tell the two apart.
    assert_eq!(fork_and_probe(&[host.as_ptr(), own_registered, own_plain]), vec![0, 0, 1]);
    // The parent's registrations and bytes are untouched.
    assert_eq!(daemon_registrations(&env.daemon.socket), before);
    // SAFETY: the registration lets the device write, but no copy runs in this test.
    assert!(unsafe { host.as_slice() }.iter().all(|&b| b == 0xa5));
    // SAFETY: as above.
    assert!(unsafe { std::slice::from_raw_parts(own_registered, 4096) }.iter().all(|&b| b == 0x3c));
    assert_eq!(s.register(&host, &dev, Access::ReadWrite).unwrap().id(), rh.id());
    // Once unregistered, the pointer's pages are inherited again.
    drop(rp);
    assert_eq!(fork_and_probe(&[own_registered]), vec![1]);
    drop(rh);
}

/// A forked child that drops its copies of the parent's objects — region, import, mapping,
/// host buffer, registrations, the session itself — leaves the parent's session as it
/// was: nothing is sent on the parent's connection (no Free, no Release, no shutdown), no
/// mapping is made or undone over the holes the parent's `MADV_DONTFORK` memory leaves in
/// the child, and the child does not hang joining a reader thread it does not have.
/// Before, the child's drops freed the parent's region, shut its connection and hung.
#[test]
fn a_forked_child_dropping_the_parents_objects_leaves_the_parents_session_alone() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let owner = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let region = hbm(&s, &dev, MIB);
    let mapping = s.map(&region).unwrap();
    // SAFETY: the mapping is MiB long, writable, and only this thread touches it.
    unsafe { std::ptr::write_bytes(mapping.as_ptr(), 0x5a, MIB as usize) };
    let theirs = hbm(&owner, &dev, MIB);
    let import = s.import(&owner.export(&theirs, &Policy::default()).unwrap(), true).unwrap();
    let host = s.alloc_host(MIB).unwrap();
    let regs = [
        s.register(&region, &dev, Access::ReadWrite).unwrap(),
        s.register(&import, &dev, Access::ReadWrite).unwrap(),
        s.register(&host, &dev, Access::ReadWrite).unwrap(),
    ];
    let before = daemon_registrations(&env.daemon.socket);
    let mut held = Some((regs, mapping, host, import, region, s));
    let code = in_child("the child hung dropping its copies of the parent's objects", || {
        // As an atexit handler would: disconnect, then drop everything.
        if let Some(h) = held.as_ref() {
            h.5.disconnect();
        }
        drop(held.take());
        0
    });
    assert_eq!(code, 0, "child exit {code}");
    let (regs, mapping, host, import, region, s) = held.take().unwrap();
    assert_eq!(daemon_registrations(&env.daemon.socket), before, "the parent's registrations stay");
    // SAFETY: as above; the parent's mapping is still in place.
    assert!(unsafe { std::slice::from_raw_parts(mapping.as_ptr(), MIB as usize) }.iter().all(|&b| b == 0x5a));
    // The parent's connection and session still serve it.
    assert_eq!(s.register(&region, &dev, Access::ReadWrite).unwrap().id(), regs[0].id());
    let again = hbm(&s, &dev, MIB);
    drop((regs, mapping, host, import, region, again, s));
    assert_eq!(daemon_registrations(&env.daemon.socket).0, 0);
}

/// In a forked child the pages the library keeps out of children (host buffers, window
/// placements) are reserved, not holes: the child's own mappings cannot land under a
/// pointer, view or array it inherited (a write through one would then corrupt the child's
/// memory instead of faulting). Before, a mapping of the child's could be placed there.
#[test]
fn a_forked_childs_own_mappings_never_land_where_the_parent_kept_memory_out() {
    let env = start("", |_| {});
    let s = common::session(&env.daemon.socket);
    let dev = gpu(&s);
    let host = s.alloc_host(MIB).unwrap();
    let region = hbm(&s, &dev, MIB);
    let mapping = s.map(&region).unwrap();
    let probes = [host.as_ptr().cast_const(), mapping.as_ptr().cast_const()];
    let landed = in_child("the mapping child hung", || {
        let landed = probes.iter().filter(|&&p| {
            // SAFETY: NOREPLACE maps only where nothing is mapped.
            let q = unsafe {
                libc::mmap(
                    p.cast_mut().cast(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                    -1,
                    0,
                )
            };
            q == p.cast_mut().cast()
        });
        i32::try_from(landed.count()).unwrap_or(99)
    });
    assert_eq!(landed, 0, "the child's mappings landed where the parent kept memory out");
    drop((mapping, region, host));
}
