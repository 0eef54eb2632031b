//! Shares of memory several hosts reach, against a real, private etcd: concurrent claims
//! get disjoint ranges, a node keeps its share across restarts, a full or mismatched table
//! is refused by name, a hostile table is refused, and only a gc of a node that is not live
//! releases its share.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use fabric_domain::records::{RECORD_VERSION, RecordError, RecordLimits};
use fabric_domain::testing::EtcdServer;
use fabric_domain::{DataPathKind, DomainClient, DomainConfig, DomainSettings, EtcdError, ShareTable};

const GIB: u64 = 1 << 30;
const RESOURCE: &str = "serial:cxl/0x5a17/cxl_volatile0";

async fn client(etcd: &EtcdServer, node: &str) -> DomainClient {
    let config = DomainConfig {
        name: "test".into(),
        endpoints: vec![etcd.endpoint().to_owned()],
        tls: None,
        node: node.into(),
        lease_ttl_secs: 6,
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
