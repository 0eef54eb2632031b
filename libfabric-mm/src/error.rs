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
    /// The daemon granted the memory copy-only (protocol 1.5): no descriptor came with it,
    /// so it cannot be mapped or opened; the copy API reaches it by GFA.
    #[error("region {0} is granted copy-only: reach it with the copy API, not by mapping it")]
    CopyOnly(u64),
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
    /// The daemon refused to pin more for this user: `limits.pinned_bytes_per_uid`.
    #[error(
        "pinning {requested} more bytes exceeds fabricd's per-user pinned limit ({used} of {max} bytes pinned; raise limits.pinned_bytes_per_uid in fabricd.toml, or unregister)"
    )]
    PinnedLimit {
        /// Bytes this user has pinned now.
        used: u64,
        /// Bytes asked for (whole pages).
        requested: u64,
        /// The limit.
        max: u64,
    },
    /// The daemon could not lock the memory: its own `RLIMIT_MEMLOCK`.
    #[error(
        "fabricd cannot lock {requested} more bytes: its RLIMIT_MEMLOCK is {limit} bytes ({locked} locked; raise LimitMEMLOCK= in fabricd.service or grant it CAP_IPC_LOCK)"
    )]
    DaemonMemlockLimit {
        /// Bytes the daemon has locked.
        locked: u64,
        /// Bytes asked for.
        requested: u64,
        /// The daemon's soft limit.
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
    /// A copy stopped before every byte moved: `code` says why (`NotFound`: an endpoint
    /// went during the copy; `Internal`: an I/O failure).
    #[error("copy {copy} failed after {bytes} bytes: {code:?}: {message}")]
    CopyFailed {
        /// The copy's id.
        copy: u64,
        /// The daemon's error code.
        code: ErrorCode,
        /// The daemon's explanation.
        message: String,
        /// Bytes known copied (whole chunks, not necessarily a prefix).
        bytes: u64,
    },
    /// The GPU's driver refused, or is not there ("CUDA not present: …").
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
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

    /// The stable negative integer the C ABI returns for this error (`FMM_E_*` in
    /// `include/fabric_mm.h`).
    pub fn code(&self) -> i32 {
        use crate::ffi::*;
        match self {
            Error::Connect { .. } => FMM_E_CONNECT,
            Error::Refused { code, .. } | Error::CopyFailed { code, .. } => match code {
                ErrorCode::PermissionDenied | ErrorCode::AdminRequired => FMM_E_PERMISSION,
                ErrorCode::NotFound => FMM_E_NOT_FOUND,
                ErrorCode::InvalidHandle => FMM_E_INVALID_HANDLE,
                ErrorCode::Revoked => FMM_E_REVOKED,
                ErrorCode::LimitExceeded => FMM_E_LIMIT,
                ErrorCode::NoSpace => FMM_E_NO_SPACE,
                // Also a daemon too old for the operation (an opcode it does not know).
                ErrorCode::NotImplemented | ErrorCode::UnknownOpcode => FMM_E_NOT_IMPLEMENTED,
                ErrorCode::BadRequest => FMM_E_BAD_REQUEST,
                _ => FMM_E_REFUSED,
            },
            Error::Protocol(_) | Error::Unexpected(_) => FMM_E_PROTOCOL,
            Error::Disconnected => FMM_E_DISCONNECTED,
            Error::Revoked { .. } => FMM_E_REVOKED,
            Error::WindowReserve { .. } => FMM_E_WINDOW,
            Error::OutsideWindow { .. } => FMM_E_OUTSIDE_WINDOW,
            Error::NoGfa(_) => FMM_E_NO_GFA,
            Error::CopyOnly(_) => FMM_E_COPY_ONLY,
            Error::AlreadyMapped { .. } => FMM_E_ALREADY_MAPPED,
            Error::MemlockLimit { .. } | Error::DaemonMemlockLimit { .. } => FMM_E_MEMLOCK,
            Error::PinnedLimit { .. } => FMM_E_LIMIT,
            Error::InvalidArgument(_) => FMM_E_ARG,
            Error::Os { .. } => FMM_E_OS,
            Error::Cuda(_) => FMM_E_DEVICE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::*;

    fn refused(code: ErrorCode) -> i32 {
        Error::Refused { op: Opcode::Copy, code, message: String::new(), limit: None }.code()
    }

    #[test]
    fn daemon_codes_map_to_the_c_codes_the_header_documents() {
        // A daemon too old for the operation does not serve it.
        assert_eq!(refused(ErrorCode::UnknownOpcode), FMM_E_NOT_IMPLEMENTED);
        assert_eq!(refused(ErrorCode::NotImplemented), FMM_E_NOT_IMPLEMENTED);
        assert_eq!(refused(ErrorCode::PermissionDenied), FMM_E_PERMISSION);
        assert_eq!(refused(ErrorCode::AdminRequired), FMM_E_PERMISSION);
        assert_eq!(refused(ErrorCode::NotFound), FMM_E_NOT_FOUND);
        assert_eq!(refused(ErrorCode::InvalidHandle), FMM_E_INVALID_HANDLE);
        assert_eq!(refused(ErrorCode::Revoked), FMM_E_REVOKED);
        assert_eq!(refused(ErrorCode::LimitExceeded), FMM_E_LIMIT);
        assert_eq!(refused(ErrorCode::NoSpace), FMM_E_NO_SPACE);
        assert_eq!(refused(ErrorCode::BadRequest), FMM_E_BAD_REQUEST);
        for other in [ErrorCode::Unavailable, ErrorCode::Internal, ErrorCode::WrongNode, ErrorCode::BadFds] {
            assert_eq!(refused(other), FMM_E_REFUSED, "{other:?}");
        }
        // A copy that stopped with the same daemon code maps the same way.
        let failed = Error::CopyFailed { copy: 1, code: ErrorCode::UnknownOpcode, message: String::new(), bytes: 0 };
        assert_eq!(failed.code(), FMM_E_NOT_IMPLEMENTED);
    }
}
