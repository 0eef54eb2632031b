//! Body encoding: postcard (compact, not self-describing, varint integers) of the struct an
//! opcode and frame kind name, with no trailing bytes allowed. Decoding is total: any byte
//! string gives a typed value or a [`BodyError`], and bounded types refuse over-long
//! strings and lists before allocating them.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::event::Event;
use super::handle::SessionToken;
use super::header::{FrameError, FrameKind, HEADER_LEN, Header, encode_frame};
use super::node::{Coherence, Grant, NodeId};
use super::opcode::Opcode;
use super::request::{
    ExportRequest, FreeRequest, HelloRequest, ImportRequest, RegisterRequest, Request, RevokeRequest,
};
use super::response::{
    AllocResponse, ErrorBody, ExportResponse, HelloResponse, ImportObjectResponse, ImportResponse, Response,
};

/// A decoded body of any kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A request.
    Request(Request),
    /// A successful response.
    Response(Response),
    /// An error response.
    Error(ErrorBody),
    /// An event.
    Event(Event),
}

impl Message {
    /// The kind of frame that carries it.
    pub fn kind(&self) -> FrameKind {
        match self {
            Message::Request(_) => FrameKind::Request,
            Message::Response(_) => FrameKind::Response,
            Message::Error(_) => FrameKind::Error,
            Message::Event(_) => FrameKind::Event,
        }
    }

    /// The opcode, when the body determines it (errors answer any opcode).
    pub fn opcode(&self) -> Option<Opcode> {
        match self {
            Message::Request(r) => Some(r.opcode()),
            Message::Response(r) => Some(r.opcode()),
            Message::Error(_) => None,
            Message::Event(_) => Some(Opcode::Subscribe),
        }
    }

    /// Descriptors that must travel with it.
    pub fn fds_required(&self) -> u8 {
        match self {
            Message::Request(r) => r.fds_required(),
            Message::Response(r) => r.fds_required(),
            Message::Error(_) | Message::Event(_) => 0,
        }
    }
}

/// Why a body does not encode or decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The bytes are not a valid body for the opcode and kind.
    #[error("{opcode} {kind:?} body does not decode")]
    Decode {
        /// Opcode.
        opcode: Opcode,
        /// Frame kind.
        kind: FrameKind,
        /// What postcard found.
        #[source]
        source: postcard::Error,
    },
    /// A valid body followed by more bytes.
    #[error("{opcode} {kind:?} body has {extra} trailing bytes")]
    TrailingBytes {
        /// Opcode.
        opcode: Opcode,
        /// Frame kind.
        kind: FrameKind,
        /// Bytes left over.
        extra: usize,
    },
    /// The body slice is not as long as the header says.
    #[error("body is {actual} bytes, header announced {announced}")]
    LengthMismatch {
        /// From the header.
        announced: u32,
        /// Given.
        actual: usize,
    },
    /// An event frame under an opcode other than `Subscribe`.
    #[error("{opcode} frames carry no events")]
    NotAnEventOpcode {
        /// Opcode.
        opcode: Opcode,
    },
    /// A node-link-only opcode ([`Opcode::PeerData`]) in a client frame.
    #[error("{opcode} frames travel only between nodes")]
    PeerOnly {
        /// Opcode.
        opcode: Opcode,
    },
    /// The header does not fit the message (kind or opcode).
    #[error("header says {opcode} {kind:?}, message is another")]
    HeaderMismatch {
        /// Opcode in the header.
        opcode: Opcode,
        /// Kind in the header.
        kind: FrameKind,
    },
    /// The body could not be serialised.
    #[error("body does not encode")]
    Encode(#[source] postcard::Error),
    /// The frame around the body is refused (too large, too many descriptors).
    #[error(transparent)]
    Frame(#[from] FrameError),
}

fn from_body<T: DeserializeOwned>(opcode: Opcode, kind: FrameKind, bytes: &[u8]) -> Result<T, BodyError> {
    let (value, rest) =
        postcard::take_from_bytes::<T>(bytes).map_err(|source| BodyError::Decode { opcode, kind, source })?;
    if !rest.is_empty() {
        return Err(BodyError::TrailingBytes { opcode, kind, extra: rest.len() });
    }
    Ok(value)
}

/// A fixed-length value that a later minor version appends to a frozen body: the session
/// token of `Hello` (1.1), the node of a handle (1.5), the node of a region a request names
/// (1.8). A response's grant (1.5, grown by a byte in 1.9) has [`with_grant`] of its own.
trait Trailer: DeserializeOwned {
    /// Its encoded length.
    const LEN: usize;
}

impl Trailer for SessionToken {
    const LEN: usize = size_of::<SessionToken>();
}

impl Trailer for NodeId {
    const LEN: usize = NodeId::LEN;
}

/// A body whose frozen form may be followed by one trailer `X`: the frozen prefix, then
/// nothing or exactly the trailer's bytes.
fn with_trailer<T: DeserializeOwned, X: Trailer>(
    opcode: Opcode,
    kind: FrameKind,
    bytes: &[u8],
) -> Result<(T, Option<X>), BodyError> {
    let (value, rest) = frozen::<T>(opcode, kind, bytes)?;
    if rest.is_empty() {
        return Ok((value, None));
    }
    // Anything but exactly one trailer after the frozen body is trailing bytes.
    if rest.len() != X::LEN {
        return Err(BodyError::TrailingBytes { opcode, kind, extra: rest.len() });
    }
    let trailer = from_body::<X>(opcode, kind, rest)?;
    Ok((value, Some(trailer)))
}

fn hello_request(bytes: &[u8]) -> Result<HelloRequest, BodyError> {
    let (mut req, token) = with_trailer::<HelloRequest, _>(Opcode::Hello, FrameKind::Request, bytes)?;
    req.resume = token;
    Ok(req)
}

fn hello_response(bytes: &[u8]) -> Result<HelloResponse, BodyError> {
    let (mut resp, token) = with_trailer::<HelloResponse, _>(Opcode::Hello, FrameKind::Response, bytes)?;
    resp.token = token;
    Ok(resp)
}

/// A body whose frozen form may be followed by a node (the handle's since 1.5, the
/// region's since 1.8), put where `node` says.
fn with_node<T: DeserializeOwned>(
    opcode: Opcode,
    kind: FrameKind,
    bytes: &[u8],
    node: impl FnOnce(&mut T) -> &mut Option<NodeId>,
) -> Result<T, BodyError> {
    let (mut value, n) = with_trailer::<T, NodeId>(opcode, kind, bytes)?;
    *node(&mut value) = n;
    Ok(value)
}

/// The frozen body of a message, and the bytes after it.
fn frozen<T: DeserializeOwned>(opcode: Opcode, kind: FrameKind, bytes: &[u8]) -> Result<(T, &[u8]), BodyError> {
    postcard::take_from_bytes::<T>(bytes).map_err(|source| BodyError::Decode { opcode, kind, source })
}

/// A response that hands memory over, and its grant after it (1.5): nothing, the 1.5
/// grant, or the 1.5 grant and its coherence's code (1.9).
fn with_grant<T: DeserializeOwned>(
    opcode: Opcode,
    bytes: &[u8],
    grant: impl FnOnce(&mut T) -> &mut Option<Grant>,
) -> Result<T, BodyError> {
    let kind = FrameKind::Response;
    let (mut value, rest) = frozen::<T>(opcode, kind, bytes)?;
    let g = match rest.len() {
        0 => None,
        Grant::LEN => Some(from_body::<Grant>(opcode, kind, rest)?),
        Grant::LEN_COHERENCE => {
            let (g, c) = rest.split_at(Grant::LEN);
            Some(from_body::<Grant>(opcode, kind, g)?.with_coherence(from_body::<Coherence>(opcode, kind, c)?))
        }
        extra => return Err(BodyError::TrailingBytes { opcode, kind, extra }),
    };
    *grant(&mut value) = g;
    Ok(value)
}

fn import_request(opcode: Opcode, bytes: &[u8]) -> Result<ImportRequest, BodyError> {
    with_node(opcode, FrameKind::Request, bytes, |r: &mut ImportRequest| &mut r.handle.node)
}

fn alloc_response(opcode: Opcode, bytes: &[u8]) -> Result<AllocResponse, BodyError> {
    with_grant(opcode, bytes, |r: &mut AllocResponse| &mut r.grant)
}

/// Decodes a request body of `opcode`.
pub fn decode_request(opcode: Opcode, bytes: &[u8]) -> Result<Request, BodyError> {
    let k = FrameKind::Request;
    Ok(match opcode {
        Opcode::Hello => Request::Hello(hello_request(bytes)?),
        Opcode::Status => Request::Status(from_body(opcode, k, bytes)?),
        Opcode::Ping => from_body::<()>(opcode, k, bytes).map(|()| Request::Ping)?,
        Opcode::Topology => Request::Topology(from_body(opcode, k, bytes)?),
        Opcode::Devices => Request::Devices(from_body(opcode, k, bytes)?),
        Opcode::Map => Request::Map(from_body(opcode, k, bytes)?),
        Opcode::Translate => Request::Translate(from_body(opcode, k, bytes)?),
        Opcode::Inventory => Request::Inventory(from_body(opcode, k, bytes)?),
        Opcode::Regions => Request::Regions(from_body(opcode, k, bytes)?),
        Opcode::Adopt => Request::Adopt(from_body(opcode, k, bytes)?),
        Opcode::ImportObject => Request::ImportObject(import_request(opcode, bytes)?),
        Opcode::Alloc => Request::Alloc(from_body(opcode, k, bytes)?),
        Opcode::Free => Request::Free(with_node(opcode, k, bytes, |r: &mut FreeRequest| &mut r.node)?),
        Opcode::Export => Request::Export(with_node(opcode, k, bytes, |r: &mut ExportRequest| &mut r.node)?),
        Opcode::Revoke => Request::Revoke(with_node(opcode, k, bytes, |r: &mut RevokeRequest| &mut r.handle.node)?),
        Opcode::Import => Request::Import(import_request(opcode, bytes)?),
        Opcode::Release => Request::Release(from_body(opcode, k, bytes)?),
        Opcode::Register => Request::Register(with_node(opcode, k, bytes, |r: &mut RegisterRequest| &mut r.node)?),
        Opcode::Unregister => Request::Unregister(from_body(opcode, k, bytes)?),
        Opcode::Copy => Request::Copy(from_body(opcode, k, bytes)?),
        Opcode::CopyBatch => Request::CopyBatch(from_body(opcode, k, bytes)?),
        Opcode::Partitions => Request::Partitions(from_body(opcode, k, bytes)?),
        Opcode::Subscribe => Request::Subscribe(from_body(opcode, k, bytes)?),
        Opcode::Domain => Request::Domain(from_body(opcode, k, bytes)?),
        Opcode::PeerData => return Err(BodyError::PeerOnly { opcode }),
    })
}

/// Decodes a successful response body of `opcode`.
pub fn decode_response(opcode: Opcode, bytes: &[u8]) -> Result<Response, BodyError> {
    let k = FrameKind::Response;
    Ok(match opcode {
        Opcode::Hello => Response::Hello(hello_response(bytes)?),
        Opcode::Status => Response::Status(from_body(opcode, k, bytes)?),
        Opcode::Ping => from_body::<()>(opcode, k, bytes).map(|()| Response::Ping)?,
        Opcode::Topology => Response::Topology(from_body(opcode, k, bytes)?),
        Opcode::Devices => Response::Devices(from_body(opcode, k, bytes)?),
        Opcode::Map => Response::Map(from_body(opcode, k, bytes)?),
        Opcode::Translate => Response::Translate(from_body(opcode, k, bytes)?),
        Opcode::Inventory => Response::Inventory(from_body(opcode, k, bytes)?),
        Opcode::Regions => Response::Regions(from_body(opcode, k, bytes)?),
        Opcode::Adopt => Response::Adopt(alloc_response(opcode, bytes)?),
        Opcode::ImportObject => {
            Response::ImportObject(with_grant(opcode, bytes, |r: &mut ImportObjectResponse| &mut r.grant)?)
        }
        Opcode::Alloc => Response::Alloc(alloc_response(opcode, bytes)?),
        Opcode::Free => from_body::<()>(opcode, k, bytes).map(|()| Response::Free)?,
        Opcode::Export => Response::Export(with_node(opcode, k, bytes, |r: &mut ExportResponse| &mut r.handle.node)?),
        Opcode::Revoke => from_body::<()>(opcode, k, bytes).map(|()| Response::Revoke)?,
        Opcode::Import => Response::Import(with_grant(opcode, bytes, |r: &mut ImportResponse| &mut r.grant)?),
        Opcode::Release => from_body::<()>(opcode, k, bytes).map(|()| Response::Release)?,
        Opcode::Register => Response::Register(from_body(opcode, k, bytes)?),
        Opcode::Unregister => from_body::<()>(opcode, k, bytes).map(|()| Response::Unregister)?,
        Opcode::Copy => Response::Copy(from_body(opcode, k, bytes)?),
        Opcode::CopyBatch => Response::CopyBatch(from_body(opcode, k, bytes)?),
        Opcode::Partitions => Response::Partitions(from_body(opcode, k, bytes)?),
        Opcode::Subscribe => Response::Subscribe(from_body(opcode, k, bytes)?),
        Opcode::Domain => Response::Domain(from_body(opcode, k, bytes)?),
        Opcode::PeerData => return Err(BodyError::PeerOnly { opcode }),
    })
}

/// Decodes an error body (the same for every opcode).
pub fn decode_error(opcode: Opcode, bytes: &[u8]) -> Result<ErrorBody, BodyError> {
    from_body(opcode, FrameKind::Error, bytes)
}

/// Decodes an event body (only under `Subscribe`).
pub fn decode_event(opcode: Opcode, bytes: &[u8]) -> Result<Event, BodyError> {
    if opcode != Opcode::Subscribe {
        return Err(BodyError::NotAnEventOpcode { opcode });
    }
    from_body(opcode, FrameKind::Event, bytes)
}

/// Decodes the body of a frame whose header was checked by [`super::decode_header`].
pub fn decode_body(header: &Header, bytes: &[u8]) -> Result<Message, BodyError> {
    if bytes.len() != header.body_len as usize {
        return Err(BodyError::LengthMismatch { announced: header.body_len, actual: bytes.len() });
    }
    let op = header.opcode;
    Ok(match header.kind {
        FrameKind::Request => Message::Request(decode_request(op, bytes)?),
        FrameKind::Response => Message::Response(decode_response(op, bytes)?),
        FrameKind::Error => Message::Error(decode_error(op, bytes)?),
        FrameKind::Event => Message::Event(decode_event(op, bytes)?),
    })
}

fn append<T: Serialize>(value: &T, out: &mut Vec<u8>) -> Result<(), BodyError> {
    postcard::to_io(value, out).map(drop).map_err(BodyError::Encode)
}

/// Appends a trailer, when there is one.
fn trail<X: Serialize>(trailer: Option<&X>, out: &mut Vec<u8>) -> Result<(), BodyError> {
    trailer.map_or(Ok(()), |t| append(t, out))
}

/// Appends a grant, when there is one: the 1.5 trailer, then its coherence's code (1.9)
/// when it has one.
fn trail_grant(grant: Option<&Grant>, out: &mut Vec<u8>) -> Result<(), BodyError> {
    trail(grant, out)?;
    trail(grant.and_then(|g| g.coherence.as_ref()), out)
}

/// Appends the body of `msg` (no header) to `out`.
pub fn encode_body(msg: &Message, out: &mut Vec<u8>) -> Result<(), BodyError> {
    match msg {
        Message::Request(r) => match r {
            Request::Hello(b) => append(b, out).and_then(|()| trail(b.resume.as_ref(), out)),
            Request::Status(b) => append(b, out),
            Request::Topology(b) | Request::Devices(b) | Request::Map(b) | Request::Inventory(b) => append(b, out),
            Request::Regions(b) => append(b, out),
            Request::Translate(b) => append(b, out),
            Request::Alloc(b) => append(b, out),
            Request::Free(b) => append(b, out).and_then(|()| trail(b.node.as_ref(), out)),
            Request::Export(b) => append(b, out).and_then(|()| trail(b.node.as_ref(), out)),
            Request::Revoke(b) => append(b, out).and_then(|()| trail(b.handle.node.as_ref(), out)),
            Request::Import(b) | Request::ImportObject(b) => {
                append(b, out).and_then(|()| trail(b.handle.node.as_ref(), out))
            }
            Request::Adopt(b) => append(b, out),
            Request::Release(b) => append(b, out),
            Request::Register(b) => append(b, out).and_then(|()| trail(b.node.as_ref(), out)),
            Request::Unregister(b) => append(b, out),
            Request::Copy(b) => append(b, out),
            Request::CopyBatch(b) => append(b, out),
            Request::Partitions(b) => append(b, out),
            Request::Domain(b) => append(b, out),
            Request::Subscribe(b) => append(b, out),
            Request::Ping => Ok(()),
        },
        Message::Response(r) => match r {
            Response::Hello(b) => append(b, out).and_then(|()| trail(b.token.as_ref(), out)),
            Response::Status(b) => append(b, out),
            Response::Topology(b) | Response::Devices(b) | Response::Map(b) | Response::Inventory(b) => append(b, out),
            Response::Regions(b) => append(b, out),
            Response::Translate(b) => append(b, out),
            Response::Alloc(b) | Response::Adopt(b) => append(b, out).and_then(|()| trail_grant(b.grant.as_ref(), out)),
            Response::ImportObject(b) => append(b, out).and_then(|()| trail_grant(b.grant.as_ref(), out)),
            Response::Export(b) => append(b, out).and_then(|()| trail(b.handle.node.as_ref(), out)),
            Response::Import(b) => append(b, out).and_then(|()| trail_grant(b.grant.as_ref(), out)),
            Response::Register(b) => append(b, out),
            Response::Copy(b) | Response::CopyBatch(b) => append(b, out),
            Response::Partitions(b) => append(b, out),
            Response::Domain(b) => append(b, out),
            Response::Subscribe(b) => append(b, out),
            Response::Free | Response::Revoke | Response::Release | Response::Unregister | Response::Ping => Ok(()),
        },
        Message::Error(b) => append(b, out),
        Message::Event(b) => append(b, out),
    }
}

/// Appends a whole frame for `msg` to `out`: `header`'s kind and opcode must fit the
/// message, its `body_len` is filled in, and the frame is checked against the opcode's
/// limits. On error `out` is left as it was.
pub fn encode_message(header: &Header, msg: &Message, out: &mut Vec<u8>) -> Result<(), BodyError> {
    if header.kind != msg.kind() || msg.opcode().is_some_and(|op| op != header.opcode) {
        return Err(BodyError::HeaderMismatch { opcode: header.opcode, kind: header.kind });
    }
    let start = out.len();
    let mut body = Vec::with_capacity(256);
    encode_body(msg, &mut body)?;
    encode_frame(header, &body, out).inspect_err(|_| out.truncate(start))?;
    debug_assert_eq!(out.len(), start + HEADER_LEN + body.len());
    Ok(())
}
