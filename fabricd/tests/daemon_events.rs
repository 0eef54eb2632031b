//! Events on the real daemon with real clients: revocations reach the importers that
//! subscribed (revoke, free, owner disconnect), and the periodic rescan of an edited sim
//! file publishes link, device and map events, updates `status` and leaves a hole in the
//! map, while other clients keep being served.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, Connection, DeviceChange, DeviceName, Event, ExportHandle,
    ExportPolicy, ExportRequest, FreeRequest, ImportRequest, LinkChange, MemoryClass, ProblemKind, Request, Response,
    Revocation, RevocationReason, RevokeRequest, StatusRequest, StatusResponse, SubscribeRequest, Topics,
    TopologyRequest,
};
use fabric_topology::{DeviceKind, Inventory, MemoryKind};

const MIB: u64 = 1 << 20;

fn inventory(sim: &Path) -> Inventory {
    fabric_drivers::sim::load(sim).unwrap()
}

fn first_gpu(inv: &Inventory) -> String {
    inv.devices.iter().find(|d| d.memory.iter().any(|m| m.kind == MemoryKind::Hbm)).unwrap().id.to_string()
}

fn call(c: &mut Connection, req: Request) -> Response {
    c.call(req, &[]).unwrap().0
}

fn subscribe(c: &mut Connection, topics: Topics) {
    let Response::Subscribe(s) = call(c, Request::Subscribe(SubscribeRequest { topics })) else { panic!() };
    assert_eq!(s.topics, topics);
}

fn alloc(c: &mut Connection, device: &str) -> u64 {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Hbm },
        size: 2 * MIB,
        align: 0,
    });
    let Response::Alloc(a) = call(c, req) else { panic!() };
    a.region
}

fn export(c: &mut Connection, region: u64) -> ExportHandle {
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let Response::Export(e) = call(c, Request::Export(ExportRequest { region, policy, node: None })) else { panic!() };
    e.handle
}

/// Imports and returns (import id, generation); the descriptor is kept open.
fn import(c: &mut Connection, handle: ExportHandle) -> (u64, u64, File) {
    let (r, mut fds) = c.call(Request::Import(ImportRequest { handle, access: AccessMode::ReadWrite }), &[]).unwrap();
    let Response::Import(i) = r else { panic!() };
    (i.import, i.generation, File::from(fds.remove(0)))
}

fn status(c: &mut Connection) -> StatusResponse {
    let Response::Status(s) = call(c, Request::Status(StatusRequest {})) else { panic!() };
    s
}

fn revocation(c: &mut Connection) -> Revocation {
    match c.next_event().unwrap() {
        Event::Revocation(r) => r,
        other => panic!("expected a revocation, got {other:?}"),
    }
}

#[test]
fn importers_that_subscribed_are_told_of_revoke_free_and_owner_exit() {
    let setup = common::Setup::new("");
    let _d = common::start(&setup.config, setup.dir.path());
    let gpu = first_gpu(&inventory(&common::sim_file()));
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    // A bystander subscribed to the map only: it is not told of B's revocations.
    let mut other = common::client(&setup.socket);
    subscribe(&mut other, Topics::MAP);
    subscribe(&mut b, Topics::REVOCATION);

    // Revoke.
    let r1 = alloc(&mut a, &gpu);
    let h1 = export(&mut a, r1);
    let (i1, g1, _f1) = import(&mut b, h1);
    call(&mut a, Request::Revoke(RevokeRequest { handle: h1 }));
    let got = revocation(&mut b);
    assert_eq!(got, Revocation { region: r1, generation: g1, import: i1, reason: RevocationReason::Revoked });

    // Free.
    let r2 = alloc(&mut a, &gpu);
    let (i2, g2, _f2) = import(&mut b, export(&mut a, r2));
    call(&mut a, Request::Free(FreeRequest { region: r2, node: None }));
    let got = revocation(&mut b);
    assert_eq!(got, Revocation { region: r2, generation: g2, import: i2, reason: RevocationReason::Freed });

    // The owner disconnects: every import of its regions ends (i1, still held after the
    // revoke, and a fresh i3).
    let (i3, g3, _f3) = import(&mut b, export(&mut a, r1));
    assert_eq!(g3, g1);
    drop(a);
    let mut got = vec![revocation(&mut b), revocation(&mut b)];
    got.sort_by_key(|r| r.import);
    let want = vec![
        Revocation { region: r1, generation: g1, import: i1, reason: RevocationReason::OwnerExited },
        Revocation { region: r1, generation: g1, import: i3, reason: RevocationReason::OwnerExited },
    ];
    assert_eq!(got, want);
    let st = status(&mut b);
    assert_eq!((st.regions, st.imports), (0, 0));

    // The bystander got nothing: its next frame is the answer to its own call.
    assert_eq!(status(&mut other).regions, 0);
    other.stream().set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    assert!(other.next_event().is_err(), "a map subscriber received another session's revocation");
}

/// Writes `text` to `path` atomically (the daemon may be reading it).
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Events until `done` accepts one (all returned), within 20 s.
fn events_until(c: &mut Connection, done: impl Fn(&Event) -> bool) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        let ev = c.next_event().unwrap();
        let stop = done(&ev);
        seen.push(ev);
        if stop {
            return seen;
        }
    }
    panic!("no matching event; saw {seen:?}");
}

#[test]
fn rescan_publishes_link_device_and_map_changes_and_status_shows_them() {
    let setup = common::Setup::new("");
    let sim = setup.dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(common::sim_file()).unwrap();
    std::fs::write(&sim, &base).unwrap();
    let config = std::fs::read_to_string(&setup.config).unwrap().replace(
        &format!("sim = [{:?}]", common::sim_file().display().to_string()),
        &format!("sim = [{:?}]\nrescan_interval_s = 1", sim.display().to_string()),
    );
    assert!(config.contains("rescan_interval_s = 1"));
    std::fs::write(&setup.config, config).unwrap();
    let d = common::start(&setup.config, setup.dir.path());
    let inv = inventory(&sim);
    let gpu0 = inv.devices.iter().filter(|d| d.kind == DeviceKind::Gpu).map(|d| d.id.to_string()).collect::<Vec<_>>();
    let mut subscriber = common::client(&setup.socket);
    subscribe(&mut subscriber, Topics::LINK.union(Topics::DEVICE).union(Topics::MAP));
    let mut other = common::client(&setup.socket);
    let before = status(&mut other);

    // gpu0's PCIe link trains at x4 of x16.
    let degraded = format!("{base}\n[[degraded]]\ndevice = \"node0/gpu0\"\nlink = \"pcie\"\nwidth = 4\n");
    replace(&sim, &degraded);
    let gpu0_id = {
        let new = inventory(&sim);
        let l = new
            .links
            .iter()
            .find(|l| l.state == fabric_topology::LinkState::Degraded && gpu0.contains(&new.device(l.b).id.to_string()))
            .unwrap();
        new.device(l.b).id.to_string()
    };
    let seen = events_until(&mut subscriber, |e| matches!(e, Event::Link { .. }));
    let Some(Event::Link { b, kind, change, .. }) = seen.last() else { panic!() };
    assert_eq!((b.as_str(), kind.as_str()), (gpu0_id.as_str(), "pcie"));
    assert_eq!(*change, LinkChange::Degraded { bandwidth_permille: 249 });
    let st = status(&mut other);
    let p = st
        .problems
        .iter()
        .find(|p| p.kind == ProblemKind::LinkDegraded && p.subject.as_str().ends_with(&gpu0_id))
        .expect("status reports the degraded link");
    assert_eq!(p.bandwidth_permille, Some(249));
    assert_eq!(st.map_generation, before.map_generation, "a link change does not change the map");

    // gpu7 vanishes (and its NVLinks with it).
    let gpus_before = gpu0.clone();
    let seven = degraded
        .replacen(
            "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            1,
        )
        .replacen("i = 8\n", "i = 7\n", 1);
    assert_ne!(seven, degraded);
    replace(&sim, &seven);
    let after: Vec<String> =
        inventory(&sim).devices.iter().filter(|d| d.kind == DeviceKind::Gpu).map(|d| d.id.to_string()).collect();
    let gone: Vec<&String> = gpus_before.iter().filter(|g| !after.contains(g)).collect();
    assert_eq!(gone.len(), 1);
    let gpu7 = gone[0].clone();
    let seen = events_until(&mut subscriber, |e| matches!(e, Event::Map(_)));
    assert!(
        seen.iter()
            .any(|e| matches!(e, Event::Device { device, change: DeviceChange::Removed } if device.as_str() == gpu7)),
        "{seen:?}"
    );
    let Some(Event::Map(m)) = seen.last() else { panic!() };
    assert!(m.holed >= 1, "{m:?}");
    assert!(m.generation > before.map_generation);

    // Status and the map listing, from a client that connected after all this.
    let mut late = common::client(&setup.socket);
    let st = status(&mut late);
    assert_eq!(st.map_generation, m.generation);
    assert!(st.problems.iter().any(|p| p.kind == ProblemKind::DeviceMissing && p.subject.as_str() == gpu7), "{st:?}");
    assert_eq!(st.devices as usize, inventory(&sim).devices.len());
    let Response::Map(doc) = call(&mut late, Request::Map(TopologyRequest { node: None })) else { panic!() };
    let listing: serde_json::Value = serde_json::from_str(&doc.json).unwrap();
    let holes: Vec<&serde_json::Value> = listing["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "hole" && r["owner"].as_str().unwrap_or("").contains(&gpu7))
        .collect();
    assert!(!holes.is_empty(), "no hole for {gpu7} in {}", doc.json);
    // The first client is still served.
    assert_eq!(status(&mut other).map_generation, m.generation);
    assert!(d.log().contains("fabric changed"));
}

#[test]
fn a_subscriber_that_falls_behind_is_closed_after_its_queue_and_never_blocks_others() {
    let setup = common::Setup::new("");
    let d = common::start(&setup.config, setup.dir.path());
    let gpu = first_gpu(&inventory(&common::sim_file()));
    let mut a = common::client(&setup.socket);
    let mut b = common::client(&setup.socket);
    subscribe(&mut b, Topics::REVOCATION);
    let region = alloc(&mut a, &gpu);
    let handle = export(&mut a, region);
    // Far more imports through one handle than a subscriber's queue holds (256): the
    // daemon's writer for B drains the queue into the socket while the revoke fills it, so
    // the burst must outrun it even when the filling thread is preempted (a loaded machine
    // once let 300 through whole).
    let n = 2000;
    for _ in 0..n {
        drop(import(&mut b, handle));
    }
    // One revoke queues an event per import at once: the daemon answers it without
    // waiting for B, and drops B's subscription when its queue is full.
    let t = Instant::now();
    call(&mut a, Request::Revoke(RevokeRequest { handle }));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(status(&mut a).regions, 1, "the daemon still serves others");
    // B gets what was queued, then the connection closes.
    let mut got = 0;
    loop {
        match b.next_event() {
            Ok(Event::Revocation(r)) => {
                assert_eq!((r.region, r.reason), (region, RevocationReason::Revoked));
                got += 1;
            }
            Ok(other) => panic!("{other:?}"),
            Err(_) => break,
        }
    }
    // The queue holds 256; B's connection runs on its own thread and may send a few while
    // the revoke is still queuing, so it sees at least 256 and never all of them.
    assert!((256..n).contains(&got), "the queue's events, then the close: got {got}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !d.log().contains("subscriber fell behind its events") {
        assert!(Instant::now() < deadline, "no log line for the dropped subscriber");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status(&mut a).imports, 0, "B's imports are released when it is closed");
}
