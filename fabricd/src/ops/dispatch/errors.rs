//! The typed refusals clients get: the one mapping from each internal error to the
//! wire's [`ErrorBody`] (a code, a message, and the limit's detail where there is one).

use fabric_proto::wire::{ErrorBody, ErrorCode, ErrorDetail, ErrorText, Name};

use crate::copy::CopyError;
use crate::dma::sys::PinError;
use crate::memory::MemoryError;

/// A typed refusal with its message.
pub fn refusal(code: ErrorCode, message: impl AsRef<str>) -> ErrorBody {
    ErrorBody { code, message: ErrorText::truncated(message.as_ref()), detail: None }
}

/// The typed refusal for a memory error.
pub fn memory(e: &MemoryError) -> ErrorBody {
    let code = match e {
        MemoryError::NotFound(_) => ErrorCode::NotFound,
        MemoryError::PermissionDenied(_) => ErrorCode::PermissionDenied,
        MemoryError::InvalidHandle => ErrorCode::InvalidHandle,
        MemoryError::Revoked => ErrorCode::Revoked,
        MemoryError::Limit { .. } => ErrorCode::LimitExceeded,
        MemoryError::NoSpace(_) => ErrorCode::NoSpace,
        MemoryError::BadRequest(_) => ErrorCode::BadRequest,
        MemoryError::NotImplemented(_) => ErrorCode::NotImplemented,
        MemoryError::DeviceLost(_) => ErrorCode::Unavailable,
        MemoryError::Node(crate::memory::numa::NumaError::NoMemory { .. }) => ErrorCode::NoSpace,
        MemoryError::Node(_) => ErrorCode::Internal,
        MemoryError::Carve(_) | MemoryError::Zero(_) => ErrorCode::Internal,
        MemoryError::Io { .. }
        | MemoryError::Private(_)
        | MemoryError::Journal(_)
        | MemoryError::Record(_)
        | MemoryError::JournalUnavailable => ErrorCode::Internal,
        MemoryError::Iova(_) => ErrorCode::NoSpace,
        MemoryError::Pin(PinError::MemlockLimit { .. }) => ErrorCode::LimitExceeded,
        MemoryError::Pin(PinError::Map { source, .. }) if source.raw_os_error() == Some(libc::EACCES) => {
            ErrorCode::PermissionDenied
        }
        MemoryError::Pin(PinError::Map { .. }) => ErrorCode::BadRequest,
        MemoryError::Pin(PinError::Lock { .. }) => ErrorCode::Internal,
        // No one waits for the answer (the client hung up, the daemon is stopping).
        MemoryError::Pin(PinError::Abandoned { .. }) => ErrorCode::Unavailable,
        MemoryError::Vfio(_) => ErrorCode::Internal,
    };
    let message = crate::error_chain(e);
    let mut body = refusal(code, message);
    if let MemoryError::Limit { what, used, requested, max, .. } = e {
        body.detail =
            Some(ErrorDetail::Limit { what: Name::truncated(what), used: *used, requested: *requested, max: *max });
    }
    if let MemoryError::Pin(PinError::MemlockLimit { requested, locked, limit }) = e {
        body.detail = Some(ErrorDetail::Limit {
            what: Name::truncated("RLIMIT_MEMLOCK"),
            used: *locked,
            requested: *requested,
            max: *limit,
        });
    }
    body
}

/// The typed refusal for a copy the engine did not queue.
pub fn copy(e: &CopyError) -> ErrorBody {
    match e {
        CopyError::TooMany { in_flight, max } => {
            let mut body = refusal(ErrorCode::LimitExceeded, e.to_string());
            body.detail = Some(ErrorDetail::Limit {
                what: Name::truncated("copies_in_flight"),
                used: u64::from(*in_flight),
                requested: 1,
                max: u64::from(*max),
            });
            body
        }
        CopyError::Queue { queued, requested, max, .. } => {
            let mut body = refusal(ErrorCode::LimitExceeded, e.to_string());
            body.detail = Some(ErrorDetail::Limit {
                what: Name::truncated("copy_chunks_queued"),
                used: *queued as u64,
                requested: *requested as u64,
                max: *max as u64,
            });
            body
        }
        e => refusal(ErrorCode::Internal, crate::error_chain(e)),
    }
}

/// The typed refusal for a state file that could not be saved (`what` says which).
pub fn internal(what: &str, e: &dyn std::error::Error) -> ErrorBody {
    refusal(ErrorCode::Internal, format!("{what}: {}", crate::error_chain(e)))
}
