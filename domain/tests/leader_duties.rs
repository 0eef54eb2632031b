//! The leader's gc against a real, private etcd: the leader frees a gone node's slot and
//! collects its records (placements, topology, shares, queued request) in one transaction fenced
//! by its leader key; a live node's gc is refused and its request dropped; a deposed
//! leader (its lease left to expire, as a node hung past its TTL) is refused by etcd
//! (`NotLeader`) and leaves everything as it was, and the new leader's gc goes through.
//! The leader's sweep collects the records of nodes that hold no slot, and only those. A
//! node in more partitions, or with shares of more resources, than one transaction takes
//! is collected in batches.
//!
//! Without an `etcd` binary the test says it is skipped (scripts/deps.sh installs it).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use std::time::{Duration, Instant};

use fabric_domain::testing::{self, EtcdServer};
use fabric_domain::{
    DataPathKind, DomainClient, DomainSettings, Election, EtcdError, LeaderFence, Leadership, RecordLimits,
};

async fn client(etcd: &EtcdServer, node: &str) -> DomainClient {
    DomainClient::connect(&testing::config(etcd.endpoint(), node, 2), RecordLimits::default()).await.unwrap()
}

/// A GPU as a node's topology record names it.
fn gpu_device(id: &str) -> fabric_domain::topology::TopologyDevice {
    fabric_domain::topology::TopologyDevice {
        id: fabric_topology::DeviceId::uuid(id),
        kind: fabric_topology::DeviceKind::Gpu,
        name: None,
        fabric: false,
        memory: Vec::new(),
        numa_node: None,
        local_cpus: None,
        pci: None,
    }
}

async fn exists(c: &DomainClient, key: &str) -> bool {
    !c.raw().get(key, None).await.unwrap().kvs().is_empty()
}

/// Waits until `e` says its node leads; the term.
async fn leads(e: &Election, within: Duration) -> i64 {
    let t0 = Instant::now();
    loop {
        if let Leadership::Leader { term, .. } = e.current() {
            return term;
        }
        assert!(t0.elapsed() < within, "not leading within {within:?}: {:?}", e.current());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_collects_a_gone_node_and_a_deposed_one_cannot() {
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    // Two gone nodes: slots claimed, records left behind, no member key.
    let mut gone = Vec::new();
    for name in ["tray-g", "tray-h"] {
        let c = client(&etcd, name).await;
        c.ensure_settings(&settings).await.unwrap();
        let slot = c.claim_slot(&settings).await.unwrap();
        let mut kv = c.raw();
        kv.put(c.keys().placements(name), "left behind", None).await.unwrap();
        kv.put(c.keys().topology(name), "left behind", None).await.unwrap();
        // A share of a device both gone nodes' hosts reach.
        c.claim_share("serial:cxl/0x77/cxl_volatile0", 1 << 30, 256 << 20, 2 << 20).await.unwrap();
        gone.push((c, slot));
    }
    // Two live members campaigning: a first, so it leads.
    let a = client(&etcd, "tray-a").await;
    let a_lease = a.grant_lease().await.unwrap();
    let a_fence = a.join_fenced(&a_lease, &testing::member("tray-a")).await.unwrap();
    let a_election = Election::start(&a, &a_lease);
    let term = leads(&a_election, Duration::from_secs(5)).await;
    let b = client(&etcd, "tray-b").await;
    let b_lease = b.grant_lease().await.unwrap();
    let b_fence = b.join_fenced(&b_lease, &testing::member("tray-b")).await.unwrap();
    let b_election = Election::start(&b, &b_lease);

    // A follower queues the gc; the leader carries it out and collects the records.
    let (g, g_slot) = &gone[0];
    b.request_gc(&b_fence, "tray-g").await.unwrap();
    assert_eq!(a.gc_queue().await.unwrap(), ["tray-g"]);
    let leader = LeaderFence::new(&a, a_lease.id(), term);
    assert_eq!(a.gc_led(&leader, "tray-g").await.unwrap(), Some(*g_slot));
    let k = g.keys();
    for key in
        [k.slot(*g_slot), k.slot_of("tray-g"), k.placements("tray-g"), k.topology("tray-g"), k.gc_request("tray-g")]
    {
        assert!(!exists(&a, &key).await, "{key} outlived the gc");
    }
    assert!(!b.gc_pending("tray-g").await.unwrap());
    // Its share went in the same transaction; tray-h's stays.
    let (value, _) = {
        let answer = a.raw().get(k.share("serial:cxl/0x77/cxl_volatile0"), None).await.unwrap();
        let e = answer.kvs().first().unwrap();
        (e.value().to_vec(), e.mod_revision())
    };
    let table: fabric_domain::ShareTable = fabric_domain::records::decode(&value, RecordLimits::default()).unwrap();
    assert_eq!(table.shares.iter().map(|s| s.node.as_str()).collect::<Vec<_>>(), ["tray-h"], "{table:?}");

    // Records of nodes that hold no slot (left by an older gc, or put by hand) are swept:
    // tray-o's placements and topology, tray-s's share; tray-h (a slot) and the live
    // members keep theirs.
    let mut kv = a.raw();
    kv.put(k.placements("tray-o"), "left behind", None).await.unwrap();
    kv.put(k.topology("tray-o"), "left behind", None).await.unwrap();
    kv.put(k.placements("tray-a"), "a live member's", None).await.unwrap();
    client(&etcd, "tray-s")
        .await
        .claim_share("serial:cxl/0x77/cxl_volatile0", 1 << 30, 2 << 20, 2 << 20)
        .await
        .unwrap();
    assert_eq!(a.sweep_orphans(&leader, 64).await.unwrap(), ["tray-o", "tray-s"]);
    for key in [k.placements("tray-o"), k.topology("tray-o")] {
        assert!(!exists(&a, &key).await, "{key} outlived the sweep");
    }
    assert!(exists(&a, &k.placements("tray-h")).await && exists(&a, &k.placements("tray-a")).await);
    let answer = a.raw().get(k.share("serial:cxl/0x77/cxl_volatile0"), None).await.unwrap();
    let table: fabric_domain::ShareTable =
        fabric_domain::records::decode(answer.kvs()[0].value(), RecordLimits::default()).unwrap();
    assert_eq!(table.shares.iter().map(|s| s.node.as_str()).collect::<Vec<_>>(), ["tray-h"], "{table:?}");
    assert!(a.sweep_orphans(&leader, 64).await.unwrap().is_empty(), "nothing left to sweep");
    kv.put(k.topology("tray-p"), "left behind", None).await.unwrap();

    // A live node's gc is refused, and its request dropped.
    b.request_gc(&b_fence, "tray-a").await.unwrap();
    assert!(matches!(a.gc_led(&leader, "tray-a").await, Err(EtcdError::GcLive { .. })));
    assert!(!a.gc_pending("tray-a").await.unwrap(), "the refused request is dropped");
    assert_eq!(a.held_slot("tray-a").await.unwrap(), None, "a live member's records are left alone");
    assert!(exists(&a, &a.keys().member("tray-a")).await);

    // a hangs past its TTL: nothing renews its lease, its leader key goes with it and b
    // leads. a still holds its old leader fence; etcd refuses it.
    drop(a_election);
    drop(a_lease);
    let new_term = leads(&b_election, Duration::from_secs(6)).await;
    assert!(new_term > term);
    let (h, h_slot) = &gone[1];
    match a.gc_led(&leader, "tray-h").await {
        Err(EtcdError::NotLeader { node, term: t }) => assert_eq!((node.as_str(), t), ("tray-a", term)),
        other => panic!("a deposed leader's gc: {other:?}"),
    }
    assert_eq!(h.held_slot("tray-h").await.unwrap(), Some(*h_slot), "the deposed leader freed nothing");
    assert!(exists(h, &h.keys().placements("tray-h")).await);
    assert!(matches!(a.sweep_orphans(&leader, 64).await, Err(EtcdError::NotLeader { .. })));
    assert!(exists(h, &h.keys().topology("tray-p")).await, "the deposed leader swept nothing");
    // The new leader's gc goes through, and so does its sweep.
    let leader = LeaderFence::new(&b, b_lease.id(), new_term);
    assert_eq!(b.gc_led(&leader, "tray-h").await.unwrap(), Some(*h_slot));
    assert!(!exists(&b, &b.keys().topology("tray-h")).await);
    // tray-a's lease ran out and it never claimed a slot: its placements go too.
    assert_eq!(b.sweep_orphans(&leader, 64).await.unwrap(), ["tray-a", "tray-p"]);
    drop(a_fence);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gc_queue_lists_every_request_past_a_page() {
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let c = client(&etcd, "tray-a").await;
    let mut kv = c.raw();
    // 5,000 requests (stuck ones a leader cannot carry out would otherwise hide the rest
    // behind one page), then one more; and a key just past the prefix, not listed.
    for chunk in (0..5_000).collect::<Vec<u32>>().chunks(100) {
        let ops: Vec<_> = chunk
            .iter()
            .map(|i| fabric_domain::etcd_client::TxnOp::put(c.keys().gc_request(&format!("node-{i:05}")), "{}", None))
            .collect();
        kv.txn(fabric_domain::etcd_client::Txn::new().and_then(ops)).await.unwrap();
    }
    kv.put(c.keys().gc_request("zz-last"), "{}", None).await.unwrap();
    kv.put(format!("{}0", c.keys().gc_requests().trim_end_matches('/')), "outside", None).await.unwrap();
    let queue = c.gc_queue().await.unwrap();
    assert_eq!(queue.len(), 5_001);
    assert_eq!(queue.first().map(String::as_str), Some("node-00000"));
    assert_eq!(queue.last().map(String::as_str), Some("zz-last"));
}

/// A gone node named in more partitions than one etcd transaction takes (180 partitions:
/// more writes than `--max-txn-ops`' 128, and 30 of them together larger than
/// `--max-request-bytes`' 1.5 MiB) is still collected: its devices leave every partition
/// in batches (the partitions it leaves empty deleted only after its slot is freed), then
/// its records go. While it is live again, no batch lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_in_more_partitions_than_one_transaction_takes_is_collected() {
    use fabric_domain::PartitionRecord;
    use fabric_domain::topology::TopologyDevice;
    use fabric_topology::{DeviceId, DeviceKind};

    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    let gone = client(&etcd, "tray-p").await;
    gone.ensure_settings(&settings).await.unwrap();
    let slot = gone.claim_slot(&settings).await.unwrap();
    let k = gone.keys().clone();
    let gpu = DeviceId::uuid("GPU-tray-p-0");
    let device = gpu_device("GPU-tray-p-0");
    // A CXL device of a pool other hosts share: the pool's, not tray-p's to take along.
    let pool = DeviceId::cxl(0x5eed);
    let pooled = TopologyDevice { id: pool.clone(), kind: DeviceKind::CxlMemdev, ..device.clone() };
    let record = fabric_domain::TopologyRecord {
        version: fabric_domain::records::RECORD_VERSION,
        node: "tray-p".into(),
        incarnation: 1,
        devices: vec![device, pooled],
        links: Vec::new(),
    };
    let mut kv = gone.raw();
    kv.put(k.topology("tray-p"), fabric_domain::records::encode(&record), None).await.unwrap();
    let others = |n: usize, from: usize| (from..from + n).map(|i| DeviceId::uuid(&format!("GPU-other-{i:06}")));
    // 40 naming only tray-p's GPU (removed), 110 naming another device too (rewritten),
    // 30 large ones (1,000 other devices each, ~50 KiB), and one that does not name it.
    let mut partitions = Vec::new();
    for i in 0..180 {
        let devices: Vec<DeviceId> = match i {
            0..40 => vec![gpu.clone()],
            40..150 => std::iter::once(gpu.clone()).chain(others(1, i)).collect(),
            _ => std::iter::once(gpu.clone()).chain(others(1_000, i * 1_000)).collect(),
        };
        partitions.push(PartitionRecord::new(&format!("p{i:03}"), devices, &[1000], &[]));
    }
    partitions.push(PartitionRecord::new("untouched", others(2, 0).collect(), &[1000], &[]));
    partitions.push(PartitionRecord::new("pool", vec![pool.clone()], &[1000], &[]));
    for p in &partitions {
        let value = fabric_domain::records::encode(p);
        assert!(value.len() < 64 * 1024, "{} bytes", value.len());
        kv.put(k.partition(&p.name), value, None).await.unwrap();
    }
    let untouched_at = kv.get(k.partition("untouched"), None).await.unwrap().kvs()[0].mod_revision();
    let pool_at = kv.get(k.partition("pool"), None).await.unwrap().kvs()[0].mod_revision();

    let a = client(&etcd, "tray-a").await;
    let a_lease = a.grant_lease().await.unwrap();
    let _a_fence = a.join_fenced(&a_lease, &testing::member("tray-a")).await.unwrap();
    let a_election = Election::start(&a, &a_lease);
    let leader = LeaderFence::new(&a, a_lease.id(), leads(&a_election, Duration::from_secs(5)).await);

    // tray-p live again (its member key, put by hand): refused, and no partition changed.
    kv.put(k.member("tray-p"), "back", None).await.unwrap();
    assert!(matches!(a.gc_led(&leader, "tray-p").await, Err(EtcdError::GcLive { .. })));
    let entries = a.raw().get(k.partitions(), Some(etcd_prefix())).await.unwrap();
    assert_eq!(entries.kvs().len(), partitions.len(), "no partition was removed while the node was live");
    let naming = entries
        .kvs()
        .iter()
        .filter(|e| {
            let p: PartitionRecord = fabric_domain::records::decode(e.value(), RecordLimits::default()).unwrap();
            p.devices.contains(&gpu)
        })
        .count();
    assert_eq!(naming, 180, "nor rewritten");
    kv.delete(k.member("tray-p"), None).await.unwrap();

    assert_eq!(a.gc_led(&leader, "tray-p").await.unwrap(), Some(slot));
    for key in [k.slot(slot), k.slot_of("tray-p"), k.topology("tray-p")] {
        assert!(!exists(&a, &key).await, "{key} outlived the gc");
    }
    let answer = a.raw().get(k.partitions(), Some(etcd_prefix())).await.unwrap();
    assert_eq!(answer.kvs().len(), 142, "the 40 naming only its GPU are removed");
    for e in answer.kvs() {
        let p: PartitionRecord = fabric_domain::records::decode(e.value(), RecordLimits::default()).unwrap();
        assert!(!p.devices.contains(&gpu), "{} still names the GPU", p.name);
        let want = match p.name.as_str() {
            "untouched" => {
                assert_eq!(e.mod_revision(), untouched_at, "a partition without its devices is not rewritten");
                2
            }
            "pool" => {
                // Deleted before, leaving an unbound client free to reach more.
                assert_eq!(
                    (e.mod_revision(), &p.devices[..]),
                    (pool_at, &[pool.clone()][..]),
                    "the pool's device stays"
                );
                1
            }
            name if name < "p150" => 1,
            _ => 1_000,
        };
        assert_eq!(p.devices.len(), want, "{}", p.name);
    }
}

/// A device a gone node's record names that a live node's record names too (a GPU moved
/// to another tray) keeps its partitions through the gone node's gc: before, the gc took it
/// out, and a partition naming only it was deleted, which unbinds (and so widens) the live
/// node's tenants. The gone node's own device still leaves its partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_another_node_now_publishes_keeps_its_partitions_through_a_gc() {
    use fabric_domain::PartitionRecord;
    use fabric_domain::topology::TopologyDevice;
    use fabric_topology::DeviceId;

    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    let gone = client(&etcd, "tray-q").await;
    gone.ensure_settings(&settings).await.unwrap();
    let slot = gone.claim_slot(&settings).await.unwrap();
    let k = gone.keys().clone();
    let gpu = gpu_device;
    let record = |node: &str, devices: Vec<TopologyDevice>| {
        fabric_domain::records::encode(&fabric_domain::TopologyRecord {
            version: fabric_domain::records::RECORD_VERSION,
            node: node.into(),
            incarnation: 1,
            devices,
            links: Vec::new(),
        })
    };
    let mut kv = gone.raw();
    kv.put(k.topology("tray-q"), record("tray-q", vec![gpu("GPU-moved"), gpu("GPU-own")]), None).await.unwrap();
    kv.put(k.topology("tray-b"), record("tray-b", vec![gpu("GPU-moved")]), None).await.unwrap();
    for (name, id) in [("moved", "GPU-moved"), ("own", "GPU-own")] {
        let p = PartitionRecord::new(name, vec![DeviceId::uuid(id)], &[1000], &[]);
        kv.put(k.partition(name), fabric_domain::records::encode(&p), None).await.unwrap();
    }

    let a = client(&etcd, "tray-a").await;
    let a_lease = a.grant_lease().await.unwrap();
    let _a_fence = a.join_fenced(&a_lease, &testing::member("tray-a")).await.unwrap();
    let a_election = Election::start(&a, &a_lease);
    let leader = LeaderFence::new(&a, a_lease.id(), leads(&a_election, Duration::from_secs(5)).await);
    assert_eq!(a.gc_led(&leader, "tray-q").await.unwrap(), Some(slot));
    assert!(exists(&a, &k.partition("moved")).await, "the live node's device lost its partition");
    assert!(!exists(&a, &k.partition("own")).await, "the gone node's own device kept its partition");
}

/// A gone node holding shares of 140 resources (one transaction of the gc would hold 140
/// table rewrites with their compares and the slot's keys: more than `--max-txn-ops`' 128)
/// is collected: its shares given back in batches, then its slot. While it is live, no
/// batch lands; the other host's shares are kept. Shares of nodes with no slot are swept
/// in batches too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_more_shares_than_one_transaction_takes_is_collected() {
    use fabric_domain::{ShareTable, ShareWant};
    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    let resources: Vec<String> = (0..140).map(|i| format!("serial:cxl/0x{i:x}/cxl_volatile0")).collect();
    let wants = |len: u64| -> Vec<ShareWant> {
        resources
            .iter()
            .map(|r| ShareWant { resource: r.clone(), capacity: 1 << 30, len, at: None, grow_to: None })
            .collect()
    };
    let gone = client(&etcd, "tray-q").await;
    gone.ensure_settings(&settings).await.unwrap();
    let slot = gone.claim_slot(&settings).await.unwrap();
    // The first 70 in one claim and the rest in another (each within etcd's limits).
    let all = wants(256 << 20);
    let mut mine = gone.claim_shares(&all[..70], 2 << 20).await.unwrap();
    mine.extend(gone.claim_shares(&all[70..], 2 << 20).await.unwrap());
    let held: std::collections::HashMap<String, u64> =
        resources.iter().cloned().zip(mine.iter().map(|s| s.offset)).collect();
    // Another host's shares of the same resources stay.
    let other = client(&etcd, "tray-r").await;
    let other_all = wants(128 << 20);
    other.claim_shares(&other_all[..70], 2 << 20).await.unwrap();
    other.claim_shares(&other_all[70..], 2 << 20).await.unwrap();
    let k = gone.keys().clone();

    let a = client(&etcd, "tray-a").await;
    let a_lease = a.grant_lease().await.unwrap();
    let _a_fence = a.join_fenced(&a_lease, &testing::member("tray-a")).await.unwrap();
    let a_election = Election::start(&a, &a_lease);
    let leader = LeaderFence::new(&a, a_lease.id(), leads(&a_election, Duration::from_secs(5)).await);
    let holders = |a: DomainClient| {
        let resources = resources.clone();
        async move {
            let mut out = Vec::new();
            for r in &resources {
                let answer = a.raw().get(a.keys().share(r), None).await.unwrap();
                let t: ShareTable =
                    fabric_domain::records::decode(answer.kvs()[0].value(), RecordLimits::default()).unwrap();
                out.push(t.shares.iter().map(|s| s.node.clone()).collect::<Vec<_>>().join(","));
            }
            out
        }
    };

    // Live (its member key, put by hand): refused, and no share given back.
    let mut kv = a.raw();
    kv.put(k.member("tray-q"), "back", None).await.unwrap();
    assert!(matches!(a.gc_led(&leader, "tray-q").await, Err(EtcdError::GcLive { .. })));
    assert!(holders(a.clone()).await.iter().all(|h| h.contains("tray-q")), "a share went while the node was live");
    kv.delete(k.member("tray-q"), None).await.unwrap();

    // The order of its writes, as a watcher sees them.
    let mut events = kv.watch(k.prefix(), Some(etcd_client::WatchOptions::new().with_prefix())).await.unwrap();
    assert_eq!(a.gc_led(&leader, "tray-q").await.unwrap(), Some(slot));
    let (mut slot_freed, mut first_share_back) = (None, None);
    while slot_freed.is_none() || first_share_back.is_none() {
        let batch = tokio::time::timeout(Duration::from_secs(5), events.message()).await.unwrap().unwrap().unwrap();
        for event in batch.events() {
            let Some(kv) = event.kv() else { continue };
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            if key == k.slot_of("tray-q") && event.event_type() == etcd_client::EventType::Delete {
                slot_freed = Some(kv.mod_revision());
            }
            if key.starts_with(&k.shares()) && first_share_back.is_none() {
                first_share_back = Some(kv.mod_revision());
            }
        }
    }
    // A node that came back between batches would hold its slot with its shares given
    // away: the slot goes first (or with them).
    assert!(
        slot_freed <= first_share_back,
        "shares given back at {first_share_back:?}, the slot freed at {slot_freed:?}"
    );
    for key in [k.slot(slot), k.slot_of("tray-q")] {
        assert!(!exists(&a, &key).await, "{key} outlived the gc");
    }
    assert!(holders(a.clone()).await.iter().all(|h| h == "tray-r"), "tray-q's shares all given back, tray-r's kept");

    // tray-q comes back and claims its 140 shares back where they were: in batches (one
    // transaction would pass etcd's limits), each at its old offset.
    let back: Vec<ShareWant> = resources
        .iter()
        .map(|r| ShareWant { resource: r.clone(), capacity: 1 << 30, len: 256 << 20, at: Some(held[r]), grow_to: None })
        .collect();
    // A resource asked for twice is refused, even when the two asks fall in different
    // batches (and nothing is claimed).
    let mut twice = back.clone();
    twice.push(back[0].clone());
    assert!(matches!(gone.claim_shares(&twice, 2 << 20).await, Err(EtcdError::Record { .. })));
    assert!(holders(a.clone()).await.iter().all(|h| h == "tray-r"));
    let claimed = gone.claim_shares(&back, 2 << 20).await.unwrap();
    assert!(claimed.iter().zip(&back).all(|(s, w)| Some(s.offset) == w.at && s.len == w.len), "{claimed:?}");
    assert!(holders(a.clone()).await.iter().all(|h| h.contains("tray-q") && h.contains("tray-r")));

    // Neither holds a slot or a member key: the leader's sweep gives their shares back, 140
    // tables each, in batches (one transaction per node was refused by etcd).
    assert_eq!(a.sweep_orphans(&leader, 64).await.unwrap(), ["tray-q", "tray-r"]);
    assert!(holders(a.clone()).await.iter().all(String::is_empty), "every share given back");
    assert!(a.sweep_orphans(&leader, 64).await.unwrap().is_empty(), "nothing left to sweep");
}

fn etcd_prefix() -> fabric_domain::etcd_client::GetOptions {
    fabric_domain::etcd_client::GetOptions::new().with_prefix()
}

/// A gone node whose topology record this build cannot read (a newer build's format) is
/// not collected: its devices are not known, and deleting the record (as the gc does last)
/// would leave them in every partition for good. A sweep leaves a node whose gc is queued
/// to that gc (before, a gc interrupted after freeing the slot had its topology swept
/// away). Once the record reads, the gc collects it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_node_whose_devices_cannot_be_read_keeps_its_records_until_they_can() {
    use fabric_domain::PartitionRecord;
    use fabric_topology::DeviceId;

    let Some(etcd) = testing::etcd_or_skip().await else { return };
    let settings = DomainSettings::new(44, 1 << 40, vec![DataPathKind::SharedFile]);
    let gone = client(&etcd, "tray-v").await;
    gone.ensure_settings(&settings).await.unwrap();
    let slot = gone.claim_slot(&settings).await.unwrap();
    let k = gone.keys().clone();
    let record = fabric_domain::TopologyRecord {
        version: fabric_domain::records::RECORD_VERSION,
        node: "tray-v".into(),
        incarnation: 1,
        devices: vec![gpu_device("GPU-tray-v-0")],
        links: Vec::new(),
    };
    let readable = fabric_domain::records::encode(&record);
    let mut newer: serde_json::Value = serde_json::from_slice(&readable).unwrap();
    newer["version"] = serde_json::json!(fabric_domain::records::RECORD_VERSION + 1);
    let mut kv = gone.raw();
    kv.put(k.topology("tray-v"), serde_json::to_vec(&newer).unwrap(), None).await.unwrap();
    let gpu = DeviceId::uuid("GPU-tray-v-0");
    let other = DeviceId::uuid("GPU-other");
    let partition = PartitionRecord::new("p", vec![gpu.clone(), other.clone()], &[1000], &[]);
    kv.put(k.partition("p"), fabric_domain::records::encode(&partition), None).await.unwrap();
    let partition_at = kv.get(k.partition("p"), None).await.unwrap().kvs()[0].mod_revision();

    let a = client(&etcd, "tray-a").await;
    let a_lease = a.grant_lease().await.unwrap();
    let a_fence = a.join_fenced(&a_lease, &testing::member("tray-a")).await.unwrap();
    let a_election = Election::start(&a, &a_lease);
    let leader = LeaderFence::new(&a, a_lease.id(), leads(&a_election, Duration::from_secs(5)).await);
    a.request_gc(&a_fence, "tray-v").await.unwrap();

    match a.gc_led(&leader, "tray-v").await {
        Err(EtcdError::Record { key, .. }) => assert_eq!(key, k.topology("tray-v")),
        other => panic!("the gc of a node whose devices are unknown: {other:?}"),
    }
    for key in [k.slot(slot), k.slot_of("tray-v"), k.topology("tray-v"), k.gc_request("tray-v")] {
        assert!(exists(&a, &key).await, "{key} went in a refused gc");
    }
    assert_eq!(kv.get(k.partition("p"), None).await.unwrap().kvs()[0].mod_revision(), partition_at);

    // As after a gc interrupted once the slot was freed: no slot, no member, its topology
    // and its request left. The sweep leaves it to the gc.
    kv.delete(k.slot(slot), None).await.unwrap();
    kv.delete(k.slot_of("tray-v"), None).await.unwrap();
    let swept = a.sweep_orphans(&leader, 64).await.unwrap();
    assert!(!swept.contains(&"tray-v".to_owned()), "{swept:?}");
    assert!(exists(&a, &k.topology("tray-v")).await, "the sweep took the devices' record");

    // A leader that reads the record collects the node, devices and all.
    kv.put(k.topology("tray-v"), readable, None).await.unwrap();
    assert_eq!(a.gc_led(&leader, "tray-v").await.unwrap(), None);
    for key in [k.topology("tray-v"), k.gc_request("tray-v")] {
        assert!(!exists(&a, &key).await, "{key} outlived the gc");
    }
    let left = kv.get(k.partition("p"), None).await.unwrap();
    let p: PartitionRecord = fabric_domain::records::decode(left.kvs()[0].value(), RecordLimits::default()).unwrap();
    assert_eq!(p.devices, vec![other]);
}
