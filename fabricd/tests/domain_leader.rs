//! The leader's duty on real daemons: three trays of the sim supernode in one domain (a
//! private etcd, TTL 2 s), a partition naming a GPU of tray0 and one of tray2; tray2 is
//! killed (`kill -9`) and, once gone, an admin asks a follower for its gc. The leader
//! carries it out (its log says so, the follower's does not), the follower answers with
//! the slot freed, and the records tray2 left behind — its slot keys, placements,
//! topology and the queued request — are gone from etcd, and the partition names tray0's
//! GPU alone. A gc of a live node asked of a follower is refused, the node untouched.
//!
//! Without an `etcd` binary the test says it is skipped (scripts/deps.sh installs it).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::time::Duration;

use fabric_domain::Keys;
use fabric_domain::testing::EtcdServer;
use fabric_proto::wire::{
    Connection, DomainAction, DomainRequest, Name, PartitionSpec, PartitionsRequest, Request, Response,
};
use serde_json::Value;

use common::domain::{all_live_and_placed, domain, gpu_of, nodes, topology, until};

const TTL: u64 = 2;
const SPAN: u64 = 1 << 40;

fn exists(rt: &tokio::runtime::Runtime, etcd: &EtcdServer, key: &str) -> bool {
    rt.block_on(async {
        let mut c = fabric_domain::etcd_client::Client::connect([etcd.endpoint()], None).await.unwrap();
        !c.get(key, None).await.unwrap().kvs().is_empty()
    })
}

fn leader(c: &mut Connection) -> Option<String> {
    domain(c, DomainAction::Status)["leader"]["node"].as_str().map(str::to_owned)
}

fn gc(c: &mut Connection, node: &str) -> Result<Value, String> {
    let action = DomainAction::Gc { node: Name::new(node).unwrap() };
    match c.call(Request::Domain(DomainRequest { action }), &[]) {
        Ok((Response::Domain(d), _)) => Ok(serde_json::from_str(&d.json).unwrap()),
        Ok((other, _)) => panic!("{other:?}"),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn a_gc_asked_of_a_follower_is_carried_out_by_the_leader() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let names = ["tray0", "tray1", "tray2"];
    let setups: Vec<_> = names.iter().map(|n| common::domain::node(etcd.endpoint(), n, n, SPAN, TTL)).collect();
    // tray0 first, so that it leads.
    let mut daemons: Vec<_> = Vec::new();
    let mut clients: Vec<Connection> = Vec::new();
    for s in &setups {
        daemons.push(Some(common::start(&s.config, s.dir.path())));
        clients.push(common::client(&s.socket));
        let c = clients.last_mut().unwrap();
        until(Duration::from_secs(15), "joined", || leader(c).is_some());
    }
    for c in &mut clients {
        until(Duration::from_secs(15), "three nodes placed", || all_live_and_placed(c, 3));
        until(Duration::from_secs(15), "three topologies", || topology(c)["nodes"].as_array().map(Vec::len) == Some(3));
    }
    let lead = leader(&mut clients[0]).unwrap();
    let (l, f) = match lead.as_str() {
        "tray0" => (0, 1),
        "tray1" => (1, 0),
        other => panic!("tray2 leads ({other}); the test kills it"),
    };
    // A partition across tray0 and tray2.
    let doc = topology(&mut clients[0]);
    let (keep, drop_gpu) = (gpu_of(&doc, "tray0"), gpu_of(&doc, "tray2"));
    let spec = PartitionSpec {
        name: Name::truncated("tenant"),
        devices: vec![keep.as_str().try_into().unwrap(), drop_gpu.as_str().try_into().unwrap()].try_into().unwrap(),
        uids: vec![4242].try_into().unwrap(),
        gids: Vec::new().try_into().unwrap(),
    };
    let Response::Partitions(_) = clients[0].call(Request::Partitions(PartitionsRequest::Set(spec)), &[]).unwrap().0
    else {
        panic!()
    };

    // A live node's gc, asked of the follower: refused, the node untouched.
    let live = gc(&mut clients[f], "tray2");
    assert!(live.as_ref().is_err_and(|e| e.contains("live member")), "{live:?}");

    // tray2 dies; once gone, the follower is asked for its gc.
    let slot2 = nodes(&mut clients[0]).into_iter().find(|n| n.0 == "tray2").unwrap().2;
    daemons[2].as_mut().unwrap().child.kill().unwrap();
    let _ = daemons[2].as_mut().unwrap().child.wait();
    until(Duration::from_secs(TTL + 3), "tray2 gone", || {
        nodes(&mut clients[f]).iter().any(|n| n.0 == "tray2" && n.1 == "gone")
    });
    let freed = gc(&mut clients[f], "tray2").unwrap();
    assert_eq!(freed["gc"]["slot"], slot2, "{freed}");
    let leader_log = daemons[l].as_ref().unwrap().log();
    let follower_log = daemons[f].as_ref().unwrap().log();
    assert!(leader_log.contains("leader: carried out the gc"), "the leader did it");
    assert!(!follower_log.contains("leader: carried out the gc"), "not the follower");
    assert!(!follower_log.contains("leader freed a slot"));

    // What tray2 left behind is gone; the partition names tray0's GPU alone.
    let k = Keys::new("test");
    for key in
        [k.slot(slot2 as u32), k.slot_of("tray2"), k.placements("tray2"), k.topology("tray2"), k.gc_request("tray2")]
    {
        assert!(!exists(&rt, &etcd, &key), "{key} outlived the gc");
    }
    for c in &mut clients[..2] {
        until(Duration::from_secs(5), "the partition without tray2's GPU", || {
            let Response::Partitions(p) = c.call(Request::Partitions(PartitionsRequest::List), &[]).unwrap().0 else {
                panic!()
            };
            p.partitions.iter().any(|p| {
                p.name.as_str() == "tenant"
                    && p.devices.iter().map(|d| d.as_str().to_owned()).collect::<Vec<_>>() == [keep.clone()]
            })
        });
        until(Duration::from_secs(5), "tray2 no longer listed", || nodes(c).iter().all(|n| n.0 != "tray2"));
    }
}
