//! A test domain on 127.0.0.1: one CA, a server node `n1`, member nodes, and a well-behaved
//! peer that must keep getting its Pong while others misbehave.

#![allow(dead_code, reason = "each test binary uses part of it")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fabric_nodelink::framed::Framed;
use fabric_nodelink::{
    Credentials, DomainCa, Hello, Link, LinkLimits, LinkStats, NodeIdentity, PEER_PROTOCOL, PeerMessage, PeerPolicy,
    Refusal, San, Server,
};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

pub const DOMAIN: &str = "lab";
pub const SERVER_INCARNATION: u64 = 100;
/// How soon the well-behaved peer's Pong must come (generous: the test machine is shared).
pub const PROMPT: Duration = Duration::from_secs(1);

/// The members' current incarnations, as etcd's member records would say.
#[derive(Debug, Default)]
pub struct Members(Mutex<HashMap<String, u64>>);

impl Members {
    pub fn set(&self, node: &str, incarnation: u64) {
        self.0.lock().expect("members").insert(node.to_owned(), incarnation);
    }
}

impl PeerPolicy for Members {
    fn admit(&self, node: &NodeIdentity, incarnation: u64) -> Result<(), Refusal> {
        match self.0.lock().expect("members").get(&node.node) {
            None => Err(Refusal::NotMember(node.node.clone())),
            Some(&current) if current == incarnation => Ok(()),
            Some(_) => Err(Refusal::StaleIncarnation { node: node.node.clone(), offered: incarnation }),
        }
    }
}

pub fn limits() -> LinkLimits {
    LinkLimits {
        max_handshakes: 4,
        max_links: 8,
        max_links_per_node: 8,
        handshake_timeout: Duration::from_millis(1500),
        frame_timeout: Duration::from_millis(1000),
        idle_timeout: Duration::from_secs(5),
    }
}

pub struct TestDomain {
    pub ca: DomainCa,
    pub members: Arc<Members>,
    pub server: Server,
    pub server_id: NodeIdentity,
}

impl TestDomain {
    /// A domain whose node `n1` serves with `limits`; `good` and `n2`, `n3` are members at
    /// incarnation 1.
    pub async fn start(limits: LinkLimits) -> Self {
        let ca = DomainCa::generate(DOMAIN).expect("ca");
        let members = Arc::new(Members::default());
        for node in ["good", "n2", "n3"] {
            members.set(node, 1);
        }
        let server_creds = creds(&ca, "n1");
        let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let server =
            Server::bind(addr, &server_creds, SERVER_INCARNATION, members.clone(), limits).await.expect("server");
        Self { ca, members, server, server_id: server_creds.identity().clone() }
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    pub fn creds(&self, node: &str) -> Credentials {
        creds(&self.ca, node)
    }

    /// A link as `node` at incarnation 1.
    pub async fn link(&self, node: &str) -> Result<Link, fabric_nodelink::LinkError> {
        Link::connect(self.addr(), &self.creds(node), &self.server_id, 1, limits()).await
    }

    /// Waits (up to 3 s) until the server's counters are `want` (they change on the
    /// server's tasks, a little after the client sees the outcome).
    pub async fn wait_stats(&self, want: LinkStats) {
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.server.stats() != want && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(self.server.stats(), want);
    }

    /// The well-behaved peer, linked.
    pub async fn good_peer(&self) -> Link {
        let mut link = self.link("good").await.expect("the good peer links");
        assert_pong(&mut link).await;
        link
    }

    /// A TLS connection as `node` that sent `hello` and read the server's answer.
    pub async fn raw_tls(&self, node: &str) -> tokio_rustls::client::TlsStream<TcpStream> {
        let creds = self.creds(node);
        let connector = TlsConnector::from(creds.client_config(&self.server_id).expect("config"));
        let tcp = TcpStream::connect(self.addr()).await.expect("connect");
        let name = fabric_nodelink::tls::server_name(&self.server_id).expect("name");
        connector.connect(name, tcp).await.expect("tls")
    }

    /// A raw stream admitted as `good`-like member `node` (Hello sent, Welcome read).
    pub async fn raw_admitted(&self, node: &str) -> tokio_rustls::client::TlsStream<TcpStream> {
        let mut framed = Framed::new(self.raw_tls(node).await, Duration::from_secs(1));
        let hello = Hello { domain: DOMAIN.into(), node: node.into(), incarnation: 1, version: PEER_PROTOCOL };
        framed.send(0, &PeerMessage::Hello(hello)).await.expect("hello");
        let (_, answer) = framed.recv(Duration::from_secs(1)).await.expect("answer");
        assert!(matches!(answer, PeerMessage::Welcome(_)), "{answer:?}");
        framed.into_inner()
    }
}

pub fn creds(ca: &DomainCa, node: &str) -> Credentials {
    let pem = ca.issue(node, &[San::Dns("localhost".into())]).expect("issue");
    Credentials::from_pem(&ca.pem().cert, &pem).expect("creds")
}

/// The peer answers a ping promptly.
pub async fn assert_pong(link: &mut Link) {
    let rtt = tokio::time::timeout(PROMPT, link.ping()).await.expect("the pong came promptly").expect("pong");
    assert!(rtt < PROMPT, "{rtt:?}");
}

/// Reads until the server closes the stream (end of stream or an error such as a TLS
/// alert or a reset); panics if it sends a whole message's worth of bytes meanwhile or does
/// not close within `within`. Returns how long it took.
pub async fn closed_by_server<S: AsyncRead + Unpin>(stream: &mut S, within: Duration) -> Duration {
    let start = Instant::now();
    let mut buf = [0u8; 256];
    let mut got = 0;
    loop {
        match tokio::time::timeout_at((start + within).into(), stream.read(&mut buf)).await {
            Err(_) => panic!("the server did not close the stream within {within:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
            Ok(Ok(n)) => {
                got += n;
                assert!(got < 64, "the server kept sending ({got} bytes)");
            }
        }
    }
}
