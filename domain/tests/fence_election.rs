//! Fenced writes and leader election against a real, private etcd: a node whose lease
//! expired cannot write until it rejoins; three campaigners elect exactly one leader that
//! every observer agrees on, and the leader's end (revoked, or expired) hands over.
//!
//! Each test starts its own etcd on 127.0.0.1; without an `etcd` binary each test says it
//! is skipped (scripts/deps.sh installs Debian's etcd-server).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::time::{Duration, Instant};

use fabric_domain::testing::{self, EtcdServer};
use fabric_domain::{DomainClient, Election, EtcdError, Leadership, LeaseState, RecordLimits};

async fn client(etcd: &EtcdServer, node: &str, ttl: u64) -> DomainClient {
    DomainClient::connect(&testing::config(etcd.endpoint(), node, ttl), RecordLimits::default()).await.unwrap()
}

async fn value(c: &DomainClient, key: &str) -> Option<Vec<u8>> {
    c.raw().get(key, None).await.unwrap().kvs().first().map(|e| e.value().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_lease_expired_cannot_write_until_it_rejoins() {
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let c = client(&etcd, "tray-0", 2).await;
    let key = c.keys().placements("tray-0");
    let first = testing::member("tray-0");
    let lease = c.grant_lease().await.unwrap();
    let fence = c.join_fenced(&lease, &first).await.unwrap();
    assert_eq!((fence.node(), fence.incarnation(), fence.lease()), ("tray-0", first.incarnation, lease.id()));
    c.put_fenced(&fence, key.clone(), "one").await.unwrap();
    assert_eq!(value(&c, &key).await.as_deref(), Some(&b"one"[..]));

    // Hung past its TTL: nothing renews the lease. The zombie learns it is one from the
    // boot clock (the lease's deadline passed), before it asks etcd.
    drop(lease);
    let stopped = Instant::now();
    while value(&c, &c.keys().member("tray-0")).await.is_some() {
        assert!(stopped.elapsed() < Duration::from_secs(5), "the member key outlived its TTL");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match c.put_fenced(&fence, key.clone(), "zombie").await {
        Err(EtcdError::Fenced { node, incarnation, reason }) => {
            assert_eq!((node.as_str(), incarnation), ("tray-0", first.incarnation));
            assert!(reason.contains("boot clock"), "{reason}");
        }
        other => panic!("a zombie's write: {other:?}"),
    }
    assert!(matches!(c.delete_fenced(&fence, key.clone()).await, Err(EtcdError::Fenced { .. })));
    assert_eq!(value(&c, &key).await.as_deref(), Some(&b"one"[..]), "nothing was written");

    // Rejoined with a new lease and incarnation: writes go through again, under a larger
    // fencing token, and the old fence stays refused.
    let second = testing::member("tray-0");
    assert_ne!(second.incarnation, first.incarnation);
    let lease = c.grant_lease().await.unwrap();
    let renewed = c.join_fenced(&lease, &second).await.unwrap();
    assert!(renewed.token() > fence.token(), "{} after {}", renewed.token(), fence.token());
    c.put_fenced(&renewed, key.clone(), "two").await.unwrap();
    assert_eq!(value(&c, &key).await.as_deref(), Some(&b"two"[..]));
    assert!(matches!(c.put_fenced(&fence, key.clone(), "zombie").await, Err(EtcdError::Fenced { .. })));

    // Where only etcd knows (the lease alive here): the member key removed under the node
    // refuses its writes ("gone") ...
    c.raw().delete(c.keys().member("tray-0"), None).await.unwrap();
    assert!(lease.check().is_ok() && renewed.check().is_ok(), "the node believes it is a member");
    match c.put_fenced(&renewed, key.clone(), "removed").await {
        Err(EtcdError::Fenced { reason, .. }) => assert!(reason.contains("gone"), "{reason}"),
        other => panic!("a removed member's write: {other:?}"),
    }
    // ... and so does a membership replaced by another incarnation on the same lease,
    // naming the one that holds the key now.
    let third = testing::member("tray-0");
    let current = c.join_fenced(&lease, &third).await.unwrap();
    assert!(current.token() > renewed.token());
    match c.put_fenced(&renewed, key.clone(), "replaced").await {
        Err(EtcdError::Fenced { reason, .. }) => {
            assert!(reason.contains(&third.incarnation.to_string()), "{reason}")
        }
        other => panic!("the old membership's write: {other:?}"),
    }
    assert_eq!(value(&c, &key).await.as_deref(), Some(&b"two"[..]), "nothing was written");
    c.delete_fenced(&current, key.clone()).await.unwrap();
    assert_eq!(value(&c, &key).await, None);
    // A fence is taken only of the node's own, current membership.
    assert!(matches!(c.fence(&lease, &first).await, Err(EtcdError::Fenced { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_refuses_without_asking_etcd_once_the_lease_is_known_lost() {
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let c = client(&etcd, "tray-0", 3).await;
    let lease = c.grant_lease().await.unwrap();
    let fence = c.join_fenced(&lease, &testing::member("tray-0")).await.unwrap();
    let mut state = lease.watch();
    drop(etcd);
    tokio::time::timeout(Duration::from_secs(3), state.wait_for(|s| matches!(s, LeaseState::Lost(_))))
        .await
        .unwrap()
        .unwrap();
    let asked = Instant::now();
    match c.put_fenced(&fence, c.keys().placements("tray-0"), "x").await {
        Err(EtcdError::Fenced { reason, .. }) => assert!(reason.contains("is lost"), "{reason}"),
        other => panic!("a write after the lease was lost: {other:?}"),
    }
    // Answered locally: no request timeout (a third of the TTL) was waited for.
    assert!(asked.elapsed() < Duration::from_millis(200), "{:?}", asked.elapsed());
}

/// Waits until every election reports the same leader, other than `gone`; returns it.
async fn agreed(elections: &[&Election], gone: Option<&str>, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        let views: Vec<Leadership> = elections.iter().map(|e| e.current()).collect();
        let leaders: Vec<Option<&str>> = views.iter().map(Leadership::leader).collect();
        if let Some(Some(first)) = leaders.first()
            && Some(*first) != gone
            && leaders.iter().all(|l| l == &Some(*first))
        {
            let count = views.iter().filter(|v| v.is_leader()).count();
            assert_eq!(count, 1, "exactly one leader: {views:?}");
            return (*first).to_owned();
        }
        assert!(Instant::now() < deadline, "no agreement within {within:?}: {views:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_campaigners_elect_one_leader_and_its_end_hands_over() {
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let ttl = 2;
    let mut nodes = Vec::new();
    for name in ["tray-0", "tray-1", "tray-2"] {
        let c = client(&etcd, name, ttl).await;
        let lease = c.grant_lease().await.unwrap();
        c.join(&lease, &testing::member(name)).await.unwrap();
        let election = Election::start(&c, &lease);
        nodes.push((name, c, Some(lease), election));
    }
    let all: Vec<&Election> = nodes.iter().map(|n| &n.3).collect();
    let first = agreed(&all, None, Duration::from_secs(5)).await;
    let leader = nodes.iter().position(|n| n.0 == first).unwrap();
    let term = match nodes[leader].3.current() {
        Leadership::Leader { node, term } => {
            assert_eq!(node, first);
            term
        }
        other => panic!("{other:?}"),
    };
    for (i, node) in nodes.iter().enumerate().filter(|(i, _)| *i != leader) {
        assert_eq!(node.3.current(), Leadership::Follower { leader: first.clone(), term }, "node {i}");
    }

    // The leader leaves (lease revoked): another takes over at once, under a larger term.
    let (_, c, lease, election) = &mut nodes[leader];
    let revoked = Instant::now();
    c.leave(lease.take().unwrap()).await.unwrap();
    let mut gone = election.watch();
    tokio::time::timeout(Duration::from_secs(1), gone.wait_for(|l| *l == Leadership::Unknown)).await.unwrap().unwrap();
    let rest: Vec<&Election> = nodes.iter().enumerate().filter(|(i, _)| *i != leader).map(|(_, n)| &n.3).collect();
    let second = agreed(&rest, Some(&first), Duration::from_secs(ttl + 1)).await;
    assert_ne!(second, first);
    assert!(revoked.elapsed() < Duration::from_secs(ttl), "hand-over after a revoke: {:?}", revoked.elapsed());
    let next = nodes.iter().position(|n| n.0 == second).unwrap();
    assert!(matches!(nodes[next].3.current(), Leadership::Leader { term: t, .. } if t > term));

    // The new leader stops renewing (hung, or killed): the last node leads about one TTL later.
    let stopped = Instant::now();
    drop(nodes[next].2.take());
    let last = nodes.iter().position(|n| n.2.is_some()).unwrap();
    let mut view = nodes[last].3.watch();
    tokio::time::timeout(Duration::from_secs(ttl + 3), view.wait_for(Leadership::is_leader)).await.unwrap().unwrap();
    let took = stopped.elapsed();
    let views: Vec<Leadership> = nodes.iter().map(|n| n.3.current()).collect();
    assert!(took >= Duration::from_millis(500) && took < Duration::from_secs(ttl + 2), "{took:?}: {views:?}");
    assert_eq!(nodes[next].3.current(), Leadership::Unknown, "a node that stopped renewing stops leading at once");
}
