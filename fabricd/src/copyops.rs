//! The `Copy` operation on the wire: endpoints checked and resolved, the copy queued on
//! the [`crate::copy`] engine, its id answered at once; the completion travels later as a
//! `CopyDone` event on the issuing connection.

use fabric_proto::wire::{CopyEndpoint, CopyRequest, CopyResponse, ErrorBody, ErrorCode, ErrorDetail, Name, Response};

use crate::copy::{CopyError, DeviceCopy, NewCopy, Sink};
use crate::daemon::Daemon;
use crate::memops::refused;
use crate::memory::Resolved;
use crate::ops::refusal;
use crate::scope::Caller;

/// Whether `[a, a + len)` and `[b, b + len)` of the same object overlap.
fn overlaps(a: &Resolved, b: &Resolved, len: u64) -> bool {
    let (ka, kb) = (a.key, b.key);
    (ka.0, ka.1, ka.2) == (kb.0, kb.1, kb.2) && ka.3 < kb.3.saturating_add(len) && kb.3 < ka.3.saturating_add(len)
}

/// `Copy`: queues `req` for `session`; the completion goes to `sink` under `request_id`.
pub fn copy(
    d: &Daemon,
    caller: &Caller,
    session: u64,
    request_id: u64,
    req: CopyRequest,
    sink: Sink,
) -> Result<Response, ErrorBody> {
    caller.require_scope()?;
    if req.len == 0 {
        return Err(refusal(ErrorCode::BadRequest, "a copy needs at least one byte"));
    }
    let gfa = |e: CopyEndpoint| matches!(e, CopyEndpoint::Gfa(_));
    let snap = (gfa(req.dst) || gfa(req.src)).then(|| d.map().snapshot());
    let members = match &snap {
        Some(s) => caller.members(s)?,
        None => None,
    };
    let resolve = || -> Result<NewCopy, ErrorBody> {
        let snap = snap.clone().unwrap_or_else(|| d.map().snapshot());
        let side = |ep, write| {
            let r = d.memory.copy_endpoint(session, &snap, ep, req.len, write).map_err(|e| refused(&e))?;
            if let (Some(m), Some(dev)) = (&members, &r.device)
                && !m.contains(dev)
            {
                return Err(refusal(
                    ErrorCode::PermissionDenied,
                    format!("the memory lies on {dev}, outside the caller's partitions ({})", caller.partition_names()),
                ));
            }
            Ok(r)
        };
        let dst = side(req.dst, true)?;
        let src = side(req.src, false)?;
        if overlaps(&dst, &src, req.len) {
            return Err(refusal(ErrorCode::BadRequest, "source and destination overlap"));
        }
        let mut deps = dst.deps;
        deps.extend(src.deps);
        // Both ends mapped for the same VFIO device that has an engine: the device moves
        // the bytes (docs/fabricd.md, "VFIO DMA backend").
        let device = match (&dst.dma, &src.dma) {
            (Some((dd, di)), Some((sd, si))) if std::sync::Arc::ptr_eq(dd, sd) && dd.has_engine() => {
                Some(DeviceCopy { device: dd.clone(), dst: *di, src: *si })
            }
            _ => None,
        };
        Ok(NewCopy { dst: dst.side, src: src.side, len: req.len, deps, device })
    };
    match d.copies.submit(session, request_id, sink, resolve) {
        Ok(Ok(copy)) => Ok(Response::Copy(CopyResponse { copy })),
        Ok(Err(e)) => Err(e),
        Err(e @ CopyError::TooMany { in_flight, max }) => {
            let mut body = refusal(ErrorCode::LimitExceeded, e.to_string());
            body.detail = Some(ErrorDetail::Limit {
                what: Name::truncated("copies_in_flight"),
                used: u64::from(in_flight),
                requested: 1,
                max: u64::from(max),
            });
            Err(body)
        }
        Err(e) => Err(refusal(ErrorCode::Internal, crate::error_chain(&e))),
    }
}
