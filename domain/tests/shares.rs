//! Shares of memory several hosts reach, against a real, private etcd: concurrent claims
//! get disjoint ranges, a node keeps its share across restarts, a full or mismatched table
//! is refused by name, a hostile table is refused, only a gc of a node that is not live
//! releases its share, a node whose share was collected while it was away gets it back
//! where it was or is refused, never moved, and a share grows in place only into free room.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use fabric_domain::records::{RECORD_VERSION, RecordError, RecordLimits};
use fabric_domain::testing::EtcdServer;
use fabric_domain::{DataPathKind, DomainClient, DomainConfig, DomainSettings, EtcdError, ShareTable, ShareWant};

const GIB: u64 = 1 << 30;
const RESOURCE: &str = "serial:cxl/0x5a17/cxl_volatile0";

async fn client(etcd: &EtcdServer, node: &str) -> DomainClient {
    let config = DomainConfig {
        name: "test".into(),
        endpoints: vec![etcd.endpoint().to_owned()],
        tls: None,
        node: node.into(),
        lease_ttl_secs: 6,
        data_paths: None,
    };
    DomainClient::connect(&config, RecordLimits::default()).await.unwrap()
}

fn settings() -> DomainSettings {
    DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_sharing_a_device_get_disjoint_shares_they_keep_until_a_gc() {
    let Some(etcd) = fabric_domain::testing::etcd_or_skip().await else { return };
    // Four hosts of one 8 GiB resource each ask for 2 GiB at once.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(4));
    let mut claimers = Vec::new();
    for i in 0..4 {
        let (c, start) = (client(&etcd, &format!("host-{i}")).await, start.clone());
        claimers.push(tokio::spawn(async move {
            c.claim_slot(&settings()).await.unwrap();
            start.wait().await;
            c.claim_share(RESOURCE, 8 * GIB, 2 * GIB, 2 << 20).await.unwrap()
        }));
    }
    let mut shares = Vec::new();
    for c in claimers {
        shares.push(c.await.unwrap());
    }
    shares.sort_by_key(|s| s.offset);
    let offsets: Vec<u64> = shares.iter().map(|s| s.offset).collect();
    assert_eq!(offsets, [0, 2 * GIB, 4 * GIB, 6 * GIB], "{shares:?}");
    assert!(shares.iter().all(|s| s.len == 2 * GIB));

    // A fifth host finds no room, and is told how much is unclaimed.
    let e = client(&etcd, "host-4").await;
    match e.claim_share(RESOURCE, 8 * GIB, GIB, 2 << 20).await {
        Err(EtcdError::ShareFull { resource, len, free: 0 }) => assert_eq!((resource.as_str(), len), (RESOURCE, GIB)),
        other => panic!("a full resource: {other:?}"),
    }
    // A host that sees another capacity is refused with both values.
    match e.claim_share(RESOURCE, 16 * GIB, GIB, 2 << 20).await {
        Err(err @ EtcdError::ShareMismatch { .. }) => {
            let text = err.to_string();
            assert!(text.contains("8589934592 bytes") && text.contains("17179869184 bytes"), "{text}");
        }
        other => panic!("another capacity: {other:?}"),
    }

    // host-1 restarts (a new client) and asks for another size: it keeps what it held.
    let host1 = shares.iter().find(|s| s.node == "host-1").unwrap().clone();
    let b = client(&etcd, "host-1").await;
    assert_eq!(b.claim_share(RESOURCE, 8 * GIB, 4 * GIB, 2 << 20).await.unwrap(), host1);

    // Its gc is refused while it is a live member, and frees the share once it is not.
    let lease = b.grant_lease().await.unwrap();
    b.join(&lease, &fabric_domain::testing::member("host-1")).await.unwrap();
    assert!(matches!(b.gc_slot("host-1").await, Err(EtcdError::GcLive { .. })));
    b.leave(lease).await.unwrap();
    b.gc_slot("host-1").await.unwrap().unwrap();
    let freed = e.claim_share(RESOURCE, 8 * GIB, 2 * GIB, 2 << 20).await.unwrap();
    assert_eq!(freed.offset, host1.offset, "host-4 takes the range host-1's gc freed");
    let (value, _) = raw_get(&e, &e.keys().share(RESOURCE)).await.unwrap();
    let table: ShareTable = fabric_domain::records::decode(&value, RecordLimits::default()).unwrap();
    let nodes: Vec<&str> = table.shares.iter().map(|s| s.node.as_str()).collect();
    let expected: Vec<&str> =
        shares.iter().map(|s| if s.node == "host-1" { "host-4" } else { s.node.as_str() }).collect();
    assert_eq!(nodes, expected, "{table:?}");
}

/// `len` bytes of the test resource (8 GiB), back at `at` when given.
fn want(len: u64, at: Option<u64>) -> [ShareWant; 1] {
    [ShareWant { resource: RESOURCE.into(), capacity: 8 * GIB, len, at, grow_to: None }]
}

#[tokio::test]
async fn a_collected_share_is_claimed_back_where_it_was_or_refused_never_moved() {
    let Some(etcd) = fabric_domain::testing::etcd_or_skip().await else { return };
    let mut hosts = Vec::new();
    for n in ["host-a", "host-b", "host-c", "host-d"] {
        let x = client(&etcd, n).await;
        x.claim_slot(&settings()).await.unwrap();
        hosts.push(x);
    }
    let [a, b, c, d] = &hosts[..] else { unreachable!() };
    assert_eq!(c.claim_shares(&want(2 * GIB, None), 2 << 20).await.unwrap()[0].offset, 0);
    assert_eq!(a.claim_shares(&want(2 * GIB, None), 2 << 20).await.unwrap()[0].offset, 2 * GIB);
    let held = b.claim_shares(&want(2 * GIB, None), 2 << 20).await.unwrap();
    assert_eq!(held[0].offset, 4 * GIB);

    // host-b asks for its share back where it has it: found, nothing written.
    let (_, before) = raw_get(b, &b.keys().share(RESOURCE)).await.unwrap();
    assert_eq!(b.claim_shares(&want(2 * GIB, Some(4 * GIB)), 2 << 20).await.unwrap(), held);
    // Remembered elsewhere than it is held: refused, naming where it is held.
    match b.claim_shares(&want(2 * GIB, Some(6 * GIB)), 2 << 20).await {
        Err(EtcdError::ShareLost { offset, holder, .. }) => {
            assert_eq!(offset, 6 * GIB);
            assert!(holder.contains("0x100000000"), "{holder}");
        }
        other => panic!("a share held elsewhere: {other:?}"),
    }
    let (_, after) = raw_get(b, &b.keys().share(RESOURCE)).await.unwrap();
    assert_eq!(before, after, "neither answer wrote the table");

    // host-c and host-a are collected while away. host-a gets its range back, not the
    // lower one host-c freed, which a claim without `at` would take.
    c.gc_slot("host-c").await.unwrap().unwrap();
    a.gc_slot("host-a").await.unwrap().unwrap();
    a.claim_slot(&settings()).await.unwrap();
    let back = a.claim_shares(&want(2 * GIB, Some(2 * GIB)), 2 << 20).await.unwrap();
    assert_eq!((back[0].offset, back[0].len), (2 * GIB, 2 * GIB));

    // Collected again, and host-d takes the range meanwhile: host-a is refused, naming
    // host-d, and the table keeps host-d's share.
    a.gc_slot("host-a").await.unwrap().unwrap();
    assert_eq!(d.claim_shares(&want(4 * GIB, None), 2 << 20).await.unwrap()[0].offset, 0);
    a.claim_slot(&settings()).await.unwrap();
    match a.claim_shares(&want(2 * GIB, Some(2 * GIB)), 2 << 20).await {
        Err(err @ EtcdError::ShareLost { .. }) => {
            let text = err.to_string();
            assert!(text.contains("host-d") && text.contains(RESOURCE), "{text}");
        }
        other => panic!("a share another node took: {other:?}"),
    }
    // Past the resource's end: refused too, saying why nobody holds it.
    match a.claim_shares(&want(2 * GIB, Some(7 * GIB)), 2 << 20).await {
        Err(EtcdError::ShareLost { holder, .. }) => assert!(holder.starts_with("nobody"), "{holder}"),
        other => panic!("a range past the end: {other:?}"),
    }
    let (value, _) = raw_get(a, &a.keys().share(RESOURCE)).await.unwrap();
    let table: ShareTable = fabric_domain::records::decode(&value, RecordLimits::default()).unwrap();
    let nodes: Vec<(&str, u64)> = table.shares.iter().map(|s| (s.node.as_str(), s.offset)).collect();
    assert_eq!(nodes, [("host-d", 0), ("host-b", 4 * GIB)]);
    // Without `at` host-a may take any free range (what a node that never held one does).
    assert_eq!(a.claim_shares(&want(2 * GIB, None), 2 << 20).await.unwrap()[0].offset, 6 * GIB);
}

/// `len` bytes of the test resource held (or claimed back) at `at`, grown to `to`.
fn grow(len: u64, at: u64, to: u64) -> [ShareWant; 1] {
    [ShareWant { resource: RESOURCE.into(), capacity: 8 * GIB, len, at: Some(at), grow_to: Some(to) }]
}

/// The test resource's table as etcd holds it: (node, offset, len) of each share.
async fn table(c: &DomainClient) -> Vec<(String, u64, u64)> {
    let (value, _) = raw_get(c, &c.keys().share(RESOURCE)).await.unwrap();
    let table: ShareTable = fabric_domain::records::decode(&value, RecordLimits::default()).unwrap();
    table.shares.into_iter().map(|s| (s.node, s.offset, s.len)).collect()
}

#[tokio::test]
async fn a_share_grows_in_place_where_the_room_after_it_is_free_and_never_moves_or_shrinks() {
    let Some(etcd) = fabric_domain::testing::etcd_or_skip().await else { return };
    let mut hosts = Vec::new();
    for n in ["host-a", "host-b", "host-c"] {
        let x = client(&etcd, n).await;
        x.claim_slot(&settings()).await.unwrap();
        hosts.push(x);
    }
    let [a, b, c] = &hosts[..] else { unreachable!() };
    assert_eq!(a.claim_shares(&want(GIB, None), 2 << 20).await.unwrap()[0].offset, 0);
    assert_eq!(b.claim_shares(&want(GIB, None), 2 << 20).await.unwrap()[0].offset, GIB);

    // a asks for 2 GiB where it holds 1: b holds the room after it, so a keeps 1 GiB and
    // nothing is written.
    let (_, before) = raw_get(a, &a.keys().share(RESOURCE)).await.unwrap();
    let kept = a.claim_shares(&grow(GIB, 0, 2 * GIB), 2 << 20).await.unwrap();
    assert_eq!((kept[0].offset, kept[0].len), (0, GIB));
    assert_eq!(raw_get(a, &a.keys().share(RESOURCE)).await.unwrap().1, before, "nothing written");
    // b, last, grows to 3 GiB where it is.
    let grown = b.claim_shares(&grow(GIB, GIB, 3 * GIB), 2 << 20).await.unwrap();
    assert_eq!((grown[0].offset, grown[0].len), (GIB, 3 * GIB));
    // Asked for less than it holds, b keeps all of it (its regions may lie anywhere in it).
    let still = b.claim_shares(&grow(GIB, GIB, 2 * GIB), 2 << 20).await.unwrap();
    assert_eq!(still[0].len, 3 * GIB);
    assert_eq!(table(a).await, [("host-a".into(), 0, GIB), ("host-b".into(), GIB, 3 * GIB)]);
    // Past the resource's end: kept.
    assert_eq!(b.claim_shares(&grow(3 * GIB, GIB, 8 * GIB), 2 << 20).await.unwrap()[0].len, 3 * GIB);

    // c takes the next range; b is collected; a now grows into b's old range.
    assert_eq!(c.claim_shares(&want(GIB, None), 2 << 20).await.unwrap()[0].offset, 4 * GIB);
    b.gc_slot("host-b").await.unwrap().unwrap();
    let grown = a.claim_shares(&grow(GIB, 0, 2 * GIB), 2 << 20).await.unwrap();
    assert_eq!((grown[0].offset, grown[0].len), (0, 2 * GIB));

    // b comes back for its range at 1 GiB: a's grown share holds part of it, so it is
    // refused, naming a, rather than moved.
    match b.claim_shares(&grow(GIB, GIB, 3 * GIB), 2 << 20).await {
        Err(EtcdError::ShareLost { holder, .. }) => assert!(holder.contains("host-a"), "{holder}"),
        other => panic!("b's range is a's now: {other:?}"),
    }
    // c is collected and claimed back at its offset, grown where the room allows (to the
    // end of the resource), and at its old size where it does not.
    c.gc_slot("host-c").await.unwrap().unwrap();
    let back = c.claim_shares(&grow(GIB, 4 * GIB, 4 * GIB), 2 << 20).await.unwrap();
    assert_eq!((back[0].offset, back[0].len), (4 * GIB, 4 * GIB));
    c.claim_slot(&settings()).await.unwrap();
    c.gc_slot("host-c").await.unwrap().unwrap();
    assert_eq!(b.claim_shares(&want(GIB, None), 2 << 20).await.unwrap()[0].offset, 2 * GIB);
    let back = c.claim_shares(&grow(GIB, 4 * GIB, 5 * GIB), 2 << 20).await.unwrap();
    assert_eq!((back[0].offset, back[0].len), (4 * GIB, GIB));
    assert_eq!(
        table(a).await,
        [("host-a".into(), 0, 2 * GIB), ("host-b".into(), 2 * GIB, GIB), ("host-c".into(), 4 * GIB, GIB)]
    );
}

#[tokio::test]
async fn hostile_share_tables_are_refused_and_never_extended() {
    let Some(etcd) = fabric_domain::testing::etcd_or_skip().await else { return };
    let c = client(&etcd, "host-0").await;
    let key = c.keys().share(RESOURCE);
    let mut raw = c.raw();
    let overlapping = format!(
        r#"{{"version":{RECORD_VERSION},"resource":"{RESOURCE}","capacity":{},"shares":[{{"node":"a","offset":0,"len":{}}},{{"node":"b","offset":{},"len":{}}}]}}"#,
        8 * GIB,
        2 * GIB,
        GIB,
        GIB
    );
    for (value, check) in [
        (overlapping.clone(), "overlap"),
        (overlapping[..40].to_owned(), "truncated"),
        (overlapping.replace(&format!(r#""version":{RECORD_VERSION}"#), r#""version":7"#), "version"),
        (" ".repeat(100 * 1024), "huge"),
    ] {
        raw.put(key.as_str(), value.as_str(), None).await.unwrap();
        match c.claim_share(RESOURCE, 8 * GIB, GIB, 2 << 20).await {
            Err(EtcdError::Record { key: k, source }) => {
                assert_eq!(k, key);
                let expected = match check {
                    "overlap" => matches!(source, RecordError::Invalid { field: "shares", .. }),
                    "truncated" => matches!(source, RecordError::Truncated { .. }),
                    "version" => matches!(source, RecordError::WrongVersion { found: 7 }),
                    _ => matches!(source, RecordError::Oversized { .. }),
                };
                assert!(expected, "{check}: {source:?}");
            }
            other => panic!("{check}: {other:?}"),
        }
        let (now, _) = raw_get(&c, &key).await.unwrap();
        assert_eq!(now, value.as_bytes(), "{check}: the refused table is left as it was");
    }
    // A resource name that is not one is refused before etcd is asked.
    assert!(matches!(c.claim_share("../x", 8 * GIB, GIB, 2 << 20).await, Err(EtcdError::Record { .. })));
}

async fn raw_get(c: &DomainClient, key: &str) -> Option<(Vec<u8>, i64)> {
    let answer = c.raw().get(key, None).await.unwrap();
    answer.kvs().first().map(|e| (e.value().to_vec(), e.mod_revision()))
}

/// A share claim made for a membership claims nothing once that membership is gone: the
/// member key removed (a lease run out while the node stalled, a gc) — before, the claim
/// went through and left a node with no slot and no member key holding a range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_share_claim_claims_nothing_for_a_membership_that_is_gone() {
    let Some(etcd) = fabric_domain::testing::etcd_or_skip().await else { return };
    let c = client(&etcd, "tray-f").await;
    let lease = c.grant_lease().await.unwrap();
    let fence = c.join_fenced(&lease, &fabric_domain::testing::member("tray-f")).await.unwrap();
    let want = |r: &str| ShareWant { resource: r.into(), capacity: 1 << 30, len: 256 << 20, at: None, grow_to: None };
    let shares = c.claim_shares_fenced(&fence, &[want("serial:cxl/0x1/cxl_volatile0")], 2 << 20).await.unwrap();
    assert_eq!(shares.len(), 1);
    // The member key goes under the node (the lease is still alive here).
    c.raw().delete(c.keys().member("tray-f"), None).await.unwrap();
    match c.claim_shares_fenced(&fence, &[want("serial:cxl/0x2/cxl_volatile0")], 2 << 20).await {
        Err(EtcdError::Fenced { reason, .. }) => assert!(reason.contains("gone"), "{reason}"),
        other => panic!("a claim for a membership that is gone: {other:?}"),
    }
    let table = c.raw().get(c.keys().share("serial:cxl/0x2/cxl_volatile0"), None).await.unwrap();
    assert!(table.kvs().is_empty(), "nothing was claimed");
    // Once the lease is known lost, refused without asking etcd.
    c.leave(lease).await.unwrap();
    assert!(matches!(
        c.claim_shares_fenced(&fence, &[want("serial:cxl/0x3/cxl_volatile0")], 2 << 20).await,
        Err(EtcdError::Fenced { .. })
    ));
}
