//! The `Copy` and `CopyBatch` operations on the wire: endpoints checked and resolved, the
//! copy (or batch) queued on the [`crate::copy`] engine, its id answered at once; the
//! completion travels later as a `CopyDone` event on the issuing connection.

use fabric_proto::wire::{
    CopyBatchRequest, CopyEndpoint, CopyRequest, CopyResponse, ErrorBody, ErrorCode, ErrorDetail, Name, Response,
};

use crate::copy::{CopyError, DeviceCopy, NewBatch, NewCopy, Sink};
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

/// What resolving a copy's endpoints needs: the map snapshot and the caller's devices
/// when a side is a GFA.
struct Resolver<'a> {
    d: &'a Daemon,
    caller: &'a Caller,
    session: u64,
    snap: Option<std::sync::Arc<fabric_addrmap::Snapshot>>,
    members: Option<std::collections::HashSet<fabric_topology::DeviceId>>,
}

impl<'a> Resolver<'a> {
    fn new(d: &'a Daemon, caller: &'a Caller, session: u64, reqs: &[CopyRequest]) -> Result<Self, ErrorBody> {
        caller.require_scope()?;
        let gfa = |e: CopyEndpoint| matches!(e, CopyEndpoint::Gfa(_));
        let snap = reqs.iter().any(|r| gfa(r.dst) || gfa(r.src)).then(|| d.map_snapshot());
        let members = match &snap {
            Some(s) => caller.members(s)?,
            None => None,
        };
        Ok(Self { d, caller, session, snap, members })
    }

    /// One copy's sides, checked (partitions, overlap) and resolved.
    fn resolve(&self, req: &CopyRequest) -> Result<NewCopy, ErrorBody> {
        if req.len == 0 {
            return Err(refusal(ErrorCode::BadRequest, "a copy needs at least one byte"));
        }
        let snap = self.snap.clone().unwrap_or_else(|| self.d.map_snapshot());
        let side = |ep, write| {
            let r = self.d.memory.copy_endpoint(self.session, &snap, ep, req.len, write).map_err(|e| refused(&e))?;
            if let (Some(m), Some(dev)) = (&self.members, &r.device)
                && !m.contains(dev)
            {
                return Err(refusal(
                    ErrorCode::PermissionDenied,
                    format!(
                        "the memory lies on {dev}, outside the caller's partitions ({})",
                        self.caller.partition_names()
                    ),
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
    }
}

/// The answer to a copy or batch the engine queued or refused.
fn queued(r: Result<Result<u64, ErrorBody>, CopyError>, batch: bool) -> Result<Response, ErrorBody> {
    match r {
        Ok(Ok(copy)) if batch => Ok(Response::CopyBatch(CopyResponse { copy })),
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

/// `Copy`: queues `req` for `session`; the completion goes to `sink` under `request_id`.
pub fn copy(
    d: &Daemon,
    caller: &Caller,
    session: u64,
    request_id: u64,
    req: CopyRequest,
    sink: Sink,
) -> Result<Response, ErrorBody> {
    let r = Resolver::new(d, caller, session, &[req])?;
    queued(d.copies.submit(caller.cred.uid, session, request_id, sink, || r.resolve(&req)), false)
}

/// `CopyBatch`: every copy checked and resolved before any is queued, then one job with
/// one completion (to `sink` under `request_id`).
pub fn copy_batch(
    d: &Daemon,
    caller: &Caller,
    session: u64,
    request_id: u64,
    req: &CopyBatchRequest,
    sink: Sink,
) -> Result<Response, ErrorBody> {
    if req.copies.is_empty() {
        return Err(refusal(ErrorCode::BadRequest, "a batch needs at least one copy"));
    }
    let r = Resolver::new(d, caller, session, &req.copies)?;
    let resolve = || -> Result<NewBatch, ErrorBody> {
        let copies = req
            .copies
            .iter()
            .enumerate()
            .map(|(i, c)| {
                r.resolve(c).map_err(|mut e| {
                    e.message =
                        fabric_proto::wire::ErrorText::truncated(&format!("copy {i} of the batch: {}", e.message));
                    e
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(NewBatch { copies })
    };
    queued(d.copies.submit_batch(caller.cred.uid, session, request_id, sink, resolve), true)
}
