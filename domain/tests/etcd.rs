//! The domain's etcd operations against a real, private etcd: concurrent slot claims,
//! repeated claims, member join refusals and their end with the lease, settings
//! mismatches, hostile records, and a lease that notices etcd is gone.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary each test says it
//! is skipped (scripts/deps.sh installs Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fabric_domain::testing::EtcdServer;
use fabric_domain::{
    DataPathKind, DomainClient, DomainConfig, DomainSettings, EtcdError, FabricGroup, LeaseState, MemberRecord,
    RecordError, RecordLimits, SlotClaim, fresh_incarnation,
};

async fn etcd() -> Option<EtcdServer> {
    fabric_domain::testing::etcd_or_skip().await
}

fn config(etcd: &EtcdServer, node: &str, ttl: u64) -> DomainConfig {
    DomainConfig {
        name: "test".into(),
        endpoints: vec![etcd.endpoint().to_owned()],
        tls: None,
        node: node.into(),
        lease_ttl_secs: ttl,
        data_paths: None,
    }
}

async fn client(etcd: &EtcdServer, node: &str, ttl: u64) -> DomainClient {
    DomainClient::connect(&config(etcd, node, ttl), RecordLimits::default()).await.unwrap()
}

fn member(node: &str) -> MemberRecord {
    MemberRecord {
        version: fabric_domain::records::RECORD_VERSION,
        name: node.into(),
        incarnation: fresh_incarnation(),
        peer_address: "127.0.0.1:7400".into(),
        capabilities: vec!["shared-file".into()],
        groups: vec![FabricGroup::CxlPool { pool: "pool-0".into() }],
        software: env!("CARGO_PKG_VERSION").into(),
        node_id: None,
    }
}

/// 2^44 bytes in 1 TiB slots: exactly 16 slots.
fn sixteen_slots() -> DomainSettings {
    DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_claimers_get_sixteen_distinct_slots() {
    let Some(etcd) = etcd().await else { return };
    let settings = sixteen_slots();
    // All connected first, then released at once, so that claims really race.
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(16));
    let mut claimers = Vec::new();
    for i in 0..16 {
        let c = client(&etcd, &format!("tray-{i}"), 6).await;
        let (settings, start) = (settings.clone(), start.clone());
        claimers.push(tokio::spawn(async move {
            start.wait().await;
            c.ensure_settings(&settings).await.unwrap();
            (c.claim_slot(&settings).await.unwrap(), c)
        }));
    }
    let mut slots = BTreeSet::new();
    let mut clients = Vec::new();
    for claimer in claimers {
        let (slot, c) = claimer.await.unwrap();
        assert!(slot < 16, "{slot}");
        slots.insert(slot);
        clients.push((slot, c));
    }
    assert_eq!(slots.len(), 16, "{slots:?}");
    // etcd agrees: each slot key names the node that was told it holds it.
    for (slot, c) in &clients {
        let value = c.raw().get(c.keys().slot(*slot), None).await.unwrap();
        let claim: SlotClaim = fabric_domain::records::decode(value.kvs()[0].value(), RecordLimits::default()).unwrap();
        assert_eq!(claim, SlotClaim::new(*slot, c.node()));
    }
    // A repeated claim (as after a restart: a new connection) returns the same slot.
    for (slot, c) in &clients {
        let again = client(&etcd, c.node(), 6).await;
        assert_eq!(again.claim_slot(&settings).await.unwrap(), *slot, "{}", c.node());
        assert_eq!(again.held_slot(c.node()).await.unwrap(), Some(*slot));
    }
    let late = client(&etcd, "tray-16", 6).await;
    match late.claim_slot(&settings).await {
        Err(EtcdError::DomainFull { count: 16 }) => {}
        other => panic!("a 17th claim in 16 slots: {other:?}"),
    }
}

#[tokio::test]
async fn a_slot_is_freed_only_by_gc_of_a_node_that_is_not_live() {
    let Some(etcd) = etcd().await else { return };
    let settings = sixteen_slots();
    let a = client(&etcd, "tray-a", 6).await;
    let slot = a.claim_slot(&settings).await.unwrap();
    let lease = a.grant_lease().await.unwrap();
    a.join(&lease, &member("tray-a")).await.unwrap();
    match a.gc_slot("tray-a").await {
        Err(EtcdError::GcLive { node }) => assert_eq!(node, "tray-a"),
        other => panic!("gc of a live node: {other:?}"),
    }
    // Leaving does not free the slot: the node gets it back when it returns.
    a.leave(lease).await.unwrap();
    assert_eq!(a.claim_slot(&settings).await.unwrap(), slot);
    assert_eq!(a.gc_slot("tray-a").await.unwrap(), Some(slot));
    assert_eq!(a.held_slot("tray-a").await.unwrap(), None);
    assert_eq!(a.gc_slot("tray-a").await.unwrap(), None);
    let raw = a.raw().get(a.keys().slot(slot), None).await.unwrap();
    assert!(raw.kvs().is_empty(), "slots/{slot} is gone with the gc");
}

#[tokio::test]
async fn a_join_in_a_slot_an_admin_collected_meanwhile_is_refused() {
    // The node read its slot; an admin's gc commits before its member key is written:
    // the join says so instead of leaving a member that serves a slot it no longer holds.
    let Some(etcd) = etcd().await else { return };
    let settings = sixteen_slots();
    let a = client(&etcd, "tray-a", 6).await;
    let slot = a.claim_slot(&settings).await.unwrap();
    let lease = a.grant_lease().await.unwrap();
    assert_eq!(a.gc_slot("tray-a").await.unwrap(), Some(slot));
    match a.join_in_slot(&lease, &member("tray-a"), slot).await {
        Err(EtcdError::SlotCollected { node, slot: s, .. }) => assert_eq!((node.as_str(), s), ("tray-a", slot)),
        other => panic!("a join in a collected slot: {other:?}"),
    }
    // A rejoin claims that slot back while nobody took it; the join goes through, and a
    // gc of the now live node is refused.
    assert_eq!(a.claim_slot_at(slot).await.unwrap(), slot);
    assert_eq!(a.claim_slot_at(slot).await.unwrap(), slot, "held: the same");
    a.join_in_slot(&lease, &member("tray-a"), slot).await.unwrap();
    assert!(matches!(a.gc_slot("tray-a").await, Err(EtcdError::GcLive { .. })));
    // Taken by another node meanwhile: never another slot, the holder named.
    let b = client(&etcd, "tray-b", 6).await;
    let other = b.claim_slot(&settings).await.unwrap();
    match b.claim_slot_at(slot).await {
        Err(EtcdError::SlotCollected { now, .. }) => assert!(now.contains(&format!("slot {other}")), "{now}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(b.gc_slot("tray-b").await.unwrap(), Some(other));
    match b.claim_slot_at(slot).await {
        Err(EtcdError::SlotCollected { now, .. }) => assert!(now.contains("tray-a"), "{now}"),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_join_in_a_slot_this_name_no_longer_holds_is_refused_though_it_holds_another() {
    // A daemon read its slot; an admin's gc frees it, another node takes it, and a second
    // daemon under the same name (a misconfiguration) claims a new slot. Before, the first
    // daemon's join passed (a `slot-of` key existed) and it served a slot another held.
    let Some(etcd) = etcd().await else { return };
    let settings = sixteen_slots();
    let a = client(&etcd, "tray-a", 6).await;
    let slot = a.claim_slot(&settings).await.unwrap();
    let lease = a.grant_lease().await.unwrap();
    assert_eq!(a.gc_slot("tray-a").await.unwrap(), Some(slot));
    let c = client(&etcd, "tray-c", 6).await;
    assert_eq!(c.claim_slot_at(slot).await.unwrap(), slot);
    let twin = client(&etcd, "tray-a", 6).await;
    let other = twin.claim_slot(&settings).await.unwrap();
    assert_ne!(other, slot);
    match a.join_in_slot(&lease, &member("tray-a"), slot).await {
        Err(EtcdError::SlotCollected { slot: s, now, .. }) => {
            assert_eq!(s, slot);
            assert!(now.contains(&format!("slot {other}")), "{now}");
        }
        other => panic!("a join in a slot another node holds: {other:?}"),
    }
    assert!(a.members().await.unwrap().members.is_empty(), "no member key was written");
    // In the slot this name holds now, the join goes through.
    a.join_in_slot(&lease, &member("tray-a"), other).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_daemon_with_the_same_name_is_refused_while_the_first_lease_lives() {
    let Some(etcd) = etcd().await else { return };
    let first = client(&etcd, "tray-1", 2).await;
    let first_record = member("tray-1");
    let first_lease = first.grant_lease().await.unwrap();
    first.join(&first_lease, &first_record).await.unwrap();

    let second = client(&etcd, "tray-1", 2).await;
    let second_lease = second.grant_lease().await.unwrap();
    match second.join(&second_lease, &member("tray-1")).await {
        Err(EtcdError::NameTaken { node, incarnation }) => {
            assert_eq!(node, "tray-1");
            assert_eq!(incarnation, first_record.incarnation.to_string());
        }
        other => panic!("a second join: {other:?}"),
    }
    // Still refused after more than one TTL: the first daemon keeps its lease alive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(first_lease.state(), LeaseState::Alive);
    assert!(matches!(second.join(&second_lease, &member("tray-1")).await, Err(EtcdError::NameTaken { .. })));

    // Revoked: the name is free at once.
    first.leave(first_lease).await.unwrap();
    let second_record = member("tray-1");
    second.join(&second_lease, &second_record).await.unwrap();
    let listed = second.members().await.unwrap();
    assert_eq!(listed.members, vec![second_record]);

    // Expired: a daemon that stops renewing (dropped lease, as after kill -9) frees the name
    // about one TTL later.
    drop(second_lease);
    let third = client(&etcd, "tray-1", 2).await;
    let third_lease = third.grant_lease().await.unwrap();
    let stopped = Instant::now();
    assert!(matches!(third.join(&third_lease, &member("tray-1")).await, Err(EtcdError::NameTaken { .. })));
    loop {
        match third.join(&third_lease, &member("tray-1")).await {
            Ok(()) => break,
            Err(EtcdError::NameTaken { .. }) if stopped.elapsed() < Duration::from_secs(6) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("join after the first lease expired: {other:?} after {:?}", stopped.elapsed()),
        }
    }
    assert!(stopped.elapsed() >= Duration::from_millis(500), "freed too early: {:?}", stopped.elapsed());
}

/// A member key that holds junk refuses the join naming why its holder is not known
/// (before: "unknown", as for any failure to read it). (A refusal whose member key is
/// gone by the time it is read is tried again; that window is not reproduced here.)
#[tokio::test]
async fn a_join_refused_names_the_holder_or_tries_again() {
    let Some(etcd) = etcd().await else { return };
    let c = client(&etcd, "tray-9", 2).await;
    let lease = c.grant_lease().await.unwrap();
    let key = c.keys().member("tray-9");
    let short = c.grant_lease().await.unwrap();
    let put = etcd_client::PutOptions::new().with_lease(short.id());
    c.raw().put(key.clone(), b"not a record".to_vec(), Some(put)).await.unwrap();
    match c.join(&lease, &member("tray-9")).await {
        Err(EtcdError::NameTaken { incarnation, .. }) => assert!(incarnation.starts_with("unknown: "), "{incarnation}"),
        other => panic!("a join over junk: {other:?}"),
    }
    // Gone with its lease: the name is free.
    c.leave(short).await.unwrap();
    c.join(&lease, &member("tray-9")).await.unwrap();
}

#[tokio::test]
async fn settings_are_written_once_and_a_mismatch_names_both_values() {
    let Some(etcd) = etcd().await else { return };
    let first = client(&etcd, "tray-0", 6).await;
    let domain = DomainSettings::new(57, 1 << 40, vec![DataPathKind::SharedFile]);
    assert_eq!(first.ensure_settings(&domain).await.unwrap(), domain);
    let second = client(&etcd, "tray-1", 6).await;
    assert_eq!(second.ensure_settings(&domain).await.unwrap(), domain);

    let narrow = DomainSettings::new(52, 1 << 40, vec![DataPathKind::SharedFile]);
    let err = second.ensure_settings(&narrow).await.unwrap_err();
    match &err {
        EtcdError::SettingsMismatch { field, domain, local } => {
            assert_eq!((*field, domain.as_str(), local.as_str()), ("address_bits", "57", "52"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(err.to_string(), "domain setting address_bits: the domain has 57, this node has 52");
    let rdma = DomainSettings::new(57, 1 << 40, vec![DataPathKind::Rdma]);
    assert!(matches!(
        second.ensure_settings(&rdma).await,
        Err(EtcdError::SettingsMismatch { field: "data_paths", .. })
    ));
    // A node that names no data paths of its own takes the domain's; the rest must agree.
    assert_eq!(second.ensure_settings_with(&rdma, false).await.unwrap(), domain);
    assert!(matches!(
        second.ensure_settings_with(&DomainSettings::new(52, 1 << 40, vec![DataPathKind::Rdma]), false).await,
        Err(EtcdError::SettingsMismatch { field: "address_bits", .. })
    ));
    // The first write stays.
    assert_eq!(first.ensure_settings(&domain).await.unwrap(), domain);

    // A slot placed under them, then the key deleted by hand: nobody writes settings again
    // (the narrow ones would contradict slot 0's GFAs), the same ones included.
    first.claim_slot(&domain).await.unwrap();
    let mut raw = first.raw();
    raw.delete(first.keys().settings(), None).await.unwrap();
    for settings in [&narrow, &domain] {
        match second.ensure_settings(settings).await {
            Err(EtcdError::SettingsGone { key }) => assert_eq!(key, first.keys().settings()),
            other => panic!("settings written again over a claimed slot: {other:?}"),
        }
    }
    assert_eq!(raw.get(first.keys().settings(), None).await.unwrap().count(), 0);
    // An admin puts them back: joins go on.
    raw.put(first.keys().settings(), fabric_domain::records::encode(&domain), None).await.unwrap();
    assert_eq!(second.ensure_settings(&domain).await.unwrap(), domain);
}

#[tokio::test]
async fn hostile_records_under_the_prefix_are_refused_with_typed_errors() {
    let Some(etcd) = etcd().await else { return };
    let c = client(&etcd, "tray-0", 6).await;
    let keys = c.keys().clone();
    let mut raw = c.raw();
    let settings = sixteen_slots();

    // Truncated settings.
    let good = br#"{"version":1,"address_bits":44,"node_span":1099511627776,"data_paths":["shared_file"]}"#;
    raw.put(keys.settings(), &good[..good.len() - 3], None).await.unwrap();
    match c.ensure_settings(&settings).await {
        Err(EtcdError::Record { key, source: RecordError::Truncated { .. } }) => assert_eq!(key, keys.settings()),
        other => panic!("truncated settings: {other:?}"),
    }

    // A claim of another format version under this node's reverse key.
    raw.put(keys.slot_of("tray-0"), r#"{"version":9,"slot":1,"node":"tray-0"}"#, None).await.unwrap();
    assert!(matches!(
        c.claim_slot(&settings).await,
        Err(EtcdError::Record { source: RecordError::WrongVersion { found: 9 }, .. })
    ));

    // A slot claimed twice by hand: slot-of/tray-0 names slot 3, which tray-9 holds.
    raw.put(keys.slot_of("tray-0"), r#"{"version":1,"slot":3,"node":"tray-0"}"#, None).await.unwrap();
    raw.put(keys.slot(3), r#"{"version":1,"slot":3,"node":"tray-9"}"#, None).await.unwrap();
    match c.claim_slot(&settings).await {
        Err(EtcdError::Inconsistent { node, slot: 3, holder }) => {
            assert_eq!((node.as_str(), holder.as_str()), ("tray-0", "tray-9"))
        }
        other => panic!("a slot claimed twice: {other:?}"),
    }

    // A huge member record (under etcd's 1.5 MiB limit, over the record bound), a member
    // under another node's key, a newer node's (a field and a fabric-group kind this build
    // does not know) and a valid one: the valid and the newer one are listed, the newer
    // one with what this build knows of it.
    raw.put(keys.member("huge"), vec![b' '; 1024 * 1024], None).await.unwrap();
    let mut impostor = member("tray-5");
    impostor.name = "tray-6".into();
    raw.put(keys.member("tray-5"), serde_json_bytes(&impostor), None).await.unwrap();
    let tray7 = member("tray-7");
    let newer = String::from_utf8(serde_json_bytes(&tray7)).unwrap();
    let newer = newer.replacen("\"groups\":[", "\"groups\":[{\"ualink_pod\":{\"pod\":1}},", 1);
    let newer = newer.replacen("\"software\"", "\"rack\":\"r1\",\"software\"", 1);
    raw.put(keys.member("tray-7"), newer, None).await.unwrap();
    let lease = c.grant_lease().await.unwrap();
    let record = member("tray-0");
    c.join(&lease, &record).await.unwrap();
    let listed = c.members().await.unwrap();
    assert_eq!(listed.members, vec![record, tray7]);
    let refused: Vec<(&str, &RecordError)> = listed.refused.iter().map(|(k, e)| (k.as_str(), e)).collect();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(matches!(refused[0], (k, RecordError::Oversized { len: 1_048_576, .. }) if k.ends_with("members/huge")));
    assert!(matches!(refused[1], (k, RecordError::Invalid { field: "name", .. }) if k.ends_with("members/tray-5")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_known_lost_before_its_ttl_when_etcd_goes_away() {
    let Some(etcd) = etcd().await else { return };
    let c = client(&etcd, "tray-0", 3).await;
    let lease = c.grant_lease().await.unwrap();
    let mut state = lease.watch();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(lease.state(), LeaseState::Alive);
    let stopped = Instant::now();
    drop(etcd);
    tokio::time::timeout(Duration::from_secs(3), state.wait_for(|s| matches!(s, LeaseState::Lost(_))))
        .await
        .expect("the lease was not reported lost within its TTL")
        .unwrap();
    assert!(stopped.elapsed() < Duration::from_secs(3), "{:?}", stopped.elapsed());
    assert!(matches!(lease.check(), Err(EtcdError::LeaseLost { .. })));
    assert!(matches!(c.join(&lease, &member("tray-0")).await, Err(EtcdError::LeaseLost { .. })));
}

fn serde_json_bytes(record: &MemberRecord) -> Vec<u8> {
    fabric_domain::records::encode(record)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_domain_larger_than_a_grpc_message_is_read_in_pages_at_one_revision_and_watched() {
    let Some(etcd) = etcd().await else { return };
    let c = client(&etcd, "reader", 6).await;
    // 5,000 records of 1 KiB: 5 MiB, beyond gRPC's default 4 MiB message; one key outside
    // the prefix that must not be read.
    let mut raw = c.raw();
    let value = vec![b'x'; 1024];
    for chunk in (0..5_000).collect::<Vec<u32>>().chunks(100) {
        let ops: Vec<_> = chunk
            .iter()
            .map(|i| fabric_domain::etcd_client::TxnOp::put(format!("/fabric/test/bulk/{i:05}"), value.clone(), None))
            .collect();
        raw.txn(fabric_domain::etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    raw.put("/fabric/test0", "outside", None).await.unwrap();
    // One answer for all of it is beyond the client's default message limit: hence pages.
    let whole = raw.get("/fabric/test/", Some(fabric_domain::etcd_client::GetOptions::new().with_prefix())).await;
    let err = whole.unwrap_err().to_string();
    assert!(err.contains("message length too large"), "{err}");
    let (all, revision) = c.read_domain().await.unwrap();
    assert_eq!(all.len(), 5_000);
    let keys: BTreeSet<&[u8]> = all.iter().map(|kv| kv.key()).collect();
    assert_eq!(keys.len(), 5_000, "no key read twice");
    assert!(all.iter().all(|kv| kv.key().starts_with(b"/fabric/test/") && kv.value() == value.as_slice()));
    // Every page at the first page's revision: a write after it is not seen...
    raw.put("/fabric/test/bulk/late", "late", None).await.unwrap();
    assert!(all.iter().all(|kv| kv.mod_revision() <= revision));
    // ...and a watch from the next revision catches up with 5 MiB of changes in one go.
    let mut stream = c.watch_domain(1).await.unwrap();
    let mut events = 0;
    while events < 5_001 {
        let r = tokio::time::timeout(Duration::from_secs(20), stream.message()).await.unwrap().unwrap().unwrap();
        events += r.events().len();
    }
    assert_eq!(events, 5_001);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_records_past_the_message_limit_cost_pages_never_the_read() {
    let Some(etcd) = etcd().await else { return };
    let c = client(&etcd, "reader", 6).await;
    let keys = c.keys().clone();
    let mut raw = c.raw();
    // 40 junk values of 1 MiB (each under etcd's 1.5 MiB request limit) amid valid members:
    // one page of 256 keys would be 40 MiB, past the reader's 17 MiB limit.
    let lease = c.grant_lease().await.unwrap();
    c.join(&lease, &member("reader")).await.unwrap();
    for i in 0..40 {
        raw.put(keys.member(&format!("junk-{i:02}")), vec![b'j'; 1 << 20], None).await.unwrap();
    }
    raw.put(keys.member("zz-after"), serde_json_bytes(&member("zz-after")), None).await.unwrap();
    assert!(c.message_limit() < 40 << 20, "{}", c.message_limit());
    let (all, revision) = c.read_domain().await.unwrap();
    let names: BTreeSet<String> = all.iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
    assert_eq!(names.len(), 42, "every key once: {names:?}");
    assert!(names.contains(&keys.member("reader")) && names.contains(&keys.member("zz-after")));
    assert!(revision > 0);
    // The members listed are the valid ones; the junk is refused, each with its reason.
    let listed = c.members().await.unwrap();
    let valid: Vec<&str> = listed.members.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(valid, ["reader", "zz-after"]);
    assert_eq!(listed.refused.len(), 40);
    assert!(listed.refused.iter().all(|(_, e)| matches!(e, RecordError::Oversized { .. })));

    // A reader with a small record bound has a limit (1.3 MiB) below one value of 1.4 MiB:
    // that key alone is past it and left out; the rest is read.
    let small = DomainClient::connect(&config(&etcd, "small", 6), RecordLimits::new(64)).await.unwrap();
    raw.put(keys.member("junk-15"), vec![b'k'; 1400 << 10], None).await.unwrap();
    assert!(small.message_limit() < 1400 << 10, "{}", small.message_limit());
    let (all, _) = small.read_domain().await.unwrap();
    let names: BTreeSet<String> = all.iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect();
    assert_eq!(names.len(), 41, "all but the one past the limit: {names:?}");
    assert!(!names.contains(&keys.member("junk-15")));
    assert!(names.contains(&keys.member("junk-14")) && names.contains(&keys.member("junk-16")));
}
