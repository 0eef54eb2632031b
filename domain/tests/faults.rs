//! Faults at the crate level, with a real etcd and nodes in network namespaces: a node
//! cut off from etcd by iptables fences itself before its TTL and rejoins after the heal;
//! etcd stopped and restarted on its data; a leader cut off steps down before another is
//! elected; sixteen nodes joining at once.
//!
//! The namespace tests need root, `ip` and `iptables` (scripts/deps.sh); without them, or
//! without `etcd`, a test prints `skipped: …` and passes. Each test creates its own
//! namespaces (unique names) and removes them, and its etcd, when it ends.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fabric_domain::testing;
use fabric_domain::testing::netns::{self, Net, NetError};
use fabric_domain::{
    DataPathKind, DomainClient, DomainSettings, Election, EtcdError, Leadership, LeaseState, RecordLimits,
};
use tokio::sync::{Barrier, mpsc, oneshot};

async fn connect(endpoint: &str, node: &str, ttl: u64) -> DomainClient {
    DomainClient::connect(&testing::config(endpoint, node, ttl), RecordLimits::default()).await.unwrap()
}

/// Waits for a namespace thread without blocking the test's runtime.
async fn join<T: Send + 'static>(thread: std::thread::JoinHandle<T>) -> T {
    tokio::task::spawn_blocking(move || thread.join().unwrap()).await.unwrap()
}

/// What the cut-off node reports.
#[derive(Debug)]
struct CutNode {
    lost_at: Instant,
    refused_while_cut: String,
    first: u64,
    second: u64,
    rejoined_at: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_etcd_fences_itself_before_its_ttl_and_rejoins_after_the_heal() {
    let Some((net, etcd)) = testing::net_and_etcd_or_skip(2).await else { return };
    const TTL: u64 = 3;
    let endpoint = etcd.endpoint().to_owned();
    let (ready_tx, ready_rx) = oneshot::channel::<u64>();
    let (healed_tx, healed_rx) = oneshot::channel::<()>();
    let (b_ready_tx, b_ready_rx) = oneshot::channel::<()>();

    // Node A, in namespace n0: joins, then waits for its lease to be lost, then for the heal.
    let a_endpoint = endpoint.clone();
    let a = netns::in_netns(&net.nodes()[0], move || async move {
        let c = connect(&a_endpoint, "node-a", TTL).await;
        let record = testing::member("node-a");
        let lease = c.grant_lease().await.unwrap();
        let fence = c.join_fenced(&lease, &record).await.unwrap();
        c.put_fenced(&fence, c.keys().placements("node-a"), "before").await.unwrap();
        let mut state = lease.watch();
        ready_tx.send(record.incarnation).unwrap();
        state.wait_for(|s| matches!(s, LeaseState::Lost(_))).await.unwrap();
        let lost_at = Instant::now();
        let refused_while_cut = match c.put_fenced(&fence, c.keys().placements("node-a"), "cut").await {
            Err(e @ EtcdError::Fenced { .. }) => e.to_string(),
            other => panic!("a write after the lease was lost: {other:?}"),
        };
        healed_rx.await.unwrap();
        // Rejoin: a new lease and incarnation, on the same client (it reconnects).
        let second = testing::member("node-a");
        let deadline = Instant::now() + Duration::from_secs(15);
        let (lease, fence) = loop {
            let attempt = async {
                let lease = c.grant_lease().await?;
                let fence = c.join_fenced(&lease, &second).await?;
                Ok::<_, EtcdError>((lease, fence))
            };
            match attempt.await {
                Ok(joined) => break joined,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("rejoin: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("no rejoin within 15 s of the heal: {e}"),
            }
        };
        let rejoined_at = Instant::now();
        c.put_fenced(&fence, c.keys().placements("node-a"), "after").await.unwrap();
        drop(lease);
        CutNode { lost_at, refused_while_cut, first: record.incarnation, second: second.incarnation, rejoined_at }
    })
    .unwrap();
    let first = ready_rx.await.unwrap();

    // Node B, in namespace n1: watches the members and reports when A's key goes, and when
    // it comes back with another incarnation.
    let b = netns::in_netns(&net.nodes()[1], move || async move {
        let c = connect(&endpoint, "node-b", TTL).await;
        let lease = c.grant_lease().await.unwrap();
        c.join(&lease, &testing::member("node-b")).await.unwrap();
        let incarnation_of_a = |list: fabric_domain::MemberList| {
            list.members.into_iter().find(|m| m.name == "node-a").map(|m| m.incarnation)
        };
        assert_eq!(incarnation_of_a(c.members().await.unwrap()), Some(first));
        b_ready_tx.send(()).unwrap();
        let (mut gone_at, mut back) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(30);
        while back.is_none() && Instant::now() < deadline {
            match incarnation_of_a(c.members().await.unwrap()) {
                None if gone_at.is_none() => gone_at = Some(Instant::now()),
                Some(incarnation) if incarnation != first => back = Some((Instant::now(), incarnation)),
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(lease.state(), LeaseState::Alive, "B was never cut");
        (gone_at.unwrap(), back.unwrap())
    })
    .unwrap();
    b_ready_rx.await.unwrap();

    let cut_at = Instant::now();
    net.nodes()[0].cut(net.etcd().addr()).unwrap();
    // Healed once B has seen A go (B polls; A waits for the word).
    tokio::time::sleep(Duration::from_secs(TTL + 2)).await;
    net.nodes()[0].heal(net.etcd().addr()).unwrap();
    let healed_at = Instant::now();
    healed_tx.send(()).unwrap();
    let node_a = join(a).await;
    let (gone_at, (back_at, back)) = join(b).await;

    let lost = node_a.lost_at - cut_at;
    let gone = gone_at - cut_at;
    eprintln!(
        "cut: A lost its lease after {lost:?}, B saw A gone after {gone:?}; heal: A rejoined after {:?}, B saw it after {:?}",
        node_a.rejoined_at - healed_at,
        back_at - healed_at
    );
    assert!(lost < Duration::from_secs(TTL), "A knew its lease lost only after {lost:?}");
    assert!(node_a.lost_at < gone_at, "A fenced itself ({lost:?}) before the others saw it gone ({gone:?})");
    assert!(gone < Duration::from_secs(TTL + 1), "B saw A gone after {gone:?}");
    assert!(node_a.refused_while_cut.contains("is fenced"), "{}", node_a.refused_while_cut);
    assert_eq!(node_a.first, first);
    assert_eq!(back, node_a.second);
    assert_ne!(node_a.second, node_a.first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restarted_on_its_data_keeps_leases_members_and_fences() {
    // On loopback: a restart needs no namespace.
    let Some(mut etcd) = testing::etcd_or_skip().await else { return };
    // Renewals every 5 s; a lease is given up 10 s after its last acknowledged renewal.
    const TTL: u64 = 15;
    let c = connect(etcd.endpoint(), "tray-0", TTL).await;
    let record = testing::member("tray-0");
    let lease = c.grant_lease().await.unwrap();
    let fence = c.join_fenced(&lease, &record).await.unwrap();
    let key = c.keys().placements("tray-0");

    // Stop etcd just after a renewal the node saw acknowledged, so that the next one (a
    // third of the TTL later) surely falls in the outage. (etcd's own TTL readout is not
    // enough: it rises before the answer reaches the node.)
    let mut renewals = lease.watch_renewals();
    renewals.borrow_and_update();
    tokio::time::timeout(Duration::from_secs(TTL), renewals.changed()).await.unwrap().unwrap();
    etcd.stop();
    let stopped = Instant::now();

    // Meanwhile: requests fail with typed errors that name etcd; the node keeps its lease.
    for error in [c.members().await.unwrap_err(), c.put_fenced(&fence, key.clone(), "x").await.unwrap_err()] {
        assert!(matches!(error, EtcdError::Request { .. } | EtcdError::Timeout { .. }), "{error:?}");
        assert!(error.to_string().starts_with("etcd "), "{error}");
        eprintln!("{:?} after the stop: {error}", stopped.elapsed());
    }
    tokio::time::sleep(Duration::from_millis(TTL * 1000 / 3 + 500).saturating_sub(stopped.elapsed())).await;
    assert_eq!(lease.state(), LeaseState::Alive, "a renewal failed, but the deadline is not reached");
    etcd.restart().await.unwrap();
    let outage = stopped.elapsed();

    // After: the lease was refreshed to its full TTL, the member is still there with the
    // same incarnation, and the node goes on with the same fence.
    let left = c.raw().lease_time_to_live(lease.id(), None).await;
    let left = match left {
        Ok(answer) => answer.ttl(),
        // The first request after a restart may find the old connection broken.
        Err(_) => c.raw().lease_time_to_live(lease.id(), None).await.unwrap().ttl(),
    };
    assert!(left >= i64::try_from(TTL).unwrap() - 2, "{left} s left after the restart");
    let members = c.members().await.unwrap();
    assert_eq!(members.members.iter().map(|m| m.incarnation).collect::<Vec<_>>(), vec![record.incarnation]);
    c.put_fenced(&fence, key.clone(), "after").await.unwrap();
    // Past the deadline of the renewal that failed: alive only if a renewal succeeded since.
    tokio::time::sleep(Duration::from_secs(TTL * 2 / 3 + 1).saturating_sub(stopped.elapsed())).await;
    assert_eq!(lease.state(), LeaseState::Alive, "renewals resumed after an outage of {outage:?}");
    eprintln!("etcd outage of {outage:?}: the lease stayed alive, {left} s left right after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_nodes_in_sixteen_namespaces_join_at_once_without_a_retry_storm() {
    let Some((net, etcd)) = testing::net_and_etcd_or_skip(16).await else { return };
    // 2^44 bytes in 1 TiB slots: exactly 16 slots.
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    let start = std::sync::Arc::new(Barrier::new(16));
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let mut threads = Vec::new();
    for (i, ns) in net.nodes().iter().enumerate() {
        let (endpoint, settings, start, done) =
            (etcd.endpoint().to_owned(), settings.clone(), start.clone(), done_tx.clone());
        threads.push(
            netns::in_netns(ns, move || async move {
                let node = format!("tray-{i}");
                let c = connect(&endpoint, &node, 6).await;
                // All connected first, then released at once, so that the claims race.
                start.wait().await;
                let began = Instant::now();
                c.ensure_settings(&settings).await.unwrap();
                let (slot, attempts) = c.claim_slot_counted(&settings).await.unwrap();
                let lease = c.grant_lease().await.unwrap();
                c.join(&lease, &testing::member(&node)).await.unwrap();
                let took = began.elapsed();
                done.send(()).unwrap();
                // Stay a member until every node joined, so the listing below sees all.
                tokio::time::sleep(Duration::from_secs(2)).await;
                let members = c.members().await.unwrap().members.len();
                (slot, attempts, took, members)
            })
            .unwrap(),
        );
    }
    drop(done_tx);
    let mut joined = 0;
    while done_rx.recv().await.is_some() {
        joined += 1;
    }
    assert_eq!(joined, 16);
    let mut slots = BTreeSet::new();
    let (mut total, mut most, mut slowest) = (0, 0, Duration::ZERO);
    for thread in threads {
        let (slot, attempts, took, members) = join(thread).await;
        assert!(slot < 16, "{slot}");
        slots.insert(slot);
        total += attempts;
        most = most.max(attempts);
        slowest = slowest.max(took);
        assert_eq!(members, 16, "every node lists the sixteen members");
    }
    eprintln!(
        "sixteen nodes: {total} claim transactions in all, at most {most} for one node, slowest join {slowest:?}"
    );
    assert_eq!(slots.len(), 16, "{slots:?}");
    // A lost race means another node won a slot in between, so one node retries at most
    // fifteen times; in all, the hashed starting points keep it near one claim per node.
    assert!(most <= 16, "{most}");
    assert!(total <= 48, "a retry storm: {total} claim transactions for 16 slots");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_cut_off_from_etcd_steps_down_before_another_is_elected() {
    let Some((net, etcd)) = testing::net_and_etcd_or_skip(3).await else { return };
    const TTL: u64 = 3;
    let mut views = Vec::new();
    let mut stops = Vec::new();
    let mut threads = Vec::new();
    for (i, ns) in net.nodes().iter().enumerate() {
        let endpoint = etcd.endpoint().to_owned();
        let (view_tx, view_rx) = oneshot::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        threads.push(
            netns::in_netns(ns, move || async move {
                let node = format!("node-{i}");
                let c = connect(&endpoint, &node, TTL).await;
                let lease = c.grant_lease().await.unwrap();
                c.join(&lease, &testing::member(&node)).await.unwrap();
                let election = Election::start(&c, &lease);
                view_tx.send(election.watch()).unwrap();
                // The election and the lease live on this thread's runtime until the end.
                let _ = stop_rx.await;
                drop((election, lease));
            })
            .unwrap(),
        );
        views.push(view_rx.await.unwrap());
        stops.push(stop_tx);
    }
    let current = |views: &[tokio::sync::watch::Receiver<Leadership>]| -> Vec<Leadership> {
        views.iter().map(|v| v.borrow().clone()).collect()
    };
    let agreed = |views: &[Leadership], gone: Option<&str>| -> Option<String> {
        let first = views.first()?.leader()?;
        let same = views.iter().all(|v| v.leader() == Some(first));
        let leaders = views.iter().filter(|v| v.is_leader()).count();
        (same && leaders == 1 && Some(first) != gone).then(|| first.to_owned())
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let first = loop {
        if let Some(leader) = agreed(&current(&views), None) {
            break leader;
        }
        assert!(Instant::now() < deadline, "no agreement: {:?}", current(&views));
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let leader: usize = first.strip_prefix("node-").unwrap().parse().unwrap();
    let others: Vec<tokio::sync::watch::Receiver<Leadership>> =
        views.iter().enumerate().filter(|(i, _)| *i != leader).map(|(_, v)| v.clone()).collect();

    let cut_at = Instant::now();
    net.nodes()[leader].cut(net.etcd().addr()).unwrap();
    let (mut down, mut up) = (None, None);
    while (down.is_none() || up.is_none()) && cut_at.elapsed() < Duration::from_secs(TTL + 3) {
        if down.is_none() && *views[leader].borrow() == Leadership::Unknown {
            down = Some(cut_at.elapsed());
        }
        if up.is_none() && agreed(&current(&others), Some(&first)).is_some() {
            up = Some(cut_at.elapsed());
            // At no moment do two nodes believe they lead.
            assert!(down.is_some(), "a new leader while the old one still leads: {:?}", current(&views));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (down, up) = (down.unwrap(), up.unwrap());
    eprintln!("leader cut: it stepped down after {down:?}, another led after {up:?}");
    assert!(down < Duration::from_secs(TTL), "{down:?}");
    assert!(up < Duration::from_secs(TTL + 1), "{up:?}");
    net.nodes()[leader].heal(net.etcd().addr()).unwrap();
    for stop in stops {
        let _ = stop.send(());
    }
    for thread in threads {
        join(thread).await;
    }
}

#[test]
fn a_net_lives_only_in_its_namespaces_and_is_removed_on_drop() {
    let net = match Net::create(2) {
        Ok(net) => net,
        Err(NetError::Unavailable(why)) => {
            fabric_domain::testing::skip(&why);
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let listed = || {
        String::from_utf8(std::process::Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).unwrap()
    };
    let names: Vec<String> = std::iter::once(net.etcd()).chain(net.nodes()).map(|ns| ns.name().to_owned()).collect();
    let before = listed();
    for name in &names {
        assert!(before.contains(name.as_str()), "{name} in {before}");
    }
    // The host's namespace has none of the test's addresses or interfaces.
    let host = std::process::Command::new("ip").args(["-4", "addr"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&host.stdout).contains("10.77.0."), "the host got a test address");
    // A node reaches a listener at etcd's address, and stops reaching it once cut.
    let addr = net.etcd().addr();
    let listener = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
    let bound = listener.clone();
    let server = netns::in_netns(net.etcd(), move || async move {
        let socket = std::net::TcpListener::bind((addr, 7777)).unwrap();
        *bound.lock().unwrap() = Some(socket.local_addr().unwrap());
        // Connections wait in the backlog; the thread only has to outlive the probes.
        let _ = stop_rx.recv();
        drop(socket);
    })
    .unwrap();
    while listener.lock().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let node = net.nodes()[0].clone();
    let reaches = |node: &netns::Netns| {
        let thread = netns::in_netns(node, move || async move {
            let connect = tokio::net::TcpStream::connect((addr, 7777));
            matches!(tokio::time::timeout(Duration::from_secs(1), connect).await, Ok(Ok(_)))
        })
        .unwrap();
        thread.join().unwrap()
    };
    assert!(reaches(&node), "a node cannot reach etcd's address");
    node.cut(addr).unwrap();
    assert!(!reaches(&node), "the cut let a connection through");
    node.heal(addr).unwrap();
    assert!(reaches(&node), "the heal did not restore the path");
    stop_tx.send(()).unwrap();
    server.join().unwrap();
    drop(net);
    let after = listed();
    for name in &names {
        assert!(!after.contains(name.as_str()), "{name} left behind: {after}");
    }
}
