//! The domain's scale benchmarks (docs/BENCHMARKS.md), with real etcd and real fabricd
//! processes; figures, not pass/fail.
//!
//! ```text
//! cargo build --release -p fabricd --example domain_bench
//! target/release/examples/domain_bench trays [--ttl S] [--kills K] [--json]
//! target/release/examples/domain_bench records [--nodes N] [--changes C] [--burst B] [--json]
//! target/release/examples/domain_bench merge [--sim FILE] [--rounds R] [--json]
//! ```
//!
//! - `trays`: `scripts/domain.sh up 16` (a private etcd and sixteen nodes, one per tray of
//!   the sim supernode): the time from the first fabricd's start to every node holding the
//!   whole domain map, each node's memory, then `kill -9` of K nodes in turn and the time
//!   until every other node shows the killed one gone.
//! - `records`: a private etcd holding N node records (slot, member on a lease, placements
//!   of eight HBM ranges) written by this tool, then one real fabricd: its time to load and
//!   watch them all, its memory, the bytes in etcd; then C changes of one node's
//!   placements one at a time (each until the node's translation shows it), and a burst of
//!   B changes to B nodes (until the last shows).
//! - `merge`: the topology records every node of a sim fabric (default
//!   `configs/sim/supernode-64.toml`) would publish, in one view; R rounds of what a node
//!   does when the domain's fabric changed — merge them (`domain_fabric::merge_with`) and
//!   index the result (`fabricd::daemon::View::build`) — and the median and spread. No etcd
//!   and no daemon: the cost a request pays once per `DomainView::fabric_revision`.
//!
//! `FABRICD` names the daemon (default: `fabricd` next to this example's directory).
#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fabric_domain::etcd_client::{Client, PutOptions, Txn, TxnOp};
use fabric_domain::records::{self, RECORD_VERSION};
use fabric_domain::testing::EtcdServer;
use fabric_domain::{DomainSettings, Keys, MemberRecord, PlacedKind, PlacedRange, PlacementsRecord, SlotClaim};
use fabric_proto::wire::{
    BoundedVec, Connection, DomainAction, DomainRequest, Request, Response, SUPPORTED_VERSIONS, TranslateQuery,
    TranslateRequest, Translation,
};
use serde_json::{Value, json};

const SPAN: u64 = 1 << 40;
const GIB: u64 = 1 << 30;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: u64| -> u64 {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().unwrap())
    };
    let json = args.iter().any(|a| a == "--json");
    let out = match args.first().map(String::as_str) {
        Some("trays") => trays(flag("--ttl", 2), flag("--kills", 3) as usize),
        Some("records") => {
            records(flag("--nodes", 12_500) as u32, flag("--changes", 50), flag("--burst", 1_000) as u32)
        }
        Some("merge") => {
            let sim = args.iter().position(|a| a == "--sim").and_then(|i| args.get(i + 1)).map(PathBuf::from);
            merge(&sim.unwrap_or_else(|| root().join("configs/sim/supernode-64.toml")), flag("--rounds", 20))
        }
        _ => {
            eprintln!(
                "usage: domain_bench trays [--ttl S] [--kills K] [--json] | records [--nodes N] [--changes C] [--burst B] [--json] | merge [--sim FILE] [--rounds R] [--json]"
            );
            std::process::exit(2);
        }
    };
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let out = json!({ "bench": out, "loadavg": load.split_whitespace().take(3).collect::<Vec<_>>() });
    if json {
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
    } else {
        println!("{out:#}");
    }
}

fn fabricd() -> PathBuf {
    if let Some(p) = std::env::var_os("FABRICD") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().join("fabricd")
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

fn connect(socket: &Path) -> Option<Connection> {
    let s = UnixStream::connect(socket).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let mut c = Connection::new(s);
    c.hello("domain-bench", SUPPORTED_VERSIONS).ok()?;
    Some(c)
}

fn nodes(c: &mut Connection) -> Vec<(String, bool, u64)> {
    let r = c.call(Request::Domain(DomainRequest { action: DomainAction::Nodes }), &[]).unwrap().0;
    let Response::Domain(d) = r else { panic!("{r:?}") };
    let doc: Value = serde_json::from_str(&d.json).unwrap();
    doc["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["name"].as_str().unwrap().to_owned(), n["state"] == "live", n["ranges"].as_u64().unwrap_or(0)))
        .collect()
}

/// `(VmRSS, VmHWM)` of `pid` in KiB.
fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Seconds since `pid` started (clock ticks of 10 ms).
fn age(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Field 22 (starttime), counted after the command name's closing parenthesis.
    let after = stat.rsplit_once(')').unwrap().1;
    let start: f64 = after.split_whitespace().nth(19).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let uptime: f64 =
        std::fs::read_to_string("/proc/uptime").unwrap().split_whitespace().next().unwrap().parse().unwrap();
    uptime - start / hz
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

fn spread(mut v: Vec<f64>) -> Value {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Value::Null;
    }
    json!({ "min": v[0], "median": v[v.len() / 2], "max": v[v.len() - 1], "n": v.len() })
}

fn trays(ttl: u64, kills: usize) -> Value {
    let run = tempfile::tempdir().unwrap();
    let dir = run.path().join("d");
    let sh = |arg: &[&str]| {
        let out = Command::new("bash")
            .arg(root().join("scripts/domain.sh"))
            .args(arg)
            .env("FABRIC_DOMAIN_RUN", &dir)
            .env("FABRICD", fabricd())
            .env("FABRIC_DOMAIN_TTL", ttl.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let up = Instant::now();
    sh(&["up", "16"]);
    let pids: Vec<u32> = (0..16)
        .map(|i| std::fs::read_to_string(dir.join(format!("tray{i}/pid"))).unwrap().trim().parse().unwrap())
        .collect();
    let mut clients: Vec<Connection> =
        (0..16).map(|i| connect(&dir.join(format!("tray{i}/fabricd.sock"))).unwrap()).collect();
    let mut full = [false; 16];
    while !full.iter().all(|f| *f) {
        for (i, c) in clients.iter_mut().enumerate() {
            if !full[i] {
                let list = nodes(c);
                full[i] = list.len() == 16 && list.iter().all(|(_, live, ranges)| *live && *ranges > 0);
            }
        }
        assert!(up.elapsed() < Duration::from_secs(120), "no full map within 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let from_up = up.elapsed();
    let from_first = pids.iter().map(|p| age(*p)).fold(0.0, f64::max);
    std::thread::sleep(Duration::from_secs(1));
    let mem: Vec<(u64, u64)> = pids.iter().map(|p| memory(*p)).collect();
    let mut deaths = Vec::new();
    for k in 0..kills.min(15) {
        let victim = 15 - k;
        let name = format!("tray{victim}");
        assert!(Command::new("kill").arg("-KILL").arg(pids[victim].to_string()).status().unwrap().success());
        let killed = Instant::now();
        let mut seen = [false; 16];
        for (i, s) in seen.iter_mut().enumerate() {
            *s = i >= 16 - k - 1;
        }
        while !seen.iter().all(|s| *s) {
            for (i, c) in clients.iter_mut().enumerate() {
                if !seen[i] {
                    seen[i] = nodes(c).iter().any(|(n, live, _)| *n == name && !live);
                }
            }
            assert!(killed.elapsed() < Duration::from_secs(ttl + 30), "{name}'s death not seen");
            std::thread::sleep(Duration::from_millis(10));
        }
        deaths.push(ms(killed.elapsed()));
    }
    sh(&["down"]);
    json!({
        "mode": "trays",
        "nodes": 16,
        "ttl_s": ttl,
        "full_map_ms_from_first_fabricd_start": (from_first * 1e3).round(),
        "full_map_ms_from_domain_sh_up": ms(from_up),
        "rss_kib": spread(mem.iter().map(|m| m.0 as f64).collect()),
        "hwm_kib": spread(mem.iter().map(|m| m.1 as f64).collect()),
        "death_seen_by_all_ms": deaths,
    })
}

/// The placements of fake node `i` in slot `i`: eight HBM ranges of 80 GiB, as an HGX node.
/// The `merge` mode (module docs).
fn merge(sim: &Path, rounds: u64) -> Value {
    let t = Instant::now();
    let fabric = fabric_topology::Fabric::build(fabric_drivers::sim::load(sim).unwrap()).unwrap();
    let names: Vec<String> = fabric.nodes().iter().map(ToString::to_string).collect();
    let keys = Keys::new("bench");
    let settings = DomainSettings::new(57, SPAN, fabric_domain::DEFAULT_DATA_PATHS.to_vec());
    let mut entries = vec![(keys.settings(), records::encode(&settings))];
    let limits = fabric_domain::RecordLimits::default();
    let built = t.elapsed();
    let published = fabric_domain::TopologyRecord::of_every_node(&fabric, 1, limits.max_bytes());
    let made = t.elapsed() - built;
    let mut record_bytes = Vec::with_capacity(published.len());
    for ((i, name), record) in names.iter().enumerate().zip(&published) {
        let slot = u32::try_from(i).unwrap();
        let mut member = fake_member(slot);
        member.name.clone_from(name);
        entries.push((keys.slot(slot), records::encode(&SlotClaim::new(slot, name))));
        entries.push((keys.member(name), records::encode(&member)));
        let bytes = records::encode(record);
        record_bytes.push(bytes.len());
        entries.push((keys.topology(name), bytes));
    }
    let view =
        fabric_domain::DomainView::load(keys, limits, entries.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())), 1);
    if let Some((key, why)) = view.refused().iter().next() {
        eprintln!("domain_bench: {} records refused, among them {key}: {why}", view.refused().len());
        std::process::exit(1);
    }
    let prepared = t.elapsed();
    let (mut merge_ms, mut index_ms, mut devices, mut links) = (vec![], vec![], 0, 0);
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        let inv = fabric_domain::domain_fabric::merge_with(&view, None);
        merge_ms.push(ms(t.elapsed()));
        (devices, links) = (inv.devices.len(), inv.links.len());
        let t = Instant::now();
        std::hint::black_box(fabricd::daemon::View::build(inv).unwrap());
        index_ms.push(ms(t.elapsed()));
    }
    json!({
        "sim": sim.display().to_string(),
        "nodes": names.len(),
        "devices": devices,
        "links": links,
        "fabric_devices": fabric.len(),
        "fabric_links": fabric.inventory().links.len(),
        "record_bytes_max": record_bytes.iter().max(),
        "prepare_ms": ms(prepared),
        "records_ms": ms(made),
        "merge_ms": spread(merge_ms),
        "index_ms": spread(index_ms),
    })
}

fn fake_placements(i: u32, ordinal: u16) -> PlacementsRecord {
    let name = format!("node{i:05}");
    let base = u64::from(i) * SPAN;
    PlacementsRecord {
        version: RECORD_VERSION,
        node: name.clone(),
        incarnation: 1,
        generation: u64::from(ordinal) + 1,
        slot: i,
        span: SPAN,
        ranges: (0..8)
            .map(|g| PlacedRange {
                start: base + g * 128 * GIB,
                reserved: 128 * GIB,
                size: 80 * GIB,
                kind: PlacedKind::Direct,
                owner: format!("sim:{name}-gpu{g}"),
                memory: Some("hbm".to_owned()),
                ordinal: if g == 0 { ordinal } else { 0 },
            })
            .collect(),
    }
}

fn fake_member(i: u32) -> MemberRecord {
    MemberRecord {
        version: RECORD_VERSION,
        name: format!("node{i:05}"),
        incarnation: 1,
        peer_address: format!("10.{}.{}.{}:7471", i >> 16, (i >> 8) & 255, i & 255),
        capabilities: vec!["shared-file".to_owned()],
        groups: vec![],
        software: env!("CARGO_PKG_VERSION").to_owned(),
        node_id: None,
    }
}

/// The resource ordinal `c`'s node translates the first GFA of fake node `i` to.
fn ordinal_seen(c: &mut Connection, i: u32) -> Option<u16> {
    let queries = BoundedVec::new(vec![TranslateQuery::Gfa(u64::from(i) * SPAN)]).unwrap();
    let r = c.call(Request::Translate(TranslateRequest { queries }), &[]).unwrap().0;
    let Response::Translate(t) = r else { panic!("{r:?}") };
    match t.results.into_vec().remove(0) {
        Translation::Remote { live: true, resource: Some(res), .. } => Some(res.ordinal),
        _ => None,
    }
}

fn records(n: u32, changes: u64, burst: u32) -> Value {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let etcd = rt.block_on(EtcdServer::start()).unwrap();
    let endpoint = etcd.endpoint().to_owned();
    let keys = Keys::new("bench");
    let mut client = rt.block_on(Client::connect([endpoint.as_str()], None)).unwrap();
    let settings = DomainSettings::new(57, SPAN, fabric_domain::DEFAULT_DATA_PATHS.to_vec());
    let t_write = Instant::now();
    let mut written = 0usize;
    rt.block_on(async {
        client.put(keys.settings(), records::encode(&settings), None).await.unwrap();
        let lease = client.lease_grant(600, None).await.unwrap().id();
        let mut batch = Vec::new();
        for i in 0..n {
            let name = format!("node{i:05}");
            let claim = records::encode(&SlotClaim::new(i, &name));
            let kvs = [
                (keys.slot(i), claim.clone(), None),
                (keys.slot_of(&name), claim, None),
                (keys.member(&name), records::encode(&fake_member(i)), Some(lease)),
                (keys.placements(&name), records::encode(&fake_placements(i, 0)), None),
            ];
            for (k, v, lease) in kvs {
                written += k.len() + v.len();
                batch.push(TxnOp::put(k, v, lease.map(|l| PutOptions::new().with_lease(l))));
            }
            if batch.len() >= 100 || i + 1 == n {
                client.txn(Txn::new().and_then(std::mem::take(&mut batch))).await.unwrap();
            }
        }
    });
    let write_time = t_write.elapsed();
    let db_size = rt.block_on(client.status()).unwrap().db_size();

    // One real node: tray0 of the supernode, in the same domain.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("fabricd.sock");
    let config = dir.path().join("fabricd.toml");
    let sim = root().join("configs/sim/supernode-64.toml");
    std::fs::write(
        &config,
        format!(
            "[socket]\npath = {:?}\n[state]\ndir = {:?}\n[discovery]\nsim = [{:?}]\nsim_node = \"tray0\"\n[metrics]\nlisten = \"\"\n[map]\nnode_span = {{ fixed = {SPAN} }}\n[domain]\nname = \"bench\"\nendpoints = [{endpoint:?}]\nnode = \"tray0\"\nlease_ttl_secs = 6\n",
            socket.display().to_string(),
            dir.path().join("state").display().to_string(),
            sim.display().to_string(),
        ),
    )
    .unwrap();
    let started = Instant::now();
    let mut daemon = Command::new(fabricd())
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("fabricd.log")).unwrap())
        .spawn()
        .unwrap();
    let mut c = loop {
        if let Some(c) = connect(&socket) {
            break c;
        }
        assert!(daemon.try_wait().unwrap().is_none(), "fabricd stopped: {}", log(dir.path()));
        assert!(started.elapsed() < Duration::from_secs(120), "fabricd not ready");
        std::thread::sleep(Duration::from_millis(5));
    };
    let ready = started.elapsed();
    // Loaded when the last node written translates.
    while ordinal_seen(&mut c, n - 1).is_none() {
        assert!(started.elapsed() < Duration::from_secs(300), "not loaded: {}", log(dir.path()));
        std::thread::sleep(Duration::from_millis(5));
    }
    let loaded = started.elapsed();
    let after_load = memory(daemon.id());

    // One change at a time, each until the node shows it.
    let mut one = Vec::new();
    for k in 1..=changes {
        let i = ((k * 7919) % u64::from(n)) as u32;
        let ordinal = k as u16;
        let name = format!("node{i:05}");
        let value = records::encode(&fake_placements(i, ordinal));
        let t = Instant::now();
        rt.block_on(client.put(keys.placements(&name), value, None)).unwrap();
        while ordinal_seen(&mut c, i) != Some(ordinal) {
            assert!(t.elapsed() < Duration::from_secs(30), "change {k} not seen");
        }
        one.push(ms(t.elapsed()));
    }
    // A burst: one change to each of `burst` nodes, as fast as etcd takes them; until the
    // last shows.
    let burst = burst.min(n);
    let t = Instant::now();
    rt.block_on(async {
        for i in 0..burst {
            let name = format!("node{i:05}");
            client.put(keys.placements(&name), records::encode(&fake_placements(i, 1000)), None).await.unwrap();
        }
    });
    let put_time = t.elapsed();
    while ordinal_seen(&mut c, burst - 1) != Some(1000) {
        assert!(t.elapsed() < Duration::from_secs(300), "burst not seen");
        std::thread::sleep(Duration::from_millis(1));
    }
    let burst_seen = t.elapsed();
    let after_changes = memory(daemon.id());
    stop(&mut daemon);
    json!({
        "mode": "records",
        "nodes": n,
        "write_ms": ms(write_time),
        "bytes_written": written,
        "etcd_db_size_bytes": db_size,
        "fabricd_ready_ms": ms(ready),
        "loaded_ms_from_start": ms(loaded),
        "rss_kib_after_load": after_load.0,
        "rss_kib_after_changes": after_changes.0,
        "hwm_kib": after_changes.1,
        "one_change_seen_ms": spread(one),
        "burst": { "changes": burst, "put_ms": ms(put_time), "last_seen_ms": ms(burst_seen) },
    })
}

fn log(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("fabricd.log")).unwrap_or_default()
}

fn stop(child: &mut Child) {
    let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    let _ = child.wait();
}
