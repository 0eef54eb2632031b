//! Monitoring on the real daemon: a device that vanishes at a rescan takes its regions with
//! it — every export revoked (a later import is `Revoked`), every importer and the owner
//! told (reason `DeviceLost`), new exports and allocations on it refused — and when it
//! comes back it is `Recovered` and takes allocations again; a kernel uevent reaches the
//! daemon's listener and a relevant one triggers a rescan without any interval (as root); a
//! CXL region torn down and created again (no device or link change) rebuilds its set.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceChange, DeviceName, ErrorCode,
    Event, ExportHandle, ExportPolicy, ExportRequest, FreeRequest, ImportRequest, MemoryClass, ProblemKind, Request,
    Response, Revocation, RevocationReason, SUPPORTED_VERSIONS, SessionToken, StatusRequest, StatusResponse,
    SubscribeRequest, Topics,
};
use fabric_topology::{DeviceKind, Inventory};

const MIB: u64 = 1 << 20;

fn inventory(sim: &Path) -> Inventory {
    fabric_drivers::sim::load(sim).unwrap()
}

fn gpus(inv: &Inventory) -> Vec<String> {
    inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).map(|d| d.id.to_string()).collect()
}

fn call(c: &mut Connection, req: Request) -> Result<Response, ErrorCode> {
    match c.call(req, &[]) {
        Ok((r, _)) => Ok(r),
        Err(CodecError::Refused { body, .. }) => Err(body.code),
        Err(e) => panic!("{e}"),
    }
}

fn subscribe(c: &mut Connection, topics: Topics) {
    let Ok(Response::Subscribe(_)) = call(c, Request::Subscribe(SubscribeRequest { topics })) else { panic!() };
}

fn alloc(c: &mut Connection, device: &str) -> Result<(u64, u64), ErrorCode> {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size: 2 * MIB,
        align: 0,
    });
    call(c, req).map(|r| match r {
        Response::Alloc(a) => (a.region, a.generation),
        other => panic!("{other:?}"),
    })
}

fn policy() -> ExportPolicy {
    ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    }
}

fn export(c: &mut Connection, region: u64) -> Result<ExportHandle, ErrorCode> {
    call(c, Request::Export(ExportRequest { region, policy: policy(), node: None })).map(|r| match r {
        Response::Export(e) => e.handle,
        other => panic!("{other:?}"),
    })
}

fn import(c: &mut Connection, handle: ExportHandle) -> Result<u64, ErrorCode> {
    call(c, Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite })).map(|r| match r {
        Response::Import(i) => i.import,
        other => panic!("{other:?}"),
    })
}

fn status(c: &mut Connection) -> StatusResponse {
    let Ok(Response::Status(s)) = call(c, Request::Status(StatusRequest {})) else { panic!() };
    s
}

/// Writes `text` to `path` atomically (the daemon may be reading it).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Events until `done` accepts one (all returned), within 20 s.
fn events_until(c: &mut Connection, done: impl Fn(&Event) -> bool) -> Vec<Event> {
    c.stream().set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        let ev = c.next_event().unwrap_or_else(|e| panic!("{e}; saw {seen:?}"));
        let stop = done(&ev);
        seen.push(ev);
        if stop {
            return seen;
        }
    }
    panic!("no matching event; saw {seen:?}");
}

/// The HGX sim with its last GPU left out (and its NVLinks with it).
fn seven_gpus(base: &str) -> String {
    let seven = base
        .replacen(
            "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            1,
        )
        .replacen("i = 8\n", "i = 7\n", 1);
    assert_ne!(seven, base);
    seven
}

/// A daemon on an editable copy of the sim file, with `discovery` lines added.
fn editable(discovery: &str) -> (common::Setup, std::path::PathBuf, String) {
    let setup = common::Setup::new("");
    let sim = setup.dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(common::sim_file()).unwrap();
    std::fs::write(&sim, &base).unwrap();
    let config = std::fs::read_to_string(&setup.config).unwrap().replace(
        &format!("sim = [{:?}]", common::sim_file().display().to_string()),
        &format!("sim = [{:?}]\n{discovery}", sim.display().to_string()),
    );
    assert!(config.contains(discovery));
    std::fs::write(&setup.config, config).unwrap();
    (setup, sim, base)
}

#[test]
fn a_vanished_device_revokes_its_regions_exports_and_tells_importers_and_owner() {
    let (setup, sim, base) = editable("rescan_interval_s = 1");
    let d = common::start(&setup.config, setup.dir.path());
    let all = gpus(&inventory(&sim));
    let seven = seven_gpus(&base);
    let gone: Vec<String> = {
        let left = gpus(&inventory_of(&seven));
        all.iter().filter(|g| !left.contains(g)).cloned().collect()
    };
    assert_eq!(gone.len(), 1);
    let gpu7 = gone[0].clone();
    let gpu0 = all.iter().find(|g| **g != gpu7).unwrap().clone();

    let mut owner = common::client(&setup.socket);
    let mut importer = common::client(&setup.socket);
    subscribe(&mut owner, Topics::REVOCATION.union(Topics::DEVICE));
    subscribe(&mut importer, Topics::REVOCATION);
    let (lost, lost_gen) = alloc(&mut owner, &gpu7).unwrap();
    let (kept, _) = alloc(&mut owner, &gpu0).unwrap();
    let handle = export(&mut owner, lost).unwrap();
    let kept_handle = export(&mut owner, kept).unwrap();
    let imp = import(&mut importer, handle).unwrap();
    let kept_imp = import(&mut importer, kept_handle).unwrap();

    replace(&sim, &seven);
    // The importer is told its import of the lost region ended, and nothing about the other.
    let ev = events_until(&mut importer, |e| matches!(e, Event::Revocation(_)));
    let want = Revocation { region: lost, generation: lost_gen, import: imp, reason: RevocationReason::DeviceLost };
    assert_eq!(ev.last(), Some(&Event::Revocation(want)));
    // The owner sees the device go, then its own region lost (import 0).
    let ev = events_until(&mut owner, |e| matches!(e, Event::Revocation(_)));
    assert!(
        ev.iter()
            .any(|e| matches!(e, Event::Device { device, change: DeviceChange::Removed } if device.as_str() == gpu7)),
        "{ev:?}"
    );
    let own = Revocation { region: lost, generation: lost_gen, import: 0, reason: RevocationReason::DeviceLost };
    assert_eq!(ev.last(), Some(&Event::Revocation(own)));

    // The handle is revoked for everyone; the other region's handle still works.
    let mut late = common::client(&setup.socket);
    assert_eq!(import(&mut late, handle), Err(ErrorCode::Revoked));
    assert!(import(&mut importer, kept_handle).unwrap() > kept_imp);
    // No new exports of the lost region, no allocations on the lost device.
    assert_eq!(export(&mut owner, lost), Err(ErrorCode::Unavailable));
    assert_eq!(alloc(&mut owner, &gpu7), Err(ErrorCode::Unavailable));
    let st = status(&mut late);
    assert_eq!(st.exports, 1, "the kept region's export only (the lost one's is revoked): {st:?}");
    assert_eq!(st.regions, 2, "the lost region stays until freed: {st:?}");
    let missing = st.problems.iter().find(|p| p.kind == ProblemKind::DeviceMissing && p.subject.as_str() == gpu7);
    assert!(missing.is_some_and(|p| p.detail.as_str().contains("exports revoked")), "{st:?}");
    assert!(d.log().contains("device lost with its regions"), "{}", d.log());

    // The device comes back: Recovered (not Added), and it takes allocations again. The
    // lost region stays lost until its owner frees it.
    replace(&sim, &base);
    let ev = events_until(
        &mut owner,
        |e| matches!(e, Event::Device { device, change: DeviceChange::Recovered } if device.as_str() == gpu7),
    );
    assert!(!ev.iter().any(|e| matches!(e, Event::Device { change: DeviceChange::Added, .. })), "{ev:?}");
    assert!(alloc(&mut owner, &gpu7).is_ok());
    assert_eq!(export(&mut owner, lost), Err(ErrorCode::Unavailable));
    assert!(call(&mut owner, Request::Free(FreeRequest { region: lost, node: None })).is_ok());
    let st = status(&mut late);
    assert!(!st.problems.iter().any(|p| p.subject.as_str() == gpu7), "{st:?}");
}

/// A client that can take its session back after a restart: the connection and its token.
fn resumable(socket: &Path, resume: Option<SessionToken>) -> (Connection, SessionToken) {
    let s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut c = Connection::new(s);
    let h = c.hello_with("monitor-test", SUPPORTED_VERSIONS, resume).unwrap();
    (c, h.token.expect("a 1.1 hello carries a token"))
}

/// A region lost with its device is journaled as lost: a restart with the device back
/// (after `kill -9`, replaying the record; then again, from the snapshot the start wrote)
/// keeps its exports revoked and the region lost until its owner frees it.
#[test]
fn a_lost_region_stays_lost_after_restarts_with_its_device_back() {
    let (setup, sim, base) = editable("rescan_interval_s = 1");
    let d = common::start(&setup.config, setup.dir.path());
    let seven = seven_gpus(&base);
    let left = gpus(&inventory_of(&seven));
    let all = gpus(&inventory(&sim));
    let gpu7 = all.iter().find(|g| !left.contains(g)).unwrap().clone();
    let gpu0 = left[0].clone();

    let (mut owner, token) = resumable(&setup.socket, None);
    subscribe(&mut owner, Topics::REVOCATION);
    let (lost, _) = alloc(&mut owner, &gpu7).unwrap();
    let (kept, _) = alloc(&mut owner, &gpu0).unwrap();
    let handle = export(&mut owner, lost).unwrap();
    let kept_handle = export(&mut owner, kept).unwrap();
    replace(&sim, &seven);
    // The owner is told after the loss is durable.
    events_until(&mut owner, |e| matches!(e, Event::Revocation(r) if r.region == lost && r.import == 0));

    // The daemon dies; the device is back before it starts again.
    drop(d);
    replace(&sim, &base);
    for start in ["replaying the journal", "from the snapshot"] {
        let _d = common::start(&setup.config, setup.dir.path());
        let mut late = common::client(&setup.socket);
        assert_eq!(import(&mut late, handle), Err(ErrorCode::Revoked), "{start}");
        assert!(import(&mut late, kept_handle).is_ok(), "{start}");
        let st = status(&mut late);
        assert_eq!((st.regions, st.exports), (2, 1), "both regions wait for their owner, one export live: {start}");
    }
    let _d = common::start(&setup.config, setup.dir.path());
    let (mut owner, _) = resumable(&setup.socket, Some(token));
    assert_eq!(export(&mut owner, lost), Err(ErrorCode::Unavailable), "still lost");
    assert!(export(&mut owner, kept).is_ok());
    assert!(call(&mut owner, Request::Free(FreeRequest { region: lost, node: None })).is_ok());
    assert!(alloc(&mut owner, &gpu7).is_ok(), "the device takes regions again");
}

fn inventory_of(text: &str) -> Inventory {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("f.toml");
    std::fs::write(&p, text).unwrap();
    inventory(&p)
}

/// Writes `text` to a sysfs `uevent` file, which makes the kernel send a synthetic uevent.
fn synth(path: &str, text: &str) -> std::io::Result<()> {
    std::fs::OpenOptions::new().write(true).open(path)?.write_all(text.as_bytes())
}

fn wait_log(d: &common::Daemon, what: &str, secs: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if d.log().contains(what) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn kernel_uevents_reach_the_listener_and_a_relevant_one_triggers_a_rescan() {
    if nix::unistd::geteuid().as_raw() != 0 {
        eprintln!("skipped: writing a sysfs uevent file (which makes the kernel send a uevent) needs root");
        return;
    }
    const LO: &str = "/sys/class/net/lo/uevent";
    const NODE: &str = "/sys/devices/system/node/node0/uevent";
    if let Err(e) = synth(LO, "change") {
        eprintln!("skipped: {LO} is not writable here ({e})");
        return;
    }
    // No periodic rescans: only a uevent can make this daemon rescan.
    let (setup, sim, base) = editable("rescan_interval_s = 0\nuevents = \"on\"");
    let d = common::start(&setup.config, setup.dir.path());
    if !d.log().contains("listening for kernel uevents") {
        assert!(d.log().contains("cannot listen for kernel uevents"), "{}", d.log());
        eprintln!("skipped: the uevent socket cannot be opened here:\n{}", d.log());
        return;
    }
    // An ignored subsystem (net): seen and logged with our synthetic UUID, not relevant.
    let uuid = "6f1c5e2a-9b7d-4c3e-8a21-0d4f5b6c7e8f";
    synth(LO, &format!("change {uuid}")).unwrap();
    assert!(wait_log(&d, uuid, 10), "the listener did not see the uevent:\n{}", d.log());
    let line = d.log().lines().find(|l| l.contains(uuid)).unwrap().to_owned();
    assert!(
        line.contains("kernel uevent") && line.contains("subsystem=net") && line.contains("relevant=false"),
        "{line}"
    );

    // The fabric changes; a relevant uevent (node) makes the daemon see it at once.
    let mut sub = common::client(&setup.socket);
    subscribe(&mut sub, Topics::DEVICE);
    replace(&sim, &seven_gpus(&base));
    let uuid2 = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
    let sent = Instant::now();
    synth(NODE, &format!("change {uuid2}")).unwrap();
    let ev = events_until(&mut sub, |e| matches!(e, Event::Device { change: DeviceChange::Removed, .. }));
    assert!(sent.elapsed() < Duration::from_secs(5), "{:?}", sent.elapsed());
    assert!(!ev.is_empty());
    let line = d.log().lines().find(|l| l.contains(uuid2)).unwrap().to_owned();
    assert!(line.contains("subsystem=node") && line.contains("relevant=true"), "{line}");
    assert!(wait_log(&d, "rescan found changes", 10), "{}", d.log());
}

#[test]
fn a_cxl_region_torn_down_and_created_again_rebuilds_its_interleave_set() {
    let setup = common::Setup::new("");
    let sim = setup.dir.path().join("fabric.toml");
    let pool = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/sim/cxl-pool.toml");
    let base = std::fs::read_to_string(&pool).unwrap();
    std::fs::write(&sim, &base).unwrap();
    let config = std::fs::read_to_string(&setup.config).unwrap().replace(
        &format!("sim = [{:?}]", common::sim_file().display().to_string()),
        &format!("sim = [{:?}]\nrescan_interval_s = 1", sim.display().to_string()),
    );
    std::fs::write(&setup.config, config).unwrap();
    let _d = common::start(&setup.config, setup.dir.path());
    let mut c = common::client(&setup.socket);
    subscribe(&mut c, Topics::MAP);
    let sets = |c: &mut Connection| -> Vec<String> {
        let Ok(Response::Map(doc)) = call(c, Request::Map(fabric_proto::wire::TopologyRequest { node: None })) else {
            panic!()
        };
        let v: serde_json::Value = serde_json::from_str(&doc.json).unwrap();
        v["ranges"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["kind"] == "interleave")
            .map(|r| r["owner"].as_str().unwrap().to_owned())
            .collect()
    };
    let before = sets(&mut c);
    assert_eq!(before.len(), 2, "{before:?}");

    // region0 torn down; its memdevs stay, so no device or link changes: only the set.
    let region0 = "[[templates.cxl-host.cxl_region]]\nname = \"region0\"\nmode = \"ram\"\ntargets = [\"mem0\", \"mem1\"]\ngranularity = 4096\nnuma = 1\n";
    assert!(base.contains(region0));
    replace(&sim, &base.replace(region0, ""));
    let ev = events_until(&mut c, |e| matches!(e, Event::Map(_)));
    let Some(Event::Map(m)) = ev.last() else { panic!() };
    assert!(m.removed >= 1, "{m:?}");
    let after = sets(&mut c);
    assert_eq!(after.len(), 1, "{after:?}");
    let gone = before.iter().find(|s| !after.contains(s)).unwrap().clone();

    // Created again: the set is back.
    replace(&sim, &base);
    let ev = events_until(&mut c, |e| matches!(e, Event::Map(_)));
    let Some(Event::Map(m)) = ev.last() else { panic!() };
    assert!(m.added >= 1, "{m:?}");
    assert!(sets(&mut c).contains(&gone));
}
