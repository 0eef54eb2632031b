//! The real daemon answers hello, status, topology, devices, map, translate and
//! partitions over its socket, and its answers equal the same computation done here.
#![allow(clippy::unwrap_used)]

mod common;

use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::Command;

use fabric_addrmap::{AddressMap, RangeKind};
use fabric_proto::TopologyOptions;
use fabric_proto::wire::{
    AllocRequest, AllocTarget, CodecError, Connection, ErrorCode, ErrorDetail, MemoryClass, Name, PartitionSpec,
    PartitionsRequest, PeerCred, ProblemKind, Request, ResourceName, Response, StatusRequest, TopologyRequest,
    TranslateQuery, TranslateRequest, Translation, Version, VersionRange,
};
use fabric_topology::{Fabric, LinkState};
use fabricd::store::MapStore;
use fabricd::transport::peer::Peer;

fn call(c: &mut Connection, req: Request) -> Response {
    c.call(req, &[]).unwrap().0
}

fn refused(c: &mut Connection, req: Request) -> fabric_proto::wire::ErrorBody {
    match c.call(req, &[]) {
        Err(CodecError::Refused { body, .. }) => body,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn sim_fabric() -> Fabric {
    Fabric::build(fabric_drivers::sim::load(&common::sim_file()).unwrap()).unwrap()
}

#[test]
fn hello_negotiates_and_refuses_versions_it_does_not_speak() {
    let s = common::Setup::new("");
    let d = common::start(&s.config, s.dir.path());
    assert!(d.ready.starts_with("READY=1\n"), "{:?}", d.ready);
    assert!(d.ready.contains("STATUS=serving 63 devices"), "{:?}", d.ready);
    assert!(d.log().contains("ready"), "{}", d.log());

    let c = common::client(&s.socket);
    assert_eq!(c.version(), fabric_proto::wire::PROTOCOL_VERSION);

    // A 1.0-only client still gets a 1.0 hello (no session token travels).
    let mut old = Connection::new(UnixStream::connect(&s.socket).unwrap());
    let v1_0 = VersionRange::new(Version::new(1, 0), Version::new(1, 0));
    let h = old.hello("old", v1_0).unwrap();
    assert_eq!((h.version, h.token), (Version::new(1, 0), None));
    assert!(matches!(old.call(Request::Status(StatusRequest {}), &[]), Ok((Response::Status(_), _))));
    // A 1.0 client does not get the opcodes 1.1 added: UnknownOpcode, typed.
    let e = refused(&mut old, Request::Regions(Default::default()));
    assert_eq!(e.code, ErrorCode::UnknownOpcode, "{e:?}");
    // Agreed once: a second hello cannot move the connection to another version.
    match old.hello("old-again", fabric_proto::wire::SUPPORTED_VERSIONS) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::BadRequest, "{body:?}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(refused(&mut old, Request::Regions(Default::default())).code, ErrorCode::UnknownOpcode, "still 1.0");

    // A request before hello is refused, typed.
    let mut raw = Connection::new(UnixStream::connect(&s.socket).unwrap());
    let e = refused(&mut raw, Request::Status(StatusRequest {}));
    assert_eq!(e.code, ErrorCode::NotNegotiated);

    // A newer minor only: no common version; the error names both ranges.
    let next = fabric_proto::wire::PROTOCOL_VERSION.minor + 1;
    let offered = VersionRange::new(Version::new(1, next), Version::new(1, next + 4));
    match raw.hello("future", offered) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, ErrorCode::UnsupportedVersion);
            assert!(matches!(body.detail, Some(ErrorDetail::Versions { offered: o, .. }) if o == offered));
        }
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
    assert!(d.log().contains("refused"), "the refusal is logged");
}

#[test]
fn status_topology_devices_map_and_translate_match_the_same_computation_in_process() {
    let s = common::Setup::new("");
    let d = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    let fabric = sim_fabric();
    let inv = fabric.inventory();

    // Status: counts and exactly the degraded links, with their bandwidth fraction.
    let Response::Status(st) = call(&mut c, Request::Status(StatusRequest {})) else { panic!() };
    assert!(st.ready);
    assert_eq!(st.devices as usize, inv.devices.len());
    assert_eq!(st.links as usize, inv.links.len());
    assert!(st.sessions >= 1);
    let mut want = Vec::new();
    for l in inv.links.iter().filter(|l| l.state == LinkState::Degraded) {
        let (cur, max) = (l.bandwidth.current_mbps.unwrap(), l.bandwidth.max_mbps.unwrap());
        want.push((format!("{}<->{}", inv.device(l.a).id, inv.device(l.b).id), (cur * 1000 / max) as u16));
    }
    assert!(!want.is_empty(), "the HGX sim has a degraded link");
    let got: Vec<_> = st
        .problems
        .iter()
        .filter(|p| p.kind == ProblemKind::LinkDegraded)
        .map(|p| (p.subject.to_string(), p.bandwidth_permille.unwrap()))
        .collect();
    assert_eq!(got, want);

    // Topology and devices: byte for byte the documents fabricctl writes.
    let Response::Topology(doc) = call(&mut c, Request::Topology(TopologyRequest { node: None })) else { panic!() };
    assert_eq!(doc.schema.as_str(), "fabric.topology/v1");
    let mut local = Vec::new();
    let order = fabric_proto::device_order(&fabric);
    let labels = fabric_proto::MatrixLabels::from_order(&fabric, &order);
    fabric_proto::topology::write_topology(&mut local, &fabric, &order, &labels, &TopologyOptions::default()).unwrap();
    assert_eq!(doc.json, String::from_utf8(local).unwrap());
    let Response::Devices(doc) = call(&mut c, Request::Devices(TopologyRequest { node: None })) else { panic!() };
    let mut local = Vec::new();
    fabric_proto::topology::write_devices(&mut local, &fabric, None).unwrap();
    assert_eq!(doc.json, String::from_utf8(local).unwrap());
    let e = refused(&mut c, Request::Topology(TopologyRequest { node: Some(Name::truncated("no-such-node")) }));
    assert_eq!(e.code, ErrorCode::NotFound);

    // Map: the listing of the state the daemon saved.
    let map = saved_map(&s.state);
    let snap = map.snapshot();
    let listing = snap.listing();
    let Response::Map(doc) = call(&mut c, Request::Map(TopologyRequest { node: None })) else { panic!() };
    assert_eq!(doc.json, serde_json::to_string_pretty(&listing).unwrap());
    assert_eq!(st.map_generation, listing.generation);

    // Translate: every direct range's first and last byte, one unmapped GFA, and back.
    let ranges: Vec<_> = listing.ranges.iter().filter(|r| r.kind == RangeKind::Direct).collect();
    assert!(!ranges.is_empty());
    let mut queries = Vec::new();
    for r in &ranges {
        queries.push(TranslateQuery::Gfa(r.start));
        queries.push(TranslateQuery::Gfa(r.start + r.size - 1));
    }
    let unmapped = listing.high_water + (1 << 40);
    queries.push(TranslateQuery::Gfa(unmapped));
    let req = TranslateRequest { queries: queries.clone().try_into().unwrap() };
    let Response::Translate(tr) = call(&mut c, Request::Translate(req)) else { panic!() };
    assert_eq!(tr.results.len(), queries.len());
    let mut back = Vec::new();
    for (q, got) in queries.iter().zip(tr.results.iter()) {
        let TranslateQuery::Gfa(g) = q else { unreachable!() };
        match (snap.translate(*g), got) {
            (Ok(loc), Translation::Resource { resource, offset, .. }) => {
                let key = snap.resource(loc.resource);
                assert_eq!(resource.device.as_str(), key.device.to_string());
                assert_eq!(fabric_topology::MemoryKind::from(resource.memory), key.kind);
                assert_eq!((resource.ordinal, *offset), (key.ordinal, loc.offset));
                back.push((TranslateQuery::Resource { resource: resource.clone(), offset: *offset }, *g));
            }
            (Err(_), Translation::Unmapped) => assert_eq!(*g, unmapped),
            (want, got) => panic!("GFA {g:#x}: in-process {want:?}, daemon {got:?}"),
        }
    }
    let req = TranslateRequest { queries: back.iter().map(|(q, _)| q.clone()).collect::<Vec<_>>().try_into().unwrap() };
    let Response::Translate(tr) = call(&mut c, Request::Translate(req)) else { panic!() };
    for ((_, g), got) in back.iter().zip(tr.results.iter()) {
        assert_eq!(got, &Translation::Gfa(*g));
    }
    let bogus = ResourceName { device: "name:nowhere/x".try_into().unwrap(), memory: MemoryClass::Hbm, ordinal: 0 };
    let req =
        TranslateRequest { queries: vec![TranslateQuery::Resource { resource: bogus, offset: 0 }].try_into().unwrap() };
    let Response::Translate(tr) = call(&mut c, Request::Translate(req)) else { panic!() };
    assert_eq!(tr.results.as_slice(), &[Translation::UnknownResource]);

    // A refusal is typed and the session goes on: this fabric has no interleave sets.
    let alloc = AllocRequest { target: AllocTarget::Set(Name::truncated("any")), size: 4096, align: 4096 };
    let e = refused(&mut c, Request::Alloc(alloc));
    assert_eq!(e.code, ErrorCode::NotFound);
    assert!(matches!(call(&mut c, Request::Status(StatusRequest {})), Response::Status(_)));
    drop(d);
}

fn spec(name: &str, devices: &[&str]) -> PartitionSpec {
    PartitionSpec {
        name: Name::truncated(name),
        devices: devices.iter().map(|d| (*d).try_into().unwrap()).collect::<Vec<_>>().try_into().unwrap(),
        uids: Default::default(),
        gids: Default::default(),
    }
}

#[test]
fn partition_changes_need_an_admin_and_the_check_uses_the_peer_credentials() {
    // In process, with injected credentials: a plain uid is refused, root is not.
    let dir = tempfile::tempdir().unwrap();
    let (config, socket, state) = (dir.path().join("c.toml"), dir.path().join("s.sock"), dir.path().join("st"));
    common::Setup::write(&config, &socket, &state, "");
    let daemon = fabricd::Daemon::start(fabricd::config::Config::load(&config).unwrap()).unwrap();
    let gpu = sim_fabric().inventory().devices.iter().find(|d| d.gpu.is_some()).unwrap().id.to_string();
    let user = Peer::new(PeerCred { pid: std::process::id() as i32, uid: 4242, gid: 4242 }, Vec::new(), None);
    let set = Request::Partitions(PartitionsRequest::Set(spec("tenant-a", &[&gpu])));
    let e = fabricd::ops::handle(&daemon, &user, set.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::AdminRequired);
    let list = Request::Partitions(PartitionsRequest::List);
    let Response::Partitions(p) = fabricd::ops::handle(&daemon, &user, list.clone()).unwrap() else { panic!() };
    assert!(p.partitions.is_empty(), "listing is open to all");
    let root = Peer::new(PeerCred { pid: 1, uid: 0, gid: 0 }, Vec::new(), None);
    let Response::Partitions(p) = fabricd::ops::handle(&daemon, &root, set).unwrap() else { panic!() };
    assert_eq!(p.partitions.len(), 1);
    assert_eq!(p.partitions[0].devices[0].as_str(), gpu);
    drop(daemon);
    // Persisted in the state dir's map record (no uids or gids: no binding).
    let map = saved_map(&state);
    assert_eq!(map.state().partitions.len(), 1);
    let record = fabricd::store::FileStore::new(&state).load().unwrap().unwrap();
    assert!(record.bindings.is_empty(), "{:?}", record.bindings);
}

/// Run as a child under an unprivileged uid by the test below; does nothing otherwise.
#[test]
fn unprivileged_client_helper() {
    let Some(sock) = std::env::var_os("FABRICD_TEST_UNPRIVILEGED_SOCKET") else { return };
    let mut c = common::client(std::path::Path::new(&sock));
    let gpu = std::env::var("FABRICD_TEST_DEVICE").unwrap();
    let e = refused(&mut c, Request::Partitions(PartitionsRequest::Set(spec("evil", &[&gpu]))));
    assert_eq!(e.code, ErrorCode::AdminRequired, "{e:?}");
    let Response::Partitions(p) = call(&mut c, Request::Partitions(PartitionsRequest::List)) else { panic!() };
    assert!(p.partitions.is_empty());
}

#[test]
fn a_non_root_client_is_refused_end_to_end() {
    if nix::unistd::geteuid().as_raw() != 0 {
        eprintln!("skipped: needs root to run a client under uid 65534");
        return;
    }
    // The socket belongs to nogroup so that uid 65534 (gid 65534) may connect.
    let s = common::Setup::new("group = \"nogroup\"");
    let d = common::start(&s.config, s.dir.path());
    let gpu = sim_fabric().inventory().devices.iter().find(|d| d.gpu.is_some()).unwrap().id.to_string();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "unprivileged_client_helper", "--nocapture", "--test-threads", "1"])
        .env("FABRICD_TEST_UNPRIVILEGED_SOCKET", &s.socket)
        .env("FABRICD_TEST_DEVICE", &gpu)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "the helper ran: {text}");
    let log = d.log();
    assert!(
        log.contains("refused") && log.contains("uid=65534") && log.contains("partitions"),
        "the refusal names uid and op: {log}"
    );
}

/// The address map in the map record the daemon saved in `state`.
fn saved_map(state: &std::path::Path) -> AddressMap {
    let record = fabricd::store::FileStore::new(state).load().unwrap().unwrap();
    AddressMap::from_state((*record.map).clone()).unwrap()
}
