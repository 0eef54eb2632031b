//! The messages of the node link, as typed enums over the Unix socket's frame header: the
//! header's opcode and kind say which message a frame is, its body is the message's
//! postcard encoding (or, for the request envelope, the operation's own bytes). Decoded by
//! the same sans-IO [`FrameDecoder`](fabric_proto::wire::FrameDecoder) with the peer
//! limits of [`PEER_DECODER`].
//!
//! | message | opcode | kind |
//! |---|---|---|
//! | [`Hello`] | `Hello` | request |
//! | [`Welcome`] | `Hello` | response |
//! | [`Refusal`] | `Hello` | error |
//! | `Ping` / `Pong` | `Ping` | request / response |
//! | [`PeerRequest`] / [`PeerResponse`] / [`PeerFailure`] | the operation's ([`PeerOp`]; `Copy`: `PeerData`) | request / response / error |

use fabric_proto::wire::{
    DecoderConfig, ExtraFds, FrameError, FrameKind, Header, Opcode, PEER_DATA_BODY, encode_frame,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::identity::{IdentityError, check_name};

/// The newest version of the peer protocol this build speaks: what its [`Hello`] offers
/// and the most its [`Welcome`] agrees to.
pub const PEER_PROTOCOL: u16 = 1;
/// The oldest version of the peer protocol this build speaks. Nodes whose ranges meet link
/// at the newest version both speak (a rolling upgrade); others are refused,
/// [`Refusal::Version`].
pub const PEER_PROTOCOL_MIN: u16 = 1;

/// The version a server agrees to with a client whose [`Hello`] offers `offered` (the
/// newest it speaks): the newest both speak, if this build speaks it.
pub fn agree(offered: u16) -> Option<u16> {
    let v = offered.min(PEER_PROTOCOL);
    (v >= PEER_PROTOCOL_MIN).then_some(v)
}

/// The limits of a node link's decoder: any kind (both ends send requests and answers),
/// no descriptors (TCP carries none), bodies up to [`PEER_DATA_BODY`] (a copy chunk, the
/// one data frame: [`PeerOp::Copy`]). Each opcode's own limit is lower still (a `Hello`
/// request, or any control operation's, 256 bytes), and a frame is buffered only as far
/// as it goes.
pub const PEER_DECODER: DecoderConfig =
    DecoderConfig { max_body: PEER_DATA_BODY, expect: None, fds_per_read: 0, extra_fds: ExtraFds::Refuse };

/// The limits of a server's decoder until a connecting node's [`Hello`] is admitted: any
/// frame larger than a `Hello` request stops the stream at its header, so that a peer not
/// admitted yet (a certificate of the domain CA is all it needs) has no larger frame read.
pub const HELLO_DECODER: DecoderConfig = DecoderConfig {
    max_body: Opcode::Hello.max_body(FrameKind::Request),
    expect: None,
    fds_per_read: 0,
    extra_fds: ExtraFds::Refuse,
};

/// The first frame a connecting node sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The domain it believes it joins.
    pub domain: String,
    /// The node it says it is (checked against its certificate).
    pub node: String,
    /// Its incarnation (fresh per start).
    pub incarnation: u64,
    /// The newest peer protocol it speaks ([`PEER_PROTOCOL`]).
    pub version: u16,
}

/// The server's answer to an admitted [`Hello`]: who it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's node name.
    pub node: String,
    /// Its incarnation.
    pub incarnation: u64,
    /// The peer protocol the link speaks ([`agree`]).
    pub version: u16,
}

/// Why a server refuses a [`Hello`]; it closes the link after sending it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    /// The Hello names another domain than the server's.
    #[error("this is domain {ours:?}, not {claimed:?}")]
    WrongDomain {
        /// The server's domain.
        ours: String,
        /// The Hello's.
        claimed: String,
    },
    /// The Hello names another node than the certificate does.
    #[error("the certificate names node {certified:?}, the hello claims {claimed:?}")]
    NotCertified {
        /// The certificate's node.
        certified: String,
        /// The Hello's.
        claimed: String,
    },
    /// The incarnation is not the node's current one (its member record names another).
    #[error("incarnation {offered} of node {node:?} is stale")]
    StaleIncarnation {
        /// The node.
        node: String,
        /// The Hello's incarnation.
        offered: u64,
    },
    /// The node is not a member of the domain now.
    #[error("node {0:?} is not a member of the domain")]
    NotMember(String),
    /// No peer protocol version both sides speak.
    #[error("peer protocol {offered} and older are not spoken here (from {supported} on)")]
    Version {
        /// The newest the Hello offers.
        offered: u16,
        /// The oldest this side speaks.
        supported: u16,
    },
    /// The server holds as many links as it may.
    #[error("the server holds as many links as it may")]
    Busy,
    /// The server does not serve peers now (it is fenced from its domain, or not joined).
    #[error("this node does not serve peers now: {0}")]
    Unavailable(String),
    /// The server holds as many links of this node as one node may have
    /// ([`crate::LinkLimits::max_links_per_node`]), so that no node takes every link.
    /// Last of the variants: an older peer reads it as a message it does not know, which
    /// ends the link all the same.
    #[error("the server holds {max} links of node {node:?}, as many as one node may have")]
    NodeBusy {
        /// The node.
        node: String,
        /// Links one node may have.
        max: u32,
    },
}

/// A cross-node operation carried by the request envelope (the next step gives each its
/// typed body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PeerOp {
    /// Import a region the server owns.
    Import,
    /// Import a vendor memory object the server owns (a CUDA fabric handle), for a node of
    /// the same NVLink domain.
    ImportObject,
    /// Release an import.
    Release,
    /// Revoke an export (told to importers).
    Revoke,
    /// Move bytes over the link: one chunk of a copy, read from or written to a region the
    /// server owns and the client node imported. Its frames are data frames
    /// ([`Opcode::PeerData`], up to [`PEER_DATA_BODY`] bytes).
    Copy,
}

impl PeerOp {
    /// Every operation.
    pub const ALL: [PeerOp; 5] = [PeerOp::Import, PeerOp::ImportObject, PeerOp::Release, PeerOp::Revoke, PeerOp::Copy];

    /// The opcode of its frames.
    pub const fn opcode(self) -> Opcode {
        match self {
            PeerOp::Import => Opcode::Import,
            PeerOp::ImportObject => Opcode::ImportObject,
            PeerOp::Release => Opcode::Release,
            PeerOp::Revoke => Opcode::Revoke,
            PeerOp::Copy => Opcode::PeerData,
        }
    }

    /// The operation of an opcode, if it is one.
    pub fn from_opcode(opcode: Opcode) -> Option<Self> {
        Self::ALL.into_iter().find(|op| op.opcode() == opcode)
    }
}

/// A request envelope: an operation and its body (opaque here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRequest {
    /// The operation.
    pub op: PeerOp,
    /// Its body.
    pub body: Vec<u8>,
}

/// The answer to a [`PeerRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerResponse {
    /// The operation answered.
    pub op: PeerOp,
    /// Its body.
    pub body: Vec<u8>,
}

/// Why a [`PeerRequest`] failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum PeerError {
    /// This node does not serve the operation (yet).
    #[error("{0:?} is not served over the node link by this node")]
    Unsupported(PeerOp),
    /// The operation was refused.
    #[error("refused: {0}")]
    Refused(String),
    /// The operation was refused with the code a local client would get (an invalid
    /// handle, a revoked export, a policy that does not admit the importer).
    #[error("{code:?}: {message}")]
    Denied {
        /// The client protocol's code.
        code: fabric_proto::wire::ErrorCode,
        /// Why.
        message: String,
    },
}

/// A failed request's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFailure {
    /// The operation.
    pub op: PeerOp,
    /// Why.
    pub error: PeerError,
}

/// One message of the node link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMessage {
    /// The client's first frame.
    Hello(Hello),
    /// The server admits it.
    Welcome(Welcome),
    /// The server refuses it.
    Refused(Refusal),
    /// Liveness.
    Ping,
    /// Its answer.
    Pong,
    /// An operation.
    Request(PeerRequest),
    /// Its answer.
    Response(PeerResponse),
    /// Its failure.
    Failure(PeerFailure),
}

/// Why a frame is not a message, or a message not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// The frame's opcode and kind are no message of the node link.
    #[error("a {kind:?} frame of opcode {opcode} is no node-link message")]
    NotPeer {
        /// Its opcode.
        opcode: Opcode,
        /// Its kind.
        kind: FrameKind,
    },
    /// The body does not decode as the message the header says, or has bytes left over.
    #[error("the {opcode} {kind:?} body does not decode: {why}")]
    Body {
        /// Its opcode.
        opcode: Opcode,
        /// Its kind.
        kind: FrameKind,
        /// Why.
        why: String,
    },
    /// A name in the message breaks the domain's naming rule.
    #[error(transparent)]
    Name(#[from] IdentityError),
    /// The message does not fit its frame's limits.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

impl PeerMessage {
    /// The opcode and kind of its frame.
    pub fn frame_type(&self) -> (Opcode, FrameKind) {
        match self {
            PeerMessage::Hello(_) => (Opcode::Hello, FrameKind::Request),
            PeerMessage::Welcome(_) => (Opcode::Hello, FrameKind::Response),
            PeerMessage::Refused(_) => (Opcode::Hello, FrameKind::Error),
            PeerMessage::Ping => (Opcode::Ping, FrameKind::Request),
            PeerMessage::Pong => (Opcode::Ping, FrameKind::Response),
            PeerMessage::Request(r) => (r.op.opcode(), FrameKind::Request),
            PeerMessage::Response(r) => (r.op.opcode(), FrameKind::Response),
            PeerMessage::Failure(f) => (f.op.opcode(), FrameKind::Error),
        }
    }

    /// Appends its frame, with `request_id`, to `out`; refused (nothing appended) when the
    /// body is over its opcode's limit.
    pub fn encode(&self, request_id: u64, out: &mut Vec<u8>) -> Result<(), MessageError> {
        let (opcode, kind) = self.frame_type();
        let body = match self {
            PeerMessage::Hello(h) => postcard::to_stdvec(h),
            PeerMessage::Welcome(w) => postcard::to_stdvec(w),
            PeerMessage::Refused(r) => postcard::to_stdvec(r),
            PeerMessage::Ping | PeerMessage::Pong => Ok(Vec::new()),
            PeerMessage::Request(r) => Ok(r.body.clone()),
            PeerMessage::Response(r) => Ok(r.body.clone()),
            PeerMessage::Failure(f) => postcard::to_stdvec(&f.error),
        }
        .map_err(|e| MessageError::Body { opcode, kind, why: e.to_string() })?;
        encode_frame(&Header::new(opcode, kind, request_id), &body, out)?;
        Ok(())
    }

    /// The message of a checked frame.
    pub fn decode(header: &Header, body: &[u8]) -> Result<Self, MessageError> {
        let (opcode, kind) = (header.opcode, header.kind);
        let not_peer = MessageError::NotPeer { opcode, kind };
        let message = match (opcode, kind) {
            (Opcode::Hello, FrameKind::Request) => {
                let hello: Hello = strict(header, body)?;
                check_name("domain", &hello.domain)?;
                check_name("node", &hello.node)?;
                PeerMessage::Hello(hello)
            }
            (Opcode::Hello, FrameKind::Response) => {
                let welcome: Welcome = strict(header, body)?;
                check_name("node", &welcome.node)?;
                PeerMessage::Welcome(welcome)
            }
            (Opcode::Hello, FrameKind::Error) => PeerMessage::Refused(strict(header, body)?),
            (Opcode::Ping, FrameKind::Request | FrameKind::Response) => {
                if !body.is_empty() {
                    return Err(MessageError::Body { opcode, kind, why: "a ping has no body".into() });
                }
                if kind == FrameKind::Request { PeerMessage::Ping } else { PeerMessage::Pong }
            }
            _ => {
                let op = PeerOp::from_opcode(opcode).ok_or(not_peer.clone())?;
                match kind {
                    FrameKind::Request => PeerMessage::Request(PeerRequest { op, body: body.to_vec() }),
                    FrameKind::Response => PeerMessage::Response(PeerResponse { op, body: body.to_vec() }),
                    FrameKind::Error => PeerMessage::Failure(PeerFailure { op, error: strict(header, body)? }),
                    FrameKind::Event => return Err(not_peer),
                }
            }
        };
        Ok(message)
    }
}

/// The whole body as one `T`, no byte left over.
fn strict<T: DeserializeOwned>(header: &Header, body: &[u8]) -> Result<T, MessageError> {
    let err = |why: String| MessageError::Body { opcode: header.opcode, kind: header.kind, why };
    let (value, rest) = postcard::take_from_bytes::<T>(body).map_err(|e| err(e.to_string()))?;
    if rest.is_empty() { Ok(value) } else { Err(err(format!("{} bytes after the message", rest.len()))) }
}

#[cfg(test)]
mod tests {
    use fabric_proto::wire::FrameDecoder;

    use super::*;

    fn samples() -> Vec<PeerMessage> {
        vec![
            PeerMessage::Hello(Hello {
                domain: "lab".into(),
                node: "n1".into(),
                incarnation: 7,
                version: PEER_PROTOCOL,
            }),
            PeerMessage::Welcome(Welcome { node: "n2".into(), incarnation: 9, version: PEER_PROTOCOL }),
            PeerMessage::Refused(Refusal::StaleIncarnation { node: "n1".into(), offered: 3 }),
            PeerMessage::Refused(Refusal::NodeBusy { node: "n1".into(), max: 16 }),
            PeerMessage::Ping,
            PeerMessage::Pong,
            PeerMessage::Request(PeerRequest { op: PeerOp::Import, body: vec![1, 2, 3] }),
            PeerMessage::Response(PeerResponse { op: PeerOp::Copy, body: vec![] }),
            PeerMessage::Failure(PeerFailure { op: PeerOp::Revoke, error: PeerError::Unsupported(PeerOp::Revoke) }),
        ]
    }

    #[test]
    fn every_message_round_trips_through_the_frame_decoder() {
        let mut bytes = Vec::new();
        for (i, m) in samples().iter().enumerate() {
            m.encode(i as u64, &mut bytes).expect("encode");
        }
        let mut d = FrameDecoder::<std::os::fd::OwnedFd>::new(PEER_DECODER);
        let mut at = 0;
        let mut got = Vec::new();
        while at < bytes.len() || !d.at_boundary() {
            while let Some(f) = d.next_frame() {
                let f = f.expect("frame");
                got.push((f.header.request_id, PeerMessage::decode(&f.header, f.body).expect("message")));
            }
            if at == bytes.len() {
                break;
            }
            at += d.push(&bytes[at..(at + 5).min(bytes.len())], Vec::new(), false);
        }
        while let Some(f) = d.next_frame() {
            let f = f.expect("frame");
            got.push((f.header.request_id, PeerMessage::decode(&f.header, f.body).expect("message")));
        }
        let want: Vec<_> = samples().into_iter().enumerate().map(|(i, m)| (i as u64, m)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn bodies_that_lie_are_refused() {
        let hello = |node: &str| Hello { domain: "lab".into(), node: node.into(), incarnation: 1, version: 1 };
        let header = |opcode, kind, len| Header { body_len: len, ..Header::new(opcode, kind, 1) };
        let mut body = postcard::to_stdvec(&hello("n1")).expect("encode");
        body.push(0);
        let h = header(Opcode::Hello, FrameKind::Request, body.len() as u32);
        assert!(matches!(PeerMessage::decode(&h, &body), Err(MessageError::Body { .. })));
        let body = postcard::to_stdvec(&hello("N1!")).expect("encode");
        let h = header(Opcode::Hello, FrameKind::Request, body.len() as u32);
        assert!(matches!(PeerMessage::decode(&h, &body), Err(MessageError::Name(_))));
        let h = header(Opcode::Ping, FrameKind::Request, 1);
        assert!(matches!(PeerMessage::decode(&h, &[0]), Err(MessageError::Body { .. })));
        let h = header(Opcode::Topology, FrameKind::Request, 0);
        assert!(matches!(PeerMessage::decode(&h, &[]), Err(MessageError::NotPeer { .. })));
        let big = PeerMessage::Request(PeerRequest { op: PeerOp::Import, body: vec![0; 1 << 12] });
        let mut out = Vec::new();
        assert!(matches!(big.encode(1, &mut out), Err(MessageError::Frame(FrameError::BodyTooLarge { .. }))));
        assert!(out.is_empty());
    }
}
