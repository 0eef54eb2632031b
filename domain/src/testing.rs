//! A private etcd for tests: started on 127.0.0.1 with free ports (or inside a test's
//! network namespace, [`netns`]) and a temporary data directory, stopped and removed on
//! drop; it can be stopped and restarted on the same data. Never a system service.
//!
//! [`EtcdServer::start`] answers [`TestingError::NotInstalled`] when there is no `etcd`
//! binary, so a test can skip with a message (`scripts/deps.sh` installs Debian's
//! `etcd-server`). [`config`] and [`member`] build what a test node needs.

pub mod netns;

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::Client;

use crate::config::DomainConfig;
use crate::records::{FabricGroup, MemberRecord, RECORD_VERSION};
use netns::{NetError, Netns};

/// How long a fresh etcd gets to answer.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a start is retried when a free port was taken meanwhile.
const START_ATTEMPTS: u32 = 3;

/// Errors from starting a private etcd.
#[derive(Debug, thiserror::Error)]
pub enum TestingError {
    /// No `etcd` binary on `PATH` (or at `$FABRIC_ETCD`).
    #[error("etcd is not installed (scripts/deps.sh installs Debian's etcd-server)")]
    NotInstalled,
    /// Setting up the data directory, the ports or the process failed.
    #[error("starting etcd: {0}")]
    Io(#[from] std::io::Error),
    /// etcd did not answer in time.
    #[error("etcd did not answer within {after:?}; its log:\n{log}")]
    NotHealthy {
        /// The wait.
        after: Duration,
        /// The end of etcd's log.
        log: String,
    },
    /// The network namespace harness failed.
    #[error(transparent)]
    Net(#[from] NetError),
}

/// What a private etcd serves its clients with over mutual TLS ([`EtcdServer::start_tls`]):
/// PEM files.
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The CA whose certificates etcd trusts from clients (and which signed `cert`).
    pub ca: PathBuf,
    /// etcd's certificate, naming 127.0.0.1.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// A client certificate and key of the same CA, for the start's readiness probe.
    pub probe: (PathBuf, PathBuf),
}

/// A private etcd process.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    endpoint: String,
    dir: tempfile::TempDir,
    /// The whole command line, to restart it on the same data.
    command: Vec<String>,
    /// The namespace it runs in, when not on loopback.
    netns: Option<Netns>,
    /// Its clients' TLS, when it requires it.
    tls: Option<ServerTls>,
}

impl EtcdServer {
    /// Starts etcd on 127.0.0.1 and waits until it answers a request.
    pub async fn start() -> Result<Self, TestingError> {
        let binary = etcd_binary().ok_or(TestingError::NotInstalled)?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let client_url = format!("http://127.0.0.1:{}", free_port()?);
            let peer_url = format!("http://127.0.0.1:{}", free_port()?);
            let command = vec![binary.display().to_string()];
            match Self::start_once(command, client_url, peer_url, None).await {
                Ok(server) => return Ok(server),
                Err(e @ TestingError::NotHealthy { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(TestingError::NotInstalled))
    }

    /// Starts etcd on 127.0.0.1 serving its clients over TLS only (`https://`), and
    /// requiring a client certificate signed by `tls.ca`; waits until it answers.
    pub async fn start_tls(tls: &ServerTls) -> Result<Self, TestingError> {
        let binary = etcd_binary().ok_or(TestingError::NotInstalled)?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            let client_url = format!("https://127.0.0.1:{}", free_port()?);
            let peer_url = format!("http://127.0.0.1:{}", free_port()?);
            let command = vec![
                binary.display().to_string(),
                format!("--cert-file={}", tls.cert.display()),
                format!("--key-file={}", tls.key.display()),
                format!("--trusted-ca-file={}", tls.ca.display()),
                "--client-cert-auth".to_owned(),
            ];
            match Self::start_with(command, client_url, peer_url, None, Some(tls.clone())).await {
                Ok(server) => return Ok(server),
                Err(e @ TestingError::NotHealthy { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(TestingError::NotInstalled))
    }

    /// Starts etcd inside `ns` (a namespace of a [`netns::Net`]), listening on its
    /// address only, and waits until it answers from there.
    pub async fn start_in(ns: &Netns) -> Result<Self, TestingError> {
        let binary = etcd_binary().ok_or(TestingError::NotInstalled)?;
        ns.check()?;
        let ip = netns::find("ip").ok_or_else(|| NetError::Unavailable("`ip` is not installed".to_owned()))?;
        let command = vec![
            ip.display().to_string(),
            "netns".into(),
            "exec".into(),
            ns.name().into(),
            binary.display().to_string(),
        ];
        let (client_url, peer_url) = (format!("http://{}:2379", ns.addr()), format!("http://{}:2380", ns.addr()));
        Self::start_once(command, client_url, peer_url, Some(ns.clone())).await
    }

    async fn start_once(
        command: Vec<String>,
        client_url: String,
        peer_url: String,
        netns: Option<Netns>,
    ) -> Result<Self, TestingError> {
        Self::start_with(command, client_url, peer_url, netns, None).await
    }

    async fn start_with(
        mut command: Vec<String>,
        client_url: String,
        peer_url: String,
        netns: Option<Netns>,
        tls: Option<ServerTls>,
    ) -> Result<Self, TestingError> {
        let dir = tempfile::tempdir()?;
        command.extend([
            "--name=test".to_owned(),
            format!("--data-dir={}", dir.path().join("data").display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=test={peer_url}"),
            "--logger=zap".to_owned(),
            "--log-outputs=stderr".to_owned(),
        ]);
        let mut server = Self { child: None, endpoint: client_url, dir, command, netns, tls };
        server.spawn_and_wait().await?;
        Ok(server)
    }

    /// Its process id while it runs (to stop it with SIGSTOP and resume it: an etcd that
    /// stops answering without closing its connections).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops etcd (SIGKILL, as a crash would), keeping its data directory.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Our own child, by its handle (`ip netns exec` execs etcd: same pid).
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts etcd again on the same data directory and addresses, and waits until it
    /// answers.
    pub async fn restart(&mut self) -> Result<(), TestingError> {
        self.stop();
        self.spawn_and_wait().await
    }

    async fn spawn_and_wait(&mut self) -> Result<(), TestingError> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("etcd.log"))?;
        let (program, args) = self.command.split_first().ok_or(TestingError::NotInstalled)?;
        let child = Command::new(program).args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(log).spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(TestingError::NotHealthy { after: START_TIMEOUT, log: self.log_tail(status) });
            }
            if self.answers().await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(TestingError::NotHealthy { after: START_TIMEOUT, log: self.log_tail("still running") })
    }

    /// Raises (`true`) or disarms etcd's NOSPACE alarm, as a full backend would: while it
    /// is raised etcd refuses every write (puts, transactions that put, lease grants) and
    /// still serves reads, watches and lease keepalives. Loopback servers only.
    pub async fn space_alarm(&self, raised: bool) -> Result<(), TestingError> {
        use etcd_client::{AlarmAction, AlarmOptions, AlarmType};
        if self.netns.is_some() {
            return Err(TestingError::Io(std::io::Error::other("the alarm is raised on loopback servers only")));
        }
        let failed = |e: etcd_client::Error| TestingError::Io(std::io::Error::other(e));
        let mut client = Client::connect([self.endpoint.as_str()], None).await.map_err(failed)?;
        let status = client.status().await.map_err(failed)?;
        let member = status.header().map_or(0, |h| h.member_id());
        let mut options = AlarmOptions::new();
        options.with_member(member);
        let action = if raised { AlarmAction::Activate } else { AlarmAction::Deactivate };
        client.alarm(action, AlarmType::Nospace, Some(options)).await.map_err(failed)?;
        Ok(())
    }

    /// The client URL (`http://127.0.0.1:PORT`; `https://` from [`EtcdServer::start_tls`]).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The directory holding etcd's data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    async fn answers(&self) -> bool {
        let endpoint = self.endpoint.clone();
        let options = match &self.tls {
            None => None,
            Some(tls) => match probe_tls(tls) {
                Ok(o) => Some(etcd_client::ConnectOptions::new().with_tls(o)),
                Err(_) => return false,
            },
        };
        let probe = || async move {
            let probe = async {
                let mut client = Client::connect([endpoint.as_str()], options).await?;
                client.get("/", None).await
            };
            matches!(tokio::time::timeout(Duration::from_secs(1), probe).await, Ok(Ok(_)))
        };
        match &self.netns {
            None => probe().await,
            // From inside etcd's namespace: its address exists nowhere else.
            Some(ns) => match netns::in_netns(ns, probe) {
                Ok(thread) => {
                    tokio::task::spawn_blocking(move || thread.join().unwrap_or(false)).await.unwrap_or(false)
                }
                Err(_) => false,
            },
        }
    }

    fn log_tail(&self, status: impl std::fmt::Display) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines.get(lines.len().saturating_sub(20)..).unwrap_or_default().join("\n");
        format!("({status})\n{tail}")
    }
}

/// The readiness probe's TLS: `tls.ca` trusted, `tls.probe` as its identity.
fn probe_tls(tls: &ServerTls) -> std::io::Result<etcd_client::TlsOptions> {
    use etcd_client::{Certificate, Identity, TlsOptions};
    let ca = Certificate::from_pem(std::fs::read(&tls.ca)?);
    let identity = Identity::from_pem(std::fs::read(&tls.probe.0)?, std::fs::read(&tls.probe.1)?);
    Ok(TlsOptions::new().ca_certificate(ca).identity(identity))
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        // Our own child, by its handle: killed and reaped before its directory goes.
        self.stop();
    }
}

/// Polls `f` every 50 ms until it answers `Some`, for up to `within`; panics naming `what`
/// past that (domain tests wait for what a watch or a lease brings).
pub fn until<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < within, "{what}: not within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `$FABRIC_ETCD`, else `etcd` on `PATH`.
pub fn etcd_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("FABRIC_ETCD") {
        return Some(PathBuf::from(path)).filter(|p| p.is_file());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join("etcd")).find(|p| p.is_file())
}

/// A port that was free a moment ago (etcd binds it right after; a lost race retries).
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

/// Whether a test may not skip for want of etcd, `ip` or `iptables`: the test command
/// (`scripts/test.sh`, as root, which sets `FABRIC_INSTALL_DEPS=1`) installed them, so a
/// skip there would hide a broken setup behind a passing test.
pub fn skips_refused() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    std::env::var("FABRIC_INSTALL_DEPS").as_deref() == Ok("1") && unsafe { libc::geteuid() } == 0
}

/// Prints `skipped: why`, or panics where [`skips_refused`].
#[allow(clippy::print_stderr)]
pub fn skip(why: &dyn std::fmt::Display) {
    assert!(
        !skips_refused(),
        "{why}; the test command installs it (root with FABRIC_INSTALL_DEPS=1), so this test may not skip"
    );
    eprintln!("skipped: {why}");
}

/// A private etcd on loopback, or `None` after printing `skipped: …` when etcd is not
/// installed (where [`skips_refused`], that panics too; any other failure panics: this is
/// for tests).
pub async fn etcd_or_skip() -> Option<EtcdServer> {
    match EtcdServer::start().await {
        Ok(server) => Some(server),
        Err(TestingError::NotInstalled) => {
            skip(&TestingError::NotInstalled);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// A private net of `nodes` node namespaces ([`netns::Net`]) with etcd started in its own,
/// or `None` after printing `skipped: …` when the namespaces are unavailable (not root, no
/// `ip` or `iptables`) or etcd is not installed (where [`skips_refused`], that panics
/// too); any other failure panics: this is for tests.
pub async fn net_and_etcd_or_skip(nodes: u8) -> Option<(netns::Net, EtcdServer)> {
    let net = match netns::Net::create(nodes) {
        Ok(net) => net,
        Err(NetError::Unavailable(why)) => {
            skip(&why);
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    match EtcdServer::start_in(net.etcd()).await {
        Ok(etcd) => Some((net, etcd)),
        Err(TestingError::NotInstalled) => {
            skip(&TestingError::NotInstalled);
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// A test node's `[domain]` configuration: domain `test` at `endpoint`.
pub fn config(endpoint: &str, node: &str, lease_ttl_secs: u64) -> DomainConfig {
    DomainConfig {
        name: "test".into(),
        endpoints: vec![endpoint.to_owned()],
        tls: None,
        node: node.into(),
        lease_ttl_secs,
        data_paths: None,
    }
}

/// A valid member record for `node`, with a fresh incarnation.
pub fn member(node: &str) -> MemberRecord {
    MemberRecord {
        version: RECORD_VERSION,
        name: node.into(),
        incarnation: crate::fresh_incarnation(),
        peer_address: "127.0.0.1:7400".into(),
        capabilities: vec!["shared-file".into()],
        groups: vec![FabricGroup::CxlPool { pool: "pool-0".into() }],
        software: env!("CARGO_PKG_VERSION").into(),
        node_id: None,
    }
}
