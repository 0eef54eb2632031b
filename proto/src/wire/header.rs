//! The fixed 32-byte frame header: a zerocopy struct of little-endian fields, its typed
//! view, and the pure functions that write a frame and check a header before any body
//! byte is read or allocated.

use zerocopy::byteorder::little_endian::{U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use super::opcode::Opcode;
use super::version::{PROTOCOL_VERSION, SUPPORTED_VERSIONS, Version, VersionRange};
use super::{MAGIC, MAX_BODY, MAX_FDS};

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 32;

/// The header exactly as it travels: 32 bytes, no padding, alignment 1, every integer
/// little-endian. See `docs/protocol.md` for the byte table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct RawHeader {
    /// [`MAGIC`] (`FBRC`).
    pub magic: [u8; 4],
    /// Protocol major version; must be a supported one.
    pub major: u8,
    /// Protocol minor version of the sender (the negotiated one after hello).
    pub minor: u8,
    /// [`Opcode`] code.
    pub opcode: U16,
    /// Flag bits (`RESPONSE`, `ERROR`, `EVENT`, `HAS_FDS`).
    pub flags: U16,
    /// File descriptors sent with the frame as `SCM_RIGHTS`.
    pub fd_count: u8,
    /// Zero.
    pub reserved0: u8,
    /// Bytes of body that follow the header.
    pub body_len: U32,
    /// Chosen by the client; a response or error echoes its request's id; an event
    /// carries the id of the subscribe request that asked for it.
    pub request_id: U64,
    /// Zero.
    pub reserved1: [u8; 8],
}

const _: () = assert!(size_of::<RawHeader>() == HEADER_LEN);
const _: () = assert!(align_of::<RawHeader>() == 1);

/// Flag: the frame answers a request.
pub const FLAG_RESPONSE: u16 = 1 << 0;
/// Flag: the answer is an error body (only with `RESPONSE`).
pub const FLAG_ERROR: u16 = 1 << 1;
/// Flag: the frame is an unsolicited event (never with `RESPONSE`).
pub const FLAG_EVENT: u16 = 1 << 2;
/// Flag: file descriptors come with the frame (set exactly when `fd_count > 0`).
pub const FLAG_HAS_FDS: u16 = 1 << 3;
const KNOWN_FLAGS: u16 = FLAG_RESPONSE | FLAG_ERROR | FLAG_EVENT | FLAG_HAS_FDS;

/// What a frame carries, from its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// A client's request.
    Request,
    /// A successful answer.
    Response,
    /// An error answer ([`super::ErrorBody`]).
    Error,
    /// An event for a subscriber ([`super::Event`]).
    Event,
}

impl FrameKind {
    /// Every kind.
    pub const ALL: [FrameKind; 4] = [FrameKind::Request, FrameKind::Response, FrameKind::Error, FrameKind::Event];

    const fn flags(self) -> u16 {
        match self {
            FrameKind::Request => 0,
            FrameKind::Response => FLAG_RESPONSE,
            FrameKind::Error => FLAG_RESPONSE | FLAG_ERROR,
            FrameKind::Event => FLAG_EVENT,
        }
    }

    fn from_flags(flags: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.flags() == flags & !FLAG_HAS_FDS)
    }
}

/// A checked header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Header {
    /// Version the sender speaks on this connection.
    pub version: Version,
    /// Operation.
    pub opcode: Opcode,
    /// Request, response, error or event.
    pub kind: FrameKind,
    /// Request id (see [`RawHeader::request_id`]).
    pub request_id: u64,
    /// Body bytes that follow. [`encode_frame`] writes the real length of the body.
    pub body_len: u32,
    /// File descriptors sent with the frame.
    pub fd_count: u8,
}

impl Header {
    /// A header at [`PROTOCOL_VERSION`] with no body and no descriptors yet.
    pub fn new(opcode: Opcode, kind: FrameKind, request_id: u64) -> Self {
        Self { version: PROTOCOL_VERSION, opcode, kind, request_id, body_len: 0, fd_count: 0 }
    }

    /// The header of an answer (`Response` or `Error`) to this request.
    pub fn answer(&self, kind: FrameKind) -> Self {
        Self { kind, body_len: 0, fd_count: 0, ..*self }
    }

    /// The raw form of this header.
    pub fn to_raw(&self) -> RawHeader {
        let has_fds = if self.fd_count > 0 { FLAG_HAS_FDS } else { 0 };
        RawHeader {
            magic: MAGIC,
            major: self.version.major,
            minor: self.version.minor,
            opcode: U16::new(self.opcode.code()),
            flags: U16::new(self.kind.flags() | has_fds),
            fd_count: self.fd_count,
            reserved0: 0,
            body_len: U32::new(self.body_len),
            request_id: U64::new(self.request_id),
            reserved1: [0; 8],
        }
    }
}

/// Why a header or frame is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("truncated header: {have} of {need} bytes")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        have: usize,
    },
    /// The frame does not start with `FBRC`.
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// The header's major version is not understood.
    #[error("unsupported protocol version {offered}; supported {supported}")]
    UnsupportedVersion {
        /// Version in the header.
        offered: Version,
        /// What this side understands.
        supported: VersionRange,
    },
    /// A reserved byte is not zero.
    #[error("reserved header bytes are not zero")]
    ReservedNotZero,
    /// Unknown flag bits, an impossible combination, or `HAS_FDS` disagreeing with the
    /// descriptor count.
    #[error("invalid flags {flags:#06x} with {fd_count} descriptors")]
    BadFlags {
        /// The flag bits.
        flags: u16,
        /// The descriptor count.
        fd_count: u8,
    },
    /// The opcode is not known. The request id and length are reported so that a server
    /// can skip a bounded body and answer with an error instead of dropping the client.
    #[error("unknown opcode {code:#06x}")]
    UnknownOpcode {
        /// The code.
        code: u16,
        /// The frame's request id.
        request_id: u64,
        /// Its body length (unchecked beyond [`MAX_BODY`]).
        body_len: u32,
    },
    /// The body is longer than this opcode allows.
    #[error("{opcode} {kind:?} body of {len} bytes exceeds {max}")]
    BodyTooLarge {
        /// The opcode.
        opcode: Opcode,
        /// What kind of frame.
        kind: FrameKind,
        /// Announced length.
        len: u64,
        /// Limit.
        max: u32,
    },
    /// More descriptors than this opcode allows.
    #[error("{opcode} {kind:?} frame announces {count} descriptors, at most {max}")]
    TooManyFds {
        /// The opcode.
        opcode: Opcode,
        /// What kind of frame.
        kind: FrameKind,
        /// Announced descriptors.
        count: u8,
        /// Limit.
        max: u8,
    },
}

/// Checks the first [`HEADER_LEN`] bytes of `bytes` as a header. Everything a receiver
/// needs before it reads or allocates the body is checked here: magic, major version,
/// reserved bytes, flags, opcode, body length and descriptor count against the opcode's
/// limits. Bytes after the header are ignored.
pub fn decode_header(bytes: &[u8]) -> Result<Header, FrameError> {
    let Ok((raw, _)) = RawHeader::read_from_prefix(bytes) else {
        return Err(FrameError::Truncated { need: HEADER_LEN, have: bytes.len() });
    };
    if raw.magic != MAGIC {
        return Err(FrameError::BadMagic { found: raw.magic });
    }
    let version = Version::new(raw.major, raw.minor);
    if raw.major < SUPPORTED_VERSIONS.min.major || raw.major > SUPPORTED_VERSIONS.max.major {
        return Err(FrameError::UnsupportedVersion { offered: version, supported: SUPPORTED_VERSIONS });
    }
    if raw.reserved0 != 0 || raw.reserved1 != [0; 8] {
        return Err(FrameError::ReservedNotZero);
    }
    let flags = raw.flags.get();
    let fd_flag = flags & FLAG_HAS_FDS != 0;
    let kind = match FrameKind::from_flags(flags) {
        Some(kind) if flags & !KNOWN_FLAGS == 0 && fd_flag == (raw.fd_count > 0) => kind,
        _ => return Err(FrameError::BadFlags { flags, fd_count: raw.fd_count }),
    };
    let body_len = raw.body_len.get();
    let request_id = raw.request_id.get();
    let Some(opcode) = Opcode::from_code(raw.opcode.get()) else {
        return Err(FrameError::UnknownOpcode { code: raw.opcode.get(), request_id, body_len });
    };
    let header = Header { version, opcode, kind, request_id, body_len, fd_count: raw.fd_count };
    check_limits(&header, u64::from(body_len))?;
    Ok(header)
}

fn check_limits(header: &Header, len: u64) -> Result<(), FrameError> {
    let (opcode, kind) = (header.opcode, header.kind);
    let max = opcode.max_body(kind);
    debug_assert!(max <= MAX_BODY);
    if len > u64::from(max) {
        return Err(FrameError::BodyTooLarge { opcode, kind, len, max });
    }
    let max = opcode.max_fds(kind);
    debug_assert!(max <= MAX_FDS);
    if header.fd_count > max {
        return Err(FrameError::TooManyFds { opcode, kind, count: header.fd_count, max });
    }
    Ok(())
}

/// Appends a frame (header then body) to `out`. The header's `body_len` is ignored: the
/// length of `body` is written. Refuses what [`decode_header`] would refuse, so a frame
/// this writes always decodes.
pub fn encode_frame(header: &Header, body: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    let v = header.version;
    if v.major < SUPPORTED_VERSIONS.min.major || v.major > SUPPORTED_VERSIONS.max.major {
        return Err(FrameError::UnsupportedVersion { offered: v, supported: SUPPORTED_VERSIONS });
    }
    check_limits(header, body.len() as u64)?;
    // Lossless: check_limits bounded the length by a u32 limit.
    let body_len = u32::try_from(body.len()).unwrap_or(u32::MAX);
    let raw = Header { body_len, ..*header }.to_raw();
    out.reserve(HEADER_LEN + body.len());
    out.extend_from_slice(raw.as_bytes());
    out.extend_from_slice(body);
    Ok(())
}
