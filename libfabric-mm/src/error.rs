//! The library's one error type: what the daemon refused, what the kernel refused, and
//! what the library itself checks (window bounds, revocation), each with a stable integer
//! code for the C ABI.

use std::io;

use fabric_proto::wire::{CodecError, ErrorCode, ErrorDetail, Opcode, RevocationReason};

/// Why a libfabric-mm call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No daemon answers at the socket.
    #[error("cannot reach fabricd at {path}")]
    Connect {
        /// The socket tried.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The daemon refused the operation; `code` says why.
    #[error("fabricd refused {op}: {code:?}: {message}")]
    Refused {
        /// The operation.
        op: Opcode,
        /// The daemon's error code.
        code: ErrorCode,
        /// The daemon's explanation.
        message: String,
        /// Numbers for limit refusals: (what, used, requested, max).
        limit: Option<(String, u64, u64, u64)>,
    },
    /// The connection to the daemon failed or broke.
    #[error("connection to fabricd")]
    Protocol(#[source] CodecError),
    /// The daemon went away; every object of this session is gone with it.
    #[error("the connection to fabricd is closed")]
    Disconnected,
    /// The memory was revoked (owner exited, export revoked, region freed, device lost).
    #[error("region {region} generation {generation} was revoked: {reason:?}")]
    Revoked {
        /// Region id.
        region: u64,
        /// Region generation.
        generation: u64,
        /// Why.
        reason: RevocationReason,
    },
    /// The window cannot be reserved at this size.
    #[error("cannot reserve a {len:#x}-byte unified window: {why} (lower FABRIC_MM_WINDOW_SIZE or WindowConfig::len)")]
    WindowReserve {
        /// Bytes asked for.
        len: u64,
        /// Why, in words (address-space limit, kernel refusal).
        why: String,
    },
    /// The memory's GFA range does not lie inside the window.
    #[error("GFA range {gfa:#x}+{len:#x} lies outside the window {window_gfa:#x}+{window_len:#x}")]
    OutsideWindow {
        /// First GFA of the memory.
        gfa: u64,
        /// Bytes.
        len: u64,
        /// First GFA the window mirrors.
        window_gfa: u64,
        /// Bytes the window mirrors.
        window_len: u64,
    },
    /// The memory has no GFA (the daemon placed it outside the map).
    #[error("region {0} has no GFA, so it cannot be placed in the window")]
    NoGfa(u64),
    /// The range is already mapped in the window.
    #[error("GFA range {gfa:#x}+{len:#x} is already mapped")]
    AlreadyMapped {
        /// First GFA.
        gfa: u64,
        /// Bytes.
        len: u64,
    },
    /// Pinning the memory exceeds RLIMIT_MEMLOCK.
    #[error(
        "pinning {requested} bytes exceeds RLIMIT_MEMLOCK ({limit} bytes; raise it with `ulimit -l` or LimitMEMLOCK=)"
    )]
    MemlockLimit {
        /// Bytes asked for.
        requested: u64,
        /// The soft limit.
        limit: u64,
    },
    /// An argument is out of range.
    #[error("{0}")]
    InvalidArgument(String),
    /// A system call failed.
    #[error("{what}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The daemon answered with something else than the request asked for.
    #[error("fabricd answered {0} with an unexpected message")]
    Unexpected(Opcode),
}

/// A [`Result`](std::result::Result) with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// The error for a codec failure: a daemon refusal becomes [`Error::Refused`].
    pub(crate) fn from_codec(op: Opcode, e: CodecError) -> Self {
        match e {
            CodecError::Refused { opcode, body } => {
                let limit = match body.detail {
                    Some(ErrorDetail::Limit { what, used, requested, max }) => {
                        Some((what.to_string(), used, requested, max))
                    }
                    _ => None,
                };
                Error::Refused { op: opcode, code: body.code, message: body.message.to_string(), limit }
            }
            CodecError::Closed | CodecError::Truncated { .. } => Error::Disconnected,
            other => {
                tracing::debug!(op = op.name(), error = %other, "protocol failure");
                Error::Protocol(other)
            }
        }
    }

    pub(crate) fn os(what: &'static str) -> impl FnOnce(io::Error) -> Self {
        move |source| Error::Os { what, source }
    }

    /// The stable negative integer the C ABI returns for this error (see
    /// `include/fabric_mm.h`).
    pub fn code(&self) -> i32 {
        match self {
            Error::Connect { .. } => -1,
            Error::Refused { code, .. } => match code {
                ErrorCode::PermissionDenied | ErrorCode::AdminRequired => -10,
                ErrorCode::NotFound => -11,
                ErrorCode::InvalidHandle => -12,
                ErrorCode::Revoked => -13,
                ErrorCode::LimitExceeded => -14,
                ErrorCode::NoSpace => -15,
                ErrorCode::NotImplemented => -16,
                ErrorCode::BadRequest => -17,
                _ => -19,
            },
            Error::Protocol(_) | Error::Unexpected(_) => -2,
            Error::Disconnected => -3,
            Error::Revoked { .. } => -13,
            Error::WindowReserve { .. } => -20,
            Error::OutsideWindow { .. } => -21,
            Error::NoGfa(_) => -22,
            Error::AlreadyMapped { .. } => -23,
            Error::MemlockLimit { .. } => -24,
            Error::InvalidArgument(_) => -30,
            Error::Os { .. } => -31,
        }
    }
}
