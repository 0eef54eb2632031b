//! The real daemon serves Prometheus metrics on `metrics.listen`: the counters move with
//! the requests clients make, the page is valid exposition text (checked with `promtool
//! check metrics` when it is installed), other paths are 404, and a port in use is a
//! start-up error; the memory gauges follow allocations and the fabric gauges and rescan
//! counters follow rescans.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, CodecError, Connection, DeviceName, ErrorCode, ExportPolicy,
    ExportRequest, ImportRequest, MemoryClass, Request, Response, StatusRequest,
};

use common::scrape::{free_port, http, promtool_check, scrape, value};

/// A setup whose daemon serves metrics on `127.0.0.1:port`.
fn setup(port: u16) -> common::Setup {
    let s = common::Setup::new("");
    let text = std::fs::read_to_string(&s.config).unwrap();
    assert!(text.contains("listen = \"\""));
    std::fs::write(&s.config, text.replace("listen = \"\"", &format!("listen = \"127.0.0.1:{port}\""))).unwrap();
    s
}

#[test]
fn counters_move_with_requests_and_the_page_is_valid_exposition_text() {
    let port = free_port();
    let s = setup(port);
    let d = common::start(&s.config, s.dir.path());
    assert!(d.log().contains("serving metrics"), "{}", d.log());

    let before = scrape(port);
    assert_eq!(value(&before, "fabricd_up"), Some(1.0));
    assert_eq!(value(&before, "fabricd_requests_total{op=\"status\",result=\"ok\"}"), None);
    assert_eq!(value(&before, "fabricd_sessions"), Some(0.0));
    let devices: f64 = before
        .lines()
        .filter(|l| l.starts_with("fabricd_devices{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(devices, 63.0, "{before}");
    assert_eq!(value(&before, "fabricd_devices{kind=\"gpu\"}"), Some(8.0));
    assert_eq!(value(&before, "fabricd_backend_present{backend=\"sim\"}"), Some(1.0), "{before}");
    assert!(value(&before, "fabricd_map_generation").unwrap() >= 1.0, "{before}");
    assert!(value(&before, "fabricd_map_mapped_bytes").unwrap() > 0.0, "{before}");

    // hello + two status requests on one connection, held open.
    let mut c = common::client(&s.socket);
    for _ in 0..2 {
        c.call(Request::Status(StatusRequest {}), &[]).unwrap();
    }
    // A request before hello: refused NotNegotiated.
    let mut raw = Connection::new(UnixStream::connect(&s.socket).unwrap());
    match raw.call(Request::Status(StatusRequest {}), &[]) {
        Err(CodecError::Refused { body, .. }) => assert_eq!(body.code, ErrorCode::NotNegotiated),
        other => panic!("expected a refusal, got {other:?}"),
    }

    let page = scrape(port);
    assert_eq!(value(&page, "fabricd_requests_total{op=\"hello\",result=\"ok\"}"), Some(1.0), "{page}");
    assert_eq!(value(&page, "fabricd_requests_total{op=\"status\",result=\"ok\"}"), Some(2.0), "{page}");
    assert_eq!(value(&page, "fabricd_requests_total{op=\"status\",result=\"not_negotiated\"}"), Some(1.0), "{page}");
    assert_eq!(value(&page, "fabricd_request_duration_seconds_count{op=\"status\"}"), Some(3.0), "{page}");
    assert_eq!(value(&page, "fabricd_request_duration_seconds_bucket{op=\"status\",le=\"+Inf\"}"), Some(3.0));
    assert!(value(&page, "fabricd_request_duration_seconds_sum{op=\"status\"}").unwrap() > 0.0);
    assert_eq!(value(&page, "fabricd_sessions"), Some(2.0), "{page}");
    assert_eq!(value(&page, "fabricd_sessions_total"), Some(2.0), "{page}");

    // Buckets are cumulative: non-decreasing in `le` order.
    let buckets: Vec<f64> = page
        .lines()
        .filter(|l| l.starts_with("fabricd_request_duration_seconds_bucket{op=\"status\","))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(buckets.len(), 17);
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");

    // Other paths and methods are 404; a malformed head is 400; an oversized one is refused.
    let (st, _, _) = http(port, b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(st, "HTTP/1.1 404 Not Found");
    let (st, _, _) = http(port, b"POST /metrics HTTP/1.1\r\n\r\n");
    assert_eq!(st, "HTTP/1.1 404 Not Found");
    let (st, _, _) = http(port, b"hello\r\n\r\n");
    assert_eq!(st, "HTTP/1.1 400 Bad Request");
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 9000));
    big.extend_from_slice(b"\r\n\r\n");
    let (st, _, _) = http(port, &big);
    assert_eq!(st, "HTTP/1.1 400 Bad Request");

    drop(c);
    drop(raw);
    promtool_check(&page);
}

/// Polls the page until `ok` accepts it (up to 20 s); returns it.
fn scrape_until(port: u16, ok: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let page = scrape(port);
        if ok(&page) {
            return page;
        }
        assert!(std::time::Instant::now() < deadline, "the page never got there:\n{page}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn memory_gauges_follow_allocations_and_fabric_gauges_follow_rescans() {
    let port = free_port();
    let s = setup(port);
    let sim = s.dir.path().join("fabric.toml");
    let base = std::fs::read_to_string(common::sim_file()).unwrap();
    std::fs::write(&sim, &base).unwrap();
    let text = std::fs::read_to_string(&s.config).unwrap().replace(
        &format!("sim = [{:?}]", common::sim_file().display().to_string()),
        &format!("sim = [{:?}]\nrescan_interval_s = 1", sim.display().to_string()),
    );
    std::fs::write(&s.config, text).unwrap();
    let _d = common::start(&s.config, s.dir.path());
    let before = scrape(port);
    for (series, v) in [
        ("fabricd_regions", 0.0),
        ("fabricd_exports", 0.0),
        ("fabricd_imports", 0.0),
        ("fabricd_allocated_bytes", 0.0),
        ("fabricd_imported_bytes", 0.0),
        ("fabricd_pinned_bytes", 0.0),
        ("fabricd_regions_lost", 0.0),
        ("fabricd_device_states{state=\"ok\"}", 63.0),
        ("fabricd_device_states{state=\"missing\"}", 0.0),
        ("fabricd_uevents_listening", 0.0),
        ("fabricd_rescans_total{trigger=\"interval\",result=\"changed\"}", 0.0),
    ] {
        assert_eq!(value(&before, series), Some(v), "{series} in\n{before}");
    }

    // A region on gpu7, exported and imported.
    let inv = fabric_drivers::sim::load(&sim).unwrap();
    let gpus: Vec<String> =
        inv.devices.iter().filter(|d| d.kind == fabric_topology::DeviceKind::Gpu).map(|d| d.id.to_string()).collect();
    let seven = base
        .replacen(
            "count = 8\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            "count = 7\nparent = \"plx{i/2}\"\nmodel = \"NVIDIA H100",
            1,
        )
        .replacen("i = 8\n", "i = 7\n", 1);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("seven.toml"), &seven).unwrap();
    let left = fabric_drivers::sim::load(&dir.path().join("seven.toml")).unwrap();
    let gpu7 = gpus.iter().find(|g| left.find(&g.parse().unwrap()).is_none()).unwrap().clone();
    let mut c = common::client(&s.socket);
    let req = Request::Alloc(AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(&gpu7), memory: MemoryClass::Hbm },
        size: 3 << 20,
        align: 0,
    });
    let Response::Alloc(a) = c.call(req, &[]).unwrap().0 else { panic!() };
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadOnly,
    };
    let Response::Export(e) =
        c.call(Request::Export(ExportRequest { region: a.region, policy, node: None }), &[]).unwrap().0
    else {
        panic!()
    };
    c.call(Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadOnly }), &[]).unwrap();
    let page = scrape(port);
    for (series, v) in [
        ("fabricd_regions", 1.0),
        ("fabricd_exports", 1.0),
        ("fabricd_imports", 1.0),
        ("fabricd_allocated_bytes", 4194304.0),
        ("fabricd_imported_bytes", 4194304.0),
    ] {
        assert_eq!(value(&page, series), Some(v), "{series} in\n{page}");
    }

    // gpu7 vanishes: the next rescan updates the fabric gauges, counts itself, and the
    // region is lost with its export revoked.
    let tmp = sim.with_extension("tmp");
    std::fs::write(&tmp, &seven).unwrap();
    std::fs::rename(&tmp, &sim).unwrap();
    let page = scrape_until(port, |p| value(p, "fabricd_devices{kind=\"gpu\"}") == Some(7.0));
    assert!(value(&page, "fabricd_device_states{state=\"missing\"}").unwrap() >= 1.0, "{page}");
    assert_eq!(value(&page, "fabricd_regions_lost"), Some(1.0), "{page}");
    assert_eq!(value(&page, "fabricd_exports"), Some(0.0), "{page}");
    assert_eq!(value(&page, "fabricd_regions"), Some(1.0), "{page}");
    let page = scrape_until(port, |p| {
        value(p, "fabricd_rescans_total{trigger=\"interval\",result=\"changed\"}").unwrap_or(0.0) >= 1.0
    });
    assert!(value(&page, "fabricd_map_generation").unwrap() > value(&before, "fabricd_map_generation").unwrap());
    promtool_check(&page);
}

#[test]
fn sigterm_stops_the_endpoint_and_a_port_in_use_is_a_start_up_error() {
    let port = free_port();
    let s = setup(port);
    let mut d = common::start(&s.config, s.dir.path());
    scrape(port);
    let pid = i32::try_from(d.child.id()).unwrap();
    // SAFETY: kill(2) on our own child's pid; it touches no memory of ours.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let st = common::wait_exit(&mut d.child, 20);
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "the endpoint closed with the daemon");

    // The port held by someone else: fabricd refuses to start, naming the key.
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let s = setup(port);
    let out = Command::new(env!("CARGO_BIN_EXE_fabricd")).arg("--config").arg(&s.config).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("cannot listen for metrics") && err.contains("metrics.listen"), "{err}");
    assert!(!s.socket.exists(), "the socket is removed when start-up fails");
}

/// Idle connections (a local user's, who never sends a request head) must not keep a
/// scrape out: with far more of them open than the endpoint serves, a scrape still gets
/// its page, promptly, and again while they stay open.
#[test]
fn idle_connections_do_not_block_scrapes() {
    let port = free_port();
    let s = setup(port);
    let d = common::start(&s.config, s.dir.path());
    scrape(port);
    let idle: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    // Let the daemon accept all of them before the scrapes come.
    std::thread::sleep(Duration::from_millis(300));
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let page = scrape(port);
        assert!(page.contains("fabricd_requests_total"), "{page}");
        assert!(t.elapsed() < Duration::from_secs(2), "a scrape waited {:?} behind idle connections", t.elapsed());
    }
    drop(idle);
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon is still running");
}
