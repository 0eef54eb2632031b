//! Faults of a domain with real fabricd processes, each in a network namespace of its own,
//! and a real etcd in another (the harness of `fabric_domain::testing::netns`): a node
//! killed (`kill -9`) is seen gone by the other within TTL + 1 s, its slot a hole, and
//! restarted in its namespace has its slot, its GFAs and its regions back; a node
//! hung (SIGSTOP) past its TTL notices on resuming that it was expired and rejoins with a
//! new incarnation, and no domain write of its old incarnation lands after its expiry; a
//! node cut off from etcd by iptables fences itself before its TTL ends, serves its local
//! clients on and rejoins on the heal; etcd stopped and restarted on its data: local
//! operations and the held domain map go on, domain changes are refused naming etcd, and
//! everything resumes; sixteen nodes started at once take sixteen slots and hold one map,
//! with a bounded number of etcd requests.
//!
//! Root, `ip`, `iptables` and `etcd` are needed; without them a test prints `skipped: …`
//! and passes (under `scripts/test.sh`, which installs them, it fails instead). Each test removes its namespaces, its etcd and its daemons when it ends.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fabric_domain::etcd_client::{Client, EventType, WatchOptions};
use fabric_domain::testing::netns::{self, ETCD_ADDR, Net, Netns};
use fabric_domain::testing::{self, EtcdServer};
use fabric_proto::wire::{
    BoundedVec, Connection, DeviceName, DomainAction, DomainRequest, Name, PartitionSpec, PartitionsRequest, Request,
    Response, Translation,
};
use serde_json::Value;

use common::domain::{all_live_and_placed, domain, map, nodes, standing, translate, until};

const SPAN: u64 = 1 << 40;

/// Node `tray<i>` of the domain at `etcd`, with lease TTL `ttl`.
fn setup(etcd: &EtcdServer, i: usize, ttl: u64) -> common::Setup {
    let name = format!("tray{i}");
    common::domain::node(etcd.endpoint(), &name, &name, SPAN, ttl)
}

/// Starts fabricd for `s` inside `ns` and waits until it is ready.
fn start_in(ns: &Netns, s: &common::Setup) -> common::Daemon {
    common::start_with(&s.config, s.dir.path(), |cmd| ns.enter_on_spawn(cmd).unwrap())
}

/// Nodes `tray0..tray<n-1>`, each in its namespace of `net`, lease TTL `ttl`; returns once
/// every node lists them all live with their placements.
fn up(net: &Net, etcd: &EtcdServer, n: usize, ttl: u64) -> (Vec<common::Setup>, Vec<common::Daemon>, Vec<Connection>) {
    let setups: Vec<_> = (0..n).map(|i| setup(etcd, i, ttl)).collect();
    let daemons: Vec<_> = setups.iter().zip(net.nodes()).map(|(s, ns)| start_in(ns, s)).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(15), "every node live with placements", || all_live_and_placed(c, n));
    }
    (setups, daemons, clients)
}

fn signal(daemon: &common::Daemon, sig: &str) {
    let pid = daemon.child.id().to_string();
    assert!(Command::new("kill").arg(format!("-{sig}")).arg(pid).status().unwrap().success());
}

/// The first GPU of `node` in `c`'s domain map.
fn gpu_of(c: &mut Connection, node: &str) -> String {
    let m = map(c);
    let r = m["ranges"].as_array().unwrap().iter().find(|r| r["node"] == node && r["kind"] == "direct").unwrap();
    r["owner"].as_str().unwrap().split('#').next().unwrap().to_owned()
}

/// The first GFA of a range `node` placed, from `c`'s domain map.
fn gfa_of(c: &mut Connection, node: &str) -> u64 {
    let m = map(c);
    let r = m["ranges"].as_array().unwrap().iter().find(|r| r["node"] == node && r["kind"] == "direct").unwrap();
    r["start"].as_u64().unwrap()
}

fn incarnation_of(c: &mut Connection, node: &str) -> Option<u64> {
    let doc = domain(c, DomainAction::Nodes);
    let n = doc["nodes"].as_array().unwrap().iter().find(|n| n["name"] == node)?;
    n["incarnation"].as_u64()
}

/// A map change a client can ask: partition `name` of `device` (admin: the tests run as
/// root). The node commits its map, which makes it publish its placements again.
fn partition(c: &mut Connection, name: &str, device: &str) -> Result<(), String> {
    let spec = PartitionSpec {
        name: Name::truncated(name),
        devices: vec![DeviceName::truncated(device)].try_into().unwrap(),
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
    };
    match c.call(Request::Partitions(PartitionsRequest::Set(spec)), &[]) {
        Ok((Response::Partitions(_), _)) => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

/// One event under the domain's prefix, as a watcher saw it.
#[derive(Debug, Clone)]
struct Seen {
    revision: i64,
    key: String,
    put: bool,
    /// The `incarnation` field of a member or placements record.
    incarnation: Option<u64>,
}

/// Records every event under `/fabric/test/` from inside `ns` until `stop` is told.
fn record_events(ns: &Netns, endpoint: String) -> (tokio::sync::oneshot::Sender<()>, JoinHandle<Vec<Seen>>) {
    let (stop_tx, mut stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = netns::in_netns(ns, move || async move {
        let mut client = Client::connect([endpoint.as_str()], None).await.unwrap();
        let mut stream = client.watch("/fabric/test/", Some(WatchOptions::new().with_prefix())).await.unwrap();
        ready_tx.send(()).unwrap();
        let mut seen = Vec::new();
        loop {
            tokio::select! {
                _ = &mut stop_rx => break,
                m = stream.message() => {
                    let Ok(Some(response)) = m else { break };
                    for e in response.events() {
                        let Some(kv) = e.kv() else { continue };
                        let value: Option<Value> = serde_json::from_slice(kv.value()).ok();
                        seen.push(Seen {
                            revision: kv.mod_revision(),
                            key: String::from_utf8_lossy(kv.key()).into_owned(),
                            put: e.event_type() == EventType::Put,
                            incarnation: value.and_then(|v| v["incarnation"].as_u64()),
                        });
                    }
                }
            }
        }
        seen
    })
    .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    (stop_tx, thread)
}

#[test]
fn a_node_hung_past_its_ttl_rejoins_with_a_new_incarnation_and_writes_nothing_as_a_zombie() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(testing::net_and_etcd_or_skip(2)) else { return };
    const TTL: u64 = 2;
    let (_setups, daemons, clients) = up(&net, &etcd, 2, TTL);
    let hung = &daemons[0];
    let [mut c0, mut c1] = <[Connection; 2]>::try_from(clients).ok().unwrap();
    let (_, old) = standing(&mut c0);
    let gpu = gpu_of(&mut c0, "tray0");
    let held = map(&mut c0);
    let (stop, events) = record_events(net.etcd(), etcd.endpoint().to_owned());

    // Hung past its TTL: the other node sees it gone.
    signal(hung, "STOP");
    let stopped = Instant::now();
    until(Duration::from_secs(TTL + 2), "tray0 gone", || {
        nodes(&mut c1).iter().any(|n| n.0 == "tray0" && n.1 == "gone")
    });
    std::thread::sleep(Duration::from_millis(500));
    // A domain change (a partition of the domain, a fenced etcd write) waits in its socket:
    // the first thing the node does on resuming is to try it, as the zombie it is.
    let asker = std::thread::spawn(move || {
        let r = partition(&mut c0, "p0", &gpu);
        (c0, r)
    });
    std::thread::sleep(Duration::from_millis(200));
    signal(hung, "CONT");
    let (mut c0, asked) = asker.join().unwrap();
    let refused = asked.expect_err("a zombie's domain write is refused");
    assert!(refused.contains("Unavailable") && refused.contains("fenced"), "{refused}");
    eprintln!("tray0 resumed {:?} after SIGSTOP; its queued write: {refused}", stopped.elapsed());
    until(Duration::from_secs(15), "tray0 rejoined with a new incarnation", || {
        let (s, inc) = standing(&mut c0);
        s == "joined" && inc != old
    });
    let (_, new) = standing(&mut c0);
    until(Duration::from_secs(10), "tray1 sees the new incarnation", || incarnation_of(&mut c1, "tray0") == Some(new));
    until(Duration::from_secs(10), "placements again", || all_live_and_placed(&mut c1, 2));
    // The rejoined node's own view holds its placements once its watch brings them back.
    until(Duration::from_secs(10), "tray0 sees placements again", || all_live_and_placed(&mut c0, 2));
    assert_eq!(map(&mut c1)["ranges"], held["ranges"], "the same slot and GFAs");
    assert!(hung.log().contains("lease lost"), "the node logs that it was expired");
    // Asked again as its new incarnation, the same change is written.
    let gpu = gpu_of(&mut c0, "tray0");
    partition(&mut c0, "p0", &gpu).expect("the rejoined node writes the domain change");
    std::thread::sleep(Duration::from_millis(500));
    stop.send(()).unwrap();
    let seen = events.join().unwrap();

    // The expiry, then the rejoin, then only writes of the new incarnation.
    let member = "/fabric/test/members/tray0";
    let placements = "/fabric/test/placements/tray0";
    let expired = seen.iter().find(|e| e.key == member && !e.put).expect("the member key expired").revision;
    let rejoined = seen
        .iter()
        .find(|e| e.key == member && e.put && e.incarnation == Some(new))
        .expect("the member key of the new incarnation")
        .revision;
    assert!(rejoined > expired, "{seen:?}");
    let after: Vec<&Seen> = seen.iter().filter(|e| e.key == placements && e.revision > expired).collect();
    assert!(!after.is_empty(), "the rejoined node published its placements: {seen:?}");
    for e in &after {
        assert_eq!(e.incarnation, Some(new), "a write of incarnation {old} after its expiry: {e:?}");
        assert!(e.revision > rejoined, "a placements write before the rejoin: {e:?}");
    }
    assert!(seen.iter().all(|e| !(e.key == member && e.put && e.incarnation == Some(old))), "{seen:?}");
    // The partition was written once, by the new incarnation: after its rejoin.
    let partition_key = "/fabric/test/partitions/p0";
    let written: Vec<&Seen> = seen.iter().filter(|e| e.key == partition_key).collect();
    assert_eq!(written.len(), 1, "{seen:?}");
    assert!(written[0].put && written[0].revision > rejoined, "{seen:?}");
}

#[test]
fn a_node_killed_in_its_namespace_is_seen_gone_within_the_ttl_and_comes_back_with_its_slot_and_regions() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(testing::net_and_etcd_or_skip(2)) else { return };
    const TTL: u64 = 2;
    let (setups, mut daemons, mut clients) = up(&net, &etcd, 2, TTL);
    let held = map(&mut clients[0]);
    let gpu = gpu_of(&mut clients[1], "tray1");
    let kept = common::domain::hold_region(&setups[1].socket, &gpu);

    let mut dead = daemons.remove(1);
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    until(Duration::from_secs(TTL + 3), "tray0 sees tray1 gone", || {
        nodes(&mut clients[0]).iter().any(|n| n.0 == "tray1" && n.1 == "gone")
    });
    let seen = killed.elapsed();
    eprintln!("kill -9: seen gone after {seen:?}");
    assert!(seen <= Duration::from_secs(TTL + 1), "gone seen after {seen:?}, more than TTL + 1 s");
    let gfa = kept.region.gfa.unwrap();
    assert!(matches!(translate(&mut clients[0], gfa), Translation::Remote { live: false, .. }), "a hole, still named");
    let status = domain(&mut clients[0], DomainAction::Status);
    assert!(status["missing"].to_string().contains("tray1: gone"), "{status}");

    // Restarted in its namespace: the same slot and GFAs, its regions back.
    drop(dead);
    let _back = start_in(&net.nodes()[1], &setups[1]);
    clients[1] = common::client(&setups[1].socket);
    for c in &mut clients {
        until(Duration::from_secs(15), "tray1 back", || all_live_and_placed(c, 2));
    }
    assert_eq!(map(&mut clients[0])["ranges"], held["ranges"]);
    kept.check_back(&setups[1].socket, &mut clients[0], "tray1", &gpu);
}

#[test]
fn a_node_cut_off_from_etcd_by_iptables_fences_itself_serves_on_and_rejoins_on_the_heal() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(testing::net_and_etcd_or_skip(2)) else { return };
    const TTL: u64 = 3;
    let (_setups, _daemons, clients) = up(&net, &etcd, 2, TTL);
    let [mut c0, mut c1] = <[Connection; 2]>::try_from(clients).ok().unwrap();
    let (_, old) = standing(&mut c0);
    let held = map(&mut c0);
    let gpu = gpu_of(&mut c0, "tray0");
    let remote = gfa_of(&mut c0, "tray1");

    let cut = &net.nodes()[0];
    cut.cut(ETCD_ADDR).unwrap();
    let t0 = Instant::now();
    until(Duration::from_secs(TTL + 1), "fenced", || standing(&mut c0).0 == "fenced");
    let fenced = t0.elapsed();
    let status = domain(&mut c0, DomainAction::Status);
    assert!(status["self"]["reason"].as_str().unwrap().contains("lease lost"), "{status}");
    // Fenced, it no longer follows the domain: it states itself fenced, and tray1 as its
    // last view saw it, unconfirmed; nothing is counted live.
    let listed = domain(&mut c0, DomainAction::Nodes);
    let states: Vec<_> =
        listed["nodes"].as_array().unwrap().iter().map(|n| (n["state"].clone(), n.get("last_seen"))).collect();
    assert_eq!(states, [("fenced".into(), None), ("unknown".into(), Some(&"live".into()))], "{listed}");
    assert_eq!(
        (status["summary"]["live"].as_u64(), status["summary"]["unknown"].as_u64()),
        (Some(0), Some(2)),
        "{status}"
    );
    assert!(status["missing"][0].as_str().unwrap().starts_with("this node is fenced"), "{status}");
    // Local service goes on: allocations, the held map, translations of other nodes' GFAs.
    let (alloc, _file) = common::alloc_hbm(&mut c0, &gpu, 1 << 20);
    assert!(alloc.size >= 1 << 20);
    assert_eq!(map(&mut c0), held);
    assert!(matches!(translate(&mut c0, remote), Translation::Remote { .. }));
    // A domain change is refused, naming etcd.
    let refused =
        c0.call(Request::Domain(DomainRequest { action: DomainAction::Gc { node: Name::truncated("tray1") } }), &[]);
    let err = format!("{:?}", refused.unwrap_err());
    assert!(err.contains("Unavailable") && err.contains("etcd unavailable"), "{err}");
    until(Duration::from_secs(TTL + 2), "tray1 sees tray0 gone", || {
        nodes(&mut c1).iter().any(|n| n.0 == "tray0" && n.1 == "gone")
    });
    let gone = t0.elapsed();
    eprintln!("cut: fenced after {fenced:?}, seen gone by tray1 after {gone:?}");
    assert!(fenced < Duration::from_secs(TTL), "fenced after {fenced:?}, not before the TTL ended");
    assert!(fenced < gone, "fenced ({fenced:?}) before the others saw it gone ({gone:?})");

    cut.heal(ETCD_ADDR).unwrap();
    let t1 = Instant::now();
    until(Duration::from_secs(15), "rejoined with a new incarnation", || {
        let (s, inc) = standing(&mut c0);
        s == "joined" && inc != old
    });
    eprintln!("healed: rejoined after {:?}", t1.elapsed());
    until(Duration::from_secs(10), "tray1 sees tray0 back", || all_live_and_placed(&mut c1, 2));
    until(Duration::from_secs(10), "tray0 states both live again", || all_live_and_placed(&mut c0, 2));
    assert_eq!(map(&mut c1)["ranges"], held["ranges"]);
    assert_eq!(map(&mut c0)["ranges"], held["ranges"]);
}

#[test]
fn etcd_stopped_and_restarted_local_service_and_held_maps_go_on_domain_changes_wait() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, mut etcd)) = rt.block_on(testing::net_and_etcd_or_skip(2)) else { return };
    const TTL: u64 = 3;
    let (_setups, _daemons, mut clients) = up(&net, &etcd, 2, TTL);
    let held = map(&mut clients[0]);
    assert_eq!(map(&mut clients[1]), held);
    let gpus: Vec<String> = (0..2).map(|i| gpu_of(&mut clients[i], &format!("tray{i}"))).collect();

    etcd.stop();
    let t0 = Instant::now();
    for (i, c) in clients.iter_mut().enumerate() {
        // Local operations and the held domain map, at once.
        let asked = Instant::now();
        assert_eq!(map(c), held);
        let (alloc, _file) = common::alloc_hbm(c, &gpus[i], 1 << 20);
        assert!(alloc.size >= 1 << 20);
        assert!(asked.elapsed() < Duration::from_secs(1), "local service waited for etcd: {:?}", asked.elapsed());
        // Domain changes (a slot gc, a partition of the domain): refused with a typed error
        // naming etcd.
        let other = Name::truncated(&format!("tray{}", 1 - i));
        let refused = c.call(Request::Domain(DomainRequest { action: DomainAction::Gc { node: other } }), &[]);
        let err = format!("{:?}", refused.unwrap_err());
        assert!(err.contains("Unavailable") && err.contains("etcd"), "{err}");
        let err = partition(c, &format!("p{i}"), &gpus[i]).expect_err("a domain partition needs etcd");
        assert!(err.contains("Unavailable") && err.contains("etcd"), "{err}");
    }
    // Past the point where the nodes' leases are lost: they say so, and still serve; the
    // fence comes before the TTL ends.
    until(Duration::from_secs(TTL + 2), "both fenced", || clients.iter_mut().all(|c| standing(c).0 == "fenced"));
    let fenced = t0.elapsed();
    assert!(fenced < Duration::from_secs(TTL), "fenced {fenced:?} after etcd stopped, not before the TTL ended");
    for c in &mut clients {
        assert_eq!(map(c), held);
    }
    eprintln!("etcd down for {:?}, both nodes fenced after {fenced:?}", t0.elapsed());
    rt.block_on(etcd.restart()).unwrap();
    let t1 = Instant::now();
    // A restarted etcd refreshes every lease, so a node's old member key may show it live
    // until that lease runs out, and only then does its rejoin go through: each view is
    // waited for until it holds both nodes' new incarnations' placements.
    for c in &mut clients {
        until(Duration::from_secs(15), "joined again", || standing(c).0 == "joined");
    }
    for c in &mut clients {
        until(Duration::from_secs(10), "both live with placements, the held map again", || {
            all_live_and_placed(c, 2) && map(c)["ranges"] == held["ranges"]
        });
    }
    eprintln!("etcd back: both nodes joined and placed after {:?}", t1.elapsed());
    for c in &mut clients {
        assert_eq!(map(c)["ranges"], held["ranges"]);
        // Domain requests reach etcd again: a live node's gc is refused by etcd's answer.
        let live =
            c.call(Request::Domain(DomainRequest { action: DomainAction::Gc { node: Name::truncated("tray0") } }), &[]);
        let err = format!("{:?}", live.unwrap_err());
        assert!(err.contains("BadRequest") && err.contains("tray0 is a live member"), "{err}");
    }
}

#[test]
fn a_watch_broken_by_a_short_etcd_restart_goes_on_from_the_views_revision() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, mut etcd)) = rt.block_on(testing::net_and_etcd_or_skip(2)) else { return };
    // A TTL long enough for the leases to outlive the restart: the joins stay, only the
    // watches break.
    const TTL: u64 = 12;
    let (_setups, daemons, mut clients) = up(&net, &etcd, 2, TTL);
    let incarnations: Vec<_> = clients.iter_mut().map(|c| incarnation_of(c, "tray0")).collect();
    rt.block_on(etcd.restart()).unwrap();
    for d in &daemons {
        until(Duration::from_secs(15), "the watch set up again", || d.log().contains("watching again"));
    }
    // A record put after the restart reaches both views through the resumed watch (each
    // refuses it, and says so in its log).
    let endpoint = etcd.endpoint().to_owned();
    netns::in_netns(net.etcd(), move || async move {
        let mut raw = Client::connect([endpoint.as_str()], None).await.unwrap();
        raw.put("/fabric/test/members/late-junk", "not a record", None).await.unwrap();
    })
    .unwrap()
    .join()
    .unwrap();
    for d in &daemons {
        until(Duration::from_secs(10), "the late record seen", || d.log().contains("members/late-junk"));
    }
    for (c, d) in clients.iter_mut().zip(&daemons) {
        assert_eq!(standing(c).0, "joined");
        let log = d.log();
        assert!(!log.contains("reading the domain again"), "the domain was read again:\n{log}");
        assert!(!log.contains("lease lost"), "a lease was lost:\n{log}");
    }
    let after: Vec<_> = clients.iter_mut().map(|c| incarnation_of(c, "tray0")).collect();
    assert_eq!(after, incarnations, "the same incarnations: no rejoin");
}

/// etcd's gRPC requests so far, by method (`grpc_server_handled_total`), read from inside
/// etcd's namespace.
fn etcd_requests(net: &Net) -> BTreeMap<String, u64> {
    let thread = netns::in_netns(net.etcd(), || async {
        let mut s = TcpStream::connect_timeout(&SocketAddr::from((ETCD_ADDR, 2379)), Duration::from_secs(5)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: etcd\r\n\r\n").unwrap();
        let mut page = String::new();
        s.read_to_string(&mut page).unwrap();
        page
    })
    .unwrap();
    let page = thread.join().unwrap();
    let mut by_method = BTreeMap::new();
    for line in page.lines().filter(|l| l.starts_with("grpc_server_handled_total{")) {
        let Some((labels, value)) = line.rsplit_once(' ') else { continue };
        let Some(method) = labels.split("grpc_method=\"").nth(1).and_then(|m| m.split('"').next()) else { continue };
        *by_method.entry(method.to_owned()).or_insert(0) += value.parse::<f64>().unwrap_or(0.0) as u64;
    }
    by_method
}

#[test]
fn sixteen_nodes_started_at_once_take_sixteen_slots_and_hold_one_map_without_a_retry_storm() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(testing::net_and_etcd_or_skip(16)) else { return };
    const TTL: u64 = 6;
    let setups: Vec<_> = (0..16).map(|i| setup(&etcd, i, TTL)).collect();
    let before = etcd_requests(&net);
    let t0 = Instant::now();
    let daemons: Vec<common::Daemon> = std::thread::scope(|scope| {
        let started: Vec<_> =
            setups.iter().zip(net.nodes()).map(|(s, ns)| scope.spawn(move || start_in(ns, s))).collect();
        started.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let ready = t0.elapsed();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(60), "sixteen nodes live with placements", || all_live_and_placed(c, 16));
    }
    let full = t0.elapsed();
    let after = etcd_requests(&net);
    let one = map(&mut clients[0]);
    for c in &mut clients[1..] {
        assert_eq!(map(c), one, "one map on every node");
    }
    let slots: BTreeSet<u64> = nodes(&mut clients[0]).iter().map(|n| n.2).collect();
    assert_eq!(slots.len(), 16, "sixteen distinct slots: {slots:?}");
    assert!(!slots.contains(&u64::MAX), "every node holds a slot: {slots:?}");
    // Each node joined once: one lease, no failed join retried.
    for (i, d) in daemons.iter().enumerate() {
        let log = d.log();
        assert_eq!(log.matches("joined the domain").count(), 1, "tray{i}:\n{log}");
        assert!(!log.contains("cannot join the domain"), "tray{i}:\n{log}");
    }
    let delta = |m: &str| after.get(m).copied().unwrap_or(0) - before.get(m).copied().unwrap_or(0);
    let (grants, txns, ranges) = (delta("LeaseGrant"), delta("Txn"), delta("Range"));
    eprintln!(
        "sixteen nodes: ready after {ready:?}, every node holds the full map after {full:?}; etcd requests: {grants} lease grants, {txns} txns, {ranges} ranges; all: {:?}",
        after.iter().map(|(m, n)| (m, n - before.get(m).copied().unwrap_or(0))).collect::<BTreeMap<_, _>>()
    );
    assert_eq!(grants, 16, "one lease per node");
    // Per node: the settings (at most one), its slot claim (a few races), its join, its
    // placements (a rescan may publish twice): a storm would be many times this.
    // Measured: 4 transactions and about 7 reads per node.
    assert!(txns <= 16 * 6, "a retry storm: {txns} transactions for sixteen joins");
    assert!(ranges <= 16 * 12, "a retry storm: {ranges} reads for sixteen joins");
}
