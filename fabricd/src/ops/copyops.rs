//! The `Copy` and `CopyBatch` operations on the wire: endpoints checked and resolved, the
//! copy (or batch) queued on the [`crate::copy`] engine, its id answered at once; the
//! completion travels later as a `CopyDone` event on the issuing connection.

use std::collections::HashSet;

use fabric_proto::wire::{CopyEndpoint, CopyRequest, CopyResponse, ErrorBody, ErrorCode, Response};
use fabric_topology::DeviceId;

use crate::copy::{DeviceCopy, NewBatch, NewCopy, Sink};
use crate::daemon::Daemon;
use crate::memory::Resolved;
use crate::ops::dispatch::errors::{memory as refused, refusal};
use crate::ops::scope::Caller;

/// Whether `[a, a + len)` and `[b, b + len)` of the same object overlap.
fn overlaps(a: &Resolved, b: &Resolved, len: u64) -> bool {
    let (ka, kb) = (a.key, b.key);
    (ka.0, ka.1, ka.2) == (kb.0, kb.1, kb.2) && ka.3 < kb.3.saturating_add(len) && kb.3 < ka.3.saturating_add(len)
}

/// A copy's (or batch's) authorized issuer: the caller, the devices its partitions hold
/// ([`crate::ops::dispatch::authz::Grant`]), its session and the request's id.
#[derive(Debug)]
pub struct Copies<'a> {
    /// Who.
    pub caller: &'a Caller,
    /// The devices the caller reaches; `None`: any.
    pub members: Option<HashSet<DeviceId>>,
    /// The session whose registrations and regions the endpoints name.
    pub session: u64,
    /// The completion travels under it.
    pub request_id: u64,
}

impl Copies<'_> {
    /// The one check the table leaves to the copy, for each end on this node (a copy
    /// across nodes' local end included): a GFA's device is known only once resolved.
    pub fn reaches(&self, end: &Resolved) -> Result<(), ErrorBody> {
        let Some(m) = &self.members else { return Ok(()) };
        match end.devices.iter().find(|dev| !m.contains(*dev)) {
            Some(dev) => Err(refusal(
                ErrorCode::PermissionDenied,
                format!(
                    "the memory lies on {dev}, outside the caller's partitions ({})",
                    self.caller.partition_names()
                ),
            )),
            None => Ok(()),
        }
    }
}

/// What resolving a copy's endpoints needs: the map snapshot when a side is a GFA.
struct Resolver<'a> {
    d: &'a Daemon,
    copies: &'a Copies<'a>,
    snap: Option<std::sync::Arc<fabric_addrmap::Snapshot>>,
}

impl<'a> Resolver<'a> {
    fn new(d: &'a Daemon, copies: &'a Copies<'a>, reqs: &[CopyRequest]) -> Self {
        let gfa = |e: CopyEndpoint| matches!(e, CopyEndpoint::Gfa(_));
        let snap = reqs.iter().any(|r| gfa(r.dst) || gfa(r.src)).then(|| d.map_snapshot());
        Self { d, copies, snap }
    }

    /// One copy's sides, checked (partitions, overlap) and resolved.
    fn resolve(&self, req: &CopyRequest) -> Result<NewCopy, ErrorBody> {
        if req.len == 0 {
            return Err(refusal(ErrorCode::BadRequest, "a copy needs at least one byte"));
        }
        let snap = self.snap.clone().unwrap_or_else(|| self.d.map_snapshot());
        let side = |ep, write| -> Result<Resolved, ErrorBody> {
            let r =
                self.d.memory.copy_endpoint(self.copies.session, &snap, ep, req.len, write).map_err(|e| refused(&e))?;
            self.copies.reaches(&r)?;
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

/// `Copy` (one, `batch` false) or `CopyBatch`: every copy checked and resolved before any
/// is queued, then one job with one completion (to `sink` under the request's id). The
/// answer is the copy's id.
pub fn submit(
    d: &Daemon,
    copies: &Copies<'_>,
    reqs: &[CopyRequest],
    batch: bool,
    sink: Sink,
) -> Result<Response, ErrorBody> {
    let r = Resolver::new(d, copies, reqs);
    let resolve = || -> Result<NewBatch, ErrorBody> {
        if let [one] = reqs
            && !batch
        {
            return r.resolve(one).map(|c| NewBatch { copies: vec![c] });
        }
        let copies = reqs
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
    let (uid, session, request_id) = (copies.caller.uid(), copies.session, copies.request_id);
    match d.copies.submit_batch(uid, session, request_id, sink, &d.memory, resolve) {
        Ok(Ok(copy)) if batch => Ok(Response::CopyBatch(CopyResponse { copy })),
        Ok(Ok(copy)) => Ok(Response::Copy(CopyResponse { copy })),
        Ok(Err(e)) => Err(e),
        Err(e) => Err(crate::ops::dispatch::errors::copy(&e)),
    }
}
