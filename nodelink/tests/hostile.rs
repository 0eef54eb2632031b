//! Hostile peers on 127.0.0.1 are refused without harm to anyone else: in every test a
//! well-behaved peer linked at the same time still gets its Pong promptly, and the server
//! keeps admitting afterwards.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TestDomain, assert_pong, closed_by_server, limits};
use fabric_nodelink::{
    Credentials, DomainCa, Hello, LinkError, LinkLimits, LinkStats, PEER_PROTOCOL, PeerError, PeerOp, PeerRequest,
    Refusal,
};
use fabric_proto::wire::{FrameKind, Header, Opcode};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// Time for the server to notice and close, beyond its own timeout.
const SLACK: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_links_pings_and_is_told_requests_are_not_served_yet() {
    let d = TestDomain::start(limits()).await;
    let mut link = d.link("n2").await.expect("link");
    assert_eq!(link.peer(), &d.server_id);
    assert_eq!(link.peer_incarnation(), common::SERVER_INCARNATION);
    assert_pong(&mut link).await;
    let answer = link.call(PeerRequest { op: PeerOp::Import, body: vec![1, 2, 3] }).await;
    assert!(matches!(answer, Err(LinkError::Peer(PeerError::Unsupported(PeerOp::Import)))), "{answer:?}");
    assert_pong(&mut link).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_refuses_a_server_that_is_not_the_expected_node() {
    let d = TestDomain::start(limits()).await;
    let creds = d.creds("n2");
    let wrong = fabric_nodelink::NodeIdentity::new(common::DOMAIN, "n3").expect("id");
    let r = fabric_nodelink::Link::connect(d.addr(), &creds, &wrong, 1, limits()).await;
    assert!(matches!(r, Err(LinkError::Io(_))), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_client_certificate() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(d.ca.pem().cert.as_bytes()) {
        roots.add(cert.expect("ca")).expect("root");
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(d.addr()).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    // TLS 1.3: the client may finish first; the server's refusal arrives as an alert.
    if let Ok(mut tls) = connector.connect(name, tcp).await {
        let mut hello = Vec::new();
        let h = Hello { domain: common::DOMAIN.into(), node: "n2".into(), incarnation: 1, version: PEER_PROTOCOL };
        fabric_nodelink::PeerMessage::Hello(h).encode(0, &mut hello).expect("encode");
        let _ = tls.write_all(&hello).await;
        closed_by_server(&mut tls, SLACK).await;
    }
    d.wait_stats(LinkStats { admitted: 1, failed: 1, ..LinkStats::default() }).await;
    assert_pong(&mut good).await;
    d.link("n2").await.expect("the server still admits");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    // Same domain name, another CA: the node's certificate is not the domain's.
    let other = DomainCa::generate(common::DOMAIN).expect("other ca");
    let pem = other.issue("n2", &[]).expect("issue");
    let creds = Credentials::from_pem(&d.ca.pem().cert, &pem).expect("creds");
    let r = fabric_nodelink::Link::connect(d.addr(), &creds, &d.server_id, 1, limits()).await;
    assert!(matches!(r, Err(LinkError::Io(_) | LinkError::Closed)), "{r:?}");
    d.wait_stats(LinkStats { admitted: 1, failed: 1, ..LinkStats::default() }).await;
    assert_pong(&mut good).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_node_claiming_to_be_another() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    let hello = Hello { domain: common::DOMAIN.into(), node: "n2".into(), incarnation: 1, version: PEER_PROTOCOL };
    let r = fabric_nodelink::Link::connect_with(d.addr(), &d.creds("n3"), &d.server_id, hello, limits()).await;
    match r {
        Err(LinkError::Refused(Refusal::NotCertified { certified, claimed })) => {
            assert_eq!((certified.as_str(), claimed.as_str()), ("n3", "n2"));
        }
        other => panic!("{other:?}"),
    }
    // Another domain in the Hello, with a valid certificate.
    let hello = Hello { domain: "elsewhere".into(), node: "n3".into(), incarnation: 1, version: PEER_PROTOCOL };
    let r = fabric_nodelink::Link::connect_with(d.addr(), &d.creds("n3"), &d.server_id, hello, limits()).await;
    assert!(matches!(r, Err(LinkError::Refused(Refusal::WrongDomain { .. }))), "{r:?}");
    d.wait_stats(LinkStats { admitted: 1, refused: 2, ..LinkStats::default() }).await;
    assert_pong(&mut good).await;
}

/// A newer node (offering a protocol this build does not know yet) links at the newest
/// both speak, as in a rolling upgrade; one offering only versions older than any spoken
/// here is refused, naming the oldest this side speaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_versions_are_agreed_within_both_ranges() {
    let d = TestDomain::start(limits()).await;
    let hello = |version| Hello { domain: common::DOMAIN.into(), node: "n3".into(), incarnation: 1, version };
    let mut newer = fabric_nodelink::Link::connect_with(d.addr(), &d.creds("n3"), &d.server_id, hello(7), limits())
        .await
        .expect("a newer node links");
    assert_eq!(newer.version(), PEER_PROTOCOL, "at the newest both speak");
    assert_pong(&mut newer).await;
    let r = fabric_nodelink::Link::connect_with(d.addr(), &d.creds("n3"), &d.server_id, hello(0), limits()).await;
    match r {
        Err(LinkError::Refused(Refusal::Version { offered, supported })) => {
            assert_eq!((offered, supported), (0, fabric_nodelink::PEER_PROTOCOL_MIN));
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_incarnation_and_a_non_member() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    d.members.set("n3", 2);
    let r = fabric_nodelink::Link::connect(d.addr(), &d.creds("n3"), &d.server_id, 1, limits()).await;
    assert!(matches!(r, Err(LinkError::Refused(Refusal::StaleIncarnation { offered: 1, .. }))), "{r:?}");
    let r = fabric_nodelink::Link::connect(d.addr(), &d.creds("n9"), &d.server_id, 1, limits()).await;
    assert!(matches!(r, Err(LinkError::Refused(Refusal::NotMember(_)))), "{r:?}");
    // The current incarnation is admitted.
    fabric_nodelink::Link::connect(d.addr(), &d.creds("n3"), &d.server_id, 2, limits()).await.expect("current");
    d.wait_stats(LinkStats { admitted: 2, refused: 2, ..LinkStats::default() }).await;
    assert_pong(&mut good).await;
}

fn raw_header(opcode: Opcode, kind: FrameKind, body_len: u32) -> Vec<u8> {
    let header = Header { body_len, ..Header::new(opcode, kind, 1) };
    zerocopy::IntoBytes::as_bytes(&header.to_raw()).to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_the_handshake() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    let mut bad_magic = raw_header(Opcode::Ping, FrameKind::Request, 0);
    bad_magic[..4].copy_from_slice(b"EVIL");
    let oversized = raw_header(Opcode::Ping, FrameKind::Request, 16 << 20);
    let mut not_peer = raw_header(Opcode::Topology, FrameKind::Request, 0);
    not_peer.extend_from_slice(&raw_header(Opcode::Ping, FrameKind::Request, 0));
    let mut lying_body = raw_header(Opcode::Ping, FrameKind::Request, 3);
    lying_body.extend_from_slice(b"abc");
    for garbage in [bad_magic, oversized, not_peer, lying_body] {
        let mut tls = d.raw_admitted("n2").await;
        tls.write_all(&garbage).await.expect("write");
        tls.flush().await.expect("flush");
        let took = closed_by_server(&mut tls, SLACK).await;
        assert!(took < limits().frame_timeout, "closed at once, not by a timeout: {took:?}");
        assert_pong(&mut good).await;
    }
    // A truncated frame: half a header, then the write side closed.
    let mut tls = d.raw_admitted("n2").await;
    tls.write_all(&raw_header(Opcode::Ping, FrameKind::Request, 0)[..10]).await.expect("write");
    tls.shutdown().await.expect("shutdown");
    closed_by_server(&mut tls, SLACK).await;
    assert_pong(&mut good).await;
}

/// Before its Hello is admitted a peer holding a certificate of the domain CA (a node
/// that is no member, or no longer one) has no frame larger than a Hello's read: a copy
/// chunk's header in its place closes the link at once. Before, the server waited for
/// the chunk's megabyte (buffering it) until the frame timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_frame_larger_than_a_hello_is_read_before_the_hello() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    for kind in [FrameKind::Request, FrameKind::Response] {
        let mut tls = d.raw_tls("n9").await;
        let mut chunk = raw_header(Opcode::PeerData, kind, fabric_proto::wire::PEER_DATA_BODY);
        chunk.extend_from_slice(&[0u8; 4096]);
        tls.write_all(&chunk).await.expect("write");
        tls.flush().await.expect("flush");
        let took = closed_by_server(&mut tls, SLACK).await;
        assert!(took < limits().frame_timeout, "{kind:?}: closed at once, not by a timeout: {took:?}");
        assert_pong(&mut good).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_instead_of_a_client_hello() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    for garbage in
        [&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &[0x16, 0x03, 0x01, 0xff, 0xff, 0, 0, 0][..], &[0u8; 300][..]]
    {
        let mut tcp = TcpStream::connect(d.addr()).await.expect("connect");
        tcp.write_all(garbage).await.expect("write");
        closed_by_server(&mut tcp, SLACK + limits().handshake_timeout).await;
        assert_pong(&mut good).await;
    }
    d.wait_stats(LinkStats { admitted: 1, failed: 3, ..LinkStats::default() }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_connections_beyond_the_limit() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    let (max, excess) = (limits().max_handshakes, 20);
    let start = Instant::now();
    let mut flood = Vec::new();
    for _ in 0..max + excess {
        flood.push(TcpStream::connect(d.addr()).await.expect("connect"));
    }
    assert_pong(&mut good).await;
    // Those beyond the limit are closed at once, well before the handshake timeout; the
    // `max` being admitted stay open until it.
    let mut closed = vec![false; flood.len()];
    let early = start + limits().handshake_timeout * 2 / 3;
    while closed.iter().filter(|c| **c).count() < excess && Instant::now() < early {
        for (tcp, closed) in flood.iter_mut().zip(closed.iter_mut()) {
            if !*closed {
                *closed = closed_now(tcp).await;
            }
        }
    }
    let at_once = closed.iter().filter(|c| **c).count();
    assert_eq!(at_once, excess, "closed before the handshake timeout");
    assert_pong(&mut good).await;
    for tcp in &mut flood {
        closed_by_server(tcp, limits().handshake_timeout + SLACK).await;
    }
    assert!(start.elapsed() + Duration::from_millis(200) >= limits().handshake_timeout);
    d.wait_stats(LinkStats {
        admitted: 1,
        closed_at_accept: excess as u64,
        failed: max as u64,
        ..LinkStats::default()
    })
    .await;
    assert_pong(&mut good).await;
    let mut late = d.link("n2").await.expect("the server admits after the flood");
    assert_pong(&mut late).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_one_address_does_not_keep_another_addresss_peer_out() {
    let d = TestDomain::start(limits()).await;
    let max = limits().max_handshakes;
    // Every slot held by silent connections from 127.0.0.2, then more from there.
    let mut flood = Vec::new();
    for _ in 0..max + 3 {
        flood.push(connect_from([127, 0, 0, 2], &d).await);
    }
    d.wait_stats(LinkStats { closed_at_accept: 3, ..LinkStats::default() }).await;
    // A peer on 127.0.0.1 links during the flood, well before the flood's handshakes time
    // out: it took the flood's oldest slot.
    let start = Instant::now();
    let mut peer = d.link("n2").await.expect("a peer from another address gets in during the flood");
    assert_pong(&mut peer).await;
    assert!(start.elapsed() < limits().handshake_timeout / 2, "{:?}", start.elapsed());
    closed_by_server(&mut flood[0], SLACK).await;
    assert!(!closed_now(&mut flood[1]).await, "the others keep their slots until their timeout");
    // The peer's slot is free again; the flood's address takes it, and gets no more.
    let mut refill = connect_from([127, 0, 0, 2], &d).await;
    let mut more = connect_from([127, 0, 0, 2], &d).await;
    closed_by_server(&mut more, SLACK).await;
    d.wait_stats(LinkStats { admitted: 1, closed_at_accept: 4, ended_for_another: 1, ..LinkStats::default() }).await;
    for tcp in flood[1..max].iter_mut().chain([&mut refill]) {
        closed_by_server(tcp, limits().handshake_timeout + SLACK).await;
    }
    assert_pong(&mut peer).await;
    d.wait_stats(LinkStats { admitted: 1, closed_at_accept: 4, ended_for_another: 1, failed: max as u64, refused: 0 })
        .await;
}

/// A flood spread over more addresses than there are handshake slots (one each, so the
/// per-address rule ends none) does not keep out a peer from an address a member of the
/// domain advertises: it takes the oldest unknown slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_from_many_addresses_does_not_keep_a_members_address_out() {
    let d = TestDomain::start(limits()).await;
    d.server.set_member_addresses([std::net::IpAddr::from([127, 0, 0, 1])]);
    let max = limits().max_handshakes;
    let mut flood = Vec::new();
    for i in 0..max + 2 {
        flood.push(connect_from([127, 0, 0, 2 + i as u8], &d).await);
    }
    d.wait_stats(LinkStats { closed_at_accept: 2, ..LinkStats::default() }).await;
    let start = Instant::now();
    let mut peer = d.link("n2").await.expect("a member's address gets in during the flood");
    assert_pong(&mut peer).await;
    assert!(start.elapsed() < limits().handshake_timeout / 2, "{:?}", start.elapsed());
    closed_by_server(&mut flood[0], SLACK).await;
    assert!(!closed_now(&mut flood[1]).await, "the others keep their slots until their timeout");
    d.wait_stats(LinkStats { admitted: 1, closed_at_accept: 2, ended_for_another: 1, ..LinkStats::default() }).await;
}

/// A TCP connection to the server from `source` (another loopback address: all of
/// 127.0.0.0/8 is this host's).
async fn connect_from(source: [u8; 4], d: &TestDomain) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind(std::net::SocketAddr::from((source, 0))).expect("bind to a loopback address");
    socket.connect(d.addr()).await.expect("connect")
}

/// Whether the server has closed `tcp` (read within 10 ms gives end of stream or an error).
async fn closed_now(tcp: &mut TcpStream) -> bool {
    let mut buf = [0u8; 16];
    match tokio::time::timeout(Duration::from_millis(10), tokio::io::AsyncReadExt::read(tcp, &mut buf)).await {
        Err(_) => false,
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(n)) => panic!("the server sent {n} bytes to a silent connection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_beyond_the_limit_are_refused_busy() {
    let d = TestDomain::start(LinkLimits { max_links: 2, ..limits() }).await;
    let mut good = d.good_peer().await;
    let _second = d.link("n2").await.expect("second link");
    let r = d.link("n3").await;
    assert!(matches!(r, Err(LinkError::Refused(Refusal::Busy))), "{r:?}");
    d.wait_stats(LinkStats { admitted: 2, refused: 1, ..LinkStats::default() }).await;
    drop(_second);
    // The slot comes back once the server sees the link closed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    d.link("n3").await.expect("a slot came back");
    assert_pong(&mut good).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_of_one_node_beyond_its_share_are_refused_and_others_still_link() {
    let d = TestDomain::start(LinkLimits { max_links: 5, max_links_per_node: 2, ..limits() }).await;
    let mut good = d.good_peer().await;
    let first = d.link("n2").await.expect("n2's first link");
    let _second = d.link("n2").await.expect("n2's second link");
    let r = d.link("n2").await;
    assert!(matches!(&r, Err(LinkError::Refused(Refusal::NodeBusy { node, max: 2 })) if node == "n2"), "{r:?}");
    // Another node is not held back by n2's links, and its refusal took no link of all.
    let _third = d.link("n3").await.expect("n3 links");
    let _fourth = d.link("n3").await.expect("n3's second link");
    d.wait_stats(LinkStats { admitted: 5, refused: 1, ..LinkStats::default() }).await;
    // n2's share comes back once the server sees one of its links closed.
    drop(first);
    tokio::time::sleep(Duration::from_millis(200)).await;
    d.link("n2").await.expect("n2's share came back");
    assert_pong(&mut good).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalls_are_cut_off() {
    let d = TestDomain::start(limits()).await;
    let mut good = d.good_peer().await;
    let l = limits();

    // Connects and sends nothing: closed by the handshake timeout.
    let connected = Instant::now();
    let mut silent = TcpStream::connect(d.addr()).await.expect("connect");
    // TLS done, no Hello: the same.
    let mut no_hello = d.raw_tls("n2").await;
    // Admitted, then stops in the middle of a frame: closed by the frame timeout.
    let mut mid_frame = d.raw_admitted("n3").await;
    mid_frame.write_all(&raw_header(Opcode::Ping, FrameKind::Request, 0)[..20]).await.expect("write");
    mid_frame.flush().await.expect("flush");

    for _ in 0..4 {
        assert_pong(&mut good).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    closed_by_server(&mut silent, l.handshake_timeout + SLACK).await;
    let took = connected.elapsed();
    assert!(took + Duration::from_millis(100) >= l.handshake_timeout, "closed by the timeout, not before: {took:?}");
    closed_by_server(&mut no_hello, l.handshake_timeout + SLACK).await;
    closed_by_server(&mut mid_frame, l.frame_timeout + SLACK).await;
    d.wait_stats(LinkStats { admitted: 2, failed: 2, ..LinkStats::default() }).await;
    assert_pong(&mut good).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_link_is_closed_and_the_client_says_why() {
    let short = LinkLimits { idle_timeout: Duration::from_millis(300), ..limits() };
    let d = TestDomain::start(short).await;
    let mut link = d.link("n2").await.expect("link");
    tokio::time::sleep(Duration::from_millis(900)).await;
    let r = link.ping().await;
    assert!(matches!(r, Err(LinkError::Closed | LinkError::Io(_))), "{r:?}");
}
