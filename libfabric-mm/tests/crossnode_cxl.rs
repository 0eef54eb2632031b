//! CXL memory shared by the hosts of a domain, through the library alone: three real
//! fabricd nodes (a private etcd, certificates from a test CA), each serving a sim host
//! attached to the same two CXL memory devices — the same serials, as hosts sharing one
//! pool see them — with a 2-way region over them; the domain's topology has every host and
//! those devices once, as the pool's. Hosts a and b each hand fabricd the
//! DAX device of that region, and their `dev/dax0.0` is one file (a stand-in for the
//! pool's memory: what one host stores, the other loads).
//! Each host allocates from its own allocator, so host-b refuses to hand its client a
//! region of a's on DPAs b's own region holds. A session on a allocates past them on the
//! set and stores; a session on b imports the handle —
//! nothing new to learn for a remote handle — and b's fabricd hands it b's own DAX device
//! at the region's place in the set: it loads a's bytes and stores its own, which a loads
//! and which lie in the shared device at the region's offset. Host c has no DAX device
//! over those members: its import is copy-only, and it pulls and pushes the region's
//! bytes over the node link (a's fabricd reaches them through its device's mapping).
//! While b's client holds the import, b's own next region lands past a's (first fit
//! would have put it there). When a frees the region, b's revocation callback runs, and
//! b may allocate on those DPAs again.
//!
//! A second test gives hosts a and b shares of the two devices in the domain
//! (`[[memory.shares]]`): their member records name the devices' CXL pools, their first
//! allocations land apart, each in its own share, a's share fills while the devices have
//! room, and b imports a's region, which it refused without shares. b, restarted with
//! twice the bytes, grows its shares in place and allocates what did not fit before.
//!
//! A third test collects host a's share while a is away (stopped past its lease, then
//! killed) and lets host c take the range: a neither rejoins on it (it stays fenced,
//! naming c), nor places new regions on it while fenced, nor starts on it (the start is
//! refused), since its regions lie there.
//!
//! What this cannot prove is that real devices shared by two kernels behave so: the QEMU
//! tier's two-host test (`qemu-tests/tests/domain.rs`) does that with one CXL device file
//! behind two guests. Without an `etcd` binary it says it is skipped.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{check, check_file, domain, fill};
use fabric_mm::{Access, CopyEndpoint, Error, Memory, Policy, RevocationReason, Target};
use fabric_proto::wire::ErrorCode;

/// Each host's share of each shared device, in the tests with `[[memory.shares]]`.
const SHARE: u64 = 64 << 20;

/// The hosts' 2-way region0 set and the bytes of its DAX device stand-in.
const SET: &str = "cxl-region:hpa-0x1000000000";
const DAX_BYTES: u64 = 128 << 30;
const LEN: u64 = 4 << 20;

/// Sim host `name`, attached to the two shared devices (their serials given, so the same
/// on every host), with region0 striped over both at 4 KiB.
fn host(name: &str) -> String {
    let memdev = |i: u32| {
        format!(
            "[[templates.host.cxl_memdev]]\nname = \"mem{i}\"\nparent = \"pci0000:0c\"\nram = \"64GiB\"\nserial = {:#x}\n",
            0x5eed_0000 + i
        )
    };
    format!(
        "[fabric]\nname = \"shared-cxl\"\ndescription = \"a host of a shared CXL pool\"\n\
         [templates.host]\n[[templates.host.numa]]\nid = 0\ncpus = \"0-7\"\ndram = \"16GiB\"\n\
         [[templates.host.host_bridge]]\nbus = \"0000:0c\"\nnuma = 0\ncxl = true\n\
         window = {{ base = 0x10_0000_0000, size = \"1TiB\", capabilities = [\"ram\"] }}\n\
         {}{}\
         [[templates.host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\n\
         [[node]]\nname = {name:?}\ntemplate = \"host\"\n",
        memdev(0),
        memdev(1)
    )
}

#[test]
fn a_region_on_shared_cxl_memory_is_imported_on_another_node_through_its_own_dax_device() {
    let Some(lab) = domain::Lab::start() else { return };
    let device = lab.dir.path().join("shared-cxl.raw");
    std::fs::File::create(&device).unwrap().set_len(DAX_BYTES).unwrap();
    let node = |name: &str, dax: bool| {
        let root = lab.dir.path().join(format!("{name}-root"));
        common::dax_fixture(&root, 2 << 20, DAX_BYTES, Some(&device));
        let fabric = lab.dir.path().join(format!("{name}.toml"));
        std::fs::write(&fabric, host(name)).unwrap();
        let memory = if dax { "[memory]\ndax = [\"dax0.0\"]\nresume_grace_s = 6\n" } else { "" };
        let discovery = format!("sim_node = {name:?}\nsysfs_root = {:?}", root.display().to_string());
        lab.node_with(&fabric, &discovery, "", memory, name)
    };
    let (a, mut b, c) = (node("host-a", true), node("host-b", true), node("host-c", false));
    domain::wait_live(&[&a, &b, &c]);
    // The domain's topology has every host, and the devices they share once, as the pool's.
    let doc = domain::topology(&b.socket);
    let pooled: Vec<_> = doc["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["id"].as_str().is_some_and(|id| id.starts_with("serial:cxl/0x5eed")))
        .map(|d| (d["id"].as_str().unwrap(), d["node"].clone()))
        .collect();
    assert_eq!(
        pooled,
        [("serial:cxl/0x5eed0000", serde_json::Value::Null), ("serial:cxl/0x5eed0001", serde_json::Value::Null)],
        "{doc}"
    );

    // Each host allocates from its own allocator: host-b's own region takes the first
    // DPAs of the shared devices, and so does host-a's first one. host-b never hands its
    // clients DPAs it holds regions on.
    let importer = domain::session(&b.socket, None);
    let own = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    let owner = domain::session(&a.socket, None);
    let first = owner.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert_eq!(first.fd_offset(), own.fd_offset(), "the two allocators know nothing of each other");
    let overlapping = owner.export(&first, &Policy::default()).unwrap();
    match importer.import(&overlapping, true) {
        Err(Error::Refused { code: ErrorCode::PermissionDenied, message, .. }) => {
            assert!(message.contains("disjoint"), "{message}")
        }
        other => panic!("an import onto host-b's own DPAs: {other:?}"),
    }

    // host-a: a region past them; store, export — as for any local sharing.
    let region = owner.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert!(region.fd_offset() >= own.fd_offset() + LEN);
    let om = owner.map(&region).unwrap();
    // No `[[memory.shares]]` here: as far as a knows, the device is its own memory.
    assert!(om.coherent());
    fill(&om, 0xa, LEN);
    om.flush(0, LEN).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();

    // host-b: the same import call; its own DAX device, at the region's place in the set.
    let import = importer.import(&handle, true).unwrap();
    assert!(!import.copy_only(), "b reaches the shared device itself");
    assert_eq!(import.gfa(), region.gfa(), "one GFA on both nodes");
    assert_eq!(import.fd_offset(), region.fd_offset(), "the same place in the same device");
    let im = importer.map(&import).unwrap();
    assert!(!im.coherent(), "another host's region on shared CXL memory: flush and invalidate are needed");
    im.invalidate(0, LEN).unwrap();
    check(&im, 0xa, LEN);
    fill(&im, 0xb, LEN);
    im.flush(0, LEN).unwrap();
    om.invalidate(0, LEN).unwrap();
    check(&om, 0xb, LEN);
    check_file(&device, region.fd_offset(), LEN, 0xb);
    // While b's client maps a's region, b's own allocator keeps off its DPAs: first fit
    // would have put b's next region exactly there (right after b's own).
    assert_eq!(region.fd_offset(), own.fd_offset() + LEN);
    let beside = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert!(beside.fd_offset() >= region.fd_offset() + LEN, "b's region {:#x} on a's", beside.fd_offset());
    // A second import of the region on b shares the hold: its release leaves the first's.
    let again = importer.import(&handle, false).unwrap();
    drop(again);
    let next = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert!(next.fd_offset() >= region.fd_offset() + LEN, "b's region {:#x} on a's", next.fd_offset());

    // host-c: no DAX device over those members, so nothing to map: copy-only.
    let far = domain::session(&c.socket, None);
    let copy = far.import(&handle, true).unwrap();
    assert!(copy.copy_only());
    assert_eq!(Memory::gfa(&copy), region.gfa());
    // It copies over the node link instead; host-a's fabricd reaches the region on the
    // device through its mapping (a DAX device serves no read()/write()).
    let gfa = region.gfa().unwrap();
    let buf = far.alloc_host(LEN).unwrap();
    let reg = (far.devices().unwrap().into_iter())
        .find_map(|d| far.register(&buf, &d.id, Access::ReadWrite).ok())
        .expect("a device of host-c takes the registration");
    let at = CopyEndpoint::Registration { id: reg.id(), offset: 0 };
    assert_eq!(far.copy(at, CopyEndpoint::Gfa(gfa), LEN).unwrap().wait().unwrap(), LEN);
    // SAFETY: the copy completed; nothing else touches the buffer meanwhile.
    let host = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr().cast::<u64>(), (LEN / 8) as usize) };
    assert!(host.iter().enumerate().all(|(i, &w)| w == common::word(0xb, i as u64 * 8)), "host-c pulled b's bytes");
    for (i, w) in host.iter_mut().enumerate() {
        *w = common::word(0xc, i as u64 * 8);
    }
    assert_eq!(far.copy(CopyEndpoint::Gfa(gfa), at, LEN).unwrap().wait().unwrap(), LEN);
    check_file(&device, region.fd_offset(), LEN, 0xc);
    om.invalidate(0, LEN).unwrap();
    check(&om, 0xc, LEN);

    // host-a frees the region: b's callback runs with Freed.
    let rx = domain::revocations(&importer);
    let region_offset = region.fd_offset();
    drop(om);
    drop(region);
    let r = rx.recv_timeout(Duration::from_secs(1)).expect("the revocation within a second of the free");
    assert_eq!((r.reason, r.import), (RevocationReason::Freed, import.import_id()));
    // The library fenced b's mapping before telling: a flush (no coherence here) touches
    // no page of it and answers Revoked.
    assert!(!im.coherent());
    assert!(matches!(im.flush(0, 64), Err(Error::Revoked { reason: RevocationReason::Freed, .. })));
    assert!(matches!(im.invalidate(0, 64), Err(Error::Revoked { .. })));
    // a ended the import, but b's client still maps b's DAX device there: the DPAs stay
    // held until the client releases the import; then they are b's to allocate.
    let still = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert!(still.fd_offset() >= region_offset + LEN, "b's region {:#x} on a's mapped DPAs", still.fd_offset());
    drop(im);
    drop(import);
    let after = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert_eq!(after.fd_offset(), region_offset, "b allocates where a's freed region was");

    // A client of b keeps mapping a's region while b's fabricd restarts: the restarted
    // daemon holds those DPAs out of its allocator for the resume grace period (6 s here),
    // as it keeps its own regions for their clients, then gives them back.
    drop((own, beside, next, still, after));
    let kept = owner.alloc(&Target::Set(SET.into()), LEN).unwrap();
    let at = kept.fd_offset();
    let handle = owner.export(&kept, &Policy::default()).unwrap();
    let client = domain::session(&b.socket, None);
    let held = client.import(&handle, true).unwrap();
    let mapped = client.map(&held).unwrap();
    assert!(at > 0, "below the held range is room for b's first region again");
    b.restart();
    domain::wait_live(&[&a, &b, &c]);
    let fresh = domain::session(&b.socket, None);
    let mut mine = Vec::new();
    loop {
        let r = fresh.alloc(&Target::Set(SET.into()), LEN).unwrap();
        assert_ne!(r.fd_offset(), at, "b's restarted daemon allocated DPAs its client still maps");
        let past = r.fd_offset() > at;
        mine.push(r);
        if past {
            break;
        }
    }
    until(Duration::from_secs(20), "the held range back in b's allocator after the grace period", || {
        let r = fresh.alloc(&Target::Set(SET.into()), LEN).unwrap();
        let back = r.fd_offset() == at;
        mine.push(r);
        back
    });
    drop((mapped, held, client));
}

#[test]
fn hosts_with_shares_of_the_shared_devices_allocate_apart_and_import_each_other() {
    let Some(lab) = domain::Lab::start() else { return };
    let device = lab.dir.path().join("shared-cxl.raw");
    std::fs::File::create(&device).unwrap().set_len(DAX_BYTES).unwrap();
    // Each host claims 64 MiB of each shared device in the domain: 128 MiB of the 2-way set.
    let node = |name: &str| sharing_host(&lab, &device, name);
    // One after the other, so the shares' order is known: a's DPAs first, then b's.
    let a = node("host-a");
    let mut b = node("host-b");
    domain::wait_live(&[&a, &b]);
    // Each node's status lists its shares: one per device, at one offset on both.
    for (node, offset) in [(&a, 0), (&b, SHARE)] {
        let status = domain::status(&node.socket);
        let shares = status["self"]["shares"].as_array().cloned().unwrap_or_default();
        let resources: Vec<&str> = shares.iter().filter_map(|s| s["resource"].as_str()).collect();
        assert_eq!(
            resources,
            ["serial:cxl/0x5eed0000/cxl_volatile0", "serial:cxl/0x5eed0001/cxl_volatile0"],
            "{status}"
        );
        assert!(shares.iter().all(|s| s["offset"] == offset && s["len"] == SHARE), "{status}");
        // Both member records name the CXL pools of the shared devices: the first device's
        // named after it, the second's as the configuration names it.
        let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
        for name in ["host-a", "host-b"] {
            let entry = nodes.iter().find(|n| n["name"] == name).unwrap_or_else(|| panic!("{name} in {status}"));
            assert_eq!(
                entry["groups"],
                serde_json::json!(["cxl-pool:serial:cxl_0x5eed0000", "cxl-pool:rack4-pool"]),
                "{status}"
            );
        }
    }

    // Each allocator hands out only its own share: the same first request lands apart.
    let importer = domain::session(&b.socket, None);
    let own = importer.alloc(&Target::Set(SET.into()), LEN).unwrap();
    let owner = domain::session(&a.socket, None);
    let region = owner.alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert_eq!(region.fd_offset(), 0, "a's share starts the devices");
    assert_eq!(own.fd_offset(), 2 * SHARE, "b's share follows a's on each member (DPA 64 MiB, set offset 128 MiB)");
    // a's share is full past 2 × 64 MiB of the set, though the devices have room.
    match owner.alloc(&Target::Set(SET.into()), 2 * SHARE) {
        Err(Error::Refused { code: ErrorCode::NoSpace, .. }) => {}
        other => panic!("past a's share: {other:?}"),
    }
    let rest = owner.alloc(&Target::Set(SET.into()), 2 * SHARE - LEN).unwrap();
    assert_eq!(rest.fd_offset(), LEN);

    // So b may hand its client a's region: DPAs it holds none of.
    let om = owner.map(&region).unwrap();
    assert!(!om.coherent(), "a region on a share of a device other hosts reach is not coherent for its owner either");
    fill(&om, 0x1a, LEN);
    om.flush(0, LEN).unwrap();
    let handle = owner.export(&region, &Policy::default()).unwrap();
    let import = importer.import(&handle, true).unwrap();
    assert!(!import.copy_only());
    assert_eq!(import.fd_offset(), region.fd_offset());
    let im = importer.map(&import).unwrap();
    assert!(!im.coherent());
    im.invalidate(0, LEN).unwrap();
    check(&im, 0x1a, LEN);
    fill(&im, 0x1b, LEN);
    im.flush(0, LEN).unwrap();
    check_file(&device, region.fd_offset(), LEN, 0x1b);
    // And b's own region, on its share, was never touched by those stores: still zero.
    let mut bytes = vec![0xffu8; LEN as usize];
    std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::open(&device).unwrap(), &mut bytes, own.fd_offset())
        .unwrap();
    assert!(bytes.iter().all(|&b| b == 0), "b's region is b's alone");

    // b's share is full past 2 × 64 MiB of the set. Restarted with twice the bytes in its
    // configuration, its shares grow in place (the room after them is free) and it
    // allocates what did not fit before; a's share stays as it was. The devices are now
    // declared coherent (as CXL with back-invalidate would be): b's mappings say so.
    match importer.alloc(&Target::Set(SET.into()), 2 * SHARE) {
        Err(Error::Refused { code: ErrorCode::NoSpace, .. }) => {}
        other => panic!("past b's share: {other:?}"),
    }
    drop((im, import, importer));
    let config = b.dir.path().join("fabricd.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    let grown = text.replace(&format!("bytes = {SHARE}\n"), &format!("bytes = {}\ncoherent = true\n", 2 * SHARE));
    std::fs::write(&config, grown).unwrap();
    b.restart();
    domain::wait_live(&[&a, &b]);
    let status = domain::status(&b.socket);
    let shares = status["self"]["shares"].as_array().cloned().unwrap_or_default();
    assert_eq!(shares.len(), 2, "{status}");
    assert!(shares.iter().all(|s| s["offset"] == SHARE && s["len"] == 2 * SHARE), "grown in place: {status}");
    let status = domain::status(&a.socket);
    let shares = status["self"]["shares"].as_array().cloned().unwrap_or_default();
    assert!(shares.iter().all(|s| s["offset"] == 0 && s["len"] == SHARE), "a's as it was: {status}");
    let grown = domain::session(&b.socket, None);
    let more = grown.alloc(&Target::Set(SET.into()), 2 * SHARE).unwrap();
    assert!(more.fd_offset() >= 2 * SHARE, "in b's share: {:#x}", more.fd_offset());
    assert!(grown.map(&more).unwrap().coherent(), "a share declared coherent");
    let import = grown.import(&handle, true).unwrap();
    assert!(grown.map(&import).unwrap().coherent(), "b declares both members coherent");
}

/// Host `name` of `lab` on the shared devices (the DAX stand-in `device`), claiming
/// [`SHARE`] of each.
fn sharing_host(lab: &domain::Lab, device: &std::path::Path, name: &str) -> common::Daemon {
    let root = lab.dir.path().join(format!("{name}-root"));
    common::dax_fixture(&root, 2 << 20, DAX_BYTES, Some(device));
    let fabric = lab.dir.path().join(format!("{name}.toml"));
    std::fs::write(&fabric, host(name)).unwrap();
    // The first device's pool is named after it; the second's is named here.
    let shares = format!(
        "[[memory.shares]]\ndevice = \"serial:cxl/0x5eed0000\"\nbytes = {SHARE}\n\
         [[memory.shares]]\ndevice = \"serial:cxl/0x5eed0001\"\nbytes = {SHARE}\npool = \"rack4-pool\"\n"
    );
    let memory = format!("[memory]\ndax = [\"dax0.0\"]\n{shares}");
    let discovery = format!("sim_node = {name:?}\nsysfs_root = {:?}", root.display().to_string());
    lab.node_with(&fabric, &discovery, "", &memory, name)
}

/// Polls `done` every 50 ms until it holds, failing with `what` after `within`.
fn until(within: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `node`'s state (`live`, `gone`, ...) as `socket`'s daemon lists it.
fn state_of(socket: &std::path::Path, node: &str) -> String {
    let status = domain::status(socket);
    let nodes = status["nodes"].as_array().cloned().unwrap_or_default();
    nodes
        .iter()
        .find(|n| n["name"] == node)
        .map(|n| n["state"].as_str().unwrap_or_default().to_owned())
        .unwrap_or_default()
}

#[test]
fn a_host_whose_share_was_collected_and_taken_neither_rejoins_nor_starts_on_it() {
    let Some(lab) = domain::Lab::start() else { return };
    let device = lab.dir.path().join("shared-cxl.raw");
    std::fs::File::create(&device).unwrap().set_len(DAX_BYTES).unwrap();
    let mut a = sharing_host(&lab, &device, "host-a");
    let b = sharing_host(&lab, &device, "host-b");
    domain::wait_live(&[&a, &b]);
    // a's region lies in its share (DPA 0 of each member).
    let region = domain::session(&a.socket, None).alloc(&Target::Set(SET.into()), LEN).unwrap();
    assert_eq!(region.fd_offset(), 0);

    // a hangs past its lease; an admin collects it through b; c starts and takes the
    // lowest free range: a's.
    let signal = |pid: u32, sig: libc::c_int| {
        // SAFETY: kill(2) on our own child's pid, which it keeps until we reap it.
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
    };
    let pid = a.child.id();
    signal(pid, libc::SIGSTOP);
    until(Duration::from_secs(10), "b sees a gone", || state_of(&b.socket, "host-a") == "gone");
    let s = std::os::unix::net::UnixStream::connect(&b.socket).unwrap();
    let mut admin = fabric_proto::wire::Connection::new(s);
    admin.hello("crossnode-test", fabric_proto::wire::SUPPORTED_VERSIONS).unwrap();
    let gc = fabric_proto::wire::DomainAction::Gc { node: fabric_proto::wire::Name::truncated("host-a") };
    admin.call(fabric_proto::wire::Request::Domain(fabric_proto::wire::DomainRequest { action: gc }), &[]).unwrap();
    let c = sharing_host(&lab, &device, "host-c");
    let status = domain::status(&c.socket);
    let offsets: Vec<u64> =
        status["self"]["shares"].as_array().unwrap().iter().map(|s| s["offset"].as_u64().unwrap()).collect();
    assert_eq!(offsets, [0, 0], "c took a's collected range: {status}");

    // a resumes: its lease is gone, and its share with it. It does not rejoin on c's
    // memory: it stays fenced, saying who holds the range.
    signal(pid, libc::SIGCONT);
    until(Duration::from_secs(15), "a fenced, naming c", || {
        let s = domain::status(&a.socket);
        s["self"]["standing"] == "fenced" && s["self"]["reason"].as_str().is_some_and(|r| r.contains("held by host-c"))
    });
    assert_ne!(state_of(&c.socket, "host-a"), "live", "a is not a member on c's range");
    // Nor does it place new regions there, fenced as it is: its share is c's now.
    let refused = domain::session(&a.socket, None).alloc(&Target::Set(SET.into()), LEN).unwrap_err();
    assert!(refused.to_string().contains("held by host-c"), "{refused}");

    // a is killed and started again on its state: refused, naming c, instead of serving
    // its region on c's DPAs.
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let log = a.dir.path().join("again.log");
    /// Kills the process when the test ends, whichever way.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut again = Reaped(
        std::process::Command::new(common::fabricd_bin())
            .arg("--config")
            .arg(a.dir.path().join("fabricd.toml"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let mut exit = None;
    until(Duration::from_secs(30), "a's second start ends", || {
        exit = again.0.try_wait().unwrap();
        exit.is_some()
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!exit.unwrap().success(), "{text}");
    assert!(text.contains("was collected and is held by host-c"), "{text}");
    drop(b);
}
