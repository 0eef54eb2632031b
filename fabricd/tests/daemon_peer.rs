//! The node link of real fabricd nodes (`docs/domain.md`, "Node link"): two nodes of one
//! domain, a private etcd and certificates from a test CA; each node listens at its peer
//! address and admits a peer only as the domain's member records say — the current
//! incarnation of a live member, read from the same records `domain status` shows — and
//! refuses a stale incarnation and a node that is no member; a node whose certificate names
//! another node is refused at start. Across nodes: a client of one node exports, a client
//! of the other imports the handle through its own node and maps the same bytes (the
//! shared sim fabric), writes are seen both ways; a free on the owner reaches the
//! importer's client as a revocation within a second and truncates the file under its
//! mapping; a node without the shared fabric (class NET), or with it but outside the
//! region's scale-up domain (its GPUs' NVLinks, or on a UALink pod its accelerators'
//! UALink ports, down), gets a copy-only grant and
//! copies to and from the region over the link: push and pull, chunk by chunk, an
//! unaligned tail, a region of its own as the other end, a copy past the region's end and a push through a read-only import
//! refused, a revoke stopping a large copy midway; a peer that sends a chunk through an
//! import it does not hold is refused.
//! An owner's revoke reaches the importer's client; a release, and a client's going, go
//! back to the owner; an
//! importer node killed has its imports released by the owner within the TTL; an owner
//! node killed reaches the importers' clients as `OwnerExited` within the TTL. While etcd
//! does not answer, established mappings keep working and new cross-node imports are
//! refused with a typed error that names etcd; they work again once the nodes rejoin. A
//! member advertised by host name is looked up and admitted first while a flood of
//! silent connections holds every handshake slot.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary it says it is
//! skipped (scripts/deps.sh installs Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::fs::File;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fabric_domain::testing::until;
use fabric_nodelink::{Link, LinkError, LinkLimits, NodeIdentity, PeerError, PeerOp, PeerRequest, Refusal};
use fabric_proto::wire::{
    Access, AccessMode, CodecError, Connection, CopyEndpoint, CopyRequest, CopyResult, ErrorCode, Event, ExportHandle,
    FreeRequest, ReleaseRequest, Request, Response, RevocationReason, RevokeRequest, Secret, SubscribeRequest, Topics,
};

use common::peer::*;
use common::scrape::free_port;

#[test]
fn a_node_admits_the_current_incarnation_of_a_live_member_only() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let pki = Pki::new();
    let ports = [free_port(), free_port()];
    let setups: Vec<_> = ["tray0", "tray1"].iter().zip(ports).map(|(n, p)| node(&etcd, &pki, n, n, p)).collect();
    let _daemons: Vec<_> = setups.iter().map(|s| common::start(&s.config, s.dir.path())).collect();
    let mut c0 = common::client(&setups[0].socket);
    let tray1 = until(Duration::from_secs(15), "tray0 lists tray1 live", || incarnation_of(&mut c0, "tray1"));
    let tray0 = until(Duration::from_secs(15), "tray0 lists itself", || incarnation_of(&mut c0, "tray0"));
    let at: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let expected = NodeIdentity::new(DOMAIN, "tray0").unwrap();
    let limits = LinkLimits::default();
    let creds1 = pki.credentials("tray1");

    // tray1's certificate at tray1's incarnation: admitted, tray0 welcomes with its own.
    let mut link = rt.block_on(Link::connect(at, &creds1, &expected, tray1, limits)).unwrap();
    assert_eq!(link.peer_incarnation(), tray0, "the Welcome states tray0's incarnation");
    rt.block_on(link.ping()).unwrap();
    // A request the service refuses (a copy chunk with no header) leaves the link sound.
    let answer = rt.block_on(link.call(PeerRequest { op: PeerOp::Copy, body: vec![] }));
    assert!(matches!(answer, Err(LinkError::Peer(PeerError::Refused(_)))), "{answer:?}");
    rt.block_on(link.ping()).unwrap();

    // Another incarnation of a member: refused as stale.
    let stale = rt.block_on(Link::connect(at, &creds1, &expected, tray1 - 1, limits)).unwrap_err();
    assert!(
        matches!(&stale, LinkError::Refused(Refusal::StaleIncarnation { node, offered }) if node == "tray1" && *offered == tray1 - 1),
        "{stale:?}"
    );
    // A certificate of the domain's CA for a node that is no member: refused.
    let stranger = rt.block_on(Link::connect(at, &pki.credentials("tray9"), &expected, 1, limits)).unwrap_err();
    assert!(matches!(&stranger, LinkError::Refused(Refusal::NotMember(n)) if n == "tray9"), "{stranger:?}");
    // The admitted link still answers.
    rt.block_on(link.ping()).unwrap();
}

#[test]
fn a_node_whose_certificate_names_another_is_refused_at_start() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let pki = Pki::new();
    let s = node(&etcd, &pki, "tray1", "tray0", free_port());
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fabricd"))
        .arg("--config")
        .arg(&s.config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let code = common::wait_exit(&mut child, 30);
    assert!(!code.success());
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert!(
        log.contains("the certificate names fabric://test/node/tray0, but this is fabric://test/node/tray1"),
        "{log}"
    );
}

fn map(f: &File, offset: u64, len: u64) -> memmap2::MmapMut {
    // SAFETY: a shared mapping of a region file; the test is its only user in this
    // process, and it is dropped before the file is truncated below.
    unsafe { memmap2::MmapOptions::new().offset(offset).len(len as usize).map_mut(f).unwrap() }
}

#[test]
fn a_client_on_one_node_maps_memory_exported_on_another_and_sees_its_revocation() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // tray2 has no shared fabric: class NET to the others.
    let (_setups, daemons, clients) = three_nodes(&etcd, &pki, shared.path(), |i| i == 2);
    let [mut c0, mut c1, mut c2]: [Connection; 3] = clients.try_into().ok().unwrap();
    // A client of tray0 allocates on tray0's GPU and exports it.
    let gpu = hbm_of(&mut c0, "tray0");
    let (a, file0) = common::alloc_hbm(&mut c0, &gpu, 1 << 20);
    let len = a.size;
    let handle = common::export(&mut c0, a.region, AccessMode::ReadWrite);
    // A client of tray1 imports it through tray1, which asks tray0 over the link.
    let t = Instant::now();
    let (i, file1) = import(&mut c1, handle, AccessMode::ReadWrite).unwrap();
    eprintln!("remote import: {:?}", t.elapsed());
    assert_eq!((i.region, i.size, i.gfa), (a.region, len, a.gfa), "the grant names tray0's region at its GFA");
    assert_eq!(i.grant.map(|g| g.owner), handle.node, "the grant names the owner node");
    // Bytes written through one node's mapping are read through the other's, both ways.
    let mut m0 = map(&file0, a.offset, len);
    let mut m1 = map(&file1, i.offset, len);
    m1[..14].copy_from_slice(b"from tray1 ...");
    assert_eq!(&m0[..14], b"from tray1 ...");
    m0[len as usize - 5..].copy_from_slice(b"tray0");
    assert_eq!(&m1[len as usize - 5..], b"tray0");
    // The importer's file is not registered for DMA: the owner's revocation could not end
    // that registration. The owner's own file is (as the region, which its free ends).
    let register = |c: &mut Connection, node: &str, file: &File| {
        use fabric_proto::wire::{DeviceName, RegisterRequest, RegisterSource};
        let req = Request::Register(RegisterRequest {
            device: DeviceName::truncated(&hbm_of(c, node)),
            source: RegisterSource::Fd,
            offset: 0,
            len: 4096,
            access: AccessMode::ReadOnly,
            node: None,
        });
        c.call(req, &[std::os::fd::AsFd::as_fd(file)]).map(|(r, _)| r)
    };
    match register(&mut c1, "tray1", &file1) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::NotImplemented, "{body:?}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(register(&mut c0, "tray0", &file0), Ok(Response::Register(_))));

    // tray2 shares no memory fabric: a copy-only grant, no descriptor.
    let net = import_copy_only(&mut c2, handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(net.grant.map(|g| g.access), Some(Access::CopyOnly), "{net:?}");
    assert_eq!((net.region, net.size, net.gfa, net.offset), (a.region, len, a.gfa, 0));
    // A handle with a wrong secret is refused by the owner, with the local code.
    let forged = ExportHandle { secret: Secret([7; 16]), ..handle };
    assert_eq!(import(&mut c1, forged, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::InvalidHandle);

    // tray0's client frees the region: tray1's client is told within a second, and the
    // file under its mapping is truncated (a later load faults instead of reading reused
    // memory).
    let Response::Subscribe(_) =
        c1.call(Request::Subscribe(SubscribeRequest { topics: Topics::REVOCATION }), &[]).unwrap().0
    else {
        panic!()
    };
    drop((m0, m1));
    let freed = Instant::now();
    let Response::Free = c0.call(Request::Free(FreeRequest { region: a.region, node: None }), &[]).unwrap().0 else {
        panic!()
    };
    match c1.next_event().unwrap() {
        Event::Revocation(r) => {
            assert_eq!((r.region, r.import, r.reason), (a.region, i.import, RevocationReason::Freed));
        }
        other => panic!("{other:?}"),
    }
    let reach = freed.elapsed();
    eprintln!("revocation reached the importer's client after {reach:?}");
    assert!(reach < Duration::from_secs(1), "{reach:?}");
    until(Duration::from_secs(1), "the region file truncated", || (file1.metadata().unwrap().len() == 0).then_some(()));

    // The same for a region imported only read-only (the owner keeps the file open for
    // writing, not as granted, to truncate it).
    let (b, _file0) = common::alloc_hbm(&mut c0, &gpu, 1 << 20);
    let handle = common::export(&mut c0, b.region, AccessMode::ReadOnly);
    let (ro, file_ro) = import(&mut c1, handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(file_ro.metadata().unwrap().len(), b.offset + b.size);
    let Response::Free = c0.call(Request::Free(FreeRequest { region: b.region, node: None }), &[]).unwrap().0 else {
        panic!()
    };
    match c1.next_event().unwrap() {
        Event::Revocation(r) => assert_eq!((r.region, r.import), (b.region, ro.import)),
        other => panic!("{other:?}"),
    }
    until(Duration::from_secs(1), "the read-only import's file truncated", || {
        (file_ro.metadata().unwrap().len() == 0).then_some(())
    });
    // tray1's request threads asked tray0 three times on one blocking link, kept between
    // the asks (a refusal leaves it sound).
    let log = daemons[1].as_ref().map(common::Daemon::log).unwrap_or_default();
    assert_eq!(log.matches("node link: linked (direct)").count(), 1, "{log}");
}

#[test]
fn an_importer_node_at_its_allowance_is_refused_while_another_node_still_imports() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // tray0, the owner, admits two live imports per importer node.
    let limits =
        |i: usize, text: &str| if i == 0 { format!("{text}[limits]\nimports_per_node = 2\n") } else { text.to_owned() };
    let (_setups, _daemons, mut c) = three_nodes_with(&etcd, &pki, shared.path(), |_| false, limits);
    let (_, _f0, handle) = tray0_hbm_export(&mut c[0]);

    // Two imports through tray1 fill tray1's allowance; a third is refused, naming the node.
    let first = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    let _second = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    let refused = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap_err();
    assert_eq!(refused.code, ErrorCode::LimitExceeded, "{refused:?}");
    assert!(
        refused.message.contains("node tray1") && refused.message.contains("imports_per_node"),
        "{}",
        refused.message
    );
    // tray2's allowance is its own: tray1 being full costs it nothing.
    let _on_tray2 = (0..2).map(|_| import(&mut c[2], handle, AccessMode::ReadOnly).unwrap()).collect::<Vec<_>>();
    assert_eq!(imports(&mut c[0]), 4, "two imports of each importer node");
    // A local client of the owner is not an importer node: no such allowance.
    let _local = (0..3).map(|_| import(&mut c[0], handle, AccessMode::ReadOnly).unwrap()).collect::<Vec<_>>();

    // A release gives tray1 its allowance back.
    let Response::Release = c[1].call(Request::Release(ReleaseRequest { import: first.0.import }), &[]).unwrap().0
    else {
        panic!()
    };
    until(Duration::from_secs(2), "the owner released the import", || (imports(&mut c[0]) == 6).then_some(()));
    let _again = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
}

#[test]
fn a_data_path_the_domains_settings_leave_out_is_not_granted_and_the_copy_stays() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // Three nodes on the shared sim fabric, in a domain that allows CXL sharing only.
    let cxl_only = |_, text: &str| text.replace("[domain]\n", "[domain]\ndata_paths = [\"cxl\"]\n");
    let (_setups, _daemons, mut c) = three_nodes_with(&etcd, &pki, shared.path(), |_| false, cxl_only);
    assert_eq!(status(&mut c[0])["settings"]["data_paths"], serde_json::json!(["cxl"]));
    let (a, f0, handle) = tray0_hbm_export(&mut c[0]);
    // tray1 reaches tray0's file, but the domain leaves shared_file out: a copy-only grant.
    let grant = import_copy_only(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(grant.grant.map(|g| g.access), Some(Access::CopyOnly), "{grant:?}");
    // Its bytes still move, by the copy over the node link.
    let gpu1 = hbm_of(&mut c[1], "tray1");
    let (r, file) = registered(&mut c[1], &gpu1, 1 << 20);
    let bytes = pattern(3, 1 << 20);
    std::os::unix::fs::FileExt::write_all_at(&file, &bytes, 0).unwrap();
    let copy = start_copy(&mut c[1], CopyEndpoint::Gfa(grant.gfa.unwrap()), reg(r, 0), 1 << 20).unwrap();
    let done = copy_done(&mut c[1], copy);
    assert_eq!((done.result, done.bytes), (CopyResult::Ok, 1 << 20), "the push completes");
    let mut back = vec![0; 1 << 20];
    std::os::unix::fs::FileExt::read_exact_at(&f0, &mut back, a.offset).unwrap();
    assert!(back == bytes, "tray0's region holds what tray1 pushed");
}

/// `configs/sim/<fabric>` with every `link` link between each `(device, fabric switch)` of
/// `down` down, written in `dir`, and the edit of a node's configuration that makes it
/// serve that fabric.
fn cut_fabric(
    dir: &std::path::Path,
    fabric: &str,
    link: &str,
    down: impl Iterator<Item = (String, String)>,
) -> impl Fn(usize, &str) -> String {
    let mut text = std::fs::read_to_string(supernode().with_file_name(fabric)).unwrap();
    for (device, switch) in down {
        text.push_str(&format!(
            "\n[[degraded]]\ndevice = \"{device}\"\nlink = \"{link}\"\nto = \"fabric/{switch}\"\nlink_down = true\n"
        ));
    }
    let cut = dir.join(format!("cut-{fabric}"));
    std::fs::write(&cut, text).unwrap();
    let sim = supernode().display().to_string();
    move |_, text: &str| text.replace(&sim, &cut.display().to_string())
}

/// 1 MiB of tray0's HBM that `c`, a client of tray0, allocates and exports read-write: the
/// allocation, its file and the handle.
fn tray0_hbm_export(c: &mut Connection) -> (fabric_proto::wire::AllocResponse, File, ExportHandle) {
    let gpu = hbm_of(c, "tray0");
    let (a, file) = common::alloc_hbm(c, &gpu, 1 << 20);
    let handle = common::export(c, a.region, AccessMode::ReadWrite);
    (a, file, handle)
}

/// A region of `device`'s host DRAM that `c` allocates and exports read-write: its handle.
fn dram_export(c: &mut Connection, device: &str) -> ExportHandle {
    use fabric_proto::wire::{AllocRequest, AllocTarget, DeviceName, MemoryClass};
    let dram = AllocTarget::Device { device: DeviceName::truncated(device), memory: MemoryClass::Dram };
    let (r, _) = c.call(Request::Alloc(AllocRequest { target: dram, size: 1 << 20, align: 0 }), &[]).unwrap();
    let Response::Alloc(d) = r else { panic!("{r:?}") };
    common::export(c, d.region, AccessMode::ReadWrite)
}

#[test]
fn a_node_outside_the_regions_scale_up_domain_gets_a_copy_only_grant_though_it_reaches_the_files() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // The supernode with every NVLink of tray2's four GPUs down: tray2 reaches the shared
    // files, but no scale-up fabric joins it to the others.
    let dir = tempfile::tempdir().unwrap();
    let down = (0..4).flat_map(|g| (0..18).map(move |s| (format!("tray2/gpu{g}"), format!("nvsw{s}"))));
    let cut = cut_fabric(dir.path(), "supernode-64.toml", "nvlink", down);
    let (_setups, _daemons, mut c) = three_nodes_with(&etcd, &pki, shared.path(), |_| false, cut);
    let (a, _f0, handle) = tray0_hbm_export(&mut c[0]);
    // tray1's GPUs reach tray0's by NVLink through the fabric's switches: the file.
    let (i, _f1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(i.grant.map(|g| g.access), Some(Access::Fd), "{i:?}");
    // tray2's do not: copy-only, though its shared_dir holds the same files.
    let grant = import_copy_only(&mut c[2], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(grant.grant.map(|g| g.access), Some(Access::CopyOnly), "{grant:?}");
    assert_eq!((grant.region, grant.gfa), (a.region, a.gfa));
    // And the other way: tray2's own region, asked by tray0, is copy-only too.
    let gpu2 = hbm_of(&mut c[2], "tray2");
    let (b, _f2) = common::alloc_hbm(&mut c[2], &gpu2, 1 << 20);
    let handle = common::export(&mut c[2], b.region, AccessMode::ReadOnly);
    let back = import_copy_only(&mut c[0], handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(back.grant.map(|g| g.access), Some(Access::CopyOnly), "{back:?}");
    // A Grace's memory is in the scale-up domain too (NVLink-C2C to its GPUs, NVLink on
    // from them): tray0's host DRAM maps on tray1.
    let handle = dram_export(&mut c[0], "name:tray0/numa0");
    let (i, _f) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(i.grant.map(|g| g.access), Some(Access::Fd), "{i:?}");
}

/// An importer that maps no shared files (no `peer.shared_dir`: its member record does not
/// offer them) is answered copy-only at once: the owner does not ask the domain's topology
/// about it. Here that topology is gone from etcd, which keeps the owner of an importer
/// that does map files waiting, then refusing `Unavailable` (the check before this test
/// was written ran for every importer).
#[test]
fn an_importer_that_maps_no_shared_files_is_answered_copy_only_without_its_topology() {
    use fabric_domain::records::{RecordLimits, SHARED_FILE, decode};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (_setups, _daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |i| i == 2);
    let keys = fabric_domain::Keys::new(DOMAIN);
    let offers = rt.block_on(async {
        let mut client = fabric_domain::etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
        client.delete(keys.topology("tray2"), None).await.unwrap();
        let mut offers = vec![];
        for n in ["tray1", "tray2"] {
            let value = client.get(keys.member(n), None).await.unwrap().kvs()[0].value().to_vec();
            let member: fabric_domain::MemberRecord = decode(&value, RecordLimits::default()).unwrap();
            offers.push(member.offers(SHARED_FILE));
        }
        offers
    });
    assert_eq!(offers, [true, false], "only the node with a shared_dir offers its files");
    until(Duration::from_secs(15), "tray0 knows no topology of tray2", || {
        let nodes = common::domain::topology(&mut c[0])["nodes"].clone();
        (!nodes.as_array().unwrap().contains(&serde_json::json!("tray2"))).then_some(())
    });
    let (_, _f0, handle) = tray0_hbm_export(&mut c[0]);
    let t = Instant::now();
    let grant = import_copy_only(&mut c[2], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(grant.grant.map(|g| g.access), Some(Access::CopyOnly), "{grant:?}");
    eprintln!("copy-only grant in {:?}", t.elapsed());
    // tray1 maps files: its topology is known, it is in tray0's scale-up domain, the file.
    let (i, _f1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(i.grant.map(|g| g.access), Some(Access::Fd), "{i:?}");
}

/// The same on a UALink pod (`ualink-pod-1024`, its hosts host0..host2 as nodes):
/// accelerators of two hosts reach each other through the pod's switch
/// planes, so HBM maps across them; host2 with every UALink port down gets copy-only; host
/// DRAM, which no UALink reaches, is not shared with host1 either.
#[test]
fn on_a_ualink_pod_hbm_maps_between_hosts_the_switch_planes_join_and_nothing_else_does() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let down = (0..4).flat_map(|a| (0..4).map(move |p| (format!("host2/acc{a}"), format!("ualsw{p}"))));
    let cut = cut_fabric(dir.path(), "ualink-pod-1024.toml", "ualink", down);
    let hosts = ["host0", "host1", "host2"];
    let (_setups, _daemons, mut c) = three_nodes_named(&etcd, &pki, shared.path(), hosts, |_| false, cut);
    let acc = hbm_of(&mut c[0], "host0");
    assert!(acc.starts_with("pci:host0/"), "{acc}");
    let (a, _f0) = common::alloc_hbm(&mut c[0], &acc, 1 << 20);
    let handle = common::export(&mut c[0], a.region, AccessMode::ReadWrite);
    let (i, _f1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(i.grant.map(|g| g.access), Some(Access::Fd), "{i:?}");
    let grant = import_copy_only(&mut c[2], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(grant.grant.map(|g| g.access), Some(Access::CopyOnly), "{grant:?}");
    // Host DRAM is on PCIe only: NET even for host1, whose accelerators are joined; the
    // pod's map gives it no GFA, so it is refused rather than copied.
    let handle = dram_export(&mut c[0], "name:host0/numa0");
    let err = import_copy_only(&mut c[1], handle, AccessMode::ReadWrite).unwrap_err();
    assert_eq!(err.code, ErrorCode::NotImplemented, "{err:?}");
    assert!(err.message.contains("class NET") && err.message.contains("no GFA"), "{err:?}");
}

#[test]
fn revoke_release_and_the_death_of_either_node_reach_the_other() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, mut daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let (a, _f0, handle) = tray0_hbm_export(&mut c[0]);
    subscribe(&mut c[1]);

    // A revoke reaches tray1's client as the same event a local importer gets.
    let (i1, _f1) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(imports(&mut c[0]), 1);
    let t = Instant::now();
    let Response::Revoke = c[0].call(Request::Revoke(RevokeRequest { handle }), &[]).unwrap().0 else { panic!() };
    let r = revocation(&mut c[1]);
    assert_eq!((r.region, r.import, r.reason), (a.region, i1.import, RevocationReason::Revoked));
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(import(&mut c[1], handle, AccessMode::ReadOnly).unwrap_err().code, ErrorCode::Revoked);
    // Its release goes back to the owner.
    let Response::Release = c[1].call(Request::Release(ReleaseRequest { import: i1.import }), &[]).unwrap().0 else {
        panic!()
    };
    until(Duration::from_secs(2), "the owner released the import", || (imports(&mut c[0]) == 0).then_some(()));

    // tray2 imports a new export, then dies: tray0 releases its import once its member
    // key goes (TTL), not before.
    let handle = common::export(&mut c[0], a.region, AccessMode::ReadWrite);
    let (_i2, _f2) = import(&mut c[2], handle, AccessMode::ReadWrite).unwrap();
    let (i1, _f1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(imports(&mut c[0]), 2);
    // A client that goes gives its imports of other nodes back (the session may be kept
    // for resume; its imports end either way).
    let mut gone = common::client(&setups[1].socket);
    let (_i3, _f3) = import(&mut gone, handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(imports(&mut c[0]), 3);
    drop(gone);
    until(Duration::from_secs(2), "a gone client's import released", || (imports(&mut c[0]) == 2).then_some(()));
    let mut dead = daemons[2].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    until(Duration::from_secs(TTL + 3), "tray2's import released", || (imports(&mut c[0]) == 1).then_some(()));
    let seen = killed.elapsed();
    eprintln!("a dead importer's import released after {seen:?}");
    assert!(seen <= Duration::from_secs(TTL + 1), "{seen:?}");

    // tray0 dies: tray1's client is told its import ended, within the TTL.
    let mut dead = daemons[0].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    let r = revocation(&mut c[1]);
    let seen = killed.elapsed();
    eprintln!("a dead owner's importer told after {seen:?}");
    assert_eq!((r.region, r.import, r.reason), (a.region, i1.import, RevocationReason::OwnerExited));
    assert!(seen <= Duration::from_secs(TTL + 1), "{seen:?}");
}

#[test]
fn an_etcd_outage_keeps_mappings_working_and_refuses_new_grants() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (_setups, _daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let (a, file0, handle) = tray0_hbm_export(&mut c[0]);
    let (i, file1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    let (mut m0, m1) = (map(&file0, a.offset, a.size), map(&file1, i.offset, i.size));

    // etcd stops answering: every node fences itself before its TTL ends.
    let pid = etcd.pid().unwrap().to_string();
    let kill = |sig: &str| assert!(std::process::Command::new("kill").args([sig, &pid]).status().unwrap().success());
    kill("-STOP");
    for x in &mut c {
        until(Duration::from_secs(TTL + 1), "fenced", || standing(x).starts_with("fenced").then_some(()));
    }
    // The established mapping keeps working: no daemon, let alone etcd, is on the path.
    m0[100..104].copy_from_slice(b"live");
    assert_eq!(&m1[100..104], b"live");
    // A new cross-node import is refused, saying why; a local one goes on.
    let refused = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap_err();
    assert_eq!(refused.code, ErrorCode::Unavailable, "{refused:?}");
    assert!(refused.message.contains("etcd") && refused.message.contains("fenced"), "{}", refused.message);
    assert!(import(&mut c[0], handle, AccessMode::ReadOnly).is_ok(), "local imports do not need etcd");

    // etcd answers again: the nodes rejoin (new incarnations) and cross-node imports work.
    kill("-CONT");
    for x in &mut c {
        until(Duration::from_secs(15), "rejoined", || (standing(x) == "joined").then_some(()));
    }
    until(Duration::from_secs(15), "imports across nodes again", || {
        import(&mut c[1], handle, AccessMode::ReadOnly).ok().map(drop)
    });
}

/// An import granted copy-only: no descriptor comes with it.
/// `setup`'s peer port.
fn peer_port(setup: &common::Setup) -> u16 {
    let text = std::fs::read_to_string(&setup.config).unwrap();
    let at = text.find("address = \"127.0.0.1:").unwrap() + "address = \"127.0.0.1:".len();
    text[at..].split('"').next().unwrap().parse().unwrap()
}

#[test]
fn a_node_without_the_shared_fabric_copies_to_and_from_another_nodes_region_over_the_link() {
    const MIB: u64 = 1 << 20;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // tray2 has no shared fabric: class NET to the others.
    let (setups, mut daemons, clients) = three_nodes(&etcd, &pki, shared.path(), |i| i == 2);
    let [mut c0, mut c1, mut c2]: [Connection; 3] = clients.try_into().ok().unwrap();
    let size = 64 * MIB;
    let gpu0 = hbm_of(&mut c0, "tray0");
    let (a, file0) = common::alloc_hbm(&mut c0, &gpu0, size);
    let handle = common::export(&mut c0, a.region, AccessMode::ReadWrite);
    let i = import_copy_only(&mut c2, handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(
        i.grant,
        Some(
            fabric_proto::wire::Grant::new(handle.node.unwrap(), Access::CopyOnly)
                .with_coherence(fabric_proto::wire::Coherence::Hardware)
        )
    );
    assert_eq!((i.gfa, i.size), (a.gfa, size));
    let gfa = a.gfa.unwrap();
    // tray2's memory is placed a moment after it is live.
    until(Duration::from_secs(15), "tray2's memory placed", || {
        let Response::Map(d) = c2.call(Request::Map(fabric_proto::wire::TopologyRequest::default()), &[]).unwrap().0
        else {
            panic!()
        };
        d.json.contains("\"tray2\"").then_some(()).filter(|()| d.json.matches("\"node\": \"tray2\"").count() > 1)
    });
    let gpu2 = hbm_of(&mut c2, "tray2");
    let (r, mem) = registered(&mut c2, &gpu2, size);
    let m0 = map(&file0, a.offset, size);

    // Push: several chunks and an unaligned tail, to an unaligned GFA.
    use std::os::unix::fs::FileExt;
    let len = 3 * MIB + 4097;
    let data = pattern(1, len as usize);
    mem.write_all_at(&data, 0).unwrap();
    let t = Instant::now();
    let id = start_copy(&mut c2, CopyEndpoint::Gfa(gfa + 123), reg(r, 0), len).unwrap();
    let d = copy_done(&mut c2, id);
    eprintln!("pushed {len} bytes across nodes in {:?}", t.elapsed());
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, len));
    assert!(m0[123..123 + len as usize] == data[..], "tray0's client reads what tray2 pushed");
    // Pull: tray0's bytes into the registration at an offset.
    let back = 2 * MIB + 1;
    let id = start_copy(&mut c2, reg(r, 8 * MIB), CopyEndpoint::Gfa(gfa + 100), back).unwrap();
    let d = copy_done(&mut c2, id);
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, back));
    let mut got = vec![0; back as usize];
    mem.read_exact_at(&mut got, 8 * MIB).unwrap();
    assert!(got[..] == m0[100..100 + back as usize], "tray2 pulled tray0's bytes");
    // A GFA of tray2's own region as the other end: pull into it, push from it.
    let (own, own_file) = common::alloc_hbm(&mut c2, &gpu2, 4 * MIB);
    let (own_gfa, mut own_map) = (own.gfa.unwrap(), map(&own_file, own.offset, 4 * MIB));
    let n = 2 * MIB + 5;
    let id = start_copy(&mut c2, CopyEndpoint::Gfa(own_gfa + 7), CopyEndpoint::Gfa(gfa + 123), n).unwrap();
    assert_eq!(copy_done(&mut c2, id).result, CopyResult::Ok);
    assert!(own_map[7..7 + n as usize] == m0[123..123 + n as usize], "tray2's region holds what it pulled");
    let fresh = pattern(3, n as usize);
    own_map[..n as usize].copy_from_slice(&fresh);
    let id = start_copy(&mut c2, CopyEndpoint::Gfa(gfa + 5 * MIB), CopyEndpoint::Gfa(own_gfa), n).unwrap();
    assert_eq!(copy_done(&mut c2, id).result, CopyResult::Ok);
    assert!(m0[5 * MIB as usize..(5 * MIB + n) as usize] == fresh[..], "tray0 reads what tray2's region pushed");

    // A batch of copies across nodes: a push and a pull, one completion for both.
    let batch = |copies: Vec<CopyRequest>| {
        Request::CopyBatch(fabric_proto::wire::CopyBatchRequest {
            copies: fabric_proto::wire::BoundedVec::new(copies).unwrap(),
        })
    };
    let pushed = pattern(4, MIB as usize + 3);
    mem.write_all_at(&pushed, 16 * MIB).unwrap();
    let copies = vec![
        CopyRequest { dst: CopyEndpoint::Gfa(gfa + 10 * MIB), src: reg(r, 16 * MIB), len: MIB + 3 },
        CopyRequest { dst: reg(r, 20 * MIB), src: CopyEndpoint::Gfa(gfa + 100), len: MIB },
    ];
    let Ok((Response::CopyBatch(b), _)) = c2.call(batch(copies), &[]) else { panic!("a batch across nodes") };
    let d = copy_done(&mut c2, b.copy);
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, 2 * MIB + 3), "one completion counts both copies");
    assert!(m0[10 * MIB as usize..(11 * MIB + 3) as usize] == pushed[..], "the batch's push landed");
    let mut got = vec![0; MIB as usize];
    mem.read_exact_at(&mut got, 20 * MIB).unwrap();
    assert!(got[..] == m0[100..100 + MIB as usize], "the batch's pull landed");
    // Sixteen pushes smaller than a chunk, of sixteen lengths, in one batch: the lanes take
    // them as they come; each lands where it was sent, and the completion counts them all.
    let small: Vec<(u64, Vec<u8>)> = (0..16u64).map(|i| (i, pattern(10 + i as u8, 4096 + 97 * i as usize))).collect();
    let mut copies = Vec::new();
    for (i, bytes) in &small {
        mem.write_all_at(bytes, 24 * MIB + i * 64 * 1024).unwrap();
        copies.push(CopyRequest {
            dst: CopyEndpoint::Gfa(gfa + 12 * MIB + i * 8192 + i),
            src: reg(r, 24 * MIB + i * 64 * 1024),
            len: bytes.len() as u64,
        });
    }
    let Ok((Response::CopyBatch(b), _)) = c2.call(batch(copies), &[]) else { panic!("a batch of small copies") };
    let d = copy_done(&mut c2, b.copy);
    let total: u64 = small.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, total));
    for (i, bytes) in &small {
        let at = (12 * MIB + i * 8192 + i) as usize;
        assert!(m0[at..at + bytes.len()] == bytes[..], "small copy {i} of the batch landed");
    }
    // A batch that mixes a copy on this node with one across nodes is refused whole, saying so.
    let mixed = vec![
        CopyRequest { dst: CopyEndpoint::Gfa(gfa), src: reg(r, 0), len: 16 },
        CopyRequest { dst: reg(r, 0), src: CopyEndpoint::Gfa(own_gfa), len: 16 },
    ];
    match c2.call(batch(mixed), &[]) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, ErrorCode::NotImplemented, "{body:?}");
            assert!(body.message.as_str().contains("copy 1 of the batch is on this node"), "{body:?}");
        }
        other => panic!("a mixed batch: {other:?}"),
    }
    // A part past the region's end refuses the batch, naming the part.
    let past = vec![
        CopyRequest { dst: reg(r, 0), src: CopyEndpoint::Gfa(gfa), len: 16 },
        CopyRequest { dst: CopyEndpoint::Gfa(gfa + size - 10), src: reg(r, 0), len: 11 },
    ];
    match c2.call(batch(past), &[]) {
        Err(CodecError::Refused { body, .. }) => {
            assert_eq!(body.code, ErrorCode::BadRequest, "{body:?}");
            assert!(body.message.as_str().starts_with("copy 1 of the batch"), "{body:?}");
        }
        other => panic!("a batch with a part past the region: {other:?}"),
    }

    // A copy past the region's end is refused at once.
    let past = start_copy(&mut c2, CopyEndpoint::Gfa(gfa + size - 10), reg(r, 0), 11).unwrap_err();
    assert_eq!(past.code, ErrorCode::BadRequest, "{past:?}");
    // A read-only import is refused a push, not a pull (another client: one session's
    // writable import would serve it).
    let mut ro = common::client(&setups[2].socket);
    let handle_ro = common::export(&mut c0, a.region, AccessMode::ReadOnly);
    import_copy_only(&mut ro, handle_ro, AccessMode::ReadOnly).unwrap();
    let (r_ro, _mem_ro) = registered(&mut ro, &gpu2, MIB);
    let denied = start_copy(&mut ro, CopyEndpoint::Gfa(gfa), reg(r_ro, 0), 16).unwrap_err();
    assert_eq!(denied.code, ErrorCode::PermissionDenied, "{denied:?}");
    let id = start_copy(&mut ro, reg(r_ro, 0), CopyEndpoint::Gfa(gfa), MIB).unwrap();
    assert_eq!(copy_done(&mut ro, id).result, CopyResult::Ok);

    // A peer that sends a chunk through an import it does not hold is refused: tray2's
    // own identity and incarnation reach its own imports only, never tray1's.
    let (i1, _f1) = import(&mut c1, handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(i1.gfa, Some(gfa));
    let incarnation = incarnation_of(&mut c0, "tray2").unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", peer_port(&setups[0])).parse().unwrap();
    let tray0 = NodeIdentity::new(DOMAIN, "tray0").unwrap();
    let tried = imports(&mut c0) + 4;
    let (held, refused) = rt.block_on(async {
        let creds = pki.credentials("tray2");
        let mut link = Link::connect(addr, &creds, &tray0, incarnation, LinkLimits::default()).await.unwrap();
        let (mut held, mut refused) = (Vec::new(), 0);
        for import in 0..=tried {
            let ask = fabricd::peer::wire::CopyAsk { import, gfa, len: 16, write: false };
            match link.call(ask.request(&[])).await {
                Ok(r) => {
                    assert_eq!(r.body[..], m0[..16]);
                    held.push(import);
                }
                Err(LinkError::Peer(PeerError::Denied { .. })) => refused += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        // Through its own import: past the region's end, and a write through the
        // read-only one, refused too.
        for &import in &held {
            let past = fabricd::peer::wire::CopyAsk { import, gfa: gfa + size - 8, len: 16, write: false };
            assert!(matches!(link.call(past.request(&[])).await, Err(LinkError::Peer(PeerError::Denied { .. }))));
        }
        (held, refused)
    });
    // tray2's two clients' imports (one session per importer node on the owner); tray1's
    // and the ids no one holds are refused.
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(refused, tried + 1 - 2);

    // tray0's client revokes the export during a large copy: the copy stops with the
    // error and the bytes done.
    let id = start_copy(&mut c2, CopyEndpoint::Gfa(gfa), reg(r, 0), size).unwrap();
    // Let some chunks move first. The whole copy takes about 100 ms here once the pages
    // are faulted in (they are, by the copies above): the revoke must come well before.
    std::thread::sleep(Duration::from_millis(10));
    let Response::Revoke = c0.call(Request::Revoke(RevokeRequest { handle }), &[]).unwrap().0 else { panic!() };
    let d = copy_done(&mut c2, id);
    match d.result {
        CopyResult::Failed { code, message } => {
            assert_eq!(code, ErrorCode::Revoked, "{message}");
            assert!(d.bytes < size && d.bytes.is_multiple_of(MIB), "{}", d.bytes);
        }
        CopyResult::Ok => panic!("a copy through a revoked import completed"),
    }
    eprintln!("a revoke stopped a copy across nodes after {} bytes", d.bytes);

    // The owner node dies during a copy: the copy completes with an error, never hangs.
    let handle = common::export(&mut c0, a.region, AccessMode::ReadWrite);
    import_copy_only(&mut c2, handle, AccessMode::ReadWrite).unwrap();
    let id = start_copy(&mut c2, reg(r, 0), CopyEndpoint::Gfa(gfa), size).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    let mut dead = daemons[0].take().unwrap();
    dead.child.kill().unwrap();
    dead.child.wait().unwrap();
    let killed = Instant::now();
    let d = copy_done(&mut c2, id);
    eprintln!("a copy whose owner died ended after {:?} with {} bytes: {:?}", killed.elapsed(), d.bytes, d.result);
    assert!(matches!(d.result, CopyResult::Failed { .. }), "{d:?}");
    assert!(d.bytes < size);
    assert!(killed.elapsed() < Duration::from_secs(TTL + 5), "{:?}", killed.elapsed());
}

/// A member whose `peer_address` is a host name links to a node while silent connections
/// from 34 other addresses hold every handshake slot: the node looked the name up
/// (`peer/addresses.rs`) and admits that member's connection first, ending the oldest of
/// the flood's; its metrics page shows both.
#[test]
fn a_member_advertised_by_name_links_through_a_flood_from_other_addresses() {
    use common::scrape::{scrape, value};
    // The name is one the hosts file maps: nothing goes to the host's DNS.
    let hosts = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
    let mapped = hosts.lines().any(|l| {
        let mut words = l.split('#').next().unwrap_or("").split_whitespace();
        words.next() == Some("127.0.0.1") && words.any(|w| w == "localhost")
    });
    if !mapped {
        eprintln!("skipped: /etc/hosts does not map localhost to 127.0.0.1");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let pki = Pki::new();
    let (p0, p1, metrics) = (free_port(), free_port(), free_port());
    // tray0 listens at 127.0.0.3; tray1's connections to it come from 127.0.0.1, which only
    // tray1's name resolves to.
    let at: SocketAddr = format!("127.0.0.3:{p0}").parse().unwrap();
    let s0 = node_at(&etcd, &pki, "tray0", "tray0", &at.to_string(), "shared_identities = true\n");
    let text = std::fs::read_to_string(&s0.config).unwrap();
    std::fs::write(&s0.config, text.replace("listen = \"\"", &format!("listen = \"127.0.0.1:{metrics}\""))).unwrap();
    let s1 = node_at(&etcd, &pki, "tray1", "tray1", &format!("localhost:{p1}"), "shared_identities = true\n");
    let _daemons = [common::start(&s0.config, s0.dir.path()), common::start(&s1.config, s1.dir.path())];
    let (mut c0, mut c1) = (common::client(&s0.socket), common::client(&s1.socket));
    until(Duration::from_secs(15), "tray0 lists tray1 live", || incarnation_of(&mut c0, "tray1"));
    until(Duration::from_secs(15), "tray1 lists tray0 live", || incarnation_of(&mut c1, "tray0"));
    until(Duration::from_secs(15), "tray0 merged tray1's topology", || {
        (common::domain::topology(&mut c0)["nodes"] == serde_json::json!(["tray0", "tray1"])).then_some(())
    });
    let outcome = |page: &str, o: &str| {
        value(page, &format!("fabricd_peer_connections_total{{outcome=\"{o}\"}}")).unwrap_or_else(|| panic!("{page}"))
    };
    // 127.0.0.3, and localhost's addresses (127.0.0.1; ::1 too where the hosts file says so).
    until(Duration::from_secs(15), "tray0 admits both members' sources first", || {
        (value(&scrape(metrics), "fabricd_peer_member_sources") >= Some(2.0)).then_some(())
    });
    let (_, _f, handle) = tray0_hbm_export(&mut c0);

    let start = Instant::now();
    let flood: Vec<_> = (0..34u8)
        .map(|i| {
            rt.block_on(async {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.bind(SocketAddr::from(([127, 0, 0, 10 + i], 0))).unwrap();
                socket.connect(at).await.unwrap()
            })
        })
        .collect();
    until(Duration::from_secs(3), "the flood holds every slot", || {
        (outcome(&scrape(metrics), "closed_at_accept") >= 2.0).then_some(())
    });
    let grant = import_copy_only(&mut c1, handle, AccessMode::ReadWrite).expect("tray1 imports during the flood");
    assert_eq!(grant.grant.map(|g| g.access), Some(Access::CopyOnly), "{grant:?}");
    let took = start.elapsed();
    assert!(took < LinkLimits::default().handshake_timeout, "{took:?}: the flood's slots had expired");
    let page = scrape(metrics);
    assert!(outcome(&page, "ended_for_another") >= 1.0, "tray1's connection took a flood's slot: {page}");
    assert!(outcome(&page, "admitted") >= 1.0, "{page}");
    common::scrape::promtool_check(&page);
    drop(flood);
}
