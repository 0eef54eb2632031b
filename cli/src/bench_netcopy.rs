//! `fabricctl bench netcopy`: the bandwidth of a copy across nodes (class NET: a client of
//! the importer node pushes a registration into a region another node exported, and pulls
//! it back, over fabricd's node link) against, in the same run, a raw TCP stream and a raw
//! TLS stream (the node link's ciphers, rustls) of the same bytes between the two nodes:
//! over loopback, where the nodes of `scripts/domain.sh` share this host's network, or,
//! with `--owner-netns`/`--importer-netns`, from the importer's network namespace to the
//! owner's link address in its own (`FABRIC_DOMAIN_NETNS=1`), the path the node link takes.
//! The ratio over TCP is the target (`netcopy_ratio`, ≥ 0.8); the one over TLS says how
//! much of the gap is encryption.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, FromRawFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use fabric_proto::wire::{
    AccessMode, AllocRequest, AllocTarget, BoundedVec, Connection, CopyEndpoint, CopyRequest, CopyResult, DeviceName,
    DomainAction, DomainRequest, Event, ExportPolicy, ExportRequest, ImportRequest, MemoryClass, RegisterRequest,
    RegisterSource, Request, Response,
};
use serde::Serialize;

use crate::bench_control::{self, ControlBenchError};

/// Result of `bench netcopy`; bandwidths in GB/s (10^9 bytes per second), best of the
/// rounds.
#[derive(Debug, Serialize)]
pub struct NetCopyBench {
    /// Benchmark name.
    pub bench: &'static str,
    /// Bytes per copy and per stream.
    pub bytes: u64,
    /// Rounds timed per figure.
    pub rounds: usize,
    /// How the importer was granted the region (`CopyOnly` on a NET pair).
    pub grant: String,
    /// Push: the importer's registration into the owner's region.
    pub push_gbps: f64,
    /// Pull: the owner's region into the importer's registration.
    pub pull_gbps: f64,
    /// Where the raw streams ran: `loopback`, or `netns IMPORTER -> OWNER (ADDRESS)`.
    pub path: String,
    /// A raw TCP stream of the same bytes over that path (baseline).
    pub tcp_gbps: f64,
    /// A raw TLS stream (rustls, the node link's configuration) over that path.
    pub tls_gbps: f64,
    /// `push_gbps / tcp_gbps` (target ≥ 0.8).
    pub netcopy_ratio: f64,
    /// `push_gbps / tls_gbps`.
    pub netcopy_tls_ratio: f64,
    /// The 1-minute load average when it ran.
    pub load_average: Option<f64>,
}

/// What to run against.
#[derive(Debug, Clone)]
pub struct NetCopyOptions {
    /// The owner node's socket (it allocates and exports).
    pub owner: PathBuf,
    /// The importer node's socket (a NET node: no shared memory with the owner).
    pub importer: PathBuf,
    /// Bytes per copy.
    pub bytes: u64,
    /// Rounds per figure.
    pub rounds: usize,
    /// The network namespaces of the owner and the importer (their names under
    /// `/run/netns`), for the raw streams to take the nodes' path; `None`: loopback.
    pub netns: Option<(String, String)>,
}

/// Where the raw streams run: the listener's namespace and address, the sender's namespace.
#[derive(Debug, Clone)]
struct StreamPath {
    listen_ns: Option<PathBuf>,
    listen: std::net::IpAddr,
    send_ns: Option<PathBuf>,
}

impl StreamPath {
    fn loopback() -> Self {
        Self { listen_ns: None, listen: std::net::Ipv4Addr::LOCALHOST.into(), send_ns: None }
    }

    /// From namespace `importer` to `owner`'s address `listen` in namespace `owner`; both
    /// must exist now (nothing is sent from the root namespace in their stead).
    fn between(owner: &str, importer: &str, listen: std::net::IpAddr) -> Result<Self, ControlBenchError> {
        let path = |name: &str| -> Result<PathBuf, ControlBenchError> {
            let bad = name.is_empty() || name.contains('/') || name == "." || name == "..";
            let p = std::path::Path::new("/run/netns").join(name);
            if bad || !p.exists() {
                return Err(ControlBenchError::Io {
                    what: format!("network namespace {name:?}"),
                    source: std::io::ErrorKind::NotFound.into(),
                });
            }
            Ok(p)
        };
        Ok(Self { listen_ns: Some(path(owner)?), listen, send_ns: Some(path(importer)?) })
    }

    fn describe(&self) -> String {
        match (&self.listen_ns, &self.send_ns) {
            (Some(l), Some(s)) => format!("netns {} -> {} ({})", name_of(s), name_of(l), self.listen),
            _ => "loopback".into(),
        }
    }

    /// A listener at this path's address (port chosen by the kernel), made in the
    /// owner's namespace.
    fn listen(&self) -> std::io::Result<TcpListener> {
        let addr = std::net::SocketAddr::new(self.listen, 0);
        in_netns(self.listen_ns.as_deref(), move || TcpListener::bind(addr))
    }

    /// A connection to `addr`, made in the importer's namespace (given up after 10 s).
    fn connect(&self, addr: std::net::SocketAddr) -> std::io::Result<TcpStream> {
        in_netns(self.send_ns.as_deref(), move || TcpStream::connect_timeout(&addr, Duration::from_secs(10)))
    }
}

fn name_of(p: &std::path::Path) -> String {
    p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Runs `f` on a thread of its own that first enters network namespace `ns` (when given):
/// a socket keeps the namespace it was made in, whichever thread uses it afterwards.
fn in_netns<T: Send + 'static>(
    ns: Option<&std::path::Path>,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let Some(ns) = ns else { return f() };
    let entering = |e: std::io::Error| std::io::Error::new(e.kind(), format!("entering {}: {e}", ns.display()));
    let file = std::fs::File::open(ns).map_err(entering)?;
    let entered = std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        Ok(f())
    })
    .join()
    .map_err(|_| std::io::Error::other("the thread entering the namespace panicked"))?;
    entered.map_err(entering)?
}

fn call(
    c: &mut Connection,
    what: &'static str,
    req: Request,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<Response, ControlBenchError> {
    c.call(req, fds).map(|(r, _)| r).map_err(|source| ControlBenchError::Call { what: what.into(), source })
}

fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> ControlBenchError {
    move |source| ControlBenchError::Io { what: what.into(), source }
}

/// One of this node's own HBM devices, from its `domain status` and map, and its node
/// link's address (`host:port`) as its member record says.
fn own_hbm(c: &mut Connection) -> Result<(String, Option<String>), ControlBenchError> {
    let Response::Domain(doc) =
        call(c, "domain status", Request::Domain(DomainRequest { action: DomainAction::Status }), &[])?
    else {
        return Err(ControlBenchError::Unexpected("domain status"));
    };
    let v: serde_json::Value =
        serde_json::from_str(&doc.json).map_err(|_| ControlBenchError::Unexpected("domain status"))?;
    let name = v["self"]["node"]
        .as_str()
        .ok_or(ControlBenchError::Unexpected("domain status (not a domain node)"))?
        .to_owned();
    let address = v["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|n| n["name"] == name.as_str())
        .and_then(|n| n["peer_address"].as_str())
        .map(str::to_owned);
    let Response::Map(doc) = call(c, "map", Request::Map(Default::default()), &[])? else {
        return Err(ControlBenchError::Unexpected("map"));
    };
    let v: serde_json::Value = serde_json::from_str(&doc.json).map_err(|_| ControlBenchError::Unexpected("map"))?;
    v["ranges"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["node"] == name.as_str() && r["memory"] == "hbm")
        .and_then(|r| r["owner"].as_str()?.split('#').next().map(str::to_owned))
        .map(|hbm| (hbm, address))
        .ok_or(ControlBenchError::NoHbm)
}

/// One copy's time, from its request to its `CopyDone`.
fn copy_time(
    c: &mut Connection,
    dst: CopyEndpoint,
    src: CopyEndpoint,
    len: u64,
) -> Result<Duration, ControlBenchError> {
    let start = Instant::now();
    let Response::Copy(r) = call(c, "copy", Request::Copy(CopyRequest { dst, src, len }), &[])? else {
        return Err(ControlBenchError::Unexpected("copy"));
    };
    loop {
        match c.next_event().map_err(|source| ControlBenchError::Call { what: "copy completion".into(), source })? {
            Event::CopyDone(d) if d.copy == r.copy => {
                return match d.result {
                    CopyResult::Ok => Ok(start.elapsed()),
                    CopyResult::Failed { .. } => Err(ControlBenchError::Unexpected("copy (it failed)")),
                };
            }
            _ => {}
        }
    }
}

/// A raw TCP stream of `bytes` over `path`, in 1 MiB writes, acknowledged by the reader
/// once all arrived.
fn tcp_time(path: &StreamPath, bytes: u64) -> Result<Duration, ControlBenchError> {
    let listener = path.listen().map_err(io("binding a TCP listener"))?;
    let addr = listener.local_addr().map_err(io("TCP listener address"))?;
    let reader = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = bytes;
        while left > 0 {
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            left = left.saturating_sub(n as u64);
        }
        s.write_all(&[1])
    });
    let mut s = path.connect(addr).map_err(io("connecting over TCP"))?;
    let _ = s.set_nodelay(true);
    let chunk = vec![0x5au8; 1 << 20];
    let start = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n]).map_err(io("writing the TCP stream"))?;
        left -= n as u64;
    }
    let mut ack = [0u8];
    s.read_exact(&mut ack).map_err(io("reading the TCP ack"))?;
    let t = start.elapsed();
    reader.join().map_err(|_| ControlBenchError::Unexpected("the TCP reader"))?.map_err(io("the TCP reader"))?;
    Ok(t)
}

/// A raw TLS stream's two ends over `path`, mutually authenticated with a throwaway CA
/// and the node link's rustls configuration: (the listener's, the dialler's).
async fn tls_pair(path: &StreamPath) -> Result<(ServerTls, ClientTls), ControlBenchError> {
    let bad = |_| ControlBenchError::Unexpected("TLS credentials");
    let ca = fabric_nodelink::DomainCa::generate("bench").map_err(bad)?;
    let creds = |node: &str| -> Result<fabric_nodelink::Credentials, ControlBenchError> {
        let pem = ca.issue(node, &[]).map_err(bad)?;
        fabric_nodelink::Credentials::from_pem(&ca.pem().cert, &pem)
            .map_err(|_| ControlBenchError::Unexpected("TLS credentials"))
    };
    let (server, client) = (creds("a")?, creds("b")?);
    let acceptor = tokio_rustls::TlsAcceptor::from(
        server.server_config().map_err(|_| ControlBenchError::Unexpected("TLS server"))?,
    );
    let expected = server.identity().clone();
    let connector = tokio_rustls::TlsConnector::from(
        client.client_config(&expected).map_err(|_| ControlBenchError::Unexpected("TLS client"))?,
    );
    let name = fabric_nodelink::tls::server_name(&expected).map_err(|_| ControlBenchError::Unexpected("TLS name"))?;
    let listener = path.listen().map_err(io("binding a TLS listener"))?;
    listener.set_nonblocking(true).map_err(io("binding a TLS listener"))?;
    let listener = tokio::net::TcpListener::from_std(listener).map_err(io("binding a TLS listener"))?;
    let addr = listener.local_addr().map_err(io("TLS listener address"))?;
    let accepted = async move {
        let (tcp, _) = listener.accept().await?;
        let _ = tcp.set_nodelay(true);
        acceptor.accept(tcp).await
    };
    let tcp = path.connect(addr).map_err(io("connecting over TLS"))?;
    tcp.set_nonblocking(true).map_err(io("connecting over TLS"))?;
    let tcp = tokio::net::TcpStream::from_std(tcp).map_err(io("connecting over TLS"))?;
    let _ = tcp.set_nodelay(true);
    let (server, client) = tokio::join!(accepted, connector.connect(name, tcp));
    Ok((server.map_err(io("the TLS accept"))?, client.map_err(io("the TLS handshake"))?))
}

type ServerTls = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
type ClientTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// The runtime the raw TLS baselines run on: two workers, as the domain runtime has.
fn tls_runtime() -> Result<tokio::runtime::Runtime, ControlBenchError> {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(io("a runtime"))
}

/// The time of a raw TLS stream of `bytes` over `path` (see [`tls_pair`]), to the reader's
/// one-byte acknowledgement.
fn tls_time(path: &StreamPath, bytes: u64) -> Result<Duration, ControlBenchError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tls_runtime()?.block_on(async move {
        let (mut server, mut s) = tls_pair(path).await?;
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 20];
            let mut left = bytes;
            while left > 0 {
                let n = server.read(&mut buf).await?;
                if n == 0 {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                left = left.saturating_sub(n as u64);
            }
            server.write_all(&[1]).await?;
            server.flush().await
        });
        let chunk = vec![0x5au8; 1 << 20];
        let start = Instant::now();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            s.write_all(&chunk[..n]).await.map_err(io("writing the TLS stream"))?;
            left -= n as u64;
        }
        s.flush().await.map_err(io("flushing the TLS stream"))?;
        let mut ack = [0u8];
        s.read_exact(&mut ack).await.map_err(io("reading the TLS ack"))?;
        let t = start.elapsed();
        reader.await.map_err(|_| ControlBenchError::Unexpected("the TLS reader"))?.map_err(io("the TLS reader"))?;
        Ok(t)
    })
}

/// A raw TLS stream on loopback (see [`tls_pair`]) whose listener echoes `len`-byte
/// messages (on a runtime worker; the asker is the calling thread): the least any request
/// over the node link can take on this machine.
pub(crate) struct TlsEcho {
    // Dropped before the runtime it is registered with.
    stream: ClientTls,
    rt: tokio::runtime::Runtime,
    len: usize,
}

impl TlsEcho {
    /// Connects, and starts the echo.
    pub(crate) fn start(len: usize) -> Result<Self, ControlBenchError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tls_runtime()?;
        let (mut server, stream) = rt.block_on(tls_pair(&StreamPath::loopback()))?;
        // Ends with the stream (end of file) or the runtime.
        rt.spawn(async move {
            let mut buf = vec![0u8; len];
            while server.read_exact(&mut buf).await.is_ok() {
                if server.write_all(&buf).await.is_err() || server.flush().await.is_err() {
                    break;
                }
            }
        });
        Ok(Self { stream, rt, len })
    }

    /// `rounds` round trips, each timed.
    pub(crate) fn round_trips(&mut self, rounds: usize) -> Result<Vec<Duration>, ControlBenchError> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (stream, len) = (&mut self.stream, self.len);
        self.rt.block_on(async move {
            let (ask, mut answer) = (vec![0x5au8; len], vec![0u8; len]);
            let mut times = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                let start = Instant::now();
                stream.write_all(&ask).await.map_err(io("writing a TLS message"))?;
                stream.flush().await.map_err(io("flushing a TLS message"))?;
                stream.read_exact(&mut answer).await.map_err(io("reading a TLS echo"))?;
                times.push(start.elapsed());
            }
            Ok(times)
        })
    }
}

fn gbps(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(f64::MIN_POSITIVE) / 1e9
}

/// Runs the network copy benchmark.
pub fn netcopy(opts: &NetCopyOptions) -> Result<NetCopyBench, ControlBenchError> {
    let (bytes, rounds) = (opts.bytes.max(1), opts.rounds.max(1));
    let mut owner = bench_control::connect(&opts.owner)?;
    let mut imp = bench_control::connect(&opts.importer)?;
    let (gpu, address) = own_hbm(&mut owner)?;
    let path = match &opts.netns {
        None => StreamPath::loopback(),
        Some((owner_ns, importer_ns)) => {
            let ip = address
                .as_deref()
                .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
                .map(|a| a.ip())
                .ok_or(ControlBenchError::Unexpected("domain status (the owner's link address is no IP:port)"))?;
            StreamPath::between(owner_ns, importer_ns, ip)?
        }
    };
    let alloc = AllocRequest {
        target: AllocTarget::Device { device: DeviceName::truncated(&gpu), memory: MemoryClass::Hbm },
        size: bytes,
        align: 0,
    };
    let Response::Alloc(a) = call(&mut owner, "alloc", Request::Alloc(alloc), &[])? else {
        return Err(ControlBenchError::Unexpected("alloc"));
    };
    let gfa = a.gfa.ok_or(ControlBenchError::Unexpected("alloc (the region has no GFA)"))?;
    let policy = ExportPolicy {
        uids: BoundedVec::default(),
        gids: BoundedVec::default(),
        partition: None,
        access: AccessMode::ReadWrite,
    };
    let req = Request::Export(ExportRequest { region: a.region, policy, node: None });
    let Response::Export(e) = call(&mut owner, "export", req, &[])? else {
        return Err(ControlBenchError::Unexpected("export"));
    };
    let req = Request::Import(ImportRequest { handle: e.handle, access: AccessMode::ReadWrite });
    let Response::Import(i) = call(&mut imp, "import", req, &[])? else {
        return Err(ControlBenchError::Unexpected("import"));
    };
    let grant = i.grant.map_or_else(|| "none".to_owned(), |g| format!("{:?}", g.access));
    // The importer's memory: a memfd registered for its own HBM device.
    let name = std::ffi::CString::new("netcopy").map_err(|_| ControlBenchError::Unexpected("memfd name"))?;
    // SAFETY: memfd_create takes a NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io("memfd_create")(std::io::Error::last_os_error()));
    }
    // SAFETY: the descriptor was just created and is owned by nothing else.
    let mem = unsafe { std::fs::File::from_raw_fd(fd) };
    mem.set_len(bytes).map_err(io("sizing the memfd"))?;
    let (dev, _) = own_hbm(&mut imp)?;
    let req = Request::Register(RegisterRequest {
        device: DeviceName::truncated(&dev),
        source: RegisterSource::Fd,
        offset: 0,
        len: bytes,
        access: AccessMode::ReadWrite,
        node: None,
    });
    let Response::Register(r) = call(&mut imp, "register", req, &[mem.as_fd()])? else {
        return Err(ControlBenchError::Unexpected("register"));
    };
    let (reg, remote) = (CopyEndpoint::Registration { id: r.registration, offset: 0 }, CopyEndpoint::Gfa(gfa));
    // Warm: links dialled, pages faulted in.
    copy_time(&mut imp, remote, reg, bytes)?;
    copy_time(&mut imp, reg, remote, bytes)?;
    let (mut push, mut pull, mut tcp, mut tls) = (Duration::MAX, Duration::MAX, Duration::MAX, Duration::MAX);
    // Interleaved, so that drift in the machine's load hits all alike.
    for _ in 0..rounds {
        push = push.min(copy_time(&mut imp, remote, reg, bytes)?);
        pull = pull.min(copy_time(&mut imp, reg, remote, bytes)?);
        tcp = tcp.min(tcp_time(&path, bytes)?);
        tls = tls.min(tls_time(&path, bytes)?);
    }
    let (push_gbps, pull_gbps, tcp_gbps, tls_gbps) =
        (gbps(bytes, push), gbps(bytes, pull), gbps(bytes, tcp), gbps(bytes, tls));
    let load_average =
        std::fs::read_to_string("/proc/loadavg").ok().and_then(|s| s.split_whitespace().next()?.parse().ok());
    Ok(NetCopyBench {
        bench: "netcopy",
        bytes,
        rounds,
        grant,
        path: path.describe(),
        push_gbps,
        pull_gbps,
        tcp_gbps,
        tls_gbps,
        netcopy_ratio: push_gbps / tcp_gbps.max(f64::MIN_POSITIVE),
        netcopy_tls_ratio: push_gbps / tls_gbps.max(f64::MIN_POSITIVE),
        load_average,
    })
}
