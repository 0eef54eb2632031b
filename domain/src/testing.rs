//! A private etcd for tests: started on 127.0.0.1 with free ports and a temporary data
//! directory, stopped and removed on drop. Never a system service.
//!
//! [`EtcdServer::start`] answers [`TestingError::NotInstalled`] when there is no `etcd`
//! binary, so a test can skip with a message (`scripts/deps.sh` installs Debian's
//! `etcd-server`).

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use etcd_client::Client;

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
}

/// A private etcd process.
#[derive(Debug)]
pub struct EtcdServer {
    child: Child,
    endpoint: String,
    dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts etcd and waits until it answers a request.
    pub async fn start() -> Result<Self, TestingError> {
        let binary = etcd_binary().ok_or(TestingError::NotInstalled)?;
        let mut last = None;
        for _ in 0..START_ATTEMPTS {
            match Self::start_once(&binary).await {
                Ok(server) => return Ok(server),
                Err(e @ TestingError::NotHealthy { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or(TestingError::NotInstalled))
    }

    async fn start_once(binary: &Path) -> Result<Self, TestingError> {
        let dir = tempfile::tempdir()?;
        let (client_port, peer_port) = (free_port()?, free_port()?);
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let log = std::fs::File::create(dir.path().join("etcd.log"))?;
        let child = Command::new(binary)
            .arg("--name=test")
            .arg(format!("--data-dir={}", dir.path().join("data").display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=test={peer_url}"))
            .arg("--logger=zap")
            .arg("--log-outputs=stderr")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        let mut server = Self { child, endpoint: client_url, dir };
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(TestingError::NotHealthy { after: START_TIMEOUT, log: server.log_tail(status) });
            }
            if server.answers().await {
                return Ok(server);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(TestingError::NotHealthy { after: START_TIMEOUT, log: server.log_tail("still running") })
    }

    /// The client URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The directory holding etcd's data and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    async fn answers(&self) -> bool {
        let probe = async {
            let mut client = Client::connect([self.endpoint.as_str()], None).await?;
            client.get("/", None).await
        };
        matches!(tokio::time::timeout(Duration::from_secs(1), probe).await, Ok(Ok(_)))
    }

    fn log_tail(&self, status: impl std::fmt::Display) -> String {
        let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines.get(lines.len().saturating_sub(20)..).unwrap_or_default().join("\n");
        format!("({status})\n{tail}")
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        // Our own child, by its handle: killed and reaped before its directory goes.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `$FABRIC_ETCD`, else `etcd` on `PATH`.
fn etcd_binary() -> Option<PathBuf> {
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
