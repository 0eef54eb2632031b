//! The domain task: while joined, it reads the domain's prefix into a [`DomainView`],
//! follows it with a watch (a broken one resumes after the view's revision), writes this
//! node's placements after each map change (and its topology after each rescan) and
//! probes etcd's round trip; each join campaigns for the domain's leader on its lease
//! (an [`Election`] that lives as long as the join). When the lease is lost it stops every
//! domain write and the campaign, says so, and rejoins (new lease, new incarnation, new
//! campaign) once etcd answers. Each step is bounded by the client's request timeout;
//! nothing here holds a lock across an await.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_domain::etcd_client::{EventType, GetOptions};
use fabric_domain::{
    DomainClient, DomainView, Election, EtcdError, LeaseState, PlacementsRecord, TopologyRecord, records,
};

use super::join::{self, Joined};
use super::{Domain, Standing, duties, publish};

/// Why a joined session ended.
enum End {
    /// The lease is lost: fence, then rejoin.
    LeaseLost(String),
    /// The watch broke (etcd restarted, compaction): watch again with the same join, from
    /// the view's revision on (`resume`), or read the domain again when there is none (the
    /// revisions after it were compacted, or the first read failed).
    Watch { reason: String, resume: Option<Box<DomainView>> },
}

/// Runs until the daemon drops the domain's runtime. `first`: the view the join at start
/// read (published already), which the first session watches on from.
pub(super) async fn run(
    domain: Arc<Domain>,
    mut joined: Option<Joined>,
    first: Option<DomainView>,
    reader: fabric_addrmap::Reader,
) {
    let mut backoff = Duration::from_millis(200);
    let mut election: Option<Election> = None;
    let mut resume: Option<Box<DomainView>> = first.map(Box::new);
    // Whether the registry refuses new regions on this node's shares: a rejoin found one
    // taken by another host.
    let mut withdrawn = false;
    loop {
        if domain.has_left() {
            // A join that was under way when the node left: its lease given back too.
            if let Some(j) = joined.take() {
                let _ = tokio::time::timeout(domain.config.request_timeout(), j.client.leave(j.lease)).await;
            }
            tracing::info!("left the domain: no rejoin");
            return;
        }
        let j = match joined.take() {
            Some(j) => j,
            None => match rejoin(&domain).await {
                Ok(j) => {
                    backoff = Duration::from_millis(200);
                    if withdrawn && domain.shares_withdrawn(None) {
                        withdrawn = false;
                    }
                    j
                }
                Err(e) => {
                    let why = crate::error_chain(&e);
                    // A slot collected went with the node's shares (the gc frees both):
                    // another host may hold their ranges as well.
                    if !withdrawn && matches!(e, EtcdError::ShareLost { .. } | EtcdError::SlotCollected { .. }) {
                        withdrawn = domain.shares_withdrawn(Some(&why));
                    }
                    tracing::warn!(error = %why, "cannot join the domain; retrying");
                    domain.etcd_failed();
                    // A fenced node stays fenced until it rejoins; one that never joined
                    // since start is unreachable.
                    domain.set_status(|s| {
                        s.standing = match &s.standing {
                            Standing::Fenced(_) => Standing::Fenced(format!("lease lost; rejoining: {why}")),
                            _ => Standing::Unreachable(why),
                        }
                    });
                    tokio::time::sleep(jittered(backoff)).await;
                    backoff = (backoff * 2).min(domain.config.request_timeout());
                    continue;
                }
            },
        };
        domain.client.store(Arc::new(Some(j.client.clone())));
        domain.fence.store(Arc::new(Some(j.fence.clone())));
        // Stored, then `left` read (both SeqCst, as `Domain::leave` sets `left`, then
        // takes the lease): a leave either takes this lease, or is seen here.
        domain.lease.store(j.lease.id(), std::sync::atomic::Ordering::SeqCst);
        if domain.has_left() {
            joined = Some(j);
            continue;
        }
        // One campaign per join: a session that ends with a broken watch keeps it.
        let e = election.get_or_insert_with(|| Election::start(&j.client, &j.lease));
        domain.leadership.store(Arc::new(Some(e.watch())));
        if let Some(link) = &domain.link {
            link.set_incarnation(j.incarnation);
        }
        domain.set_status(|s| {
            s.standing = Standing::Joined;
            s.incarnation = j.incarnation;
            s.etcd_reachable = true;
        });
        let began = tokio::time::Instant::now();
        let reason = match session(&domain, &j, &reader, resume.take()).await {
            End::LeaseLost(reason) => {
                // The view stays a true prefix of the domain's history: the next session
                // watches on from it rather than reading the whole domain again (about
                // 18 MiB at 12,500 nodes, every node at once when etcd was away); where
                // that was compacted, or etcd went back in time, it reads.
                let last = domain.view();
                resume = (last.revision() > 0).then(|| Box::new((*last).clone()));
                reason
            }
            End::Watch { reason, resume: view } => {
                match &view {
                    Some(v) => tracing::warn!(%reason, from = v.revision() + 1, "domain watch lost; watching again"),
                    None => tracing::warn!(%reason, "domain watch lost; reading the domain again"),
                }
                domain.etcd_failed();
                resume = view;
                // A watch that keeps breaking is set up again less and less often (one that
                // lasted a while starts over).
                if began.elapsed() > domain.config.lease_ttl() {
                    backoff = Duration::from_millis(200);
                }
                // The wait ends early when the lease is lost meanwhile: the node fences
                // itself then, not after the wait.
                let mut lease = j.lease.watch();
                let waited = match j.lease.state() {
                    LeaseState::Lost(why) => Err(End::LeaseLost(why)),
                    _ => unless_lost(&mut lease, tokio::time::sleep(jittered(backoff))).await,
                };
                backoff = (backoff * 2).min(domain.config.request_timeout());
                match waited {
                    Ok(()) => {
                        joined = Some(j);
                        continue;
                    }
                    Err(End::LeaseLost(reason) | End::Watch { reason, .. }) => reason,
                }
            }
        };
        if domain.has_left() {
            tracing::info!(%reason, "left the domain: the lease was given back");
            return;
        }
        tracing::warn!(%reason, incarnation = j.incarnation, "lease lost: domain writes stop until the node rejoins");
        domain.set_status(|s| s.standing = Standing::Fenced(format!("lease lost: {reason}")));
        domain.client.store(Arc::new(None));
        domain.fence.store(Arc::new(None));
        domain.lease.store(0, std::sync::atomic::Ordering::Relaxed);
        // The campaign ends with the lease: leadership is unknown until a rejoin
        // campaigns again.
        domain.leadership.store(Arc::new(None));
        election = None;
        // This node's imports end first (local, and before a revoke makes the
        // departure visible at once).
        void_imports(&domain).await;
        // Best effort: a lease lost only here (a renewal stream that stalled) would
        // keep the old member key, and a leader key, until its TTL ran out, and the
        // rejoin would meet `NameTaken` meanwhile.
        let revoked = tokio::time::timeout(domain.config.request_timeout(), j.client.leave(j.lease)).await;
        if let Ok(Err(e)) = revoked {
            tracing::debug!(error = %crate::error_chain(&e), "the lost lease could not be revoked");
        }
    }
}

/// etcd's revision now (a read of the settings key: any key's answer carries it).
async fn current_revision(client: &DomainClient) -> Result<i64, EtcdError> {
    let mut kv = client.raw();
    let answer = client.call("revision read", kv.get(client.keys().settings(), None)).await?;
    Ok(answer.header().map_or(0, |h| h.revision()))
}

/// `d` spread over ±50 %: nodes that all lost etcd at one instant do not all come back
/// at the next.
fn jittered(d: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    // A fresh random key per call (std seeds each `RandomState` from the OS).
    let r = std::collections::hash_map::RandomState::new().build_hasher().finish();
    d / 2 + d.mul_f64((r >> 11) as f64 / (1u64 << 53) as f64)
}

/// This node's incarnation is over (its lease is lost): the owners of what its clients
/// imported release those imports once they see it gone, and reuse the memory once it is
/// back as another incarnation. Its clients' imports end here first, before it rejoins, so
/// that no device of this node still maps memory an owner may hand to someone else. What
/// it granted other nodes ends too (`Owner::end_all`): they void it when they see it gone.
async fn void_imports(domain: &Domain) {
    let Some(d) = domain.link.as_ref().and_then(|l| l.service().daemon()).and_then(|w| w.upgrade()) else { return };
    // Deleting carved devices blocks: off the runtime's worker.
    let voided = tokio::task::spawn_blocking(move || {
        if let Some(link) = d.domain.as_ref().and_then(|x| x.link()) {
            link.service().importer().void_all(&d);
            link.service().owner().end_all(&d);
        }
    });
    if let Err(e) = voided.await {
        tracing::warn!(error = %e, "ending the imports of a lost incarnation failed");
    }
}

async fn rejoin(domain: &Domain) -> Result<Joined, EtcdError> {
    // Only in the slot this daemon serves: a slot changes only through an admin's gc of
    // this node while it was gone, and its memory lies in the old one; serving on would hand
    // out GFAs of another node. The join claims it back if nobody took it, else says so
    // (`SlotCollected`) and claims no other.
    let (_, j) = join::join(&domain.config, &domain.settings, &domain.member, Some(domain.slot)).await?;
    // The shares too: a gc while the node was away freed them, and another node may hold
    // their ranges now; serving on would hand out its memory.
    if let Err(e) = join::claim_back(&j.client, &j.fence, &domain.shares).await {
        let _ = j.client.leave(j.lease).await;
        return Err(e);
    }
    Ok(j)
}

/// One joined session: the view, the watch, placements and probes, until the lease is
/// lost or the watch breaks. `resume`: the view a broken watch (or the session before a
/// lost lease) left, every event up to its revision applied; the watch goes on after it rather than the whole domain
/// being read again (12,500 nodes are about 18 MiB).
async fn session(domain: &Domain, j: &Joined, reader: &fabric_addrmap::Reader, resume: Option<Box<DomainView>>) -> End {
    let mut lease = j.lease.watch();
    if let LeaseState::Lost(why) = j.lease.state() {
        return End::LeaseLost(why);
    }
    // A resumed watch that breaks again before any event came is not resumed a second
    // time: what breaks it may be at its start revision (a catch-up answer past the
    // message limit, say), and a read of the domain, paged, gets past it.
    // A view ahead of etcd (restored from an older snapshot: its revisions went back) is
    // not watched on from: the revisions it waits for would be other changes.
    let resume = match resume {
        Some(view) => match unless_lost(&mut lease, current_revision(&j.client)).await {
            Ok(Ok(now)) if now >= view.revision() => Some(view),
            Ok(Ok(now)) => {
                tracing::warn!(
                    view = view.revision(),
                    etcd = now,
                    "etcd is behind this node's view (restored?); reading the domain again"
                );
                None
            }
            Ok(Err(e)) => return End::Watch { reason: crate::error_chain(&e), resume: Some(view) },
            Err(end) => return end,
        },
        None => None,
    };
    let resumed = resume.is_some();
    let mut progressed = false;
    let again = |view: DomainView, progressed: bool| (!resumed || progressed).then(|| Box::new(view));
    let mut view = match resume {
        Some(view) => *view,
        // The settings the node holds stay: they are written once.
        // Every wait on etcd before the loop below, too, ends when the lease is lost.
        None => match unless_lost(&mut lease, read_view(&j.client, domain.view().settings().cloned())).await {
            Ok(Ok(view)) => {
                domain.publish_view(view.clone());
                view
            }
            Ok(Err(reason)) => return End::Watch { reason, resume: None },
            Err(end) => return end,
        },
    };
    let mut stream = match unless_lost(&mut lease, j.client.watch_domain(view.revision() + 1)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return End::Watch { reason: crate::error_chain(&e), resume: Some(Box::new(view)) },
        Err(end) => return end,
    };
    // What etcd holds of this node's as the view says: not written again when unchanged
    // (a broken watch, common to every node when etcd restarts, would otherwise have
    // every node rewrite both records, and every other node receive them).
    let mut published = Published {
        placements: view.placements_of(&domain.config.node).cloned(),
        topology: view.topology(&domain.config.node).cloned(),
    };
    let (own_placements, own_topology) =
        (j.client.keys().placements(&domain.config.node), j.client.keys().topology(&domain.config.node));
    // When a failed write is tried again: a deadline of the loop below, never a sleep
    // inside it, so a lost lease is acted on at once meanwhile.
    let mut retry = match unless_lost(&mut lease, publish(domain, j, reader, &mut published)).await {
        Ok(Ok(at)) => at,
        Ok(Err(end)) | Err(end) => return end,
    };
    let mut probe = tokio::time::interval(domain.config.keepalive_interval());
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The leader's duties: on becoming leader, on a queued gc, at each probe.
    let busy = Arc::new(duties::Duties::default());
    let mut leading = (**domain.leadership.load()).clone();
    let gc_queue = j.client.keys().gc_requests().into_bytes();
    let duties = |busy: &Arc<duties::Duties>| {
        duties::spawn(&j.client, j.lease.id(), &domain.leadership(), busy);
    };
    duties(&busy);
    loop {
        tokio::select! {
            changed = async {
                match leading.as_mut() {
                    Some(rx) => rx.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            } => {
                if changed {
                    duties(&busy);
                } else {
                    leading = None;
                }
            }
            changed = lease.changed() => {
                if let Some(end) = lost(changed, &lease) {
                    return end;
                }
            }
            () = domain.map_changed.notified(), if retry.is_none() => {
                retry = match unless_lost(&mut lease, publish(domain, j, reader, &mut published)).await {
                    Ok(Ok(at)) => at,
                    Ok(Err(end)) | Err(end) => return end,
                };
            }
            () = tokio::time::sleep_until(retry.unwrap_or_else(tokio::time::Instant::now)), if retry.is_some() => {
                retry = match unless_lost(&mut lease, publish(domain, j, reader, &mut published)).await {
                    Ok(Ok(at)) => at,
                    Ok(Err(end)) | Err(end) => return end,
                };
            }
            message = stream.message() => {
                let response = match message {
                    Ok(Some(r)) => r,
                    Ok(None) => {
                        return End::Watch { reason: "etcd closed the watch".to_owned(), resume: again(view, progressed) }
                    }
                    Err(e) => return End::Watch { reason: format!("watch: {e}"), resume: again(view, progressed) },
                };
                if response.canceled() {
                    // Compacted past the view's revision: the events it misses are gone, so
                    // the domain is read again. Canceled otherwise (etcd lost its cluster
                    // under `require_leader`, say): watched again from the view.
                    let compacted = response.compact_revision() > 0;
                    let reason = format!("watch canceled: {:?} (compacted at {})", response.cancel_reason(), response.compact_revision());
                    return End::Watch { reason, resume: if compacted { None } else { again(view, progressed) } };
                }
                progressed |= !response.events().is_empty();
                let mut queued = false;
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    let value = match event.event_type() {
                        EventType::Put => Some(kv.value()),
                        EventType::Delete => None,
                    };
                    queued |= value.is_some() && kv.key().starts_with(&gc_queue);
                    // What etcd holds of this node's own records now (its own writes
                    // coming back, or another's): the next publish writes where the local
                    // record differs from it. (Not at once: a record taken away by hand
                    // stays away until this node's own changes, as tests rely on.)
                    if kv.key() == own_placements.as_bytes() {
                        published.placements = value.and_then(|v| records::decode(v, Domain::limits()).ok());
                    } else if kv.key() == own_topology.as_bytes() {
                        published.topology = value.and_then(|v| records::decode(v, Domain::limits()).ok());
                    }
                    if let Err(reason) = view.apply(kv.key(), value, kv.mod_revision()) {
                        tracing::warn!(key = %String::from_utf8_lossy(kv.key()), %reason, "refused an etcd record");
                    }
                }
                domain.publish_view(view.clone());
                if queued {
                    duties(&busy);
                }
            }
            _ = probe.tick() => {
                duties(&busy);
                let started = Instant::now();
                let mut kv = j.client.raw();
                let count = GetOptions::new().with_count_only();
                let probed = unless_lost(&mut lease, j.client.call("probe", kv.get(j.client.keys().settings(), Some(count))));
                match probed.await {
                    Err(end) => return end,
                    Ok(Ok(_)) => domain.set_status(|s| {
                        s.etcd_reachable = true;
                        s.round_trip = Some(started.elapsed());
                    }),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %crate::error_chain(&e), "etcd probe failed");
                        domain.etcd_failed();
                    }
                }
            }
        }
    }
}

/// How the lease's change `changed` (of `lease`) ends the session: lost, or its
/// renewal stopped; `None` while it holds.
fn lost(
    changed: Result<(), tokio::sync::watch::error::RecvError>,
    lease: &tokio::sync::watch::Receiver<LeaseState>,
) -> Option<End> {
    (changed.is_err() || matches!(&*lease.borrow(), LeaseState::Lost(_))).then(|| ended(lease))
}

/// The session's end for a lease found lost or no longer renewed.
fn ended(lease: &tokio::sync::watch::Receiver<LeaseState>) -> End {
    match &*lease.borrow() {
        LeaseState::Lost(why) => End::LeaseLost(why.clone()),
        _ => End::LeaseLost("the lease's renewal stopped".to_owned()),
    }
}

/// `work` (an arm's wait on etcd, up to a third of the TTL), unless the lease is lost
/// first (`fabric_domain::lease::unless_lost`): a node cut off from etcd would otherwise
/// act as a member (admit peers, grant imports) past the loss.
async fn unless_lost<T>(
    lease: &mut tokio::sync::watch::Receiver<LeaseState>,
    work: impl std::future::Future<Output = T>,
) -> Result<T, End> {
    fabric_domain::lease::unless_lost(lease, work).await.ok_or_else(|| ended(lease))
}

/// The domain read whole (paged) and loaded into a view, over the `settings` a view read
/// before holds (`DomainView::load_over`). The load is seconds of CPU at 12,500 nodes in
/// a debug build: it runs on the blocking pool, so that the runtime's workers renew the
/// lease meanwhile.
pub(super) async fn read_view(
    client: &DomainClient,
    settings: Option<fabric_domain::DomainSettings>,
) -> Result<DomainView, String> {
    let (all, revision) = client.read_domain().await.map_err(|e| crate::error_chain(&e))?;
    let keys = client.keys().clone();
    tokio::task::spawn_blocking(move || {
        let entries = all.iter().map(|e| (e.key(), e.value()));
        DomainView::load_over(keys, Domain::limits(), settings, entries, revision)
    })
    .await
    .map_err(|e| format!("loading the domain's records: {e}"))
}

/// What publishing this node's records came to.
enum Outcome {
    /// Written, or nothing new to write.
    Done,
    /// etcd did not take a record: try again after a while (a change meanwhile is in the
    /// map, which the retry reads).
    Retry,
    /// This membership no longer holds its member key: the session ends.
    Fenced(End),
}

/// Publishes this node's records ([`publish_records`]): `Ok(Some(when))` when a failed write
/// is to be tried again then, `Err` when this membership no longer holds.
async fn publish(
    domain: &Domain,
    j: &Joined,
    reader: &fabric_addrmap::Reader,
    published: &mut Published,
) -> Result<Option<tokio::time::Instant>, End> {
    match publish_records(domain, j, reader, published).await {
        Outcome::Done => Ok(None),
        Outcome::Retry => Ok(Some(tokio::time::Instant::now() + domain.config.keepalive_interval())),
        Outcome::Fenced(end) => Err(end),
    }
}

/// The records this session wrote last.
#[derive(Default)]
struct Published {
    placements: Option<PlacementsRecord>,
    topology: Option<TopologyRecord>,
}

/// Writes this node's placements and topology when they differ from the last written.
async fn publish_records(
    domain: &Domain,
    j: &Joined,
    reader: &fabric_addrmap::Reader,
    published: &mut Published,
) -> Outcome {
    let snap = reader.snapshot();
    let placements = publish::record(&snap, &domain.config.node, j.incarnation, domain.slot, domain.settings.node_span);
    if published.placements.as_ref() != Some(&placements) {
        let key = j.client.keys().placements(&domain.config.node);
        match write(domain, j, key, &placements).await {
            Outcome::Done => {
                tracing::info!(
                    generation = placements.generation,
                    ranges = placements.ranges.len(),
                    "placements published"
                );
                published.placements = Some(placements);
            }
            other => return other,
        }
    }
    let Some(made) = domain.topology.load_full() else { return Outcome::Done };
    let topology = TopologyRecord { incarnation: j.incarnation, ..(*made).clone() };
    if published.topology.as_ref() != Some(&topology) {
        let encoded = fabric_domain::records::encode(&topology).len();
        let bound = Domain::limits().max_bytes();
        let key = j.client.keys().topology(&domain.config.node);
        if encoded > bound {
            // Every other node would refuse it: say so here, once per change, and take the
            // last one published away, or the others would go on deciding data paths from
            // a fabric this node no longer has.
            tracing::warn!(
                bytes = encoded,
                bound,
                "topology record too large to publish; the domain shows no topology of this node"
            );
            return match settle(domain, publish::remove(&j.client, &j.fence, key).await) {
                Outcome::Done => {
                    published.topology = Some(topology);
                    Outcome::Done
                }
                other => other,
            };
        }
        match write(domain, j, key, &topology).await {
            Outcome::Done => {
                tracing::info!(devices = topology.devices.len(), links = topology.links.len(), "topology published");
                published.topology = Some(topology);
            }
            other => return other,
        }
    }
    Outcome::Done
}

/// One fenced write of `record` at `key`.
async fn write<R: fabric_domain::records::Record>(domain: &Domain, j: &Joined, key: String, record: &R) -> Outcome {
    settle(domain, publish::write(&j.client, &j.fence, key, record).await)
}

/// What a fenced write's result comes to.
fn settle(domain: &Domain, written: Result<bool, EtcdError>) -> Outcome {
    match written {
        Ok(true) => Outcome::Done,
        Ok(false) => Outcome::Fenced(End::LeaseLost("this membership no longer holds its member key".to_owned())),
        Err(e) => {
            tracing::warn!(error = %crate::error_chain(&e), "cannot publish this node's records; retrying");
            domain.etcd_failed();
            Outcome::Retry
        }
    }
}
