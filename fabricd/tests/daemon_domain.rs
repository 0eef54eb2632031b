//! fabricd nodes joined into one domain through a private etcd: three nodes, each serving
//! one tray of the sim supernode, hold the same domain map; a GFA of another node's slot
//! translates to that node; a node killed with SIGKILL is seen gone within TTL + 1 s with
//! its slot kept as a hole, and comes back with the same slot and GFAs; a second daemon
//! with a live node's name and one with other domain settings are refused, a cleanly
//! stopped node's name is free at once, an admin's gc frees only a gone node's slot (and
//! a node whose collected slot another took refuses to restart from its old state); a
//! node whose etcd stops answering fences itself (its leadership unknown), serves on and
//! rejoins; three nodes agree on one leader, and on a new one with a larger term when the
//! leader is killed; hostile records written into etcd by hand are refused by running
//! nodes with the reason logged and poison no map; a node's map changed while etcd is
//! away reaches the others once it is back, under the same membership; and
//! `scripts/domain.sh` starts and stops a domain, on loopback or with each node in a
//! network namespace of its own.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary it says it is
//! skipped (scripts/deps.sh installs Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fabric_domain::testing::EtcdServer;
use fabric_proto::wire::{Connection, DomainAction, DomainRequest, Request, Translation};
use serde_json::Value;

use common::domain::{all_live_and_placed, domain, map, nodes, translate, until};
use common::scrape::{free_port, promtool_check, scrape, value};

const TTL: u64 = 2;
const SPAN: u64 = 1 << 40;

fn etcd(rt: &tokio::runtime::Runtime) -> Option<EtcdServer> {
    rt.block_on(fabric_domain::testing::etcd_or_skip())
}

/// A node's files: tray `tray` of the supernode in domain `test`, node span `span`.
fn node(etcd: &EtcdServer, name: &str, tray: &str, span: u64) -> common::Setup {
    common::domain::node(etcd.endpoint(), name, tray, span, TTL)
}

#[test]
fn three_nodes_hold_one_map_and_see_a_death() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let setups: Vec<_> = (0..3).map(|i| node(&etcd, &format!("tray{i}"), &format!("tray{i}"), SPAN)).collect();
    let mut daemons: Vec<_> = setups.iter().map(|s| Some(common::start(&s.config, s.dir.path()))).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(15), "every node live with its placements", || all_live_and_placed(c, 3));
    }
    // One map, the same on every node: three slots, each node's memory inside its own.
    let first = map(&mut clients[0]);
    for c in &mut clients[1..] {
        assert_eq!(map(c), first, "every node shows the same domain map");
    }
    let slots: Vec<(String, u64)> = first["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["node"].as_str().unwrap().to_owned(), n["start"].as_u64().unwrap() / SPAN))
        .collect();
    assert_eq!(slots.len(), 3, "{first}");
    let ranges = first["ranges"].as_array().unwrap();
    for r in ranges {
        let node = r["node"].as_str().unwrap();
        let slot = slots.iter().find(|(n, _)| n == node).unwrap().1;
        assert_eq!(r["start"].as_u64().unwrap() / SPAN, slot, "{r}");
    }
    // A GFA of tray1 asked of tray0 names tray1, the device and the offset.
    let r1 = ranges.iter().find(|r| r["node"] == "tray1" && r["kind"] == "direct").unwrap().clone();
    let gfa = r1["start"].as_u64().unwrap() + 4096 + 5;
    let owner = r1["owner"].as_str().unwrap();
    let device = owner.split('#').next().unwrap();
    match translate(&mut clients[0], gfa) {
        Translation::Remote { node, live: true, resource: Some(res), offset, set: None } => {
            assert_eq!((node.as_str(), res.device.as_str(), offset), ("tray1", device, 4096 + 5));
        }
        other => panic!("{other:?}"),
    }
    // Its own GFAs stay local answers.
    let r0 = ranges.iter().find(|r| r["node"] == "tray0" && r["kind"] == "direct").unwrap();
    assert!(matches!(translate(&mut clients[0], r0["start"].as_u64().unwrap()), Translation::Resource { .. }));

    // A client of tray1 holds a region there, written through its mapping.
    let kept = common::domain::hold_region(&setups[1].socket, device);

    // kill -9 tray1: the others see it gone within TTL + 1 s, its slot kept as a hole.
    let before: Vec<Value> = ranges.iter().filter(|r| r["node"] == "tray1").cloned().collect();
    let mut dead = daemons[1].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    for i in [0, 2] {
        let c = &mut clients[i];
        until(Duration::from_secs(TTL + 3), "tray1 gone", || {
            nodes(c).iter().any(|(n, state, _, _)| n == "tray1" && state == "gone")
        });
    }
    let seen = killed.elapsed();
    assert!(seen <= Duration::from_secs(TTL + 1), "gone seen after {seen:?}, more than TTL + 1 s");
    let holed = map(&mut clients[0]);
    assert_eq!(map(&mut clients[2]), holed);
    let gone = holed["nodes"].as_array().unwrap().iter().find(|n| n["node"] == "tray1").unwrap();
    assert_eq!(gone["state"], "gone");
    for r in holed["ranges"].as_array().unwrap().iter().filter(|r| r["node"] == "tray1") {
        assert_eq!((r["kind"].as_str(), r["size"].as_u64()), (Some("hole"), Some(0)), "{r}");
    }
    match translate(&mut clients[0], gfa) {
        Translation::Remote { node, live: false, .. } => assert_eq!(node.as_str(), "tray1"),
        other => panic!("{other:?}"),
    }
    let status = domain(&mut clients[0], DomainAction::Status);
    let missing = status["missing"].to_string();
    assert!(missing.contains("tray1: gone"), "{status}");
    assert_eq!(status["self"]["standing"], "joined", "{status}");

    // tray1 comes back: the same slot, the same GFAs, the same map as before.
    drop(dead);
    daemons[1] = Some(common::start(&setups[1].config, setups[1].dir.path()));
    clients[1] = common::client(&setups[1].socket);
    for c in &mut clients {
        until(Duration::from_secs(15), "tray1 back", || all_live_and_placed(c, 3));
    }
    let again = map(&mut clients[0]);
    let after: Vec<Value> =
        again["ranges"].as_array().unwrap().iter().filter(|r| r["node"] == "tray1").cloned().collect();
    assert_eq!(after, before, "tray1 has its GFAs back");
    for c in &mut clients[1..] {
        assert_eq!(map(c), again);
    }
    // And its regions: the client takes its session back by token and finds its region,
    // its bytes, at the same GFA, which tray0 translates to tray1's device again.
    kept.check_back(&setups[1].socket, &mut clients[0], "tray1", device);
}

/// Runs fabricd on `config` and expects it to refuse to start; its log.
fn refused(config: &Path) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fabricd"))
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = common::wait_exit(&mut child, 30);
    let mut log = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut log).unwrap();
    assert!(!status.success(), "fabricd started; log:\n{log}");
    log
}

#[test]
fn a_taken_name_and_other_settings_are_refused_and_gc_frees_a_gone_slot() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let first = node(&etcd, "tray0", "tray0", SPAN);
    let mut live = common::start(&first.config, first.dir.path());
    // Another daemon (its own state dir and socket) under the same name.
    let twin = node(&etcd, "tray0", "tray0", SPAN);
    let log = refused(&twin.config);
    assert!(log.contains("tray0 is held by a live daemon"), "{log}");
    // A clean stop leaves the domain at once: the name is free without waiting for the TTL.
    let stopped = Command::new("kill").arg("-TERM").arg(live.child.id().to_string()).status().unwrap();
    assert!(stopped.success());
    assert!(common::wait_exit(&mut live.child, 10).success());
    let t0 = Instant::now();
    let _twin = common::start(&twin.config, twin.dir.path());
    assert!(t0.elapsed() < Duration::from_secs(TTL), "the name was free at once");
    let mut c = common::client(&twin.socket);
    assert_eq!(nodes(&mut c)[0].0, "tray0");
    // An admin's gc: refused for a live node; frees a gone node's slot for good.
    let asker = node(&etcd, "tray1", "tray1", SPAN);
    let _asker = common::start(&asker.config, asker.dir.path());
    let mut a = common::client(&asker.socket);
    let live = a.call(
        Request::Domain(DomainRequest {
            action: DomainAction::Gc { node: fabric_proto::wire::Name::truncated("tray0") },
        }),
        &[],
    );
    let err = format!("{:?}", live.unwrap_err());
    assert!(err.contains("BadRequest") && err.contains("tray0 is a live member"), "{err}");
    let slot = nodes(&mut a).iter().find(|n| n.0 == "tray0").unwrap().2;
    drop(_twin);
    until(Duration::from_secs(TTL + 2), "tray0 gone", || nodes(&mut a).iter().any(|n| n.0 == "tray0" && n.1 == "gone"));
    let freed = domain(&mut a, DomainAction::Gc { node: fabric_proto::wire::Name::truncated("tray0") });
    assert_eq!((freed["gc"]["node"].as_str(), freed["gc"]["slot"].as_u64()), (Some("tray0"), Some(slot)), "{freed}");
    assert_eq!(freed["nodes"], serde_json::json!([]), "a gc's answer lists no nodes: {freed}");
    until(Duration::from_secs(5), "tray0's slot gone from the view", || nodes(&mut a).iter().all(|n| n.0 != "tray0"));
    // Taken by another node, the slot is not tray0's to serve again: its saved map lies
    // there. A restart from its state directory refuses, naming the holder, rather than
    // serve that map from another slot.
    // (Claimed by hand for tray5, as its join would: both keys of the claim.)
    let endpoint = etcd.endpoint().to_owned();
    rt.block_on(async {
        use fabric_domain::records::{Keys, SlotClaim, encode};
        let mut client = fabric_domain::etcd_client::Client::connect([endpoint], None).await.unwrap();
        let (keys, claim) = (Keys::new("test"), encode(&SlotClaim::new(u32::try_from(slot).unwrap(), "tray5")));
        client.put(keys.slot(u32::try_from(slot).unwrap()), claim.clone(), None).await.unwrap();
        client.put(keys.slot_of("tray5"), claim, None).await.unwrap();
    });
    let log = refused(&twin.config);
    assert!(log.contains("was collected by an admin's gc (now held by tray5)"), "{log}");
    // Another node with another node span: both values named.
    let other = node(&etcd, "tray1", "tray1", 2 * SPAN);
    let log = refused(&other.config);
    assert!(
        log.contains("domain setting node_span: the domain has 0x10000000000, this node has 0x20000000000"),
        "{log}"
    );
    // Auto node spans are refused at load, naming the key.
    let auto = node(&etcd, "tray2", "tray2", SPAN);
    let text = std::fs::read_to_string(&auto.config).unwrap();
    std::fs::write(&auto.config, text.replace(&format!("node_span = {{ fixed = {SPAN} }}"), "")).unwrap();
    let log = refused(&auto.config);
    assert!(log.contains("map.node_span: a domain node needs a fixed node span"), "{log}");
    // Other data paths than the domain's (which the first node wrote: fabricd's default).
    let narrow = node(&etcd, "tray3", "tray3", SPAN);
    let text = std::fs::read_to_string(&narrow.config).unwrap();
    std::fs::write(&narrow.config, text.replace("[domain]\n", "[domain]\ndata_paths = [\"cxl\"]\n")).unwrap();
    let log = refused(&narrow.config);
    assert!(log.contains("data_paths") && log.contains("[SharedFile, Nvlink, Cxl]") && log.contains("[Cxl]"), "{log}");
}

#[test]
fn a_node_that_names_no_data_paths_joins_a_domain_an_earlier_build_made_with_its_data_paths() {
    use fabric_domain::records::{Keys, encode};
    use fabric_domain::{DataPathKind, DomainSettings};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    // The settings as a build before `[domain] data_paths` wrote them.
    let endpoint = etcd.endpoint().to_owned();
    rt.block_on(async {
        let mut client = fabric_domain::etcd_client::Client::connect([endpoint], None).await.unwrap();
        let earlier = DomainSettings::new(57, SPAN, vec![DataPathKind::SharedFile]);
        client.put(Keys::new("test").settings(), encode(&earlier), None).await.unwrap();
    });
    let s = node(&etcd, "tray0", "tray0", SPAN);
    let _d = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    until(Duration::from_secs(15), "joined with placements", || all_live_and_placed(&mut c, 1));
    let status = domain(&mut c, DomainAction::Status);
    assert_eq!(status["settings"]["data_paths"], serde_json::json!(["shared_file"]), "{status}");
    // One that names others is refused, naming both.
    let narrow = node(&etcd, "tray1", "tray1", SPAN);
    let text = std::fs::read_to_string(&narrow.config).unwrap();
    std::fs::write(&narrow.config, text.replace("[domain]\n", "[domain]\ndata_paths = [\"cxl\"]\n")).unwrap();
    let log = refused(&narrow.config);
    assert!(log.contains("data_paths") && log.contains("[SharedFile]") && log.contains("[Cxl]"), "{log}");
}

/// The pid of the etcd `server` runs (the one whose command line names its data dir).
fn etcd_pid(server: &EtcdServer) -> String {
    let dir = server.dir().display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()))
        .find(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmd).contains(&dir)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .expect("the test's etcd runs")
}

fn signal(pid: &str, sig: &str) {
    assert!(Command::new("kill").arg(format!("-{sig}")).arg(pid).status().unwrap().success());
}

#[test]
fn a_node_cut_off_from_etcd_fences_itself_serves_on_and_rejoins() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let s = node(&etcd, "tray0", "tray0", SPAN);
    let _d = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    until(Duration::from_secs(15), "joined with placements", || all_live_and_placed(&mut c, 1));
    until(Duration::from_secs(TTL + 2), "the only node leads", || {
        leader(&mut c).is_some_and(|(node, _, this)| node == "tray0" && this)
    });
    let first = domain(&mut c, DomainAction::Status);
    assert_eq!(first["self"]["standing"], "joined", "{first}");
    let incarnation = first["self"]["incarnation"].as_u64().unwrap();
    let held = map(&mut c);
    // etcd stops answering (SIGSTOP): the lease cannot be renewed; the node fences itself
    // before its TTL runs out.
    let pid = etcd_pid(&etcd);
    signal(&pid, "STOP");
    let fenced = until(Duration::from_secs(TTL + 1), "fenced", || {
        domain(&mut c, DomainAction::Status)["self"]["standing"] == "fenced"
    });
    assert!(fenced < Duration::from_secs(TTL), "fenced after {fenced:?}, not before the TTL ended");
    // Local service goes on: the domain map it held is still answered, at once.
    let t0 = Instant::now();
    assert_eq!(map(&mut c), held);
    assert!(t0.elapsed() < Duration::from_secs(1));
    let status = domain(&mut c, DomainAction::Status);
    assert!(status["self"]["reason"].as_str().unwrap().contains("lease lost"), "{status}");
    assert_eq!(status.get("leader"), None, "a fenced node does not claim to lead: {status}");
    // etcd back: a new lease and a new incarnation; the same slot.
    signal(&pid, "CONT");
    until(Duration::from_secs(20), "rejoined with a new incarnation", || {
        let s = domain(&mut c, DomainAction::Status);
        s["self"]["standing"] == "joined" && s["self"]["incarnation"].as_u64() != Some(incarnation)
    });
    until(Duration::from_secs(10), "placements again", || all_live_and_placed(&mut c, 1));
    assert_eq!(map(&mut c)["ranges"], held["ranges"]);
    until(Duration::from_secs(TTL + 2), "leads again", || leader(&mut c).is_some_and(|(_, _, this)| this));

    // etcd killed (a crash, not a stall): the watch breaks at once and is set up again and
    // again, each try refused; the lease is lost meanwhile, and the node fences itself
    // before the TTL ends, whichever wait it was in.
    signal(&pid, "KILL");
    let fenced = until(Duration::from_secs(TTL + 1), "fenced", || {
        domain(&mut c, DomainAction::Status)["self"]["standing"] == "fenced"
    });
    assert!(fenced < Duration::from_secs(TTL), "fenced after {fenced:?}, not before the TTL ended");
    assert_eq!(map(&mut c)["ranges"], held["ranges"], "local service goes on");
}

#[test]
fn a_node_joins_through_an_etcd_that_requires_mutual_tls_and_a_certificate_of_another_ca_is_refused() {
    use fabric_domain::testing::{ServerTls, TestingError, skip};
    use fabric_nodelink::certs::{San, create_ca, create_node};
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The domain's CA (fabric-certs, as an operator makes it) signs etcd's certificate,
    // naming its address, and the nodes'.
    let pki = tempfile::tempdir().unwrap();
    let ca = create_ca(pki.path(), "test").unwrap();
    let server = create_node(pki.path(), "test", "etcd", &["127.0.0.1".parse::<San>().unwrap()]).unwrap();
    let tray0 = create_node(pki.path(), "test", "tray0", &[]).unwrap();
    let other = tempfile::tempdir().unwrap();
    let other_ca = create_ca(other.path(), "test").unwrap();
    let stranger = create_node(other.path(), "test", "tray1", &[]).unwrap();
    let tls = ServerTls {
        ca: ca.cert.clone(),
        cert: server.cert,
        key: server.key,
        probe: (tray0.cert.clone(), tray0.key.clone()),
    };
    let etcd = match rt.block_on(EtcdServer::start_tls(&tls)) {
        Ok(etcd) => etcd,
        Err(TestingError::NotInstalled) => return skip(&TestingError::NotInstalled),
        Err(e) => panic!("{e}"),
    };
    assert!(etcd.endpoint().starts_with("https://127.0.0.1:"), "{}", etcd.endpoint());
    let with_tls = |s: &common::Setup, ca: &Path, cert: &Path, key: &Path| {
        let text = std::fs::read_to_string(&s.config).unwrap();
        let tls = format!("[domain.tls]\nca = {ca:?}\ncert = {cert:?}\nkey = {key:?}\n");
        std::fs::write(&s.config, format!("{text}{tls}")).unwrap();
    };

    // tray0, with the domain's CA and its own certificate: joined, placed, etcd answering.
    let s0 = common::domain::node(etcd.endpoint(), "tray0", "tray0", SPAN, TTL);
    with_tls(&s0, &ca.cert, &tray0.cert, &tray0.key);
    let _d0 = common::start(&s0.config, s0.dir.path());
    let mut c0 = common::client(&s0.socket);
    until(Duration::from_secs(15), "joined with placements over TLS", || all_live_and_placed(&mut c0, 1));
    let status = domain(&mut c0, DomainAction::Status);
    assert_eq!(
        (status["self"]["standing"].as_str(), status["etcd"]["reachable"].as_bool()),
        (Some("joined"), Some(true))
    );

    // A certificate another CA signed: etcd refuses it, and the node, never joined, does not start.
    let s1 = common::domain::node(etcd.endpoint(), "tray1", "tray1", SPAN, TTL);
    with_tls(&s1, &ca.cert, &stranger.cert, &stranger.key);
    let log = refused(&s1.config);
    assert!(log.contains("cannot start") && log.contains("node tray1") && log.contains("etcd connect"), "{log}");
    // Trusting another CA than etcd's: the node refuses etcd's certificate.
    let s2 = common::domain::node(etcd.endpoint(), "tray2", "tray2", SPAN, TTL);
    with_tls(&s2, &other_ca.cert, &tray0.cert, &tray0.key);
    let log = refused(&s2.config);
    assert!(log.contains("node tray2") && log.contains("invalid peer certificate"), "{log}");
    // Neither got in.
    let names: Vec<String> = nodes(&mut c0).into_iter().map(|n| n.0).collect();
    assert_eq!(names, ["tray0"]);
}

/// `fabricd_domain_members` by state on a metrics page: live, gone, unknown.
fn members(page: &str) -> [Option<f64>; 3] {
    ["live", "gone", "unknown"].map(|s| value(page, &format!("fabricd_domain_members{{state=\"{s}\"}}")))
}

/// `(node, term, this node leads)` of the leader `c`'s node knows, from `domain status`.
fn leader(c: &mut Connection) -> Option<(String, i64, bool)> {
    let doc = domain(c, DomainAction::Status);
    let l = doc.get("leader")?;
    Some((l["node"].as_str()?.to_owned(), l["term"].as_i64()?, l["this_node"].as_bool()?))
}

/// The leader every node in `clients` names, once they all name the same one with the same
/// term and exactly one of them says it leads (the leader is always among them here).
fn agreed(clients: &mut [&mut Connection]) -> Option<(String, i64)> {
    let seen: Vec<_> = clients.iter_mut().map(|c| leader(c)).collect::<Option<_>>()?;
    let (node, term, _) = seen[0].clone();
    let same = seen.iter().all(|(n, t, _)| *n == node && *t == term);
    let leads = seen.iter().filter(|(_, _, this)| *this).count();
    (same && leads == 1).then_some((node, term))
}

#[test]
fn three_nodes_agree_on_a_leader_and_replace_a_killed_one() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let setups: Vec<_> = (0..3)
        .map(|i| {
            let s = node(&etcd, &format!("tray{i}"), &format!("tray{i}"), SPAN);
            let text = std::fs::read_to_string(&s.config).unwrap();
            let listen = format!("listen = \"127.0.0.1:{}\"", ports[i]);
            std::fs::write(&s.config, text.replace("listen = \"\"", &listen)).unwrap();
            s
        })
        .collect();
    let mut daemons: Vec<_> = setups.iter().map(|s| Some(common::start(&s.config, s.dir.path()))).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(15), "every node live", || nodes(c).iter().filter(|n| n.1 == "live").count() == 3);
    }
    let mut first = None;
    until(Duration::from_secs(TTL + 2), "one leader named by every node", || {
        first = agreed(&mut clients.iter_mut().collect::<Vec<_>>());
        first.is_some()
    });
    let (old, old_term) = first.unwrap();
    let l: usize = old.strip_prefix("tray").unwrap().parse().unwrap();
    // `domain nodes` marks it, and only it.
    let listed = domain(&mut clients[(l + 1) % 3], DomainAction::Nodes);
    let marked: Vec<_> =
        listed["nodes"].as_array().unwrap().iter().filter(|n| n["leader"] == true).map(|n| n["name"].clone()).collect();
    assert_eq!(marked, [Value::from(old.clone())], "{listed}");
    // Each node's metrics say whether it leads, and the term; the members by state, that
    // it is joined, and etcd's round trip and errors.
    for (i, port) in ports.iter().enumerate() {
        let page = scrape(*port);
        assert_eq!(value(&page, "fabricd_domain_leader"), Some(if i == l { 1.0 } else { 0.0 }), "{page}");
        assert_eq!(value(&page, "fabricd_domain_leader_term"), Some(old_term as f64), "{page}");
        assert_eq!(members(&page), [Some(3.0), Some(0.0), Some(0.0)], "{page}");
        assert_eq!(value(&page, "fabricd_domain_joined"), Some(1.0), "{page}");
        let rtt = value(&page, "fabricd_domain_etcd_round_trip_seconds");
        assert!(rtt.is_some_and(|s| s > 0.0 && s < 5.0), "{page}");
        assert!(value(&page, "fabricd_domain_etcd_errors_total").is_some(), "{page}");
        promtool_check(&page);
    }

    // kill -9 the leader: the two others agree on a new one, with a larger term, within
    // TTL + 2 s.
    let mut dead = daemons[l].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    let mut next = None;
    let [a, b] = [(l + 1) % 3, (l + 2) % 3];
    let (lo, hi) = clients.split_at_mut(a.max(b));
    let mut others = [&mut lo[a.min(b)], &mut hi[0]];
    until(Duration::from_secs(TTL + 4), "a new leader named by both others", || {
        next = agreed(&mut others).filter(|(n, _)| *n != old);
        next.is_some()
    });
    let took = killed.elapsed();
    assert!(took <= Duration::from_secs(TTL + 2), "new leader after {took:?}, more than TTL + 2 s");
    let (new, new_term) = next.unwrap();
    eprintln!("{old} (term {old_term}) killed; {new} leads (term {new_term}) after {took:?}");
    assert!(new_term > old_term, "term {new_term} after {old_term}");
    // The two others count it gone.
    for i in [a, b] {
        until(Duration::from_secs(TTL + 2), "the killed node counted gone", || {
            members(&scrape(ports[i])) == [Some(2.0), Some(1.0), Some(0.0)]
        });
    }

    // The killed node restarted follows the new leader.
    drop(dead);
    daemons[l] = Some(common::start(&setups[l].config, setups[l].dir.path()));
    clients[l] = common::client(&setups[l].socket);
    until(Duration::from_secs(15), "the restarted node follows", || {
        leader(&mut clients[l]).is_some_and(|(n, t, this)| n == new && t == new_term && !this)
    });
    let all = agreed(&mut clients.iter_mut().collect::<Vec<_>>());
    assert_eq!(all, Some((new, new_term)));
}

/// The logs of the two nodes `domain_sh` started under `run` (they say why one did not
/// start or answer; the run dir goes with the test).
fn node_logs(run: &Path) -> String {
    (0..2)
        .map(|i| {
            let log = run.join(format!("d/tray{i}/fabricd.log"));
            format!("--- tray{i}:\n{}\n", std::fs::read_to_string(&log).unwrap_or_default())
        })
        .collect()
}

/// Runs `scripts/domain.sh ARGS` with its run dir under `run`, this build's fabricd, a 2 s
/// TTL and `env`: whether it succeeded, and what it printed.
fn domain_sh<'a>(run: &'a Path, env: &'a [(&'a str, &'a str)]) -> impl Fn(&[&str]) -> (bool, String) + 'a {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/domain.sh");
    move |args: &[&str]| {
        let out = Command::new("bash")
            .arg(&script)
            .args(args)
            .env("FABRIC_DOMAIN_RUN", run.join("d"))
            .env("FABRICD", env!("CARGO_BIN_EXE_fabricd"))
            .env("FABRIC_DOMAIN_TTL", "2")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), text)
    }
}

#[test]
fn domain_sh_starts_a_domain_and_stops_only_what_it_started() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    // The script starts its own etcd; this only checks that one is installed.
    let Some(_etcd) = etcd(&rt) else { return };
    let run = tempfile::tempdir().unwrap();
    let sh = domain_sh(run.path(), &[]);
    let (ok, text) = sh(&["up", "2"]);
    if !ok {
        panic!("{text}\n{}", node_logs(run.path()));
    }
    let sockets: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.strip_prefix("tray").and_then(|l| l.split_once(' ')).map(|(_, p)| PathBuf::from(p)))
        .collect();
    assert_eq!(sockets.len(), 2, "{text}");
    let (ok, again) = sh(&["up", "2"]);
    assert!(!ok && again.contains("already up"), "{again}");
    let mut c = common::client(&sockets[1]);
    until(Duration::from_secs(15), "both trays live", || all_live_and_placed(&mut c, 2));
    let (ok, status) = sh(&["status"]);
    assert!(ok && status.matches("running").count() == 2, "{status}");
    let (ok, text) = sh(&["down"]);
    assert!(ok, "{text}");
    assert!(!run.path().join("d").exists(), "the run dir is removed");
    assert!(std::os::unix::net::UnixStream::connect(&sockets[0]).is_err(), "tray0 stopped");
}

/// `FABRIC_DOMAIN_NETNS=1`: an `up` that fails takes down what it started; etcd and each
/// node in a network namespace of its own, the node link between the namespaces'
/// addresses; `bench netcopy --owner-netns --importer-netns` streams its baselines along
/// the same path; `down`, not told the prefix, deletes the namespaces. Root with `ip`
/// only (skipped otherwise).
#[test]
fn domain_sh_puts_each_node_in_a_namespace_of_its_own_and_removes_them() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(_etcd) = etcd(&rt) else { return };
    if let Err(e) = fabric_domain::testing::netns::available() {
        eprintln!("skipped: {e}");
        return;
    }
    let fabricctl = Path::new(env!("CARGO_BIN_EXE_fabricd")).with_file_name("fabricctl");
    let certs = fabricctl.with_file_name("fabric-certs");
    if !(fabricctl.exists() && certs.exists()) {
        eprintln!("skipped: no fabricctl and fabric-certs next to fabricd (cargo build --workspace --bins)");
        return;
    }
    let run = tempfile::tempdir().unwrap();
    let prefix = format!("fdt{}", std::process::id());
    let certs_env = certs.display().to_string();
    let env = [
        ("FABRIC_CERTS", certs_env.as_str()),
        ("FABRIC_DOMAIN_NETNS", "1"),
        ("FABRIC_DOMAIN_NETNS_PREFIX", &prefix),
        ("FABRIC_DOMAIN_NET", "1"),
    ];
    let names = ["sw", "etcd", "tray0", "tray1"].map(|n| format!("{prefix}-{n}"));
    let exists = |n: &str| Path::new("/run/netns").join(n).exists();
    // An `up` whose nodes do not start takes down the namespaces and etcd it started.
    let failing: Vec<(&str, &str)> = env.iter().copied().chain([("FABRICD", "/bin/false")]).collect();
    let (ok, text) = domain_sh(run.path(), &failing)(&["up", "2"]);
    assert!(!ok && text.contains("taking down what it started"), "{text}");
    assert!(names.iter().all(|n| !exists(n)) && !run.path().join("d").exists(), "{text}");
    let (ok, text) = domain_sh(run.path(), &env)(&["up", "2"]);
    // Taken down whatever the checks below find, by a `down` that is not told the prefix
    // (the run dir remembers the namespaces).
    struct Down<F: Fn(&[&str]) -> (bool, String)>(F);
    impl<F: Fn(&[&str]) -> (bool, String)> Drop for Down<F> {
        fn drop(&mut self) {
            let _ = (self.0)(&["down"]);
        }
    }
    let down = Down(domain_sh(run.path(), &[]));
    assert!(ok, "{text}");
    assert!(names.iter().all(|n| exists(n)), "{text}");
    let socket = |i: usize| run.path().join(format!("d/tray{i}/fabricd.sock"));
    let mut c = common::client(&socket(0));
    until(Duration::from_secs(15), "both trays live", || all_live_and_placed(&mut c, 2));
    // The owner answers an import once it has the importer's topology (it waits 2 s at
    // most): it has, before the bench imports.
    until(Duration::from_secs(15), "tray1's topology merged on tray0", || {
        common::domain::topology(&mut c)["nodes"] == serde_json::json!(["tray0", "tray1"])
    });
    // Each node's link is at its namespace's address, which the host's namespace lacks.
    let doc = domain(&mut c, DomainAction::Status);
    let mut addresses: Vec<&str> =
        doc["nodes"].as_array().unwrap().iter().map(|n| n["peer_address"].as_str().unwrap()).collect();
    addresses.sort_unstable();
    assert_eq!(addresses, ["10.79.0.10:7471", "10.79.0.11:7471"], "{doc}");
    // The network copy's baselines cross the same namespaces (a listener at tray0's
    // address can only be made inside tray0's namespace).
    let out = Command::new(&fabricctl)
        .args(["bench", "netcopy", "--bytes", "1048576", "--rounds", "1", "--json", "--owner"])
        .arg(socket(0))
        .arg("--importer")
        .arg(socket(1))
        .args(["--owner-netns", &names[2], "--importer-netns", &names[3]])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}\n{}", node_logs(run.path()));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["grant"], "CopyOnly", "{v}");
    assert_eq!(v["path"], format!("netns {} -> {} (10.79.0.10)", names[3], names[2]), "{v}");
    for key in ["push_gbps", "pull_gbps", "tcp_gbps", "tls_gbps", "netcopy_ratio"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()), "{key}: {v}");
    }
    drop(down);
    assert!(names.iter().all(|n| !exists(n)), "the namespaces are deleted");
    assert!(!run.path().join("d").exists(), "the run dir is removed");
}

/// Hostile records written into etcd by hand under two running nodes — a truncated
/// placements record, another node's placements under a name that holds no slot, a member
/// record of an unknown version, a slot claimed a second time for a live node, a value far
/// past the record limit — are each refused with a logged reason naming the key; neither
/// node crashes, and both keep serving the domain map they held.
#[test]
fn hostile_records_in_etcd_are_refused_and_poison_no_running_node() {
    use fabric_domain::records::{Keys, SlotClaim, encode};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let setups: Vec<_> = (0..2).map(|i| node(&etcd, &format!("tray{i}"), &format!("tray{i}"), SPAN)).collect();
    let daemons: Vec<_> = setups.iter().map(|s| common::start(&s.config, s.dir.path())).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(15), "both nodes live with their placements", || all_live_and_placed(c, 2));
    }
    let held = map(&mut clients[0]);
    assert_eq!(map(&mut clients[1]), held);

    let keys = Keys::new("test");
    let endpoint = etcd.endpoint().to_owned();
    // The first GFA of tray1's slot, which a forged record of tray0's claims below.
    let theirs =
        held["ranges"].as_array().unwrap().iter().find(|r| r["node"] == "tray1").unwrap()["start"].as_u64().unwrap();
    let hostile = rt.block_on(async {
        let mut client = fabric_domain::etcd_client::Client::connect([endpoint], None).await.unwrap();
        let real = client.get(keys.placements("tray1"), None).await.unwrap().kvs()[0].value().to_vec();
        let own = client.get(keys.placements("tray0"), None).await.unwrap().kvs()[0].value().to_vec();
        let mut outside: fabric_domain::PlacementsRecord =
            fabric_domain::records::decode(&own, fabric_domain::RecordLimits::default()).unwrap();
        outside.ranges[0].start = theirs;
        let hostile = vec![
            (keys.placements("tray1"), real[..real.len() / 2].to_vec()),
            // Well formed, but a range outside tray0's own slot: in tray1's.
            (keys.placements("tray0"), encode(&outside)),
            (keys.placements("ghost"), real.clone()),
            (keys.member("evil"), br#"{"version":99,"name":"evil"}"#.to_vec()),
            (keys.slot(4000), encode(&SlotClaim::new(4000, "tray0"))),
            (keys.topology("tray1"), vec![b'['; 1 << 20]),
        ];
        for (k, v) in &hostile {
            client.put(k.clone(), v.clone(), None).await.unwrap();
        }
        hostile
    });
    for d in &daemons {
        until(Duration::from_secs(10), "each hostile key refused in the node's log", || {
            let log = d.log();
            hostile
                .iter()
                .all(|(k, _)| log.lines().any(|l| l.contains("refused an etcd record") && l.contains(k.as_str())))
        });
    }
    for line in daemons[0].log().lines().filter(|l| l.contains("refused an etcd record")) {
        eprintln!("tray0: {line}");
    }
    for d in &daemons {
        let log = d.log();
        let forged = log.lines().find(|l| l.contains("refused an etcd record") && l.contains("placements/tray0"));
        assert!(forged.is_some_and(|l| l.contains("is not inside slot")), "{forged:?}");
    }
    // Both nodes serve on with the map they held: no ghost, no evil member, no second slot,
    // no range of tray0's inside tray1's slot.
    for c in &mut clients {
        assert_eq!(map(c)["ranges"], held["ranges"]);
        let names: Vec<String> = nodes(c).into_iter().map(|n| n.0).collect();
        assert_eq!(names, ["tray0", "tray1"]);
        assert!(all_live_and_placed(c, 2));
        let r1 = held["ranges"].as_array().unwrap().iter().find(|r| r["node"] == "tray1").unwrap();
        assert!(matches!(
            translate(c, r1["start"].as_u64().unwrap()),
            Translation::Remote { .. } | Translation::Resource { .. }
        ));
    }
}

/// The ranges of node `node` in `c`'s domain map, as `(owner, start, size)`.
fn ranges_of(c: &mut Connection, node: &str) -> Vec<(String, u64, u64)> {
    map(c)["ranges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["node"] == node)
        .map(|r| {
            let n = |k: &str| r[k].as_u64().unwrap();
            (r["owner"].as_str().unwrap().to_owned(), n("start"), n("size"))
        })
        .collect()
}

/// tray0 and tray1 of [`tray1_rescanning`], running (the daemons go before their
/// directories).
struct Trays {
    clients: Vec<Connection>,
    _daemons: Vec<common::Daemon>,
    _setups: [common::Setup; 2],
    /// tray1's copy of the supernode.
    fabric: PathBuf,
    /// tray1's ranges as tray0 first held them.
    before: Vec<(String, u64, u64)>,
}

/// tray0 and tray1 of the supernode, tray1 serving a copy of it (in `dir`) that it
/// rescans every second; both live with placements, four of tray1's ranges its GPUs' HBM.
fn tray1_rescanning(etcd: &EtcdServer, dir: &Path, ttl: u64) -> Trays {
    let fabric = dir.join("supernode.toml");
    std::fs::write(&fabric, std::fs::read_to_string(common::domain::supernode()).unwrap()).unwrap();
    let setups = [
        common::domain::node_of(etcd, &common::domain::supernode(), "tray0", SPAN, ttl),
        common::domain::node_of(etcd, &fabric, "tray1", SPAN, ttl),
    ];
    let text = std::fs::read_to_string(&setups[1].config).unwrap();
    std::fs::write(&setups[1].config, text.replacen("[discovery]\n", "[discovery]\nrescan_interval_s = 1\n", 1))
        .unwrap();
    let daemons: Vec<_> = setups.iter().map(|s| common::start(&s.config, s.dir.path())).collect();
    let mut clients: Vec<_> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for c in &mut clients {
        until(Duration::from_secs(15), "both live with placements", || all_live_and_placed(c, 2));
    }
    let before = ranges_of(&mut clients[0], "tray1");
    let hbm = before.iter().filter(|(owner, _, _)| owner.ends_with("#hbm0")).count();
    assert_eq!(hbm, 4, "tray1's four GPUs: {before:?}");
    Trays { clients, _daemons: daemons, _setups: setups, fabric, before }
}

/// Takes tray1's fourth GPU out of its copy of the supernode and waits until tray1's own
/// map has a hole where it was; returns that range.
fn drop_fourth_gpu(fabric: &Path, before: &[(String, u64, u64)], tray1: &mut Connection) -> (String, u64, u64) {
    let base = std::fs::read_to_string(fabric).unwrap();
    let gpus = "count = 4\nparent = \"pci00{i/2}{i%2+8}:00\"";
    assert!(base.contains(gpus));
    let three = base.replace(gpus, &gpus.replace("count = 4", "count = 3")).replace("\ni = 4\n", "\ni = 3\n");
    assert_eq!(three.matches("\ni = 3\n").count(), 2, "the GPUs' two link templates");
    std::fs::write(fabric, three).unwrap();
    let hbm: Vec<_> = before.iter().filter(|(owner, _, _)| owner.ends_with("#hbm0")).cloned().collect();
    let mut gone = None;
    until(Duration::from_secs(10), "tray1's own map lost a GPU", || {
        gone = hbm.iter().find(|r| matches!(translate(tray1, r.1 + 5), Translation::Hole { .. })).cloned();
        gone.is_some()
    });
    gone.unwrap()
}

/// Waits (up to `within`) until tray0 holds tray1's placements as tray1 does, changed
/// from `before`, with `gone` a hole; says how long that took after `what`.
fn tray0_sees_the_hole(
    clients: &mut [Connection],
    before: &[(String, u64, u64)],
    gone: &(String, u64, u64),
    within: Duration,
    what: &str,
) {
    let t = until(within, "tray0 sees tray1's new placements", || {
        let now = ranges_of(&mut clients[0], "tray1");
        now != before && now == ranges_of(&mut clients[1], "tray1")
    });
    eprintln!("tray1's placements reached tray0 {t:?} after {what}");
    let seen = ranges_of(&mut clients[0], "tray1");
    assert!(seen.iter().any(|r| r.0 == gone.0 && r.2 == 0), "the GPU's range is a hole now: {seen:?}");
}

#[test]
fn placements_changed_while_etcd_is_away_reach_the_others_once_it_is_back() {
    // A TTL long enough that a short etcd outage costs no lease: the node keeps its
    // membership (and incarnation), and its new placements are written when etcd answers.
    const LONG_TTL: u64 = 30;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(mut etcd) = etcd(&rt) else { return };
    let dir = tempfile::tempdir().unwrap();
    // Bound whole: the daemons and their directories live as long as the test.
    let mut trays = tray1_rescanning(&etcd, dir.path(), LONG_TTL);
    let (fabric, before, clients) = (trays.fabric.clone(), trays.before.clone(), &mut trays.clients);
    let incarnation = domain(&mut clients[1], DomainAction::Status)["self"]["incarnation"].as_u64().unwrap();

    // etcd goes; then tray1's fourth GPU: its own map has a hole there at its next rescan.
    etcd.stop();
    let gone = drop_fourth_gpu(&fabric, &before, &mut clients[1]);
    assert_eq!(ranges_of(&mut clients[0], "tray1"), before, "tray0 cannot have heard of it");

    // etcd back: tray1's new placements are written, and tray0 holds them.
    rt.block_on(etcd.restart()).unwrap();
    tray0_sees_the_hole(clients, &before, &gone, Duration::from_secs(LONG_TTL / 3 + 5), "etcd restarted");
    let status = domain(&mut clients[1], DomainAction::Status);
    assert_eq!(status["self"]["standing"], "joined", "{status}");
    assert_eq!(status["self"]["incarnation"].as_u64(), Some(incarnation), "the same membership, no rejoin");
}

/// A watch broken by an etcd restart (every node's at once) does not make a node write
/// its unchanged placements and topology again: before, each new session rewrote both,
/// and every other node received them.
#[test]
fn unchanged_records_are_not_written_again_after_etcd_restarts() {
    const LONG_TTL: u64 = 30;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(mut etcd) = etcd(&rt) else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut trays = tray1_rescanning(&etcd, dir.path(), LONG_TTL);
    let clients = &mut trays.clients;
    let incarnation = domain(&mut clients[1], DomainAction::Status)["self"]["incarnation"].as_u64().unwrap();
    let keys = fabric_domain::records::Keys::new("test");
    let revisions = |rt: &tokio::runtime::Runtime, endpoint: String| {
        let (placements, topology) = (keys.placements("tray1"), keys.topology("tray1"));
        rt.block_on(async move {
            let mut client = fabric_domain::etcd_client::Client::connect([endpoint], None).await.unwrap();
            let mut at = Vec::new();
            for key in [placements, topology] {
                let answer = client.get(key.clone(), None).await.unwrap();
                at.push(answer.kvs().first().map(|kv| kv.mod_revision()).unwrap_or_else(|| panic!("{key} absent")));
            }
            at
        })
    };
    let before = revisions(&rt, etcd.endpoint().to_owned());
    let restarts = |c: &mut Connection| domain(c, DomainAction::Status)["etcd"]["errors"].as_u64().unwrap_or(0);
    let errors_before = restarts(&mut clients[1]);
    rt.block_on(etcd.restart()).unwrap();
    // tray1 saw its watch break, and watched again.
    until(Duration::from_secs(10), "tray1 saw etcd go", || restarts(&mut clients[1]) > errors_before);
    until(Duration::from_secs(10), "tray1 joined and reaching etcd", || {
        let s = domain(&mut clients[1], DomainAction::Status);
        s["self"]["standing"] == "joined" && s["etcd"]["reachable"] == true
    });
    // Longer than the session's first publish after a watch is set up again.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(revisions(&rt, etcd.endpoint().to_owned()), before, "tray1 rewrote unchanged records");
    let status = domain(&mut clients[1], DomainAction::Status);
    assert_eq!(status["self"]["incarnation"].as_u64(), Some(incarnation), "the same membership: {status}");
}

#[test]
fn placements_etcd_refuses_to_store_are_written_when_it_takes_writes_again() {
    // etcd stays up, its watch and the node's lease alive, but refuses every write (its
    // NOSPACE alarm): the node's session goes on, and the refused write is tried again at
    // its deadline, not by a rejoin.
    const TTL: u64 = 10;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = etcd(&rt) else { return };
    let dir = tempfile::tempdir().unwrap();
    // Bound whole: the daemons and their directories live as long as the test.
    let mut trays = tray1_rescanning(&etcd, dir.path(), TTL);
    let (fabric, before, clients) = (trays.fabric.clone(), trays.before.clone(), &mut trays.clients);
    let incarnation = domain(&mut clients[1], DomainAction::Status)["self"]["incarnation"].as_u64().unwrap();
    let errors = |c: &mut Connection| domain(c, DomainAction::Status)["etcd"]["errors"].as_u64().unwrap_or(0);
    let errors_before = errors(&mut clients[1]);

    rt.block_on(etcd.space_alarm(true)).unwrap();
    let gone = drop_fourth_gpu(&fabric, &before, &mut clients[1]);
    until(Duration::from_secs(10), "tray1 counts its refused writes", || errors(&mut clients[1]) > errors_before);
    // Longer than a TTL: the refusals cost tray1 neither its lease nor its session.
    std::thread::sleep(Duration::from_secs(TTL + 2));
    assert_eq!(ranges_of(&mut clients[0], "tray1"), before, "etcd stored none of tray1's writes");
    let status = domain(&mut clients[1], DomainAction::Status);
    assert_eq!(status["self"]["standing"], "joined", "{status}");
    assert_eq!(status["self"]["incarnation"].as_u64(), Some(incarnation), "{status}");
    let live = nodes(&mut clients[0]);
    assert!(live.iter().any(|n| n.0 == "tray1" && n.1 == "live"), "tray0 still sees tray1 live: {live:?}");

    rt.block_on(etcd.space_alarm(false)).unwrap();
    tray0_sees_the_hole(clients, &before, &gone, Duration::from_secs(TTL), "the alarm was disarmed");
    let status = domain(&mut clients[1], DomainAction::Status);
    assert_eq!(status["self"]["incarnation"].as_u64(), Some(incarnation), "the same membership, no rejoin: {status}");
}
