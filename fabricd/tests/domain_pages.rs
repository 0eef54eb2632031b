//! The domain's listings at the 100,000-GPU scale: a real fabricd (tray0 of the sim
//! supernode) in a domain whose private etcd holds 12,500 more nodes written by the test
//! (slot claims, member records — one in seven left out, so gone — and placements of
//! eight HBM ranges each). The whole `Nodes` listing passes an answer's limit; its pages
//! (`NodesPage`, `MapPage`, protocol 1.7) each decode within it, share one view revision
//! even while the domain changes under them, and together list every node and range
//! exactly once; `fabricctl domain status|nodes -o json` and `fabricctl map --daemon -o
//! json` print the whole listings from them.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fabric_domain::etcd_client::{Client, PutOptions, Txn, TxnOp};
use fabric_domain::records::{self, RECORD_VERSION};
use fabric_domain::{Keys, MemberRecord, PlacedKind, PlacedRange, PlacementsRecord, SlotClaim};
use fabric_proto::wire::{Connection, DomainAction, DomainRequest, Name, PageRequest, Request, Response};
use serde_json::Value;

use common::domain::{all_live_and_placed, domain, until};

const SPAN: u64 = 1 << 40;
const GIB: u64 = 1 << 30;
const NODES: u32 = 12_500;
/// The `Domain` answer's limit.
const ANSWER: usize = 1 << 20;

fn name(i: u32) -> String {
    format!("node{i:05}")
}

fn live(i: u32) -> bool {
    i % 7 != 3
}

fn placements(i: u32, slot: u32) -> PlacementsRecord {
    PlacementsRecord {
        version: RECORD_VERSION,
        node: name(i),
        incarnation: 1,
        generation: 1,
        slot,
        span: SPAN,
        ranges: (0..8)
            .map(|g| PlacedRange {
                start: u64::from(slot) * SPAN + g * 128 * GIB,
                reserved: 128 * GIB,
                size: 80 * GIB,
                kind: PlacedKind::Direct,
                owner: format!("sim:{}-gpu{g}", name(i)),
                memory: Some("hbm".to_owned()),
                ordinal: 0,
            })
            .collect(),
    }
}

fn member(i: u32, incarnation: u64) -> MemberRecord {
    MemberRecord {
        version: RECORD_VERSION,
        name: name(i),
        incarnation,
        peer_address: format!("10.{}.{}.{}:7471", i >> 16, (i >> 8) & 255, i & 255),
        capabilities: vec!["shared-file".to_owned()],
        groups: vec![],
        software: "test".to_owned(),
        node_id: None,
    }
}

/// One `Domain` answer: its JSON, refused answers as `Err`.
fn ask(c: &mut Connection, action: DomainAction) -> Result<String, String> {
    match c.call(Request::Domain(DomainRequest { action }), &[]) {
        Ok((Response::Domain(d), _)) => Ok(d.json),
        Ok((other, _)) => panic!("{other:?}"),
        Err(e) => Err(e.to_string()),
    }
}

/// Every page of a listing, from `first` on: `(revision, page json)` each. Every page is
/// within the answer's limit.
fn pages(c: &mut Connection, what: fn(PageRequest) -> DomainAction, first: PageRequest) -> Vec<(u64, Value)> {
    let mut req = first;
    let mut out = Vec::new();
    loop {
        let json = ask(c, what(req.clone())).unwrap();
        assert!(json.len() < ANSWER, "a page of {} bytes", json.len());
        let v: Value = serde_json::from_str(&json).unwrap();
        let revision = v["page"]["revision"].as_u64().unwrap();
        let next = v["page"]["next"].as_str().map(str::to_owned);
        out.push((revision, v));
        let Some(next) = next else { return out };
        assert!(out.len() < 1_000, "pages do not end");
        req = PageRequest { revision, after: Some(Name::new(next.as_str()).unwrap()) };
    }
}

/// fabricctl, built next to fabricd (`cargo build -p fabric-cli`).
fn fabricctl() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_BIN_EXE_fabricd")).with_file_name("fabricctl");
    p.exists().then_some(p)
}

fn cli_json(bin: &Path, socket: &Path, args: &[&str]) -> Value {
    let t0 = std::time::Instant::now();
    let out = Command::new(bin).args(args).arg("--daemon").arg(socket).args(["-o", "json"]).output().unwrap();
    eprintln!("fabricctl {args:?}: {:?}, {} bytes of JSON", t0.elapsed(), out.stdout.len());
    assert!(out.status.success(), "fabricctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn listings_of_twelve_thousand_five_hundred_nodes_come_in_pages() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(fabric_domain::testing::etcd_or_skip()) else { return };
    let s = common::domain::node(etcd.endpoint(), "tray0", "tray0", SPAN, 6);
    let _daemon = common::start(&s.config, s.dir.path());
    let mut c = common::client(&s.socket);
    until(Duration::from_secs(15), "tray0 joined with placements", || all_live_and_placed(&mut c, 1));
    let own = domain(&mut c, DomainAction::Status)["self"]["slot"].as_u64().unwrap() as u32;
    let slot = |i: u32| if i >= own { i + 1 } else { i };

    // 12,500 nodes written straight into etcd, 25 nodes a transaction.
    let keys = Keys::new("test");
    let mut etcd_client = rt.block_on(Client::connect([etcd.endpoint()], None)).unwrap();
    let lease = rt.block_on(etcd_client.lease_grant(600, None)).unwrap().id();
    rt.block_on(async {
        let mut batch = Vec::new();
        for i in 0..NODES {
            let claim = records::encode(&SlotClaim::new(slot(i), &name(i)));
            batch.push(TxnOp::put(keys.slot(slot(i)), claim.clone(), None));
            batch.push(TxnOp::put(keys.slot_of(&name(i)), claim, None));
            batch.push(TxnOp::put(keys.placements(&name(i)), records::encode(&placements(i, slot(i))), None));
            if live(i) {
                let m = records::encode(&member(i, 1));
                batch.push(TxnOp::put(keys.member(&name(i)), m, Some(PutOptions::new().with_lease(lease))));
            }
            if batch.len() >= 96 || i + 1 == NODES {
                etcd_client.txn(Txn::new().and_then(std::mem::take(&mut batch))).await.unwrap();
            }
        }
    });
    let total = NODES as usize + 1;
    let lives = (0..NODES).filter(|i| live(*i)).count() + 1;
    until(Duration::from_secs(120), "the node holds every record", || {
        let st = domain(&mut c, DomainAction::Status);
        st["summary"]["nodes"] == total && st["summary"]["live"] == lives
    });
    // A status counts the nodes instead of listing them; the whole `Nodes` listing passes
    // an answer's limit (what a 1.6 client gets).
    let status = domain(&mut c, DomainAction::Status);
    assert_eq!(status["nodes"], serde_json::json!([]), "{}", status["summary"]);
    assert_eq!(status["summary"]["gone"], total - lives);
    let whole = ask(&mut c, DomainAction::Nodes);
    assert!(whole.as_ref().is_err_and(|e| e.contains("does not encode")), "{:?}", whole.map(|j| j.len()));

    // The nodes, page by page: one revision, every node once, in name order, as written.
    let node_pages = pages(&mut c, DomainAction::NodesPage, PageRequest::default());
    assert!(node_pages.len() > 2, "{} pages", node_pages.len());
    let revision = node_pages[0].0;
    assert!(node_pages.iter().all(|(r, _)| *r == revision));
    let listed: Vec<Value> = node_pages.iter().flat_map(|(_, p)| p["nodes"].as_array().unwrap().clone()).collect();
    let names: Vec<&str> = listed.iter().map(|n| n["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), total);
    assert!(names.windows(2).all(|w| w[0] < w[1]), "in name order, each once");
    assert!(node_pages.iter().all(|(_, p)| p["page"]["total"] == total));
    for n in &listed {
        let Some(i) = n["name"].as_str().unwrap().strip_prefix("node").map(|d| d.parse::<u32>().unwrap()) else {
            assert_eq!(n["name"], "tray0");
            continue;
        };
        assert_eq!(n["slot"], slot(i), "{n}");
        assert_eq!(n["state"], if live(i) { "live" } else { "gone" }, "{n}");
        assert_eq!(n["ranges"], 8, "{n}");
        if live(i) {
            assert_eq!((n["incarnation"].as_u64(), n["mapped_bytes"].as_u64()), (Some(1), Some(8 * 80 * GIB)), "{n}");
        }
    }

    // The domain changes between two pages: the rest of the listing still comes from the
    // revision of its first page; a listing begun afterwards shows the change.
    let first = pages_one(&mut c, PageRequest::default());
    let (r0, next) = (first["page"]["revision"].as_u64().unwrap(), first["page"]["next"].as_str().unwrap().to_owned());
    let changed = NODES - 1;
    rt.block_on(etcd_client.put(
        keys.member(&name(changed)),
        records::encode(&member(changed, 2)),
        Some(PutOptions::new().with_lease(lease)),
    ))
    .unwrap();
    let incarnation_of = |pages: &[(u64, Value)]| {
        pages
            .iter()
            .flat_map(|(_, p)| p["nodes"].as_array().unwrap().clone())
            .find(|n| n["name"] == name(changed).as_str())
            .map(|n| n["incarnation"].clone())
    };
    until(Duration::from_secs(30), "the change seen", || {
        incarnation_of(&pages(&mut c, DomainAction::NodesPage, PageRequest::default())) == Some(serde_json::json!(2))
    });
    let rest = pages(
        &mut c,
        DomainAction::NodesPage,
        PageRequest { revision: r0, after: Some(Name::new(next.as_str()).unwrap()) },
    );
    assert!(rest.iter().all(|(r, _)| *r == r0), "the pages after the change come from the first page's revision");
    assert_eq!(incarnation_of(&rest), Some(serde_json::json!(1)));

    // The map, page by page: one revision, every slot once, every node's eight ranges
    // (a gone node's as holes).
    let map_pages = pages(&mut c, DomainAction::MapPage, PageRequest::default());
    eprintln!("{} pages of nodes, {} pages of the map", node_pages.len(), map_pages.len());
    let generation = map_pages[0].1["generation"].clone();
    assert!(map_pages.iter().all(|(r, p)| *r == map_pages[0].0 && p["generation"] == generation));
    let mut ranges: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for r in map_pages.iter().flat_map(|(_, p)| p["ranges"].as_array().unwrap().clone()) {
        ranges.entry(r["node"].as_str().unwrap().to_owned()).or_default().push(r);
    }
    let slots: BTreeSet<u64> = map_pages
        .iter()
        .flat_map(|(_, p)| p["nodes"].as_array().unwrap().clone())
        .map(|n| n["start"].as_u64().unwrap() / SPAN)
        .collect();
    assert_eq!(slots.len(), total, "every slot once");
    assert_eq!(ranges.len(), total);
    for i in 0..NODES {
        let got = &ranges[&name(i)];
        let starts: Vec<u64> = got.iter().map(|r| r["start"].as_u64().unwrap()).collect();
        let want: Vec<u64> = placements(i, slot(i)).ranges.iter().map(|r| r.start).collect();
        assert_eq!(starts, want, "{}", name(i));
        let kind = if live(i) { "direct" } else { "hole" };
        assert!(got.iter().all(|r| r["kind"] == kind), "{got:?}");
    }

    // fabricctl pages them and prints one document each.
    let Some(cli) = fabricctl() else {
        eprintln!("fabricctl not built next to fabricd (cargo build -p fabric-cli): its part skipped");
        return;
    };
    let nodes = cli_json(&cli, &s.socket, &["domain", "nodes"]);
    assert_eq!(nodes["nodes"].as_array().unwrap().len(), total);
    assert_eq!(nodes.get("page"), None);
    let status = cli_json(&cli, &s.socket, &["domain", "status"]);
    assert_eq!(status["nodes"].as_array().unwrap().len(), total);
    assert_eq!(status["self"]["node"], "tray0");
    let map = cli_json(&cli, &s.socket, &["map"]);
    assert_eq!(map["nodes"].as_array().unwrap().len(), total);
    let direct = map["ranges"].as_array().unwrap().iter().filter(|r| r["kind"] == "direct").count();
    assert!(direct >= 8 * (lives - 1), "{direct} direct ranges");
    let mapped: u64 = map["ranges"].as_array().unwrap().iter().map(|r| r["size"].as_u64().unwrap()).sum();
    assert_eq!(map["mapped_bytes"].as_u64(), Some(mapped));
}

fn pages_one(c: &mut Connection, req: PageRequest) -> Value {
    serde_json::from_str(&ask(c, DomainAction::NodesPage(req)).unwrap()).unwrap()
}
