//! Faults across nodes with real fabricd nodes, a private etcd and the node link
//! (`docs/domain.md`, "Faults"): memory a node imported and that its owner freed after
//! that node died (kill -9) is quarantined — the free succeeds, the range is not handed
//! out again (an allocation of the whole resource is refused), and `domain status` names
//! the node, also after the owner itself is killed and restarted — until the node returns
//! as a new incarnation, or an admin collects it with `domain gc`; what a live importer
//! held when its owner was killed stays held until the importer reaches the restarted
//! owner; and more revocations at once than an event queue holds (300 imports of
//! one region freed) all reach the importer node's clients, and the freed range is free
//! again once the importer acknowledged them. Two nodes in network namespaces of their
//! own, cut from each other by iptables while etcd sees both: the mapping made before
//! keeps working, a new import is refused promptly as `Unavailable` naming the owner, and
//! imports and revocations cross again after the heal. Two nodes in namespaces, one
//! without the shared fabric (class NET): its client pushes to and pulls from the other's
//! region over the link between the namespaces. An owner stopped past the importer's
//! ask grants late; the importer gives that grant back. An owner stopped past its lease
//! rejoins holding nothing it granted before; a release it could not take while stopped
//! is told again once it answers.
//!
//! Each test starts its own etcd (on 127.0.0.1, or in a namespace); without `etcd` (or,
//! for the namespaces, root, `ip` and `iptables`) it says it is skipped.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::time::{Duration, Instant};

use fabric_domain::testing::netns::Netns;
use fabric_domain::testing::until;
use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, CodecError, Connection, CopyEndpoint, CopyResult, DeviceName, DomainAction,
    DomainRequest, ErrorBody, ErrorCode, FreeRequest, MemoryClass, Name, Request, Response, RevocationReason,
    RevokeRequest,
};
use serde_json::Value;

use common::peer::*;

const MIB: u64 = 1 << 20;

/// Allocates `size` bytes of `gpu`'s HBM: the region and its GFA, or the refusal.
fn alloc(c: &mut Connection, gpu: &str, size: u64) -> Result<(u64, Option<u64>), ErrorBody> {
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(gpu), memory: MemoryClass::Hbm },
        size,
        align: 0,
    });
    match c.call(req, &[]) {
        Ok((Response::Alloc(a), _)) => Ok((a.region, a.gfa)),
        Ok((other, _)) => panic!("{other:?}"),
        Err(CodecError::Refused { body, .. }) => Err(body),
        Err(e) => panic!("{e:?}"),
    }
}

fn free(c: &mut Connection, region: u64) {
    let Response::Free = c.call(Request::Free(FreeRequest { region, node: None }), &[]).unwrap().0 else { panic!() };
}

/// The usable size of `gpu`'s HBM resource, as a refusal of more than it holds states it (300
/// GiB: more than a sim GPU's 186 GB, less than a uid may allocate on a tray of four).
fn capacity(c: &mut Connection, gpu: &str) -> u64 {
    let e = alloc(c, gpu, 300 << 30).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoSpace, "{e:?}");
    let m = e.message.to_string();
    let after = m.split(" in ").last().unwrap();
    let bytes: u64 = after.split(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no capacity in {m:?}"));
    // In whole 2 MiB granules, as the allocator places them.
    bytes / (2 * MIB) * (2 * MIB)
}

/// The quarantine `c`'s node reports: (node, regions, bytes).
fn quarantine(c: &mut Connection) -> Vec<(String, u64, u64)> {
    let doc = status(c);
    let Some(q) = doc["quarantine"].as_array() else { return Vec::new() };
    q.iter()
        .map(|n| (n["node"].as_str().unwrap().to_owned(), n["regions"].as_u64().unwrap(), n["bytes"].as_u64().unwrap()))
        .collect()
}

fn gc(c: &mut Connection, node: &str) -> Value {
    let req = Request::Domain(DomainRequest { action: DomainAction::Gc { node: Name::truncated(node) } });
    match c.call(req, &[]).unwrap().0 {
        Response::Domain(d) => serde_json::from_str(&d.json).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// Kills `d` with SIGKILL and reaps it.
fn kill(d: &mut Option<common::Daemon>) {
    let mut d = d.take().unwrap();
    d.child.kill().unwrap();
    d.child.wait().unwrap();
}

#[test]
fn memory_a_dead_node_imported_is_quarantined_until_it_returns_or_an_admin_collects_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(mut etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, mut daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let gpu = hbm_of(&mut c[0], "tray0");
    let whole = capacity(&mut c[0], &gpu);
    let (region, gfa) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadWrite);
    let (_i, _f) = import(&mut c[2], handle, AccessMode::ReadWrite).unwrap();
    assert_eq!(imports(&mut c[0]), 1);

    // tray2 dies holding the import: tray0 releases it after the TTL, then its client
    // frees the region. The free is answered, but the range stays out of reuse.
    kill(&mut daemons[2]);
    until(Duration::from_secs(TTL + 3), "tray2's import released", || (imports(&mut c[0]) == 0).then_some(()));
    free(&mut c[0], region);
    assert_eq!(quarantine(&mut c[0]), vec![("tray2".to_owned(), 1, 2 * MIB)]);
    let refused = alloc(&mut c[0], &gpu, whole).unwrap_err();
    assert_eq!(refused.code, ErrorCode::NoSpace, "the whole resource is not free: {refused:?}");
    let (probe, at) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    assert_ne!(at, gfa, "the quarantined range is not handed out again");
    free(&mut c[0], probe);

    // tray0 itself dies (kill -9) and restarts: the quarantine it saved comes back with it.
    kill(&mut daemons[0]);
    // Its name is taken again once its lease ended.
    until(Duration::from_secs(TTL + 3), "tray0's member gone", || {
        incarnation_of(&mut c[1], "tray0").is_none().then_some(())
    });
    daemons[0] = Some(common::start(&setups[0].config, setups[0].dir.path()));
    c[0] = common::client(&setups[0].socket);
    assert_eq!(quarantine(&mut c[0]), vec![("tray2".to_owned(), 1, 2 * MIB)], "the quarantine outlived the restart");
    assert_eq!(alloc(&mut c[0], &gpu, whole).unwrap_err().code, ErrorCode::NoSpace);
    let (probe, at) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    assert_ne!(at, gfa, "nor after the owner's restart");
    free(&mut c[0], probe);

    // tray0 dies again and restarts while etcd does not answer: it serves with its
    // remembered slot and a view it could not read, which says nothing of who left — the
    // quarantine stays (that empty view lifted it once).
    kill(&mut daemons[0]);
    etcd.stop();
    daemons[0] = Some(common::start(&setups[0].config, setups[0].dir.path()));
    c[0] = common::client(&setups[0].socket);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(quarantine(&mut c[0]), vec![("tray2".to_owned(), 1, 2 * MIB)], "kept through a start without etcd");
    assert_eq!(alloc(&mut c[0], &gpu, whole).unwrap_err().code, ErrorCode::NoSpace);
    rt.block_on(etcd.restart()).unwrap();
    for i in [0, 1] {
        until(Duration::from_secs(3 * TTL + 10), "tray0 and tray1 joined again", || {
            (standing(&mut c[i]) == "joined").then_some(())
        });
    }
    assert_eq!(quarantine(&mut c[0]), vec![("tray2".to_owned(), 1, 2 * MIB)], "and once it read the domain");
    // tray1 knows tray0's new incarnation before it asks tray0 anything again.
    let now = status(&mut c[0])["self"]["incarnation"].as_u64();
    until(Duration::from_secs(15), "tray1 sees tray0's incarnation", || {
        (incarnation_of(&mut c[1], "tray0") == now).then_some(())
    });

    // tray2 comes back (a new incarnation: it holds nothing): the quarantine lifts.
    daemons[2] = Some(common::start(&setups[2].config, setups[2].dir.path()));
    let t = Instant::now();
    until(Duration::from_secs(15), "tray2's quarantine lifted", || quarantine(&mut c[0]).is_empty().then_some(()));
    eprintln!("quarantine lifted {:?} after tray2 restarted", t.elapsed());
    let (all, _) = alloc(&mut c[0], &gpu, whole).expect("the whole resource is free again");
    free(&mut c[0], all);

    // The admin path: tray1 imports, dies; the freed region is quarantined until an admin
    // collects tray1 (`domain gc`, on any node), which frees its slot and lifts the
    // quarantine.
    let (region, gfa) = alloc(&mut c[0], &gpu, 4 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadWrite);
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    kill(&mut daemons[1]);
    until(Duration::from_secs(TTL + 3), "tray1's import released", || (imports(&mut c[0]) == 0).then_some(()));
    free(&mut c[0], region);
    assert_eq!(quarantine(&mut c[0]), vec![("tray1".to_owned(), 1, 4 * MIB)]);
    assert_eq!(alloc(&mut c[0], &gpu, whole).unwrap_err().code, ErrorCode::NoSpace);
    // The admin asks tray2 (restarted above): the slot goes domain-wide, and tray0, seeing
    // tray1 collected, lifts its quarantine too.
    let mut c2 = common::client(&setups[2].socket);
    let doc = gc(&mut c2, "tray1");
    assert_eq!(doc["gc"]["lifted_bytes"], 0, "tray2 held nothing of tray1's: {doc}");
    until(Duration::from_secs(5), "tray1's quarantine lifted on tray0", || {
        quarantine(&mut c[0]).is_empty().then_some(())
    });
    let (again, at) = alloc(&mut c[0], &gpu, 4 * MIB).unwrap();
    assert_eq!(at, gfa, "first fit hands the collected range out again");
    free(&mut c[0], again);
}

/// The holds tray0 saved (its `quarantine.record`, in its directory of the shared fabric).
fn saved_holds(shared: &std::path::Path) -> Vec<fabricd::memory::holds::Hold> {
    let bytes = std::fs::read(shared.join("sim/tray0").join(fabricd::memory::holds::FILE)).unwrap();
    fabricd::memory::holds::decode(&bytes).unwrap()
}

#[test]
fn an_owner_restarted_lifts_what_it_saved_for_a_live_importer_once_that_node_reaches_it() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, mut daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let gpu = hbm_of(&mut c[0], "tray0");
    let (region, _) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadOnly);
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    let holds = saved_holds(shared.path());
    assert_eq!(holds.len(), 1, "saved before the grant: {holds:?}");
    let tray1 = incarnation_of(&mut c[0], "tray1").unwrap();
    assert_eq!((holds[0].node.as_str(), holds[0].incarnation, holds[0].region), ("tray1", tray1, region));

    // tray0 dies with the import live and comes back: tray1 may still map the region, so
    // the restored hold stays until tray1 reaches the new incarnation.
    kill(&mut daemons[0]);
    until(Duration::from_secs(TTL + 3), "tray0's member gone", || {
        incarnation_of(&mut c[1], "tray0").is_none().then_some(())
    });
    daemons[0] = Some(common::start(&setups[0].config, setups[0].dir.path()));
    c[0] = common::client(&setups[0].socket);
    assert_eq!(saved_holds(shared.path()), holds, "kept across the restart");
    // tray1 asks the new tray0 for something (having voided what the last one granted):
    // the hold it had goes.
    let (fresh, _) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], fresh, AccessMode::ReadOnly);
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    let now: Vec<u64> = saved_holds(shared.path()).iter().map(|h| h.region).collect();
    assert_eq!(now, [fresh], "only the new import is held: {now:?}");
}

/// An owner whose lease ran out (stopped past the TTL) and that rejoins in the same
/// process ends what it granted: the importer voided those imports when it saw the owner
/// gone, and the owner holds them no more. What the importer may still map stays saved
/// (quarantined when freed) until the importer reaches the new incarnation. Before, the
/// owner kept every such import until the importer node itself restarted.
#[test]
fn an_owner_that_rejoins_in_process_holds_nothing_it_granted_before() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (_setups, daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let gpu = hbm_of(&mut c[0], "tray0");
    let (region, _) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadOnly);
    subscribe(&mut c[1]);
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(imports(&mut c[0]), 1);
    let before = incarnation_of(&mut c[1], "tray0").unwrap();

    signal(&daemons[0], "-STOP");
    let r = revocation(&mut c[1]);
    assert_eq!((r.region, r.reason), (region, RevocationReason::OwnerExited), "{r:?}");
    signal(&daemons[0], "-CONT");
    until(Duration::from_secs(TTL + 10), "tray0 back as another incarnation", || {
        incarnation_of(&mut c[1], "tray0").is_some_and(|now| now != before).then_some(())
    });
    until(Duration::from_secs(5), "the old grant ended at tray0", || (imports(&mut c[0]) == 0).then_some(()));
    let holds: Vec<(String, u64)> = saved_holds(shared.path()).into_iter().map(|h| (h.node, h.region)).collect();
    assert_eq!(holds, [("tray1".to_owned(), region)], "kept for what tray1 may still map");
    // tray1 reaches the new incarnation (having voided the last one's grants): the hold
    // goes, and the new import is the only one tray0 holds.
    let (fresh, _) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], fresh, AccessMode::ReadOnly);
    // (Refused `Unavailable` while tray0's own view of tray1 is not yet back.)
    let _held =
        until(Duration::from_secs(5), "the new import", || import(&mut c[1], handle, AccessMode::ReadOnly).ok());
    assert_eq!(imports(&mut c[0]), 1);
    let now: Vec<u64> = saved_holds(shared.path()).iter().map(|h| h.region).collect();
    assert_eq!(now, [fresh], "only the new import is held: {now:?}");
}

#[test]
fn more_revocations_at_once_than_a_queue_holds_all_reach_the_importer_nodes_clients() {
    const CLIENTS: usize = 3;
    const EACH: usize = 100;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, _daemons, mut c) = three_nodes(&etcd, &pki, shared.path(), |_| false);
    let gpu = hbm_of(&mut c[0], "tray0");
    let (region, gfa) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadWrite);
    // 300 imports of tray0's region by three clients of tray1: more than the 256 events a
    // queue holds, all revoked by one free.
    let mut clients: Vec<Connection> = (0..CLIENTS).map(|_| common::client(&setups[1].socket)).collect();
    let mut held = Vec::new();
    for cl in &mut clients {
        subscribe(cl);
        for _ in 0..EACH {
            held.push(import(cl, handle, AccessMode::ReadOnly).unwrap());
        }
    }
    assert_eq!(imports(&mut c[0]), (CLIENTS * EACH) as u64);
    let t = Instant::now();
    free(&mut c[0], region);
    for (n, cl) in clients.iter_mut().enumerate() {
        let mut got = std::collections::BTreeSet::new();
        for _ in 0..EACH {
            let r = revocation(cl);
            assert_eq!((r.region, r.reason), (region, RevocationReason::Freed));
            got.insert(r.import);
        }
        let want: std::collections::BTreeSet<u64> =
            held[n * EACH..(n + 1) * EACH].iter().map(|(i, _)| i.import).collect();
        assert_eq!(got, want, "client {n} is told of each of its imports");
    }
    eprintln!("{} revocations reached tray1's clients after {:?}", CLIENTS * EACH, t.elapsed());
    // tray1 acknowledged every one: the range is free again.
    until(Duration::from_secs(5), "the freed range back", || quarantine(&mut c[0]).is_empty().then_some(()));
    let (again, at) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    assert_eq!(at, gfa);
    free(&mut c[0], again);
    // The acknowledgements are saved (once the outbox drained): a restart holds nothing.
    until(Duration::from_secs(5), "the record saved empty", || saved_holds(shared.path()).is_empty().then_some(()));
}

/// Three nodes whose leases last `ttl` seconds (long enough that a stop of a few seconds
/// does not expire one), each with a region of tray0's HBM exported `access`: their files,
/// daemons and clients, and the handle.
fn three_with_lease(
    etcd: &fabric_domain::testing::EtcdServer,
    pki: &Pki,
    shared: &std::path::Path,
    ttl: u64,
    access: AccessMode,
) -> (Vec<common::Setup>, Vec<Option<common::Daemon>>, Vec<Connection>, fabric_proto::wire::ExportHandle) {
    let (setups, daemons, mut c) = three_nodes_with(
        etcd,
        pki,
        shared,
        |_| false,
        |_, text| text.replace(&format!("lease_ttl_secs = {TTL}"), &format!("lease_ttl_secs = {ttl}")),
    );
    let gpu = hbm_of(&mut c[0], "tray0");
    let (region, _) = alloc(&mut c[0], &gpu, 2 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, access);
    (setups, daemons, c, handle)
}

/// Sends `sig` (`-STOP`, `-CONT`) to daemon `d`.
fn signal(d: &Option<common::Daemon>, sig: &str) {
    let pid = d.as_ref().unwrap().child.id().to_string();
    assert!(std::process::Command::new("kill").arg(sig).arg(&pid).status().unwrap().success());
}

/// An owner slower than the importer's ask (stopped, SIGSTOP, past the 3 s an answer is
/// waited for) still grants and records the import when it resumes; the importer, whose
/// client was refused meanwhile, reads that late answer on a thread of its own and gives
/// the grant back, so the owner does not hold it (and count it against tray1) until tray1
/// restarts.
#[test]
fn a_grant_that_comes_after_the_importer_gave_up_is_given_back() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, daemons, mut c, handle) = three_with_lease(&etcd, &pki, shared.path(), 15, AccessMode::ReadWrite);
    // A first import opens tray1's blocking link to tray0 (kept for later asks); its client
    // leaves, and the import goes back.
    let mut first = common::client(&setups[1].socket);
    drop(import(&mut first, handle, AccessMode::ReadOnly).unwrap());
    drop(first);
    until(Duration::from_secs(5), "the first import given back", || (imports(&mut c[0]) == 0).then_some(()));

    signal(&daemons[0], "-STOP");
    let asked = Instant::now();
    let refused = import(&mut c[1], handle, AccessMode::ReadOnly).map(|_| ()).unwrap_err();
    let waited = asked.elapsed();
    signal(&daemons[0], "-CONT");
    assert_eq!(refused.code, ErrorCode::Unavailable, "{refused:?}");
    assert!(waited >= Duration::from_secs(3), "refused after {waited:?}, before the answer's wait ended");
    let importer = daemons[1].as_ref().unwrap();
    until(Duration::from_secs(10), "the late grant given back", || {
        let given = importer.log().contains("a grant came after its import gave up; given back");
        (given && imports(&mut c[0]) == 0).then_some(())
    });
    eprintln!(
        "refused after {waited:?}; the late grant given back {:?} after the owner resumed",
        asked.elapsed() - waited
    );
    // The link still serves: the same import now succeeds and is held once.
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(imports(&mut c[0]), 1);
}

/// A release the owner could not take (stopped: the link to it cannot be made) is told
/// again once it answers: the owner holds nothing the importer's client let go of. Before,
/// the release was told once and the owner held the import until the importer restarted.
#[test]
fn a_release_the_owner_could_not_take_is_told_again() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (setups, daemons, mut c, handle) = three_with_lease(&etcd, &pki, shared.path(), 20, AccessMode::ReadOnly);
    let mut holder = common::client(&setups[1].socket);
    let held = import(&mut holder, handle, AccessMode::ReadOnly).unwrap();
    assert_eq!(imports(&mut c[0]), 1);

    signal(&daemons[0], "-STOP");
    // The client leaves: tray1 releases its import, and cannot reach tray0.
    drop(held);
    drop(holder);
    let importer = daemons[1].as_ref().unwrap();
    until(Duration::from_secs(15), "the release failed once", || {
        importer.log().contains("cannot release an import at its owner").then_some(())
    });
    signal(&daemons[0], "-CONT");
    let t = Instant::now();
    until(Duration::from_secs(15), "the release told again", || (imports(&mut c[0]) == 0).then_some(()));
    eprintln!("released at tray0 {:?} after it resumed", t.elapsed());
}

/// tray0 and tray1, each in its namespace of `net` with its link at the namespace's
/// address, on the shared sim fabric in `shared` where `on_fabric` says (identities shared
/// across the domain), started and each listing both live: their files, daemons, clients.
fn in_namespaces(
    net: &fabric_domain::testing::netns::Net,
    etcd: &fabric_domain::testing::EtcdServer,
    pki: &Pki,
    shared: &std::path::Path,
    on_fabric: impl Fn(usize) -> bool,
) -> (Vec<common::Setup>, Vec<common::Daemon>, Vec<Connection>) {
    let names = ["tray0", "tray1"];
    let setups: Vec<_> = names
        .iter()
        .zip(net.nodes())
        .enumerate()
        .map(|(i, (n, ns))| {
            let fabric = if on_fabric(i) { format!("shared_dir = {:?}\n", shared.join("sim")) } else { String::new() };
            node_at(etcd, pki, n, n, &format!("{}:7471", ns.addr()), &format!("{fabric}shared_identities = true\n"))
        })
        .collect();
    let daemons: Vec<_> = setups
        .iter()
        .zip(net.nodes())
        .map(|(s, ns)| common::start_with(&s.config, s.dir.path(), |cmd| ns.enter_on_spawn(cmd).unwrap()))
        .collect();
    let mut c: Vec<Connection> = setups.iter().map(|s| common::client(&s.socket)).collect();
    for x in &mut c {
        for n in names {
            until(Duration::from_secs(15), "both nodes live", || incarnation_of(x, n));
        }
    }
    (setups, daemons, c)
}

/// Drops what each of `a` and `b` sends to the other (etcd still sees both).
fn partition(a: &Netns, b: &Netns, cut: bool) {
    let (ab, ba) = if cut { (a.cut(b.addr()), b.cut(a.addr())) } else { (a.heal(b.addr()), b.heal(a.addr())) };
    ab.unwrap();
    ba.unwrap();
}

#[test]
fn a_partition_between_two_nodes_keeps_mappings_and_refuses_new_imports_naming_the_node_until_it_heals() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(fabric_domain::testing::net_and_etcd_or_skip(2)) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    let (_setups, _daemons, mut c) = in_namespaces(&net, &etcd, &pki, shared.path(), |_| true);
    // Across the namespaces' network: tray1's client maps tray0's region.
    let gpu = hbm_of(&mut c[0], "tray0");
    let (a, file0) = common::alloc_hbm(&mut c[0], &gpu, 2 * MIB);
    let handle = common::export(&mut c[0], a.region, AccessMode::ReadWrite);
    let (i, file1) = import(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    let (mut m0, m1) = (map_file(&file0, a.offset, a.size), map_file(&file1, i.offset, i.size));
    m0[..4].copy_from_slice(b"ns-0");
    assert_eq!(&m1[..4], b"ns-0");

    // The two nodes cannot reach each other; etcd still sees both.
    partition(&net.nodes()[0], &net.nodes()[1], true);
    m0[8..12].copy_from_slice(b"kept");
    assert_eq!(&m1[8..12], b"kept", "the established mapping keeps working");
    let t = Instant::now();
    let refused = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap_err();
    let took = t.elapsed();
    eprintln!("a new import across the partition refused after {took:?}: {}", refused.message);
    assert_eq!(refused.code, ErrorCode::Unavailable, "{refused:?}");
    assert!(refused.message.contains("tray0"), "{}", refused.message);
    assert!(took < Duration::from_secs(7), "refused promptly, not after a long hang: {took:?}");
    for x in &mut c {
        assert_eq!(standing(x), "joined", "etcd sees both nodes");
    }

    // Healed: a new import works again, and a revoke reaches tray1's client.
    partition(&net.nodes()[0], &net.nodes()[1], false);
    let (i2, _f) = until(Duration::from_secs(15), "imports across the healed link", || {
        import(&mut c[1], handle, AccessMode::ReadOnly).ok()
    });
    subscribe(&mut c[1]);
    let Response::Revoke = c[0].call(Request::Revoke(RevokeRequest { handle }), &[]).unwrap().0 else { panic!() };
    let mut told = std::collections::BTreeSet::new();
    while told.len() < 2 {
        let r = revocation(&mut c[1]);
        assert_eq!((r.region, r.reason), (a.region, RevocationReason::Revoked));
        told.insert(r.import);
    }
    assert_eq!(told, [i.import, i2.import].into_iter().collect());
    drop((m0, m1));
}

fn map_file(f: &std::fs::File, offset: u64, len: u64) -> memmap2::MmapMut {
    // SAFETY: a shared mapping of a region file, used by this test only while the region
    // lives.
    unsafe { memmap2::MmapOptions::new().offset(offset).len(len as usize).map_mut(f).unwrap() }
}

#[test]
fn a_node_in_its_namespace_copies_to_and_from_a_region_of_a_node_in_another() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some((net, etcd)) = rt.block_on(fabric_domain::testing::net_and_etcd_or_skip(2)) else { return };
    let (pki, shared) = (Pki::new(), tempfile::tempdir().unwrap());
    // tray1 has no shared fabric: class NET to tray0, its bytes cross the link only.
    let (_setups, _daemons, mut c) = in_namespaces(&net, &etcd, &pki, shared.path(), |i| i == 0);
    let size = 8 * MIB;
    let gpu0 = hbm_of(&mut c[0], "tray0");
    let (a, file0) = common::alloc_hbm(&mut c[0], &gpu0, size);
    let handle = common::export(&mut c[0], a.region, AccessMode::ReadWrite);
    let i = import_copy_only(&mut c[1], handle, AccessMode::ReadWrite).unwrap();
    let gfa = i.gfa.unwrap();
    assert_eq!((i.gfa, i.size), (a.gfa, size));
    let gpu1 = until(Duration::from_secs(15), "tray1's memory placed", || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hbm_of(&mut c[1], "tray1"))).ok()
    });
    let (r, mem) = registered(&mut c[1], &gpu1, size);
    let m0 = map_file(&file0, a.offset, size);

    // Push across the namespaces: several chunks and an unaligned tail, to an unaligned GFA.
    use std::os::unix::fs::FileExt;
    let len = 3 * MIB + 4097;
    let data = pattern(7, len as usize);
    mem.write_all_at(&data, 0).unwrap();
    let id = start_copy(&mut c[1], CopyEndpoint::Gfa(gfa + 123), reg(r, 0), len).unwrap();
    let d = copy_done(&mut c[1], id);
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, len));
    assert!(m0[123..123 + len as usize] == data[..], "tray0's client reads what tray1 pushed");
    // Pull: tray0's bytes into the registration at an offset.
    let back = 2 * MIB + 1;
    let id = start_copy(&mut c[1], reg(r, 4 * MIB), CopyEndpoint::Gfa(gfa + 100), back).unwrap();
    let d = copy_done(&mut c[1], id);
    assert_eq!((d.result, d.bytes), (CopyResult::Ok, back));
    let mut got = vec![0; back as usize];
    mem.read_exact_at(&mut got, 4 * MIB).unwrap();
    assert!(got[..] == m0[100..100 + back as usize], "tray1 pulled tray0's bytes");
}
