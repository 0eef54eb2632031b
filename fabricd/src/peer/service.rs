//! What this node answers over the node link: the owner's side of an import
//! (`Import`, `ImportObject`, `Release`: [`Owner`]; `Copy` chunks: [`super::copy::serve`])
//! and the importer's side of a revocation (`Revoke`: [`Importer`]). Until the daemon is
//! attached (it is built after the domain joins), every
//! request is refused as unavailable.

use std::sync::{Arc, OnceLock, Weak};

use fabric_nodelink::{Peer, PeerError, PeerOp, PeerRequest, PeerService, Served};

use super::importer::Importer;
use super::owner::{On, Owner};
use super::wire;
use crate::daemon::Daemon;

/// The daemon's peer service.
#[derive(Debug, Default)]
pub struct Service {
    daemon: OnceLock<Weak<Daemon>>,
    owner: Owner,
    importer: Importer,
    copies: super::copy::Copies,
}

impl Service {
    /// Hands it the daemon (once; later calls are ignored).
    pub fn attach(&self, daemon: Weak<Daemon>) {
        let _ = self.daemon.set(daemon);
    }

    /// The owner's side.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The importer's side.
    pub fn importer(&self) -> &Importer {
        &self.importer
    }

    /// This node's copies across nodes.
    pub fn copies(&self) -> &super::copy::Copies {
        &self.copies
    }

    /// The daemon, once attached.
    pub fn daemon(&self) -> Option<Weak<Daemon>> {
        self.daemon.get().cloned()
    }

    fn answer(
        &self,
        d: &Arc<Daemon>,
        peer: &Peer,
        request: &PeerRequest,
        on: On,
    ) -> Result<fabric_nodelink::PeerResponse, PeerError> {
        let op = request.op;
        match op {
            PeerOp::Import => {
                let ask: wire::ImportAsk = wire::decode(&request.body)?;
                let who = super::owner::principal(d, peer, Some(&ask));
                let grant = granting(d).and_then(|()| self.owner.import(d, peer, ask, on));
                Ok(wire::response(op, &judged(d, &who, "import", grant)?))
            }
            PeerOp::ImportObject => {
                let ask: wire::ImportAsk = wire::decode(&request.body)?;
                let who = super::owner::principal(d, peer, Some(&ask));
                let grant = granting(d).and_then(|()| self.owner.import_object(d, peer, ask));
                Ok(wire::response(op, &judged(d, &who, "import_object", grant)?))
            }
            PeerOp::Release => {
                let who = super::owner::principal(d, peer, None);
                let released = self.owner.release(d, peer, wire::decode(&request.body)?);
                judged(d, &who, "release", released)?;
                Ok(wire::response(op, &()))
            }
            PeerOp::Revoke => {
                self.importer.revoked(d, peer, wire::decode(&request.body)?)?;
                Ok(wire::response(op, &()))
            }
            // Served by `PeerService::serve` through `super::copy::serve`.
            PeerOp::Copy => Err(PeerError::Unsupported(op)),
        }
    }
}

/// `r`, its refusal (if any) logged and counted with the daemon's other refusals, under
/// the asking node's principal and the operation's name, as the dispatch's are.
fn judged<T>(
    d: &Daemon,
    who: &crate::ops::principal::Principal,
    op: &'static str,
    r: Result<T, PeerError>,
) -> Result<T, PeerError> {
    if let Err(e) = &r {
        let code = match e {
            PeerError::Denied { code, .. } => *code,
            _ => fabric_proto::wire::ErrorCode::BadRequest,
        };
        d.refused_line(who, op, code, &e.to_string());
    }
    r
}

/// A node that is not joined grants nothing: its view may be stale and its membership
/// (what its grants are recorded against) may be gone. Links admitted before the fence
/// still reach this point.
pub(super) fn granting(d: &Daemon) -> Result<(), PeerError> {
    if let Some(domain) = &d.domain
        && let standing = domain.status().standing.clone()
        && standing != crate::tasks::domain::Standing::Joined
    {
        return Err(PeerError::Denied {
            code: fabric_proto::wire::ErrorCode::Unavailable,
            message: format!("it is {standing} from its domain's etcd: no new grants until it rejoins"),
        });
    }
    Ok(())
}

impl PeerService for Service {
    fn serve(&self, peer: &Peer, request: PeerRequest) -> Served {
        let Some(d) = self.daemon.get().and_then(Weak::upgrade) else {
            let answer = Err(PeerError::Refused("the daemon is starting".into()));
            return Box::pin(async move { answer });
        };
        // An import is answered here, on the link's task: it is a lookup in memory but for
        // the steps that block (a changed quarantine record's `fsync`, the first ask of an
        // incarnation), which `On::Worker` takes off the worker; so the common import costs
        // no hand-off to another thread and back. Every other answer runs on a blocking
        // thread, never on the domain runtime's workers (its links' TLS, etcd's lease): a
        // copy chunk moves a megabyte with `pread`/`pwrite`, a release may end a region
        // (its backing removed), a revocation deletes the DAX devices carved for it.
        let peer = peer.clone();
        Box::pin(async move {
            let (op, who) = (request.op, peer.identity.to_string());
            let run = move |on: On| {
                let Some(service) = d.domain.as_ref().and_then(|x| x.link()).map(|l| l.service()) else {
                    return Err(PeerError::Refused("this node has no node link".into()));
                };
                match request.op {
                    PeerOp::Copy => super::copy::serve(&d, service.owner.session_of(&peer), &request.body),
                    _ => service.answer(&d, &peer, &request, on),
                }
            };
            let answer = match op {
                PeerOp::Import => run(On::Worker),
                _ => tokio::task::spawn_blocking(move || run(On::Blocking))
                    .await
                    .unwrap_or_else(|e| Err(PeerError::Refused(format!("the request's task failed: {e}")))),
            };
            if let Err(e) = &answer {
                tracing::info!(peer = %who, ?op, error = %e, "node link: request refused");
            }
            answer
        })
    }
}
