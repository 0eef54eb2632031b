//! Faults across nodes with real fabricd nodes, a private etcd and the node link
//! (`docs/domain.md`, "Faults"): memory a node imported and that its owner freed after
//! that node died (kill -9) is quarantined — the free succeeds, the range is not handed
//! out again (an allocation of the whole resource is refused), and `domain status` names
//! the node — until the node returns as a new incarnation, or an admin collects it with
//! `domain gc`; and more revocations at once than an event queue holds (300 imports of
//! one region freed) all reach the importer node's clients, and the freed range is free
//! again once the importer acknowledged them.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary it says it is
//! skipped.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::time::{Duration, Instant};

use fabric_domain::testing::until;
use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, CodecError, Connection, DeviceName, DomainAction, DomainRequest, ErrorBody,
    ErrorCode, FreeRequest, MemoryClass, Name, Request, Response, RevocationReason,
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
    let Response::Free = c.call(Request::Free(FreeRequest { region }), &[]).unwrap().0 else { panic!() };
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
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
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

    // tray2 comes back (a new incarnation: it holds nothing): the quarantine lifts.
    daemons[2] = Some(common::start(&setups[2].config, setups[2].dir.path()));
    let t = Instant::now();
    until(Duration::from_secs(15), "tray2's quarantine lifted", || quarantine(&mut c[0]).is_empty().then_some(()));
    eprintln!("quarantine lifted {:?} after tray2 restarted", t.elapsed());
    let (all, _) = alloc(&mut c[0], &gpu, whole).expect("the whole resource is free again");
    free(&mut c[0], all);

    // The admin path: tray1 imports, dies; the freed region is quarantined until an admin
    // collects tray1 (`domain gc`), which frees its slot and lifts the quarantine.
    let (region, gfa) = alloc(&mut c[0], &gpu, 4 * MIB).unwrap();
    let handle = common::export(&mut c[0], region, AccessMode::ReadWrite);
    let (_i, _f) = import(&mut c[1], handle, AccessMode::ReadOnly).unwrap();
    kill(&mut daemons[1]);
    until(Duration::from_secs(TTL + 3), "tray1's import released", || (imports(&mut c[0]) == 0).then_some(()));
    free(&mut c[0], region);
    assert_eq!(quarantine(&mut c[0]), vec![("tray1".to_owned(), 1, 4 * MIB)]);
    assert_eq!(alloc(&mut c[0], &gpu, whole).unwrap_err().code, ErrorCode::NoSpace);
    let doc = gc(&mut c[0], "tray1");
    assert_eq!(doc["gc"]["lifted_bytes"], 4 * MIB, "{doc}");
    assert!(quarantine(&mut c[0]).is_empty());
    let (again, at) = alloc(&mut c[0], &gpu, 4 * MIB).unwrap();
    assert_eq!(at, gfa, "first fit hands the collected range out again");
    free(&mut c[0], again);
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
}
